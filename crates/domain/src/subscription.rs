//! A subscription's life after its checkout (docs/api.md, "Subscriptions"): what is
//! due when (trial end, renewal, payment retry, the end of a period with a scheduled
//! cancel), what a renewal charges (the base price for the period ahead, `invoice`
//! usage of the period behind, each a line), and every transition between the
//! statuses of the API, as pure functions of the subscription and the time.
//!
//! Periods are calendar periods counted from the subscription's billing anchor (the
//! start of its first paid period), so a subscription started on the 31st renews on
//! the last day of shorter months and on the 31st again after them.

use rust_decimal::{Decimal, RoundingStrategy};

use crate::billing::{DiscountType, EmbeddedDiscount, Subscription, SubscriptionStatus};
use crate::error::FieldError;
use crate::ids::MeterId;
use crate::product::{SettlementMode, TrialUsageMode, UsagePrice};
use crate::settlement::period_months;
use crate::time::DAY_MS;

wire_enum!(
    /// What a scheduled cancel does at the end of the period.
    OnExecute { Cancel => "cancel", Pause => "pause" }
);
wire_enum!(
    /// `immediate` ends the subscription now; `scheduled` at the end of its period.
    CancelMode { Immediate => "immediate", Scheduled => "scheduled" }
);

/// Payment retries after a declined renewal, in days after it: then the
/// subscription is `unpaid` (docs/api.md, "Subscriptions"; dunning as card networks
/// and peers do it).
pub const RETRY_AFTER_DAYS: [i64; 3] = [1, 3, 5];

/// How long after a period ends its renewal waits, so usage of the period that
/// arrives late (a producer's retry, a lagging pipeline) is still billed on the
/// period's own transaction (docs/api.md, "Subscriptions"). Later usage is billed
/// with the next charge ([`BilledUsage`]).
pub const LATE_USAGE_GRACE_MS: i64 = 60 * 60 * 1000;

/// The longest grace a store may set: a renewal waits at most a week.
pub const MAX_LATE_USAGE_GRACE_MS: i64 = 7 * DAY_MS;

/// A store's billing settings (`GET/POST /v1/store/settings`), per environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    /// What `POST /v1/subscriptions/{id}/cancel` does without a `mode`.
    pub default_cancel_mode: CancelMode,
    /// How long a renewal waits after its period for late usage.
    pub late_usage_grace_ms: i64,
    /// Percent of a referred checkout's `amount_paid` its affiliate earns.
    pub affiliate_commission_percent: Decimal,
    /// Where referral links point (`?ref=<code>` is added); none: no links.
    pub referral_base_url: Option<String>,
}

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            default_cancel_mode: CancelMode::Scheduled,
            late_usage_grace_ms: LATE_USAGE_GRACE_MS,
            affiliate_commission_percent: Decimal::ZERO,
            referral_base_url: None,
        }
    }
}

/// What a charge billed of one `invoice` price for one period: the meter's value
/// then. Kept while events of the period can still be ingested
/// (`limits::MAX_EVENT_AGE_MS` after its end), so usage that arrives after the
/// period was billed is billed with a later charge: never lost, never twice.
#[derive(Debug, Clone, PartialEq)]
pub struct BilledUsage {
    pub price_id: String,
    pub meter_id: MeterId,
    pub period_start_ms: i64,
    pub period_end_ms: i64,
    /// The meter's value over the period when it was last billed.
    pub quantity: Decimal,
    /// The period's events the meter had stopped counting then (voided or amended):
    /// a later correction names how many more it took out.
    pub voided_events: u64,
    /// The meter's revision then: a later correction says when it was revised.
    pub meter_revision: u32,
    /// The price as billed: a later adjustment bills at it even after the
    /// subscription moved to another product. `None` in records written before
    /// prices were kept: then the product's price of `price_id`.
    pub price: Option<UsagePrice>,
}

/// Usage not billed yet of a window the subscription's current prices do not
/// cover, with the `invoice` price it is billed at: the part of a period before an
/// upgrade, at the old product's price (the new product's prices count from
/// `end_ms` on), or a period that ended during a pause. The next charge that bills
/// usage bills it, so usage is billed at the price it was used under, once
/// (docs/api.md, "Subscriptions").
#[derive(Debug, Clone, PartialEq)]
pub struct RetiredUsage {
    pub price: UsagePrice,
    /// The product the price belonged to, named in the charge's line.
    pub product_name: String,
    pub start_ms: i64,
    pub end_ms: i64,
}

