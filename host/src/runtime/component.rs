//! Running the guest as a component (`wasm32-wasip2`, world `gpt2:text/gpt2` in `wit/`):
//! WASI preview 2 plus `wasi:nn` through `wasmtime_wasi_nn::wit`, over the same backend and
//! the same preloaded graphs as the preview-1 path. [`Host::load_component`] compiles and links
//! it once ([`GuestComponent`]); each call instantiates it afresh (its own WASI context,
//! wasi-nn state and KV caches) with the same limits as [`RunOptions`].

use super::{
    arm_deadline, instantiate_error, run_error, store_limits, Host, HostError, InstanceSlot,
    RunOptions,
};
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Store, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_nn::wit::{WasiNnCtx, WasiNnView};
use wasmtime_wasi_nn::{Backend, Registry};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "gpt2:text/generator",
    });
}

pub use bindings::exports::gpt2::text::generate::{Completion, Sampling, Score};

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
    nn: WasiNnCtx,
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
    wasmtime_wasi_nn::wit::add_to_linker(&mut linker, |s: &mut ComponentState| {
        WasiNnView::new(&mut s.table, &mut s.nn)
    })?;
    Ok(linker)
}

impl Host {
    /// Compile a guest component (`.wasm`) once and link it with WASI preview 2 and
    /// `wasi:nn` (a component that does not fit the `gpt2:text` world is an error here).
    pub fn load_component(&self, path: &std::path::Path) -> Result<GuestComponent, HostError> {
        let error = |e: wasmtime::Error| HostError::Module {
            path: path.to_owned(),
            message: format!("{e:?}"),
        };
        let component = Component::from_file(self.engine(), path).map_err(error)?;
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
        let mut store = self.component_store(options);
        let instance = component
            .pre
            .instantiate(&mut store)
            .map_err(|e| instantiate_error(self, e))?;
        Ok((slot, store, instance))
    }

    fn component_store(&self, options: &RunOptions) -> Store<ComponentState> {
        let state = ComponentState {
            wasi: WasiCtxBuilder::new().build(),
            table: ResourceTable::new(),
            nn: WasiNnCtx::new(
                [Backend::from(self.backend().clone())],
                Registry::from(self.graphs().clone()),
            ),
            limits: store_limits(options),
        };
        let mut store = Store::new(self.engine(), state);
        store.limiter(|s| &mut s.limits);
        arm_deadline(&mut store, options);
        store
    }

    /// Generate with a fresh instance of `component` on graph `graph`, handing each piece of
    /// text to `on_piece` as it is made. `options` gives the limits (its `args` are unused).
    pub fn generate_with_component(
        &self,
        component: &GuestComponent,
        graph: &str,
        prompt: &str,
        params: &Sampling,
        options: &RunOptions,
        mut on_piece: impl FnMut(&str),
    ) -> Result<Result<Completion, String>, HostError> {
        let (_slot, mut store, instance) = self.component_instance(component, options)?;
        let generate = instance.gpt2_text_generate();
        let generation = generate
            .generation()
            .call_constructor(&mut store, graph, prompt, params)
            .map_err(|e| run_error(options, e))?;
        loop {
            match generate
                .generation()
                .call_next(&mut store, generation)
                .map_err(|e| run_error(options, e))?
            {
                Ok(Some(piece)) => on_piece(&piece),
                Ok(None) => break,
                Err(message) => return Ok(Err(message)),
            }
        }
        let completion = generate
            .generation()
            .call_finish(&mut store, generation)
            .map_err(|e| run_error(options, e))?;
        generation
            .resource_drop(&mut store)
            .map_err(|e| run_error(options, e))?;
        Ok(Ok(completion))
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
