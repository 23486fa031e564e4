//! Load generator for the completions service, measured as its users see it.
//!
//! N concurrent clients each stream `--requests` completions back to back (or, with
//! `--duration S`, start new ones until S seconds have passed: a sustained load whose rate
//! the first wave's prompts and the last requests' tail weigh little in). Every
//! stream of a round gets its own prompt (client `c` in round `r` takes prompt
//! `(r * N + c) % P` of `--prompts P`), so a server that mixed streams up would show it.
//! Before the concurrent phase each prompt used runs once alone, one stream at a time, and
//! its text is the reference: every concurrent text must equal its prompt's single-stream
//! text (the run exits with status 1 otherwise; `--no-check` skips both).
//!
//! Prints one JSON line: aggregate tokens/s (`usage.completion_tokens` of every request over
//! the concurrent phase's wall time) and requests/s; time to first token (from sending the
//! request to the first streamed piece with text) and the gap between successive streamed
//! pieces of one stream, as percentiles over all requests, and apart for the first wave
//! (every client's first request, all sent at once) and the requests after it (`first_wave`,
//! `after_first_wave`); `texts_equal_single_stream`.
//!
//! Requests are greedy by default; `--temperature T [--top-p P]` samples, prompt `k` with the
//! seed `--seed` + k, so its text under load must still equal its text alone. Prompts are
//! short built-in openings, or with `--prompt-file FILE` windows of token ids cut from the
//! text (`--prompt-tokens MIN-MAX`, some long with `--long-prompts SHARE:TOKENS`; see
//! `prompts.rs`); the report then gives the long and the other prompts' streams apart.
//!
//! A failed request ends the run with its error, unless `--keep-going`: then it is counted
//! (`failed`, the first `errors` with when each was sent and how long it took to fail) and
//! its client goes on with the next; `--request-timeout` bounds every request.
//!
//! The clients' streams share `--client-threads` threads (default 2; `stream.rs`), so that
//! on the machine it measures the load generator takes little of the service's cores.
//!
//! Usage: loadgen --url URL --concurrency N (--requests M | --duration S) --max-tokens T
//!        [--temperature T --top-p P --seed S] [--field NAME=JSON] [--prompt-file FILE
//!        --prompt-tokens MIN-MAX --long-prompts SHARE:TOKENS] [--prompts P] [--json-out FILE]
//!        [--label TEXT]
//!        [--no-check] [--keep-going] [--request-timeout SECONDS] [--client-threads N]

mod chunk;
mod cycle;
mod failures;
mod prompts;
mod stream;

use anyhow::{bail, Context, Result};
use clap::Parser;
use prompts::{Lengths, Prompt, Prompts};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stream::{Client, Stream, Target};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent streams (clients).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Requests per client, sent back to back.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    /// Instead of `--requests`: each client starts requests back to back until this many
    /// seconds have passed since the concurrent phase began (the ones under way finish).
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Distinct prompts (default: one per client). Without `--prompt-file`, the first ones
    /// come from a built-in list, the rest are "Prompt K:".
    #[arg(long)]
    prompts: Option<usize>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling's mass (with `--temperature`).
    #[arg(long)]
    top_p: Option<f32>,
    /// Prompt k's requests sample with seed S + k.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Another field of every request, as NAME=JSON (repeatable), e.g.
    /// `--field presence_penalty=0.5 --field 'logit_bias={"11": 2}'`.
    #[arg(long = "field", value_name = "NAME=JSON", value_parser = parse_field)]
    fields: Vec<(String, serde_json::Value)>,
    /// Cut the prompts from this text (its first 200,000 characters, tokenized by the
    /// service) as windows of token ids at random offsets.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<std::path::PathBuf>,
    /// With `--prompt-file`: prompt lengths in tokens, uniform in MIN-MAX.
    #[arg(long, value_name = "MIN-MAX", default_value = "180-220")]
    prompt_tokens: String,
    /// With `--prompt-file`: this share of the prompts (spread evenly) is this many tokens
    /// (+-10%), e.g. `0.25:800`.
    #[arg(long, value_name = "SHARE:TOKENS")]
    long_prompts: Option<String>,
    /// The model to ask for (default: the service's default model).
    #[arg(long)]
    model: Option<String>,
    /// Skip the single-stream reference phase and the text check.
    #[arg(long)]
    no_check: bool,
    /// Also append the JSON line to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<std::path::PathBuf>,
    /// Copied into the JSON line as `label` (the chart draws one series per label).
    #[arg(long)]
    label: Option<String>,
    /// Count a failed request of the concurrent phase and go on, instead of ending the run
    /// (texts are checked on the requests that succeeded).
    #[arg(long)]
    keep_going: bool,
    /// Threads the clients' streams share (the threads read whichever connections have
    /// data).
    #[arg(long, default_value_t = 2)]
    client_threads: usize,
    /// Give up on a request (its whole stream) after this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0)]
    request_timeout: f64,
}

