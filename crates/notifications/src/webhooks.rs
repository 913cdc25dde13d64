//! Webhooks in the engine: endpoints, the deliveries the projector schedules when an
//! event is applied (in log order, so the endpoints subscribed at that moment decide),
//! attempts folded in from the log, the cli pending feed, and due deliveries for the
//! dispatcher (which lives at the HTTP edge, where bodies are rendered and sent).

use std::ops::Bound;

use tally_domain::ids::{EndpointId, StoreId};
use tally_domain::record::{BillingEvent, LedgerEvent, Record, WebhookAttempt};
use tally_domain::webhook::{
    event_types, validate_url, DeliveryMode, WebhookEndpoint, CLI_PLACEHOLDER_URL,
    MAX_ENDPOINT_NAME_CHARS, ROTATED_SECRET_GRACE_MS,
};
use tally_domain::{FieldError, Mode};
use tally_projection::Visit;
use tally_proto::{v1, Message};

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::{new_id, random_base62};
use tally_core::journal::Update;
use tally_core::keys::{self, DueKey, Key, PendingKey};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::pagination::collect_prefix;
use tally_core::Scope;

use crate::Notifications;

/// 43 base62 characters: more than 32 random bytes (docs/api.md, webhook secrets).
pub const SECRET_RANDOM_CHARS: usize = 43;
/// Endpoints per store and environment (each event is matched against all of them).
pub const MAX_ENDPOINTS_PER_SCOPE: usize = 100;

/// Input of create and update, as the edge parsed it (`None`: not given).
#[derive(Debug, Clone, Default)]
pub struct EndpointInput {
    pub name: Option<String>,
    pub url: Option<String>,
    pub delivery_mode: Option<String>,
    pub events: Option<Vec<String>>,
    pub status: Option<String>,
}

/// A delivery and what is known about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub endpoint_id: String,
    pub event_id: String,
    pub event_type: String,
    pub created_at_ms: i64,
    pub attempts: u32,
    pub delivered: bool,
    pub next_attempt_at_ms: Option<i64>,
    pub first_attempt_at_ms: i64,
    pub last_status_code: u16,
    pub last_error: String,
    pub event_key: Vec<u8>,
    /// cli endpoints: this delivery's key in the pending feed.
    pub pending_key: Vec<u8>,
}

fn corrupt(e: impl std::fmt::Display) -> EngineError {
    EngineError::Corrupt(e.to_string())
}

fn encode_delivery(d: &Delivery) -> Vec<u8> {
    v1::WebhookDelivery {
        endpoint_id: d.endpoint_id.clone(),
        event_id: d.event_id.clone(),
        event_type: d.event_type.clone(),
        created_at_ms: d.created_at_ms,
        attempts: d.attempts,
        delivered: d.delivered,
        next_attempt_at_ms: d.next_attempt_at_ms,
        first_attempt_at_ms: d.first_attempt_at_ms,
        last_status_code: d.last_status_code as u32,
        last_error: d.last_error.clone(),
        event_key: d.event_key.clone(),
        pending_key: d.pending_key.clone(),
    }
    .encode_to_vec()
}

fn decode_delivery(bytes: &[u8]) -> Result<Delivery, EngineError> {
    let d = v1::WebhookDelivery::decode(bytes).map_err(corrupt)?;
    Ok(Delivery {
        endpoint_id: d.endpoint_id,
        event_id: d.event_id,
        event_type: d.event_type,
        created_at_ms: d.created_at_ms,
        attempts: d.attempts,
        delivered: d.delivered,
        next_attempt_at_ms: d.next_attempt_at_ms,
        first_attempt_at_ms: d.first_attempt_at_ms,
        last_status_code: d.last_status_code as u16,
        last_error: d.last_error,
        event_key: d.event_key,
        pending_key: d.pending_key,
    })
}

/// A ledger event's snapshot (table `W`), written with its first delivery.
fn encode_ledger_event(event: &LedgerEvent) -> Vec<u8> {
    tally_proto::ledger_event_to_proto(event).encode_to_vec()
}

