//! Starts the real server (embedded log, sled, both listeners on loopback ports) in
//! this process, so tests speak HTTP over real sockets and can restart it on the same
//! data dir.

#![allow(dead_code)]

pub mod failing_log;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use tally_domain::clock::{Clock, ManualClock};
use tally_engine::{keys, Engine};
use tally_http::HttpConfig;
use tally_log::embedded::EmbeddedLog;
use tally_projection::{ProjectionStore, SledStore};

pub struct Server {
    pub prod_url: String,
    pub test_url: String,
    pub engine: Arc<Engine>,
    pub clock: Arc<ManualClock>,
    pub data_dir: PathBuf,
    shutdown: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    projector: Vec<tokio::task::JoinHandle<()>>,
}

pub fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

pub fn default_config() -> HttpConfig {
    HttpConfig {
        admin_token: Some("admin-secret".into()),
        rate_limit_per_second: 100_000,
        rate_limit_burst: 100_000,
        allow_private_webhooks: false,
        dispatch_webhooks: true,
        dispatch_scope: std::sync::Arc::new(tally_http::webhooks::EveryStore),
        cluster: None,
        request_timeout_ms: tally_http::REQUEST_TIMEOUT_MS,
        body_read_timeout_ms: tally_http::BODY_READ_TIMEOUT_MS,
    }
}

impl Server {
    pub async fn start(dir: &Path, config: HttpConfig) -> Server {
        Self::start_with_clock(dir, config, Arc::new(ManualClock::new(wall_clock_ms()))).await
    }

    pub async fn start_with_clock(
        dir: &Path,
        config: HttpConfig,
        clock: Arc<ManualClock>,
    ) -> Server {
        Self::start_with_store(dir, config, clock, |sled| {
            Arc::new(tally_projection::CheckpointStore::new(sled))
        })
        .await
    }

    /// Starts with the projection stack `wrap` builds over the durable sled store (the
    /// service runs `CheckpointStore` over it; tests insert faults above or below).
    pub async fn start_with_store(
        dir: &Path,
        config: HttpConfig,
        clock: Arc<ManualClock>,
        wrap: impl FnOnce(Arc<dyn ProjectionStore>) -> Arc<dyn ProjectionStore>,
    ) -> Server {
        Self::start_with_faults(dir, config, clock, |log| log, wrap).await
    }

    /// Starts with the log wrapped by `wrap_log` and the projection stack built by
    /// `wrap` (fault injection).
    pub async fn start_with_faults(
        dir: &Path,
        config: HttpConfig,
        clock: Arc<ManualClock>,
        wrap_log: impl FnOnce(Arc<dyn tally_log::Log>) -> Arc<dyn tally_log::Log>,
        wrap: impl FnOnce(Arc<dyn ProjectionStore>) -> Arc<dyn ProjectionStore>,
    ) -> Server {
        let log = loop {
            match EmbeddedLog::open(dir.join("log")) {
                Ok(log) => break log,
                Err(tally_log::LogError::Locked(_)) => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await
                }
                Err(e) => panic!("{e}"),
            }
        };
        // `open` waits for the lock a stop just released (sled frees it late).
        let store: Arc<dyn ProjectionStore> =
            Arc::new(SledStore::open_with(dir.join("projections"), keys::bucket_rows()).unwrap());
        let engine = Engine::open(
            wrap_log(Arc::new(log)),
            wrap(store),
            clock.clone() as Arc<dyn Clock>,
        )
        .await
        .unwrap();
        let (shutdown, rx) = tokio::sync::watch::channel(false);
        let projector = engine.start_projector(rx.clone());
        engine.wait_caught_up().await.unwrap();
        let prod = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let test = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let prod_url = format!("http://{}", prod.local_addr().unwrap());
        let test_url = format!("http://{}", test.local_addr().unwrap());
        let (prod_state, test_state) = tally_http::states(engine.clone(), config);
        let server = tokio::spawn(tally_http::serve(
            (prod, prod_state),
            (test, test_state),
            rx,
        ));
        Server {
            prod_url,
            test_url,
            engine,
            clock,
            data_dir: dir.to_path_buf(),
            shutdown,
            server,
            projector,
        }
    }

    /// Graceful stop; releases the data dir.
    pub async fn stop(self) {
        self.shutdown.send(true).unwrap();
        self.server.await.unwrap().unwrap();
        for p in self.projector {
            p.await.unwrap();
        }
        self.engine.flush().unwrap();
        drop(self.engine);
    }

    /// Stop after an injected storage fault: the final flush may fail (what it would
    /// have written is re-applied from the log by the next start).
    pub async fn stop_after_fault(self) {
        self.shutdown.send(true).unwrap();
        self.server.await.unwrap().unwrap();
        for p in self.projector {
            p.await.unwrap();
        }
        let _ = self.engine.flush();
        drop(self.engine);
    }
}

