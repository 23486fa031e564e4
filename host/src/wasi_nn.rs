//! Our GPT-2 backend behind wasmtime-wasi-nn's traits
//! ([`BackendInner`] -> [`BackendGraph`] -> [`BackendExecutionContext`]).
//!
//! The graph contract (also in the README):
//! - input 0: the whole token sequence so far, `I32 [1, T]` (or `[T]`), `1 <= T <= n_ctx`,
//!   every id in `0..vocab`;
//! - input 1 (optional): `I32 [1]` `logits_from`, the first position whose logits output 1
//!   must hold; through the witx ABI it stays set until set again, through the WIT ABI
//!   (`compute` with named inputs) it applies to the call it is passed with;
//! - output 0: the logits of the last position, `F32 [1, vocab]`;
//! - output 1 (only after input 1 was set): the logits of positions `logits_from..T`,
//!   `F32 [1, T - logits_from, vocab]`, from one batched prefill;
//! - output 2: the greedy next token, `I32 [1]`, the argmax of output 0 computed where the
//!   logits are (on the GPU only 4 bytes come back);
//! - output 3: the model's context length `n_ctx`, `I32 [1]`, at any time (a guest learns
//!   where its generation must end);
//! - input 2 (optional): `F32 [2]` `sampling`, temperature (> 0) and top_p (in (0, 1]), or
//!   `F32 [3]` with min_p (in [0, 1]) after them, and input 3 (optional): `I64 [1]` `seed` (0
//!   until set); kept like input 1;
//! - inputs 4-7 (optional, kept like input 1): the processing of the logits before output
//!   4's draw ([`crate::engine::processing`]): `F32 [3]` `penalties` (presence, frequency,
//!   repetition), `I32 [1]` `generated_from` (the first position whose tokens count as
//!   generated), and the logit bias as `I32 [n]` `bias_ids` with `F32 [n]` `bias_values`;
//! - output 4 (only after input 2 was set): the sampled next token, `I32 [1]`, drawn from
//!   output 0 (processed) where the logits are by the rule of [`crate::engine::draw`] (a seed
//!   and a position always draw the same token).
//!
//! A graph holds the weights once (an [`Executor`], CPU or CUDA); every execution context
//! holds its own KV cache (a [`Session`]); both devices share this contract. `compute` keeps
//! the longest common prefix of the cached sequence and the new one, rewinds the cache to it
//! and runs only the rest as one batch.

use crate::engine::draw::{self, DrawRule};
use crate::engine::processing::{EditedRule, Processing, ProcessingError};
use crate::engine::{Device, EngineOptions, Executor, GpuDtype, Session};
use crate::guest_cycle::{self, GuestClock, Part};
use crate::model::{self, Gpt2Config, LoadError};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use tensor_bytes::{
    f32_values, i32_value, i32_values, le_bytes, penalty_values, sampling_values, seed_value,
};
use wasmtime_wasi_nn::backend::{
    BackendError, BackendExecutionContext, BackendFromDir, BackendGraph, BackendInner, Id,
    NamedTensor,
};
use wasmtime_wasi_nn::wit::{ExecutionTarget, GraphEncoding, TensorType};
use wasmtime_wasi_nn::{ExecutionContext, Graph, GraphRegistry, Tensor};

mod error;
mod tensor_bytes;

pub use error::{backend_error_kind, backend_error_message, ErrorKind, Gpt2Error};

/// The wasi-nn backend: registered for the `autodetect` encoding; loads llm.c bytes or
/// safetensors + config.json bytes from the guest, and HF folders or llm.c files from disk.
///
/// Where a graph runs: the device override (the host's `--device`) when there is one, for
/// every graph. Without it, a guest's `load` picks the device with its execution target
/// (`cpu` -> [`Device::Cpu`], `gpu` -> [`Device::Cuda`], `tpu` -> an error), and graphs the
/// host loads itself ([`Gpt2Backend::load_path`], [`Gpt2Backend::graph_from`],
/// `load_from_dir`; `load_by_name` passes no target) run on the CPU.
#[derive(Clone)]
pub struct Gpt2Backend {
    /// `Some`: every graph runs there, whatever the guest's execution target says.
    device: Option<Device>,
    max_load_bytes: usize,
    options: EngineOptions,
}

