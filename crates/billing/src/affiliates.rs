//! Affiliates (docs/api.md, "Affiliates"): invitations and their acceptance, the
//! affiliates with their referral codes, clicks, conversions and commission, and the
//! page-based lists of both.
//!
//! Decided in apply, in the store's log order: one invitation per email, an
//! invitation accepted once, a referral code unique, a conversion counted once per
//! completed checkout (with the store's commission percent at that point of the log,
//! for an active affiliate), a refund taking back the commission its share earned.
//! Counters are not versions: a status change is applied over the version it was
//! derived from, and keeps the counters apply kept meanwhile.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::{new_id, random_base62};
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::{check_base, Outcome};
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::pagination::{page_based, PageBased};
use tally_core::Scope;
use tally_domain::affiliate::{
    commission, commission_kept, Affiliate, AffiliateInvite, AffiliateStatus, InviteStatus,
};
use tally_domain::billing::Payment;
use tally_domain::customer::is_valid_email;
use tally_domain::record::Record;
use tally_domain::{FieldError, Mode};

use crate::Billing;

/// Characters of a referral code (~48 bits: unguessable enough to count clicks).
pub const REFERRAL_CODE_CHARS: usize = 8;

/// Invitations (and affiliates) a page-based list counts through at most: the
/// lists are counted whole for `total_records`.
pub const MAX_AFFILIATES_PER_SCOPE: usize = 100_000;

fn invite_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::AFFILIATE_INVITE, store_id, mode)
        .text(id)
        .into_bytes()
}

fn invite_email_key(store_id: &str, mode: Mode, email: &str) -> Vec<u8> {
    Key::scoped(keys::AFFILIATE_INVITE_EMAIL, store_id, mode)
        .text(email)
        .into_bytes()
}

fn affiliate_key(store_id: &str, mode: Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::AFFILIATE, store_id, mode)
        .text(id)
        .into_bytes()
}

fn code_key(store_id: &str, mode: Mode, code: &str) -> Vec<u8> {
    crate::apply::code_key(keys::AFFILIATE_CODE, store_id, mode, code)
}

fn refused(code: &'static str, message: impl Into<String>, param: &str) -> ApplyError {
    Outcome::rejected(code, message.into())
        .with_param(param)
        .into()
}

/// A new invitation: one per email in the store and mode.
pub fn apply_invite_created(
    overlay: &mut Overlay<'_>,
    invite: &AffiliateInvite,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&invite.store_id, invite.mode);
    let email = invite_email_key(store_id, mode, &invite.email);
    if overlay.contains(&email)? {
        return Err(refused(
            "affiliate_invite_exists",
            format!("'{}' is invited already", invite.email),
            "email",
        ));
    }
    overlay.put(email, invite.id.as_bytes().to_vec());
    overlay.put(
        ListingKey::entry(
            keys::AFFILIATE_INVITE_LIST,
            store_id,
            mode,
            None,
            invite.created_at_ms,
            &invite.id,
        ),
        Vec::new(),
    );
    overlay.put(
        invite_key(store_id, mode, &invite.id),
        codec::encode_invite(invite),
    );
    Ok(())
}

/// An invited affiliate joins: the invitation still pending, the code free.
pub fn apply_affiliate_joined(
    overlay: &mut Overlay<'_>,
    invite_id: &str,
    affiliate: &Affiliate,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&affiliate.store_id, affiliate.mode);
    let key = invite_key(store_id, mode, invite_id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(refused(
            "resource_missing",
            format!("no such invite: '{invite_id}'"),
            "id",
        ));
    };
    let mut invite = codec::decode_invite(&bytes)?;
    if invite.status != InviteStatus::Pending {
        return Err(Outcome::rejected(
            "invalid_state_transition",
            "the invite is accepted already",
        )
        .into());
    }
    let fresh = affiliate.status == AffiliateStatus::Active
        && affiliate.clicks == 0
        && affiliate.conversions == 0
        && affiliate.earnings == 0
        && affiliate.currency.is_none()
        && affiliate.email == invite.email
        && !affiliate.referral_code.is_empty();
    if !fresh {
        return Err(Outcome::rejected(
            "record_undecodable",
            "a joining affiliate starts active, with nothing counted, under its invitation's email",
        )
        .into());
    }
    let code = code_key(store_id, mode, &affiliate.referral_code);
    if overlay.contains(&code)?
        || overlay.contains(&affiliate_key(store_id, mode, &affiliate.id))?
    {
        return Err(Outcome::rejected("resource_changed", "the referral code is taken").into());
    }
    invite.status = InviteStatus::Accepted;
    invite.affiliate_id = Some(affiliate.id.clone());
    invite.updated_at_ms = affiliate
        .created_at_ms
        .max(invite.updated_at_ms.saturating_add(1));
    overlay.put(key, codec::encode_invite(&invite));
    overlay.put(code, affiliate.id.as_bytes().to_vec());
    overlay.put(
        ListingKey::entry(
            keys::AFFILIATE_LIST,
            store_id,
            mode,
            None,
            affiliate.created_at_ms,
            &affiliate.id,
        ),
        Vec::new(),
    );
    overlay.put(
        affiliate_key(store_id, mode, &affiliate.id),
        codec::encode_affiliate(affiliate),
    );
    Ok(())
}

