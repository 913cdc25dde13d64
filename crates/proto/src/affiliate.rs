//! Affiliates and invitations between the domain and `tally.v1`.

use tally_domain::affiliate::{Affiliate, AffiliateInvite, AffiliateStatus, InviteStatus};

use crate::convert::{mode_from_proto, mode_to_proto, DecodeError};
use crate::product::named;
use crate::v1;

pub fn invite_to_proto(i: &AffiliateInvite) -> v1::AffiliateInvite {
    v1::AffiliateInvite {
        id: i.id.to_string(),
        store_id: i.store_id.to_string(),
        mode: mode_to_proto(i.mode),
        email: i.email.clone(),
        name: i.name.clone(),
        status: i.status.as_str().into(),
        affiliate_id: i.affiliate_id.as_ref().map(|a| a.to_string()),
        created_at_ms: i.created_at_ms,
        updated_at_ms: i.updated_at_ms,
    }
}

pub fn invite_from_proto(i: v1::AffiliateInvite) -> Result<AffiliateInvite, DecodeError> {
    Ok(AffiliateInvite {
        id: i.id.into(),
        store_id: i.store_id.into(),
        mode: mode_from_proto(i.mode)?,
        email: i.email,
        name: i.name,
        status: named(InviteStatus::parse, &i.status, "invite status")?,
        affiliate_id: i.affiliate_id.map(Into::into),
        created_at_ms: i.created_at_ms,
        updated_at_ms: i.updated_at_ms,
    })
}

pub fn affiliate_to_proto(a: &Affiliate) -> v1::Affiliate {
    v1::Affiliate {
        id: a.id.to_string(),
        store_id: a.store_id.to_string(),
        mode: mode_to_proto(a.mode),
        email: a.email.clone(),
        name: a.name.clone(),
        status: a.status.as_str().into(),
        referral_code: a.referral_code.clone(),
        clicks: a.clicks,
        conversions: a.conversions,
        earnings: a.earnings,
        currency: a.currency.clone(),
        created_at_ms: a.created_at_ms,
        updated_at_ms: a.updated_at_ms,
    }
}

pub fn affiliate_from_proto(a: v1::Affiliate) -> Result<Affiliate, DecodeError> {
    Ok(Affiliate {
        id: a.id.into(),
        store_id: a.store_id.into(),
        mode: mode_from_proto(a.mode)?,
        email: a.email,
        name: a.name,
        status: named(AffiliateStatus::parse, &a.status, "affiliate status")?,
        referral_code: a.referral_code,
        clicks: a.clicks,
        conversions: a.conversions,
        earnings: a.earnings,
        currency: a.currency,
        created_at_ms: a.created_at_ms,
        updated_at_ms: a.updated_at_ms,
    })
}
