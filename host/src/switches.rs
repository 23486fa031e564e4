//! Every `WASI_NN_HOST_*` environment switch, read once per process ([`get`]), in two groups:
//!
//! - [`Settings`]: what an operator may tune in production (how the GPU's contexts are spread
//!   over batchers, how long a step waits for them, batch invariance, the kernel cache).
//! - [`Measurement`]: parts that can be turned off or resized to measure what they are worth.
//!   The results stay right, except with [`Skip`], which leaves parts of a pass out (only the
//!   time counts). Nothing in production needs them.
//!
//! `docs/tuning.md` lists every switch with its default.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Every switch, read once.
#[derive(Clone, Debug)]
pub struct Switches {
    pub settings: Settings,
    pub measurement: Measurement,
}

/// The switches of this process, read from the environment at the first call.
pub fn get() -> &'static Switches {
    static SWITCHES: OnceLock<Switches> = OnceLock::new();
    SWITCHES.get_or_init(|| {
        Switches::from_env(|name| std::env::var(format!("WASI_NN_HOST_{name}")).ok())
    })
}

/// Production settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Independent batchers ("lanes") the GPU's contexts are spread over, each with its own
    /// batched-step stream, so their passes run side by side (`BATCH_LANES=N`, 1 to 8;
    /// default 2).
    pub batch_lanes: usize,
    /// Contexts a lane takes before a new one goes to the next lane (`LANE_FILL=N`; default
    /// 128): below that many streams all share one lane's steps.
    pub lane_fill: usize,
    /// Most tokens one GPU batched step runs, decodes included (`STEP_TOKENS=N`, 1 to
    /// 1024; None: by the model's width, [`Settings::step_tokens_for`]): prompts share what
    /// the decodes leave, in chunks. A pass holds [`Settings::pass_rows_for`] rows.
    pub step_tokens: Option<usize>,
    /// A batched step waits for the last step's contexts to come back until shortly before the
    /// pass run ahead for them is expected to end on the GPU (by the time a step takes to
    /// launch its pass, and this much more), then runs with the contexts that are back
    /// (`GATHER_MARGIN_US=N`, default 60). `GATHER_MARGIN_US=all` (None) waits for all of
    /// them (up to the pass's time from launch to end, at most 2 ms).
    pub gather_margin: Option<Duration>,
    /// Steps run ahead of a greedy or drawing guest at most (`AHEAD_DEPTH=N`, 1 to
    /// [`MAX_AHEAD_DEPTH`]; default 4): past 1, a context whose guest is not back when the next
    /// pass is launched still gets its next step in it, and each step more lets a guest fall
    /// one more pass behind and keep its row.
    pub ahead_depth: usize,
    /// How long a context waiting for a batched GPU step spins before it parks (`SPIN_US`, 0
    /// by default).
    pub spin: Duration,
    /// Batch-invariant batched steps (`BATCH_INVARIANT`): a context's logits are the same
    /// bits whatever contexts share its steps, and alone (bf16 on sm_80+).
    pub batch_invariant: bool,
    /// Where compiled kernels (CUBIN, or PTX) are cached (`CACHE=DIR`; default
    /// `$XDG_CACHE_HOME/wasi-nn-host` or `~/.cache/wasi-nn-host`).
    pub cache_dir: Option<PathBuf>,
    /// A folder of kernels compiled ahead (`PREBUILT=DIR`, written by `wasi-nn-host
    /// compile-kernels --arch sm_XY --into DIR`; the container image sets it), read before
    /// the cache.
    pub prebuilt_dir: Option<PathBuf>,
    /// How a host thread waits for the GPU (`SYNC=yield|spin|block|auto`; default yield, an
    /// unknown value too).
    pub sync: GpuWait,
}

/// The heuristic's candidates timed for a batched cuBLASLt product's shape by default.
pub const LT_CANDIDATES: usize = 12;

/// Most steps run ahead of a guest that `AHEAD_DEPTH` may ask for: each needs a logits buffer
/// of its own in every session.
pub const MAX_AHEAD_DEPTH: usize = 4;

/// The default step budget of a model 768 wide (124M) and narrower.
const STEP_TOKENS_AT_768: usize = 512;
/// The least default step budget, reached at 1,536 wide and past (1558M's 1,600).
const STEP_TOKENS_LEAST: usize = 256;

