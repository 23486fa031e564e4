//! The preview 1 path: a guest module (`_start`) linked with WASI preview 1 and wasi-nn's
//! witx ABI (`wasi_ephemeral_nn`). [`Host::load_module`] compiles and links it once
//! ([`GuestModule`]); [`Host::run`] starts a fresh, sandboxed instance of it with its own WASI
//! context and its own wasi-nn state (its own execution contexts and KV caches) over the
//! host's shared graphs.

use super::component::ComponentState;
use super::preinit_component::is_component;
use super::witx::WitxNn;
use super::{
    arm_deadline, arm_fuel, instantiate_error, run_error, store_limits, Host, HostError,
    OutputCallback, RunOptions, RunOutcome,
};
use std::path::Path;
use std::time::{Duration, Instant};
use wasmtime::component::Component;
use wasmtime::{ExternType, InstancePre, Linker, Module, ModuleExport, Store, StoreLimits};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::bindings::sync::CommandPre;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

/// Per-instance state: the guest's WASI context and wasi-nn state.
pub struct GuestState {
    wasi: WasiP1Ctx,
    nn: WitxNn,
    limits: StoreLimits,
}

/// A guest program compiled and linked once ([`Host::load_module`]): every [`Host::run`] only
/// instantiates it. Either a preview 1 module (`_start`) or a preview 2 command component
/// (`wasi:cli/run`, with `wasi:nn` WIT). Cheap to clone (shared).
#[derive(Clone)]
pub struct GuestModule {
    kind: Program,
}

#[derive(Clone)]
enum Program {
    Module {
        pre: InstancePre<GuestState>,
        start: ModuleExport,
    },
    Command(CommandPre<ComponentState>),
}

impl GuestModule {
    /// The compiled module (`None` for a component).
    pub fn module(&self) -> Option<&Module> {
        match &self.kind {
            Program::Module { pre, .. } => Some(pre.module()),
            Program::Command(_) => None,
        }
    }
}

/// The preview 1 linker: WASI preview 1 and wasi-nn's witx ABI.
pub(crate) fn module_linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<GuestState>> {
    let mut linker: Linker<GuestState> = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |s: &mut GuestState| &mut s.wasi)?;
    super::witx::add_to_linker(&mut linker, |s: &mut GuestState| &mut s.nn)?;
    Ok(linker)
}

/// A WASI stdout that hands every write to a callback (for streaming to a caller).
#[derive(Clone)]
struct CallbackOutput(OutputCallback);

