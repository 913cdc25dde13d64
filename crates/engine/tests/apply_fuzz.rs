//! Fuzz-style property test of the apply path: random records, as a buggy or hostile
//! writer of the log could append them (extreme and unrepresentable decimals,
//! forged unbalanced transactions, conflicting names, external ids and idempotency
//! keys, reversals of anything, undecodable payloads), applied in any chunking:
//! - apply never fails and never panics (a caught panic would leave an
//!   `apply_failed` outcome, which this test refuses);
//! - any chunking gives the digest of applying the whole log at once (replay);
//! - the ledger's invariants hold whatever was written: every balance within
//!   `MAX_BALANCE`, no customer balance below zero, every scope's balances sum to
//!   exactly zero;
//! - billing's and usage settlement's invariants hold (see `check_billing`,
//!   `check_settlement`), and settlement does not depend on how the usage and store
//!   partitions interleave (`interleaving`).

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use rust_decimal::Decimal;
use tally_domain::customer::Customer;
use tally_domain::ledger::{
    Account, AccountStatus, Entry, SystemAccount, Transaction, TransactionKind, MAX_AMOUNT,
    MAX_BALANCE,
};
use tally_domain::meter::{Aggregation, Meter, MeterFilter, MeterStatus};
use tally_domain::product::{
    BillingPeriod, BillingType, Product, ProductStatus, SettlementMode, TargetAccount, TaxCategory,
    TaxMode, TrialUsageMode, UsagePrice,
};
use tally_domain::record::{IdempotentResponse, Record, RecordMeta, RequestKey};
use tally_domain::usage::{PropertyValue, UsageEvent};
use tally_domain::Mode;
use tally_engine::codec;
use tally_engine::keys;
use tally_engine::outcome::Outcome;
use tally_engine::projector::{apply_chunk_in_memory, apply_chunk_in_memory_as, ProjectorState};
use tally_log::LogEntry;
use tally_projection::{scan_prefix, MemoryStore, ProjectionStore, Visit};
use tally_runtime::ChunkMode;

const STORE: &str = "st_fuzz";
const T0: i64 = 1_800_000_000_000;

fn decimal() -> impl Strategy<Value = Decimal> {
    prop_oneof![
        (1i64..1_000).prop_map(Decimal::from),
        (1i64..1_000_000, 0u32..=18).prop_map(|(m, s)| Decimal::new(m, s)),
        Just(MAX_AMOUNT),
        Just(MAX_BALANCE),
        Just(Decimal::MAX),
        Just(Decimal::MIN),
        Just(Decimal::new(1, 18)),
        Just(Decimal::new(1, 28)),
        (any::<i64>(), 0u32..=28).prop_map(|(m, s)| Decimal::new(m, s)),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Customer {
        id: u8,
        external: Option<u8>,
    },
    Meter {
        id: u8,
        name: u8,
        aggregation: u8,
        archived: bool,
    },
    /// A product pricing some meters (ids up to 5: some never exist).
    Product {
        id: u8,
        meters: Vec<u8>,
        archived: bool,
    },
    Usage {
        customer: u8,
        event: u8,
        value: Decimal,
        as_text: bool,
        /// The gateway found a purchase settling it in credits.
        settles: bool,
    },
    /// A void of stored events (or of ids never stored: refused whole).
    Void {
        events: Vec<u8>,
    },
    /// A revision step of a meter (existing or not, any aggregation, any revision
    /// number, the minutes of the usage ops or others).
    Revise {
        meter: u8,
        aggregation: u8,
        revision: u32,
        minutes: Vec<i64>,
    },
    /// An amendment of an event (stored or not, voided or not) by a replacement
    /// whose id may be taken and whose customer may differ.
    Amend {
        event: u8,
        replacement: u8,
        customer: u8,
        value: Decimal,
    },
    /// A usage settlement as any writer could append it: of a position that holds a
    /// usage record or not, repeated, before its record, any quantity.
    Settle {
        source: u8,
        customer: u8,
        meter: u8,
        quantity: Decimal,
    },
    OpenAccount {
        account: u8,
        name: u8,
        initial: Decimal,
    },
    Move {
        account: u8,
        debit: bool,
        amount: Decimal,
        key: u8,
    },
    Reverse {
        tx: u8,
        account: u8,
    },
    /// A priced auto-recharge's charge settled (paid or declined), for a debit
    /// that left one pending or not, perhaps twice.
    Recharge {
        account: u8,
        debit: u8,
        paid: bool,
    },
    Status {
        account: u8,
        status: u8,
    },
    Forged {
        account: u8,
        amounts: Vec<(u8, Decimal)>,
    },
    Backfill {
        meter: u8,
        events: Vec<u8>,
        finish: bool,
    },
    /// A keyed request's recorded response.
    Response {
        key: u8,
        fingerprint: u8,
        status: u16,
    },
    /// A discount limited to `max` redemptions, perhaps deleted or expiring.
    Discount {
        id: u8,
        max: u32,
        deleted: bool,
        expires_half_days: Option<u8>,
    },
    Checkout {
        id: u8,
        product: u8,
        discount: Option<u8>,
    },
    /// A checkout referred by affiliate code `code{n}`.
    Referred {
        id: u8,
        product: u8,
        code: u8,
    },
    Invite {
        id: u8,
        email: u8,
    },
    Join {
        invite: u8,
        affiliate: u8,
        code: u8,
        forged: bool,
    },
    Suspend {
        affiliate: u8,
        suspended: bool,
    },
    Commission(u8),
    Click(u8),
    /// A completion; `forged` makes its amounts not add up.
    Complete {
        checkout: u8,
        amount: i64,
        discount_amount: i64,
        tax: i64,
        forged: bool,
    },
    Refund {
        payment: u8,
        amount: i64,
    },
    Dispute {
        payment: u8,
    },
    /// What every node of a cluster applies: a store, an API key created or revoked.
    Store(u8),
    Key {
        id: u8,
        revoke: bool,
    },
    Garbage(Vec<u8>),
}

/// What a record's envelope carries besides it: a base version (right or stale), an
/// idempotency key (a few keys and fingerprints, so repeats and reuses happen), and
/// its time, in half days (so claims expire within a run).
#[derive(Debug, Clone)]
struct Envelope {
    base: Option<i64>,
    request: Option<(u8, u8)>,
    half_days: u8,
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (
        proptest::option::weighted(0.2, prop_oneof![Just(T0), 0i64..3]),
        proptest::option::weighted(0.3, (0u8..3, 0u8..2)),
        0u8..4,
    )
        .prop_map(|(base, request, half_days)| Envelope {
            base,
            request,
            half_days,
        })
}

fn request_key(key: u8, fingerprint: u8) -> RequestKey {
    RequestKey {
        api_key_sha256: vec![1; 32],
        key: format!("key{key}"),
        fingerprint: vec![fingerprint],
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..4, proptest::option::of(0u8..3)).prop_map(|(id, external)| Op::Customer { id, external }),
        1 => (0u8..4, 0u8..3, 0u8..8, proptest::bool::weighted(0.3))
            .prop_map(|(id, name, aggregation, archived)| Op::Meter { id, name, aggregation, archived }),
        1 => (0u8..3, proptest::collection::vec(0u8..6, 0..3), proptest::bool::weighted(0.3))
            .prop_map(|(id, meters, archived)| Op::Product { id, meters, archived }),
        3 => (0u8..4, 0u8..8, decimal(), any::<bool>(), proptest::bool::weighted(0.7))
            .prop_map(|(customer, event, value, as_text, settles)| Op::Usage { customer, event, value, as_text, settles }),
        1 => (0u8..70, 0u8..4, 0u8..4, decimal())
            .prop_map(|(source, customer, meter, quantity)| Op::Settle { source, customer, meter, quantity }),
        1 => (0u8..4, 0u8..2, decimal()).prop_map(|(account, name, initial)| Op::OpenAccount { account, name, initial }),
        4 => (0u8..4, any::<bool>(), decimal(), 0u8..6)
            .prop_map(|(account, debit, amount, key)| Op::Move { account, debit, amount, key }),
        1 => (0u8..12, 0u8..4).prop_map(|(tx, account)| Op::Reverse { tx, account }),
        2 => (2u8..4, 0u8..60, any::<bool>()).prop_map(|(account, debit, paid)| Op::Recharge { account, debit, paid }),
        1 => (0u8..4, 0u8..3).prop_map(|(account, status)| Op::Status { account, status }),
        1 => (0u8..4, proptest::collection::vec((0u8..6, decimal()), 0..4))
            .prop_map(|(account, amounts)| Op::Forged { account, amounts }),
        1 => (0u8..4, proptest::collection::vec(0u8..8, 0..4), any::<bool>())
            .prop_map(|(meter, events, finish)| Op::Backfill { meter, events, finish }),
        1 => proptest::collection::vec(0u8..9, 0..3).prop_map(|events| Op::Void { events }),
        1 => (0u8..9, 0u8..12, 0u8..4, decimal())
            .prop_map(|(event, replacement, customer, value)| Op::Amend { event, replacement, customer, value }),
        1 => (0u8..4, 0u8..8, 0u32..4, proptest::collection::vec(-1i64..3, 0..3))
            .prop_map(|(meter, aggregation, revision, minutes)| Op::Revise { meter, aggregation, revision, minutes }),
        1 => (0u8..3, 0u8..2, prop_oneof![Just(200u16), Just(400u16)])
            .prop_map(|(key, fingerprint, status)| Op::Response { key, fingerprint, status }),
        1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(Op::Garbage),
        3 => billing_op(),
        1 => shared_op(),
    ]
}

