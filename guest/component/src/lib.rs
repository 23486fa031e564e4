//! The GPT-2 guest as a component (`wasm32-wasip2`): exports `gpt2:text/generate`, imports
//! `wasi:nn` (WIT), and shares tokenizer, sampling and the generation loop with the wasip1
//! command through the `gpt2-guest` library.

use gpt2_guest::generate::{
    Forward, Generation as TextGeneration, GenerationParams, HostDraw, Prompt,
};
use gpt2_guest::processing::{Processing, TokenLogprob as Logprob};
use gpt2_guest::sampling::SamplingParams;
use gpt2_guest::tokenizer::Gpt2Tokenizer;
use std::cell::RefCell;
use std::sync::OnceLock;

wit_bindgen::generate!({
    world: "gpt2",
    path: "../../wit",
    generate_all,
});

use exports::gpt2::text::generate::{
    Completion, Guest as GenerateGuest, GuestGeneration, Piece, Prompt as WitPrompt, Sampling,
    Score, TokenLogprob, TopLogprob,
};
use wasi::nn::{graph, inference, tensor};

struct Component;
export!(Component);

/// The embedded tokenizer, once built: by `wizer-initialize` in a pre-initialised component
/// (the snapshot starts with it), else by the first [`tokenizer`] call of the instance.
static TOKENIZER: OnceLock<Result<Gpt2Tokenizer, String>> = OnceLock::new();

