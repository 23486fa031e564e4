//! The products of a batched CPU step of a few rows (the step's contexts): the LM head against
//! the `[vocab, C]` embedding matrix (72% of the embedded model's weights) and, for models
//! whose layers are small enough to copy, every layer's four products.
//!
//! Through the `gemm` crate a step of 4-16 rows took 5-12 ms on this machine's 2 cores
//! against 2 ms for one row's matrix-vector product, whichever way round the product was given
//! to it (it rearranges its operands on every call). [`Packed`] packs a matrix once, at
//! load, into panels of
//! [`PANEL`] columns (`[C][PANEL]` each, the last one padded with zeros), and a step streams
//! every panel once for all its rows: each panel's columns in registers, each row's value
//! broadcast, the sums over C accumulated with FMA in C's order. x86-64 with AVX2 and FMA only
//! (detected at run time); elsewhere the caller keeps `gemm`.

use rayon::prelude::*;

/// Columns of one panel: two AVX registers.
pub const PANEL: usize = 16;

/// Rows of one register block (each with two accumulators).
const BLOCK_ROWS: usize = 4;

/// Most panels one task takes (small matrices are cut finer, so every thread has work).
const PANELS_PER_TASK: usize = 32;

/// A `[n_out, n_in]` row-major weight matrix packed for [`Packed::matmul`].
pub struct Packed {
    panels: Vec<f32>,
    n_out: usize,
    n_in: usize,
}

/// The start of an output row; the tasks write their own columns of every row.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the tasks write disjoint column ranges of the output (see `Packed::matmul`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// (A method, so closures capture the whole `Out`, not its raw field.)
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

impl Packed {
    /// `w` packed, or None where the kernel cannot run (no AVX2 and FMA).
    pub fn new(w: &[f32], n_out: usize, n_in: usize) -> Option<Self> {
        if !available() || w.len() != n_out * n_in || n_in == 0 {
            return None;
        }
        let count = n_out.div_ceil(PANEL);
        let mut panels = vec![0.0f32; count * n_in * PANEL];
        panels
            .par_chunks_mut(n_in * PANEL)
            .enumerate()
            .for_each(|(p, panel)| {
                for col in 0..PANEL.min(n_out - p * PANEL) {
                    let row = &w[(p * PANEL + col) * n_in..][..n_in];
                    for (k, &v) in row.iter().enumerate() {
                        panel[k * PANEL + col] = v;
                    }
                }
            });
        Some(Self {
            panels,
            n_out,
            n_in,
        })
    }

    /// Bytes of the packed copy.
    pub fn bytes(&self) -> usize {
        4 * self.panels.len()
    }

    /// `out[rows, n_out] (+)= x[rows, n_in] W^T` (row-major), added to what `out` holds
    /// when `accumulate`.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], accumulate: bool) {
        let rows = x.len() / self.n_in;
        assert!(
            x.len() == rows * self.n_in && out.len() == rows * self.n_out,
            "packed product shapes"
        );
        let (base, n_out) = (Out(out.as_mut_ptr()), self.n_out);
        // SAFETY: row r < rows starts r * n_out floats into `out`, which holds rows * n_out
        // (checked); the rows are distinct.
        unsafe { self.run(rows, |r| base.at(r * n_out), x, accumulate) };
    }

    /// Row r of `x[rows, n_in] W^T` into `outs[r]` (each `n_out` long): rows that live in
    /// different buffers (each context's logits), written where they are read.
    pub fn matmul_rows(&self, outs: &mut [&mut [f32]], x: &[f32]) {
        let rows = x.len() / self.n_in;
        assert!(
            x.len() == rows * self.n_in
                && outs.len() == rows
                && outs.iter().all(|row| row.len() == self.n_out),
            "packed product shapes"
        );
        let starts: Vec<Out> = outs.iter_mut().map(|row| Out(row.as_mut_ptr())).collect();
        // SAFETY: one start per row of x, each a distinct `&mut` row of n_out floats (checked).
        unsafe { self.run(rows, |r| starts[r].at(0), x, false) };
    }

    /// The product of the `rows` rows of `x`, row r's `n_out` outputs at `start(r)`.
    ///
    /// # Safety
    /// `x` holds `rows` rows of `n_in`; for each r < rows, `start(r)` points at `n_out`
    /// writable floats that no other row's and nothing else touches during the call.
    unsafe fn run(
        &self,
        rows: usize,
        start: impl Fn(usize) -> *mut f32 + Sync,
        x: &[f32],
        accumulate: bool,
    ) {
        let (n_in, n_out) = (self.n_in, self.n_out);
        let count = n_out.div_ceil(PANEL);
        let per_task = count
            .div_ceil(4 * rayon::current_num_threads())
            .clamp(1, PANELS_PER_TASK);
        let tasks = self.panels.par_chunks(n_in * PANEL * per_task);
        tasks.enumerate().for_each(|(t, panels)| {
            for (i, panel) in panels.chunks(n_in * PANEL).enumerate() {
                let first = (t * per_task + i) * PANEL;
                let cols = PANEL.min(n_out - first);
                let mut r = 0;
                while r < rows {
                    let take = BLOCK_ROWS.min(rows - r);
                    let mut sums = [[0.0f32; PANEL]; BLOCK_ROWS];
                    let xs = &x[r * n_in..(r + take) * n_in];
                    // SAFETY: `available()` held when this was packed; the panel holds
                    // n_in * PANEL floats and xs `take` rows of n_in.
                    unsafe {
                        match take {
                            1 => panel_block::<1>(panel, xs, n_in, &mut sums),
                            2 => panel_block::<2>(panel, xs, n_in, &mut sums),
                            3 => panel_block::<3>(panel, xs, n_in, &mut sums),
                            _ => panel_block::<4>(panel, xs, n_in, &mut sums),
                        }
                    }
                    for (j, sum) in sums.iter().take(take).enumerate() {
                        let dst = start(r + j).wrapping_add(first);
                        // SAFETY: row r + j has n_out floats at its start (the caller's
                        // promise) and first + cols <= n_out; no other task touches these
                        // columns (each task has its own panels).
                        unsafe {
                            let dst = std::slice::from_raw_parts_mut(dst, cols);
                            if accumulate {
                                dst.iter_mut().zip(sum).for_each(|(d, s)| *d += s);
                            } else {
                                dst.copy_from_slice(&sum[..cols]);
                            }
                        }
                    }
                    r += take;
                }
            }
        });
    }
}

