//! Low-balance thresholds and auto-recharge (docs/api.md, "Thresholds and
//! auto-recharge"), decided in apply after every step of an account, in log order:
//!
//! - `credits.balance_low` fires once each time the available balance (balance less
//!   live holds) crosses below the account's `low_balance_threshold`: a marker (table
//!   `;`) remembers that it is below, and is cleared when it is at or above again.
//! - After a debit that leaves the balance below `auto_recharge.threshold`, a credit
//!   of `auto_recharge.amount` (a grant, description `auto_recharge`) is booked in the
//!   same record, right after the debit, and `credits.auto_recharged` fires: at most
//!   one per debit. A recharge that would break a limit is not booked (the debit
//!   stands).
//! - A priced auto-recharge is charged first: the debit leaves a pending recharge
//!   (table `"`, one per account at a time) that billing's scheduler charges on
//!   the customer's last successful payment method, then settles with an
//!   `AutoRechargeSettled` record: paid, the grant is booked as above (naming the
//!   payment); declined, nothing is booked, `auto_recharge` is cleared and
//!   `credits.auto_recharge_failed` fires.

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use tally_core::outcome::Outcome;
use tally_domain::grant::MAX_ACTIVE_GRANTS_PER_ACCOUNT;
use tally_domain::ledger::{
    balances_after, Account, AccountStatus, Entry, SystemAccount, Transaction, TransactionKind,
};
use tally_domain::record::{LedgerEvent, RechargeOutcome, RechargeSettled};
use tally_domain::Mode;

use tally_core::keys::{self, Key};
use tally_core::overlay::{ApplyError, Overlay};

use crate::posting::{note_exhaustion, stored_account, stored_balance};

pub const EVENT_CREDITS_BALANCE_LOW: &str = "credits.balance_low";
pub const EVENT_CREDITS_AUTO_RECHARGED: &str = "credits.auto_recharged";
pub const EVENT_CREDITS_AUTO_RECHARGE_FAILED: &str = "credits.auto_recharge_failed";
/// The description of a recharge's grant.
pub const AUTO_RECHARGE_DESCRIPTION: &str = "auto_recharge";

fn low_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_BALANCE_LOW, store, mode)
        .text(account_id)
        .into_bytes()
}

/// Runs after a step of the account decided at record time `at_ms`: `debit` is the
/// step's debit, when it was one; `cause` is a unique name of the step (event ids
/// derive from it). Stores and answers the events.
pub(crate) fn after_step(
    overlay: &mut Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
    at_ms: i64,
    debit: Option<&Transaction>,
    cause: &str,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let Some(account) = stored_account(overlay, store, mode, account_id)? else {
        return Ok(Vec::new());
    };
    let mut events = Vec::new();
    if let (Some(debit), Some(recharge), AccountStatus::Active) =
        (debit, account.auto_recharge.as_ref(), account.status)
    {
        let balance = stored_balance(overlay, store, mode, account_id)?;
        if balance < recharge.threshold {
            match recharge.price {
                None => events.extend(recharge_after(
                    overlay,
                    &account,
                    Recharge {
                        debit_id: &debit.id,
                        created_at_ms: debit.created_at_ms,
                        amount: recharge.amount,
                        payment_id: None,
                    },
                    at_ms,
                )?),
                // Charged first; one at a time per account.
                Some(_) => {
                    let pending = keys::recharge_pending_key(store, mode, account_id);
                    if !overlay.contains(&pending)? {
                        overlay.put(pending, debit.id.as_bytes().to_vec());
                    }
                }
            }
        }
    }
    let marker = low_key(store, mode, account_id);
    let below = match (account.low_balance_threshold, account.status) {
        (Some(threshold), AccountStatus::Active | AccountStatus::Frozen) => {
            let balance = stored_balance(overlay, store, mode, account_id)?;
            let held = crate::holds::held(overlay, store, mode, account_id, at_ms)?;
            tally_domain::reservation::available(balance, held) < threshold
        }
        _ => false,
    };
    let marked = overlay.contains(&marker)?;
    if below && !marked {
        overlay.put(marker, Vec::new());
        let balance = stored_balance(overlay, store, mode, account_id)?;
        events.push(LedgerEvent {
            id: tally_core::ids::derived_id("whevt", &format!("{cause}:balance_low")),
            event_type: EVENT_CREDITS_BALANCE_LOW.to_string(),
            created_at_ms: at_ms,
            transaction_id: None,
            account: account.clone(),
            balance,
        });
    } else if !below && marked {
        overlay.delete(marker);
    }
    note_exhaustion(overlay, &events);
    Ok(events)
}