impl Gpt2Backend {
    /// Guests may `load` models of at most this many bytes by default.
    pub const DEFAULT_MAX_LOAD_BYTES: usize = 1 << 30;

    /// A backend whose graphs all run on `device`, whatever the guest's execution target
    /// (the host's `--device`).
    pub fn new(device: Device, max_load_bytes: usize) -> Self {
        Self::with_device_override(Some(device), max_load_bytes)
    }

    /// A backend where the guest's execution target picks the device of the graphs it loads
    /// from bytes (host-loaded graphs run on the CPU).
    pub fn auto(max_load_bytes: usize) -> Self {
        Self::with_device_override(None, max_load_bytes)
    }

    /// [`Gpt2Backend::new`] for `Some(device)`, [`Gpt2Backend::auto`] for `None`.
    pub fn with_device_override(device: Option<Device>, max_load_bytes: usize) -> Self {
        Self {
            device,
            max_load_bytes,
            options: EngineOptions::default(),
        }
    }

    /// Store weights on the GPU as `dtype` (the CPU backend always computes in f32).
    pub fn with_dtype(mut self, dtype: GpuDtype) -> Self {
        self.options.dtype = dtype;
        self
    }

    /// Cap each execution context's KV cache (GPU).
    pub fn with_max_kv_bytes(mut self, bytes: usize) -> Self {
        self.options.max_kv_bytes = bytes;
        self
    }

    /// Which GPU `Device::Cuda` is (`cuda:N`).
    pub fn with_gpu(mut self, gpu: u32) -> Self {
        self.options.gpu = gpu;
        self
    }

    /// Contexts made ready per GPU graph when it loads.
    pub fn with_warm_contexts(mut self, n: usize) -> Self {
        self.options.warm_contexts = n;
        self
    }

    /// Cap the KV caches of all contexts of one graph together (`None`: the device's
    /// default).
    pub fn with_kv_pool_bytes(mut self, bytes: Option<usize>) -> Self {
        self.options.kv_pool_bytes = bytes;
        self
    }

    /// The device of graphs loaded without an execution target (host-loaded graphs): the
    /// override if there is one, else the CPU.
    pub fn device(&self) -> Device {
        self.device.unwrap_or(Device::Cpu)
    }

    /// Which GPU `Device::Cuda` is (`cuda:N`).
    pub fn gpu(&self) -> u32 {
        self.options.gpu
    }

    /// The host's device override (`--device`), if any.
    pub fn device_override(&self) -> Option<Device> {
        self.device
    }

    /// The device a graph loaded for the guest's execution target `target` runs on: the
    /// override if there is one, else the target's device (`tpu` is an error).
    pub fn device_for(&self, target: ExecutionTarget) -> Result<Device, Gpt2Error> {
        if let Some(device) = self.device {
            return Ok(device);
        }
        match target {
            ExecutionTarget::Cpu => Ok(Device::Cpu),
            ExecutionTarget::Gpu => Ok(Device::Cuda),
            ExecutionTarget::Tpu => Err(Gpt2Error::UnsupportedTarget("tpu")),
        }
    }

    /// Load a graph from a path (HF folder or llm.c file) onto [`Gpt2Backend::device`].
    pub fn load_path(&self, path: &Path) -> Result<Graph, Gpt2Error> {
        let weights = model::load_path(path)?;
        self.graph_from(weights)
    }

    /// Wrap already-loaded weights as a graph on [`Gpt2Backend::device`].
    pub fn graph_from(&self, weights: model::Gpt2Weights) -> Result<Graph, Gpt2Error> {
        self.graph_on(weights, self.device())
    }

