//! Every state change the service makes, as a value. Each is one record in the log;
//! projections are folds over these. Records carry full resulting state (the whole
//! meter after an update), so applying one never depends on reading the clock.

use crate::billing::{Checkout, Discount, Dispute, Payment, Subscription};
use crate::customer::Customer;
use crate::ids::{EndpointId, MeterId, StoreId, TransactionId};
use crate::ledger::{Account, Transaction};
use crate::meter::Meter;
use crate::mode::Mode;
use crate::product::Product;
use crate::usage::UsageEvent;

#[derive(Debug, Clone, PartialEq)]
pub struct StoreRecord {
    pub store_id: StoreId,
    pub name: String,
    pub prod_key_sha256: Vec<u8>,
    pub test_key_sha256: Vec<u8>,
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    StoreCreated(StoreRecord),
    CustomerUpserted(Customer),
    MeterUpserted(Meter),
    UsageBatch {
        store_id: StoreId,
        mode: Mode,
        events: Vec<UsageEvent>,
        /// The gateway found a purchase settling some of these events in credits
        /// (docs/api.md, "Usage prices"): apply leaves their units for settlement.
        settles: bool,
        /// The gateway matched the events knowing every record of the partition
        /// below this offset: a meter created or changed from there up to this
        /// record decides them in apply (ARCHITECTURE.md, "Meters the gateway did
        /// not know"). `None` in records of earlier builds.
        matched_below: Option<u64>,
    },
    /// One step of a backfill (ARCHITECTURE.md "Backfill"): fold the listed stored
    /// events into the meter; the finishing step also folds what arrived since the
    /// service's scan (received at or after `rescan_from_ms`) and moves the meter's
    /// counting start to `start_ms`.
    MeterBackfill {
        store_id: StoreId,
        mode: Mode,
        meter_id: MeterId,
        start_ms: i64,
        event_ids: Vec<String>,
        finish: bool,
        rescan_from_ms: i64,
    },
    WebhookEndpointUpserted(crate::webhook::WebhookEndpoint),
    WebhookEndpointDeleted {
        store_id: StoreId,
        mode: Mode,
        endpoint_id: EndpointId,
    },
    WebhookAttempt(WebhookAttempt),
    /// The final response of a request sent with an `idempotency-key`, so any node
    /// replays it (ARCHITECTURE.md "Idempotency keys").
    IdempotentResponse(IdempotentResponse),
    /// A product's full state after a create, update, archive or unarchive.
    ProductUpserted(Product),
    /// One atomic ledger step (see `tally.v1.CreditLedger`).
    CreditLedger {
        account: Option<Account>,
        transaction: Option<Transaction>,
        events: Vec<LedgerEvent>,
    },
    /// A discount's full state after a create, update or delete.
    DiscountUpserted(Discount),
    /// A new, open checkout.
    CheckoutCreated(Checkout),
    /// A paid checkout: apply decides whether it is still open and its discount still
    /// redeemable, then writes all of it or none (docs/api.md, "Checkouts").
    CheckoutCompleted(CheckoutCompletion),
    /// A refund (a payment of type `refund`); apply decides it fits what is left.
    RefundCreated(Payment),
    /// A dispute opened on a payment (test mode).
    DisputeOpened(Dispute),
    /// A store's tax rate for one country (percent).
    TaxRateSet {
        store_id: StoreId,
        mode: Mode,
        country: String,
        rate_percent: rust_decimal::Decimal,
    },
    /// Usage of one usage record, settled against credit accounts (written after
    /// that record is applied; applied once per source record).
    UsageSettled(UsageSettlement),
    /// A subscription's new state (renewal, retry, period end, cancel, pause,
    /// resume) with the payment a charge made; applied only over the version it was
    /// derived from (`RecordMeta::base_updated_at_ms`).
    SubscriptionChanged {
        subscription: Subscription,
        payment: Option<Payment>,
    },
    /// A store's test-mode clock: `to_ms` at the record's time, moving on from there.
    TestClockSet {
        store_id: StoreId,
        to_ms: i64,
    },
    /// A store's billing settings in one environment.
    StoreSettingsSet {
        store_id: StoreId,
        mode: Mode,
        settings: crate::subscription::StoreSettings,
    },
    AffiliateInviteCreated(crate::affiliate::AffiliateInvite),
    /// An invited affiliate joins (apply decides the invitation is still pending
    /// and the referral code free).
    AffiliateJoined {
        invite_id: crate::ids::InviteId,
        affiliate: crate::affiliate::Affiliate,
    },
    /// An affiliate's status changed (derived from a version: base).
    AffiliateUpserted(crate::affiliate::Affiliate),
    AffiliateClicked {
        store_id: StoreId,
        mode: Mode,
        referral_code: String,
    },
    /// A store's moderation policy, replaced whole.
    ModerationPolicySet {
        store_id: StoreId,
        mode: Mode,
        policy: crate::moderation::Policy,
    },
    /// A restricted API key of a store (only its SHA-256 is kept).
    ApiKeyCreated {
        store_id: StoreId,
        key_id: String,
        mode: Mode,
        key_sha256: Vec<u8>,
        permissions: Vec<String>,
        created_at_ms: i64,
    },
    /// A key revoked: refused from the moment this record is applied.
    ApiKeyRevoked {
        store_id: StoreId,
        key_id: String,
    },
    /// A credit reservation's hold, commit or release (decided in apply).
    CreditReservation(crate::reservation::ReservationStep),
    /// An account's grants reached their expiry: apply books what is due at the
    /// record's time (the expiry sweep appends it).
    CreditExpiriesDue {
        store_id: StoreId,
        mode: Mode,
        account_id: crate::ids::AccountId,
    },
    /// Stored usage events voided: all of them or, when one is not a stored event,
    /// none (decided in apply; the record's time is the void's time).
    EventsVoided {
        store_id: StoreId,
        mode: Mode,
        event_ids: Vec<String>,
        reason: String,
    },
    /// A step of a meter revision (docs/api.md, "Meter revisions"): the first step
    /// switches the meter to `meter`'s definition (its revision is the meter's
    /// next); every step re-derives the meter's buckets of `minutes` from the
    /// stored events (decided in apply; a step of a superseded revision is refused).
    MeterRevised {
        meter: crate::meter::Meter,
        minutes: Vec<i64>,
    },
    /// A stored usage event amended: voided and replaced by `replacement`, in one
    /// record so one never lands without the other (decided in apply; refused whole
    /// when the event is not stored, already voided, or the replacement's id taken).
    EventAmended {
        store_id: StoreId,
        mode: Mode,
        event_id: String,
        reason: String,
        replacement: crate::usage::UsageEvent,
        /// As `UsageBatch::matched_below`, for the replacement's meters.
        matched_below: Option<u64>,
    },
    /// A priced auto-recharge charged (or declined) on the customer's last
    /// successful payment method (docs/api.md, "Thresholds and auto-recharge"):
    /// apply books its grant, or clears the account's `auto_recharge` on a decline.
    AutoRechargeSettled(RechargeSettled),
}

