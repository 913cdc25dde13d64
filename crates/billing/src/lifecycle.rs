//! The subscription lifecycle's apply (docs/api.md, "Subscriptions"): a
//! subscription's new state, decided by its service from the version it read and
//! applied only over that version, so a renewal, a retry or a period end is applied
//! once however many schedulers (nodes, restarts, test-clock advances) derived it;
//! the scheduler's index of what is due (table `9`); the listings (tables `%` `&`);
//! the stores' test clocks (table `0`); and the events a transition emits, decided
//! here from the two versions.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::{check_base, Outcome};
use tally_core::overlay::{ApplyError, Overlay};
use tally_domain::billing::{Payment, Subscription, SubscriptionStatus};
use tally_domain::record::{BillingEvent, BillingObject};
use tally_domain::subscription::ExtraItem;
use tally_domain::Mode;

use crate::apply::{payment_key, put_events, put_payment, subscription_key};

/// Outcome code of a test clock set backwards.
pub const TEST_CLOCK_BACKWARDS: &str = "test_clock_backwards";

/// The scheduler's index row of what is due on `sub`, if anything.
pub fn due_key(sub: &Subscription) -> Option<Vec<u8>> {
    let (at, _) = sub.due()?;
    Some(due_entry(sub.mode, at, &sub.store_id, &sub.id))
}

fn due_entry(mode: Mode, at_ms: i64, store_id: &str, id: &str) -> Vec<u8> {
    Key::table(keys::SUBSCRIPTION_DUE)
        .mode(mode)
        .int(at_ms)
        .text(store_id)
        .text(id)
        .into_bytes()
}

/// A due row read back: (due at, store, subscription id).
pub fn read_due(key: &[u8]) -> Result<(i64, String, String), EngineError> {
    let bad = || EngineError::Corrupt("a subscription due row".into());
    let at = key.get(2..10).map(keys::read_int).ok_or_else(bad)?;
    let (store, next) = keys::read_text(key, 10).ok_or_else(bad)?;
    let (id, _) = keys::read_text(key, next).ok_or_else(bad)?;
    Ok((at, store.to_string(), id.to_string()))
}

/// Writes a subscription first created (a checkout's completion): its listings and
/// what is due.
pub fn put_new_subscription(overlay: &mut Overlay<'_>, sub: &Subscription) {
    let (store_id, mode) = (&sub.store_id, sub.mode);
    overlay.put(
        ListingKey::entry(
            keys::SUBSCRIPTION_LIST,
            store_id,
            mode,
            None,
            sub.created_at_ms,
            &sub.id,
        ),
        Vec::new(),
    );
    overlay.put(
        ListingKey::entry(
            keys::SUBSCRIPTION_BY_CUSTOMER,
            store_id,
            mode,
            Some(&sub.customer_id),
            sub.created_at_ms,
            &sub.id,
        ),
        Vec::new(),
    );
    if let Some(due) = due_key(sub) {
        overlay.put(due, Vec::new());
    }
    overlay.put(
        subscription_key(store_id, mode, &sub.id),
        codec::encode_subscription(sub),
    );
}

