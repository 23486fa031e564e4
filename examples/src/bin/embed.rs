//! Embedding the host in 40 lines: load the model once, compile the guest once, then run
//! several sandboxed instances at the same time, each streaming its text to us.
//! Usage: embed GPT2_WASM [PROMPT]...

use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;
use wasi_nn_host::{Device, HostBuilder, RunOptions};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let wasm = args.next().context("usage: embed GPT2_WASM [PROMPT]...")?;
    let prompts: Vec<String> = args.collect();
    let model = wasi_nn_host::find_default_model().context("models/gpt2-shakespeare not found")?;
    let host = Arc::new(
        HostBuilder::new(Device::Cpu)
            .graph("gpt2", &model)?
            .build()?,
    );
    let module = host.load_module(Path::new(&wasm))?;
    std::thread::scope(|scope| {
        for (i, prompt) in prompts.iter().enumerate() {
            let (host, module) = (host.clone(), module.clone());
            scope.spawn(move || {
                let options = RunOptions {
                    args: vec!["--max-tokens".into(), "24".into(), prompt.clone()],
                    // each piece of text reaches us as the guest writes it
                    on_stdout: Some(Arc::new(move |bytes: &[u8]| {
                        println!("[{i}] {:?}", String::from_utf8_lossy(bytes));
                    })),
                    max_memory_bytes: Some(512 << 20),
                    timeout: Some(std::time::Duration::from_secs(30)),
                    ..Default::default()
                };
                match host.run(&module, "gpt2.wasm", &options) {
                    Ok(out) => println!("[{i}] exit {}", out.exit_code),
                    Err(e) => println!("[{i}] failed: {e}"),
                }
            });
        }
    });
    Ok(())
}
