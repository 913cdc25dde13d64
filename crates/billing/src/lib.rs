//! The billing context: products (what a store sells, with usage prices bound to
//! meters), discounts, checkouts with test cards, payments and refunds (the API's
//! transactions), disputes, per-store tax rates, and the subscription a checkout of a
//! recurring product starts (ARCHITECTURE.md, "tally-billing").
//!
//! Same inner shape as every context: the records it owns (`ProductUpserted`,
//! `DiscountUpserted`, `CheckoutCreated`, `CheckoutCompleted`, `RefundCreated`,
//! `DisputeOpened`, `TaxRateSet`, `UsageSettled`), its keys (tables
//! `R p Z d e f o t v x y s H E g 1 2 3 4 5 6` of the core key space), its apply
//! ([`apply`], [`settlement`]), its services and queries ([`products`],
//! [`discounts`], [`checkouts`], [`payments`]) and the settler that turns usage
//! settled in credits into records ([`Billing::run_settler`]). It reaches other
//! contexts only through the ports it owns ([`Meters`], [`Customers`], [`Credits`]);
//! metering reaches it through metering's `Pricing` port, which the composition
//! root answers with [`Billing::meter_priced_on_active_product`].

use std::sync::Arc;

use rust_decimal::Decimal;
use tally_core::{EngineError, Journal, Scope};
use tally_domain::meter::MeterStatus;

pub mod affiliates;
pub mod apply;
pub mod checkouts;
pub mod discounts;
pub mod lifecycle;
pub mod payments;
pub mod products;
pub mod recharges;
pub mod settlement;
pub mod subscriptions;

/// A meter, as billing needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeterInfo {
    pub status: MeterStatus,
    pub aggregation: tally_domain::meter::Aggregation,
    /// How many times its definition was revised, plus one (docs/api.md, "Meter
    /// revisions").
    pub revision: u32,
}

/// What billing asks of metering: it owns this port, the composition root
/// implements it.
pub trait Meters: Send + Sync {
    /// A meter of the scope, if it exists.
    fn meter_info(&self, scope: &Scope, meter_id: &str) -> Result<Option<MeterInfo>, EngineError>;

    /// A customer's usage of a meter over the whole minutes from `start_ms`'s to
    /// `end_ms`'s (so consecutive periods count every event once); `None` when
    /// the value left the exact range (or the meter is gone).
    fn period_usage(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<Option<Decimal>, EngineError>;

    /// The customer's events in the same minutes as `period_usage` that the meter
    /// stopped counting because they were voided or amended.
    fn period_voided_events(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<u64, EngineError>;
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

/// A priced auto-recharge waiting for its charge (docs/api.md, "Thresholds and
/// auto-recharge"), as billing asks the ledger for them.
#[derive(Debug, Clone, PartialEq)]
pub struct RechargeDue {
    pub scope: Scope,
    pub account_id: String,
    pub customer_id: String,
    /// The debit that left the balance below the threshold.
    pub debit_id: String,
    /// The credits one recharge books.
    pub amount: Decimal,
    pub unit_label: String,
    pub price: tally_domain::ledger::RechargePrice,
}

/// What billing asks of the credits ledger.
#[async_trait::async_trait]
pub trait Credits: Send + Sync {
    /// Up to `limit` priced auto-recharges waiting for their charge, of the stores
    /// this node serves.
    fn recharges_due(&self, limit: usize) -> Result<Vec<RechargeDue>, EngineError>;
}

/// A card a customer paid with, charged again later (a renewal, an auto-recharge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardOnFile {
    pub last4: String,
    /// It pays its first charge and declines every later one (a test card).
    pub declines_later: bool,
    /// Its expiry (`MM/YY` or `MM/YYYY`), when known.
    pub exp: Option<String>,
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
    /// Charges a card given now, at `at_ms` by the store's clock.
    fn charge(
        &self,
        card: &tally_domain::billing::CardInput,
        amount_minor: i64,
        currency: &str,
        at_ms: i64,
    ) -> Result<Charged, EngineError>;

    /// Charges a card on file (a subscription's renewal or retry, an
    /// auto-recharge) at `at_ms` by the store's clock. A decline is
    /// `EngineError::CardDeclined`.
    fn charge_on_file(
        &self,
        card: &CardOnFile,
        amount_minor: i64,
        currency: &str,
        at_ms: i64,
    ) -> Result<(), EngineError>;
}

/// The test-mode provider: the test cards of docs/api.md ("Checkouts").
#[derive(Debug, Default)]
pub struct TestCards;

/// A card past its expiry month at `at_ms` (by the store's clock) is declined,
/// whatever card it is.
fn check_expiry(last4: &str, exp: Option<&str>, at_ms: i64) -> Result<(), EngineError> {
    match exp.filter(|exp| tally_domain::billing::card_expired(exp, at_ms)) {
        Some(exp) => Err(EngineError::CardDeclined {
            code: "expired_card",
            message: format!(
                "the card ending {last4} expired at the end of {}; nothing was charged",
                exp.trim()
            ),
            param: "exp",
        }),
        None => Ok(()),
    }
}

/// A test card's decline: `code`, naming the card.
fn declined(last4: &str, code: &'static str) -> EngineError {
    EngineError::CardDeclined {
        code,
        message: format!("the card ending {last4} was declined ({code}); nothing was charged"),
        param: "card_number",
    }
}

impl PaymentProvider for TestCards {
    fn charge(
        &self,
        input: &tally_domain::billing::CardInput,
        _amount_minor: i64,
        _currency: &str,
        at_ms: i64,
    ) -> Result<Charged, EngineError> {
        use tally_domain::billing::{test_card, CardBehavior};
        let card = test_card(input)?;
        check_expiry(&card.last4, input.exp.as_deref(), at_ms)?;
        match card.behavior {
            CardBehavior::Declines(code) => Err(declined(&card.last4, code)),
            behavior => Ok(Charged {
                card_last4: card.last4,
                declines_later: behavior == CardBehavior::PaysThenDeclines,
            }),
        }
    }

    fn charge_on_file(
        &self,
        card: &CardOnFile,
        _amount_minor: i64,
        _currency: &str,
        at_ms: i64,
    ) -> Result<(), EngineError> {
        check_expiry(&card.last4, card.exp.as_deref(), at_ms)?;
        if card.declines_later {
            return Err(declined(&card.last4, "card_declined"));
        }
        Ok(())
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
    /// Woken when a commit leaves a usage settlement pending.
    settler_wake: tokio::sync::Notify,
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
            settler_wake: tokio::sync::Notify::new(),
            meters: ports.meters,
            customers: ports.customers,
            credits: ports.credits,
            test_payments: ports.test_payments,
            live_payments: ports.live_payments,
        }
    }
}

/// Pending settlements the settler appends per round: bounds the records it has in
/// flight (each waits for its apply) and the memory of one scan.
pub const SETTLE_BATCH: usize = 256;

/// How often the settler looks for pending settlements without being woken: a
/// pending settlement left by another node, or by a crash before it was appended.
pub const SETTLE_POLL_MS: u64 = 1_000;

impl Billing {
    /// The settlement of the `credits` usage prices a subscription (or a one-time
    /// checkout) bought, by price.
    pub fn settlement_totals(
        &self,
        scope: &Scope,
        source_id: &str,
    ) -> Result<Vec<tally_domain::settlement::SettlementTotals>, EngineError> {
        settlement::settlement_totals(
            self.journal.store().as_ref(),
            &scope.store_id,
            scope.mode,
            source_id,
        )
    }