/// A subscription's new state, with the payment its charge made. Refused unless the
/// stored version is the record's base (someone else moved it first), the identity
/// is unchanged, and a payment is new, paid, of this subscription and adds up.
pub fn apply_subscription_changed(
    overlay: &mut Overlay<'_>,
    sub: &Subscription,
    payment: Option<&Payment>,
    base_updated_at_ms: Option<i64>,
    customer_at: crate::apply::CustomerAt<'_>,
) -> Result<(Vec<BillingEvent>, Vec<crate::apply::CheckoutGrant>), ApplyError> {
    let (store_id, mode) = (&sub.store_id, sub.mode);
    let key = subscription_key(store_id, mode, &sub.id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(Outcome::rejected(
            "resource_missing",
            format!("no such subscription: '{}'", sub.id),
        )
        .into());
    };
    let before = codec::decode_subscription(&bytes)?;
    // A lifecycle change is always derived from a version: without one it could
    // undo another's.
    check_base(
        Some(base_updated_at_ms.unwrap_or(i64::MIN)),
        Some(before.updated_at_ms),
    )?;
    let same_identity = before.customer_id == sub.customer_id
        && before.created_at_ms == sub.created_at_ms
        && sub.updated_at_ms > before.updated_at_ms;
    if !same_identity {
        return Err(changed(
            "the subscription's identity or version does not follow",
        ));
    }
    if let Some(payment) = payment {
        let adds_up = payment
            .amount
            .checked_sub(payment.discount_amount)
            .and_then(|a| a.checked_add(payment.tax_amount))
            == Some(payment.amount_paid);
        let ours = payment.subscription_id.as_ref() == Some(&sub.id)
            && payment.customer_id == sub.customer_id
            && payment.store_id == sub.store_id
            && payment.mode == sub.mode
            && payment.refunded_amount == 0
            && [payment.amount, payment.discount_amount, payment.tax_amount]
                .iter()
                .all(|a| *a >= 0);
        if !adds_up || !ours {
            return Err(changed("the renewal's payment does not add up"));
        }
        if overlay
            .get(&payment_key(store_id, mode, &payment.id))?
            .is_some()
        {
            return Err(changed("the payment id is taken already"));
        }
        put_payment(overlay, payment, true);
    }
    if let Some(old) = due_key(&before) {
        overlay.delete(old);
    }
    if let Some(new) = due_key(sub) {
        overlay.put(new, Vec::new());
    }
    rebind(overlay, &before, sub)?;
    overlay.put(key, codec::encode_subscription(sub));
    let last_transaction = match payment {
        Some(payment) => Some(payment.clone()),
        None => stored_payment(overlay, sub)?,
    };
    let customer = customer_at(overlay, store_id, mode, &sub.customer_id)?;
    let events = transition_events(
        &before,
        sub,
        payment.is_some(),
        (customer, last_transaction),
    );
    put_events(overlay, store_id, mode, &events);
    Ok((events, period_grants(&before, sub, payment)))
}

/// The credits a change grants. A charge that paid a new period (a renewal, a
/// trial's end, a paid retry, a resume's new period) grants the product's
/// `customer_credits` features for the subscription's units, and each add-on
/// item's for its units, once per period. An item added to a live subscription
/// grants its product's credits when it is added, as a checkout grants the first
/// period's (docs/api.md, "Subscriptions"). A proration pays no new period
/// and a final usage charge ends the subscription: neither grants.
fn period_grants(
    before: &Subscription,
    after: &Subscription,
    payment: Option<&Payment>,
) -> Vec<crate::apply::CheckoutGrant> {
    let mut grants = Vec::new();
    if matches!(
        after.status,
        SubscriptionStatus::Active | SubscriptionStatus::Trialing
    ) {
        for item in after
            .extra_items
            .iter()
            .filter(|item| !has_item(before, item))
        {
            grants.extend(crate::apply::product_grants(
                &after.customer_id,
                &item.product,
                item.units,
                &format!("item:{}:{}", after.id, item.id),
            ));
        }
    }
    let Some(payment) = payment else {
        return grants;
    };
    let pays_current_period = payment.period_start_ms == Some(after.current_period_start_ms)
        && payment.period_end_ms == Some(after.current_period_end_ms);
    let moved_on = (
        before.status,
        before.current_period_start_ms,
        before.current_period_end_ms,
    ) != (
        after.status,
        after.current_period_start_ms,
        after.current_period_end_ms,
    );
    if after.status != SubscriptionStatus::Active || !pays_current_period || !moved_on {
        return grants;
    }
    let period = format!("period:{}:{}", after.id, after.current_period_start_ms);
    grants.extend(crate::apply::product_grants(
        &after.customer_id,
        &after.product,
        after.units,
        &period,
    ));
    for item in &after.extra_items {
        grants.extend(crate::apply::product_grants(
            &after.customer_id,
            &item.product,
            item.units,
            &format!("{period}:{}", item.id),
        ));
    }
    grants
}