/// Priced auto-recharges (account 3 recharges 10 for a price below 50): debits
/// that leave it pending, charges settled for the right debit or another, paid or
/// declined, twice, with the account frozen, closed or re-credited in between.
fn recharge_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (30i64..120).prop_map(|initial| Op::OpenAccount { account: 3, name: 0, initial: Decimal::from(initial) }),
        4 => (any::<bool>(), 1i64..40, 0u8..6)
            .prop_map(|(debit, amount, key)| Op::Move { account: 3, debit: debit || amount > 5, amount: Decimal::from(amount), key }),
        3 => (0u8..60, proptest::bool::weighted(0.7)).prop_map(|(debit, paid)| Op::Recharge { account: 3, debit, paid }),
        1 => (0u8..3).prop_map(|status| Op::Status { account: 3, status }),
    ]
}

/// Stores and API keys: what every node of a cluster applies.
fn shared_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..2).prop_map(Op::Store),
        (0u8..3, any::<bool>()).prop_map(|(id, revoke)| Op::Key { id, revoke }),
    ]
}

/// Discounts, checkouts, completions, refunds and disputes.
fn billing_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..2, 1u32..4, proptest::bool::weighted(0.2), proptest::option::of(0u8..4))
            .prop_map(|(id, max, deleted, expires_half_days)| Op::Discount { id, max, deleted, expires_half_days }),
        2 => (0u8..6, 0u8..3, proptest::option::of(0u8..3))
            .prop_map(|(id, product, discount)| Op::Checkout { id, product, discount }),
        3 => (0u8..6, 0i64..5_000, 0i64..500, 0i64..300, proptest::bool::weighted(0.1))
            .prop_map(|(checkout, amount, discount_amount, tax, forged)| Op::Complete { checkout, amount, discount_amount, tax, forged }),
        3 => (0u8..7, -5i64..3_000).prop_map(|(payment, amount)| Op::Refund { payment, amount }),
        1 => (0u8..7).prop_map(|payment| Op::Dispute { payment }),
        // Affiliates: invitations, joins (forged ones too), referred checkouts.
        1 => (0u8..2, 0u8..2).prop_map(|(id, email)| Op::Invite { id, email }),
        2 => (0u8..2, 0u8..2, 0u8..2, proptest::bool::weighted(0.2))
            .prop_map(|(invite, affiliate, code, forged)| Op::Join { invite, affiliate, code, forged }),
        1 => (0u8..2, proptest::bool::weighted(0.3)).prop_map(|(affiliate, suspended)| Op::Suspend { affiliate, suspended }),
        1 => (1u8..60).prop_map(Op::Commission),
        1 => (0u8..2).prop_map(Op::Click),
        3 => (0u8..6, 0u8..3, 0u8..2).prop_map(|(id, product, code)| Op::Referred { id, product, code }),
        // Usage settled in credits against the accounts the purchases bound.
        2 => (0u8..2, 0u8..8, decimal(), proptest::bool::weighted(0.8))
            .prop_map(|(customer, event, value, settles)| Op::Usage { customer, event, value, as_text: false, settles }),
        3 => (0u8..90, 0u8..2, prop_oneof![Just(1u8), Just(3), 0u8..4], prop_oneof![3 => (1i64..20).prop_map(Decimal::from), 1 => decimal()])
            .prop_map(|(source, customer, meter, quantity)| Op::Settle { source, customer, meter, quantity }),
        2 => (0u8..2, prop_oneof![(1i64..30).prop_map(Decimal::from), decimal()])
            .prop_map(|(account, initial)| Op::OpenAccount { account, name: 0, initial }),
        1 => (0u8..2, decimal(), 0u8..6)
            .prop_map(|(account, amount, key)| Op::Move { account, debit: false, amount, key }),
    ]
}

fn product(id: u8, meters: &[u8], archived: bool) -> Product {
    let mut seen = std::collections::BTreeSet::new();
    Product {
        id: format!("prod_{id}").into(),
        store_id: STORE.into(),
        mode: Mode::Test,
        name: "p".into(),
        description: None,
        price: 100,
        currency: "USD".into(),
        billing_type: BillingType::Recurring,
        billing_period: BillingPeriod::EveryMonth,
        status: if archived {
            ProductStatus::Archived
        } else {
            ProductStatus::Active
        },
        tax_mode: TaxMode::Exclusive,
        tax_category: TaxCategory::Saas,
        image_urls: Vec::new(),
        features: Vec::new(),
        usage_prices: meters
            .iter()
            .filter(|m| seen.insert(**m))
            .map(|m| UsagePrice {
                id: format!("uprc_{m}"),
                meter_id: format!("mtr_{m}").into(),
                // Odd meters settle in credits, from the accounts named `a0`.
                unit_price: Decimal::new(5, 1),
                free_allowance: Decimal::from(*m % 3),
                cap: (*m == 3).then(|| Decimal::from(4)),
                settlement_mode: if m % 2 == 1 {
                    SettlementMode::Credits
                } else {
                    SettlementMode::Invoice
                },
                target_account: TargetAccount::Customer,
                target_account_name: "a0".into(),
                trial_usage_mode: TrialUsageMode::Free,
            })
            .collect(),
        trial_period_days: None,
        trial_price: None,
        business_net_pricing: false,
        product_url: None,
        default_success_url: None,
        custom_fields: Vec::new(),
        created_at_ms: T0,
        updated_at_ms: T0,
    }
}

/// Billing records as a hostile writer could append them: ids collide on purpose
/// (six checkouts, their payments `txn_0..5`), amounts are random.
mod billing {
    use super::*;
    use tally_domain::billing::{
        Checkout, CheckoutStatus, Discount, DiscountDuration, DiscountStatus, DiscountType,
        Dispute, Payment, PaymentStatus, PaymentType,
    };
    use tally_domain::record::CheckoutCompletion;

    pub fn discount(id: u8, max: u32, deleted: bool, expires: Option<u8>) -> Discount {
        Discount {
            id: format!("dis_{id}").into(),
            store_id: STORE.into(),
            mode: Mode::Test,
            name: "d".into(),
            code: format!("CODE{id}"),
            discount_type: DiscountType::Percentage,
            amount: Decimal::TEN,
            currency: None,
            stored_status: if deleted {
                DiscountStatus::Deleted
            } else {
                DiscountStatus::Active
            },
            starts_at_ms: None,
            expires_at_ms: expires.map(|h| T0 + i64::from(h) * 12 * 3_600_000),
            max_redemptions: Some(max),
            duration: DiscountDuration::Once,
            duration_in_months: None,
            applies_to_products: Vec::new(),
            redeem_count: 0,
            created_at_ms: T0,
            updated_at_ms: T0,
        }
    }

    pub fn checkout(id: u8, product: u8, discount: Option<u8>) -> Checkout {
        referred(id, product, discount, None)
    }

