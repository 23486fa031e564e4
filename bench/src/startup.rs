//! Guest start-up through the whole host path (`wasi-nn-bench startup`): for each module, the
//! time from the [`Host::run`] call to the guest's `_start` entry, the total time of a 1-token
//! request (`--max-tokens 1 ROMEO:`: start-up, tokenizer, a 3-token prefill, teardown) and a
//! decode step as the guest sees it (a 33-token request less a 1-token one, over 32), all on
//! the embedded default model on the CPU, medians of many runs. A component (e.g.
//! `gpt2_component.wasm` or its pre-initialised snapshot) is measured through
//! [`Host::generate_with_component`] with the same requests; its start-up and in-guest times
//! are not visible there (NaN).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use wasi_nn_host::runtime::{
    is_component, GuestComponent, Host, HostError, RunOptions, RunOutcome, Sampling,
};

/// What one module measured (milliseconds; medians, with the 90th percentile of start-up).
#[derive(Debug, serde::Serialize)]
pub struct StartupReport {
    pub module: String,
    pub runs: usize,
    pub start_ms: f64,
    pub start_p90_ms: f64,
    pub one_token_ms: f64,
    pub one_token_p90_ms: f64,
    /// The guest's own time from its first forward pass to its first token (the 3-token
    /// prefill and sampling: the part of `one_token_ms` that is not start-up or teardown).
    pub first_token_in_guest_ms: f64,
    pub decode_step_ms: f64,
    /// `one_token_ms / decode_step_ms`.
    pub one_token_in_decode_steps: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile (0.5 = median) of `v`; NaN when `v` is empty.
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// One greedy request of `tokens` tokens after "ROMEO:"; returns (start-up, total, the
/// guest's own time to its first token).
fn request(run: &Runner<'_>, tokens: usize) -> Result<(f64, f64, f64)> {
    let options = RunOptions {
        args: vec![
            "--json".into(),
            "--max-tokens".into(),
            tokens.to_string(),
            "ROMEO:".into(),
        ],
        capture: Some(1 << 20),
        ..Default::default()
    };
    let t = Instant::now();
    let out = run(&options)?;
    let total = ms(t.elapsed());
    if out.exit_code != 0 {
        bail!(
            "the guest exited with {}: {}",
            out.exit_code,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "the guest's --json line: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let first_token = line["timings"]["prompt_ms"].as_f64().unwrap_or(f64::NAN);
    Ok((ms(out.start_latency), total, first_token))
}

/// Runs the module under test once.
type Runner<'a> = dyn Fn(&RunOptions) -> Result<RunOutcome, HostError> + 'a;

/// One request of the given number of tokens to the guest under test: (start-up, total, the
/// guest's own time to its first token), as [`request`] returns.
type Measure<'a> = dyn Fn(usize) -> Result<(f64, f64, f64)> + 'a;

/// One greedy request of `tokens` tokens after "ROMEO:" through a component; returns (NaN,
/// total, NaN) like [`request`].
fn component_request(
    host: &Host,
    component: &GuestComponent,
    tokens: usize,
) -> Result<(f64, f64, f64)> {
    let params = Sampling {
        max_tokens: u32::try_from(tokens)?,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        ..Default::default()
    };
    let t = Instant::now();
    let completion = host
        .generate_with_component(
            component,
            "gpt2",
            "ROMEO:",
            &params,
            &RunOptions::default(),
            |_| {},
        )?
        .map_err(|e| anyhow::anyhow!("the component: {e}"))?;
    let total = ms(t.elapsed());
    if completion.ids.len() != tokens {
        bail!("{} tokens, not {tokens}", completion.ids.len());
    }
    Ok((f64::NAN, total, f64::NAN))
}

/// Whether the file at `path` is a component rather than a core module.
fn is_component_file(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut header = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(is_component(&header))
}

/// Measure each module in `modules` on `host` with `runs` requests of each kind (after 3
/// warm-up requests).
pub fn run(host: &Host, modules: &[PathBuf], runs: usize) -> Result<Vec<StartupReport>> {
    let mut reports = Vec::new();
    for path in modules {
        let measure: Box<Measure<'_>> = if is_component_file(path)? {
            let component = host
                .load_component(path)
                .with_context(|| format!("loading {}", path.display()))?;
            Box::new(move |tokens| component_request(host, &component, tokens))
        } else {
            let module = host
                .load_module(path)
                .with_context(|| format!("loading {}", path.display()))?;
            Box::new(move |tokens| {
                let runner = |options: &RunOptions| host.run(&module, "gpt2.wasm", options);
                request(&runner, tokens)
            })
        };
        for _ in 0..3 {
            measure(1)?;
        }
        let (mut start, mut one) = (Vec::new(), Vec::new());
        let (mut long, mut first) = (Vec::new(), Vec::new());
        // interleaved, so that drifts in the machine's load hit both kinds alike
        for _ in 0..runs {
            let (s, t, f) = measure(1)?;
            start.push(s);
            one.push(t);
            first.push(f);
            long.push(measure(33)?.1);
        }
        let one_token_ms = quantile(one.clone(), 0.5);
        let decode_step_ms = (quantile(long, 0.5) - one_token_ms) / 32.0;
        reports.push(StartupReport {
            module: display(path),
            runs,
            start_ms: quantile(start.clone(), 0.5),
            start_p90_ms: quantile(start, 0.9),
            one_token_ms,
            one_token_p90_ms: quantile(one, 0.9),
            first_token_in_guest_ms: quantile(first, 0.5),
            decode_step_ms,
            one_token_in_decode_steps: one_token_ms / decode_step_ms,
        });
    }
    Ok(reports)
}

fn display(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