/// Whether `on` has the add-on item `item` (by its id).
fn has_item(on: &Subscription, item: &ExtraItem) -> bool {
    on.extra_items.iter().any(|i| i.id == item.id)
}

/// Whether a subscription's `credits` usage is settled in this status.
fn settles_usage(status: SubscriptionStatus) -> bool {
    use SubscriptionStatus::*;
    matches!(status, Active | Trialing | PastDue | ScheduledCancel)
}

/// Usage settled in credits follows the subscription: its bindings end when it
/// stops (canceled, paused, unpaid) or changes product, and start again when it is
/// live again or on the new product, from the change's time.
fn rebind(
    overlay: &mut Overlay<'_>,
    before: &Subscription,
    after: &Subscription,
) -> Result<(), EngineError> {
    let at = after.updated_at_ms;
    let product_changed = before.product.id != after.product.id
        || before.product.usage_prices != after.product.usage_prices;
    let (was, is) = (settles_usage(before.status), settles_usage(after.status));
    if was && (!is || product_changed) {
        crate::settlement::end_bindings(
            overlay,
            &before.customer_id,
            &before.id,
            &before.product,
            at,
        )?;
    }
    if is && (!was || product_changed) {
        crate::settlement::bind_purchase(
            overlay,
            &after.customer_id,
            &after.id,
            &after.product,
            (after.billing_anchor_ms, at),
            after.trial_end_ms,
        )?;
    }
    // Add-on items: an item's prices settle while it is on a live subscription.
    if was {
        for item in &before.extra_items {
            if !is || !has_item(after, item) {
                crate::settlement::end_bindings(
                    overlay,
                    &before.customer_id,
                    &before.id,
                    &item.product,
                    at,
                )?;
            }
        }
    }
    if is {
        for item in &after.extra_items {
            if !was || !has_item(before, item) {
                crate::settlement::bind_purchase(
                    overlay,
                    &after.customer_id,
                    &after.id,
                    &item.product,
                    (after.billing_anchor_ms, at),
                    after.trial_end_ms,
                )?;
            }
        }
    }
    Ok(())
}

fn changed(message: &str) -> ApplyError {
    Outcome::rejected("resource_changed", message.to_string()).into()
}

/// The events a move from `before` to `after` emits (docs/api.md, "Subscriptions").
/// The subscription's last transaction as stored now (at the event), if any.
fn stored_payment(
    overlay: &Overlay<'_>,
    sub: &Subscription,
) -> Result<Option<Payment>, EngineError> {
    let Some(id) = &sub.last_transaction_id else {
        return Ok(None);
    };
    overlay
        .get(&payment_key(&sub.store_id, sub.mode, id))?
        .map(|bytes| codec::decode_payment(&bytes))
        .transpose()
}

fn transition_events(
    before: &Subscription,
    after: &Subscription,
    paid: bool,
    (customer, last_transaction): (Option<tally_domain::customer::Customer>, Option<Payment>),
) -> Vec<BillingEvent> {
    use SubscriptionStatus::*;
    let mut types = Vec::new();
    if paid {
        if matches!(before.status, Trialing | PastDue) && after.status == Active {
            types.push("subscription.active");
        }
        types.push("subscription.paid");
    }
    if before.status != after.status {
        match after.status {
            PastDue => types.push("subscription.past_due"),
            Unpaid => {
                types.push("subscription.unpaid");
                // The period ended with nothing paid.
                types.push("subscription.expired");
            }
            Canceled => types.push("subscription.canceled"),
            ScheduledCancel => types.push("subscription.scheduled_cancel"),
            Paused => types.push("subscription.paused"),
            Active if before.status == Paused => types.push("subscription.active"),
            _ => {}
        }
    }
    let items_changed = before.product.id != after.product.id
        || before.units != after.units
        || before.extra_items != after.extra_items
        || before.metadata != after.metadata;
    // Late usage of an ended subscription's last period settled with nothing to
    // charge: nothing the integrator sees changed.
    let late_usage_settled_quietly = !paid
        && before.status == after.status
        && before.late_usage_due_ms.is_some()
        && after.late_usage_due_ms.is_none();
    if (types.is_empty() && !late_usage_settled_quietly) || items_changed {
        types.push("subscription.update");
    }
    types
        .into_iter()
        .map(|event_type| BillingEvent {
            // One version of one subscription emits each type at most once.
            id: tally_core::ids::derived_id(
                "evt",
                &format!("{}:{}:{event_type}", after.id, after.updated_at_ms),
            ),
            event_type: event_type.to_string(),
            created_at_ms: after.updated_at_ms,
            object: BillingObject::Subscription {
                subscription: after.clone(),
                customer: customer.clone(),
                last_transaction: last_transaction.clone(),
            },
        })
        .collect()
}

