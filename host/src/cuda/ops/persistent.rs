//! `kernels/persistent.cu`: a lone sequence's decode step as one persistent kernel (sm_90):
//! the shape it takes for a model (its ring of weight slots, its scratch), its argument
//! block, and its launch (cooperative: every block resident at once, since they wait for
//! each other at each phase).

use super::{kernel_args, Launcher};
use crate::cuda::buffer::{DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError, DriverContext};
use crate::engine::GpuDtype;
use crate::model::Gpt2Config;
use cudarc::driver::LaunchConfig;

/// Compute warps a block (one loader warp more).
pub const PD_WARPS: u32 = 16;
const PD_THREADS: usize = PD_WARPS as usize * 32;
/// Slots of the ring at most (`PD_MAX_SLOTS` in the kernel).
const MAX_SLOTS: usize = 32;
/// Bytes of a ring slot unless `WASI_NN_HOST_PERSISTENT_SLOT` says otherwise.
const DEFAULT_SLOT: usize = 16 << 10;
/// Position splits of a head's attention at most (the phase's items are at most the blocks;
/// the projection's combine reads one a lane).
pub(crate) const MAX_SPLITS: usize = 16;
const _: () = assert!(MAX_SPLITS <= 32);
/// Pointers a layer's entry in the kernel's table holds (`PdLayer`).
pub const LAYER_POINTERS: usize = 14;

/// How the kernel is laid out for one model, dtype, context capacity and GPU; made only by
/// [`PersistentShape::new`], which keeps what the kernel assumes of it (see `fits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistentShape {
    /// Blocks: one an SM.
    blocks: u32,
    /// Bytes of a weight slot (a multiple of 16, at least the longest weight row).
    slot_bytes: usize,
    slots: usize,
    /// Floats of the staged input vector and the attention's scratch.
    xs_floats: usize,
    /// Splits of a head's positions in the attention phase at most.
    max_splits: usize,
    /// Floats of a block's (row, segment) sums of one product, the most any product takes.
    vals_floats: usize,
    /// Positions the scratch holds scores for (the sessions' KV capacity).
    capacity: usize,
}

impl PersistentShape {
    /// The shape for `cfg` in `dtype` with `capacity` positions on a GPU of `sms` SMs whose
    /// blocks may take `shared_limit` bytes of dynamic shared memory; None where the kernel
    /// does not take the model (then the decode graph of per-layer kernels runs).
    pub fn new(
        cfg: &Gpt2Config,
        dtype: GpuDtype,
        capacity: usize,
        sms: usize,
        shared_limit: usize,
        slot: Option<usize>,
    ) -> Option<Self> {
        let c = cfg.n_embd;
        let heads = cfg.n_head.max(1);
        let hd = c / heads;
        // 16-byte rows and vectors, 8 elements a lane, hd/4 a quarter-warp's share in steps
        // of 8, one float4 a thread in the LayerNorm
        if c == 0
            || !c.is_multiple_of(8)
            || hd * heads != c
            || !hd.is_multiple_of(32)
            || hd > 128
            || c > 4 * PD_THREADS
        {
            return None;
        }
        let longest_row = 4 * c * dtype.bytes();
        let slot_bytes = slot
            .unwrap_or(DEFAULT_SLOT)
            .max(longest_row)
            .next_multiple_of(16);
        if sms == 0 {
            return None;
        }
        let max_splits = (sms / heads).clamp(1, MAX_SPLITS);
        // the FC projection's input; the attention's q, scores and groups' sums
        let xs_floats = (4 * c).max(hd + capacity.next_multiple_of(4) + 4 * PD_THREADS);
        let w = dtype.bytes();
        let products = [
            (3 * c, c),
            (c, c),
            (4 * c, c),
            (c, 4 * c),
            (cfg.vocab_size, c),
        ];
        let vals_floats = (products.iter())
            .map(|&(n, k)| product_values(n, k * w, k, sms, slot_bytes))
            .max()?;
        let ring = shared_limit.checked_sub((xs_floats + vals_floats) * 4)?;
        let slots = (ring / slot_bytes).min(MAX_SLOTS);
        if slots < 2 {
            return None;
        }
        Some(Self {
            blocks: u32::try_from(sms).ok()?,
            slot_bytes,
            slots,
            xs_floats,
            max_splits,
            vals_floats,
            capacity,
        })
    }

    /// Blocks the grid takes (one an SM).
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Threads a block takes: the compute warps and the loader warp.
    pub fn threads(&self) -> u32 {
        PD_THREADS as u32 + 32
    }

