//! The kernel workbench: each kernel alone against the CPU reference functions, on fresh
//! random inputs of several sizes (`wasi-nn-bench check-cuda` and `tests/tests/cuda.rs` run
//! it). It drives the host's launchers (`wasi_nn_host::cuda::ops`, the `dev` feature) on
//! buffers of its own. For bf16 weights the reference uses the same bf16-rounded weights, so
//! both sides multiply the same numbers.

mod draw;
pub use draw::draw_speed;
mod gemm;
pub use gemm::{gemm_speed, GemmSpeed};
mod lo_rows;
mod tiles;

use crate::checks::scaled_error;
use rand::{Rng, SeedableRng};
use wasi_nn_host::cpu;
use wasi_nn_host::cuda::blas::{Blas, LtBias, LtEpilogue, Shape};
use wasi_nn_host::cuda::buffer::{Act, Bf16, DevBuf, DevPtr};
use wasi_nn_host::cuda::error::CudaError;
use wasi_nn_host::cuda::ops::attention::{
    decode_cluster_shape, DecodeAttention, FusedDecode, PrefillAttention, Start, ATT_CHUNK,
};
use wasi_nn_host::cuda::ops::batch::RowTable;
use wasi_nn_host::cuda::ops::batch_gemm::{batch_gemm_plan, gemm_most_parts, GemmPlan, MAX_PARTS};
use wasi_nn_host::cuda::ops::embed_norm::{Embed, LayerNorm};
use wasi_nn_host::cuda::ops::matmul::{GemmEpilogue, Matmul};
use wasi_nn_host::cuda::ops::matvec::{argmax_row, Matvec};
use wasi_nn_host::cuda::ops::{Epilogue, KvLayer, Launcher};
use wasi_nn_host::cuda::weights::{DevLayer, DevWeights};
use wasi_nn_host::cuda::CudaExecutor;
use wasi_nn_host::engine::{argmax, EngineError, GpuDtype};
use wasi_nn_host::model::{random_weights, Gpt2Config, Gpt2Weights};

/// One kernel on one size: the worst `|gpu - cpu| / max(1, |cpu|)`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelReport {
    pub kernel: String,
    pub dtype: String,
    pub size: String,
    pub max_error: f32,
    pub tolerance: f32,
    pub passed: bool,
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// Values rounded to fp16 (as the KV cache of bf16 weights keeps them).
fn f16_round(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&x| half::f16::from_f32(x).to_f32())
        .collect()
}

/// Values as fp16 bits, two to an f32 word (the first in the low half): what an fp16 cache
/// holds, for an f32 buffer's upload.
fn pack_f16(values: &[f32]) -> Vec<f32> {
    values
        .chunks(2)
        .map(|pair| {
            let bits = |i: usize| pair.get(i).map_or(0, |&x| half::f16::from_f32(x).to_bits());
            f32::from_bits(u32::from(bits(0)) | (u32::from(bits(1)) << 16))
        })
        .collect()
}

/// The first `n` fp16 values of words packed as [`pack_f16`] packs them.
fn unpack_f16(words: &[f32], n: usize) -> Vec<f32> {
    words
        .iter()
        .flat_map(|w| {
            let bits = w.to_bits();
            [bits as u16, (bits >> 16) as u16]
        })
        .take(n)
        .map(|h| half::f16::from_bits(h).to_f32())
        .collect()
}

/// The buffers one kernel check needs (as a session holds them, one layer, the whole
/// context), the launcher and the random inputs.
struct Bench {
    l: Launcher,
    rng: rand_chacha::ChaCha8Rng,
    x: DevBuf<f32>,
    h: DevBuf<f32>,
    qkv: DevBuf<f32>,
    fc: DevBuf<f32>,
    k_cache: DevBuf<f32>,
    v_cache: DevBuf<f32>,
    partial: DevBuf<f32>,
    logits: DevBuf<f32>,
    ids: DevBuf<i32>,
    next: DevBuf<u64>,
    max_chunks: usize,
    blas: Option<Blas>,
    /// The KV cache holds fp16 (bf16 weights; f32 otherwise).
    kv16: bool,
    /// The session's plan: tensor-core prefill attention.
    tensor_cores: bool,
    tiled_attention: bool,
    fused_decode: bool,
}

/// Which f32 buffer of the bench.
#[derive(Clone, Copy)]
enum B {
    X,
    H,
    Qkv,
    Fc,
    K,
    V,
    Logits,
}

impl Bench {
    fn new(exec: &CudaExecutor, config: Gpt2Config, seed: u64) -> Result<Self, EngineError> {
        let l = exec.launcher()?;
        let plan = exec.open()?.plan();
        let stream = l.stream().clone();
        let (c, t) = (config.n_embd, config.n_ctx);
        let max_chunks = t.div_ceil(ATT_CHUNK as usize);
        let zeros = |n, what| DevBuf::<f32>::zeros(&stream, n, what);
        let switches = exec.gpu().measurement();
        Ok(Self {
            x: zeros(t * c, "x")?,
            h: zeros(t * c, "h")?,
            qkv: zeros(t * 3 * c, "qkv")?,
            fc: zeros(t * 4 * c, "fc")?,
            k_cache: zeros(t * c, "keys")?,
            v_cache: zeros(t * c, "values")?,
            partial: zeros(
                config.n_head * max_chunks * (config.head_dim() + 2),
                "partial",
            )?,
            logits: zeros(config.vocab_size, "logits")?,
            ids: DevBuf::zeros(&stream, t + 1, "ids")?,
            next: DevBuf::zeros(&stream, 1, "argmax")?,
            max_chunks,
            blas: switches
                .cublas
                .then(|| {
                    let plans = switches.cublaslt.then(std::sync::Arc::default);
                    Blas::new(&stream, t, c, plans.as_ref())
                })
                .flatten(),
            kv16: l.dtype().kv_bytes() == 2,
            tensor_cores: plan.tensor_cores,
            tiled_attention: plan.tiled_attention,
            fused_decode: exec.gpu().fused_decode(),
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            l,
        })
    }

    fn buf(&self, which: B) -> &DevBuf<f32> {
        match which {
            B::X => &self.x,
            B::H => &self.h,
            B::Qkv => &self.qkv,
            B::Fc => &self.fc,
            B::K => &self.k_cache,
            B::V => &self.v_cache,
            B::Logits => &self.logits,
        }
    }

    fn ptr(&self, which: B) -> DevPtr<f32> {
        self.buf(which).ptr()
    }