    /// Load weights onto [`Gpt2Backend::device`] as an executor, for
    /// [`GraphSet::insert_executor`] (which keeps it to report its KV pool).
    pub fn executor_from(
        &self,
        weights: model::Gpt2Weights,
    ) -> Result<Arc<dyn Executor>, Gpt2Error> {
        Ok(crate::executor_for(weights, self.device(), &self.options)?)
    }

    /// Load a graph from guest bytes (`[llm.c checkpoint]` or `[model.safetensors,
    /// config.json]`) for the execution target `target` (see [`Gpt2Backend::device_for`]).
    pub fn load_bytes(
        &self,
        builders: &[&[u8]],
        target: ExecutionTarget,
    ) -> Result<Graph, Gpt2Error> {
        let device = self.device_for(target)?;
        let size: usize = builders.iter().map(|b| b.len()).sum();
        if size > self.max_load_bytes {
            return Err(LoadError::TooLarge {
                source_name: "guest buffer".into(),
                size,
                limit: self.max_load_bytes,
            }
            .into());
        }
        let weights = model::load_buffers(builders)?;
        self.graph_on(weights, device).map_err(|e| match e {
            // Say why the GPU was tried: the guest's target chose it.
            Gpt2Error::Engine(e) if self.device.is_none() && device == Device::Cuda => {
                Gpt2Error::TargetDevice(e)
            }
            e => e,
        })
    }

    fn graph_on(&self, weights: model::Gpt2Weights, device: Device) -> Result<Graph, Gpt2Error> {
        let executor = crate::executor_for(weights, device, &self.options)?;
        Ok(graph_of(executor))
    }
}

impl BackendInner for Gpt2Backend {
    fn encoding(&self) -> GraphEncoding {
        GraphEncoding::Autodetect
    }

    fn load(&mut self, builders: &[&[u8]], target: ExecutionTarget) -> Result<Graph, BackendError> {
        Ok(self.load_bytes(builders, target)?)
    }

    fn as_dir_loadable(&mut self) -> Option<&mut dyn BackendFromDir> {
        Some(self)
    }
}

impl BackendFromDir for Gpt2Backend {
    /// A host-side load (e.g. wasmtime's `--graph`): on the override device, else the CPU,
    /// like every graph the host preloads.
    fn load_from_dir(
        &mut self,
        path: &Path,
        _target: ExecutionTarget,
    ) -> Result<Graph, BackendError> {
        Ok(self.load_path(path)?)
    }
}

struct Gpt2Graph {
    executor: Arc<dyn Executor>,
}

impl BackendGraph for Gpt2Graph {
    fn init_execution_context(&self) -> Result<ExecutionContext, BackendError> {
        let context: Box<dyn BackendExecutionContext> =
            Box::new(Gpt2Context::new(self.executor.clone())?);
        Ok(context.into())
    }
}

#[cfg(test)]
mod announced_edits;

/// One execution context: its own KV cache, inputs and last outputs.
pub struct Gpt2Context {
    config: Gpt2Config,
    session: Box<dyn Session>,
    /// The tokens whose keys and values `session` holds.
    cached: Vec<u32>,
    tokens: Option<Vec<u32>>,
    logits_from: Option<usize>,
    /// Whether a compute has run since the inputs last changed the outputs.
    computed: bool,
    /// Output 1's row range: logits of positions `logits_from..T` are rows `skip..` of the
    /// session's all-position logits.
    range_skip: Option<usize>,
    /// Outputs fetched from the session, kept until the next compute.
    last_logits: Option<Vec<f32>>,
    range_logits: Option<Vec<f32>>,
    /// Input 2 (temperature, top_p, min_p, checked) and input 3.
    sampling: Option<(f32, f32, f32)>,
    seed: u64,
    /// Inputs 4-7, the processing before the draw.
    processing: ProcessingInputs,
    /// Output 4 of the last compute, once drawn.
    drawn: Option<u32>,
    /// The draw after a processing the last compute announced to the session (for its
    /// sequence and the inputs then; any input set since clears it).
    announced: Option<Arc<EditedRule>>,
    /// The processing and edits the last compute announced, and the length of its sequence:
    /// the next compute, one drawn token longer under the same processing, makes its edits
    /// from these ([`Processing::edits_after`]) instead of from the whole sequence.
    edits_made: Option<(Processing, usize, Arc<EditedRule>)>,
    /// Positions the last compute took from the cache instead of computing.
    last_reused: usize,
    /// The guest's own time between its calls, for [`guest_cycle`].
    clock: GuestClock,
}