    /// What the kernel assumes of its shape for `cfg` in `dtype`, checked again at each
    /// launch: two slots or more, each holding the longest row; scratch for q, the scores of
    /// `capacity` positions and the groups' sums, and for the FC projection's input.
    fn fits(&self, cfg: &Gpt2Config, dtype: GpuDtype) -> bool {
        let c = cfg.n_embd;
        let hd = cfg.head_dim();
        (2..=MAX_SLOTS).contains(&self.slots)
            && self.slot_bytes >= 4 * c * dtype.bytes()
            && self.slot_bytes.is_multiple_of(16)
            && self.xs_floats
                >= (4 * c).max(hd + self.capacity.next_multiple_of(4) + 4 * PD_THREADS)
            && self.blocks > 0
    }

    /// Dynamic shared memory a block takes.
    pub fn shared_bytes(&self) -> usize {
        self.slots * self.slot_bytes + (self.xs_floats + self.vals_floats) * 4
    }

    /// Floats of the attention phase's partial results (`[heads * max_splits * (hd + 2)]`).
    pub fn partial_floats(&self, cfg: &Gpt2Config) -> usize {
        cfg.n_head * self.max_splits * (cfg.head_dim() + 2)
    }
}

/// The (row, segment) sums a block keeps of a product of `n` rows of `k` elements
/// (`row_bytes` each) on `blocks` blocks, the most any block keeps: as `pd_product` and
/// `pd_seg_len` in the kernel split them (a block's rows are the floor or the ceiling of
/// n / blocks).
fn product_values(n: usize, row_bytes: usize, k: usize, blocks: usize, slot_bytes: usize) -> usize {
    let per = (slot_bytes / row_bytes).max(1);
    [n / blocks, n.div_ceil(blocks)]
        .into_iter()
        .map(|rows| {
            let segs = (PD_WARPS as usize / rows.min(per).max(1)).max(1);
            let seg_len = k.div_ceil(segs).next_multiple_of(256);
            rows * k.div_ceil(seg_len)
        })
        .max()
        .unwrap_or(0)
}

/// The argument block, laid out as `PdArgs` in the kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PdArgs {
    layers: u64,
    wte: u64,
    lnf_w: u64,
    lnf_b: u64,
    x: u64,
    q: u64,
    fc: u64,
    partials: u64,
    logits: u64,
    best: u64,
    position: u64,
    counter: u64,
    trace: u64,
    n_layer: i32,
    c: i32,
    n_head: i32,
    vocab: i32,
    slot_bytes: i32,
    slots: i32,
    max_splits: i32,
    xs_floats: i32,
    vals_floats: i32,
}

/// One decode step: the embedding's output in `x`, the position in `position`.
#[derive(Clone, Copy, Debug)]
pub struct PersistentDecode {
    pub shape: PersistentShape,
    /// `[n_layer * LAYER_POINTERS]`: each layer's weights and KV cache (see `PdLayer`).
    pub layers: DevPtr<u64>,
    pub wte: DevPtr<Stored>,
    pub lnf_w: DevPtr<Stored>,
    pub lnf_b: DevPtr<Stored>,
    pub x: DevPtr<f32>,
    pub q: DevPtr<f32>,
    pub fc: DevPtr<f32>,
    pub partials: DevPtr<f32>,
    pub logits: DevPtr<f32>,
    pub argmax_key: DevPtr<u64>,
    pub position: DevPtr<i32>,
    /// The phase counter, zeroed here before the launch.
    pub counter: DevPtr<u32>,
    /// Positions the KV cache holds (the position is below it, as the session keeps it).
    pub capacity: usize,
    /// `[phases * TRACE_SLOTS]`: when phases started and ended (`PERSISTENT_TRACE`, see
    /// [`phase_times`]).
    pub trace: Option<DevPtr<u64>>,
}

/// Phases of a step: five a layer and the LM head.
pub fn phases(cfg: &Gpt2Config) -> usize {
    5 * cfg.n_layer + 1
}

/// Times a trace keeps of each phase (`PD_TRACE`): block 0's start, input staged, products
/// done, end; the last block's end.
pub const TRACE_SLOTS: usize = 5;

/// Where a step's time went, from its trace: for each kind of phase (QKV, attention,
/// projection, FC, FC projection, LM head) the means, in microseconds, of block 0's time
/// staging its input (the attention: its scores), in its products (the attention: the
/// weighted values), in the epilogue, then until the last block was done, then until block 0
/// started the next phase (the wait at the counter); and the whole step's.
#[cfg(any(test, feature = "dev"))]
pub fn phase_times(trace: &[u64]) -> ([[f64; TRACE_SLOTS]; 6], f64) {
    let mut sums = [[0.0; TRACE_SLOTS]; 6];
    let mut counts = [0usize; 6];
    let phases = trace.len() / TRACE_SLOTS;
    let at = |p: usize, what: usize| trace[p * TRACE_SLOTS + what] as f64 / 1e3;
    let last = TRACE_SLOTS - 1;
    for p in 0..phases {
        let kind = if p + 1 == phases { 5 } else { p % 5 };
        let next = if p + 1 < phases {
            at(p + 1, 0)
        } else {
            at(p, last)
        };
        for (what, sum) in sums[kind][..last].iter_mut().enumerate() {
            *sum += at(p, what + 1) - at(p, what);
        }
        sums[kind][last] += next - at(p, last);
        counts[kind] += 1;
    }
    for (sum, n) in sums.iter_mut().zip(counts) {
        for v in sum.iter_mut() {
            *v /= n.max(1) as f64;
        }
    }
    let total = if phases > 0 {
        at(phases - 1, last) - at(0, 0)
    } else {
        0.0
    };
    (sums, total)
}

