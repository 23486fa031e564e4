//! The HTTP service (`wasi_nn_host::serve`) end to end: a real server on a loopback port
//! running the guest component, a real HTTP client, and the CLI (`gpt2.wasm --json`) as the
//! reference for the text.

use integration_tests::*;
use std::io::{BufRead, Read, Write};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use wasi_nn_host::serve::{ChatTemplate, Service, ServiceConfig};
use wasi_nn_host::{Device, GuestModule, HostBuilder, RunOptions};

struct Server {
    url: String,
    service: Arc<Service>,
    host: Arc<wasi_nn_host::Host>,
    /// The command guest, for the CLI's answers.
    module: GuestModule,
}

/// The chat template of the tests' shared server: turns as `ROLE: text` lines.
const TEMPLATE: &str = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}\
                        {% if add_generation_prompt %}ASSISTANT:{% endif %}";

/// One server for the whole test binary (with a chat template for `gpt2`).
fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        start_server_with(&["gpt2"], |c| {
            let template = ChatTemplate::new(TEMPLATE).expect("template");
            c.chat_templates.insert("gpt2".into(), template);
        })
    })
}

/// A server on a loopback port, on its own runtime thread, serving the default model under
/// each of `graphs` (the first is the default model).
fn start_server(graphs: &[&str]) -> Server {
    start_server_with(graphs, |_| {})
}

/// [`start_server`] with a configuration changed by `configure`.
fn start_server_with(graphs: &[&str], configure: impl FnOnce(&mut ServiceConfig)) -> Server {
    let mut builder = HostBuilder::new(Device::Cpu);
    for name in graphs {
        builder = builder.graph(name, &shakespeare_dir()).expect("model");
    }
    let host = Arc::new(builder.build().expect("host"));
    let component = host
        .load_component(&gpt2_component())
        .expect("compile component");
    let module = host.load_module(&gpt2_wasm()).expect("compile module");
    let mut config = ServiceConfig {
        default_model: graphs[0].to_owned(),
        ..Default::default()
    };
    configure(&mut config);
    let service = Service::new(host.clone(), component, config).expect("service");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let serving = wasi_nn_host::serve::serve(listener, service.clone(), std::future::pending());
    std::thread::spawn(move || runtime.block_on(serving).expect("serve"));
    Server {
        url,
        service,
        host,
        module,
    }
}

fn post(body: serde_json::Value) -> (u16, serde_json::Value) {
    post_to(server(), body)
}

fn post_to(s: &Server, body: serde_json::Value) -> (u16, serde_json::Value) {
    let response = ureq::post(&format!("{}/v1/completions", s.url))
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(&body)
        .expect("request");
    let status = response.status().as_u16();
    let value = response.into_body().read_json().expect("json body");
    (status, value)
}

/// The streamed text pieces and the final chunk (with the usage chunk's `usage` in it).
fn stream(body: serde_json::Value) -> (Vec<String>, serde_json::Value) {
    let chunks = stream_chunks(server(), "/v1/completions", body);
    let (mut pieces, mut last) = (Vec::new(), serde_json::Value::Null);
    for chunk in chunks {
        match chunk["choices"].get(0) {
            Some(choice) if choice["finish_reason"].is_null() => {
                pieces.push(choice["text"].as_str().expect("text").to_owned())
            }
            Some(_) => last = chunk,
            None => last["usage"] = chunk["usage"].clone(),
        }
    }
    (pieces, last)
}

/// Every chunk of a streamed answer up to `[DONE]`.
fn stream_chunks(s: &Server, path: &str, body: serde_json::Value) -> Vec<serde_json::Value> {
    let response = ureq::post(&format!("{}{path}", s.url))
        .send_json(&body)
        .expect("request");
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let reader = std::io::BufReader::new(response.into_body().into_reader());
    let mut chunks = Vec::new();
    for line in reader.lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return chunks;
        }
        chunks.push(serde_json::from_str(data).expect("chunk"));
    }
    panic!("stream ended without [DONE]");
}

/// A raw HTTP/1.1 streamed request on its own socket, read until the first event arrived:
/// the socket (to read on or hang up) and what came so far. `key`: a bearer token.
fn open_stream(address: &str, body: &str, key: Option<&str>) -> (std::net::TcpStream, Vec<u8>) {
    let mut socket = std::net::TcpStream::connect(address).expect("connect");
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nhost: {address}\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = socket.read(&mut buf).expect("read");
        assert!(n > 0, "stream closed early");
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        assert!(
            !text.contains("\r\n\r\n") || text.starts_with("HTTP/1.1 200"),
            "not a stream: {text}"
        );
    }
    (socket, seen)
}