impl Settings {
    /// The most tokens one batched step of a model `n_embd` wide runs: `STEP_TOKENS`, else
    /// 512 for 768 wide (124M) and narrower, scaled down with the width (a wider model's
    /// token costs more of a pass) in multiples of 64, to 256 at 1,600 (1558M). Measured at
    /// both ends (H200, 64 sampled streams of ~200-token prompts): at 124M 512 rather than
    /// 256 gave 256 sampled streams 11-14% more tokens/s and 64 the same; at 1558M 256
    /// rather than 512 gave 64 sampled streams 1-4% more tokens/s and their first token ~20%
    /// sooner, 192 the same as 256, 128 and 1,024 less (docs/design/batching.md, "Chunked
    /// prompts").
    /// The widths between are not measured.
    pub fn step_tokens_for(&self, n_embd: usize) -> usize {
        self.step_tokens.unwrap_or_else(|| {
            let scaled = STEP_TOKENS_AT_768 * 768 / n_embd.max(1);
            (scaled.next_multiple_of(64)).clamp(STEP_TOKENS_LEAST, STEP_TOKENS_AT_768)
        })
    }

    /// Most rows one batched pass of a model `n_embd` wide holds (its buffers and its largest
    /// graph): a step's budget and a chunk's rows past it (a step's decodes may run over its
    /// budget, and a chunk takes what the budget leaves), rounded up to the graphs' sizes
    /// (multiples of 32), and at least 320 (256 decodes and a chunk). Past that a step runs
    /// several passes in turn.
    pub fn pass_rows_for(&self, n_embd: usize) -> usize {
        (self.step_tokens_for(n_embd) + 64)
            .next_multiple_of(32)
            .max(320)
    }
}

/// How a host thread waits for the GPU: the CUDA context's scheduling flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuWait {
    /// Spin, yielding the core to other threads between checks (`CU_CTX_SCHED_YIELD`): as
    /// quick to wake as spinning, and the guests and HTTP threads of a busy service get the
    /// core. At 256 greedy streams 4-8% more tokens/s than the driver's choice, one stream
    /// as fast (docs/tuning.md).
    Yield,
    /// Spin on the core (`CU_CTX_SCHED_SPIN`).
    Spin,
    /// Sleep until the GPU's interrupt (`CU_CTX_SCHED_BLOCKING_SYNC`).
    Block,
    /// The driver's choice (`CU_CTX_SCHED_AUTO`: spinning while there are more cores than
    /// contexts).
    Auto,
}

impl GpuWait {
    fn parse(value: Option<&str>) -> Self {
        match value {
            None | Some("yield") => GpuWait::Yield,
            Some("spin") => GpuWait::Spin,
            Some("block") => GpuWait::Block,
            Some("auto") => GpuWait::Auto,
            Some(other) => {
                tracing::warn!("WASI_NN_HOST_SYNC={other}: not yield, spin, block or auto; yield");
                GpuWait::Yield
            }
        }
    }
}