impl Gpt2Context {
    pub fn new(executor: Arc<dyn Executor>) -> Result<Self, Gpt2Error> {
        Ok(Self {
            config: executor.config(),
            session: executor.new_session()?,
            cached: Vec::new(),
            tokens: None,
            logits_from: None,
            computed: false,
            range_skip: None,
            last_logits: None,
            range_logits: None,
            sampling: None,
            seed: 0,
            processing: ProcessingInputs::default(),
            drawn: None,
            announced: None,
            edits_made: None,
            last_reused: 0,
            clock: GuestClock::default(),
        })
    }

    /// Number of positions whose keys and values are cached.
    pub fn cached_len(&self) -> usize {
        self.cached.len()
    }

    /// How many positions the last compute reused from the KV cache.
    pub fn last_reused(&self) -> usize {
        self.last_reused
    }

    /// Set input `index` (0: token ids, 1: logits_from, 2: sampling, 3: seed, 4: penalties,
    /// 5: generated_from, 6: bias_ids, 7: bias_values) from a wasi-nn tensor.
    pub fn set_input_tensor(&mut self, index: u32, tensor: &Tensor) -> Result<(), Gpt2Error> {
        let vocab = self.config.vocab_size;
        self.announced = None;
        match index {
            2 => {
                let (temperature, top_p, min_p) = sampling_values(index, tensor)?;
                DrawRule::new(temperature, top_p, 0)?.with_min_p(min_p)?;
                self.sampling = Some((temperature, top_p, min_p));
                return Ok(());
            }
            3 => {
                self.seed = seed_value(index, tensor)?;
                return Ok(());
            }
            4 => {
                let penalties = penalty_values(index, tensor)?;
                Processing::new(penalties, &[], &[], 0, vocab)?;
                self.processing.penalties = penalties;
                return Ok(());
            }
            6 => {
                let ids = i32_values(index, tensor)?;
                // each id checked now; its pairing with input 7 at the draw
                Processing::new((0.0, 0.0, 1.0), &ids, &vec![0.0; ids.len()], 0, vocab)?;
                self.processing.bias_ids = ids;
                return Ok(());
            }
            7 => {
                self.processing.bias_values = f32_values(index, tensor)?;
                return Ok(());
            }
            1 => {
                let from = i32_value(index, tensor)?;
                let from = usize::try_from(from).map_err(|_| Gpt2Error::LogitsFromOutOfRange {
                    from: i64::from(from),
                    len: 0,
                })?;
                self.logits_from = Some(from);
                return Ok(());
            }
            5 => {
                // past the sequence: refused at the draw, where the sequence is known
                let from = i32_value(index, tensor)?;
                self.processing.generated_from = usize::try_from(from)
                    .map_err(|_| ProcessingError::NegativeGeneratedFrom(from))?;
                return Ok(());
            }
            _ => {}
        }
        let values = i32_values(index, tensor)?;
        match index {
            0 => {
                if values.is_empty() {
                    return Err(Gpt2Error::EmptySequence);
                }
                if values.len() > self.config.n_ctx {
                    return Err(Gpt2Error::TooLong {
                        len: values.len(),
                        n_ctx: self.config.n_ctx,
                    });
                }
                // every id of the sequence is checked at every step: one allocation, and
                // the error made only for a bad id
                let mut tokens = Vec::with_capacity(values.len());
                for (position, &id) in values.iter().enumerate() {
                    match u32::try_from(id).ok().filter(|&t| (t as usize) < vocab) {
                        Some(token) => tokens.push(token),
                        None => {
                            return Err(Gpt2Error::TokenOutOfRange {
                                position,
                                id: i64::from(id),
                                vocab,
                            })
                        }
                    }
                }
                self.tokens = Some(tokens);
            }
            _ => return Err(Gpt2Error::NoSuchInput(index.to_string())),
        }
        Ok(())
    }