/// A service with `config` on its own runtime thread, stopped by sending on the returned
/// channel; the thread's result is `serve`'s.
type Serving = std::thread::JoinHandle<Result<(), wasi_nn_host::serve::ServeError>>;
fn serve_until_stopped(
    config: ServiceConfig,
) -> (
    String,
    Arc<Service>,
    tokio::sync::oneshot::Sender<()>,
    Serving,
) {
    let host = Arc::new(
        HostBuilder::new(Device::Cpu)
            .graph("gpt2", &shakespeare_dir())
            .expect("model")
            .build()
            .expect("host"),
    );
    let component = host.load_component(&gpt2_component()).expect("component");
    let service = Service::new(host, component, config).expect("service");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let address = listener.local_addr().expect("addr").to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = wasi_nn_host::serve::serve(listener, service.clone(), async {
        let _ = stopped.await;
    });
    let server = std::thread::spawn(move || runtime.block_on(serving));
    (address, service, stop, server)
}

/// What the CLI path (the guest run directly) prints for the same request.
fn cli_json(args: &[&str]) -> serde_json::Value {
    let s = server();
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let options = RunOptions {
        args: all.iter().map(|a| a.to_string()).collect(),
        capture: Some(1 << 20),
        ..Default::default()
    };
    let out = s.host.run(&s.module, "gpt2.wasm", &options).expect("run");
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn completion_equals_the_cli_and_streaming_equals_both() {
    let want = cli_json(&["--max-tokens", "40", "--temperature", "0", "JULIET:"]);
    let request = serde_json::json!({ "prompt": "JULIET:", "max_tokens": 40, "temperature": 0 });
    let (status, got) = post(request.clone());
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want["text"]);
    assert_eq!(got["choices"][0]["finish_reason"], "length");
    assert_eq!(got["usage"]["completion_tokens"], 40);
    assert_eq!(got["object"], "text_completion");
    assert_eq!(got["model"], "gpt2");
    // timings measured by the service: the first token before the end, 39 more tokens after it
    let timings = &got["timings"];
    let (ttft, total) = (
        timings["ttft_ms"].as_f64().expect("ttft_ms"),
        timings["total_ms"].as_f64().expect("total_ms"),
    );
    assert!(ttft > 0.0 && ttft <= total, "{timings}");
    let rate = timings["tokens_per_s"].as_f64().expect("tokens_per_s");
    assert!(
        (rate - 39.0 / ((total - ttft) / 1e3)).abs() < 1e-6 * rate,
        "{timings}"
    );

    let mut streamed = request;
    streamed["stream"] = true.into();
    streamed["stream_options"] = serde_json::json!({ "include_usage": true });
    let (pieces, last) = stream(streamed);
    assert!(pieces.len() > 10, "text arrives in pieces");
    assert_eq!(pieces.concat(), want["text"].as_str().expect("text"));
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 40);

    // sampled with a seed: the same seed twice gives the same text, stop strings end it
    let sampled = serde_json::json!({ "prompt": "ROMEO:", "max_tokens": 30, "temperature": 0.8,
                                      "top_p": 0.9, "seed": 5, "stop": ["\n\n"] });
    let (a, b) = (post(sampled.clone()).1, post(sampled).1);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert!(!a["choices"][0]["text"]
        .as_str()
        .unwrap_or("\n\n")
        .contains("\n\n"));
}

#[test]
fn bad_requests_get_clear_4xx_errors() {
    let cases = [
        (serde_json::json!({ "max_tokens": 5 }), 400, "prompt"),
        (serde_json::json!({ "prompt": 5 }), 400, "prompt"),
        (
            serde_json::json!({ "prompt": "x", "max_tokens": 0 }),
            400,
            "max_tokens",
        ),
        (
            serde_json::json!({ "prompt": "x", "max_tokens": 100000 }),
            400,
            "max_tokens",
        ),
        (
            serde_json::json!({ "prompt": "x", "temperature": -1 }),
            400,
            "temperature",
        ),
        (
            serde_json::json!({ "prompt": "x", "top_p": 0 }),
            400,
            "top_p",
        ),
        (
            serde_json::json!({ "prompt": "x", "stop": ["", "a"] }),
            400,
            "stop",
        ),
        (
            serde_json::json!({ "prompt": "x", "best_of": 3 }),
            400,
            "best_of",
        ),
        (
            serde_json::json!({ "prompt": "x", "model": "gpt-4" }),
            404,
            "gpt-4",
        ),
        (serde_json::json!({ "prompt": "x", "foo": 1 }), 400, "foo"),
        (
            serde_json::json!({ "prompt": "x", "suffix": "y" }),
            400,
            "suffix",
        ),
        (
            serde_json::json!({ "prompt": "x", "logprobs": 21 }),
            400,
            "logprobs",
        ),
        (serde_json::json!({ "prompt": "x", "n": 40 }), 400, "n"),
        (
            serde_json::json!({ "prompt": "x", "logit_bias": { "a": 1 } }),
            400,
            "logit_bias",
        ),
        (serde_json::json!({ "prompt": [] }), 400, "prompt"),
        (serde_json::json!({ "prompt": [[1], "x"] }), 400, "prompt"),
    ];
    for (body, status, mention) in cases {
        let (got_status, got) = post(body.clone());
        assert_eq!(got_status, status, "{body} -> {got}");
        let message = got["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(mention),
            "{body}: `{message}` should mention `{mention}`"
        );
    }
    // not JSON at all
    let response = ureq::post(&format!("{}/v1/completions", server().url))
        .config()
        .http_status_as_error(false)
        .build()
        .header("content-type", "application/json")
        .send("{not json")
        .expect("request");
    assert_eq!(response.status().as_u16(), 400);
    // the other routes
    let models: serde_json::Value = ureq::get(&format!("{}/v1/models", server().url))
        .call()
        .expect("models")
        .into_body()
        .read_json()
        .expect("json");
    assert_eq!(models["data"][0]["id"], "gpt2");
    let health: serde_json::Value = ureq::get(&format!("{}/health", server().url))
        .call()
        .expect("health")
        .into_body()
        .read_json()
        .expect("json");
    assert_eq!(health["status"], "ok");
}

