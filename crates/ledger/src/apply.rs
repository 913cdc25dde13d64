//! The ledger's apply (called by the projector): every posting rule of a ledger step
//! decided in log order (docs/api.md, "Customer credits"), with grants assigned,
//! expiries booked, holds respected and thresholds checked by the layers below.

use rust_decimal::Decimal;
use tally_domain::ledger::{
    balances_after, check_open, post, Account, AccountStatus, Rejection, Transaction,
    TransactionKind, MAX_AMOUNT,
};
use tally_domain::record::LedgerEvent;
use tally_domain::Mode;

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};

use crate::posting::{
    account_missing, balance_key, balances_before, exhausted_key, movement_events, note_exhaustion,
    post_transaction, refused, stored_account, stored_balance, Posted, EVENT_CREDITS_EXHAUSTED,
};

/// Folds one ledger step into the projection (called by the projector), after
/// re-checking in log order every decision the service took before appending: the
/// account name is free, a closed account changes no more, the account takes
/// transactions, the idempotency key is new (or this repeats its transaction), a
/// reversal is the first, entries balance, no balance passes its limit and no
/// customer balance goes negative, and a closed account keeps nothing. A step that
/// fails a check is refused as a whole (the projector records the outcome).
///
/// Returns the webhook events of the step. They are decided here too, from the
/// balance the transaction leaves (ids derive from the transaction's, so a replay
/// produces the same ones); records written before that carry their own.
pub fn apply_ledger_step(
    overlay: &mut Overlay<'_>,
    account: Option<&Account>,
    transaction: Option<&Transaction>,
    events: &[LedgerEvent],
    base_updated_at_ms: Option<i64>,
    recorded_at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    // The status the transaction is checked against: the account's before this step.
    let mut status_before = None;
    if let Some(account) = account {
        let (store, mode) = (&account.store_id, account.mode);
        let key = Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
            .text(&account.id)
            .into_bytes();
        let stored = overlay.get(&key)?;
        if base_updated_at_ms.is_some() {
            let stored_at = stored
                .as_deref()
                .map(codec::decode_account)
                .transpose()?
                .map(|a| a.updated_at_ms);
            tally_core::outcome::check_base(base_updated_at_ms, stored_at)?;
        }
        match stored {
            None => {
                let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, store, mode)
                    .text(&account.customer_id)
                    .text(&account.name)
                    .into_bytes();
                if overlay.contains(&name_key)? {
                    return Err(account_name_taken(&account.customer_id, &account.name).into());
                }
                status_before = Some(AccountStatus::Active);
                for (table, owner) in [
                    (keys::CREDIT_ACCOUNT_LIST, None),
                    (
                        keys::CREDIT_ACCOUNT_BY_CUSTOMER,
                        Some(account.customer_id.as_str()),
                    ),
                ] {
                    let entry = ListingKey::entry(
                        table,
                        store,
                        mode,
                        owner,
                        account.created_at_ms,
                        &account.id,
                    );
                    overlay.put(entry, Vec::new());
                }
                overlay.put(name_key, account.id.as_bytes().to_vec());
                overlay.put(
                    balance_key(store, mode, &account.id),
                    codec::encode_account_totals(codec::AccountTotals::default()),
                );
            }
            Some(bytes) => {
                let before = codec::decode_account(&bytes)?;
                if before.status == AccountStatus::Closed {
                    return Err(refused(Rejection::AccountClosed));
                }
                status_before = Some(before.status);
                // A recharge waiting for its charge is dropped when its terms change
                // or the account stops being active: it was asked for under others.
                if before.auto_recharge != account.auto_recharge
                    || account.status != AccountStatus::Active
                {
                    overlay.delete(keys::recharge_pending_key(store, mode, &account.id));
                }
            }
        }
        overlay.put(key, codec::encode_account(account));
    }
    let mut events = events.to_vec();
    let mut debit = None;
    if let Some(tx) = transaction {
        let posted = apply_transaction(overlay, tx, status_before, account, recorded_at_ms)?;
        let mut decided = posted.expired;
        decided.extend(if events.is_empty() {
            movement_events(&posted.transaction, &posted.account, posted.balance_after)
        } else {
            std::mem::take(&mut events)
        });
        events = decided;
        debit = Some(posted.transaction).filter(|t| t.kind == TransactionKind::Debit);
    }
    // Thresholds and auto-recharge, right after the step (docs/api.md).
    let subject = transaction
        .map(|t| {
            (
                t.store_id.clone(),
                t.mode,
                t.account_id.clone(),
                t.id.to_string(),
            )
        })
        .or(account.map(|a| {
            let cause = format!("{}:{recorded_at_ms}", a.id);
            (a.store_id.clone(), a.mode, a.id.clone(), cause)
        }));
    if let Some((store, mode, account_id, cause)) = subject {
        events.extend(crate::thresholds::after_step(
            overlay,
            &store,
            mode,
            &account_id,
            recorded_at_ms,
            debit.as_ref(),
            &cause,
        )?);
    }
    if let Some(account) = account.filter(|a| a.status == AccountStatus::Closed) {
        if transaction.is_none() {
            // Nothing live was left to forfeit, so no transaction booked what expired
            // before the close: book it here, first, as every step does (docs/api.md,
            // "Credit grants"). Without this, credits of a grant past its instant but
            // not yet swept stayed in the balance and the close was refused.
            let expired = crate::grants::book_expiries(overlay, account, recorded_at_ms)?;
            events.splice(0..0, expired);
        }
        crate::holds::release_all(overlay, account, recorded_at_ms)?;
        let left =
            crate::posting::stored_balance(overlay, &account.store_id, account.mode, &account.id)?;
        if !left.is_zero() {
            return Err(Outcome::rejected(
                "account_balance_changed",
                "the balance changed while the account was being closed; retry the close",
            )
            .into());
        }
    }
    note_exhaustion(overlay, &events);
    Ok(events)
}

