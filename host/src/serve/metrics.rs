//! `/metrics`: the service's counters, gauges and histograms through the `metrics` crate,
//! rendered in Prometheus text format by `metrics-exporter-prometheus`.
//!
//! The recorder is process-wide: the first service installs it. An embedder that installed
//! a recorder of its own gets the same metrics in it, and `/metrics` says so.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

/// HTTP requests answered, by route and status.
pub(crate) const REQUESTS: &str = "wasi_nn_http_requests_total";
/// Prompt tokens of the completions started.
pub(crate) const PROMPT_TOKENS: &str = "wasi_nn_prompt_tokens_total";
/// Tokens generated.
pub(crate) const GENERATED_TOKENS: &str = "wasi_nn_generation_tokens_total";
/// From a request's arrival to its first generated token.
pub(crate) const TTFT: &str = "wasi_nn_time_to_first_token_seconds";
/// Between consecutive tokens of one completion.
pub(crate) const INTER_TOKEN: &str = "wasi_nn_inter_token_seconds";
/// From a request's arrival to the end of one of its choices (a completion).
pub(crate) const REQUEST_LATENCY: &str = "wasi_nn_request_seconds";
/// From a request's arrival to its admission (places for its guests).
pub(crate) const QUEUE_TIME: &str = "wasi_nn_queue_seconds";
/// Guest instances generating now.
pub(crate) const GUESTS_RUNNING: &str = "wasi_nn_guests_running";
/// Requests waiting for guests.
pub(crate) const QUEUED: &str = "wasi_nn_requests_queued";
/// The share (0 to 1) of the KV-cache pools that open contexts hold.
pub(crate) const KV_USAGE: &str = "wasi_nn_kv_cache_usage_ratio";

/// The names an inference gateway's endpoint picker reads (the model-server protocol of the
/// Gateway API inference extension, with vLLM's names, which pickers read by default): the
/// same gauges as [`QUEUED`], [`GUESTS_RUNNING`] and [`KV_USAGE`] (both of vLLM's names
/// for the last: older pickers read `gpu_cache_usage_perc`). vLLM's "perc" is a fraction
/// from 0 to 1, as ours.
const PICKER_QUEUED: &str = "vllm:num_requests_waiting";
const PICKER_RUNNING: &str = "vllm:num_requests_running";
const PICKER_KV_USAGE: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];

/// Seconds spent in each part of the guests' token cycle ([`crate::guest_cycle`]), and how
/// often each ran.
pub(crate) const CYCLE_SECONDS: &str = "wasi_nn_cycle_seconds_total";
pub(crate) const CYCLE_COUNT: &str = "wasi_nn_cycle_count_total";

/// Steps run ahead for contexts before their guests came back, by outcome: `hit` (the guest
/// came back with the token the step was run with, and took its result), `miss` (it came
/// back with another, and the step was thrown away), `late` (a context's rows ran in a pass
/// its step did not wait for).
pub(crate) const RUN_AHEAD: &str = "wasi_nn_run_ahead_total";

/// Bytes in use on the process's heaps, by allocator: `jemalloc` (the CLI's allocator, so
/// the Rust side's allocations; about 0 for an embedder on another allocator) and `libc`
/// (glibc's malloc: what C libraries such as the CUDA driver, cuBLAS and NVRTC hold).
pub(crate) const HEAP: &str = "wasi_nn_heap_bytes";

/// How often the recorder folds the histograms' samples in.
const UPKEEP: Duration = Duration::from_secs(5);

/// Seconds: 1 ms to 60 s.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// The handle of the recorder this process's services installed; `None` when another
/// recorder was installed first.
pub(crate) fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &BUCKETS)
                .ok()?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            describe();
            // Histogram samples wait in the recorder until an upkeep folds them into the
            // buckets: without one between scrapes (or with no scraper at all) they pile
            // up, ~1 KB a 128-token request.
            let upkept = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(UPKEEP);
                    upkept.run_upkeep();
                })
                .ok()?;
            Some(handle)
        })
        .as_ref()
}

fn describe() {
    metrics::describe_counter!(REQUESTS, "HTTP requests answered, by route and status");
    metrics::describe_counter!(PROMPT_TOKENS, "prompt tokens of the completions started");
    metrics::describe_counter!(GENERATED_TOKENS, "tokens generated");
    for (name, help) in [
        (
            TTFT,
            "from a request's arrival to its first generated token",
        ),
        (INTER_TOKEN, "between consecutive tokens of one completion"),
        (
            REQUEST_LATENCY,
            "from a request's arrival to the end of one of its completions",
        ),
        (QUEUE_TIME, "from a request's arrival to its admission"),
    ] {
        metrics::describe_histogram!(name, metrics::Unit::Seconds, help);
    }
    metrics::describe_gauge!(GUESTS_RUNNING, "guest instances generating now");
    metrics::describe_counter!(
        RUN_AHEAD,
        "steps run ahead for contexts before their guests came back, by outcome"
    );
    metrics::describe_gauge!(QUEUED, "requests waiting for guests");
    metrics::describe_gauge!(
        KV_USAGE,
        "share (0 to 1) of the KV-cache pools held by open contexts"
    );
    metrics::describe_gauge!(
        PICKER_QUEUED,
        "requests waiting for guests (wasi_nn_requests_queued, by vLLM's name)"
    );
    metrics::describe_gauge!(
        PICKER_RUNNING,
        "guest instances generating now (wasi_nn_guests_running, by vLLM's name)"
    );
    for name in PICKER_KV_USAGE {
        metrics::describe_gauge!(
            name,
            "share (0 to 1) of the KV cache held (wasi_nn_kv_cache_usage_ratio, by vLLM's name)"
        );
    }
    metrics::describe_gauge!(
        HEAP,
        metrics::Unit::Bytes,
        "bytes in use on the process's heaps, by allocator (jemalloc: the CLI's Rust side; libc: C libraries)"
    );
}