fn tokenizer() -> Result<&'static Gpt2Tokenizer, String> {
    TOKENIZER
        .get_or_init(|| Gpt2Tokenizer::embedded().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The pre-initialisation entry point (the world's `wizer-initialize`, called once by
/// `wasi-nn-host preinit`): builds the embedded tokenizer and the tables its first encode
/// builds lazily. A failure is not kept, so a run builds the tokenizer again and reports it.
/// The snapshot still exports it (see the host's `preinitialize_component`); there, or after
/// a first request, it does nothing.
impl Guest for Component {
    fn wizer_initialize() {
        if TOKENIZER.get().is_some() {
            return;
        }
        if let Ok(tokenizer) = Gpt2Tokenizer::embedded() {
            let _ = tokenizer.encode("Hello world");
            let _ = TOKENIZER.set(Ok(tokenizer));
        }
    }
}

/// A graph's execution context through the `wasi:nn` WIT interface.
struct WitModel {
    context: inference::GraphExecutionContext,
    _graph: graph::Graph,
    /// The last logits tensor as it came (read in place when 4-aligned), or copied.
    raw: Vec<u8>,
    logits: Vec<f32>,
    /// Whether the backend took `next_token_only` last time (ours does; another runtime may
    /// refuse the input or ignore it, and greedy steps then read the logits).
    next_token_only: bool,
    /// Whether the backend took `sampling` and `seed` and drew `sampled_token` last time.
    draws: bool,
    /// Whether it took the processing with them (`penalties`, `generated_from`, the bias,
    /// min-p): cleared on its first refusal, which leaves plain draws on.
    processes: bool,
}

/// What a `compute` asks for besides the logits.
#[derive(Clone, Copy)]
enum Ask<'a> {
    Logits,
    /// The greedy `next_token` instead of the logits.
    NextToken,
    /// The `sampled_token` this draw makes, instead of the logits.
    Draw(&'a HostDraw<'a>),
}

fn nn_error(what: &str, e: wasi::nn::errors::Error) -> String {
    format!("{what}: {:?}: {}", e.code(), e.data())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

impl WitModel {
    fn load(name: &str) -> Result<Self, String> {
        let graph =
            graph::load_by_name(name).map_err(|e| nn_error(&format!("load graph `{name}`"), e))?;
        let context = graph
            .init_execution_context()
            .map_err(|e| nn_error("init-execution-context", e))?;
        Ok(Self {
            context,
            _graph: graph,
            raw: Vec::new(),
            logits: Vec::new(),
            next_token_only: true,
            draws: true,
            processes: true,
        })
    }

    /// compute() with the token ids (and optionally logits-from); the named outputs.
    fn compute(
        &self,
        tokens: &[u32],
        logits_from: Option<i32>,
    ) -> Result<Vec<(String, tensor::Tensor)>, String> {
        self.compute_with(tokens, logits_from, Ask::Logits)
    }

    /// compute(), asking for what `ask` names.
    fn compute_with(
        &self,
        tokens: &[u32],
        logits_from: Option<i32>,
        ask: Ask<'_>,
    ) -> Result<Vec<(String, tensor::Tensor)>, String> {
        self.compute_asking(tokens, logits_from, ask)
            .map_err(|e| nn_error("compute", e))
    }

    fn compute_asking(
        &self,
        tokens: &[u32],
        logits_from: Option<i32>,
        ask: Ask<'_>,
    ) -> Result<Vec<(String, tensor::Tensor)>, wasi::nn::errors::Error> {
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut inputs = vec![(
            "input_ids".to_string(),
            tensor::Tensor::new(&[1, tokens.len() as u32], tensor::TensorType::I32, &ids),
        )];
        if let Some(from) = logits_from {
            let bytes = from.to_le_bytes();
            inputs.push((
                "logits_from".to_string(),
                tensor::Tensor::new(&[1], tensor::TensorType::I32, &bytes),
            ));
        }
        match ask {
            Ask::Logits => {}
            Ask::NextToken => inputs.push((
                "next_token_only".to_string(),
                tensor::Tensor::new(&[1], tensor::TensorType::I32, &1i32.to_le_bytes()),
            )),
            Ask::Draw(draw) => {
                let values = draw.inputs();
                let tensor =
                    |ty, values: Vec<u8>, n: usize| tensor::Tensor::new(&[n as u32], ty, &values);
                let f32s = |name: &str, values: &[f32]| {
                    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (
                        name.to_string(),
                        tensor(tensor::TensorType::Fp32, bytes, values.len()),
                    )
                };
                let i32s = |name: &str, values: &[i32]| {
                    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (
                        name.to_string(),
                        tensor(tensor::TensorType::I32, bytes, values.len()),
                    )
                };
                inputs.push(f32s("sampling", values.sampling()));
                let seed = values.seed.to_le_bytes().to_vec();
                inputs.push(("seed".to_string(), tensor(tensor::TensorType::I64, seed, 1)));
                if values.processes() {
                    inputs.push(f32s("penalties", &values.penalties));
                    inputs.push(i32s("generated_from", &[values.generated_from]));
                    if !values.bias_ids.is_empty() {
                        inputs.push(i32s("bias_ids", &values.bias_ids));
                        inputs.push(f32s("bias_values", &values.bias_values));
                    }
                }
            }
        }
        self.context.compute(inputs)
    }

    /// The last logits from `outputs` (named `logits`, else the first).
    fn take_logits(&mut self, outputs: &[(String, tensor::Tensor)]) -> Result<&[f32], String> {
        self.raw = output(outputs, "logits")
            .or_else(|| outputs.first().map(|(_, t)| t.data()))
            .ok_or("compute returned no outputs")?;
        // wasm is little-endian: an aligned buffer is the f32s already (no second copy).
        if let Ok(logits) = bytemuck::try_cast_slice::<u8, f32>(&self.raw) {
            return Ok(logits);
        }
        self.logits.clear();
        self.logits.extend(
            self.raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        Ok(&self.logits)
    }
}

fn output(outputs: &[(String, tensor::Tensor)], name: &str) -> Option<Vec<u8>> {
    outputs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.data())
}

impl Forward for WitModel {
    fn last_logits(&mut self, tokens: &[u32]) -> Result<&[f32], String> {
        let outputs = self.compute(tokens, None)?;
        self.take_logits(&outputs)
    }

    fn greedy_next(&mut self, tokens: &[u32]) -> Result<u32, String> {
        if self.next_token_only {
            // a backend that refuses the extra input gets the plain call (the context keeps
            // its cache either way: the same tokens again run nothing new)
            if let Ok(outputs) = self.compute_with(tokens, None, Ask::NextToken) {
                if let Some(id) = output(&outputs, "next_token").and_then(|d| {
                    d.get(..4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }) {
                    return Ok(id);
                }
                // it ignored the input: the logits came back
                self.next_token_only = false;
                return Ok(gpt2_guest::sampling::argmax(self.take_logits(&outputs)?) as u32);
            }
            self.next_token_only = false;
        }
        Ok(gpt2_guest::sampling::argmax(self.last_logits(tokens)?) as u32)
    }

    /// `sampled_token` for `sampling` and `seed` (and the processing, where the draw has
    /// one); a backend that refuses them or returns no such output leaves such draws to the
    /// guest from then on.
    fn sampled_next(&mut self, tokens: &[u32], draw: &HostDraw) -> Result<Option<u32>, String> {
        if !self.draws || (draw.processes && !self.processes) {
            return Ok(None);
        }
        let outputs = match self.compute_asking(tokens, None, Ask::Draw(draw)) {
            Ok(outputs) => outputs,
            // a backend without these inputs refuses them as invalid; anything else (the
            // sequence past the context, a device error) is the step's own failure
            Err(e) if e.code() == wasi::nn::errors::ErrorCode::InvalidArgument => {
                match draw.processes {
                    true => self.processes = false,
                    false => self.draws = false,
                }
                return Ok(None);
            }
            Err(e) => return Err(nn_error("compute", e)),
        };
        let drawn = output(&outputs, "sampled_token").and_then(|d| {
            d.get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        });
        if drawn.is_none() {
            self.draws = false;
        }
        Ok(drawn)
    }

    fn all_logits(&mut self, tokens: &[u32]) -> Result<Option<Vec<f32>>, String> {
        let outputs = self.compute(tokens, Some(0))?;
        Ok(output(&outputs, "range_logits").map(|d| f32s(&d)))
    }
}

/// A generation: its model (loaded on first use) and its state.
struct Generation {
    graph: String,
    state: RefCell<Result<(Option<WitModel>, TextGeneration), String>>,
}

fn generation_params(params: Sampling) -> GenerationParams {
    GenerationParams {
        max_tokens: params.max_tokens as usize,
        sampling: SamplingParams {
            temperature: params.temperature,
            top_k: params.top_k as usize,
            top_p: params.top_p,
            seed: params.seed,
        },
        stops: params.stop,
        stop_ids: params.stop_token_ids,
        processing: Processing {
            logit_bias: params.logit_bias,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            repetition_penalty: params.repetition_penalty,
            min_p: params.min_p,
        },
        logprobs: params.logprobs.map(|n| n as usize),
        echo: params.echo,
        context: (params.context_length > 0).then_some(params.context_length as usize),
    }
}

/// A token's bytes as text.
fn token_text(tokenizer: &gpt2_guest::tokenizer::Gpt2Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tokenizer.token_bytes().get(id)).into_owned()
}

fn wit_logprobs(
    tokenizer: &gpt2_guest::tokenizer::Gpt2Tokenizer,
    entries: &[Logprob],
) -> Vec<TokenLogprob> {
    entries
        .iter()
        .map(|e| TokenLogprob {
            id: e.id,
            token: token_text(tokenizer, e.id),
            logprob: e.logprob,
            top: e
                .top
                .iter()
                .map(|&(id, logprob)| TopLogprob {
                    id,
                    token: token_text(tokenizer, id),
                    logprob,
                })
                .collect(),
        })
        .collect()
}

impl GuestGeneration for Generation {
    fn new(graph: String, prompt: WitPrompt, params: Sampling) -> Self {
        let params = generation_params(params);
        let state = tokenizer()
            .and_then(|t| match &prompt {
                WitPrompt::Text(text) => TextGeneration::new(t, text, params),
                WitPrompt::Ids(ids) => TextGeneration::with_prompt(t, Prompt::Ids(ids), params),
            })
            .map(|g| (None, g));
        Self {
            graph,
            state: RefCell::new(state),
        }
    }

    fn prompt_tokens(&self) -> Result<u32, String> {
        let state = self.state.borrow();
        let (_, generation) = state.as_ref().map_err(|e| e.clone())?;
        Ok(generation.prompt_ids().len() as u32)
    }

    fn next(&self) -> Result<Option<Piece>, String> {
        let tokenizer = tokenizer()?;
        let mut state = self.state.borrow_mut();
        let (model, generation) = state.as_mut().map_err(|e| e.clone())?;
        if model.is_none() {
            *model = Some(WitModel::load(&self.graph)?);
        }
        let model = model.as_mut().ok_or("no model")?;
        let Some(text) = generation.next(model, tokenizer)? else {
            return Ok(None);
        };
        let logprobs = wit_logprobs(tokenizer, &generation.take_fresh_logprobs());
        Ok(Some(Piece { text, logprobs }))
    }

    fn finish(&self) -> Completion {
        let state = self.state.borrow();
        match (state.as_ref(), tokenizer()) {
            (Ok((_, g)), Ok(tokenizer)) => Completion {
                prompt_ids: g.prompt_ids().to_vec(),
                ids: g.ids().to_vec(),
                text: format!("{}{}", g.echo_text(), g.text()),
                finish_reason: g.finish_reason().unwrap_or("length").to_owned(),
                prompt_logprobs: wit_logprobs(tokenizer, g.prompt_logprobs()),
                logprobs: wit_logprobs(tokenizer, g.logprobs()),
            },
            _ => Completion {
                prompt_ids: Vec::new(),
                ids: Vec::new(),
                text: String::new(),
                finish_reason: "error".to_owned(),
                prompt_logprobs: Vec::new(),
                logprobs: Vec::new(),
            },
        }
    }
}

impl GenerateGuest for Component {
    type Generation = Generation;

    fn tokenize(text: String) -> Result<Vec<u32>, String> {
        tokenizer()?.encode(&text).map_err(|e| e.to_string())
    }

    fn detokenize(ids: Vec<u32>) -> Result<String, String> {
        let tokenizer = tokenizer()?;
        let vocab = tokenizer.vocab_size();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(format!(
                "token id {id} at position {i} is outside the vocabulary (0..{vocab})"
            ));
        }
        Ok(String::from_utf8_lossy(&tokenizer.token_bytes().concat(&ids)).into_owned())
    }

    fn perplexity(
        graph: String,
        text: String,
        window: u32,
        max_scored: Option<u32>,
    ) -> Result<Score, String> {
        let tokenizer = tokenizer()?;
        let ids = tokenizer.encode(&text).map_err(|e| e.to_string())?;
        let mut model = WitModel::load(&graph)?;
        let score = gpt2_guest::generate::perplexity(
            &mut model,
            &ids,
            tokenizer.vocab_size(),
            window as usize,
            max_scored.map(|m| m as usize),
        )?;
        Ok(Score {
            tokens_scored: score.tokens_scored as u32,
            nll_per_token: score.nll_per_token,
            perplexity: score.perplexity,
        })
    }
}
