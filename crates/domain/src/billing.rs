//! Checkouts, payments (the billing context's transactions), subscriptions as a
//! checkout creates them, discounts, refunds and disputes: the types and the pure
//! rules of docs/api.md ("Checkouts", "Transactions", "Discounts").
//!
//! Money is an integer in minor units of the product's currency. Every sum is
//! checked; the bounds (`MAX_PRICE_MINOR` x `MAX_CHECKOUT_UNITS`) keep them far
//! inside `i64`, and an overflow is a 400 naming the field, never a panic.

use std::collections::BTreeMap;

use chrono::{Months, TimeZone, Utc};
use rust_decimal::{Decimal, RoundingStrategy};

use crate::customer::Patch;
use crate::error::FieldError;
use crate::ids::{
    CheckoutId, CustomerId, DiscountId, DisputeId, PaymentId, ProductId, StoreId, SubscriptionId,
};
use crate::limits::{
    MAX_CHECKOUT_UNITS, MAX_DISCOUNT_CODE_CHARS, MAX_DISCOUNT_MONTHS, MAX_DISCOUNT_PRODUCTS,
    MAX_DISCOUNT_REDEMPTIONS, MAX_NAME_CHARS, MAX_PRICE_MINOR, MAX_REASON_CHARS,
    MAX_TAX_RATE_PERCENT,
};
use crate::mode::Mode;
use crate::product::{parse_integer, BillingPeriod, BillingType, Product, ProductStatus, TaxMode};
use crate::time::{parse_iso8601_ms, DAY_MS};

wire_enum!(
    /// `percentage` takes a share of the price; `fixed` takes an amount of one currency.
    DiscountType { Percentage => "percentage", Fixed => "fixed" }
);
wire_enum!(
    /// How many charges of a subscription a discount applies to.
    DiscountDuration { Forever => "forever", Once => "once", Repeating => "repeating" }
);
wire_enum!(
    /// A discount's status as the API shows it. Only `draft`, `active` and `deleted`
    /// are stored; `scheduled` (before its start) and `expired` (at its expiry date, or
    /// once redeemed `max_redemptions` times) follow from time and count.
    DiscountStatus {
        Deleted => "deleted",
        Active => "active",
        Draft => "draft",
        Expired => "expired",
        Scheduled => "scheduled",
    }
);
wire_enum!(
    /// `open` until paid; `completed` once (and only once) paid.
    CheckoutStatus { Open => "open", Completed => "completed" }
);
wire_enum!(
    PaymentType { Payment => "payment", Refund => "refund" }
);
wire_enum!(
    PaymentStatus {
        Paid => "paid",
        Refunded => "refunded",
        PartiallyRefunded => "partially_refunded",
        Failed => "failed",
    }
);
wire_enum!(
    SubscriptionStatus {
        Active => "active",
        Canceled => "canceled",
        Unpaid => "unpaid",
        Paused => "paused",
        Trialing => "trialing",
        ScheduledCancel => "scheduled_cancel",
        PastDue => "past_due",
    }
);

