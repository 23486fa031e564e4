//! A batched step's split product through cuBLAS over the hi rows of every row and the lo rows
//! of the first `lo_rows` alone (prompt rows before their prompt's last come after those and
//! are multiplied as bf16): each consumer (`product_value` in `kernels/batch.cu`) adds the lo
//! row's product for the first rows only, and never reads the rows the product left out
//! (NaN here).

use super::{row_table, Bench};
use wasi_nn_host::cpu;
use wasi_nn_host::cuda::buffer::{Act, Bf16, DevBuf};
use wasi_nn_host::cuda::ops::batch::BatchEpilogue;
use wasi_nn_host::cuda::ops::Epilogue;
use wasi_nn_host::cuda::weights::DevLayer;
use wasi_nn_host::engine::{EngineError, GpuDtype};
use wasi_nn_host::model::LayerWeights;

/// Runs the check on layer 0's QKV weights (bf16 mode, with cuBLAS).
pub(super) fn check_lo_rows(
    b: &mut Bench,
    (lw, dl): (&LayerWeights, &DevLayer),
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    if b.l.dtype() != GpuDtype::Bf16 || b.blas.is_none() {
        return Ok(());
    }
    let c = b.l.config().n_embd;
    let (n, k) = (3 * c, c);
    let stream = b.l.stream().clone();
    for (m, lo) in [(96usize, 40usize), (130, 1), (64, 64)] {
        let x = b.random(m * k);
        let mut bits = vec![0 as Bf16; 2 * m * k];
        let mut hi_only = vec![0.0f32; m * k];
        for (i, v) in x.iter().enumerate() {
            let hi = half::bf16::from_f32(*v);
            bits[i] = hi.to_bits();
            bits[m * k + i] = half::bf16::from_f32(v - hi.to_f32()).to_bits();
            hi_only[i] = hi.to_f32();
        }
        // rows < lo see x to ~16 bits, the others its bf16 hi halves
        let mut want = vec![0.0; m * n];
        for (r, out) in want.chunks_mut(n).enumerate() {
            let row = if r < lo {
                &x[r * k..][..k]
            } else {
                &hi_only[r * k..][..k]
            };
            cpu::linear(out, row, &lw.qkv_w, Some(&lw.qkv_b), k, n);
        }
        let input = DevBuf::<Bf16>::from_host(&stream, &bits, "product input")?;
        let tmp = DevBuf::<f32>::from_host(&stream, &vec![f32::NAN; 2 * m * n], "product")?;
        let shape = (m + lo, n, k);
        (b.blas()?).gemm(
            &b.l,
            dl.qkv_w.ptr(),
            Act::Bf16(input.ptr()),
            shape,
            (tmp.ptr(), n),
            false,
        )?;
        let ints = DevBuf::<i32>::zeros(&stream, 2 * m, "table")?;
        let addrs = DevBuf::<u64>::zeros(&stream, 3 * m, "table")?;
        let keys = DevBuf::<u64>::zeros(&stream, m, "table")?;
        let mut t = row_table(m, (&ints, &addrs, &keys), 0);
        t.lo_rows = lo;
        let out = DevBuf::<f32>::zeros(&stream, m * n, "sums")?;
        b.l.batch_epilogue(
            &t,
            BatchEpilogue {
                out: Act::F32(out.ptr()),
                tmp: tmp.ptr(),
                bias: dl.qkv_b.ptr(),
                n,
                epilogue: Epilogue::Store,
                split: true,
                parts: 1,
            },
        )?;
        let what = format!("batched split product, lo rows of {lo} of {m} rows");
        report(&what, &out.read(&stream, m * n)?, &want, 1e-4);
    }
    Ok(())
}
