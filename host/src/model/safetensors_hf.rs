//! HF checkpoints: `config.json` plus `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), fp32/fp16/bf16, tensor names with or without the
//! `transformer.` prefix, linear weights in `Conv1D` `[in, out]` layout.

use super::{
    map_file, parse_hf_config, progress, Gpt2Config, Gpt2Weights, LayerWeights, LoadError,
};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Storage type of a written checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StorageDtype {
    F32,
    F16,
    Bf16,
}

pub(super) fn load_hf_dir(dir: &Path) -> Result<Gpt2Weights, LoadError> {
    let config_path = dir.join("config.json");
    let config_bytes = std::fs::read(&config_path).map_err(|source| LoadError::Io {
        path: config_path.clone(),
        source,
    })?;
    let config = parse_hf_config(&config_bytes, &config_path.display().to_string())?;

    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let shard_paths = if single.exists() {
        vec![single]
    } else if index.exists() {
        shards_from_index(&index)?
    } else {
        return Err(LoadError::malformed(
            dir.display().to_string(),
            "no model.safetensors or model.safetensors.index.json in this folder",
        ));
    };
    let maps = shard_paths
        .iter()
        .map(|p| map_file(p))
        .collect::<Result<Vec<_>, _>>()?;
    let buffers: Vec<&[u8]> = maps.iter().map(|m| &m[..]).collect();
    let label = if shard_paths.len() == 1 {
        shard_paths[0].display().to_string()
    } else {
        format!("{} ({} shards)", index.display(), shard_paths.len())
    };
    parse_hf_safetensors(&buffers, config, &label)
}

fn shards_from_index(index: &Path) -> Result<Vec<std::path::PathBuf>, LoadError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let name = index.display().to_string();
    let bytes = std::fs::read(index).map_err(|source| LoadError::Io {
        path: index.to_owned(),
        source,
    })?;
    let parsed: Index = serde_json::from_slice(&bytes)
        .map_err(|e| LoadError::malformed(&name, format!("bad index: {e}")))?;
    let mut files: Vec<String> = parsed.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    let dir = index.parent().unwrap_or(Path::new("."));
    files
        .into_iter()
        .map(|f| {
            // Shard names come from the file; keep them inside the checkpoint folder.
            if f.contains('/') || f.contains('\\') || f == ".." {
                Err(LoadError::malformed(
                    &name,
                    format!("shard name `{f}` is not a plain file name"),
                ))
            } else {
                Ok(dir.join(f))
            }
        })
        .collect()
}

/// Parse one or more safetensors buffers (shards) into f32 weights for `config`.
pub fn parse_hf_safetensors(
    buffers: &[&[u8]],
    config: Gpt2Config,
    source_name: &str,
) -> Result<Gpt2Weights, LoadError> {
    let mut shards = Vec::with_capacity(buffers.len());
    for buffer in buffers {
        let st = SafeTensors::deserialize(buffer).map_err(|e| {
            LoadError::malformed(source_name, format!("not a valid safetensors file: {e}"))
        })?;
        shards.push(st);
    }
    // Map every tensor name, without the optional `transformer.` prefix, to its shard.
    let mut names: HashMap<String, (usize, String)> = HashMap::new();
    for (i, st) in shards.iter().enumerate() {
        for name in st.names() {
            let short = name.strip_prefix("transformer.").unwrap_or(name);
            names.insert(short.to_owned(), (i, name.to_owned()));
        }
    }
    let total: usize = buffers.iter().map(|b| b.len()).sum();
    let bar = progress(total, "loading");
    let c = config.n_embd;
    let get = |short: &str, shape: &[usize]| -> Result<Vec<f32>, LoadError> {
        let (shard, full) = names.get(short).ok_or_else(|| LoadError::MissingTensor {
            source_name: source_name.to_owned(),
            tensor: short.to_owned(),
        })?;
        let view = shards[*shard]
            .tensor(full)
            .map_err(|e| LoadError::malformed(source_name, e.to_string()))?;
        if view.shape() != shape {
            return Err(LoadError::ShapeMismatch {
                source_name: source_name.to_owned(),
                tensor: full.clone(),
                found: view.shape().to_vec(),
                expected: shape.to_vec(),
            });
        }
        bar.inc(view.data().len() as u64);
        to_f32(view.dtype(), view.data()).ok_or_else(|| LoadError::UnsupportedDtype {
            source_name: source_name.to_owned(),
            tensor: full.clone(),
            dtype: format!("{:?}", view.dtype()),
        })
    };
    // Conv1D weights are [in, out]; we keep [out, in].
    let get_conv1d = |short: &str, n_in: usize, n_out: usize| -> Result<Vec<f32>, LoadError> {
        let w = get(short, &[n_in, n_out])?;
        Ok(transpose(&w, n_in, n_out))
    };
    let mut layers = Vec::with_capacity(config.n_layer);
    for l in 0..config.n_layer {
        let p = |s: &str| format!("h.{l}.{s}");
        layers.push(LayerWeights {
            ln1_w: get(&p("ln_1.weight"), &[c])?,
            ln1_b: get(&p("ln_1.bias"), &[c])?,
            qkv_w: get_conv1d(&p("attn.c_attn.weight"), c, 3 * c)?,
            qkv_b: get(&p("attn.c_attn.bias"), &[3 * c])?,
            proj_w: get_conv1d(&p("attn.c_proj.weight"), c, c)?,
            proj_b: get(&p("attn.c_proj.bias"), &[c])?,
            ln2_w: get(&p("ln_2.weight"), &[c])?,
            ln2_b: get(&p("ln_2.bias"), &[c])?,
            fc_w: get_conv1d(&p("mlp.c_fc.weight"), c, 4 * c)?,
            fc_b: get(&p("mlp.c_fc.bias"), &[4 * c])?,
            fc_proj_w: get_conv1d(&p("mlp.c_proj.weight"), 4 * c, c)?,
            fc_proj_b: get(&p("mlp.c_proj.bias"), &[c])?,
        });
    }
    let weights = Gpt2Weights {
        config,
        wte: get("wte.weight", &[config.vocab_size, c])?,
        wpe: get("wpe.weight", &[config.n_ctx, c])?,
        layers,
        lnf_w: get("ln_f.weight", &[c])?,
        lnf_b: get("ln_f.bias", &[c])?,
    };
    bar.finish_and_clear();
    Ok(weights)
}