/// A blocking HTTP client for the one-shot calls (cutting the prompts, the service's
/// counters), whose error answers come back as answers, each call bounded by `timeout`.
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// The request of prompt `k`: a streamed completion with its usage.
fn request_body(args: &Args, prompt: &Prompt, k: usize) -> serde_json::Value {
    let mut body = serde_json::json!({ "prompt": prompt.json(), "max_tokens": args.max_tokens,
                                       "temperature": args.temperature, "stream": true,
                                       "stream_options": { "include_usage": true } });
    if args.temperature > 0.0 {
        body["seed"] = (args.seed + k as u64).into();
        if let Some(top_p) = args.top_p {
            body["top_p"] = top_p.into();
        }
    }
    if let Some(model) = &args.model {
        body["model"] = model.as_str().into();
    }
    for (name, value) in &args.fields {
        body[name.as_str()] = value.clone();
    }
    body
}

/// `NAME=JSON` of `--field`; not a field the load generator sets itself (its own flags
/// say what it reports, and the client reads streams).
fn parse_field(text: &str) -> Result<(String, serde_json::Value), String> {
    const OWN: [&str; 8] = [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "model",
        "stream",
        "stream_options",
    ];
    let (name, json) = text
        .split_once('=')
        .filter(|(name, _)| !name.is_empty())
        .ok_or_else(|| format!("{text:?}: expected NAME=JSON"))?;
    if OWN.contains(&name) {
        return Err(format!("{name}: set by loadgen itself (see its own flags)"));
    }
    let value = serde_json::from_str(json).map_err(|e| format!("{name}: {json:?}: {e}"))?;
    Ok((name.to_owned(), value))
}

/// Time to first token and gaps of some of the streams.
#[derive(Default)]
struct Timings {
    ttfts: Vec<f64>,
    gaps: Vec<f64>,
}

impl Timings {
    fn add(&mut self, stream: &Stream) {
        self.ttfts.extend(stream.ttft_ms);
        self.gaps.extend(&stream.gaps_ms);
    }

    fn report(mut self) -> serde_json::Value {
        self.ttfts.sort_by(f64::total_cmp);
        self.gaps.sort_by(f64::total_cmp);
        serde_json::json!({
            "requests": self.ttfts.len(),
            "ttft_ms_p50": percentile(&self.ttfts, 0.5), "ttft_ms_p99": percentile(&self.ttfts, 0.99),
            "gap_ms_p50": percentile(&self.gaps, 0.5), "gap_ms_p99": percentile(&self.gaps, 0.99),
        })
    }
}

/// Nearest-rank percentile `q` of sorted `v` (NaN, written as null, when empty).
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// One request of the concurrent phase: which client, which round, which prompt, when it
/// was sent (seconds since the phase began).
struct Done {
    client: usize,
    round: usize,
    prompt: usize,
    sent_s: f64,
    stream: Stream,
}

/// Where two texts first differ, with a little of each from there.
fn first_difference(a: &str, b: &str) -> String {
    let at = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i);
    let snippet = |s: &str| {
        s.get(at..)
            .unwrap_or("")
            .chars()
            .take(40)
            .collect::<String>()
    };
    format!(
        "byte {at}: single stream {:?}, concurrent {:?}",
        snippet(a),
        snippet(b)
    )
}

/// Each done request of a client, or its failure.
type Outcomes = Vec<Result<Done, failures::Failure>>;

