//! Pre-initialisation of guest modules with wasmtime-wizer: run a module's init export
//! (`wizer-initialize`) once, at build time, and write a new module whose memory and globals
//! start where the init function left them. `gpt2.wasm` builds its tokenizer there, so a run of
//! the snapshot starts with it instead of building it (about 60 ms on 2 cores).
//!
//! The snapshot must behave like the plain module for every run, so the init function runs
//! with an empty WASI context and may only call the imports that cannot leak run-time state
//! into it: `random_get` (hash-map keys), `fd_write` (captured; a panic message reaches the
//! error) and `proc_exit`. Any other import (arguments, environment, clocks, files, preopens,
//! wasi-nn) stops the pre-initialisation with [`PreinitError::ForbiddenImport`]: what those
//! return must be read when the guest runs, never snapshotted.
//!
//! The state is read through wasmtime-wizer's own instrumentation and rewriting
//! ([`Wizer::instrument`], [`Wizer::snapshot`]); the init function runs here, synchronously,
//! in an engine of its own.

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use wasmtime::{Engine, ExternType, Instance, Linker, Module, Store, Val};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wizer::{InstanceState, SnapshotVal, ValType, Wizer};

use super::init_deadline::{init_engine, InitDeadline, INIT_TIME_LIMIT};
use super::snapshot_mark::marked;

/// The init export `gpt2.wasm` has and [`preinitialize`] calls: wasmtime-wizer's default
/// name, so `wasmtime wizer` finds it too.
pub const INIT_EXPORT: &str = "wizer-initialize";

/// The WASI preview 1 imports the init function may call (see the module docs).
const ALLOWED_WASI: &[&str] = &["random_get", "fd_write", "proc_exit"];

/// How much of the init function's stdout and stderr is kept for error messages.
pub(super) const CAPTURE_BYTES: usize = 64 << 10;

/// Why a module could not be pre-initialised.
#[derive(Debug, thiserror::Error)]
pub enum PreinitError {
    #[error("wasmtime-wizer cannot pre-initialise this module: {0}")]
    Unsupported(String),
    #[error(
        "the guest exports no `{INIT_EXPORT}` function of type [] -> [] (is it already \
         pre-initialised?)"
    )]
    NoInitFunction,
    #[error(
        "the init function called `{0}`: what it returns must be read when the guest runs, \
         not snapshotted (only {ALLOWED_WASI:?} of WASI preview 1, or WASI preview 2's \
         random numbers, standard streams and exit, may be called there)"
    )]
    ForbiddenImport(String),
    #[error("the init function failed: {message}{}", stderr_suffix(.stderr))]
    InitFailed { message: String, stderr: String },
    #[error("wasmtime: {0}")]
    Wasmtime(String),
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.trim().is_empty() {
        String::new()
    } else {
        format!("; its stderr: {}", stderr.trim_end())
    }
}

fn wasmtime_err(e: wasmtime::Error) -> PreinitError {
    PreinitError::Wasmtime(format!("{e:?}"))
}

/// Whether `module` exports [`INIT_EXPORT`] as a function of type `[] -> []`, i.e. whether
/// [`preinitialize`] applies to it (a pre-initialised module no longer exports it).
pub fn has_init_export(module: &Module) -> bool {
    matches!(
        module.get_export(INIT_EXPORT),
        Some(ExternType::Func(f)) if f.params().len() == 0 && f.results().len() == 0
    )
}

/// The init function's store: an empty WASI context (no arguments, environment or preopens;
/// stdout and stderr captured).
struct InitState {
    wasi: WasiP1Ctx,
}

/// Run `wasm`'s [`INIT_EXPORT`] and return the pre-initialised module: its memories and
/// mutable globals as the init function left them, the init export removed, everything
/// else (`_start`, imports) unchanged, and [`super::SNAPSHOT_SECTION`] appended. A component goes
/// to [`super::preinitialize_component`].
pub fn preinitialize(wasm: &[u8]) -> Result<Vec<u8>, PreinitError> {
    if super::is_component(wasm) {
        return super::preinitialize_component(wasm);
    }
    preinitialize_module(wasm, INIT_TIME_LIMIT).map(marked)
}