/// An item of a subscription besides its main product.
#[derive(Debug, Clone, PartialEq)]
pub struct ExtraItem {
    pub id: String,
    /// The product as added.
    pub product: crate::product::Product,
    pub units: u32,
    /// When it was added: its `invoice` usage prices bill usage from then.
    pub added_at_ms: i64,
}

/// One line of a transaction: what it charges and why.
#[derive(Debug, Clone, PartialEq)]
pub struct PaymentLine {
    pub description: String,
    /// The meter of a usage line.
    pub meter_id: Option<MeterId>,
    /// Units (a usage line: billable meter units, after allowance and cap).
    pub quantity: Decimal,
    /// Minor units per unit.
    pub unit_price: Decimal,
    /// Minor units.
    pub amount: i64,
}

/// What is due on a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DueKind {
    /// The trial ends: the first paid period is charged.
    TrialEnd,
    /// The period ends: the next is charged (usage of the ended one with it).
    Renewal,
    /// A declined renewal is tried again.
    Retry,
    /// The period ends and a scheduled cancel (or pause) takes effect.
    PeriodEnd,
    /// The grace after a period's end that canceled (or paused) the subscription
    /// passed: usage of that last period that arrived since its final charge is
    /// billed (docs/api.md, "Late usage and corrections").
    LateUsage,
}

/// The transition asked for is not one the subscription's status allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidTransition {
    pub from: SubscriptionStatus,
    pub to: SubscriptionStatus,
}

impl InvalidTransition {
    pub fn message(&self) -> String {
        format!(
            "a subscription that is {} cannot become {}",
            self.from.as_str(),
            self.to.as_str()
        )
    }
}

impl Subscription {
    /// The next thing due, and when; `None` for a subscription with nothing ahead
    /// (canceled, paused, unpaid).
    pub fn due(&self) -> Option<(i64, DueKind)> {
        match self.status {
            SubscriptionStatus::Trialing => Some((
                self.trial_end_ms.unwrap_or(self.current_period_end_ms),
                DueKind::TrialEnd,
            )),
            SubscriptionStatus::Active => Some((
                self.current_period_end_ms
                    .saturating_add(self.late_usage_grace_ms),
                DueKind::Renewal,
            )),
            SubscriptionStatus::ScheduledCancel => {
                Some((self.current_period_end_ms, DueKind::PeriodEnd))
            }
            SubscriptionStatus::PastDue => self.next_retry_ms.map(|at| (at, DueKind::Retry)),
            SubscriptionStatus::Canceled | SubscriptionStatus::Paused => {
                self.late_usage_due_ms.map(|at| (at, DueKind::LateUsage))
            }
            SubscriptionStatus::Unpaid => None,
        }
    }

    /// The period of the product's billing period that starts at `start_ms`, counted
    /// from the anchor: `(start, end)`.
    pub fn period_from(&self, start_ms: i64) -> (i64, i64) {
        let anchor = self.billing_anchor_ms;
        match period_months(self.product.billing_period) {
            Some(months) => crate::settlement::period_bounds(anchor, months, start_ms),
            None => (start_ms, start_ms),
        }
    }
}

/// What a charge due at some time bills: the base price for `base` (a period
/// ahead) and `invoice` usage of `usage` (a period behind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChargePlan {
    pub base: Option<(i64, i64)>,
    pub usage: Option<(i64, i64)>,
    /// Only usage prices whose trial usage is charged (usage of a trial).
    pub trial_usage: bool,
}