#[derive(Debug, Clone, PartialEq)]
pub struct Discount {
    pub id: DiscountId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub name: String,
    pub code: String,
    pub discount_type: DiscountType,
    /// Percent (0 < p <= 100) for `percentage`, minor units for `fixed`.
    pub amount: Decimal,
    /// Only for `fixed`.
    pub currency: Option<String>,
    /// `draft`, `active` or `deleted` (see [`DiscountStatus`]).
    pub stored_status: DiscountStatus,
    pub starts_at_ms: Option<i64>,
    pub expires_at_ms: Option<i64>,
    pub max_redemptions: Option<u32>,
    pub duration: DiscountDuration,
    pub duration_in_months: Option<u32>,
    /// Empty: every product.
    pub applies_to_products: Vec<ProductId>,
    pub redeem_count: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Discount {
    /// The status at `at_ms` (docs/api.md, "Discounts").
    pub fn status_at(&self, at_ms: i64) -> DiscountStatus {
        match self.stored_status {
            DiscountStatus::Active => {}
            other => return other,
        }
        if self.expires_at_ms.is_some_and(|end| end <= at_ms)
            || self
                .max_redemptions
                .is_some_and(|max| self.redeem_count >= max)
        {
            DiscountStatus::Expired
        } else if self.starts_at_ms.is_some_and(|start| start > at_ms) {
            DiscountStatus::Scheduled
        } else {
            DiscountStatus::Active
        }
    }

    /// Whether a checkout of `product` may redeem this discount at `at_ms`: the
    /// reason it may not names `discount_code`, the field the customer typed.
    pub fn check_redeemable(&self, at_ms: i64, product: &Product) -> Result<(), FieldError> {
        let param = "discount_code";
        let refuse = |code, message: String| Err(FieldError::new(code, param, message));
        match self.status_at(at_ms) {
            DiscountStatus::Active => {}
            DiscountStatus::Expired
                if self
                    .max_redemptions
                    .is_some_and(|max| self.redeem_count >= max) =>
            {
                return refuse(
                    "discount_exhausted",
                    format!(
                        "discount '{}' has been redeemed the most times it allows",
                        self.code
                    ),
                )
            }
            DiscountStatus::Expired => {
                return refuse(
                    "discount_expired",
                    format!("discount '{}' has expired", self.code),
                )
            }
            status => {
                return refuse(
                    "discount_not_active",
                    format!("discount '{}' is {}", self.code, status.as_str()),
                )
            }
        }
        if !self.applies_to_products.is_empty() && !self.applies_to_products.contains(&product.id) {
            return refuse(
                "discount_not_applicable",
                format!(
                    "discount '{}' does not apply to product '{}'",
                    self.code, product.id
                ),
            );
        }
        if let Some(currency) = &self.currency {
            if *currency != product.currency {
                return refuse(
                    "discount_currency_mismatch",
                    format!(
                        "discount '{}' is an amount in {currency}; the product is priced in {}",
                        self.code, product.currency
                    ),
                );
            }
        }
        Ok(())
    }

    /// The discount taken off `gross` minor units: a percentage rounds half away
    /// from zero to the minor unit; neither takes more than `gross`.
    pub fn amount_off(&self, gross: i64) -> i64 {
        let off = match self.discount_type {
            DiscountType::Percentage => (Decimal::from(gross) * self.amount / Decimal::ONE_HUNDRED)
                .round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero),
            DiscountType::Fixed => self.amount,
        };
        i64::try_from(off).unwrap_or(gross).clamp(0, gross)
    }

    /// The discount as a subscription records it.
    pub fn embedded(&self) -> EmbeddedDiscount {
        EmbeddedDiscount {
            id: self.id.clone(),
            code: self.code.clone(),
            name: self.name.clone(),
            discount_type: self.discount_type,
            amount: self.amount,
            duration: self.duration,
            duration_in_months: self.duration_in_months,
        }
    }
}

/// A discount as a subscription keeps it (`discount` on a subscription, docs/api.md).
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddedDiscount {
    pub id: DiscountId,
    pub code: String,
    pub name: String,
    pub discount_type: DiscountType,
    pub amount: Decimal,
    pub duration: DiscountDuration,
    pub duration_in_months: Option<u32>,
}

/// Create input as the edge parsed it; numbers are their exact text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DiscountInput {
    pub name: Option<String>,
    pub code: Option<String>,
    pub discount_type: Option<String>,
    pub amount: Option<String>,
    pub percentage: Option<String>,
    pub currency: Option<String>,
    pub status: Option<String>,
    pub starts_at: Option<String>,
    pub expiry_date: Option<String>,
    pub max_redemptions: Option<String>,
    pub duration: Option<String>,
    pub duration_in_months: Option<String>,
    pub applies_to_products: Option<Vec<String>>,
}

/// Update input: what may change after creation (the code, type and amount may
/// not: redeemed checkouts and subscriptions record them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DiscountUpdate {
    pub name: Patch<String>,
    pub status: Patch<String>,
    pub expiry_date: Patch<String>,
    pub max_redemptions: Patch<String>,
}

fn bounded_text(param: &str, text: &str, max: usize) -> Result<String, FieldError> {
    let trimmed = text.trim();
    if trimmed.is_empty() || trimmed.chars().count() > max {
        return Err(FieldError::invalid(
            param,
            format!("`{param}` must be 1 to {max} characters"),
        ));
    }
    Ok(trimmed.to_string())
}

fn instant(param: &str, text: &str) -> Result<i64, FieldError> {
    parse_iso8601_ms(text).ok_or_else(|| {
        FieldError::invalid(
            param,
            format!(
                "`{param}` must be an ISO 8601 instant with an offset, e.g. 2027-01-31T00:00:00Z"
            ),
        )
    })
}

fn whole(param: &str, text: &str, min: u32, max: u32) -> Result<u32, FieldError> {
    let n = parse_integer(param, text, min.into(), max.into())?;
    // In range, so it fits.
    Ok(u32::try_from(n).unwrap_or(max))
}