/// Whether this CPU runs the packed kernel.
fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The sums of one panel's PANEL columns for the R rows of `x` (R <= BLOCK_ROWS, each
/// accumulator in a register).
///
/// # Safety
/// AVX2 and FMA must be available; `panel` holds `n_in * PANEL` floats, `x` R rows of `n_in`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_block<const R: usize>(
    panel: &[f32],
    x: &[f32],
    n_in: usize,
    sums: &mut [[f32; PANEL]; BLOCK_ROWS],
) {
    use std::arch::x86_64::*;
    debug_assert!(R <= BLOCK_ROWS && x.len() == R * n_in && panel.len() >= n_in * PANEL);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let (p, xp) = (panel.as_ptr(), x.as_ptr());
    for k in 0..n_in {
        // SAFETY: k * PANEL + 16 <= n_in * PANEL floats of the panel; j * n_in + k < R * n_in.
        unsafe {
            let (w0, w1) = (
                _mm256_loadu_ps(p.add(k * PANEL)),
                _mm256_loadu_ps(p.add(k * PANEL + 8)),
            );
            for (j, a) in acc.iter_mut().enumerate() {
                let v = _mm256_set1_ps(*xp.add(j * n_in + k));
                a[0] = _mm256_fmadd_ps(w0, v, a[0]);
                a[1] = _mm256_fmadd_ps(w1, v, a[1]);
            }
        }
    }
    for (sum, a) in sums.iter_mut().zip(&acc) {
        // SAFETY: each half of `sum` holds 8 floats.
        unsafe {
            _mm256_storeu_ps(sum.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(sum.as_mut_ptr().add(8), a[1]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn panel_block<const R: usize>(
    _: &[f32],
    _: &[f32],
    _: usize,
    _: &mut [[f32; PANEL]; BLOCK_ROWS],
) {
    unreachable!("Packed::new refuses to pack without AVX2 and FMA")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sums, for row counts around the register block and a width and
    /// column count that are no multiples of anything.
    #[test]
    fn packed_products_match_plain_sums() {
        let (n_out, n_in) = (1000 + 7, 37);
        let w: Vec<f32> = (0..n_out * n_in)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 1e-3)
            .collect();
        let Some(packed) = Packed::new(&w, n_out, n_in) else {
            eprintln!("skipped: no AVX2 and FMA here");
            return;
        };
        for rows in [1, 3, 4, 5, 16, 17] {
            let x: Vec<f32> = (0..rows * n_in)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) * 1e-2)
                .collect();
            let mut out = vec![f32::NAN; rows * n_out];
            packed.matmul(&mut out, &x, false);
            // accumulating: onto a known start, out = start + x W^T
            let start = |r: usize, i: usize| ((r * 13 + i * 7) % 11) as f64 - 5.0;
            let mut added: Vec<f32> = (0..rows * n_out)
                .map(|j| start(j / n_out, j % n_out) as f32)
                .collect();
            packed.matmul(&mut added, &x, true);
            // rows in buffers of their own: the same values as the rows of one buffer
            let mut own: Vec<Vec<f32>> = vec![vec![f32::NAN; n_out]; rows];
            let mut dests: Vec<&mut [f32]> = own.iter_mut().map(|row| &mut row[..]).collect();
            packed.matmul_rows(&mut dests, &x);
            for (r, row) in own.iter().enumerate() {
                assert!(
                    row[..] == out[r * n_out..][..n_out],
                    "row {r} in its own buffer"
                );
            }
            for r in 0..rows {
                for i in 0..n_out {
                    let want: f64 = (0..n_in)
                        .map(|k| w[i * n_in + k] as f64 * x[r * n_in + k] as f64)
                        .sum();
                    let sum = added[r * n_out + i] as f64;
                    assert!(
                        (sum - start(r, i) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "accumulated row {r} col {i}: {sum} vs {want} + {}",
                        start(r, i)
                    );
                    let got = out[r * n_out + i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "row {r} col {i}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
