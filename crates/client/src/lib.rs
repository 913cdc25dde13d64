//! A typed Rust client of the Tally API (docs/api.md). Its operations and types are
//! the ones `docs/openapi.json` documents: the tests of this crate check every
//! operation's method, path and operation id, and every type's fields, against
//! that document, and the HTTP tests run each operation against a real server.
//!
//! ```no_run
//! # async fn example() -> Result<(), tally_client::Error> {
//! use tally_client::{Client, CustomerCreate, EventInput, IngestRequest};
//! let tally = Client::new("http://127.0.0.1:8081", "tally_test_...");
//! let customer = tally
//!     .create_customer(&CustomerCreate { email: "ada@example.com".into(), ..Default::default() })
//!     .await?;
//! let result = tally
//!     .ingest(&IngestRequest {
//!         events: vec![EventInput {
//!             name: "api.call".into(),
//!             customer_id: Some(customer.id.clone()),
//!             ..Default::default()
//!         }],
//!     })
//!     .await?;
//! assert_eq!(result.accepted, 1);
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod types;
pub use types::*;

/// How long one call may take by default (the server answers within 45 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Every operation this client calls: (HTTP method, documented path, operationId).
/// The crate's tests hold it to docs/openapi.json.
pub const OPERATIONS: [(&str, &str, &str); 28] = [
    ("post", "/admin/v1/stores", "create_store"),
    ("post", "/admin/v1/stores/{id}/keys", "create_key"),
    (
        "delete",
        "/admin/v1/stores/{id}/keys/{key_id}",
        "revoke_key",
    ),
    ("post", "/v1/customers", "customers_create"),
    ("get", "/v1/customers/{id}", "customers_get"),
    ("get", "/v1/customers", "customers_list"),
    ("post", "/v1/meters", "meters_create"),
    ("get", "/v1/meters/{id}", "meters_get"),
    ("get", "/v1/meters/{id}/usage", "meters_usage"),
    ("post", "/v1/meters/{id}/revisions", "meters_revise"),
    ("post", "/v1/events/ingest", "events_ingest"),
    ("get", "/v1/events/{event_id}", "events_get"),
    ("post", "/v1/events/void", "events_void"),
    ("post", "/v1/events/{event_id}/amend", "events_amend"),
    ("post", "/v1/customer-credits/accounts", "create_account"),
    ("get", "/v1/customer-credits/accounts/{id}", "get_account"),
    (
        "post",
        "/v1/customer-credits/accounts/{id}/credit",
        "credits_credit",
    ),
    (
        "post",
        "/v1/customer-credits/accounts/{id}/debit",
        "credits_debit",
    ),
    (
        "post",
        "/v1/customer-credits/accounts/{id}/grants",
        "credits_create_grant",
    ),
    (
        "post",
        "/v1/customer-credits/accounts/{id}/reservations",
        "credits_reserve",
    ),
    (
        "post",
        "/v1/customer-credits/reservations/{id}/commit",
        "credits_commit_reservation",
    ),
    (
        "post",
        "/v1/customer-credits/reservations/{id}/release",
        "credits_release_reservation",
    ),
    ("post", "/v1/webhooks", "webhooks_create"),
    (
        "get",
        "/v1/webhooks/{id}/events/pending",
        "webhooks_pending",
    ),
    (
        "post",
        "/v1/webhooks/{id}/events/{event_id}/ack",
        "webhooks_ack",
    ),
    ("get", "/healthz", "healthz"),
    ("get", "/readyz", "readyz"),
    ("get", "/v1/openapi.json", "openapi_json"),
];

/// A call that did not give the answer asked for.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server answered with an error body (docs/api.md, "Errors").
    #[error("{status} {}: {}", .error.code.as_deref().unwrap_or("error"), .error.message)]
    Api { status: u16, error: ErrorDetail },
    /// No answer (connection, timeout) or an unreadable one.
    #[error("transport: {0}")]
    Transport(#[from] reqwest::Error),
    /// An answer that is not the documented shape.
    #[error("unexpected answer ({status}): {message}")]
    Unexpected { status: u16, message: String },
}

impl Error {
    /// The error code of an API error (`insufficient_balance`, ...).
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Api { error, .. } => error.code.as_deref(),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Api { status, .. } | Error::Unexpected { status, .. } => Some(*status),
            Error::Transport(e) => e.status().map(|s| s.as_u16()),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, Clone, Deserialize, Serialize)]
struct ErrorEnvelope {
    error: ErrorDetail,
}

/// How the client authenticates.
#[derive(Debug, Clone)]
enum Auth {
    ApiKey(String),
    AdminToken(String),
    None,
}

/// A client of one listener, with one API key (or the admin token).
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    auth: Auth,
    http: reqwest::Client,
}

fn http_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

