//! `gpt2.wasm`: GPT-2 text generation and scoring over WASI-NN.
//!
//! The module tokenizes the prompt, then for each new token hands the whole sequence to the
//! host's graph (input 0, `I32 [1, T]`), reads the last position's logits (output 0,
//! `F32 [1, vocab]`; a backend that returns `F32 [1, T, vocab]` works too) and samples the next
//! token. The host's backend caches the prefix, so each step costs one position.

use gpt2_guest::generate::{DrawInputs, Forward, Generation, GenerationParams, HostDraw};
use gpt2_guest::processing::Processing;
use gpt2_guest::sampling::SamplingParams;
use gpt2_guest::tokenizer::Gpt2Tokenizer;
use std::io::Write;
use std::sync::OnceLock;
use std::time::Instant;
use wasi_nn::{ExecutionTarget, GraphBuilder, GraphEncoding, GraphExecutionContext, TensorType};

const USAGE: &str = "\
usage: gpt2.wasm [OPTIONS] PROMPT
       gpt2.wasm --perplexity FILE --window W [--max-scored N] [OPTIONS]

options:
  --graph NAME         wasi-nn graph to load by name (default: gpt2); the host chose its device
  --model DIR          load DIR/model.safetensors and DIR/config.json as bytes (wasi-nn `load`)
                       instead; the host must grant DIR (`--dir HOST::DIR`)
  --target cpu|gpu|tpu wasi-nn execution target of --model (default: cpu); it picks the
                       device unless the host's --device overrides it
  --max-tokens N       tokens to generate (default: 100)
  --temperature T      0 = greedy (default: 0)
  --top-k K            keep the K most likely tokens (default: 0 = all)
  --top-p P            nucleus sampling mass (default: 1.0)
  --seed S             sampling seed (default: 0)
  --min-p P            keep tokens at least P times as probable as the top one (default: 0)
  --presence-penalty X subtracted once from the logit of each token generated so far
  --frequency-penalty X  subtracted from a token's logit once per time it was generated
  --repetition-penalty R  HF's: the logits of the prompt's and generated tokens divided by R
                       (multiplied where negative; default: 1 = off)
  --logit-bias ID:B    add B to token ID's logit (repeatable; -100 bans it, 100 forces it)
  --stop TEXT          stop when TEXT appears (repeatable); <|endoftext|> always stops
  --context N          the model's context in tokens (default: what the backend's output 3
                       says; a generation that reaches it ends with `length`)
  --json               print one JSON line with ids, text and timings instead of streaming
  --stream-json        print each piece of text as a JSON line {\"text\": ...} as it is made,
                       then the --json line (for programs that stream to their callers)
  --logits             print the prompt's next-token logits as one JSON line, generate nothing
  --tokenizer FILE     an HF tokenizer.json instead of the embedded GPT-2 vocabulary
  --perplexity FILE    score FILE in windows: feed tokens[i..i+W], score tokens[i+1..i+W+1]
  --window W           window for --perplexity (default: 512)
  --max-scored N       stop after N scored tokens (default: all)
";

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Options {
    graph: String,
    model: Option<String>,
    target: ExecutionTarget,
    max_tokens: usize,
    context: Option<usize>,
    sampling: SamplingParams,
    processing: Processing,
    stops: Vec<String>,
    json: bool,
    stream_json: bool,
    logits: bool,
    tokenizer: Option<String>,
    perplexity: Option<String>,
    window: usize,
    max_scored: Option<usize>,
    prompt: Option<String>,
}

fn parse_args() -> Result<Options, Error> {
    use lexopt::prelude::*;
    let mut o = Options {
        graph: "gpt2".into(),
        model: None,
        target: ExecutionTarget::CPU,
        max_tokens: 100,
        context: None,
        sampling: SamplingParams::default(),
        processing: Processing::default(),
        stops: Vec::new(),
        json: false,
        stream_json: false,
        logits: false,
        tokenizer: None,
        perplexity: None,
        window: 512,
        max_scored: None,
        prompt: None,
    };
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next()? {
        match arg {
            Long("graph") => o.graph = parser.value()?.string()?,
            Long("model") => o.model = Some(parser.value()?.string()?),
            Long("target") => {
                o.target = match parser.value()?.string()?.as_str() {
                    "cpu" => ExecutionTarget::CPU,
                    "gpu" => ExecutionTarget::GPU,
                    "tpu" => ExecutionTarget::TPU,
                    other => {
                        return Err(format!("--target: `{other}` is not cpu, gpu or tpu").into())
                    }
                }
            }
            Long("max-tokens") => o.max_tokens = parser.value()?.parse()?,
            Long("context") => o.context = Some(parser.value()?.parse()?),
            Long("temperature") => o.sampling.temperature = parser.value()?.parse()?,
            Long("top-k") => o.sampling.top_k = parser.value()?.parse()?,
            Long("top-p") => o.sampling.top_p = parser.value()?.parse()?,
            Long("seed") => o.sampling.seed = parser.value()?.parse()?,
            Long("min-p") => o.processing.min_p = parser.value()?.parse()?,
            Long("presence-penalty") => o.processing.presence_penalty = parser.value()?.parse()?,
            Long("frequency-penalty") => {
                o.processing.frequency_penalty = parser.value()?.parse()?
            }
            Long("repetition-penalty") => {
                o.processing.repetition_penalty = parser.value()?.parse()?
            }
            Long("logit-bias") => {
                let value = parser.value()?.string()?;
                let (id, bias) = value
                    .split_once(':')
                    .and_then(|(id, b)| Some((id.parse().ok()?, b.parse().ok()?)))
                    .ok_or_else(|| format!("--logit-bias {value}: expected ID:BIAS"))?;
                o.processing.logit_bias.push((id, bias));
            }
            Long("stop") => o.stops.push(parser.value()?.string()?),
            Long("json") => o.json = true,
            Long("stream-json") => {
                o.stream_json = true;
                o.json = true;
            }
            Long("logits") => o.logits = true,
            Long("tokenizer") => o.tokenizer = Some(parser.value()?.string()?),
            Long("perplexity") => o.perplexity = Some(parser.value()?.string()?),
            Long("window") => o.window = parser.value()?.parse()?,
            Long("max-scored") => o.max_scored = Some(parser.value()?.parse()?),
            Short('h') | Long("help") => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            Value(v) if o.prompt.is_none() => o.prompt = Some(v.string()?),
            _ => return Err(arg.unexpected().into()),
        }
    }
    let t = o.sampling.temperature;
    if !(t.is_finite() && t >= 0.0) {
        return Err(format!("--temperature {t} must be a finite number >= 0").into());
    }
    let p = o.sampling.top_p;
    if !(p > 0.0 && p <= 1.0) {
        return Err(format!("--top-p {p} must be in (0, 1]").into());
    }
    if o.window == 0 {
        return Err("--window must be at least 1".into());
    }
    if o.perplexity.is_none() && o.prompt.is_none() {
        return Err("missing PROMPT (see --help)".into());
    }
    Ok(o)
}

/// The embedded tokenizer, once built: by [`preinitialize`] in a pre-initialised module (the
/// snapshot starts with it), else by the first [`embedded_tokenizer`] call of the run.
static EMBEDDED: OnceLock<Gpt2Tokenizer> = OnceLock::new();

/// The pre-initialisation entry point (`wizer-initialize`, the name wasmtime-wizer calls by
/// default; `wasi-nn-host preinit` runs it and snapshots the module): builds everything that
/// does not depend on the run (the embedded tokenizer and the lazily built tables its first
/// encode needs), so that a run of the snapshot starts with it. It reads no arguments,
/// environment, clock or files: those are read when the snapshot runs, as in the plain module.
/// A failure here leaves [`EMBEDDED`] empty; the run then builds it and reports the error.
#[unsafe(export_name = "wizer-initialize")]
pub extern "C" fn preinitialize() {
    if let Ok(tokenizer) = Gpt2Tokenizer::embedded() {
        // The pre-tokenizer's regex and byte tables are built on first use; an encode (whose
        // result, and the BPE cache entry it leaves, change no output) builds them now.
        let _ = tokenizer.encode("Hello world");
        let _ = EMBEDDED.set(tokenizer);
    }
}

/// The embedded tokenizer: the pre-initialised one, or built now.
fn embedded_tokenizer() -> Result<&'static Gpt2Tokenizer, Error> {
    if let Some(tokenizer) = EMBEDDED.get() {
        return Ok(tokenizer);
    }
    let tokenizer = Gpt2Tokenizer::embedded()?;
    Ok(EMBEDDED.get_or_init(|| tokenizer))
}

