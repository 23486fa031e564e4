//! The HTTP layer: the route table, what every request passes through (its request id,
//! `tracing` span, log line and counter; the API key on the guarded routes), and serving on
//! a listener with graceful shutdown.

use super::completions::{chat_completions, completions};
use super::error::ApiError;
use super::info::{demo_page, health, metrics_text, models};
use super::metrics;
use super::request::{new_request_id, RequestId};
use super::tokenizer::{detokenize, tokenize};
use super::{ServeError, Service};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

/// The service's routes.
pub fn router(service: Arc<Service>) -> Router {
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(
            service.clone(),
            check_api_key,
        ));
    Router::new()
        .route("/", get(demo_page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(guarded)
        .layer(DefaultBodyLimit::max(service.config.max_body_bytes))
        .layer(middleware::from_fn(request_context))
        .with_state(service)
}

/// Each streamed token is a small write of its own: without TCP_NODELAY, Nagle's algorithm
/// holds it until the client acknowledges the one before, which a client's delayed
/// acknowledgement can put off by tens of milliseconds (40 ms stalls in the gaps of a client
/// reading many streams on two threads).
fn prepare_connection(tcp: &mut tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("cannot set TCP_NODELAY on a connection: {e}");
    }
}

/// Serve `service` on `listener` until `shutdown` completes; then drain: answer `/health`
/// with 503 while still accepting for
/// [`ServiceConfig::shutdown_delay`](super::ServiceConfig::shutdown_delay), stop accepting,
/// let the requests in flight finish for up to
/// [`ServiceConfig::shutdown_grace`](super::ServiceConfig::shutdown_grace), and cancel the
/// rest.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let signalled = Arc::new(tokio::sync::Notify::new());
    let notify = signalled.clone();
    let draining = service.clone();
    let listener = listener.tap_io(prepare_connection);
    let server =
        axum::serve(listener, router(service.clone())).with_graceful_shutdown(async move {
            shutdown.await;
            draining.draining.store(true, Ordering::Relaxed);
            let delay = draining.config.shutdown_delay;
            if !delay.is_zero() {
                tracing::info!("draining: /health answers 503; accepting for {delay:?} more");
                tokio::time::sleep(delay).await;
            }
            tracing::info!("shutting down: no new connections; finishing the requests in flight");
            notify.notify_one();
        });
    let grace = service.config.shutdown_grace;
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served.map_err(ServeError::Http),
        () = async { signalled.notified().await; tokio::time::sleep(grace).await } => {
            tracing::warn!(
                "shutdown deadline of {grace:?} passed: cancelling {} guests",
                service.active()
            );
            service.stopping.store(true, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// Every request: its id (echoed in `x-request-id`), a `tracing` span, a log line and the
/// request counter.
async fn request_context(mut request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(new_request_id, str::to_owned);
    let route = request.uri().path().to_owned();
    let span = tracing::info_span!("request", id = %id, method = %request.method(), route = %route);
    request.extensions_mut().insert(RequestId(id.clone()));
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status().as_u16();
    span.in_scope(|| {
        tracing::info!(
            status,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "answered"
        )
    });
    metrics::request(&route, status);
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// The API key check of the guarded routes.
async fn check_api_key(
    State(service): State<Arc<Service>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &service.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Equal, in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::prepare_connection;

    #[tokio::test]
    async fn accepted_connections_send_small_writes_at_once() -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let client = tokio::net::TcpStream::connect(listener.local_addr()?).await?;
        let (mut accepted, _) = listener.accept().await?;
        assert!(
            !accepted.nodelay()?,
            "a socket starts with Nagle's algorithm on"
        );
        prepare_connection(&mut accepted);
        assert!(accepted.nodelay()?);
        drop(client);
        Ok(())
    }
}
