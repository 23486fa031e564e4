//! `wasi-nn-host serve`: its command-line arguments and the blocking entry point that runs
//! the service until Ctrl-C or SIGTERM. Building the [`Host`] from `--graph` (or the default
//! model) is left to the binary, which loads models for `run` the same way.

use super::{serve, ChatTemplate, ServeError, Service, ServiceConfig};
use crate::engine::{DeviceSpec, GpuDtype};
use crate::runtime::{ComponentSnapshot, Host};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Serve OpenAI-style completions over HTTP, one fresh guest-component instance per request.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The guest component (gpt2_component.wasm, built for wasm32-wasip2).
    #[arg(long)]
    pub component: PathBuf,
    /// Address to listen on (0.0.0.0 for every interface, as in a container).
    #[arg(long, env = "WASI_NN_SERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "WASI_NN_SERVE_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Where forward passes run: cpu, cuda (the first GPU) or cuda:N (counted among the
    /// GPUs CUDA_VISIBLE_DEVICES leaves visible). One process a GPU: see docs/deploy.md.
    #[arg(long, value_name = "cpu|cuda|cuda:N", default_value = "cpu")]
    pub device: DeviceSpec,
    /// Storage type of the weights on the GPU (converted at load).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: GpuDtype,
    /// Preload a graph and serve it as a model of the same name: NAME=PATH (HF folder,
    /// llm.c .bin, random:SIZE, or null:SIZE to measure the host without a forward pass). The
    /// first is the model of requests that name none.
    /// Without any, `gpt2` is the embedded default model (models/gpt2-shakespeare).
    #[arg(long = "graph", value_name = "NAME=PATH")]
    pub graphs: Vec<String>,
    /// Seconds one request may run.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Bound each request's guest work in wasmtime fuel (about one unit per wasm
    /// instruction; forward passes count as one call), whatever the machine's load; guests
    /// run somewhat slower with it counted.
    #[arg(long)]
    pub fuel: Option<u64>,
    /// Require `Authorization: Bearer KEY` on the /v1 routes, /tokenize and /detokenize.
    #[arg(long, env = "WASI_NN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Guests that may generate at once (each choice of a request is one); more requests
    /// wait in the queue. Default: --max-instances.
    #[arg(long)]
    pub max_concurrent: Option<usize>,
    /// Requests that may wait for guests; beyond them the answer is 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// A Jinja chat template for /v1/chat/completions, for every model (without it, a
    /// model's own comes from `chat_template` in its folder's tokenizer_config.json).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Seconds the service goes on accepting requests after Ctrl-C or SIGTERM while
    /// /health answers 503 (draining), so load balancers and endpoint pickers take it out
    /// first; then it stops accepting.
    #[arg(long, default_value_t = 0)]
    pub shutdown_delay: u64,
    /// Seconds the streams in flight get to finish once the service stops accepting.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace: u64,
    /// Requests that may run at once: the size of the host's instance pool (each reserves
    /// about 4 GiB of address space, not memory); more get 503 until one finishes.
    #[arg(long, default_value_t = crate::runtime::InstancePool::default().max_instances)]
    pub max_instances: u32,
    /// GPU contexts made ready per graph at start (their KV caches and buffers allocated up
    /// front, as a server preallocates its KV memory), so a burst of requests doesn't wait
    /// for them; up to `--max-instances` is useful.
    #[arg(long, default_value_t = 0)]
    pub warm_contexts: usize,
    /// Bytes of each instance's memory that stay resident when its request ends: the pages
    /// the guest wrote are reset from the guest's image instead of being handed back to the
    /// kernel, so the next guest in that slot neither faults them in again nor makes every
    /// core flush its TLB. Default: 64 MiB where Linux has PAGEMAP_SCAN (6.7+), which resets
    /// only the written pages; else 0.
    #[arg(long, value_name = "BYTES", default_value_t = crate::runtime::InstancePool::default_keep_resident())]
    pub keep_resident: usize,
}

