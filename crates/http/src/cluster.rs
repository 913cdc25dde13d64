//! Any node answers (ARCHITECTURE.md, "Partitions and ownership"): in a cluster
//! that splits the projection (`tally serve --cluster NAME --peers ...`), a request
//! about a store whose partition another node projects is forwarded to that node
//! and its answer returned unchanged.
//!
//! Each node tells its peers which partitions it serves (projected in full and
//! restored) at `GET /internal/v1/cluster`, behind the cluster's shared secret; every
//! node polls its peers for it. A forwarded request carries the secret, so the
//! receiver answers it itself and never forwards it again; a receiver that no
//! longer serves the partition answers 503 `not_partition_owner` before doing
//! anything, and the sender asks another node. Only a request that never reached a
//! node (connection refused) or that a node refused that way is sent again: any
//! other failure answers 503 and the client retries with its idempotency key, as
//! after any lost answer.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tally_engine::Scope;

use crate::error::ApiError;
use crate::extract::MAX_BODY_BYTES;
use crate::middleware::Proceed;
use crate::AppState;

/// Header carrying the cluster's secret: on the status endpoint, and on a forwarded
/// request (which marks it as one).
pub const CLUSTER_SECRET_HEADER: &str = "x-tally-cluster-secret";
/// Path of a node's status for its peers (not part of `/v1`).
pub const CLUSTER_STATUS_PATH: &str = "/internal/v1/cluster";
/// How often a node asks its peers which partitions they serve: how long a moved
/// partition may be sent to its old owner (who refuses it, and the sender asks
/// again at once).
pub const ROUTES_REFRESH_MS: u64 = 500;
/// How long a peer has to answer a status poll before it counts as serving nothing.
pub const STATUS_TIMEOUT_MS: u64 = 1_000;
/// Pause between attempts to find a node serving a partition (none is while the
/// group moves partitions after a node died: up to the group's session timeout).
pub const FORWARD_RETRY_MS: u64 = 200;
/// Longest a request waits for a node to serve its store's partition (while the
/// cluster moves it, or its new owner restores it) before it answers 503 with
/// `Retry-After`: well inside a client's timeout, so it learns to retry.
pub const MAX_FORWARD_WAIT_MS: u64 = 10_000;
/// Fewest characters of the cluster secret: it lets a caller act as a node.
pub const MIN_CLUSTER_SECRET_CHARS: usize = 32;
/// Most peers a node is given (each is polled every `ROUTES_REFRESH_MS`).
pub const MAX_PEERS: usize = 64;
/// Headers that belong to one connection and are not passed on.
const HOP_BY_HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "host",
];

/// How this node takes part in a cluster that splits the projection.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Shared by every node of the cluster (`--cluster-secret`).
    pub secret: String,
    /// Every node's production listener, this one's included or not
    /// (`--peers http://host:port,...`).
    pub peers: Vec<url::Url>,
    /// The log's partition count.
    pub partitions: u32,
    /// This node's test listener port, reported to peers: they forward test-mode
    /// requests there (same host as its production URL).
    pub test_port: u16,
}

/// Where a partition is served: a node's two listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    prod: url::Url,
    test: url::Url,
}

/// The routes this node knows, refreshed from its peers.
#[derive(Debug)]
pub struct ClusterRouting {
    config: ClusterConfig,
    client: reqwest::Client,
    /// Partition -> the nodes that reported serving it (usually one; two while a
    /// partition moves).
    routes: RwLock<BTreeMap<u32, Vec<Route>>>,
}

