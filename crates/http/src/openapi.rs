//! The OpenAPI 3.1 document of the API, generated from the route handlers: every
//! handler carries a `#[utoipa::path]` annotation and is registered through
//! `utoipa_axum::routes!`, so a route exists in the router exactly when it is in the
//! document (docs/api.md, "OpenAPI document"). This module adds what every route
//! shares: the error responses of the middleware, the `x-api-key` security scheme,
//! the shared parameters and the schemas of the wire objects.
//!
//! The schema structs below are never built: responses are rendered by `wire.rs`.
//! They describe those renderings, and the tests that validate real responses
//! against this document (and the contract fuzzer in `.ci/run`) keep them true.

#![allow(dead_code)]

use std::collections::BTreeMap;

use serde_json::Value;
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{self, ApiKeyValue, SecurityScheme};
use utoipa::openapi::{Content, OpenApi, Ref, Response};
use utoipa::{IntoParams, Modify, ToSchema};

/// Where the document is served (no key needed).
pub const OPENAPI_PATH: &str = "/v1/openapi.json";

/// The document for both listeners (the admin routes exist on the production one).
pub fn document() -> OpenApi {
    let (_, mut api) = crate::api_router(true).split_for_parts();
    Shared.modify(&mut api);
    bodies_without_required_fields_are_optional(&mut api);
    api
}

/// The document as served and as written to `docs/openapi.json`: pretty JSON with a
/// final newline, so the file diffs well.
pub fn document_json() -> String {
    let mut text = serde_json::to_string_pretty(&document())
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

/// A request body whose schema requires no field may be left out (an empty body
/// reads as `{}`: docs/api.md, "Errors, request ids, limits").
fn bodies_without_required_fields_are_optional(api: &mut OpenApi) {
    let components = api.components.as_ref();
    let requires_nothing = |name: &str| -> bool {
        components
            .and_then(|c| c.schemas.get(name))
            .and_then(|schema| serde_json::to_value(schema).ok())
            .is_some_and(|schema| {
                // A plain object schema (not a composition that adds required fields).
                schema.get("allOf").is_none()
                    && schema["required"]
                        .as_array()
                        .is_none_or(|required| required.is_empty())
            })
    };
    for item in api.paths.paths.values_mut() {
        for operation in [item.post.as_mut(), item.delete.as_mut()] {
            let Some(utoipa::openapi::RefOr::T(body)) =
                operation.and_then(|o| o.request_body.as_mut())
            else {
                continue;
            };
            let refs = serde_json::to_value(&*body).unwrap_or_default();
            let optional = refs["content"]["application/json"]["schema"]["$ref"]
                .as_str()
                .and_then(|r| r.strip_prefix("#/components/schemas/"))
                .is_some_and(requires_nothing);
            if optional {
                body.required = None;
            }
        }
    }
}

/// The document's frame: info, tags, the security scheme, the shared schemas.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Tally API",
        description = "Usage metering, credits ledger and billing. The contract in prose is docs/api.md; this document is generated from the route handlers.",
        license(name = "Proprietary"),
    ),
    servers(
        (url = "http://127.0.0.1:8080", description = "production listener (`--listen`)"),
        (url = "http://127.0.0.1:8081", description = "test listener (`--test-listen`)"),
    ),
    security(("api_key" = [])),
    components(schemas(ErrorBody, ErrorDetail, Deleted)),
    tags(
        (name = "customers"), (name = "meters"), (name = "events"), (name = "usage"),
        (name = "customer-credits"), (name = "products"), (name = "discounts"),
        (name = "checkouts"), (name = "transactions"), (name = "subscriptions"),
        (name = "test-clock"), (name = "store"), (name = "affiliates"),
        (name = "moderation"), (name = "webhooks"), (name = "admin"), (name = "health"),
    )
)]
pub struct ApiDoc;

/// Adds to every operation the responses its middleware may give, and the
/// security scheme.
struct Shared;

/// An error response whose body is [`ErrorBody`].
pub fn error_response(description: &str) -> Response {
    Response::builder()
        .description(description)
        .content(
            "application/json",
            Content::new(Some(Ref::from_schema_name("ErrorBody"))),
        )
        .build()
}

/// Paths served without an API key.
fn is_open(path: &str) -> bool {
    !path.starts_with("/v1/") || path == OPENAPI_PATH
}

fn add_missing(operation: &mut Operation, status: &str, description: &str) {
    operation
        .responses
        .responses
        .entry(status.to_string())
        .or_insert_with(|| error_response(description).into());
}

