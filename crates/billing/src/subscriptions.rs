//! Subscriptions after their checkout (docs/api.md, "Subscriptions"): the list,
//! cancel, pause and resume, the scheduler that runs what is due (trial ends,
//! renewals with their `invoice` usage, payment retries, scheduled cancels) on the
//! store's clock, and the test clock that moves a test store's time forward and runs
//! everything due until then.
//!
//! Every change is a `SubscriptionChanged` record derived from the version read and
//! applied only over it (`lifecycle`): two schedulers (nodes, a restart, a test-clock
//! advance racing the background scheduler) deriving the same renewal append two
//! records, and apply keeps the first; the second is refused as stale and charges
//! nothing. A card is charged before the record is appended (the test cards move no
//! money; a real provider would authorize there and capture once applied, as for
//! checkouts).

use std::ops::Bound;
use std::sync::Arc;

use rust_decimal::Decimal;

use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, ListingKey};
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest};
use tally_core::Scope;
use tally_domain::billing::{
    price_charge, Charge, Payment, PaymentStatus, PaymentType, Subscription, SubscriptionStatus,
};
use tally_domain::record::Record;
use tally_domain::subscription::{
    adjustment_description, after_declined, after_late_usage, after_paid, after_period_end, cancel,
    charge_lines, charge_plan, discount_off, late_usage_due, pause, period_amount, resume,
    retire_item_usage_prices, retire_usage_prices, usage_adjustment, usage_to_bill, BilledUsage,
    CancelMode, ChargePlan, DueKind, InvalidTransition, OnExecute, PaymentLine,
};
use tally_domain::subscription::{proration_line, ExtraItem, StoreSettings, UpdateBehavior};
use tally_domain::time::parse_iso8601_ms;
use tally_domain::{FieldError, Mode};

use crate::lifecycle;
use crate::Billing;

/// Due work the scheduler runs per scan: bounds a scan's memory and the records in
/// flight; a longer backlog (a node down for days) is worked off scan by scan.
pub const SCHEDULE_BATCH: usize = 100;

/// How often the background scheduler looks for due work.
pub const SCHEDULE_POLL_MS: u64 = 1_000;

/// Times an advance runs work due at one instant before it gives up: a batch of
/// `SCHEDULE_BATCH` per run, so this bounds a stuck item's retries, not real work
/// (which moves the due instant on).
pub const MAX_STALLED_STEPS: u32 = 1_000;

/// How far a test clock may jump in one advance: each period, retry and period end
/// on the way runs, so a jump bounds the work one request does.
pub const MAX_TEST_CLOCK_ADVANCE_MS: i64 = 2 * 366 * tally_domain::time::DAY_MS;

/// Items a subscription holds at most (its main item included): bounds its record
/// and a renewal's lines.
pub const MAX_SUBSCRIPTION_ITEMS: usize = 20;

/// `POST /v1/store/settings`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct SettingsInput {
    pub default_cancel_mode: Option<String>,
    pub late_usage_grace_seconds: Option<u32>,
    pub affiliate_commission_percent: Option<String>,
    pub referral_base_url: tally_domain::customer::Patch<String>,
}

/// An item of `POST /v1/subscriptions/{id}`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct ItemInput {
    pub id: Option<String>,
    pub product_id: Option<String>,
    pub units: Option<u32>,
}

/// `POST /v1/subscriptions/{id}`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionUpdate {
    pub items: Vec<ItemInput>,
    pub update_behavior: Option<String>,
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

fn parse_behavior(
    text: Option<&str>,
    default: UpdateBehavior,
) -> Result<UpdateBehavior, FieldError> {
    match text {
        Some(text) => UpdateBehavior::parse_field("update_behavior", text),
        None => Ok(default),
    }
}

/// `sub` with its main item moved to `product` at `now` (an upgrade): the old
/// product's usage prices keep the usage until then.
fn upgraded(
    sub: &Subscription,
    product: &tally_domain::product::Product,
    now: i64,
) -> Subscription {
    let mut next = sub.clone();
    next.product = product.clone();
    retire_usage_prices(sub, &mut next, now);
    next
}

/// A product a subscription may hold: being sold, recurring, in the subscription's
/// currency and billing period (400 naming `param` otherwise).
fn check_compatible(
    sub: &Subscription,
    product: &tally_domain::product::Product,
    param: &str,
) -> Result<(), EngineError> {
    tally_domain::billing::check_sold(product).map_err(|mut e| {
        e.param = param.to_string();
        e
    })?;
    if product.currency != sub.product.currency {
        return Err(FieldError::invalid(
            param,
            format!(
                "the product is priced in {}, the subscription in {}",
                product.currency, sub.product.currency
            ),
        )
        .into());
    }
    if product.billing_period != sub.product.billing_period
        || product.billing_type != sub.product.billing_type
    {
        return Err(FieldError::invalid(
            param,
            "the product bills on another period; cancel and subscribe to it instead",
        )
        .into());
    }
    Ok(())
}

/// A filter of the subscription list.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionFilter {
    pub customer_id: Option<String>,
    pub status: Option<SubscriptionStatus>,
}

fn invalid_transition(error: InvalidTransition) -> EngineError {
    EngineError::conflict("invalid_state_transition", error.message())
}

impl Billing {
    /// The scope's business time: the store's test clock in test mode.
    pub fn now_in(&self, scope: &Scope) -> i64 {
        self.journal.now_in(scope)
    }