    pub fn referred(id: u8, product: u8, discount: Option<u8>, code: Option<u8>) -> Checkout {
        Checkout {
            id: format!("chk_{id}").into(),
            store_id: STORE.into(),
            mode: Mode::Test,
            status: CheckoutStatus::Open,
            product_id: format!("prod_{product}").into(),
            customer_id: format!("cus_{}", id % 2).into(),
            units: 1,
            discount_id: discount.map(|d| format!("dis_{d}").into()),
            discount_code: discount.map(|d| format!("CODE{d}")),
            affiliate_code: code.map(|c| format!("code{c}")),
            success_url: None,
            metadata: Default::default(),
            amount: 0,
            currency: "USD".into(),
            transaction_id: None,
            subscription_id: None,
            completed_at_ms: None,
            created_at_ms: T0,
            updated_at_ms: T0,
        }
    }

    fn payment(id: String, customer: String, amount: i64) -> Payment {
        Payment {
            id: id.into(),
            store_id: STORE.into(),
            mode: Mode::Test,
            payment_type: PaymentType::Payment,
            status: PaymentStatus::Paid,
            amount,
            currency: "USD".into(),
            discount_amount: 0,
            tax_amount: 0,
            amount_paid: amount,
            refunded_amount: 0,
            tax_country: None,
            checkout_id: None,
            subscription_id: None,
            customer_id: customer.into(),
            description: String::new(),
            period_start_ms: None,
            period_end_ms: None,
            refund_of: None,
            reason: None,
            disputed: false,
            card_last4: None,
            card_declines_later: false,
            card_exp: None,
            affiliate_id: None,
            affiliate_commission: 0,
            lines: Vec::new(),
            created_at_ms: T0,
            updated_at_ms: T0,
        }
    }

    /// The outcome of charging the recharge that move op `debit` left pending (or
    /// never left) on account `n`: its payment, or a decline.
    pub fn recharge(i: usize, n: u8, debit: usize, paid: bool) -> Record {
        Record::AutoRechargeSettled(tally_domain::record::RechargeSettled {
            store_id: STORE.into(),
            mode: Mode::Test,
            account_id: format!("ca_{n}").into(),
            debit_id: format!("ctx_{debit}").into(),
            amount: Decimal::TEN,
            outcome: if paid {
                // Every fifth names another customer's payment: refused whole.
                tally_domain::record::RechargeOutcome::Paid(payment(
                    format!("txn_ar{i}"),
                    format!("cus_{}", (n + u8::from(i % 5 == 4)) % 2),
                    100,
                ))
            } else {
                tally_domain::record::RechargeOutcome::Declined {
                    message: "declined".into(),
                }
            },
        })
    }

    /// Completes checkout `id` as last created before this op (or a fresh one).
    pub fn completion(
        earlier: &[(Op, Envelope)],
        id: u8,
        (amount, discount_amount, tax): (i64, i64, i64),
        forged: bool,
    ) -> CheckoutCompletion {
        let (product, discount, code) = earlier
            .iter()
            .rev()
            .find_map(|(op, _)| match op {
                Op::Checkout {
                    id: c,
                    product,
                    discount,
                } if *c == id => Some((*product, *discount, None)),
                Op::Referred {
                    id: c,
                    product,
                    code,
                } if *c == id => Some((*product, None, Some(*code))),
                _ => None,
            })
            .unwrap_or((0, None, None));
        let mut done = referred(id, product, discount, code);
        done.status = CheckoutStatus::Completed;
        let mut paid = payment(format!("txn_{id}"), done.customer_id.to_string(), amount);
        paid.discount_amount = discount_amount.min(amount);
        paid.tax_amount = tax;
        paid.amount_paid = amount - paid.discount_amount + tax + i64::from(forged);
        paid.checkout_id = Some(done.id.clone());
        done.transaction_id = Some(paid.id.clone());
        CheckoutCompletion {
            checkout: done,
            payment: paid,
            subscription: None,
        }
    }

    pub fn refund(i: usize, payment_n: u8, amount: i64) -> Payment {
        let mut refund = payment(
            format!("txn_r{i}"),
            format!("cus_{}", payment_n % 2),
            amount,
        );
        refund.payment_type = PaymentType::Refund;
        refund.status = PaymentStatus::Refunded;
        refund.refund_of = Some(format!("txn_{payment_n}").into());
        refund
    }

    pub fn dispute(i: usize, payment_n: u8) -> Dispute {
        Dispute {
            id: format!("dp_{i}").into(),
            store_id: STORE.into(),
            mode: Mode::Test,
            transaction_id: format!("txn_{payment_n}").into(),
            customer_id: format!("cus_{}", payment_n % 2).into(),
            amount: 0,
            currency: "USD".into(),
            reason: None,
            created_at_ms: T0,
        }
    }
}

fn affiliate(n: u8, code: u8) -> tally_domain::affiliate::Affiliate {
    tally_domain::affiliate::Affiliate {
        id: format!("aff_{n}").into(),
        store_id: STORE.into(),
        mode: Mode::Test,
        email: String::new(),
        name: None,
        status: tally_domain::affiliate::AffiliateStatus::Active,
        referral_code: format!("code{code}"),
        clicks: 0,
        conversions: 0,
        earnings: 0,
        currency: None,
        created_at_ms: T0,
        updated_at_ms: T0,
    }
}

fn account(n: u8, name: u8, status: AccountStatus) -> Account {
    Account {
        id: format!("ca_{n}").into(),
        store_id: STORE.into(),
        mode: Mode::Test,
        customer_id: format!("cus_{}", n % 2).into(),
        name: format!("a{name}"),
        unit_label: "credits".into(),
        status,
        created_at_ms: T0,
        updated_at_ms: T0,
        low_balance_threshold: None,
        auto_recharge: None,
    }
}

fn transaction(
    id: String,
    kind: TransactionKind,
    account: u8,
    amount: Decimal,
    entries: Vec<Entry>,
) -> Transaction {
    Transaction {
        id: id.into(),
        store_id: STORE.into(),
        mode: Mode::Test,
        kind,
        account_id: format!("ca_{account}").into(),
        amount,
        entries,
        idempotency_key: None,
        description: None,
        metadata: Default::default(),
        reverses: None,
        created_at_ms: T0,
        grant_terms: None,
    }
}

fn entry(i: usize, account: &str, amount: Decimal) -> Entry {
    Entry {
        id: format!("ce_{i}_{account}"),
        account_id: account.into(),
        amount,
        grant_id: None,
    }
}

fn meter(id: u8, name: u8, aggregation: u8) -> Meter {
    let aggregation = [
        Aggregation::Count,
        Aggregation::Sum,
        Aggregation::Min,
        Aggregation::Max,
        Aggregation::Unique,
        Aggregation::Average,
        Aggregation::Latest,
        Aggregation::TimeWeightedSum,
    ][aggregation as usize % 8];
    Meter {
        id: format!("mtr_{id}").into(),
        store_id: STORE.into(),
        mode: Mode::Test,
        name: format!("m{name}"),
        event_name: "e".into(),
        aggregation,
        aggregation_property: (aggregation != Aggregation::Count).then(|| "v".to_string()),
        filter: MeterFilter::default(),
        unit_label: "units".into(),
        status: MeterStatus::Active,
        created_at_ms: T0,
        updated_at_ms: T0,
        counts_from_ms: T0,
        revision: 1,
    }
}