fn main() {
    let result = parse_args().and_then(|options| {
        let from_file;
        let tokenizer = match &options.tokenizer {
            Some(path) => {
                let bytes = std::fs::read(path).map_err(|e| format!("--tokenizer {path}: {e}"))?;
                from_file = Gpt2Tokenizer::from_json(&bytes)?;
                &from_file
            }
            None => embedded_tokenizer()?,
        };
        match &options.perplexity {
            Some(path) => perplexity(&options, tokenizer, path),
            None => generate(&options, tokenizer),
        }
    });
    if let Err(e) = result {
        eprintln!("gpt2.wasm: {e}");
        std::process::exit(1);
    }
}

/// A graph's execution context (wasi-nn witx ABI) plus the buffer its logits are read into,
/// and what the backend has shown of itself (so a backend that lacks our extensions costs no
/// second compute and no refused copy per step).
struct Model<'g> {
    context: GraphExecutionContext<'g>,
    vocab: usize,
    buffer: Vec<f32>,
    /// Whether the backend offers output 2 (the greedy next token); cleared on first failure.
    has_argmax: bool,
    /// Whether output 0 holds every position's logits (`[1, T, vocab]`, as backends without
    /// our contract return them) rather than the last position's: learned on the first read
    /// of a sequence longer than one token, then the buffer is sized for it before asking.
    every_position: bool,
    /// Whether the last compute was refused as too large (past the model's context).
    refused: bool,
    /// Whether the backend draws sampled tokens (inputs 2 and 3, output 4; ours does), and
    /// the settings inputs 2 and 3 hold (they stay set until set again).
    has_draw: bool,
    draw_inputs: Option<DrawInputs>,
}

