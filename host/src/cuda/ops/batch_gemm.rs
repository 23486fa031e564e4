//! The batched step's products on our tensor-core kernel (`batch_gemm_bf16_*` in
//! `kernels/batch.cu`): the launcher, and the plan of a product (how K is cut into slices,
//! the tile width, the planes) that makes a row's sums the same at every step size.

use super::{kernel_args, Launcher};
use crate::cuda::buffer::{Bf16, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use cudarc::driver::LaunchConfig;

impl Launcher {
    /// `out[z][r, :] = (a[r] + a[rows + r]) w^T` over plane z's share of K, for the `rows` rows
    /// of a split bf16 input (`[2 * rows, k]`, hi rows then lo rows): K cut into `plan.slices`
    /// slices summed in order, `plan.planes` f32 planes of `[rows, n]` one after the other
    /// (each slice its own plane, or all folded into one), for a consumer that sums them in
    /// order (`product_value`). The batched step's products on our tensor-core kernel; a row's
    /// result does not depend on the other rows. `None` when the GPU or the shape does not suit
    /// the kernel (the caller then uses cuBLAS).
    pub fn batch_gemm(
        &self,
        w: DevPtr<Stored>,
        a: DevPtr<Bf16>,
        (rows, n, k): (usize, usize, usize),
        out: DevPtr<f32>,
        plan: GemmPlan,
    ) -> Option<Result<(), CudaError>> {
        let (slices, planes, cols) = (plan.slices, plan.planes, plan.cols());
        let funcs = self.kernels.batch_gemm.as_ref()?;
        let usable = self.dtype == crate::engine::GpuDtype::Bf16
            && (1..=MAX_PARTS).contains(&slices)
            && (planes == 1 || planes == slices)
            && rows >= 1
            && n.is_multiple_of(cols)
            && k.is_multiple_of(slices * BG_BK);
        if !usable {
            return None;
        }
        let checked = ensure(
            w.len() >= n * k && a.len() >= 2 * rows * k && out.len() >= planes * rows * n,
            "batched product",
        );
        if let Err(e) = checked {
            return Some(Err(e));
        }
        let cfg = LaunchConfig {
            grid_dim: (
                (planes * rows.div_ceil(BG_STREAMS)) as u32,
                (n / cols) as u32,
                1,
            ),
            block_dim: (BG_THREADS, 1, 1),
            shared_mem_bytes: gemm_shared_bytes(cols) as u32,
        };
        let (c, a, w) = (out.addr(), a.addr(), w.addr());
        let (rows, n, k, slices) = (rows as i32, n as i32, k as i32, slices as i32);
        let func = &funcs[usize::from(!plan.wide) + 2 * usize::from(plan.planes < plan.slices)];
        // SAFETY: w holds n rows of k, a 2 * rows rows of k, out `planes` planes of rows rows
        // of n (checked); the grid covers the rows in tiles of 64 (rows past `rows` neither
        // read nor written), n in whole column tiles and K in `planes` spans of whole slices,
        // each of whole 64-wide stages.
        let mut args = kernel_args![&c, &a, &w, &rows, &n, &k, &slices];
        Some(unsafe { self.launch(func, cfg, 1, &mut args, "batched product") })
    }
}

/// Rows (each as its hi and lo row) and K-stage width of one block of
/// [`Launcher::batch_gemm`], and its two column widths (`BG_STREAMS`, `BG_BK`, `batch_gemm_bf16_n64`
/// / `_n32` in `kernels/batch.cu`).
const BG_STREAMS: usize = 64;
const BG_BK: usize = 64;
const BG_WIDE: usize = 64;
const BG_NARROW: usize = 32;

/// Output columns of one block of [`Launcher::batch_gemm`]: 64 (`wide`) or 32.
fn tile_cols(wide: bool) -> usize {
    if wide {
        BG_WIDE
    } else {
        BG_NARROW
    }
}
const BG_STAGES: usize = 4;
const BG_THREADS: u32 = 256;

/// Dynamic shared memory of [`Launcher::batch_gemm`]'s blocks of `cols` columns: `BG_STAGES`
/// stages of 128 input rows and the tile's weight rows, each row 64 bf16 (swizzled, unpadded).
fn gemm_shared_bytes(cols: usize) -> usize {
    BG_STAGES * (2 * BG_STREAMS + cols) * BG_BK * 2
}

/// Let a product kernel use its dynamic shared memory (above the default 48 KiB).
pub(crate) fn allow_gemm_shared_memory(
    func: &cudarc::driver::CudaFunction,
    wide: bool,
) -> Result<(), CudaError> {
    use super::super::error::DriverContext;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    let cols = tile_cols(wide);
    func.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        gemm_shared_bytes(cols) as i32,
    )
    .ctx("product shared memory")
}

