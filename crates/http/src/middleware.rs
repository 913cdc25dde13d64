//! Cross-cutting HTTP behaviour, in the order a request meets it:
//! 1. [`request_context`]: request id, error-body rendering, metrics, request log;
//! 2. [`authenticate`]: `x-api-key` to a scope of this listener's environment;
//! 3. [`rate_limit`]: a token bucket per key, 429 with `retry-after` and
//!    `x-ratelimit-*` headers;
//! 4. [`idempotency`]: `idempotency-key` replay for POSTs (24 h, survives restarts);
//! 5. [`write_gate`]: 503 for writes while the engine takes none.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tally_engine::stores::{key_digest, AuthError};
use tokio::sync::watch;

use crate::error::ApiError;
use crate::extract::read_body_limited;
use crate::AppState;

pub const REQUEST_ID_HEADER: &str = "x-request-id";
pub const API_KEY_HEADER: &str = "x-api-key";
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";
/// How long an idempotency key is remembered (docs/api.md: 24 h).
pub const IDEMPOTENCY_TTL_MS: i64 = 24 * 60 * 60 * 1000;
/// Longest accepted idempotency key.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;
/// Token buckets kept before idle ones are evicted (bounds memory under key churn).
pub const MAX_RATE_LIMIT_BUCKETS: usize = 100_000;

/// The request id, in request extensions for handlers and logs.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

pub async fn request_context(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let request_id = format!("req_{}", tally_engine::ids::random_base62(20));
    request
        .extensions_mut()
        .insert(RequestId(request_id.clone()));
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let mut response = next.run(request).await;
    if let Some(error) = response.extensions_mut().remove::<ApiError>() {
        let headers = std::mem::take(response.headers_mut());
        let mut rendered = (error.status, axum::Json(error.body(&request_id))).into_response();
        for (name, value) in headers.iter() {
            if name != axum::http::header::CONTENT_TYPE
                && name != axum::http::header::CONTENT_LENGTH
            {
                rendered.headers_mut().insert(name.clone(), value.clone());
            }
        }
        if error.status.is_server_error() {
            tracing::warn!(request_id, status = error.status.as_u16(), message = %error.message, "request failed");
        }
        response = rendered;
    }
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    let status = response.status().as_u16();
    let elapsed = started.elapsed();
    state
        .engine
        .metrics()
        .record_request(method.as_str(), &route, status, elapsed);
    tracing::debug!(request_id, method = %method, route, status, elapsed_us = elapsed.as_micros() as u64, "request");
    response
}

/// Resolves `x-api-key` to the scope and stores it in the request extensions.
pub async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let key = request
        .headers()
        .get(API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    match state
        .engine
        .directory()
        .authenticate(key.as_deref(), state.mode)
    {
        Ok(scope) => {
            request.extensions_mut().insert(scope);
            request
                .extensions_mut()
                .insert(KeyDigest(key_digest(key.as_deref().unwrap_or(""))));
            next.run(request).await
        }
        Err(error) => {
            let (code, message) = match error {
                AuthError::Missing => ("api_key_missing", "no API key: send it in the `x-api-key` header".to_string()),
                AuthError::Unknown => ("api_key_invalid", "the API key is not valid".to_string()),
                AuthError::WrongEnvironment { key_mode } => (
                    "api_key_wrong_environment",
                    format!(
                        "this is a {key_mode} key, and this listener serves {}; send {key_mode} keys to the {} listener",
                        state.mode,
                        if key_mode == tally_domain::Mode::Test { "test (--test-listen)" } else { "production (--listen)" }
                    ),
                ),
            };
            ApiError::new(StatusCode::UNAUTHORIZED, code, message).into_response()
        }
    }
}

/// SHA-256 of the caller's key: identifies the key for rate limits and idempotency
/// without keeping the secret around.
#[derive(Debug, Clone)]
pub struct KeyDigest(pub Vec<u8>);

