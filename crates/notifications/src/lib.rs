//! The notifications context: webhook endpoints, the deliveries apply schedules for
//! the events other contexts emit (as data: a ledger step's `LedgerEvent`s), and
//! the attempts the dispatcher records. Same inner shape as every context: its
//! records (`WebhookEndpointUpserted`, `WebhookEndpointDeleted`, `WebhookAttempt`),
//! keys (tables `W`, `w`, `D`, `Q`, `P`, `Y` of the core key space), apply, services and
//! queries ([`webhooks`]), and the [`dispatcher`] that POSTs due deliveries and
//! records each attempt; event bodies come from the HTTP edge (the API's wire
//! types) through the dispatcher's `EventBodies` port.

use std::sync::Arc;

use tally_core::Journal;

pub mod dispatcher;
pub mod webhooks;

pub use webhooks::*;

#[derive(Debug)]
pub struct Notifications {
    journal: Arc<Journal>,
}

impl Notifications {
    pub fn new(journal: Arc<Journal>) -> Notifications {
        Notifications { journal }
    }
}
