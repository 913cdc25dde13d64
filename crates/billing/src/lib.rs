//! The billing context: products (what a store sells, with usage prices bound to
//! meters). Checkouts, transactions, subscriptions and settlement belong here too as
//! they are built (ARCHITECTURE.md, "tally-billing").
//!
//! Same inner shape as every context: the records it owns (`ProductUpserted`), its
//! keys (tables `R`, `p`, `Z` of the core key space), its apply ([`apply`]), its
//! services and queries ([`products`]). It reaches meters only through its own
//! port, [`Meters`]; metering reaches it through metering's `Pricing` port, which
//! the composition root answers with [`Billing::meter_priced_on_active_product`].

use std::sync::Arc;

use tally_core::{EngineError, Journal, Scope};
use tally_domain::meter::MeterStatus;

pub mod apply;
pub mod products;

/// What billing asks of metering: it owns this port, the composition root
/// implements it.
pub trait Meters: Send + Sync {
    /// The status of a meter of the scope, if it exists.
    fn meter_status(
        &self,
        scope: &Scope,
        meter_id: &str,
    ) -> Result<Option<MeterStatus>, EngineError>;
}

pub struct Billing {
    journal: Arc<Journal>,
    meters: Arc<dyn Meters>,
}

impl std::fmt::Debug for Billing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Billing").finish()
    }
}

impl Billing {
    pub fn new(journal: Arc<Journal>, meters: Arc<dyn Meters>) -> Billing {
        Billing { journal, meters }
    }
}
