//! The HTTP facade: a thin axum layer serving `/v1` from the engine's projections.
//!
//! Two listeners share one router shape; each serves one environment (production on
//! `--listen`, test on `--test-listen`) and only accepts that environment's keys.
//! Wire types (JSON) are built and parsed here and nowhere else; all errors pass
//! through `error.rs`.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::IntoResponse;
use axum::Router;
use dashmap::DashMap;
use tally_domain::Mode;
use tally_engine::Engine;

mod answer_encoding;
pub mod body_limit;
pub mod cluster;
pub mod error;
pub mod extract;
pub mod ingest_body;
mod intake;
pub mod middleware;
pub mod openapi;
mod pipeline;
pub mod routes;
pub mod webhooks;
pub mod wire;

use error::ApiError;
use middleware::{InflightIdempotency, RateLimiter};
use utoipa_axum::router::OpenApiRouter;

#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// `TALLY_ADMIN_TOKEN`: enables the admin API on the production listener.
    pub admin_token: Option<String>,
    pub rate_limit_per_second: u32,
    pub rate_limit_burst: u32,
    /// `--allow-private-webhooks`: production endpoints may target private addresses.
    pub allow_private_webhooks: bool,
    /// Whether this node runs the webhook dispatcher.
    pub dispatch_webhooks: bool,
    /// The stores whose webhooks it delivers (all of them, unless the node shares
    /// the work with a cluster).
    pub dispatch_scope: Arc<dyn webhooks::DispatchScope>,
    /// Set when this node shares the projection with a cluster: requests about
    /// stores it does not serve are forwarded (`cluster`).
    pub cluster: Option<Arc<cluster::ClusterRouting>>,
    /// A request's whole deadline (`REQUEST_TIMEOUT_MS` in service; tests shorten
    /// it to see its answer).
    pub request_timeout_ms: u64,
    /// How long reading a request body may take (`BODY_READ_TIMEOUT_MS` in
    /// service; tests shorten it).
    pub body_read_timeout_ms: u64,
}

/// What the handlers and middleware of one listener share, behind one pointer: axum
/// clones the state into every layer and clones the layered route for every
/// request, and with six `Arc`s here each request paid dozens of atomic count
/// changes on counters both cores touch (a few percent of the request workers'
/// time in a profile of the ledger benchmark).
#[derive(Clone)]
pub struct AppState(Arc<AppContext>);

impl std::ops::Deref for AppState {
    type Target = AppContext;

    fn deref(&self) -> &AppContext {
        &self.0
    }
}

pub struct AppContext {
    pub engine: Arc<Engine>,
    /// The environment this listener serves.
    pub mode: Mode,
    pub config: Arc<HttpConfig>,
    pub limiter: Arc<RateLimiter>,
    pub idempotency_inflight: InflightIdempotency,
    pub dispatcher: Arc<webhooks::Dispatcher>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("mode", &self.mode)
            .finish()
    }
}

async fn route_not_found() -> impl IntoResponse {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "route_not_found",
        "no such route; see docs/api.md",
    )
}

async fn method_not_allowed() -> impl IntoResponse {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that HTTP method",
    )
}

/// Runs engine work that scans (listings with filters, previews, usage queries)
/// on the blocking pool, so it never holds an async worker that other requests
/// need.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, tally_engine::EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(ApiError::from),
        Err(join_error) => {
            tracing::error!(%join_error, "a blocking request task failed");
            Err(ApiError::internal("internal error; it has been logged"))
        }
    }
}

/// Runs engine work that reads for a bounded while (a usage query: at most
/// `MAX_USAGE_WINDOWS` windows) on the request's own thread, after handing the
/// thread's other tasks to another worker (`block_in_place`), so it neither holds
/// an async worker nor hops to the blocking pool and back: each hop waits for a
/// core, and on two saturated cores that wait was a visible part of the usage
/// query's tail (docs/benchmarks.md, "Usage queries stay on their thread"). A runtime of one
/// thread (tests) cannot hand its tasks over, so the work goes to the pool there.
pub(crate) async fn bounded_read<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, tally_engine::EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work).map_err(ApiError::from)
        }
        _ => blocking(work).await,
    }
}

/// The `/v1` routes that need an API key, one router per resource module, merged
/// (each module owns its paths and their documentation).
fn v1_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(routes::customers::router())
        .merge(routes::meters::router())
        .merge(routes::products::router())
        .merge(routes::billing::router())
        .merge(routes::subscriptions::router())
        .merge(routes::affiliates::router())
        .merge(routes::moderation::router())
        .merge(routes::events::router())
        .merge(routes::credits::router())
        .merge(routes::webhooks::router())
}

