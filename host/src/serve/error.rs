//! A request's error answer: [`ApiError`], OpenAI-style (`{"error": {"message", "type",
//! "code"}}` with an HTTP status), which every 4xx and 5xx carries.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// An OpenAI-style error answer: `{"error": {"message": ..., "type": ..., "code": ...}}`
/// with a status.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    kind: &'static str,
    pub message: String,
    /// Seconds after which the client may retry (429 and 503).
    retry_after: Option<u32>,
}

#[derive(Serialize)]
pub(crate) struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: u16,
}

impl<'a> ErrorBody<'a> {
    pub(crate) fn new(kind: &'a str, message: &'a str, status: StatusCode) -> Self {
        Self {
            error: ErrorDetail {
                message,
                kind,
                code: status.as_u16(),
            },
        }
    }
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub(crate) fn server_error(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 503: every instance slot is taken; the client may retry.
    pub(crate) fn busy(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_busy", message);
        e.retry_after = Some(1);
        e
    }

    /// 429: the queue is full.
    pub(crate) fn too_many(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
        e.retry_after = Some(1);
        e
    }

    pub(crate) fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key: send `Authorization: Bearer KEY`",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(self.kind, &self.message, self.status);
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