impl Client {
    /// A client of `base_url` (e.g. `http://127.0.0.1:8081`) with an API key.
    pub fn new(base_url: &str, api_key: &str) -> Client {
        Client {
            base: base_url.trim_end_matches('/').to_string(),
            auth: Auth::ApiKey(api_key.to_string()),
            http: http_client(DEFAULT_TIMEOUT),
        }
    }

    /// A client of the admin API (`Authorization: Bearer $TALLY_ADMIN_TOKEN`).
    pub fn admin(base_url: &str, admin_token: &str) -> Client {
        Client {
            base: base_url.trim_end_matches('/').to_string(),
            auth: Auth::AdminToken(admin_token.to_string()),
            http: http_client(DEFAULT_TIMEOUT),
        }
    }

    /// A client of the routes that need no key (health, the OpenAPI document).
    pub fn anonymous(base_url: &str) -> Client {
        Client {
            base: base_url.trim_end_matches('/').to_string(),
            auth: Auth::None,
            http: http_client(DEFAULT_TIMEOUT),
        }
    }

    /// The same client with another per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.http = http_client(timeout);
        self
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.auth {
            Auth::ApiKey(key) => request.header("x-api-key", key),
            Auth::AdminToken(token) => request.bearer_auth(token),
            Auth::None => request,
        }
    }

    async fn send<T: DeserializeOwned>(&self, request: reqwest::RequestBuilder) -> Result<T> {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&bytes).map_err(|e| Error::Unexpected {
                status,
                message: format!("the answer does not decode: {e}"),
            });
        }
        match serde_json::from_slice::<ErrorEnvelope>(&bytes) {
            Ok(envelope) => Err(Error::Api {
                status,
                error: envelope.error,
            }),
            Err(_) => Err(Error::Unexpected {
                status,
                message: String::from_utf8_lossy(&bytes).chars().take(500).collect(),
            }),
        }
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    async fn get_query<T: DeserializeOwned, Q: Serialize + ?Sized>(
        &self,
        path: &str,
        query: &Q,
    ) -> Result<T> {
        self.send(self.request(reqwest::Method::GET, path).query(query))
            .await
    }

    async fn post<T: DeserializeOwned, B: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T> {
        self.send(self.request(reqwest::Method::POST, path).json(body))
            .await
    }

    /// A POST with an `idempotency-key` (docs/api.md: a retry gets the first answer).
    pub async fn post_idempotent<T: DeserializeOwned, B: Serialize + ?Sized>(
        &self,
        path: &str,
        idempotency_key: &str,
        body: &B,
    ) -> Result<T> {
        self.send(
            self.request(reqwest::Method::POST, path)
                .header("idempotency-key", idempotency_key)
                .json(body),
        )
        .await
    }

    // ---- admin ----

    pub async fn create_store(&self, name: &str) -> Result<Store> {
        self.post("/admin/v1/stores", &serde_json::json!({ "name": name }))
            .await
    }

    pub async fn create_key(&self, store_id: &str, input: &KeyCreate) -> Result<ApiKey> {
        self.post(&format!("/admin/v1/stores/{store_id}/keys"), input)
            .await
    }

    pub async fn revoke_key(&self, store_id: &str, key_id: &str) -> Result<RevokedKey> {
        self.send(self.request(
            reqwest::Method::DELETE,
            &format!("/admin/v1/stores/{store_id}/keys/{key_id}"),
        ))
        .await
    }

    // ---- customers ----

    pub async fn create_customer(&self, input: &CustomerCreate) -> Result<Customer> {
        self.post("/v1/customers", input).await
    }

    pub async fn get_customer(&self, id: &str) -> Result<Customer> {
        self.get(&format!("/v1/customers/{id}")).await
    }

    pub async fn list_customers(&self, page: &PageQuery) -> Result<List<Customer>> {
        self.get_query("/v1/customers", page).await
    }

    // ---- meters, events, usage ----

    pub async fn create_meter(&self, input: &MeterCreate) -> Result<Meter> {
        self.post("/v1/meters", input).await
    }

    pub async fn get_meter(&self, id: &str) -> Result<Meter> {
        self.get(&format!("/v1/meters/{id}")).await
    }

    /// Revises a meter's filter or aggregation property (docs/api.md, "Meter
    /// revisions"); a dry run only says which customers' usage would change.
    pub async fn revise_meter(
        &self,
        id: &str,
        request: &MeterRevisionRequest,
    ) -> Result<MeterRevision> {
        self.post(&format!("/v1/meters/{id}/revisions"), request)
            .await
    }

    pub async fn meter_usage(&self, meter_id: &str, query: &UsageQuery) -> Result<MeterUsage> {
        self.get_query(&format!("/v1/meters/{meter_id}/usage"), query)
            .await
    }

    pub async fn ingest(&self, batch: &IngestRequest) -> Result<IngestResult> {
        self.post("/v1/events/ingest", batch).await
    }

    /// Ingest of a body already serialized (load generators build it once).
    pub async fn ingest_raw(&self, json_body: Vec<u8>) -> Result<IngestResult> {
        self.send(
            self.request(reqwest::Method::POST, "/v1/events/ingest")
                .header("content-type", "application/json")
                .body(json_body),
        )
        .await
    }

    pub async fn get_event(&self, event_id: &str) -> Result<UsageEvent> {
        self.get(&format!("/v1/events/{event_id}")).await
    }

    /// Voids stored events (all or nothing; docs/api.md, "Voiding events").
    pub async fn void_events(&self, request: &VoidRequest) -> Result<EventVoid> {
        self.post("/v1/events/void", request).await
    }

    /// Amends a stored event: voids it and stores its replacement, in one record
    /// (docs/api.md, "Amending an event").
    pub async fn amend_event(
        &self,
        event_id: &str,
        request: &AmendRequest,
    ) -> Result<EventAmendment> {
        self.post(&format!("/v1/events/{event_id}/amend"), request)
            .await
    }

    // ---- customer credits ----

    pub async fn create_account(&self, input: &AccountCreate) -> Result<CreditAccount> {
        self.post("/v1/customer-credits/accounts", input).await
    }

    pub async fn get_account(&self, id: &str) -> Result<CreditAccount> {
        self.get(&format!("/v1/customer-credits/accounts/{id}"))
            .await
    }

    pub async fn credit(&self, account_id: &str, movement: &Movement) -> Result<CreditTransaction> {
        self.post(
            &format!("/v1/customer-credits/accounts/{account_id}/credit"),
            movement,
        )
        .await
    }

    pub async fn debit(&self, account_id: &str, movement: &Movement) -> Result<CreditTransaction> {
        self.post(
            &format!("/v1/customer-credits/accounts/{account_id}/debit"),
            movement,
        )
        .await
    }

    /// Credits the account through a grant with a priority and an expiry.
    pub async fn create_grant(&self, account_id: &str, input: &GrantCreate) -> Result<CreditGrant> {
        self.post(
            &format!("/v1/customer-credits/accounts/{account_id}/grants"),
            input,
        )
        .await
    }

    /// Holds credits until a commit, a release or the expiry.
    pub async fn reserve(
        &self,
        account_id: &str,
        input: &ReservationCreate,
    ) -> Result<CreditReservation> {
        self.post(
            &format!("/v1/customer-credits/accounts/{account_id}/reservations"),
            input,
        )
        .await
    }

    /// Debits `amount` of what the reservation holds (all of it when `None`).
    pub async fn commit_reservation(
        &self,
        id: &str,
        amount: Option<&str>,
    ) -> Result<CreditReservation> {
        self.post(
            &format!("/v1/customer-credits/reservations/{id}/commit"),
            &serde_json::json!({ "amount": amount }),
        )
        .await
    }

    pub async fn release_reservation(&self, id: &str) -> Result<CreditReservation> {
        self.post(
            &format!("/v1/customer-credits/reservations/{id}/release"),
            &serde_json::json!({}),
        )
        .await
    }

    // ---- webhooks ----

    pub async fn create_webhook(&self, input: &WebhookCreate) -> Result<Webhook> {
        self.post("/v1/webhooks", input).await
    }

    /// The cli feed of an endpoint (at most `limit`, 1..100).
    pub async fn pending_events(&self, webhook_id: &str, limit: u32) -> Result<PendingEvents> {
        self.get_query(
            &format!("/v1/webhooks/{webhook_id}/events/pending"),
            &[("limit", limit)],
        )
        .await
    }

    pub async fn ack_event(
        &self,
        webhook_id: &str,
        event_id: &str,
        status: u16,
    ) -> Result<WebhookAttempt> {
        self.post(
            &format!("/v1/webhooks/{webhook_id}/events/{event_id}/ack"),
            &serde_json::json!({ "status": status }),
        )
        .await
    }

    // ---- open routes ----

    pub async fn healthz(&self) -> Result<Health> {
        self.get("/healthz").await
    }

    pub async fn readyz(&self) -> Result<Health> {
        self.get("/readyz").await
    }

    /// The server's OpenAPI document.
    pub async fn openapi(&self) -> Result<Value> {
        self.get("/v1/openapi.json").await
    }
}

/// Query of a cursor list.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PageQuery {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub starting_after: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ending_before: Option<String>,
}

/// Query of `GET /v1/meters/{id}/usage`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct UsageQuery {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub customer_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_customer_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_by: Option<String>,
}

/// Unused fields of a map-shaped value.
pub type Metadata = BTreeMap<String, String>;