impl ClusterRouting {
    pub fn new(config: ClusterConfig) -> Result<Arc<ClusterRouting>, String> {
        if config.secret.chars().count() < MIN_CLUSTER_SECRET_CHARS {
            return Err(format!(
                "the cluster secret must be a random secret of at least {MIN_CLUSTER_SECRET_CHARS} characters"
            ));
        }
        // The secret travels as a header value, which HTTP trims and which holds
        // only visible ASCII and inner spaces: a secret with surrounding whitespace
        // (a line read with its newline) would reach the peer cut, and every
        // forward would be refused as `cluster_secret_invalid`. Refused here, at
        // start, where the mistake is.
        if config.secret.trim() != config.secret
            || !config
                .secret
                .bytes()
                .all(|byte| byte == b' ' || byte.is_ascii_graphic())
        {
            return Err(
                "the cluster secret must be printable ASCII without leading or trailing whitespace (it is sent as an HTTP header)"
                    .to_string(),
            );
        }
        if config.peers.len() > MAX_PEERS {
            return Err(format!("at most {MAX_PEERS} peers"));
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|error| error.to_string())?;
        Ok(Arc::new(ClusterRouting {
            config,
            client,
            routes: RwLock::default(),
        }))
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Whether `headers` carry this cluster's secret (constant time).
    fn carries_secret(&self, headers: &HeaderMap) -> bool {
        headers
            .get(CLUSTER_SECRET_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|presented| {
                crate::middleware::constant_time_eq(
                    presented.as_bytes(),
                    self.config.secret.as_bytes(),
                )
            })
    }

    /// Asks every peer which partitions it serves, and replaces the routes.
    pub async fn refresh(&self) {
        let polls = self.config.peers.iter().map(|peer| self.poll(peer));
        let answers = futures::future::join_all(polls).await;
        let mut routes: BTreeMap<u32, Vec<Route>> = BTreeMap::new();
        for (route, serving) in answers.into_iter().flatten() {
            for partition in serving {
                routes.entry(partition).or_default().push(route.clone());
            }
        }
        *self.routes.write().unwrap_or_else(|p| p.into_inner()) = routes;
    }

    async fn poll(&self, peer: &url::Url) -> Option<(Route, Vec<u32>)> {
        let url = peer.join(CLUSTER_STATUS_PATH).ok()?;
        let answer = self
            .client
            .get(url)
            .header(CLUSTER_SECRET_HEADER, &self.config.secret)
            .timeout(Duration::from_millis(STATUS_TIMEOUT_MS))
            .send()
            .await
            .ok()?;
        if !answer.status().is_success() {
            return None;
        }
        let status: serde_json::Value = answer.json().await.ok()?;
        let mut test = peer.clone();
        let port = status.get("test_port")?.as_u64()?;
        test.set_port(Some(u16::try_from(port).ok()?)).ok()?;
        let serving = status
            .get("serving")?
            .as_array()?
            .iter()
            .filter_map(|p| p.as_u64().and_then(|p| u32::try_from(p).ok()))
            .filter(|p| *p < self.config.partitions)
            .collect();
        Some((
            Route {
                prod: peer.clone(),
                test,
            },
            serving,
        ))
    }

    /// Keeps the routes fresh for as long as the node runs.
    pub async fn run(self: Arc<Self>) {
        loop {
            self.refresh().await;
            tokio::time::sleep(Duration::from_millis(ROUTES_REFRESH_MS)).await;
        }
    }

    fn owner_url(&self, partition: u32, mode: tally_domain::Mode) -> Option<url::Url> {
        let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
        let route = routes.get(&partition)?.first()?;
        Some(match mode {
            tally_domain::Mode::Prod => route.prod.clone(),
            tally_domain::Mode::Test => route.test.clone(),
        })
    }

    /// Sends `request` to `base` and returns the answer as it came, or why not
    /// (`Retry`: it never reached a node that serves the partition).
    async fn send(
        &self,
        base: &url::Url,
        method: &axum::http::Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: &axum::body::Bytes,
    ) -> Result<Response, Failure> {
        let url = base
            .join(path_and_query)
            .map_err(|_| Failure::Fatal("the forwarded path is not a URL"))?;
        let mut outgoing = self.client.request(method.clone(), url).body(body.clone());
        for (name, value) in headers {
            if !HOP_BY_HOP.contains(&name.as_str()) && name.as_str() != CLUSTER_SECRET_HEADER {
                outgoing = outgoing.header(name, value);
            }
        }
        let answer = outgoing
            .header(CLUSTER_SECRET_HEADER, &self.config.secret)
            .send()
            .await
            .map_err(|error| {
                if error.is_connect() {
                    Failure::Retry
                } else {
                    Failure::Fatal("the node that owns the store did not answer")
                }
            })?;
        let status = answer.status();
        let answer_headers = answer.headers().clone();
        let bytes = answer
            .bytes()
            .await
            .map_err(|_| Failure::Fatal("the node that owns the store broke off its answer"))?;
        if status == StatusCode::SERVICE_UNAVAILABLE
            && serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .is_some_and(|v| {
                    v.pointer("/error/code").and_then(|c| c.as_str()) == Some(NOT_OWNER)
                })
        {
            return Err(Failure::Retry);
        }
        let mut response = Response::new(Body::from(bytes));
        *response.status_mut() = status;
        for (name, value) in &answer_headers {
            if !HOP_BY_HOP.contains(&name.as_str()) && name != axum::http::header::CONTENT_LENGTH {
                response.headers_mut().append(name.clone(), value.clone());
            }
        }
        Ok(response)
    }
}

/// Why a forward failed.
enum Failure {
    /// The request reached no node that serves the partition: ask again.
    Retry,
    /// It may have been taken: the client decides (503).
    Fatal(&'static str),
}

/// The code of a node's refusal of a request forwarded to it for a partition it
/// does not serve (anymore).
const NOT_OWNER: &str = "not_partition_owner";

/// `GET /internal/v1/cluster`: the partitions this node serves, for its peers.
#[utoipa::path(
    get,
    path = "/internal/v1/cluster",
    operation_id = "cluster_status",
    tag = "cluster",
    summary = "Which partitions this node serves (for the other nodes of a split cluster; needs the cluster secret)",
    params(("x-tally-cluster-secret" = String, Header, description = "the cluster's shared secret")),
    responses(
        (status = 200, description = "`{\"serving\": [partition, ...], \"skipped_from\": {partition: offset, ...}, \"test_port\": port}`: `skipped_from` names, per partition this node skipped and has not restored, the first offset it skipped"),
        (status = 401, description = "`cluster_secret_invalid`"),
        (status = 404, description = "`not_in_cluster`: this node is not in a split cluster")
    )
)]
pub async fn status(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let Some(cluster) = &state.config.cluster else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "not_in_cluster",
            "this node does not share its projection with a cluster (`tally serve --peers`)",
        )
        .into_response();
    };
    if !cluster.carries_secret(&headers) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "cluster_secret_invalid",
            format!("send the cluster's secret in `{CLUSTER_SECRET_HEADER}`"),
        )
        .into_response();
    }
    let ownership = state.engine.journal().runtime().ownership().clone();
    let serving: Vec<u32> = (0..cluster.config.partitions)
        .filter(|p| ownership.serves(*p))
        .collect();
    // Where this node began skipping each partition it does not hold in full: a
    // restore from the changelog here needs a checkpoint past it.
    let skipped_from: serde_json::Map<String, serde_json::Value> = (0..cluster.config.partitions)
        .filter_map(|p| Some((p.to_string(), json!(ownership.skipped_from(p)?))))
        .collect();
    Json(json!({
        "serving": serving,
        "skipped_from": skipped_from,
        "test_port": cluster.config.test_port,
    }))
    .into_response()
}

