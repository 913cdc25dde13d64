//! The billing context: products (what a store sells, with usage prices bound to
//! meters), discounts, checkouts with test cards, payments and refunds (the API's
//! transactions), disputes, per-store tax rates, and the subscription a checkout of a
//! recurring product starts (ARCHITECTURE.md, "tally-billing").
//!
//! Same inner shape as every context: the records it owns (`ProductUpserted`,
//! `DiscountUpserted`, `CheckoutCreated`, `CheckoutCompleted`, `RefundCreated`,
//! `DisputeOpened`, `TaxRateSet`), its keys (tables `R p Z d e f o t v x y s H E g`
//! of the core key space), its apply ([`apply`]), its services and queries
//! ([`products`], [`discounts`], [`checkouts`], [`payments`]). It reaches other
//! contexts only through the ports it owns ([`Meters`], [`Customers`], [`Credits`]);
//! metering reaches it through metering's `Pricing` port, which the composition
//! root answers with [`Billing::meter_priced_on_active_product`].

use std::sync::Arc;

use rust_decimal::Decimal;
use tally_core::{EngineError, Journal, Scope};
use tally_domain::meter::MeterStatus;

pub mod apply;
pub mod checkouts;
pub mod discounts;
pub mod payments;
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

/// What billing asks of the directory.
#[async_trait::async_trait]
pub trait Customers: Send + Sync {
    /// `None`: no such customer; else the customer's country (ISO 3166-1 alpha-2),
    /// if known, which picks the tax rate.
    fn customer_country(
        &self,
        scope: &Scope,
        customer_id: &str,
    ) -> Result<Option<Option<String>>, EngineError>;

    /// Creates a customer from an email (a checkout for a new customer); its id.
    async fn create_customer(&self, scope: &Scope, email: &str) -> Result<String, EngineError>;
}

/// A credit grant, as billing asks the ledger for one.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant<'a> {
    pub customer_id: &'a str,
    /// The account of the customer with this name (created when missing).
    pub account_name: &'a str,
    pub unit_label: &'a str,
    pub amount: Decimal,
    /// Exactly once per key, however often asked.
    pub key: String,
}

/// What billing asks of the credits ledger.
#[async_trait::async_trait]
pub trait Credits: Send + Sync {
    async fn grant(&self, scope: &Scope, grant: Grant<'_>) -> Result<(), EngineError>;
}

/// The other contexts billing reaches, through its ports.
pub struct Ports {
    pub meters: Arc<dyn Meters>,
    pub customers: Arc<dyn Customers>,
    pub credits: Arc<dyn Credits>,
}

pub struct Billing {
    journal: Arc<Journal>,
    meters: Arc<dyn Meters>,
    customers: Arc<dyn Customers>,
    credits: Arc<dyn Credits>,
}

impl std::fmt::Debug for Billing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Billing").finish()
    }
}

impl Billing {
    pub fn new(journal: Arc<Journal>, ports: Ports) -> Billing {
        Billing {
            journal,
            meters: ports.meters,
            customers: ports.customers,
            credits: ports.credits,
        }
    }
}
