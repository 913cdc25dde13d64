//! The credits ledger service and its projection (docs/api.md, "Customer credits").
//!
//! Consistency: the service checks a request against the projection (fast 409s) and
//! appends it; the projector decides it in log order (balance, status, idempotency
//! key, reversal at most once, limits) and records the outcome the caller waits for.
//! So 200 concurrent debits of 1 against a balance of 100 succeed exactly 100 times on
//! any number of nodes, without a per-account lock; webhook events are decided in
//! apply too, from the balance the transaction leaves. Freeze, unfreeze and close
//! keep a per-account lock (rare, and a close must see the balance it forfeits).

use std::ops::Bound;

use rust_decimal::Decimal;
use tally_domain::exact::exact_add;
use tally_domain::ledger::{
    balances_after, check_open, parse_amount, post, post_reversal, Account, AccountStatus,
    Rejection, SystemAccount, Transaction, TransactionKind, DEFAULT_ACCOUNT_NAME,
    DEFAULT_UNIT_LABEL, MAX_ACCOUNT_NAME_CHARS, MAX_AMOUNT, MAX_DESCRIPTION_CHARS,
    MAX_IDEMPOTENCY_KEY_CHARS,
};
use tally_domain::record::{LedgerEvent, Record};
use tally_domain::{FieldError, Mode};

use tally_core::codec::{self, StoredEntry};
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest};
use tally_core::{Decision, Scope};

use crate::Ledger;

pub const EVENT_CREDITS_GRANTED: &str = "credits.granted";
pub const EVENT_CREDITS_CONSUMED: &str = "credits.consumed";
pub const EVENT_CREDITS_EXHAUSTED: &str = "customer_credits.exhausted";
pub const EVENT_CREDITS_EXPIRED: &str = "credits.expired";

/// Input of `POST /v1/customer-credits/accounts`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct AccountInput {
    pub customer_id: Option<String>,
    pub name: Option<String>,
    pub unit_label: Option<String>,
    pub initial_balance: Option<String>,
    /// Parsed by the edge (`parse_amount`, zero allowed).
    pub low_balance_threshold: Option<Decimal>,
    pub auto_recharge: Option<tally_domain::ledger::AutoRecharge>,
}

/// Input of credit and debit.
#[derive(Debug, Clone, Default)]
pub struct MovementInput {
    pub amount: Option<String>,
    pub idempotency_key: Option<String>,
    pub description: Option<String>,
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// A transaction with what the projection knows about it.
#[derive(Debug, Clone)]
pub struct TransactionView {
    pub transaction: Transaction,
    pub reversed_by: Option<String>,
}

fn rejected(rejection: Rejection) -> EngineError {
    EngineError::conflict(rejection.code(), rejection.message())
}

fn text_field(param: &str, value: Option<&String>, default: &str) -> Result<String, FieldError> {
    match value {
        None => Ok(default.to_string()),
        Some(text) => {
            let trimmed = text.trim();
            if trimmed.is_empty() || trimmed.chars().count() > MAX_ACCOUNT_NAME_CHARS {
                return Err(FieldError::invalid(
                    param,
                    format!("`{param}` must be 1 to {MAX_ACCOUNT_NAME_CHARS} characters"),
                ));
            }
            Ok(trimmed.to_string())
        }
    }
}

fn refused(rejection: Rejection) -> ApplyError {
    ApplyError::Refused(Outcome::rejected(rejection.code(), rejection.message()))
}

fn balance_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_BALANCE, store, mode)
        .text(account_id)
        .into_bytes()
}

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
                    codec::encode_decimal(Decimal::ZERO),
                );
            }
            Some(bytes) => {
                let before = codec::decode_account(&bytes)?;
                if before.status == AccountStatus::Closed {
                    return Err(refused(Rejection::AccountClosed));
                }
                status_before = Some(before.status);
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
        crate::reservations::release_all(overlay, account, recorded_at_ms)?;
        let key = balance_key(&account.store_id, account.mode, &account.id);
        let left = match overlay.get(&key)? {
            Some(bytes) => codec::decode_decimal(&bytes)?,
            None => Decimal::ZERO,
        };
        if !left.is_zero() {
            return Err(Outcome::rejected(
                "account_balance_changed",
                "the balance changed while the account was being closed; retry the close",
            )
            .into());
        }
    }
    store_events(overlay, &events);
    Ok(events)
}