impl Modify for Shared {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::ApiKey(security::ApiKey::Header(ApiKeyValue::with_description(
                "x-api-key",
                "tally_prod_... on the production listener, tally_test_... on the test listener",
            ))),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(utoipa::openapi::security::Http::new(
                utoipa::openapi::security::HttpAuthScheme::Bearer,
            )),
        );
        for (path, item) in openapi.paths.paths.iter_mut() {
            let open = is_open(path);
            let has_path_params = path.contains('{');
            let admin = path.starts_with("/admin/");
            for (method, operation) in [
                ("get", item.get.as_mut()),
                ("post", item.post.as_mut()),
                ("delete", item.delete.as_mut()),
            ] {
                let Some(operation) = operation else { continue };
                if open && !admin {
                    operation.security = Some(Vec::new());
                }
                if admin {
                    operation.security =
                        Some(vec![utoipa::openapi::security::SecurityRequirement::new::<
                            &str,
                            [&str; 0],
                            &str,
                        >("admin_token", [])]);
                }
                if !open || admin {
                    add_missing(
                        operation,
                        "401",
                        "authentication_error: api_key_missing, api_key_invalid, api_key_wrong_environment (admin: admin_token_invalid)",
                    );
                }
                if !open {
                    add_missing(operation, "403", "permission_error: permission_denied");
                    add_missing(operation, "429", "rate_limit_error: rate_limited");
                }
                if has_path_params {
                    add_missing(operation, "404", "resource_missing");
                }
                let takes_cursor = operation.parameters.iter().flatten().any(
                    |p| matches!(p, utoipa::openapi::RefOr::T(p) if p.name == "starting_after"),
                );
                if takes_cursor {
                    add_missing(
                        operation,
                        "404",
                        "resource_missing (param `starting_after` or `ending_before`: no item has that id)",
                    );
                }
                if method != "get" {
                    add_missing(
                        operation,
                        "400",
                        "invalid_request_error: invalid_json, invalid_content_type, invalid_content_encoding, parameter_missing, parameter_invalid, parameter_unknown, body_unreadable",
                    );
                    add_missing(operation, "408", "body_read_timeout");
                    add_missing(operation, "413", "body_too_large, record_too_large");
                    add_missing(
                        operation,
                        "409",
                        "idempotency_key_reused, idempotency_key_in_use, resource_changed",
                    );
                } else if !open {
                    add_missing(
                        operation,
                        "400",
                        "invalid_request_error: parameter_invalid (a query parameter)",
                    );
                }
                if !open || admin {
                    add_missing(
                        operation,
                        "503",
                        "api_error: not_ready, projector_failed, log_unavailable, projection_lagging, outcome_pending, outcome_unknown, partition_unavailable, partition_moved, request_timeout",
                    );
                    add_missing(operation, "500", "api_error: internal_error");
                }
            }
        }
    }
}

/// Every error: docs/api.md, "Errors, request ids, limits".
#[derive(ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
    /// The request id again (`x-request-id`).
    pub trace_id: String,
}

#[derive(ToSchema)]
pub struct ErrorDetail {
    /// `invalid_request_error`, `card_error`, `authentication_error`,
    /// `permission_error`, `rate_limit_error` or `api_error`.
    #[schema(rename = "type")]
    pub error_type: String,
    /// What went wrong, machine-readable.
    pub code: Option<String>,
    pub message: String,
    /// The request field at fault (`events[3].timestamp`).
    pub param: Option<String>,
    pub details: Option<BTreeMap<String, Value>>,
    pub request_id: String,
}

/// A deleted resource.
#[derive(ToSchema)]
pub struct Deleted {
    pub id: String,
    pub object: String,
    pub deleted: bool,
}

/// The cursor of a list (docs/api.md, "Lists").
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CursorParams {
    /// 1..100, default 10.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// An item id: the page after it (older items).
    pub starting_after: Option<String>,
    /// An item id: the page before it (newer items).
    pub ending_before: Option<String>,
}

/// The page of a page-based list (affiliates, invitations).
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageParams {
    /// 1-based, default 1, at most `MAX_PAGE_NUMBER` (1,000,000).
    #[param(minimum = 1, maximum = 1_000_000)]
    pub page: Option<u32>,
    /// 1..100, default 10.
    #[param(minimum = 1, maximum = 100)]
    pub page_size: Option<u32>,
}

/// The id in the path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
pub struct IdParam {
    pub id: String,
}

/// The body of an action that takes none (`{}` or an empty body).
#[derive(ToSchema)]
pub struct NoBody {}

/// A cursor list (docs/api.md, "Lists").
#[derive(ToSchema)]
pub struct List<T: ToSchema> {
    /// Always `list`.
    pub object: String,
    /// Newest first.
    pub data: Vec<T>,
    /// Exact: one more item exists past this page.
    pub has_more: bool,
}

/// A page-based list (affiliates, invitations).
#[derive(ToSchema)]
pub struct Paged<T: ToSchema> {
    pub items: Vec<T>,
    pub pagination: Pagination,
}

#[derive(ToSchema)]
pub struct Pagination {
    pub total_records: u64,
    pub total_pages: u64,
    pub current_page: u64,
    /// Null on the last page.
    pub next_page: Option<u64>,
    /// Null on the first page.
    pub prev_page: Option<u64>,
}

// ---- health and admin ----

#[derive(ToSchema)]
pub struct Health {
    /// `ok` (healthz) or `ready` (readyz).
    pub status: String,
    /// readyz: writes wait for the projection.
    pub lagging: Option<bool>,
    pub apply_lag_ms: Option<u64>,
}

#[derive(ToSchema)]
pub struct StoreCreate {
    /// 1..255 characters.
    pub name: String,
}

#[derive(ToSchema)]
pub struct ModeKeys {
    pub test: String,
    pub prod: String,
}

/// A store and its first two keys (shown once).
#[derive(ToSchema)]
pub struct Store {
    pub id: String,
    pub object: String,
    pub name: String,
    pub api_keys: ModeKeys,
    pub api_key_ids: ModeKeys,
    pub created_at: String,
}

