//! Credit grants (docs/api.md, "Credit grants"), decided in apply: every credit
//! unit of an account belongs to exactly one grant, so a customer account's balance
//! always equals what its active grants have left.
//!
//! - A transaction that gives the account credits (a credit, an initial balance, a
//!   reversal that gives back) makes one grant of its amount, with the terms the
//!   transaction carries (priority, expiry) or the defaults.
//! - One that takes (a debit, a reversal that takes, a close) draws from the active
//!   grants in draw order (`tally_domain::grant`): its account entry is split into
//!   one entry per grant drawn, each naming its grant; the entries still sum to zero.
//! - A grant past its expiry instant (judged by the record's time, never the clock
//!   at apply) is booked before any step of its account: an `expiry` transaction
//!   moves what it has left to `forfeit`, dated at the instant itself, and emits
//!   `credits.expired`. A void does the same at once (`grant_void`).
//!
//! The account's active grants are one value in draw order (table `}`); each grant's
//! full state is its own value (table `{`), listed per account (table `~`).

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use tally_domain::grant::{
    draw, live_total, sort_for_draw, ActiveGrant, Grant, GrantStatus, MAX_ACTIVE_GRANTS_PER_ACCOUNT,
};
use tally_domain::ids::GrantId;
use tally_domain::ledger::{
    Account, Entry, Rejection, SystemAccount, Transaction, TransactionKind,
};
use tally_domain::record::LedgerEvent;
use tally_domain::Mode;

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};

use crate::posting::{movement_events, post_transaction, refused};

pub(crate) fn active_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_GRANTS_ACTIVE, store, mode)
        .text(account_id)
        .into_bytes()
}

pub(crate) fn grant_key(store: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_GRANT, store, mode)
        .text(id)
        .into_bytes()
}

/// The `?` row of an active grant with an expiry (none without one).
fn due_row(store: &str, mode: Mode, account_id: &str, grant: &ActiveGrant) -> Option<Vec<u8>> {
    grant
        .expires_at_ms
        .map(|at| keys::grant_due_key(mode, at, store, account_id, &grant.id))
}

fn seq_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_GRANT_SEQ, store, mode)
        .text(account_id)
        .into_bytes()
}

/// The id of the grant a transaction makes: derived from the transaction's, so a
/// replay makes the same one.
pub fn grant_id_of(transaction_id: &str) -> GrantId {
    format!("grt_{}", transaction_id.trim_start_matches("ctx_")).into()
}

pub(crate) fn load_active(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
) -> Result<Vec<ActiveGrant>, EngineError> {
    match overlay.get(&active_key(store, mode, account_id))? {
        Some(bytes) => codec::decode_active_grants(&bytes),
        None => Ok(Vec::new()),
    }
}

fn save_active(
    overlay: &mut Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
    grants: &[ActiveGrant],
) {
    let key = active_key(store, mode, account_id);
    if grants.is_empty() {
        overlay.delete(key);
    } else {
        overlay.put(key, codec::encode_active_grants(grants));
    }
}

fn load_grant(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    id: &str,
) -> Result<Grant, ApplyError> {
    match overlay.get(&grant_key(store, mode, id))? {
        Some(bytes) => Ok(codec::decode_grant(&bytes)?),
        None => Err(EngineError::Corrupt(format!("active grant {id} has no state")).into()),
    }
}

fn put_grant(overlay: &mut Overlay<'_>, grant: &Grant) {
    overlay.put(
        grant_key(&grant.store_id, grant.mode, &grant.id),
        codec::encode_grant(grant),
    );
}

