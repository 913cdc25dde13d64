//! Usage settled in credits (docs/api.md, "Usage prices"): a purchase binds the
//! customer's usage of a meter to one of their credit accounts, and the usage is
//! debited from that account as it is projected, exactly once per event, never
//! below zero.
//!
//! The rules here are pure: which events a binding charges (from the purchase on,
//! after a free trial), the period an event falls in (calendar periods counted from
//! the purchase), and how much of a period's usage is billable (above
//! `free_allowance`, up to `cap`). `billable` is additive over any split of a
//! period's usage, so settling usage in any batches charges the same total as
//! settling it at once (the property test below).

use rust_decimal::{Decimal, RoundingStrategy};

use crate::exact::exact_add;
use crate::ids::{CustomerId, MeterId};
use crate::ledger::MAX_AMOUNT_SCALE;
use crate::product::{BillingPeriod, Product, SettlementMode, TrialUsageMode, UsagePrice};

/// A customer's usage of one meter, bound by a purchase to one of their credit
/// accounts: what usage apply charges as events arrive.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageBinding {
    /// The subscription (recurring product) or checkout (one-time product) that
    /// bought the price: its settlement totals are kept under this id.
    pub source_id: String,
    pub price_id: String,
    pub meter_id: MeterId,
    /// Credits per meter unit.
    pub unit_price: Decimal,
    pub free_allowance: Decimal,
    pub cap: Option<Decimal>,
    pub account_name: String,
    /// Periods are counted from here (the purchase).
    pub anchor_ms: i64,
    /// Calendar months per period; `None`: one period that never ends.
    pub period_months: Option<u32>,
    /// Events before this instant are not charged (the purchase, or the end of a
    /// trial whose usage is free).
    pub charge_from_ms: i64,
    /// Events at or after this instant are not charged (a subscription that ended).
    pub charge_until_ms: Option<i64>,
}

impl UsageBinding {
    /// The bindings a purchase makes: one per `credits` usage price of `product`,
    /// charging events from `from_ms` (after a free trial ending at `trial_end_ms`),
    /// in periods counted from `anchor_ms`.
    pub fn for_purchase(
        source_id: &str,
        product: &Product,
        anchor_ms: i64,
        from_ms: i64,
        trial_end_ms: Option<i64>,
    ) -> Vec<UsageBinding> {
        product
            .usage_prices
            .iter()
            .filter(|price| price.settlement_mode == SettlementMode::Credits)
            .map(|price| binding(source_id, product, price, anchor_ms, from_ms, trial_end_ms))
            .collect()
    }

    /// Whether an event at `timestamp_ms` is charged.
    pub fn charges_at(&self, timestamp_ms: i64) -> bool {
        timestamp_ms >= self.charge_from_ms && self.charge_until_ms.is_none_or(|u| timestamp_ms < u)
    }

    /// The start of the period an event at `timestamp_ms` (charged, so not before
    /// the anchor) falls in.
    pub fn period_start(&self, timestamp_ms: i64) -> i64 {
        match self.period_months {
            None => self.anchor_ms,
            Some(months) => period_start(self.anchor_ms, months, timestamp_ms),
        }
    }
}

fn binding(
    source_id: &str,
    product: &Product,
    price: &UsagePrice,
    anchor_ms: i64,
    from_ms: i64,
    trial_end_ms: Option<i64>,
) -> UsageBinding {
    let free_trial = price.trial_usage_mode == TrialUsageMode::Free;
    UsageBinding {
        source_id: source_id.to_string(),
        price_id: price.id.clone(),
        meter_id: price.meter_id.clone(),
        unit_price: price.unit_price,
        free_allowance: price.free_allowance,
        cap: price.cap,
        account_name: price.target_account_name.clone(),
        anchor_ms,
        period_months: period_months(product.billing_period),
        charge_from_ms: match trial_end_ms {
            Some(end) if free_trial => end.max(from_ms),
            _ => from_ms,
        },
        charge_until_ms: None,
    }
}