/// The charge of a priced auto-recharge, as the billing scheduler made it.
#[derive(Debug, Clone, PartialEq)]
pub struct RechargeSettled {
    pub store_id: StoreId,
    pub mode: Mode,
    pub account_id: crate::ids::AccountId,
    /// The debit that left the balance below the threshold: the pending recharge
    /// this settles (apply refuses any other).
    pub debit_id: crate::ids::TransactionId,
    /// The credits the charge bought.
    pub amount: rust_decimal::Decimal,
    pub outcome: RechargeOutcome,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RechargeOutcome {
    /// Charged: the payment, stored with the grant.
    Paid(crate::billing::Payment),
    /// Declined, or no payment method to charge: why.
    Declined { message: String },
}

/// What a usage record charges the credit accounts its events are bound to.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageSettlement {
    pub store_id: StoreId,
    pub mode: Mode,
    /// The usage record's position: the settlement's identity.
    pub source_partition: u32,
    pub source_offset: u64,
    pub units: Vec<crate::settlement::UsageUnits>,
}

/// What a checkout's completion writes: the checkout as completed, its payment and,
/// for a recurring product, its subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckoutCompletion {
    pub checkout: Checkout,
    pub payment: Payment,
    pub subscription: Option<Subscription>,
}

/// The resource a billing event carries, as it was when the event happened.
#[derive(Debug, Clone, PartialEq)]
pub enum BillingObject {
    Checkout(Checkout),
    /// A subscription, with its customer and last transaction as they were at the
    /// event (a webhook body shows them, and may not change between attempts).
    Subscription {
        subscription: Subscription,
        customer: Option<crate::customer::Customer>,
        last_transaction: Option<Payment>,
    },
    Payment(Payment),
    Dispute(Dispute),
}