/// Keeps a step's webhook events (table `W`) and notes an announced exhaustion, so
/// usage settlement announces an empty account once, not on every shortfall.
pub(crate) fn store_events(overlay: &mut Overlay<'_>, events: &[LedgerEvent]) {
    for event in events {
        let (store, mode) = (&event.account.store_id, event.account.mode);
        overlay.put(
            Key::scoped(keys::WEBHOOK_EVENT, store, mode)
                .int(event.created_at_ms)
                .text(&event.id)
                .into_bytes(),
            tally_proto::Message::encode_to_vec(&tally_proto::ledger_event_to_proto(event)),
        );
        if event.event_type == EVENT_CREDITS_EXHAUSTED {
            overlay.put(exhausted_key(store, mode, &event.account.id), Vec::new());
        }
    }
}

fn exhausted_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_EXHAUSTED, store, mode)
        .text(account_id)
        .into_bytes()
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
    let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, store, mode)
        .text(debit.customer_id)
        .text(debit.account_name)
        .into_bytes();
    let Some(account_id) = overlay.get(&name_key)? else {
        return Ok((Decimal::ZERO, Vec::new()));
    };
    let account_id = String::from_utf8_lossy(&account_id).into_owned();
    let account_key = Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
        .text(&account_id)
        .into_bytes();
    let Some(bytes) = overlay.get(&account_key)? else {
        return Err(EngineError::Corrupt(format!("account {account_id} named but missing")).into());
    };
    let account = codec::decode_account(&bytes)?;
    if account.status != AccountStatus::Active {
        return Ok((Decimal::ZERO, Vec::new()));
    }
    // Grants expired by the record's time hold nothing to take.
    let expired = crate::grants::book_expiries(overlay, &account, debit.created_at_ms)?;
    store_events(overlay, &expired);
    let balance = match overlay.get(&balance_key(store, mode, &account_id))? {
        Some(bytes) => codec::decode_decimal(&bytes)?,
        None => Decimal::ZERO,
    };
    // Only what no reservation holds (docs/api.md, "Reservations").
    let held = crate::reservations::held(overlay, store, mode, &account_id, debit.created_at_ms)?;
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
        store_events(overlay, &exhausted);
        events.extend(exhausted);
        return Ok((Decimal::ZERO, events));
    }
    let mut n = 0;
    let mut entry_id = || {
        n += 1;
        format!("{}_{n}", debit.transaction_id.replacen("ctx_", "ce_", 1))
    };
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
    store_events(overlay, &posted.expired);
    store_events(overlay, &moved);
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
        None => {
            let key = Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
                .text(&tx.account_id)
                .into_bytes();
            match overlay.get(&key)? {
                Some(bytes) => codec::decode_account(&bytes)?,
                None => {
                    return Err(Outcome::rejected(
                        "resource_missing",
                        format!("no such customer credits account: '{}'", tx.account_id),
                    )
                    .into())
                }
            }
        }
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

/// What applying one transaction decided: the transaction as posted (its grants
/// assigned), the account's balance after it, and the expiries booked before it.
pub(crate) struct Posted {
    pub account: Account,
    pub balance_after: Decimal,
    pub transaction: Transaction,
    pub expired: Vec<LedgerEvent>,
}