/// The records of `ops`, as payloads (garbage stays garbage). Every meter id a usage
/// event names is created first, so no chunk waits for another partition.
fn payloads(ops: &[(Op, Envelope)]) -> Vec<Vec<u8>> {
    let mut records: Vec<Option<(Record, RecordMeta)>> = (0..4)
        .map(|i| {
            let meta = RecordMeta {
                recorded_at_ms: T0,
                ..Default::default()
            };
            Some((Record::MeterUpserted(meter(i, i, i)), meta))
        })
        .collect();
    let mut garbage = BTreeMap::new();
    for (i, (op, envelope)) in ops.iter().enumerate() {
        let record = match op {
            Op::Customer { id, external } => Record::CustomerUpserted(Customer {
                id: format!("cus_{id}").into(),
                store_id: STORE.into(),
                mode: Mode::Test,
                email: "f@x.io".into(),
                name: None,
                country: None,
                metadata: Default::default(),
                external_id: external.map(|e| format!("ext{e}")),
                created_at_ms: T0,
                updated_at_ms: T0,
            }),
            Op::Meter {
                id,
                name,
                aggregation,
                archived,
            } => {
                let mut meter = meter(*id, *name, *aggregation);
                if *archived {
                    meter.status = MeterStatus::Archived;
                }
                Record::MeterUpserted(meter)
            }
            Op::Product {
                id,
                meters,
                archived,
            } => Record::ProductUpserted(product(*id, meters, *archived)),
            Op::Settle {
                source,
                customer,
                meter,
                quantity,
            } => Record::UsageSettled(tally_domain::record::UsageSettlement {
                store_id: STORE.into(),
                mode: Mode::Test,
                source_partition: 0,
                source_offset: u64::from(*source),
                units: vec![tally_domain::settlement::UsageUnits {
                    customer_id: format!("cus_{customer}").into(),
                    meter_id: format!("mtr_{meter}").into(),
                    // After every purchase (records are at most 1.5 days after T0).
                    timestamp_ms: T0 + 2 * 86_400_000,
                    quantity: *quantity,
                    events: 1,
                }],
            }),
            Op::Usage {
                customer,
                event,
                value,
                as_text,
                settles,
            } => {
                let value = if *as_text {
                    PropertyValue::String(value.to_string())
                } else {
                    PropertyValue::Number(*value)
                };
                Record::UsageBatch {
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    events: vec![UsageEvent {
                        event_id: format!("ev{event}"),
                        name: "e".into(),
                        customer_id: format!("cus_{customer}").into(),
                        external_customer_id: None,
                        timestamp_ms: T0 + 1_000,
                        properties: [("v".to_string(), value)].into_iter().collect(),
                        received_at_ms: T0,
                        matched_meter_ids: (0..4).map(|m| format!("mtr_{m}").into()).collect(),
                        event_id_assigned: false,
                    }],
                    settles: *settles,
                    matched_below: None,
                }
            }
            Op::OpenAccount {
                account: n,
                name,
                initial,
            } => {
                let mut a = account(*n, *name, AccountStatus::Active);
                // Accounts 2 and 3 recharge below 50: for free, and for a price.
                if *n >= 2 {
                    a.auto_recharge = Some(tally_domain::ledger::AutoRecharge {
                        threshold: Decimal::from(50),
                        amount: Decimal::TEN,
                        price: (*n == 3).then(|| tally_domain::ledger::RechargePrice {
                            amount: 100,
                            currency: "USD".into(),
                        }),
                    });
                }
                let seed = transaction(
                    format!("ctx_{i}"),
                    TransactionKind::InitialBalance,
                    *n,
                    *initial,
                    vec![
                        entry(i, &a.id, *initial),
                        entry(i, SystemAccount::Issuance.account_id(), -*initial),
                    ],
                );
                Record::CreditLedger {
                    account: Some(a),
                    transaction: Some(seed),
                    events: vec![],
                }
            }
            Op::Move {
                account: n,
                debit,
                amount,
                key,
            } => {
                let (kind, signed, other) = if *debit {
                    (TransactionKind::Debit, -*amount, SystemAccount::Consumption)
                } else {
                    (TransactionKind::Credit, *amount, SystemAccount::Issuance)
                };
                let mut tx = transaction(
                    format!("ctx_{i}"),
                    kind,
                    *n,
                    *amount,
                    vec![
                        entry(i, &format!("ca_{n}"), signed),
                        entry(i, other.account_id(), -signed),
                    ],
                );
                tx.idempotency_key = Some(format!("k{key}"));
                Record::CreditLedger {
                    account: None,
                    transaction: Some(tx),
                    events: vec![],
                }
            }
            Op::Recharge {
                account: n,
                debit,
                paid,
            } => {
                // Mostly the latest debit of the account before it (the one a
                // pending recharge most likely waits for), else any op's id.
                let latest = ops[..i].iter().enumerate().rev().find_map(|(j, (op, _))| {
                    matches!(op, Op::Move { account, debit: true, .. } if account == n).then_some(j)
                });
                let debit = match latest {
                    Some(j) if *debit < 45 => j,
                    _ => usize::from(*debit),
                };
                billing::recharge(i, *n, debit, *paid)
            }
            Op::Reverse { tx, account: n } => {
                let mut reversal = transaction(
                    format!("ctx_{i}"),
                    TransactionKind::Reversal,
                    *n,
                    Decimal::ONE,
                    vec![
                        entry(i, &format!("ca_{n}"), -Decimal::ONE),
                        entry(i, SystemAccount::Issuance.account_id(), Decimal::ONE),
                    ],
                );
                reversal.reverses = Some(format!("ctx_{tx}").into());
                Record::CreditLedger {
                    account: None,
                    transaction: Some(reversal),
                    events: vec![],
                }
            }
            Op::Status { account: n, status } => {
                let status = [
                    AccountStatus::Active,
                    AccountStatus::Frozen,
                    AccountStatus::Closed,
                ][*status as usize % 3];
                Record::CreditLedger {
                    account: Some(account(*n, 0, status)),
                    transaction: None,
                    events: vec![],
                }
            }
            Op::Forged {
                account: n,
                amounts,
            } => {
                let names = [
                    "ca_0",
                    "ca_1",
                    "ca_2",
                    "system:issuance",
                    "system:consumption",
                    "system:forfeit",
                ];
                let entries = amounts
                    .iter()
                    .enumerate()
                    .map(|(j, (who, amount))| entry(i * 10 + j, names[*who as usize % 6], *amount))
                    .collect();
                Record::CreditLedger {
                    account: None,
                    transaction: Some(transaction(
                        format!("ctx_{i}"),
                        TransactionKind::Credit,
                        *n,
                        Decimal::ONE,
                        entries,
                    )),
                    events: vec![],
                }
            }
            Op::Backfill {
                meter,
                events,
                finish,
            } => Record::MeterBackfill {
                store_id: STORE.into(),
                mode: Mode::Test,
                meter_id: format!("mtr_{meter}").into(),
                start_ms: T0 - 3_600_000,
                event_ids: events.iter().map(|e| format!("ev{e}")).collect(),
                finish: *finish,
                rescan_from_ms: T0 - 60_000,
            },
            Op::Response {
                key,
                fingerprint,
                status,
            } => Record::IdempotentResponse(IdempotentResponse {
                request: request_key(*key, *fingerprint),
                partition_key: Vec::new(),
                status: *status,
                body: format!("{{\"answer\":{i}}}"),
            }),
            Op::Discount {
                id,
                max,
                deleted,
                expires_half_days,
            } => {
                Record::DiscountUpserted(billing::discount(*id, *max, *deleted, *expires_half_days))
            }
            Op::Checkout {
                id,
                product,
                discount,
            } => Record::CheckoutCreated(billing::checkout(*id, *product, *discount)),
            Op::Referred { id, product, code } => {
                Record::CheckoutCreated(billing::referred(*id, *product, None, Some(*code)))
            }
            Op::Invite { id, email } => {
                Record::AffiliateInviteCreated(tally_domain::affiliate::AffiliateInvite {
                    id: format!("inv_{id}").into(),
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    email: format!("a{email}@x.io"),
                    name: None,
                    status: tally_domain::affiliate::InviteStatus::Pending,
                    affiliate_id: None,
                    created_at_ms: T0,
                    updated_at_ms: T0,
                })
            }
            Op::Join {
                invite,
                affiliate,
                code,
                forged,
            } => {
                let email = ops[..i]
                    .iter()
                    .rev()
                    .find_map(|(op, _)| match op {
                        Op::Invite { id, email } if id == invite => Some(*email),
                        _ => None,
                    })
                    .unwrap_or(0);
                let mut joined = self::affiliate(*affiliate, *code);
                joined.email = format!("a{email}@x.io");
                if *forged {
                    joined.earnings = 1_000;
                }
                Record::AffiliateJoined {
                    invite_id: format!("inv_{invite}").into(),
                    affiliate: joined,
                }
            }
            Op::Suspend {
                affiliate,
                suspended,
            } => {
                let mut changed = self::affiliate(*affiliate, 0);
                if *suspended {
                    changed.status = tally_domain::affiliate::AffiliateStatus::Suspended;
                }
                Record::AffiliateUpserted(changed)
            }
            Op::Commission(percent) => Record::StoreSettingsSet {
                store_id: STORE.into(),
                mode: Mode::Test,
                settings: tally_domain::subscription::StoreSettings {
                    affiliate_commission_percent: Decimal::from(*percent),
                    ..Default::default()
                },
            },
            Op::Click(code) => Record::AffiliateClicked {
                store_id: STORE.into(),
                mode: Mode::Test,
                referral_code: format!("code{code}"),
            },
            Op::Complete {
                checkout,
                amount,
                discount_amount,
                tax,
                forged,
            } => Record::CheckoutCompleted(billing::completion(
                &ops[..i],
                *checkout,
                (*amount, *discount_amount, *tax),
                *forged,
            )),
            Op::Refund { payment, amount } => {
                Record::RefundCreated(billing::refund(i, *payment, *amount))
            }
            Op::Dispute { payment } => Record::DisputeOpened(billing::dispute(i, *payment)),
            Op::Store(n) => Record::StoreCreated(tally_domain::record::StoreRecord {
                store_id: format!("st_{n}").into(),
                name: format!("store {n}"),
                prod_key_sha256: vec![*n; 32],
                test_key_sha256: vec![n.wrapping_add(100); 32],
                created_at_ms: T0,
            }),
            Op::Key { id, revoke: false } => Record::ApiKeyCreated {
                store_id: "st_0".into(),
                key_id: format!("key_{id}"),
                mode: Mode::Test,
                key_sha256: vec![id.wrapping_add(200); 32],
                permissions: if *id == 0 {
                    vec![]
                } else {
                    vec!["customers:read".into()]
                },
                created_at_ms: T0,
            },
            Op::Void { events } => Record::EventsVoided {
                store_id: STORE.into(),
                mode: Mode::Test,
                event_ids: events.iter().map(|e| format!("ev{e}")).collect(),
                reason: "fuzz".into(),
            },
            Op::Revise {
                meter: id,
                aggregation,
                revision,
                minutes,
            } => {
                let mut revised = meter(*id, 0, *aggregation);
                revised.revision = *revision;
                revised.aggregation_property = Some("w".into());
                let first = T0.div_euclid(60_000);
                Record::MeterRevised {
                    meter: revised,
                    minutes: minutes.iter().map(|m| first + m).collect(),
                }
            }
            Op::Amend {
                event,
                replacement,
                customer,
                value,
            } => Record::EventAmended {
                store_id: STORE.into(),
                mode: Mode::Test,
                event_id: format!("ev{event}"),
                reason: "fuzz".into(),
                replacement: UsageEvent {
                    event_id: format!("ev{replacement}"),
                    name: "e".into(),
                    customer_id: format!("cus_{customer}").into(),
                    external_customer_id: None,
                    timestamp_ms: T0 + 61_000,
                    properties: [("v".to_string(), PropertyValue::Number(*value))]
                        .into_iter()
                        .collect(),
                    received_at_ms: T0 + 60_000,
                    matched_meter_ids: (0..4).map(|m| format!("mtr_{m}").into()).collect(),
                    event_id_assigned: false,
                },
                matched_below: None,
            },
            Op::Key { id, revoke: true } => Record::ApiKeyRevoked {
                store_id: "st_0".into(),
                key_id: format!("key_{id}"),
            },
            Op::Garbage(bytes) => {
                garbage.insert(records.len(), bytes.clone());
                records.push(None);
                continue;
            }
        };
        let meta = RecordMeta {
            recorded_at_ms: T0 + i64::from(envelope.half_days) * 12 * 3_600_000,
            base_updated_at_ms: envelope.base,
            request: envelope.request.map(|(k, f)| request_key(k, f)),
        };
        records.push(Some((record, meta)));
    }
    records
        .iter()
        .enumerate()
        .map(|(i, r)| match r {
            Some((record, meta)) => tally_proto::encode_record_with(record, meta),
            None => garbage[&i].clone(),
        })
        .collect()
}

