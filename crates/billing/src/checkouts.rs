//! Checkouts: create (open), read, and complete with a test card (docs/api.md,
//! "Checkouts"). Completing prices the checkout again (discount, tax), builds the
//! payment and, for a recurring product, the subscription, and appends them as one
//! record: apply decides whether the checkout is still open and its discount still
//! redeemable. Credit grants of the product's features follow through the ledger
//! port, keyed by checkout and feature, so a retried completion grants them once.

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Decision;
use tally_core::Scope;
use tally_domain::billing::{
    check_sold, checkout_gross, parse_units, period_end, price_charge, trial_end, CardInput,
    Checkout, CheckoutStatus, Discount, Payment, PaymentStatus, PaymentType, Subscription,
    SubscriptionStatus,
};
use tally_domain::customer::{is_valid_email, validate_metadata};
use tally_domain::product::{check_url, BillingType, Product};
use tally_domain::record::{CheckoutCompletion, Record};
use tally_domain::usage::parse_decimal;
use tally_domain::FieldError;

use crate::apply::{checkout_key, tax_rate_key};
use crate::Billing;

/// Input of `POST /v1/checkouts`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct CheckoutInput {
    pub product_id: Option<String>,
    pub customer_id: Option<String>,
    /// `customer.email`: a new customer is created for the checkout.
    pub customer_email: Option<String>,
    pub units: Option<String>,
    pub discount_code: Option<String>,
    pub affiliate_code: Option<String>,
    pub success_url: Option<String>,
    pub metadata: BTreeMap<String, String>,
}