#[derive(ToSchema)]
pub struct KeyCreate {
    /// `test` or `prod`.
    pub mode: String,
    /// `all` or `<resource>:read|write`.
    pub permissions: Vec<String>,
}

/// A restricted key (the key shown once).
#[derive(ToSchema)]
pub struct ApiKey {
    pub id: String,
    pub object: String,
    pub key: String,
    pub mode: String,
    pub permissions: Vec<String>,
}

#[derive(ToSchema)]
pub struct RevokedKey {
    pub id: String,
    pub object: String,
    pub revoked: bool,
}

// ---- customers ----

#[derive(ToSchema)]
pub struct Customer {
    /// `cus_...`
    pub id: String,
    pub object: String,
    /// `prod` or `test`.
    pub mode: String,
    pub email: Option<String>,
    pub name: Option<String>,
    pub country: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub external_id: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(ToSchema)]
pub struct CustomerCreate {
    pub email: String,
    pub name: Option<String>,
    /// ISO 3166-1 alpha-2.
    pub country: Option<String>,
    /// Strings, numbers or booleans, stored as strings.
    pub metadata: Option<BTreeMap<String, Value>>,
    pub external_id: Option<String>,
}

/// An absent field is kept, `null` clears it (not `email`).
#[derive(ToSchema)]
pub struct CustomerUpdate {
    pub email: Option<String>,
    pub name: Option<String>,
    pub country: Option<String>,
    pub metadata: Option<BTreeMap<String, Value>>,
    pub external_id: Option<String>,
}

// ---- meters and usage ----

#[derive(ToSchema)]
pub struct FilterClause {
    pub property: String,
    /// `eq ne gt gte lt lte like not_like in exists`.
    pub operator: String,
    /// A string, number, boolean, or (for `in`) an array of those.
    pub value: Value,
}

#[derive(ToSchema)]
pub struct MeterFilter {
    /// `and` or `or`.
    pub conjunction: String,
    pub clauses: Vec<FilterClause>,
}

#[derive(ToSchema)]
pub struct Meter {
    /// `mtr_...`
    pub id: String,
    pub object: String,
    pub store_id: String,
    pub mode: String,
    pub name: String,
    pub event_name: String,
    /// `count`, `sum`, `average`, `min`, `max`, `unique`, `latest`,
    /// `time_weighted_sum`.
    pub aggregation: String,
    pub aggregation_property: Option<String>,
    pub filter: MeterFilter,
    pub unit_label: String,
    /// `active` or `archived`.
    pub status: String,
    pub counts_from: String,
    /// 1 when created; each revision adds one.
    pub revision: u32,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(ToSchema)]
pub struct MeterRevisionRequest {
    /// Replaces the filter (null: no filter); absent keeps it.
    pub filter: Option<MeterFilter>,
    /// Replaces the aggregation property (null only for `count`); absent keeps it.
    pub aggregation_property: Option<String>,
    /// `true`: only say which customers' usage would change.
    pub dry_run: bool,
}

#[derive(ToSchema)]
pub struct RevisionChange {
    pub customer_id: String,
    /// Decimal string, or null where the aggregation has no value.
    pub before: Option<String>,
    pub after: Option<String>,
}

#[derive(ToSchema)]
pub struct MeterRevision {
    /// `meter_revision`
    pub object: String,
    pub dry_run: bool,
    /// The revision the meter has (or, on a dry run, would have).
    pub revision: u32,
    /// Customers whose usage over the last 35 days changes, with their values.
    pub changes: Vec<RevisionChange>,
    /// The revised meter (not on a dry run).
    pub meter: Option<Meter>,
}

#[derive(ToSchema)]
pub struct MeterCreate {
    pub name: String,
    pub event_name: String,
    pub aggregation: String,
    pub aggregation_property: Option<String>,
    pub filter: Option<MeterFilter>,
    pub unit_label: Option<String>,
}

#[derive(ToSchema)]
pub struct MeterUpdate {
    pub name: Option<String>,
    pub unit_label: Option<String>,
}

#[derive(ToSchema)]
pub struct Backfill {
    /// ISO 8601; at most 35 days back.
    pub start: String,
}

#[derive(ToSchema)]
pub struct DefinitionPreview {
    pub event_name: String,
    pub aggregation: String,
    pub aggregation_property: Option<String>,
    pub filter: Option<MeterFilter>,
    pub start: Option<String>,
    pub end: Option<String>,
    /// `none`, `minute`, `hour`, `day`.
    pub window: Option<String>,
    pub customer_id: Option<String>,
    pub external_customer_id: Option<String>,
}

#[derive(ToSchema)]
pub struct MeterPreviewRequest {
    pub start: Option<String>,
    pub end: Option<String>,
    pub window: Option<String>,
    pub customer_id: Option<String>,
    pub external_customer_id: Option<String>,
}

#[derive(ToSchema)]
pub struct UsageWindow {
    pub start: String,
    pub end: String,
    /// A decimal string; null for `average`, `min`, `max`, `latest` without a data
    /// point.
    pub value: Option<String>,
}

#[derive(ToSchema)]
pub struct UsageGroup {
    pub customer_id: Option<String>,
    pub value: Option<String>,
    pub windows: Vec<UsageWindow>,
}