    /// Run the forward pass over the current inputs, reusing the cached prefix.
    pub fn run(&mut self) -> Result<(), Gpt2Error> {
        let tokens = self.tokens.as_ref().ok_or(Gpt2Error::NoInput)?;
        let (len, cached_len) = (tokens.len(), self.cached.len());
        // At least the last position is recomputed: its logits are the output.
        let mut keep = common_prefix(&self.cached, tokens).min(len - 1);
        if let Some(from) = self.logits_from {
            if from >= len {
                return Err(Gpt2Error::LogitsFromOutOfRange {
                    from: from as i64,
                    len,
                });
            }
            keep = keep.min(from);
        }
        self.session.truncate(keep);
        self.cached.truncate(keep);
        self.computed = false;
        self.range_skip = None;
        self.last_logits = None;
        self.range_logits = None;
        self.drawn = None;
        let want_range = self.logits_from.is_some();
        // the draw output 4 will be asked for, so that a batching device makes it in the step;
        // the last compute's edits hold for the sequence it computed, all of it kept here
        let made = self.edits_made.take();
        let kept = made.filter(|(_, made_len, _)| *made_len == cached_len && keep == cached_len);
        let announced = self.edited_rule(tokens, kept);
        self.announced = announced.as_ref().map(|(_, edited)| edited.clone());
        self.edits_made = announced.map(|(processing, edited)| (processing, len, edited));
        self.session.announce_draw(self.announced.clone());
        let extended = guest_cycle::timed(Part::Step, || {
            self.session.extend(&tokens[keep..], want_range)
        });
        if let Err(e) = extended {
            // The cache may hold part of the failed step; start over next time.
            self.session.truncate(0);
            self.cached.clear();
            self.edits_made = None;
            return Err(e.into());
        }
        self.cached.extend_from_slice(&tokens[keep..]);
        self.last_reused = keep;
        self.computed = true;
        // Rows computed cover keep..len; output 1 starts at `from >= keep`.
        self.range_skip = self.logits_from.map(|from| from - keep);
        Ok(())
    }

    /// The draw output 4 would make after a processing for the sequence `tokens`, or None: no
    /// sampling set, a plain rule (the device draws it with the step anyway), or inputs that
    /// output 4 will refuse.
    /// `made`: the last compute's processing, sequence length and edits, where `tokens`
    /// begins with that sequence; the edits are made from them where `tokens` is one token
    /// longer under the same processing. Returns the processing too, for the next compute.
    fn edited_rule(
        &self,
        tokens: &[u32],
        made: Option<(Processing, usize, Arc<EditedRule>)>,
    ) -> Option<(Processing, Arc<EditedRule>)> {
        let (temperature, top_p, min_p) = self.sampling?;
        let rule = (DrawRule::new(temperature, top_p, self.seed).ok()?)
            .with_min_p(min_p)
            .ok()?;
        let processing = self.processing.processing(self.config.vocab_size).ok()?;
        if processing.is_neutral() && rule.is_plain() {
            return None;
        }
        let following = made.and_then(|(before, len, before_edits)| {
            let same = before == processing && len + 1 == tokens.len();
            same.then(|| processing.edits_after(&before_edits.edits, tokens))?
        });
        let edits = match following {
            Some(edits) => edits,
            None => processing.edits(tokens).ok()??,
        };
        Some((processing, Arc::new(EditedRule { rule, edits })))
    }