/// A status or name change, over the version it was derived from; the counters
/// stay what apply kept.
pub fn apply_affiliate_upserted(
    overlay: &mut Overlay<'_>,
    changed: &Affiliate,
    base_updated_at_ms: Option<i64>,
) -> Result<(), ApplyError> {
    let key = affiliate_key(&changed.store_id, changed.mode, &changed.id);
    let Some(bytes) = overlay.get(&key)? else {
        return Err(refused(
            "resource_missing",
            format!("no such affiliate: '{}'", changed.id),
            "id",
        ));
    };
    let mut stored = codec::decode_affiliate(&bytes)?;
    check_base(
        Some(base_updated_at_ms.unwrap_or(i64::MIN)),
        Some(stored.updated_at_ms),
    )?;
    stored.status = changed.status;
    stored.name = changed.name.clone();
    stored.updated_at_ms = changed
        .updated_at_ms
        .max(stored.updated_at_ms.saturating_add(1));
    overlay.put(key, codec::encode_affiliate(&stored));
    Ok(())
}

fn affiliate_by_code(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    code: &str,
) -> Result<Option<Affiliate>, EngineError> {
    let get = |key: &[u8]| overlay.get(key);
    let Some(id) = crate::apply::code_row(get, keys::AFFILIATE_CODE, store_id, mode, code)? else {
        return Ok(None);
    };
    match overlay.get(&affiliate_key(store_id, mode, &id))? {
        Some(bytes) => codec::decode_affiliate(&bytes).map(Some),
        None => Err(EngineError::Corrupt(format!(
            "referral code of a missing affiliate {id}"
        ))),
    }
}

/// A click on a referral link: counted for an active affiliate.
pub fn apply_click(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    code: &str,
) -> Result<(), ApplyError> {
    let Some(mut affiliate) = affiliate_by_code(overlay, store_id, mode, code)? else {
        return Err(refused(
            "resource_missing",
            format!("no affiliate with referral code '{code}'"),
            "referral_code",
        ));
    };
    if affiliate.status == AffiliateStatus::Active {
        affiliate.clicks = affiliate.clicks.saturating_add(1);
        overlay.put(
            affiliate_key(store_id, mode, &affiliate.id),
            codec::encode_affiliate(&affiliate),
        );
    }
    Ok(())
}

/// A completed checkout naming `code`: a conversion and its commission for an
/// active affiliate, noted on the payment. Returns the payment as stored.
pub fn convert(
    overlay: &mut Overlay<'_>,
    code: Option<&str>,
    payment: &Payment,
) -> Result<Payment, EngineError> {
    let mut payment = payment.clone();
    let Some(code) = code else {
        return Ok(payment);
    };
    let (store_id, mode) = (payment.store_id.clone(), payment.mode);
    let Some(mut affiliate) = affiliate_by_code(overlay, &store_id, mode, code)? else {
        return Ok(payment);
    };
    if affiliate.status != AffiliateStatus::Active {
        return Ok(payment);
    }
    let settings = crate::lifecycle::read_settings_in(overlay, &store_id, mode)?;
    let earned = commission(payment.amount_paid, settings.affiliate_commission_percent);
    affiliate.conversions = affiliate.conversions.saturating_add(1);
    affiliate.earnings = affiliate.earnings.saturating_add(earned);
    affiliate
        .currency
        .get_or_insert_with(|| payment.currency.clone());
    overlay.put(
        affiliate_key(&store_id, mode, &affiliate.id),
        codec::encode_affiliate(&affiliate),
    );
    payment.affiliate_id = Some(affiliate.id.clone());
    payment.affiliate_commission = earned;
    Ok(payment)
}