/// The balances of the accounts a transaction's entries touch, before it.
fn balances_before(
    overlay: &Overlay<'_>,
    tx: &Transaction,
) -> Result<std::collections::HashMap<tally_domain::ids::AccountId, Decimal>, EngineError> {
    let mut balances = std::collections::HashMap::new();
    for entry in &tx.entries {
        let key = balance_key(&tx.store_id, tx.mode, &entry.account_id);
        let balance = match overlay.get(&key)? {
            Some(bytes) => codec::decode_decimal(&bytes)?,
            None => Decimal::ZERO,
        };
        balances.insert(entry.account_id.clone(), balance);
    }
    Ok(balances)
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
    let balances_before = balances_before(overlay, tx)?;
    let balance_before = |id: &str| balances_before.get(id).copied().unwrap_or_default();
    // Checked against the final balances; each entry is then posted in order.
    let after = balances_after(tx, &balance_before).map_err(refused)?;
    let takes_spendable = matches!(tx.kind, TransactionKind::Debit | TransactionKind::Reversal);
    if takes_spendable && tx.delta_for(&tx.account_id) < Decimal::ZERO {
        let held = crate::reservations::held(overlay, store, mode, &tx.account_id, at_ms)?;
        let left = after.get(&tx.account_id).copied().unwrap_or_default();
        if left < held {
            return Err(refused(Rejection::InsufficientBalance));
        }
    }
    overlay.put(
        Key::scoped(keys::CREDIT_TRANSACTION, store, mode)
            .text(&tx.id)
            .into_bytes(),
        codec::encode_transaction(tx),
    );
    let mut running = balances_before;
    for entry in &tx.entries {
        let before = running.get(&entry.account_id).copied().unwrap_or_default();
        let balance =
            exact_add(before, entry.amount).ok_or_else(|| refused(Rejection::AmountOutOfRange))?;
        running.insert(entry.account_id.clone(), balance);
        overlay.put(
            balance_key(store, mode, &entry.account_id),
            codec::encode_decimal(balance),
        );
        if SystemAccount::from_account_id(&entry.account_id).is_some() {
            continue;
        }
        post_entry(overlay, tx, entry, balance)?;
    }
    let balance_after = running.get(&tx.account_id).copied().unwrap_or_default();
    if balance_after > Decimal::ZERO && tx.delta_for(&tx.account_id) > Decimal::ZERO {
        // Holding credits again: the next time it runs dry is announced again.
        overlay.delete(exhausted_key(store, mode, &tx.account_id));
    }
    Ok(balance_after)
}

