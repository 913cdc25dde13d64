//! Billing's apply: products, discounts, checkouts, payments, refunds and disputes
//! folded into the projection in log order. Every rule that guards money is decided
//! here (the services' checks are fast paths; ARCHITECTURE.md, "Decisions in
//! apply"): a priced meter exists and is active, a discount code is unique and not
//! redeemed past its limit, a checkout is paid once, a refund fits what is left. The
//! `Z` index metering's apply reads to refuse archiving a priced meter is kept here.

use rust_decimal::Decimal;
use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::{check_base, Outcome};
use tally_core::overlay::{ApplyError, Overlay};
use tally_domain::billing::{
    check_sold, Checkout, CheckoutStatus, Discount, Dispute, Payment, PaymentType,
    SubscriptionStatus,
};
use tally_domain::meter::MeterStatus;
use tally_domain::product::Product;
use tally_domain::record::{BillingEvent, BillingObject, CheckoutCompletion};
use tally_domain::usage::canonical_decimal;
use tally_domain::{FieldError, Mode};

use crate::products::{meter_missing, meter_not_active};

/// A product, created or updated.
pub fn apply_product(
    overlay: &mut Overlay<'_>,
    product: &Product,
    base_updated_at_ms: Option<i64>,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&product.store_id, product.mode);
    let key = product_key(store_id, mode, &product.id);
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_product(&b))
        .transpose()?;
    check_base(
        base_updated_at_ms,
        previous.as_ref().map(|p| p.updated_at_ms),
    )?;
    let newly_priced: Vec<&str> = match &previous {
        Some(old) => {
            let old_priced = old.priced_meters();
            product
                .priced_meters()
                .into_iter()
                .filter(|m| !old_priced.contains(m))
                .collect()
        }
        None => product.priced_meters().into_iter().collect(),
    };
    for (i, price) in product.usage_prices.iter().enumerate() {
        if !newly_priced.contains(&price.meter_id.as_str()) {
            continue;
        }
        let meter_key = keys::meter_key(store_id, mode, &price.meter_id);
        let param = format!("usage_prices[{i}].meter_id");
        match overlay.get(&meter_key)? {
            None => return Err(meter_missing(&price.meter_id, &param).into()),
            Some(bytes) => {
                if codec::decode_meter(&bytes)?.status != MeterStatus::Active {
                    return Err(meter_not_active(&price.meter_id, &param).into());
                }
            }
        }
    }
    if let Some(old) = &previous {
        for meter_id in old.priced_meters() {
            overlay.delete(priced_key(store_id, mode, meter_id, &product.id));
        }
    } else {
        overlay.put(
            ListingKey::entry(
                keys::PRODUCT_LIST,
                store_id,
                mode,
                None,
                product.created_at_ms,
                &product.id,
            ),
            Vec::new(),
        );
    }
    for meter_id in product.priced_meters() {
        overlay.put(
            priced_key(store_id, mode, meter_id, &product.id),
            Vec::new(),
        );
    }
    overlay.put(key, codec::encode_product(product));
    Ok(())
}

pub fn product_key(store_id: &str, mode: tally_domain::Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::PRODUCT, store_id, mode)
        .text(id)
        .into_bytes()
}

/// The `Z` row saying `meter_id` is priced on the active product `product_id`.
pub fn priced_key(
    store_id: &str,
    mode: tally_domain::Mode,
    meter_id: &str,
    product_id: &str,
) -> Vec<u8> {
    let mut key = keys::meter_priced_prefix(store_id, mode, meter_id);
    key.extend_from_slice(product_id.as_bytes());
    key.push(0);
    key
}

/// A rule of the domain broken in log order: refused with its code and field.
fn refused(error: FieldError) -> ApplyError {
    let param = error.param.clone();
    Outcome::rejected(error.code, error.message)
        .with_param(&param)
        .into()
}

fn missing(resource: &str, id: &str, param: &str) -> ApplyError {
    Outcome::rejected("resource_missing", format!("no {resource} '{id}'"))
        .with_param(param)
        .into()
}