/// The charge `kind` makes on `sub`.
pub fn charge_plan(sub: &Subscription, kind: DueKind) -> ChargePlan {
    let ended = (sub.current_period_start_ms, sub.current_period_end_ms);
    match kind {
        DueKind::TrialEnd => ChargePlan {
            base: Some(sub.period_from(sub.current_period_end_ms)),
            usage: Some(ended),
            trial_usage: true,
        },
        DueKind::Renewal => ChargePlan {
            base: Some(sub.period_from(sub.current_period_end_ms)),
            usage: Some(ended),
            trial_usage: false,
        },
        DueKind::Retry => ChargePlan {
            base: Some((sub.current_period_start_ms, sub.current_period_end_ms)),
            usage: sub.open_usage,
            trial_usage: sub.open_usage_was_trial,
        },
        DueKind::PeriodEnd => ChargePlan {
            base: None,
            usage: Some(ended),
            trial_usage: false,
        },
        // Only what changed in periods billed before (their late usage and
        // corrections), which every charge adds.
        DueKind::LateUsage => ChargePlan {
            base: None,
            usage: None,
            trial_usage: false,
        },
    }
}

/// One `invoice` usage price a charge bills, over its part of the plan's usage
/// period.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageToBill {
    pub price: UsagePrice,
    pub start_ms: i64,
    pub end_ms: i64,
    /// A price of a product the subscription left within the period: its name.
    pub retired_from: Option<String>,
}

/// The `invoice` usage a plan bills: the prices of products left within the period
/// over the part they priced, then the product's own prices from the last change
/// on; for a trial's usage only prices whose trial usage is charged. Windows end at
/// `until` when it is sooner (a preview of usage to date).
pub fn usage_to_bill(
    sub: &Subscription,
    plan: &ChargePlan,
    until: Option<i64>,
) -> Vec<UsageToBill> {
    let Some((start, end)) = plan.usage else {
        return Vec::new();
    };
    let end = until.map_or(end, |until| until.min(end));
    let billed = |price: &UsagePrice| {
        price.settlement_mode == SettlementMode::Invoice
            && (!plan.trial_usage || price.trial_usage_mode == TrialUsageMode::Charge)
    };
    let retired = sub
        .retired_usage
        .iter()
        .filter(|r| billed(&r.price))
        // Unbilled usage of an earlier window (a period that ended during a pause)
        // is billed by the next charge whatever period it bills.
        .map(|r| UsageToBill {
            price: r.price.clone(),
            start_ms: r.start_ms,
            end_ms: r.end_ms.min(end),
            retired_from: Some(r.product_name.clone()),
        })
        .filter(|u| u.start_ms < u.end_ms);
    let from = sub
        .usage_priced_from_ms
        .map_or(start, |from| from.clamp(start, end.max(start)));
    let own = sub
        .product
        .usage_prices
        .iter()
        .filter(|p| billed(p))
        .map(|p| UsageToBill {
            price: p.clone(),
            start_ms: from,
            end_ms: end,
            retired_from: None,
        });
    // Add-on items' prices bill their usage since the item was added.
    let items = sub.extra_items.iter().flat_map(|item| {
        let start = from.max(item.added_at_ms).min(end.max(from));
        item.product
            .usage_prices
            .iter()
            .filter(|p| billed(p))
            .map(move |p| UsageToBill {
                price: p.clone(),
                start_ms: start,
                end_ms: end,
                retired_from: None,
            })
    });
    retired.chain(own).chain(items).collect()
}

/// The subscription `next` after its main product changed at `at_ms` (an upgrade)
/// from `sub`'s: the old product's `invoice` prices keep the usage of the open
/// period until then ([`RetiredUsage`]).
pub fn retire_usage_prices(sub: &Subscription, next: &mut Subscription, at_ms: i64) {
    if sub.product.id == next.product.id {
        return;
    }
    retire_usage_prices_until(sub, next, at_ms);
    // Usage from here on is the new product's, whatever the old one priced.
    next.usage_priced_from_ms = Some(at_ms);
}

/// Keeps the usage of `sub`'s open period not billed yet, until `at_ms`, for the
/// next charge that bills usage, at the prices of `sub`'s product.
fn retire_usage_prices_until(sub: &Subscription, next: &mut Subscription, at_ms: i64) {
    retire_prices(sub, &sub.product, i64::MIN, next, at_ms);
}

/// The subscription `next` after the add-on `item` was removed at `at_ms` from
/// `sub`'s items: its `invoice` prices keep the usage of the open period from when
/// it was added until then ([`RetiredUsage`]), billed by the next charge.
pub fn retire_item_usage_prices(
    sub: &Subscription,
    item: &ExtraItem,
    next: &mut Subscription,
    at_ms: i64,
) {
    retire_prices(sub, &item.product, item.added_at_ms, next, at_ms);
}