/// The heap gauges, read now.
fn heap() {
    // jemalloc's statistics are refreshed when its epoch advances
    if tikv_jemalloc_ctl::epoch::advance().is_ok() {
        if let Ok(bytes) = tikv_jemalloc_ctl::stats::allocated::read() {
            metrics::gauge!(HEAP, "allocator" => "jemalloc").set(bytes as f64);
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and only reads glibc's own counters.
        let info = unsafe { libc::mallinfo2() };
        let bytes = info.uordblks.saturating_add(info.hblkhd);
        metrics::gauge!(HEAP, "allocator" => "libc").set(bytes as f64);
    }
}

/// The per-token metrics' handles, looked up once (not per token).
struct Handles {
    ttft: metrics::Histogram,
    inter_token: metrics::Histogram,
    request_latency: metrics::Histogram,
    queue_time: metrics::Histogram,
    prompt_tokens: metrics::Counter,
    generated_tokens: metrics::Counter,
}

fn handles() -> &'static Handles {
    static HANDLES: OnceLock<Handles> = OnceLock::new();
    HANDLES.get_or_init(|| {
        // the recorder first, so the handles are its
        handle();
        Handles {
            ttft: metrics::histogram!(TTFT),
            inter_token: metrics::histogram!(INTER_TOKEN),
            request_latency: metrics::histogram!(REQUEST_LATENCY),
            queue_time: metrics::histogram!(QUEUE_TIME),
            prompt_tokens: metrics::counter!(PROMPT_TOKENS),
            generated_tokens: metrics::counter!(GENERATED_TOKENS),
        }
    })
}

pub(crate) fn ttft(d: Duration) {
    handles().ttft.record(d.as_secs_f64());
}

pub(crate) fn inter_token(d: Duration) {
    handles().inter_token.record(d.as_secs_f64());
}

pub(crate) fn request_latency(d: Duration) {
    handles().request_latency.record(d.as_secs_f64());
}

pub(crate) fn queue_time(d: Duration) {
    handles().queue_time.record(d.as_secs_f64());
}

pub(crate) fn tokens(prompt: u32, generated: usize) {
    let h = handles();
    h.prompt_tokens.increment(prompt as u64);
    h.generated_tokens.increment(generated as u64);
}

pub(crate) fn request(route: &str, status: u16) {
    metrics::counter!(REQUESTS, "route" => route.to_owned(), "status" => status.to_string())
        .increment(1);
}

pub(crate) fn guests_running(n: usize) {
    metrics::gauge!(GUESTS_RUNNING).set(n as f64);
    metrics::gauge!(PICKER_RUNNING).set(n as f64);
}

pub(crate) fn queued(n: usize) {
    metrics::gauge!(QUEUED).set(n as f64);
    metrics::gauge!(PICKER_QUEUED).set(n as f64);
}

/// The KV pools' bytes held and caps (`None`: no pool, 0 held).
pub(crate) fn kv_usage(pool: Option<(usize, usize)>) {
    let share = match pool {
        Some((used, cap)) if cap > 0 => (used as f64 / cap as f64).min(1.0),
        _ => 0.0,
    };
    metrics::gauge!(KV_USAGE).set(share);
    for name in PICKER_KV_USAGE {
        metrics::gauge!(name).set(share);
    }
}

/// The batchers' run-ahead outcomes so far (`None`: nothing batches; zeros then).
pub(crate) fn run_ahead(counts: Option<crate::engine::batch::SpeculationCounts>) {
    let c = counts.unwrap_or_default();
    for (outcome, value) in [("hit", c.hits), ("miss", c.misses), ("late", c.deferred)] {
        metrics::counter!(RUN_AHEAD, "outcome" => outcome).absolute(value);
    }
}

/// The Prometheus text, or why there is none.
pub(crate) fn render() -> Result<String, &'static str> {
    let handle = handle().ok_or(
        "another metrics recorder was installed in this process: the service's metrics go there",
    )?;
    heap();
    handle.run_upkeep();
    let mut text = handle.render();
    cycle(&mut text);
    Ok(text)
}

/// The totals of [`crate::guest_cycle`], counters written straight into the text (they are
/// sums of seconds, which the `metrics` crate's integer counters can't hold).
fn cycle(text: &mut String) {
    use crate::guest_cycle::{total, Part};
    use std::fmt::Write;
    let _ = writeln!(
        text,
        "# HELP {CYCLE_SECONDS} time of each part of the guests' token cycle (step: the forward \
         pass waited for; read_logits, encode: the logits brought back and made a tensor; draw: a \
         sampled token drawn where the logits are; guest: \
         the guests' own time between their calls)\n# TYPE {CYCLE_SECONDS} counter"
    );
    for part in Part::ALL {
        let (_, seconds) = total(part);
        let _ = writeln!(
            text,
            "{CYCLE_SECONDS}{{part=\"{}\"}} {seconds}",
            part.name()
        );
    }
    let _ = writeln!(
        text,
        "# HELP {CYCLE_COUNT} how often each part of the guests' token cycle ran\n\
         # TYPE {CYCLE_COUNT} counter"
    );
    for part in Part::ALL {
        let (count, _) = total(part);
        let _ = writeln!(text, "{CYCLE_COUNT}{{part=\"{}\"}} {count}", part.name());
    }
}
