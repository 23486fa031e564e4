//! One client's streamed completions over HTTP/1.1, asynchronously: the clients share a few
//! threads (`--client-threads`) instead of a thread each. On the machine it measures, a
//! blocked thread a stream is woken for every chunk, and those wake-ups and switches take
//! cores from the service; a thread serving many connections reads the chunks that arrived
//! together in one go.

use crate::chunk::{self, Event};
use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// What one streamed completion looked like from the client.
pub struct Stream {
    /// From sending the request to the first piece with text (or, with none, to the final
    /// chunk of a completion that has tokens).
    pub ttft_ms: Option<f64>,
    /// Between successive pieces, in ms.
    pub gaps_ms: Vec<f64>,
    /// `usage.completion_tokens` of the final chunk.
    pub tokens: usize,
    pub text: String,
}

/// Where the service is: `http://host:port` (no TLS).
#[derive(Clone)]
pub struct Target {
    /// `host:port`, for the connection and the `Host` header.
    authority: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Self> {
        let uri: Uri = url.parse().with_context(|| format!("--url {url}"))?;
        if uri.scheme_str() != Some("http") {
            bail!("--url {url}: only http:// URLs are supported");
        }
        if !matches!(uri.path(), "" | "/") {
            bail!("--url {url}: a path is not supported (the routes are the service's own)");
        }
        let authority = uri.authority().context("--url has no host")?;
        let port = authority.port_u16().unwrap_or(80);
        Ok(Self {
            authority: format!("{}:{port}", authority.host()),
        })
    }
}

/// One client: its connection, kept open across its requests (the thread-a-stream client before
/// it opened one a request: it returned at `[DONE]`, before its body's end, so its pool never
/// got the connection back).
pub struct Client {
    target: Target,
    sender: Option<SendRequest<Full<Bytes>>>,
    timeout: Duration,
}

impl Client {
    /// A client of `target` whose every request (its whole stream) is bounded by `timeout`.
    pub fn new(target: Target, timeout: Duration) -> Self {
        Self {
            target,
            sender: None,
            timeout,
        }
    }

    /// The open connection (and `true`: it served a request before), or a new one if there
    /// is none or the last one closed.
    async fn ready(&mut self) -> Result<(&mut SendRequest<Full<Bytes>>, bool)> {
        if let Some(sender) = self.sender.as_mut() {
            if sender.ready().await.is_ok() {
                let sender = self.sender.as_mut().context("the connection went away")?;
                return Ok((sender, true));
            }
        }
        let tcp = TcpStream::connect(&self.target.authority)
            .await
            .with_context(|| format!("connecting to {}", self.target.authority))?;
        // a request is one small write; don't hold it back for an acknowledgement
        tcp.set_nodelay(true)?;
        let (sender, connection) = http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(async move {
            // the connection's errors reach the request that was using it
            let _ = connection.await;
        });
        Ok((self.sender.insert(sender), false))
    }

    /// Stream one completion: POST `body` (JSON) to `/v1/completions` and read its events
    /// until the body ends.
    pub async fn stream(&mut self, body: &serde_json::Value) -> Result<Stream> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.stream_unbounded(body)).await {
            Ok(result) => result,
            Err(_) => {
                // the connection may still carry the rest of that stream
                self.sender = None;
                bail!("no complete answer within {} s", timeout.as_secs_f64())
            }
        }
    }

    async fn stream_unbounded(&mut self, body: &serde_json::Value) -> Result<Stream> {
        let bytes = Bytes::from(serde_json::to_vec(body)?);
        let request = || {
            Request::post("/v1/completions")
                .header(HOST, &self.target.authority)
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(bytes.clone()))
        };
        let (first, second) = (request()?, request()?);
        let sent = Instant::now();
        let (sender, reused) = self.ready().await?;
        let response = match sender.send_request(first).await {
            Ok(response) => response,
            // A kept connection the server closed between requests (its close not seen yet)
            // fails before any answer: the request goes once more on a new connection, as a
            // pooling client retries it (a completion request is safe to repeat).
            Err(_) if reused => {
                self.sender = None;
                let (sender, _) = self.ready().await?;
                sender.send_request(second).await?
            }
            Err(e) => return Err(e.into()),
        };
        let status = response.status();
        if !status.is_success() {
            let bytes = response.into_body().collect().await?.to_bytes();
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes));
        }
        read_events(response.into_body(), sent).await
    }
}