    fn random(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| self.rng.random::<f32>() * 2.0 - 1.0)
            .collect()
    }

    fn put(&mut self, which: B, values: &[f32]) -> Result<(), CudaError> {
        let stream = self.l.stream().clone();
        let buf = match which {
            B::X => &mut self.x,
            B::H => &mut self.h,
            B::Qkv => &mut self.qkv,
            B::Fc => &mut self.fc,
            B::K => &mut self.k_cache,
            B::V => &mut self.v_cache,
            B::Logits => &mut self.logits,
        };
        match which {
            B::K | B::V if self.kv16 => buf.write(&stream, 0, &pack_f16(values)),
            _ => buf.write(&stream, 0, values),
        }
    }

    fn get(&self, which: B, n: usize) -> Result<Vec<f32>, CudaError> {
        match which {
            B::K | B::V if self.kv16 => {
                let words = self.buf(which).read(self.l.stream(), n.div_ceil(2))?;
                Ok(unpack_f16(&words, n))
            }
            _ => self.buf(which).read(self.l.stream(), n),
        }
    }

    /// Values as the KV cache keeps them.
    fn kept(&self, values: &[f32]) -> Vec<f32> {
        match self.kv16 {
            true => f16_round(values),
            false => values.to_vec(),
        }
    }

    /// Upload `tokens` to ids[1..], and with `first` the position to ids[0].
    fn put_ids(&mut self, first: Option<usize>, tokens: &[i32]) -> Result<(), CudaError> {
        let stream = self.l.stream().clone();
        match first {
            Some(pos) => {
                let all: Vec<i32> = std::iter::once(pos as i32)
                    .chain(tokens.iter().copied())
                    .collect();
                self.ids.write(&stream, 0, &all)
            }
            None => self.ids.write(&stream, 1, tokens),
        }
    }

    fn position(&self) -> DevPtr<i32> {
        self.ids.ptr()
    }

    fn kv(&self) -> KvLayer {
        let bytes = self.l.dtype().kv_bytes();
        KvLayer {
            k: self.k_cache.ptr().as_cached(bytes),
            v: self.v_cache.ptr().as_cached(bytes),
        }
    }

    fn blas(&self) -> Result<&Blas, CudaError> {
        self.blas
            .as_ref()
            .ok_or_else(|| CudaError::Unavailable("no cuBLAS".into()))
    }

    /// The bf16 GEMM-input buffer.
    fn x_bf16(&self) -> Result<DevPtr<Bf16>, CudaError> {
        Ok(self.blas()?.x_bf16.ptr())
    }

    /// Where prefill attention writes: the projection's bf16 input in the fused bf16 mode,
    /// else h (f32).
    fn attention_out(&self, fused: bool) -> Result<Act, CudaError> {
        Ok(if fused {
            Act::Bf16(self.x_bf16()?)
        } else {
            Act::F32(self.h.ptr())
        })
    }

    /// `n` values of what `attention_out` named.
    fn get_act(&self, out: Act, n: usize) -> Result<Vec<f32>, CudaError> {
        match out {
            Act::Bf16(_) => self.get_bf16(n),
            Act::F32(_) => self.get(B::H, n),
        }
    }

    /// Upload `values` (bf16-exact) as bf16 QKV rows.
    fn put_qkv_bf16(&mut self, values: &[f32]) -> Result<(), CudaError> {
        let bits: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let stream = self.l.stream().clone();
        let blas = self
            .blas
            .as_mut()
            .ok_or_else(|| CudaError::Unavailable("no cuBLAS".into()))?;
        blas.qkv_bf16.write(&stream, 0, &bits)
    }

    fn get_bf16(&self, n: usize) -> Result<Vec<f32>, CudaError> {
        let bits = self.blas()?.x_bf16.read(self.l.stream(), n)?;
        Ok(bits
            .iter()
            .map(|&v| half::bf16::from_bits(v).to_f32())
            .collect())
    }

    /// Prefill attention on the kernel a session's plan would pick (tensor cores, from the
    /// bf16 rows `fresh` or the cache; else tiled or one block per row, through h and a
    /// conversion for a bf16 output).
    fn prefill_attention(
        &self,
        a: PrefillAttention,
        fresh: Option<DevPtr<Bf16>>,
    ) -> Result<(), CudaError> {
        let qkv = self.qkv.ptr();
        if self.tensor_cores {
            return match fresh {
                Some(rows) => self.l.prefill_attention_fresh(a, rows),
                None => self.l.prefill_attention_mma(a, qkv),
            };
        }
        if let Act::Bf16(out) = a.out {
            let h = self.h.ptr();
            self.prefill_attention(
                PrefillAttention {
                    out: Act::F32(h),
                    ..a
                },
                None,
            )?;
            return self.l.to_bf16(out, h, a.rows * self.l.config().n_embd);
        }
        if self.tiled_attention {
            self.l.prefill_attention_tiled(a, qkv)
        } else {
            self.l.prefill_attention_plain(a, qkv)
        }
    }

    /// The LM head over the row in x (final LayerNorm fused), argmax key into `next`.
    fn lm_head(&self, w: &DevWeights) -> Result<(), CudaError> {
        let head = w.lm_head(
            self.l.config(),
            self.logits.ptr(),
            self.x.ptr(),
            self.next.ptr(),
        );
        self.l.matvec(head)
    }

    /// The FC product through cuBLAS (`input` in the weights' type) and the GELU epilogue
    /// pass into `out`, as the prefill's fallback path does.
    fn fc_gelu(&self, dl: &DevLayer, input: Act, rows: usize, out: Act) -> Result<(), CudaError> {
        let c = self.l.config().n_embd;
        let blas = self.blas()?;
        let tmp = blas.tmp.ptr();
        blas.gemm(
            &self.l,
            dl.fc_w.ptr(),
            input,
            (rows, 4 * c, c),
            (tmp, 4 * c),
            false,
        )?;
        self.l.gemm_epilogue(GemmEpilogue {
            out,
            tmp,
            bias: dl.fc_b.ptr(),
            rows,
            n: 4 * c,
            epilogue: Epilogue::Gelu,
            start: 0,
            kv: None,
            out_stride: 4 * c,
        })
    }

    fn argmax(&self) -> Result<u32, CudaError> {
        let key = self.next.read(self.l.stream(), 1)?;
        Ok(argmax_row(key.first().copied().unwrap_or(0)))
    }
}

