//! Credit reservations (docs/api.md, "Reservations"): a hold on part of an account's
//! balance, then a commit (a debit of at most what is held; the rest is released) or
//! a release. Apply decides each step in log order, like every ledger step: a hold
//! is granted only from the available balance (`balance - held`), so 200 concurrent
//! holds of 1 against 100 hold exactly 100 on any number of nodes, without a lock.
//!
//! Expiry is decided from record time: a hold counts while the time of the record
//! being applied is before its `expires_at`, and from then on it is expired, whether
//! or not any record has noted it. The account's hold list (table `>`) is pruned of
//! expired holds whenever a hold step rewrites it, and each pruned reservation is
//! stored as `expired` then, so a replay stores the same states at the same records.

use rust_decimal::Decimal;
use tally_domain::ledger::{check_open, parse_amount, post, Rejection, TransactionKind};
use tally_domain::record::{LedgerEvent, Record};
use tally_domain::reservation::{
    available, held_at, Hold, Reservation, ReservationStatus, ReservationStep,
    DEFAULT_RESERVATION_SECONDS, MAX_HELD_RESERVATIONS_PER_ACCOUNT, MAX_RESERVATION_SECONDS,
};
use tally_domain::{FieldError, Mode};

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::{Decision, Scope};

use crate::apply::apply_transaction;
use crate::holds::{load, reservation_key, stored_holds, write_holds};
use crate::posting::{
    account_missing, movement_events, note_exhaustion, refused, stored_account, stored_balance,
};
use crate::Ledger;

/// Input of `POST /v1/customer-credits/accounts/{id}/reservations`, as the edge
/// parsed it.
#[derive(Debug, Clone, Default)]
pub struct ReservationInput {
    pub amount: Option<String>,
    pub idempotency_key: Option<String>,
    pub expires_in_seconds: Option<i64>,
}

fn idempotency_row(store: &str, mode: Mode, key: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_RESERVATION_IDEMPOTENCY, store, mode)
        .tail(key.as_bytes())
        .into_bytes()
}