/// Most K slices (planes for the consumer to sum, `MAX_PLANES` in `kernels/batch.cu`) a
/// product is cut into.
pub const MAX_PARTS: usize = 8;

/// How [`Launcher::batch_gemm`] runs one product: K in `slices` slices (summed in order, which
/// fixes a row's bits), written as `planes` planes (1: the slices folded in the kernel, or one
/// plane each), 64-column tiles (`wide`) or 32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub slices: usize,
    pub planes: usize,
    pub wide: bool,
}

impl GemmPlan {
    /// Output columns of one block.
    pub fn cols(&self) -> usize {
        tile_cols(self.wide)
    }

    /// Blocks of a product of `rows` rows and `n` columns.
    fn blocks(&self, rows: usize, n: usize) -> usize {
        (n / self.cols()) * rows.div_ceil(BG_STREAMS) * self.planes
    }
}

/// The slices of a product of `n` columns and depth `k` on a GPU of `sms` multiprocessors, and
/// whether a step of up to 64 rows takes it in 64-column tiles: those tiles unless even 8 slices
/// of them leave SMs idle, then K cut into as many slices as keep the blocks within two an SM
/// (at most [`MAX_PARTS`], whole stages each). Not a function of the rows: every step cuts a
/// product's K the same way, so a row's sums are the same whatever rows it runs with.
fn batch_gemm_slices(n: usize, k: usize, sms: usize) -> (usize, bool) {
    let wide = n.is_multiple_of(BG_WIDE) && (n / BG_WIDE) * MAX_PARTS >= sms;
    let tiles = (n / tile_cols(wide)).max(1);
    (
        gemm_most_parts(k, (2 * sms / tiles).clamp(1, MAX_PARTS)),
        wide,
    )
}

/// The plan for a product of `rows` rows, `n` columns and depth `k` on a GPU of `sms`
/// multiprocessors, its planes within `room` floats. The slices are the product's own
/// ([`batch_gemm_slices`]); up to 64 rows each slice is a plane, as the 64-column choice says.
/// More rows fold the slices into one plane in the kernel, in the widest tiles that still give
/// every SM a block, and keep a plane per slice only where a single plane would not.
pub fn batch_gemm_plan(rows: usize, n: usize, k: usize, sms: usize, room: usize) -> GemmPlan {
    let (slices, wide) = batch_gemm_slices(n, k, sms);
    let fits = |planes: usize| planes * rows * n <= room;
    let own = GemmPlan {
        slices,
        planes: if fits(slices) { slices } else { 1 },
        wide,
    };
    if rows <= BG_STREAMS {
        return own;
    }
    let wides: &[bool] = if n.is_multiple_of(BG_WIDE) {
        &[true, false]
    } else {
        &[false]
    };
    [1, slices]
        .into_iter()
        .filter(|&planes| fits(planes))
        .flat_map(|planes| {
            wides.iter().map(move |&wide| GemmPlan {
                slices,
                planes,
                wide,
            })
        })
        .find(|plan| plan.blocks(rows, n) >= sms)
        .unwrap_or(GemmPlan { wide: false, ..own })
}

/// Whether our kernel suits a product of `n` columns and depth `k` on a GPU of `sms`
/// multiprocessors, at any number of rows: weights of at most [`BG_MOST_WEIGHT_BYTES`] (bf16),
/// and a 64-row step's plan that gives every multiprocessor a block. Elsewhere cuBLAS was
/// faster (H200, 64 rows: 774M's pass 2.60 ms with ours against 2.19 with cuBLAS; 1558M's QKV
/// and MLP products, 25 stages deep without a fitting cut, take one slice of 75 or 100 tiles).
pub fn batch_gemm_suits((n, k): (usize, usize), sms: usize) -> bool {
    let plan = batch_gemm_plan(BG_STREAMS, n, k, sms, usize::MAX);
    n * k * 2 <= BG_MOST_WEIGHT_BYTES && plan.blocks(BG_STREAMS, n) >= sms
}

/// The largest weights (bytes) of a product our kernel takes: 124M's MLP products (768 x 3072).
pub const BG_MOST_WEIGHT_BYTES: usize = 768 * 3072 * 2;

