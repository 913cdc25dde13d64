//! Payments and refunds (the API's transactions), disputes, subscriptions as read,
//! and the store's tax rates (docs/api.md, "Transactions"). A refund is decided in
//! apply against what is left of its payment, so concurrent refunds never take more
//! than was paid.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::keys::{self, ListingKey};
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest};
use tally_core::Scope;
use tally_domain::billing::{
    parse_reason, parse_tax_rate, Dispute, Payment, PaymentStatus, PaymentType, Subscription,
};
use tally_domain::product::parse_positive_minor;
use tally_domain::record::Record;
use tally_domain::{FieldError, Mode};

use crate::apply::{payment_key, subscription_key};
use crate::Billing;

/// Which payments a list shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentFilter {
    All,
    Customer(String),
    Subscription(String),
}

/// Input of `POST /v1/refunds` and `POST /v1/disputes`.
#[derive(Debug, Clone, Default)]
pub struct RefundInput {
    pub transaction_id: Option<String>,
    /// Minor units; the whole remainder when absent.
    pub amount: Option<String>,
    pub reason: Option<String>,
}

impl Billing {
    pub fn get_payment(&self, scope: &Scope, id: &str) -> Result<Payment, EngineError> {
        match self
            .journal
            .store()
            .get(&payment_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_payment(&bytes),
            None => Err(EngineError::not_found("transaction", id)),
        }
    }

    pub fn get_subscription(&self, scope: &Scope, id: &str) -> Result<Subscription, EngineError> {
        match self
            .journal
            .store()
            .get(&subscription_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_subscription(&bytes),
            None => Err(EngineError::not_found("subscription", id)),
        }
    }

    /// Payments and refunds, newest first.
    pub fn list_payments(
        &self,
        scope: &Scope,
        filter: &PaymentFilter,
        page: &PageRequest,
    ) -> Result<Page<Payment>, EngineError> {
        let (table, owner) = match filter {
            PaymentFilter::All => (keys::PAYMENT_LIST, None),
            PaymentFilter::Customer(id) => (keys::PAYMENT_BY_CUSTOMER, Some(id.as_str())),
            PaymentFilter::Subscription(id) => (keys::PAYMENT_BY_SUBSCRIPTION, Some(id.as_str())),
        };
        let prefix = ListingKey::prefix(table, &scope.store_id, scope.mode, owner);
        let cursor = cursor_from(page, |id| {
            let payment = self.get_payment(scope, id)?;
            Ok(ListingKey::entry(
                table,
                &scope.store_id,
                scope.mode,
                owner,
                payment.created_at_ms,
                &payment.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                self.get_payment(scope, id).map(Some)
            },
        )
    }

    /// The payment a refund or dispute names, answering 404 on `transaction_id`.
    fn named_payment(&self, scope: &Scope, input: &RefundInput) -> Result<Payment, EngineError> {
        let id = input
            .transaction_id
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| FieldError::missing("transaction_id"))?;
        self.get_payment(scope, id)
            .map_err(|e| e.for_param("transaction_id"))
    }

    /// Refunds part or (by default) all of what is left of a payment; returns the
    /// refund, a transaction of type `refund`.
    pub async fn create_refund(
        &self,
        scope: &Scope,
        input: &RefundInput,
    ) -> Result<Payment, EngineError> {
        let original = self.named_payment(scope, input)?;
        let reason = parse_reason(input.reason.as_deref())?;
        let amount = match &input.amount {
            Some(text) => parse_positive_minor("amount", text)?,
            None => original.refundable(),
        };
        original.check_refund(amount)?;
        if amount == 0 {
            return Err(FieldError::new(
                "refund_exceeds_remaining",
                "transaction_id",
                format!("nothing of transaction '{}' is left to refund", original.id),
            )
            .into());
        }
        let now = self.journal.now_in(scope);
        // The payment's customer, checkout, subscription, period and card.
        let refund = Payment {
            id: new_id("txn").into(),
            payment_type: PaymentType::Refund,
            status: PaymentStatus::Refunded,
            amount,
            discount_amount: 0,
            tax_amount: 0,
            amount_paid: amount,
            refunded_amount: 0,
            description: format!("refund of {}", original.id),
            refund_of: Some(original.id.clone()),
            reason,
            disputed: false,
            created_at_ms: now,
            updated_at_ms: now,
            ..original
        };
        self.journal
            .append_and_apply(&Record::RefundCreated(refund.clone()))
            .await?;
        Ok(refund)
    }

    /// Opens a dispute on a payment (test mode: disputes come from card networks).
    pub async fn open_dispute(
        &self,
        scope: &Scope,
        input: &RefundInput,
    ) -> Result<Dispute, EngineError> {
        if scope.mode == Mode::Prod {
            return Err(FieldError::new(
                "test_mode_only",
                "transaction_id",
                "disputes are opened by card networks; this endpoint simulates one with a test key only",
            )
            .into());
        }
        let payment = self.named_payment(scope, input)?;
        let dispute = Dispute {
            id: new_id("dp").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            transaction_id: payment.id.clone(),
            customer_id: payment.customer_id.clone(),
            amount: payment.refundable(),
            currency: payment.currency.clone(),
            reason: parse_reason(input.reason.as_deref())?,
            created_at_ms: self.journal.now_in(scope),
        };
        self.journal
            .append_and_apply(&Record::DisputeOpened(dispute.clone()))
            .await?;
        Ok(dispute)
    }

    /// Sets the store's tax rate (percent) for a country.
    pub async fn set_tax_rate(
        &self,
        scope: &Scope,
        country: Option<&str>,
        rate: Option<&str>,
    ) -> Result<(String, rust_decimal::Decimal), EngineError> {
        let country = country
            .map(str::trim)
            .filter(|c| c.len() == 2 && c.chars().all(|ch| ch.is_ascii_uppercase()))
            .ok_or_else(|| {
                FieldError::invalid(
                    "country",
                    "`country` must be an ISO 3166-1 alpha-2 code, e.g. DE",
                )
            })?
            .to_string();
        let rate = parse_tax_rate(rate.ok_or_else(|| FieldError::missing("rate"))?)?;
        self.journal
            .append_and_apply(&Record::TaxRateSet {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                country: country.clone(),
                rate_percent: rate,
            })
            .await?;
        Ok((country, rate))
    }

    /// The store's tax rates (percent) by country, in country order (at most one
    /// per ISO 3166-1 alpha-2 code, so a few hundred).
    pub fn list_tax_rates(
        &self,
        scope: &Scope,
    ) -> Result<Vec<(String, rust_decimal::Decimal)>, EngineError> {
        let prefix = keys::Key::scoped(keys::TAX_RATE, &scope.store_id, scope.mode).into_bytes();
        tally_core::pagination::collect_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            usize::MAX,
            |key, value| {
                let parsed = keys::read_text(key, prefix.len()).and_then(|(country, _)| {
                    let rate = std::str::from_utf8(value).ok()?.parse().ok()?;
                    Some((country.to_string(), rate))
                });
                parsed
                    .map(Some)
                    .ok_or_else(|| EngineError::Corrupt("a tax rate row".into()))
            },
        )
    }
}
