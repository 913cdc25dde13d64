//! Credit reservations: a hold on part of an account's balance, later committed (a
//! debit of at most what is held) or released (docs/api.md, "Reservations").
//!
//! What a hold takes is no longer available: debits and new holds see
//! `available = balance - held`. Whether a hold has expired is decided from record
//! time (the time of the record being applied), never from the clock at apply time,
//! so a replay decides every expiry the same way.

use rust_decimal::Decimal;

use crate::exact::exact_add;
use crate::ids::{AccountId, ReservationId, StoreId, TransactionId};
use crate::ledger::Transaction;
use crate::mode::Mode;

/// Longest hold a caller may ask for (a day): a hold is a short promise, not a
/// second balance; longer commitments are debits.
pub const MAX_RESERVATION_SECONDS: i64 = 86_400;
/// The hold's length when the caller names none.
pub const DEFAULT_RESERVATION_SECONDS: i64 = 300;
/// Holds one account may have at once. Every debit of the account reads them, so
/// the number is bounded; a hold past it is refused (`too_many_reservations`).
pub const MAX_HELD_RESERVATIONS_PER_ACCOUNT: usize = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationStatus {
    Held,
    Committed,
    Released,
    Expired,
}

impl ReservationStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ReservationStatus::Held => "held",
            ReservationStatus::Committed => "committed",
            ReservationStatus::Released => "released",
            ReservationStatus::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Option<ReservationStatus> {
        [
            ReservationStatus::Held,
            ReservationStatus::Committed,
            ReservationStatus::Released,
            ReservationStatus::Expired,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub id: ReservationId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub account_id: AccountId,
    /// What the hold took from the available balance (positive).
    pub amount: Decimal,
    /// As stored; see [`Reservation::status_at`] for what it is at an instant.
    pub status: ReservationStatus,
    pub idempotency_key: String,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The debit a commit made.
    pub transaction_id: Option<TransactionId>,
    pub committed_amount: Option<Decimal>,
}

impl Reservation {
    /// The status at `at_ms`: a hold is expired from its `expires_at` on, whether or
    /// not a record has noted it yet.
    pub fn status_at(&self, at_ms: i64) -> ReservationStatus {
        match self.status {
            ReservationStatus::Held if at_ms >= self.expires_at_ms => ReservationStatus::Expired,
            status => status,
        }
    }
}

/// One step of a reservation's life, as its log record carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReservationStep {
    /// A new hold (status `held`).
    Hold(Reservation),
    /// Ends a hold with `transaction`, a debit of at most what it holds.
    Commit {
        store_id: StoreId,
        mode: Mode,
        reservation_id: ReservationId,
        transaction: Transaction,
    },
    /// Ends a hold without a debit.
    Release {
        store_id: StoreId,
        mode: Mode,
        reservation_id: ReservationId,
    },
}

impl ReservationStep {
    pub fn store_id(&self) -> &StoreId {
        match self {
            ReservationStep::Hold(r) => &r.store_id,
            ReservationStep::Commit { store_id, .. }
            | ReservationStep::Release { store_id, .. } => store_id,
        }
    }
}

/// One live hold of an account, as the account's hold list keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub reservation_id: ReservationId,
    pub amount: Decimal,
    pub expires_at_ms: i64,
}

/// The sum of the holds still live at `at_ms` (None only past `Decimal`'s range,
/// which bounded amounts and `MAX_HELD_RESERVATIONS_PER_ACCOUNT` rule out).
pub fn held_at(holds: &[Hold], at_ms: i64) -> Option<Decimal> {
    holds
        .iter()
        .filter(|h| h.expires_at_ms > at_ms)
        .try_fold(Decimal::ZERO, |sum, h| exact_add(sum, h.amount))
}

/// What a debit or a new hold may take: the balance less what is held, never below
/// zero (checked: bounded inputs cannot overflow, and an impossible overflow reads
/// as nothing available rather than a panic).
pub fn available(balance: Decimal, held: Decimal) -> Decimal {
    balance
        .checked_sub(held)
        .unwrap_or(Decimal::ZERO)
        .max(Decimal::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(amount: i64, expires_at_ms: i64) -> Hold {
        Hold {
            reservation_id: "rsv_1".into(),
            amount: Decimal::from(amount),
            expires_at_ms,
        }
    }

    #[test]
    fn available_is_the_balance_less_holds_and_never_below_zero() {
        let d = Decimal::from;
        assert_eq!(available(d(49), d(11)), d(38));
        // A grant that expired under a hold left less than is held.
        assert_eq!(available(d(0), d(11)), Decimal::ZERO);
        assert_eq!(
            available(Decimal::MIN, Decimal::MAX),
            Decimal::ZERO,
            "no overflow"
        );
    }

    #[test]
    fn a_hold_counts_until_its_expiry_instant_and_not_from_it() {
        let holds = [hold(3, 100), hold(4, 200)];
        assert_eq!(held_at(&holds, 99), Some(Decimal::from(7)));
        assert_eq!(held_at(&holds, 100), Some(Decimal::from(4)));
        assert_eq!(held_at(&holds, 200), Some(Decimal::ZERO));
    }

    #[test]
    fn a_held_reservation_reads_expired_from_its_expiry_on() {
        let r = Reservation {
            id: "rsv_1".into(),
            store_id: "st_1".into(),
            mode: Mode::Test,
            account_id: "ca_1".into(),
            amount: Decimal::ONE,
            status: ReservationStatus::Held,
            idempotency_key: "k".into(),
            expires_at_ms: 100,
            created_at_ms: 0,
            updated_at_ms: 0,
            transaction_id: None,
            committed_amount: None,
        };
        assert_eq!(r.status_at(99), ReservationStatus::Held);
        assert_eq!(r.status_at(100), ReservationStatus::Expired);
        let released = Reservation {
            status: ReservationStatus::Released,
            ..r
        };
        assert_eq!(released.status_at(1_000), ReservationStatus::Released);
    }
}