/// The graph: `--model DIR` loaded from bytes for `--target`, else `--graph NAME` by name
/// (`load_by_name` takes no execution target: the host decides where it runs); with the
/// context length its `config.json` gives (`n_positions`), when the guest read one.
fn load_graph(options: &Options) -> Result<(wasi_nn::Graph, Option<usize>), Error> {
    let builder = GraphBuilder::new(GraphEncoding::Autodetec, options.target);
    let Some(dir) = &options.model else {
        return builder
            .build_from_cache(&options.graph)
            .map(|graph| (graph, None))
            .map_err(|e| format!("cannot load graph `{}` by name: {e}", options.graph).into());
    };
    let read = |name: &str| {
        let path = format!("{}/{name}", dir.trim_end_matches('/'));
        std::fs::read(&path).map_err(|e| {
            format!("--model {dir}: {path}: {e} (did the host grant the directory with --dir?)")
        })
    };
    let weights = read("model.safetensors")?;
    let config = read("config.json")?;
    let target = match options.target {
        ExecutionTarget::CPU => "cpu",
        ExecutionTarget::GPU => "gpu",
        ExecutionTarget::TPU => "tpu",
        ExecutionTarget::AUTO => "auto",
    };
    let context = serde_json::from_slice::<serde_json::Value>(&config)
        .ok()
        .and_then(|c| c.get("n_positions").or_else(|| c.get("n_ctx"))?.as_u64())
        .map(|n| n as usize);
    let graph = builder.build_from_bytes([weights, config]).map_err(|e| {
        let hint = match options.target {
            ExecutionTarget::GPU => {
                "; the host may have no usable GPU (CUDA driver) and no --device override; \
                     its log says why"
            }
            ExecutionTarget::CPU => "",
            _ => "; the host may not support this target; its log says why",
        };
        format!("cannot load --model {dir} for execution target {target}: {e}{hint}")
    })?;
    Ok((graph, context))
}

impl<'g> Model<'g> {
    fn new(graph: &'g wasi_nn::Graph, vocab: usize) -> Result<Self, Error> {
        let context = graph
            .init_execution_context()
            .map_err(|e| format!("init_execution_context: {e}"))?;
        Ok(Self {
            context,
            vocab,
            buffer: vec![0.0; vocab],
            has_argmax: true,
            every_position: false,
            refused: false,
            has_draw: true,
            draw_inputs: None,
        })
    }

    /// The context length the backend reports (output 3), if it does.
    fn context_length(&mut self) -> Option<usize> {
        let mut n = [0i32; 1];
        match self.context.get_output(3, &mut n) {
            Ok(4) if n[0] > 0 => Some(n[0] as usize),
            _ => None,
        }
    }

    /// Set input 0; a refusal as too large is remembered ([`Forward::refused_as_too_large`]).
    fn set_tokens(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.refused = false;
        let result = self
            .context
            .set_input(0, TensorType::I32, &[1, tokens.len()], tokens);
        result.map_err(|e| {
            self.refused_with(&e);
            format!("set_input (sequence of {} tokens): {e}", tokens.len())
        })
    }

