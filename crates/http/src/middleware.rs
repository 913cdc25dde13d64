//! Cross-cutting HTTP behaviour, in the order a request meets it:
//! 0. tower-http (`crate::router`, around the router): request id, trace span,
//!    body limit;
//! 1. [`request_context`]: error-body rendering, metrics;
//! 2. [`authenticate`]: `x-api-key` to a scope of this listener's environment
//!    (2-6 and `crate::cluster::forward` after it run as one layer, `crate::pipeline`);
//! 3. [`rate_limit`]: a GCRA limiter per key (governor), 429 with `retry-after` and
//!    `x-ratelimit-*` headers;
//! 4. [`idempotency`]: `idempotency-key` replay for POSTs (24 h, survives restarts);
//! 5. [`write_gate`]: 503 for writes while the engine takes none;
//! 6. [`found_after_catching_up`]: on a log shared between nodes, a 404 only once
//!    this node has applied what the log held (the request runs again after that).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use sha2::{Digest, Sha256};
use tally_domain::record::{IdempotentResponse, Record, RequestKey};
use tally_engine::idempotency::{self, RequestSlot};
use tally_engine::stores::{AuthError, Authenticated};
use tokio::sync::watch;

use crate::error::ApiError;
use crate::extract::read_body_limited;
use crate::AppState;

pub const REQUEST_ID_HEADER: &str = "x-request-id";
pub const API_KEY_HEADER: &str = "x-api-key";
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";
/// Longest accepted idempotency key.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;
/// Token buckets kept before idle ones are evicted (bounds memory under key churn).
pub const MAX_RATE_LIMIT_BUCKETS: usize = 100_000;
/// `Retry-After` of a 503 that names no other: the conditions behind one (a start's
/// catch-up, a lagging projection, an undecided outcome) last seconds, and a client
/// that comes back after one second neither waits long nor adds to the load much.
pub const UNAVAILABLE_RETRY_AFTER_SECONDS: u64 = 1;

/// Makes request ids (`req_` + 20 base62 characters) for tower-http's request-id
/// layers. Every request gets a fresh one: a client's `x-request-id` is replaced,
/// so an id always names one request of this server.
#[derive(Debug, Clone, Copy, Default)]
pub struct TallyRequestIds;

impl TallyRequestIds {
    pub fn header_value() -> HeaderValue {
        HeaderValue::from_str(&format!("req_{}", tally_engine::ids::random_base62(20)))
            .unwrap_or_else(|_| HeaderValue::from_static("req_unknown"))
    }
}

impl tower_http::request_id::MakeRequestId for TallyRequestIds {
    fn make_request_id<B>(
        &mut self,
        _request: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        Some(tower_http::request_id::RequestId::new(Self::header_value()))
    }
}

/// The request id the request-id layer gave this request.
pub fn request_id_of(extensions: &axum::http::Extensions) -> String {
    extensions
        .get::<tower_http::request_id::RequestId>()
        .and_then(|id| id.header_value().to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// Renders every error with the request id (the body of docs/api.md) and counts
/// the request in the metrics. The request id is set, and put on the response,
/// by tower-http's request-id layers around this one (`crate::router`).
pub async fn request_context(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let request_id = request_id_of(request.extensions());
    let method = request.method().clone();
    // The request's whole deadline, here rather than in an outer layer, so that
    // its 503 carries the error body and request id like every other error.
    let timeout_ms = state.config.request_timeout_ms;
    let deadline = std::time::Duration::from_millis(timeout_ms);
    let mut response = match tokio::time::timeout(deadline, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "request_timeout",
            format!(
                "the request took longer than {} ms and was stopped; retry it (with the same idempotency-key, a write that ran answers its first response)",
                timeout_ms
            ),
        )
        .into_response(),
    };
    let mut body_left_unread = false;
    if let Some(error) = response.extensions_mut().remove::<ApiError>() {
        body_left_unread = error
            .code
            .as_deref()
            .is_some_and(|code| crate::extract::BODY_LEFT_UNREAD_CODES.contains(&code));
        let headers = std::mem::take(response.headers_mut());
        let mut rendered = (error.status, axum::Json(error.body(&request_id))).into_response();
        for (name, value) in headers.iter() {
            if name != axum::http::header::CONTENT_TYPE
                && name != axum::http::header::CONTENT_LENGTH
            {
                rendered.headers_mut().insert(name.clone(), value.clone());
            }
        }
        if error.status == StatusCode::SERVICE_UNAVAILABLE {
            // A 503 is a state the client is told to wait out (a node catching up,
            // backpressure, a pending outcome), answered to every request while it
            // lasts: at warn, a readiness probe or a shed load filled the log with
            // one line per request. A fault behind one (the projector stopped, the
            // log failing) is logged once, at error, where it happens; 503s are
            // counted in the status metrics.
            tracing::debug!(request_id, status = error.status.as_u16(), message = %error.message, "request answered unavailable");
        } else if error.status.is_server_error() {
            tracing::warn!(request_id, status = error.status.as_u16(), message = %error.message, "request failed");
        }
        response = rendered;
    }
    if body_left_unread || response.status() == StatusCode::PAYLOAD_TOO_LARGE {
        // A body refused at the limit (or given up on when it stopped arriving or
        // broke) may not be read to its end (`body_limit` drains a refused body
        // only so far, and not one the client holds back for `100-continue`), so
        // the rest of it may still be on the connection: no further request can
        // follow on it. Saying so on every such refusal (one rule for all of
        // them) keeps a client from putting the connection back in its pool and
        // sending its next request into a socket the server is closing.
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            HeaderValue::from_static("close"),
        );
    }
    if response.status() == StatusCode::SERVICE_UNAVAILABLE {
        // Every 503 is temporary here (a node catching up, a lagging projection, an
        // outcome not yet decided, a partition moving): say when to come back, as
        // HTTP asks, unless the answer already did.
        response
            .headers_mut()
            .entry(axum::http::header::RETRY_AFTER)
            .or_insert(HeaderValue::from(UNAVAILABLE_RETRY_AFTER_SECONDS));
    }
    let status = response.status().as_u16();
    // The route's pattern, which `RouteLabel` put on the response inside the router.
    let route = response
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |path| path.as_str());
    state
        .engine
        .metrics()
        .record_request(method.as_str(), route, status, started.elapsed());
    response
}