/// Client `client`'s requests, back to back: `--requests` of them, or with a `duration`
/// until that much time has passed since `start`; it stops at its first failure unless
/// `--keep-going`.
async fn run_client(
    client: usize,
    args: &Args,
    all: &[Prompt],
    mut http: Client,
    start: Instant,
    duration: Option<Duration>,
) -> Outcomes {
    let rounds = match duration {
        Some(_) => usize::MAX,
        None => args.requests,
    };
    let prompts = all.len();
    let mut outcomes = Vec::new();
    for round in 0..rounds {
        if duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        let k = (round * args.concurrency + client) % prompts;
        let sent_s = start.elapsed().as_secs_f64();
        let outcome = http
            .stream(&request_body(args, &all[k], k))
            .await
            .map(|stream| Done {
                client,
                round,
                prompt: k,
                sent_s,
                stream,
            })
            .map_err(|e| failures::Failure {
                sent_s,
                failed_after_s: start.elapsed().as_secs_f64() - sent_s,
                error: format!("client {client}, request {round}, prompt {k}: {e:#}"),
            });
        let failed = outcome.is_err();
        outcomes.push(outcome);
        if failed && !args.keep_going {
            break;
        }
    }
    outcomes
}

fn main() -> Result<()> {
    let args = Arc::new(Args::parse());
    if args.concurrency == 0 || args.requests == 0 {
        bail!("--concurrency and --requests must be at least 1");
    }
    if !(args.request_timeout.is_finite() && args.request_timeout > 0.0) {
        bail!("--request-timeout must be a positive number of seconds");
    }
    if args.client_threads == 0 {
        bail!("--client-threads must be at least 1");
    }
    let timeout = Duration::from_secs_f64(args.request_timeout);
    let agent = || agent(timeout);
    let target = Target::parse(&args.url)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads)
        .enable_all()
        .build()
        .context("starting the clients' threads")?;
    let duration = match args.duration {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            bail!("--duration must be a positive number of seconds")
        }
        Some(d) => Some(Duration::from_secs_f64(d)),
        None => None,
    };
    let source = match &args.prompt_file {
        None => Prompts::BuiltIn,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let lengths = Lengths::parse(&args.prompt_tokens, args.long_prompts.as_deref())?;
            Prompts::cut(&agent(), &args.url, &text, lengths)?
        }
    };
    let prompts = args.prompts.unwrap_or(args.concurrency).max(1);
    let all: Arc<Vec<Prompt>> = Arc::new((0..prompts).map(|k| source.get(k)).collect());
    // a timed run may come round to every prompt
    let used = match duration {
        Some(_) => prompts,
        None => prompts.min(args.concurrency * args.requests),
    };

    // The reference texts: each prompt alone, one stream at a time (also the warm-up).
    let mut reference = Vec::new();
    let mut single_tokens = 0;
    let single_start = Instant::now();
    if !args.no_check {
        let mut client = Client::new(target.clone(), timeout);
        for (k, prompt) in all.iter().enumerate().take(used) {
            let s = runtime
                .block_on(client.stream(&request_body(&args, prompt, k)))
                .with_context(|| format!("single stream of prompt {k}"))?;
            single_tokens += s.tokens;
            reference.push(s.text);
        }
    }
    let single_seconds = single_start.elapsed().as_secs_f64();

    let cycle_before = cycle::Totals::fetch(&agent(), &args.url);
    let start = Instant::now();
    // each client's requests in order, each done or failed; a client stops at its first
    // failure unless --keep-going
    let results: Vec<Outcomes> = runtime
        .block_on(async {
            let clients: Vec<_> = (0..args.concurrency)
                .map(|client| {
                    let (args, all) = (args.clone(), all.clone());
                    let target = target.clone();
                    tokio::spawn(async move {
                        run_client(
                            client,
                            &args,
                            &all,
                            Client::new(target, timeout),
                            start,
                            duration,
                        )
                        .await
                    })
                })
                .collect();
            let mut results = Vec::new();
            for handle in clients {
                results.push(handle.await);
            }
            results
        })
        .into_iter()
        .map(|joined| joined.map_err(|_| anyhow::anyhow!("a client panicked")))
        .collect::<Result<_>>()?;
    let seconds = start.elapsed().as_secs_f64();
    let totals = cycle::Totals::fetch(&agent(), &args.url);
    let (cycle, run_ahead) = (
        totals.since(&cycle_before),
        totals.run_ahead_since(&cycle_before),
    );
    let (mut done, mut failed) = (Vec::new(), failures::Failures::default());
    for outcomes in results {
        for outcome in outcomes {
            match outcome {
                Ok(d) => done.push(d),
                Err(f) if args.keep_going => failed.0.push(f),
                Err(f) => bail!("{}", f.error),
            }
        }
    }
    let total = done.len();

    let (mut gaps, mut ttfts, mut tokens, mut equal) = (Vec::new(), Vec::new(), 0, 0);
    // the streams of long prompts, and of the others, apart; and the first wave (every
    // client's first request, all sent at once) apart from the requests after it
    let (mut long, mut others) = (Timings::default(), Timings::default());
    let (mut first_wave, mut later) = (Timings::default(), Timings::default());
    for d in &done {
        gaps.extend(&d.stream.gaps_ms);
        ttfts.extend(d.stream.ttft_ms);
        tokens += d.stream.tokens;
        match d.round {
            0 => first_wave.add(&d.stream),
            _ => later.add(&d.stream),
        }
        match source.is_long(d.prompt) {
            true => long.add(&d.stream),
            false => others.add(&d.stream),
        }
        if let Some(want) = reference.get(d.prompt) {
            if *want == d.stream.text {
                equal += 1;
            } else {
                eprintln!(
                    "text differs from the single stream: client {}, request {}, prompt {} ({:?}), {}",
                    d.client,
                    d.round,
                    d.prompt,
                    all[d.prompt].describe(),
                    first_difference(want, &d.stream.text)
                );
            }
        }
    }
    gaps.sort_by(f64::total_cmp);
    ttfts.sort_by(f64::total_cmp);
    let checked = !args.no_check;
    let mut report = serde_json::json!({
        "concurrency": args.concurrency, "requests": total, "prompts": used,
        "max_tokens": args.max_tokens, "seconds": seconds,
        "duration_s": args.duration,
        "requests_per_s": total as f64 / seconds, "tokens": tokens,
        "tokens_per_s": tokens as f64 / seconds,
        "ttft_ms_p50": percentile(&ttfts, 0.5), "ttft_ms_p99": percentile(&ttfts, 0.99),
        "gap_ms_p50": percentile(&gaps, 0.5), "gap_ms_p90": percentile(&gaps, 0.9),
        "gap_ms_p99": percentile(&gaps, 0.99),
        "single_stream_tokens_per_s": checked.then(|| single_tokens as f64 / single_seconds),
        "texts_equal_single_stream": checked.then(|| format!("{equal} of {total}")),
        "temperature": args.temperature, "top_p": args.top_p,
    });
    if !args.fields.is_empty() {
        report["fields"] = (args.fields.iter().cloned())
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    let cut: Vec<usize> = all.iter().filter_map(Prompt::tokens).collect();
    if !cut.is_empty() {
        report["prompt_tokens_mean"] = (cut.iter().sum::<usize>() as f64 / cut.len() as f64).into();
        report["prompt_tokens_max"] = cut.iter().max().copied().into();
    }
    if !later.ttfts.is_empty() {
        report["first_wave"] = first_wave.report();
        report["after_first_wave"] = later.report();
    }
    if !long.ttfts.is_empty() {
        report["long_prompts"] = long.report();
        report["other_prompts"] = others.report();
    }
    if let Some(cycle) = cycle {
        report["cycle"] = cycle;
    }
    if let Some(run_ahead) = run_ahead {
        report["run_ahead"] = run_ahead;
    }
    if args.keep_going {
        let sent: Vec<f64> = done.iter().map(|d| d.sent_s).collect();
        if let (serde_json::Value::Object(fields), Some(report)) =
            (failed.report(&sent), report.as_object_mut())
        {
            report.extend(fields);
        }
    }
    if let Some(label) = &args.label {
        report["label"] = label.as_str().into();
    }
    let line = report.to_string();
    println!("{line}");
    if let Some(path) = &args.json_out {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(file, "{line}").with_context(|| format!("writing {}", path.display()))?;
    }
    if checked && equal != total {
        eprintln!("texts_equal_single_stream: {equal} of {total}");
        std::process::exit(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_field;

    #[test]
    fn fields_are_a_name_and_a_json_value() {
        let (name, value) = parse_field("presence_penalty=0.5").expect("a number");
        assert_eq!(
            (name.as_str(), value),
            ("presence_penalty", serde_json::json!(0.5))
        );
        let (_, bias) = parse_field(r#"logit_bias={"11": 2, "198": -100}"#).expect("an object");
        assert_eq!(bias["198"], -100);
        for bad in [
            "presence_penalty",
            "=1",
            "x=not json",
            "temperature=1",
            "stream=false",
        ] {
            assert!(parse_field(bad).is_err(), "{bad}");
        }
    }
}