/// Convert little-endian f32/f16/bf16 bytes to f32; `None` for any other dtype.
fn to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F32 => Some(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::F16 => Some(
            data.chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::BF16 => Some(
            data.chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// `[rows, cols]` -> `[cols, rows]`.
pub(crate) fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; m.len()];
    for r in 0..rows {
        for (c, &v) in m[r * cols..(r + 1) * cols].iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
    out
}

fn encode(values: &[f32], dtype: StorageDtype) -> Vec<u8> {
    match dtype {
        StorageDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        StorageDtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        StorageDtype::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

/// Write `weights` as an HF checkpoint folder: `config.json` and `model.safetensors`
/// (names without prefix, `Conv1D` layout, as `GPT2LMHeadModel.save_pretrained` writes them).
pub fn write_hf_checkpoint(
    weights: &Gpt2Weights,
    dir: &Path,
    dtype: StorageDtype,
) -> Result<(), LoadError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| LoadError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let cfg = weights.config;
    let c = cfg.n_embd;
    let config_json = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": c,
        "n_positions": cfg.n_ctx,
        "n_ctx": cfg.n_ctx,
        "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": match dtype { StorageDtype::F32 => "float32", StorageDtype::F16 => "float16", StorageDtype::Bf16 => "bfloat16" },
    });
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config_json).unwrap_or_default();
    std::fs::write(&config_path, text).map_err(io(&config_path))?;

    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, values: &[f32]| {
        tensors.insert(name, (shape, encode(values, dtype)));
    };
    put("wte.weight".into(), vec![cfg.vocab_size, c], &weights.wte);
    put("wpe.weight".into(), vec![cfg.n_ctx, c], &weights.wpe);
    put("ln_f.weight".into(), vec![c], &weights.lnf_w);
    put("ln_f.bias".into(), vec![c], &weights.lnf_b);
    for (l, layer) in weights.layers.iter().enumerate() {
        for (name, values, shape) in Gpt2Weights::layer_tensors(layer, c) {
            if shape.len() == 2 {
                // back to Conv1D [in, out]
                put(
                    format!("h.{l}.{name}"),
                    vec![shape[1], shape[0]],
                    &transpose(values, shape[0], shape[1]),
                );
            } else {
                put(format!("h.{l}.{name}"), shape, values);
            }
        }
    }
    let st_dtype = match dtype {
        StorageDtype::F32 => Dtype::F32,
        StorageDtype::F16 => Dtype::F16,
        StorageDtype::Bf16 => Dtype::BF16,
    };
    let model_path = dir.join("model.safetensors");
    let views = tensors
        .iter()
        .map(|(name, (shape, data))| {
            safetensors::tensor::TensorView::new(st_dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| LoadError::malformed(model_path.display().to_string(), e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut metadata = HashMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    safetensors::serialize_to_file(views, Some(metadata), &model_path)
        .map_err(|e| LoadError::malformed(model_path.display().to_string(), e.to_string()))
}