/// A token bucket per API key.
#[derive(Debug)]
pub struct RateLimiter {
    pub per_second: f64,
    pub burst: f64,
    buckets: DashMap<Vec<u8>, (f64, Instant)>,
}

pub struct RateDecision {
    allowed: bool,
    remaining: u64,
    /// Seconds until a token is available (when refused) or the bucket is full.
    reset_seconds: u64,
}

impl RateLimiter {
    pub fn new(per_second: u32, burst: u32) -> RateLimiter {
        RateLimiter {
            per_second: per_second.max(1) as f64,
            burst: burst.max(1) as f64,
            buckets: DashMap::new(),
        }
    }

    pub fn check(&self, key: &[u8]) -> RateDecision {
        let now = Instant::now();
        if self.buckets.len() > MAX_RATE_LIMIT_BUCKETS {
            let idle = Duration::from_secs_f64(self.burst / self.per_second);
            self.buckets
                .retain(|_, (_, at)| now.duration_since(*at) < idle);
        }
        let mut bucket = self
            .buckets
            .entry(key.to_vec())
            .or_insert((self.burst, now));
        let (tokens, at) = *bucket;
        let refilled =
            (tokens + now.duration_since(at).as_secs_f64() * self.per_second).min(self.burst);
        if refilled >= 1.0 {
            *bucket = (refilled - 1.0, now);
            RateDecision {
                allowed: true,
                remaining: (refilled - 1.0).floor() as u64,
                reset_seconds: ((self.burst - refilled + 1.0) / self.per_second).ceil() as u64,
            }
        } else {
            *bucket = (refilled, now);
            RateDecision {
                allowed: false,
                remaining: 0,
                reset_seconds: ((1.0 - refilled) / self.per_second).ceil().max(1.0) as u64,
            }
        }
    }
}

pub async fn rate_limit(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let key = request
        .extensions()
        .get::<KeyDigest>()
        .map(|k| k.0.clone())
        .unwrap_or_default();
    let decision = state.limiter.check(&key);
    let mut response = if decision.allowed {
        next.run(request).await
    } else {
        let mut refused = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!(
                "too many requests for this API key (limit {} per second); retry after {} s",
                state.limiter.per_second, decision.reset_seconds
            ),
        )
        .into_response();
        refused
            .headers_mut()
            .insert("retry-after", HeaderValue::from(decision.reset_seconds));
        refused
    };
    let headers = response.headers_mut();
    headers.insert(
        "x-ratelimit-limit",
        HeaderValue::from(state.limiter.per_second as u64),
    );
    headers.insert(
        "x-ratelimit-remaining",
        HeaderValue::from(decision.remaining),
    );
    headers.insert(
        "x-ratelimit-reset",
        HeaderValue::from(decision.reset_seconds),
    );
    response
}

/// Refuses writes (anything but GET and HEAD) with 503 before any lock or check while
/// the engine takes none: before the projection caught up after a start, after the
/// projector or the log failed, while the projection lags. Reads are served.
pub async fn write_gate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    // Previews are POSTs that write nothing.
    let read_only = matches!(*request.method(), Method::GET | Method::HEAD)
        || request.uri().path().ends_with("/preview");
    if read_only {
        return next.run(request).await;
    }
    match state.engine.check_writable() {
        Ok(()) => next.run(request).await,
        Err(error) => ApiError::from(error).into_response(),
    }
}

/// Keys being processed right now, each with a signal that turns true when its
/// request has finished (and its response, if final, is saved). A concurrent retry
/// waits for it instead of running twice.
pub type InflightIdempotency = Arc<DashMap<Vec<u8>, watch::Receiver<bool>>>;

/// How long a request with an `idempotency-key` may run in the background after its
/// client stopped waiting (`outcome_pending`): the write is durable, and its final
/// response is saved for the retry when the projector gets to it.
pub const IDEMPOTENT_BACKGROUND_WAIT_MS: u64 = 10 * 60 * 1000;