/// Run every kernel on random inputs for a few model widths, in f32 and bf16.
pub fn run(seed: u64) -> Result<Vec<KernelReport>, EngineError> {
    let mut reports = Vec::new();
    for (i, &(n_head, n_embd, n_ctx, vocab_size)) in
        [(4, 64, 96, 301), (4, 256, 160, 1000), (12, 768, 300, 5003)]
            .iter()
            .enumerate()
    {
        let config = Gpt2Config {
            n_layer: 1,
            n_head,
            n_embd,
            n_ctx,
            vocab_size,
        };
        let weights = random_weights(config, seed.wrapping_add(i as u64));
        for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
            let reference = match dtype {
                GpuDtype::F32 => weights.clone(),
                GpuDtype::Bf16 => weights.bf16_rounded(),
            };
            let exec = crate::checks::gpu_executor(&weights, dtype)?;
            let mut bench = Bench::new(&exec, config, seed ^ (i as u64 * 7919 + dtype as u64))?;
            let size = format!("C{n_embd} H{n_head} T{n_ctx} V{vocab_size}");
            let mut report = |kernel: &str, ours: &[f32], want: &[f32], tolerance: f32| {
                let max_error = scaled_error(ours, want);
                reports.push(KernelReport {
                    kernel: kernel.to_owned(),
                    dtype: format!("{dtype:?}").to_lowercase(),
                    size: size.clone(),
                    max_error,
                    tolerance,
                    passed: max_error <= tolerance,
                });
            };
            check_one(&mut bench, exec.weights(), &reference, dtype, &mut report)?;
        }
    }
    Ok(reports)
}