/// What follows a middleware of the `/v1` chain: the rest of the chain, then the
/// handler (`crate::pipeline` runs the chain inside one axum layer). It is axum's
/// `Next` in all but name, so each middleware reads as an axum one.
pub trait Proceed: Clone + Send + 'static {
    fn run(self, request: Request) -> futures::future::BoxFuture<'static, Response>;
}

/// Puts the route's pattern (axum's `MatchedPath`, known only once the router
/// matched the request) on the response, where [`request_context`], which runs
/// around the router, reads it for the metrics' route label. The only layer that
/// wraps each route (`crate::router` says why the others do not).
#[derive(Clone, Copy)]
pub struct RouteLabelLayer;

impl<S> tower::Layer<S> for RouteLabelLayer {
    type Service = RouteLabel<S>;

    fn layer(&self, inner: S) -> RouteLabel<S> {
        RouteLabel(inner)
    }
}

/// The service of [`RouteLabelLayer`].
#[derive(Clone)]
pub struct RouteLabel<S>(S);

impl<S> tower::Service<Request> for RouteLabel<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Response, std::convert::Infallible>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let label = request.extensions().get::<MatchedPath>().cloned();
        let answer = self.0.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            if let Some(label) = label {
                response.extensions_mut().insert(label);
            }
            Ok(response)
        })
    }
}