/// The customer-visible side of one entry: sequence, entry, id pointer, history.
fn post_entry(
    overlay: &mut Overlay<'_>,
    tx: &Transaction,
    entry: &tally_domain::ledger::Entry,
    balance: Decimal,
) -> Result<(), ApplyError> {
    let (store, mode) = (&tx.store_id, tx.mode);
    let seq_key = Key::scoped(keys::CREDIT_ENTRY_SEQ, store, mode)
        .text(&entry.account_id)
        .into_bytes();
    let seq = match overlay.get(&seq_key)? {
        Some(bytes) => u64::from_be_bytes(
            bytes
                .as_slice()
                .try_into()
                .map_err(|_| EngineError::Corrupt("entry seq".into()))?,
        ),
        None => 0,
    };
    overlay.put(seq_key, (seq + 1).to_be_bytes().to_vec());
    let stored = StoredEntry {
        id: entry.id.clone(),
        transaction_id: tx.id.to_string(),
        account_id: entry.account_id.to_string(),
        amount: entry.amount,
        created_at_ms: tx.created_at_ms,
        balance_after: balance,
        grant_id: entry.grant_id.as_ref().map(|g| g.to_string()),
    };
    overlay.put(
        Key::scoped(keys::CREDIT_ENTRY, store, mode)
            .text(&entry.account_id)
            .uint(seq)
            .into_bytes(),
        codec::encode_entry(&stored),
    );
    let mut pointer = entry.account_id.as_bytes().to_vec();
    pointer.push(0);
    pointer.extend_from_slice(&seq.to_be_bytes());
    overlay.put(
        Key::scoped(keys::CREDIT_ENTRY_ID, store, mode)
            .text(&entry.id)
            .into_bytes(),
        pointer,
    );
    overlay.put(
        Key::scoped(keys::CREDIT_BALANCE_HISTORY, store, mode)
            .text(&entry.account_id)
            .int(tx.created_at_ms)
            .uint(seq)
            .into_bytes(),
        codec::encode_decimal(balance),
    );
    Ok(())
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

fn idempotency_key_reused() -> Outcome {
    Outcome::rejected(
        "idempotency_key_reused",
        "this idempotency_key was used for a different amount, account or operation",
    )
    .with_param("idempotency_key")
}

fn account_name_taken(customer_id: &str, name: &str) -> Outcome {
    Outcome::rejected(
        "account_name_taken",
        format!("customer {customer_id} already has an account named '{name}'"),
    )
    .with_param("name")
}

impl Ledger {
    /// The id of the customer's account named `name`, if there is one.
    pub fn account_id_by_name(
        &self,
        scope: &Scope,
        customer_id: &str,
        name: &str,
    ) -> Result<Option<String>, EngineError> {
        let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, &scope.store_id, scope.mode)
            .text(customer_id)
            .text(name);
        Ok(self
            .journal
            .store()
            .get(name_key.as_bytes())?
            .map(|id| String::from_utf8_lossy(&id).into_owned()))
    }

    pub fn get_account(&self, scope: &Scope, id: &str) -> Result<Account, EngineError> {
        let key = Key::scoped(keys::CREDIT_ACCOUNT, &scope.store_id, scope.mode).text(id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_account(&bytes),
            None => Err(EngineError::not_found("customer credits account", id)),
        }
    }

    /// The balance of an account (customer or `system:*`) now: a grant whose expiry
    /// has passed holds nothing, whether or not a record has booked its expiry yet.
    pub fn balance(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = Key::scoped(keys::CREDIT_BALANCE, &scope.store_id, scope.mode).text(account_id);
        let booked = match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_decimal(&bytes)?,
            None => Decimal::ZERO,
        };
        self.less_unbooked_expiries(scope, account_id, booked, self.journal.now_ms())
    }

    /// The balance as the posted entries leave it (expiries not yet booked still
    /// count): what the audit replays.
    pub fn booked_balance(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = Key::scoped(keys::CREDIT_BALANCE, &scope.store_id, scope.mode).text(account_id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_decimal(&bytes),
            None => Ok(Decimal::ZERO),
        }
    }

    /// `booked` less what grants expired by `at_ms` but not yet booked have left. No
    /// step of the account happened since such a grant expired (a step books it
    /// first), so what it has left now is what it had at any instant since.
    fn less_unbooked_expiries(
        &self,
        scope: &Scope,
        account_id: &str,
        booked: Decimal,
        at_ms: i64,
    ) -> Result<Decimal, EngineError> {
        let key = crate::grants::active_key(&scope.store_id, scope.mode, account_id);
        let Some(bytes) = self.journal.store().get(&key)? else {
            return Ok(booked);
        };
        let mut balance = booked;
        for grant in codec::decode_active_grants(&bytes)? {
            if !grant.live_at(at_ms) {
                balance = balance.checked_sub(grant.remaining).ok_or_else(|| {
                    EngineError::Corrupt("a grant's remainder passes the decimal range".into())
                })?;
            }
        }
        Ok(balance)
    }

    /// The balance as of `at_ms` (inclusive): the balance after the last entry at or
    /// before that instant.
    pub fn balance_at(
        &self,
        scope: &Scope,
        account_id: &str,
        at_ms: i64,
    ) -> Result<Decimal, EngineError> {
        let base =
            Key::scoped(keys::CREDIT_BALANCE_HISTORY, &scope.store_id, scope.mode).text(account_id);
        let start = base.clone().into_bytes();
        let end = base.int(at_ms.saturating_add(1)).into_bytes();
        let mut found = None;
        self.journal.store().scan(
            Bound::Included(&start),
            Bound::Excluded(&end),
            true,
            &mut |_, v| {
                found = Some(v.to_vec());
                tally_projection::Visit::Stop
            },
        )?;
        let booked = match found {
            Some(bytes) => codec::decode_decimal(&bytes)?,
            None => Decimal::ZERO,
        };
        self.less_unbooked_expiries(scope, account_id, booked, at_ms)
    }

    /// A transaction of `kind` on `account_id` with the given entries, created now.
    pub(crate) fn new_transaction(
        &self,
        scope: &Scope,
        kind: TransactionKind,
        account_id: &str,
        amount: Decimal,
        entries: Vec<tally_domain::ledger::Entry>,
    ) -> Transaction {
        Transaction {
            id: new_id("ctx").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            kind,
            account_id: account_id.into(),
            amount,
            entries,
            idempotency_key: None,
            description: None,
            metadata: Default::default(),
            reverses: None,
            created_at_ms: self.journal.now_ms(),
            grant_terms: None,
        }
    }

    /// Appends a transaction on an account whose balance was `balance`, with the
    /// and waits for the projector's decision: applied, refused (409), or a repeat of
    /// an earlier transaction with the same idempotency key (that transaction is
    /// returned). The balance it leaves, and so its webhook events, are decided in
    /// apply.
    pub(crate) async fn commit_movement(
        &self,
        scope: &Scope,
        tx: Transaction,
    ) -> Result<TransactionView, EngineError> {
        let decision = self
            .journal
            .append_and_decide(&Record::CreditLedger {
                account: None,
                transaction: Some(tx.clone()),
                events: Vec::new(),
            })
            .await?;
        match decision {
            // Apply decided the grants (the entries as posted): read it back.
            Decision::Applied => self.get_transaction(scope, &tx.id),
            Decision::SameAs(id) => self.get_transaction(scope, &id),
        }
    }

    pub async fn create_account(
        &self,
        scope: &Scope,
        input: &AccountInput,
    ) -> Result<(Account, Decimal), EngineError> {
        let customer_id = input
            .customer_id
            .as_deref()
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| FieldError::missing("customer_id"))?;
        let name = text_field("name", input.name.as_ref(), DEFAULT_ACCOUNT_NAME)?;
        let unit_label = text_field("unit_label", input.unit_label.as_ref(), DEFAULT_UNIT_LABEL)?;
        let initial = match &input.initial_balance {
            None => Decimal::ZERO,
            Some(text) => parse_amount("initial_balance", text, true)?,
        };
        if !self.holders.customer_exists(scope, customer_id)? {
            return Err(EngineError::NotFound {
                resource: "customer",
                id: customer_id.to_string(),
                param: Some("customer_id".into()),
            });
        }
        // A fast answer from the projection; apply decides again in log order.
        let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, &scope.store_id, scope.mode)
            .text(customer_id)
            .text(&name);
        if self.journal.store().get(name_key.as_bytes())?.is_some() {
            return Err(account_name_taken(customer_id, &name).into());
        }
        let now = self.journal.now_ms();
        let account = Account {
            id: new_id("ca").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            customer_id: customer_id.into(),
            name,
            unit_label,
            status: AccountStatus::Active,
            created_at_ms: now,
            updated_at_ms: now,
            low_balance_threshold: input.low_balance_threshold,
            auto_recharge: input.auto_recharge,
        };
        let transaction = if initial > Decimal::ZERO {
            let entries = post(
                TransactionKind::InitialBalance,
                &account.id,
                account.status,
                Decimal::ZERO,
                initial,
                &mut || new_id("ce"),
            )
            .map_err(rejected)?;
            let mut tx = self.new_transaction(
                scope,
                TransactionKind::InitialBalance,
                &account.id,
                initial,
                entries,
            );
            tx.description = Some("initial balance".into());
            Some(tx)
        } else {
            None
        };
        // One record: the account and its seed exist together or not at all.
        self.journal
            .append_and_apply(&Record::CreditLedger {
                account: Some(account.clone()),
                transaction,
                events: Vec::new(),
            })
            .await?;
        Ok((account, initial))
    }

    pub fn list_accounts(
        &self,
        scope: &Scope,
        customer_id: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<(Account, Decimal)>, EngineError> {
        let table = match customer_id {
            Some(_) => keys::CREDIT_ACCOUNT_BY_CUSTOMER,
            None => keys::CREDIT_ACCOUNT_LIST,
        };
        let prefix = ListingKey::prefix(table, &scope.store_id, scope.mode, customer_id);
        let cursor = cursor_from(page, |id| {
            let account = self.get_account(scope, id)?;
            if customer_id.is_some_and(|c| account.customer_id != *c) {
                return Err(EngineError::not_found("customer credits account", id));
            }
            Ok(ListingKey::entry(
                table,
                &scope.store_id,
                scope.mode,
                customer_id,
                account.created_at_ms,
                &account.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let account = self.get_account(scope, id)?;
                let balance = self.balance(scope, id)?;
                Ok(Some((account, balance)))
            },
        )
    }

    /// freeze / unfreeze: active <-> frozen; repeating a transition returns the
    /// account unchanged; a closed account refuses both.
    pub async fn set_account_frozen(
        &self,
        scope: &Scope,
        id: &str,
        frozen: bool,
    ) -> Result<(Account, Decimal), EngineError> {
        let target = if frozen {
            AccountStatus::Frozen
        } else {
            AccountStatus::Active
        };
        let account = self
            .journal
            .update(|| {
                let mut account = self.get_account(scope, id)?;
                if account.status == AccountStatus::Closed {
                    return Err(rejected(Rejection::AccountClosed));
                }
                if account.status == target {
                    return Ok(Update::Unchanged(account));
                }
                account.status = target;
                let base = self.journal.restamp(&mut account.updated_at_ms);
                Ok(Update::Write {
                    record: Record::CreditLedger {
                        account: Some(account.clone()),
                        transaction: None,
                        events: Vec::new(),
                    },
                    base_updated_at_ms: base,
                    result: account,
                })
            })
            .await?;
        let balance = self.balance(scope, id)?;
        Ok((account, balance))
    }

    /// Sets or clears the account's low-balance threshold and auto-recharge
    /// (docs/api.md, "Thresholds and auto-recharge"); a closed account refuses.
    pub async fn update_thresholds(
        &self,
        scope: &Scope,
        id: &str,
        threshold: tally_domain::customer::Patch<Decimal>,
        recharge: tally_domain::customer::Patch<tally_domain::ledger::AutoRecharge>,
    ) -> Result<(Account, Decimal), EngineError> {
        let account = self
            .journal
            .update(|| {
                let mut account = self.get_account(scope, id)?;
                if account.status == AccountStatus::Closed {
                    return Err(rejected(Rejection::AccountClosed));
                }
                let next_threshold = threshold.clone().apply_to(account.low_balance_threshold);
                let next_recharge = recharge.clone().apply_to(account.auto_recharge);
                if next_threshold == account.low_balance_threshold
                    && next_recharge == account.auto_recharge
                {
                    return Ok(Update::Unchanged(account));
                }
                account.low_balance_threshold = next_threshold;
                account.auto_recharge = next_recharge;
                let base = self.journal.restamp(&mut account.updated_at_ms);
                Ok(Update::Write {
                    record: Record::CreditLedger {
                        account: Some(account.clone()),
                        transaction: None,
                        events: Vec::new(),
                    },
                    base_updated_at_ms: base,
                    result: account,
                })
            })
            .await?;
        let balance = self.balance(scope, id)?;
        Ok((account, balance))
    }

    /// close: final. The remaining balance moves to `forfeit` in the same record.
    pub async fn close_account(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<(Account, Decimal), EngineError> {
        let account = self
            .journal
            .update(|| {
                let mut account = self.get_account(scope, id)?;
                if account.status == AccountStatus::Closed {
                    return Ok(Update::Unchanged(account));
                }
                let balance = self.balance(scope, id)?;
                let transaction = if balance > Decimal::ZERO {
                    // The close posts against the account as it is (frozen accounts
                    // close too).
                    let entries = post(
                        TransactionKind::Close,
                        &account.id,
                        AccountStatus::Active,
                        balance,
                        balance,
                        &mut || new_id("ce"),
                    )
                    .map_err(rejected)?;
                    let mut tx =
                        self.new_transaction(scope, TransactionKind::Close, id, balance, entries);
                    tx.description = Some("account closed: remaining balance forfeited".into());
                    Some(tx)
                } else {
                    None
                };
                account.status = AccountStatus::Closed;
                let base = self.journal.restamp(&mut account.updated_at_ms);
                Ok(Update::Write {
                    record: Record::CreditLedger {
                        account: Some(account.clone()),
                        transaction,
                        events: Vec::new(),
                    },
                    base_updated_at_ms: base,
                    result: account,
                })
            })
            .await?;
        Ok((account, Decimal::ZERO))
    }

    pub fn get_transaction(&self, scope: &Scope, id: &str) -> Result<TransactionView, EngineError> {
        let key = Key::scoped(keys::CREDIT_TRANSACTION, &scope.store_id, scope.mode).text(id);
        let transaction = match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_transaction(&bytes)?,
            None => return Err(EngineError::not_found("customer credits transaction", id)),
        };
        let reversed_key = Key::scoped(keys::CREDIT_REVERSED, &scope.store_id, scope.mode).text(id);
        let reversed_by = self
            .journal
            .store()
            .get(reversed_key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        Ok(TransactionView {
            transaction,
            reversed_by,
        })
    }

    /// credit or debit, idempotent by the caller's key.
    pub async fn move_credits(
        &self,
        scope: &Scope,
        account_id: &str,
        kind: TransactionKind,
        input: &MovementInput,
    ) -> Result<TransactionView, EngineError> {
        self.move_credits_with_terms(scope, account_id, kind, input, None)
            .await
    }

    /// `move_credits`; a credit's grant gets `terms` (docs/api.md, "Credit grants").
    pub(crate) async fn move_credits_with_terms(
        &self,
        scope: &Scope,
        account_id: &str,
        kind: TransactionKind,
        input: &MovementInput,
        terms: Option<tally_domain::grant::GrantTerms>,
    ) -> Result<TransactionView, EngineError> {
        let amount_text = input
            .amount
            .as_deref()
            .ok_or_else(|| FieldError::missing("amount"))?;
        let amount = parse_amount("amount", amount_text, false)?;
        let idempotency_key = input
            .idempotency_key
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| FieldError::missing("idempotency_key"))?
            .to_string();
        if idempotency_key.chars().count() > MAX_IDEMPOTENCY_KEY_CHARS {
            return Err(FieldError::invalid(
                "idempotency_key",
                "`idempotency_key` is at most 255 characters",
            )
            .into());
        }
        if input
            .description
            .as_ref()
            .is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_CHARS)
        {
            return Err(FieldError::invalid(
                "description",
                "`description` is at most 1000 characters",
            )
            .into());
        }
        tally_domain::customer::validate_metadata(&input.metadata)?;
        // No lock: the projector decides in log order (balance, status, idempotency
        // key), so concurrent debits share group commits and none overdraws.
        let account = self.get_account(scope, account_id)?;
        let idempotency = Key::scoped(keys::CREDIT_IDEMPOTENCY, &scope.store_id, scope.mode)
            .tail(idempotency_key.as_bytes());
        if let Some(existing) = self.journal.store().get(idempotency.as_bytes())? {
            let view = self.get_transaction(scope, &String::from_utf8_lossy(&existing))?;
            let same = view.transaction.account_id == account_id
                && view.transaction.amount == amount
                && view.transaction.kind == kind;
            if !same {
                return Err(idempotency_key_reused().into());
            }
            return Ok(view);
        }
        let mut balance = self.balance(scope, account_id)?;
        if kind == TransactionKind::Debit {
            // What reservations hold is not there to take (apply decides again).
            balance = tally_domain::reservation::available(balance, self.held(scope, account_id)?);
        }
        let entries = post(
            kind,
            &account.id,
            account.status,
            balance,
            amount,
            &mut || new_id("ce"),
        )
        .map_err(rejected)?;
        let mut tx = self.new_transaction(scope, kind, account_id, amount, entries);
        tx.idempotency_key = Some(idempotency_key);
        tx.description = input.description.clone();
        tx.metadata = input.metadata.clone();
        tx.grant_terms = terms;
        self.commit_movement(scope, tx).await
    }

    /// A new transaction mirroring the original's entries; at most once.
    pub async fn reverse_transaction(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<TransactionView, EngineError> {
        let original = self.get_transaction(scope, id)?;
        let account_id = original.transaction.account_id.clone();
        let account = self.get_account(scope, &account_id)?;
        let balance = self.balance(scope, &account_id)?;
        let entries = post_reversal(
            &original.transaction,
            account.status,
            balance,
            original.reversed_by.is_some(),
            &mut || new_id("ce"),
        )
        .map_err(rejected)?;
        let mut tx = self.new_transaction(
            scope,
            TransactionKind::Reversal,
            &account_id,
            original.transaction.amount,
            entries,
        );
        tx.description = Some(format!("reversal of {id}"));
        tx.reverses = Some(id.into());
        self.commit_movement(scope, tx).await
    }

    pub fn list_entries(
        &self,
        scope: &Scope,
        account_id: &str,
        page: &PageRequest,
    ) -> Result<Page<StoredEntry>, EngineError> {
        self.get_account(scope, account_id)?;
        let prefix = Key::scoped(keys::CREDIT_ENTRY, &scope.store_id, scope.mode)
            .text(account_id)
            .into_bytes();
        let cursor = cursor_from(page, |entry_id| {
            let pointer_key =
                Key::scoped(keys::CREDIT_ENTRY_ID, &scope.store_id, scope.mode).text(entry_id);
            let pointer = self
                .journal
                .store()
                .get(pointer_key.as_bytes())?
                .ok_or_else(|| EngineError::not_found("customer credits entry", entry_id))?;
            let (owner, next) = keys::read_text(&pointer, 0)
                .ok_or_else(|| EngineError::Corrupt("entry pointer".into()))?;
            if owner != account_id {
                return Err(EngineError::not_found("customer credits entry", entry_id));
            }
            let mut key = prefix.clone();
            key.extend_from_slice(&pointer[next..]);
            Ok(key)
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |_, value| codec::decode_entry(value).map(Some),
        )
    }
}
