//! The credits ledger context: credits accounts, double-entry transactions and their
//! entries (docs/api.md, "Customer credits"), with the same inner shape as every
//! context: its records (`CreditLedger`, `CreditReservation`), keys (tables `a`, `b`, `n`, `l`, `k`, `T`, `r`, `i`, `L`, `j`,
//! `h`, `q`, and for reservations `<`, `>`, `=`, of the core key space), apply ([`ledger::apply_ledger_step`]: every posting rule
//! decided in log order), services and queries ([`Ledger`]), and the independent
//! audit ([`audit`]).
//!
//! Apply returns the webhook events a step emits as data; the composition root hands
//! them to the notifications context, so the ledger knows nothing of webhooks.

use std::sync::Arc;

use tally_core::{EngineError, Journal, Scope};

pub mod audit;
pub mod grants;
pub mod ledger;
pub mod reservations;
pub mod thresholds;

pub use grants::GrantInput;
pub use ledger::*;
pub use reservations::ReservationInput;

/// What the ledger asks of the directory: it owns this port, the composition root
/// implements it.
pub trait AccountHolders: Send + Sync {
    /// Whether the scope has a customer with this id.
    fn customer_exists(&self, scope: &Scope, id: &str) -> Result<bool, EngineError>;
}

pub struct Ledger {
    journal: Arc<Journal>,
    holders: Arc<dyn AccountHolders>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish()
    }
}

impl Ledger {
    pub fn new(journal: Arc<Journal>, holders: Arc<dyn AccountHolders>) -> Ledger {
        Ledger { journal, holders }
    }
}