/// A saved response (`aux` space, key `idem\0<api key digest>\0<idempotency key>`).
#[derive(Debug, Serialize, Deserialize)]
struct SavedResponse {
    fingerprint: String,
    status: u16,
    body: String,
    created_at_ms: i64,
}

fn idempotency_storage_key(digest: &[u8], key: &str) -> Vec<u8> {
    let mut storage = b"idem\x00".to_vec();
    storage.extend_from_slice(digest);
    storage.push(0);
    storage.extend_from_slice(key.as_bytes());
    storage
}

/// Whether a response is remembered: final answers are, failures the caller should
/// retry (auth, rate limit, server errors, lag) are not.
fn remembered(status: StatusCode) -> bool {
    !(status.is_server_error() || matches!(status.as_u16(), 401 | 403 | 429))
}

/// Removes its in-flight entry and signals waiters when dropped: also when the
/// handler panicked, so a key is never left "in use".
struct InflightGuard {
    inflight: InflightIdempotency,
    key: Vec<u8>,
    done: watch::Sender<bool>,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.inflight.remove(&self.key);
        self.done.send_replace(true);
    }
}

/// What the saved entry says about this request.
enum Saved {
    None,
    Replay(Response),
    Conflict(Response),
}

fn saved_response(
    state: &AppState,
    storage_key: &[u8],
    fingerprint: &str,
    now: i64,
) -> Result<Saved, Response> {
    let saved = match state.engine.store().aux_get(storage_key) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Ok(Saved::None),
        Err(e) => return Err(ApiError::internal(format!("idempotency store: {e}")).into_response()),
    };
    let Ok(saved) = serde_json::from_slice::<SavedResponse>(&saved) else {
        return Ok(Saved::None);
    };
    if now - saved.created_at_ms >= IDEMPOTENCY_TTL_MS {
        return Ok(Saved::None);
    }
    if saved.fingerprint != fingerprint {
        return Ok(Saved::Conflict(
            ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "this idempotency-key was used with a different request; use a new key",
            )
            .with_param("idempotency-key")
            .into_response(),
        ));
    }
    let mut response = Response::new(Body::from(saved.body));
    *response.status_mut() = StatusCode::from_u16(saved.status).unwrap_or(StatusCode::OK);
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response.headers_mut().insert(
        HeaderName::from_static("idempotent-replayed"),
        HeaderValue::from_static("true"),
    );
    Ok(Saved::Replay(response))
}

fn key_in_use() -> Response {
    ApiError::new(
        StatusCode::CONFLICT,
        "idempotency_key_in_use",
        "a request with this idempotency-key is still being processed; retry with the same key shortly",
    )
    .into_response()
}

