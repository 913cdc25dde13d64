//! Webhook delivery at the edge: renders event bodies (the envelope of spec part 6),
//! signs them, and the dispatcher that POSTs due deliveries and records every
//! attempt in the log (so restarts resume the schedule and replays never re-deliver).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::json;
use tally_domain::record::WebhookAttempt;
use tally_domain::webhook::{
    is_forbidden_ip, next_attempt_at, signature_header, url_scheme_and_host, DeliveryMode,
    WebhookEndpoint,
};
use tally_domain::Mode;
use tally_engine::ledger::{TransactionView, EVENT_CREDITS_EXHAUSTED};
use tally_engine::webhooks::Delivery;
use tally_engine::{Engine, EngineError, Scope};
use tokio::sync::Semaphore;

use crate::routes::credits::{account_json, transaction_json};

/// Only HTTP 200 succeeds; anything slower than this is a failed attempt.
pub const DELIVERY_TIMEOUT_MS: u64 = 10_000;
/// How often the dispatcher looks for due deliveries.
pub const DISPATCH_POLL_MS: u64 = 100;
/// Due deliveries taken per poll.
pub const DISPATCH_BATCH: usize = 256;
/// Concurrent deliveries to one endpoint: a slow endpoint holds at most these.
pub const MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT: usize = 4;
/// Concurrent deliveries in all.
pub const MAX_CONCURRENT_DELIVERIES: usize = 64;

/// The exact JSON body of an event: `{id, eventType, created_at (ms), object}`. Built
/// from immutable data (the event's snapshot and its transaction as created), so every
/// attempt and the cli feed carry the same bytes.
pub fn event_body(
    engine: &Engine,
    scope: &Scope,
    delivery: &Delivery,
) -> Result<String, EngineError> {
    let event = engine.delivery_event(delivery)?;
    let object = match &event.transaction_id {
        Some(id) if event.event_type != EVENT_CREDITS_EXHAUSTED => {
            let view = engine.get_transaction(scope, id)?;
            transaction_json(&TransactionView {
                transaction: view.transaction,
                reversed_by: None,
            })
        }
        _ => account_json(&event.account, event.balance),
    };
    Ok(json!({
        "id": event.id,
        "eventType": event.event_type,
        "created_at": event.created_at_ms,
        "object": object,
    })
    .to_string())
}

/// The headers of a delivery made at `now_ms`.
pub fn delivery_headers(
    endpoint: &WebhookEndpoint,
    delivery: &Delivery,
    body: &str,
    now_ms: i64,
) -> Vec<(String, String)> {
    vec![
        ("Content-Type".into(), "application/json".into()),
        (
            "tally-signature".into(),
            signature_header(
                &endpoint.signing_secrets(now_ms),
                now_ms.div_euclid(1000),
                body.as_bytes(),
            ),
        ),
        ("tally-event-id".into(), delivery.event_id.clone()),
        ("tally-event-type".into(), delivery.event_type.clone()),
    ]
}

pub struct Dispatcher {
    engine: Arc<Engine>,
    allow_private: bool,
    client: reqwest::Client,
    in_flight: DashMap<String, ()>,
    per_endpoint: DashMap<String, Arc<Semaphore>>,
    overall: Arc<Semaphore>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dispatcher")
    }
}

