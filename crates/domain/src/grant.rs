//! Credit grants (docs/api.md, "Credit grants"): every credit unit of an account
//! belongs to exactly one grant, so an account's balance is always the sum of what
//! its active grants have left. A credit (or an initial balance, or a reversal that
//! gives credits back) makes a grant; a debit draws from the active grants in a
//! known order; a grant's expiry or void moves what it has left to `forfeit`.
//!
//! Pure rules only: the draw order and the draw itself. Expiry is decided by the
//! ledger's apply from record time.

use rust_decimal::Decimal;

use crate::exact::exact_add;
use crate::ids::{AccountId, GrantId, StoreId, TransactionId};
use crate::mode::Mode;

/// Priority of a grant made without one (credits, initial balances): the middle,
/// so callers can put grants both before and after plain credits.
pub const DEFAULT_GRANT_PRIORITY: u32 = 50;
/// Priorities run 0 (drawn first) to this.
pub const MAX_GRANT_PRIORITY: u32 = 100;
/// Active grants one account may hold. Every debit reads them (one value), so the
/// number is bounded; a credit past it is refused (`too_many_grants`).
pub const MAX_ACTIVE_GRANTS_PER_ACCOUNT: usize = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantStatus {
    /// Has credits left (or may get some back from a reversal).
    Active,
    /// Drawn to zero.
    Consumed,
    /// Its expiry instant passed; what was left went to `forfeit`.
    Expired,
    /// Voided (or its account closed); what was left went to `forfeit`.
    Voided,
}