#[test]
fn a_client_that_disconnects_mid_stream_stops_its_instance() {
    // its own server, so other tests' requests do not count as running instances
    let s = &start_server(&["gpt2"]);
    let before = s.service.active();
    let address = s.url.trim_start_matches("http://");
    let body = r#"{"prompt":"ROMEO:","max_tokens":500,"temperature":0.9,"stream":true}"#;
    let (socket, _) = open_stream(address, body, None);
    assert!(s.service.active() > before, "an instance is running");
    drop(socket);
    let start = Instant::now();
    while s.service.active() > before {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "instance still running after disconnect"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // 500 tokens at ~3 ms each would take well over a second: it was stopped, not finished
    assert!(
        start.elapsed() < Duration::from_millis(1000),
        "took {:?}",
        start.elapsed()
    );
    let response = ureq::post(&format!("{}/v1/completions", s.url))
        .send_json(serde_json::json!({ "prompt": "x", "max_tokens": 2 }))
        .expect("still serving");
    assert_eq!(response.status().as_u16(), 200);
}

#[test]
fn concurrent_requests_all_complete_correctly() {
    let want = cli_json(&[
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "KING RICHARD III:",
    ]);
    let results: Vec<(u16, serde_json::Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            (0..8)
                .map(|i| {
                    scope.spawn(move || {
                    let body = serde_json::json!({ "prompt": "KING RICHARD III:", "max_tokens": 24,
                                                   "temperature": 0, "stream": i % 2 == 0 });
                    if i % 2 == 0 {
                        let (pieces, last) = stream(body);
                        (200, serde_json::json!({ "text": pieces.concat(), "last": last }))
                    } else {
                        let (status, v) = post(body);
                        (status, serde_json::json!({ "text": v["choices"][0]["text"] }))
                    }
                })
                })
                .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client"))
            .collect()
    });
    for (status, value) in results {
        assert_eq!(status, 200);
        assert_eq!(value["text"], want["text"]);
    }
}

#[test]
fn every_graph_is_a_model_and_the_first_is_the_default() {
    let s = &start_server(&["shakespeare", "again"]);
    let models: serde_json::Value = ureq::get(&format!("{}/v1/models", s.url))
        .call()
        .expect("models")
        .into_body()
        .read_json()
        .expect("json");
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["again", "shakespeare"]);
    let request = serde_json::json!({ "prompt": "JULIET:", "max_tokens": 8, "temperature": 0 });
    let (status, default) = post_to(s, request.clone());
    assert_eq!(status, 200, "{default}");
    assert_eq!(default["model"], "shakespeare");
    let mut named = request;
    named["model"] = "again".into();
    let (status, again) = post_to(s, named);
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["model"], "again");
    // the same weights under two names
    assert_eq!(again["choices"][0]["text"], default["choices"][0]["text"]);
    // `gpt2` is not one of them here
    let (status, missing) = post_to(s, serde_json::json!({ "prompt": "x", "model": "gpt2" }));
    assert_eq!(status, 404, "{missing}");
}