/// Serves a request about a store this node serves; forwards the others to the node
/// that does (see the module documentation).
pub async fn forward(
    State(state): State<AppState>,
    request: Request,
    next: impl Proceed,
) -> Response {
    let Some(cluster) = state.config.cluster.clone() else {
        return next.run(request).await;
    };
    let Some(scope) = request.extensions().get::<Scope>().cloned() else {
        return next.run(request).await;
    };
    let partition = tally_log::partition_of(scope.store_id.as_bytes(), cluster.config.partitions);
    let ownership = state.engine.journal().runtime().ownership().clone();
    let deadline = Instant::now()
        + state
            .engine
            .apply_wait()
            .min(Duration::from_millis(MAX_FORWARD_WAIT_MS));
    let forwarded = cluster.carries_secret(request.headers());
    loop {
        if ownership.serves(partition) {
            return next.run(request).await;
        }
        // Projected here but still being restored: wait for it rather than send it
        // elsewhere (nobody else serves it).
        let restoring = ownership.projects(partition);
        if forwarded && !restoring {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                NOT_OWNER,
                "this node does not serve this store's partition (anymore)",
            )
            .into_response();
        }
        if restoring {
            if Instant::now() >= deadline {
                return unavailable("this node is restoring the store's partition; retry shortly");
            }
            tokio::time::sleep(Duration::from_millis(FORWARD_RETRY_MS)).await;
            continue;
        }
        break;
    }
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(error) => return crate::extract::body_read_error(error).into_response(),
    };
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    loop {
        if let Some(base) = cluster.owner_url(partition, scope.mode) {
            match cluster
                .send(&base, &parts.method, &path_and_query, &parts.headers, &body)
                .await
            {
                Ok(response) => {
                    state.engine.metrics().forwarded("answered");
                    return response;
                }
                Err(Failure::Fatal(why)) => {
                    state.engine.metrics().forwarded("failed");
                    return unavailable(why);
                }
                Err(Failure::Retry) => cluster.refresh().await,
            }
        }
        if ownership.serves(partition) {
            // The partition came here meanwhile.
            return next.run(Request::from_parts(parts, Body::from(body))).await;
        }
        if Instant::now() >= deadline {
            state.engine.metrics().forwarded("unavailable");
            return unavailable("no node of the cluster serves this store's partition right now (it is moving); retry shortly");
        }
        tokio::time::sleep(Duration::from_millis(FORWARD_RETRY_MS)).await;
        cluster.refresh().await;
    }
}

fn unavailable(message: &'static str) -> Response {
    let mut response = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "partition_unavailable",
        message,
    )
    .into_response();
    response.headers_mut().insert(
        HeaderName::from_static("retry-after"),
        axum::http::HeaderValue::from(crate::middleware::UNAVAILABLE_RETRY_AFTER_SECONDS),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(secret: &str) -> ClusterConfig {
        ClusterConfig {
            secret: secret.to_string(),
            peers: Vec::new(),
            partitions: 4,
            test_port: 0,
        }
    }

    /// A secret that could not reach a peer intact (too short, surrounded by
    /// whitespace, or not sendable as a header) is refused at start.
    #[test]
    fn a_secret_that_would_not_reach_peers_intact_is_refused() {
        let good = "s".repeat(MIN_CLUSTER_SECRET_CHARS);
        assert!(ClusterRouting::new(config(&good)).is_ok());
        assert!(ClusterRouting::new(config(&format!("{good} with inner spaces"))).is_ok());
        for bad in [
            "s".repeat(MIN_CLUSTER_SECRET_CHARS - 1),
            format!("{good}\n"),
            format!(" {good}"),
            format!("{good}\t"),
            format!("{good}\u{e9}"),
            format!("{good}\u{7f}"),
        ] {
            assert!(ClusterRouting::new(config(&bad)).is_err(), "{bad:?}");
        }
    }
}
