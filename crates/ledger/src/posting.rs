//! Posting: the ledger's lowest layer in apply. A transaction whose entries are final
//! is checked against the balances it leaves (and the account's live holds) and
//! written with its entries, each at the end of its account's entry list (the
//! account's row, `b`, keeps the balance with the list's length), and its webhook
//! events are made. Everything that
//! decides a transaction (grants, holds, thresholds, the rules of each step) sits
//! above and calls down here.

use rust_decimal::Decimal;
use tally_domain::exact::exact_add;
use tally_domain::ledger::{
    balances_after, Account, Rejection, SystemAccount, Transaction, TransactionKind,
};
use tally_domain::record::LedgerEvent;
use tally_domain::Mode;

use tally_core::codec::{self, StoredEntry};
use tally_core::error::EngineError;
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};

pub const EVENT_CREDITS_GRANTED: &str = "credits.granted";
pub const EVENT_CREDITS_CONSUMED: &str = "credits.consumed";
pub const EVENT_CREDITS_EXHAUSTED: &str = "customer_credits.exhausted";
pub const EVENT_CREDITS_EXPIRED: &str = "credits.expired";

pub(crate) fn refused(rejection: Rejection) -> ApplyError {
    ApplyError::Refused(Outcome::rejected(rejection.code(), rejection.message()))
}

pub(crate) fn balance_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_BALANCE, store, mode)
        .text(account_id)
        .into_bytes()
}

/// An account's balance as posted (0 before its first entry).
pub(crate) fn stored_balance(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
) -> Result<Decimal, EngineError> {
    Ok(account_totals(|key| overlay.get(key), store, mode, account_id)?.balance)
}

/// An account's row (`b`) as stored: its balance and entry list so far (zero and
/// empty before its first entry).
pub(crate) fn account_totals(
    read: impl FnOnce(&[u8]) -> Result<Option<Vec<u8>>, EngineError>,
    store: &str,
    mode: Mode,
    account_id: &str,
) -> Result<codec::AccountTotals, EngineError> {
    match read(&balance_key(store, mode, account_id))? {
        Some(bytes) => codec::decode_account_totals(&bytes),
        None => Ok(codec::AccountTotals::default()),
    }
}

/// A customer account as stored, if there is one.
pub(crate) fn stored_account(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
) -> Result<Option<Account>, EngineError> {
    let key = Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
        .text(account_id)
        .into_bytes();
    overlay
        .get(&key)?
        .map(|bytes| codec::decode_account(&bytes))
        .transpose()
}

/// The refusal of a step on an account that does not exist.
pub(crate) fn account_missing(account_id: &str) -> ApplyError {
    Outcome::rejected(
        "resource_missing",
        format!("no such customer credits account: '{account_id}'"),
    )
    .into()
}

/// Notes an announced exhaustion among a step's events, so usage settlement
/// announces an empty account once, not on every shortfall. The events themselves
/// leave apply as data: notifications stores one (table `W`) only when it schedules
/// a delivery of it.
pub(crate) fn note_exhaustion(overlay: &mut Overlay<'_>, events: &[LedgerEvent]) {
    for event in events
        .iter()
        .filter(|e| e.event_type == EVENT_CREDITS_EXHAUSTED)
    {
        let (store, mode) = (&event.account.store_id, event.account.mode);
        overlay.put(exhausted_key(store, mode, &event.account.id), Vec::new());
    }
}

pub(crate) fn exhausted_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_EXHAUSTED, store, mode)
        .text(account_id)
        .into_bytes()
}

/// The webhook events of a transaction that left its account at `balance_after`:
/// `credits.granted` when it added, `credits.consumed` when it took (and
/// `customer_credits.exhausted` when that left exactly 0); none for a close.
pub(crate) fn movement_events(
    tx: &Transaction,
    account: &Account,
    balance_after: Decimal,
) -> Vec<LedgerEvent> {
    let delta = tx.delta_for(&tx.account_id);
    let event = |event_type: &str, suffix: &str| LedgerEvent {
        id: format!("whevt_{}{suffix}", tx.id.trim_start_matches("ctx_")),
        event_type: event_type.to_string(),
        created_at_ms: tx.created_at_ms,
        transaction_id: Some(tx.id.clone()),
        account: account.clone(),
        balance: balance_after,
    };
    match tx.kind {
        TransactionKind::Close | TransactionKind::GrantVoid => Vec::new(),
        TransactionKind::Expiry => vec![event(EVENT_CREDITS_EXPIRED, "e")],
        _ if delta > Decimal::ZERO => vec![event(EVENT_CREDITS_GRANTED, "g")],
        _ if delta < Decimal::ZERO && balance_after.is_zero() => vec![
            event(EVENT_CREDITS_CONSUMED, "c"),
            event(EVENT_CREDITS_EXHAUSTED, "x"),
        ],
        _ if delta < Decimal::ZERO => vec![event(EVENT_CREDITS_CONSUMED, "c")],
        _ => Vec::new(),
    }
}

/// What applying one transaction decided: the transaction as posted (its grants
/// assigned), the account's balance after it, and the expiries booked before it.
pub(crate) struct Posted {
    pub account: Account,
    pub balance_after: Decimal,
    pub transaction: Transaction,
    pub expired: Vec<LedgerEvent>,
}

/// The rows (`b`) of the accounts a transaction's entries touch, before it.
fn totals_before(
    overlay: &Overlay<'_>,
    tx: &Transaction,
) -> Result<
    std::collections::HashMap<tally_domain::ids::AccountId, codec::AccountTotals>,
    EngineError,