/// A discount code: letters, digits, `_` and `-`, kept as typed (codes compare exactly).
pub fn normalize_discount_code(text: &str) -> Result<String, FieldError> {
    let code = text.trim();
    if code.is_empty()
        || code.chars().count() > MAX_DISCOUNT_CODE_CHARS
        || !code
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(FieldError::invalid(
            "code",
            format!("`code` must be 1 to {MAX_DISCOUNT_CODE_CHARS} letters, digits, `_` or `-`"),
        ));
    }
    Ok(code.to_string())
}

fn stored_status(text: &str) -> Result<DiscountStatus, FieldError> {
    match DiscountStatus::parse(text.trim()) {
        Some(s @ (DiscountStatus::Active | DiscountStatus::Draft)) => Ok(s),
        _ => Err(FieldError::invalid(
            "status",
            "`status` must be `active` or `draft` (scheduled and expired follow from the dates; delete with DELETE)",
        )),
    }
}

/// Builds a discount from create input (that the listed products exist is the
/// service's to check).
pub fn new_discount(
    input: &DiscountInput,
    id: DiscountId,
    store_id: StoreId,
    mode: Mode,
    now_ms: i64,
) -> Result<Discount, FieldError> {
    let name = bounded_text(
        "name",
        input
            .name
            .as_deref()
            .ok_or_else(|| FieldError::missing("name"))?,
        MAX_NAME_CHARS,
    )?;
    let code = normalize_discount_code(
        input
            .code
            .as_deref()
            .ok_or_else(|| FieldError::missing("code"))?,
    )?;
    let discount_type = DiscountType::parse_field(
        "type",
        input
            .discount_type
            .as_deref()
            .ok_or_else(|| FieldError::missing("type"))?,
    )?;
    let (amount, currency) = match discount_type {
        DiscountType::Percentage => {
            let (param, text) = match (&input.percentage, &input.amount) {
                (Some(p), _) => ("percentage", p),
                (None, Some(a)) => ("amount", a),
                (None, None) => return Err(FieldError::missing("amount")),
            };
            let percent = crate::usage::parse_decimal(text.trim())
                .filter(|p| *p > Decimal::ZERO && *p <= Decimal::ONE_HUNDRED)
                .ok_or_else(|| {
                    FieldError::invalid(
                        param,
                        format!("`{param}` must be a number above 0 and at most 100"),
                    )
                })?;
            if input.currency.is_some() {
                return Err(FieldError::invalid(
                    "currency",
                    "`currency` is only for `fixed` discounts",
                ));
            }
            (percent, None)
        }
        DiscountType::Fixed => {
            let text = input
                .amount
                .as_deref()
                .ok_or_else(|| FieldError::missing("amount"))?;
            let minor = crate::product::parse_minor("amount", text)?;
            if minor == 0 {
                return Err(FieldError::invalid(
                    "amount",
                    format!(
                        "`amount` must be an integer from 1 to {MAX_PRICE_MINOR} (minor units)"
                    ),
                ));
            }
            let currency = crate::product::parse_currency(
                input
                    .currency
                    .as_deref()
                    .ok_or_else(|| FieldError::missing("currency"))?,
            )?;
            (Decimal::from(minor), Some(currency))
        }
    };
    let stored = match &input.status {
        None => DiscountStatus::Active,
        Some(text) => stored_status(text)?,
    };
    let starts_at_ms = input
        .starts_at
        .as_deref()
        .map(|t| instant("starts_at", t))
        .transpose()?;
    let expires_at_ms = input
        .expiry_date
        .as_deref()
        .map(|t| instant("expiry_date", t))
        .transpose()?;
    if let (Some(start), Some(end)) = (starts_at_ms, expires_at_ms) {
        if end <= start {
            return Err(FieldError::invalid(
                "expiry_date",
                "`expiry_date` must be after `starts_at`",
            ));
        }
    }
    let max_redemptions = input
        .max_redemptions
        .as_deref()
        .map(|t| whole("max_redemptions", t, 1, MAX_DISCOUNT_REDEMPTIONS))
        .transpose()?;
    let duration = match &input.duration {
        None => DiscountDuration::Once,
        Some(text) => DiscountDuration::parse_field("duration", text.trim())?,
    };
    let duration_in_months = match (duration, &input.duration_in_months) {
        (DiscountDuration::Repeating, Some(text)) => {
            Some(whole("duration_in_months", text, 1, MAX_DISCOUNT_MONTHS)?)
        }
        (DiscountDuration::Repeating, None) => {
            return Err(FieldError::missing("duration_in_months"))
        }
        (_, Some(_)) => {
            return Err(FieldError::invalid(
                "duration_in_months",
                "`duration_in_months` is only for `repeating` discounts",
            ))
        }
        (_, None) => None,
    };
    let products = input.applies_to_products.clone().unwrap_or_default();
    if products.len() > MAX_DISCOUNT_PRODUCTS {
        return Err(FieldError::invalid(
            "applies_to_products",
            format!("`applies_to_products` lists at most {MAX_DISCOUNT_PRODUCTS} products"),
        ));
    }
    let mut applies_to_products: Vec<ProductId> = Vec::with_capacity(products.len());
    for (i, product) in products.iter().enumerate() {
        let id = product.trim();
        if id.is_empty() {
            return Err(FieldError::invalid(
                format!("applies_to_products[{i}]"),
                "a product id must not be empty",
            ));
        }
        if !applies_to_products.iter().any(|p| p.as_str() == id) {
            applies_to_products.push(id.into());
        }
    }
    Ok(Discount {
        id,
        store_id,
        mode,
        name,
        code,
        discount_type,
        amount,
        currency,
        stored_status: stored,
        starts_at_ms,
        expires_at_ms,
        max_redemptions,
        duration,
        duration_in_months,
        applies_to_products,
        redeem_count: 0,
        created_at_ms: now_ms,
        updated_at_ms: now_ms,
    })
}

