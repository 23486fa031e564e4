//! Pre-initialisation of guest components (`wasm32-wasip2`, world `gpt2:text/gpt2`): the
//! component counterpart of [`super::preinitialize`] for modules, over wasmtime-wizer's
//! component support ([`Wizer::instrument_component`], [`Wizer::snapshot_component`]). The
//! init function is the component-level export [`INIT_EXPORT`] (`wizer-initialize: func()` in
//! the world); the snapshot keeps it (see [`preinitialize_component`]).
//!
//! As for modules, the init function must not read anything that depends on the run. It may
//! call WASI's I/O streams, random numbers (hash-map keys), `wasi:cli/exit` and the standard
//! streams (stdin empty, stdout and stderr captured) over an empty context, and nothing
//! else: a call to any other import (environment, arguments, clocks, filesystem, sockets,
//! `wasi:nn`) traps and stops the pre-initialisation with [`PreinitError::ForbiddenImport`].

use super::init_deadline::{init_engine, InitDeadline, INIT_TIME_LIMIT};
use super::preinit::{block_on, init_failure, PreinitError, CAPTURE_BYTES, INIT_EXPORT};
use super::snapshot_mark::marked;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{
    Component, Instance, Lift, Linker, ResourceTable, ResourceType, WasmList,
};
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wizer::{ComponentInstanceState, Wizer};

/// Whether `wasm` is a component (the binary's layer field is 1) rather than a core module.
pub fn is_component(wasm: &[u8]) -> bool {
    wasm.len() >= 8 && wasm[0..4] == *b"\0asm" && wasm[6..8] == [1, 0]
}