/// Any route: status, the `x-request-id` and `retry-after` headers, and the body as JSON
/// (or as a JSON string when it is not JSON).
fn call(
    s: &Server,
    path: &str,
    body: Option<serde_json::Value>,
    headers: &[(&str, &str)],
) -> (u16, [Option<String>; 2], serde_json::Value) {
    let url = format!("{}{path}", s.url);
    let response = match body {
        Some(body) => {
            let mut request = ureq::post(&url);
            for (k, v) in headers {
                request = request.header(*k, *v);
            }
            request
                .config()
                .http_status_as_error(false)
                .build()
                .send_json(&body)
        }
        None => {
            let mut request = ureq::get(&url);
            for (k, v) in headers {
                request = request.header(*k, *v);
            }
            request.config().http_status_as_error(false).build().call()
        }
    }
    .expect("request");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let named = [header("x-request-id"), header("retry-after")];
    let status = response.status().as_u16();
    let text = response.into_body().read_to_string().expect("body");
    let value = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, named, value)
}

fn text(v: &serde_json::Value, i: usize) -> &str {
    v["choices"][i]["text"].as_str().expect("text")
}

/// `log_softmax(row)` in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = max
        + row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// The ids of the `n` largest of `row`, largest first.
fn top(row: &[f64], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

#[test]
fn logprobs_equal_hf_for_generated_and_echoed_prompt_tokens() {
    let fixture = read_json("shakespeare.json");
    let prompts = id_lists(&fixture["prompt_ids"]);
    let greedy = id_lists(&fixture["greedy_64"]);
    let vocab = 50257;
    let logits = read_f32_rows("shakespeare_logits.bin", vocab);
    let text_of = |ids: &[u32]| -> String {
        let (status, _, v) = call(
            server(),
            "/detokenize",
            Some(serde_json::json!({ "tokens": ids })),
            &[],
        );
        assert_eq!(status, 200, "{v}");
        v["prompt"].as_str().expect("prompt").to_owned()
    };
    for (k, prompt) in prompts.iter().enumerate() {
        let hf = log_softmax(&logits[k]);
        let want_top = top(&hf, 5);
        // the first generated token: its logprob and the top 5 alternatives
        let (status, got) = post(serde_json::json!({
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5 }));
        assert_eq!(status, 200, "{got}");
        let lp = &got["choices"][0]["logprobs"];
        let chosen = greedy[k][0] as usize;
        let token = lp["tokens"][0].as_str().expect("token");
        assert_eq!(token, text_of(&[chosen as u32]));
        let value = lp["token_logprobs"][0].as_f64().expect("logprob");
        assert!(
            (value - hf[chosen]).abs() < 1e-4,
            "prompt {k}: {value} vs HF {}",
            hf[chosen]
        );
        let alternatives = lp["top_logprobs"][0].as_object().expect("top");
        for &id in &want_top {
            let name = text_of(&[id as u32]);
            let got = alternatives[&name].as_f64().unwrap_or(f64::NAN);
            assert!(
                (got - hf[id]).abs() < 1e-4,
                "prompt {k} alternative {id}: {got} vs {}",
                hf[id]
            );
        }
        // echo: the prompt's tokens scored in one prefill; the last one's logprob is the
        // HF logprob of the greedy token after the fixture prompt
        let mut ids = prompt.clone();
        ids.push(chosen as u32);
        let (status, got) = post(serde_json::json!({
            "prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 3, "temperature": 0 }));
        assert_eq!(status, 200, "{got}");
        let lp = &got["choices"][0]["logprobs"];
        let values = lp["token_logprobs"].as_array().expect("token_logprobs");
        assert_eq!(
            values.len(),
            ids.len(),
            "every prompt token, nothing generated"
        );
        assert!(values[0].is_null() && lp["top_logprobs"][0].is_null());
        let last = values[ids.len() - 1].as_f64().expect("logprob");
        assert!(
            (last - hf[chosen]).abs() < 1e-4,
            "echo {k}: {last} vs {}",
            hf[chosen]
        );
        assert_eq!(
            text(&got, 0),
            text_of(&ids),
            "echo returns the prompt's text"
        );
        let offsets = lp["text_offset"].as_array().expect("text_offset");
        assert_eq!(offsets[0], 0);
        assert_eq!(got["usage"]["completion_tokens"], 0);
    }
}

#[test]
fn every_sampling_field_does_what_it_says() {
    let base = serde_json::json!({ "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0 });
    let (_, greedy) = post(base.clone());
    let greedy_ids = {
        let (_, _, t) = call(
            server(),
            "/tokenize",
            Some(serde_json::json!({ "prompt": text(&greedy, 0) })),
            &[],
        );
        ids(&t["tokens"])
    };
    let with = |extra: serde_json::Value| {
        let mut body = base.clone();
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, v) = post(body.clone());
        assert_eq!(status, 200, "{body} -> {v}");
        v
    };
    // neutral values of every field change nothing
    let neutral = with(serde_json::json!({
        "n": 1, "best_of": 1, "suffix": "", "user": "u", "logprobs": null, "echo": false,
        "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
        "top_k": -1, "min_p": 0, "stop_token_ids": [], "stream": false, "top_p": 1, "seed": 0 }));
    assert_eq!(text(&neutral, 0), text(&greedy, 0));
    // a ban on the first greedy token changes the first token
    let first = greedy_ids[0].to_string();
    let banned = with(serde_json::json!({ "logit_bias": { first.clone(): -100 } }));
    assert_ne!(text(&banned, 0), text(&greedy, 0));
    let forced = with(serde_json::json!({ "logit_bias": { "50": 100 }, "max_tokens": 3 }));
    assert_eq!(text(&forced, 0), "SSS", "token 50 is `S`");
    // a stop token id ends the text before it
    let stop_at = greedy_ids[3];
    let stopped = with(serde_json::json!({ "stop_token_ids": [stop_at] }));
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert!(text(&greedy, 0).starts_with(text(&stopped, 0)));
    assert_eq!(stopped["usage"]["completion_tokens"], 3);
    // penalties: the greedy text repeats itself; a frequency penalty makes it change
    let long = serde_json::json!({ "max_tokens": 40 });
    let plain = with(long.clone());
    for penalty in [
        serde_json::json!({ "max_tokens": 40, "frequency_penalty": 2 }),
        serde_json::json!({ "max_tokens": 40, "presence_penalty": 2 }),
        serde_json::json!({ "max_tokens": 40, "repetition_penalty": 3 }),
    ] {
        let got = with(penalty.clone());
        assert_ne!(text(&got, 0), text(&plain, 0), "{penalty}");
    }
    // n choices: index order, each equal to a single request with seed + index
    let sampled = serde_json::json!({ "temperature": 0.9, "seed": 11, "max_tokens": 16, "top_k": 40, "min_p": 0.02 });
    let mut many = sampled.clone();
    many["n"] = 3.into();
    let three = with(many);
    for i in 0..3 {
        assert_eq!(three["choices"][i]["index"], i);
        let mut one = sampled.clone();
        one["seed"] = (11 + i).into();
        assert_eq!(text(&three, i), text(&with(one), 0), "choice {i}");
    }
    assert_ne!(text(&three, 0), text(&three, 1));
    assert_eq!(three["usage"]["completion_tokens"], 48);
    // prompt lists: strings and token ids, one choice each; ids give the text's completion
    let ids_of = |t: &str| {
        let (_, _, v) = call(
            server(),
            "/tokenize",
            Some(serde_json::json!({ "prompt": t })),
            &[],
        );
        v["tokens"].clone()
    };
    let listed = with(serde_json::json!({ "prompt": ["ROMEO:", "JULIET:"] }));
    let by_ids = with(serde_json::json!({ "prompt": [ids_of("ROMEO:"), ids_of("JULIET:")] }));
    let one_ids = with(serde_json::json!({ "prompt": ids_of("JULIET:") }));
    assert_eq!(text(&listed, 0), text(&greedy, 0));
    assert_eq!(text(&by_ids, 0), text(&greedy, 0));
    assert_eq!(text(&by_ids, 1), text(&listed, 1));
    assert_eq!(text(&one_ids, 0), text(&listed, 1));
    assert_eq!(
        listed["usage"]["prompt_tokens"],
        3 + ids(&ids_of("JULIET:")).len()
    );
    // streamed with several choices: every index gets its own text and finish chunk
    let chunks = stream_chunks(
        server(),
        "/v1/completions",
        serde_json::json!({ "prompt": ["ROMEO:", "JULIET:"], "max_tokens": 12, "temperature": 0,
                            "stream": true, "stream_options": { "include_usage": true } }),
    );
    let mut texts = [String::new(), String::new()];
    let mut finished = 0;
    for c in &chunks {
        if let Some(choice) = c["choices"].get(0) {
            let i = choice["index"].as_u64().expect("index") as usize;
            texts[i].push_str(choice["text"].as_str().unwrap_or(""));
            finished += usize::from(!choice["finish_reason"].is_null());
        }
    }
    assert_eq!(finished, 2);
    assert_eq!(
        [texts[0].as_str(), texts[1].as_str()],
        [text(&listed, 0), text(&listed, 1)]
    );
    let usage = &chunks.last().expect("chunks")["usage"];
    assert_eq!(usage["completion_tokens"], 24, "{usage}");
}

#[test]
fn context_limits_are_400s_before_any_work_and_length_keeps_the_text() {
    let newline = 198;
    let long: Vec<u32> = vec![newline; 500];
    let (status, e) = post(serde_json::json!({ "prompt": long, "max_tokens": 100 }));
    assert_eq!(status, 400);
    assert_eq!(
        e["error"]["message"],
        "this model's maximum context length is 512 tokens; the request needs 600: 500 in the \
         prompt, 100 to generate"
    );
    let too_long: Vec<u32> = vec![newline; 513];
    let (status, e) = post(serde_json::json!({ "prompt": too_long }));
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("the prompt has 513"),
        "{e}"
    );
    // the same limit for text, counted by the guest's tokenizer (" a" is one token)
    let (status, e) = post(serde_json::json!({ "prompt": " a".repeat(600), "max_tokens": 1 }));
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("the prompt has 600 tokens; this model's context is 512"),
        "{e}"
    );
    // without max_tokens, a generation that reaches the context ends there and keeps its text
    let (status, v) = post(serde_json::json!({ "prompt": long, "temperature": 0 }));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], 512);
    // a bad token id is the guest's 400
    let (status, e) = post(serde_json::json!({ "prompt": [1, 50257] }));
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("token id 50257"),
        "{e}"
    );
}