/// Applies an update to a discount that is not deleted.
pub fn update_discount(discount: &mut Discount, update: &DiscountUpdate) -> Result<(), FieldError> {
    if discount.stored_status == DiscountStatus::Deleted {
        return Err(FieldError::new(
            "discount_deleted",
            "id",
            format!("discount '{}' is deleted", discount.id),
        ));
    }
    match &update.name {
        Patch::Set(name) => discount.name = bounded_text("name", name, MAX_NAME_CHARS)?,
        Patch::Clear => return Err(FieldError::missing("name")),
        Patch::Keep => {}
    }
    match &update.status {
        Patch::Set(text) => {
            let status = stored_status(text)?;
            if status == DiscountStatus::Draft && discount.stored_status != DiscountStatus::Draft {
                return Err(FieldError::invalid(
                    "status",
                    "an active discount cannot go back to `draft`",
                ));
            }
            discount.stored_status = status;
        }
        Patch::Clear => return Err(FieldError::missing("status")),
        Patch::Keep => {}
    }
    match &update.expiry_date {
        Patch::Set(text) => discount.expires_at_ms = Some(instant("expiry_date", text)?),
        Patch::Clear => discount.expires_at_ms = None,
        Patch::Keep => {}
    }
    match &update.max_redemptions {
        Patch::Set(text) => {
            discount.max_redemptions =
                Some(whole("max_redemptions", text, 1, MAX_DISCOUNT_REDEMPTIONS)?)
        }
        Patch::Clear => discount.max_redemptions = None,
        Patch::Keep => {}
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq)]
pub struct Checkout {
    pub id: CheckoutId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub status: CheckoutStatus,
    pub product_id: ProductId,
    pub customer_id: CustomerId,
    pub units: u32,
    pub discount_id: Option<DiscountId>,
    pub discount_code: Option<String>,
    pub affiliate_code: Option<String>,
    pub success_url: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// What completing it will charge, as priced at creation (the completion prices
    /// again: the discount may have changed).
    pub amount: i64,
    pub currency: String,
    pub transaction_id: Option<PaymentId>,
    pub subscription_id: Option<SubscriptionId>,
    pub completed_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A payment collected, failed or refunded (a `transaction`, docs/api.md).
#[derive(Debug, Clone, PartialEq)]
pub struct Payment {
    pub id: PaymentId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub payment_type: PaymentType,
    pub status: PaymentStatus,
    /// The price before discount and (exclusive) tax; for an inclusive price, the
    /// price less the tax it includes. A refund: the amount refunded.
    pub amount: i64,
    pub currency: String,
    pub discount_amount: i64,
    pub tax_amount: i64,
    /// `amount - discount_amount + tax_amount`.
    pub amount_paid: i64,
    pub refunded_amount: i64,
    pub tax_country: Option<String>,
    pub checkout_id: Option<CheckoutId>,
    pub subscription_id: Option<SubscriptionId>,
    pub customer_id: CustomerId,
    pub description: String,
    pub period_start_ms: Option<i64>,
    pub period_end_ms: Option<i64>,
    /// A refund: the payment it refunds.
    pub refund_of: Option<PaymentId>,
    pub reason: Option<String>,
    pub disputed: bool,
    /// Last four digits of the card charged.
    pub card_last4: Option<String>,
    /// The card charged pays now and declines every later charge (a test card):
    /// what a later charge on file meets (an auto-recharge).
    pub card_declines_later: bool,
    /// The card's expiry as given (`MM/YY` or `MM/YYYY`): a later charge on file
    /// after its month is declined. `None` in records of earlier builds.
    pub card_exp: Option<String>,
    /// What it charges, line by line (the lines' amounts add up to `amount` before
    /// tax for an exclusive price).
    pub lines: Vec<crate::subscription::PaymentLine>,
    /// The affiliate a checkout's payment was referred by, and the commission it
    /// earned (set in apply).
    pub affiliate_id: Option<crate::ids::AffiliateId>,
    pub affiliate_commission: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Payment {
    /// What of the payment is left to refund.
    pub fn refundable(&self) -> i64 {
        self.amount_paid.saturating_sub(self.refunded_amount).max(0)
    }

    /// A payment that went through (refunded in part or not): what can be refunded,
    /// and whose card can be charged again.
    pub fn succeeded(&self) -> bool {
        self.payment_type == PaymentType::Payment
            && matches!(
                self.status,
                PaymentStatus::Paid | PaymentStatus::PartiallyRefunded
            )
    }

    /// Whether a refund of `amount` may be taken from this payment now.
    pub fn check_refund(&self, amount: i64) -> Result<(), FieldError> {
        if !self.succeeded() {
            return Err(FieldError::new(
                "transaction_not_refundable",
                "transaction_id",
                format!(
                    "transaction '{}' is a {} with status {}; only paid payments are refunded",
                    self.id,
                    self.payment_type.as_str(),
                    self.status.as_str()
                ),
            ));
        }
        if amount > self.refundable() {
            return Err(FieldError::new(
                "refund_exceeds_remaining",
                "amount",
                format!(
                    "`amount` is {amount} but only {} of transaction '{}' is left to refund",
                    self.refundable(),
                    self.id
                ),
            ));
        }
        Ok(())
    }

    /// Takes a refund of `amount` (checked by [`Payment::check_refund`]).
    pub fn take_refund(&mut self, amount: i64, at_ms: i64) {
        self.refunded_amount = self.refunded_amount.saturating_add(amount);
        self.status = if self.refunded_amount >= self.amount_paid {
            PaymentStatus::Refunded
        } else {
            PaymentStatus::PartiallyRefunded
        };
        self.updated_at_ms = at_ms;
    }
}

/// A subscription as a checkout of a recurring product creates it; its lifecycle
/// (renewals, cancels, pauses) is docs/api.md's "Subscriptions".
#[derive(Debug, Clone, PartialEq)]
pub struct Subscription {
    pub id: SubscriptionId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub status: SubscriptionStatus,
    /// The product as bought: renewals charge this price until the subscription
    /// changes product.
    pub product: Product,
    pub customer_id: CustomerId,
    pub item_id: String,
    pub units: u32,
    pub last_transaction_id: Option<PaymentId>,
    pub last_transaction_at_ms: Option<i64>,
    pub current_period_start_ms: i64,
    pub current_period_end_ms: i64,
    pub trial_end_ms: Option<i64>,
    pub canceled_at_ms: Option<i64>,
    pub discount: Option<EmbeddedDiscount>,
    /// Charges the discount still applies to (`None`: forever).
    pub discount_charges_left: Option<u32>,
    pub metadata: BTreeMap<String, String>,
    pub card_last4: String,
    /// The test card that pays now and declines every later charge.
    pub card_declines_renewals: bool,
    /// The card's expiry as it was given (`MM/YY` or `MM/YYYY`): a charge after
    /// its month is declined. `None` in records of earlier builds: never expires.
    pub card_exp: Option<String>,
    /// Periods are counted from here: the start of the first paid period.
    pub billing_anchor_ms: i64,
    /// A scheduled cancel: what happens at the end of the period.
    pub on_period_end: Option<crate::subscription::OnExecute>,
    /// Failed retries of the charge owed while `past_due`.
    pub retries: u32,
    pub next_retry_ms: Option<i64>,
    /// When the charge owed first failed.
    pub failed_at_ms: Option<i64>,
    /// The usage period the charge owed bills, and whether it was a trial's.
    pub open_usage: Option<(i64, i64)>,
    pub open_usage_was_trial: bool,
    pub paused_at_ms: Option<i64>,
    /// `invoice` usage billed per period, while late events can still arrive.
    pub billed_usage: Vec<crate::subscription::BilledUsage>,
    /// `invoice` prices of products left within the open period, each with the
    /// part of it they priced: billed with the period's usage.
    pub retired_usage: Vec<crate::subscription::RetiredUsage>,
    /// The last change of product within the open period: the product's own usage
    /// prices count from here (`None`: from the period's start).
    pub usage_priced_from_ms: Option<i64>,
    /// Items besides the main one (`product` x `units`): add-ons of other products
    /// in the same currency and billing period.
    pub extra_items: Vec<crate::subscription::ExtraItem>,
    /// Lines the next charge carries: prorations, a credit left over.
    pub pending_lines: Vec<crate::subscription::PaymentLine>,
    /// How long a renewal waits after the period for late usage: the store's
    /// setting when the subscription was created or last changed.
    pub late_usage_grace_ms: i64,
    /// A subscription its period's end canceled or paused: when the usage of that
    /// last period which arrived late (within the grace) is billed. `None` once
    /// billed, and for every other subscription.
    pub late_usage_due_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Dispute {
    pub id: DisputeId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub transaction_id: PaymentId,
    pub customer_id: CustomerId,
    pub amount: i64,
    pub currency: String,
    pub reason: Option<String>,
    pub created_at_ms: i64,
}

/// What a charge comes to (the fields of a payment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub amount: i64,
    pub discount_amount: i64,
    pub tax_amount: i64,
    pub amount_paid: i64,
}

fn too_large(param: &str) -> FieldError {
    FieldError::invalid(
        param,
        format!(
            "the charge comes to more than {MAX_PRICE_MINOR} x {MAX_CHECKOUT_UNITS} minor units"
        ),
    )
}

/// Prices a charge of `gross` minor units: the discount first, then tax at
/// `rate_percent` on what is left, added (`exclusive`) or carved out (`inclusive`,
/// where `amount` becomes the gross less that tax). Taxes round half away from zero.
pub fn price_charge(
    gross: i64,
    discount_amount: i64,
    tax_mode: TaxMode,
    rate_percent: Decimal,
) -> Result<Charge, FieldError> {
    let net = gross
        .checked_sub(discount_amount)
        .filter(|n| *n >= 0)
        .ok_or_else(|| too_large("discount_code"))?;
    let rate = rate_percent / Decimal::ONE_HUNDRED;
    let round = |d: Decimal| {
        i64::try_from(d.round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero))
            .map_err(|_| too_large("units"))
    };
    let (amount, tax_amount) = match tax_mode {
        TaxMode::Exclusive => (gross, round(Decimal::from(net) * rate)?),
        TaxMode::Inclusive => {
            let tax = round(Decimal::from(net) - Decimal::from(net) / (Decimal::ONE + rate))?;
            (gross - tax, tax)
        }
    };
    let amount_paid = amount
        .checked_sub(discount_amount)
        .and_then(|a| a.checked_add(tax_amount))
        .ok_or_else(|| too_large("units"))?;
    Ok(Charge {
        amount,
        discount_amount,
        tax_amount,
        amount_paid,
    })
}

/// What one checkout of `units` of `product` charges before discount and tax: the
/// trial price (0 when none) for a product with a trial, else the price.
pub fn checkout_gross(product: &Product, units: u32) -> Result<i64, FieldError> {
    let unit_price = match product.trial_period_days {
        Some(days) if days > 0 && product.billing_type == BillingType::Recurring => {
            product.trial_price.unwrap_or(0)
        }
        _ => product.price,
    };
    unit_price
        .checked_mul(i64::from(units))
        .ok_or_else(|| too_large("units"))
}

/// Whether `product` can be bought now.
pub fn check_sold(product: &Product) -> Result<(), FieldError> {
    if product.status != ProductStatus::Active {
        return Err(FieldError::new(
            "product_not_active",
            "product_id",
            format!("product '{}' is archived and no longer sold", product.id),
        ));
    }
    Ok(())
}

/// Units of a checkout: 1 to `MAX_CHECKOUT_UNITS`, default 1.
pub fn parse_units(text: Option<&str>) -> Result<u32, FieldError> {
    match text {
        None => Ok(1),
        Some(text) => {
            let units = parse_integer("units", text, 1, MAX_CHECKOUT_UNITS)?;
            // In range, so it fits.
            Ok(u32::try_from(units).unwrap_or(1))
        }
    }
}

/// A refund or dispute reason.
pub fn parse_reason(text: Option<&str>) -> Result<Option<String>, FieldError> {
    text.map(|t| bounded_text("reason", t, MAX_REASON_CHARS))
        .transpose()
}

/// A tax rate in percent: 0 to `MAX_TAX_RATE_PERCENT`, at most 4 decimals.
pub fn parse_tax_rate(text: &str) -> Result<Decimal, FieldError> {
    crate::usage::parse_decimal(text.trim())
        .filter(|r| {
            *r >= Decimal::ZERO && *r <= Decimal::from(MAX_TAX_RATE_PERCENT) && r.scale() <= 4
        })
        .ok_or_else(|| {
            FieldError::invalid(
                "rate",
                format!("`rate` must be a percentage from 0 to {MAX_TAX_RATE_PERCENT} with at most 4 decimals"),
            )
        })
}

/// The end of a period of `period` starting at `start_ms` (calendar months, UTC);
/// `None` for a one-time period or past the calendar's end.
pub fn period_end(start_ms: i64, period: BillingPeriod) -> Option<i64> {
    let months = match period {
        BillingPeriod::EveryMonth => 1,
        BillingPeriod::EveryThreeMonths => 3,
        BillingPeriod::EverySixMonths => 6,
        BillingPeriod::EveryYear => 12,
        BillingPeriod::Once => return None,
    };
    Utc.timestamp_millis_opt(start_ms)
        .single()?
        .checked_add_months(Months::new(months))
        .map(|t| t.timestamp_millis())
}

/// The end of a trial of `days` starting at `start_ms`.
pub fn trial_end(start_ms: i64, days: u32) -> i64 {
    start_ms.saturating_add(i64::from(days).saturating_mul(DAY_MS))
}

/// What a test card does (docs/api.md, "Test cards").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CardBehavior {
    /// Pays.
    Pays,
    /// Pays now, declines every later charge (renewal failures).
    PaysThenDeclines,
    /// Declines with this code.
    Declines(&'static str),
}

/// A card as the edge parsed it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CardInput {
    pub number: Option<String>,
    pub cvc: Option<String>,
    pub exp: Option<String>,
}

