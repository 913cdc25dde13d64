//! The ledger audit: replays every credits record from the log, independently of the
//! projector (usage debits: the transactions each applied settlement's claim names,
//! as apply decided what they took), and checks the ledger's invariants
//! (`tally ledger verify`):
//! every transaction's entries sum to zero, no customer account's balance is ever
//! negative, and the projected balances equal the replayed ones. It also feeds
//! `tally ledger export`.

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use sha2::{Digest, Sha256};
use tally_domain::ledger::{Account, SystemAccount, Transaction};
use tally_domain::record::Record;
use tally_domain::reservation::ReservationStep;
use tally_domain::usage::canonical_decimal;
use tally_log::Log;
use tally_projection::ProjectionStore;

use tally_core::error::EngineError;
use tally_core::outcome::outcome_key;
use tally_core::Scope;

use crate::Ledger;

#[derive(Debug, Default)]
pub struct LedgerReplay {
    /// (store, mode byte, account id) -> balance, customer and system accounts.
    pub balances: BTreeMap<(String, char, String), Decimal>,
    pub accounts: BTreeMap<tally_domain::ids::AccountId, Account>,
    pub transactions: u64,
    pub violations: Vec<String>,
}

impl LedgerReplay {
    pub fn customer_account_count(&self) -> usize {
        self.accounts.len()
    }

    fn system_total(&self, system: SystemAccount) -> Decimal {
        self.balances
            .iter()
            .filter(|((_, _, id), _)| id == system.account_id())
            .map(|(_, b)| *b)
            .sum()
    }

    /// Net credits issued (what `issuance` gave out).
    pub fn total_issued(&self) -> Decimal {
        -self.system_total(SystemAccount::Issuance)
    }

    pub fn total_consumed(&self) -> Decimal {
        self.system_total(SystemAccount::Consumption)
    }

    pub fn total_forfeited(&self) -> Decimal {
        self.system_total(SystemAccount::Forfeit)
    }

    /// SHA-256 over every balance and the transaction count.
    pub fn digest(&self) -> String {
        let mut hasher = Sha256::new();
        for ((store, mode, account), balance) in &self.balances {
            hasher.update(format!(
                "{store}\0{mode}\0{account}\0{}\n",
                canonical_decimal(*balance)
            ));
        }
        hasher.update(self.transactions.to_le_bytes());
        hex::encode(hasher.finalize())
    }

    fn apply(&mut self, transaction: &Transaction) {
        self.transactions += 1;
        if !transaction.entries_sum_to_zero() {
            let sum: Decimal = transaction.entries.iter().map(|e| e.amount).sum();
            self.violations.push(format!(
                "transaction {} has entries summing to {} (must be 0 with at least two entries)",
                transaction.id, sum
            ));
        }
        let mode = transaction.mode.key_byte() as char;
        for entry in &transaction.entries {
            let balance = self
                .balances
                .entry((
                    transaction.store_id.to_string(),
                    mode,
                    entry.account_id.to_string(),
                ))
                .or_default();
            *balance += entry.amount;
            if SystemAccount::from_account_id(&entry.account_id).is_none()
                && balance.is_sign_negative()
                && !balance.is_zero()
            {
                self.violations.push(format!(
                    "account {} went negative ({}) with transaction {}",
                    entry.account_id, balance, transaction.id
                ));
            }
        }
    }
}