/// `product`'s `invoice` prices keep the usage of `sub`'s open period from
/// `since_ms` (at the earliest where the period's usage is priced from) until
/// `at_ms`, in `next`.
fn retire_prices(
    sub: &Subscription,
    product: &crate::product::Product,
    since_ms: i64,
    next: &mut Subscription,
    at_ms: i64,
) {
    let start = sub
        .usage_priced_from_ms
        .map_or(sub.current_period_start_ms, |from| {
            from.max(sub.current_period_start_ms)
        })
        .max(since_ms);
    if at_ms <= start {
        return;
    }
    next.retired_usage.extend(
        product
            .usage_prices
            .iter()
            .filter(|p| p.settlement_mode == SettlementMode::Invoice)
            .map(|price| RetiredUsage {
                price: price.clone(),
                product_name: product.name.clone(),
                start_ms: start,
                end_ms: at_ms,
            }),
    );
}

/// Minor units for a period's `usage` of an `invoice` price:
/// `ceil(max(0, min(usage, cap) - free_allowance) * unit_price)`; `None` past `i64`.
pub fn invoice_usage_amount(usage: Decimal, price: &UsagePrice) -> Option<(Decimal, i64)> {
    let capped = price.cap.map_or(usage, |cap| usage.min(cap));
    let billable = (capped - price.free_allowance).max(Decimal::ZERO);
    let amount = billable
        .checked_mul(price.unit_price)?
        .round_dp_with_strategy(0, RoundingStrategy::ToPositiveInfinity);
    Some((billable, i64::try_from(amount).ok()?))
}

/// The adjustment of a billed period whose usage changed since it was billed: the
/// period's charge with the meter's value now, less its charge with the value
/// billed (so allowance and cap apply to the period as a whole), as (billable
/// units, minor units). Positive for usage that arrived late, negative for usage a
/// correction (a void, an amendment, a meter revision) took out. `None` past `i64`.
pub fn usage_adjustment(
    billed: Decimal,
    now: Decimal,
    price: &UsagePrice,
) -> Option<(Decimal, i64)> {
    let (units_now, amount_now) = invoice_usage_amount(now, price)?;
    let (units_then, amount_then) = invoice_usage_amount(billed, price)?;
    Some((
        units_now.checked_sub(units_then)?,
        amount_now.checked_sub(amount_then)?,
    ))
}

/// The description of the line adjusting a billed period whose usage changed
/// (docs/api.md, "Late usage and corrections"): late usage or a correction, of which
/// meter and period, then what corrected it since it was billed: how many of its
/// events were voided or amended (`voided_now` against the billed count), and
/// whether the meter was revised (`revision_now` against the billed one; 0 is
/// unknown).
pub fn adjustment_description(
    billed: &BilledUsage,
    late: bool,
    voided_now: u64,
    revision_now: u32,
) -> String {
    let what = if late {
        "late usage"
    } else {
        "usage correction"
    };
    let mut description = format!(
        "{what} of meter {} ({} to {})",
        billed.meter_id,
        crate::time::format_iso8601_ms(billed.period_start_ms),
        crate::time::format_iso8601_ms(billed.period_end_ms)
    );
    let mut causes = Vec::new();
    match voided_now.saturating_sub(billed.voided_events) {
        0 => {}
        1 => causes.push("1 event voided".to_string()),
        n => causes.push(format!("{n} events voided")),
    }
    if billed.meter_revision != 0 && revision_now > billed.meter_revision {
        causes.push(format!("meter revised to revision {revision_now}"));
    }
    if !causes.is_empty() {
        description.push_str(": ");
        description.push_str(&causes.join(", "));
    }
    description
}