/// Folds one reservation step, decided at record time `at_ms`. Returns the webhook
/// events of a commit's debit.
pub fn apply_reservation_step(
    overlay: &mut Overlay<'_>,
    step: &ReservationStep,
    at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    match step {
        ReservationStep::Hold(reservation) => {
            let mut events = apply_hold(overlay, reservation, at_ms)?;
            events.extend(crate::thresholds::after_step(
                overlay,
                &reservation.store_id,
                reservation.mode,
                &reservation.account_id,
                at_ms,
                None,
                &format!("{}:hold", reservation.id),
            )?);
            Ok(events)
        }
        ReservationStep::Commit {
            store_id,
            mode,
            reservation_id,
            transaction,
        } => {
            let mut reservation = load(overlay, store_id, *mode, reservation_id)?;
            match reservation.status_at(at_ms) {
                ReservationStatus::Held => {}
                ReservationStatus::Committed => {
                    return Err(ApplyError::Refused(Outcome::SameAs {
                        id: reservation.id.to_string(),
                    }))
                }
                ReservationStatus::Expired => return Err(reservation_expired().into()),
                ReservationStatus::Released => return Err(reservation_released().into()),
            }
            let valid = transaction.kind == TransactionKind::Debit
                && transaction.account_id == reservation.account_id
                && transaction.amount <= reservation.amount;
            if !valid {
                return Err(refused(Rejection::Unbalanced));
            }
            let (store, mode) = (store_id.as_str(), *mode);
            let mut holds = stored_holds(overlay, store, mode, &reservation.account_id)?;
            holds.retain(|h| h.reservation_id != reservation.id);
            write_holds(overlay, store, mode, &reservation.account_id, holds, at_ms)?;
            reservation.status = ReservationStatus::Committed;
            reservation.transaction_id = Some(transaction.id.clone());
            reservation.committed_amount = Some(transaction.amount);
            reservation.updated_at_ms = at_ms;
            overlay.put(
                reservation_key(store, mode, &reservation.id),
                codec::encode_reservation(&reservation),
            );
            // The hold is gone, so the debit sees the balance less the other holds:
            // it fits, as the hold kept other spending off it, unless the account
            // was frozen since or grants expired under it (a hold claims the
            // balance, not grants: docs/api.md, "Reservations").
            let posted = apply_transaction(overlay, transaction, None, None, at_ms)?;
            let mut events = posted.expired;
            events.extend(movement_events(
                &posted.transaction,
                &posted.account,
                posted.balance_after,
            ));
            note_exhaustion(overlay, &events);
            events.extend(crate::thresholds::after_step(
                overlay,
                store,
                mode,
                &posted.account.id,
                at_ms,
                Some(&posted.transaction),
                &posted.transaction.id,
            )?);
            Ok(events)
        }
        ReservationStep::Release {
            store_id,
            mode,
            reservation_id,
        } => {
            let mut reservation = load(overlay, store_id, *mode, reservation_id)?;
            match reservation.status_at(at_ms) {
                ReservationStatus::Held => {}
                ReservationStatus::Committed => return Err(reservation_committed().into()),
                // Released or expired: nothing is held; the caller gets it as it is.
                ReservationStatus::Released | ReservationStatus::Expired => {
                    return Err(ApplyError::Refused(Outcome::SameAs {
                        id: reservation.id.to_string(),
                    }))
                }
            }
            let (store, mode) = (store_id.as_str(), *mode);
            let mut holds = stored_holds(overlay, store, mode, &reservation.account_id)?;
            holds.retain(|h| h.reservation_id != reservation.id);
            write_holds(overlay, store, mode, &reservation.account_id, holds, at_ms)?;
            reservation.status = ReservationStatus::Released;
            reservation.updated_at_ms = at_ms;
            overlay.put(
                reservation_key(store, mode, &reservation.id),
                codec::encode_reservation(&reservation),
            );
            crate::thresholds::after_step(
                overlay,
                store,
                mode,
                &reservation.account_id,
                at_ms,
                None,
                &format!("{}:release", reservation.id),
            )
        }
    }
}

fn apply_hold(
    overlay: &mut Overlay<'_>,
    reservation: &Reservation,
    at_ms: i64,
) -> Result<Vec<LedgerEvent>, ApplyError> {
    let (store, mode) = (reservation.store_id.as_str(), reservation.mode);
    let idempotency = idempotency_row(store, mode, &reservation.idempotency_key);
    if let Some(existing) = overlay.get(&idempotency)? {
        let existing = load(overlay, store, mode, &String::from_utf8_lossy(&existing))?;
        return Err(if same_hold(&existing, reservation) {
            ApplyError::Refused(Outcome::SameAs {
                id: existing.id.to_string(),
            })
        } else {
            idempotency_key_reused().into()
        });
    }
    let valid = reservation.status == ReservationStatus::Held
        && reservation.amount > Decimal::ZERO
        && reservation.amount <= tally_domain::ledger::MAX_AMOUNT
        && reservation.expires_at_ms > at_ms;
    if !valid {
        return Err(refused(Rejection::Unbalanced));
    }
    let account = stored_account(overlay, store, mode, &reservation.account_id)?
        .ok_or_else(|| account_missing(&reservation.account_id))?;
    check_open(account.status).map_err(refused)?;
    // Grants expired by the record's time hold nothing to reserve.
    let expired = crate::grants::book_expiries(overlay, &account, at_ms)?;
    note_exhaustion(overlay, &expired);
    let balance = stored_balance(overlay, store, mode, &account.id)?;
    let mut holds = stored_holds(overlay, store, mode, &account.id)?;
    holds.retain(|h| h.expires_at_ms > at_ms);
    let held = held_at(&holds, at_ms).ok_or_else(|| refused(Rejection::AmountOutOfRange))?;
    if available(balance, held) < reservation.amount {
        return Err(refused(Rejection::InsufficientBalance));
    }
    if holds.len() >= MAX_HELD_RESERVATIONS_PER_ACCOUNT {
        return Err(too_many_reservations().into());
    }
    // Expired holds dropped above are stored as expired by `write_holds`.
    let mut all = stored_holds(overlay, store, mode, &account.id)?;
    all.push(Hold {
        reservation_id: reservation.id.clone(),
        amount: reservation.amount,
        expires_at_ms: reservation.expires_at_ms,
    });
    write_holds(overlay, store, mode, &account.id, all, at_ms)?;
    overlay.put(idempotency, reservation.id.as_bytes().to_vec());
    overlay.put(
        reservation_key(store, mode, &reservation.id),
        codec::encode_reservation(reservation),
    );
    Ok(expired)
}