fn clock_key(store_id: &str) -> Vec<u8> {
    Key::table(keys::TEST_CLOCK).text(store_id).into_bytes()
}

/// A store's test clock as stored: (`to_ms`, set at).
pub fn read_test_clock(bytes: &[u8]) -> Result<(i64, i64), EngineError> {
    if bytes.len() != 16 {
        return Err(EngineError::Corrupt("a test clock row".into()));
    }
    Ok((keys::read_int(&bytes[..8]), keys::read_int(&bytes[8..])))
}

/// Sets a store's test clock; never backwards (what it shows at the record's time).
pub fn apply_test_clock(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    to_ms: i64,
    recorded_at_ms: i64,
) -> Result<(), ApplyError> {
    let key = clock_key(store_id);
    if let Some(bytes) = overlay.get(&key)? {
        let (to, at) = read_test_clock(&bytes)?;
        let shown = tally_core::journal::test_time(to, at, recorded_at_ms);
        if to_ms < shown {
            return Err(Outcome::rejected(
                TEST_CLOCK_BACKWARDS,
                "the test clock only moves forward",
            )
            .with_param("to")
            .into());
        }
    }
    // Two ints in the key encoding (`keys::read_int` reads them back).
    let value = Key::table(keys::TEST_CLOCK)
        .int(to_ms)
        .int(recorded_at_ms)
        .into_bytes()
        .split_off(1);
    overlay.put(key, value);
    Ok(())
}

/// Every store's test clock: (store, `to_ms`, set at), for the journal's cache.
pub fn test_clocks(
    store: &dyn tally_projection::ProjectionStore,
) -> Result<Vec<(String, i64, i64)>, EngineError> {
    tally_core::pagination::collect_prefix(
        store,
        &[keys::TEST_CLOCK],
        false,
        usize::MAX,
        |key, value| {
            let (store_id, _) = keys::read_text(key, 1)
                .ok_or_else(|| EngineError::Corrupt("a test clock key".into()))?;
            let (to, at) = read_test_clock(value)?;
            Ok(Some((store_id.to_string(), to, at)))
        },
    )
}

fn settings_key(store_id: &str, mode: Mode) -> Vec<u8> {
    Key::scoped(keys::STORE_SETTINGS, store_id, mode).into_bytes()
}

/// A store's billing settings as stored (the defaults when never set).
pub fn read_settings(
    store: &dyn tally_projection::ProjectionStore,
    store_id: &str,
    mode: Mode,
) -> Result<tally_domain::subscription::StoreSettings, EngineError> {
    match store.get(&settings_key(store_id, mode))? {
        Some(bytes) => codec::decode_store_settings(&bytes),
        None => Ok(Default::default()),
    }
}

/// A store's billing settings as apply sees them (this chunk's writes included).
pub fn read_settings_in(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
) -> Result<tally_domain::subscription::StoreSettings, EngineError> {
    match overlay.get(&settings_key(store_id, mode))? {
        Some(bytes) => codec::decode_store_settings(&bytes),
        None => Ok(Default::default()),
    }
}

/// A store's billing settings, replaced whole.
pub fn apply_store_settings(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    settings: &tally_domain::subscription::StoreSettings,
) {
    overlay.put(
        settings_key(store_id, mode),
        codec::encode_store_settings(store_id, mode, settings),
    );
}