/// The lines of a charge: the base price x units for the period ahead, then one
/// line per `invoice` usage price with what its meter counted over its part of the
/// period behind (`None`: a meter whose value overflowed, billed as 0 and named in
/// the line).
pub fn charge_lines(
    sub: &Subscription,
    plan: &ChargePlan,
    usage: &[(UsageToBill, Option<Decimal>)],
) -> Option<Vec<PaymentLine>> {
    let mut lines = Vec::new();
    if plan.base.is_some() {
        lines.extend(item_lines(sub)?);
        lines.extend(sub.pending_lines.iter().cloned());
    }
    for (bill, value) in usage {
        let price = &bill.price;
        let (quantity, amount) = match value {
            Some(value) => invoice_usage_amount(*value, price)?,
            None => (Decimal::ZERO, 0),
        };
        let mut description = format!("usage of meter {}", price.meter_id);
        if let Some(product) = &bill.retired_from {
            description.push_str(&format!(
                " under {product} ({} to {})",
                crate::time::format_iso8601_ms(bill.start_ms),
                crate::time::format_iso8601_ms(bill.end_ms)
            ));
        }
        if value.is_none() {
            description.push_str(" (its value left the exact range; not billed)");
        }
        lines.push(PaymentLine {
            description,
            meter_id: Some(price.meter_id.clone()),
            quantity,
            unit_price: price.unit_price,
            amount,
        });
    }
    Some(lines)
}

/// One line per item: its product's price x units, for one period.
pub fn item_lines(sub: &Subscription) -> Option<Vec<PaymentLine>> {
    let main = (sub.units, &sub.product.name, sub.product.price);
    let extras = sub
        .extra_items
        .iter()
        .map(|i| (i.units, &i.product.name, i.product.price));
    std::iter::once(main)
        .chain(extras)
        .map(|(units, name, price)| {
            Some(PaymentLine {
                description: format!("{units} x {name}"),
                meter_id: None,
                quantity: Decimal::from(units),
                unit_price: Decimal::from(price),
                amount: price.checked_mul(i64::from(units))?,
            })
        })
        .collect()
}

/// What one period of the subscription's items costs (minor units).
pub fn period_amount(sub: &Subscription) -> Option<i64> {
    item_lines(sub)?
        .iter()
        .try_fold(0i64, |sum, l| sum.checked_add(l.amount))
}

wire_enum!(
    /// How a change of items or product within a period is charged (docs/api.md, "Subscriptions": updates and upgrades).
    UpdateBehavior {
        ProrationChargeImmediately => "proration-charge-immediately",
        ProrationCharge => "proration-charge",
        ProrationNone => "proration-none",
    }
);

/// The proration of a change at `at_ms` from `old` to `new` (minor units per
/// period) within `period`: the difference times the exact fraction of the period
/// left, in whole seconds, rounded half away from zero to the minor unit. Negative
/// for a downgrade (the unused time of the old price credited). `None` when the
/// period is over or empty.
pub fn proration_line(
    old: i64,
    new: i64,
    (start, end): (i64, i64),
    at_ms: i64,
    what: &str,
) -> Option<PaymentLine> {
    let total = (end - start) / 1000;
    let left = (end - at_ms).max(0) / 1000;
    if total <= 0 || left <= 0 || old == new {
        return None;
    }
    let fraction = Decimal::from(left) / Decimal::from(total);
    let difference = Decimal::from(new.checked_sub(old)?);
    let amount =
        (difference * fraction).round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero);
    Some(PaymentLine {
        description: format!("proration: {what} ({left} s of {total} s left)"),
        meter_id: None,
        quantity: fraction.round_dp(6).normalize(),
        unit_price: difference,
        amount: i64::try_from(amount).ok()?,
    })
}

/// The discount a charge of `base` minor units (the base line) gets, if the
/// subscription's discount still applies to this charge.
pub fn discount_off(sub: &Subscription, base: i64) -> i64 {
    match (&sub.discount, sub.discount_charges_left) {
        (Some(discount), None) => off(discount, base),
        (Some(discount), Some(left)) if left > 0 => off(discount, base),
        _ => 0,
    }
}

fn off(discount: &EmbeddedDiscount, gross: i64) -> i64 {
    let off = match discount.discount_type {
        DiscountType::Percentage => (Decimal::from(gross) * discount.amount / Decimal::ONE_HUNDRED)
            .round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero),
        DiscountType::Fixed => discount.amount,
    };
    i64::try_from(off).unwrap_or(gross).clamp(0, gross)
}