/// Credits a purchase grants (a product's `customer_credits` features, at its
/// checkout and for each period its subscription pays), as billing asks for them in
/// the apply of the purchase's record: decided with the purchase, so a crash can
/// never keep one without the other.
#[derive(Debug, Clone, PartialEq)]
pub struct PurchaseGrant<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub customer_id: &'a str,
    pub account_name: &'a str,
    pub unit_label: &'a str,
    pub amount: Decimal,
    /// Once per purchase and feature: the credit's idempotency key, and the seed of
    /// its ids (and of the account's, when the grant creates it).
    pub key: &'a str,
    pub description: &'a str,
    pub created_at_ms: i64,
}

/// Credits `grant.amount` to the customer's account of that name, created when
/// missing (active, ids derived from the grant's key, so a replay makes the same
/// ones). Nothing when its key was booked already (a log of an earlier build,
/// where the service credited after the purchase, holds that credit itself), or
/// when the account is frozen or closed: it takes no transactions. Refused like
/// any credit past a limit (the caller keeps the purchase and drops the grant).
pub fn apply_purchase_grant(
    overlay: &mut Overlay<'_>,
    grant: &PurchaseGrant<'_>,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let (store, mode, at) = (grant.store_id, grant.mode, grant.created_at_ms);
    let idempotency = Key::scoped(keys::CREDIT_IDEMPOTENCY, store, mode).tail(grant.key.as_bytes());
    if overlay.contains(idempotency.as_bytes())? {
        return Ok(Vec::new());
    }
    let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, store, mode)
        .text(grant.customer_id)
        .text(grant.account_name)
        .into_bytes();
    let (account, created) = match overlay.get(&name_key)? {
        Some(id) => {
            let id = String::from_utf8_lossy(&id).into_owned();
            let Some(account) = stored_account(overlay, store, mode, &id)? else {
                return Err(EngineError::Corrupt(format!("account {id} named but missing")).into());
            };
            (account, false)
        }
        None => (
            Account {
                id: tally_core::ids::derived_id("ca", grant.key).into(),
                store_id: store.into(),
                mode,
                customer_id: grant.customer_id.into(),
                name: grant.account_name.to_string(),
                unit_label: grant.unit_label.to_string(),
                status: AccountStatus::Active,
                created_at_ms: at,
                updated_at_ms: at,
                low_balance_threshold: None,
                auto_recharge: None,
            },
            true,
        ),
    };
    if account.status != AccountStatus::Active {
        return Ok(Vec::new());
    }
    let balance = if created {
        Decimal::ZERO
    } else {
        stored_balance(overlay, store, mode, &account.id)?
    };
    let mut tx = derived_credit(
        &account,
        balance,
        grant.amount,
        tally_core::ids::derived_id("ctx", grant.key),
        at,
    )?;
    tx.idempotency_key = Some(grant.key.to_string());
    tx.description = Some(grant.description.to_string());
    apply_ledger_step(
        overlay,
        created.then_some(&account),
        Some(&tx),
        &[],
        None,
        at,
    )
}