    /// The last position's logits (fetched from the device once per compute).
    pub fn last_logits(&mut self) -> Result<&[f32], Gpt2Error> {
        if !self.computed {
            return Err(Gpt2Error::NotComputed(0));
        }
        if self.last_logits.is_none() {
            let read = guest_cycle::timed(Part::ReadLogits, || self.session.last_logits())?;
            self.last_logits = Some(read);
        }
        Ok(self.last_logits.as_deref().unwrap_or_default())
    }

    /// Output 4: the token the sampling settings draw for the next position (drawn once per
    /// compute), where the logits are: a plain rule (temperature, top-p, seed) as it is, one
    /// with min-p or processing after the processing's
    /// [`Edits`](crate::engine::processing::Edits) (a bias list naming a token
    /// twice: from the logits brought here, processed by [`Processing::apply`] and drawn by
    /// the specification).
    pub fn sampled_token(&mut self) -> Result<u32, Gpt2Error> {
        if !self.computed {
            return Err(Gpt2Error::NotComputed(4));
        }
        let (temperature, top_p, min_p) = self.sampling.ok_or(Gpt2Error::NoDrawRule)?;
        if let Some(id) = self.drawn {
            return Ok(id);
        }
        let rule = DrawRule::new(temperature, top_p, self.seed)?.with_min_p(min_p)?;
        let processing = self.processing.processing(self.config.vocab_size)?;
        let plain = processing.is_neutral() && rule.is_plain();
        let edited = match (plain, &self.announced) {
            (true, _) => None,
            // what compute announced: the same inputs and sequence
            (false, Some(announced)) if announced.rule == rule => Some(announced.clone()),
            (false, _) => {
                (processing.edits(&self.cached)?).map(|edits| Arc::new(EditedRule { rule, edits }))
            }
        };
        let id = match (plain, edited) {
            (true, _) => guest_cycle::timed(Part::Draw, || self.session.draw(&rule))?,
            (false, Some(edited)) => guest_cycle::timed(Part::Draw, || {
                self.session.draw_edited(&edited.rule, &edited.edits)
            })?,
            // a bias named twice: its additions one by one, here
            (false, None) => {
                self.last_logits()?;
                let logits = self.last_logits.as_deref().unwrap_or_default();
                let sequence = &self.cached;
                guest_cycle::timed(Part::Draw, || {
                    let mut processed = Vec::new();
                    processing.apply(logits, sequence, &mut processed)?;
                    Ok::<_, Gpt2Error>(draw::draw(&processed, &rule, sequence.len()))
                })?
            }
        };
        self.drawn = Some(id);
        Ok(id)
    }

    /// Output `index` as a wasi-nn tensor: 0 last logits, 1 range logits, 2 greedy next id,
    /// 3 context length, 4 sampled next id.
    pub fn output_tensor(&mut self, index: u32) -> Result<Tensor, Gpt2Error> {
        let vocab = self.config.vocab_size as u32;
        let f32_tensor =
            |dims: Vec<u32>, values: &[f32]| Tensor::new(dims, TensorType::Fp32, le_bytes(values));
        match index {
            0 => {
                let logits = self.last_logits()?;
                Ok(guest_cycle::timed(Part::Encode, || {
                    f32_tensor(vec![1, vocab], logits)
                }))
            }
            1 => {
                let Some(skip) = self.range_skip else {
                    return Err(if self.logits_from.is_none() {
                        Gpt2Error::NoAllLogits
                    } else {
                        Gpt2Error::NotComputed(1)
                    });
                };
                if self.range_logits.is_none() {
                    let all = self.session.all_logits()?;
                    self.range_logits = Some(all[skip * vocab as usize..].to_vec());
                }
                let values = self.range_logits.as_deref().unwrap_or_default();
                Ok(f32_tensor(
                    vec![1, values.len() as u32 / vocab, vocab],
                    values,
                ))
            }
            2 => {
                if !self.computed {
                    return Err(Gpt2Error::NotComputed(2));
                }
                let id = self.session.argmax()? as i32;
                Ok(Tensor::new(
                    vec![1],
                    TensorType::I32,
                    id.to_le_bytes().to_vec(),
                ))
            }
            3 => Ok(Tensor::new(
                vec![1],
                TensorType::I32,
                (self.config.n_ctx as i32).to_le_bytes().to_vec(),
            )),
            4 => {
                let id = self.sampled_token()? as i32;
                Ok(Tensor::new(
                    vec![1],
                    TensorType::I32,
                    id.to_le_bytes().to_vec(),
                ))
            }
            _ => Err(Gpt2Error::NoSuchOutput(index.to_string())),
        }
    }
}