/// Calendar months per period; `None` for a one-time purchase.
pub fn period_months(period: BillingPeriod) -> Option<u32> {
    match period {
        BillingPeriod::EveryMonth => Some(1),
        BillingPeriod::EveryThreeMonths => Some(3),
        BillingPeriod::EverySixMonths => Some(6),
        BillingPeriod::EveryYear => Some(12),
        BillingPeriod::Once => None,
    }
}

/// The start of the period containing `at_ms`, periods being `months` calendar
/// months long counted from `anchor_ms` (each start is the anchor plus a whole
/// number of periods, so a 31st anchor does not drift to the 28th). `at_ms` before
/// the anchor falls in the first period.
pub fn period_start(anchor_ms: i64, months: u32, at_ms: i64) -> i64 {
    use chrono::{Datelike, Months, TimeZone, Utc};
    let (Some(anchor), Some(at)) = (
        Utc.timestamp_millis_opt(anchor_ms).single(),
        Utc.timestamp_millis_opt(at_ms).single(),
    ) else {
        return anchor_ms;
    };
    if at_ms <= anchor_ms || months == 0 {
        return anchor_ms;
    }
    let elapsed = (at.year() - anchor.year()) * 12 + at.month() as i32 - anchor.month() as i32;
    // The estimate is at most one period late; step back while it starts after `at`.
    let mut periods = (elapsed.max(0) as u32) / months;
    loop {
        let start = anchor
            .checked_add_months(Months::new(periods * months))
            .map(|t| t.timestamp_millis());
        match start {
            Some(start) if start <= at_ms => return start,
            _ if periods == 0 => return anchor_ms,
            _ => periods -= 1,
        }
    }
}

/// The period of `months` calendar months counted from `anchor_ms` that contains
/// `at_ms` (the first, for an instant before the anchor): `(start, end)`.
pub fn period_bounds(anchor_ms: i64, months: u32, at_ms: i64) -> (i64, i64) {
    use chrono::{Months, TimeZone, Utc};
    if months == 0 {
        return (anchor_ms, i64::MAX);
    }
    let start = period_start(anchor_ms, months, at_ms);
    let Some(anchor) = Utc.timestamp_millis_opt(anchor_ms).single() else {
        return (start, start);
    };
    // The first period start after `start`, counted from the anchor (no drift).
    let mut k = 1u32;
    loop {
        match anchor.checked_add_months(Months::new(k.saturating_mul(months))) {
            Some(t) if t.timestamp_millis() > start => return (start, t.timestamp_millis()),
            Some(_) => k = k.saturating_add(1),
            None => return (start, i64::MAX),
        }
    }
}

/// The billable part of `quantity` more units in a period that had used
/// `used_before`: the units above `free_allowance` and up to `cap`. Additive: the
/// billable parts of a split sum to the billable part of the whole. A negative
/// `quantity` (a void's) gives a negative part; a period never uses fewer than no
/// units. `None` past the exact range (a forged record's numbers).
pub fn billable(
    used_before: Decimal,
    quantity: Decimal,
    free_allowance: Decimal,
    cap: Option<Decimal>,
) -> Option<Decimal> {
    let billed = |used: Decimal| {
        let used = used.max(Decimal::ZERO);
        let capped = cap.map_or(used, |cap| used.min(cap));
        Some(capped.checked_sub(free_allowance)?.max(Decimal::ZERO))
    };
    let after = exact_add(used_before, quantity)?;
    billed(after)?.checked_sub(billed(used_before)?)
}

/// Credits for `units` billable units at `unit_price`, rounded up to the ledger's
/// scale (a fraction of the smallest amount the ledger holds is charged, never
/// given away). `None` past the exact range.
pub fn credits_for(units: Decimal, unit_price: Decimal) -> Option<Decimal> {
    let amount = units.checked_mul(unit_price)?;
    Some(
        amount
            .round_dp_with_strategy(MAX_AMOUNT_SCALE, RoundingStrategy::AwayFromZero)
            .normalize(),
    )
}

/// Meter units a usage record's new events added, as its settlement carries them:
/// one customer, one meter, one instant (events of one millisecond add up). The
/// settlement decides in the store's log order which purchases they charge.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageUnits {
    pub customer_id: CustomerId,
    pub meter_id: MeterId,
    pub timestamp_ms: i64,
    pub quantity: Decimal,
    pub events: u32,
}

