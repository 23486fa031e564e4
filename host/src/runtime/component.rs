//! Running the guest as a component (`wasm32-wasip2`, world `gpt2:text/gpt2` in `wit/`):
//! WASI preview 2 plus `wasi:nn` (WIT, our own binding: [`super::wit_nn`]), over the same backend and
//! the same preloaded graphs as the preview-1 path. [`Host::load_component`] compiles and links
//! it once ([`GuestComponent`]); each call instantiates it afresh (its own WASI context,
//! wasi-nn state and KV caches) with the same limits as [`RunOptions`].

use super::wit_nn::{WitNn, WitNnView};
use super::{
    arm_deadline, arm_fuel, instantiate_error, run_error, store_limits, Host, HostError,
    InstanceSlot, RunOptions,
};
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Store, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "gpt2:text/generator",
    });
}

pub use bindings::exports::gpt2::text::generate::{
    Completion, Piece, Prompt, Sampling, Score, TokenLogprob, TopLogprob,
};

impl Default for Sampling {
    /// OpenAI's defaults: 16 tokens at temperature 1, nothing else changed.
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logprobs: None,
            echo: false,
            context_length: 0,
        }
    }
}

/// A generation running in a fresh instance of a component ([`Host::start_generation`]):
/// ask for its prompt's size, pull its pieces, then finish it. Dropping it drops the
/// instance (and its wasi-nn contexts).
pub struct ComponentGeneration<'h> {
    store: Store<ComponentState>,
    instance: bindings::Generator,
    generation: wasmtime::component::ResourceAny,
    options: RunOptions,
    // dropped after the store
    _slot: InstanceSlot<'h>,
}

impl ComponentGeneration<'_> {
    /// The prompt's token count, or the guest's reason the request cannot run (checked
    /// before any forward pass).
    pub fn prompt_tokens(&mut self) -> Result<Result<u32, String>, HostError> {
        self.instance
            .gpt2_text_generate()
            .generation()
            .call_prompt_tokens(&mut self.store, self.generation)
            .map_err(|e| run_error(&self.options, e))
    }

    /// The next piece; `Ok(None)` once the generation has ended.
    pub fn next_piece(&mut self) -> Result<Result<Option<Piece>, String>, HostError> {
        self.instance
            .gpt2_text_generate()
            .generation()
            .call_next(&mut self.store, self.generation)
            .map_err(|e| run_error(&self.options, e))
    }

    /// The completion (what was made so far, if the generation has not ended).
    pub fn finish(mut self) -> Result<Completion, HostError> {
        let completion = self
            .instance
            .gpt2_text_generate()
            .generation()
            .call_finish(&mut self.store, self.generation)
            .map_err(|e| run_error(&self.options, e))?;
        self.generation
            .resource_drop(&mut self.store)
            .map_err(|e| run_error(&self.options, e))?;
        Ok(completion)
    }
}

/// What [`Host::load_component_preinitialised`] did about its component's set-up.
#[derive(Clone, Debug, PartialEq)]
pub enum ComponentSnapshot {
    /// It was a snapshot already (or not a component, which fails to load anyway).
    Given,
    /// It was not, and has an init export: pre-initialised at load, taking `seconds`.
    MadeAtLoad { seconds: f64 },
    /// It has no init export: nothing to pre-initialise.
    NoInitExport,
    /// Pre-initialising it failed, for this reason: each instance runs its own set-up.
    Failed(String),
}