/// Whether a hold repeats an earlier one with the same idempotency key.
fn same_hold(existing: &Reservation, new: &Reservation) -> bool {
    existing.account_id == new.account_id && existing.amount == new.amount
}

fn idempotency_key_reused() -> Outcome {
    Outcome::rejected(
        "idempotency_key_reused",
        "this idempotency_key was used for a different amount or account",
    )
    .with_param("idempotency_key")
}

fn reservation_expired() -> Outcome {
    Outcome::rejected(
        "reservation_expired",
        "the reservation expired and holds nothing; reserve again",
    )
}

fn reservation_released() -> Outcome {
    Outcome::rejected(
        "reservation_released",
        "the reservation was released and holds nothing; reserve again",
    )
}

fn reservation_committed() -> Outcome {
    Outcome::rejected(
        "reservation_committed",
        "the reservation was committed; reverse its transaction to give the credits back",
    )
}

fn too_many_reservations() -> Outcome {
    Outcome::rejected(
        "too_many_reservations",
        format!(
            "the account already has {MAX_HELD_RESERVATIONS_PER_ACCOUNT} live reservations; \
             commit or release some first"
        ),
    )
}

impl Ledger {
    /// What the account's live holds take now.
    /// A reservation as it is now (a hold past its expiry reads `expired`).
    pub fn get_reservation(&self, scope: &Scope, id: &str) -> Result<Reservation, EngineError> {
        let key = reservation_key(&scope.store_id, scope.mode, id);
        match self.journal.store().get(&key)? {
            Some(bytes) => {
                let mut reservation = codec::decode_reservation(&bytes)?;
                reservation.status = reservation.status_at(self.journal.now_ms());
                Ok(reservation)
            }
            None => Err(EngineError::not_found("credit reservation", id)),
        }
    }