/// Resolves `x-api-key` to the scope and stores it in the request extensions.
pub async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: impl Proceed,
) -> Response {
    let key = request
        .headers()
        .get(API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut verdict = state
        .engine
        .directory()
        .authenticate(key.as_deref(), state.mode);
    if matches!(verdict, Err(AuthError::Unknown)) && state.engine.log().shared_between_nodes() {
        // A key created through another node is durable before its creator answers,
        // but this node may not have applied it yet: as for a 404
        // (`found_after_catching_up`), catch up with the log once, then decide.
        let caught_up = tokio::time::timeout(
            Duration::from_millis(CATCH_UP_BEFORE_NOT_FOUND_MS),
            state.engine.wait_caught_up(),
        )
        .await;
        if matches!(caught_up, Ok(Ok(()))) {
            verdict = state
                .engine
                .directory()
                .authenticate(key.as_deref(), state.mode);
        }
    }
    match verdict {
        Ok(Authenticated { scope, digest }) => {
            // A restricted key needs the permission of the resource and method.
            if let Some(held) = state.engine.directory().permissions_of(&digest) {
                let path = request.uri().path();
                if let Some(needed) = tally_domain::access::needed(path, request.method().as_str())
                {
                    if !tally_domain::access::allows(&held, &needed) {
                        return ApiError::new(
                            StatusCode::FORBIDDEN,
                            "permission_denied",
                            format!("this API key lacks the permission `{needed}`"),
                        )
                        .into_response();
                    }
                }
            }
            request.extensions_mut().insert(scope);
            request.extensions_mut().insert(KeyDigest(digest));
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

/// Compares two secrets in time that depends on their length only.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// SHA-256 of the caller's key: identifies the key for rate limits and idempotency
/// without keeping the secret around.
#[derive(Debug, Clone)]
pub struct KeyDigest(pub Vec<u8>);

/// A GCRA rate limiter per API key (governor): `per_second` sustained, `burst` at
/// once (a token bucket's behaviour, without a float per key).
#[derive(Debug)]
pub struct RateLimiter {
    pub per_second: u32,
    pub burst: u32,
    limiter: governor::RateLimiter<
        Vec<u8>,
        governor::state::keyed::DashMapStateStore<Vec<u8>>,
        governor::clock::DefaultClock,
        governor::middleware::StateInformationMiddleware,
    >,
}

pub struct RateDecision {
    allowed: bool,
    remaining: u64,
    /// Seconds until a request is allowed (when refused) or the bucket is full.
    reset_seconds: u64,
}

impl RateLimiter {
    pub fn new(per_second: u32, burst: u32) -> RateLimiter {
        let per_second = per_second.max(1);
        let burst = burst.max(1);
        let quota =
            governor::Quota::per_second(std::num::NonZeroU32::MIN.saturating_add(per_second - 1))
                .allow_burst(std::num::NonZeroU32::MIN.saturating_add(burst - 1));
        RateLimiter {
            per_second,
            burst,
            limiter: governor::RateLimiter::dashmap(quota)
                .with_middleware::<governor::middleware::StateInformationMiddleware>(),
        }
    }

    pub fn check(&self, key: &[u8]) -> RateDecision {
        use governor::clock::Clock;
        if self.limiter.len() > MAX_RATE_LIMIT_BUCKETS {
            // Keys whose bucket refilled are indistinguishable from new ones.
            self.limiter.retain_recent();
            self.limiter.shrink_to_fit();
        }
        match self.limiter.check_key(&key.to_vec()) {
            Ok(snapshot) => {
                let remaining = snapshot.remaining_burst_capacity();
                let missing = self.burst.saturating_sub(remaining) as u64;
                RateDecision {
                    allowed: true,
                    remaining: remaining as u64,
                    reset_seconds: missing.div_ceil(self.per_second as u64),
                }
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.limiter.clock().now());
                RateDecision {
                    allowed: false,
                    remaining: 0,
                    reset_seconds: wait.as_secs_f64().ceil().max(1.0) as u64,
                }
            }
        }
    }
}

pub async fn rate_limit(
    State(state): State<AppState>,
    request: Request,
    next: impl Proceed,
) -> Response {
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
    // The limit is the bucket's size, so `remaining` (what the bucket holds now)
    // never exceeds it; the bucket refills at `per_second` (docs/api.md).
    headers.insert("x-ratelimit-limit", HeaderValue::from(state.limiter.burst));
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
pub async fn write_gate(
    State(state): State<AppState>,
    request: Request,
    next: impl Proceed,
) -> Response {
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

/// How long a request that found nothing waits for this node to apply what the
/// log holds before it runs again: a few times the usual apply lag, short enough
/// that a lagging node still answers (the 404 it found) well within the client's
/// timeout.
pub const CATCH_UP_BEFORE_NOT_FOUND_MS: u64 = 5_000;

/// On a log shared between nodes (Kafka), a resource created through another node is
/// durable in the log before its creator answers, but this node may not have applied
/// it yet. So a 404 is answered only after this node has applied everything the log
/// held when the request found nothing: the request then runs once more and its
/// answer stands. A node that does not catch up within
/// [`CATCH_UP_BEFORE_NOT_FOUND_MS`] answers what it found. It runs inside the
/// idempotency layer, so a key remembers the final answer, not the early 404.
/// Only a request that appended nothing runs again (counted through
/// `tally_engine::APPENDED`), so nothing is ever written twice.
pub async fn found_after_catching_up(
    State(state): State<AppState>,
    request: Request,
    next: impl Proceed,
) -> Response {
    if !state.engine.log().shared_between_nodes() {
        return next.run(request).await;
    }
    let (parts, body) = match read_body_limited(request).await {
        Ok(pair) => pair,
        Err(error) => return error.into_response(),
    };
    let again = axum::http::Request::from_parts(parts, body);
    let (first, appended) = tally_engine::APPENDED
        .scope(std::cell::Cell::new(0), async {
            let first = next.clone().run(again.clone().map(Body::from)).await;
            (first, tally_engine::APPENDED.with(std::cell::Cell::get))
        })
        .await;
    if first.status() != StatusCode::NOT_FOUND || appended > 0 {
        return first;
    }
    let limit = Duration::from_millis(CATCH_UP_BEFORE_NOT_FOUND_MS);
    if !state.engine.journal().caught_up_within(limit).await {
        return first;
    }
    next.run(again.map(Body::from)).await
}

/// Keys being processed on this node right now, each with a signal that turns true
/// when its request has finished. A concurrent retry on this node waits for it
/// instead of running twice; across nodes, apply decides (see below).
pub type InflightIdempotency = Arc<DashMap<Vec<u8>, watch::Receiver<bool>>>;

/// How long a request with an `idempotency-key` may run in the background after its
/// client stopped waiting (`outcome_pending`): the write is durable, and its final
/// response is recorded for the retry when the projector gets to it.
pub const IDEMPOTENT_BACKGROUND_WAIT_MS: u64 = 10 * 60 * 1000;
/// How often a retry polls the projection for the response of the request that
/// holds its key (on another node, or still in flight).
const RESPONSE_POLL_MS: u64 = 20;

/// Whether a response is remembered: final answers are, failures the caller should
/// retry (auth, rate limit, server errors, lag) are not.
fn remembered(status: StatusCode) -> bool {
    !(status.is_server_error() || matches!(status.as_u16(), 401 | 403 | 429))
}

/// Removes its in-flight entry and signals waiters when dropped: also when the
/// handler panicked, so a key is never left "in use" on this node.
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

/// What the projection says about a key.
enum Claimed {
    /// Nobody holds it: this request may run.
    Free,
    /// Held by a request whose response is not recorded yet.
    Pending,
    /// Answered (a replay or a 409 `idempotency_key_reused`).
    Answer(Response),
}

fn claimed(state: &AppState, request: &RequestKey) -> Result<Claimed, Response> {
    let claim = idempotency::lookup(
        state.engine.store().as_ref(),
        &request.api_key_sha256,
        &request.key,
        state.engine.now_ms(),
    )
    .map_err(|e| ApiError::internal(format!("idempotency store: {e}")).into_response())?;
    let Some(claim) = claim else {
        return Ok(Claimed::Free);
    };
    if claim.fingerprint != request.fingerprint {
        return Ok(Claimed::Answer(
            ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "this idempotency-key was used with a different request; use a new key",
            )
            .with_param("idempotency-key")
            .into_response(),
        ));
    }
    let Some(saved) = claim.response else {
        return Ok(Claimed::Pending);
    };
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
    Ok(Claimed::Answer(response))
}

/// Waits (at most `wait`) for the response of the request holding the key; 409
/// `idempotency_key_in_use` if it is not recorded by then.
async fn wait_for_response(state: &AppState, request: &RequestKey, wait: Duration) -> Response {
    let deadline = Instant::now() + wait;
    loop {
        match claimed(state, request) {
            Err(response) | Ok(Claimed::Answer(response)) => return response,
            Ok(Claimed::Free | Claimed::Pending) if Instant::now() >= deadline => {
                return key_in_use()
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(RESPONSE_POLL_MS)).await,
        }
    }
}

fn key_in_use() -> Response {
    ApiError::new(
        StatusCode::CONFLICT,
        "idempotency_key_in_use",
        "a request with this idempotency-key is still being processed; retry with the same key shortly",
    )
    .into_response()
}

/// `idempotency-key` on a POST (ARCHITECTURE.md "Idempotency keys"): the first
/// record the request appends carries the key and apply claims it, in log order, so
/// one key creates one thing whichever nodes its retries reach. The final response
/// is recorded in the log too, and every node replays it byte for byte.
pub async fn idempotency(
    State(state): State<AppState>,
    request: Request,
    next: impl Proceed,
) -> Response {
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
    // Trimmed, as HTTP/1 parsers deliver a header: the same key sent over HTTP/2,
    // which keeps a value's spaces, names the same request.
    let key = match key.as_deref().map(str::trim) {
        Ok(k) if !k.is_empty() && k.chars().count() <= MAX_IDEMPOTENCY_KEY_CHARS => k.to_string(),
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
    let request_key = RequestKey {
        api_key_sha256: digest,
        key,
        fingerprint: hasher.finalize().to_vec(),
    };
    let mut inflight_key = request_key.api_key_sha256.clone();
    inflight_key.push(0);
    inflight_key.extend_from_slice(request_key.key.as_bytes());
    let client_wait = state.engine.apply_wait();
    // Answer from the projection, or claim the key on this node, or wait for the
    // request of this node that holds it.
    let done = loop {
        match claimed(&state, &request_key) {
            Err(response) | Ok(Claimed::Answer(response)) => return response,
            Ok(Claimed::Pending) => {
                return wait_for_response(&state, &request_key, client_wait).await
            }
            Ok(Claimed::Free) => {}
        }
        let holder = match state.idempotency_inflight.entry(inflight_key.clone()) {
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
        key: inflight_key,
        done,
    };
    let request_id = request_id_of(&parts.extensions);
    // A request that appends nothing records its response in its store's partition,
    // where the records of its retries would go (`Record::partition_key`).
    let store_key = parts
        .extensions
        .get::<tally_engine::Scope>()
        .map(|scope| scope.store_id.as_bytes().to_vec());
    // The handler runs as its own task: a client that disconnects, or stops waiting,
    // does not cancel a write that may already be durable; its final response is
    // recorded for the retry.
    let task_state = state.clone();
    let task = tokio::spawn(async move {
        let _guard = guard;
        let background = Duration::from_millis(IDEMPOTENT_BACKGROUND_WAIT_MS);
        let (response, partition_key) = idempotency::REQUEST
            .scope(
                RequestSlot::new(request_key.clone()),
                tally_engine::APPLY_WAIT.scope(background, async {
                    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
                    let partition_key = idempotency::REQUEST.with(|slot| slot.partition_key());
                    (response, partition_key)
                }),
            )
            .await;
        let repeated = response
            .extensions()
            .get::<ApiError>()
            .is_some_and(|e| e.code.as_deref() == Some("idempotency_key_in_use"));
        if repeated {
            // Apply found the key claimed by another node's request: its response.
            return wait_for_response(&task_state, &request_key, background).await;
        }
        remember(
            &task_state,
            request_key,
            partition_key.or(store_key),
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

/// Longest pause between attempts to record a response while writes are refused.
const RECORD_RETRY_MAX_PAUSE_MS: u64 = 1_000;

/// Appends a response record and waits until it is applied. While the node refuses
/// writes for a while (lag, a log outage), it tries again, for as long as the
/// request may run in the background (`IDEMPOTENT_BACKGROUND_WAIT_MS`): the write
/// it answers for is durable, so its response should be too.
async fn record_response(
    state: &AppState,
    record: &Record,
) -> Result<(), tally_engine::EngineError> {
    use tally_engine::EngineError;
    let journal = state.engine.journal();
    let deadline = Instant::now() + Duration::from_millis(IDEMPOTENT_BACKGROUND_WAIT_MS);
    let mut pause = Duration::from_millis(RESPONSE_POLL_MS);
    loop {
        match journal.append(record).await {
            Ok((partition, offset)) => return journal.wait_applied(partition, offset).await,
            Err(EngineError::Unavailable { .. } | EngineError::LogUnavailable(_))
                if Instant::now() + pause < deadline =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(RECORD_RETRY_MAX_PAUSE_MS));
            }
            Err(error) => return Err(error),
        }
    }
}

/// Records the final response (rendering a pending error body first, so the replay
/// is byte-identical) in the log, waits until it is applied (so a retry on any node
/// finds it), and returns it.
async fn remember(
    state: &AppState,
    request: RequestKey,
    partition_key: Option<Vec<u8>>,
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
    // Outside a store's scope, with the API key's other responses.
    let partition_key = partition_key.unwrap_or_else(|| request.api_key_sha256.clone());
    let record = Record::IdempotentResponse(IdempotentResponse {
        request,
        partition_key,
        status: status.as_u16(),
        body: String::from_utf8_lossy(&bytes).into_owned(),
    });
    if let Err(error) = record_response(state, &record).await {
        // The answer stands; a retry finds the key claimed without a response and
        // answers 409 `idempotency_key_in_use` until the claim expires.
        tracing::warn!(%error, "could not record an idempotent response");
    }
    Response::from_parts(parts, Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limiter_counts_the_burst_down_then_refuses_until_a_token_is_back() {
        let limiter = RateLimiter::new(1, 3);
        let decisions: Vec<_> = (0..4).map(|_| limiter.check(b"key")).collect();
        assert!(decisions[..3].iter().all(|d| d.allowed));
        assert_eq!(
            decisions[..3]
                .iter()
                .map(|d| d.remaining)
                .collect::<Vec<_>>(),
            [2, 1, 0]
        );
        // Full again 3 s after the third request at 1 per second.
        assert_eq!(decisions[2].reset_seconds, 3);
        assert!(!decisions[3].allowed);
        assert_eq!(decisions[3].reset_seconds, 1);
        // Keys are independent.
        assert!(limiter.check(b"other").allowed);
    }
}