impl GrantStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            GrantStatus::Active => "active",
            GrantStatus::Consumed => "consumed",
            GrantStatus::Expired => "expired",
            GrantStatus::Voided => "voided",
        }
    }

    pub fn parse(text: &str) -> Option<GrantStatus> {
        [
            GrantStatus::Active,
            GrantStatus::Consumed,
            GrantStatus::Expired,
            GrantStatus::Voided,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

/// The terms a credit's grant is made with (a credit without terms: no expiry,
/// the default priority).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantTerms {
    pub priority: u32,
    pub expires_at_ms: Option<i64>,
}

impl Default for GrantTerms {
    fn default() -> Self {
        GrantTerms {
            priority: DEFAULT_GRANT_PRIORITY,
            expires_at_ms: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub id: GrantId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub account_id: AccountId,
    /// What the grant gave.
    pub amount: Decimal,
    /// What it has left.
    pub remaining: Decimal,
    pub terms: GrantTerms,
    pub status: GrantStatus,
    /// The transaction that made it.
    pub transaction_id: TransactionId,
    pub description: Option<String>,
    pub metadata: std::collections::BTreeMap<String, String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Creation order within the account: the last tie-break of the draw order.
    pub seq: u64,
}

/// An active grant as the account's draw list keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveGrant {
    pub id: GrantId,
    pub remaining: Decimal,
    pub priority: u32,
    pub expires_at_ms: Option<i64>,
    pub seq: u64,
}

impl ActiveGrant {
    /// The draw order: lower priority first, then the soonest expiry (none last),
    /// then the oldest.
    pub fn draw_key(&self) -> (u32, i64, u64) {
        (
            self.priority,
            self.expires_at_ms.unwrap_or(i64::MAX),
            self.seq,
        )
    }

    /// Whether the grant can still be drawn at `at_ms` (its expiry is exclusive: from
    /// the instant on it holds nothing).
    pub fn live_at(&self, at_ms: i64) -> bool {
        self.expires_at_ms.is_none_or(|e| at_ms < e)
    }
}

/// Sorts a draw list into draw order.
pub fn sort_for_draw(grants: &mut [ActiveGrant]) {
    grants.sort_by_key(ActiveGrant::draw_key);
}

/// Takes `amount` from `grants` (in draw order, live at `at_ms`): what each grant
/// gave, in order. `None` when they hold less than `amount` together.
pub fn draw(
    grants: &mut [ActiveGrant],
    amount: Decimal,
    at_ms: i64,
) -> Option<Vec<(GrantId, Decimal)>> {
    let mut left = amount;
    let mut taken = Vec::new();
    for grant in grants.iter_mut() {
        if left.is_zero() {
            break;
        }
        if !grant.live_at(at_ms) || grant.remaining <= Decimal::ZERO {
            continue;
        }
        let take = left.min(grant.remaining);
        grant.remaining = grant.remaining.checked_sub(take)?;
        left = left.checked_sub(take)?;
        taken.push((grant.id.clone(), take));
    }
    left.is_zero().then_some(taken)
}

/// What the grants live at `at_ms` hold together.
pub fn live_total(grants: &[ActiveGrant], at_ms: i64) -> Option<Decimal> {
    grants
        .iter()
        .filter(|g| g.live_at(at_ms))
        .try_fold(Decimal::ZERO, |sum, g| exact_add(sum, g.remaining))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn grant(
        id: &str,
        remaining: i64,
        priority: u32,
        expires: Option<i64>,
        seq: u64,
    ) -> ActiveGrant {
        ActiveGrant {
            id: id.into(),
            remaining: Decimal::from(remaining),
            priority,
            expires_at_ms: expires,
            seq,
        }
    }

    #[test]
    fn draws_by_priority_then_soonest_expiry_then_oldest() {
        let mut grants = vec![
            grant("late", 5, 50, None, 1),
            grant("soon", 5, 50, Some(1_000), 2),
            grant("first", 5, 10, None, 3),
            grant("older", 5, 50, None, 0),
        ];
        sort_for_draw(&mut grants);
        let order: Vec<_> = grants.iter().map(|g| g.id.to_string()).collect();
        assert_eq!(order, ["first", "soon", "older", "late"]);
        let taken = draw(&mut grants, Decimal::from(12), 0).unwrap();
        assert_eq!(
            taken,
            vec![
                ("first".into(), Decimal::from(5)),
                ("soon".into(), Decimal::from(5)),
                ("older".into(), Decimal::from(2)),
            ]
        );
        // Expired at the instant: skipped.
        let mut grants = vec![
            grant("soon", 5, 0, Some(1_000), 0),
            grant("b", 5, 50, None, 1),
        ];
        assert_eq!(
            draw(&mut grants, Decimal::from(3), 1_000).unwrap(),
            vec![("b".into(), Decimal::from(3))]
        );
        assert!(draw(&mut grants, Decimal::from(3), 1_000).is_none());
    }

    proptest! {
        /// A draw takes exactly the amount when the live grants hold it, in draw
        /// order, and the remainders fall by exactly what was taken.
        #[test]
        fn a_draw_takes_exactly_what_it_says(
            specs in prop::collection::vec((0i64..50, 0u32..3, prop::option::of(0i64..10)), 0..12),
            amount in 1i64..200,
            at in 0i64..10,
        ) {
            let mut grants: Vec<ActiveGrant> = specs
                .iter()
                .enumerate()
                .map(|(i, (r, p, e))| grant(&format!("g{i}"), *r, *p, *e, i as u64))
                .collect();
            sort_for_draw(&mut grants);
            let before = live_total(&grants, at).unwrap();
            let copy = grants.clone();
            match draw(&mut grants, Decimal::from(amount), at) {
                Some(taken) => {
                    let sum: Decimal = taken.iter().map(|(_, t)| *t).sum();
                    prop_assert_eq!(sum, Decimal::from(amount));
                    prop_assert_eq!(live_total(&grants, at).unwrap(), before - Decimal::from(amount));
                    // Every grant drawn before the last one drawn was emptied.
                    for (id, _) in taken.iter().take(taken.len().saturating_sub(1)) {
                        let g = grants.iter().find(|g| &g.id == id).unwrap();
                        prop_assert!(g.remaining.is_zero());
                    }
                }
                None => prop_assert!(before < Decimal::from(amount), "{:?}", copy),
            }
        }
    }
}
