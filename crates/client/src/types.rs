//! The wire types of the operations the client calls, named as the schemas of
//! docs/openapi.json and holding their fields (`documented!` records each type's
//! field names, which the tests compare with the document). Decimal amounts are
//! strings, as on the wire; times are ISO 8601 strings.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A type that is a schema of the OpenAPI document.
pub trait Documented {
    /// The schema's name in `components.schemas`.
    const SCHEMA: &'static str;
    /// The type's fields, as named on the wire.
    const FIELDS: &'static [&'static str];
    /// Whether the client only sends it (a request body).
    const REQUEST: bool;
}

/// The documented types, for the tests: (schema, fields, request).
pub fn documented() -> Vec<(&'static str, &'static [&'static str], bool)> {
    fn entry<T: Documented>() -> (&'static str, &'static [&'static str], bool) {
        (T::SCHEMA, T::FIELDS, T::REQUEST)
    }
    vec![
        entry::<ErrorDetail>(),
        entry::<Store>(),
        entry::<ModeKeys>(),
        entry::<KeyCreate>(),
        entry::<ApiKey>(),
        entry::<RevokedKey>(),
        entry::<Customer>(),
        entry::<CustomerCreate>(),
        entry::<Meter>(),
        entry::<MeterFilter>(),
        entry::<FilterClause>(),
        entry::<MeterCreate>(),
        entry::<MeterUsage>(),
        entry::<UsageWindow>(),
        entry::<UsageGroup>(),
        entry::<IngestRequest>(),
        entry::<EventInput>(),
        entry::<IngestResult>(),
        entry::<IngestReport>(),
        entry::<Warning>(),
        entry::<UsageEvent>(),
        entry::<VoidRequest>(),
        entry::<EventVoid>(),
        entry::<EventChanges>(),
        entry::<MeterRevisionRequest>(),
        entry::<RevisionChange>(),
        entry::<MeterRevision>(),
        entry::<AmendRequest>(),
        entry::<EventAmendment>(),
        entry::<CreditAccount>(),
        entry::<AccountCreate>(),
        entry::<Movement>(),
        entry::<CreditTransaction>(),
        entry::<CreditEntry>(),
        entry::<GrantCreate>(),
        entry::<CreditGrant>(),
        entry::<ReservationCreate>(),
        entry::<CreditReservation>(),
        entry::<Webhook>(),
        entry::<WebhookInput>(),
        entry::<PendingEvents>(),
        entry::<WebhookEvent>(),
        entry::<WebhookAttempt>(),
        entry::<Health>(),
    ]
}

macro_rules! documented {
    (
        $(#[$meta:meta])*
        $kind:ident pub struct $name:ident {
            $( $(#[$field_meta:meta])* pub $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        pub struct $name {
            $( $(#[$field_meta])* pub $field: $ty ),*
        }

        impl Documented for $name {
            const SCHEMA: &'static str = stringify!($name);
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
            const REQUEST: bool = documented!(@request $kind);
        }
    };
    (@request request) => { true };
    (@request response) => { false };
}

/// A cursor list of `T`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    pub object: String,
    pub data: Vec<T>,
    pub has_more: bool,
}

documented! {
    /// The `error` object of every error answer.
    response pub struct ErrorDetail {
        pub r#type: String,
        pub code: Option<String>,
        pub message: String,
        pub param: Option<String>,
        #[serde(default)]
        pub details: Option<BTreeMap<String, Value>>,
        pub request_id: String,
    }
}

documented! {
    response pub struct ModeKeys {
        pub test: String,
        pub prod: String,
    }
}

documented! {
    /// A store and its first two keys (shown once).
    response pub struct Store {
        pub id: String,
        pub object: String,
        pub name: String,
        pub api_keys: ModeKeys,
        pub api_key_ids: ModeKeys,
        pub created_at: String,
    }
}

documented! {
    request pub struct KeyCreate {
        /// `test` or `prod`.
        pub mode: String,
        /// `all` or `<resource>:read|write`.
        pub permissions: Vec<String>,
    }
}

documented! {
    response pub struct ApiKey {
        pub id: String,
        pub object: String,
        pub key: String,
        pub mode: String,
        pub permissions: Vec<String>,
    }
}

documented! {
    response pub struct RevokedKey {
        pub id: String,
        pub object: String,
        pub revoked: bool,
    }
}

documented! {
    response pub struct Customer {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub email: Option<String>,
        pub name: Option<String>,
        pub country: Option<String>,
        pub metadata: BTreeMap<String, String>,
        pub external_id: Option<String>,
        pub created_at: String,
        pub updated_at: String,
    }
}

documented! {
    request pub struct CustomerCreate {
        pub email: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub country: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub metadata: Option<BTreeMap<String, String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub external_id: Option<String>,
    }
}

documented! {
    response pub struct FilterClause {
        pub property: String,
        pub operator: String,
        pub value: Value,
    }
}

documented! {
    response pub struct MeterFilter {
        pub conjunction: String,
        pub clauses: Vec<FilterClause>,
    }
}

documented! {
    response pub struct Meter {
        pub id: String,
        pub object: String,
        pub store_id: String,
        pub mode: String,
        pub name: String,
        pub event_name: String,
        pub aggregation: String,
        pub aggregation_property: Option<String>,
        pub filter: MeterFilter,
        pub unit_label: String,
        pub status: String,
        pub counts_from: String,
        /// 1 when created; each revision adds one.
        pub revision: u32,
        pub created_at: String,
        pub updated_at: String,
    }
}

documented! {
    /// A revision: fields given replace the meter's (`Some(None)` sends null).
    request pub struct MeterRevisionRequest {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub filter: Option<Option<MeterFilter>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub aggregation_property: Option<Option<String>>,
        pub dry_run: bool,
    }
}

documented! {
    response pub struct RevisionChange {
        pub customer_id: String,
        pub before: Option<String>,
        pub after: Option<String>,
    }
}

documented! {
    response pub struct MeterRevision {
        pub object: String,
        pub dry_run: bool,
        pub revision: u32,
        pub changes: Vec<RevisionChange>,
        #[serde(default)]
        pub meter: Option<Meter>,
    }
}

documented! {
    request pub struct MeterCreate {
        pub name: String,
        pub event_name: String,
        /// `count`, `sum`, `average`, `min`, `max`, `unique`, `latest`,
        /// `time_weighted_sum`.
        pub aggregation: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub aggregation_property: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub filter: Option<MeterFilter>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub unit_label: Option<String>,
    }
}

documented! {
    response pub struct UsageWindow {
        pub start: String,
        pub end: String,
        pub value: Option<String>,
    }
}

documented! {
    response pub struct UsageGroup {
        pub customer_id: Option<String>,
        pub value: Option<String>,
        pub windows: Vec<UsageWindow>,
    }
}

documented! {
    response pub struct MeterUsage {
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
        #[serde(default)]
        pub groups: Option<Vec<UsageGroup>>,
    }
}

documented! {
    request pub struct EventInput {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub event_id: Option<String>,
        pub name: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub customer_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub external_customer_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub timestamp: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub properties: Option<BTreeMap<String, Value>>,
    }
}

documented! {
    request pub struct IngestRequest {
        pub events: Vec<EventInput>,
    }
}

documented! {
    response pub struct Warning {
        pub code: String,
        pub message: String,
    }
}

documented! {
    response pub struct IngestReport {
        pub event_id: String,
        pub customer_id: String,
        pub duplicate: bool,
        pub matched_meters: Vec<String>,
        pub warnings: Vec<Warning>,
    }
}

documented! {
    response pub struct IngestResult {
        pub object: String,
        pub accepted: u64,
        pub duplicates: u64,
        pub events: Vec<IngestReport>,
    }
}

documented! {
    response pub struct UsageEvent {
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
        /// A voided event counts in no meter.
        pub voided: bool,
        pub void_reason: Option<String>,
        pub voided_at: Option<String>,
    }
}

documented! {
    request pub struct VoidRequest {
        /// 1 to 100 ids of stored events.
        pub event_ids: Vec<String>,
        pub reason: String,
    }
}

documented! {
    response pub struct EventVoid {
        pub object: String,
        pub voided: Vec<String>,
        pub already_voided: Vec<String>,
    }
}

documented! {
    /// What an amendment changes; the customer never changes.
    request pub struct EventChanges {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub event_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub timestamp: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub properties: Option<BTreeMap<String, Value>>,
    }
}

documented! {
    request pub struct AmendRequest {
        pub event: EventChanges,
        pub reason: String,
    }
}

documented! {
    response pub struct EventAmendment {
        pub object: String,
        pub voided: String,
        pub replacement: UsageEvent,
    }
}

documented! {
    response pub struct CreditAccount {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub store_id: String,
        pub customer_id: String,
        pub name: String,
        pub unit_label: String,
        pub status: String,
        /// A decimal string.
        pub balance: String,
        /// `balance` less what live reservations hold.
        pub available_balance: String,
        #[serde(default)]
        pub low_balance_threshold: Option<String>,
        #[serde(default)]
        pub auto_recharge: Option<Value>,
        pub created_at: String,
        pub updated_at: String,
    }
}

documented! {
    request pub struct AccountCreate {
        pub customer_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub unit_label: Option<String>,
        /// A decimal string.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub initial_balance: Option<String>,
    }
}

documented! {
    request pub struct Movement {
        /// A decimal string.
        pub amount: String,
        pub idempotency_key: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub description: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub metadata: Option<BTreeMap<String, String>>,
    }
}

documented! {
    request pub struct GrantCreate {
        /// A decimal string.
        pub amount: String,
        pub idempotency_key: String,
        /// ISO 8601, in the future.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub expires_at: Option<String>,
        /// 0 (drawn first) to 100; default 50.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub priority: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub description: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub metadata: Option<BTreeMap<String, String>>,
    }
}

documented! {
    response pub struct CreditGrant {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub account_id: String,
        pub amount: String,
        pub remaining: String,
        pub priority: i64,
        #[serde(default)]
        pub expires_at: Option<String>,
        /// `active`, `consumed`, `expired` or `voided`.
        pub status: String,
        pub transaction_id: String,
        #[serde(default)]
        pub description: Option<String>,
        #[serde(default)]
        pub metadata: BTreeMap<String, String>,
        pub created_at: String,
        pub updated_at: String,
    }
}

documented! {
    request pub struct ReservationCreate {
        /// A decimal string.
        pub amount: String,
        pub idempotency_key: String,
        /// 1 to 86400; default 300.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub expires_in_seconds: Option<i64>,
    }
}

documented! {
    response pub struct CreditReservation {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub account_id: String,
        pub amount: String,
        /// `held`, `committed`, `released` or `expired`.
        pub status: String,
        pub idempotency_key: String,
        pub expires_at: String,
        #[serde(default)]
        pub transaction_id: Option<String>,
        #[serde(default)]
        pub committed_amount: Option<String>,
        pub created_at: String,
        pub updated_at: String,
    }
}

documented! {
    response pub struct CreditEntry {
        pub id: String,
        pub object: String,
        pub transaction_id: String,
        pub account_id: String,
        pub amount: String,
        /// A customer account's entry: the grant it gave to or drew from.
        #[serde(default)]
        pub grant_id: Option<String>,
        #[serde(default)]
        pub balance_after: Option<String>,
        pub created_at: String,
    }
}

documented! {
    response pub struct CreditTransaction {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub r#type: String,
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
}

documented! {
    response pub struct Webhook {
        pub id: String,
        pub object: String,
        pub mode: String,
        pub store_id: String,
        pub name: Option<String>,
        pub url: String,
        pub delivery_mode: String,
        pub status: String,
        pub events: Vec<String>,
        pub created_at: String,
        pub updated_at: String,
        #[serde(default)]
        pub secret: Option<String>,
    }
}

documented! {
    request pub struct WebhookInput {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub url: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub delivery_mode: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub events: Option<Vec<String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub status: Option<String>,
    }
}

/// The request of `create_webhook`.
pub type WebhookCreate = WebhookInput;

documented! {
    response pub struct WebhookEvent {
        pub id: String,
        pub object: String,
        pub event_type: String,
        pub created_at: String,
        /// The exact bytes an HTTP delivery would carry.
        pub body: String,
        pub headers: BTreeMap<String, String>,
    }
}

documented! {
    response pub struct PendingEvents {
        pub object: String,
        pub items: Vec<WebhookEvent>,
    }
}

documented! {
    response pub struct WebhookAttempt {
        pub id: String,
        pub object: String,
        pub endpoint_id: String,
        pub event_id: String,
        pub attempt: u32,
        pub status_code: Option<u16>,
        pub latency_ms: u64,
        pub failure_reason: Option<String>,
        pub delivered: bool,
        pub manual: bool,
        pub next_attempt_at: Option<String>,
        pub created_at: String,
    }
}

documented! {
    response pub struct Health {
        pub status: String,
        #[serde(default)]
        pub lagging: Option<bool>,
        #[serde(default)]
        pub apply_lag_ms: Option<u64>,
    }
}