/// The routes served without an API key: health, metrics, the OpenAPI document,
/// and (on the production listener) the admin API with its own token.
fn open_routes(with_admin: bool) -> OpenApiRouter<AppState> {
    let open = OpenApiRouter::new()
        .routes(utoipa_axum::routes!(routes::health::healthz))
        .routes(utoipa_axum::routes!(routes::health::readyz))
        .routes(utoipa_axum::routes!(routes::health::metrics))
        .routes(utoipa_axum::routes!(routes::health::openapi_json));
    if !with_admin {
        return open;
    }
    open.routes(utoipa_axum::routes!(routes::admin::create_store))
        .routes(utoipa_axum::routes!(routes::admin::create_key))
        .routes(utoipa_axum::routes!(routes::admin::revoke_key))
}

/// Every route with its documentation (`openapi::document` reads the document off
/// it; `router` serves it).
pub fn api_router(with_admin: bool) -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(<openapi::ApiDoc as utoipa::OpenApi>::openapi())
        .merge(open_routes(with_admin))
        .routes(utoipa_axum::routes!(cluster::status))
        .merge(v1_routes())
}

/// The router of one listener.
pub fn router(state: AppState) -> Router {
    let (v1, _) = v1_routes().split_for_parts();
    let v1 = v1
        .method_not_allowed_fallback(method_not_allowed)
        // Authenticate, forward to the node serving the store (in a cluster), rate
        // limit, idempotency, the write gate, the catch-up before a 404: one layer
        // (`pipeline` says why).
        .layer(from_fn_with_state(state.clone(), pipeline::v1_chain));
    let (open, _) = open_routes(state.mode == Mode::Prod)
        .routes(utoipa_axum::routes!(cluster::status))
        .split_for_parts();
    let routes = open
        .method_not_allowed_fallback(method_not_allowed)
        .merge(v1)
        .fallback(route_not_found)
        // The one layer every route gets: it hands the route's pattern to
        // `request_context` (outside the router, where it is not yet known).
        .layer(middleware::RouteLabelLayer)
        .with_state(state.clone());
    let request_id = axum::http::HeaderName::from_static(middleware::REQUEST_ID_HEADER);
    // The layers every request passes, applied once around the whole router rather
    // than to each route: axum's `Router::layer` wraps every route in each of them,
    // and a route clones what it wraps on every request, so each layer there cost
    // every request a copy of all the layers inside it (docs/benchmarks.md,
    // "Layers around the router, not each route"). Outermost first: a fresh
    // request id (replacing a client's), its trace span, the error rendering and
    // metrics, then the body limit (which drains a refused body before its 413,
    // `body_limit` says why).
    let stack = tower::ServiceBuilder::new()
        .layer(tower_http::set_header::SetRequestHeaderLayer::overriding(
            request_id.clone(),
            |_: &axum::http::Request<axum::body::Body>| {
                Some(middleware::TallyRequestIds::header_value())
            },
        ))
        .layer(tower_http::request_id::SetRequestIdLayer::new(
            request_id.clone(),
            middleware::TallyRequestIds,
        ))
        .layer(tower_http::request_id::PropagateRequestIdLayer::new(
            request_id,
        ))
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(|request: &axum::http::Request<axum::body::Body>| {
                    tracing::debug_span!(
                        "request",
                        method = %request.method(),
                        path = %request.uri().path(),
                        request_id = %middleware::request_id_of(request.extensions()),
                    )
                })
                // 5xx are logged with their message by `request_context`.
                .on_failure(()),
        )
        .layer(from_fn_with_state(state, middleware::request_context))
        .layer(body_limit::BodyLimitLayer)
        .service(routes);
    Router::new().fallback_service(stack)
}

/// The state of both listeners (they share limits and the idempotency guard).
pub fn states(engine: Arc<Engine>, config: HttpConfig) -> (AppState, AppState) {
    let config = Arc::new(config);
    let limiter = Arc::new(RateLimiter::new(
        config.rate_limit_per_second,
        config.rate_limit_burst,
    ));
    let inflight: InflightIdempotency = Arc::new(DashMap::new());
    let dispatcher = webhooks::Dispatcher::new(
        engine.notifications().clone(),
        Arc::new(webhooks::WireBodies(engine.clone())),
        config.dispatch_scope.clone(),
        config.allow_private_webhooks,
    );
    let make = |mode| {
        AppState(Arc::new(AppContext {
            dispatcher: dispatcher.clone(),
            engine: engine.clone(),
            mode,
            config: config.clone(),
            limiter: limiter.clone(),
            idempotency_inflight: inflight.clone(),
        }))
    };
    (make(Mode::Prod), make(Mode::Test))
}