/// A credit of `amount` to `account` (holding `balance`) decided in apply: its id
/// given (derived from what caused it, so a replay makes the same), its entries'
/// ids derived from it. It makes a grant of no expiry and priority 50, as every
/// credit without grant terms does.
fn derived_credit(
    account: &Account,
    balance: Decimal,
    amount: Decimal,
    transaction_id: String,
    at: i64,
) -> Result<Transaction, ApplyError> {
    let mut entry_id = tally_domain::ledger::entry_ids(&transaction_id);
    let entries = post(
        TransactionKind::Credit,
        &account.id,
        account.status,
        balance,
        amount,
        &mut entry_id,
    )
    .map_err(refused)?;
    Ok(Transaction {
        id: transaction_id.clone().into(),
        store_id: account.store_id.clone(),
        mode: account.mode,
        kind: TransactionKind::Credit,
        account_id: account.id.clone(),
        amount,
        entries,
        idempotency_key: None,
        description: None,
        metadata: Default::default(),
        reverses: None,
        created_at_ms: at,
        grant_terms: None,
    })
}

/// The customer's active account named `name`, if any (usage settlement's debits
/// and take-backs find the account by name).
fn active_account_named(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    customer_id: &str,
    name: &str,
) -> Result<Option<Account>, ApplyError> {
    let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, store, mode)
        .text(customer_id)
        .text(name)
        .into_bytes();
    let Some(account_id) = overlay.get(&name_key)? else {
        return Ok(None);
    };
    let account_id = String::from_utf8_lossy(&account_id).into_owned();
    let Some(account) = stored_account(overlay, store, mode, &account_id)? else {
        return Err(EngineError::Corrupt(format!("account {account_id} named but missing")).into());
    };
    Ok(Some(account).filter(|a| a.status == AccountStatus::Active))
}

/// Gives back credits a void took out of usage settled in credits (docs/api.md,
/// "Usage prices settled in credits"): a credit of `refund.amount` to the customer's
/// account of that name, a grant of no expiry like any credit, carrying the usage
/// debit's description and metadata. Answers what it gave: nothing when the account
/// is gone, frozen or closed (it takes no transactions).
pub fn apply_usage_refund(
    overlay: &mut Overlay<'_>,
    refund: &UsageDebit<'_>,
) -> Result<(Decimal, Vec<LedgerEvent>), ApplyError> {
    let (store, mode) = (refund.store_id, refund.mode);
    let Some(account) = active_account_named(
        overlay,
        store,
        mode,
        refund.customer_id,
        refund.account_name,
    )?
    else {
        return Ok((Decimal::ZERO, Vec::new()));
    };
    let balance = stored_balance(overlay, store, mode, &account.id)?;
    let mut tx = derived_credit(
        &account,
        balance,
        refund.amount,
        refund.transaction_id.clone(),
        refund.created_at_ms,
    )?;
    tx.description = Some(refund.description.clone());
    tx.metadata = refund.metadata.clone();
    let events = apply_ledger_step(overlay, None, Some(&tx), &[], None, refund.created_at_ms)?;
    Ok((refund.amount, events))
}

/// A debit for usage settled in credits, as billing's settlement asks for it.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageDebit<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub customer_id: &'a str,
    pub account_name: &'a str,
    pub amount: Decimal,
    pub transaction_id: String,
    pub description: String,
    pub metadata: std::collections::BTreeMap<String, String>,
    pub created_at_ms: i64,
}