fn preinitialize_module(wasm: &[u8], limit: Duration) -> Result<Vec<u8>, PreinitError> {
    let mut wizer = Wizer::new();
    wizer.init_func(INIT_EXPORT);
    let (cx, instrumented) = wizer
        .instrument(wasm)
        .map_err(|e| PreinitError::Unsupported(format!("{e:#}")))?;
    let engine = init_engine().map_err(wasmtime_err)?;
    let module = Module::new(&engine, &instrumented).map_err(wasmtime_err)?;
    if !has_init_export(&module) {
        return Err(PreinitError::NoInitFunction);
    }

    let stdout = MemoryOutputPipe::new(CAPTURE_BYTES);
    let stderr = MemoryOutputPipe::new(CAPTURE_BYTES);
    let wasi = WasiCtxBuilder::new()
        .stdout(stdout.clone())
        .stderr(stderr.clone())
        .build_p1();
    let forbidden = Arc::new(Mutex::new(None));
    let mut store = Store::new(&engine, InitState { wasi });
    store.set_epoch_deadline(1);
    let linker = init_linker(&engine, &module, &forbidden)?;
    let deadline = InitDeadline::start(&engine, limit);
    let instance = linker
        .instantiate(&mut store, &module)
        .map_err(|e| init_failure(&forbidden, &e, &stderr, limit))?;
    let init = instance
        .get_typed_func::<(), ()>(&mut store, INIT_EXPORT)
        .map_err(|_| PreinitError::NoInitFunction)?;
    if let Err(e) = init.call(&mut store, ()) {
        return Err(init_failure(&forbidden, &e, &stderr, limit));
    }
    drop(deadline);

    let mut state = SnapshotState {
        store: &mut store,
        instance,
        missing: None,
    };
    let snapshot = block_on(wizer.snapshot(&cx, &mut state));
    if let Some(name) = state.missing {
        return Err(PreinitError::Unsupported(format!(
            "the instrumented module lacks its export `{name}`"
        )));
    }
    snapshot.map_err(|e| PreinitError::Unsupported(format!("{e:#}")))
}

/// Why an init function failed: the forbidden import it called, else its exit code, its
/// running past `limit`, or its trap, with what it wrote to stderr.
pub(crate) fn init_failure(
    forbidden: &Mutex<Option<String>>,
    e: &wasmtime::Error,
    stderr: &MemoryOutputPipe,
    limit: Duration,
) -> PreinitError {
    if let Some(import) = forbidden.lock().ok().and_then(|mut f| f.take()) {
        return PreinitError::ForbiddenImport(import);
    }
    let exit = e
        .downcast_ref::<wasmtime_wasi::I32Exit>()
        .map(|exit| exit.0);
    let interrupted = e.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt);
    let message = match exit {
        Some(code) => format!("it exited with code {code}"),
        None if interrupted => format!("it ran longer than {} s", limit.as_secs_f64()),
        None => format!("{e:?}"),
    };
    let stderr = String::from_utf8_lossy(&stderr.contents()).into_owned();
    PreinitError::InitFailed { message, stderr }
}

/// WASI preview 1 for the init function, with every import outside [`ALLOWED_WASI`] (and
/// every non-WASI import) replaced by one that records its name and traps.
fn init_linker(
    engine: &Engine,
    module: &Module,
    forbidden: &Arc<Mutex<Option<String>>>,
) -> Result<Linker<InitState>, PreinitError> {
    let mut linker: Linker<InitState> = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |s: &mut InitState| &mut s.wasi)
        .map_err(wasmtime_err)?;
    linker.allow_shadowing(true);
    for import in module.imports() {
        let ExternType::Func(ty) = import.ty() else {
            continue;
        };
        let allowed =
            import.module() == "wasi_snapshot_preview1" && ALLOWED_WASI.contains(&import.name());
        if allowed {
            continue;
        }
        let name = format!("{}::{}", import.module(), import.name());
        let forbidden = forbidden.clone();
        linker
            .func_new(import.module(), import.name(), ty, move |_, _, _| {
                if let Ok(mut slot) = forbidden.lock() {
                    slot.get_or_insert_with(|| name.clone());
                }
                Err(wasmtime::Error::msg(format!(
                    "`{name}` may not be called during pre-initialisation"
                )))
            })
            .map_err(wasmtime_err)?;
    }
    Ok(linker)
}

/// wasmtime-wizer's view of the initialised instance.
struct SnapshotState<'a> {
    store: &'a mut Store<InitState>,
    instance: Instance,
    /// An export wizer asked for that the instance lacks (cannot happen for modules it
    /// instrumented; reported instead of panicking).
    missing: Option<String>,
}