#[derive(ToSchema)]
pub struct MeterUsage {
    pub object: String,
    pub meter_id: String,
    pub customer_id: Option<String>,
    pub aggregation: String,
    pub unit_label: String,
    pub start: String,
    pub end: String,
    pub window: String,
    pub value: Option<String>,
    pub windows: Vec<UsageWindow>,
    /// With `group_by=customer_id`.
    pub groups: Option<Vec<UsageGroup>>,
}

#[derive(ToSchema)]
pub struct MeterPreview {
    pub object: String,
    pub aggregation: String,
    pub customer_id: Option<String>,
    pub value: Option<String>,
    pub windows: Vec<UsageWindow>,
    pub events_scanned: u64,
    pub events_matched: u64,
    pub truncated: bool,
}

// ---- usage events ----

#[derive(ToSchema)]
pub struct EventInput {
    /// 1-255 characters; absent: the service assigns one.
    pub event_id: Option<String>,
    /// 1-128 characters.
    pub name: String,
    pub customer_id: Option<String>,
    pub external_customer_id: Option<String>,
    /// ISO 8601 with an offset; default the receipt time.
    pub timestamp: Option<String>,
    /// At most 50 string or number values.
    pub properties: Option<BTreeMap<String, Value>>,
}

#[derive(ToSchema)]
pub struct IngestRequest {
    /// 1..100 events.
    pub events: Vec<EventInput>,
}

/// A preview takes any objects: each is validated and reported in place.
#[derive(ToSchema)]
pub struct PreviewRequest {
    /// 1..100 events, valid or not.
    pub events: Vec<Value>,
}

#[derive(ToSchema)]
pub struct Warning {
    pub code: String,
    pub message: String,
}

#[derive(ToSchema)]
pub struct IngestReport {
    pub event_id: String,
    pub customer_id: String,
    pub duplicate: bool,
    pub matched_meters: Vec<String>,
    pub warnings: Vec<Warning>,
}

#[derive(ToSchema)]
pub struct IngestResult {
    pub object: String,
    pub accepted: u64,
    pub duplicates: u64,
    pub events: Vec<IngestReport>,
}

#[derive(ToSchema)]
pub struct EventError {
    pub code: String,
    pub message: String,
    pub param: Option<String>,
}

#[derive(ToSchema)]
pub struct PreviewReport {
    pub valid: bool,
    pub event_id: Option<String>,
    pub customer_id: Option<String>,
    pub duplicate: bool,
    pub matched_meters: Vec<String>,
    pub warnings: Vec<Warning>,
    pub error: Option<EventError>,
}

#[derive(ToSchema)]
pub struct IngestPreview {
    pub object: String,
    pub valid: bool,
    pub events: Vec<PreviewReport>,
}

#[derive(ToSchema)]
pub struct UsageEvent {
    pub id: String,
    pub object: String,
    pub mode: String,
    pub event_id: String,
    pub name: String,
    pub customer_id: String,
    pub external_customer_id: Option<String>,
    pub timestamp: String,
    pub properties: BTreeMap<String, Value>,
    pub received_at: String,
    pub matched_meters: Vec<String>,
    /// Voided events count in no meter; they are listed only with `include_voided=true`.
    pub voided: bool,
    pub void_reason: Option<String>,
    /// ISO 8601 (the time the void was recorded).
    pub voided_at: Option<String>,
}

#[derive(ToSchema)]
pub struct VoidRequest {
    /// 1 to 100 ids of stored events; repeats count once.
    pub event_ids: Vec<String>,
    /// 1 to 500 characters.
    pub reason: String,
}

#[derive(ToSchema)]
pub struct EventVoid {
    /// `event_void`
    pub object: String,
    /// Ids this request voided.
    pub voided: Vec<String>,
    /// Ids that were voided before (left as they were).
    pub already_voided: Vec<String>,
}

#[derive(ToSchema)]
pub struct AmendRequest {
    pub event: EventChanges,
    /// 1 to 500 characters.
    pub reason: String,
}

/// What the replacement changes; each field given replaces the original's, the
/// customer never changes (`customer_id` or `external_customer_id` here is a 400).
#[derive(ToSchema)]
pub struct EventChanges {
    /// A new id (a taken one is a 409 `event_id_taken`); omitted: one is assigned.
    pub event_id: Option<String>,
    pub name: Option<String>,
    /// ISO 8601; omitted: the original's (it must still be ingestible).
    pub timestamp: Option<String>,
    /// Replaces the original's properties whole.
    pub properties: Option<std::collections::BTreeMap<String, serde_json::Value>>,
}

#[derive(ToSchema)]
pub struct EventAmendment {
    /// `event_amendment`
    pub object: String,
    /// The amended event's id, now voided.
    pub voided: String,
    pub replacement: UsageEvent,
}

// ---- customer credits ----

#[derive(ToSchema)]
pub struct CreditAccount {
    /// `ca_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    pub store_id: String,
    pub customer_id: String,
    pub name: String,
    pub unit_label: String,
    /// `active`, `frozen` or `closed`.
    pub status: String,
    /// A decimal string.
    pub balance: String,
    /// A decimal string or null: `credits.balance_low` fires each time the
    /// available balance crosses below it.
    pub low_balance_threshold: Option<String>,
    /// `{"threshold", "amount"}` or null.
    pub auto_recharge: Option<AutoRechargeTerms>,
    /// `balance` less what live reservations hold (what a debit or a new
    /// reservation may take). With `at`, the balance at that instant: holds are not
    /// kept as history.
    pub available_balance: String,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(ToSchema)]