/// What a settlement charges one binding in one period: the units of its record
/// that fall under the binding, added up.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageCharge {
    pub customer_id: CustomerId,
    pub source_id: String,
    pub price_id: String,
    pub meter_id: MeterId,
    pub account_name: String,
    pub unit_price: Decimal,
    pub free_allowance: Decimal,
    pub cap: Option<Decimal>,
    pub period_start_ms: i64,
    pub quantity: Decimal,
}

impl UsageCharge {
    /// The charges `units` make under `bindings` (the customer's bindings of the
    /// units' meter), one per binding and period, in a fixed order.
    pub fn of(units: &[(&UsageUnits, &[UsageBinding])]) -> Vec<UsageCharge> {
        let mut charges: std::collections::BTreeMap<(String, String, String, i64), UsageCharge> =
            std::collections::BTreeMap::new();
        // Positive units charge; negative ones are a void's, taken back (a record's
        // charges net out per binding and period).
        for (unit, bindings) in units.iter().filter(|(u, _)| !u.quantity.is_zero()) {
            for binding in bindings.iter().filter(|b| b.charges_at(unit.timestamp_ms)) {
                let period_start_ms = binding.period_start(unit.timestamp_ms);
                let charge = charges
                    .entry((
                        unit.customer_id.to_string(),
                        binding.source_id.clone(),
                        binding.price_id.clone(),
                        period_start_ms,
                    ))
                    .or_insert_with(|| UsageCharge {
                        customer_id: unit.customer_id.clone(),
                        source_id: binding.source_id.clone(),
                        price_id: binding.price_id.clone(),
                        meter_id: binding.meter_id.clone(),
                        account_name: binding.account_name.clone(),
                        unit_price: binding.unit_price,
                        free_allowance: binding.free_allowance,
                        cap: binding.cap,
                        period_start_ms,
                        quantity: Decimal::ZERO,
                    });
                // Inputs are bounded (limits::MAX_PROPERTY_NUMBER_ABS); past the
                // exact range the charge stops growing rather than rounding.
                if let Some(sum) = exact_add(charge.quantity, unit.quantity) {
                    charge.quantity = sum;
                }
            }
        }
        charges
            .into_values()
            .filter(|c| !c.quantity.is_zero())
            .collect()
    }
}

/// One period of a binding as settlement keeps it: the meter units it used and, for
/// periods settled by builds that keep them, the credits its usage was billed and
/// what was debited of them (a void's take-back forgives that period's shortfall
/// first, not another period's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeriodSettlement {
    pub used: Decimal,
    /// (billed, debited); `None` for a period an earlier build settled.
    pub paid: Option<(Decimal, Decimal)>,
}

impl PeriodSettlement {
    /// A period nothing was charged in yet.
    pub fn new() -> Self {
        PeriodSettlement {
            used: Decimal::ZERO,
            paid: Some((Decimal::ZERO, Decimal::ZERO)),
        }
    }

    /// The period's billed, debited and shortfall as totals, when it keeps them.
    pub fn totals(&self) -> Option<SettlementTotals> {
        self.paid.map(|(billed, debited)| SettlementTotals {
            billed,
            debited,
            shortfall: billed.checked_sub(debited).unwrap_or(Decimal::ZERO),
            ..SettlementTotals::default()
        })
    }
}

/// What taking back `credits` of a binding's billed usage does (a voided event's):
/// what the account lacked (the shortfall) is forgiven first, then what was debited
/// comes back, never more than was debited. Answers (forgiven, to give back).
pub fn take_back(totals: &SettlementTotals, credits: Decimal) -> (Decimal, Decimal) {
    let credits = credits.max(Decimal::ZERO);
    let forgiven = credits.min(totals.shortfall.max(Decimal::ZERO));
    // Both are at most `credits`, which the ledger's limits bound: no overflow.
    let back = (credits - forgiven).min(totals.debited.max(Decimal::ZERO));
    (forgiven, back)
}