fn check_one(
    b: &mut Bench,
    dev: &DevWeights,
    w: &Gpt2Weights,
    dtype: GpuDtype,
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    let cfg = w.config;
    let (c, v) = (cfg.n_embd, cfg.vocab_size);
    let (lw, dl) = (&w.layers[0], &dev.layers[0]);

    // matvec: LayerNorm prologue, bias + GELU epilogue (the FC step of decode)
    let x = b.random(c);
    b.put(B::X, &x)?;
    b.l.matvec(Matvec {
        out: b.ptr(B::Fc),
        x: b.ptr(B::X),
        w: dl.fc_w.ptr(),
        bias: Some(dl.fc_b.ptr()),
        n: 4 * c,
        k: c,
        norm: Some(dl.ln2()),
        epilogue: Epilogue::Gelu,
        kv: None,
        argmax_key: None,
        // as in a decode step: the next product's weights asked of L2 on the way
        prefetch: Some(dl.fc_proj_w.ptr()),
    })?;
    let mut h = vec![0.0; c];
    cpu::layer_norm(&mut h, &x, &lw.ln2_w, &lw.ln2_b);
    let mut want = vec![0.0; 4 * c];
    cpu::linear(&mut want, &h, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
    want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
    report("matvec+layernorm+gelu", &b.get(B::Fc, 4 * c)?, &want, 1e-4);

    // the batched step's tensor-core products (bf16): f32 rows split into bf16 hi and lo rows
    // (as the batched kernels store a product's input) against the layer's QKV and
    // MLP-projection weights; the hi and lo rows summed in the kernel, the planes summed here in
    // order, as the next kernel does. Each shape with the step's plan, a plane per slice of
    // narrow tiles, the same slices folded into one plane, and one slice of wide tiles. The
    // first rows of one input at each row count: the step's plans must give every row the same
    // bits at every count (batch invariance), and folding must not change them.
    if dtype == GpuDtype::Bf16 {
        let shapes = [
            ("qkv", dl.qkv_w.ptr(), &lw.qkv_w, 3 * c, c),
            (
                "mlp projection",
                dl.fc_proj_w.ptr(),
                &lw.fc_proj_w,
                c,
                4 * c,
            ),
        ];
        let sms = b.l.gpu().sms();
        let counts = [256usize, 1, 17, 64, 130];
        for (name, on_gpu, on_cpu, n, k) in shapes {
            let x = b.random(counts[0] * k);
            let mut want = vec![0.0; counts[0] * n];
            for (row, out) in x.chunks(k).zip(want.chunks_mut(n)) {
                cpu::linear(out, row, on_cpu, None, k, n);
            }
            // the step's plan's results at the most rows
            let mut widest: Option<Vec<f32>> = None;
            for m in counts {
                let mut bits = vec![0 as Bf16; 2 * m * k];
                for (i, v) in x[..m * k].iter().enumerate() {
                    let hi = half::bf16::from_f32(*v);
                    bits[i] = hi.to_bits();
                    bits[m * k + i] = half::bf16::from_f32(v - hi.to_f32()).to_bits();
                }
                let stream = b.l.stream().clone();
                let input = DevBuf::<Bf16>::from_host(&stream, &bits, "product input")?;
                let step = batch_gemm_plan(m, n, k, sms, MAX_PARTS * m * n);
                let most = gemm_most_parts(k, MAX_PARTS);
                let plans = [
                    step,
                    GemmPlan {
                        slices: most,
                        planes: most,
                        wide: false,
                    },
                    GemmPlan {
                        slices: most,
                        planes: 1,
                        wide: false,
                    },
                    GemmPlan {
                        slices: 1,
                        planes: 1,
                        wide: true,
                    },
                ];
                let mut sliced: Option<Vec<f32>> = None;
                for (i, plan) in plans.into_iter().enumerate() {
                    if plans[..i].contains(&plan) {
                        continue;
                    }
                    let len = plan.planes * m * n;
                    let out = DevBuf::<f32>::zeros(&stream, len, "product planes")?;
                    match b
                        .l
                        .batch_gemm(on_gpu, input.ptr(), (m, n, k), out.ptr(), plan)
                    {
                        Some(ran) => ran?,
                        None => continue,
                    }
                    let planes = out.read(&stream, len)?;
                    let ours: Vec<f32> = (0..m * n)
                        .map(|i| (0..plan.planes).fold(0.0, |v, p| v + planes[p * m * n + i]))
                        .collect();
                    let (slices, folded, cols) = (plan.slices, plan.planes == 1, plan.cols());
                    let what = format!(
                        "batched product {name} ({m} rows, {slices} K slices{}, {cols}-column tiles)",
                        if folded && slices > 1 { " folded" } else { "" }
                    );
                    report(&what, &ours, &want[..m * n], 1e-4);
                    if plan == step {
                        match &widest {
                            None => widest = Some(ours.clone()),
                            Some(all) => report(
                                &format!(
                                    "batched product {name}: {m} rows' bits as {}'s",
                                    counts[0]
                                ),
                                &ours,
                                &all[..m * n],
                                0.0,
                            ),
                        }
                    }
                    if plan.slices == most && !plan.wide {
                        match &sliced {
                            None => sliced = Some(ours),
                            Some(planes) => report(
                                &format!("batched product {name}: {m} rows, {most} slices folded as planes"),
                                &ours,
                                planes,
                                0.0,
                            ),
                        }
                    }
                }
            }
        }
    }

    lo_rows::check_lo_rows(b, (lw, dl), report)?;

    // matvec: k = 4C, bias + residual epilogue (the MLP projection)
    let (fc_in, x0) = (b.random(4 * c), b.random(c));
    b.put(B::Fc, &fc_in)?;
    b.put(B::X, &x0)?;
    b.l.matvec(Matvec {
        out: b.ptr(B::X),
        x: b.ptr(B::Fc),
        w: dl.fc_proj_w.ptr(),
        bias: Some(dl.fc_proj_b.ptr()),
        n: c,
        k: 4 * c,
        norm: None,
        epilogue: Epilogue::Residual,
        kv: None,
        argmax_key: None,
        prefetch: None,
    })?;
    let mut delta = vec![0.0; c];
    cpu::linear(
        &mut delta,
        &fc_in,
        &lw.fc_proj_w,
        Some(&lw.fc_proj_b),
        4 * c,
        c,
    );
    let want: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
    report("matvec+residual", &b.get(B::X, c)?, &want, 1e-4);

    // the LM head (matvec over the vocabulary, final LayerNorm fused) and its argmax, from
    // a cleared key
    b.put(B::X, &x)?;
    let stream = b.l.stream().clone();
    b.next.clear(&stream)?;
    b.lm_head(dev)?;
    let mut h = vec![0.0; c];
    cpu::layer_norm(&mut h, &x, &w.lnf_w, &w.lnf_b);
    let mut want = vec![0.0; v];
    cpu::linear(&mut want, &h, &w.wte, None, c, v);
    let logits = b.get(B::Logits, v)?;
    report("matvec lm-head", &logits, &want, 1e-4);
    let argmax_of = |logits: &[f32]| [argmax(logits) as f32];
    report("argmax", &[b.argmax()? as f32], &argmax_of(&logits), 0.0);
    // with the key still set by larger logits, the embedding kernel must clear it
    let big: Vec<f32> = x.iter().map(|v| v * 8.0).collect();
    b.put(B::X, &big)?;
    b.lm_head(dev)?;
    let embed = |b: &Bench, rows, start| {
        b.l.embed(Embed {
            out: b.ptr(B::X),
            tokens: b.ids.ptr().skip(1),
            wte: dev.wte.ptr(),
            wpe: dev.wpe.ptr(),
            rows,
            start: Some(start),
            position: b.position(),
            argmax_key: b.next.ptr(),
            feed: false,
        })
    };
    embed(b, 1, 0)?;
    b.lm_head(dev)?;
    let logits = b.get(B::Logits, v)?;
    let gpu = b.argmax()? as f32;
    report(
        "argmax after embed clears",
        &[gpu],
        &argmax_of(&logits),
        0.0,
    );

    // prefill products (cuBLAS + the epilogue pass, or the tiled kernel) at several row counts
    for rows in [1usize, 7, 70] {
        let xs = b.random(rows * c);
        b.put(B::H, &xs)?;
        match &b.blas {
            Some(blas) => {
                // bf16 weights: the activations go in as bf16 (tensor cores)
                let input = match dtype {
                    GpuDtype::Bf16 => {
                        b.l.to_bf16(blas.x_bf16.ptr(), b.ptr(B::H), rows * c)?;
                        Act::Bf16(blas.x_bf16.ptr())
                    }
                    GpuDtype::F32 => Act::F32(b.ptr(B::H)),
                };
                b.fc_gelu(dl, input, rows, Act::F32(b.ptr(B::Fc)))?;
            }
            None => b.l.matmul(Matmul {
                out: b.ptr(B::Fc),
                x: b.ptr(B::H),
                w: dl.fc_w.ptr(),
                bias: Some(dl.fc_b.ptr()),
                rows,
                n: 4 * c,
                k: c,
                epilogue: Epilogue::Gelu,
                start: 0,
                kv: None,
                out_stride: 4 * c,
            })?,
        }
        // bf16 through cuBLAS rounds the activations to bf16 as well
        let xr = if dtype == GpuDtype::Bf16 && b.blas.is_some() {
            bf16_round(&xs)
        } else {
            xs
        };
        let mut want = vec![0.0; rows * 4 * c];
        cpu::linear(&mut want, &xr, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
        want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
        report(
            &format!("matmul+gelu rows={rows}"),
            &b.get(B::Fc, rows * 4 * c)?,
            &want,
            1e-3,
        );
    }

    // cuBLASLt products with fused epilogues (bf16 prefill): GELU + bias into f32 on inputs
    // large enough to tell GELU's tanh form from erf's (they differ by ~1e-4 near 1.5),
    // into bf16 as the prefill uses it, and bias + accumulate into the residual stream
    if dtype == GpuDtype::Bf16 && b.blas.as_ref().is_some_and(Blas::has_lt) {
        let rows = 33;
        let act: Vec<f32> = b.random(rows * c).iter().map(|v| v * 4.0).collect();
        let x0 = b.random(rows * c);
        b.put(B::H, &act)?;
        b.put(B::X, &x0)?;
        let xb = b.x_bf16()?;
        b.l.to_bf16(xb, b.ptr(B::H), rows * c)?;
        let act_r = bf16_round(&act);
        let mut gelu_ref = vec![0.0; rows * 4 * c];
        cpu::linear(&mut gelu_ref, &act_r, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
        gelu_ref.iter_mut().for_each(|v| *v = cpu::gelu(*v));
        let mut delta = vec![0.0; rows * c];
        cpu::linear(&mut delta, &act_r, &lw.proj_w, Some(&lw.proj_b), c, c);
        let res_ref: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
        // the f32 products take an f32 bias (cuBLASLt has no bf16 bias with an f32 result)
        b.put(B::H, &lw.fc_b)?;
        let fc_b32 = b.ptr(B::H);
        let gelu = Shape::new((rows, 4 * c, c), LtEpilogue::GeluBias);
        for what in ["gelu f32", "gelu bf16", "residual"] {
            let blas = b.blas()?;
            let fc = b.ptr(B::Fc);
            let ran = match what {
                "gelu f32" => blas.lt_matmul(
                    &b.l,
                    gelu,
                    dl.fc_w.ptr(),
                    xb,
                    LtBias::F32(fc_b32),
                    Act::F32(fc),
                )?,
                "gelu bf16" => {
                    let out = Act::Bf16(fc.cast());
                    blas.lt_matmul(
                        &b.l,
                        gelu,
                        dl.fc_w.ptr(),
                        xb,
                        LtBias::Stored(dl.fc_b.ptr()),
                        out,
                    )?
                }
                _ => {
                    let shape = Shape {
                        accumulate: true,
                        ..Shape::new((rows, c, c), LtEpilogue::Bias)
                    };
                    let bias = LtBias::F32(dl.proj_b32());
                    blas.lt_matmul(
                        &b.l,
                        shape,
                        dl.proj_w.ptr(),
                        xb,
                        bias,
                        Act::F32(b.ptr(B::X)),
                    )?
                }
            };
            let name = format!("cublaslt {what}");
            if !ran {
                // no algorithm for this shape: the prefill takes the cuBLAS path instead
                report(&format!("{name} (no plan; cuBLAS path)"), &[], &[], 0.0);
                continue;
            }
            let (got, want, tolerance) = match what {
                "gelu f32" => (b.get(B::Fc, rows * 4 * c)?, &gelu_ref, 2e-5),
                "gelu bf16" => {
                    let words = b.get(B::Fc, rows * 2 * c)?;
                    let got = words
                        .iter()
                        .flat_map(|w| {
                            let bits = w.to_bits();
                            [bits as u16, (bits >> 16) as u16]
                        })
                        .map(|h| half::bf16::from_bits(h).to_f32())
                        .collect();
                    (got, &gelu_ref, 1e-2)
                }
                _ => (b.get(B::X, rows * c)?, &res_ref, 1e-3),
            };
            report(&name, &got, want, tolerance);
        }
        // the batched pass's plain products: on cuBLAS's default until timed, then through
        // cuBLASLt on the candidate that timing kept
        let stream = b.l.stream().clone();
        let plans = std::sync::Arc::default();
        let tuned = Blas::new(&stream, 1, 1, Some(&plans)).map(Blas::with_tuned_products);
        if let Some(tuned) = tuned {
            let rows = 33;
            let act: Vec<f32> = b.random(rows * c).iter().map(|v| v * 4.0).collect();
            b.put(B::H, &act)?;
            let xb = b.x_bf16()?;
            b.l.to_bf16(xb, b.ptr(B::H), rows * c)?;
            let mut want = vec![0.0; rows * 4 * c];
            cpu::linear(&mut want, &bf16_round(&act), &lw.fc_w, None, c, 4 * c);
            for when in ["before timing", "timed"] {
                // SAFETY: the shape was met on the bench's buffers and the layer's weights,
                // alive while `b` is; the output is scratch.
                if when == "timed" && unsafe { tuned.tune_products(&b.l, 2) }?.is_empty() {
                    // the product ran on cuBLAS's default path, not through cuBLASLt
                    report("batched plain product (nothing timed)", &[0.0], &[1.0], 0.0);
                    continue;
                }
                let out = (b.ptr(B::Fc), 4 * c);
                tuned.gemm(
                    &b.l,
                    dl.fc_w.ptr(),
                    Act::Bf16(xb),
                    (rows, 4 * c, c),
                    out,
                    false,
                )?;
                let got = b.get(B::Fc, rows * 4 * c)?;
                report(
                    &format!("batched plain product ({when})"),
                    &got,
                    &want,
                    2e-5,
                );
            }
        }
    }

    // layernorm over rows: plain, with a pending bias, and into bf16 (the fused prefill)
    let rows = 5;
    let fused = dtype == GpuDtype::Bf16 && b.blas.is_some();
    for (pre, to_bf16) in [(false, false), (true, false), (true, true)] {
        if to_bf16 && !fused {
            continue;
        }
        let xs = b.random(rows * c);
        b.put(B::X, &xs)?;
        let out = if to_bf16 {
            Act::Bf16(b.x_bf16()?)
        } else {
            Act::F32(b.ptr(B::H))
        };
        b.l.layernorm(LayerNorm {
            out,
            x: b.ptr(B::X),
            norm: dl.ln1(),
            pre_bias: pre.then(|| dl.proj_b.ptr()),
            rows,
        })?;
        let biased: Vec<f32> = xs
            .chunks(c)
            .flat_map(|r| {
                r.iter()
                    .zip(&lw.proj_b)
                    .map(|(a, p)| if pre { a + p } else { *a })
            })
            .collect();
        let mut want = vec![0.0; rows * c];
        cpu::layer_norm(&mut want, &biased, &lw.ln1_w, &lw.ln1_b);
        let (got, tolerance) = if to_bf16 {
            (b.get_bf16(rows * c)?, 1e-2)
        } else {
            (b.get(B::H, rows * c)?, 1e-4)
        };
        let name = format!("layernorm pre_bias={pre} to_bf16={to_bf16}");
        report(&name, &got, &want, tolerance);
        if pre {
            let x_after = b.get(B::X, rows * c)?;
            report("layernorm pre_bias written back", &x_after, &biased, 1e-6);
        }
    }

    // the fused prefill's products: a projection accumulating into the residual stream,
    // and the FC product with its GELU epilogue writing the next product's input
    if b.blas.is_some() {
        let rows = 33;
        let (act, x0) = (b.random(rows * c), b.random(rows * c));
        b.put(B::H, &act)?;
        b.put(B::X, &x0)?;
        let bf16 = dtype == GpuDtype::Bf16;
        let (a, a_4c) = if bf16 {
            let xb = b.x_bf16()?;
            b.l.to_bf16(xb, b.ptr(B::H), rows * c)?;
            (Act::Bf16(xb), Act::Bf16(xb))
        } else {
            (Act::F32(b.ptr(B::H)), Act::F32(b.ptr(B::Fc)))
        };
        let act_r = if bf16 { bf16_round(&act) } else { act };
        let blas = b.blas()?;
        blas.gemm(
            &b.l,
            dl.proj_w.ptr(),
            a,
            (rows, c, c),
            (b.ptr(B::X), c),
            true,
        )?;
        b.fc_gelu(dl, a, rows, a_4c)?;
        let mut delta = vec![0.0; rows * c];
        cpu::linear(&mut delta, &act_r, &lw.proj_w, None, c, c);
        let want: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
        report("gemm accumulate", &b.get(B::X, rows * c)?, &want, 1e-3);
        let mut want = vec![0.0; rows * 4 * c];
        cpu::linear(&mut want, &act_r, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
        want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
        let (got, tolerance) = if bf16 {
            (b.get_bf16(rows * 4 * c)?, 1e-2)
        } else {
            (b.get(B::Fc, rows * 4 * c)?, 1e-3)
        };
        report(
            &format!("gemm + gelu epilogue to_bf16={bf16}"),
            &got,
            &want,
            tolerance,
        );
    }

    // embedding of a few tokens at a start position
    let (n, start) = (4usize, 3usize);
    let tokens: Vec<i32> = (0..n).map(|_| b.rng.random_range(0..v as i32)).collect();
    b.put_ids(None, &tokens)?;
    embed(b, n, start)?;
    let want: Vec<f32> = tokens
        .iter()
        .enumerate()
        .flat_map(|(t, &tok)| (0..c).map(move |k| (t, tok as usize, k)))
        .map(|(t, tok, k)| w.wte[tok * c + k] + w.wpe[(start + t) * c + k])
        .collect();
    report("embed", &b.get(B::X, n * c)?, &want, 1e-6);

    // a decode step run ahead feeds itself: the argmax of the step before (its key as the LM
    // head left it), at the position after the last one; both written back to the ids
    b.lm_head(dev)?;
    let token = b.argmax()? as usize;
    let last = 5usize;
    b.put_ids(Some(last), &[0])?;
    b.l.embed(Embed {
        out: b.ptr(B::X),
        tokens: b.ids.ptr().skip(1),
        wte: dev.wte.ptr(),
        wpe: dev.wpe.ptr(),
        rows: 1,
        start: None,
        position: b.position(),
        argmax_key: b.next.ptr(),
        feed: true,
    })?;
    let ids = b.ids.read(b.l.stream(), 2)?;
    let key = b.next.read(b.l.stream(), 1)?;
    let fed: Vec<f32> = [ids[1], ids[0]].iter().map(|&i| i as f32).collect();
    let cleared = key.first().map_or(f32::NAN, |&k| k as f32);
    report(
        "embed fed: token, position, key cleared",
        &[fed[0], fed[1], cleared],
        &[token as f32, (last + 1) as f32, 0.0],
        0.0,
    );
    let want: Vec<f32> = (0..c)
        .map(|k| w.wte[token * c + k] + w.wpe[(last + 1) * c + k])
        .collect();
    report("embed fed", &b.get(B::X, c)?, &want, 1e-6);

    // attention: random keys and values for the whole context, then decode at the last
    // position and prefill the last rows
    let len = cfg.n_ctx;
    // as the cache keeps them (fp16 with bf16 weights)
    let (keys, values) = (b.random(len * c), b.random(len * c));
    let (keys, values) = (b.kept(&keys), b.kept(&values));
    b.put(B::K, &keys)?;
    b.put(B::V, &values)?;
    let kv = b.kv();
    // Tensor cores see fp16 queries, keys and values (and round the probabilities).
    let (tc, tolerance) = if b.tensor_cores {
        (true, 3e-3)
    } else {
        (false, 2e-4)
    };
    let round = |v: &[f32]| if tc { f16_round(v) } else { v.to_vec() };
    let (keys_r, values_r) = (round(&keys), round(&values));
    let mut qkv = Vec::new();
    // a whole prompt (a partial last tile), then a few rows after a long prefix
    for (start, q_rows) in [(0usize, len), (len - 40, 40), (10, len - 10)] {
        qkv = b.random(q_rows * 3 * c);
        b.put(B::Qkv, &qkv)?;
        let out = b.attention_out(fused)?;
        let attention = PrefillAttention {
            out,
            kv,
            start: Start::Host(start),
            rows: q_rows,
        };
        b.prefill_attention(attention, None)?;
        let mut want = vec![0.0; q_rows * c];
        let visible = (start + q_rows) * c;
        cpu::attention(
            &mut want,
            &round(&qkv),
            (&keys_r[..visible], &values_r[..visible]),
            start,
            cfg.n_head,
            c,
        );
        let got = b.get_act(out, q_rows * c)?;
        let name = format!(
            "attention prefill start={start} rows={q_rows} to_bf16={}",
            out.is_bf16()
        );
        // a bf16 output is rounded too
        report(
            &name,
            &got,
            &want,
            if out.is_bf16() { 1e-2 } else { tolerance },
        );
    }
    b.put_ids(Some(len - 1), &[])?;
    b.l.decode_attention(DecodeAttention {
        out: b.ptr(B::H),
        qkv: b.ptr(B::Qkv),
        kv,
        position: b.position(),
        partial: b.partial.ptr(),
        max_chunks: b.max_chunks,
    })?;
    let mut want = vec![0.0; c];
    cpu::attention(
        &mut want,
        &qkv[..3 * c],
        (&keys, &values),
        len - 1,
        cfg.n_head,
        c,
    );
    report("attention decode", &b.get(B::H, c)?, &want, 2e-4);

    // the batched decode attention: rows of ragged lengths (one chunk, chunk edges, the
    // whole context, a padding row) over the same cache, f32 or split bf16 output
    let qkv_b = (&lw.qkv_b[..], dl.qkv_b.ptr());
    check_batch_attention(b, dtype, (&keys, &values), qkv_b, report)?;
    tiles::check_tiles(b, (&keys, &values), qkv_b, report)?;
    check_batch_feed(b, report)?;
    // the sampled draw, on the model's vocabulary, GPT-2's, and one whose chunks are too long
    // for the walk through shared memory
    let seed = b.rng.random();
    draw::check_draw(&b.l, &[v, 50257, 140_000], seed, report)?;
    // and after a request's processing, with and without min-p
    draw::check_draw_edited(&b.l, &[v, 50257], seed ^ 1, report)?;

    // the tensor-core attention reading the prompt's queries, keys and values from bf16
    // QKV rows (after a prefix in the f32 cache) and appending them to the cache; it sees
    // bf16 everywhere (the prefix is rounded on the way, probabilities too)
    let (mut keys, mut values) = (keys, values);
    if tc {
        for (start, q_rows) in [(0usize, len - 3), (len - 70, 70)] {
            let rows_qkv = bf16_round(&b.random(q_rows * 3 * c));
            b.put_qkv_bf16(&rows_qkv)?;
            let out = b.attention_out(fused)?;
            let rows_ptr = b.blas()?.qkv_bf16.ptr();
            let attention = PrefillAttention {
                out,
                kv,
                start: Start::Host(start),
                rows: q_rows,
            };
            b.prefill_attention(attention, Some(rows_ptr))?;
            for (t, row) in rows_qkv.chunks(3 * c).enumerate() {
                let at = (start + t) * c;
                keys[at..at + c].copy_from_slice(&row[c..2 * c]);
                values[at..at + c].copy_from_slice(&row[2 * c..]);
            }
            let visible = (start + q_rows) * c;
            let mut want = vec![0.0; q_rows * c];
            let cache = (
                &bf16_round(&keys[..visible]),
                &bf16_round(&values[..visible]),
            );
            cpu::attention(
                &mut want,
                &rows_qkv,
                (cache.0, cache.1),
                start,
                cfg.n_head,
                c,
            );
            let got = b.get_act(out, q_rows * c)?;
            let name = format!("attention prefill bf16 rows start={start} rows={q_rows}");
            report(&name, &got, &want, 1e-2);
            let k_got = b.get(B::K, visible)?;
            let v_got = b.get(B::V, visible)?;
            let got = [&k_got[start * c..], &v_got[start * c..]].concat();
            let want = [&keys[start * c..visible], &values[start * c..visible]].concat();
            // bf16 into fp16 is exact but for fp16's subnormals
            let name = format!("attention prefill bf16 rows appended start={start}");
            report(&name, &got, &want, if b.kv16 { 1e-6 } else { 0.0 });
        }
    }

    // the fused decode step (sm_90 clusters): LayerNorm + QKV + cache append + attention,
    // at the last position, at one where some blocks of a cluster get no positions, and at 0
    if b.fused_decode {
        for pos in [len - 1, 5, 0] {
            let x = b.random(c);
            b.put(B::X, &x)?;
            b.put_ids(Some(pos), &[])?;
            // the session's default cluster shape (8 blocks; 128 threads for wide f32)
            let wide_f32 = dtype == GpuDtype::F32 && c > 768;
            let chosen = b.l.gpu().measurement().decode_cluster;
            let (cluster, threads) = decode_cluster_shape(chosen, wide_f32);
            b.l.fused_decode(FusedDecode {
                out: b.ptr(B::H),
                x: b.ptr(B::X),
                qkv_w: dl.qkv_w.ptr(),
                qkv_b: dl.qkv_b.ptr(),
                norm: dl.ln1(),
                kv,
                position: b.position(),
                capacity: len,
                cluster,
                threads,
                prefetch: Some(dl.proj_w.ptr()),
            })?;
            let mut normed = vec![0.0; c];
            cpu::layer_norm(&mut normed, &x, &lw.ln1_w, &lw.ln1_b);
            let mut qkv = vec![0.0; 3 * c];
            cpu::linear(&mut qkv, &normed, &lw.qkv_w, Some(&lw.qkv_b), c, 3 * c);
            // the new key and value as the cache should keep them
            let kept = b.kept(&qkv[c..]);
            let visible = (pos + 1) * c;
            let k_row = b.get(B::K, visible)?;
            let v_row = b.get(B::V, visible)?;
            let appended = [&k_row[pos * c..], &v_row[pos * c..]].concat();
            let name = format!("decode qkv+attention cache append pos={pos}");
            // fp16: a value on a rounding edge may go either way (one fp16 step, < 1e-3)
            report(&name, &appended, &kept, if b.kv16 { 1e-3 } else { 1e-4 });
            // the attention over the cache as the kernel wrote it: a value that went the other
            // way on its rounding edge would otherwise show again in the output (at position 0
            // the output is that value)
            keys[pos * c..visible].copy_from_slice(&appended[..c]);
            values[pos * c..visible].copy_from_slice(&appended[c..]);
            let mut want = vec![0.0; c];
            let cache = (&keys[..visible], &values[..visible]);
            cpu::attention(&mut want, &qkv, cache, pos, cfg.n_head, c);
            let name = format!("decode qkv+attention (clusters) pos={pos}");
            report(&name, &b.get(B::H, c)?, &want, 2e-4);
        }
    }
    Ok(())
}

/// The table of `rows` rows over `ints` (tokens, then positions) and `addrs` (key caches,
/// value caches, logits buffers), `rows` each.
fn row_table(
    rows: usize,
    (ints, addrs, keys): (&DevBuf<i32>, &DevBuf<u64>, &DevBuf<u64>),
    layer_floats: usize,
) -> RowTable {
    let (ip, ap) = (ints.ptr(), addrs.ptr());
    RowTable {
        rows,
        logit_rows: rows,
        lo_rows: rows,
        tokens: ip,
        positions: ip.skip(rows),
        k_caches: ap,
        v_caches: ap.skip(rows),
        logits: ap.skip(2 * rows),
        keys: keys.ptr(),
        layer_floats,
        tiles: None,
    }
}

/// The argmax key the LM head raises for `value` at column `col` (`argmax_key` in
/// `kernels/matvec.cu`): larger values give larger keys, and of equal values the first
/// column wins.
fn argmax_key(value: f32, col: usize) -> u64 {
    if value.is_nan() {
        return 0;
    }
    let u = value.to_bits();
    let ordered = if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - col as u32)
}

/// The token feed (`batch_feed`): a row whose feed names a row of the pass before takes that
/// row's argmax, decoded from the key its LM head left (here made from random logits, and one
/// key never raised, 0, which names token 0); a row without a feed, or with one past the
/// keys' rows, keeps its token.
fn check_batch_feed(
    b: &mut Bench,
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    let v = b.l.config().vocab_size;
    let stream = b.l.stream().clone();
    let before = 16;
    // the pass before: each row's logits, their argmax and the key the LM head leaves
    let mut keys = Vec::with_capacity(before);
    let mut argmaxes = Vec::with_capacity(before);
    for row in 0..before {
        let logits = b.random(v);
        let key = match row {
            7 => 0, // a row whose key no logit raised
            _ => (0..v)
                .map(|col| argmax_key(logits[col], col))
                .max()
                .unwrap_or(0),
        };
        keys.push(key);
        argmaxes.push(if row == 7 { 0 } else { argmax(&logits) as i32 });
    }
    let feeds: Vec<i32> = vec![-1, 0, 3, 15, 16, 2, -1, 7, 100, 1, 15, 0];
    let rows = feeds.len();
    let tokens: Vec<i32> = (0..rows).map(|r| ((r * 37 + 5) % v) as i32).collect();
    let want: Vec<f32> = feeds
        .iter()
        .zip(&tokens)
        .map(|(&f, &t)| match usize::try_from(f) {
            Ok(f) if f < before => argmaxes[f] as f32,
            _ => t as f32,
        })
        .collect();
    // the table: tokens, positions, feeds; no caches (the feed touches none)
    let ints: Vec<i32> = tokens
        .iter()
        .copied()
        .chain(std::iter::repeat_n(0, rows))
        .chain(feeds.iter().copied())
        .collect();
    let ints = DevBuf::from_host(&stream, &ints, "table")?;
    let addrs = DevBuf::<u64>::zeros(&stream, 3 * rows, "table")?;
    let keys_buf = DevBuf::from_host(&stream, &keys, "keys")?;
    let table = row_table(rows, (&ints, &addrs, &keys_buf), 0);
    let ip = ints.ptr();
    b.l.batch_feed(&table, ip.skip(2 * rows))?;
    let got: Vec<f32> = ints
        .read(&stream, rows)?
        .iter()
        .map(|&t| t as f32)
        .collect();
    report(
        &format!("token feed rows={rows} keys={before}"),
        &got,
        &want,
        0.0,
    );
    Ok(())
}

/// The batched attention (`batch_attention` + `batch_attention_combine`) for rows at ragged
/// positions, each with its own cache, against the CPU's attention of each row alone: the
/// QKV product's rows plus the bias give the query and the key and value appended at the
/// row's position. In bf16 mode the product rows come split (hi and lo rows summed) and the
/// output is split too (summed back here). One span per row, and up to three and four spans
/// combined, of 64 and 256 positions.
fn check_batch_attention(
    b: &mut Bench,
    dtype: GpuDtype,
    (keys, values): (&[f32], &[f32]),
    qkv_b: (&[f32], DevPtr<wasi_nn_host::cuda::buffer::Stored>),
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    use wasi_nn_host::cuda::ops::batch::{
        BatchAttention, BATCH_ATT_SPAN as SPAN, BATCH_ATT_SPLITS,
    };
    let cfg = b.l.config();
    let (c, t) = (cfg.n_embd, cfg.n_ctx);
    // rows at the ends of the cache and of a span (row 5 is the last position, whose appended
    // key is read back below), a padding row, and rows at the ends of the bf16 decode's pieces
    // of 32 positions, a warp a piece: two pieces exactly, four (one a warp), and a fifth
    // piece of one position (the first warp's second)
    let last = t as i32 - 1;
    let mut positions: Vec<i32> = vec![0, 31, 32, 33, (t / 2) as i32, last, -1];
    positions.extend([63, 127, 128].map(|p| p.min(last - 1)));
    let rows = positions.len();
    let split = dtype == GpuDtype::Bf16;
    let stream = b.l.stream().clone();
    // the QKV product's rows: hi and lo halves in bf16 mode
    let product_rows = if split { 2 * rows } else { rows };
    let tmp_values = b.random(product_rows * 3 * c);
    let tmp = DevBuf::from_host(&stream, &tmp_values, "product rows")?;
    let mut caches = Vec::new();
    let upload = |values: &[f32]| match b.kv16 {
        true => DevBuf::from_host(&stream, &pack_f16(values), "KV cache"),
        false => DevBuf::from_host(&stream, values, "KV cache"),
    };
    for _ in 0..rows {
        caches.push((upload(keys)?, upload(values)?));
    }
    let ints: Vec<i32> = std::iter::repeat_n(0, rows)
        .chain(positions.iter().copied())
        .collect();
    let addrs: Vec<u64> = caches
        .iter()
        .map(|(k, _)| k.ptr().addr())
        .chain(caches.iter().map(|(_, v)| v.ptr().addr()))
        .chain(std::iter::repeat_n(0, rows))
        .collect();
    let ints = DevBuf::from_host(&stream, &ints, "table")?;
    let addrs = DevBuf::from_host(&stream, &addrs, "table")?;
    let keys_buf = DevBuf::<u64>::zeros(&stream, rows, "table")?;
    let table = row_table(rows, (&ints, &addrs, &keys_buf), t * c);
    let partial = DevBuf::<f32>::zeros(
        &stream,
        rows * cfg.n_head * BATCH_ATT_SPLITS * (cfg.head_dim() + 2),
        "partial",
    )?;
    let out = if split {
        Act::Bf16(b.x_bf16()?)
    } else {
        Act::F32(b.ptr(B::H))
    };
    // what the CPU sees: each row's q, k, v (product rows summed, bias added) over its cache
    let mut want = vec![0.0; rows * c];
    for (r, &p) in positions.iter().enumerate() {
        if p < 0 {
            continue; // a padding row gives zeros
        }
        let p = p as usize;
        let mut qkv: Vec<f32> = tmp_values[r * 3 * c..(r + 1) * 3 * c].to_vec();
        if split {
            let lo = &tmp_values[(rows + r) * 3 * c..(rows + r + 1) * 3 * c];
            qkv.iter_mut().zip(lo).for_each(|(a, l)| *a += l);
        }
        qkv.iter_mut().zip(qkv_b.0).for_each(|(a, bias)| *a += bias);
        let visible = (p + 1) * c;
        let (mut k, mut v) = (keys[..visible].to_vec(), values[..visible].to_vec());
        let kept = b.kept(&qkv[c..]);
        k[p * c..].copy_from_slice(&kept[..c]);
        v[p * c..].copy_from_slice(&kept[c..]);
        cpu::attention(
            &mut want[r * c..(r + 1) * c],
            &qkv,
            (&k, &v),
            p,
            cfg.n_head,
            c,
        );
    }
    // a row's spans come from its own length (one per `span` positions, at most the grid's):
    // the rows that take at most 3 spans of 64 get the same bits from grids of 3 and 4 spans
    let mut at_most_3 = None;
    for (splits, span) in [
        (1, SPAN),
        (BATCH_ATT_SPLITS, SPAN),
        (3, SPAN),
        (BATCH_ATT_SPLITS, 4 * SPAN),
    ] {
        let attention = BatchAttention {
            out,
            tmp: tmp.ptr(),
            bias: qkv_b.1,
            split,
            parts: 1,
            partial: partial.ptr(),
            layer: 0,
            splits,
            span,
            append: true,
        };
        b.l.batch_attention(&table, attention)?;
        let got: Vec<f32> = if split {
            let halves = b.get_bf16(2 * rows * c)?;
            let (hi, lo) = halves.split_at(rows * c);
            hi.iter().zip(lo).map(|(h, l)| h + l).collect()
        } else {
            b.get(B::H, rows * c)?
        };
        let name = format!("attention batched rows={rows} spans={splits} of {span} split={split}");
        report(&name, &got, &want, 2e-4);
        if span == SPAN && splits >= 3 {
            // the rows of at most 3 spans of their own
            let few: Vec<f32> = (positions.iter().enumerate())
                .filter(|&(_, &p)| (p + 1).max(1) as usize <= 3 * SPAN)
                .flat_map(|(r, _)| got[r * c..(r + 1) * c].to_vec())
                .collect();
            match &at_most_3 {
                None => at_most_3 = Some(few),
                Some(before) => report(
                    &format!(
                        "attention batched rows={rows}: a row's bits from grids of 4 and 3 spans"
                    ),
                    &few,
                    before,
                    0.0,
                ),
            }
        }
    }
    // the appended keys: row 5's cache holds its key at its position
    let (r, p) = (5, positions[5] as usize);
    let got_k = match b.kv16 {
        true => unpack_f16(&caches[r].0.read(&stream, (t * c).div_ceil(2))?, t * c),
        false => caches[r].0.read(&stream, t * c)?,
    };
    let mut k_want: Vec<f32> = tmp_values[r * 3 * c + c..r * 3 * c + 2 * c].to_vec();
    if split {
        let lo = &tmp_values[(rows + r) * 3 * c + c..(rows + r) * 3 * c + 2 * c];
        k_want.iter_mut().zip(lo).for_each(|(a, l)| *a += l);
    }
    k_want
        .iter_mut()
        .zip(&qkv_b.0[c..2 * c])
        .for_each(|(a, bias)| *a += bias);
    report(
        "attention batched appended key",
        &got_k[p * c..(p + 1) * c],
        &b.kept(&k_want),
        if b.kv16 { 1e-3 } else { 1e-6 },
    );
    Ok(())
}