impl BillingObject {
    /// The store and environment the object belongs to.
    pub fn scope(&self) -> (&StoreId, Mode) {
        match self {
            BillingObject::Checkout(c) => (&c.store_id, c.mode),
            BillingObject::Subscription {
                subscription: s, ..
            } => (&s.store_id, s.mode),
            BillingObject::Payment(p) => (&p.store_id, p.mode),
            BillingObject::Dispute(d) => (&d.store_id, d.mode),
        }
    }
}

/// A webhook event of the billing context (ids derive from the record's, so a
/// replay produces the same ones).
#[derive(Debug, Clone, PartialEq)]
pub struct BillingEvent {
    pub id: String,
    pub event_type: String,
    pub created_at_ms: i64,
    pub object: BillingObject,
}

/// What travels beside a record in its log envelope.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordMeta {
    /// When the service appended the record (epoch ms, from the injected clock);
    /// expiries are decided from it, never from the clock at apply time.
    pub recorded_at_ms: i64,
    /// On an update: the `updated_at_ms` of the version it was derived from. Apply
    /// refuses the record (`resource_changed`) when the stored version differs, so
    /// two concurrent updates never lose one another's changes.
    pub base_updated_at_ms: Option<i64>,
    /// On the first record a request sent with an `idempotency-key` appends: apply
    /// claims the key for it, or refuses it as a repeat.
    pub request: Option<RequestKey>,
}

/// An `idempotency-key` as apply decides on it: scoped by the API key that sent it,
/// with the fingerprint of the request (path and body) it was first used with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    /// SHA-256 of the API key: one store and environment.
    pub api_key_sha256: Vec<u8>,
    pub key: String,
    /// SHA-256 of the request's path and body.
    pub fingerprint: Vec<u8>,
}

/// The response a keyed request was answered with.
#[derive(Debug, Clone, PartialEq)]
pub struct IdempotentResponse {
    pub request: RequestKey,
    /// The partition key of the record the request appended first (or of its API
    /// key): the response follows that record in one partition's order.
    pub partition_key: Vec<u8>,
    pub status: u16,
    pub body: String,
}

/// The outcome of one delivery attempt (see `tally.v1.WebhookAttempt`).
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookAttempt {
    pub store_id: StoreId,
    pub mode: Mode,
    pub endpoint_id: EndpointId,
    pub event_id: String,
    pub attempt: u32,
    pub at_ms: i64,
    pub status_code: u16,
    pub latency_ms: u64,
    pub error: String,
    pub delivered: bool,
    pub next_attempt_at_ms: Option<i64>,
    pub manual: bool,
}

/// A webhook event the ledger emits; delivered by the webhook dispatcher.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerEvent {
    pub id: String,
    pub event_type: String,
    pub created_at_ms: i64,
    pub transaction_id: Option<TransactionId>,
    pub account: Account,
    pub balance: rust_decimal::Decimal,
}

impl Record {
    /// Whether every node of a cluster applies this record, whoever owns its
    /// partition: what a node needs to route a request to the owner (a store and
    /// its API keys), and nothing else.
    pub fn applies_on_every_node(&self) -> bool {
        matches!(
            self,
            Record::StoreCreated(_) | Record::ApiKeyCreated { .. } | Record::ApiKeyRevoked { .. }
        )
    }

    /// The usage events this record stores, if it stores any: a usage batch's, or an
    /// amendment's replacement (what the event index and `F` rows point at).
    pub fn stored_events(&self) -> Option<(&StoreId, Mode, &[crate::usage::UsageEvent])> {
        match self {
            Record::UsageBatch {
                store_id,
                mode,
                events,
                ..
            } => Some((store_id, *mode, events)),
            Record::EventAmended {
                store_id,
                mode,
                replacement,
                ..
            } => Some((store_id, *mode, std::slice::from_ref(replacement))),
            _ => None,
        }
    }

