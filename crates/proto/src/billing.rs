//! Billing resources between the domain and `tally.v1` (discounts, checkouts,
//! payments, subscriptions, disputes, billing events). Enums travel as their wire
//! names; an unknown name or an unparsable decimal is a [`DecodeError`].

use tally_domain::billing::{
    Checkout, CheckoutStatus, Discount, DiscountDuration, DiscountStatus, DiscountType, Dispute,
    EmbeddedDiscount, Payment, PaymentStatus, PaymentType, Subscription, SubscriptionStatus,
};
use tally_domain::record::{BillingEvent, BillingObject, CheckoutCompletion};
use tally_domain::subscription::{BilledUsage, ExtraItem, OnExecute, PaymentLine, RetiredUsage};
use tally_domain::usage::canonical_decimal;

use crate::convert::{mode_from_proto, mode_to_proto, DecodeError};
use crate::product::{
    decimal, named, product_from_proto, product_to_proto, usage_price_from_proto,
    usage_price_to_proto,
};
use crate::v1;

pub fn discount_to_proto(d: &Discount) -> v1::Discount {
    v1::Discount {
        id: d.id.to_string(),
        store_id: d.store_id.to_string(),
        mode: mode_to_proto(d.mode),
        name: d.name.clone(),
        code: d.code.clone(),
        r#type: d.discount_type.as_str().into(),
        amount: canonical_decimal(d.amount),
        currency: d.currency.clone(),
        stored_status: d.stored_status.as_str().into(),
        starts_at_ms: d.starts_at_ms,
        expires_at_ms: d.expires_at_ms,
        max_redemptions: d.max_redemptions,
        duration: d.duration.as_str().into(),
        duration_in_months: d.duration_in_months,
        applies_to_products: d
            .applies_to_products
            .iter()
            .map(|p| p.to_string())
            .collect(),
        redeem_count: d.redeem_count,
        created_at_ms: d.created_at_ms,
        updated_at_ms: d.updated_at_ms,
    }
}

