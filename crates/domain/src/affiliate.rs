//! Affiliates (docs/api.md, "Affiliates"): invitations, the affiliates who joined,
//! their clicks, conversions and commission. Commission is the store's percent of a
//! completed checkout's `amount_paid`, rounded down to the minor unit, and a refund
//! takes back the part of it the refunded share earned, so what an affiliate keeps
//! is always `floor(commission x (paid - refunded) / paid)`.

use rust_decimal::{Decimal, RoundingStrategy};

use crate::error::FieldError;
use crate::ids::{AffiliateId, InviteId, StoreId};
use crate::mode::Mode;

wire_enum!(
    /// An invitation's status.
    InviteStatus { Pending => "pending", Accepted => "accepted" }
);
wire_enum!(
    /// A suspended affiliate keeps what it earned and earns nothing more.
    AffiliateStatus { Active => "active", Suspended => "suspended" }
);

/// The largest commission percent a store may set.
pub const MAX_COMMISSION_PERCENT: u32 = 100;

#[derive(Debug, Clone, PartialEq)]
pub struct AffiliateInvite {
    pub id: InviteId,
    pub store_id: StoreId,
    pub mode: Mode,
    /// Lowercased: one invitation per address.
    pub email: String,
    pub name: Option<String>,
    pub status: InviteStatus,
    pub affiliate_id: Option<AffiliateId>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Affiliate {
    pub id: AffiliateId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub email: String,
    pub name: Option<String>,
    pub status: AffiliateStatus,
    /// What checkouts name in `affiliate_code` (unique in the store and mode).
    pub referral_code: String,
    pub clicks: u64,
    pub conversions: u64,
    /// Lifetime commission, minor units of `currency`.
    pub earnings: i64,
    /// The currency of the first conversion.
    pub currency: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// The commission on `amount_paid` at `percent`, rounded down.
pub fn commission(amount_paid: i64, percent: Decimal) -> i64 {
    let exact = Decimal::from(amount_paid.max(0)) * percent / Decimal::ONE_HUNDRED;
    i64::try_from(exact.round_dp_with_strategy(0, RoundingStrategy::ToZero)).unwrap_or(0)
}

/// What an affiliate keeps of `commission` once `refunded` of `paid` went back.
pub fn commission_kept(commission: i64, paid: i64, refunded: i64) -> i64 {
    if paid <= 0 {
        return 0;
    }
    let left = (paid - refunded).clamp(0, paid);
    let kept = Decimal::from(commission) * Decimal::from(left) / Decimal::from(paid);
    i64::try_from(kept.round_dp_with_strategy(0, RoundingStrategy::ToZero)).unwrap_or(0)
}

/// A store's commission percent: 0 to `MAX_COMMISSION_PERCENT`, at most 4 decimals.
pub fn parse_commission_percent(text: &str) -> Result<Decimal, FieldError> {
    let param = "affiliate_commission_percent";
    text.trim()
        .parse::<Decimal>()
        .ok()
        .filter(|p| {
            *p >= Decimal::ZERO && *p <= Decimal::from(MAX_COMMISSION_PERCENT) && p.scale() <= 4
        })
        .map(|p| p.normalize())
        .ok_or_else(|| {
            FieldError::invalid(
                param,
                format!("`{param}` must be 0 to {MAX_COMMISSION_PERCENT} with at most 4 decimals"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn commission_rounds_down() {
        assert_eq!(commission(999, Decimal::from(10)), 99);
        assert_eq!(commission(1000, Decimal::new(125, 1)), 125);
    }

    proptest! {
        /// Refunds in any steps take back exactly what the refunded share earned:
        /// the kept commission never grows and never goes below zero.
        #[test]
        fn refunds_take_back_commission_proportionally(
            paid in 1i64..100_000,
            percent in 0u32..=100,
            steps in proptest::collection::vec(0i64..50_000, 0..6),
        ) {
            let c = commission(paid, Decimal::from(percent));
            let mut refunded = 0;
            let mut kept = commission_kept(c, paid, 0);
            prop_assert_eq!(kept, c);
            for step in steps {
                refunded = (refunded + step).min(paid);
                let now = commission_kept(c, paid, refunded);
                prop_assert!(now <= kept && now >= 0);
                kept = now;
            }
            if refunded == paid {
                prop_assert_eq!(kept, 0);
            }
        }
    }
}