    /// The partitioning key: every record of a store goes to one partition, so a
    /// store's records keep one order and one node can own the store (see
    /// ARCHITECTURE.md, "Partitions and ownership").
    pub fn partition_key(&self) -> Vec<u8> {
        match self {
            Record::StoreCreated(s) => s.store_id.as_bytes().to_vec(),
            Record::CustomerUpserted(c) => c.store_id.as_bytes().to_vec(),
            Record::MeterUpserted(m) => m.store_id.as_bytes().to_vec(),
            // With the store's meters, so "is this meter priced?" is decided in one
            // log order with the meter's archive.
            Record::ProductUpserted(p) => p.store_id.as_bytes().to_vec(),
            Record::MeterBackfill { store_id, .. } => store_id.as_bytes().to_vec(),
            // Ledger steps go with their store's control records, so the endpoints
            // subscribed when an event happens are decided in one log order.
            Record::CreditLedger {
                account,
                transaction,
                ..
            } => account
                .as_ref()
                .map(|a| a.store_id.as_str())
                .or(transaction.as_ref().map(|t| t.store_id.as_str()))
                .unwrap_or("")
                .as_bytes()
                .to_vec(),
            Record::WebhookEndpointUpserted(e) => e.store_id.as_bytes().to_vec(),
            Record::WebhookEndpointDeleted { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::WebhookAttempt(a) => a.store_id.as_bytes().to_vec(),
            Record::IdempotentResponse(r) => r.partition_key.clone(),
            // Billing goes with its store's products and endpoints: a discount's
            // redemptions and a payment's refunds are decided in one order.
            Record::DiscountUpserted(d) => d.store_id.as_bytes().to_vec(),
            Record::CheckoutCreated(c) => c.store_id.as_bytes().to_vec(),
            Record::CheckoutCompleted(c) => c.checkout.store_id.as_bytes().to_vec(),
            Record::RefundCreated(p) => p.store_id.as_bytes().to_vec(),
            Record::DisputeOpened(d) => d.store_id.as_bytes().to_vec(),
            Record::TaxRateSet { store_id, .. } => store_id.as_bytes().to_vec(),
            // With the store's ledger steps: balances are decided in one order.
            Record::UsageSettled(s) => s.store_id.as_bytes().to_vec(),
            Record::SubscriptionChanged { subscription, .. } => {
                subscription.store_id.as_bytes().to_vec()
            }
            Record::TestClockSet { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::StoreSettingsSet { store_id, .. } => store_id.as_bytes().to_vec(),
            // With the store's checkouts: conversions are counted in one order.
            Record::AffiliateInviteCreated(i) => i.store_id.as_bytes().to_vec(),
            Record::AffiliateJoined { affiliate, .. } => affiliate.store_id.as_bytes().to_vec(),
            Record::AffiliateUpserted(a) => a.store_id.as_bytes().to_vec(),
            Record::AffiliateClicked { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::ModerationPolicySet { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::ApiKeyCreated { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::ApiKeyRevoked { store_id, .. } => store_id.as_bytes().to_vec(),
            // With the store's customers and meters: event ids are deduplicated per
            // store, so a store's events are decided in one order (and by one node
            // of a cluster that splits the projection, ARCHITECTURE.md).
            Record::UsageBatch { store_id, .. } => store_id.as_bytes().to_vec(),
            // With the store's ledger steps: holds and debits see one order.
            Record::CreditReservation(step) => step.store_id().as_bytes().to_vec(),
            Record::CreditExpiriesDue { store_id, .. } => store_id.as_bytes().to_vec(),
            // With the store's usage records: a void sees every event stored before it.
            Record::EventsVoided { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::EventAmended { store_id, .. } => store_id.as_bytes().to_vec(),
            Record::MeterRevised { meter, .. } => meter.store_id.as_bytes().to_vec(),
            Record::AutoRechargeSettled(settled) => settled.store_id.as_bytes().to_vec(),
        }
    }
}