/// Measurement switches: each turns a part off, or resizes it, to see what it is worth.
#[derive(Clone, Debug)]
pub struct Measurement {
    /// Decode, prefill and batched-step CUDA graphs (`NO_GRAPH` turns them off).
    pub graphs: bool,
    /// Programmatic dependent launch on sm_90+ (`NO_PDL`).
    pub pdl: bool,
    /// cuBLAS for prefill products (`NO_CUBLAS`: our tiled kernel).
    pub cublas: bool,
    /// cuBLASLt for bf16 products with fused epilogues (`NO_CUBLASLT`).
    pub cublaslt: bool,
    /// Tensor-core prefill attention in bf16 mode (`NO_TC_ATTENTION`).
    pub tc_attention: bool,
    /// The tiled CUDA-core prefill attention (`NO_TILED_ATTENTION`: one block per row).
    pub tiled_attention: bool,
    /// Tensor-core attention reading the QKV product's bf16 rows (`NO_FRESH_KV`).
    pub fresh_kv: bool,
    /// The fused decode QKV + attention kernel on sm_90+ (`NO_FUSED_ATTENTION`).
    pub fused_attention: bool,
    /// Blocks per head and threads of the fused decode kernel (`DECODE_CLUSTER=8x256`; the
    /// launcher checks the values against the kernel's limits).
    pub decode_cluster: Option<(u32, u32)>,
    /// Blocks that draw one row of a sampled draw, a thread-block cluster on sm_90+
    /// (`DRAW_CLUSTER=ONE,BATCHED`: a lone row's draw and the batched pass's, each 1 to 8;
    /// unset: the GPU's default).
    pub draw_cluster: Option<(u32, u32)>,
    /// Each decode kernel asks L2 for up to this many bytes of the next kernel's weights
    /// while it runs (`L2_PREFETCH=BYTES`, 0 turns it off; default 2 MiB).
    pub l2_prefetch: usize,
    /// Steps run ahead for greedy contexts in batched steps (`NO_RUN_AHEAD` turns it off).
    pub run_ahead: bool,
    /// A step launches its pass run ahead before the pass in flight ends, its tokens fed on
    /// the GPU (`NO_EARLY_LAUNCH` makes it wait for that pass first).
    pub early_launch: bool,
    /// Blocks of the batched attention the GPU runs in one wave, past which a step's rows are
    /// not cut into more spans (`BATCH_WAVE=N`; 0: no limit; default 8 an SM).
    pub batch_wave: Option<usize>,
    /// Our tensor-core kernel for the batched step's bf16 products instead of cuBLAS in
    /// steps of at most this many rows (`BATCH_GEMM=ROWS`, 0 for cuBLAS everywhere; unset:
    /// the GPU's default).
    pub batch_gemm: Option<usize>,
    /// The heuristic's candidates timed for each batched cuBLASLt product shape at start
    /// (`LT_CANDIDATES=N`, 1 to 64; default [`LT_CANDIDATES`]).
    pub lt_candidates: usize,
    /// Bytes of each session's cuBLASLt workspace, which bounds the algorithms (split-K ones
    /// among them) the heuristic offers (`LT_WORKSPACE_MB=N`, 1 to 256; default 4 MiB).
    pub lt_workspace: usize,
    /// The CPU's packed products (the LM head, and small models' layers) instead of `gemm`
    /// (`NO_PACKED` turns them off).
    pub packed: bool,
    /// The batched step's LM head over the rows whose logits are wanted (`NO_LOGIT_ROWS`: over
    /// every row, prompt rows before a prompt's last included).
    pub logit_rows: bool,
    /// The batched step's attention takes a prompt's rows in tiles, their keys read once a
    /// tile (`NO_PROMPT_TILES`: one block a row and head, as a decode row).
    pub prompt_tiles: bool,
    /// The batched step's bf16 attention runs a pass of decodes alone in blocks of half the
    /// warps where those fit one wave and whole blocks do not (`NO_ATTENTION_HALVES`: whole
    /// blocks always).
    pub attention_halves: bool,
    /// The batched step's rows of chunks of long prompts keep their lo halves in cuBLAS's
    /// split products (`SPLIT_PROMPTS`; by default they are multiplied as bf16, as a
    /// prefill's rows are).
    pub split_prompts: bool,
    /// The batched step's cuBLAS products run through cuBLASLt with each shape's algorithm
    /// chosen by timing its candidates before the graphs are captured (`NO_TUNED_GEMM`:
    /// cuBLAS's default algorithm).
    pub tuned_gemm: bool,
    /// A lone sequence's decode step as one persistent kernel on sm_90
    /// (`PERSISTENT_DECODE=1`, or `0` for the graph of per-layer kernels; unset: the graph,
    /// measured faster today, docs/design/persistent-decode.md). `EngineOptions` overrides it.
    pub persistent_decode: Option<bool>,
    /// Bytes of a slot of the persistent kernel's weight ring (`PERSISTENT_SLOT=BYTES`;
    /// raised to the longest weight row where smaller).
    pub persistent_slot: Option<usize>,
    /// The persistent kernel records when each phase starts and ends (`PERSISTENT_TRACE`;
    /// `wasi-nn-bench bench` prints where the step's time went).
    pub persistent_trace: bool,
    /// Compile the `.cu` files of this folder instead of the built-in ones (`KERNELS=DIR`).
    pub kernels_dir: Option<PathBuf>,
    /// The kernels loaded as machine code for the GPU's architecture (`NO_CUBIN`: as PTX,
    /// which the driver compiles at load).
    pub cubin: bool,
    /// wasmtime writes `/tmp/perf-PID.map`, naming the guests' compiled functions for `perf`
    /// (`PERF_MAP`; `bench/host-profile.sh` sets it).
    pub perf_map: bool,
    pub skip: Skip,
}

/// Parts of a forward pass to leave out (`SKIP=attn,qkv,proj,mlp,head` in the decode graph,
/// `gemm,pattn,ln,epi` in a prefill; the batched step honours `gemm`, `attn`, `ln`, `epi`,
/// `head` and `draw`, its sampled draw, whose rows then take their argmax): a profiling aid;
/// the results are then wrong, only the time counts.
#[derive(Clone, Debug, Default)]
pub struct Skip {
    pub attn: bool,
    pub qkv: bool,
    pub proj: bool,
    pub mlp: bool,
    pub head: bool,
    pub gemm: bool,
    pub pattn: bool,
    pub ln: bool,
    pub epi: bool,
    pub draw: bool,
}