impl Dispatcher {
    pub fn new(engine: Arc<Engine>, allow_private: bool) -> Arc<Dispatcher> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(DELIVERY_TIMEOUT_MS))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("build the webhook HTTP client");
        Arc::new(Dispatcher {
            engine,
            allow_private,
            client,
            in_flight: DashMap::new(),
            per_endpoint: DashMap::new(),
            overall: Arc::new(Semaphore::new(MAX_CONCURRENT_DELIVERIES)),
        })
    }

    /// Delivers what is due until `shutdown` turns true.
    pub async fn run(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tokio::time::sleep(Duration::from_millis(DISPATCH_POLL_MS)) => {}
            }
            let due = match self
                .engine
                .due_deliveries(self.engine.now_ms(), DISPATCH_BATCH)
            {
                Ok(due) => due,
                Err(error) => {
                    tracing::error!(%error, "reading due webhook deliveries failed");
                    continue;
                }
            };
            for (scope, delivery) in due {
                let key = format!("{}/{}", delivery.endpoint_id, delivery.event_id);
                if self.in_flight.insert(key.clone(), ()).is_some() {
                    continue;
                }
                let dispatcher = self.clone();
                tokio::spawn(async move {
                    let semaphore = dispatcher
                        .per_endpoint
                        .entry(delivery.endpoint_id.clone())
                        .or_insert_with(|| {
                            Arc::new(Semaphore::new(MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT))
                        })
                        .clone();
                    let _endpoint_slot = semaphore.acquire().await;
                    let _slot = dispatcher.overall.acquire().await;
                    if let Err(error) = dispatcher.deliver(&scope, &delivery, false).await {
                        tracing::warn!(%error, event = %delivery.event_id, "webhook attempt could not be recorded");
                    }
                    dispatcher.in_flight.remove(&key);
                });
            }
        }
    }

    /// Makes one attempt and records it; returns the recorded attempt.
    pub async fn deliver(
        &self,
        scope: &Scope,
        delivery: &Delivery,
        manual: bool,
    ) -> Result<WebhookAttempt, EngineError> {
        let now = self.engine.now_ms();
        let number = delivery.attempts + 1;
        let first = if delivery.first_attempt_at_ms == 0 {
            now
        } else {
            delivery.first_attempt_at_ms
        };
        let endpoint = match self.engine.get_endpoint(scope, &delivery.endpoint_id) {
            Ok(e) if e.enabled && e.delivery_mode == DeliveryMode::Http => Some(e),
            Ok(_) | Err(EngineError::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        let started = Instant::now();
        let (status_code, error) = match &endpoint {
            None => (0, "endpoint disabled or deleted: not delivered".to_string()),
            Some(endpoint) => {
                let body = event_body(&self.engine, scope, delivery)?;
                match self.refuse_private_target(endpoint).await {
                    Some(reason) => (0, reason),
                    None => self.post(endpoint, delivery, &body, now).await,
                }
            }
        };
        let delivered = status_code == 200;
        let next_attempt_at_ms = match (&endpoint, delivered, manual) {
            (None, _, _) | (_, true, _) => None,
            // A manual resend leaves the schedule where it was.
            (_, false, true) => delivery.next_attempt_at_ms,
            (_, false, false) => next_attempt_at(first, number),
        };
        let attempt = WebhookAttempt {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            endpoint_id: delivery.endpoint_id.clone(),
            event_id: delivery.event_id.clone(),
            attempt: number,
            at_ms: now,
            status_code,
            latency_ms: started.elapsed().as_millis() as u64,
            error,
            delivered,
            next_attempt_at_ms,
            manual,
        };
        self.engine.record_attempt(attempt.clone()).await?;
        Ok(attempt)
    }

    /// Production endpoints may not reach private addresses, also after DNS
    /// resolution at delivery time (SSRF), unless `--allow-private-webhooks`.
    async fn refuse_private_target(&self, endpoint: &WebhookEndpoint) -> Option<String> {
        if endpoint.mode != Mode::Prod || self.allow_private {
            return None;
        }
        let (scheme, host) = url_scheme_and_host(&endpoint.url)?;
        let port = if scheme == "https" { 443 } else { 80 };
        match tokio::net::lookup_host((host, port)).await {
            Ok(addresses) => {
                let addresses: Vec<_> = addresses.collect();
                match addresses.iter().find(|a| is_forbidden_ip(a.ip())) {
                    Some(bad) => Some(format!(
                        "refused: {host} resolves to the non-public address {}",
                        bad.ip()
                    )),
                    None if addresses.is_empty() => Some(format!("{host} did not resolve")),
                    None => None,
                }
            }
            Err(e) => Some(format!("{host} did not resolve: {e}")),
        }
    }

    async fn post(
        &self,
        endpoint: &WebhookEndpoint,
        delivery: &Delivery,
        body: &str,
        now_ms: i64,
    ) -> (u16, String) {
        let mut request = self.client.post(&endpoint.url).body(body.to_string());
        for (name, value) in delivery_headers(endpoint, delivery, body, now_ms) {
            request = request.header(name, value);
        }
        match request.send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let error = if status == 200 {
                    String::new()
                } else {
                    format!("the endpoint answered {status}")
                };
                (status, error)
            }
            Err(e) if e.is_timeout() => (0, "timed out after 10 s".into()),
            Err(e) => (0, format!("request failed: {e}")),
        }
    }
}