impl Billing {
    /// Checkouts, newest first.
    pub fn list_checkouts(
        &self,
        scope: &Scope,
        page: &tally_core::pagination::PageRequest,
    ) -> Result<tally_core::pagination::Page<Checkout>, EngineError> {
        use tally_core::keys::{self, ListingKey};
        let table = keys::CHECKOUT_LIST;
        let prefix = ListingKey::prefix(table, &scope.store_id, scope.mode, None);
        let cursor = tally_core::pagination::cursor_from(page, |id| {
            let checkout = self.get_checkout(scope, id)?;
            Ok(ListingKey::entry(
                table,
                &scope.store_id,
                scope.mode,
                None,
                checkout.created_at_ms,
                &checkout.id,
            ))
        })?;
        tally_core::pagination::paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                self.get_checkout(scope, id).map(Some)
            },
        )
    }

    pub fn get_checkout(&self, scope: &Scope, id: &str) -> Result<Checkout, EngineError> {
        match self
            .journal
            .store()
            .get(&checkout_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_checkout(&bytes),
            None => Err(EngineError::not_found("checkout", id)),
        }
    }

    /// The tax rate (percent) of a store for a country; 0 when none is set.
    pub fn tax_rate(&self, scope: &Scope, country: Option<&str>) -> Result<Decimal, EngineError> {
        let Some(country) = country else {
            return Ok(Decimal::ZERO);
        };
        match self
            .journal
            .store()
            .get(&tax_rate_key(&scope.store_id, scope.mode, country))?
        {
            Some(bytes) => parse_decimal(&String::from_utf8_lossy(&bytes))
                .ok_or_else(|| EngineError::Corrupt(format!("tax rate of {country}"))),
            None => Ok(Decimal::ZERO),
        }
    }

    /// The product a checkout buys, answering 404 on `product_id`.
    fn product_for(&self, scope: &Scope, id: &str) -> Result<Product, EngineError> {
        self.get_product(scope, id)
            .map_err(|e| e.for_param("product_id"))
    }

    /// The discount a code names, redeemable on `product` now (the fast answer;
    /// apply decides again at completion).
    fn redeemable(
        &self,
        scope: &Scope,
        code: &str,
        product: &Product,
    ) -> Result<Discount, EngineError> {
        let discount = self.discount_by_code(scope, code, "discount_code")?;
        discount.check_redeemable(self.journal.now_in(scope), product)?;
        Ok(discount)
    }

    pub async fn create_checkout(
        &self,
        scope: &Scope,
        input: &CheckoutInput,
    ) -> Result<Checkout, EngineError> {
        let product_id = input
            .product_id
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| FieldError::missing("product_id"))?;
        let units = parse_units(input.units.as_deref())?;
        if let Some(url) = &input.success_url {
            check_url("success_url", url)?;
        }
        validate_metadata(&input.metadata)?;
        let product = self.product_for(scope, product_id)?;
        check_sold(&product)?;
        let discount = input
            .discount_code
            .as_deref()
            .map(|code| self.redeemable(scope, code, &product))
            .transpose()?;
        let gross = checkout_gross(&product, units)?;
        // Checked before a customer may be created: a bad request writes nothing.
        if let Some(code) = &input.affiliate_code {
            if self.affiliate_by_code(scope, code)?.is_none() {
                return Err(EngineError::not_found("affiliate", code).for_param("affiliate_code"));
            }
        }
        let customer_id = match (&input.customer_id, &input.customer_email) {
            (Some(_), Some(_)) => {
                return Err(FieldError::invalid(
                    "customer",
                    "give `customer_id` or `customer`, not both",
                )
                .into())
            }
            (None, None) => return Err(FieldError::missing("customer_id").into()),
            (Some(id), None) => {
                if self.customers.customer_country(scope, id)?.is_none() {
                    return Err(EngineError::NotFound {
                        resource: "customer",
                        id: id.clone(),
                        param: Some("customer_id".into()),
                    });
                }
                id.clone()
            }
            (None, Some(email)) => {
                if !is_valid_email(email.trim()) {
                    return Err(FieldError::invalid(
                        "customer.email",
                        "`customer.email` must be a valid email address",
                    )
                    .into());
                }
                self.customers.create_customer(scope, email.trim()).await?
            }
        };
        let country = self
            .customers
            .customer_country(scope, &customer_id)?
            .flatten();
        let charge = price_charge(
            gross,
            discount.as_ref().map_or(0, |d| d.amount_off(gross)),
            product.tax_mode,
            self.tax_rate(scope, country.as_deref())?,
        )?;
        let now = self.journal.now_in(scope);
        let checkout = Checkout {
            id: new_id("chk").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            status: CheckoutStatus::Open,
            product_id: product.id.clone(),
            customer_id: customer_id.into(),
            units,
            discount_id: discount.as_ref().map(|d| d.id.clone()),
            discount_code: discount.as_ref().map(|d| d.code.clone()),
            affiliate_code: input.affiliate_code.clone(),
            success_url: input
                .success_url
                .clone()
                .or_else(|| product.default_success_url.clone()),
            metadata: input.metadata.clone(),
            amount: charge.amount_paid,
            currency: product.currency.clone(),
            transaction_id: None,
            subscription_id: None,
            completed_at_ms: None,
            created_at_ms: now,
            updated_at_ms: now,
        };
        self.journal
            .append_and_apply(&Record::CheckoutCreated(checkout.clone()))
            .await?;
        Ok(checkout)
    }

    /// Pays a checkout through the scope's payment provider (the test cards in test
    /// mode; none in live mode yet). A declined card answers 402 and writes nothing;
    /// a completed checkout answers as it is (never a second charge).
    pub async fn complete_checkout(
        &self,
        scope: &Scope,
        id: &str,
        card: &CardInput,
    ) -> Result<Checkout, EngineError> {
        // The card's fields are checked first (400 naming the field), whatever the
        // checkout's state: a malformed request is refused the same way every time.
        tally_domain::billing::test_card(card)?;
        let open = self.get_checkout(scope, id)?;
        if open.status == CheckoutStatus::Completed {
            return Ok(open);
        }
        let product = self.product_for(scope, &open.product_id)?;
        check_sold(&product)?;
        let discount = match &open.discount_id {
            Some(id) => {
                let discount = self.get_discount(scope, id)?;
                discount.check_redeemable(self.journal.now_in(scope), &product)?;
                Some(discount)
            }
            None => None,
        };
        let country = self
            .customers
            .customer_country(scope, &open.customer_id)?
            .flatten();
        let gross = checkout_gross(&product, open.units)?;
        let charge = price_charge(
            gross,
            discount.as_ref().map_or(0, |d| d.amount_off(gross)),
            product.tax_mode,
            self.tax_rate(scope, country.as_deref())?,
        )?;
        let provider = self.provider(scope.mode).ok_or_else(|| {
            FieldError::new(
                "payment_provider_not_configured",
                "card_number",
                "no payment provider is configured for live payments; test cards work with a test key only",
            )
        })?;
        let card_exp = card.exp.as_deref().map(|exp| exp.trim().to_string());
        // By the store's clock (the test clock in test mode): an expired card is
        // declined.
        let now = self.journal.now_in(scope);
        let card = provider.charge(card, charge.amount_paid, &product.currency, now)?;
        let grace_ms = self.store_settings(scope)?.late_usage_grace_ms;
        let subscription = (product.billing_type == BillingType::Recurring).then(|| {
            let trial = product.trial_period_days.filter(|d| *d > 0);
            let period_end = match trial {
                Some(days) => trial_end(now, days),
                None => period_end(now, product.billing_period).unwrap_or(now),
            };
            let anchor = if trial.is_some() { period_end } else { now };
            Subscription {
                id: new_id("sub").into(),
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                status: if trial.is_some() {
                    SubscriptionStatus::Trialing
                } else {
                    SubscriptionStatus::Active
                },
                product: product.clone(),
                customer_id: open.customer_id.clone(),
                item_id: new_id("si"),
                units: open.units,
                last_transaction_id: None,
                last_transaction_at_ms: Some(now),
                current_period_start_ms: now,
                current_period_end_ms: period_end,
                trial_end_ms: trial.map(|days| trial_end(now, days)),
                canceled_at_ms: None,
                discount: discount.as_ref().map(Discount::embedded),
                discount_charges_left: discount.as_ref().and_then(|d| {
                    use tally_domain::billing::DiscountDuration;
                    match d.duration {
                        DiscountDuration::Forever => None,
                        DiscountDuration::Once => Some(0),
                        // This charge was the first of its months.
                        DiscountDuration::Repeating => {
                            Some(d.duration_in_months.unwrap_or(1).saturating_sub(1))
                        }
                    }
                }),
                metadata: open.metadata.clone(),
                card_last4: card.card_last4.clone(),
                card_declines_renewals: card.declines_later,
                card_exp: card_exp.clone(),
                // The first paid period starts after the trial.
                billing_anchor_ms: anchor,
                on_period_end: None,
                retries: 0,
                next_retry_ms: None,
                failed_at_ms: None,
                open_usage: None,
                open_usage_was_trial: false,
                paused_at_ms: None,
                billed_usage: Vec::new(),
                retired_usage: Vec::new(),
                usage_priced_from_ms: None,
                extra_items: Vec::new(),
                pending_lines: Vec::new(),
                late_usage_grace_ms: grace_ms,
                late_usage_due_ms: None,
                created_at_ms: now,
                updated_at_ms: now,
            }
        });
        let payment = Payment {
            id: new_id("txn").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            payment_type: PaymentType::Payment,
            status: PaymentStatus::Paid,
            amount: charge.amount,
            currency: product.currency.clone(),
            discount_amount: charge.discount_amount,
            tax_amount: charge.tax_amount,
            amount_paid: charge.amount_paid,
            refunded_amount: 0,
            tax_country: country,
            checkout_id: Some(open.id.clone()),
            subscription_id: subscription.as_ref().map(|s| s.id.clone()),
            customer_id: open.customer_id.clone(),
            description: format!("{} x {}", open.units, product.name),
            period_start_ms: subscription.as_ref().map(|s| s.current_period_start_ms),
            period_end_ms: subscription.as_ref().map(|s| s.current_period_end_ms),
            refund_of: None,
            reason: None,
            disputed: false,
            card_last4: Some(card.card_last4.clone()),
            card_declines_later: card.declines_later,
            card_exp,
            affiliate_id: None,
            affiliate_commission: 0,
            lines: vec![tally_domain::subscription::PaymentLine {
                description: format!("{} x {}", open.units, product.name),
                meter_id: None,
                quantity: rust_decimal::Decimal::from(open.units),
                unit_price: rust_decimal::Decimal::from(gross)
                    / rust_decimal::Decimal::from(open.units.max(1)),
                amount: gross,
            }],
            created_at_ms: now,
            updated_at_ms: now,
        };
        let subscription = subscription.map(|mut s| {
            s.last_transaction_id = Some(payment.id.clone());
            s
        });
        let mut done = open.clone();
        done.status = CheckoutStatus::Completed;
        done.amount = charge.amount_paid;
        done.transaction_id = Some(payment.id.clone());
        done.subscription_id = subscription.as_ref().map(|s| s.id.clone());
        done.completed_at_ms = Some(now);
        done.updated_at_ms = now.max(open.updated_at_ms);
        let record = Record::CheckoutCompleted(CheckoutCompletion {
            checkout: done.clone(),
            payment,
            subscription,
        });
        let done = match self.journal.append_and_decide(&record).await? {
            Decision::Applied => done,
            // Another completion came first: its payment stands, this one charged nothing.
            Decision::SameAs(_) => self.get_checkout(scope, id)?,
        };
        Ok(done)
    }
}