> {
    let mut totals = std::collections::HashMap::new();
    for entry in &tx.entries {
        let read = |key: &[u8]| overlay.get(key);
        let row = account_totals(read, &tx.store_id, tx.mode, &entry.account_id)?;
        totals.insert(entry.account_id.clone(), row);
    }
    Ok(totals)
}

/// The balances of the accounts a transaction's entries touch, before it.
pub(crate) fn balances_before(
    overlay: &Overlay<'_>,
    tx: &Transaction,
) -> Result<std::collections::HashMap<tally_domain::ids::AccountId, Decimal>, EngineError> {
    Ok(totals_before(overlay, tx)?
        .into_iter()
        .map(|(account, totals)| (account, totals.balance))
        .collect())
}

/// Posts a transaction whose entries are final: checks the balances it leaves (and,
/// for one that takes from the account, what the account's live holds need), stores
/// it and its entries. Returns the account's balance after it.
pub(crate) fn post_transaction(
    overlay: &mut Overlay<'_>,
    tx: &Transaction,
    at_ms: i64,
) -> Result<Decimal, ApplyError> {
    let (store, mode) = (&tx.store_id, tx.mode);
    let totals_before = totals_before(overlay, tx)?;
    let balance_before = |id: &str| {
        totals_before
            .get(id)
            .map(|totals| totals.balance)
            .unwrap_or_default()
    };
    // Checked against the final balances; each entry is then posted in order.
    let after = balances_after(tx, &balance_before).map_err(refused)?;
    let takes_spendable = matches!(tx.kind, TransactionKind::Debit | TransactionKind::Reversal);
    if takes_spendable && tx.delta_for(&tx.account_id) < Decimal::ZERO {
        let held = crate::holds::held(overlay, store, mode, &tx.account_id, at_ms)?;
        let left = after.get(&tx.account_id).copied().unwrap_or_default();
        if left < held {
            return Err(refused(Rejection::InsufficientBalance));
        }
    }
    // Every posted entry id names its transaction (what a list cursor relies on).
    // A record of an earlier build may carry entry ids of another form: posted
    // under their names here, the same on every replay.
    let named;
    let tx = if tx
        .entries
        .iter()
        .all(|e| tally_domain::ledger::names_transaction(&e.id, &tx.id))
    {
        tx
    } else {
        let mut renamed = tx.clone();
        tally_domain::ledger::name_entries(&renamed.id, &mut renamed.entries);
        named = renamed;
        &named
    };
    let mut running = totals_before;
    let mut entry_seqs = Vec::with_capacity(tx.entries.len());
    for entry in &tx.entries {
        let mut totals = running.get(&entry.account_id).copied().unwrap_or_default();
        totals.balance = exact_add(totals.balance, entry.amount)
            .ok_or_else(|| refused(Rejection::AmountOutOfRange))?;
        if SystemAccount::from_account_id(&entry.account_id).is_some() {
            entry_seqs.push(0);
        } else {
            entry_seqs.push(post_entry(overlay, tx, entry, &mut totals)?);
        }
        overlay.put(
            balance_key(store, mode, &entry.account_id),
            codec::encode_account_totals(totals),
        );
        running.insert(entry.account_id.clone(), totals);
    }
    // Written after its entries, with their places in the entry lists: a list
    // cursor finds an entry through its transaction's row (the entry id names the
    // transaction), so no row per entry id is kept.
    overlay.put(
        Key::scoped(keys::CREDIT_TRANSACTION, store, mode)
            .text(&tx.id)
            .into_bytes(),
        codec::encode_posted_transaction(tx, entry_seqs),
    );
    let balance_after = running
        .get(&tx.account_id)
        .map(|totals| totals.balance)
        .unwrap_or_default();
    if balance_after > Decimal::ZERO && tx.delta_for(&tx.account_id) > Decimal::ZERO {
        // Holding credits again: the next time it runs dry is announced again.
        overlay.delete(exhausted_key(store, mode, &tx.account_id));
    }
    Ok(balance_after)
}

/// The customer-visible side of one entry: its place at the end of the account's
/// entry list (`totals`, whose balance is the one right after the entry, gains
/// it). Returns that place. The entry's `posted_at_ms` never falls below the
/// previous entry's, so the list is ordered by it and a balance `at` an instant is
/// found by bisecting the list.
fn post_entry(
    overlay: &mut Overlay<'_>,
    tx: &Transaction,
    entry: &tally_domain::ledger::Entry,
    totals: &mut codec::AccountTotals,
) -> Result<u64, ApplyError> {
    let (store, mode) = (&tx.store_id, tx.mode);
    let seq = totals.entries.count;
    let posted_at_ms = tx.created_at_ms.max(totals.entries.last_posted_at_ms);
    totals.entries = codec::EntryListEnd {
        count: seq
            .checked_add(1)
            .ok_or_else(|| EngineError::Corrupt("an entry list's count overflows".into()))?,
        last_posted_at_ms: posted_at_ms,
    };
    let stored = StoredEntry {
        id: entry.id.clone(),
        transaction_id: tx.id.to_string(),
        account_id: entry.account_id.to_string(),
        amount: entry.amount,
        created_at_ms: tx.created_at_ms,
        posted_at_ms,
        balance_after: totals.balance,
        grant_id: entry.grant_id.as_ref().map(|g| g.to_string()),
    };
    overlay.put(
        entry_key(store, mode, &entry.account_id, seq),
        codec::encode_entry(&stored),
    );
    Ok(seq)
}

/// The key of the entry at place `seq` of an account's entry list (table `L`).
pub(crate) fn entry_key(store: &str, mode: Mode, account_id: &str, seq: u64) -> Vec<u8> {
    Key::scoped(keys::CREDIT_ENTRY, store, mode)
        .text(account_id)
        .uint(seq)
        .into_bytes()
}