pub fn discount_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::DISCOUNT, store_id, mode)
        .text(id)
        .into_bytes()
}

/// The row of a code customers type (a discount's, a referral code) in `table`:
/// codes are unique and found whatever their case (docs/api.md, "Discounts",
/// "Affiliates"), so the row is keyed by the code in lower case; the resource keeps
/// the case it was created with.
pub(crate) fn code_key(table: u8, store_id: &str, mode: Mode, code: &str) -> Vec<u8> {
    Key::scoped(table, store_id, mode)
        .text(&code.to_ascii_lowercase())
        .into_bytes()
}

/// What a code's row in `table` names, read through `get` (the overlay in apply, the
/// store in a service): its lower-case row, else the row a build before
/// case-insensitive codes wrote under the code as given.
pub(crate) fn code_row(
    get: impl Fn(&[u8]) -> Result<Option<Vec<u8>>, EngineError>,
    table: u8,
    store_id: &str,
    mode: Mode,
    code: &str,
) -> Result<Option<String>, EngineError> {
    let exact = || Key::scoped(table, store_id, mode).text(code).into_bytes();
    let row = match get(&code_key(table, store_id, mode, code))? {
        Some(row) => Some(row),
        None => get(&exact())?,
    };
    Ok(row.map(|id| String::from_utf8_lossy(&id).into_owned()))
}

pub fn discount_code_key(store_id: &str, mode: Mode, code: &str) -> Vec<u8> {
    code_key(keys::DISCOUNT_CODE, store_id, mode, code)
}

pub fn checkout_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::CHECKOUT, store_id, mode)
        .text(id)
        .into_bytes()
}

pub fn payment_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::PAYMENT, store_id, mode)
        .text(id)
        .into_bytes()
}

pub fn subscription_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::SUBSCRIPTION, store_id, mode)
        .text(id)
        .into_bytes()
}

pub fn dispute_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::DISPUTE, store_id, mode)
        .text(id)
        .into_bytes()
}

pub fn tax_rate_key(store_id: &str, mode: Mode, country: &str) -> Vec<u8> {
    Key::scoped(keys::TAX_RATE, store_id, mode)
        .text(country)
        .into_bytes()
}

/// 409 `discount_code_taken`: a code names one discount of a store and environment,
/// for good (a deleted discount keeps its code, so old receipts stay unambiguous).
pub fn discount_code_taken(code: &str) -> Outcome {
    Outcome::rejected(
        "discount_code_taken",
        format!("the discount code '{code}' is already used in this store and environment"),
    )
    .with_param("code")
}

/// 400: a limit below the redemptions already made.
pub fn max_below_redeemed(redeemed: u32) -> FieldError {
    FieldError::invalid(
        "max_redemptions",
        format!("`max_redemptions` cannot go below the {redeemed} redemptions already made"),
    )
}

/// A discount, created, updated or deleted; its code is decided unique here.
pub fn apply_discount(
    overlay: &mut Overlay<'_>,
    discount: &Discount,
    base_updated_at_ms: Option<i64>,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&discount.store_id, discount.mode);
    let key = discount_key(store_id, mode, &discount.id);
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_discount(&b))
        .transpose()?;
    check_base(
        base_updated_at_ms,
        previous.as_ref().map(|d| d.updated_at_ms),
    )?;
    // Redemptions are counted here only: an update carries the count it read,
    // the stored one stands.
    let mut discount = discount.clone();
    if let Some(old) = &previous {
        discount.redeem_count = old.redeem_count;
        if discount
            .max_redemptions
            .is_some_and(|max| max < old.redeem_count)
        {
            return Err(refused(max_below_redeemed(old.redeem_count)));
        }
    }
    match &previous {
        Some(old) if old.code != discount.code => {
            return Err(
                Outcome::rejected("parameter_invalid", "a discount's code cannot change")
                    .with_param("code")
                    .into(),
            )
        }
        Some(_) => {}
        None => {
            let code_key = discount_code_key(store_id, mode, &discount.code);
            if overlay.get(&code_key)?.is_some() {
                return Err(discount_code_taken(&discount.code).into());
            }
            overlay.put(code_key, discount.id.as_bytes().to_vec());
            overlay.put(
                ListingKey::entry(
                    keys::DISCOUNT_LIST,
                    store_id,
                    mode,
                    None,
                    discount.created_at_ms,
                    &discount.id,
                ),
                Vec::new(),
            );
        }
    }
    overlay.put(key, codec::encode_discount(&discount));
    Ok(())
}