#[test]
fn chat_renders_the_template_and_a_model_without_one_says_so() {
    let messages = serde_json::json!([
        { "role": "system", "content": "A play." },
        { "role": "user", "content": [{ "type": "text", "text": "Speak, " }, { "type": "text", "text": "Romeo." }] }
    ]);
    let rendered = "SYSTEM: A play.\nUSER: Speak, Romeo.\nASSISTANT:";
    let (_, want) =
        post(serde_json::json!({ "prompt": rendered, "max_tokens": 10, "temperature": 0 }));
    let body = serde_json::json!({ "messages": messages, "max_tokens": 10, "temperature": 0,
                                   "logprobs": true, "top_logprobs": 2 });
    let (status, _, got) = call(server(), "/v1/chat/completions", Some(body.clone()), &[]);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["object"], "chat.completion");
    assert_eq!(got["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        got["choices"][0]["message"]["content"],
        want["choices"][0]["text"]
    );
    let content = got["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(content.len(), 10);
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(2));
    // streamed: the role first, then deltas that add up to the same text
    let mut streamed = body;
    streamed["stream"] = true.into();
    let chunks = stream_chunks(server(), "/v1/chat/completions", streamed);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    // a server whose model has no template
    let bare = start_server(&["gpt2"]);
    let (status, _, e) = call(
        &bare,
        "/v1/chat/completions",
        Some(serde_json::json!({ "messages": messages })),
        &[],
    );
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no chat template"),
        "{e}"
    );
}