/// Serves both listeners until `shutdown` resolves, then finishes in-flight requests.
pub async fn serve(
    prod: (tokio::net::TcpListener, AppState),
    test: (tokio::net::TcpListener, AppState),
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let (prod_listener, prod_state) = prod;
    let dispatcher = prod_state
        .config
        .dispatch_webhooks
        .then(|| tokio::spawn(prod_state.dispatcher.clone().run(shutdown.clone())));
    let (test_listener, test_state) = test;
    let body_timeout = Duration::from_millis(prod_state.config.body_read_timeout_ms);
    let prod_server = serve_listener(
        prod_listener,
        hardened(router(prod_state), body_timeout),
        shutdown.clone(),
    );
    let test_server = serve_listener(
        test_listener,
        hardened(router(test_state), body_timeout),
        shutdown.clone(),
    );
    let (a, b) = tokio::join!(prod_server, test_server);
    if let Some(dispatcher) = dispatcher {
        let _ = dispatcher.await;
    }
    a?;
    b?;
    Ok(())
}

/// Open connections per listener. Beyond it, new connections wait in the kernel's
/// accept queue instead of taking file descriptors and memory (slowloris, fd
/// exhaustion).
pub const MAX_CONNECTIONS: usize = 4_096;
/// How long a client may take to send a request's headers, and a new connection
/// its first byte.
pub const HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// How long a request may take from its first byte to its response, body included
/// (a write itself waits at most `APPLY_WAIT_TIMEOUT_MS` for the projector).
pub const REQUEST_TIMEOUT_MS: u64 = tally_engine::APPLY_WAIT_TIMEOUT_MS + 15_000;
/// How long reading a request body may take (a 1 MiB body on a slow link).
pub const BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Requests handled at once per listener; more wait their turn (bounds memory and
/// the blocking pool under floods).
pub const MAX_CONCURRENT_REQUESTS: usize = 1_024;
/// The smallest answer compressed for a client that accepts gzip. Below about one
/// TCP segment (~1,460 bytes of payload on Ethernet) compression saves no packet,
/// yet each compressed answer costs a compressor's fixed setup: zeroing its tables
/// and building a Huffman table. That was ~17-35 µs of server CPU per request, more
/// than the rest of a small read, with tower-http's default floor of 32 bytes
/// (docs/benchmarks.md, "Small answers sent uncompressed").
pub const MIN_COMPRESSED_BODY_BYTES: u16 = 1_400;

/// How hard answers are compressed: gzip's fastest level (deflate level 1, as
/// nginx's default). A full ingest answer (~35 KB of JSON for 100 events) costs
/// ~170 µs of server CPU at the default level against ~30-50 µs at this one, for
/// ~8% more bytes (3.3 KB against 3.1 KB): ~1.3 µs saved of the ~33 µs of server
/// CPU an ingested event costs, for a client that accepts gzip (docs/benchmarks.md,
/// "Answers compressed at gzip's fastest level").
pub const COMPRESSION_LEVEL: tower_http::CompressionLevel = tower_http::CompressionLevel::Fastest;

/// How answers are compressed, in one place: the layer around every listener's
/// router, and the ingest answer, which is compressed on the intake runtime
/// before it leaves (`answer_encoding`): gzip at `COMPRESSION_LEVEL`, for answers
/// of at least `MIN_COMPRESSED_BODY_BYTES`, to clients that accept it.
pub(crate) fn compression() -> tower_http::compression::CompressionLayer<
    tower_http::compression::predicate::And<
        tower_http::compression::predicate::DefaultPredicate,
        tower_http::compression::predicate::SizeAbove,
    >,
> {
    use tower_http::compression::predicate::{DefaultPredicate, Predicate, SizeAbove};
    tower_http::compression::CompressionLayer::new()
        .quality(COMPRESSION_LEVEL)
        .compress_when(DefaultPredicate::new().and(SizeAbove::new(MIN_COMPRESSED_BODY_BYTES)))
}

/// The layers every listener's router gets: a panic answers 500 with the error body
/// (and is logged) instead of dropping the connection, requests have a body-read
/// deadline (the total deadline, `REQUEST_TIMEOUT_MS`, is kept by
/// `middleware::request_context`, which renders its error) and a concurrency cap,
/// and answers of at least `MIN_COMPRESSED_BODY_BYTES` are compressed (gzip, at
/// `COMPRESSION_LEVEL`) for clients that accept it.
fn hardened(router: Router, body_read_timeout: Duration) -> Router {
    hardened_with(router, body_read_timeout, MAX_CONCURRENT_REQUESTS)
}

fn hardened_with(router: Router, body_read_timeout: Duration, concurrent: usize) -> Router {
    use tower_http::catch_panic::CatchPanicLayer;
    use tower_http::timeout::RequestBodyTimeoutLayer;
    // Around the router once (see `router`): one concurrency cap per listener, not
    // one per route.
    let stack = tower::ServiceBuilder::new()
        .layer(tower::limit::ConcurrencyLimitLayer::new(concurrent))
        .layer(RequestBodyTimeoutLayer::new(body_read_timeout))
        .layer(CatchPanicLayer::custom(
            |panic: Box<dyn std::any::Any + Send>| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(panic = %what, "BUG: a request handler panicked");
                ApiError::internal("internal error; it has been logged").into_response()
            },
        ))
        .layer(compression())
        .service(router);
    Router::new().fallback_service(stack)
}