/// A new checkout: nothing to decide (completion decides).
pub fn apply_checkout_created(
    overlay: &mut Overlay<'_>,
    checkout: &Checkout,
) -> Result<(), ApplyError> {
    let key = checkout_key(&checkout.store_id, checkout.mode, &checkout.id);
    if overlay.get(&key)?.is_some() {
        return Err(Outcome::rejected("resource_changed", "the checkout exists already").into());
    }
    overlay.put(key, codec::encode_checkout(checkout));
    overlay.put(
        ListingKey::entry(
            keys::CHECKOUT_LIST,
            &checkout.store_id,
            checkout.mode,
            None,
            checkout.created_at_ms,
            &checkout.id,
        ),
        Vec::new(),
    );
    Ok(())
}

pub(crate) fn put_payment(overlay: &mut Overlay<'_>, payment: &Payment, new: bool) {
    let (store_id, mode) = (&payment.store_id, payment.mode);
    if new {
        let at = payment.created_at_ms;
        overlay.put(
            ListingKey::entry(keys::PAYMENT_LIST, store_id, mode, None, at, &payment.id),
            Vec::new(),
        );
        overlay.put(
            ListingKey::entry(
                keys::PAYMENT_BY_CUSTOMER,
                store_id,
                mode,
                Some(&payment.customer_id),
                at,
                &payment.id,
            ),
            Vec::new(),
        );
        if let Some(subscription) = &payment.subscription_id {
            overlay.put(
                ListingKey::entry(
                    keys::PAYMENT_BY_SUBSCRIPTION,
                    store_id,
                    mode,
                    Some(subscription),
                    at,
                    &payment.id,
                ),
                Vec::new(),
            );
        }
    }
    overlay.put(
        payment_key(store_id, mode, &payment.id),
        codec::encode_payment(payment),
    );
}

/// The payment of an auto-recharge whose grant the ledger booked in the same
/// record (docs/api.md, "Thresholds and auto-recharge"); a payment id taken is
/// refused (ids are fresh: it would be a corrupt record).
pub fn apply_recharge_payment(
    overlay: &mut Overlay<'_>,
    payment: &Payment,
) -> Result<(), ApplyError> {
    if overlay.contains(&payment_key(&payment.store_id, payment.mode, &payment.id))? {
        return Err(Outcome::rejected(
            "resource_changed",
            format!("transaction {} exists already", payment.id),
        )
        .into());
    }
    put_payment(overlay, payment, true);
    Ok(())
}

/// The ids of the events of one object: derived, so a replay emits the same ones.
fn event(event_type: &str, at_ms: i64, object: BillingObject, object_id: &str) -> BillingEvent {
    BillingEvent {
        id: format!("evt_{object_id}_{}", event_type.replace('.', "_")),
        event_type: event_type.to_string(),
        created_at_ms: at_ms,
        object,
    }
}

pub(crate) fn put_events(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    events: &[BillingEvent],
) {
    for e in events {
        overlay.put(event_key(store_id, mode, e), codec::encode_billing_event(e));
    }
}

/// Where a billing event's snapshot is stored (table `E`).
pub fn event_key(store_id: &str, mode: Mode, event: &BillingEvent) -> Vec<u8> {
    Key::scoped(keys::BILLING_EVENT, store_id, mode)
        .int(event.created_at_ms)
        .text(&event.id)
        .into_bytes()
}