fn decode_ledger_event(bytes: &[u8]) -> Result<LedgerEvent, EngineError> {
    tally_proto::ledger_event_from_proto(v1::LedgerEvent::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

fn decode_endpoint(bytes: &[u8]) -> Result<WebhookEndpoint, EngineError> {
    tally_proto::endpoint_from_proto(v1::WebhookEndpoint::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

fn delivery_key(store: &StoreId, mode: Mode, endpoint: &EndpointId, event: &str) -> Vec<u8> {
    Key::scoped(keys::WEBHOOK_DELIVERY, store, mode)
        .text(endpoint)
        .text(event)
        .into_bytes()
}

/// What one look at the due index found.
#[derive(Debug)]
pub struct DueLook {
    /// Deliveries to attempt: (scope, endpoint, event), oldest due first.
    pub due: Vec<(Scope, EndpointId, String)>,
    /// The due time of the first entry the look met, passed over or not (`None`:
    /// it met none).
    pub first_due_ms: Option<i64>,
}

/// Where a look at the due index starts: the first entry due at `from_ms` or later
/// (`None`: the oldest). Entries of that same millisecond are in, whatever their
/// store, endpoint or event: one made after the last poll met the first of them
/// sorts anywhere among them.
fn due_scan_start(from_ms: Option<i64>) -> Vec<u8> {
    match from_ms {
        Some(from_ms) => DueKey::after(from_ms.saturating_sub(1)),
        None => Key::table(keys::WEBHOOK_DUE).into_bytes(),
    }
}

fn due_key(at_ms: i64, store: &StoreId, mode: Mode, endpoint: &EndpointId, event: &str) -> Vec<u8> {
    DueKey {
        due_at_ms: at_ms,
        store_id: store.to_string(),
        mode,
        endpoint_id: endpoint.to_string(),
        event_id: event.to_string(),
    }
    .encode()
}

/// Oldest first: by event time, then log position, then place within the record, so
/// two events of one step (consumed, then exhausted) keep their order.
fn pending_key(
    store: &StoreId,
    mode: Mode,
    endpoint: &EndpointId,
    created_at_ms: i64,
    position: (u64, usize),
    event: &str,
) -> Vec<u8> {
    PendingKey {
        store_id: store.to_string(),
        mode,
        endpoint_id: endpoint.to_string(),
        created_at_ms,
        offset: position.0,
        place: position.1 as u64,
        event_id: event.to_string(),
    }
    .encode()
}

/// Projector: the endpoint's new state.
/// 409 `too_many_webhooks`: decided by the service before appending and again by
/// apply, in log order.
fn too_many_webhooks() -> Outcome {
    Outcome::rejected(
        "too_many_webhooks",
        format!("at most {MAX_ENDPOINTS_PER_SCOPE} webhook endpoints per store and environment"),
    )
}

pub fn apply_endpoint(
    overlay: &mut Overlay<'_>,
    endpoint: &WebhookEndpoint,
    base_updated_at_ms: Option<i64>,
) -> Result<(), ApplyError> {
    let key = Key::scoped(keys::WEBHOOK_ENDPOINT, &endpoint.store_id, endpoint.mode)
        .text(&endpoint.id)
        .into_bytes();
    if base_updated_at_ms.is_some() {
        // An update: of the version it was derived from, and never of a deleted
        // endpoint (which it would bring back).
        let stored = overlay
            .get(&key)?
            .map(|bytes| decode_endpoint(&bytes))
            .transpose()?;
        tally_core::outcome::check_base(base_updated_at_ms, stored.map(|e| e.updated_at_ms))?;
    } else if !overlay.contains(&key)? {
        let scope = Key::scoped(keys::WEBHOOK_ENDPOINT, &endpoint.store_id, endpoint.mode);
        if overlay.prefix_entries(scope.as_bytes())?.len() >= MAX_ENDPOINTS_PER_SCOPE {
            return Err(too_many_webhooks().into());
        }
    }
    overlay.put(
        key,
        tally_proto::endpoint_to_proto(endpoint).encode_to_vec(),
    );
    Ok(())
}

/// An event another context emitted, as scheduling needs it: where its snapshot is
/// stored (`event_key`: a `W` row for ledger events, an `E` row for billing ones).
#[derive(Debug, Clone)]
pub struct EventHead<'a> {
    pub id: &'a str,
    pub event_type: &'a str,
    pub created_at_ms: i64,
    pub store_id: &'a StoreId,
    pub mode: Mode,
    pub event_key: Vec<u8>,
    /// The snapshot to store at `event_key` once a delivery needs it: a ledger
    /// event's. Only a delivery ever reads it, so an event no endpoint subscribes to
    /// costs no row (a debit's largest). `None`: its context stores it (billing's
    /// events, which are listed too).
    pub unstored: Option<&'a LedgerEvent>,
}

impl<'a> EventHead<'a> {
    pub fn ledger(event: &'a LedgerEvent) -> EventHead<'a> {
        let (store, mode) = (&event.account.store_id, event.account.mode);
        EventHead {
            id: &event.id,
            event_type: &event.event_type,
            created_at_ms: event.created_at_ms,
            store_id: store,
            mode,
            event_key: Key::scoped(keys::WEBHOOK_EVENT, store, mode)
                .int(event.created_at_ms)
                .text(&event.id)
                .into_bytes(),
            unstored: Some(event),
        }
    }
}

/// An event as a delivery reads it back.
#[derive(Debug, Clone)]
pub enum StoredEvent {
    Ledger(LedgerEvent),
    Billing(BillingEvent),
}

/// Projector: one delivery per enabled endpoint subscribed to each event. HTTP
/// deliveries are due at once; cli ones join the endpoint's pending feed.
pub fn schedule_deliveries(
    overlay: &mut Overlay<'_>,
    events: &[EventHead<'_>],
    log_offset: u64,
) -> Result<(), EngineError> {
    for (index, event) in events.iter().enumerate() {
        let (store, mode) = (event.store_id, event.mode);
        let prefix = Key::scoped(keys::WEBHOOK_ENDPOINT, store, mode).into_bytes();
        let endpoints = overlay
            .committed_scan(&prefix)?
            .values()
            .map(|v| decode_endpoint(v))
            .collect::<Result<Vec<_>, _>>()?;
        let event_key = event.event_key.clone();
        let mut subscribed = endpoints
            .iter()
            .filter(|e| e.subscribes_to(event.event_type))
            .peekable();
        if let (Some(_), Some(snapshot)) = (subscribed.peek(), event.unstored) {
            overlay.put(event_key.clone(), encode_ledger_event(snapshot));
        }
        for endpoint in subscribed {
            let pending = match endpoint.delivery_mode {
                DeliveryMode::Http => Vec::new(),
                DeliveryMode::Cli => pending_key(
                    store,
                    mode,
                    &endpoint.id,
                    event.created_at_ms,
                    (log_offset, index),
                    event.id,
                ),
            };
            let delivery = Delivery {
                endpoint_id: endpoint.id.to_string(),
                event_id: event.id.to_string(),
                event_type: event.event_type.to_string(),
                created_at_ms: event.created_at_ms,
                attempts: 0,
                delivered: false,
                next_attempt_at_ms: (endpoint.delivery_mode == DeliveryMode::Http)
                    .then_some(event.created_at_ms),
                first_attempt_at_ms: 0,
                last_status_code: 0,
                last_error: String::new(),
                event_key: event_key.clone(),
                pending_key: pending.clone(),
            };
            match endpoint.delivery_mode {
                DeliveryMode::Http => overlay.put(
                    due_key(event.created_at_ms, store, mode, &endpoint.id, event.id),
                    Vec::new(),
                ),
                DeliveryMode::Cli => overlay.put(pending, Vec::new()),
            }
            overlay.put(
                delivery_key(store, mode, &endpoint.id, event.id),
                encode_delivery(&delivery),
            );
        }
    }
    Ok(())
}

/// Projector: an attempt's outcome.
pub fn apply_attempt(
    overlay: &mut Overlay<'_>,
    attempt: &WebhookAttempt,
) -> Result<(), EngineError> {
    let (store, mode) = (&attempt.store_id, attempt.mode);
    let key = delivery_key(store, mode, &attempt.endpoint_id, &attempt.event_id);
    let Some(bytes) = overlay.get(&key)? else {
        return Ok(()); // a resend of a delivery that no longer exists
    };
    let mut delivery = decode_delivery(&bytes)?;
    if let Some(previous) = delivery.next_attempt_at_ms {
        overlay.delete(due_key(
            previous,
            store,
            mode,
            &attempt.endpoint_id,
            &attempt.event_id,
        ));
    }
    if delivery.first_attempt_at_ms == 0 {
        delivery.first_attempt_at_ms = attempt.at_ms;
    }
    delivery.attempts = delivery.attempts.max(attempt.attempt);
    delivery.delivered |= attempt.delivered;
    delivery.last_status_code = attempt.status_code;
    delivery.last_error = attempt.error.clone();
    delivery.next_attempt_at_ms = if delivery.delivered {
        None
    } else {
        attempt.next_attempt_at_ms
    };
    if let Some(next) = delivery.next_attempt_at_ms {
        overlay.put(
            due_key(next, store, mode, &attempt.endpoint_id, &attempt.event_id),
            Vec::new(),
        );
    }
    if delivery.delivered && !delivery.pending_key.is_empty() {
        overlay.delete(delivery.pending_key.clone());
    }
    overlay.put(key, encode_delivery(&delivery));
    overlay.put(
        attempt_key(store, mode, attempt),
        tally_proto::attempt_to_proto(attempt).encode_to_vec(),
    );
    Ok(())
}

fn attempt_key(store: &str, mode: Mode, attempt: &WebhookAttempt) -> Vec<u8> {
    Key::scoped(keys::WEBHOOK_ATTEMPT, store, mode)
        .text(&attempt.endpoint_id)
        .int(attempt.at_ms)
        .text(&attempt.event_id)
        .uint(attempt.attempt as u64)
        .into_bytes()
}

/// An attempt's id, the cursor of the deliveries list: its time, event and number
/// (`wha_<at ms>_<attempt>_<event id>`), so a cursor names its index key exactly.
pub fn attempt_id(attempt: &WebhookAttempt) -> String {
    format!(
        "wha_{}_{}_{}",
        attempt.at_ms, attempt.attempt, attempt.event_id
    )
}

fn attempt_key_of_id(store: &str, mode: Mode, endpoint_id: &str, id: &str) -> Option<Vec<u8>> {
    let rest = id.strip_prefix("wha_")?;
    let (at, rest) = rest.split_once('_')?;
    let (number, event) = rest.split_once('_')?;
    Some(
        Key::scoped(keys::WEBHOOK_ATTEMPT, store, mode)
            .text(endpoint_id)
            .int(at.parse().ok()?)
            .text(event)
            .uint(number.parse().ok()?)
            .into_bytes(),
    )
}

fn text(param: &str, value: &str, max: usize) -> Result<String, FieldError> {
    let trimmed = value.trim();
    if trimmed.is_empty() || trimmed.chars().count() > max {
        return Err(FieldError::invalid(
            param,
            format!("`{param}` must be 1 to {max} characters"),
        ));
    }
    Ok(trimmed.to_string())
}

fn new_secret() -> String {
    format!("whsec_{}", random_base62(SECRET_RANDOM_CHARS))
}

/// Due-index entries one dispatcher poll looks at, at most: bounds the poll's cost
/// when many deliveries wait on endpoints at their concurrency cap.
pub const MAX_DUE_SCAN: usize = 20_000;

/// An endpoint deleted: its deliveries stay (their attempts are history).
pub fn apply_endpoint_deleted(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    endpoint_id: &str,
) {
    overlay.delete(
        Key::scoped(keys::WEBHOOK_ENDPOINT, store_id, mode)
            .text(endpoint_id)
            .into_bytes(),
    );
}

impl Notifications {
    pub fn get_endpoint(&self, scope: &Scope, id: &str) -> Result<WebhookEndpoint, EngineError> {
        let key = Key::scoped(keys::WEBHOOK_ENDPOINT, &scope.store_id, scope.mode).text(id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => decode_endpoint(&bytes),
            None => Err(EngineError::not_found("webhook", id)),
        }
    }

    /// Endpoints of the scope, newest first.
    pub fn list_endpoints(&self, scope: &Scope) -> Result<Vec<WebhookEndpoint>, EngineError> {
        let prefix = Key::scoped(keys::WEBHOOK_ENDPOINT, &scope.store_id, scope.mode).into_bytes();
        let mut endpoints = collect_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            usize::MAX,
            |_, v| decode_endpoint(v).map(Some),
        )?;
        endpoints.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then(b.id.cmp(&a.id)));
        Ok(endpoints)
    }

    pub async fn create_endpoint(
        &self,
        scope: &Scope,
        input: &EndpointInput,
        allow_private: bool,
    ) -> Result<WebhookEndpoint, EngineError> {
        let name = text(
            "name",
            input.name.as_deref().unwrap_or("webhook"),
            MAX_ENDPOINT_NAME_CHARS,
        )?;
        let delivery_mode = match input.delivery_mode.as_deref() {
            None => DeliveryMode::Http,
            Some(m) => DeliveryMode::parse(m).ok_or_else(|| {
                FieldError::invalid("delivery_mode", "`delivery_mode` must be http or cli")
            })?,
        };
        let url = match (delivery_mode, input.url.as_deref()) {
            (DeliveryMode::Cli, None) => CLI_PLACEHOLDER_URL.to_string(),
            (DeliveryMode::Cli, Some(url)) => {
                text("url", url, tally_domain::webhook::MAX_URL_CHARS)?
            }
            (DeliveryMode::Http, None) => return Err(FieldError::missing("url").into()),
            (DeliveryMode::Http, Some(url)) => {
                let url = url.trim().to_string();
                validate_url(&url, scope.mode, allow_private)?;
                url
            }
        };
        let events = event_types(
            input
                .events
                .as_deref()
                .ok_or_else(|| FieldError::missing("events"))?,
        )?;
        let enabled = match input.status.as_deref() {
            None | Some("enabled") => true,
            Some("disabled") => false,
            Some(_) => {
                return Err(
                    FieldError::invalid("status", "`status` must be enabled or disabled").into(),
                )
            }
        };
        // A fast answer from the projection; apply decides again in log order.
        if self.list_endpoints(scope)?.len() >= MAX_ENDPOINTS_PER_SCOPE {
            return Err(too_many_webhooks().into());
        }
        let now = self.journal.now_ms();
        let endpoint = WebhookEndpoint {
            id: new_id("wh").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            name,
            url,
            delivery_mode,
            enabled,
            events,
            secret: new_secret(),
            previous_secret: None,
            previous_secret_expires_at_ms: 0,
            created_at_ms: now,
            updated_at_ms: now,
        };
        self.journal
            .append_and_apply(&Record::WebhookEndpointUpserted(endpoint.clone()))
            .await?;
        Ok(endpoint)
    }

    pub async fn update_endpoint(
        &self,
        scope: &Scope,
        id: &str,
        input: &EndpointInput,
        allow_private: bool,
    ) -> Result<WebhookEndpoint, EngineError> {
        if input.delivery_mode.is_some() {
            return Err(FieldError::new(
                "webhook_field_immutable",
                "delivery_mode",
                "`delivery_mode` cannot change; create another endpoint",
            )
            .into());
        }
        self.journal
            .update(|| {
                let mut endpoint = self.get_endpoint(scope, id)?;
                if let Some(name) = &input.name {
                    endpoint.name = text("name", name, MAX_ENDPOINT_NAME_CHARS)?;
                }
                if let Some(url) = &input.url {
                    let url = url.trim().to_string();
                    if endpoint.delivery_mode == DeliveryMode::Http {
                        validate_url(&url, scope.mode, allow_private)?;
                    }
                    endpoint.url = url;
                }
                if let Some(events) = &input.events {
                    endpoint.events = event_types(events)?;
                }
                match input.status.as_deref() {
                    None => {}
                    Some("enabled") => endpoint.enabled = true,
                    Some("disabled") => endpoint.enabled = false,
                    Some(_) => {
                        return Err(FieldError::invalid(
                            "status",
                            "`status` must be enabled or disabled",
                        )
                        .into())
                    }
                }
                let base = self.journal.restamp(&mut endpoint.updated_at_ms);
                Ok(Update::Write {
                    record: Record::WebhookEndpointUpserted(endpoint.clone()),
                    base_updated_at_ms: base,
                    result: endpoint,
                })
            })
            .await
    }

    pub async fn delete_endpoint(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<WebhookEndpoint, EngineError> {
        let endpoint = self.get_endpoint(scope, id)?;
        self.journal
            .append_and_apply(&Record::WebhookEndpointDeleted {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                endpoint_id: id.into(),
            })
            .await?;
        Ok(endpoint)
    }

    /// A new secret; the old one keeps signing for 24 hours.
    pub async fn rotate_secret(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<WebhookEndpoint, EngineError> {
        self.journal
            .update(|| {
                let mut endpoint = self.get_endpoint(scope, id)?;
                let base = self.journal.restamp(&mut endpoint.updated_at_ms);
                endpoint.previous_secret =
                    Some(std::mem::replace(&mut endpoint.secret, new_secret()));
                endpoint.previous_secret_expires_at_ms =
                    endpoint.updated_at_ms + ROTATED_SECRET_GRACE_MS;
                Ok(Update::Write {
                    record: Record::WebhookEndpointUpserted(endpoint.clone()),
                    base_updated_at_ms: base,
                    result: endpoint,
                })
            })
            .await
    }

    pub fn get_delivery(
        &self,
        scope: &Scope,
        endpoint_id: &EndpointId,
        event_id: &str,
    ) -> Result<Delivery, EngineError> {
        match self.journal.store().get(&delivery_key(
            &scope.store_id,
            scope.mode,
            endpoint_id,
            event_id,
        ))? {
            Some(bytes) => decode_delivery(&bytes),
            None => Err(EngineError::NotFound {
                resource: "webhook event",
                id: event_id.to_string(),
                param: Some("event_id".into()),
            }),
        }
    }

    /// The event a delivery carries.
    pub fn delivery_event(&self, delivery: &Delivery) -> Result<StoredEvent, EngineError> {
        let bytes = self
            .journal
            .store()
            .get(&delivery.event_key)?
            .ok_or_else(|| {
                EngineError::Corrupt(format!(
                    "event {} of a delivery is missing",
                    delivery.event_id
                ))
            })?;
        if delivery.event_key.first() == Some(&keys::BILLING_EVENT) {
            return Ok(StoredEvent::Billing(codec::decode_billing_event(&bytes)?));
        }
        decode_ledger_event(&bytes).map(StoredEvent::Ledger)
    }

    /// The cli feed: unacknowledged deliveries of the endpoint, oldest first.
    pub fn pending_deliveries(
        &self,
        scope: &Scope,
        endpoint_id: &str,
        limit: usize,
    ) -> Result<Vec<Delivery>, EngineError> {
        let prefix = PendingKey::prefix(&scope.store_id, scope.mode, endpoint_id);
        let event_ids = collect_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            limit,
            |k, _| Ok(Some(PendingKey::decode(k)?.event_id)),
        )?;
        let endpoint_id = EndpointId::from(endpoint_id);
        event_ids
            .iter()
            .map(|event_id| self.get_delivery(scope, &endpoint_id, event_id))
            .collect()
    }

    /// Records an attempt and waits until it is applied.
    pub async fn record_attempt(&self, attempt: WebhookAttempt) -> Result<(), EngineError> {
        self.journal
            .append_and_apply(&Record::WebhookAttempt(attempt))
            .await
    }

    /// Attempts of an endpoint, newest first.
    /// An endpoint's delivery attempts, newest first, as a cursor list (the cursor
    /// is an attempt's id, `attempt_id`).
    pub fn list_attempts(
        &self,
        scope: &Scope,
        endpoint_id: &str,
        page: &tally_core::pagination::PageRequest,
    ) -> Result<tally_core::pagination::Page<WebhookAttempt>, EngineError> {
        let prefix = Key::scoped(keys::WEBHOOK_ATTEMPT, &scope.store_id, scope.mode)
            .text(endpoint_id)
            .into_bytes();
        let store = self.journal.store();
        let cursor = tally_core::pagination::cursor_from(page, |id| {
            let key = attempt_key_of_id(&scope.store_id, scope.mode, endpoint_id, id)
                .ok_or_else(|| EngineError::not_found("webhook attempt", id))?;
            match store.get(&key)? {
                Some(_) => Ok(key),
                None => Err(EngineError::not_found("webhook attempt", id)),
            }
        })?;
        tally_core::pagination::paginate(store.as_ref(), &prefix, cursor, page.limit, |_, v| {
            let attempt = v1::WebhookAttempt::decode(v).map_err(corrupt)?;
            tally_proto::attempt_from_proto(attempt)
                .map(Some)
                .map_err(corrupt)
        })
    }

    /// Deliveries waiting for an attempt, counted up to `cap` (a scrape of
    /// `/metrics` stays cheap whatever the backlog).
    pub fn queued_deliveries(&self, cap: usize) -> Result<usize, EngineError> {
        let start = Key::table(keys::WEBHOOK_DUE).into_bytes();
        let end = DueKey::after(i64::MAX - 1);
        let mut count = 0usize;
        self.journal.store().scan(
            Bound::Included(&start),
            Bound::Excluded(&end),
            false,
            &mut |_, _| {
                count += 1;
                if count >= cap {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            },
        )?;
        Ok(count)
    }

    /// HTTP deliveries due by their store's clock (the scan ends at `now_ms`, the
    /// latest any store's clock shows), oldest due first, as (scope, endpoint, event):
    /// at most `limit` that `skip` (store, endpoint, event) does not pass over (the
    /// dispatcher skips deliveries in flight, endpoints with their most taken, so one
    /// slow endpoint's backlog never hides the others', and stores another node of a
    /// cluster delivers for), looking at no more than `MAX_DUE_SCAN` index entries.
    /// The caller reads each delivery (`get_delivery`) when it is about to attempt
    /// it: it may wait for a slot meanwhile. The scan starts at entries due at
    /// `from_ms` (`None`: at the oldest).
    pub fn due_deliveries(
        &self,
        now_ms: i64,
        from_ms: Option<i64>,
        limit: usize,
        skip: &dyn Fn(&str, &str, &str) -> bool,
    ) -> Result<DueLook, EngineError> {
        let start = due_scan_start(from_ms);
        let end = DueKey::after(now_ms);
        let mut found = Vec::new();
        let mut first_due = None;
        let mut scanned = 0usize;
        let mut corrupt = None;
        // In steps: a poll stops after `limit` found, and each delivery is read
        // again before it is sent, so it needs no one moment across the index.
        self.journal.store().scan_in_steps(
            Bound::Included(&start),
            Bound::Excluded(&end),
            false,
            &mut |k, _| {
                scanned += 1;
                match DueKey::decode(k) {
                    Ok(key) => {
                        first_due.get_or_insert(key.due_at_ms);
                        // Due by its store's clock (a test store's test clock may
                        // be ahead of `now_ms`, the latest of them all).
                        let scope = Scope {
                            store_id: key.store_id.as_str().into(),
                            mode: key.mode,
                        };
                        let due = key.due_at_ms <= self.journal.now_in(&scope);
                        if due && !skip(&key.store_id, &key.endpoint_id, &key.event_id) {
                            found.push(key);
                        }
                    }
                    // Corrupt storage: stop with the error, never skip or default.
                    Err(error) => {
                        corrupt = Some(error);
                        return Visit::Stop;
                    }
                }
                if found.len() >= limit || scanned >= MAX_DUE_SCAN {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            },
        )?;
        if let Some(error) = corrupt {
            return Err(error);
        }
        let found = found
            .into_iter()
            .map(|key| {
                let scope = Scope {
                    store_id: key.store_id.into(),
                    mode: key.mode,
                };
                (
                    scope,
                    EndpointId::from(key.endpoint_id.as_str()),
                    key.event_id,
                )
            })
            .collect();
        Ok(DueLook {
            due: found,
            first_due_ms: first_due,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::event_index::EventIndex;
    use tally_core::overlay::Fetched;
    use tally_domain::ledger::{Account, AccountStatus};

    fn endpoint(store: &str, events: &[&str]) -> WebhookEndpoint {
        WebhookEndpoint {
            id: EndpointId::from(format!("wh_{}", events.join("_"))),
            store_id: StoreId::from(store),
            mode: Mode::Test,
            name: "hook".into(),
            url: "https://example.com/hook".into(),
            delivery_mode: DeliveryMode::Http,
            enabled: true,
            events: events.iter().map(|e| e.to_string()).collect(),
            secret: "whsec_x".into(),
            previous_secret: None,
            previous_secret_expires_at_ms: 0,
            created_at_ms: 1,
            updated_at_ms: 1,
        }
    }

    fn consumed(store: &str) -> LedgerEvent {
        LedgerEvent {
            id: "whevt_1".into(),
            event_type: "credits.consumed".into(),
            created_at_ms: 1_000,
            transaction_id: None,
            account: Account {
                id: "ca_1".into(),
                store_id: StoreId::from(store),
                mode: Mode::Test,
                customer_id: "cus_1".into(),
                name: "main".into(),
                unit_label: "credits".into(),
                status: AccountStatus::Active,
                created_at_ms: 1,
                updated_at_ms: 1,
                low_balance_threshold: None,
                auto_recharge: None,
            },
            balance: "1".parse().unwrap(),
        }
    }

    /// Whether scheduling `event` in a scope with `endpoints` stores its snapshot,
    /// and how many deliveries it makes.
    fn schedule(endpoints: &[WebhookEndpoint], event: &LedgerEvent) -> (bool, usize) {
        let store = tally_projection::MemoryStore::new();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut overlay = Overlay::new(&store, &index, &fetched);
        for endpoint in endpoints {
            apply_endpoint(&mut overlay, endpoint, None).unwrap();
        }
        let head = EventHead::ledger(event);
        let key = head.event_key.clone();
        schedule_deliveries(&mut overlay, &[head], 7).unwrap();
        let stored = overlay.get(&key).unwrap();
        if let Some(bytes) = &stored {
            assert_eq!(
                &decode_ledger_event(bytes).unwrap(),
                event,
                "the stored snapshot is the event"
            );
        }
        let deliveries = Key::scoped(keys::WEBHOOK_DELIVERY, &event.account.store_id, Mode::Test);
        let made = overlay.prefix_entries(deliveries.as_bytes()).unwrap().len();
        (stored.is_some(), made)
    }

    #[test]
    fn a_look_from_a_due_time_takes_every_entry_of_that_millisecond_and_after() {
        let key = |at_ms: i64, store: &str, event: &str| {
            due_key(
                at_ms,
                &StoreId::from(store),
                Mode::Test,
                &EndpointId::from("wh_1"),
                event,
            )
        };
        let start = due_scan_start(Some(1_000));
        assert!(
            key(1_000, "st_0", "a") >= start,
            "the least key of that millisecond"
        );
        assert!(key(1_000, "st_z", "z") >= start);
        assert!(key(1_001, "st_0", "a") >= start);
        assert!(
            key(999, "st_z", "z") < start,
            "earlier: left to the full look"
        );
        let oldest = due_scan_start(None);
        assert!(key(i64::MIN, "st_0", "a") >= oldest);
        assert!(oldest.as_slice() < key(999, "st_0", "a").as_slice());
    }

    #[test]
    fn a_ledger_event_is_stored_only_when_a_delivery_needs_it() {
        let event = consumed("st_1");
        assert_eq!(schedule(&[], &event), (false, 0), "no endpoint");
        assert_eq!(
            schedule(&[endpoint("st_1", &["credits.granted"])], &event),
            (false, 0),
            "an endpoint of other events"
        );
        assert_eq!(
            schedule(&[endpoint("st_2", &["credits.consumed"])], &event),
            (false, 0),
            "an endpoint of another store"
        );
        assert_eq!(
            schedule(
                &[
                    endpoint("st_1", &["credits.consumed"]),
                    endpoint("st_1", &["credits.consumed", "credits.granted"])
                ],
                &event
            ),
            (true, 2),
            "two subscribed endpoints, one snapshot"
        );
    }

    /// Runs `step` in a chunk over `store` with `cache`, then commits it.
    fn chunk(
        store: &tally_projection::MemoryStore,
        cache: &mut tally_core::overlay::BucketCache,
        step: impl FnOnce(&mut Overlay<'_>),
    ) {
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut overlay = Overlay::new(store, &index, &fetched);
        overlay.cache = Some(cache);
        step(&mut overlay);
        let mut committed = overlay.into_changes().unwrap();
        tally_projection::ProjectionStore::apply_shared(
            store,
            std::mem::take(&mut committed.changes),
            &[(0, 1)],
        )
        .unwrap();
        cache.absorb(&mut committed);
    }

    fn deliveries(store: &tally_projection::MemoryStore) -> usize {
        let prefix = Key::scoped(keys::WEBHOOK_DELIVERY, "st_1", Mode::Test).into_bytes();
        let mut n = 0;
        tally_projection::scan_prefix(store, &prefix, false, &mut |_, _| {
            n += 1;
            tally_projection::Visit::Continue
        })
        .unwrap();
        n
    }

    /// The endpoints a step is delivered to are the committed ones, whatever a
    /// scan of an earlier chunk saw: one created, changed or disabled after events
    /// were scheduled counts from the next chunk on.
    #[test]
    fn endpoints_written_after_a_scan_are_seen_by_the_next_chunk() {
        let store = tally_projection::MemoryStore::new();
        let mut cache = tally_core::overlay::BucketCache::for_empty_store();
        let mut event = consumed("st_1");
        let mut schedule = |store: &tally_projection::MemoryStore,
                            cache: &mut tally_core::overlay::BucketCache,
                            id: &str| {
            event.id = id.into();
            let head = EventHead::ledger(&event);
            chunk(store, cache, |o| {
                schedule_deliveries(o, &[head], 7).unwrap()
            });
        };
        schedule(&store, &mut cache, "whevt_1");
        assert_eq!(deliveries(&store), 0, "no endpoint yet");
        let mut hook = endpoint("st_1", &["credits.consumed"]);
        chunk(&store, &mut cache, |o| {
            apply_endpoint(o, &hook, None).unwrap()
        });
        schedule(&store, &mut cache, "whevt_2");
        assert_eq!(deliveries(&store), 1, "the endpoint created since the scan");
        let base = Some(hook.updated_at_ms);
        hook.enabled = false;
        hook.updated_at_ms += 1;
        chunk(&store, &mut cache, |o| {
            apply_endpoint(o, &hook, base).unwrap()
        });
        schedule(&store, &mut cache, "whevt_3");
        assert_eq!(deliveries(&store), 1, "the endpoint disabled since");
    }
}