    pub fn list_subscriptions(
        &self,
        scope: &Scope,
        filter: &SubscriptionFilter,
        page: &PageRequest,
    ) -> Result<Page<Subscription>, EngineError> {
        let (table, owner) = match &filter.customer_id {
            Some(customer) => (keys::SUBSCRIPTION_BY_CUSTOMER, Some(customer.as_str())),
            None => (keys::SUBSCRIPTION_LIST, None),
        };
        let prefix = ListingKey::prefix(table, &scope.store_id, scope.mode, owner);
        let cursor = cursor_from(page, |id| {
            let sub = self.get_subscription(scope, id)?;
            Ok(ListingKey::entry(
                table,
                &scope.store_id,
                scope.mode,
                owner,
                sub.created_at_ms,
                &sub.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let sub = self.get_subscription(scope, id)?;
                Ok(filter
                    .status
                    .is_none_or(|status| sub.status == status)
                    .then_some(sub))
            },
        )
    }

    /// Whether a purchase bills the customer's usage of the meter: a live
    /// subscription (active, trialing, past due or ending at its period's end)
    /// whose product prices it, or a purchase settling it in credits.
    pub fn usage_is_billed(
        &self,
        scope: &Scope,
        customer_id: &str,
        meter_id: &str,
    ) -> Result<bool, EngineError> {
        if crate::settlement::is_bound_to(
            self.journal.store().as_ref(),
            &scope.store_id,
            scope.mode,
            customer_id,
            meter_id,
        )? {
            return Ok(true);
        }
        let prefix = ListingKey::prefix(
            keys::SUBSCRIPTION_BY_CUSTOMER,
            &scope.store_id,
            scope.mode,
            Some(customer_id),
        );
        let mut ids = Vec::new();
        tally_projection::scan_prefix(
            self.journal.store().as_ref(),
            &prefix,
            true,
            &mut |key, _| {
                if let Ok(id) = ListingKey::id_in(&prefix, key) {
                    ids.push(id.to_string());
                }
                tally_projection::Visit::Continue
            },
        )?;
        for id in ids {
            let sub = self.get_subscription(scope, &id)?;
            let live = matches!(
                sub.status,
                SubscriptionStatus::Active
                    | SubscriptionStatus::Trialing
                    | SubscriptionStatus::PastDue
                    | SubscriptionStatus::ScheduledCancel
            );
            if live && sub.product.priced_meters().contains(meter_id) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Applies `change` to the current version (re-derived if another change got
    /// there first).
    async fn transition(
        &self,
        scope: &Scope,
        id: &str,
        change: impl Fn(&Subscription, i64) -> Result<Subscription, InvalidTransition>,
    ) -> Result<Subscription, EngineError> {
        self.journal
            .update(|| {
                let sub = self.get_subscription(scope, id)?;
                let now = self.now_in(scope).max(sub.updated_at_ms.saturating_add(1));
                let next = change(&sub, now).map_err(invalid_transition)?;
                Ok(Update::Write {
                    record: Record::SubscriptionChanged {
                        subscription: next.clone(),
                        payment: None,
                    },
                    base_updated_at_ms: sub.updated_at_ms,
                    result: next,
                })
            })
            .await
    }

    /// `POST /v1/subscriptions/{id}`: changes items (units of an item by `id`, an item
    /// without `id` added, an extra item with `units` 0 removed) and metadata,
    /// prorated as `update_behavior` says (default `proration-charge`).
    pub async fn update_subscription(
        &self,
        scope: &Scope,
        id: &str,
        input: &SubscriptionUpdate,
    ) -> Result<Subscription, EngineError> {
        let behavior = parse_behavior(
            input.update_behavior.as_deref(),
            UpdateBehavior::ProrationCharge,
        )?;
        // The limits a checkout's metadata (which a subscription starts with) has.
        if let Some(metadata) = &input.metadata {
            tally_domain::customer::validate_metadata(metadata)?;
        }
        let now = self.now_in(scope);
        let mut added = Vec::new();
        for (i, item) in input.items.iter().enumerate() {
            if item.id.is_none() {
                let param = format!("items[{i}].product_id");
                let product_id = item
                    .product_id
                    .as_deref()
                    .ok_or_else(|| FieldError::missing(param.clone()))?;
                let product = self
                    .get_product(scope, product_id)
                    .map_err(|e| e.for_param(&param))?;
                added.push((i, product));
            }
        }
        self.change_with_proration(scope, id, behavior, now, |sub| {
            let mut next = sub.clone();
            for (i, item) in input.items.iter().enumerate() {
                let param = format!("items[{i}].units");
                // Without `units` an item keeps its own (a new one gets 1).
                let units = item.units.unwrap_or_else(|| match item.id.as_deref() {
                    Some(item_id) if item_id == sub.item_id => next.units,
                    Some(item_id) => next
                        .extra_items
                        .iter()
                        .find(|x| x.id == item_id)
                        .map_or(1, |x| x.units),
                    None => 1,
                });
                if i64::from(units) > tally_domain::limits::MAX_CHECKOUT_UNITS {
                    return Err(FieldError::invalid(
                        param,
                        format!("at most {} units", tally_domain::limits::MAX_CHECKOUT_UNITS),
                    )
                    .into());
                }
                match item.id.as_deref() {
                    Some(item_id) if item_id == sub.item_id => {
                        if units == 0 {
                            return Err(FieldError::invalid(
                                param,
                                "the subscription's main item cannot be removed; cancel the subscription",
                            )
                            .into());
                        }
                        next.units = units;
                    }
                    Some(item_id) => {
                        let Some(pos) = next.extra_items.iter().position(|x| x.id == item_id) else {
                            // An unknown id is a missing resource, as an unknown
                            // product is: 404 naming the parameter.
                            return Err(EngineError::not_found("subscription item", item_id)
                                .for_param(&format!("items[{i}].id")));
                        };
                        if units == 0 {
                            let removed = next.extra_items.remove(pos);
                            // Its usage until now is still billed, by the next charge.
                            retire_item_usage_prices(sub, &removed, &mut next, now);
                        } else {
                            next.extra_items[pos].units = units;
                        }
                    }
                    None => {
                        let product = added
                            .iter()
                            .find(|(j, _)| *j == i)
                            .map(|(_, p)| p.clone())
                            .ok_or_else(|| EngineError::Corrupt("an added item".into()))?;
                        check_compatible(sub, &product, &format!("items[{i}].product_id"))?;
                        // One item per product, as a price is one item on a Stripe
                        // subscription: more of it is more units of that item.
                        if next.product.id == product.id
                            || next.extra_items.iter().any(|x| x.product.id == product.id)
                        {
                            return Err(FieldError::invalid(
                                format!("items[{i}].product_id"),
                                "the subscription has an item of this product already; set that item's units instead",
                            )
                            .into());
                        }
                        if units == 0 {
                            return Err(FieldError::invalid(param, "a new item needs units").into());
                        }
                        if next.extra_items.len() >= MAX_SUBSCRIPTION_ITEMS - 1 {
                            return Err(FieldError::invalid(
                                "items",
                                format!("at most {MAX_SUBSCRIPTION_ITEMS} items"),
                            )
                            .into());
                        }
                        next.extra_items.push(ExtraItem {
                            id: new_id("si"),
                            product,
                            units,
                            added_at_ms: now,
                        });
                    }
                }
            }
            if let Some(metadata) = &input.metadata {
                next.metadata = metadata.clone();
            }
            Ok(next)
        })
        .await
    }

    /// `POST /v1/subscriptions/{id}/upgrade {product_id, update_behavior}`: the main
    /// item moves to another product of the same currency and billing period,
    /// prorated (default `proration-charge-immediately`).
    pub async fn upgrade_subscription(
        &self,
        scope: &Scope,
        id: &str,
        product_id: Option<&str>,
        update_behavior: Option<&str>,
    ) -> Result<Subscription, EngineError> {
        let behavior = parse_behavior(update_behavior, UpdateBehavior::ProrationChargeImmediately)?;
        let product_id = product_id.ok_or_else(|| FieldError::missing("product_id"))?;
        let product = self
            .get_product(scope, product_id)
            .map_err(|e| e.for_param("product_id"))?;
        let now = self.now_in(scope);
        self.change_with_proration(scope, id, behavior, now, |sub| {
            check_compatible(sub, &product, "product_id")?;
            Ok(upgraded(sub, &product, now))
        })
        .await
    }

    /// Applies an item or product change derived from the current version, with
    /// its proration: charged now (a payment; a decline answers 402 and changes
    /// nothing; a credit goes to the next charge), carried to the next charge, or
    /// none. Only an active, trialing or cancel-scheduled subscription changes; a
    /// trial's change is not prorated (nothing was paid for it).
    async fn change_with_proration(
        &self,
        scope: &Scope,
        id: &str,
        behavior: UpdateBehavior,
        now: i64,
        change: impl Fn(&Subscription) -> Result<Subscription, EngineError>,
    ) -> Result<Subscription, EngineError> {
        self.journal
            .update(|| {
                let sub = self.get_subscription(scope, id)?;
                use SubscriptionStatus::*;
                if !matches!(sub.status, Active | Trialing | ScheduledCancel) {
                    return Err(EngineError::conflict(
                        "invalid_state_transition",
                        format!(
                            "a subscription that is {} cannot change its items or product",
                            sub.status.as_str()
                        ),
                    ));
                }
                let mut next = change(&sub)?;
                next.updated_at_ms = now.max(sub.updated_at_ms.saturating_add(1));
                let proration = proration(&sub, &next, behavior, now)?;
                let mut payment = None;
                if let Some(line) = proration {
                    let immediately = behavior == UpdateBehavior::ProrationChargeImmediately;
                    if immediately && line.amount > 0 {
                        payment = Some(self.charge_now(scope, &next, line, now)?);
                        next.last_transaction_id = payment.as_ref().map(|p: &Payment| p.id.clone());
                        next.last_transaction_at_ms = Some(now);
                    } else {
                        next.pending_lines.push(line);
                    }
                }
                Ok(Update::Write {
                    record: Record::SubscriptionChanged {
                        subscription: next.clone(),
                        payment,
                    },
                    base_updated_at_ms: sub.updated_at_ms,
                    result: next,
                })
            })
            .await
    }

    /// Charges one proration line now on the card on file (tax as the product's).
    fn charge_now(
        &self,
        scope: &Scope,
        sub: &Subscription,
        line: PaymentLine,
        now: i64,
    ) -> Result<Payment, EngineError> {
        let (country, rate) = self.customer_tax(scope, &sub.customer_id)?;
        let charge = price_charge(line.amount, 0, sub.product.tax_mode, rate)?;
        match self.provider(scope.mode) {
            Some(provider) => provider.charge_on_file(
                &card_of(sub),
                charge.amount_paid,
                &sub.product.currency,
                now,
            )?,
            None => {
                return Err(FieldError::new(
                    "payment_provider_not_configured",
                    "update_behavior",
                    "no payment provider is configured for live payments",
                )
                .into())
            }
        }
        Ok(Payment {
            id: new_id("txn").into(),
            store_id: sub.store_id.clone(),
            mode: sub.mode,
            payment_type: PaymentType::Payment,
            status: PaymentStatus::Paid,
            amount: charge.amount,
            currency: sub.product.currency.clone(),
            discount_amount: 0,
            tax_amount: charge.tax_amount,
            amount_paid: charge.amount_paid,
            refunded_amount: 0,
            tax_country: country,
            checkout_id: None,
            subscription_id: Some(sub.id.clone()),
            customer_id: sub.customer_id.clone(),
            description: format!("proration of {}", sub.product.name),
            period_start_ms: Some(now),
            period_end_ms: Some(sub.current_period_end_ms),
            refund_of: None,
            reason: None,
            disputed: false,
            card_last4: Some(sub.card_last4.clone()),
            card_declines_later: sub.card_declines_renewals,
            card_exp: sub.card_exp.clone(),
            affiliate_id: None,
            affiliate_commission: 0,
            lines: vec![line],
            created_at_ms: now,
            updated_at_ms: now,
        })
    }

    /// The store's billing settings (the defaults when never set).
    pub fn store_settings(&self, scope: &Scope) -> Result<StoreSettings, EngineError> {
        lifecycle::read_settings(self.journal.store().as_ref(), &scope.store_id, scope.mode)
    }

    /// `POST /v1/store/settings`: changes what is given, keeps the rest. A new
    /// grace applies to a subscription from its next charge; a new commission to
    /// conversions from now.
    pub async fn set_store_settings(
        &self,
        scope: &Scope,
        input: &SettingsInput,
    ) -> Result<StoreSettings, EngineError> {
        let mut settings = self.store_settings(scope)?;
        if let Some(text) = &input.default_cancel_mode {
            settings.default_cancel_mode = CancelMode::parse_field("default_cancel_mode", text)?;
        }
        if let Some(seconds) = input.late_usage_grace_seconds {
            let ms = i64::from(seconds) * 1000;
            if ms > tally_domain::subscription::MAX_LATE_USAGE_GRACE_MS {
                return Err(FieldError::invalid(
                    "late_usage_grace_seconds",
                    format!(
                        "at most {} seconds",
                        tally_domain::subscription::MAX_LATE_USAGE_GRACE_MS / 1000
                    ),
                )
                .into());
            }
            settings.late_usage_grace_ms = ms;
        }
        if let Some(text) = &input.affiliate_commission_percent {
            settings.affiliate_commission_percent =
                tally_domain::affiliate::parse_commission_percent(text)?;
        }
        match &input.referral_base_url {
            tally_domain::customer::Patch::Keep => {}
            tally_domain::customer::Patch::Clear => settings.referral_base_url = None,
            tally_domain::customer::Patch::Set(url) => {
                tally_domain::product::check_url("referral_base_url", url)?;
                settings.referral_base_url = Some(url.clone());
            }
        }
        self.journal
            .append_and_apply(&Record::StoreSettingsSet {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                settings: settings.clone(),
            })
            .await?;
        Ok(settings)
    }

    /// `POST /v1/subscriptions/{id}/cancel {mode, onExecute}`: `scheduled` (the
    /// store's default unless set otherwise) ends it at the end of the period (then
    /// canceled, or paused with `onExecute` `pause`); `immediate` now.
    pub async fn cancel_subscription(
        &self,
        scope: &Scope,
        id: &str,
        mode: Option<&str>,
        on_execute: Option<&str>,
    ) -> Result<Subscription, EngineError> {
        let mode = match mode {
            Some(text) => CancelMode::parse_field("mode", text)?,
            None => self.store_settings(scope)?.default_cancel_mode,
        };
        let on_execute = match (mode, on_execute) {
            (CancelMode::Scheduled, Some(text)) => OnExecute::parse_field("onExecute", text)?,
            _ => OnExecute::Cancel,
        };
        let canceled = self
            .transition(scope, id, |sub, now| cancel(sub, mode, on_execute, now))
            .await?;
        // A scheduled cancel of a period that has already ended (in the late-usage
        // grace, before the renewal is due) ends the period now, in this request, as
        // its end would have, rather than leave it `scheduled_cancel` with its
        // period over until the scheduler's next pass (docs/api.md, "Subscriptions").
        // Resuming does the same for a period that ended while paused.
        match canceled.due() {
            Some((at, DueKind::PeriodEnd)) if at <= self.now_in(scope) => {
                self.charge(scope, &canceled, at, DueKind::PeriodEnd)
                    .await?;
                self.get_subscription(scope, id)
            }
            _ => Ok(canceled),
        }
    }

    pub async fn pause_subscription(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<Subscription, EngineError> {
        self.transition(scope, id, pause).await
    }

    /// A resume whose paid period ended while paused starts a new period and charges
    /// it now, in this request (a decline leaves it `past_due`, as a renewal would).
    pub async fn resume_subscription(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<Subscription, EngineError> {
        let resumed = self.transition(scope, id, resume).await?;
        let fresh = resumed.current_period_start_ms == resumed.current_period_end_ms;
        if fresh && resumed.status == SubscriptionStatus::Active {
            let at = resumed.current_period_start_ms;
            self.charge(scope, &resumed, at, DueKind::Renewal).await?;
            return self.get_subscription(scope, id);
        }
        Ok(resumed)
    }

    /// Runs what is due on one subscription at `due_at` (read from the due index):
    /// nothing if it moved on meanwhile. Charges are priced from the product as
    /// bought, the discount while it lasts, the period's `invoice` usage from
    /// metering, and the customer's tax rate.
    pub async fn run_due(&self, scope: &Scope, id: &str, due_at: i64) -> Result<(), EngineError> {
        let sub = match self.get_subscription(scope, id) {
            Ok(sub) => sub,
            Err(EngineError::NotFound { .. }) => return Ok(()),
            Err(error) => return Err(error),
        };
        let Some((at, kind)) = sub.due().filter(|(at, _)| *at == due_at) else {
            return Ok(());
        };
        self.charge(scope, &sub, at, kind).await
    }

    /// Makes the charge `kind` on `sub` at `at` and moves the subscription on (or
    /// past due); a version that moved meanwhile charges nothing.
    async fn charge(
        &self,
        scope: &Scope,
        sub: &Subscription,
        at: i64,
        kind: DueKind,
    ) -> Result<(), EngineError> {
        let sub = sub.clone();
        // Usage accepted before now is billed with this charge: wait until what the
        // log holds is applied (what is still missed is billed later as late usage).
        self.journal.wait_caught_up().await?;
        let plan = charge_plan(&sub, kind);
        let Priced {
            lines,
            charge,
            country,
            billed_usage,
            carry,
        } = self.price(scope, &sub, &plan, None)?;
        // A period end with nothing to bill just ends the period; late usage with
        // none to bill just settles.
        let ends = matches!(kind, DueKind::PeriodEnd | DueKind::LateUsage);
        let nothing_to_charge = ends && charge.amount_paid == 0;
        // What a charge that bills no new period leaves: the subscription ended (a
        // period end) or its late usage settled.
        let settled = |sub: &Subscription| match kind {
            DueKind::LateUsage => after_late_usage(sub, at),
            _ => after_period_end(sub, at),
        };
        let (next, payment) = if nothing_to_charge {
            let mut next = settled(&sub);
            // Billed as nothing: late usage of the period is measured from there,
            // and a credit larger than the corrections' charges waits for the next
            // charge (a resume's), as it would after a paid one.
            next.billed_usage = billed_usage;
            next.pending_lines.extend(carry);
            (next, None)
        } else {
            let paid = match self.provider(scope.mode) {
                _ if charge.amount_paid == 0 => true,
                Some(provider) => {
                    match provider.charge_on_file(
                        &card_of(&sub),
                        charge.amount_paid,
                        &sub.product.currency,
                        at,
                    ) {
                        Ok(()) => true,
                        Err(EngineError::CardDeclined { .. }) => false,
                        Err(error) => return Err(error),
                    }
                }
                None => false,
            };
            if paid {
                let payment_id = new_id("txn");
                let period = plan
                    .base
                    .or(plan.usage)
                    .unwrap_or((sub.current_period_start_ms, sub.current_period_end_ms));
                let payment = Payment {
                    id: payment_id.clone().into(),
                    store_id: sub.store_id.clone(),
                    mode: sub.mode,
                    payment_type: PaymentType::Payment,
                    status: PaymentStatus::Paid,
                    amount: charge.amount,
                    currency: sub.product.currency.clone(),
                    discount_amount: charge.discount_amount,
                    tax_amount: charge.tax_amount,
                    amount_paid: charge.amount_paid,
                    refunded_amount: 0,
                    tax_country: country,
                    checkout_id: None,
                    subscription_id: Some(sub.id.clone()),
                    customer_id: sub.customer_id.clone(),
                    description: match kind {
                        DueKind::PeriodEnd => format!("final usage of {}", sub.product.name),
                        DueKind::LateUsage => format!("late usage of {}", sub.product.name),
                        _ => format!("renewal of {}", sub.product.name),
                    },
                    period_start_ms: Some(period.0),
                    period_end_ms: Some(period.1),
                    refund_of: None,
                    reason: None,
                    disputed: false,
                    card_last4: Some(sub.card_last4.clone()),
                    card_declines_later: sub.card_declines_renewals,
                    card_exp: sub.card_exp.clone(),
                    affiliate_id: None,
                    affiliate_commission: 0,
                    lines,
                    created_at_ms: at,
                    updated_at_ms: at,
                };
                let mut next = if ends {
                    let mut ended = settled(&sub);
                    ended.last_transaction_id = Some(payment.id.clone());
                    ended.last_transaction_at_ms = Some(at);
                    ended
                } else {
                    after_paid(&sub, &plan, at, &payment_id)
                };
                next.billed_usage = billed_usage;
                if let Some(carry) = carry {
                    next.pending_lines.push(carry);
                }
                (next, Some(payment))
            } else if ends {
                // The final (or late) usage was declined: the subscription ends as
                // scheduled, and nothing more is billed (no late usage is due).
                (settled(&sub), None)
            } else {
                (after_declined(&sub, &plan, at), None)
            }
        };
        let mut next = next;
        next.late_usage_grace_ms = self.store_settings(scope)?.late_usage_grace_ms;
        let declined = ends && !nothing_to_charge && payment.is_none();
        if kind == DueKind::PeriodEnd && !declined {
            next.late_usage_due_ms = late_usage_due(&next, &next.billed_usage);
        }
        let record = Record::SubscriptionChanged {
            subscription: next,
            payment,
        };
        match self
            .journal
            .append_and_decide_with(&record, Some(sub.updated_at_ms))
            .await
        {
            Ok(_) => Ok(()),
            // Another scheduler ran it first: nothing was charged twice.
            Err(EngineError::Conflict {
                code: "resource_changed",
                ..
            }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// The customer's country and the store's tax rate for it.
    fn customer_tax(
        &self,
        scope: &Scope,
        customer_id: &str,
    ) -> Result<(Option<String>, rust_decimal::Decimal), EngineError> {
        let country = self
            .customers
            .customer_country(scope, customer_id)?
            .flatten();
        let rate = self.tax_rate(scope, country.as_deref())?;
        Ok((country, rate))
    }

    /// What a billed period's corrections are now: the events its meter stopped
    /// counting (voided or amended) and the meter's revision (0: the meter is gone).
    fn corrections(
        &self,
        scope: &Scope,
        sub: &Subscription,
        billed: &BilledUsage,
    ) -> Result<(u64, u32), EngineError> {
        let voided = self.meters.period_voided_events(
            scope,
            &billed.meter_id,
            &sub.customer_id,
            billed.period_start_ms,
            billed.period_end_ms,
        )?;
        let revision = self
            .meters
            .meter_info(scope, &billed.meter_id)?
            .map_or(0, |meter| meter.revision);
        Ok((voided, revision))
    }

    /// Prices a charge `plan` makes on `sub`: its lines (usage counted up to
    /// `usage_until` instead of the plan's end, for a preview), the discount while it
    /// lasts, the customer's tax rate.
    fn price(
        &self,
        scope: &Scope,
        sub: &Subscription,
        plan: &ChargePlan,
        usage_until: Option<i64>,
    ) -> Result<Priced, EngineError> {
        let mut usage = Vec::new();
        for bill in usage_to_bill(sub, plan, usage_until) {
            let value = self.meters.period_usage(
                scope,
                &bill.price.meter_id,
                &sub.customer_id,
                bill.start_ms,
                bill.end_ms,
            )?;
            usage.push((bill, value));
        }
        let too_large =
            || EngineError::Corrupt(format!("the charge of subscription {} leaves i64", sub.id));
        let mut lines = charge_lines(sub, plan, &usage).ok_or_else(too_large)?;
        // Usage of periods billed before that arrived since: billed now, once.
        let now = self.now_in(scope);
        let horizon = now.saturating_sub(
            tally_domain::limits::MAX_EVENT_AGE_MS + tally_domain::limits::MAX_EVENT_FUTURE_SKEW_MS,
        );
        let mut billed_usage = Vec::new();
        for entry in &sub.billed_usage {
            // The price it was billed at; older entries name the product's.
            let Some(price) = entry.price.as_ref().or_else(|| {
                sub.product
                    .usage_prices
                    .iter()
                    .find(|p| p.id == entry.price_id)
            }) else {
                continue;
            };
            let current = self.meters.period_usage(
                scope,
                &entry.meter_id,
                &sub.customer_id,
                entry.period_start_ms,
                entry.period_end_ms,
            )?;
            let mut kept = entry.clone();
            // More than was billed: late usage; less: a correction took usage out
            // (docs/api.md, "Late usage and corrections"), credited on this charge.
            if let Some(current) = current.filter(|c| *c != entry.quantity) {
                let (quantity, amount) =
                    usage_adjustment(entry.quantity, current, price).ok_or_else(too_large)?;
                let (voided_events, meter_revision) = self.corrections(scope, sub, entry)?;
                lines.push(PaymentLine {
                    description: adjustment_description(
                        entry,
                        current > entry.quantity,
                        voided_events,
                        meter_revision,
                    ),
                    meter_id: Some(entry.meter_id.clone()),
                    quantity,
                    unit_price: price.unit_price,
                    amount,
                });
                kept.quantity = current;
                kept.voided_events = voided_events;
                kept.meter_revision = meter_revision;
            }
            // Past the horizon no event of the period can arrive any more.
            if kept.period_end_ms >= horizon {
                billed_usage.push(kept);
            }
        }
        for (bill, value) in &usage {
            let mut billed = BilledUsage {
                price_id: bill.price.id.clone(),
                meter_id: bill.price.meter_id.clone(),
                period_start_ms: bill.start_ms,
                period_end_ms: bill.end_ms,
                quantity: value.unwrap_or_default(),
                voided_events: 0,
                meter_revision: 0,
                price: Some(bill.price.clone()),
            };
            (billed.voided_events, billed.meter_revision) =
                self.corrections(scope, sub, &billed)?;
            billed_usage.push(billed);
        }
        let base = match plan.base {
            Some(_) => period_amount(sub).ok_or_else(too_large)?,
            None => 0,
        };
        let mut gross = lines
            .iter()
            .try_fold(0i64, |sum, l| sum.checked_add(l.amount))
            .ok_or_else(too_large)?;
        // Credits (a downgrade's proration) larger than the charge: the rest is
        // carried to the next one.
        let mut carry = None;
        if gross < 0 {
            lines.push(PaymentLine {
                description: "credit carried to the next charge".into(),
                meter_id: None,
                quantity: Decimal::ONE,
                unit_price: Decimal::from(-gross),
                amount: -gross,
            });
            carry = Some(PaymentLine {
                description: "credit carried from an earlier charge".into(),
                meter_id: None,
                quantity: Decimal::ONE,
                unit_price: Decimal::from(gross),
                amount: gross,
            });
            gross = 0;
        }
        let (country, rate) = self.customer_tax(scope, &sub.customer_id)?;
        let charge = price_charge(
            gross,
            discount_off(sub, base).min(gross),
            sub.product.tax_mode,
            rate,
        )?;
        Ok(Priced {
            lines,
            charge,
            country,
            billed_usage,
            carry,
        })
    }

    /// `GET /v1/subscriptions/{id}/upcoming`: the transaction the next charge would
    /// make, with the usage to date, writing nothing. `None`: nothing is due ahead.
    pub fn upcoming(&self, scope: &Scope, id: &str) -> Result<Option<Upcoming>, EngineError> {
        let sub = self.get_subscription(scope, id)?;
        self.upcoming_of(scope, &sub, None)
    }

    /// The next charge of `sub` as of now, carrying `proration` if it was moved
    /// there.
    fn upcoming_of(
        &self,
        scope: &Scope,
        sub: &Subscription,
        proration: Option<PaymentLine>,
    ) -> Result<Option<Upcoming>, EngineError> {
        // A subscription that ended has no next charge to show: what its last
        // period's late usage bills is charged once, after the grace.
        let Some((at, kind)) = sub.due().filter(|(_, kind)| *kind != DueKind::LateUsage) else {
            return Ok(None);
        };
        let plan = charge_plan(sub, kind);
        // Usage is counted by whole minutes: to date means through this minute.
        let through = self
            .now_in(scope)
            .saturating_add(tally_domain::time::MINUTE_MS);
        let priced = self.price(scope, sub, &plan, Some(through))?;
        Ok(Some(Upcoming {
            at_ms: at,
            period: plan.base.or(plan.usage),
            currency: sub.product.currency.clone(),
            lines: priced.lines,
            charge: priced.charge,
            proration_now: proration,
        }))
    }

    /// `GET /v1/subscriptions/{id}/upcoming?product_id=`: what an upgrade to the
    /// product now would charge at once (its proration, under the upgrade's default
    /// `proration-charge-immediately`) and at the next charge, writing nothing.
    pub fn preview_upgrade(
        &self,
        scope: &Scope,
        id: &str,
        product_id: &str,
    ) -> Result<Option<Upcoming>, EngineError> {
        let sub = self.get_subscription(scope, id)?;
        let product = self
            .get_product(scope, product_id)
            .map_err(|e| e.for_param("product_id"))?;
        check_compatible(&sub, &product, "product_id")?;
        let now = self.now_in(scope);
        let mut next = upgraded(&sub, &product, now);
        let line = proration(&sub, &next, UpdateBehavior::ProrationChargeImmediately, now)?;
        let (now_line, carried) = match line {
            Some(line) if line.amount > 0 => (Some(line), None),
            other => (None, other),
        };
        next.pending_lines.extend(carried);
        self.upcoming_of(scope, &next, now_line)
    }

    /// Runs, soonest first, everything due up to its scope's time in `mode` (of one
    /// store, or of all): at most `SCHEDULE_BATCH` items; how many it ran.
    /// `horizon`: no store's time is later (the scan stops there).
    pub async fn run_due_work(
        &self,
        mode: Mode,
        store: Option<&str>,
        horizon: i64,
        until: impl Fn(&str) -> i64,
    ) -> Result<usize, EngineError> {
        let (start, end) = keys::due_until(keys::SUBSCRIPTION_DUE, mode, horizon);
        let mut due = Vec::new();
        let mut failure = None;
        self.journal.store().scan(
            Bound::Included(&start),
            Bound::Excluded(&end),
            false,
            &mut |key, _| match lifecycle::read_due(key) {
                Ok((at, _, _)) if at > horizon => tally_projection::Visit::Stop,
                Ok((at, store_id, id)) => {
                    // A store another node serves is that node's to run.
                    if store.is_none_or(|s| s == store_id)
                        && at <= until(&store_id)
                        && self.journal.serves_store(&store_id)
                    {
                        due.push((at, store_id, id));
                    }
                    if due.len() >= SCHEDULE_BATCH {
                        tally_projection::Visit::Stop
                    } else {
                        tally_projection::Visit::Continue
                    }
                }
                Err(error) => {
                    failure = Some(error);
                    tally_projection::Visit::Stop
                }
            },
        )?;
        if let Some(error) = failure {
            return Err(error);
        }
        // Soonest first across stores; one store's items keep their order.
        due.sort();
        let ran = due.len();
        for (at, store_id, id) in due {
            let scope = Scope {
                store_id: store_id.into(),
                mode,
            };
            self.run_due(&scope, &id, at).await?;
        }
        Ok(ran)
    }

    /// The scope's test clock (docs/api.md, "Test clock"): test mode only.
    pub fn test_clock(&self, scope: &Scope) -> Result<i64, EngineError> {
        test_mode_only(scope)?;
        Ok(self.now_in(scope))
    }

    /// `POST /v1/test-clock/advance {to}`: moves the test store's time forward to
    /// `to` (never back, at most `MAX_TEST_CLOCK_ADVANCE_MS` at once) and runs,
    /// soonest first, everything due until then. Returns the new time.
    pub async fn advance_test_clock(
        &self,
        scope: &Scope,
        to: Option<&str>,
    ) -> Result<i64, EngineError> {
        test_mode_only(scope)?;
        let text = to.ok_or_else(|| FieldError::missing("to"))?;
        let to_ms = parse_iso8601_ms(text)
            .ok_or_else(|| FieldError::invalid("to", "`to` must be an ISO 8601 date-time"))?;
        let now = self.now_in(scope);
        if to_ms < now {
            return Err(FieldError::new(
                lifecycle::TEST_CLOCK_BACKWARDS,
                "to",
                "the test clock only moves forward; `to` is before the store's test time",
            )
            .into());
        }
        if to_ms - now > MAX_TEST_CLOCK_ADVANCE_MS {
            return Err(FieldError::invalid(
                "to",
                format!(
                    "one advance moves the test clock at most {} days; advance in steps",
                    MAX_TEST_CLOCK_ADVANCE_MS / tally_domain::time::DAY_MS
                ),
            )
            .into());
        }
        // Due work runs at its own time, soonest first, before the clock moves past
        // it: each step sets the clock to the next due instant, runs it, and goes on.
        // An item that stays due at the same instant after being run (it could not
        // move on) stops the advance instead of spinning.
        let mut stalled = (None, 0u32);
        loop {
            let next = self.next_due(scope, to_ms)?;
            let step = next.unwrap_or(to_ms);
            self.set_test_clock(scope, step).await?;
            if next.is_none() {
                break;
            }
            stalled = match stalled {
                (Some(at), n) if at == step => (Some(at), n + 1),
                _ => (Some(step), 0),
            };
            if stalled.1 >= MAX_STALLED_STEPS {
                return Err(EngineError::Unavailable {
                    code: "test_clock_stalled",
                    message: "work due on the test clock could not run; the clock stopped at it (see the server log)",
                });
            }
            self.run_due_work(scope.mode, Some(&scope.store_id), step, |_| step)
                .await?;
        }
        Ok(self.now_in(scope))
    }

    /// The soonest due instant of the test store, if any is at or before `until`.
    fn next_due(&self, scope: &Scope, until: i64) -> Result<Option<i64>, EngineError> {
        let (start, end) = keys::due_until(keys::SUBSCRIPTION_DUE, scope.mode, until);
        let mut found = None;
        let mut failure = None;
        self.journal.store().scan(
            Bound::Included(&start),
            Bound::Excluded(&end),
            false,
            &mut |key, _| match lifecycle::read_due(key) {
                Ok((at, _, _)) if at > until => tally_projection::Visit::Stop,
                Ok((at, store_id, _)) if store_id == scope.store_id.as_ref() => {
                    found = Some(at);
                    tally_projection::Visit::Stop
                }
                Ok(_) => tally_projection::Visit::Continue,
                Err(error) => {
                    failure = Some(error);
                    tally_projection::Visit::Stop
                }
            },
        )?;
        match failure {
            Some(error) => Err(error),
            None => Ok(found),
        }
    }

    async fn set_test_clock(&self, scope: &Scope, to_ms: i64) -> Result<(), EngineError> {
        if to_ms <= self.now_in(scope) {
            return Ok(());
        }
        self.journal
            .append_and_apply(&Record::TestClockSet {
                store_id: scope.store_id.clone(),
                to_ms,
            })
            .await
    }

    /// Runs due work until `shutdown` turns true: production on the wall clock, test
    /// stores on their test clocks (which move on with it), every
    /// `SCHEDULE_POLL_MS`. Work due while the node was down runs once at start.
    pub async fn run_scheduler(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tokio::time::sleep(std::time::Duration::from_millis(SCHEDULE_POLL_MS)) => {}
            }
            if self.journal.check_writable().is_err() {
                continue;
            }
            for mode in [Mode::Prod, Mode::Test] {
                loop {
                    let now = |store: &str| {
                        self.journal.now_in(&Scope {
                            store_id: store.into(),
                            mode,
                        })
                    };
                    let horizon = match mode {
                        Mode::Prod => self.journal.now_ms(),
                        Mode::Test => self.journal.latest_test_time(),
                    };
                    match self.run_due_work(mode, None, horizon, now).await {
                        Ok(n) if n >= SCHEDULE_BATCH => continue,
                        Ok(_) => break,
                        Err(error) => {
                            tracing::warn!(%error, "scheduled subscription work deferred; it is retried");
                            break;
                        }
                    }
                }
            }
            // Priced auto-recharges wait for their charge here too.
            loop {
                match self.charge_recharges().await {
                    Ok(n) if n >= crate::recharges::RECHARGE_BATCH => continue,
                    Ok(_) => break,
                    Err(error) => {
                        tracing::warn!(%error, "auto-recharge charges deferred; they are retried");
                        break;
                    }
                }
            }
        }
    }
}

/// The proration of moving `sub` to `next` at `now` under `behavior`: none for a
/// trial (nothing was paid for it) or under `proration-none`.
fn proration(
    sub: &Subscription,
    next: &Subscription,
    behavior: UpdateBehavior,
    now: i64,
) -> Result<Option<PaymentLine>, EngineError> {
    if sub.status == SubscriptionStatus::Trialing || behavior == UpdateBehavior::ProrationNone {
        return Ok(None);
    }
    let too_large = || EngineError::Corrupt(format!("the items of {} leave i64", sub.id));
    let old = period_amount(sub).ok_or_else(too_large)?;
    let new = period_amount(next).ok_or_else(too_large)?;
    let period = (sub.current_period_start_ms, sub.current_period_end_ms);
    Ok(proration_line(old, new, period, now, "items changed"))
}

/// The card a subscription renews on.
fn card_of(sub: &Subscription) -> crate::CardOnFile {
    crate::CardOnFile {
        last4: sub.card_last4.clone(),
        declines_later: sub.card_declines_renewals,
        exp: sub.card_exp.clone(),
    }
}

/// A priced charge.
struct Priced {
    lines: Vec<PaymentLine>,
    charge: Charge,
    country: Option<String>,
    /// The subscription's billed usage once this charge is paid.
    billed_usage: Vec<BilledUsage>,
    /// A credit the charge could not use, for the next one.
    carry: Option<PaymentLine>,
}

/// What the next charge of a subscription would be.
#[derive(Debug, Clone)]
pub struct Upcoming {
    /// When it is due.
    pub at_ms: i64,
    pub period: Option<(i64, i64)>,
    pub currency: String,
    pub lines: Vec<PaymentLine>,
    pub charge: Charge,
    /// An upgrade preview: the proration charged at once.
    pub proration_now: Option<PaymentLine>,
}

fn test_mode_only(scope: &Scope) -> Result<(), EngineError> {
    match scope.mode {
        Mode::Test => Ok(()),
        Mode::Prod => Err(FieldError::new(
            "test_mode_only",
            "to",
            "the test clock exists in test mode only; use a test key",
        )
        .into()),
    }
}