/// Billing's port into the directory inside apply: a customer as the projection
/// holds it at this point of the log (a subscription event's snapshot).
pub type CustomerAt<'a> =
    &'a dyn Fn(
        &Overlay<'_>,
        &str,
        Mode,
        &str,
    )
        -> Result<Option<tally_domain::customer::Customer>, tally_core::error::EngineError>;

/// Credits a purchase grants: a `customer_credits` feature's `amount` times the
/// units bought, into the customer's account named `bucket_name`, at the checkout
/// and for each later period a subscription pays. The projector books them through
/// the ledger in the same apply (docs/api.md, "Checkouts").
#[derive(Debug, Clone, PartialEq)]
pub struct CheckoutGrant {
    pub customer_id: String,
    pub account_name: String,
    pub unit_label: String,
    pub amount: Decimal,
    /// Once per checkout and feature.
    pub key: String,
}

/// The grants of `product`'s `customer_credits` features for `units`, keyed
/// `<key_base>:<feature id>` (features whose amount times the units leaves a
/// decimal's range grant nothing: the product's limits keep them far inside it).
pub(crate) fn product_grants(
    customer_id: &str,
    product: &Product,
    units: u32,
    key_base: &str,
) -> Vec<CheckoutGrant> {
    product
        .features
        .iter()
        .filter_map(|feature| {
            let credits = feature.customer_credits.as_ref()?;
            Some(CheckoutGrant {
                customer_id: customer_id.to_string(),
                account_name: credits.bucket_name.clone(),
                unit_label: credits.unit_label.clone(),
                amount: credits.amount.checked_mul(Decimal::from(units))?,
                key: format!("{key_base}:{}", feature.id),
            })
        })
        .collect()
}

/// The grants of a checkout of `product`: its first period (or trial).
fn checkout_grants(done: &Checkout, product: &Product) -> Vec<CheckoutGrant> {
    product_grants(
        &done.customer_id,
        product,
        done.units,
        &format!("checkout:{}", done.id),
    )
}

