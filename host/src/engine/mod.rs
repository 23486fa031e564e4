//! What every device backend shares, and nothing device-specific: where a forward pass runs
//! ([`Device`], [`GpuDtype`]), the engine's error ([`EngineError`]), the two traits a backend
//! implements ([`Executor`]: a model loaded on a device; [`Session`]: one sequence's KV cache
//! on it), the greedy [`argmax`], the sampled draw's specification ([`draw`]), and continuous
//! batching across contexts ([`batch`]).
//!
//! The CPU reference ([`crate::cpu`]) and the CUDA backend ([`crate::cuda`]) depend on this
//! module; it depends on neither. The wasi-nn contract ([`crate::wasi_nn`]) sits on top.

pub mod batch;
pub mod draw;
mod kv_pool;
pub mod processing;

use crate::model::{Gpt2Config, LoadError};

/// Where the forward pass runs. Which GPU [`Device::Cuda`] means is
/// [`EngineOptions::gpu`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

/// A device as the command line names it: `cpu`, `cuda` (the first GPU CUDA makes visible)
/// or `cuda:N`. GPUs are counted among those `CUDA_VISIBLE_DEVICES` leaves visible, as CUDA
/// counts them: with `CUDA_VISIBLE_DEVICES=2,3`, `cuda:1` is the machine's third GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub device: Device,
    /// The GPU's ordinal (0 for the CPU).
    pub gpu: u32,
}

impl DeviceSpec {
    pub const CPU: DeviceSpec = DeviceSpec {
        device: Device::Cpu,
        gpu: 0,
    };
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{text:?}: expected cpu, cuda or cuda:N (N a GPU's ordinal)");
        match text.split_once(':') {
            None if text.eq_ignore_ascii_case("cpu") => Ok(DeviceSpec::CPU),
            None if text.eq_ignore_ascii_case("cuda") => Ok(DeviceSpec {
                device: Device::Cuda,
                gpu: 0,
            }),
            Some((kind, ordinal)) if kind.eq_ignore_ascii_case("cuda") => {
                let gpu = ordinal.parse().map_err(|_| bad())?;
                Ok(DeviceSpec {
                    device: Device::Cuda,
                    gpu,
                })
            }
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.device {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda => write!(f, "cuda:{}", self.gpu),
        }
    }
}

/// Storage type of the weights on the GPU. Activations, the KV cache and logits stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum GpuDtype {
    #[default]
    F32,
    Bf16,
}

impl GpuDtype {
    /// Bytes of one element of the KV cache: f32 with f32 weights, fp16 with bf16 weights.
    pub fn kv_bytes(self) -> usize {
        match self {
            GpuDtype::F32 => 4,
            GpuDtype::Bf16 => 2,
        }
    }

    /// Bytes of one stored weight.
    pub fn bytes(self) -> usize {
        match self {
            GpuDtype::F32 => 4,
            GpuDtype::Bf16 => 2,
        }
    }
}

/// How an executor is set up on its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Storage type of the weights on the GPU (the CPU computes in f32).
    pub dtype: GpuDtype,
    /// Cap on one context's KV cache (GPU).
    pub max_kv_bytes: usize,
    /// Cap on the KV caches of all contexts of one model together (on the GPU each context
    /// counts with its session's other buffers); `None`: the device's default (CPU:
    /// [`Self::DEFAULT_KV_POOL_BYTES`]; GPU: three quarters of the device memory free once
    /// the weights are loaded).
    pub kv_pool_bytes: Option<usize>,
    /// Contexts made ready when the model loads (GPU: their KV caches and buffers allocated
    /// up front, as a server preallocates its KV memory), so the first requests of a burst
    /// don't pay for them.
    pub warm_contexts: usize,
    /// Which GPU [`Device::Cuda`] is: N of `cuda:N` ([`DeviceSpec`]).
    pub gpu: u32,
    /// A lone sequence's decode step as one persistent kernel (sm_90): `Some(true)` or
    /// `Some(false)` to choose; `None`: `WASI_NN_HOST_PERSISTENT_DECODE` if set, else the
    /// graph of per-layer kernels (measured faster today; docs/design/persistent-decode.md).
    pub persistent_decode: Option<bool>,
}

impl EngineOptions {
    /// Each GPU context's KV cache may hold at most this many bytes by default.
    pub const DEFAULT_MAX_KV_BYTES: usize = 2 << 30;
    /// The KV caches of one model's CPU contexts may hold this many bytes together by default.
    pub const DEFAULT_KV_POOL_BYTES: usize = 4 << 30;
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            dtype: GpuDtype::F32,
            max_kv_bytes: Self::DEFAULT_MAX_KV_BYTES,
            kv_pool_bytes: None,
            warm_contexts: 0,
            gpu: 0,
            persistent_decode: None,
        }
    }
}

/// Errors of a forward pass or of setting one up, on any device.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the token sequence is empty")]
    EmptySequence,
    #[error("sequence of {len} tokens exceeds this context's KV capacity of {capacity} positions")]
    OverCapacity { len: usize, capacity: usize },
    #[error("token id {id} is outside the vocabulary (0..{vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The KV caches of this model's contexts together would pass the pool's cap.
    #[error(
        "the KV cache pool is full: this context needs {needed} more bytes, {used} of {cap} are in use"
    )]
    KvPoolFull {
        needed: usize,
        used: usize,
        cap: usize,
    },
    /// The device ran out of memory for `what` (a KV cache, activations, weights).
    #[error("device: {what}: out of GPU memory")]
    OutOfMemory { what: String },
    /// Anything else the device reported (no GPU, no driver, a failed launch, ...).
    #[error("device: {0}")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl EngineError {
    /// A device error from a plain message.
    pub fn device(message: impl Into<String>) -> Self {
        EngineError::Device(message.into().into())
    }
}

