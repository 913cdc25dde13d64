//! An account's holds (docs/api.md, "Reservations"): the list of its live holds
//! (table `>`), what they take at an instant, and the state changes that end holds
//! without a debit (expiry noted, a closing account's release). The lowest layer of
//! reservations: posting reads what is held, and the reservation steps above write.

use rust_decimal::Decimal;
use tally_domain::ledger::{Account, Rejection};
use tally_domain::reservation::{held_at, Hold, Reservation, ReservationStatus};
use tally_domain::Mode;

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};

/// A rejection of a hold step (posting's own helper sits above this layer).
fn refused(rejection: Rejection) -> ApplyError {
    ApplyError::Refused(Outcome::rejected(rejection.code(), rejection.message()))
}

pub(crate) fn holds_key(store: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_HOLDS, store, mode)
        .text(account_id)
        .into_bytes()
}

pub(crate) fn reservation_key(store: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::CREDIT_RESERVATION, store, mode)
        .text(id)
        .into_bytes()
}

/// The account's hold list as stored (live and not yet pruned).
pub(crate) fn stored_holds(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
) -> Result<Vec<Hold>, EngineError> {
    match overlay.get(&holds_key(store, mode, account_id))? {
        Some(bytes) => codec::decode_holds(&bytes),
        None => Ok(Vec::new()),
    }
}

/// What the account's live holds take at `at_ms`.
pub(crate) fn held(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
    at_ms: i64,
) -> Result<Decimal, ApplyError> {
    let holds = stored_holds(overlay, store, mode, account_id)?;
    held_at(&holds, at_ms).ok_or_else(|| refused(Rejection::AmountOutOfRange))
}

pub(crate) fn load(
    overlay: &Overlay<'_>,
    store: &str,
    mode: Mode,
    id: &str,
) -> Result<Reservation, ApplyError> {
    match overlay.get(&reservation_key(store, mode, id))? {
        Some(bytes) => Ok(codec::decode_reservation(&bytes)?),
        None => Err(Outcome::rejected(
            "resource_missing",
            format!("no such credit reservation: '{id}'"),
        )
        .into()),
    }
}

/// Rewrites the account's hold list: `keep` the live holds, and every hold expired
/// at `at_ms` is dropped and its reservation stored as `expired`.
pub(crate) fn write_holds(
    overlay: &mut Overlay<'_>,
    store: &str,
    mode: Mode,
    account_id: &str,
    holds: Vec<Hold>,
    at_ms: i64,
) -> Result<(), ApplyError> {
    let mut live = Vec::with_capacity(holds.len());
    for hold in holds {
        if hold.expires_at_ms > at_ms {
            live.push(hold);
            continue;
        }
        let mut expired = load(overlay, store, mode, &hold.reservation_id)?;
        if expired.status == ReservationStatus::Held {
            expired.status = ReservationStatus::Expired;
            expired.updated_at_ms = expired.expires_at_ms;
            overlay.put(
                reservation_key(store, mode, &expired.id),
                codec::encode_reservation(&expired),
            );
        }
    }
    let key = holds_key(store, mode, account_id);
    if live.is_empty() {
        overlay.delete(key);
    } else {
        overlay.put(key, codec::encode_holds(&live));
    }
    Ok(())
}

/// Ends every hold of a closing account: its balance is forfeited, so nothing is
/// left to hold.
pub(crate) fn release_all(
    overlay: &mut Overlay<'_>,
    account: &Account,
    at_ms: i64,
) -> Result<(), ApplyError> {
    let (store, mode) = (account.store_id.as_str(), account.mode);
    let holds = stored_holds(overlay, store, mode, &account.id)?;
    for hold in &holds {
        let mut reservation = load(overlay, store, mode, &hold.reservation_id)?;
        if reservation.status_at(at_ms) == ReservationStatus::Held {
            reservation.status = ReservationStatus::Released;
            reservation.updated_at_ms = at_ms;
            overlay.put(
                reservation_key(store, mode, &reservation.id),
                codec::encode_reservation(&reservation),
            );
        }
    }
    write_holds(overlay, store, mode, &account.id, Vec::new(), at_ms)
}