impl ServeArgs {
    /// The instance pool `--max-instances` asks for.
    pub fn instance_pool(&self) -> crate::runtime::InstancePool {
        crate::runtime::InstancePool {
            max_instances: self.max_instances,
            keep_resident_bytes: self.keep_resident,
            ..Default::default()
        }
    }

    /// The `--graph` flags as `(name, path or random:SIZE)`.
    pub fn graph_specs(&self) -> Result<Vec<(&str, &str)>, ServeError> {
        self.graphs
            .iter()
            .map(|spec| {
                spec.split_once('=')
                    .filter(|(name, path)| !name.is_empty() && !path.is_empty())
                    .ok_or_else(|| ServeError::GraphSpec(spec.clone()))
            })
            .collect()
    }

    /// The model of requests that name none: the first `--graph`, else `gpt2`.
    fn default_model(&self) -> Result<String, ServeError> {
        Ok(self
            .graph_specs()?
            .first()
            .map_or("gpt2", |(name, _)| name)
            .to_owned())
    }

    /// The chat template of each model: `--chat-template` for all, else each model
    /// folder's own (`--graph NAME=DIR`, or the default model's folder).
    fn chat_templates(
        &self,
        models: &[String],
    ) -> Result<HashMap<String, ChatTemplate>, ServeError> {
        if let Some(path) = &self.chat_template {
            let template = ChatTemplate::from_file(path)?;
            return Ok(models
                .iter()
                .map(|m| (m.clone(), template.clone()))
                .collect());
        }
        let mut dirs: Vec<(String, PathBuf)> = self
            .graph_specs()?
            .into_iter()
            .map(|(name, path)| (name.to_owned(), PathBuf::from(path)))
            .filter(|(_, path)| path.is_dir())
            .collect();
        if self.graphs.is_empty() {
            dirs.extend(crate::find_default_model().map(|dir| ("gpt2".to_owned(), dir)));
        }
        let mut templates = HashMap::new();
        for (name, dir) in dirs {
            if let Some(template) = ChatTemplate::from_model_dir(&dir)? {
                templates.insert(name, template);
            }
        }
        Ok(templates)
    }
}

/// Serve `host`'s graphs as `args` says until Ctrl-C or SIGTERM, on a multi-threaded runtime
/// of its own. Build `host` with [`ServeArgs::instance_pool`].
pub fn run(host: Host, args: &ServeArgs) -> Result<(), ServeError> {
    let (component, snapshot) = host.load_component_preinitialised(&args.component)?;
    let path = args.component.display();
    match snapshot {
        ComponentSnapshot::MadeAtLoad { seconds } => eprintln!(
            "pre-initialised {path} at load ({seconds:.1} s; `wasi-nn-host preinit` does it once, ahead)"
        ),
        ComponentSnapshot::Failed(why) => tracing::warn!(
            "{path} could not be pre-initialised, so every request's instance runs its own set-up: {why}"
        ),
        ComponentSnapshot::Given | ComponentSnapshot::NoInitExport => {}
    }
    let config = ServiceConfig {
        default_model: args.default_model()?,
        timeout: Duration::from_secs(args.timeout),
        fuel: args.fuel,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_concurrent: args.max_concurrent,
        max_queue: args.max_queue,
        max_body_bytes: args.max_body_bytes,
        chat_templates: args.chat_templates(&host.graph_names())?,
        shutdown_delay: Duration::from_secs(args.shutdown_delay),
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        ..Default::default()
    };
    let service = Service::new(Arc::new(host), component, config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(async {
        let address = format!("{}:{}", args.host, args.port);
        let bind = |source| ServeError::Bind {
            address: address.clone(),
            source,
        };
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(bind)?;
        let local = listener.local_addr().map_err(bind)?;
        eprintln!("listening on http://{local}");
        serve(listener, service, shutdown_signal()).await
    })?;
    // guests cancelled at the deadline stop at their next token; don't wait on stragglers
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// Ctrl-C or SIGTERM (without signal handlers the service runs until it is killed).
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => eprintln!("Ctrl-C: finishing the requests in flight"),
        () = term => eprintln!("SIGTERM: finishing the requests in flight"),
    }
}
