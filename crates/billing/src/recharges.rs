//! Priced auto-recharges (docs/api.md, "Thresholds and auto-recharge"): a debit
//! that leaves an account below the threshold of an auto-recharge with a price
//! leaves the recharge pending in the ledger; the scheduler charges its price on the
//! customer's last successful payment method and appends the outcome as one
//! `AutoRechargeSettled` record, which apply decides (the grant and the payment
//! together, or, on a decline, `auto_recharge` cleared and a webhook).
//!
//! Nothing is decided here that apply does not re-check: two schedulers that charge
//! the same pending recharge append two records, and apply settles the first and
//! refuses the second (`recharge_not_pending`), so one grant and one payment are
//! kept. The charge itself follows the provider's contract (`PaymentProvider`): a
//! provider that moves real money authorizes here and captures once applied.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::keys::ListingKey;
use tally_core::pagination::collect_prefix;
use tally_core::Scope;
use tally_domain::billing::{Payment, PaymentStatus, PaymentType};
use tally_domain::record::{RechargeOutcome, RechargeSettled, Record};
use tally_domain::subscription::PaymentLine;

use crate::apply::payment_key;
use crate::{Billing, CardOnFile, RechargeDue};

/// Pending recharges one pass of the scheduler charges (bounds one pass; the next
/// pass takes the rest).
pub const RECHARGE_BATCH: usize = 100;

/// A customer's payments read back (newest first) looking for a card to charge
/// again: a customer with this many payments without a card (refunds) has none.
pub const MAX_PAYMENTS_SEARCHED: usize = 100;

/// The description of a recharge's payment and of its line.
pub fn recharge_description(due: &RechargeDue) -> String {
    format!(
        "auto_recharge of {} {} on account {}",
        tally_domain::usage::canonical_decimal(due.amount),
        due.unit_label,
        due.account_id
    )
}

impl Billing {
    /// Charges up to `RECHARGE_BATCH` pending recharges; answers how many.
    pub(crate) async fn charge_recharges(&self) -> Result<usize, EngineError> {
        let due = self.credits.recharges_due(RECHARGE_BATCH)?;
        for recharge in &due {
            self.charge_recharge(recharge).await?;
        }
        Ok(due.len())
    }

    async fn charge_recharge(&self, due: &RechargeDue) -> Result<(), EngineError> {
        let scope = &due.scope;
        let now = self.journal.now_in(scope);
        let card = self.last_card(scope, &due.customer_id)?;
        let outcome = match (card, self.provider(scope.mode)) {
            (None, _) => RechargeOutcome::Declined {
                message: format!(
                    "customer {} has no successful card payment to charge",
                    due.customer_id
                ),
            },
            (Some(_), None) => RechargeOutcome::Declined {
                message: "no payment provider is configured for live payments".into(),
            },
            (Some(card), Some(provider)) => {
                match provider.charge_on_file(&card, due.price.amount, &due.price.currency, now) {
                    Ok(()) => RechargeOutcome::Paid(recharge_payment(due, &card, now)),
                    Err(EngineError::CardDeclined { message, .. }) => {
                        RechargeOutcome::Declined { message }
                    }
                    Err(error) => return Err(error),
                }
            }
        };
        let record = Record::AutoRechargeSettled(RechargeSettled {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            account_id: due.account_id.clone().into(),
            debit_id: due.debit_id.clone().into(),
            amount: due.amount,
            outcome,
        });
        match self.journal.append_and_decide(&record).await {
            Ok(_) => Ok(()),
            // Another scheduler settled it first, or its terms changed meanwhile:
            // nothing is kept of this charge.
            Err(EngineError::Conflict {
                code: "recharge_not_pending",
                ..
            }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// The card of the customer's latest paid payment, if any.
    fn last_card(
        &self,
        scope: &Scope,
        customer_id: &str,
    ) -> Result<Option<CardOnFile>, EngineError> {
        let prefix = ListingKey::prefix(
            tally_core::keys::PAYMENT_BY_CUSTOMER,
            &scope.store_id,
            scope.mode,
            Some(customer_id),
        );
        let ids = collect_prefix(
            self.journal.store().as_ref(),
            &prefix,
            true,
            MAX_PAYMENTS_SEARCHED,
            |key, _| ListingKey::id_in(&prefix, key).map(|id| Some(id.to_string())),
        )?;
        for id in ids {
            let Some(bytes) =
                self.journal
                    .store()
                    .get(&payment_key(&scope.store_id, scope.mode, &id))?
            else {
                continue;
            };
            let payment = codec::decode_payment(&bytes)?;
            if let (true, Some(last4)) = (payment.succeeded(), payment.card_last4) {
                return Ok(Some(CardOnFile {
                    last4,
                    declines_later: payment.card_declines_later,
                    exp: payment.card_exp,
                }));
            }
        }
        Ok(None)
    }
}

/// The payment of a recharge charged on `card` at `now`: its price, without tax or
/// discount, one line.
fn recharge_payment(due: &RechargeDue, card: &CardOnFile, now: i64) -> Payment {
    let description = recharge_description(due);
    let price = due.price.amount;
    Payment {
        id: new_id("txn").into(),
        store_id: due.scope.store_id.clone(),
        mode: due.scope.mode,
        payment_type: PaymentType::Payment,
        status: PaymentStatus::Paid,
        amount: price,
        currency: due.price.currency.clone(),
        discount_amount: 0,
        tax_amount: 0,
        amount_paid: price,
        refunded_amount: 0,
        tax_country: None,
        checkout_id: None,
        subscription_id: None,
        customer_id: due.customer_id.clone().into(),
        description: description.clone(),
        period_start_ms: None,
        period_end_ms: None,
        refund_of: None,
        reason: None,
        disputed: false,
        card_last4: Some(card.last4.clone()),
        card_declines_later: card.declines_later,
        card_exp: card.exp.clone(),
        lines: vec![PaymentLine {
            description,
            meter_id: None,
            quantity: due.amount,
            unit_price: rust_decimal::Decimal::from(price)
                .checked_div(due.amount)
                .unwrap_or_default(),
            amount: price,
        }],
        affiliate_id: None,
        affiliate_commission: 0,
        created_at_ms: now,
        updated_at_ms: now,
    }
}