/// Inputs 4-7 as the guest set them; checked together at the draw.
#[derive(Debug, Clone)]
struct ProcessingInputs {
    penalties: (f32, f32, f32),
    generated_from: usize,
    bias_ids: Vec<i32>,
    bias_values: Vec<f32>,
}

impl Default for ProcessingInputs {
    fn default() -> Self {
        Self {
            penalties: (0.0, 0.0, 1.0),
            generated_from: 0,
            bias_ids: Vec::new(),
            bias_values: Vec::new(),
        }
    }
}

impl ProcessingInputs {
    fn processing(&self, vocab: usize) -> Result<Processing, Gpt2Error> {
        Ok(Processing::new(
            self.penalties,
            &self.bias_ids,
            &self.bias_values,
            self.generated_from,
            vocab,
        )?)
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The WIT `compute` input that asks for the greedy next token instead of the logits.
pub const NEXT_TOKEN_ONLY: &str = "next_token_only";

fn input_index(id: &Id) -> Result<u32, Gpt2Error> {
    match id {
        Id::Index(i) => Ok(*i),
        Id::Name(name) => match name.as_str() {
            "input_ids" | "0" => Ok(0),
            "logits_from" | "1" => Ok(1),
            "sampling" | "2" => Ok(2),
            "seed" | "3" => Ok(3),
            "penalties" | "4" => Ok(4),
            "generated_from" | "5" => Ok(5),
            "bias_ids" | "6" => Ok(6),
            "bias_values" | "7" => Ok(7),
            other => Err(Gpt2Error::NoSuchInput(other.to_owned())),
        },
    }
}

fn output_index(id: &Id) -> Result<u32, Gpt2Error> {
    match id {
        Id::Index(i) => Ok(*i),
        Id::Name(name) => match name.as_str() {
            "logits" | "0" => Ok(0),
            "range_logits" | "1" => Ok(1),
            "next_token" | "2" => Ok(2),
            "context_length" | "3" => Ok(3),
            "sampled_token" | "4" => Ok(4),
            other => Err(Gpt2Error::NoSuchOutput(other.to_owned())),
        },
    }
}

impl BackendExecutionContext for Gpt2Context {
    fn set_input(&mut self, id: Id, tensor: &Tensor) -> Result<(), BackendError> {
        self.guest_call(|c| Ok(c.set_input_tensor(input_index(&id)?, tensor)?))
    }

    fn get_output(&mut self, id: Id) -> Result<Tensor, BackendError> {
        self.guest_call(|c| Ok(c.output_tensor(output_index(&id)?)?))
    }

    fn compute(
        &mut self,
        inputs: Option<Vec<NamedTensor>>,
    ) -> Result<Option<Vec<NamedTensor>>, BackendError> {
        self.guest_call(|c| c.compute_with(inputs))
    }
}

impl Gpt2Context {
    /// `call` as one of the guest's calls: the time since its last call returned is the
    /// guest's own ([`guest_cycle::Part::Guest`]).
    fn guest_call<R>(&mut self, call: impl FnOnce(&mut Self) -> R) -> R {
        self.clock.called();
        let out = call(self);
        self.clock.returned();
        out
    }

    /// `compute` of either ABI: the witx one (no inputs: they were set before, no outputs)
    /// or the WIT one (named inputs and outputs).
    fn compute_with(
        &mut self,
        inputs: Option<Vec<NamedTensor>>,
    ) -> Result<Option<Vec<NamedTensor>>, BackendError> {
        let Some(inputs) = inputs else {
            self.run()?;
            return Ok(None);
        };
        // The WIT ABI passes named inputs and wants named outputs back. With the input
        // `next_token_only` (I32 [1], non-zero), the outputs are the greedy `next_token`
        // (I32 [1]) instead of the last logits: a greedy guest then takes 4 bytes, not V floats;
        // with `sampling` (and `seed`), the drawn `sampled_token` instead.
        // Each call's inputs are its own: `logits_from` applies to the compute it came with
        // (a rejected one does not linger), the token ids are the whole sequence as always.
        self.logits_from = None;
        self.sampling = None;
        self.seed = 0;
        self.processing = ProcessingInputs::default();
        let mut next_token_only = false;
        for (position, input) in inputs.iter().enumerate() {
            if input.name == NEXT_TOKEN_ONLY {
                let values = i32_values(2, &input.tensor)?;
                next_token_only = values.first().is_some_and(|&v| v != 0);
                continue;
            }
            let index = match input_index(&Id::Name(input.name.clone())) {
                Ok(i) => i,
                Err(_) => position as u32,
            };
            self.set_input_tensor(index, &input.tensor)?;
        }
        self.run()?;
        let first = match (self.sampling, next_token_only) {
            (Some(_), _) => ("sampled_token", 4),
            (None, true) => ("next_token", 2),
            (None, false) => ("logits", 0),
        };
        let mut outputs = vec![NamedTensor {
            name: first.0.to_owned(),
            tensor: self.output_tensor(first.1)?,
        }];
        if self.range_skip.is_some() {
            outputs.push(NamedTensor {
                name: "range_logits".to_owned(),
                tensor: self.output_tensor(1)?,
            });
        }
        Ok(Some(outputs))
    }
}

/// An executor as a wasi-nn graph.
fn graph_of(executor: Arc<dyn Executor>) -> Graph {
    let graph: Box<dyn BackendGraph> = Box::new(Gpt2Graph { executor });
    graph.into()
}

/// Named graphs preloaded by the host, shared (weights and all) by every guest instance, and
/// the executors behind those of ours (for their KV pools).
#[derive(Clone, Default)]
pub struct GraphSet {
    graphs: HashMap<String, Graph>,
    executors: HashMap<String, Arc<dyn Executor>>,
}

impl GraphSet {
    pub fn insert(&mut self, name: impl Into<String>, graph: Graph) {
        let name = name.into();
        self.executors.remove(&name);
        self.graphs.insert(name, graph);
    }
    /// `executor` as the graph `name`.
    pub fn insert_executor(&mut self, name: impl Into<String>, executor: Arc<dyn Executor>) {
        let name = name.into();
        self.graphs.insert(name.clone(), graph_of(executor.clone()));
        self.executors.insert(name, executor);
    }
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.graphs.keys().map(String::as_str)
    }
    /// Bytes the open contexts hold in the KV pools of the executors inserted with
    /// [`GraphSet::insert_executor`], and the pools' caps, summed (`None`: no such pool).
    pub fn kv_pool(&self) -> Option<(usize, usize)> {
        self.executors
            .values()
            .filter_map(|e| e.kv_pool())
            .reduce(|(used, cap), (u, c)| (used + u, cap + c))
    }
    /// What the batchers of the executors inserted with [`GraphSet::insert_executor`] have
    /// done, summed (`None`: none batches).
    pub fn batch_counts(&self) -> Option<crate::engine::batch::BatchCounts> {
        self.executors
            .values()
            .filter_map(|e| e.batch_counts())
            .reduce(crate::engine::batch::BatchCounts::with)
    }
}

impl GraphRegistry for GraphSet {
    fn get(&self, name: &str) -> Option<&Graph> {
        self.graphs.get(name)
    }
    fn get_mut(&mut self, name: &str) -> Option<&mut Graph> {
        self.graphs.get_mut(name)
    }
}