/// Moves what one grant has left to `forfeit` in a transaction of `kind` (an expiry
/// dated at the grant's instant, or a void dated `at_ms`), ends the grant with
/// `status`, and answers the webhook events.
fn forfeit(
    overlay: &mut Overlay<'_>,
    account: &Account,
    active: &ActiveGrant,
    kind: TransactionKind,
    status: GrantStatus,
    at_ms: i64,
    transaction_id: String,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let (store, mode) = (account.store_id.as_str(), account.mode);
    let mut grant = load_grant(overlay, store, mode, &active.id)?;
    grant.status = status;
    grant.remaining = Decimal::ZERO;
    grant.updated_at_ms = at_ms;
    put_grant(overlay, &grant);
    if active.remaining <= Decimal::ZERO {
        return Ok(Vec::new());
    }
    let tx = Transaction {
        id: transaction_id.clone().into(),
        store_id: account.store_id.clone(),
        mode,
        kind,
        account_id: account.id.clone(),
        amount: active.remaining,
        entries: vec![
            Entry {
                id: tally_domain::ledger::entry_id(&transaction_id, 1),
                account_id: account.id.clone(),
                amount: -active.remaining,
                grant_id: Some(active.id.clone()),
            },
            Entry {
                id: tally_domain::ledger::entry_id(&transaction_id, 2),
                account_id: SystemAccount::Forfeit.account_id().into(),
                amount: active.remaining,
                grant_id: None,
            },
        ],
        idempotency_key: None,
        description: Some(format!("{} of grant {}", kind.as_str(), active.id)),
        metadata: BTreeMap::new(),
        reverses: None,
        created_at_ms: at_ms,
        grant_terms: None,
    };
    let balance_after = post_transaction(overlay, &tx, at_ms)?;
    Ok(movement_events(&tx, account, balance_after))
}

/// Books every expiry of the account's grants due at record time `at_ms` (in order
/// of their instants), and answers their `credits.expired` events.
pub(crate) fn book_expiries(
    overlay: &mut Overlay<'_>,
    account: &Account,
    at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let (store, mode) = (account.store_id.as_str(), account.mode);
    let mut active = load_active(overlay, store, mode, &account.id)?;
    let mut due: Vec<ActiveGrant> = active
        .iter()
        .filter(|g| !g.live_at(at_ms))
        .cloned()
        .collect();
    if due.is_empty() {
        return Ok(Vec::new());
    }
    due.sort_by_key(|g| (g.expires_at_ms, g.seq));
    active.retain(|g| g.live_at(at_ms));
    save_active(overlay, store, mode, &account.id, &active);
    let mut events = Vec::new();
    for grant in &due {
        if let Some(row) = due_row(store, mode, &account.id, grant) {
            overlay.delete(row);
        }
        let instant = grant.expires_at_ms.unwrap_or(at_ms);
        let id = format!("ctx_x{}", grant.id.trim_start_matches("grt_"));
        events.extend(forfeit(
            overlay,
            account,
            grant,
            TransactionKind::Expiry,
            GrantStatus::Expired,
            instant,
            id,
        )?);
    }
    Ok(events)
}