pub struct GrantCreate {
    /// A decimal string > 0.
    pub amount: String,
    pub idempotency_key: String,
    /// ISO 8601, in the future; none: the grant never expires.
    pub expires_at: Option<String>,
    /// 0 (drawn first) to 100; default 50.
    pub priority: Option<i64>,
    pub description: Option<String>,
    pub metadata: Option<BTreeMap<String, Value>>,
}

#[derive(ToSchema)]
pub struct CreditGrant {
    /// `grt_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    pub account_id: String,
    /// What the grant gave.
    pub amount: String,
    /// What it has left.
    pub remaining: String,
    pub priority: i64,
    pub expires_at: Option<String>,
    /// `active`, `consumed`, `expired` or `voided`.
    pub status: String,
    /// The transaction that made it.
    pub transaction_id: String,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(ToSchema)]
pub struct ReservationCreate {
    /// A decimal string > 0: what to hold.
    pub amount: String,
    pub idempotency_key: String,
    /// 1 to 86400; default 300.
    pub expires_in_seconds: Option<i64>,
}

#[derive(ToSchema)]
pub struct ReservationCommit {
    /// A decimal string, at most what is held; default: all of it.
    pub amount: Option<String>,
}

#[derive(ToSchema)]
pub struct CreditReservation {
    /// `rsv_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    pub account_id: String,
    /// What the reservation holds (or held).
    pub amount: String,
    /// `held`, `committed`, `released` or `expired`.
    pub status: String,
    pub idempotency_key: String,
    pub expires_at: String,
    /// The debit a commit made.
    pub transaction_id: Option<String>,
    pub committed_amount: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(ToSchema)]
pub struct AccountCreate {
    pub customer_id: String,
    pub name: Option<String>,
    pub unit_label: Option<String>,
    /// A decimal string, >= 0.
    pub initial_balance: Option<String>,
    /// A decimal string, >= 0.
    pub low_balance_threshold: Option<String>,
    pub auto_recharge: Option<AutoRechargeTerms>,
}

#[derive(ToSchema)]
pub struct AutoRechargeTerms {
    /// A decimal string, >= 0: a debit that leaves the balance below it recharges.
    pub threshold: String,
    /// A decimal string, > 0: the grant booked right after that debit.
    pub amount: String,
    /// Integer minor units, 1..=10,000,000,000, or null: what one recharge costs,
    /// charged on the customer's last successful payment method before the grant
    /// is booked (a decline clears `auto_recharge`). Null: the grant is free.
    pub price: Option<i64>,
    /// ISO 4217 code, required with `price`.
    pub currency: Option<String>,
}

#[derive(ToSchema)]
pub struct AccountUpdate {
    /// A decimal string >= 0, or null to clear; absent keeps it.
    pub low_balance_threshold: Option<String>,
    /// An object, or null to clear; absent keeps it.
    pub auto_recharge: Option<AutoRechargeTerms>,
}

#[derive(ToSchema)]
pub struct Movement {
    /// A decimal string: plain digits, at most 18 fractional digits.
    pub amount: String,
    pub idempotency_key: String,
    pub description: Option<String>,
    pub metadata: Option<BTreeMap<String, Value>>,
}

#[derive(ToSchema)]
pub struct CreditEntry {
    /// `ce_...`
    pub id: String,
    pub object: String,
    pub transaction_id: String,
    /// An account id, or `system:issuance|consumption|forfeit`.
    pub account_id: String,
    /// Signed decimal string.
    pub amount: String,
    /// A customer account's entry: the grant it gave to or drew from.
    pub grant_id: Option<String>,
    /// In account listings only.
    pub balance_after: Option<String>,
    pub created_at: String,
}

#[derive(ToSchema)]
pub struct CreditTransaction {
    /// `ctx_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    /// `initial_balance`, `credit`, `debit`, `reversal`, `close`.
    #[schema(rename = "type")]
    pub kind: String,
    pub account_id: String,
    pub amount: String,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub idempotency_key: Option<String>,
    pub reverses: Option<String>,
    pub reversed_by: Option<String>,
    pub entries: Vec<CreditEntry>,
    pub created_at: String,
}

// ---- products ----

#[derive(ToSchema)]
pub struct Product {
    /// `prod_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    pub name: String,
    pub description: Option<String>,
    /// Integer minor units.
    pub price: i64,
    pub currency: String,
    pub billing_type: String,
    pub billing_period: String,
    pub status: String,
    pub tax_mode: String,
    pub tax_category: String,
    pub created_at: String,
    pub updated_at: String,
    pub image_url: Option<String>,
    pub image_urls: Vec<String>,
    pub features: Vec<BTreeMap<String, Value>>,
    pub usage_prices: Vec<BTreeMap<String, Value>>,
    pub recurring_interval: Option<String>,
    pub recurring_interval_count: Option<u32>,
    pub trial_period_days: Option<u32>,
    pub trial_price: Option<i64>,
    pub business_net_pricing: bool,
    pub product_url: Option<String>,
    pub default_success_url: Option<String>,
    pub custom_fields: Vec<BTreeMap<String, Value>>,
}

/// Create: the fields of an update, `name`, `price` and `currency` required.
#[derive(ToSchema, serde::Serialize)]
pub struct ProductCreate {
    pub name: String,
    pub price: i64,
    pub currency: String,
    #[serde(flatten)]
    pub rest: ProductInput,
}