    /// Whether a purchase settles any of these events in credits (the gateway's
    /// question, through its `Settlements` port).
    pub fn settles(
        &self,
        scope: &Scope,
        events: &[tally_domain::usage::UsageEvent],
    ) -> Result<bool, EngineError> {
        settlement::is_bound(
            self.journal.store().as_ref(),
            &scope.store_id,
            scope.mode,
            events,
        )
    }

    /// The payment provider of an environment: the test cards in test mode; in live
    /// mode the configured one, if any.
    pub(crate) fn provider(&self, mode: tally_domain::Mode) -> Option<&dyn PaymentProvider> {
        match mode {
            tally_domain::Mode::Test => Some(self.test_payments.as_ref()),
            tally_domain::Mode::Prod => self.live_payments.as_deref(),
        }
    }

    /// A commit left a usage settlement pending.
    pub fn wake_settler(&self) {
        self.settler_wake.notify_one();
    }

    /// Appends up to `SETTLE_BATCH` pending usage settlements as `UsageSettled`
    /// records and waits until they are applied; how many it appended. Any number of
    /// settlers (nodes, restarts) may append one twice: apply settles a usage record
    /// once and refuses the repeat.
    pub async fn settle_pending(&self) -> Result<usize, EngineError> {
        self.journal.check_writable()?;
        // Only the stores this node serves: in a split cluster another node's
        // projection of a store is not current here (ARCHITECTURE.md, "Partitions
        // and ownership"), and its node settles it.
        let pending = settlement::pending_settlements(
            self.journal.store().as_ref(),
            SETTLE_BATCH,
            |store| self.journal.serves_store(store),
        )?;
        let appends = pending.into_iter().map(|settlement| async move {
            self.journal
                .append_and_decide(&tally_domain::record::Record::UsageSettled(settlement))
                .await
        });
        let mut appended = 0;
        for result in futures::future::join_all(appends).await {
            match result {
                Ok(_) => appended += 1,
                // Another settler got there first.
                Err(EngineError::Conflict {
                    code: settlement::ALREADY_SETTLED,
                    ..
                }) => appended += 1,
                Err(error) => return Err(error),
            }
        }
        Ok(appended)
    }

    /// Settles pending usage until `shutdown` turns true: when woken by a commit
    /// that left one, and every `SETTLE_POLL_MS`.
    pub async fn run_settler(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = self.settler_wake.notified() => {}
                _ = tokio::time::sleep(std::time::Duration::from_millis(SETTLE_POLL_MS)) => {}
            }
            loop {
                match self.settle_pending().await {
                    Ok(n) if n >= SETTLE_BATCH => continue,
                    Ok(_) => break,
                    // Not ready or not writable yet (catching up, a full disk): later.
                    Err(error @ EngineError::Unavailable { .. }) => {
                        tracing::debug!(%error, "usage settlement deferred");
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "usage settlement deferred; it is retried");
                        break;
                    }
                }
            }
        }
    }
}