/// A refund of `original` (refunded `before` so far, `after` now): the affiliate
/// gives back what the refunded share earned.
pub fn claw_back(
    overlay: &mut Overlay<'_>,
    original: &Payment,
    before: i64,
    after: i64,
) -> Result<(), EngineError> {
    let Some(affiliate_id) = &original.affiliate_id else {
        return Ok(());
    };
    let c = original.affiliate_commission;
    let back = commission_kept(c, original.amount_paid, before)
        - commission_kept(c, original.amount_paid, after);
    if back <= 0 {
        return Ok(());
    }
    let key = affiliate_key(&original.store_id, original.mode, affiliate_id);
    if let Some(bytes) = overlay.get(&key)? {
        let mut affiliate = codec::decode_affiliate(&bytes)?;
        affiliate.earnings = affiliate.earnings.saturating_sub(back);
        overlay.put(key, codec::encode_affiliate(&affiliate));
    }
    Ok(())
}

impl Billing {
    /// `POST /v1/affiliates/invites {email, name?}`.
    pub async fn create_invite(
        &self,
        scope: &Scope,
        email: Option<&str>,
        name: Option<&str>,
    ) -> Result<AffiliateInvite, EngineError> {
        let email = email
            .ok_or_else(|| FieldError::missing("email"))?
            .trim()
            .to_lowercase();
        if !is_valid_email(&email) {
            return Err(FieldError::invalid("email", "`email` is not a valid address").into());
        }
        let name = match name.map(str::trim) {
            Some(n) if n.chars().count() > tally_domain::limits::MAX_NAME_CHARS => {
                return Err(FieldError::invalid(
                    "name",
                    format!(
                        "at most {} characters",
                        tally_domain::limits::MAX_NAME_CHARS
                    ),
                )
                .into())
            }
            Some("") | None => None,
            Some(n) => Some(n.to_string()),
        };
        let now = self.now_in(scope);
        let invite = AffiliateInvite {
            id: new_id("inv").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            email,
            name,
            status: InviteStatus::Pending,
            affiliate_id: None,
            created_at_ms: now,
            updated_at_ms: now,
        };
        self.journal
            .append_and_apply(&Record::AffiliateInviteCreated(invite.clone()))
            .await?;
        Ok(invite)
    }

    pub fn get_invite(&self, scope: &Scope, id: &str) -> Result<AffiliateInvite, EngineError> {
        match self
            .journal
            .store()
            .get(&invite_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_invite(&bytes),
            None => Err(EngineError::not_found("affiliate invite", id)),
        }
    }

    /// `POST /v1/affiliates/invites/{id}/accept`: the affiliate, active, with a new
    /// referral code (drawn again if taken meanwhile).
    pub async fn accept_invite(&self, scope: &Scope, id: &str) -> Result<Affiliate, EngineError> {
        for _ in 0..tally_core::journal::MAX_UPDATE_ATTEMPTS {
            let invite = self.get_invite(scope, id)?;
            if invite.status != InviteStatus::Pending {
                return Err(EngineError::conflict(
                    "invalid_state_transition",
                    "an invite that is accepted cannot be accepted again",
                ));
            }
            let now = self.now_in(scope);
            let affiliate = Affiliate {
                id: new_id("aff").into(),
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                email: invite.email.clone(),
                name: invite.name.clone(),
                status: AffiliateStatus::Active,
                referral_code: random_base62(REFERRAL_CODE_CHARS),
                clicks: 0,
                conversions: 0,
                earnings: 0,
                currency: None,
                created_at_ms: now,
                updated_at_ms: now,
            };
            match self
                .journal
                .append_and_apply(&Record::AffiliateJoined {
                    invite_id: invite.id.clone(),
                    affiliate: affiliate.clone(),
                })
                .await
            {
                Ok(()) => return Ok(affiliate),
                Err(EngineError::Conflict {
                    code: "resource_changed",
                    ..
                }) => continue,
                Err(error) => return Err(error),
            }
        }
        Err(EngineError::conflict(
            "resource_changed",
            "the invite changed while it was being accepted; retry",
        ))
    }