#[test]
fn tokenizer_models_health_metrics_and_request_ids() {
    let s = server();
    let (status, id, v) = call(
        s,
        "/tokenize",
        Some(serde_json::json!({ "prompt": "ROMEO:" })),
        &[("x-request-id", "abc-1")],
    );
    assert_eq!(status, 200);
    assert_eq!(
        id[0].as_deref(),
        Some("abc-1"),
        "the client's request id comes back"
    );
    assert_eq!(v["tokens"], serde_json::json!([33676, 4720, 25]));
    assert_eq!(
        (v["count"].as_u64(), v["max_model_len"].as_u64()),
        (Some(3), Some(512))
    );
    let (_, _, v) = call(
        s,
        "/detokenize",
        Some(serde_json::json!({ "tokens": [33676, 4720, 25] })),
        &[],
    );
    assert_eq!(v["prompt"], "ROMEO:");
    let (status, _, v) = call(
        s,
        "/detokenize",
        Some(serde_json::json!({ "tokens": [99999] })),
        &[],
    );
    assert_eq!(status, 400, "{v}");
    let (_, id, v) = call(s, "/v1/models", None, &[]);
    assert!(
        id[0].as_deref().is_some_and(|id| !id.is_empty()),
        "a request id is made"
    );
    assert_eq!(v["data"][0]["max_model_len"], 512);
    let (_, _, v) = call(s, "/health", None, &[]);
    assert_eq!(v["status"], "ok");
    // metrics move with a completion
    let count = |text: &str, name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (_, _, before) = call(s, "/metrics", None, &[]);
    let before = before.as_str().expect("text").to_owned();
    let (status, _) = post(serde_json::json!({ "prompt": "ROMEO:", "max_tokens": 5 }));
    assert_eq!(status, 200);
    let (status, _, after) = call(s, "/metrics", None, &[]);
    assert_eq!(status, 200);
    let after = after.as_str().expect("text");
    for (name, at_least) in [
        ("wasi_nn_generation_tokens_total", 5.0),
        ("wasi_nn_prompt_tokens_total", 3.0),
        ("wasi_nn_time_to_first_token_seconds_count", 1.0),
        ("wasi_nn_inter_token_seconds_count", 4.0),
        (
            "wasi_nn_http_requests_total{route=\"/v1/completions\",status=\"200\"}",
            1.0,
        ),
        // a step a token, and the guest's turn between them
        ("wasi_nn_cycle_count_total{part=\"step\"}", 5.0),
        ("wasi_nn_cycle_count_total{part=\"guest\"}", 4.0),
        ("wasi_nn_request_seconds_count", 1.0),
        ("wasi_nn_queue_seconds_count", 1.0),
    ] {
        let moved = count(after, name) - count(&before, name);
        assert!(moved >= at_least, "{name} moved by {moved}\n{after}");
    }
    assert!(after.contains("wasi_nn_guests_running"));
    // the run-ahead outcomes are there whether the device runs ahead or not
    for outcome in ["hit", "miss", "late"] {
        let line = format!("wasi_nn_run_ahead_total{{outcome=\"{outcome}\"}}");
        assert!(after.contains(&line), "no {line}\n{after}");
    }
    // the gauges an inference gateway's endpoint picker reads, by vLLM's names, equal ours;
    // the KV pools are held by open contexts only (none is open between requests here,
    // unless another test's runs)
    for (ours, picker) in [
        ("wasi_nn_requests_queued", "vllm:num_requests_waiting"),
        ("wasi_nn_guests_running", "vllm:num_requests_running"),
        ("wasi_nn_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
        ("wasi_nn_kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc"),
    ] {
        let gauge = |name: &str| {
            after
                .lines()
                .find(|l| l.split(' ').next() == Some(name))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no gauge {name}\n{after}"))
        };
        assert_eq!(gauge(ours), gauge(picker), "{picker}");
        assert!((0.0..=1.0).contains(&gauge("wasi_nn_kv_cache_usage_ratio")));
    }
    let step_seconds = count(after, "wasi_nn_cycle_seconds_total{part=\"step\"}")
        - count(&before, "wasi_nn_cycle_seconds_total{part=\"step\"}");
    assert!(step_seconds > 0.0, "{after}");
    // the heaps: this test runs on the system allocator, so glibc's holds the Rust side too
    assert!(after.contains("wasi_nn_heap_bytes{allocator=\"jemalloc\"}"));
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        let libc = count(after, "wasi_nn_heap_bytes{allocator=\"libc\"}");
        assert!(libc > 1e6, "glibc's heap holds {libc} bytes\n{after}");
    }
    // the demo page
    let (status, _, page) = call(s, "/", None, &[]);
    assert_eq!(status, 200);
    assert!(page.as_str().is_some_and(|p| p.contains("/v1/completions")));
}

