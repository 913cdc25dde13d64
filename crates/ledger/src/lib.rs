//! The credits ledger context: credits accounts, double-entry transactions and their
//! entries, grants, reservations, thresholds (docs/api.md, "Customer credits"), with
//! the same inner shape as every context: its records (`CreditLedger`,
//! `CreditReservation`, `CreditExpiriesDue`), keys (tables `a`, `b`, `n`, `l`, `k`,
//! `T`, `r`, `i`, `L`, `j`, `h`, `q`; grants `{`, `}`, `~`, `^`, `?`, `#`; holds `<`,
//! `>`, `=`; thresholds `;` of the core key space), apply (every posting rule decided
//! in log order), services and queries ([`Ledger`]), and the independent audit
//! ([`audit`]).
//!
//! Modules depend only downwards, in this order (no circle):
//! `holds` (an account's live holds) <- `posting` (a final transaction written) <-
//! `grants` (which grants a transaction gives to or draws from, expiries) <-
//! `thresholds` (low balance, auto-recharge) <- `apply` (each ledger step's rules) <-
//! `reservations` (hold steps; their service); the services `ledger` (accounts,
//! movements, balances) <- `grant_service`, `reservations` and `audit` call its
//! methods.
//!
//! Apply returns the webhook events a step emits as data; the composition root hands
//! them to the notifications context, so the ledger knows nothing of webhooks.

use std::sync::Arc;

use tally_core::{EngineError, Journal, Scope};

pub mod apply;
pub mod audit;
pub mod grant_service;
pub mod grants;
pub mod holds;
pub mod ledger;
pub mod posting;
pub mod reservations;
pub mod thresholds;

pub use apply::{
    apply_ledger_step, apply_purchase_grant, apply_usage_debit, apply_usage_refund, PurchaseGrant,
    UsageDebit,
};
pub use grant_service::GrantInput;
pub use ledger::*;
pub use posting::{
    EVENT_CREDITS_CONSUMED, EVENT_CREDITS_EXHAUSTED, EVENT_CREDITS_EXPIRED, EVENT_CREDITS_GRANTED,
};
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