impl Launcher {
    pub fn persistent_decode(&self, a: PersistentDecode) -> Result<(), CudaError> {
        let cfg = self.config;
        let (c, shape) = (cfg.n_embd, a.shape);
        let func =
            self.kernels.persistent.as_ref().ok_or_else(|| {
                CudaError::unavailable("the persistent decode kernel needs sm_90")
            })?;
        ensure(
            a.layers.len() >= cfg.n_layer * LAYER_POINTERS
                && a.x.len() >= c
                && a.q.len() >= c
                && a.fc.len() >= 4 * c
                && a.partials.len() >= shape.partial_floats(&cfg)
                && a.logits.len() >= cfg.vocab_size
                && a.wte.len() >= cfg.vocab_size * c
                && shape.shared_bytes() <= func.1
                && shape.fits(&cfg, self.dtype)
                && a.capacity <= shape.capacity
                && a.trace
                    .is_none_or(|t| t.len() >= TRACE_SLOTS * phases(&cfg)),
            "persistent decode",
        )?;
        let int = |v: usize| i32::try_from(v).map_err(|_| CudaError::unavailable("shape"));
        let args = PdArgs {
            layers: a.layers.addr(),
            wte: a.wte.addr(),
            lnf_w: a.lnf_w.addr(),
            lnf_b: a.lnf_b.addr(),
            x: a.x.addr(),
            q: a.q.addr(),
            fc: a.fc.addr(),
            partials: a.partials.addr(),
            logits: a.logits.addr(),
            best: a.argmax_key.addr(),
            position: a.position.addr(),
            counter: a.counter.addr(),
            trace: a.trace.map_or(0, DevPtr::addr),
            n_layer: int(cfg.n_layer)?,
            c: int(c)?,
            n_head: int(cfg.n_head)?,
            vocab: int(cfg.vocab_size)?,
            slot_bytes: int(shape.slot_bytes)?,
            slots: int(shape.slots)?,
            max_splits: int(shape.max_splits)?,
            xs_floats: int(shape.xs_floats)?,
            vals_floats: int(shape.vals_floats)?,
        };
        self.gpu.ctx.bind_to_thread().ctx("persistent decode")?;
        // SAFETY: the counter is one u32 of device memory, zeroed on this stream before the
        // kernel that counts on it.
        unsafe {
            cudarc::driver::sys::cuMemsetD32Async(a.counter.addr(), 0, 1, self.stream.cu_stream())
        }
        .result()
        .ctx("persistent decode counter")?;
        let cfg = LaunchConfig {
            grid_dim: (shape.blocks, 1, 1),
            block_dim: (shape.threads(), 1, 1),
            shared_mem_bytes: shape.shared_bytes() as u32,
        };
        // SAFETY: the table holds each layer's weights ([3C, C], [C, C], [4C, C], [C, 4C] with
        // their biases and LayerNorms) and its KV cache ([capacity, C] each, the position below
        // capacity, as the session keeps it); x, q, fc, partials, logits and the key are
        // checked above against what the kernel writes for this shape.
        let mut args = kernel_args![&args];
        unsafe { self.launch_cooperative(&func.0, cfg, &mut args, "persistent decode") }
    }
}