    /// Holds `amount` of the account's available balance until it expires.
    pub async fn reserve(
        &self,
        scope: &Scope,
        account_id: &str,
        input: &ReservationInput,
    ) -> Result<Reservation, EngineError> {
        let amount_text = input
            .amount
            .as_deref()
            .ok_or_else(|| FieldError::missing("amount"))?;
        let amount = parse_amount("amount", amount_text, false)?;
        let idempotency_key =
            crate::ledger::idempotency_key_field(input.idempotency_key.as_deref())?;
        let seconds = input
            .expires_in_seconds
            .unwrap_or(DEFAULT_RESERVATION_SECONDS);
        if !(1..=MAX_RESERVATION_SECONDS).contains(&seconds) {
            return Err(FieldError::invalid(
                "expires_in_seconds",
                format!(
                    "`expires_in_seconds` must be an integer from 1 to {MAX_RESERVATION_SECONDS}"
                ),
            )
            .into());
        }
        let account = self.get_account(scope, account_id)?;
        let store = self.journal.store();
        let idempotency = idempotency_row(&scope.store_id, scope.mode, &idempotency_key);
        if let Some(existing) = store.get(&idempotency)? {
            let existing = self.get_reservation(scope, &String::from_utf8_lossy(&existing))?;
            if existing.account_id != account_id || existing.amount != amount {
                return Err(idempotency_key_reused().into());
            }
            return Ok(existing);
        }
        // The fast check; apply decides again in log order.
        check_open(account.status).map_err(|r| EngineError::conflict(r.code(), r.message()))?;
        let free = available(
            self.balance(scope, account_id)?,
            self.held(scope, account_id)?,
        );
        if free < amount {
            let r = Rejection::InsufficientBalance;
            return Err(EngineError::conflict(r.code(), r.message()));
        }
        let now = self.journal.now_ms();
        let reservation = Reservation {
            id: new_id("rsv").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            account_id: account.id.clone(),
            amount,
            status: ReservationStatus::Held,
            idempotency_key,
            expires_at_ms: now.saturating_add(seconds.saturating_mul(1000)),
            created_at_ms: now,
            updated_at_ms: now,
            transaction_id: None,
            committed_amount: None,
        };
        let step = ReservationStep::Hold(reservation.clone());
        match self
            .journal
            .append_and_decide(&Record::CreditReservation(step))
            .await?
        {
            Decision::Applied => Ok(reservation),
            Decision::SameAs(id) => self.get_reservation(scope, &id),
        }
    }

    /// Debits `amount` (default: all it holds) and releases the rest. Committing a
    /// committed reservation again returns it with its transaction.
    pub async fn commit_reservation(
        &self,
        scope: &Scope,
        id: &str,
        amount: Option<&str>,
    ) -> Result<Reservation, EngineError> {
        let reservation = self.get_reservation(scope, id)?;
        let amount = match amount {
            None => reservation.amount,
            Some(text) => {
                let amount = parse_amount("amount", text, false)?;
                if amount > reservation.amount {
                    return Err(FieldError::invalid(
                        "amount",
                        format!(
                            "`amount` is at most what the reservation holds ({})",
                            tally_domain::usage::canonical_decimal(reservation.amount)
                        ),
                    )
                    .into());
                }
                amount
            }
        };
        match reservation.status {
            ReservationStatus::Held => {}
            ReservationStatus::Committed => return Ok(reservation),
            ReservationStatus::Expired => return Err(reservation_expired().into()),
            ReservationStatus::Released => return Err(reservation_released().into()),
        }
        let account = self.get_account(scope, &reservation.account_id)?;
        // The entries of a debit of `amount` from an account holding at least it.
        let entries = post(
            TransactionKind::Debit,
            &account.id,
            account.status,
            amount,
            amount,
            &mut String::new,
        )
        .map_err(|r| EngineError::conflict(r.code(), r.message()))?;
        let mut tx =
            self.new_transaction(scope, TransactionKind::Debit, &account.id, amount, entries);
        tx.description = Some(format!("commit of reservation {id}"));
        tx.metadata.insert("reservation_id".into(), id.to_string());
        let step = ReservationStep::Commit {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            reservation_id: reservation.id.clone(),
            transaction: tx,
        };
        self.journal
            .append_and_decide(&Record::CreditReservation(step))
            .await?;
        self.get_reservation(scope, id)
    }

    /// Ends a hold without a debit. Releasing a released or expired reservation
    /// returns it as it is.
    pub async fn release_reservation(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<Reservation, EngineError> {
        let reservation = self.get_reservation(scope, id)?;
        match reservation.status {
            ReservationStatus::Held => {}
            ReservationStatus::Committed => return Err(reservation_committed().into()),
            ReservationStatus::Released | ReservationStatus::Expired => return Ok(reservation),
        }
        let step = ReservationStep::Release {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            reservation_id: reservation.id.clone(),
        };
        self.journal
            .append_and_decide(&Record::CreditReservation(step))
            .await?;
        self.get_reservation(scope, id)
    }
}