impl InstanceState for SnapshotState<'_> {
    fn global_get(
        &mut self,
        name: &str,
        _type_hint: ValType,
    ) -> impl Future<Output = SnapshotVal> + Send {
        let value = match self.instance.get_global(&mut *self.store, name) {
            Some(global) => match global.get(&mut *self.store) {
                Val::I32(x) => Some(SnapshotVal::I32(x)),
                Val::I64(x) => Some(SnapshotVal::I64(x)),
                Val::F32(x) => Some(SnapshotVal::F32(x)),
                Val::F64(x) => Some(SnapshotVal::F64(x)),
                Val::V128(x) => Some(SnapshotVal::V128(x.as_u128())),
                _ => None,
            },
            None => None,
        };
        let value = value.unwrap_or_else(|| {
            self.missing.get_or_insert_with(|| name.to_owned());
            SnapshotVal::I32(0)
        });
        std::future::ready(value)
    }

    fn memory_contents(
        &mut self,
        name: &str,
        contents: impl FnOnce(&[u8]) + Send,
    ) -> impl Future<Output = ()> + Send {
        match self.instance.get_memory(&mut *self.store, name) {
            Some(memory) => contents(memory.data(&*self.store)),
            None => {
                self.missing.get_or_insert_with(|| name.to_owned());
                contents(&[]);
            }
        }
        std::future::ready(())
    }
}

/// Drive a future that never waits on anything outside itself (wasmtime-wizer's snapshot
/// over [`SnapshotState`], whose reads are immediate) to completion on this thread.
pub(super) fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wat(text: &str) -> Vec<u8> {
        wat::parse_str(text).expect("valid wat")
    }

    #[test]
    fn snapshots_memory_and_globals_and_drops_the_init_export() {
        let wasm = wat(r#"(module
            (memory (export "memory") 1)
            (global $g (mut i32) (i32.const 0))
            (func (export "wizer-initialize")
                (i32.store (i32.const 64) (i32.const 0x2a2a2a2a))
                (global.set $g (i32.const 7)))
            (func (export "get") (result i32) (i32.add (global.get $g) (i32.load (i32.const 64))))
        )"#);
        let out = preinitialize(&wasm).expect("pre-initialise");
        assert!(super::super::is_preinitialised(&out) && !super::super::is_preinitialised(&wasm));
        let engine = Engine::default();
        // the marker section leaves a valid module
        let module = Module::new(&engine, &out).expect("valid output");
        assert!(!has_init_export(&module));
        let mut store = Store::new(&engine, ());
        let instance = Instance::new(&mut store, &module, &[]).expect("instantiate");
        let get = instance
            .get_typed_func::<(), i32>(&mut store, "get")
            .expect("get");
        assert_eq!(get.call(&mut store, ()).expect("call"), 7 + 0x2a2a2a2a);
        assert!(matches!(
            preinitialize(&out),
            Err(PreinitError::NoInitFunction)
        ));
    }

    #[test]
    fn an_init_that_never_returns_is_given_up_at_the_limit() {
        let wasm = wat(r#"(module
            (func (export "wizer-initialize") (loop $forever (br $forever)))
        )"#);
        match preinitialize_module(&wasm, Duration::from_millis(200)) {
            Err(PreinitError::InitFailed { message, .. }) => {
                assert!(message.contains("ran longer than 0.2 s"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn run_time_state_may_not_be_read_during_init() {
        let wasm = wat(r#"(module
            (import "wasi_snapshot_preview1" "environ_sizes_get" (func $env (param i32 i32) (result i32)))
            (memory (export "memory") 1)
            (func (export "wizer-initialize") (drop (call $env (i32.const 0) (i32.const 4))))
        )"#);
        match preinitialize(&wasm) {
            Err(PreinitError::ForbiddenImport(name)) => {
                assert_eq!(name, "wasi_snapshot_preview1::environ_sizes_get")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_failing_init_is_reported_with_its_stderr() {
        let wasm = wat(r#"(module
            (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
            (memory (export "memory") 1)
            (data (i32.const 16) "boom")
            (func (export "wizer-initialize")
                (i32.store (i32.const 0) (i32.const 16))
                (i32.store (i32.const 4) (i32.const 4))
                (drop (call $write (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
                unreachable)
        )"#);
        let err = preinitialize(&wasm).expect_err("the init traps");
        assert!(matches!(err, PreinitError::InitFailed { .. }), "{err:?}");
        assert!(err.to_string().contains("boom"), "{err}");
    }
}