/// Update: an absent field is kept, `null` clears an optional one, a list replaces
/// the whole list.
#[derive(ToSchema, serde::Serialize)]
pub struct ProductInput {
    pub name: Option<String>,
    pub description: Option<String>,
    pub price: Option<i64>,
    pub currency: Option<String>,
    /// `recurring` or `onetime`.
    pub billing_type: Option<String>,
    /// `every-month`, `every-three-months`, `every-six-months`, `every-year`, `once`.
    pub billing_period: Option<String>,
    pub status: Option<String>,
    pub tax_mode: Option<String>,
    pub tax_category: Option<String>,
    pub image_url: Option<String>,
    pub image_urls: Option<Vec<String>>,
    /// `{type, description?, customer_credits?{amount, unit_label?, bucket_name?}}`.
    pub features: Option<Vec<BTreeMap<String, Value>>>,
    /// `{meter_id, unit_price, free_allowance?, cap?, settlement_mode?, target_account?, target_account_name?, trial_usage_mode?}`.
    pub usage_prices: Option<Vec<BTreeMap<String, Value>>>,
    pub trial_period_days: Option<u32>,
    pub trial_price: Option<i64>,
    pub business_net_pricing: Option<bool>,
    pub product_url: Option<String>,
    pub default_success_url: Option<String>,
    pub custom_fields: Option<Vec<BTreeMap<String, Value>>>,
}

// ---- billing ----

#[derive(ToSchema)]
pub struct Discount {
    pub id: String,
    pub object: String,
    pub mode: String,
    /// `draft`, `scheduled`, `active`, `expired`, `deleted`.
    pub status: String,
    pub name: String,
    pub code: String,
    #[schema(rename = "type")]
    pub discount_type: String,
    /// The percent, or minor units.
    pub amount: Value,
    pub currency: Option<String>,
    pub percentage: Option<Value>,
    pub starts_at: Option<String>,
    pub expiry_date: Option<String>,
    pub max_redemptions: Option<u64>,
    pub duration: String,
    pub duration_in_months: Option<u32>,
    pub applies_to_products: Vec<String>,
    pub redeem_count: u64,
    pub created_at: String,
    pub updated_at: String,
}

/// Create: `name`, `code` and `type` required (and `currency` for `fixed`).
#[derive(ToSchema, serde::Serialize)]
pub struct DiscountCreate {
    pub name: String,
    pub code: String,
    #[serde(rename = "type")]
    pub discount_type: String,
    #[serde(flatten)]
    pub rest: DiscountInput,
}

/// Update: `name`, `status`, `expiry_date`, `max_redemptions`; the others are
/// refused with `discount_field_immutable`.
#[derive(ToSchema, serde::Serialize)]
pub struct DiscountInput {
    pub name: Option<String>,
    pub code: Option<String>,
    /// `percentage` or `fixed`.
    #[serde(rename = "type")]
    pub discount_type: Option<String>,
    pub amount: Option<Value>,
    pub percentage: Option<Value>,
    pub currency: Option<String>,
    pub status: Option<String>,
    pub starts_at: Option<String>,
    pub expiry_date: Option<String>,
    pub max_redemptions: Option<u64>,
    pub duration: Option<String>,
    pub duration_in_months: Option<u32>,
    pub applies_to_products: Option<Vec<String>>,
}

#[derive(ToSchema)]
pub struct NewCustomer {
    pub email: String,
}

#[derive(ToSchema)]
pub struct CheckoutCreate {
    pub product_id: String,
    pub customer_id: Option<String>,
    /// Creates the customer (not with `customer_id`).
    pub customer: Option<NewCustomer>,
    /// 1..10,000, default 1.
    pub units: Option<u32>,
    pub discount_code: Option<String>,
    pub affiliate_code: Option<String>,
    pub success_url: Option<String>,
    pub metadata: Option<BTreeMap<String, Value>>,
}

#[derive(ToSchema)]
pub struct CardPayment {
    /// Test cards only (docs/api.md, "Checkouts").
    pub card_number: String,
    pub cvc: String,
    /// `MM/YY` or `MM/YYYY`.
    pub exp: String,
}

#[derive(ToSchema)]
pub struct Checkout {
    pub id: String,
    pub object: String,
    pub mode: String,
    /// `open` or `completed`.
    pub status: String,
    pub product_id: String,
    pub customer_id: String,
    pub units: u32,
    pub amount: i64,
    pub currency: String,
    pub discount_id: Option<String>,
    pub discount_code: Option<String>,
    pub affiliate_code: Option<String>,
    pub success_url: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub transaction_id: Option<String>,
    pub subscription_id: Option<String>,
    pub completed_at: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    /// One-time purchases with `credits` usage prices.
    pub usage_settlement: Option<Vec<BTreeMap<String, Value>>>,
}

#[derive(ToSchema)]
pub struct Line {
    pub description: String,
    pub meter_id: Option<String>,
    pub quantity: String,
    pub unit_price: String,
    pub amount: i64,
}

