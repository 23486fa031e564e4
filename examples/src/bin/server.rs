//! The completions service: `server --module gpt2.wasm [--port 8080] [--device cuda --dtype bf16]
//! [--graph gpt2=PATH|random:124M]`. See the crate docs for the routes.

use anyhow::{Context, Result};
use clap::Parser;
use std::sync::Arc;
use std::time::Duration;
use wasi_nn_examples::{router, Service, ServiceConfig};
use wasi_nn_host::{Device, GpuDtype, HostBuilder};

#[derive(Parser)]
struct Args {
    /// The guest (gpt2.wasm).
    #[arg(long)]
    module: std::path::PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: GpuDtype,
    /// The model served as `gpt2`: a path, random:SIZE, or the embedded default model.
    #[arg(long)]
    graph: Option<String>,
    /// Seconds one request may run.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut builder = HostBuilder::new(args.device).dtype(args.dtype);
    builder = match args.graph.as_deref() {
        Some(spec) if spec.starts_with("random:") => {
            let size = &spec["random:".len()..];
            let config = wasi_nn_host::model::Gpt2Config::preset(size).context("unknown size")?;
            builder.graph_from_weights("gpt2", wasi_nn_host::model::random_weights(config, 0))?
        }
        Some(path) => builder.graph("gpt2", path.as_ref())?,
        None => builder.graph(
            "gpt2",
            &wasi_nn_host::find_default_model().context("no default model")?,
        )?,
    };
    let host = Arc::new(builder.build()?);
    let module = host.load_module(&args.module)?;
    let config = ServiceConfig {
        timeout: Duration::from_secs(args.timeout),
        ..Default::default()
    };
    let service = Service::new(host, module, config);
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(service))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