/// The most K slices, at most `most`, that cut `k` into whole stages of [`Launcher::batch_gemm`].
pub fn gemm_most_parts(k: usize, most: usize) -> usize {
    (1..=most.max(1))
        .rev()
        .find(|p| k.is_multiple_of(p * BG_BK))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (QKV, attention projection, FC, MLP projection) of a model of width `c`: (n, k).
    fn products(c: usize) -> [(usize, usize); 4] {
        [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)]
    }

    #[test]
    fn slices_cut_k_into_whole_stages() {
        assert_eq!(gemm_most_parts(768, MAX_PARTS), 6);
        assert_eq!(gemm_most_parts(3072, MAX_PARTS), 8);
        assert_eq!(gemm_most_parts(1600, MAX_PARTS), 5);
        assert_eq!(gemm_most_parts(1600, 3), 1);
        assert_eq!(gemm_most_parts(64, MAX_PARTS), 1);
        assert_eq!(gemm_most_parts(768, 0), 1);
        for k in (64..=6400).step_by(64) {
            for most in 1..=MAX_PARTS {
                let p = gemm_most_parts(k, most);
                assert!(
                    (1..=most).contains(&p) && k % (p * BG_BK) == 0,
                    "k {k} most {most}"
                );
            }
        }
    }

    #[test]
    fn a_64_row_step_of_124m_fills_an_h200_with_our_products() {
        let (sms, room) = (132, 2 * 256 * 4 * 768);
        let plans: Vec<GemmPlan> = products(768)
            .iter()
            .map(|&(n, k)| batch_gemm_plan(64, n, k, sms, room))
            .collect();
        let want = [(6, true), (6, false), (4, true), (8, false)];
        for (plan, (slices, wide)) in plans.iter().zip(want) {
            assert_eq!(
                *plan,
                GemmPlan {
                    slices,
                    planes: slices,
                    wide
                }
            );
        }
        for (&(n, k), &plan) in products(768).iter().zip(&plans) {
            assert!(batch_gemm_suits((n, k), sms), "{n}x{k}");
            // the planes fit the scratch buffer
            assert!(plan.planes * 64 * n <= room);
        }
    }

    #[test]
    fn every_step_cuts_k_the_same_way() {
        let (sms, room) = (132, 2 * 320 * 4 * 768);
        for (n, k) in products(768) {
            let own = batch_gemm_plan(1, n, k, sms, room);
            for rows in [1, 8, 17, 64, 65, 128, 130, 192, 256, 320] {
                let plan = batch_gemm_plan(rows, n, k, sms, room);
                assert_eq!(plan.slices, own.slices, "{rows} rows, {n}x{k}");
                assert!(plan.planes == 1 || plan.planes == plan.slices);
                assert!(plan.planes * rows * n <= room, "{rows} rows, {n}x{k}");
                assert!(k.is_multiple_of(plan.slices * BG_BK) && n.is_multiple_of(plan.cols()));
                // up to 64 rows a plane per slice; beyond, every SM gets a block
                match rows <= BG_STREAMS {
                    true => assert_eq!(plan, own),
                    false => assert!(
                        plan.blocks(rows, n) >= sms,
                        "{rows} rows, {n}x{k}: {plan:?}"
                    ),
                }
            }
        }
        // 256 rows of QKV: enough 64-column tiles for one folded plane
        let qkv = batch_gemm_plan(256, 3 * 768, 768, sms, room);
        assert_eq!((qkv.slices, qkv.planes, qkv.wide), (6, 1, true));
        // 256 rows of the MLP projection: too few tiles, so a plane per slice
        let proj = batch_gemm_plan(256, 768, 4 * 768, sms, room);
        assert_eq!((proj.slices, proj.planes), (8, 8));
    }

    #[test]
    fn larger_models_and_thin_plans_keep_cublas() {
        let sms = 132;
        // 1558M: K = 1600 has no cut into 2-4 slices, so QKV (75 tiles) and FC (100) take one
        for (n, k) in products(1600) {
            assert!(!batch_gemm_suits((n, k), sms), "{n}x{k}");
        }
        // 355M: only the attention projection's 2 MiB of weights
        let suits: Vec<bool> = products(1024)
            .iter()
            .map(|&(n, k)| batch_gemm_suits((n, k), sms))
            .collect();
        assert_eq!(suits, [false, true, false, false]);
        // a product whose plan has fewer blocks than SMs
        assert!(!batch_gemm_suits((64, 64), sms));
    }

    #[test]
    fn planes_never_outgrow_the_scratch_buffer() {
        for rows in [1, 17, 64, 130, 256] {
            for (n, k) in products(768) {
                let room = 2 * 64 * 4 * 768;
                let plan = batch_gemm_plan(rows, n, k, 132, room);
                assert!(
                    plan.planes == 1 || plan.planes * rows * n <= room,
                    "{rows} rows, {n}x{k}"
                );
            }
        }
    }
}