/// The subscription after a paid charge of `plan` (due at `at_ms`): active, in the
/// period the base paid for, the discount's charge counted.
pub fn after_paid(
    sub: &Subscription,
    plan: &ChargePlan,
    at_ms: i64,
    payment_id: &str,
) -> Subscription {
    let mut next = sub.clone();
    if let Some((start, end)) = plan.base {
        next.current_period_start_ms = start;
        next.current_period_end_ms = end;
        // Charged with this one.
        next.pending_lines.clear();
        if sub.discount.is_some() {
            next.discount_charges_left = sub.discount_charges_left.map(|n| n.saturating_sub(1));
        }
    }
    if plan.usage.is_some() {
        // Billed with this one.
        next.retired_usage.clear();
        next.usage_priced_from_ms = None;
    }
    next.status = SubscriptionStatus::Active;
    next.retries = 0;
    next.next_retry_ms = None;
    next.open_usage = None;
    next.open_usage_was_trial = false;
    next.last_transaction_id = Some(payment_id.into());
    next.last_transaction_at_ms = Some(at_ms);
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    next
}

/// The subscription after a declined charge of `plan` due at `at_ms`: `past_due`
/// with the next retry (the period moves on: the base owed is the new period's), or
/// `unpaid` once the retries are exhausted.
pub fn after_declined(sub: &Subscription, plan: &ChargePlan, at_ms: i64) -> Subscription {
    let mut next = sub.clone();
    let first_failure = sub.status != SubscriptionStatus::PastDue;
    if first_failure {
        if let Some((start, end)) = plan.base {
            next.current_period_start_ms = start;
            next.current_period_end_ms = end;
        }
        next.open_usage = plan.usage;
        next.open_usage_was_trial = plan.trial_usage;
        next.retries = 0;
        next.failed_at_ms = Some(at_ms);
    } else {
        next.retries = sub.retries.saturating_add(1);
    }
    let failed_at = next.failed_at_ms.unwrap_or(at_ms);
    match RETRY_AFTER_DAYS.get(next.retries as usize) {
        Some(days) => {
            next.status = SubscriptionStatus::PastDue;
            next.next_retry_ms = Some(failed_at.saturating_add(days.saturating_mul(DAY_MS)));
        }
        None => {
            next.status = SubscriptionStatus::Unpaid;
            next.next_retry_ms = None;
        }
    }
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    next
}

/// The subscription at the end of a period with a scheduled cancel: canceled, or
/// paused when the cancel said so.
pub fn after_period_end(sub: &Subscription, at_ms: i64) -> Subscription {
    let mut next = sub.clone();
    match sub.on_period_end.unwrap_or(OnExecute::Cancel) {
        OnExecute::Cancel => {
            next.status = SubscriptionStatus::Canceled;
            next.canceled_at_ms = Some(at_ms);
        }
        OnExecute::Pause => {
            next.status = SubscriptionStatus::Paused;
            next.paused_at_ms = Some(at_ms);
        }
    }
    next.on_period_end = None;
    // The period's usage was billed with its end (or there was none to bill): a
    // resume bills usage from there on.
    next.retired_usage.clear();
    next.usage_priced_from_ms = Some(sub.current_period_end_ms);
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    next
}

/// When the late usage of the period a scheduled cancel (or pause) ended is billed:
/// once the grace after the period's end passed, as a renewal would wait; `None`
/// without a grace (nothing can still arrive for the period) or without usage
/// billed for it.
pub fn late_usage_due(ended: &Subscription, billed: &[BilledUsage]) -> Option<i64> {
    let period_end = ended.current_period_end_ms;
    let billed_the_period = billed.iter().any(|b| b.period_end_ms == period_end);
    (ended.late_usage_grace_ms > 0 && billed_the_period)
        .then(|| period_end.saturating_add(ended.late_usage_grace_ms))
}

/// The late usage of a subscription's last period is settled (billed, nothing to
/// bill, or declined): nothing more is due on it.
pub fn after_late_usage(sub: &Subscription, at_ms: i64) -> Subscription {
    let mut next = sub.clone();
    next.late_usage_due_ms = None;
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    next
}