/// Replays every credits record of the log that apply applied (`projection` holds
/// the outcomes of the records it refused, and must be caught up with the log).
/// `visit` sees each transaction with its account (for exports); `progress` gets
/// (records read, partition, offset, end).
pub async fn replay_ledger(
    log: &dyn Log,
    projection: &dyn ProjectionStore,
    mut visit: impl FnMut(&Transaction, Option<&Account>),
    mut progress: impl FnMut(u64, u32, u64, u64),
) -> Result<LedgerReplay, EngineError> {
    let mut replay = LedgerReplay::default();
    let mut records = 0u64;
    for partition in 0..log.partition_count() {
        // Only what the projection has decided: past its position, which records
        // apply refuses is not known yet.
        let end = log
            .read_end(partition)
            .await?
            .min(projection.position(partition)?);
        tally_log::read_range(
            log,
            partition,
            0,
            end,
            tally_runtime::CHUNK_MAX_RECORDS,
            |entries| {
                for entry in entries {
                    records += 1;
                    // Apply decides credits, debits and reversals in log order; a
                    // record it refused (a debit appended on a stale balance, a
                    // repeated idempotency key) has a recorded outcome and moved no
                    // money.
                    if projection
                        .get(&outcome_key(entry.partition, entry.offset))?
                        .is_some()
                    {
                        continue;
                    }
                    let (record, _) = tally_proto::decode_record(&entry.payload).map_err(|e| {
                        EngineError::Corrupt(format!("record at {}: {e}", entry.offset))
                    })?;
                    // What the record's apply booked itself (the `#` row): expiries,
                    // dated before its own step, replayed first; auto-recharges and a
                    // purchase's grants, which follow its step, replayed after it.
                    let mut after = Vec::new();
                    if let Some(booked) = projection.get(&tally_core::keys::ledger_booked_key(
                        entry.partition,
                        entry.offset,
                    ))? {
                        for id in tally_core::keys::settlement_transactions(&booked) {
                            let transaction = booked_transaction(projection, &record, &id)?;
                            note_account(projection, &mut replay, &transaction)?;
                            if transaction.kind == tally_domain::ledger::TransactionKind::Expiry {
                                replay.apply(&transaction);
                                visit(&transaction, replay.accounts.get(&transaction.account_id));
                            } else {
                                after.push(transaction);
                            }
                        }
                    }
                    // Usage settled in credits: apply decided how much each debit
                    // took (the balance at that point of the log); the settlement's
                    // claim names the transactions, replayed here like any other.
                    if let Record::UsageSettled(settlement) = &record {
                        let claim = tally_core::keys::settlement_done_key(
                            settlement.source_partition,
                            settlement.source_offset,
                        );
                        let posted = projection.get(&claim)?.ok_or_else(|| {
                            EngineError::Corrupt(format!(
                                "the usage settlement at {} was applied but left no claim",
                                entry.offset
                            ))
                        })?;
                        for id in tally_core::keys::settlement_transactions(&posted) {
                            let key = tally_core::keys::Key::scoped(
                                tally_core::keys::CREDIT_TRANSACTION,
                                &settlement.store_id,
                                settlement.mode,
                            )
                            .text(&id)
                            .into_bytes();
                            let Some(bytes) = projection.get(&key)? else {
                                replay.violations.push(format!(
                                    "usage debit {id} is named by its settlement but missing"
                                ));
                                continue;
                            };
                            let transaction = tally_core::codec::decode_transaction(&bytes)?;
                            replay.apply(&transaction);
                            visit(&transaction, replay.accounts.get(&transaction.account_id));
                        }
                    }
                    // A committed reservation's debit (a hold itself moves no money).
                    if let Record::CreditReservation(ReservationStep::Commit {
                        transaction, ..
                    }) = &record
                    {
                        let transaction = as_posted(projection, transaction.clone())?;
                        replay.apply(&transaction);
                        visit(&transaction, replay.accounts.get(&transaction.account_id));
                    }
                    if let Record::CreditLedger {
                        account,
                        transaction,
                        ..
                    } = record
                    {
                        if let Some(account) = account {
                            let mode = account.mode.key_byte() as char;
                            replay
                                .balances
                                .entry((account.store_id.to_string(), mode, account.id.to_string()))
                                .or_default();
                            replay.accounts.insert(account.id.clone(), account);
                        }
                        if let Some(transaction) = transaction {
                            let transaction = as_posted(projection, transaction)?;
                            replay.apply(&transaction);
                            visit(&transaction, replay.accounts.get(&transaction.account_id));
                        }
                    }
                    for transaction in &after {
                        replay.apply(transaction);
                        visit(transaction, replay.accounts.get(&transaction.account_id));
                    }
                }
                let at = entries.last().map_or(end, |e| e.next_offset);
                progress(records, partition, at, end);
                Ok::<(), EngineError>(())
            },
        )
        .await?;
    }
    Ok(replay)
}

/// Makes the account of a transaction apply booked known to the replay when no
/// record of its own created it (a purchase's grant creates its account), read
/// from the projection.
fn note_account(
    projection: &dyn ProjectionStore,
    replay: &mut LedgerReplay,
    transaction: &Transaction,
) -> Result<(), EngineError> {
    if replay.accounts.contains_key(&transaction.account_id) {
        return Ok(());
    }
    let key = tally_core::keys::Key::scoped(
        tally_core::keys::CREDIT_ACCOUNT,
        &transaction.store_id,
        transaction.mode,
    )
    .text(&transaction.account_id)
    .into_bytes();
    if let Some(bytes) = projection.get(&key)? {
        let account = tally_core::codec::decode_account(&bytes)?;
        replay.accounts.insert(account.id.clone(), account);
    }
    Ok(())
}