/// The init function's store: an empty WASI context and its resource table.
struct InitState {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl WasiView for InitState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

fn wasmtime_err(e: wasmtime::Error) -> PreinitError {
    PreinitError::Wasmtime(format!("{e:?}"))
}

/// Run the component's [`INIT_EXPORT`] and return the pre-initialised component: the
/// memories and mutable globals of its core instances as the init function left them,
/// everything else (the init export included) unchanged, and
/// [`super::SNAPSHOT_SECTION`] appended.
pub fn preinitialize_component(wasm: &[u8]) -> Result<Vec<u8>, PreinitError> {
    preinitialize_component_within(wasm, INIT_TIME_LIMIT)
}

/// [`preinitialize_component`], the init function given up after `limit`.
fn preinitialize_component_within(wasm: &[u8], limit: Duration) -> Result<Vec<u8>, PreinitError> {
    let mut wizer = Wizer::new();
    wizer.init_func(INIT_EXPORT);
    // wasmtime-wizer 48 removes the init export from the component *and* from the core
    // module that has an export of the same name (wit-bindgen names a world function's core
    // export after it), leaving the component's alias of that core export dangling (an
    // invalid component). So the export stays; calling it again in a run is harmless (the
    // tokenizer is already set) and hosts never do.
    wizer.keep_init_func(true);
    let (cx, instrumented) = wizer
        .instrument_component(wasm)
        .map_err(|e| PreinitError::Unsupported(format!("{e:#}")))?;
    let engine = init_engine().map_err(wasmtime_err)?;
    let component = Component::new(&engine, &instrumented).map_err(wasmtime_err)?;
    let init_index = match component.get_export(None, INIT_EXPORT) {
        Some((ComponentItem::ComponentFunc(ty), index))
            if ty.params().len() == 0 && ty.results().len() == 0 =>
        {
            index
        }
        _ => return Err(PreinitError::NoInitFunction),
    };

    let stdout = MemoryOutputPipe::new(CAPTURE_BYTES);
    let stderr = MemoryOutputPipe::new(CAPTURE_BYTES);
    let wasi = WasiCtxBuilder::new()
        .stdout(stdout.clone())
        .stderr(stderr.clone())
        .build();
    let mut store = Store::new(
        &engine,
        InitState {
            wasi,
            table: ResourceTable::new(),
        },
    );
    store.set_epoch_deadline(1);
    let forbidden = Arc::new(Mutex::new(None));
    let linker = init_linker(&engine, &component, &forbidden)?;
    let deadline = InitDeadline::start(&engine, limit);
    let instance = linker
        .instantiate(&mut store, &component)
        .map_err(|e| init_failure(&forbidden, &e, &stderr, limit))?;
    let init = instance
        .get_typed_func::<(), ()>(&mut store, init_index)
        .map_err(|_| PreinitError::NoInitFunction)?;
    if let Err(e) = init.call(&mut store, ()) {
        return Err(init_failure(&forbidden, &e, &stderr, limit));
    }
    drop(deadline);

    let mut state = SnapshotState {
        store: &mut store,
        instance,
        failed: None,
    };
    let snapshot = block_on(wizer.snapshot_component(&cx, &mut state));
    if let Some(failure) = state.failed {
        return Err(PreinitError::Unsupported(failure));
    }
    snapshot
        .map(marked)
        .map_err(|e| PreinitError::Unsupported(format!("{e:#}")))
}

/// The WASI interfaces (names without their versions) the init function may call.
const ALLOWED_INTERFACES: &[&str] = &[
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:random/random",
    "wasi:random/insecure",
    "wasi:random/insecure-seed",
    "wasi:cli/exit",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
];

/// The resource type of every resource of an import wasmtime-wasi does not provide
/// (`wasi:nn`, ...): no function of those interfaces can be called, so none is ever made.
struct Forbidden;

/// WASI preview 2 over the empty context, with every function of an interface outside
/// [`ALLOWED_INTERFACES`] (environment, clocks, filesystem, sockets, `wasi:nn`, anything
/// else) replaced by one that records its name and traps. wasmtime-wasi's resource types
/// stay (other interfaces' types refer to them); the resources of interfaces it does not
/// provide get [`Forbidden`].
fn init_linker(
    engine: &Engine,
    component: &Component,
    forbidden: &Arc<Mutex<Option<String>>>,
) -> Result<Linker<InitState>, PreinitError> {
    let mut linker: Linker<InitState> = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(wasmtime_err)?;
    linker.allow_shadowing(true);
    for (name, item) in component.component_type().imports(engine) {
        let ComponentItem::ComponentInstance(interface) = item.ty else {
            return Err(PreinitError::ForbiddenImport(format!(
                "{name} (the init function may only import WASI interfaces)"
            )));
        };
        let unversioned = name.split('@').next().unwrap_or(name);
        if ALLOWED_INTERFACES.contains(&unversioned) {
            continue;
        }
        let wasi_provides =
            unversioned.starts_with("wasi:") && !unversioned.starts_with("wasi:nn/");
        let mut instance = linker.instance(name).map_err(wasmtime_err)?;
        for (export, item) in interface.exports(engine) {
            match item.ty {
                ComponentItem::ComponentFunc(_) => {
                    let qualified = format!("{name}#{export}");
                    let forbidden = forbidden.clone();
                    instance
                        .func_new(export, move |_, _, _, _| {
                            if let Ok(mut slot) = forbidden.lock() {
                                slot.get_or_insert_with(|| qualified.clone());
                            }
                            Err(wasmtime::format_err!(
                                "`{qualified}` may not be called during pre-initialisation"
                            ))
                        })
                        .map_err(wasmtime_err)?;
                }
                ComponentItem::Resource(_) if !wasi_provides => instance
                    .resource(export, ResourceType::host::<Forbidden>(), |_, _| Ok(()))
                    .map_err(wasmtime_err)?,
                _ => {}
            }
        }
    }
    Ok(linker)
}

/// wasmtime-wizer's view of the initialised component instance: it reads each core
/// instance's state through accessor functions its instrumentation exported.
struct SnapshotState<'a> {
    store: &'a mut Store<InitState>,
    instance: Instance,
    /// Why an accessor could not be called (cannot happen for components wizer instrumented;
    /// reported instead of panicking).
    failed: Option<String>,
}

impl SnapshotState<'_> {
    fn call<R: Lift + 'static>(&mut self, instance: &str, func: &str) -> Option<R> {
        let result = (|| -> wasmtime::Result<R> {
            let (_, parent) = self
                .instance
                .get_export(&mut *self.store, None, instance)
                .ok_or_else(|| wasmtime::format_err!("no export `{instance}`"))?;
            let (_, index) = self
                .instance
                .get_export(&mut *self.store, Some(&parent), func)
                .ok_or_else(|| wasmtime::format_err!("no export `{instance}#{func}`"))?;
            let f = self
                .instance
                .get_typed_func::<(), (R,)>(&mut *self.store, index)?;
            let (value,) = f.call(&mut *self.store, ())?;
            Ok(value)
        })();
        match result {
            Ok(value) => Some(value),
            Err(e) => {
                self.failed
                    .get_or_insert_with(|| format!("reading the instance's state: {e:#}"));
                None
            }
        }
    }
}