/// Times in epoch milliseconds, amounts in minor units.
#[derive(ToSchema)]
pub struct Transaction {
    pub id: String,
    pub object: String,
    pub mode: String,
    /// `payment` or `refund`.
    #[schema(rename = "type")]
    pub payment_type: String,
    /// `paid`, `refunded`, `partially_refunded`, `failed`.
    pub status: String,
    pub amount: i64,
    pub currency: String,
    pub amount_paid: i64,
    pub discount_amount: i64,
    pub tax_amount: i64,
    pub refunded_amount: i64,
    pub tax_country: Option<String>,
    pub order: Option<String>,
    pub subscription: Option<String>,
    pub customer: Option<String>,
    pub description: Option<String>,
    pub period_start: Option<i64>,
    pub period_end: Option<i64>,
    pub refunded_transaction: Option<String>,
    pub reason: Option<String>,
    pub disputed: bool,
    pub card_last4: Option<String>,
    pub lines: Vec<Line>,
    pub created_at: i64,
}

#[derive(ToSchema)]
pub struct RefundCreate {
    pub transaction_id: String,
    /// Minor units; default everything left.
    pub amount: Option<i64>,
    pub reason: Option<String>,
}

#[derive(ToSchema)]
pub struct DisputeCreate {
    pub transaction_id: String,
    pub reason: Option<String>,
}

#[derive(ToSchema)]
pub struct Dispute {
    pub id: String,
    pub object: String,
    pub mode: String,
    pub status: String,
    pub transaction_id: String,
    pub customer_id: Option<String>,
    pub amount: i64,
    pub currency: String,
    pub reason: Option<String>,
    pub created_at: String,
}

#[derive(ToSchema)]
pub struct TaxRateSet {
    /// ISO 3166-1 alpha-2.
    pub country: String,
    /// Percent, 0..100, at most 4 decimals.
    pub rate: Value,
}

#[derive(ToSchema)]
pub struct TaxRate {
    pub object: String,
    pub country: String,
    pub rate: String,
}

#[derive(ToSchema)]
pub struct Subscription {
    pub id: String,
    pub object: String,
    pub mode: String,
    /// `trialing`, `active`, `past_due`, `scheduled_cancel`, `paused`, `canceled`, `unpaid`.
    pub status: String,
    /// The product as bought.
    pub product: Product,
    /// The customer as now (`{id, object}` when unknown).
    pub customer: BTreeMap<String, Value>,
    pub collection_method: String,
    pub items: Vec<BTreeMap<String, Value>>,
    pub pending_lines: Vec<Line>,
    pub last_transaction_id: Option<String>,
    pub last_transaction: Option<Transaction>,
    pub last_transaction_date: Option<String>,
    pub next_transaction_date: Option<String>,
    pub current_period_start_date: Option<String>,
    pub current_period_end_date: Option<String>,
    pub trial_end_date: Option<String>,
    pub canceled_at: Option<String>,
    pub cancel_at_period_end: bool,
    pub on_period_end: Option<String>,
    pub paused_at: Option<String>,
    pub payment_retries: u32,
    pub next_retry_date: Option<String>,
    pub discount: Option<BTreeMap<String, Value>>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
    pub usage_settlement: Option<Vec<BTreeMap<String, Value>>>,
}

#[derive(ToSchema)]
pub struct SubscriptionItemInput {
    /// An existing item's id.
    pub id: Option<String>,
    /// Adds an item of another product (one the subscription has no item of).
    pub product_id: Option<String>,
    pub price_id: Option<String>,
    /// 0 removes an added item; without it an item keeps its units, a new one
    /// gets 1.
    pub units: Option<u32>,
}

#[derive(ToSchema)]
pub struct SubscriptionUpdate {
    pub items: Option<Vec<SubscriptionItemInput>>,
    /// `proration-charge-immediately`, `proration-charge`, `proration-none`.
    pub update_behavior: Option<String>,
    pub metadata: Option<BTreeMap<String, Value>>,
}

#[derive(ToSchema)]
pub struct SubscriptionUpgrade {
    pub product_id: String,
    pub update_behavior: Option<String>,
}

#[derive(ToSchema)]
pub struct SubscriptionCancel {
    /// `scheduled` or `immediate`.
    pub mode: Option<String>,
    /// `cancel` or `pause` (scheduled cancels).
    #[schema(rename = "onExecute")]
    pub on_execute: Option<String>,
}

#[derive(ToSchema)]
pub struct UpcomingTransaction {
    pub object: String,
    pub subscription: String,
    pub date: String,
    pub period_start: Option<i64>,
    pub period_end: Option<i64>,
    pub currency: String,
    pub amount: i64,
    pub discount_amount: i64,
    pub tax_amount: i64,
    pub amount_paid: i64,
    pub lines: Vec<Line>,
    pub proration_now: Option<Line>,
}

#[derive(ToSchema)]
pub struct StoreSettings {
    pub object: String,
    /// `scheduled` or `immediate`.
    pub default_cancel_mode: String,
    pub late_usage_grace_seconds: u64,
    /// A decimal string.
    pub affiliate_commission_percent: String,
    pub referral_base_url: Option<String>,
}

#[derive(ToSchema)]
pub struct StoreSettingsInput {
    pub default_cancel_mode: Option<String>,
    /// 0..604800.
    pub late_usage_grace_seconds: Option<u32>,
    pub affiliate_commission_percent: Option<Value>,
    pub referral_base_url: Option<String>,
}

#[derive(ToSchema)]
pub struct TestClock {
    pub object: String,
    pub now: String,
}