/// `AutoRechargeSettled`: settles the recharge `debit_id` left pending (else it is
/// refused: settled already, or never pending). Paid: its grant is booked (none
/// when it would break a limit: then `Ok(false)`, and billing stores no payment);
/// declined: the account's `auto_recharge` is cleared. Answers the events and
/// whether a grant was booked.
pub fn apply_recharge_settled(
    overlay: &mut Overlay<'_>,
    settled: &RechargeSettled,
    at_ms: i64,
) -> Result<(Vec<LedgerEvent>, bool), ApplyError> {
    let (store, mode, account_id) = (settled.store_id.as_str(), settled.mode, &settled.account_id);
    let pending = keys::recharge_pending_key(store, mode, account_id);
    if overlay.get(&pending)?.as_deref() != Some(settled.debit_id.as_bytes()) {
        return Err(Outcome::rejected(
            "recharge_not_pending",
            format!(
                "no auto-recharge of account {account_id} waits for debit {}",
                settled.debit_id
            ),
        )
        .into());
    }
    overlay.delete(pending);
    let Some(mut account) = stored_account(overlay, store, mode, account_id)? else {
        return Err(crate::posting::account_missing(account_id));
    };
    if let RechargeOutcome::Paid(payment) = &settled.outcome {
        // The payment must be the account customer's, of this scope, and paid.
        let theirs = payment.customer_id == account.customer_id
            && payment.store_id == account.store_id
            && payment.mode == mode
            && payment.amount_paid > 0;
        if !theirs {
            return Err(Outcome::rejected(
                "parameter_invalid",
                "an auto-recharge's payment is not a payment of the account's customer",
            )
            .into());
        }
    }
    let (mut events, booked) = match &settled.outcome {
        RechargeOutcome::Paid(payment) if account.status == AccountStatus::Active => {
            let recharge = Recharge {
                debit_id: &settled.debit_id,
                created_at_ms: at_ms,
                amount: settled.amount,
                payment_id: Some(&payment.id),
            };
            let events = recharge_after(overlay, &account, recharge, at_ms)?;
            let booked = !events.is_empty();
            (events, booked)
        }
        // A frozen or closed account takes no grant: the charge is not kept.
        RechargeOutcome::Paid(_) => (Vec::new(), false),
        RechargeOutcome::Declined { .. } => {
            account.auto_recharge = None;
            // A newer version: an update derived from the one before is refused
            // (and derived again), so it cannot put the declined terms back.
            account.updated_at_ms = at_ms.max(account.updated_at_ms.saturating_add(1));
            overlay.put(
                Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
                    .text(account_id)
                    .into_bytes(),
                tally_core::codec::encode_account(&account),
            );
            let balance = stored_balance(overlay, store, mode, account_id)?;
            let event = LedgerEvent {
                id: format!("whevt_rf{}", settled.debit_id.trim_start_matches("ctx_")),
                event_type: EVENT_CREDITS_AUTO_RECHARGE_FAILED.to_string(),
                created_at_ms: at_ms,
                transaction_id: None,
                account: account.clone(),
                balance,
            };
            (vec![event], false)
        }
    };
    note_exhaustion(overlay, &events);
    events.extend(after_step(
        overlay,
        store,
        mode,
        account_id,
        at_ms,
        None,
        &format!("{}:recharge", settled.debit_id),
    )?);
    Ok((events, booked))
}

/// A recharge to book: after which debit, when, how much, paid by which payment
/// (none: a free grant).
struct Recharge<'a> {
    debit_id: &'a str,
    created_at_ms: i64,
    amount: Decimal,
    payment_id: Option<&'a str>,
}

/// The credit an auto-recharge books right after its debit (none when it would
/// break a limit: the account's active grants or a balance's range).
fn recharge_after(
    overlay: &mut Overlay<'_>,
    account: &Account,
    recharge: Recharge<'_>,
    at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let Recharge {
        debit_id,
        created_at_ms,
        amount,
        payment_id,
    } = recharge;
    let (store, mode) = (account.store_id.as_str(), account.mode);
    let active = crate::grants::load_active(overlay, store, mode, &account.id)?;
    if active.len() >= MAX_ACTIVE_GRANTS_PER_ACCOUNT {
        return Ok(Vec::new());
    }
    let id = format!("ctx_r{}", debit_id.trim_start_matches("ctx_"));
    let mut tx = Transaction {
        id: id.clone().into(),
        store_id: account.store_id.clone(),
        mode,
        kind: TransactionKind::Credit,
        account_id: account.id.clone(),
        amount,
        entries: vec![
            Entry {
                id: tally_domain::ledger::entry_id(&id, 1),
                account_id: account.id.clone(),
                amount,
                grant_id: None,
            },
            Entry {
                id: tally_domain::ledger::entry_id(&id, 2),
                account_id: SystemAccount::Issuance.account_id().into(),
                amount: -amount,
                grant_id: None,
            },
        ],
        idempotency_key: None,
        description: Some(AUTO_RECHARGE_DESCRIPTION.to_string()),
        metadata: BTreeMap::from_iter(
            [("debit_id", Some(debit_id)), ("payment_id", payment_id)]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v?.to_string()))),
        ),
        reverses: None,
        created_at_ms,
        grant_terms: None,
    };
    let before = crate::posting::balances_before(overlay, &tx)?;
    if balances_after(&tx, &|id: &str| before.get(id).copied().unwrap_or_default()).is_err() {
        return Ok(Vec::new());
    }
    crate::grants::assign(overlay, &mut tx, at_ms)?;
    let balance_after = crate::posting::post_transaction(overlay, &tx, at_ms)?;
    Ok(vec![LedgerEvent {
        id: format!("whevt_{}a", tx.id.trim_start_matches("ctx_")),
        event_type: EVENT_CREDITS_AUTO_RECHARGED.to_string(),
        created_at_ms: tx.created_at_ms,
        transaction_id: Some(tx.id.clone()),
        account: account.clone(),
        balance: balance_after,
    }])
}