    /// Inputs 2-7 as `inputs` has them. The processing (4-7) only where it is on or was on
    /// before (a context's start neutral), so a backend without it still draws plain rules.
    fn set_draw_inputs(&mut self, inputs: &DrawInputs) -> Result<(), wasi_nn::Error> {
        let was_processing = (self.draw_inputs.as_ref()).is_some_and(DrawInputs::processes);
        if inputs.processes() || was_processing {
            let c = &mut self.context;
            let n = inputs.bias_ids.len();
            c.set_input(4, TensorType::F32, &[3], inputs.penalties)
                .and_then(|()| c.set_input(5, TensorType::I32, &[1], [inputs.generated_from]))
                .and_then(|()| c.set_input(6, TensorType::I32, &[n], &inputs.bias_ids))
                .and_then(|()| c.set_input(7, TensorType::F32, &[n], &inputs.bias_values))?;
        }
        let sampling = inputs.sampling();
        (self.context)
            .set_input(2, TensorType::F32, &[sampling.len()], sampling)
            .and_then(|()| (self.context).set_input(3, TensorType::I64, &[1], [inputs.seed as i64]))
    }

    fn compute(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.set_tokens(tokens)?;
        let result = self.context.compute();
        result.map_err(|e| {
            self.refused_with(&e);
            format!("compute: {e}")
        })
    }

    fn refused_with(&mut self, e: &wasi_nn::Error) {
        // (the crate does not export its error-code type; its Debug names the code)
        self.refused =
            matches!(e, wasi_nn::Error::BackendError(code) if format!("{code:?}") == "TooLarge");
    }

    /// The last position's logits of the sequence of `len` tokens just computed (output 0).
    fn read_last(&mut self, len: usize) -> Result<&[f32], String> {
        let rows = if self.every_position { len } else { 1 };
        if self.buffer.len() < rows * self.vocab {
            self.buffer.resize(rows * self.vocab, 0.0);
        }
        let bytes = match self
            .context
            .get_output(0, &mut self.buffer[..rows * self.vocab])
        {
            Ok(n) => n,
            // Too small for a backend that returns every position (F32 [1, T, vocab]):
            // retry once with room for all of them.
            Err(first) if len > 1 && !self.every_position => {
                self.buffer.resize(len * self.vocab, 0.0);
                self.context
                    .get_output(0, &mut self.buffer[..len * self.vocab])
                    .map_err(|_| format!("get_output: {first}"))?
            }
            Err(e) => return Err(format!("get_output: {e}")),
        };
        let n = bytes / 4;
        if n < self.vocab {
            return Err(format!(
                "get_output: the backend returned {n} logits; the vocabulary has {}",
                self.vocab
            ));
        }
        if len > 1 && n == len * self.vocab {
            self.every_position = true;
        }
        Ok(&self.buffer[n - self.vocab..n])
    }
}

impl Forward for Model<'_> {
    fn last_logits(&mut self, tokens: &[u32]) -> Result<&[f32], String> {
        self.compute(tokens)?;
        self.read_last(tokens.len())
    }

    /// Output 2 where the backend has it (4 bytes cross instead of the whole logits row);
    /// where it has not, the logits of the same compute.
    fn greedy_next(&mut self, tokens: &[u32]) -> Result<u32, String> {
        self.compute(tokens)?;
        if self.has_argmax {
            let mut next = [0i32; 1];
            match self.context.get_output(2, &mut next) {
                Ok(4) if (0..self.vocab as i32).contains(&next[0]) => return Ok(next[0] as u32),
                _ => self.has_argmax = false,
            }
        }
        Ok(gpt2_guest::sampling::argmax(self.read_last(tokens.len())?) as u32)
    }

    fn refused_as_too_large(&self) -> bool {
        self.refused
    }

    /// Output 4 after inputs 2 (temperature, top-p, min-p) and 3 (seed), and 4-7 (the
    /// processing) where the draw processes. A backend that refuses any of them leaves every
    /// draw to the guest from then on: the inputs it holds are not known then, and inputs
    /// stay set (a run's processing does not change, so its plain draws lose nothing).
    fn sampled_next(&mut self, tokens: &[u32], draw: &HostDraw) -> Result<Option<u32>, String> {
        if !self.has_draw {
            return Ok(None);
        }
        let inputs = draw.inputs();
        if self.draw_inputs.as_ref() != Some(&inputs) {
            if self.set_draw_inputs(&inputs).is_err() {
                self.draw_inputs = None;
                self.has_draw = false;
                return Ok(None);
            }
            self.draw_inputs = Some(inputs);
        }
        self.compute(tokens)?;
        let mut next = [0i32; 1];
        match self.context.get_output(4, &mut next) {
            Ok(4) if (0..self.vocab as i32).contains(&next[0]) => Ok(Some(next[0] as u32)),
            _ => {
                self.has_draw = false;
                Ok(None)
            }
        }
    }

    /// Output 1 after input 1 (`logits_from` = 0): every position from one prefill.
    fn all_logits(&mut self, tokens: &[u32]) -> Result<Option<Vec<f32>>, String> {
        self.set_tokens(tokens)?;
        if self
            .context
            .set_input(1, TensorType::I32, &[1], [0i32])
            .is_err()
        {
            return Ok(None);
        }
        self.context
            .compute()
            .map_err(|e| format!("compute: {e}"))?;
        let mut all = vec![0.0f32; tokens.len() * self.vocab];
        match self.context.get_output(1, &mut all) {
            Ok(bytes) if bytes == all.len() * 4 => Ok(Some(all)),
            _ => Ok(None),
        }
    }
}