/// Let the kernel take as much dynamic shared memory as the GPU allows a block (`optin_limit`
/// less its static shared memory); returns the bytes it may take.
pub(crate) fn allow_persistent_shared_memory(
    func: &cudarc::driver::CudaFunction,
    optin_limit: usize,
) -> Result<usize, CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    let static_bytes = func
        .get_attribute(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .ctx("persistent decode shared memory")?;
    let limit = optin_limit.saturating_sub(usize::try_from(static_bytes).unwrap_or(usize::MAX));
    func.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        i32::try_from(limit).unwrap_or(i32::MAX),
    )
    .ctx("persistent decode shared memory")?;
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100_SHARED: usize = 227 * 1024 - 2048;

    fn shape(name: &str, dtype: GpuDtype) -> Option<PersistentShape> {
        let cfg = Gpt2Config::preset(name).expect("a preset");
        PersistentShape::new(&cfg, dtype, cfg.n_ctx, 132, H100_SHARED, None)
    }

    #[test]
    fn every_gpt2_size_fits_an_h100_block_in_both_dtypes() {
        for name in ["124M", "355M", "774M", "1558M"] {
            for dtype in [GpuDtype::Bf16, GpuDtype::F32] {
                let s = shape(name, dtype).expect("a shape");
                let cfg = Gpt2Config::preset(name).expect("a preset");
                assert!(s.shared_bytes() <= H100_SHARED, "{name} {dtype:?}: {s:?}");
                assert!(
                    s.slot_bytes >= 4 * cfg.n_embd * dtype.bytes()
                        && s.slot_bytes.is_multiple_of(16)
                );
                assert!(s.slots >= 2 && s.slots <= MAX_SLOTS);
                // the attention's scratch: q, the scores of a whole context, the groups' sums
                assert!(s.xs_floats >= cfg.head_dim() + cfg.n_ctx + 4 * PD_THREADS);
                assert!(cfg.n_head * s.max_splits <= 132);
            }
        }
    }

    #[test]
    fn the_sums_of_a_product_cover_every_row_and_segment() {
        // 124M's FC projection on 132 blocks: 5 or 6 rows of 3072 (6144 bytes), 2 a 16 KiB
        // slot: 16 / 2 = 8 segments of 384, rounded to 512: 6 segments
        assert_eq!(product_values(768, 6144, 3072, 132, 16 << 10), 6 * 6);
        // the LM head: 381 rows, one segment each
        assert_eq!(product_values(50257, 1536, 768, 132, 16 << 10), 381);
        // fewer rows than warps: 2 rows of 768 take 8 segments, rounded to 256: 3
        assert_eq!(product_values(4, 1536, 768, 2, 16 << 10), 2 * 3);
    }

    #[test]
    fn phase_times_split_each_phase_into_its_parts() {
        // two layers and the head: 11 phases of 10 us each; block 0 staged after 1, done with
        // its products after 4, finished after 6, the last block after 8, the next phase
        // starting 2 later
        let trace: Vec<u64> = (0..11u64)
            .flat_map(|p| [0, 1_000, 4_000, 6_000, 8_000].map(|t| p * 10_000 + t))
            .collect();
        let (kinds, total) = phase_times(&trace);
        for (kind, times) in kinds.iter().enumerate() {
            let wait = if kind == 5 { 0.0 } else { 2.0 };
            assert_eq!(*times, [1.0, 3.0, 2.0, 2.0, wait], "kind {kind}");
        }
        assert_eq!(total, 108.0);
    }

    #[test]
    fn product_values_cover_every_block_of_many_shapes() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m as u64) as usize
        };
        for _ in 0..2000 {
            let n = 1 + next(60_000);
            let k = 8 * (1 + next(800));
            let w = [2, 4][next(2)];
            let blocks = 1 + next(200);
            let slot = (k * w).max(16 << next(3) << 10).next_multiple_of(16);
            let per = (slot / (k * w)).max(1);
            let most = (0..blocks)
                .map(|b| {
                    let rows = (b + 1) * n / blocks - b * n / blocks;
                    let segs = (PD_WARPS as usize / rows.min(per).max(1)).max(1);
                    let seg_len = k.div_ceil(segs).next_multiple_of(256);
                    rows * k.div_ceil(seg_len)
                })
                .max()
                .unwrap_or(0);
            assert_eq!(
                product_values(n, k * w, k, blocks, slot),
                most,
                "n {n} k {k} blocks {blocks}"
            );
        }
    }

    #[test]
    fn a_slot_holds_the_longest_row_whatever_was_asked() {
        let cfg = Gpt2Config::preset("1558M").expect("a preset");
        let s = PersistentShape::new(&cfg, GpuDtype::F32, 1024, 132, H100_SHARED, Some(1000))
            .expect("a shape");
        assert_eq!(s.slot_bytes, 4 * 1600 * 4);
    }

    #[test]
    fn shapes_the_kernel_cannot_take_fall_back() {
        let odd = Gpt2Config {
            n_layer: 2,
            n_head: 3,
            n_embd: 60,
            n_ctx: 64,
            vocab_size: 100,
        };
        assert_eq!(
            PersistentShape::new(&odd, GpuDtype::Bf16, 64, 132, H100_SHARED, None),
            None
        );
        let cfg = Gpt2Config::preset("124M").expect("a preset");
        // too little shared memory for two slots
        assert_eq!(
            PersistentShape::new(&cfg, GpuDtype::Bf16, 1024, 132, 20 * 1024, None),
            None
        );
        assert_eq!(
            PersistentShape::new(&cfg, GpuDtype::Bf16, 1024, 0, H100_SHARED, None),
            None
        );
    }
}