/// Debits usage from the customer's account of that name, never below zero: takes
/// what the account holds up to `amount` and answers what it took (0 when the
/// customer has no such account, or it is not active). Emits `credits.consumed`,
/// and `customer_credits.exhausted` when the account is left empty; an account
/// already empty announces its exhaustion once (until it holds credits again).
pub fn apply_usage_debit(
    overlay: &mut Overlay<'_>,
    debit: &UsageDebit<'_>,
) -> Result<(Decimal, Vec<LedgerEvent>), ApplyError> {
    let (store, mode) = (debit.store_id, debit.mode);
    let Some(account) =
        active_account_named(overlay, store, mode, debit.customer_id, debit.account_name)?
    else {
        return Ok((Decimal::ZERO, Vec::new()));
    };
    let account_id = account.id.to_string();
    // Grants expired by the record's time hold nothing to take.
    let expired = crate::grants::book_expiries(overlay, &account, debit.created_at_ms)?;
    note_exhaustion(overlay, &expired);
    let balance = stored_balance(overlay, store, mode, &account_id)?;
    // Only what no reservation holds (docs/api.md, "Reservations").
    let held = crate::holds::held(overlay, store, mode, &account_id, debit.created_at_ms)?;
    let available = tally_domain::reservation::available(balance, held);
    let take = debit.amount.min(available);
    if take <= Decimal::ZERO {
        let marker = exhausted_key(store, mode, &account_id);
        if overlay.contains(&marker)? {
            return Ok((Decimal::ZERO, expired));
        }
        let mut events = expired;
        let exhausted = vec![LedgerEvent {
            id: tally_core::ids::derived_id(
                "whevt",
                &format!("{}:exhausted", debit.transaction_id),
            ),
            event_type: EVENT_CREDITS_EXHAUSTED.to_string(),
            created_at_ms: debit.created_at_ms,
            transaction_id: None,
            account,
            balance,
        }];
        note_exhaustion(overlay, &exhausted);
        events.extend(exhausted);
        return Ok((Decimal::ZERO, events));
    }
    let mut entry_id = tally_domain::ledger::entry_ids(&debit.transaction_id);
    let entries = post(
        TransactionKind::Debit,
        &account.id,
        account.status,
        balance,
        take,
        &mut entry_id,
    )
    .map_err(refused)?;
    let mut metadata = debit.metadata.clone();
    if take < debit.amount {
        metadata.insert(
            "requested".into(),
            tally_domain::usage::canonical_decimal(debit.amount),
        );
        metadata.insert(
            "shortfall".into(),
            tally_domain::usage::canonical_decimal(debit.amount - take),
        );
    }
    let tx = Transaction {
        id: debit.transaction_id.clone().into(),
        store_id: store.into(),
        mode,
        kind: TransactionKind::Debit,
        account_id: account.id.clone(),
        amount: take,
        entries,
        idempotency_key: None,
        description: Some(debit.description.clone()),
        metadata,
        reverses: None,
        created_at_ms: debit.created_at_ms,
        grant_terms: None,
    };
    let posted = apply_transaction(overlay, &tx, None, None, debit.created_at_ms)?;
    let moved = movement_events(&posted.transaction, &posted.account, posted.balance_after);
    note_exhaustion(overlay, &posted.expired);
    note_exhaustion(overlay, &moved);
    let after = crate::thresholds::after_step(
        overlay,
        store,
        mode,
        &account_id,
        debit.created_at_ms,
        Some(&posted.transaction),
        &posted.transaction.id,
    )?;
    let mut events = expired;
    events.extend(posted.expired);
    events.extend(moved);
    events.extend(after);
    Ok((take, events))
}