#[test]
fn api_key_queue_and_body_limits() {
    let s = start_server_with(&["gpt2"], |c| {
        c.api_key = Some("sesame".into());
        c.max_concurrent = Some(1);
        c.max_queue = 0;
        c.max_body_bytes = 4096;
    });
    let body = serde_json::json!({ "prompt": "ROMEO:", "max_tokens": 2 });
    let (status, _, e) = call(&s, "/v1/completions", Some(body.clone()), &[]);
    assert_eq!(status, 401, "{e}");
    let (status, _, _) = call(
        &s,
        "/v1/completions",
        Some(body.clone()),
        &[("authorization", "Bearer nope")],
    );
    assert_eq!(status, 401);
    let auth = [("authorization", "Bearer sesame")];
    let (status, _, v) = call(&s, "/v1/completions", Some(body.clone()), &auth);
    assert_eq!(status, 200, "{v}");
    let (status, _, _) = call(&s, "/health", None, &[]);
    assert_eq!(status, 200, "health needs no key");
    // one guest at a time and no queue: a second request while a stream runs gets 429
    let address = s.url.trim_start_matches("http://").to_owned();
    let long = r#"{"prompt":"ROMEO:","max_tokens":400,"temperature":0.9,"stream":true}"#;
    let (socket, _) = open_stream(&address, long, Some("sesame"));
    let (status, named, e) = call(&s, "/v1/completions", Some(body.clone()), &auth);
    assert_eq!(status, 429, "{e}");
    assert_eq!(named[1].as_deref(), Some("1"), "Retry-After");
    drop(socket);
    // a body over the limit
    let big = serde_json::json!({ "prompt": "x".repeat(5000) });
    let (status, _, _) = call(&s, "/v1/completions", Some(big), &auth);
    assert_eq!(status, 413);
}

#[test]
fn shutdown_lets_a_stream_in_flight_finish() {
    let (address, _, stop, server) = serve_until_stopped(ServiceConfig::default());
    let body = r#"{"prompt":"ROMEO:","max_tokens":60,"temperature":0,"stream":true}"#;
    let (mut socket, mut seen) = open_stream(&address, body, None);
    let mut buf = [0u8; 4096];
    stop.send(()).expect("signal");
    // the stream in flight runs to its end
    loop {
        let n = socket.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&seen).contains("[DONE]") {
            break;
        }
    }
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains("\"finish_reason\":\"length\""), "{seen}");
    assert!(seen.contains("[DONE]"));
    drop(socket);
    server.join().expect("server thread").expect("served");
    assert!(
        std::net::TcpStream::connect(&address).is_err(),
        "no longer listening"
    );
}