/// `POST /v1/subscriptions/{id}/cancel`.
pub fn cancel(
    sub: &Subscription,
    mode: CancelMode,
    on_execute: OnExecute,
    at_ms: i64,
) -> Result<Subscription, InvalidTransition> {
    use SubscriptionStatus::*;
    let to = match mode {
        CancelMode::Immediate => Canceled,
        CancelMode::Scheduled => ScheduledCancel,
    };
    let allowed = match mode {
        CancelMode::Immediate => matches!(
            sub.status,
            Active | Trialing | PastDue | ScheduledCancel | Paused | Unpaid
        ),
        CancelMode::Scheduled => matches!(sub.status, Active | Trialing),
    };
    if !allowed {
        return Err(InvalidTransition {
            from: sub.status,
            to,
        });
    }
    let mut next = sub.clone();
    next.status = to;
    match mode {
        CancelMode::Immediate => {
            next.canceled_at_ms = Some(at_ms);
            next.on_period_end = None;
            next.next_retry_ms = None;
            // Billing nothing more, late usage included.
            next.late_usage_due_ms = None;
        }
        CancelMode::Scheduled => next.on_period_end = Some(on_execute),
    }
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    Ok(next)
}

/// `POST /v1/subscriptions/{id}/pause`: an active subscription stops renewing.
pub fn pause(sub: &Subscription, at_ms: i64) -> Result<Subscription, InvalidTransition> {
    if sub.status != SubscriptionStatus::Active {
        return Err(InvalidTransition {
            from: sub.status,
            to: SubscriptionStatus::Paused,
        });
    }
    let mut next = sub.clone();
    next.status = SubscriptionStatus::Paused;
    next.paused_at_ms = Some(at_ms);
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    Ok(next)
}

/// `POST /v1/subscriptions/{id}/resume`: a paused subscription is active again. If
/// its paid period ended while paused, a new period starts at the resume and is due
/// at once (nothing is charged for the pause); one still running continues.
pub fn resume(sub: &Subscription, at_ms: i64) -> Result<Subscription, InvalidTransition> {
    if sub.status != SubscriptionStatus::Paused {
        return Err(InvalidTransition {
            from: sub.status,
            to: SubscriptionStatus::Active,
        });
    }
    let mut next = sub.clone();
    next.status = SubscriptionStatus::Active;
    if sub.current_period_end_ms <= at_ms {
        // The period ended during the pause: its usage not billed yet is billed
        // with the charge of the new period, at the product's prices.
        retire_usage_prices_until(sub, &mut next, sub.current_period_end_ms);
        next.usage_priced_from_ms = None;
        next.billing_anchor_ms = at_ms;
        next.current_period_start_ms = at_ms;
        next.current_period_end_ms = at_ms;
    }
    next.paused_at_ms = None;
    // The late usage of the period the pause began with is billed with the next
    // charge instead, as every charge bills what changed in billed periods.
    next.late_usage_due_ms = None;
    next.updated_at_ms = next.updated_at_ms.saturating_add(1).max(at_ms);
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn billed(voided_events: u64, meter_revision: u32) -> BilledUsage {
        BilledUsage {
            price_id: "price_1".into(),
            meter_id: "mtr_1".to_string().into(),
            period_start_ms: 0,
            period_end_ms: 60_000,
            quantity: Decimal::TEN,
            voided_events,
            meter_revision,
            price: None,
        }
    }

    #[test]
    fn an_adjustment_names_its_meter_period_and_what_corrected_it() {
        let period = "of meter mtr_1 (1970-01-01T00:00:00.000Z to 1970-01-01T00:01:00.000Z)";
        assert_eq!(
            adjustment_description(&billed(0, 1), true, 0, 1),
            format!("late usage {period}")
        );
        assert_eq!(
            adjustment_description(&billed(2, 1), false, 3, 1),
            format!("usage correction {period}: 1 event voided")
        );
        assert_eq!(
            adjustment_description(&billed(2, 1), false, 7, 3),
            format!("usage correction {period}: 5 events voided, meter revised to revision 3")
        );
        // A period billed before revisions were recorded (0) claims none.
        assert_eq!(
            adjustment_description(&billed(0, 0), false, 0, 2),
            format!("usage correction {period}")
        );
    }
}
