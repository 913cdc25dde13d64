//! A store's moderation policy (docs/api.md, "Moderation"): stored per store and
//! environment, replaced whole; screening itself is pure (`domain::moderation`).

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key};
use tally_core::overlay::Overlay;
use tally_core::Scope;
use tally_domain::moderation::{validate_policy, Policy};
use tally_domain::record::Record;
use tally_domain::Mode;

use crate::Directory;

fn policy_key(store_id: &str, mode: Mode) -> Vec<u8> {
    Key::scoped(keys::MODERATION_POLICY, store_id, mode).into_bytes()
}

/// The policy, replaced whole (validated by the service before appending).
pub fn apply_policy(overlay: &mut Overlay<'_>, store_id: &str, mode: Mode, policy: &Policy) {
    overlay.put(
        policy_key(store_id, mode),
        codec::encode_policy(store_id, mode, policy),
    );
}

impl Directory {
    /// `GET /v1/moderation/policy` (an empty policy allows everything).
    pub fn moderation_policy(&self, scope: &Scope) -> Result<Policy, EngineError> {
        match self
            .journal
            .store()
            .get(&policy_key(&scope.store_id, scope.mode))?
        {
            Some(bytes) => codec::decode_policy(&bytes),
            None => Ok(Policy::default()),
        }
    }

    /// `POST /v1/moderation/policy`: replaces the policy.
    pub async fn set_moderation_policy(
        &self,
        scope: &Scope,
        policy: Policy,
    ) -> Result<Policy, EngineError> {
        let policy = validate_policy(policy)?;
        self.journal
            .append_and_apply(&Record::ModerationPolicySet {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                policy: policy.clone(),
            })
            .await?;
        Ok(policy)
    }
}