#[derive(ToSchema)]
pub struct ClockAdvance {
    /// ISO 8601, not earlier than the clock, at most 732 days ahead.
    pub to: String,
}

// ---- affiliates and moderation ----

#[derive(ToSchema)]
pub struct AffiliateInvite {
    pub id: String,
    pub object: String,
    pub mode: String,
    pub email: String,
    pub name: Option<String>,
    /// `pending` or `accepted`.
    pub status: String,
    pub affiliate_id: Option<String>,
    /// Epoch milliseconds.
    pub created_at: i64,
}

#[derive(ToSchema)]
pub struct InviteCreate {
    pub email: String,
    pub name: Option<String>,
}

#[derive(ToSchema)]
pub struct Affiliate {
    pub id: String,
    pub object: String,
    pub mode: String,
    pub email: String,
    pub name: Option<String>,
    /// `active` or `suspended`.
    pub status: String,
    pub referral_code: String,
    /// The store's `referral_base_url` with `ref=<code>` added; `?ref=<code>` alone
    /// while the store has none.
    pub referral_link: String,
    pub clicks: u64,
    pub conversions: u64,
    /// Minor units of `currency`.
    pub earnings: i64,
    pub currency: Option<String>,
    pub created_at: String,
}

#[derive(ToSchema)]
pub struct AffiliateUpdate {
    pub status: Option<String>,
    pub name: Option<String>,
}

#[derive(ToSchema)]
pub struct Click {
    pub referral_code: String,
}

#[derive(ToSchema)]
pub struct PromptInput {
    /// 1..32768 characters.
    pub prompt: String,
    pub external_id: Option<String>,
}

#[derive(ToSchema)]
pub struct ModerationUsage {
    pub units: u64,
}

#[derive(ToSchema)]
pub struct ModerationResult {
    pub id: String,
    pub object: String,
    pub prompt: String,
    /// `allow`, `flag` or `deny`.
    pub decision: String,
    pub reasons: Vec<String>,
    pub usage: ModerationUsage,
    pub external_id: Option<String>,
    pub metered: bool,
}

#[derive(ToSchema)]
pub struct Pii {
    /// `off`, `flag` or `deny`.
    pub email: String,
    pub phone: String,
    pub card: String,
    pub iban: String,
}

#[derive(ToSchema)]
pub struct ModerationPolicy {
    pub object: String,
    pub deny_terms: Vec<String>,
    pub flag_terms: Vec<String>,
    pub deny_patterns: Vec<String>,
    pub flag_patterns: Vec<String>,
    pub pii: Pii,
}

#[derive(ToSchema)]
pub struct PolicyInput {
    pub deny_terms: Option<Vec<String>>,
    pub flag_terms: Option<Vec<String>>,
    pub deny_patterns: Option<Vec<String>>,
    pub flag_patterns: Option<Vec<String>>,
    pub pii: Option<PiiInput>,
}

/// Absent detectors are off.
#[derive(ToSchema)]
pub struct PiiInput {
    /// `off`, `flag` or `deny`.
    pub email: Option<String>,
    pub phone: Option<String>,
    pub card: Option<String>,
    pub iban: Option<String>,
}

// ---- webhooks ----

#[derive(ToSchema)]
pub struct Webhook {
    /// `wh_...`
    pub id: String,
    pub object: String,
    pub mode: String,
    pub store_id: String,
    pub name: Option<String>,
    pub url: String,
    /// `http` or `cli`.
    pub delivery_mode: String,
    /// `enabled` or `disabled`.
    pub status: String,
    pub events: Vec<String>,
    pub created_at: String,
    pub updated_at: String,
    /// On create and rotate only.
    pub secret: Option<String>,
}

/// Create: `events` required (and `url` for `http` endpoints).
#[derive(ToSchema, serde::Serialize)]
pub struct WebhookCreate {
    pub events: Vec<String>,
    #[serde(flatten)]
    pub rest: WebhookInput,
}

#[derive(ToSchema, serde::Serialize)]
pub struct WebhookInput {
    pub name: Option<String>,
    /// Required for `http` endpoints.
    pub url: Option<String>,
    pub delivery_mode: Option<String>,
    pub events: Option<Vec<String>>,
    pub status: Option<String>,
}

#[derive(ToSchema)]
pub struct WebhookSecret {
    pub object: String,
    pub secret: String,
}

#[derive(ToSchema)]
pub struct WebhookAttempt {
    pub id: String,
    pub object: String,
    pub endpoint_id: String,
    pub event_id: String,
    pub attempt: u32,
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    /// Why the attempt failed (null when it was delivered).
    pub failure_reason: Option<String>,
    pub delivered: bool,
    pub manual: bool,
    pub next_attempt_at: Option<String>,
    pub created_at: String,
}

#[derive(ToSchema)]
pub struct WebhookEvent {
    /// The event id.
    pub id: String,
    pub object: String,
    pub event_type: String,
    pub created_at: String,
    /// The exact bytes an HTTP delivery would carry.
    pub body: String,
    pub headers: BTreeMap<String, String>,
}

#[derive(ToSchema)]
pub struct PendingEvents {
    pub object: String,
    pub items: Vec<WebhookEvent>,
}

#[derive(ToSchema)]
pub struct Ack {
    /// 100..599; 200 removes the event from the feed.
    pub status: u16,
}