    pub fn get_affiliate(&self, scope: &Scope, id: &str) -> Result<Affiliate, EngineError> {
        match self
            .journal
            .store()
            .get(&affiliate_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_affiliate(&bytes),
            None => Err(EngineError::not_found("affiliate", id)),
        }
    }

    /// The affiliate a referral code names, if any.
    pub fn affiliate_by_code(
        &self,
        scope: &Scope,
        code: &str,
    ) -> Result<Option<Affiliate>, EngineError> {
        let store = self.journal.store();
        let get = |key: &[u8]| Ok(store.get(key)?);
        match crate::apply::code_row(get, keys::AFFILIATE_CODE, &scope.store_id, scope.mode, code)?
        {
            Some(id) => self.get_affiliate(scope, &id).map(Some),
            None => Ok(None),
        }
    }

    /// `POST /v1/affiliates/{id} {status?, name?}`: suspend or reactivate, rename.
    pub async fn update_affiliate(
        &self,
        scope: &Scope,
        id: &str,
        status: Option<&str>,
        name: Option<&str>,
    ) -> Result<Affiliate, EngineError> {
        let status = status
            .map(|s| AffiliateStatus::parse_field("status", s))
            .transpose()?;
        self.journal
            .update(|| {
                let mut affiliate = self.get_affiliate(scope, id)?;
                let base = affiliate.updated_at_ms;
                if let Some(status) = status {
                    affiliate.status = status;
                }
                if let Some(name) = name {
                    affiliate.name = Some(name.trim().to_string()).filter(|n| !n.is_empty());
                }
                affiliate.updated_at_ms = self.journal.update_time(base);
                Ok(tally_core::journal::Update::Write {
                    record: Record::AffiliateUpserted(affiliate.clone()),
                    base_updated_at_ms: base,
                    result: (),
                })
            })
            .await?;
        self.get_affiliate(scope, id)
    }

    /// `POST /v1/affiliates/clicks {referral_code}`.
    pub async fn record_click(
        &self,
        scope: &Scope,
        code: Option<&str>,
    ) -> Result<Affiliate, EngineError> {
        let code = code.ok_or_else(|| FieldError::missing("referral_code"))?;
        let Some(affiliate) = self.affiliate_by_code(scope, code)? else {
            return Err(EngineError::not_found("affiliate", code).for_param("referral_code"));
        };
        self.journal
            .append_and_apply(&Record::AffiliateClicked {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                referral_code: code.to_string(),
            })
            .await?;
        self.get_affiliate(scope, &affiliate.id)
    }

    /// `GET /v1/affiliates?page=&page_size=`: newest first.
    pub fn list_affiliates(
        &self,
        scope: &Scope,
        page: usize,
        page_size: usize,
    ) -> Result<PageBased<Affiliate>, EngineError> {
        let prefix = ListingKey::prefix(keys::AFFILIATE_LIST, &scope.store_id, scope.mode, None);
        page_based(
            self.journal.store().as_ref(),
            &prefix,
            page,
            page_size,
            MAX_AFFILIATES_PER_SCOPE,
            |key| self.get_affiliate(scope, ListingKey::id_in(&prefix, key)?),
        )
    }

    /// `GET /v1/affiliates/invites?page=&page_size=`: newest first.
    pub fn list_invites(
        &self,
        scope: &Scope,
        page: usize,
        page_size: usize,
    ) -> Result<PageBased<AffiliateInvite>, EngineError> {
        let prefix = ListingKey::prefix(
            keys::AFFILIATE_INVITE_LIST,
            &scope.store_id,
            scope.mode,
            None,
        );
        page_based(
            self.journal.store().as_ref(),
            &prefix,
            page,
            page_size,
            MAX_AFFILIATES_PER_SCOPE,
            |key| self.get_invite(scope, ListingKey::id_in(&prefix, key)?),
        )
    }
}