/// A binding's settlement so far, as `GET /v1/subscriptions/{id}` shows it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettlementTotals {
    pub meter_id: String,
    pub account_name: String,
    /// Meter units charged to the binding (free ones included).
    pub quantity: Decimal,
    /// Credits the billable units came to.
    pub billed: Decimal,
    /// Credits taken from the account.
    pub debited: Decimal,
    /// Credits the account lacked (billed - debited).
    pub shortfall: Decimal,
}

#[cfg(test)]
mod take_back_tests {
    use super::*;
    use proptest::prelude::*;

    fn totals(billed: i64, debited: i64) -> SettlementTotals {
        SettlementTotals {
            billed: Decimal::from(billed),
            debited: Decimal::from(debited),
            shortfall: Decimal::from(billed - debited),
            ..SettlementTotals::default()
        }
    }

    #[test]
    fn a_take_back_forgives_the_shortfall_first_and_never_returns_more_than_was_debited() {
        let d = Decimal::from;
        // Paid in full: all of it comes back.
        assert_eq!(take_back(&totals(10, 10), d(3)), (d(0), d(3)));
        // 4 never taken: forgiven first, the rest comes back.
        assert_eq!(take_back(&totals(10, 6), d(3)), (d(3), d(0)));
        assert_eq!(take_back(&totals(10, 6), d(5)), (d(4), d(1)));
        // More than was billed (a forged record): at most what was debited.
        assert_eq!(take_back(&totals(10, 6), d(50)), (d(4), d(6)));
        assert_eq!(take_back(&totals(0, 0), d(2)), (d(0), d(0)));
        assert_eq!(take_back(&totals(10, 10), d(-2)), (d(0), d(0)));
    }

    /// One period's settlement as `apply_usage_settled` folds it: each usage adds
    /// its billable units' credits (the account giving what it has), each void takes
    /// its own back (`take_back`, the account getting back what was given).
    #[derive(Default)]
    struct Period {
        used: Decimal,
        totals: SettlementTotals,
        balance: Decimal,
    }

    impl Period {
        fn step(&mut self, quantity: Decimal, allowance: Decimal, cap: Option<Decimal>) {
            let units = billable(self.used, quantity, allowance, cap).unwrap();
            self.used += quantity;
            let credits = credits_for(units.abs(), Decimal::from(3)).unwrap();
            let (billed, debited) = if quantity < Decimal::ZERO {
                let (forgiven, back) = take_back(&self.totals, credits);
                self.balance += back;
                (-(forgiven + back), -back)
            } else {
                let taken = credits.min(self.balance);
                self.balance -= taken;
                (credits, taken)
            };
            self.totals.quantity += quantity;
            self.totals.billed += billed;
            self.totals.debited += debited;
            self.totals.shortfall += billed - debited;
        }
    }