impl Skip {
    /// Whether any part of the decode step is left out.
    pub fn decode_any(&self) -> bool {
        self.attn || self.qkv || self.proj || self.mlp || self.head
    }
}

impl Switches {
    /// The switches from `var(NAME)`, the value of `WASI_NN_HOST_NAME` if set.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).is_some();
        let number = |name: &str| var(name).and_then(|v| v.parse::<usize>().ok());
        let decode_cluster = var("DECODE_CLUSTER").and_then(|v| {
            let (n, t) = v.split_once('x')?;
            Some((n.parse::<u32>().ok()?, t.parse::<u32>().ok()?))
        });
        let draw_cluster = var("DRAW_CLUSTER").and_then(|v| {
            let (one, batched) = v.split_once(',')?;
            let blocks = |n: &str| Some(n.parse::<u32>().ok()?.clamp(1, 8));
            Some((blocks(one)?, blocks(batched)?))
        });
        let parts = var("SKIP").unwrap_or_default();
        let has = |part: &str| parts.split(',').any(|s| s == part);
        let cache_dir = var("CACHE").map(PathBuf::from).or_else(|| {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("wasi-nn-host"))
        });
        Self {
            settings: Settings {
                batch_lanes: number("BATCH_LANES").unwrap_or(2).clamp(1, 8),
                lane_fill: number("LANE_FILL").unwrap_or(128).max(1),
                step_tokens: number("STEP_TOKENS").map(|n| n.clamp(1, 1024)),
                gather_margin: match var("GATHER_MARGIN_US") {
                    Some(v) if v == "all" => None,
                    v => Some(Duration::from_micros(
                        v.and_then(|v| v.parse().ok()).unwrap_or(60),
                    )),
                },
                ahead_depth: number("AHEAD_DEPTH")
                    .unwrap_or(MAX_AHEAD_DEPTH)
                    .clamp(1, MAX_AHEAD_DEPTH),
                spin: Duration::from_micros(
                    var("SPIN_US").and_then(|v| v.parse().ok()).unwrap_or(0),
                ),
                batch_invariant: set("BATCH_INVARIANT"),
                cache_dir,
                prebuilt_dir: var("PREBUILT").map(PathBuf::from),
                sync: GpuWait::parse(var("SYNC").as_deref()),
            },
            measurement: Measurement {
                graphs: !set("NO_GRAPH"),
                pdl: !set("NO_PDL"),
                cublas: !set("NO_CUBLAS"),
                cublaslt: !set("NO_CUBLASLT"),
                tc_attention: !set("NO_TC_ATTENTION"),
                tiled_attention: !set("NO_TILED_ATTENTION"),
                fresh_kv: !set("NO_FRESH_KV"),
                fused_attention: !set("NO_FUSED_ATTENTION"),
                decode_cluster,
                draw_cluster,
                l2_prefetch: number("L2_PREFETCH").unwrap_or(2 << 20),
                run_ahead: !set("NO_RUN_AHEAD"),
                early_launch: !set("NO_EARLY_LAUNCH"),
                batch_wave: number("BATCH_WAVE"),
                batch_gemm: number("BATCH_GEMM"),
                lt_candidates: number("LT_CANDIDATES")
                    .unwrap_or(LT_CANDIDATES)
                    .clamp(1, 64),
                lt_workspace: number("LT_WORKSPACE_MB").unwrap_or(4).clamp(1, 256) << 20,
                packed: !set("NO_PACKED"),
                logit_rows: !set("NO_LOGIT_ROWS"),
                prompt_tiles: !set("NO_PROMPT_TILES"),
                attention_halves: !set("NO_ATTENTION_HALVES"),
                split_prompts: set("SPLIT_PROMPTS"),
                tuned_gemm: !set("NO_TUNED_GEMM"),
                persistent_decode: var("PERSISTENT_DECODE").map(|v| v != "0"),
                persistent_slot: number("PERSISTENT_SLOT"),
                persistent_trace: set("PERSISTENT_TRACE"),
                kernels_dir: var("KERNELS").map(PathBuf::from),
                cubin: !set("NO_CUBIN"),
                perf_map: set("PERF_MAP"),
                skip: Skip {
                    attn: has("attn"),
                    qkv: has("qkv"),
                    proj: has("proj"),
                    mlp: has("mlp"),
                    head: has("head"),
                    gemm: has("gemm"),
                    pattn: has("pattn"),
                    ln: has("ln"),
                    epi: has("epi"),
                    draw: has("draw"),
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> Switches {
        Switches::from_env(|name| {
            (vars.iter())
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_without_any_switch() {
        let s = read(&[]);
        assert_eq!(s.settings.batch_lanes, 2);
        assert_eq!(s.settings.lane_fill, 128);
        assert_eq!(s.settings.step_tokens, None);
        assert_eq!(s.settings.gather_margin, Some(Duration::from_micros(60)));
        assert_eq!(s.settings.ahead_depth, MAX_AHEAD_DEPTH);
        assert!(!s.settings.batch_invariant);
        assert_eq!(s.settings.sync, GpuWait::Yield);
        let m = &s.measurement;
        assert!(m.graphs && m.pdl && m.cublas && m.run_ahead && m.early_launch && m.packed);
        assert!(m.logit_rows && m.prompt_tiles && m.attention_halves);
        assert_eq!(m.l2_prefetch, 2 << 20);
        assert_eq!((m.lt_candidates, m.lt_workspace), (LT_CANDIDATES, 4 << 20));
        assert_eq!(
            (m.batch_wave, m.batch_gemm, m.decode_cluster),
            (None, None, None)
        );
        assert_eq!(m.draw_cluster, None);
        assert!(!m.skip.attn && !m.skip.head);
    }

    #[test]
    fn switches_are_parsed_and_clamped() {
        let s = read(&[
            ("BATCH_LANES", "20"),
            ("AHEAD_DEPTH", "0"),
            ("GATHER_MARGIN_US", "all"),
            ("NO_GRAPH", ""),
            ("DECODE_CLUSTER", "8x256"),
            ("DRAW_CLUSTER", "12,0"),
            ("SKIP", "attn,head"),
            ("BATCH_GEMM", "0"),
            ("STEP_TOKENS", "0"),
            ("SYNC", "block"),
            ("LT_CANDIDATES", "100"),
            ("LT_WORKSPACE_MB", "32"),
        ]);
        assert_eq!(s.measurement.lt_candidates, 64);
        assert_eq!(s.measurement.lt_workspace, 32 << 20);
        assert_eq!(s.settings.sync, GpuWait::Block);
        assert_eq!(read(&[("SYNC", "spin")]).settings.sync, GpuWait::Spin);
        assert_eq!(read(&[("SYNC", "auto")]).settings.sync, GpuWait::Auto);
        assert_eq!(read(&[("SYNC", "nap")]).settings.sync, GpuWait::Yield);
        assert_eq!(s.settings.batch_lanes, 8);
        assert_eq!(s.settings.ahead_depth, 1);
        let deep = read(&[("AHEAD_DEPTH", "9")]);
        assert_eq!(deep.settings.ahead_depth, MAX_AHEAD_DEPTH);
        assert_eq!(s.settings.gather_margin, None);
        assert!(!s.measurement.graphs);
        assert_eq!(s.measurement.decode_cluster, Some((8, 256)));
        assert_eq!(s.measurement.draw_cluster, Some((8, 1)));
        assert!(s.measurement.skip.attn && s.measurement.skip.head && !s.measurement.skip.ln);
        assert_eq!(s.measurement.batch_gemm, Some(0));
        assert_eq!(s.settings.step_tokens, Some(1));
        assert_eq!(
            s.settings.step_tokens_for(1600),
            1,
            "a budget set holds for every model"
        );
    }

    #[test]
    fn a_pass_holds_the_budget_and_a_chunk_in_whole_graph_sizes() {
        let rows = |tokens: &str| read(&[("STEP_TOKENS", tokens)]).settings.pass_rows_for(768);
        assert_eq!(read(&[]).settings.pass_rows_for(768), 576);
        assert_eq!(rows("1"), 320);
        assert_eq!(rows("300"), 384);
        assert_eq!(rows("512"), 576);
        assert_eq!(rows("5000"), 1088, "the budget is clamped to 1024 first");
        for tokens in ["1", "256", "300", "777", "1024"] {
            assert_eq!(rows(tokens) % 32, 0);
        }
    }

    #[test]
    fn the_default_budget_shrinks_with_the_models_width() {
        let s = read(&[]).settings;
        // GPT-2's widths: 124M, 355M, 774M, 1558M; and narrower test models
        let budgets: Vec<usize> = [64, 768, 1024, 1280, 1600, 4096]
            .map(|w| s.step_tokens_for(w))
            .to_vec();
        assert_eq!(budgets, [512, 512, 384, 320, 256, 256]);
        assert_eq!(s.pass_rows_for(1600), 320);
    }
}