/// The bytes of the guest at `path`.
fn read_guest(path: &std::path::Path) -> Result<Vec<u8>, HostError> {
    std::fs::read(path).map_err(|e| HostError::Module {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// A guest component compiled and linked once ([`Host::load_component`]): each call only
/// instantiates it. Cheap to clone (shared).
#[derive(Clone)]
pub struct GuestComponent {
    pre: bindings::GeneratorPre<ComponentState>,
}

impl GuestComponent {
    /// The compiled component.
    pub fn component(&self) -> &Component {
        self.pre.instance_pre().component()
    }
}

/// Per-instance state of a component.
pub struct ComponentState {
    wasi: WasiCtx,
    table: ResourceTable,
    nn: WitNn,
    limits: StoreLimits,
}

impl WasiView for ComponentState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

pub(crate) fn component_linker(
    engine: &wasmtime::Engine,
) -> wasmtime::Result<Linker<ComponentState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    super::wit_nn::add_to_linker(&mut linker, |s: &mut ComponentState| {
        WitNnView::new(&mut s.table, &mut s.nn)
    })?;
    Ok(linker)
}

impl Host {
    /// Compile a guest component (`.wasm`) once and link it with WASI preview 2 and
    /// `wasi:nn` (a component that does not fit the `gpt2:text` world is an error here).
    pub fn load_component(&self, path: &std::path::Path) -> Result<GuestComponent, HostError> {
        self.component_from(&read_guest(path)?, path)
    }

    /// [`Host::load_component`], pre-initialised first ([`super::preinitialize_component`],
    /// in memory) when the component has an init export and is not a snapshot already
    /// ([`super::is_preinitialised`]). Otherwise each instance, one a request in the
    /// service, would build what the init function builds (`gpt2_component.wasm`'s
    /// tokenizer, ~60 ms of CPU). `wasi-nn-host preinit` writes the snapshot once, ahead,
    /// and saves the ~1 s this takes. A component that cannot be pre-initialised loads as
    /// it is ([`ComponentSnapshot::Failed`]).
    pub fn load_component_preinitialised(
        &self,
        path: &std::path::Path,
    ) -> Result<(GuestComponent, ComponentSnapshot), HostError> {
        let wasm = read_guest(path)?;
        let (wasm, snapshot) = if !super::is_component(&wasm) || super::is_preinitialised(&wasm) {
            (wasm, ComponentSnapshot::Given)
        } else {
            let started = std::time::Instant::now();
            match super::preinitialize_component(&wasm) {
                Ok(made) => {
                    let seconds = started.elapsed().as_secs_f64();
                    (made, ComponentSnapshot::MadeAtLoad { seconds })
                }
                Err(super::PreinitError::NoInitFunction) => (wasm, ComponentSnapshot::NoInitExport),
                Err(e) => (wasm, ComponentSnapshot::Failed(e.to_string())),
            }
        };
        Ok((self.component_from(&wasm, path)?, snapshot))
    }

    /// The component `wasm` (read from `path`) compiled and linked.
    fn component_from(
        &self,
        wasm: &[u8],
        path: &std::path::Path,
    ) -> Result<GuestComponent, HostError> {
        let error = |e: wasmtime::Error| HostError::Module {
            path: path.to_owned(),
            message: format!("{e:?}"),
        };
        let component = Component::new(self.engine(), wasm).map_err(error)?;
        let pre = self
            .component_linker()
            .instantiate_pre(&component)
            .and_then(bindings::GeneratorPre::new)
            .map_err(error)?;
        Ok(GuestComponent { pre })
    }

    /// A fresh instance of `component` in a store of its own, with `options`' limits, and its
    /// place in the pool (drop it after the store).
    fn component_instance(
        &self,
        component: &GuestComponent,
        options: &RunOptions,
    ) -> Result<(InstanceSlot<'_>, Store<ComponentState>, bindings::Generator), HostError> {
        let slot = self.instance_slot()?;
        let mut store = self.component_store(options, WasiCtxBuilder::new().build())?;
        let instance = component
            .pre
            .instantiate(&mut store)
            .map_err(|e| instantiate_error(self, e))?;
        Ok((slot, store, instance))
    }

    /// A store for one instance of a component: `wasi`, `options`' limits, its own wasi-nn
    /// state.
    pub(crate) fn component_store(
        &self,
        options: &RunOptions,
        wasi: WasiCtx,
    ) -> Result<Store<ComponentState>, HostError> {
        let state = ComponentState {
            wasi,
            table: ResourceTable::new(),
            nn: WitNn::new(self.backend().clone(), self.graphs().clone()),
            limits: store_limits(options),
        };
        let mut store = Store::new(self.engine(), state);
        store.limiter(|s| &mut s.limits);
        arm_deadline(&mut store, options);
        arm_fuel(&mut store, options, self.metered)?;
        Ok(store)
    }

    /// Start a generation in a fresh instance of `component` on graph `graph`, with
    /// `options`' limits (its `args` are unused).
    pub fn start_generation(
        &self,
        component: &GuestComponent,
        graph: &str,
        prompt: &Prompt,
        params: &Sampling,
        options: &RunOptions,
    ) -> Result<ComponentGeneration<'_>, HostError> {
        let (slot, mut store, instance) = self.component_instance(component, options)?;
        let generation = instance
            .gpt2_text_generate()
            .generation()
            .call_constructor(&mut store, graph, prompt, params)
            .map_err(|e| run_error(options, e))?;
        Ok(ComponentGeneration {
            store,
            instance,
            generation,
            options: options.clone(),
            _slot: slot,
        })
    }

    /// Generate from `prompt` with a fresh instance of `component` on graph `graph`,
    /// handing each piece to `on_piece` as it is made. `options` gives the limits (its
    /// `args` are unused). The inner error is the guest's.
    pub fn generate_with_component(
        &self,
        component: &GuestComponent,
        graph: &str,
        prompt: &str,
        params: &Sampling,
        options: &RunOptions,
        mut on_piece: impl FnMut(&Piece),
    ) -> Result<Result<Completion, String>, HostError> {
        let prompt = Prompt::Text(prompt.to_owned());
        let mut generation = self.start_generation(component, graph, &prompt, params, options)?;
        loop {
            match generation.next_piece()? {
                Ok(Some(piece)) => on_piece(&piece),
                Ok(None) => break,
                Err(message) => return Ok(Err(message)),
            }
        }
        generation.finish().map(Ok)
    }

    /// The embedded tokenizer's ids of `text`, from a fresh instance of `component`.
    pub fn tokenize_with_component(
        &self,
        component: &GuestComponent,
        text: &str,
        options: &RunOptions,
    ) -> Result<Result<Vec<u32>, String>, HostError> {
        let (_slot, mut store, instance) = self.component_instance(component, options)?;
        instance
            .gpt2_text_generate()
            .call_tokenize(&mut store, text)
            .map_err(|e| run_error(options, e))
    }

    /// The text of `ids`, from a fresh instance of `component`.
    pub fn detokenize_with_component(
        &self,
        component: &GuestComponent,
        ids: &[u32],
        options: &RunOptions,
    ) -> Result<Result<String, String>, HostError> {
        let (_slot, mut store, instance) = self.component_instance(component, options)?;
        instance
            .gpt2_text_generate()
            .call_detokenize(&mut store, ids)
            .map_err(|e| run_error(options, e))
    }

    /// Score `text` with a fresh instance of `component` (see the WIT `perplexity`).
    pub fn perplexity_with_component(
        &self,
        component: &GuestComponent,
        graph: &str,
        text: &str,
        window: u32,
        max_scored: Option<u32>,
        options: &RunOptions,
    ) -> Result<Result<Score, String>, HostError> {
        let (_slot, mut store, instance) = self.component_instance(component, options)?;
        instance
            .gpt2_text_generate()
            .call_perplexity(&mut store, graph, text, window, max_scored)
            .map_err(|e| run_error(options, e))
    }
}
