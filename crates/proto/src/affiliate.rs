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

pub fn policy_to_proto(
    store_id: &str,
    mode: tally_domain::Mode,
    p: &tally_domain::moderation::Policy,
) -> v1::ModerationPolicy {
    v1::ModerationPolicy {
        store_id: store_id.to_string(),
        mode: mode_to_proto(mode),
        deny_terms: p.deny_terms.clone(),
        flag_terms: p.flag_terms.clone(),
        deny_patterns: p.deny_patterns.clone(),
        flag_patterns: p.flag_patterns.clone(),
        pii_email: p.pii.email.0.as_str().into(),
        pii_phone: p.pii.phone.0.as_str().into(),
        pii_card: p.pii.card.0.as_str().into(),
        pii_iban: p.pii.iban.0.as_str().into(),
    }
}

pub fn policy_from_proto(
    p: v1::ModerationPolicy,
) -> Result<(String, tally_domain::Mode, tally_domain::moderation::Policy), DecodeError> {
    use tally_domain::moderation::{Pii, PiiAction, PiiActionOr, Policy};
    let action = |text: &str| {
        if text.is_empty() {
            Ok(PiiActionOr(PiiAction::Off))
        } else {
            named(PiiAction::parse, text, "pii action").map(PiiActionOr)
        }
    };
    Ok((
        p.store_id,
        mode_from_proto(p.mode)?,
        Policy {
            deny_terms: p.deny_terms,
            flag_terms: p.flag_terms,
            deny_patterns: p.deny_patterns,
            flag_patterns: p.flag_patterns,
            pii: Pii {
                email: action(&p.pii_email)?,
                phone: action(&p.pii_phone)?,
                card: action(&p.pii_card)?,
                iban: action(&p.pii_iban)?,
            },
        },
    ))
}