    proptest! {
        /// Whatever usage arrives and whichever of it is voided, in any order, the
        /// period ends billed exactly what its remaining usage costs, no credit is
        /// given back that was not taken, and the account ends where charging only
        /// the remaining usage would have left it when it never ran short.
        #[test]
        fn take_backs_leave_the_period_billed_for_what_remains(
            usage in proptest::collection::vec((1u32..50, any::<bool>()), 0..30),
            allowance in 0u32..100,
            cap in proptest::option::of(0u32..600),
            balance in 0u32..2000,
            voided_first in any::<bool>(),
        ) {
            let (allowance, cap) = (Decimal::from(allowance), cap.map(Decimal::from));
            let start = Decimal::from(balance);
            let mut period = Period { balance: start, ..Period::default() };
            for (quantity, _) in &usage {
                period.step(Decimal::from(*quantity), allowance, cap);
            }
            let mut voids: Vec<u32> = usage.iter().filter(|(_, v)| *v).map(|(q, _)| *q).collect();
            if voided_first {
                voids.reverse();
            }
            for quantity in voids {
                period.step(-Decimal::from(quantity), allowance, cap);
            }
            let remaining: u32 = usage.iter().filter(|(_, v)| !*v).map(|(q, _)| *q).sum();
            let owed = credits_for(
                billable(Decimal::ZERO, Decimal::from(remaining), allowance, cap).unwrap(),
                Decimal::from(3),
            )
            .unwrap();
            prop_assert_eq!(period.used, Decimal::from(remaining));
            prop_assert_eq!(period.totals.billed, owed);
            prop_assert_eq!(period.totals.shortfall, period.totals.billed - period.totals.debited);
            prop_assert!(period.totals.debited >= Decimal::ZERO);
            prop_assert!(period.totals.shortfall >= Decimal::ZERO);
            prop_assert_eq!(period.balance, start - period.totals.debited);
            if period.totals.shortfall.is_zero() {
                prop_assert_eq!(period.balance, start - owed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(text: &str) -> i64 {
        crate::time::parse_iso8601_ms(text).unwrap()
    }

    #[test]
    fn periods_are_counted_from_the_anchor_without_drifting() {
        let anchor = ms("2026-01-31T10:00:00Z");
        assert_eq!(period_start(anchor, 1, anchor), anchor);
        assert_eq!(period_start(anchor, 1, ms("2026-02-15T00:00:00Z")), anchor);
        assert_eq!(
            period_start(anchor, 1, ms("2026-03-01T00:00:00Z")),
            ms("2026-02-28T10:00:00Z")
        );
        // Counted from the anchor: March's period starts on the 31st again.
        assert_eq!(
            period_start(anchor, 1, ms("2026-04-05T00:00:00Z")),
            ms("2026-03-31T10:00:00Z")
        );
        assert_eq!(period_start(anchor, 12, ms("2027-01-31T09:59:59Z")), anchor);
        assert_eq!(
            period_start(anchor, 12, ms("2027-01-31T10:00:00Z")),
            ms("2027-01-31T10:00:00Z")
        );
        assert_eq!(period_start(anchor, 3, anchor - 1), anchor);
    }

    #[test]
    fn billable_counts_above_the_allowance_and_up_to_the_cap() {
        let d = |n: i64| Decimal::from(n);
        assert_eq!(billable(d(0), d(5), d(3), None), Some(d(2)));
        assert_eq!(billable(d(5), d(5), d(3), Some(d(8))), Some(d(3)));
        assert_eq!(billable(d(8), d(5), d(3), Some(d(8))), Some(d(0)));
        assert_eq!(billable(d(0), d(2), d(3), None), Some(d(0)));
    }

    #[test]
    fn credits_round_up_at_the_ledger_scale() {
        let price = Decimal::new(1, 18); // 1e-18
        let third = Decimal::ONE / Decimal::from(3);
        assert_eq!(credits_for(third, price), Some(Decimal::new(1, 18)));
        assert_eq!(
            credits_for(Decimal::from(4), Decimal::new(25, 2)),
            Some(Decimal::ONE)
        );
    }

    proptest! {
        /// Settling a period's usage in any split bills what settling it at once does.
        #[test]
        fn billable_is_additive_over_any_split(
            parts in proptest::collection::vec(0u32..1000, 0..20),
            free in 0u32..3000,
            cap in proptest::option::of(0u32..6000),
        ) {
            let free = Decimal::from(free);
            let cap = cap.map(|c| Decimal::from(c).max(free));
            let mut used = Decimal::ZERO;
            let mut total = Decimal::ZERO;
            for part in &parts {
                let part = Decimal::from(*part);
                total += billable(used, part, free, cap).unwrap();
                used += part;
            }
            prop_assert_eq!(total, billable(Decimal::ZERO, used, free, cap).unwrap());
            prop_assert!(total >= Decimal::ZERO);
        }

        /// Against a reference that walks the periods one by one from the anchor.
        #[test]
        fn an_instant_falls_in_the_last_period_starting_at_or_before_it(
            anchor in 0i64..4_000_000_000_000,
            after in 0i64..200_000_000_000,
            months in prop_oneof![Just(1u32), Just(3), Just(6), Just(12)],
        ) {
            use chrono::{Months, TimeZone, Utc};
            let at = anchor + after;
            let base = Utc.timestamp_millis_opt(anchor).single().unwrap();
            let mut expected = anchor;
            for k in 1.. {
                let start = base.checked_add_months(Months::new(k * months)).unwrap().timestamp_millis();
                if start > at {
                    break;
                }
                expected = start;
            }
            prop_assert_eq!(period_start(anchor, months, at), expected);
        }
    }
}