/// The streamed events of a completion's body, each line timed when this task reads its frame
/// (after the client threads' own queueing, which `--client-threads` bounds).
async fn read_events(mut body: Incoming, sent: Instant) -> Result<Stream> {
    let mut reader = Events::new(sent);
    let mut pending: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let now = Instant::now();
        pending.extend_from_slice(&data);
        let mut start = 0;
        while let Some(end) = pending[start..].iter().position(|&b| b == b'\n') {
            let line = std::str::from_utf8(&pending[start..start + end])
                .context("a streamed line is not UTF-8")?;
            reader.line(line, now)?;
            start += end + 1;
        }
        pending.drain(..start);
    }
    // the body has ended (read to its end, the connection serves the next request)
    reader.finish()
}

/// The events of one stream read so far.
struct Events {
    sent: Instant,
    ttft: Option<Duration>,
    last: Option<Instant>,
    gaps_ms: Vec<f64>,
    text: String,
    tokens: Option<u64>,
    done: bool,
}

impl Events {
    fn new(sent: Instant) -> Self {
        Self {
            sent,
            ttft: None,
            last: None,
            gaps_ms: Vec::new(),
            text: String::new(),
            tokens: None,
            done: false,
        }
    }

    /// One line of the body, read at `now`.
    fn line(&mut self, line: &str, now: Instant) -> Result<()> {
        let Some(data) = line.trim_end_matches('\r').strip_prefix("data: ") else {
            return Ok(());
        };
        if self.done {
            bail!("data after [DONE]");
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let piece = match chunk::parse(data)? {
            Event::Usage(n) => {
                self.tokens = Some(n);
                if self.ttft.is_none() && n > 0 {
                    self.ttft = Some(now - self.sent);
                }
                return Ok(());
            }
            Event::Nothing => return Ok(()),
            Event::Text(piece) => piece,
        };
        self.text.push_str(&piece);
        match self.last {
            Some(last) => self.gaps_ms.push((now - last).as_secs_f64() * 1e3),
            None => self.ttft = Some(now - self.sent),
        }
        self.last = Some(now);
        Ok(())
    }

    fn finish(self) -> Result<Stream> {
        if !self.done {
            bail!("stream ended without [DONE]");
        }
        let tokens = self.tokens.context("stream ended without usage")?;
        Ok(Stream {
            ttft_ms: self.ttft.map(|t| t.as_secs_f64() * 1e3),
            gaps_ms: self.gaps_ms,
            tokens: tokens as usize,
            text: self.text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_reads_its_pieces_usage_and_done() -> Result<()> {
        let sent = Instant::now();
        let mut events = Events::new(sent);
        let later = sent + Duration::from_millis(5);
        events.line(r#"data: {"choices":[{"text":"Hel"}]}"#, later)?;
        events.line("", later)?;
        let after = later + Duration::from_millis(2);
        events.line(r#"data: {"choices":[{"text":"lo"}]}"#, after)?;
        events.line(
            r#"data: {"choices":[],"usage":{"completion_tokens":2}}"#,
            after,
        )?;
        events.line("data: [DONE]", after)?;
        let stream = events.finish()?;
        assert_eq!(stream.text, "Hello");
        assert_eq!(stream.tokens, 2);
        assert_eq!(stream.gaps_ms, vec![2.0]);
        assert_eq!(stream.ttft_ms, Some(5.0));
        Ok(())
    }

    #[test]
    fn a_stream_without_done_or_usage_or_with_data_after_done_fails() -> Result<()> {
        let sent = Instant::now();
        let mut events = Events::new(sent);
        events.line(r#"data: {"choices":[{"text":"a"}]}"#, sent)?;
        assert!(events.finish().is_err());
        let mut events = Events::new(sent);
        events.line("data: [DONE]", sent)?;
        assert!(events.finish().is_err());
        let mut events = Events::new(sent);
        events.line("data: [DONE]", sent)?;
        assert!(events
            .line(r#"data: {"choices":[{"text":"a"}]}"#, sent)
            .is_err());
        Ok(())
    }

    #[test]
    fn only_http_urls_are_targets() -> Result<()> {
        assert_eq!(
            Target::parse("http://127.0.0.1:18125")?.authority,
            "127.0.0.1:18125"
        );
        assert_eq!(Target::parse("http://localhost")?.authority, "localhost:80");
        assert!(Target::parse("https://example.com").is_err());
        assert!(Target::parse("http://localhost:8000/prefix").is_err());
        Ok(())
    }
}