/// A card whose fields are well formed: its digits and what it does in test mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestCard {
    pub last4: String,
    pub behavior: CardBehavior,
}

/// Validates a card's fields (400 naming the field) and says what the test card
/// does; any number that is not one of the test cards is declined.
pub fn test_card(card: &CardInput) -> Result<TestCard, FieldError> {
    let number: String = card
        .number
        .as_deref()
        .ok_or_else(|| FieldError::missing("card_number"))?
        .chars()
        .filter(|c| *c != ' ' && *c != '-')
        .collect();
    if !(12..=19).contains(&number.len()) || !number.chars().all(|c| c.is_ascii_digit()) {
        return Err(FieldError::invalid(
            "card_number",
            "`card_number` must be 12 to 19 digits",
        ));
    }
    let cvc = card
        .cvc
        .as_deref()
        .ok_or_else(|| FieldError::missing("cvc"))?
        .trim();
    if !(3..=4).contains(&cvc.len()) || !cvc.chars().all(|c| c.is_ascii_digit()) {
        return Err(FieldError::invalid("cvc", "`cvc` must be 3 or 4 digits"));
    }
    let exp = card
        .exp
        .as_deref()
        .ok_or_else(|| FieldError::missing("exp"))?
        .trim();
    let valid_exp = exp.split_once('/').is_some_and(|(month, year)| {
        month.parse::<u32>().is_ok_and(|m| (1..=12).contains(&m))
            && (year.len() == 2 || year.len() == 4)
            && year.chars().all(|c| c.is_ascii_digit())
    });
    if !valid_exp {
        return Err(FieldError::invalid("exp", "`exp` must be MM/YY or MM/YYYY"));
    }
    let behavior = match number.as_str() {
        "4242424242424242" => CardBehavior::Pays,
        "4000000000000341" => CardBehavior::PaysThenDeclines,
        "4000000000009995" => CardBehavior::Declines("insufficient_funds"),
        "4000000000000127" => CardBehavior::Declines("incorrect_cvc"),
        _ => CardBehavior::Declines("card_declined"),
    };
    Ok(TestCard {
        last4: number[number.len() - 4..].to_string(),
        behavior,
    })
}