#[test]
fn streamed_logprobs_and_echo_equal_the_whole_answer() {
    let body = serde_json::json!({ "prompt": ["ROMEO:", "JULIET:"], "n": 2, "max_tokens": 10,
                                   "temperature": 0.7, "seed": 3, "logprobs": 2, "echo": true });
    let (status, whole) = post(body.clone());
    assert_eq!(status, 200, "{whole}");
    let mut streamed = body;
    streamed["stream"] = true.into();
    let chunks = stream_chunks(server(), "/v1/completions", streamed);
    for i in 0..4 {
        let mut text = String::new();
        let (mut tokens, mut values, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
        for c in &chunks {
            let choice = &c["choices"][0];
            if choice["index"] != i {
                continue;
            }
            text.push_str(choice["text"].as_str().unwrap_or(""));
            if let Some(lp) = choice["logprobs"].as_object() {
                tokens.extend(lp["tokens"].as_array().expect("tokens").clone());
                values.extend(lp["token_logprobs"].as_array().expect("values").clone());
                offsets.extend(lp["text_offset"].as_array().expect("offsets").clone());
            }
        }
        let want = &whole["choices"][i];
        assert_eq!(text, want["text"].as_str().expect("text"), "choice {i}");
        assert_eq!(
            tokens,
            *want["logprobs"]["tokens"].as_array().expect("tokens")
        );
        // equal within the CPU's tolerance: a step batched with other contexts may sum in
        // another order than one run alone
        let want_values = want["logprobs"]["token_logprobs"]
            .as_array()
            .expect("values");
        assert_eq!(values.len(), want_values.len(), "choice {i}");
        for (got, want) in values.iter().zip(want_values) {
            match (got.as_f64(), want.as_f64()) {
                (Some(a), Some(b)) => assert!((a - b).abs() <= 1e-4, "choice {i}: {a} vs {b}"),
                _ => assert_eq!(got, want, "choice {i}"),
            }
        }
        assert_eq!(
            offsets,
            *want["logprobs"]["text_offset"].as_array().expect("offsets")
        );
        assert!(values[0].is_null(), "the prompt's first token has none");
    }
}

#[test]
fn a_draining_service_fails_its_health_check_while_it_still_serves() {
    let delay = Duration::from_secs(3);
    let config = ServiceConfig {
        shutdown_delay: delay,
        shutdown_grace: Duration::from_secs(5),
        ..Default::default()
    };
    let (address, service, stop, server) = serve_until_stopped(config);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let health = || {
        let mut r = agent
            .get(&format!("http://{address}/health"))
            .call()
            .expect("health");
        let body: serde_json::Value = r.body_mut().read_json().expect("json");
        (r.status().as_u16(), body["status"].clone())
    };
    assert_eq!(health(), (200, "ok".into()));
    let signalled = Instant::now();
    stop.send(()).expect("signal");
    let start = Instant::now();
    while !service.draining() {
        assert!(start.elapsed() < Duration::from_secs(1), "not draining");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(health(), (503, "draining".into()));
    // still accepting: a new connection gets its completion (it may take longer than the
    // delay on a loaded machine; it must have connected within it)
    assert!(
        signalled.elapsed() < delay / 2,
        "the request comes too late to prove anything"
    );
    let body = serde_json::json!({ "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0 });
    let response = ureq::post(&format!("http://{address}/v1/completions"))
        .send_json(&body)
        .expect("a completion while draining");
    assert_eq!(response.status().as_u16(), 200);
    server.join().expect("server thread").expect("served");
    assert!(
        signalled.elapsed() >= delay,
        "serve returned before the delay was over"
    );
    assert!(
        std::net::TcpStream::connect(&address).is_err(),
        "connections are refused once the service stopped"
    );
}

#[test]
fn streams_past_the_shutdown_deadline_are_cancelled() {
    let config = ServiceConfig {
        shutdown_grace: Duration::from_millis(200),
        ..Default::default()
    };
    let (address, service, stop, server) = serve_until_stopped(config);
    // 500 tokens take over a second on the CPU: well past the deadline
    let body = r#"{"prompt":"ROMEO:","max_tokens":500,"temperature":0,"stream":true}"#;
    let (_socket, _) = open_stream(&address, body, None);
    let signalled = Instant::now();
    stop.send(()).expect("signal");
    server.join().expect("server thread").expect("served");
    let took = signalled.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "serve returned after {took:?}"
    );
    // the guest stops at its next token
    let start = Instant::now();
    while service.active() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the guest still runs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
