//! The service's state: [`ServiceConfig`], what it serves and how each request is limited,
//! and [`Service`], the host and compiled component every request shares with the counters
//! of guests running, queued and served.

use super::metrics;
use super::request::Limits;
use super::{ChatTemplate, ServeError};
use crate::runtime::{GuestComponent, Host, RunOptions};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// What the service serves and how each request is limited.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// The model (graph name) a request without `model` gets.
    pub default_model: String,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// Wall-clock limit of one request's guest instance.
    pub timeout: Duration,
    /// Fuel of one request's guest instance (the host must meter it,
    /// [`crate::HostBuilder::fuel_metering`]).
    pub fuel: Option<u64>,
    /// Linear-memory cap of one guest instance.
    pub max_memory_bytes: usize,
    /// Guests that may generate at once (every choice of a request is one); `None`: the
    /// host's instance pool, else 64.
    pub max_concurrent: Option<usize>,
    /// Requests that may wait for guests; beyond them a request gets 429.
    pub max_queue: usize,
    /// The longest a request waits in the queue before a 429.
    pub queue_timeout: Duration,
    /// Most choices (`n` times prompts) one request may ask for.
    pub max_choices: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Requests to the `/v1` routes and the tokenizer's must carry `Authorization: Bearer
    /// KEY`.
    pub api_key: Option<String>,
    /// Chat templates by model; a model without one answers chat requests with a 400.
    pub chat_templates: HashMap<String, ChatTemplate>,
    /// After a shutdown signal, the service goes on accepting requests this long while
    /// `/health` answers 503 (draining), so that load balancers and endpoint pickers take it
    /// out of rotation before it refuses connections.
    pub shutdown_delay: Duration,
    /// Once it stops accepting, streams in flight get this long to finish; then they are
    /// cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            default_model: "gpt2".into(),
            max_tokens_limit: 1024,
            timeout: Duration::from_secs(120),
            fuel: None,
            max_memory_bytes: 1 << 30,
            max_concurrent: None,
            max_queue: 256,
            queue_timeout: Duration::from_secs(60),
            max_choices: 16,
            max_body_bytes: 1 << 20,
            api_key: None,
            chat_templates: HashMap::new(),
            shutdown_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// Shared state of the service: the host, the compiled component, the limits, counters.
pub struct Service {
    pub(super) host: Arc<Host>,
    pub(super) component: GuestComponent,
    pub(super) config: ServiceConfig,
    /// The host's graph names: the models served.
    pub(super) models: Vec<String>,
    /// Guests that may generate at once.
    pub(super) guests: Arc<Semaphore>,
    pub(super) max_concurrent: usize,
    pub(super) queued: AtomicUsize,
    pub(super) active: AtomicUsize,
    pub(super) served: AtomicUsize,
    /// Set when a shutdown signal came: `/health` answers 503.
    pub(super) draining: AtomicBool,
    /// Set when the shutdown deadline has passed: instances stop at their next token.
    pub(super) stopping: AtomicBool,
}

impl Service {
    /// A service over `host`'s graphs, running `component` (from [`Host::load_component`])
    /// for each request. The default model must be one of the host's graphs.
    pub fn new(
        host: Arc<Host>,
        component: GuestComponent,
        config: ServiceConfig,
    ) -> Result<Arc<Self>, ServeError> {
        let models = host.graph_names();
        if !models.contains(&config.default_model) {
            return Err(ServeError::UnknownDefaultModel {
                model: config.default_model,
                graphs: models,
            });
        }
        if let Some(model) = config.chat_templates.keys().find(|m| !models.contains(m)) {
            return Err(ServeError::UnknownTemplateModel(model.clone()));
        }
        let max_concurrent = config
            .max_concurrent
            .or_else(|| host.instance_pool().map(|p| p.max_instances as usize))
            .unwrap_or(64)
            .max(1);
        // the recorder exists before the first request counts anything, and the gauges
        // from the start
        metrics::handle();
        metrics::guests_running(0);
        metrics::queued(0);
        metrics::kv_usage(host.kv_pool());
        Ok(Arc::new(Self {
            host,
            component,
            config,
            models,
            guests: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            queued: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        }))
    }

    /// Guest instances running now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Guest instances that have finished (completed, failed or cancelled).
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Whether a shutdown signal came (the service drains).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Requests waiting for guests now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub(super) fn limits(&self) -> Limits<'_> {
        Limits {
            default_model: &self.config.default_model,
            models: &self.models,
            max_tokens: self.config.max_tokens_limit,
            max_choices: self.config.max_choices.min(self.max_concurrent),
        }
    }

    pub(super) fn run_options(&self, cancel: Option<Arc<AtomicBool>>) -> RunOptions {
        RunOptions {
            max_memory_bytes: Some(self.config.max_memory_bytes),
            timeout: Some(self.config.timeout),
            fuel: self.config.fuel,
            cancel,
            ..Default::default()
        }
    }
}