/// One transaction of a ledger step; `status_before` is the account's status before
/// the step when the step carries the account (created or changed), else read here.
/// A transaction that takes from the account (other than a close) must leave at
/// least what its live holds at record time `at_ms` take (docs/api.md,
/// "Reservations").
pub(crate) fn apply_transaction(
    overlay: &mut Overlay<'_>,
    tx: &Transaction,
    status_before: Option<AccountStatus>,
    account_in_step: Option<&Account>,
    at_ms: i64,
) -> Result<Posted, ApplyError> {
    let (store, mode) = (&tx.store_id, tx.mode);
    let stored = match account_in_step.filter(|a| a.id == tx.account_id) {
        Some(account) => account.clone(),
        None => stored_account(overlay, store, mode, &tx.account_id)?
            .ok_or_else(|| account_missing(&tx.account_id))?,
    };
    let status = status_before.unwrap_or(stored.status);
    // A close posts against a frozen account too; everything else needs it active.
    if tx.kind != TransactionKind::Close {
        check_open(status).map_err(refused)?;
    }
    if !movement_matches_kind(tx) {
        return Err(refused(Rejection::Unbalanced));
    }
    if let Some(idempotency_key) = &tx.idempotency_key {
        let key = Key::scoped(keys::CREDIT_IDEMPOTENCY, store, mode)
            .tail(idempotency_key.as_bytes())
            .into_bytes();
        if let Some(existing_id) = overlay.get(&key)? {
            let existing_id = String::from_utf8_lossy(&existing_id).into_owned();
            let existing_key = Key::scoped(keys::CREDIT_TRANSACTION, store, mode)
                .text(&existing_id)
                .into_bytes();
            let existing = match overlay.get(&existing_key)? {
                Some(bytes) => codec::decode_transaction(&bytes)?,
                None => {
                    return Err(EngineError::Corrupt(
                        "idempotency key without its transaction".into(),
                    )
                    .into())
                }
            };
            return Err(if same_request(&existing, tx) {
                ApplyError::Refused(Outcome::SameAs { id: existing_id })
            } else {
                idempotency_key_reused().into()
            });
        }
        overlay.put(key, tx.id.as_bytes().to_vec());
    }
    if let Some(original) = &tx.reverses {
        let key = Key::scoped(keys::CREDIT_REVERSED, store, mode)
            .text(original)
            .into_bytes();
        if overlay.contains(&key)? {
            return Err(refused(Rejection::AlreadyReversed));
        }
        overlay.put(key, tx.id.as_bytes().to_vec());
    }
    // Grants are decided here, in log order: expiries due at the record's time are
    // booked first (a debit recorded after an expiry cannot use it), then the
    // transaction's account side is given its grants (docs/api.md, "Credit grants").
    let expired = crate::grants::book_expiries(overlay, &stored, at_ms)?;
    // The balances it leaves are checked before grants are assigned, so a step past
    // a limit is refused as that (`amount_out_of_range`), whatever its grants.
    let before = balances_before(overlay, tx)?;
    balances_after(tx, &|id: &str| before.get(id).copied().unwrap_or_default()).map_err(refused)?;
    let mut decided = tx.clone();
    crate::grants::assign(overlay, &mut decided, at_ms)?;
    let balance_after = post_transaction(overlay, &decided, at_ms)?;
    Ok(Posted {
        account: stored,
        balance_after,
        transaction: decided,
        expired,
    })
}

/// Whether the account's side of a transaction is what its kind says: a credit or
/// seed adds its positive `amount`, a debit takes it, a close empties the account.
/// The service only writes such transactions; apply refuses any other.
fn movement_matches_kind(tx: &Transaction) -> bool {
    let delta = tx.delta_for(&tx.account_id);
    let in_range = tx.amount > Decimal::ZERO && tx.amount <= MAX_AMOUNT;
    match tx.kind {
        TransactionKind::Credit | TransactionKind::InitialBalance => in_range && delta == tx.amount,
        TransactionKind::Debit | TransactionKind::GrantVoid => in_range && delta == -tx.amount,
        // Built by apply itself, never appended.
        TransactionKind::Expiry => false,
        TransactionKind::Close => delta <= Decimal::ZERO,
        TransactionKind::Reversal => tx.reverses.is_some(),
    }
}

/// Whether `tx` repeats `existing` (same idempotency key): same account, amount and
/// operation. Then the caller gets the existing transaction, not a second one.
fn same_request(existing: &Transaction, tx: &Transaction) -> bool {
    existing.account_id == tx.account_id && existing.amount == tx.amount && existing.kind == tx.kind
}

pub(crate) fn idempotency_key_reused() -> Outcome {
    Outcome::rejected(
        "idempotency_key_reused",
        "this idempotency_key was used for a different amount, account or operation",
    )
    .with_param("idempotency_key")
}

pub(crate) fn account_name_taken(customer_id: &str, name: &str) -> Outcome {
    Outcome::rejected(
        "account_name_taken",
        format!("customer {customer_id} already has an account named '{name}'"),
    )
    .with_param("name")
}

/// `CreditExpiriesDue`: books the account's expiries due at record time `at_ms`. An
/// account gone or closed has nothing to book (its grants ended with it).
pub fn apply_expiries_due(
    overlay: &mut Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
    at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let Some(account) = stored_account(overlay, store, mode, account_id)? else {
        return Ok(Vec::new());
    };
    let mut events = crate::grants::book_expiries(overlay, &account, at_ms)?;
    note_exhaustion(overlay, &events);
    events.extend(crate::thresholds::after_step(
        overlay,
        store,
        mode,
        account_id,
        at_ms,
        None,
        &format!("{account_id}:{at_ms}:expiry"),
    )?);
    Ok(events)
}