fn generate(options: &Options, tokenizer: &Gpt2Tokenizer) -> Result<(), Error> {
    let prompt = options.prompt.as_deref().unwrap_or_default();
    let (graph, config_context) = load_graph(options)?;
    let mut model = Model::new(&graph, tokenizer.vocab_size())?;
    let params = GenerationParams {
        max_tokens: options.max_tokens,
        sampling: options.sampling,
        processing: options.processing.clone(),
        stops: options.stops.clone(),
        // where the generation must end: told, learned from the backend (output 3) or from
        // the model's config.json; failing all three, from the backend's refusal
        context: options
            .context
            .or_else(|| model.context_length())
            .or(config_context),
        ..Default::default()
    };
    let mut generation = Generation::new(tokenizer, prompt, params)?;
    if options.logits {
        let prompt_ids = generation.prompt_ids().to_vec();
        let logits = model.last_logits(&prompt_ids)?;
        println!(
            "{}",
            serde_json::json!({ "prompt_ids": prompt_ids, "logits": logits })
        );
        return Ok(());
    }
    let mut stdout = std::io::stdout();
    let start = Instant::now();
    let mut prompt_ms = None;
    while let Some(piece) = generation.next(&mut model, tokenizer)? {
        prompt_ms.get_or_insert_with(|| start.elapsed().as_secs_f64() * 1e3);
        if piece.is_empty() {
            continue;
        }
        if options.stream_json {
            writeln!(stdout, "{}", serde_json::json!({ "text": piece }))?;
            stdout.flush()?;
        } else if !options.json {
            stdout.write_all(piece.as_bytes())?;
            stdout.flush()?;
        }
    }
    let total_ms = start.elapsed().as_secs_f64() * 1e3;
    let prompt_ms = prompt_ms.unwrap_or(total_ms);
    if options.json {
        let generated = generation.ids().len();
        let decode_tokens = generated.saturating_sub(1);
        let ms_per_token = if decode_tokens > 0 {
            (total_ms - prompt_ms) / decode_tokens as f64
        } else {
            0.0
        };
        let line = serde_json::json!({
            "prompt_ids": generation.prompt_ids(),
            "ids": generation.ids(),
            "text": generation.text(),
            "finish_reason": generation.finish_reason(),
            "timings": {
                "prompt_tokens": generation.prompt_ids().len(),
                "generated_tokens": generated,
                "prompt_ms": prompt_ms,
                "total_ms": total_ms,
                "ms_per_token": ms_per_token,
                "tokens_per_s": if ms_per_token > 0.0 { 1e3 / ms_per_token } else { 0.0 },
                "sampling_ms_per_token": if generated == 0 { 0.0 } else { generation.sampling_seconds * 1e3 / generated as f64 },
            }
        });
        writeln!(stdout, "{line}")?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}

fn perplexity(options: &Options, tokenizer: &Gpt2Tokenizer, path: &str) -> Result<(), Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!("--perplexity {path}: {e} (did the host grant the directory with --dir?)")
    })?;
    let ids = tokenizer.encode(&text)?;
    let (graph, _) = load_graph(options)?;
    let mut model = Model::new(&graph, tokenizer.vocab_size())?;
    let start = Instant::now();
    let score = gpt2_guest::generate::perplexity(
        &mut model,
        &ids,
        tokenizer.vocab_size(),
        options.window,
        options.max_scored,
    )?;
    let line = serde_json::json!({
        "tokens_total": ids.len(),
        "tokens_scored": score.tokens_scored,
        "window": options.window,
        "nll_per_token": score.nll_per_token,
        "perplexity": score.perplexity,
        "ms": start.elapsed().as_secs_f64() * 1e3,
    });
    println!("{line}");
    Ok(())
}
