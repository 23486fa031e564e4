//! Load generator for the completions service: N concurrent streaming clients, each sending
//! requests back to back; reports requests/s, aggregate tokens/s and the latency between
//! streamed pieces (percentiles). Usage: loadgen --url URL --concurrency N --requests M.

use anyhow::{bail, Result};
use clap::Parser;
use std::io::BufRead;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Requests per client.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
}

/// Stream one completion; return the gaps between pieces in ms, the generated tokens
/// (from the final chunk's `usage`) and the text.
fn one(url: &str, max_tokens: u32, seed: u64) -> Result<(Vec<f64>, usize, String)> {
    let body = serde_json::json!({ "prompt": "The", "max_tokens": max_tokens, "temperature": 0.0,
                                   "seed": seed, "stream": true });
    let response = ureq::post(&format!("{url}/v1/completions")).send_json(&body)?;
    let reader = std::io::BufReader::new(response.into_body().into_reader());
    let (mut gaps, mut pieces, mut tokens, mut last) = (Vec::new(), 0, 0, Instant::now());
    let mut text = String::new();
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok((gaps, tokens, text));
        }
        let chunk: serde_json::Value = serde_json::from_str(data)?;
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
            continue;
        }
        if let Some(piece) = chunk["choices"][0]["text"].as_str() {
            text.push_str(piece);
        }
        if chunk["error"].is_object() || chunk["choices"].is_null() {
            bail!("server error: {data}");
        }
        let now = Instant::now();
        if pieces > 0 {
            gaps.push((now - last).as_secs_f64() * 1e3);
        }
        last = now;
        pieces += 1;
    }
    bail!("stream ended without [DONE]")
}

/// One client's piece gaps (ms), generated tokens and texts.
type ClientResult = (Vec<f64>, usize, Vec<String>);

fn main() -> Result<()> {
    let args = Args::parse();
    let start = Instant::now();
    let results: Vec<Result<ClientResult>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.concurrency)
            .map(|c| {
                let args = &args;
                scope.spawn(move || -> Result<ClientResult> {
                    let (mut gaps, mut pieces, mut texts) = (Vec::new(), 0, Vec::new());
                    for r in 0..args.requests {
                        let (g, p, t) = one(&args.url, args.max_tokens, (c * 1000 + r) as u64)?;
                        gaps.extend(g);
                        pieces += p;
                        texts.push(t);
                    }
                    Ok((gaps, pieces, texts))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("client panicked")))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let (mut gaps, mut pieces, mut texts) = (Vec::new(), 0, std::collections::BTreeSet::new());
    for r in results {
        let (g, p, t) = r?;
        gaps.extend(g);
        pieces += p;
        texts.extend(t);
    }
    gaps.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        gaps.get(((gaps.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let requests = args.concurrency * args.requests;
    println!(
        "{}",
        serde_json::json!({
            "concurrency": args.concurrency, "requests": requests, "seconds": seconds,
            "requests_per_s": requests as f64 / seconds, "tokens": pieces,
            "tokens_per_s": pieces as f64 / seconds,
            "gap_ms_p50": pct(0.5), "gap_ms_p90": pct(0.9), "gap_ms_p99": pct(0.99),
            // greedy on one prompt: every request must produce the same text
            "distinct_texts": texts.len(),
        })
    );
    Ok(())
}