pub fn discount_from_proto(d: v1::Discount) -> Result<Discount, DecodeError> {
    Ok(Discount {
        id: d.id.into(),
        store_id: d.store_id.into(),
        mode: mode_from_proto(d.mode)?,
        name: d.name,
        code: d.code,
        discount_type: named(DiscountType::parse, &d.r#type, "discount type")?,
        amount: decimal(&d.amount, "discount amount")?,
        currency: d.currency,
        stored_status: named(DiscountStatus::parse, &d.stored_status, "discount status")?,
        starts_at_ms: d.starts_at_ms,
        expires_at_ms: d.expires_at_ms,
        max_redemptions: d.max_redemptions,
        duration: named(DiscountDuration::parse, &d.duration, "duration")?,
        duration_in_months: d.duration_in_months,
        applies_to_products: d.applies_to_products.into_iter().map(Into::into).collect(),
        redeem_count: d.redeem_count,
        created_at_ms: d.created_at_ms,
        updated_at_ms: d.updated_at_ms,
    })
}

pub fn checkout_to_proto(c: &Checkout) -> v1::Checkout {
    v1::Checkout {
        id: c.id.to_string(),
        store_id: c.store_id.to_string(),
        mode: mode_to_proto(c.mode),
        status: c.status.as_str().into(),
        product_id: c.product_id.to_string(),
        customer_id: c.customer_id.to_string(),
        units: c.units,
        discount_id: c.discount_id.as_ref().map(|d| d.to_string()),
        discount_code: c.discount_code.clone(),
        affiliate_code: c.affiliate_code.clone(),
        success_url: c.success_url.clone(),
        metadata: c.metadata.clone(),
        amount: c.amount,
        currency: c.currency.clone(),
        transaction_id: c.transaction_id.as_ref().map(|t| t.to_string()),
        subscription_id: c.subscription_id.as_ref().map(|s| s.to_string()),
        completed_at_ms: c.completed_at_ms,
        created_at_ms: c.created_at_ms,
        updated_at_ms: c.updated_at_ms,
    }
}

pub fn checkout_from_proto(c: v1::Checkout) -> Result<Checkout, DecodeError> {
    Ok(Checkout {
        id: c.id.into(),
        store_id: c.store_id.into(),
        mode: mode_from_proto(c.mode)?,
        status: named(CheckoutStatus::parse, &c.status, "checkout status")?,
        product_id: c.product_id.into(),
        customer_id: c.customer_id.into(),
        units: c.units,
        discount_id: c.discount_id.map(Into::into),
        discount_code: c.discount_code,
        affiliate_code: c.affiliate_code,
        success_url: c.success_url,
        metadata: c.metadata,
        amount: c.amount,
        currency: c.currency,
        transaction_id: c.transaction_id.map(Into::into),
        subscription_id: c.subscription_id.map(Into::into),
        completed_at_ms: c.completed_at_ms,
        created_at_ms: c.created_at_ms,
        updated_at_ms: c.updated_at_ms,
    })
}

fn line_to_proto(l: &PaymentLine) -> v1::PaymentLine {
    v1::PaymentLine {
        description: l.description.clone(),
        meter_id: l.meter_id.as_ref().map(|m| m.to_string()),
        quantity: canonical_decimal(l.quantity),
        unit_price: canonical_decimal(l.unit_price),
        amount: l.amount,
    }
}

fn line_from_proto(l: v1::PaymentLine) -> Result<PaymentLine, DecodeError> {
    Ok(PaymentLine {
        description: l.description,
        meter_id: l.meter_id.map(Into::into),
        quantity: decimal(&l.quantity, "line quantity")?,
        unit_price: decimal(&l.unit_price, "line unit_price")?,
        amount: l.amount,
    })
}

pub fn payment_to_proto(p: &Payment) -> v1::Payment {
    v1::Payment {
        id: p.id.to_string(),
        store_id: p.store_id.to_string(),
        mode: mode_to_proto(p.mode),
        r#type: p.payment_type.as_str().into(),
        status: p.status.as_str().into(),
        amount: p.amount,
        currency: p.currency.clone(),
        discount_amount: p.discount_amount,
        tax_amount: p.tax_amount,
        amount_paid: p.amount_paid,
        refunded_amount: p.refunded_amount,
        tax_country: p.tax_country.clone(),
        checkout_id: p.checkout_id.as_ref().map(|c| c.to_string()),
        subscription_id: p.subscription_id.as_ref().map(|s| s.to_string()),
        customer_id: p.customer_id.to_string(),
        description: p.description.clone(),
        period_start_ms: p.period_start_ms,
        period_end_ms: p.period_end_ms,
        refund_of: p.refund_of.as_ref().map(|r| r.to_string()),
        reason: p.reason.clone(),
        disputed: p.disputed,
        card_last4: p.card_last4.clone(),
        card_declines_later: p.card_declines_later,
        card_exp: p.card_exp.clone(),
        created_at_ms: p.created_at_ms,
        updated_at_ms: p.updated_at_ms,
        lines: p.lines.iter().map(line_to_proto).collect(),
        affiliate_id: p.affiliate_id.as_ref().map(|a| a.to_string()),
        affiliate_commission: p.affiliate_commission,
    }
}

pub fn payment_from_proto(p: v1::Payment) -> Result<Payment, DecodeError> {
    Ok(Payment {
        id: p.id.into(),
        store_id: p.store_id.into(),
        mode: mode_from_proto(p.mode)?,
        payment_type: named(PaymentType::parse, &p.r#type, "transaction type")?,
        status: named(PaymentStatus::parse, &p.status, "transaction status")?,
        amount: p.amount,
        currency: p.currency,
        discount_amount: p.discount_amount,
        tax_amount: p.tax_amount,
        amount_paid: p.amount_paid,
        refunded_amount: p.refunded_amount,
        tax_country: p.tax_country,
        checkout_id: p.checkout_id.map(Into::into),
        subscription_id: p.subscription_id.map(Into::into),
        customer_id: p.customer_id.into(),
        description: p.description,
        period_start_ms: p.period_start_ms,
        period_end_ms: p.period_end_ms,
        refund_of: p.refund_of.map(Into::into),
        reason: p.reason,
        disputed: p.disputed,
        card_last4: p.card_last4,
        card_declines_later: p.card_declines_later,
        card_exp: p.card_exp,
        created_at_ms: p.created_at_ms,
        updated_at_ms: p.updated_at_ms,
        lines: p
            .lines
            .into_iter()
            .map(line_from_proto)
            .collect::<Result<_, DecodeError>>()?,
        affiliate_id: p.affiliate_id.map(Into::into),
        affiliate_commission: p.affiliate_commission,
    })
}

pub fn subscription_to_proto(s: &Subscription) -> v1::Subscription {
    v1::Subscription {
        id: s.id.to_string(),
        store_id: s.store_id.to_string(),
        mode: mode_to_proto(s.mode),
        status: s.status.as_str().into(),
        product: Some(product_to_proto(&s.product)),
        customer_id: s.customer_id.to_string(),
        item_id: s.item_id.clone(),
        units: s.units,
        last_transaction_id: s.last_transaction_id.as_ref().map(|t| t.to_string()),
        last_transaction_at_ms: s.last_transaction_at_ms,
        current_period_start_ms: s.current_period_start_ms,
        current_period_end_ms: s.current_period_end_ms,
        trial_end_ms: s.trial_end_ms,
        canceled_at_ms: s.canceled_at_ms,
        discount: s.discount.as_ref().map(|d| v1::EmbeddedDiscount {
            id: d.id.to_string(),
            code: d.code.clone(),
            name: d.name.clone(),
            r#type: d.discount_type.as_str().into(),
            amount: canonical_decimal(d.amount),
            duration: d.duration.as_str().into(),
            duration_in_months: d.duration_in_months,
        }),
        discount_charges_left: s.discount_charges_left,
        metadata: s.metadata.clone(),
        card_last4: s.card_last4.clone(),
        card_declines_renewals: s.card_declines_renewals,
        card_exp: s.card_exp.clone(),
        created_at_ms: s.created_at_ms,
        updated_at_ms: s.updated_at_ms,
        billing_anchor_ms: s.billing_anchor_ms,
        on_period_end: s.on_period_end.map(|o| o.as_str().into()),
        retries: s.retries,
        next_retry_ms: s.next_retry_ms,
        failed_at_ms: s.failed_at_ms,
        open_usage_start_ms: s.open_usage.map(|(start, _)| start),
        open_usage_end_ms: s.open_usage.map(|(_, end)| end),
        open_usage_was_trial: s.open_usage_was_trial,
        paused_at_ms: s.paused_at_ms,
        billed_usage: s
            .billed_usage
            .iter()
            .map(|b| v1::BilledUsage {
                price_id: b.price_id.clone(),
                meter_id: b.meter_id.to_string(),
                period_start_ms: b.period_start_ms,
                period_end_ms: b.period_end_ms,
                quantity: canonical_decimal(b.quantity),
                voided_events: b.voided_events,
                meter_revision: b.meter_revision,
                price: b.price.as_ref().map(usage_price_to_proto),
            })
            .collect(),
        retired_usage: s
            .retired_usage
            .iter()
            .map(|r| v1::RetiredUsage {
                price: Some(usage_price_to_proto(&r.price)),
                product_name: r.product_name.clone(),
                start_ms: r.start_ms,
                end_ms: r.end_ms,
            })
            .collect(),
        usage_priced_from_ms: s.usage_priced_from_ms,
        extra_items: s
            .extra_items
            .iter()
            .map(|i| v1::ExtraItem {
                id: i.id.clone(),
                product: Some(product_to_proto(&i.product)),
                units: i.units,
                added_at_ms: i.added_at_ms,
            })
            .collect(),
        pending_lines: s.pending_lines.iter().map(line_to_proto).collect(),
        late_usage_grace_ms: Some(s.late_usage_grace_ms),
        late_usage_due_ms: s.late_usage_due_ms,
    }
}

pub fn subscription_from_proto(s: v1::Subscription) -> Result<Subscription, DecodeError> {
    let discount = s
        .discount
        .map(|d| {
            Ok::<_, DecodeError>(EmbeddedDiscount {
                id: d.id.into(),
                code: d.code,
                name: d.name,
                discount_type: named(DiscountType::parse, &d.r#type, "discount type")?,
                amount: decimal(&d.amount, "discount amount")?,
                duration: named(DiscountDuration::parse, &d.duration, "duration")?,
                duration_in_months: d.duration_in_months,
            })
        })
        .transpose()?;
    Ok(Subscription {
        id: s.id.into(),
        store_id: s.store_id.into(),
        mode: mode_from_proto(s.mode)?,
        status: named(SubscriptionStatus::parse, &s.status, "subscription status")?,
        product: product_from_proto(s.product.ok_or(DecodeError::BadField("product"))?)?,
        customer_id: s.customer_id.into(),
        item_id: s.item_id,
        units: s.units,
        last_transaction_id: s.last_transaction_id.map(Into::into),
        last_transaction_at_ms: s.last_transaction_at_ms,
        current_period_start_ms: s.current_period_start_ms,
        current_period_end_ms: s.current_period_end_ms,
        trial_end_ms: s.trial_end_ms,
        canceled_at_ms: s.canceled_at_ms,
        discount,
        discount_charges_left: s.discount_charges_left,
        metadata: s.metadata,
        card_last4: s.card_last4,
        card_declines_renewals: s.card_declines_renewals,
        card_exp: s.card_exp,
        created_at_ms: s.created_at_ms,
        updated_at_ms: s.updated_at_ms,
        // Written before renewals ran: periods count from the current one.
        billing_anchor_ms: if s.billing_anchor_ms == 0 {
            s.current_period_start_ms
        } else {
            s.billing_anchor_ms
        },
        on_period_end: s
            .on_period_end
            .map(|o| named(OnExecute::parse, &o, "on_period_end"))
            .transpose()?,
        retries: s.retries,
        next_retry_ms: s.next_retry_ms,
        failed_at_ms: s.failed_at_ms,
        open_usage: s.open_usage_start_ms.zip(s.open_usage_end_ms),
        open_usage_was_trial: s.open_usage_was_trial,
        paused_at_ms: s.paused_at_ms,
        billed_usage: s
            .billed_usage
            .into_iter()
            .map(|b| {
                Ok(BilledUsage {
                    price_id: b.price_id,
                    meter_id: b.meter_id.into(),
                    period_start_ms: b.period_start_ms,
                    period_end_ms: b.period_end_ms,
                    quantity: decimal(&b.quantity, "billed usage")?,
                    voided_events: b.voided_events,
                    meter_revision: b.meter_revision,
                    price: b.price.map(usage_price_from_proto).transpose()?,
                })
            })
            .collect::<Result<_, DecodeError>>()?,
        retired_usage: s
            .retired_usage
            .into_iter()
            .map(|r| {
                Ok(RetiredUsage {
                    price: usage_price_from_proto(
                        r.price
                            .ok_or(DecodeError::BadField("retired usage price"))?,
                    )?,
                    product_name: r.product_name,
                    start_ms: r.start_ms,
                    end_ms: r.end_ms,
                })
            })
            .collect::<Result<_, DecodeError>>()?,
        usage_priced_from_ms: s.usage_priced_from_ms,
        extra_items: s
            .extra_items
            .into_iter()
            .map(|i| {
                Ok(ExtraItem {
                    id: i.id,
                    product: product_from_proto(
                        i.product.ok_or(DecodeError::BadField("item product"))?,
                    )?,
                    units: i.units,
                    added_at_ms: i.added_at_ms,
                })
            })
            .collect::<Result<_, DecodeError>>()?,
        pending_lines: s
            .pending_lines
            .into_iter()
            .map(line_from_proto)
            .collect::<Result<_, DecodeError>>()?,
        late_usage_grace_ms: s
            .late_usage_grace_ms
            .unwrap_or(tally_domain::subscription::LATE_USAGE_GRACE_MS),
        late_usage_due_ms: s.late_usage_due_ms,
    })
}

pub fn settings_to_proto(
    store_id: &str,
    mode: tally_domain::Mode,
    s: &tally_domain::subscription::StoreSettings,
) -> v1::StoreSettingsSet {
    v1::StoreSettingsSet {
        store_id: store_id.to_string(),
        mode: mode_to_proto(mode),
        default_cancel_mode: s.default_cancel_mode.as_str().into(),
        late_usage_grace_ms: s.late_usage_grace_ms,
        affiliate_commission_percent: canonical_decimal(s.affiliate_commission_percent),
        referral_base_url: s.referral_base_url.clone(),
    }
}

pub fn settings_from_proto(
    s: v1::StoreSettingsSet,
) -> Result<
    (
        String,
        tally_domain::Mode,
        tally_domain::subscription::StoreSettings,
    ),
    DecodeError,
> {
    Ok((
        s.store_id,
        mode_from_proto(s.mode)?,
        tally_domain::subscription::StoreSettings {
            default_cancel_mode: named(
                tally_domain::subscription::CancelMode::parse,
                &s.default_cancel_mode,
                "default_cancel_mode",
            )?,
            late_usage_grace_ms: s.late_usage_grace_ms,
            affiliate_commission_percent: if s.affiliate_commission_percent.is_empty() {
                rust_decimal::Decimal::ZERO
            } else {
                decimal(
                    &s.affiliate_commission_percent,
                    "affiliate_commission_percent",
                )?
            },
            referral_base_url: s.referral_base_url,
        },
    ))
}

pub fn dispute_to_proto(d: &Dispute) -> v1::Dispute {
    v1::Dispute {
        id: d.id.to_string(),
        store_id: d.store_id.to_string(),
        mode: mode_to_proto(d.mode),
        transaction_id: d.transaction_id.to_string(),
        customer_id: d.customer_id.to_string(),
        amount: d.amount,
        currency: d.currency.clone(),
        reason: d.reason.clone(),
        created_at_ms: d.created_at_ms,
    }
}

pub fn dispute_from_proto(d: v1::Dispute) -> Result<Dispute, DecodeError> {
    Ok(Dispute {
        id: d.id.into(),
        store_id: d.store_id.into(),
        mode: mode_from_proto(d.mode)?,
        transaction_id: d.transaction_id.into(),
        customer_id: d.customer_id.into(),
        amount: d.amount,
        currency: d.currency,
        reason: d.reason,
        created_at_ms: d.created_at_ms,
    })
}

pub fn completion_to_proto(c: &CheckoutCompletion) -> v1::CheckoutCompleted {
    v1::CheckoutCompleted {
        checkout: Some(checkout_to_proto(&c.checkout)),
        payment: Some(payment_to_proto(&c.payment)),
        subscription: c.subscription.as_ref().map(subscription_to_proto),
    }
}

pub fn completion_from_proto(c: v1::CheckoutCompleted) -> Result<CheckoutCompletion, DecodeError> {
    Ok(CheckoutCompletion {
        checkout: checkout_from_proto(c.checkout.ok_or(DecodeError::BadField("checkout"))?)?,
        payment: payment_from_proto(c.payment.ok_or(DecodeError::BadField("payment"))?)?,
        subscription: c.subscription.map(subscription_from_proto).transpose()?,
    })
}

pub fn billing_event_to_proto(e: &BillingEvent) -> v1::BillingEvent {
    use v1::billing_event::Object;
    let (subscription_last_transaction, subscription_customer) = match &e.object {
        BillingObject::Subscription {
            last_transaction,
            customer,
            ..
        } => (
            last_transaction.as_ref().map(payment_to_proto),
            customer.as_ref().map(crate::convert::customer_to_proto),
        ),
        _ => (None, None),
    };
    v1::BillingEvent {
        id: e.id.clone(),
        event_type: e.event_type.clone(),
        created_at_ms: e.created_at_ms,
        object: Some(match &e.object {
            BillingObject::Checkout(c) => Object::Checkout(checkout_to_proto(c)),
            BillingObject::Subscription { subscription, .. } => {
                Object::Subscription(subscription_to_proto(subscription))
            }
            BillingObject::Payment(p) => Object::Payment(payment_to_proto(p)),
            BillingObject::Dispute(d) => Object::Dispute(dispute_to_proto(d)),
        }),
        subscription_last_transaction,
        subscription_customer,
    }
}

pub fn billing_event_from_proto(e: v1::BillingEvent) -> Result<BillingEvent, DecodeError> {
    use v1::billing_event::Object;
    let object = match e.object.ok_or(DecodeError::BadField("object"))? {
        Object::Checkout(c) => BillingObject::Checkout(checkout_from_proto(c)?),
        Object::Subscription(s) => BillingObject::Subscription {
            subscription: subscription_from_proto(s)?,
            last_transaction: e
                .subscription_last_transaction
                .map(payment_from_proto)
                .transpose()?,
            customer: e
                .subscription_customer
                .map(crate::convert::customer_from_proto)
                .transpose()?,
        },
        Object::Payment(p) => BillingObject::Payment(payment_from_proto(p)?),
        Object::Dispute(d) => BillingObject::Dispute(dispute_from_proto(d)?),
    };
    Ok(BillingEvent {
        id: e.id,
        event_type: e.event_type,
        created_at_ms: e.created_at_ms,
        object,
    })
}