/// A model loaded on a device, shared by every execution context of its graph.
pub trait Executor: Send + Sync {
    fn config(&self) -> Gpt2Config;
    fn new_session(&self) -> Result<Box<dyn Session>, EngineError>;
    /// What the executor's batcher has done, if its contexts share batched steps.
    fn batch_counts(&self) -> Option<batch::BatchCounts> {
        None
    }
    /// Bytes of the KV pool its open contexts hold, and the pool's cap, if it has one.
    fn kv_pool(&self) -> Option<(usize, usize)> {
        None
    }
}

/// One sequence's KV cache on a device. Logits stay on the device until asked for, so a
/// greedy step can bring back just the argmax.
pub trait Session: Send + Sync {
    /// Number of cached positions.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget every position from `len` on.
    fn truncate(&mut self, len: usize);
    /// Run `tokens` at the next positions; keep the last position's logits, and every new
    /// position's when `all_positions`.
    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), EngineError>;
    /// Logits of the last position of the last `extend`, `[V]`.
    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError>;
    /// Logits of every position of the last `extend(.., true)`, `[n, V]`.
    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError>;
    /// Index of the largest last-position logit (first index on ties, NaN never wins).
    fn argmax(&mut self) -> Result<u32, EngineError>;
    /// The token `rule` draws from the last position's logits for the next position
    /// ([`draw::draw`]); devices that hold the logits elsewhere draw there.
    fn draw(&mut self, rule: &draw::DrawRule) -> Result<u32, EngineError> {
        let position = self.len();
        Ok(draw::draw(&self.last_logits()?, rule, position))
    }
    /// The draw the guest will ask for after its next `extend` (a rule after a processing's
    /// edits, made for the sequence that extend leaves), or None: a device that batches steps
    /// can make it inside the step, as it makes plain draws. Only a hint: [`Self::draw_edited`]
    /// gives the draw it is asked for either way.
    fn announce_draw(&mut self, _next: Option<std::sync::Arc<processing::EditedRule>>) {}
    /// The token `rule` draws from the last position's logits after a request's processing
    /// changed them (`edits`, [`processing::Edits`]); the logits read afterwards are still the
    /// unprocessed ones. Devices that hold the logits elsewhere process and draw there.
    fn draw_edited(
        &mut self,
        rule: &draw::DrawRule,
        edits: &processing::Edits,
    ) -> Result<u32, EngineError> {
        let position = self.len();
        Ok(edits.draw(self.last_logits()?, rule, position))
    }
}

/// The index of the largest value, first on ties, NaN never chosen (as the GPU kernel); 0
/// when no value is above minus infinity.
///
/// Two passes: the largest value (16 running maxima, which the compiler vectorises; NaN is
/// skipped by `f32::max`), then its first index. Over 50,257 logits 14 us here against 38 us
/// for one pass keeping the index, which took 2.4% of a 16-stream CPU service's time.
pub fn argmax(values: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    let largest = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if largest == f32::NEG_INFINITY {
        return 0;
    }
    values.iter().position(|&v| v == largest).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::{argmax, Device, DeviceSpec};

    #[test]
    fn device_specs_parse_and_print() {
        let cuda = |gpu| DeviceSpec {
            device: Device::Cuda,
            gpu,
        };
        for (text, want, printed) in [
            ("cpu", DeviceSpec::CPU, "cpu"),
            ("CPU", DeviceSpec::CPU, "cpu"),
            ("cuda", cuda(0), "cuda:0"),
            ("cuda:0", cuda(0), "cuda:0"),
            ("cuda:3", cuda(3), "cuda:3"),
        ] {
            let spec: DeviceSpec = text.parse().expect("a device");
            assert_eq!(spec, want, "{text}");
            assert_eq!(spec.to_string(), printed);
            assert_eq!(printed.parse::<DeviceSpec>(), Ok(want));
        }
        for bad in [
            "", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "cuda:1:2", "rocm:0",
        ] {
            let err = bad.parse::<DeviceSpec>().expect_err("not a device");
            assert!(err.contains("cuda:N"), "{bad}: {err}");
        }
    }

    /// Against the plain one-pass loop (first index of the strictly largest, NaN skipped), on
    /// ties, NaNs, infinities and lengths around the lane count.
    #[test]
    fn argmax_is_the_first_largest_and_skips_nan() {
        let plain = |values: &[f32]| {
            let (mut best, mut best_value) = (0, f32::NEG_INFINITY);
            for (i, &v) in values.iter().enumerate() {
                if v > best_value {
                    best = i;
                    best_value = v;
                }
            }
            best as u32
        };
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN],
            vec![f32::NAN, f32::NEG_INFINITY],
            vec![f32::NEG_INFINITY; 40],
            vec![1.0, 3.0, 3.0, 2.0],
            vec![f32::NAN, 0.5, f32::NAN, 0.5],
            vec![-1.0, f32::INFINITY, f32::INFINITY],
        ];
        for n in [1, 15, 16, 17, 33, 50257] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1009) as f32 * 0.25 - 100.0)
                .collect();
            cases.push(v.clone());
            let mut with_nan = v;
            with_nan[n / 2] = f32::NAN;
            cases.push(with_nan);
        }
        for case in &cases {
            assert_eq!(
                argmax(case),
                plain(case),
                "{:?}",
                &case[..case.len().min(8)]
            );
        }
    }
}