/// A transaction as apply posted it: the same movement per account as the record's,
/// with the account's entry split per grant drawn (docs/api.md, "Credit grants"),
/// so an export lists the entries `GET /v1/customer-credits/transactions/{id}`
/// shows. A record whose transaction was never stored keeps its own.
fn as_posted(
    projection: &dyn ProjectionStore,
    transaction: Transaction,
) -> Result<Transaction, EngineError> {
    let key = tally_core::keys::Key::scoped(
        tally_core::keys::CREDIT_TRANSACTION,
        &transaction.store_id,
        transaction.mode,
    )
    .text(&transaction.id)
    .into_bytes();
    let Some(bytes) = projection.get(&key)? else {
        return Ok(transaction);
    };
    let posted = tally_core::codec::decode_transaction(&bytes)?;
    // The audit's arithmetic stays its own: only a posting of the same movement
    // replaces the record's (a different one is the projection's fault, reported
    // by the balance comparison, not hidden here).
    let same = posted.account_id == transaction.account_id
        && posted.amount == transaction.amount
        && posted.kind == transaction.kind
        && posted.delta_for(&posted.account_id) == transaction.delta_for(&transaction.account_id);
    Ok(if same { posted } else { transaction })
}

/// A transaction apply booked while applying `record` (an expiry), read from the
/// projection in the record's store.
fn booked_transaction(
    projection: &dyn ProjectionStore,
    record: &Record,
    id: &str,
) -> Result<Transaction, EngineError> {
    let scope = record_scope(record).ok_or_else(|| {
        EngineError::Corrupt(format!("expiry {id} was booked by a record of no store"))
    })?;
    let key =
        tally_core::keys::Key::scoped(tally_core::keys::CREDIT_TRANSACTION, &scope.0, scope.1)
            .text(id)
            .into_bytes();
    let bytes = projection
        .get(&key)?
        .ok_or_else(|| EngineError::Corrupt(format!("booked expiry {id} is missing")))?;
    tally_core::codec::decode_transaction(&bytes)
}

/// The store and mode of a record that can book transactions itself (expiries,
/// auto-recharges, a purchase's grants: a checkout's, a subscription period's).
fn record_scope(record: &Record) -> Option<(String, tally_domain::Mode)> {
    match record {
        Record::CreditLedger {
            account,
            transaction,
            ..
        } => account
            .as_ref()
            .map(|a| (a.store_id.to_string(), a.mode))
            .or(transaction
                .as_ref()
                .map(|t| (t.store_id.to_string(), t.mode))),
        Record::CreditReservation(step) => Some(match step {
            ReservationStep::Hold(r) => (r.store_id.to_string(), r.mode),
            ReservationStep::Commit { store_id, mode, .. }
            | ReservationStep::Release { store_id, mode, .. } => (store_id.to_string(), *mode),
        }),
        Record::UsageSettled(s) => Some((s.store_id.to_string(), s.mode)),
        Record::CheckoutCompleted(c) => Some((c.checkout.store_id.to_string(), c.checkout.mode)),
        Record::SubscriptionChanged { subscription, .. } => {
            Some((subscription.store_id.to_string(), subscription.mode))
        }
        Record::AutoRechargeSettled(s) => Some((s.store_id.to_string(), s.mode)),
        Record::CreditExpiriesDue { store_id, mode, .. } => Some((store_id.to_string(), *mode)),
        _ => None,
    }
}

impl Ledger {
    /// Compares replayed balances with the projection; adds violations.
    pub fn check_projected_balances(&self, replay: &mut LedgerReplay) -> Result<(), EngineError> {
        let mut mismatches = Vec::new();
        for ((store, mode, account), replayed) in &replay.balances {
            let scope = Scope {
                store_id: store.clone().into(),
                mode: tally_core::keys::read_mode(*mode as u8, "a replayed ledger account")?,
            };
            let projected = self.booked_balance(&scope, account)?;
            if projected != *replayed {
                mismatches.push(format!(
                    "account {account}: projected balance {projected} differs from the replayed {replayed}"
                ));
            }
        }
        replay.violations.extend(mismatches);
        Ok(())
    }
}