/// Decides the grants of a transaction's account side (module doc), in place.
pub(crate) fn assign(
    overlay: &mut Overlay<'_>,
    tx: &mut Transaction,
    at_ms: i64,
) -> Result<(), ApplyError> {
    let (store, mode) = (tx.store_id.to_string(), tx.mode);
    let account_id = tx.account_id.to_string();
    let delta = tx.delta_for(&account_id);
    let mut active = load_active(overlay, &store, mode, &account_id)?;
    match tx.kind {
        TransactionKind::GrantVoid => {
            // The service names the grant and what it had left; both must hold still.
            let named = tx
                .entries
                .iter()
                .find(|e| e.account_id == tx.account_id)
                .and_then(|e| e.grant_id.clone());
            let position = named
                .as_ref()
                .and_then(|id| active.iter().position(|g| &g.id == id));
            let Some(position) = position else {
                return Err(grant_not_active().into());
            };
            if active[position].remaining != tx.amount || !active[position].live_at(at_ms) {
                return Err(grant_changed().into());
            }
            let gone = active.remove(position);
            save_active(overlay, &store, mode, &account_id, &active);
            if let Some(row) = due_row(&store, mode, &account_id, &gone) {
                overlay.delete(row);
            }
            let mut grant = load_grant(overlay, &store, mode, &gone.id)?;
            grant.status = GrantStatus::Voided;
            grant.remaining = Decimal::ZERO;
            grant.updated_at_ms = at_ms;
            put_grant(overlay, &grant);
            Ok(())
        }
        TransactionKind::Expiry => Err(refused(Rejection::Unbalanced)),
        _ if delta > Decimal::ZERO => {
            if active.len() >= MAX_ACTIVE_GRANTS_PER_ACCOUNT {
                return Err(too_many_grants().into());
            }
            let terms = tx.grant_terms.unwrap_or_default();
            if terms.expires_at_ms.is_some_and(|e| e <= at_ms) {
                return Err(Outcome::rejected(
                    "parameter_invalid",
                    "`expires_at` passed before the grant was recorded",
                )
                .with_param("expires_at")
                .into());
            }
            let seq_key = seq_key(&store, mode, &account_id);
            let seq = match overlay.get(&seq_key)? {
                Some(bytes) => u64::from_be_bytes(
                    bytes
                        .as_slice()
                        .try_into()
                        .map_err(|_| EngineError::Corrupt("grant seq".into()))?,
                ),
                None => 0,
            };
            overlay.put(seq_key, (seq + 1).to_be_bytes().to_vec());
            let id = grant_id_of(&tx.id);
            let grant = Grant {
                id: id.clone(),
                store_id: tx.store_id.clone(),
                mode,
                account_id: tx.account_id.clone(),
                amount: delta,
                remaining: delta,
                terms,
                status: GrantStatus::Active,
                transaction_id: tx.id.clone(),
                description: tx.description.clone(),
                metadata: tx.metadata.clone(),
                created_at_ms: tx.created_at_ms,
                updated_at_ms: tx.created_at_ms,
                seq,
            };
            put_grant(overlay, &grant);
            overlay.put(
                ListingKey::entry(
                    keys::CREDIT_GRANT_LIST,
                    &store,
                    mode,
                    Some(&account_id),
                    tx.created_at_ms,
                    &id,
                ),
                Vec::new(),
            );
            let made = ActiveGrant {
                id: id.clone(),
                remaining: delta,
                priority: terms.priority,
                expires_at_ms: terms.expires_at_ms,
                seq,
            };
            if let Some(row) = due_row(&store, mode, &account_id, &made) {
                overlay.put(row, Vec::new());
            }
            active.push(made);
            sort_for_draw(&mut active);
            save_active(overlay, &store, mode, &account_id, &active);
            for entry in tx.entries.iter_mut().filter(|e| e.account_id == account_id) {
                entry.grant_id = Some(id.clone());
            }
            Ok(())
        }
        _ if delta < Decimal::ZERO => {
            let take = -delta;
            if tx.kind == TransactionKind::Close
                && live_total(&active, at_ms).is_none_or(|live| live != take)
            {
                return Err(Outcome::rejected(
                    "account_balance_changed",
                    "the balance changed while the account was being closed; retry the close",
                )
                .into());
            }
            let Some(taken) = draw(&mut active, take, at_ms) else {
                return Err(refused(Rejection::InsufficientBalance));
            };
            let ended = if tx.kind == TransactionKind::Close {
                GrantStatus::Voided
            } else {
                GrantStatus::Consumed
            };
            for (id, _) in &taken {
                let left = active
                    .iter()
                    .find(|g| &g.id == id)
                    .map(|g| g.remaining)
                    .unwrap_or_default();
                let mut grant = load_grant(overlay, &store, mode, id)?;
                grant.remaining = left;
                if left.is_zero() {
                    grant.status = ended;
                }
                grant.updated_at_ms = at_ms;
                put_grant(overlay, &grant);
            }
            for emptied in active.iter().filter(|g| g.remaining <= Decimal::ZERO) {
                if let Some(row) = due_row(&store, mode, &account_id, emptied) {
                    overlay.delete(row);
                }
            }
            active.retain(|g| g.remaining > Decimal::ZERO);
            save_active(overlay, &store, mode, &account_id, &active);
            split_entry(tx, &account_id, &taken);
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Replaces the account's one entry with one per grant drawn, then numbers the
/// transaction's entries again in order (`tally_domain::ledger::entry_id`), so every
/// entry id still names its transaction.
fn split_entry(tx: &mut Transaction, account_id: &str, taken: &[(GrantId, Decimal)]) {
    let Some(index) = tx.entries.iter().position(|e| e.account_id == account_id) else {
        return;
    };
    let original = tx.entries.remove(index);
    let split: Vec<Entry> = taken
        .iter()
        .map(|(grant, amount)| Entry {
            id: String::new(),
            account_id: original.account_id.clone(),
            amount: -*amount,
            grant_id: Some(grant.clone()),
        })
        .collect();
    for (offset, entry) in split.into_iter().enumerate() {
        tx.entries.insert(index + offset, entry);
    }
    tally_domain::ledger::name_entries(&tx.id, &mut tx.entries);
}

pub(crate) fn grant_not_active() -> Outcome {
    Outcome::rejected(
        "grant_not_active",
        "the grant is not active (consumed, expired or voided); nothing was changed",
    )
}

fn grant_changed() -> Outcome {
    Outcome::rejected(
        "resource_changed",
        "the grant changed while it was being voided; retry",
    )
}

fn too_many_grants() -> Outcome {
    Outcome::rejected(
        "too_many_grants",
        format!(
            "the account already has {MAX_ACTIVE_GRANTS_PER_ACCOUNT} active grants; \
             let some be consumed or void them first"
        ),
    )
}

/// How often the expiry sweep looks for grants past their instant: an expiry (and
/// its `credits.expired`) is written at most about this long after it.
pub const EXPIRY_SWEEP_POLL_MS: u64 = 1_000;
/// Accounts one pass of the sweep books before it looks again (bounds one pass).
pub const EXPIRY_SWEEP_BATCH: usize = 100;

/// Appends a `CreditExpiriesDue` for each account (of a store this node serves)
/// with a grant past its instant; answers how many it appended.
pub async fn sweep_expiries(
    journal: &tally_core::Journal,
    mode: Mode,
) -> Result<usize, EngineError> {
    let now = journal.now_ms();
    let mut due = std::collections::BTreeSet::new();
    let mut failure = None;
    let (start, end) = keys::due_until(keys::GRANT_DUE, mode, now);
    journal.store().scan(
        std::ops::Bound::Included(&start),
        std::ops::Bound::Excluded(&end),
        false,
        &mut |key, _| match keys::read_grant_due(key) {
            Ok((at, _, _)) if at > now => tally_projection::Visit::Stop,
            Ok((_, store, account)) => {
                if journal.serves_store(&store) {
                    due.insert((store, account));
                }
                if due.len() >= EXPIRY_SWEEP_BATCH {
                    tally_projection::Visit::Stop
                } else {
                    tally_projection::Visit::Continue
                }
            }
            Err(error) => {
                failure = Some(error);
                tally_projection::Visit::Stop
            }
        },
    )?;
    if let Some(error) = failure {
        return Err(error);
    }
    let appended = due.len();
    for (store, account) in due {
        journal
            .append_and_decide(&tally_domain::record::Record::CreditExpiriesDue {
                store_id: store.into(),
                mode,
                account_id: account.into(),
            })
            .await?;
    }
    Ok(appended)
}

/// The expiry sweep (docs/api.md, "Credit grants"): books expiries at their
/// instant even when nothing else touches the account.
pub async fn run_expiry_sweep(
    journal: std::sync::Arc<tally_core::Journal>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tokio::time::sleep(std::time::Duration::from_millis(EXPIRY_SWEEP_POLL_MS)) => {}
        }
        if journal.check_writable().is_err() {
            continue;
        }
        for mode in [Mode::Prod, Mode::Test] {
            loop {
                match sweep_expiries(&journal, mode).await {
                    Ok(n) if n >= EXPIRY_SWEEP_BATCH => continue,
                    Ok(_) => break,
                    Err(error) => {
                        tracing::warn!(%error, "grant expiries deferred; the sweep retries");
                        break;
                    }
                }
            }
        }
    }
}
