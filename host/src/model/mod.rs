//! GPT-2 model description: the hyper-parameters ([`Gpt2Config`]), the weights in f32
//! ([`Gpt2Weights`]) and the loaders that fill them from HF or llm.c checkpoints.
//!
//! Every linear weight is stored `[out, in]` row-major (PyTorch `Linear` and llm.c layout), so a
//! matrix-vector product reads one contiguous row per output. HF's `Conv1D` stores `[in, out]`;
//! the HF loader transposes it once at load time.

mod llmc;
mod random;
mod safetensors_hf;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use llmc::{parse_llmc, write_llmc, LLMC_MAGIC};
pub use random::random_weights;
pub use safetensors_hf::{parse_hf_safetensors, write_hf_checkpoint, StorageDtype};

/// Hyper-parameters of a GPT-2 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpt2Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Context length (`n_positions` in HF configs).
    pub n_ctx: usize,
    pub vocab_size: usize,
}

impl Gpt2Config {
    /// The four published GPT-2 sizes, by their usual names (`124M`, `355M`, `774M`, `1558M`),
    /// or a shape of GPT-2's vocabulary and context written `LAYERSxHEADSxWIDTH` (`2x2x64`:
    /// a model small enough that its forward pass costs next to nothing, for measuring
    /// everything around it). None for anything else.
    pub fn preset(name: &str) -> Option<Self> {
        let (n_layer, n_head, n_embd) = match name {
            "124M" => (12, 12, 768),
            "355M" => (24, 16, 1024),
            "774M" => (36, 20, 1280),
            "1558M" => (48, 25, 1600),
            _ => {
                let mut dims = name.split('x').map(|d| d.parse::<usize>().ok());
                let (Some(Some(l)), Some(Some(h)), Some(Some(c)), None) =
                    (dims.next(), dims.next(), dims.next(), dims.next())
                else {
                    return None;
                };
                let fits =
                    (1..=64).contains(&l) && (1..=64).contains(&h) && (1..=4096).contains(&c);
                if !fits || c % h != 0 {
                    return None;
                }
                (l, h, c)
            }
        };
        Some(Self {
            n_layer,
            n_head,
            n_embd,
            n_ctx: 1024,
            vocab_size: 50257,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Number of parameters (the LM head is tied to `wte` and not counted twice).
    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        let per_layer =
            2 * c + 3 * c * c + 3 * c + c * c + c + 2 * c + 4 * c * c + 4 * c + 4 * c * c + c;
        self.vocab_size * c + self.n_ctx * c + self.n_layer * per_layer + 2 * c
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.n_layer == 0
            || self.n_head == 0
            || self.n_embd == 0
            || self.n_ctx == 0
            || self.vocab_size == 0
        {
            return Err(format!("every dimension must be positive: {self:?}"));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            ));
        }
        // Token ids cross the wasi-nn boundary as i32; and nothing this large is GPT-2.
        let limit = 1 << 24;
        if self.n_embd > limit
            || self.n_ctx > limit
            || self.vocab_size > limit
            || self.n_layer > 4096
        {
            return Err(format!("implausibly large dimensions: {self:?}"));
        }
        Ok(())
    }
}

/// The weights of one transformer block, f32, linear weights `[out, in]`.
#[derive(Clone)]
pub struct LayerWeights {
    pub ln1_w: Vec<f32>,     // [C]
    pub ln1_b: Vec<f32>,     // [C]
    pub qkv_w: Vec<f32>,     // [3C, C]
    pub qkv_b: Vec<f32>,     // [3C]
    pub proj_w: Vec<f32>,    // [C, C]
    pub proj_b: Vec<f32>,    // [C]
    pub ln2_w: Vec<f32>,     // [C]
    pub ln2_b: Vec<f32>,     // [C]
    pub fc_w: Vec<f32>,      // [4C, C]
    pub fc_b: Vec<f32>,      // [4C]
    pub fc_proj_w: Vec<f32>, // [C, 4C]
    pub fc_proj_b: Vec<f32>, // [C]
}

/// All weights of a GPT-2 model in f32. The LM head is tied to `wte`.
#[derive(Clone)]
pub struct Gpt2Weights {
    pub config: Gpt2Config,
    pub wte: Vec<f32>, // [V, C]
    pub wpe: Vec<f32>, // [n_ctx, C]
    pub layers: Vec<LayerWeights>,
    pub lnf_w: Vec<f32>, // [C]
    pub lnf_b: Vec<f32>, // [C]
}