/// A store with keys, created through the admin API.
pub struct Keys {
    pub test: String,
    pub prod: String,
}

pub async fn create_store(server: &Server, name: &str) -> Keys {
    let response = reqwest::Client::new()
        .post(format!("{}/admin/v1/stores", server.prod_url))
        .bearer_auth("admin-secret")
        .json(&serde_json::json!({"name": name}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    Keys {
        test: body["api_keys"]["test"].as_str().unwrap().to_string(),
        prod: body["api_keys"]["prod"].as_str().unwrap().to_string(),
    }
}

/// A small client bound to one listener and key.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub key: String,
    pub http: reqwest::Client,
}

pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Api {
    pub fn new(base: &str, key: &str) -> Api {
        Api {
            base: base.to_string(),
            key: key.to_string(),
            http: reqwest::Client::new(),
        }
    }

    /// The API key it sends.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Sends a hand-built request and reads the answer.
    pub async fn finish_raw(request: reqwest::RequestBuilder) -> Answer {
        Self::finish(request.send().await.unwrap()).await
    }

    async fn finish(response: reqwest::Response) -> Answer {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        Self::finish(
            self.http
                .get(format!("{}{path}", self.base))
                .header("x-api-key", &self.key)
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    pub async fn post(&self, path: &str, body: Value) -> Answer {
        Self::finish(
            self.http
                .post(format!("{}{path}", self.base))
                .header("x-api-key", &self.key)
                .json(&body)
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    /// A POST with no body at all (no content type either).
    pub async fn post_without_body(&self, path: &str) -> Answer {
        Self::finish_raw(
            self.http
                .post(format!("{}{path}", self.base))
                .header("x-api-key", &self.key),
        )
        .await
    }

    pub async fn post_idempotent(&self, path: &str, key: &str, body: Value) -> Answer {
        Self::finish(
            self.http
                .post(format!("{}{path}", self.base))
                .header("x-api-key", &self.key)
                .header("idempotency-key", key)
                .json(&body)
                .send()
                .await
                .unwrap(),
        )
        .await
    }
}

/// Asserts the error body of docs/api.md and returns its `error` object.
/// A customer with this external id (and an email made from it): its id.
pub async fn customer(api: &Api, external_id: &str) -> String {
    let answer = api
        .post(
            "/v1/customers",
            serde_json::json!({"email": format!("{external_id}@example.com"), "external_id": external_id}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

/// Every aggregation a meter can have.
pub const AGGREGATIONS: [&str; 8] = [
    "count",
    "sum",
    "max",
    "min",
    "average",
    "unique",
    "latest",
    "time_weighted_sum",
];

/// A meter over events named `calls`: `unique` over property `s`, `count` over
/// none, the others over `n` (the correction tests' meters).
pub async fn calls_meter(api: &Api, name: &str, aggregation: &str, filter: Value) -> String {
    let property = match aggregation {
        "count" => Value::Null,
        "unique" => serde_json::json!("s"),
        _ => serde_json::json!("n"),
    };
    let answer = api
        .post(
            "/v1/meters",
            serde_json::json!({"name": name, "event_name": "calls", "aggregation": aggregation,
                "aggregation_property": property, "filter": filter}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

/// A meter's usage over `range` (query text) in minute windows, for `who` (a
/// customer id, or "" for all customers): `{"value", "windows": [[start, value]]}`.
pub async fn minute_usage(api: &Api, meter: &str, who: &str, range: &str) -> Value {
    let customer = if who.is_empty() {
        String::new()
    } else {
        format!("customer_id={who}&")
    };
    let answer = api
        .get(&format!(
            "/v1/meters/{meter}/usage?{customer}window=minute&{range}"
        ))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let windows: Vec<Value> = answer.body["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| serde_json::json!([w["start"], w["value"]]))
        .collect();
    serde_json::json!({"value": answer.body["value"], "windows": windows})
}

pub fn assert_error(answer: &Answer, status: u16, error_type: &str) -> Value {
    assert_eq!(answer.status, status, "body: {}", answer.body);
    let error = &answer.body["error"];
    assert_eq!(error["type"], error_type, "body: {}", answer.body);
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(error.get("code").is_some() && error.get("param").is_some());
    let request_id = error["request_id"].as_str().expect("request_id");
    assert_eq!(answer.body["trace_id"], request_id);
    assert_eq!(answer.headers["x-request-id"], request_id);
    if status == 503 {
        // Every 503 is temporary and says when to come back (docs/api.md, "Errors").
        let retry_after = answer
            .headers
            .get("retry-after")
            .map(|v| v.to_str().unwrap());
        assert!(
            retry_after
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|s| s >= 1),
            "a 503 without a Retry-After of whole seconds: {retry_after:?}"
        );
    }
    error.clone()
}

pub fn temp_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    (dir, path)
}

/// A server with one store ("acme"), its test API, and one customer's id.
pub async fn with_customer() -> (tempfile::TempDir, Server, Api, String) {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let answer = api
        .post("/v1/customers", serde_json::json!({"email": "c@x.io"}))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let customer = answer.body["id"].as_str().unwrap().to_string();
    (guard, server, api, customer)
}

/// `with_customer`, and the id of a credits account of that customer holding
/// `initial`.
pub async fn with_account(initial: &str) -> (tempfile::TempDir, Server, Api, String) {
    let (guard, server, api, customer) = with_customer().await;
    let account = api
        .post(
            "/v1/customer-credits/accounts",
            serde_json::json!({"customer_id": customer, "initial_balance": initial}),
        )
        .await;
    assert_eq!(account.status, 200, "{}", account.body);
    let id = account.body["id"].as_str().unwrap().to_string();
    (guard, server, api, id)
}

/// The store's test time, and the card expiry (`MM/YYYY`) of its month: a card
/// good through now and no later month.
pub async fn test_time_and_expiry(api: &Api) -> (i64, String) {
    let clock = api.get("/v1/test-clock").await;
    assert_eq!(clock.status, 200, "{}", clock.body);
    let now = clock.body["now"].as_str().unwrap();
    // `YYYY-MM-...` -> `MM/YYYY`.
    let exp = format!("{}/{}", &now[5..7], &now[..4]);
    (tally_domain::time::parse_iso8601_ms(now).unwrap(), exp)
}

/// Sets the items of the subscription at `path` (`POST /v1/subscriptions/{id}`,
/// no proration) and insists on a 200: answers the subscription.
pub async fn set_items(api: &Api, path: &str, items: Value) -> Value {
    let answer = api
        .post(
            path,
            json!({"items": items, "update_behavior": "proration-none"}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

/// The id of the subscription's item of `product`.
pub fn item_of(subscription: &Value, product: &str) -> String {
    subscription["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["product_id"] == product)
        .unwrap_or_else(|| panic!("no item of {product}: {subscription}"))["id"]
        .as_str()
        .unwrap()
        .to_string()
}