/// A checkout paid: decided here, in log order, that it is still open (a second
/// completion is a repeat: `SameAs` the checkout, nothing charged twice), that its
/// product is still sold, and that its discount is still redeemable at the record's
/// time (so `redeem_count` never passes `max_redemptions`, whatever the concurrency).
/// Returns the events to deliver and the credits it grants.
pub fn apply_checkout_completed(
    overlay: &mut Overlay<'_>,
    completion: &CheckoutCompletion,
    recorded_at_ms: i64,
    customer_at: CustomerAt<'_>,
) -> Result<(Vec<BillingEvent>, Vec<CheckoutGrant>), ApplyError> {
    let done = &completion.checkout;
    let (store_id, mode) = (&done.store_id, done.mode);
    let key = checkout_key(store_id, mode, &done.id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(missing("checkout", &done.id, "id"));
    };
    let open = codec::decode_checkout(&bytes)?;
    if open.status == CheckoutStatus::Completed {
        return Err(Outcome::SameAs {
            id: open.id.to_string(),
        }
        .into());
    }
    check_completion(&open, completion)?;
    fresh(overlay, payment_key(store_id, mode, &completion.payment.id))?;
    if let Some(subscription) = &completion.subscription {
        fresh(overlay, subscription_key(store_id, mode, &subscription.id))?;
    }
    let Some(bytes) = overlay.get(&product_key(store_id, mode, &open.product_id))? else {
        return Err(missing("product", &open.product_id, "product_id"));
    };
    let product = codec::decode_product(&bytes)?;
    check_sold(&product).map_err(refused)?;
    if let Some(discount_id) = &open.discount_id {
        let key = discount_key(store_id, mode, discount_id);
        let Some(bytes) = overlay.get(&key)? else {
            return Err(missing("discount", discount_id, "discount_code"));
        };
        let mut discount = codec::decode_discount(&bytes)?;
        // At the completion's business time (a test store's test clock), which the
        // service stamped on the record.
        let redeemed_at = done.completed_at_ms.unwrap_or(recorded_at_ms);
        discount
            .check_redeemable(redeemed_at, &product)
            .map_err(refused)?;
        discount.redeem_count = discount.redeem_count.saturating_add(1);
        // A new version: an update derived from the one before is refused (base).
        discount.updated_at_ms = discount.updated_at_ms.saturating_add(1).max(recorded_at_ms);
        overlay.put(key, codec::encode_discount(&discount));
    }
    overlay.put(key, codec::encode_checkout(done));
    // A referred checkout: a conversion and its commission, noted on the payment.
    let payment =
        crate::affiliates::convert(overlay, done.affiliate_code.as_deref(), &completion.payment)?;
    put_payment(overlay, &payment, true);
    let at = done.completed_at_ms.unwrap_or(recorded_at_ms);
    let mut events = vec![event(
        "checkout.completed",
        at,
        BillingObject::Checkout(done.clone()),
        &done.id,
    )];
    match &completion.subscription {
        Some(subscription) => crate::settlement::bind_purchase(
            overlay,
            &done.customer_id,
            &subscription.id,
            &subscription.product,
            (subscription.billing_anchor_ms, at),
            subscription.trial_end_ms,
        )?,
        None => crate::settlement::bind_purchase(
            overlay,
            &done.customer_id,
            &done.id,
            &product,
            (at, at),
            None,
        )?,
    }
    if let Some(subscription) = &completion.subscription {
        crate::lifecycle::put_new_subscription(overlay, subscription);
        let customer = customer_at(overlay, store_id, mode, &subscription.customer_id)?;
        let object = || BillingObject::Subscription {
            subscription: subscription.clone(),
            customer: customer.clone(),
            last_transaction: Some(payment.clone()),
        };
        if subscription.status == SubscriptionStatus::Trialing {
            events.push(event(
                "subscription.trialing",
                at,
                object(),
                &subscription.id,
            ));
        } else {
            events.push(event("subscription.active", at, object(), &subscription.id));
            events.push(event("subscription.paid", at, object(), &subscription.id));
        }
    }
    put_events(overlay, store_id, mode, &events);
    Ok((events, checkout_grants(done, &product)))
}

/// A record creating a resource under an id already taken is refused (ids are
/// random; only a forged or repeated record collides).
fn fresh(overlay: &mut Overlay<'_>, key: Vec<u8>) -> Result<(), ApplyError> {
    match overlay.get(&key)? {
        Some(_) => Err(Outcome::rejected("resource_changed", "the id is taken already").into()),
        None => Ok(()),
    }
}

/// What a completion record must be to be applied at all: it completes the open
/// checkout it names, for its customer and product, with a fresh payment whose
/// amounts add up (a record no service would write is refused, never half-applied).
fn check_completion(open: &Checkout, completion: &CheckoutCompletion) -> Result<(), ApplyError> {
    let done = &completion.checkout;
    let payment = &completion.payment;
    let charge_adds_up = [payment.amount, payment.discount_amount, payment.tax_amount]
        .iter()
        .all(|a| *a >= 0)
        && payment
            .amount
            .checked_sub(payment.discount_amount)
            .and_then(|a| a.checked_add(payment.tax_amount))
            == Some(payment.amount_paid)
        && payment.amount_paid >= 0;
    let consistent = done.status == CheckoutStatus::Completed
        && done.product_id == open.product_id
        && done.customer_id == open.customer_id
        && done.discount_id == open.discount_id
        && done.transaction_id.as_ref() == Some(&payment.id)
        && payment.payment_type == PaymentType::Payment
        && payment.status == tally_domain::billing::PaymentStatus::Paid
        && payment.refunded_amount == 0
        && !payment.disputed
        && payment.customer_id == open.customer_id
        && payment.checkout_id.as_ref() == Some(&open.id)
        && payment.store_id == open.store_id
        && payment.mode == open.mode
        && charge_adds_up
        && completion.subscription.as_ref().is_none_or(|s| {
            s.store_id == open.store_id
                && s.mode == open.mode
                && done.subscription_id.as_ref() == Some(&s.id)
                && payment.subscription_id.as_ref() == Some(&s.id)
        });
    if consistent {
        Ok(())
    } else {
        Err(Outcome::rejected(
            "record_undecodable",
            "the completion does not match its checkout, or its amounts do not add up",
        )
        .into())
    }
}

