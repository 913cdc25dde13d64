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

/// A charge a payment provider accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charged {
    pub card_last4: String,
    /// The card pays now and declines every later charge (a test card).
    pub declines_later: bool,
}

/// What billing asks of a payment provider: charge a card. A decline is
/// `EngineError::CardDeclined` (402) and charges nothing. The charge is asked for
/// before apply decides the completion (the discount may run out meanwhile), so a
/// provider that moves real money must authorize here and capture only once the
/// completion is applied; the test cards move none.
pub trait PaymentProvider: Send + Sync {
    fn charge(
        &self,
        card: &tally_domain::billing::CardInput,
        amount_minor: i64,
        currency: &str,
    ) -> Result<Charged, EngineError>;
}

/// The test-mode provider: the test cards of docs/api.md ("Checkouts").
#[derive(Debug, Default)]
pub struct TestCards;

impl PaymentProvider for TestCards {
    fn charge(
        &self,
        card: &tally_domain::billing::CardInput,
        _amount_minor: i64,
        _currency: &str,
    ) -> Result<Charged, EngineError> {
        use tally_domain::billing::{test_card, CardBehavior};
        let card = test_card(card)?;
        match card.behavior {
            CardBehavior::Declines(code) => Err(EngineError::CardDeclined {
                code,
                message: format!(
                    "the card ending {} was declined ({code}); nothing was charged",
                    card.last4
                ),
            }),
            behavior => Ok(Charged {
                card_last4: card.last4,
                declines_later: behavior == CardBehavior::PaysThenDeclines,
            }),
        }
    }
}

/// The other contexts billing reaches, through its ports.
pub struct Ports {
    pub meters: Arc<dyn Meters>,
    pub customers: Arc<dyn Customers>,
    pub credits: Arc<dyn Credits>,
    /// Charges cards of test mode (the test cards).
    pub test_payments: Arc<dyn PaymentProvider>,
    /// Charges cards of live mode: none is implemented yet, so live checkouts
    /// answer 400 `payment_provider_not_configured`.
    pub live_payments: Option<Arc<dyn PaymentProvider>>,
}

pub struct Billing {
    journal: Arc<Journal>,
    meters: Arc<dyn Meters>,
    customers: Arc<dyn Customers>,
    credits: Arc<dyn Credits>,
    test_payments: Arc<dyn PaymentProvider>,
    live_payments: Option<Arc<dyn PaymentProvider>>,
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
            test_payments: ports.test_payments,
            live_payments: ports.live_payments,
        }
    }
}
