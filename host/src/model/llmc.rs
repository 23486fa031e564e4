//! llm.c checkpoints (`gpt2_124M.bin`): a header of 256 little-endian i32
//! (`[magic 20240326, version, maxT, V, L, NH, C, padded V, 0...]`), then every parameter
//! tensor in a fixed order, f32 (version 3) or bf16 (version 5). `wte` holds the padded
//! vocabulary; rows past `V` are dropped at load.

use super::{progress, Gpt2Config, Gpt2Weights, LayerWeights, LoadError};

pub const LLMC_MAGIC: i32 = 20240326;
const HEADER_INTS: usize = 256;
const HEADER_BYTES: usize = HEADER_INTS * 4;

/// Parse an llm.c checkpoint from bytes; `source_name` names it in errors.
pub fn parse_llmc(bytes: &[u8], source_name: &str) -> Result<Gpt2Weights, LoadError> {
    let bad = |m: String| LoadError::malformed(source_name, m);
    let Header {
        config,
        padded_vocab,
        bytes_per,
        version,
    } = parse_header(bytes, &bad)?;
    let (c, l) = (config.n_embd, config.n_layer);
    let sizes = param_sizes(&config, padded_vocab);
    let num_params: usize = sizes.iter().sum();
    let expected = HEADER_BYTES + num_params * bytes_per;
    if bytes.len() != expected {
        return Err(bad(format!(
            "{} bytes, but the header ({config:?}, padded vocab {padded_vocab}, version {version}) needs {expected}{}",
            bytes.len(),
            if bytes.len() < expected { ": truncated" } else { ": trailing data" }
        )));
    }
    let bar = progress(bytes.len(), "loading");
    let mut offset = HEADER_BYTES;
    let mut take = |n: usize| -> Vec<f32> {
        let chunk = &bytes[offset..offset + n * bytes_per];
        offset += n * bytes_per;
        bar.inc(chunk.len() as u64);
        if bytes_per == 4 {
            chunk
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        } else {
            chunk
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()
        }
    };
    let mut wte = take(sizes[0]);
    wte.truncate(config.vocab_size * c);
    let wpe = take(sizes[1]);
    // The per-layer tensors are stacked over layers: split each into L pieces.
    let mut stacked: Vec<Vec<f32>> = (2..14).map(|i| take(sizes[i])).collect();
    let lnf_w = take(c);
    let lnf_b = take(c);
    let mut split = |i: usize| -> Vec<Vec<f32>> {
        let all = std::mem::take(&mut stacked[i]);
        let per = all.len() / l;
        all.chunks_exact(per).map(<[f32]>::to_vec).collect()
    };
    let mut parts: Vec<std::vec::IntoIter<Vec<f32>>> =
        (0..12).map(|i| split(i).into_iter()).collect();
    let mut next = |i: usize| parts[i].next().unwrap_or_default();
    let layers = (0..l)
        .map(|_| LayerWeights {
            ln1_w: next(0),
            ln1_b: next(1),
            qkv_w: next(2),
            qkv_b: next(3),
            proj_w: next(4),
            proj_b: next(5),
            ln2_w: next(6),
            ln2_b: next(7),
            fc_w: next(8),
            fc_b: next(9),
            fc_proj_w: next(10),
            fc_proj_b: next(11),
        })
        .collect();
    bar.finish_and_clear();
    Ok(Gpt2Weights {
        config,
        wte,
        wpe,
        layers,
        lnf_w,
        lnf_b,
    })
}

/// What an llm.c header says: the model's shape, the padded vocabulary, the bytes of one
/// parameter (4: fp32, version 3; 2: bf16, version 5) and the version.
struct Header {
    config: Gpt2Config,
    padded_vocab: usize,
    bytes_per: usize,
    version: i32,
}

/// The header of an llm.c checkpoint, checked (`bad` makes the error).
fn parse_header(bytes: &[u8], bad: &impl Fn(String) -> LoadError) -> Result<Header, LoadError> {
    if bytes.len() < HEADER_BYTES {
        return Err(bad(format!(
            "truncated: {} bytes is shorter than the {HEADER_BYTES}-byte llm.c header",
            bytes.len()
        )));
    }
    let header: Vec<i32> = bytes[..HEADER_BYTES]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if header[0] != LLMC_MAGIC {
        return Err(bad(format!(
            "bad magic {} (expected {LLMC_MAGIC})",
            header[0]
        )));
    }
    let bytes_per = match header[1] {
        3 => 4,
        5 => 2,
        v => {
            return Err(bad(format!(
                "unsupported version {v}: 3 (fp32) and 5 (bf16) are supported; \
                 re-export with llm.c's train_gpt2.py if this is an older file"
            )))
        }
    };
    let dim = |i: usize, what: &str| -> Result<usize, LoadError> {
        usize::try_from(header[i])
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| {
                bad(format!(
                    "header field {what} = {} is not positive",
                    header[i]
                ))
            })
    };
    let config = Gpt2Config {
        n_ctx: dim(2, "maxT")?,
        vocab_size: dim(3, "vocab_size")?,
        n_layer: dim(4, "num_layers")?,
        n_head: dim(5, "num_heads")?,
        n_embd: dim(6, "channels")?,
    };
    let padded_vocab = dim(7, "padded_vocab_size")?;
    config.validate().map_err(bad)?;
    if padded_vocab < config.vocab_size || padded_vocab > (1 << 24) {
        return Err(bad(format!(
            "padded vocab {padded_vocab} is smaller than vocab {} (or implausible)",
            config.vocab_size
        )));
    }
    Ok(Header {
        config,
        padded_vocab,
        bytes_per,
        version: header[1],
    })
}

/// Element counts of the 16 tensors in file order.
fn param_sizes(config: &Gpt2Config, padded_vocab: usize) -> [usize; 16] {
    let (c, l) = (config.n_embd, config.n_layer);
    [
        padded_vocab * c,
        config.n_ctx * c,
        l * c,
        l * c,
        l * 3 * c * c,
        l * 3 * c,
        l * c * c,
        l * c,
        l * c,
        l * c,
        l * 4 * c * c,
        l * 4 * c,
        l * 4 * c * c,
        l * c,
        c,
        c,
    ]
}

/// Serialise `weights` as an llm.c checkpoint (version 3 = f32, or 5 = bf16), vocabulary
/// padded to a multiple of 128 as llm.c does.
pub fn write_llmc(weights: &Gpt2Weights, bf16: bool) -> Vec<u8> {
    let cfg = weights.config;
    let c = cfg.n_embd;
    let padded_vocab = cfg.vocab_size.div_ceil(128) * 128;
    let mut header = [0i32; HEADER_INTS];
    header[0] = LLMC_MAGIC;
    header[1] = if bf16 { 5 } else { 3 };
    for (i, v) in [
        cfg.n_ctx,
        cfg.vocab_size,
        cfg.n_layer,
        cfg.n_head,
        c,
        padded_vocab,
    ]
    .into_iter()
    .enumerate()
    {
        header[2 + i] = v as i32;
    }
    let mut out: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut put = |values: &[f32]| {
        for v in values {
            if bf16 {
                out.extend(half::bf16::from_f32(*v).to_le_bytes());
            } else {
                out.extend(v.to_le_bytes());
            }
        }
    };
    put(&weights.wte);
    put(&vec![0.0; (padded_vocab - cfg.vocab_size) * c]);
    put(&weights.wpe);
    for i in 0..12 {
        for layer in &weights.layers {
            put(Gpt2Weights::layer_tensors(layer, c)[i].1);
        }
    }
    put(&weights.lnf_w);
    put(&weights.lnf_b);
    out
}