impl Gpt2Weights {
    /// The tensors in a fixed order with their names and shapes; the order of llm.c checkpoints
    /// is built from it, the random initialiser and the GPU upload walk it.
    pub fn layer_tensors(
        layer: &LayerWeights,
        c: usize,
    ) -> [(&'static str, &[f32], Vec<usize>); 12] {
        [
            ("ln_1.weight", &layer.ln1_w, vec![c]),
            ("ln_1.bias", &layer.ln1_b, vec![c]),
            ("attn.c_attn.weight", &layer.qkv_w, vec![3 * c, c]),
            ("attn.c_attn.bias", &layer.qkv_b, vec![3 * c]),
            ("attn.c_proj.weight", &layer.proj_w, vec![c, c]),
            ("attn.c_proj.bias", &layer.proj_b, vec![c]),
            ("ln_2.weight", &layer.ln2_w, vec![c]),
            ("ln_2.bias", &layer.ln2_b, vec![c]),
            ("mlp.c_fc.weight", &layer.fc_w, vec![4 * c, c]),
            ("mlp.c_fc.bias", &layer.fc_b, vec![4 * c]),
            ("mlp.c_proj.weight", &layer.fc_proj_w, vec![c, 4 * c]),
            ("mlp.c_proj.bias", &layer.fc_proj_b, vec![c]),
        ]
    }

    /// The same weights rounded to bf16 and back: what the GPU holds with `--dtype bf16`, so a
    /// CPU reference over them isolates the GPU's own arithmetic from the weight rounding.
    pub fn bf16_rounded(&self) -> Gpt2Weights {
        let mut w = self.clone();
        let layers = w.layers.iter_mut().flat_map(|l| {
            [
                &mut l.ln1_w,
                &mut l.ln1_b,
                &mut l.qkv_w,
                &mut l.qkv_b,
                &mut l.proj_w,
                &mut l.proj_b,
                &mut l.ln2_w,
                &mut l.ln2_b,
                &mut l.fc_w,
                &mut l.fc_b,
                &mut l.fc_proj_w,
                &mut l.fc_proj_b,
            ]
        });
        let globals = [&mut w.wte, &mut w.wpe, &mut w.lnf_w, &mut w.lnf_b];
        for tensor in layers.chain(globals) {
            tensor
                .iter_mut()
                .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        }
        w
    }

    /// Size of the weights in bytes at `bytes_per_param` (the tied head counted once).
    pub fn nbytes(&self, bytes_per_param: usize) -> usize {
        self.config.num_params() * bytes_per_param
    }
}

/// Everything that can go wrong turning bytes into a model. Each error names its source
/// (a file path or "guest buffer") and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{source_name}: {message}")]
    Malformed {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: missing tensor `{tensor}`")]
    MissingTensor { source_name: String, tensor: String },
    #[error("{source_name}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        source_name: String,
        tensor: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "{source_name}: tensor `{tensor}` has dtype {dtype}; only F32, F16 and BF16 are supported"
    )]
    UnsupportedDtype {
        source_name: String,
        tensor: String,
        dtype: String,
    },
    #[error("{source_name}: {size} bytes is over the load limit of {limit} bytes")]
    TooLarge {
        source_name: String,
        size: usize,
        limit: usize,
    },
}

impl LoadError {
    pub(crate) fn malformed(source_name: impl Into<String>, message: impl Into<String>) -> Self {
        LoadError::Malformed {
            source_name: source_name.into(),
            message: message.into(),
        }
    }
}

/// The HF `config.json` fields we read; everything else is ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    // The original GPT-2 configs carry both; newer ones only n_positions.
    #[serde(default)]
    n_positions: Option<usize>,
    #[serde(default)]
    n_ctx: Option<usize>,
    vocab_size: usize,
    #[serde(default)]
    layer_norm_epsilon: Option<f64>,
    #[serde(default)]
    activation_function: Option<String>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    n_inner: Option<usize>,
}