/// Serves one listener until `shutdown`, then lets open requests finish. Written on
/// hyper-util rather than `axum::serve` for what that one does not set: a header
/// read timeout (it needs a timer) and a cap on open connections.
async fn serve_listener(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut shutdown = shutdown;
    let connections_stop = shutdown.clone();
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::server::graceful::GracefulShutdown;
    use tower::ServiceExt;

    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(HEADER_READ_TIMEOUT_MS));
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let stop = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            _ = &mut stop => break,
            slot = slots.clone().acquire_owned() => slot,
        };
        let Ok(slot) = slot else { break };
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = router.clone().map_request(
            move |mut request: axum::extract::Request<hyper::body::Incoming>| {
                request
                    .extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                request.map(axum::body::Body::new)
            },
        );
        let service = hyper_util::service::TowerToHyperService::new(service);
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let mut stop = connections_stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // hyper's header timeout starts with a request's first byte, and the
            // auto builder waits for that byte (to tell HTTP/1 from HTTP/2) with no
            // deadline: a connection that sends nothing would hold its slot for
            // good, and `MAX_CONNECTIONS` of them would lock every client out.
            // (`peek`, not `readable`: readiness may be reported spuriously.)
            let mut first = [0u8; 1];
            let first_byte = tokio::time::timeout(
                Duration::from_millis(HEADER_READ_TIMEOUT_MS),
                stream.peek(&mut first),
            );
            tokio::select! {
                waited = first_byte => if !matches!(waited, Ok(Ok(1))) {
                    return;
                },
                _ = stop.wait_for(|stop| *stop) => return,
            }
            let connection = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            if let Err(error) = watcher.watch(connection).await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::Body;
    use axum::Router;
    use tokio::sync::Notify;
    use tower::ServiceExt;

    /// The concurrency cap holds for the listener as a whole: a request to another
    /// route waits while the cap is taken (it was one cap per route when the layer
    /// wrapped each route).
    #[tokio::test]
    async fn the_concurrency_cap_is_one_for_all_routes() {
        let release = Arc::new(Notify::new());
        let held = release.clone();
        // Plain services, not documented routes: this checks the layering only.
        let routes = Router::new()
            .route_service(
                "/slow",
                tower::service_fn(move |_: axum::extract::Request| {
                    let held = held.clone();
                    async move {
                        held.notified().await;
                        Ok::<_, std::convert::Infallible>(axum::response::Response::new(
                            Body::empty(),
                        ))
                    }
                }),
            )
            .route_service(
                "/quick",
                tower::service_fn(|_: axum::extract::Request| async {
                    Ok::<_, std::convert::Infallible>(axum::response::Response::new(Body::empty()))
                }),
            );
        let app = super::hardened_with(routes, Duration::from_secs(5), 1);
        let request = |path: &str| {
            axum::http::Request::builder()
                .uri(path)
                .body(Body::empty())
                .unwrap()
        };
        let slow = tokio::spawn(app.clone().oneshot(request("/slow")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let quick = tokio::time::timeout(
            Duration::from_millis(300),
            app.clone().oneshot(request("/quick")),
        )
        .await;
        assert!(quick.is_err(), "another route ran while the cap was taken");
        release.notify_one();
        assert_eq!(slow.await.unwrap().unwrap().status(), 200);
        let quick = tokio::time::timeout(Duration::from_secs(5), app.oneshot(request("/quick")))
            .await
            .expect("the cap is free again")
            .unwrap();
        assert_eq!(quick.status(), 200);
    }
}