impl wasmtime_wasi::cli::IsTerminal for CallbackOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for CallbackOutput {
    fn p2_stream(&self) -> Box<dyn wasmtime_wasi::p2::OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for CallbackOutput {
    async fn ready(&mut self) {}
}

impl wasmtime_wasi::p2::OutputStream for CallbackOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> Result<(), wasmtime_wasi::p2::StreamError> {
        (self.0)(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> Result<(), wasmtime_wasi::p2::StreamError> {
        Ok(())
    }
    fn check_write(&mut self) -> Result<usize, wasmtime_wasi::p2::StreamError> {
        Ok(1 << 20)
    }
}

impl tokio::io::AsyncWrite for CallbackOutput {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        (self.0)(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

impl Host {
    /// Compile a guest program from a file and link it: a module (`.wasm` or `.wat`) with
    /// WASI preview 1 and wasi-nn's witx ABI, or a command component with WASI preview 2 and
    /// `wasi:nn` WIT (imports it asks for that the host lacks are an error here, not at run
    /// time). A pre-initialised module ([`super::preinitialize`]) loads the same way.
    pub fn load_module(&self, path: &Path) -> Result<GuestModule, HostError> {
        let error = |message: String| HostError::Module {
            path: path.to_owned(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| error(format!("{e}")))?;
        if is_component(&bytes) {
            let component =
                Component::new(&self.engine, &bytes).map_err(|e| error(format!("{e:?}")))?;
            let pre = self
                .component_linker()
                .instantiate_pre(&component)
                .and_then(CommandPre::new)
                .map_err(|e| {
                    error(format!(
                        "{e:?} (a component must be a WASI command: export wasi:cli/run)"
                    ))
                })?;
            return Ok(GuestModule {
                kind: Program::Command(pre),
            });
        }
        let module = Module::new(&self.engine, &bytes).map_err(|e| error(format!("{e:?}")))?;
        let is_command = matches!(
            module.get_export("_start"),
            Some(ExternType::Func(f)) if f.params().len() == 0 && f.results().len() == 0
        );
        let start = module
            .get_export_index("_start")
            .filter(|_| is_command)
            .ok_or_else(|| {
                error("the module exports no `_start: [] -> []` (not a WASI command)".into())
            })?;
        let pre = self
            .linker
            .instantiate_pre(&module)
            .map_err(|e| error(format!("{e:?}")))?;
        Ok(GuestModule {
            kind: Program::Module { pre, start },
        })
    }

    /// Run `module` in a fresh instance (`_start` of a module, `wasi:cli/run` of a
    /// component); returns its exit code (0 when it returns normally, the `proc_exit` code
    /// otherwise, 1 for a component's `run` that returns an error).
    pub fn run(
        &self,
        module: &GuestModule,
        program: &str,
        options: &RunOptions,
    ) -> Result<RunOutcome, HostError> {
        let called = Instant::now();
        // given back after the store (declared later, dropped first) has freed the instance
        let _slot = self.instance_slot()?;
        let mut wasi = WasiCtxBuilder::new();
        let mut argv = vec![program.to_owned()];
        argv.extend(options.args.iter().cloned());
        wasi.args(&argv);
        let pipes = options
            .capture
            .map(|cap| (MemoryOutputPipe::new(cap), MemoryOutputPipe::new(cap)));
        match &pipes {
            Some((out, err)) => {
                wasi.stdout(out.clone()).stderr(err.clone());
            }
            None => {
                wasi.inherit_stdout().inherit_stderr();
            }
        }
        if let Some(callback) = &options.on_stdout {
            wasi.stdout(CallbackOutput(callback.clone()));
        }
        for (host_path, guest_path) in &options.dirs {
            wasi.preopened_dir(host_path, guest_path, FsPerms::ReadOnly)
                .map_err(|e| HostError::Dir {
                    path: host_path.clone(),
                    message: format!("{e}"),
                })?;
        }
        let (start_latency, result) = match &module.kind {
            Program::Module { pre, start } => self.run_module(pre, start, wasi, options, called)?,
            Program::Command(pre) => self.run_command(pre, wasi, options, called)?,
        };
        let exit_code = match result {
            Ok(Ok(code)) => code,
            Ok(Err(e)) => match e.downcast_ref::<I32Exit>() {
                Some(exit) => exit.0,
                None => return Err(run_error(options, e)),
            },
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                return Err(HostError::Trap(format!("a host call panicked: {message}")));
            }
        };
        let (stdout, stderr) = match pipes {
            Some((out, err)) => (out.contents().to_vec(), err.contents().to_vec()),
            None => Default::default(),
        };
        Ok(RunOutcome {
            exit_code,
            stdout,
            stderr,
            start_latency,
        })
    }

    fn run_module(
        &self,
        pre: &InstancePre<GuestState>,
        start: &ModuleExport,
        mut wasi: WasiCtxBuilder,
        options: &RunOptions,
        called: Instant,
    ) -> Result<(Duration, Called), HostError> {
        let state = GuestState {
            wasi: wasi.build_p1(),
            nn: WitxNn::new(self.backend.clone(), self.graphs.clone()),
            limits: store_limits(options),
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        arm_deadline(&mut store, options);
        arm_fuel(&mut store, options, self.metered)?;
        let instance = pre
            .instantiate(&mut store)
            .map_err(|e| instantiate_error(self, e))?;
        let start = instance
            .get_module_export(&mut store, start)
            .and_then(|export| export.into_func())
            .ok_or_else(|| HostError::Trap("`_start` is not a function".into()))?
            .typed::<(), ()>(&store)
            .map_err(|e| HostError::Trap(format!("`_start`: {e:?}")))?;
        // No host call should panic (wasi-nn's bindings are ours and check every guest
        // pointer); should one still, the instance is thrown away and the host goes on.
        let start_latency = called.elapsed();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            start.call(&mut store, ()).map(|()| 0)
        }));
        Ok((start_latency, result))
    }

    fn run_command(
        &self,
        pre: &CommandPre<ComponentState>,
        mut wasi: WasiCtxBuilder,
        options: &RunOptions,
        called: Instant,
    ) -> Result<(Duration, Called), HostError> {
        let mut store = self.component_store(options, wasi.build())?;
        let command = pre
            .instantiate(&mut store)
            .map_err(|e| instantiate_error(self, e))?;
        let start_latency = called.elapsed();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            command
                .wasi_cli_run()
                .call_run(&mut store)
                .map(|r| if r.is_ok() { 0 } else { 1 })
        }));
        Ok((start_latency, result))
    }
}

/// What calling a guest's entry point gave: its exit code, its trap, or a host call's panic.
type Called = std::thread::Result<wasmtime::Result<i32>>;