fn entries(payloads: &[Vec<u8>]) -> Vec<LogEntry> {
    payloads
        .iter()
        .enumerate()
        .map(|(i, payload)| LogEntry {
            partition: 0,
            offset: i as u64,
            next_offset: i as u64 + 1,
            payload: payload.clone(),
        })
        .collect()
}

/// The chunk boundaries `cuts` make in a log of `len` entries, 0 and `len` included.
fn chunk_points(len: usize, cuts: &[usize]) -> Vec<usize> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (len + 1)).collect();
    points.extend([0, len]);
    points.sort_unstable();
    points.dedup();
    points
}

fn apply_in_chunks(
    entries: &[LogEntry],
    cuts: &[usize],
) -> Result<Arc<MemoryStore>, TestCaseError> {
    let store = Arc::new(MemoryStore::new());
    let mut state = ProjectorState::empty();
    let points = chunk_points(entries.len(), cuts);
    for window in points.windows(2) {
        let chunk = &entries[window[0]..window[1]];
        if let Err(error) = apply_chunk_in_memory(store.as_ref(), &mut state, chunk, entries) {
            return Err(TestCaseError::fail(format!("apply failed: {error}")));
        }
    }
    Ok(store)
}

/// The keys whose values differ between two projections (for failure messages).
fn differing_keys(a: &MemoryStore, b: &MemoryStore) -> Vec<String> {
    let all = |store: &MemoryStore| {
        let mut rows = BTreeMap::new();
        let _ = store.scan(
            std::ops::Bound::Unbounded,
            std::ops::Bound::Unbounded,
            false,
            &mut |k, v| {
                rows.insert(k.to_vec(), v.to_vec());
                Visit::Continue
            },
        );
        rows
    };
    let (a, b) = (all(a), all(b));
    a.keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn check_invariants(store: &MemoryStore) -> Result<(), TestCaseError> {
    let mut failure = None;
    scan_prefix(store, &[keys::OUTCOME], false, &mut |_, value| {
        if let Ok(Outcome::Rejected { code, message, .. }) = Outcome::decode(value) {
            if code == "apply_failed" {
                failure = Some(format!("apply panicked: {message}"));
            }
        }
        Visit::Continue
    })
    .unwrap();
    let mut balances = Vec::new();
    scan_prefix(store, &[keys::CREDIT_BALANCE], false, &mut |key, value| {
        let balance = codec::decode_account_totals(value).unwrap().balance;
        let customer = !String::from_utf8_lossy(key).contains("system:");
        balances.push((customer, balance));
        Visit::Continue
    })
    .unwrap();
    if let Some(failure) = failure {
        return Err(TestCaseError::fail(failure));
    }
    for (customer, balance) in &balances {
        prop_assert!(
            balance.abs() <= MAX_BALANCE,
            "balance {} out of range",
            balance
        );
        prop_assert!(
            !customer || !balance.is_sign_negative() || balance.is_zero(),
            "negative customer balance {}",
            balance
        );
    }
    prop_assert!(
        sums_to_zero(balances.iter().map(|(_, b)| *b)),
        "balances do not sum to zero: {:?}",
        balances
    );
    // Spec part 3, decided in apply whatever the order: no active product prices a
    // meter that is archived or does not exist.
    let mut products = Vec::new();
    scan_prefix(store, &[keys::PRODUCT], false, &mut |_, value| {
        products.push(codec::decode_product(value).unwrap());
        Visit::Continue
    })
    .unwrap();
    for product in products
        .iter()
        .filter(|p| p.status == ProductStatus::Active)
    {
        for price in &product.usage_prices {
            let key = keys::meter_key(STORE, Mode::Test, &price.meter_id);
            let meter = store
                .get(&key)
                .unwrap()
                .map(|v| codec::decode_meter(&v).unwrap());
            prop_assert!(
                meter
                    .as_ref()
                    .is_some_and(|m| m.status == MeterStatus::Active),
                "{} prices {} which is {:?}",
                product.id,
                price.meter_id,
                meter.map(|m| m.status)
            );
        }
    }
    check_billing(store)?;
    check_settlement(store)
}

/// Usage settlement, decided in apply whatever was written: a binding's totals add
/// up (debited within what was billed, the rest the shortfall) and a usage record
/// settled is not pending any more.
fn check_settlement(store: &MemoryStore) -> Result<(), TestCaseError> {
    let mut totals = Vec::new();
    scan_prefix(store, &[keys::SETTLEMENT_TOTALS], false, &mut |_, value| {
        totals.push(codec::decode_settlement_totals(value).unwrap());
        Visit::Continue
    })
    .unwrap();
    for t in &totals {
        prop_assert!(
            t.debited >= Decimal::ZERO && t.debited <= t.billed,
            "{:?}",
            t
        );
        prop_assert_eq!(t.shortfall, t.billed - t.debited, "{:?}", t);
        prop_assert!(t.quantity >= Decimal::ZERO, "{:?}", t);
    }
    // What the totals say was debited is what the ledger's usage debits took, less
    // what voids gave back (credits of the same metadata).
    let mut taken = Decimal::ZERO;
    scan_prefix(
        store,
        &[keys::CREDIT_TRANSACTION],
        false,
        &mut |_, value| {
            let tx = codec::decode_transaction(value).unwrap();
            if tx.metadata.contains_key("source_id") {
                match tx.kind {
                    tally_domain::ledger::TransactionKind::Credit => taken -= tx.amount,
                    _ => taken += tx.amount,
                }
            }
            Visit::Continue
        },
    )
    .unwrap();
    let debited: Decimal = totals.iter().map(|t| t.debited).sum();
    prop_assert_eq!(taken, debited);
    let mut settled = Vec::new();
    scan_prefix(store, &[keys::SETTLEMENT_DONE], false, &mut |key, _| {
        settled.push(key[1..].to_vec());
        Visit::Continue
    })
    .unwrap();
    for position in settled {
        let mut pending = vec![keys::SETTLEMENT_PENDING];
        pending.extend(position);
        prop_assert!(
            store.get(&pending).unwrap().is_none(),
            "settled, still pending"
        );
    }
    Ok(())
}

/// Billing, decided in apply whatever was written: no discount redeemed past its
/// limit, each redemption a completed checkout, no payment refunded past what was
/// paid, every refund counted on its payment, so sum(amount_paid) - sum(refunds)
/// of the transactions list is what the payments keep.
fn check_billing(store: &MemoryStore) -> Result<(), TestCaseError> {
    let mut discounts = Vec::new();
    scan_prefix(store, &[keys::DISCOUNT], false, &mut |_, value| {
        discounts.push(codec::decode_discount(value).unwrap());
        Visit::Continue
    })
    .unwrap();
    let mut checkouts = Vec::new();
    scan_prefix(store, &[keys::CHECKOUT], false, &mut |_, value| {
        checkouts.push(codec::decode_checkout(value).unwrap());
        Visit::Continue
    })
    .unwrap();
    let mut listed = Vec::new();
    scan_prefix(store, &[keys::PAYMENT_LIST], false, &mut |key, _| {
        listed.push(key.to_vec());
        Visit::Continue
    })
    .unwrap();
    let prefix = keys::ListingKey::prefix(keys::PAYMENT_LIST, STORE, Mode::Test, None);
    let payments: Vec<_> = listed
        .iter()
        .map(|key| {
            let id = keys::ListingKey::id_in(&prefix, key).unwrap();
            let bytes = store
                .get(&tally_billing::apply::payment_key(STORE, Mode::Test, id))
                .unwrap()
                .expect("a listed transaction exists");
            codec::decode_payment(&bytes).unwrap()
        })
        .collect();
    for discount in &discounts {
        let max = discount.max_redemptions.unwrap_or(u32::MAX);
        prop_assert!(
            discount.redeem_count <= max,
            "{} redeemed {} > {}",
            discount.id,
            discount.redeem_count,
            max
        );
        let completed = checkouts
            .iter()
            .filter(|c| {
                c.status == tally_domain::billing::CheckoutStatus::Completed
                    && c.discount_id.as_ref() == Some(&discount.id)
            })
            .count();
        // A discount re-created by a later upsert starts from its record's count.
        prop_assert!(discount.redeem_count as usize <= completed);
    }
    // An auto-recharge's payment is kept only with the grant it paid for, and a
    // grant names the payment that paid for it.
    let mut paid_by = Vec::new();
    let mut payers = Vec::new();
    scan_prefix(
        store,
        &[keys::CREDIT_TRANSACTION],
        false,
        &mut |_, value| {
            let tx = codec::decode_transaction(value).unwrap();
            if let Some(payment) = tx.metadata.get("payment_id") {
                paid_by.push(payment.clone());
                // Account `ca_n` is customer `cus_{n % 2}`'s: so must its payment be.
                let n: u8 = tx.account_id.trim_start_matches("ca_").parse().unwrap();
                payers.push((payment.clone(), format!("cus_{}", n % 2)));
            }
            Visit::Continue
        },
    )
    .unwrap();
    let mut recharge_payments: Vec<String> = payments
        .iter()
        .filter(|p| p.id.starts_with("txn_ar"))
        .map(|p| p.id.to_string())
        .collect();
    recharge_payments.sort();
    paid_by.sort();
    prop_assert_eq!(recharge_payments, paid_by);
    for (payment_id, customer) in &payers {
        let payment = payments
            .iter()
            .find(|p| p.id.as_str() == payment_id)
            .unwrap();
        prop_assert_eq!(payment.customer_id.as_str(), customer.as_str());
    }
    use tally_domain::billing::PaymentType;
    let (mut paid, mut refunded, mut kept) = (0i64, 0i64, 0i64);
    for payment in &payments {
        match payment.payment_type {
            PaymentType::Payment => {
                prop_assert!(
                    payment.refunded_amount >= 0 && payment.refunded_amount <= payment.amount_paid
                );
                let refunds: i64 = payments
                    .iter()
                    .filter(|r| r.refund_of.as_ref() == Some(&payment.id))
                    .map(|r| r.amount)
                    .sum();
                prop_assert_eq!(
                    refunds,
                    payment.refunded_amount,
                    "refunds of {}",
                    payment.id
                );
                paid += payment.amount_paid;
                kept += payment.amount_paid - payment.refunded_amount;
            }
            PaymentType::Refund => {
                prop_assert!(payment.amount >= 1);
                refunded += payment.amount;
            }
        }
    }
    prop_assert_eq!(paid - refunded, kept);
    let completed = checkouts
        .iter()
        .filter(|c| c.status == tally_domain::billing::CheckoutStatus::Completed)
        .count();
    let payment_count = payments
        .iter()
        .filter(|p| p.payment_type == PaymentType::Payment && p.checkout_id.is_some())
        .count();
    prop_assert_eq!(
        completed,
        payment_count,
        "one payment per completed checkout"
    );
    // Affiliates: what each earned is what its referred payments keep of their
    // commission, and each referred payment is one conversion.
    let mut affiliates = Vec::new();
    scan_prefix(store, &[keys::AFFILIATE], false, &mut |_, value| {
        affiliates.push(codec::decode_affiliate(value).unwrap());
        Visit::Continue
    })
    .unwrap();
    for affiliate in &affiliates {
        let referred: Vec<_> = payments
            .iter()
            .filter(|p| p.affiliate_id.as_ref() == Some(&affiliate.id))
            .collect();
        let kept: i64 = referred
            .iter()
            .map(|p| {
                tally_domain::affiliate::commission_kept(
                    p.affiliate_commission,
                    p.amount_paid,
                    p.refunded_amount,
                )
            })
            .sum();
        prop_assert_eq!(affiliate.earnings, kept, "{:?}", affiliate);
        prop_assert_eq!(affiliate.conversions as usize, referred.len());
        prop_assert!(affiliate.earnings >= 0);
    }
    Ok(())
}

/// Whether decimals sum to exactly zero, in i128 arithmetic of integer and
/// fractional parts (a Decimal sum of balances of very different sizes may need
/// more than 28 digits on the way, though each balance is exact).
fn sums_to_zero(values: impl Iterator<Item = Decimal>) -> bool {
    const ONE: i128 = 10_000_000_000_000_000_000_000_000_000; // 1e28
    let (mut integers, mut fractions) = (0i128, 0i128);
    for value in values {
        let whole = value.trunc();
        let fraction = value - whole;
        integers += whole.mantissa() / 10i128.pow(whole.scale());
        fractions += fraction.mantissa() * 10i128.pow(28 - fraction.scale());
    }
    fractions % ONE == 0 && integers + fractions / ONE == 0
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn apply_never_fails_and_replays_exactly(
        ops in proptest::collection::vec((op(), envelope()), 1..60),
        cuts in proptest::collection::vec(0usize..80, 0..6),
    ) {
        let entries = entries(&payloads(&ops));
        let whole = apply_in_chunks(&entries, &[])?;
        let chunked = apply_in_chunks(&entries, &cuts)?;
        prop_assert_eq!(whole.digest().unwrap(), chunked.digest().unwrap());
        check_invariants(&whole)?;
    }

    /// Priced auto-recharges: whatever the order of debits, charges (paid or
    /// declined, for the pending debit or another, repeated) and status changes,
    /// apply keeps a recharge's payment exactly with the grant it paid for, the
    /// ledger's invariants hold, and any chunking replays the same.
    #[test]
    fn priced_recharges_keep_payment_and_grant_together(
        ops in proptest::collection::vec((recharge_op(), envelope()), 1..40),
        cuts in proptest::collection::vec(0usize..50, 0..4),
    ) {
        let entries = entries(&payloads(&ops));
        let whole = apply_in_chunks(&entries, &[])?;
        let chunked = apply_in_chunks(&entries, &cuts)?;
        prop_assert_eq!(whole.digest().unwrap(), chunked.digest().unwrap());
        check_invariants(&whole)?;
    }

    /// A node of a cluster skips the records of a partition it does not own but
    /// those every node needs (`ChunkMode::Shared`), and restores them when it gains
    /// the partition: whatever the ownership changes, restore chunkings and restarts
    /// (state reloaded from the store) in between, it ends with the projection of a
    /// node that applied everything, and no skip mark left.
    #[test]
    fn skipping_and_restoring_a_partition_ends_at_the_full_projection(
        ops in proptest::collection::vec((op(), envelope()), 1..60),
        cuts in proptest::collection::vec(0usize..80, 0..8),
        owned in proptest::collection::vec(any::<bool>(), 8),
        restore_step in 1usize..8,
        restarts in proptest::collection::vec(any::<bool>(), 8),
    ) {
        let entries = entries(&payloads(&ops));
        let whole = apply_in_chunks(&entries, &[])?;
        let store = Arc::new(MemoryStore::new());
        let mut state = ProjectorState::empty();
        let points = chunk_points(entries.len(), &cuts);
        let apply = |state: &mut ProjectorState, chunk: &[LogEntry], mode| {
            apply_chunk_in_memory_as(store.as_ref(), state, chunk, mode, &entries)
                .map(|_| ())
                .map_err(|e| TestCaseError::fail(format!("apply failed: {e}")))
        };
        let mut skipped = false;
        // The runtime's order: a partition gained is restored before anything new.
        let restore = |state: &mut ProjectorState, until: usize| -> Result<(), TestCaseError> {
            while let Some(from) = tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap() {
                let from = from as usize;
                prop_assert!(from < until, "the skip mark {} is not below the watermark {}", from, until);
                let end = (from + restore_step).min(until);
                apply(state, &entries[from..end], ChunkMode::Restore { partition: 0, until: until as u64 })?;
            }
            Ok(())
        };
        for (turn, window) in points.windows(2).enumerate() {
            let owns = owned[turn % owned.len()] || turn + 2 == points.len();
            if owns {
                restore(&mut state, window[0])?;
            }
            let mode = if owns { ChunkMode::Full } else { ChunkMode::Shared };
            skipped |= !owns;
            apply(&mut state, &entries[window[0]..window[1]], mode)?;
            if restarts[turn % restarts.len()] {
                state = ProjectorState::load(store.as_ref(), Arc::new(Default::default()))
                    .map_err(|e| TestCaseError::fail(format!("reload failed: {e}")))?;
            }
        }
        prop_assert_eq!(tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap(), None);
        prop_assert_eq!(whole.digest().unwrap(), store.digest().unwrap(), "skipped: {}; differing keys: {:?}", skipped, differing_keys(&whole, &store));
    }

    /// The same, where a gained partition is first restored from a snapshot: the
    /// rows of a node that applied the log in full up to a position between the
    /// skip mark and the watermark (what a split cluster's changelog holds), then
    /// from the log after it. Whatever stale rows the node held of the partition
    /// give way, and it ends with the full projection.
    #[test]
    fn restoring_from_a_snapshot_then_the_log_ends_at_the_full_projection(
        ops in proptest::collection::vec((op(), envelope()), 1..60),
        cuts in proptest::collection::vec(0usize..80, 0..8),
        owned in proptest::collection::vec(any::<bool>(), 8),
        restore_step in 1usize..8,
        snapshot_at in proptest::collection::vec(any::<proptest::sample::Index>(), 8),
    ) {
        // The store first, with the API key the requests claim keys under: a claim
        // belongs to its key's store's partition.
        let store_record = Record::StoreCreated(tally_domain::record::StoreRecord {
            store_id: STORE.into(),
            name: "fuzz".into(),
            prod_key_sha256: vec![2; 32],
            test_key_sha256: vec![1; 32],
            created_at_ms: T0,
        });
        let mut all = vec![tally_proto::encode_record_with(&store_record, &RecordMeta::default())];
        all.extend(payloads(&ops));
        let entries = entries(&all);
        let whole = apply_in_chunks(&entries, &[])?;
        let store = Arc::new(MemoryStore::new());
        let mut state = ProjectorState::empty();
        let points = chunk_points(entries.len(), &cuts);
        let apply = |state: &mut ProjectorState, chunk: &[LogEntry], mode| {
            apply_chunk_in_memory_as(store.as_ref(), state, chunk, mode, &entries)
                .map(|_| ())
                .map_err(|e| TestCaseError::fail(format!("apply failed: {e}")))
        };
        let mut from_snapshot = 0;
        for (turn, window) in points.windows(2).enumerate() {
            let owns = owned[turn % owned.len()] || turn + 2 == points.len();
            let until = window[0];
            if owns {
                if let Some(from) = tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap() {
                    let from = from as usize;
                    // A full node's rows of the partition at a position in (from, until].
                    let at = from + 1 + snapshot_at[turn % snapshot_at.len()].index(until - from);
                    let full = apply_in_chunks(&entries[..at], &[])?;
                    let rows = tally_core::changelog_store::rows_of_partitions(
                        full.as_ref(), 1, &std::collections::BTreeSet::from([0]),
                    ).unwrap().remove(&0).unwrap_or_default();
                    let snapshot = tally_log::changelog::PartitionSnapshot {
                        position: at as u64,
                        rows: rows.into_iter().collect(),
                    };
                    tally_engine::restore::restore_partition(store.as_ref(), &mut state, 1, 0, snapshot)
                        .map_err(|e| TestCaseError::fail(format!("restore failed: {e}")))?;
                    from_snapshot += 1;
                    prop_assert_eq!(
                        tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap(),
                        Some(at as u64)
                    );
                }
                while let Some(from) = tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap() {
                    let from = from as usize;
                    let end = (from + restore_step).min(until);
                    apply(&mut state, &entries[from..end], ChunkMode::Restore { partition: 0, until: until as u64 })?;
                }
            }
            let mode = if owns { ChunkMode::Full } else { ChunkMode::Shared };
            apply(&mut state, &entries[window[0]..window[1]], mode)?;
        }
        prop_assert_eq!(tally_engine::projector::skipped_from(store.as_ref(), 0).unwrap(), None);
        prop_assert_eq!(whole.digest().unwrap(), store.digest().unwrap(), "restored from a snapshot {} times; differing keys: {:?}", from_snapshot, differing_keys(&whole, &store));
    }

    /// Billing alone, where every kind of record often meets the others: any
    /// sequence of discounts, checkouts, completions (concurrent ones are repeats
    /// here), refunds and disputes, in any chunking, keeps the billing invariants.
    #[test]
    fn billing_never_redeems_or_refunds_past_its_limits(
        ops in proptest::collection::vec((billing_op(), envelope()), 1..80),
        cuts in proptest::collection::vec(0usize..90, 0..6),
    ) {
        let mut all: Vec<(Op, Envelope)> = [vec![1, 3], vec![0, 1], vec![]]
            .into_iter()
            .zip(0..)
            .map(|(meters, id)| {
                let op = Op::Product { id, meters, archived: false };
                (op, Envelope { base: None, request: None, half_days: 0 })
            })
            .collect();
        all.extend(ops);
        let entries = entries(&payloads(&all));
        let whole = apply_in_chunks(&entries, &[])?;
        let chunked = apply_in_chunks(&entries, &cuts)?;
        prop_assert_eq!(whole.digest().unwrap(), chunked.digest().unwrap());
        check_invariants(&whole)?;
    }
}

/// Logs of earlier builds partitioned usage by customer, settlements (and bindings and the ledger) by
/// store: whatever order a replay interleaves the two partitions in, even a
/// settlement before the usage record it settles, the projection is the same, and
/// the credits billed are the reference's: the period's units above the free
/// allowance, at the unit price (ARCHITECTURE.md, "Usage settlement").
mod interleaving {
    use super::*;

    fn meta() -> RecordMeta {
        RecordMeta {
            recorded_at_ms: T0,
            ..Default::default()
        }
    }

    fn usage(k: usize, value: i64) -> Record {
        Record::UsageBatch {
            store_id: STORE.into(),
            mode: Mode::Test,
            events: vec![UsageEvent {
                event_id: format!("ev{k}"),
                name: "e".into(),
                customer_id: "cus_0".into(),
                external_customer_id: None,
                timestamp_ms: T0 + 1_000,
                properties: [("v".to_string(), PropertyValue::Number(Decimal::from(value)))]
                    .into_iter()
                    .collect(),
                received_at_ms: T0,
                matched_meter_ids: (0..4).map(|m| format!("mtr_{m}").into()).collect(),
                event_id_assigned: false,
            }],
            settles: true,
            matched_below: None,
        }
    }

    /// What the usage record at (1, `k`) leaves pending: its sum meter's units.
    fn settlement(k: usize, value: i64) -> Record {
        Record::UsageSettled(tally_domain::record::UsageSettlement {
            store_id: STORE.into(),
            mode: Mode::Test,
            source_partition: 1,
            source_offset: k as u64,
            units: vec![tally_domain::settlement::UsageUnits {
                customer_id: "cus_0".into(),
                meter_id: "mtr_1".into(),
                timestamp_ms: T0 + 1_000,
                quantity: Decimal::from(value),
                events: 1,
            }],
        })
    }

    fn entry(partition: u32, offset: usize, record: &Record) -> LogEntry {
        LogEntry {
            partition,
            offset: offset as u64,
            next_offset: offset as u64 + 1,
            payload: tally_proto::encode_record_with(record, &meta()),
        }
    }

    /// Applies partition 0's records and partition 1's, each in its order,
    /// interleaved as `pattern` says (true: take partition 1's next), one chunk each.
    fn apply_interleaved(
        p0: &[LogEntry],
        p1: &[LogEntry],
        setup: usize,
        pattern: &[bool],
    ) -> Result<Arc<MemoryStore>, TestCaseError> {
        let log: Vec<LogEntry> = p0.iter().chain(p1).cloned().collect();
        let store = Arc::new(MemoryStore::new());
        let mut state = ProjectorState::empty();
        let (mut i0, mut i1) = (0, 0);
        let mut turns = pattern.iter().copied().chain(std::iter::repeat(false));
        while i0 < p0.len() || i1 < p1.len() {
            // The setup (meters, purchase, account) first: usage waits for its meters.
            let take_p1 =
                i0 >= setup && i1 < p1.len() && (i0 >= p0.len() || turns.next() == Some(true));
            let next = if take_p1 {
                i1 += 1;
                &p1[i1 - 1]
            } else {
                i0 += 1;
                &p0[i0 - 1]
            };
            apply_chunk_in_memory(store.as_ref(), &mut state, std::slice::from_ref(next), &log)
                .map_err(|e| TestCaseError::fail(format!("apply failed: {e}")))?;
        }
        Ok(store)
    }

    /// Meters 0-3, a product pricing meter 1's usage, and its checkout completed:
    /// customer 0's usage of meter 1 is bound from then on.
    fn purchase() -> Vec<Record> {
        let checkout = Op::Checkout {
            id: 0,
            product: 0,
            discount: None,
        };
        let envelope = Envelope {
            base: None,
            request: None,
            half_days: 0,
        };
        let mut records: Vec<Record> = (0..4)
            .map(|i| Record::MeterUpserted(meter(i, i, i)))
            .collect();
        records.push(Record::ProductUpserted(product(0, &[1], false)));
        records.push(Record::CheckoutCreated(billing::checkout(0, 0, None)));
        records.push(Record::CheckoutCompleted(billing::completion(
            &[(checkout, envelope)],
            0,
            (0, 0, 0),
            false,
        )));
        records
    }

    /// A usage record whose gateway had not applied the purchase before it (a
    /// checkout completed through another node moments before) still leaves its
    /// units for settlement: apply asks the bindings itself. A record of an
    /// earlier build (no `matched_below`) keeps the gateway's answer, and a
    /// gateway's yes stands.
    #[test]
    fn a_purchase_the_gateway_did_not_know_still_settles_its_usage() {
        for (gateway_says, matched_below, pending_expected) in
            [(false, Some(0), 1), (false, None, 0), (true, None, 1)]
        {
            let mut records = purchase();
            let mut record = usage(0, 5);
            if let Record::UsageBatch {
                settles,
                matched_below: below,
                ..
            } = &mut record
            {
                *settles = gateway_says;
                *below = matched_below;
            }
            records.push(record);
            let log: Vec<LogEntry> = records
                .iter()
                .enumerate()
                .map(|(i, r)| entry(0, i, r))
                .collect();
            let store = MemoryStore::new();
            apply_chunk_in_memory(&store, &mut ProjectorState::empty(), &log, &log).unwrap();
            let mut pending = 0;
            scan_prefix(&store, &[keys::SETTLEMENT_PENDING], false, &mut |_, _| {
                pending += 1;
                Visit::Continue
            })
            .unwrap();
            assert_eq!(
                pending, pending_expected,
                "gateway says {gateway_says}, matched below {matched_below:?}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
        #[test]
        fn settlement_does_not_depend_on_how_partitions_interleave(
            values in proptest::collection::vec(1i64..20, 1..12),
            initial in 0i64..200,
            repeats in proptest::collection::vec(0usize..12, 0..4),
            a in proptest::collection::vec(any::<bool>(), 0..40),
            b in proptest::collection::vec(any::<bool>(), 0..40),
        ) {
            let mut p0_records = purchase();
            let seed = transaction(
                "ctx_seed".into(),
                TransactionKind::InitialBalance,
                0,
                Decimal::from(initial),
                vec![
                    super::entry(0, "ca_0", Decimal::from(initial)),
                    super::entry(0, SystemAccount::Issuance.account_id(), -Decimal::from(initial)),
                ],
            );
            if initial > 0 {
                p0_records.push(Record::CreditLedger {
                    account: Some(account(0, 0, AccountStatus::Active)),
                    transaction: Some(seed),
                    events: vec![],
                });
            }
            let setup = p0_records.len();
            // Each usage record settled once, some twice (another settler's repeat).
            for (k, value) in values.iter().enumerate() {
                p0_records.push(settlement(k, *value));
            }
            for k in repeats.iter().filter(|k| **k < values.len()) {
                p0_records.push(settlement(*k, values[*k]));
            }
            let p0: Vec<LogEntry> = p0_records.iter().enumerate().map(|(i, r)| entry(0, i, r)).collect();
            let p1: Vec<LogEntry> = values.iter().enumerate().map(|(k, v)| entry(1, k, &usage(k, *v))).collect();

            let first = apply_interleaved(&p0, &p1, setup, &a)?;
            let second = apply_interleaved(&p0, &p1, setup, &b)?;
            prop_assert_eq!(first.digest().unwrap(), second.digest().unwrap());
            check_invariants(&first)?;

            // The reference: one period, free allowance 1 (meter 1), 0.5 a unit.
            let mut totals = Vec::new();
            scan_prefix(first.as_ref(), &[keys::SETTLEMENT_TOTALS], false, &mut |_, value| {
                totals.push(codec::decode_settlement_totals(value).unwrap());
                Visit::Continue
            }).unwrap();
            prop_assert_eq!(totals.len(), 1);
            let total: i64 = values.iter().sum();
            let billed = Decimal::from((total - 1).max(0)) * Decimal::new(5, 1);
            prop_assert_eq!(totals[0].quantity, Decimal::from(total));
            prop_assert_eq!(totals[0].billed, billed);
            let expected_debit = if initial > 0 { billed.min(Decimal::from(initial)) } else { Decimal::ZERO };
            prop_assert_eq!(totals[0].debited, expected_debit);
            // Nothing is left pending.
            let mut pending = 0;
            scan_prefix(first.as_ref(), &[keys::SETTLEMENT_PENDING], false, &mut |_, _| {
                pending += 1;
                Visit::Continue
            }).unwrap();
            prop_assert_eq!(pending, 0);
        }
    }
}
