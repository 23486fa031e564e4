//! The HTTP service (`wasi_nn_host::serve`) end to end: a real server on a loopback port
//! running the guest component, a real HTTP client, and the CLI (`gpt2.wasm --json`) as the
//! reference for the text.

use integration_tests::*;
use std::io::{BufRead, Read, Write};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use wasi_nn_host::serve::{Service, ServiceConfig};
use wasi_nn_host::{Device, GuestModule, HostBuilder, RunOptions};

struct Server {
    url: String,
    service: Arc<Service>,
    host: Arc<wasi_nn_host::Host>,
    /// The command guest, for the CLI's answers.
    module: GuestModule,
}

/// One server for the whole test binary.
fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| start_server(&["gpt2"]))
}

/// A server on a loopback port, on its own runtime thread, serving the default model under
/// each of `graphs` (the first is the default model).
fn start_server(graphs: &[&str]) -> Server {
    let mut builder = HostBuilder::new(Device::Cpu);
    for name in graphs {
        builder = builder.graph(name, &shakespeare_dir()).expect("model");
    }
    let host = Arc::new(builder.build().expect("host"));
    let component = host
        .load_component(&gpt2_component())
        .expect("compile component");
    let module = host.load_module(&gpt2_wasm()).expect("compile module");
    let config = ServiceConfig {
        default_model: graphs[0].to_owned(),
        ..Default::default()
    };
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

/// The streamed text pieces and the final chunk.
fn stream(body: serde_json::Value) -> (Vec<String>, serde_json::Value) {
    let response = ureq::post(&format!("{}/v1/completions", server().url))
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
    let (mut pieces, mut last) = (Vec::new(), serde_json::Value::Null);
    for line in reader.lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return (pieces, last);
        }
        let chunk: serde_json::Value = serde_json::from_str(data).expect("chunk");
        let choice = &chunk["choices"][0];
        if choice["finish_reason"].is_null() {
            pieces.push(choice["text"].as_str().expect("text").to_owned());
        } else {
            last = chunk;
        }
    }
    panic!("stream ended without [DONE]");
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
    let mut socket = std::net::TcpStream::connect(address).expect("connect");
    let body = r#"{"prompt":"ROMEO:","max_tokens":500,"temperature":0.9,"stream":true}"#;
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    // read until the first piece arrives, then hang up
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = socket.read(&mut buf).expect("read");
        assert!(n > 0, "stream closed early");
        seen.extend_from_slice(&buf[..n]);
    }
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