impl ComponentInstanceState for SnapshotState<'_> {
    fn call_func_ret_list_u8(
        &mut self,
        instance: &str,
        func: &str,
        contents: impl FnOnce(&[u8]) + Send,
    ) -> impl std::future::Future<Output = ()> + Send {
        match self.call::<WasmList<u8>>(instance, func) {
            Some(list) => contents(list.as_le_slice(&*self.store)),
            None => contents(&[]),
        }
        std::future::ready(())
    }

    fn call_func_ret_s32(
        &mut self,
        instance: &str,
        func: &str,
    ) -> impl std::future::Future<Output = i32> + Send {
        std::future::ready(self.call::<i32>(instance, func).unwrap_or(0))
    }

    fn call_func_ret_s64(
        &mut self,
        instance: &str,
        func: &str,
    ) -> impl std::future::Future<Output = i64> + Send {
        std::future::ready(self.call::<i64>(instance, func).unwrap_or(0))
    }

    fn call_func_ret_f32(
        &mut self,
        instance: &str,
        func: &str,
    ) -> impl std::future::Future<Output = u32> + Send {
        std::future::ready(self.call::<f32>(instance, func).map_or(0, f32::to_bits))
    }

    fn call_func_ret_f64(
        &mut self,
        instance: &str,
        func: &str,
    ) -> impl std::future::Future<Output = u64> + Send {
        std::future::ready(self.call::<f64>(instance, func).map_or(0, f64::to_bits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wat(text: &str) -> Vec<u8> {
        wat::parse_str(text).expect("valid wat")
    }

    #[test]
    fn snapshots_a_components_state() {
        let wasm = wat(r#"(component
            (core module $m
                (memory (export "memory") 1)
                (global $g (mut i32) (i32.const 0))
                (func (export "init")
                    (i32.store (i32.const 64) (i32.const 0x2a2a2a2a))
                    (global.set $g (i32.const 7)))
                (func (export "get") (result i32)
                    (i32.add (global.get $g) (i32.load (i32.const 64)))))
            (core instance $i (instantiate $m))
            (func (export "wizer-initialize") (canon lift (core func $i "init")))
            (func (export "get") (result u32) (canon lift (core func $i "get")))
        )"#);
        assert!(is_component(&wasm));
        let out = super::super::preinitialize(&wasm).expect("pre-initialise");
        assert!(is_component(&out));
        assert!(super::super::is_preinitialised(&out) && !super::super::is_preinitialised(&wasm));
        let engine = Engine::default();
        let component = Component::new(&engine, &out).expect("valid output");
        let mut store = Store::new(&engine, ());
        let instance = Linker::new(&engine)
            .instantiate(&mut store, &component)
            .expect("instantiate");
        let get = instance
            .get_typed_func::<(), (u32,)>(&mut store, "get")
            .expect("get");
        assert_eq!(get.call(&mut store, ()).expect("call").0, 7 + 0x2a2a2a2a);
    }

    #[test]
    fn an_init_that_never_returns_is_given_up_at_the_limit() {
        let wasm = wat(r#"(component
            (core module $m (func (export "init") (loop $forever (br $forever))))
            (core instance $i (instantiate $m))
            (func (export "wizer-initialize") (canon lift (core func $i "init")))
        )"#);
        let started = std::time::Instant::now();
        match preinitialize_component_within(&wasm, Duration::from_millis(200)) {
            Err(PreinitError::InitFailed { message, .. }) => {
                assert!(message.contains("ran longer than 0.2 s"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn a_component_without_an_init_export_has_nothing_to_pre_initialise() {
        let wasm = wat(r#"(component
            (core module $m (func (export "get") (result i32) (i32.const 1)))
            (core instance $i (instantiate $m))
            (func (export "get") (result u32) (canon lift (core func $i "get")))
        )"#);
        assert!(matches!(
            preinitialize_component(&wasm),
            Err(PreinitError::NoInitFunction)
        ));
    }

    #[test]
    fn run_time_state_may_not_be_read_during_a_components_init() {
        let wasm = wat(r#"(component
            (import "wasi:clocks/monotonic-clock@0.2.0" (instance $clock
                (export "now" (func (result u64)))))
            (core func $now (canon lower (func $clock "now")))
            (core module $m
                (import "" "now" (func $now (result i64)))
                (memory (export "memory") 1)
                (func (export "init") (drop (call $now))))
            (core instance $i (instantiate $m (with "" (instance (export "now" (func $now))))))
            (func (export "wizer-initialize") (canon lift (core func $i "init")))
        )"#);
        match preinitialize_component(&wasm) {
            Err(PreinitError::ForbiddenImport(name)) => {
                assert_eq!(name, "wasi:clocks/monotonic-clock@0.2.0#now")
            }
            other => panic!("{other:?}"),
        }
    }
}