/// Whether a card whose `exp` (`MM/YY` or `MM/YYYY`, as `test_card` accepts it) is
/// past at `now_ms`: a card is good through the last day of its month (UTC), as
/// card networks count it. A two-digit year is of this century.
pub fn card_expired(exp: &str, now_ms: i64) -> bool {
    use chrono::Datelike;
    let Some((month, year)) = exp.trim().split_once('/') else {
        return false;
    };
    let (Ok(month), Ok(year)) = (month.parse::<i32>(), year.parse::<i32>()) else {
        return false;
    };
    let year = if year < 100 { 2000 + year } else { year };
    let Some(now) = chrono::DateTime::from_timestamp_millis(now_ms) else {
        return false;
    };
    (year, month) < (now.year(), now.month() as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_is_good_through_its_expiry_month() {
        // 2026-11-30T12:00:00Z.
        let now = 1_796_040_000_000;
        for (exp, expired) in [
            ("11/26", false),
            ("11/2026", false),
            ("12/26", false),
            ("01/27", false),
            ("10/26", true),
            ("10/2026", true),
            ("12/25", true),
            ("01/20", true),
        ] {
            assert_eq!(card_expired(exp, now), expired, "{exp}");
        }
    }

    fn discount(kind: DiscountType, amount: i64) -> Discount {
        new_discount(
            &DiscountInput {
                name: Some("Launch".into()),
                code: Some("LAUNCH".into()),
                discount_type: Some(kind.as_str().into()),
                amount: Some(amount.to_string()),
                currency: (kind == DiscountType::Fixed).then(|| "usd".into()),
                max_redemptions: Some("2".into()),
                expiry_date: Some("2030-01-01T00:00:00Z".into()),
                ..Default::default()
            },
            "dis_1".into(),
            "st_1".into(),
            Mode::Test,
            0,
        )
        .unwrap()
    }

    #[test]
    fn a_discount_expires_at_its_date_and_at_its_last_redemption() {
        let mut d = discount(DiscountType::Percentage, 10);
        let before = parse_iso8601_ms("2029-12-31T23:59:59Z").unwrap();
        let at = parse_iso8601_ms("2030-01-01T00:00:00Z").unwrap();
        assert_eq!(d.status_at(before), DiscountStatus::Active);
        assert_eq!(d.status_at(at), DiscountStatus::Expired);
        d.redeem_count = 2;
        assert_eq!(d.status_at(before), DiscountStatus::Expired);
        d.starts_at_ms = Some(before + 10);
        d.redeem_count = 0;
        assert_eq!(d.status_at(before), DiscountStatus::Scheduled);
    }

    #[test]
    fn discounts_never_take_more_than_the_price() {
        assert_eq!(discount(DiscountType::Percentage, 10).amount_off(1005), 101);
        assert_eq!(discount(DiscountType::Percentage, 100).amount_off(999), 999);
        assert_eq!(discount(DiscountType::Fixed, 500).amount_off(300), 300);
        assert_eq!(discount(DiscountType::Fixed, 500).amount_off(800), 500);
    }

    #[test]
    fn tax_is_added_or_carved_out_and_amount_paid_adds_up() {
        let rate = Decimal::from(20);
        let ex = price_charge(1000, 100, TaxMode::Exclusive, rate).unwrap();
        assert_eq!((ex.tax_amount, ex.amount_paid), (180, 1080));
        let inc = price_charge(1200, 0, TaxMode::Inclusive, rate).unwrap();
        assert_eq!(
            (inc.amount, inc.tax_amount, inc.amount_paid),
            (1000, 200, 1200)
        );
        for charge in [ex, inc] {
            assert_eq!(
                charge.amount_paid,
                charge.amount - charge.discount_amount + charge.tax_amount
            );
        }
    }

    #[test]
    fn test_cards_do_what_docs_say() {
        let card = |n: &str| {
            test_card(&CardInput {
                number: Some(n.into()),
                cvc: Some("123".into()),
                exp: Some("12/34".into()),
            })
            .map(|c| c.behavior)
        };
        assert_eq!(card("4242 4242 4242 4242"), Ok(CardBehavior::Pays));
        assert_eq!(
            card("4000000000000002"),
            Ok(CardBehavior::Declines("card_declined"))
        );
        assert_eq!(
            card("4000000000009995"),
            Ok(CardBehavior::Declines("insufficient_funds"))
        );
        assert_eq!(
            card("4000000000000127"),
            Ok(CardBehavior::Declines("incorrect_cvc"))
        );
        assert_eq!(card("4000000000000341"), Ok(CardBehavior::PaysThenDeclines));
        assert_eq!(card("42").unwrap_err().param, "card_number");
    }

    #[test]
    fn periods_are_calendar_months() {
        let jan31 = parse_iso8601_ms("2027-01-31T10:00:00Z").unwrap();
        let end = period_end(jan31, BillingPeriod::EveryMonth).unwrap();
        assert_eq!(end, parse_iso8601_ms("2027-02-28T10:00:00Z").unwrap());
        assert_eq!(period_end(jan31, BillingPeriod::Once), None);
    }
}