/// A refund: decided here that what it takes is still left on its payment.
pub fn apply_refund(
    overlay: &mut Overlay<'_>,
    refund: &Payment,
) -> Result<Vec<BillingEvent>, ApplyError> {
    let (store_id, mode) = (&refund.store_id, refund.mode);
    let Some(original_id) = &refund.refund_of else {
        return Err(missing("transaction", "", "transaction_id"));
    };
    let key = payment_key(store_id, mode, original_id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(missing("transaction", original_id, "transaction_id"));
    };
    let mut original = codec::decode_payment(&bytes)?;
    if refund.amount < 1
        || refund.payment_type != PaymentType::Refund
        || refund.amount_paid != refund.amount
        || refund.customer_id != original.customer_id
    {
        return Err(Outcome::rejected(
            "record_undecodable",
            "a refund takes at least 1 minor unit of its own customer's payment",
        )
        .into());
    }
    fresh(overlay, payment_key(store_id, mode, &refund.id))?;
    original.check_refund(refund.amount).map_err(refused)?;
    let refunded_before = original.refunded_amount;
    original.take_refund(refund.amount, refund.created_at_ms);
    crate::affiliates::claw_back(
        overlay,
        &original,
        refunded_before,
        original.refunded_amount,
    )?;
    put_payment(overlay, &original, false);
    put_payment(overlay, refund, true);
    let events = vec![event(
        "refund.created",
        refund.created_at_ms,
        BillingObject::Payment(refund.clone()),
        &refund.id,
    )];
    put_events(overlay, store_id, mode, &events);
    Ok(events)
}

/// A dispute: one per payment, on a payment (not a refund).
pub fn apply_dispute(
    overlay: &mut Overlay<'_>,
    dispute: &Dispute,
) -> Result<Vec<BillingEvent>, ApplyError> {
    let (store_id, mode) = (&dispute.store_id, dispute.mode);
    let key = payment_key(store_id, mode, &dispute.transaction_id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(missing(
            "transaction",
            &dispute.transaction_id,
            "transaction_id",
        ));
    };
    let mut payment = codec::decode_payment(&bytes)?;
    if payment.disputed {
        return Err(Outcome::rejected(
            "dispute_exists",
            format!("transaction '{}' is already disputed", payment.id),
        )
        .with_param("transaction_id")
        .into());
    }
    if payment.payment_type != PaymentType::Payment {
        return Err(Outcome::rejected(
            "transaction_not_disputable",
            format!(
                "transaction '{}' is a refund; only payments are disputed",
                payment.id
            ),
        )
        .with_param("transaction_id")
        .into());
    }
    fresh(overlay, dispute_key(store_id, mode, &dispute.id))?;
    payment.disputed = true;
    payment.updated_at_ms = payment.updated_at_ms.max(dispute.created_at_ms);
    put_payment(overlay, &payment, false);
    overlay.put(
        dispute_key(store_id, mode, &dispute.id),
        codec::encode_dispute(dispute),
    );
    let events = vec![event(
        "dispute.created",
        dispute.created_at_ms,
        BillingObject::Dispute(dispute.clone()),
        &dispute.id,
    )];
    put_events(overlay, store_id, mode, &events);
    Ok(events)
}

/// A store's tax rate for a country.
pub fn apply_tax_rate(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    country: &str,
    rate: Decimal,
) {
    overlay.put(
        tax_rate_key(store_id, mode, country),
        canonical_decimal(rate).into_bytes(),
    );
}