/// Parse an HF GPT-2 `config.json`, refusing settings our forward pass does not implement.
pub fn parse_hf_config(bytes: &[u8], source_name: &str) -> Result<Gpt2Config, LoadError> {
    let hf: HfConfig = serde_json::from_slice(bytes)
        .map_err(|e| LoadError::malformed(source_name, format!("not a GPT-2 config.json: {e}")))?;
    if let Some(t) = &hf.model_type {
        if t != "gpt2" {
            return Err(LoadError::malformed(
                source_name,
                format!("model_type is `{t}`, expected `gpt2`"),
            ));
        }
    }
    if let Some(act) = &hf.activation_function {
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(LoadError::malformed(
                source_name,
                format!("activation_function `{act}` is not supported (GELU tanh form only)"),
            ));
        }
    }
    if let Some(eps) = hf.layer_norm_epsilon {
        if (eps - 1e-5).abs() > 1e-12 {
            return Err(LoadError::malformed(
                source_name,
                format!("layer_norm_epsilon {eps} is not 1e-5"),
            ));
        }
    }
    if hf.tie_word_embeddings == Some(false) {
        return Err(LoadError::malformed(
            source_name,
            "untied LM head is not supported",
        ));
    }
    if let Some(inner) = hf.n_inner {
        if inner != 4 * hf.n_embd {
            return Err(LoadError::malformed(
                source_name,
                format!("n_inner {inner} is not 4 * n_embd"),
            ));
        }
    }
    let config = Gpt2Config {
        n_layer: hf.n_layer,
        n_head: hf.n_head,
        n_embd: hf.n_embd,
        n_ctx: hf.n_positions.or(hf.n_ctx).ok_or_else(|| {
            LoadError::malformed(source_name, "neither n_positions nor n_ctx is given")
        })?,
        vocab_size: hf.vocab_size,
    };
    config
        .validate()
        .map_err(|m| LoadError::malformed(source_name, m))?;
    Ok(config)
}

/// Load a model from a path: an HF folder (`config.json` + `model.safetensors` or a sharded
/// `model.safetensors.index.json`), or an llm.c `.bin` checkpoint. Files are memory-mapped.
pub fn load_path(path: &Path) -> Result<Gpt2Weights, LoadError> {
    if path.is_dir() {
        safetensors_hf::load_hf_dir(path)
    } else {
        let mmap = map_file(path)?;
        let name = path.display().to_string();
        if mmap.len() >= 4 && mmap[..4] == LLMC_MAGIC.to_le_bytes() {
            parse_llmc(&mmap, &name)
        } else {
            Err(LoadError::malformed(
                name,
                "not an llm.c checkpoint (bad magic); for HF checkpoints pass the folder holding config.json",
            ))
        }
    }
}

/// Load a model named on a command line: `random:SIZE` (124M, 355M, 774M, 1558M: the
/// deterministic random weights of that GPT-2 shape, seed 0), else a path as [`load_path`].
pub fn load_spec(spec: &str) -> Result<Gpt2Weights, LoadError> {
    match spec.strip_prefix("random:") {
        Some(size) => {
            let config = Gpt2Config::preset(size).ok_or_else(|| {
                LoadError::malformed(
                    spec,
                    "unknown size; random: takes 124M, 355M, 774M, 1558M or LAYERSxHEADSxWIDTH",
                )
            })?;
            Ok(random_weights(config, 0))
        }
        None => load_path(Path::new(spec)),
    }
}

/// Load a model from in-memory buffers, as a wasi-nn guest passes them to `load`:
/// `[llm.c bytes]` or `[model.safetensors bytes, config.json bytes]`.
pub fn load_buffers(buffers: &[&[u8]]) -> Result<Gpt2Weights, LoadError> {
    const NAME: &str = "guest buffer";
    match buffers {
        [bin] if bin.len() >= 4 && bin[..4] == LLMC_MAGIC.to_le_bytes() => parse_llmc(bin, NAME),
        [st, config] => {
            let config = parse_hf_config(config, "guest buffer 1 (config.json)")?;
            parse_hf_safetensors(&[st], config, "guest buffer 0 (model.safetensors)")
        }
        [_] => Err(LoadError::malformed(
            NAME,
            "one buffer must be an llm.c checkpoint; HF checkpoints need two: model.safetensors and config.json",
        )),
        _ => Err(LoadError::malformed(
            NAME,
            format!("expected 1 or 2 buffers, got {}", buffers.len()),
        )),
    }
}

pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and lives only while we copy out of it; a checkpoint changed
    // under us while loading is outside what we promise (as for every mmap-based loader).
    unsafe { memmap2::Mmap::map(&file) }.map_err(io)
}

/// A progress bar for loads large enough to be worth one (hidden when stderr is not a terminal).
pub(crate) fn progress(total_bytes: usize, label: &str) -> indicatif::ProgressBar {
    if total_bytes < (256 << 20) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total_bytes as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes}")
    {
        bar.set_style(style);
    }
    bar.set_message(label.to_owned());
    bar
}