pub async fn idempotency(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let Some(key) = request
        .headers()
        .get(IDEMPOTENCY_HEADER)
        .map(|v| v.to_str().map(str::to_string))
    else {
        return next.run(request).await;
    };
    let key = match key {
        Ok(k) if !k.trim().is_empty() && k.chars().count() <= MAX_IDEMPOTENCY_KEY_CHARS => k,
        _ => {
            return ApiError::bad_request(
                "idempotency_key_invalid",
                format!(
                    "`idempotency-key` must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} visible characters"
                ),
            )
            .into_response()
        }
    };
    let digest = request
        .extensions()
        .get::<KeyDigest>()
        .map(|k| k.0.clone())
        .unwrap_or_default();
    let path = request.uri().path().to_string();
    let (parts, body) = match read_body_limited(request).await {
        Ok(pair) => pair,
        Err(error) => return error.into_response(),
    };
    let mut hasher = Sha256::new();
    hasher.update(path.as_bytes());
    hasher.update([0]);
    hasher.update(&body);
    let fingerprint = hex::encode(hasher.finalize());
    let storage_key = idempotency_storage_key(&digest, &key);
    let now = state.engine.now_ms();
    let client_wait = state.engine.apply_wait();
    // Claim the key, or wait for the request that holds it and answer with its saved
    // response; a holder that saved nothing (it failed) lets this one run.
    let done = loop {
        match saved_response(&state, &storage_key, &fingerprint, now) {
            Err(response) => return response,
            Ok(Saved::Replay(response) | Saved::Conflict(response)) => return response,
            Ok(Saved::None) => {}
        }
        let holder = match state.idempotency_inflight.entry(storage_key.clone()) {
            dashmap::Entry::Occupied(entry) => entry.get().clone(),
            dashmap::Entry::Vacant(entry) => {
                let (done, waiting) = watch::channel(false);
                entry.insert(waiting);
                break done;
            }
        };
        let mut holder = holder;
        let finished = tokio::time::timeout(client_wait, holder.wait_for(|finished| *finished))
            .await
            .is_ok();
        if !finished {
            return key_in_use();
        }
    };
    let guard = InflightGuard {
        inflight: state.idempotency_inflight.clone(),
        key: storage_key.clone(),
        done,
    };
    let request_id = parts
        .extensions
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    // The handler runs as its own task: a client that disconnects, or stops waiting,
    // does not cancel a write that may already be durable; its final response is
    // saved for the retry.
    let task_state = state.clone();
    let task = tokio::spawn(async move {
        let _guard = guard;
        let response = tally_engine::APPLY_WAIT
            .scope(
                Duration::from_millis(IDEMPOTENT_BACKGROUND_WAIT_MS),
                next.run(Request::from_parts(parts, Body::from(body))),
            )
            .await;
        remember(
            &task_state,
            &storage_key,
            &fingerprint,
            now,
            response,
            &request_id,
        )
        .await
    });
    match tokio::time::timeout(client_wait, task).await {
        Ok(Ok(response)) => response,
        Ok(Err(join_error)) => {
            tracing::error!(%join_error, "request handler failed");
            ApiError::internal("internal error; it has been logged").into_response()
        }
        Err(_) => ApiError::from(tally_engine::EngineError::ApplyTimeout).into_response(),
    }
}

/// Saves the final response (rendering a pending error body first, so the replay is
/// byte-identical) durably, and returns it.
async fn remember(
    state: &AppState,
    storage_key: &[u8],
    fingerprint: &str,
    now: i64,
    mut response: Response,
    request_id: &str,
) -> Response {
    let status = response.status();
    if !remembered(status) {
        return response;
    }
    if let Some(error) = response.extensions_mut().remove::<ApiError>() {
        response = (error.status, axum::Json(error.body(request_id))).into_response();
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return ApiError::internal("response body could not be read").into_response();
    };
    let saved = SavedResponse {
        fingerprint: fingerprint.to_string(),
        status: status.as_u16(),
        body: String::from_utf8_lossy(&bytes).into_owned(),
        created_at_ms: now,
    };
    let store = state.engine.store().clone();
    let key = storage_key.to_vec();
    let value = serde_json::to_vec(&saved).unwrap_or_default();
    // Durable before the client sees the answer: a retry after a crash replays it.
    let saved = tokio::task::spawn_blocking(move || {
        store.aux_put(&key, Some(&value))?;
        store.flush_aux()
    })
    .await;
    if !matches!(saved, Ok(Ok(()))) {
        tracing::warn!("could not save idempotent response");
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Deletes idempotency entries older than the TTL (run periodically).
pub fn sweep_idempotency(state: &AppState) -> usize {
    let now = state.engine.now_ms();
    let store = state.engine.store();
    let mut expired = Vec::new();
    let _ = store.aux_scan(&mut |key, value| {
        if key.starts_with(b"idem\x00") {
            let created = serde_json::from_slice::<SavedResponse>(value)
                .map(|saved| saved.created_at_ms)
                .unwrap_or(0);
            if now - created >= IDEMPOTENCY_TTL_MS {
                expired.push(key.to_vec());
            }
        }
        tally_projection::Visit::Continue
    });
    for key in &expired {
        let _ = store.aux_put(key, None);
    }
    expired.len()
}
