//! The grants service (docs/api.md, "Credit grants"): create through a credit with
//! terms, read as of now, list per account, void. Apply decides each in log order
//! (`crate::grants`).

use rust_decimal::Decimal;
use tally_domain::grant::{Grant, GrantStatus};
use tally_domain::ledger::{Entry, SystemAccount, TransactionKind};

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, ListingKey};

use crate::grants::{grant_id_of, grant_key, grant_not_active};

/// Input of `POST /v1/customer-credits/accounts/{id}/grants`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct GrantInput {
    pub movement: crate::MovementInput,
    /// 0 (drawn first) to `MAX_GRANT_PRIORITY`; default `DEFAULT_GRANT_PRIORITY`.
    pub priority: Option<i64>,
    /// The expiry instant (epoch ms), in the future.
    pub expires_at_ms: Option<i64>,
}

/// Attempts of a void whose grant changed under it (a debit drew from it) before it
/// gives up with `resource_changed`: each attempt re-reads what is left.
const VOID_ATTEMPTS: usize = 5;

impl crate::Ledger {
    /// A grant as it is now: one past its expiry reads `expired` with nothing left,
    /// whether or not a record has booked the expiry yet.
    pub fn get_grant(&self, scope: &tally_core::Scope, id: &str) -> Result<Grant, EngineError> {
        let key = grant_key(&scope.store_id, scope.mode, id);
        let mut grant = match self.journal.store().get(&key)? {
            Some(bytes) => codec::decode_grant(&bytes)?,
            None => return Err(EngineError::not_found("credit grant", id)),
        };
        let now = self.journal.now_ms();
        if grant.status == GrantStatus::Active
            && grant.terms.expires_at_ms.is_some_and(|e| e <= now)
        {
            grant.status = GrantStatus::Expired;
            grant.remaining = Decimal::ZERO;
        }
        Ok(grant)
    }

    /// Credits the account through a grant with these terms; answers the grant. The
    /// same idempotency key answers the grant it made first.
    pub async fn create_grant(
        &self,
        scope: &tally_core::Scope,
        account_id: &str,
        input: &GrantInput,
    ) -> Result<Grant, EngineError> {
        use tally_domain::grant::{GrantTerms, DEFAULT_GRANT_PRIORITY, MAX_GRANT_PRIORITY};
        use tally_domain::FieldError;
        let priority = match input.priority {
            None => DEFAULT_GRANT_PRIORITY,
            Some(p) if (0..=i64::from(MAX_GRANT_PRIORITY)).contains(&p) => p as u32,
            Some(_) => {
                return Err(FieldError::invalid(
                    "priority",
                    format!("`priority` must be an integer from 0 to {MAX_GRANT_PRIORITY}"),
                )
                .into())
            }
        };
        if input
            .expires_at_ms
            .is_some_and(|e| e <= self.journal.now_ms())
        {
            return Err(
                FieldError::invalid("expires_at", "`expires_at` must be in the future").into(),
            );
        }
        let terms = GrantTerms {
            priority,
            expires_at_ms: input.expires_at_ms,
        };
        let view = self
            .move_credits_with_terms(
                scope,
                account_id,
                TransactionKind::Credit,
                &input.movement,
                Some(terms),
            )
            .await?;
        self.get_grant(scope, &grant_id_of(&view.transaction.id))
    }

    /// The account's grants, newest first; `status` keeps only those in it (as they
    /// are now).
    pub fn list_grants(
        &self,
        scope: &tally_core::Scope,
        account_id: &str,
        status: Option<GrantStatus>,
        page: &tally_core::pagination::PageRequest,
    ) -> Result<tally_core::pagination::Page<Grant>, EngineError> {
        use tally_core::pagination::{cursor_from, paginate};
        self.get_account(scope, account_id)?;
        let prefix = ListingKey::prefix(
            keys::CREDIT_GRANT_LIST,
            &scope.store_id,
            scope.mode,
            Some(account_id),
        );
        let cursor = cursor_from(page, |id| {
            let grant = self.get_grant(scope, id)?;
            if grant.account_id != account_id {
                return Err(EngineError::not_found("credit grant", id));
            }
            Ok(ListingKey::entry(
                keys::CREDIT_GRANT_LIST,
                &scope.store_id,
                scope.mode,
                Some(account_id),
                grant.created_at_ms,
                &grant.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let grant = self.get_grant(scope, id)?;
                Ok(status.is_none_or(|s| s == grant.status).then_some(grant))
            },
        )
    }

    /// Voids an active grant now: what it has left moves to `forfeit`.
    pub async fn void_grant(
        &self,
        scope: &tally_core::Scope,
        id: &str,
    ) -> Result<Grant, EngineError> {
        for _ in 0..VOID_ATTEMPTS {
            let grant = self.get_grant(scope, id)?;
            if grant.status != GrantStatus::Active {
                return Err(grant_not_active().into());
            }
            let account = self.get_account(scope, &grant.account_id)?;
            tally_domain::ledger::check_open(account.status)
                .map_err(|r| EngineError::conflict(r.code(), r.message()))?;
            if grant.remaining.is_zero() {
                // Drawn to nothing but still active (a reversal may give back to a
                // new grant, never to this one): there is nothing to forfeit.
                return Err(grant_not_active().into());
            }
            let mut tx = self.new_transaction(
                scope,
                TransactionKind::GrantVoid,
                &grant.account_id,
                grant.remaining,
                vec![
                    Entry {
                        id: String::new(),
                        account_id: grant.account_id.clone(),
                        amount: -grant.remaining,
                        grant_id: Some(grant.id.clone()),
                    },
                    Entry {
                        id: String::new(),
                        account_id: SystemAccount::Forfeit.account_id().into(),
                        amount: grant.remaining,
                        grant_id: None,
                    },
                ],
            );
            tx.description = Some(format!("void of grant {id}"));
            match self.commit_movement(scope, tx).await {
                Ok(_) => return self.get_grant(scope, id),
                Err(EngineError::Conflict {
                    code: "resource_changed",
                    ..
                }) => continue,
                Err(error) => return Err(error),
            }
        }
        Err(EngineError::conflict(
            "resource_changed",
            "the grant kept changing while it was being voided; retry",
        ))
    }
}
