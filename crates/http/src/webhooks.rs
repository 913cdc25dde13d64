//! Webhook event bodies at the edge: the envelope of docs/api.md ("Webhooks"), rendered with the
//! API's wire types, for the dispatcher (the notifications context's, through its
//! `EventBodies` port) and the cli feed alike.

use std::sync::Arc;

use serde_json::json;
use tally_domain::record::BillingObject;
pub use tally_engine::dispatcher::{
    delivery_headers, DispatchScope, Dispatcher, EventBodies, EveryStore, DELIVERY_TIMEOUT_MS,
    DISPATCH_BATCH, DISPATCH_POLL_MS, MAX_CONCURRENT_DELIVERIES,
    MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT,
};
use tally_engine::ledger::{TransactionView, EVENT_CREDITS_EXHAUSTED};
use tally_engine::webhooks::{Delivery, StoredEvent};
use tally_engine::{Engine, EngineError, Scope};

use crate::routes::credits::{account_json, transaction_json};
use crate::wire;

/// The exact JSON body of an event: `{id, eventType, created_at (ms), object}`. Built
/// from immutable data (the event's snapshot and its transaction as created), so every
/// attempt and the cli feed carry the same bytes.
pub fn event_body(
    engine: &Engine,
    scope: &Scope,
    delivery: &Delivery,
) -> Result<String, EngineError> {
    let (id, event_type, created_at_ms, object) = match engine
        .notifications()
        .delivery_event(delivery)?
    {
        StoredEvent::Ledger(event) => {
            let object = match &event.transaction_id {
                Some(id) if event.event_type != EVENT_CREDITS_EXHAUSTED => {
                    let view = engine.ledger().get_transaction(scope, id)?;
                    transaction_json(&TransactionView {
                        transaction: view.transaction,
                        reversed_by: None,
                    })
                }
                _ => account_json(&event.account, event.balance),
            };
            (event.id, event.event_type, event.created_at_ms, object)
        }
        // The resource as it was when the event happened (a subscription's
        // customer and last transaction as the event stored them: they may
        // change later, the body may not).
        StoredEvent::Billing(event) => {
            let object = match &event.object {
                BillingObject::Checkout(c) => wire::checkout(c),
                BillingObject::Subscription {
                    subscription,
                    customer,
                    last_transaction,
                } => wire::subscription(subscription, customer.as_ref(), last_transaction.as_ref()),
                BillingObject::Payment(p) => wire::transaction(p),
                BillingObject::Dispute(d) => wire::dispute(d),
            };
            (event.id, event.event_type, event.created_at_ms, object)
        }
    };
    Ok(json!({
        "id": id,
        "eventType": event_type,
        "created_at": created_at_ms,
        "object": object,
    })
    .to_string())
}

/// The engine's event bodies, as the dispatcher's port asks for them.
#[derive(Debug)]
pub struct WireBodies(pub Arc<Engine>);

impl EventBodies for WireBodies {
    fn body(&self, scope: &Scope, delivery: &Delivery) -> Result<String, EngineError> {
        event_body(&self.0, scope, delivery)
    }
}
