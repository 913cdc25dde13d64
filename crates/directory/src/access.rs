//! Restricted API keys and revocation (docs/api.md, "Keys and permissions"): a key
//! created with permissions, and any key (a store's first two included) revoked.
//! Both are log records, so every node refuses a revoked key once it applied the
//! revocation; keys are kept as SHA-256 digests only.

use tally_core::error::EngineError;
use tally_core::ids::{random_base62, API_KEY_RANDOM_CHARS};
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::Scope;
use tally_domain::record::Record;
use tally_domain::Mode;

use crate::stores::{key_digest, PROD_KEY_PREFIX, TEST_KEY_PREFIX};
use crate::{Directory, DirectoryApplied};

/// The id of a key: a store's first keys get one derived from their digest.
pub fn key_id_of(digest: &[u8]) -> String {
    format!("key_{}", hex::encode(&digest[..digest.len().min(12)]))
}

fn index_key(store_id: &str, key_id: &str) -> Vec<u8> {
    Key::table(keys::API_KEY_ID)
        .text(store_id)
        .text(key_id)
        .into_bytes()
}

fn permissions_key(digest: &[u8]) -> Vec<u8> {
    Key::table(keys::API_KEY_PERMISSIONS)
        .tail(digest)
        .into_bytes()
}

fn auth_key(digest: &[u8]) -> Vec<u8> {
    Key::table(keys::API_KEY).tail(digest).into_bytes()
}

/// The admin handle on a key: digest, mode byte, revoked byte.
pub fn put_index(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    key_id: &str,
    digest: &[u8],
    mode: Mode,
) {
    let mut value = digest.to_vec();
    value.push(mode.key_byte());
    value.push(0);
    overlay.put(index_key(store_id, key_id), value);
}

/// A restricted key: of an existing store, under a fresh id and digest.
#[allow(clippy::too_many_arguments)]
pub fn apply_key_created(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    key_id: &str,
    mode: Mode,
    digest: &[u8],
    permissions: &[String],
    applied: &mut DirectoryApplied,
) -> Result<(), ApplyError> {
    if !overlay.contains(&Key::table(keys::STORE).text(store_id).into_bytes())? {
        return Err(
            Outcome::rejected("resource_missing", format!("no such store: '{store_id}'")).into(),
        );
    }
    let valid = tally_domain::access::parse_permissions(permissions).is_ok() && digest.len() == 32;
    if !valid
        || overlay.contains(&index_key(store_id, key_id))?
        || overlay.contains(&auth_key(digest))?
    {
        return Err(
            Outcome::rejected("resource_changed", "the key or its id exists already").into(),
        );
    }
    let mut scope = store_id.as_bytes().to_vec();
    scope.push(mode.key_byte());
    overlay.put(auth_key(digest), scope);
    overlay.put(permissions_key(digest), permissions.join("\n").into_bytes());
    put_index(overlay, store_id, key_id, digest, mode);
    applied.keys_added.push((
        digest.to_vec(),
        Scope {
            store_id: store_id.into(),
            mode,
        },
        Some(permissions.to_vec()),
    ));
    Ok(())
}

/// A key revoked: it authenticates nothing from this record on.
pub fn apply_key_revoked(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    key_id: &str,
    applied: &mut DirectoryApplied,
) -> Result<(), ApplyError> {
    let index = index_key(store_id, key_id);
    let Some(mut value) = overlay.get(&index)? else {
        return Err(
            Outcome::rejected("resource_missing", format!("no such key: '{key_id}'"))
                .with_param("key_id")
                .into(),
        );
    };
    if value.len() != 34 {
        return Err(EngineError::Corrupt("an API key index entry".into()).into());
    }
    if value[33] == 1 {
        return Err(Outcome::rejected("api_key_revoked", "the key is revoked already").into());
    }
    let digest = value[..32].to_vec();
    overlay.delete(auth_key(&digest));
    overlay.delete(permissions_key(&digest));
    value[33] = 1;
    overlay.put(index, value);
    applied.keys_revoked.push(digest);
    Ok(())
}

/// A key as created: its secret is shown once.
#[derive(Debug, Clone)]
pub struct CreatedKey {
    pub id: String,
    pub key: String,
    pub mode: Mode,
    pub permissions: Vec<String>,
}

impl Directory {
    /// `POST /admin/v1/stores/{id}/keys {mode, permissions}`.
    pub async fn create_key(
        &self,
        store_id: &str,
        mode: Mode,
        permissions: &[String],
    ) -> Result<CreatedKey, EngineError> {
        let permissions = tally_domain::access::parse_permissions(permissions)?;
        let store_key = Key::table(keys::STORE).text(store_id).into_bytes();
        if self.journal.store().get(&store_key)?.is_none() {
            return Err(EngineError::not_found("store", store_id));
        }
        let prefix = match mode {
            Mode::Prod => PROD_KEY_PREFIX,
            Mode::Test => TEST_KEY_PREFIX,
        };
        let key = format!("{prefix}{}", random_base62(API_KEY_RANDOM_CHARS));
        let digest = key_digest(&key);
        let id = key_id_of(&digest);
        self.journal
            .append_and_apply(&Record::ApiKeyCreated {
                store_id: store_id.into(),
                key_id: id.clone(),
                mode,
                key_sha256: digest,
                permissions: permissions.clone(),
                created_at_ms: self.journal.now_ms(),
            })
            .await?;
        Ok(CreatedKey {
            id,
            key,
            mode,
            permissions,
        })
    }

    /// `DELETE /admin/v1/stores/{id}/keys/{key_id}`.
    pub async fn revoke_key(&self, store_id: &str, key_id: &str) -> Result<(), EngineError> {
        self.journal
            .append_and_apply(&Record::ApiKeyRevoked {
                store_id: store_id.into(),
                key_id: key_id.to_string(),
            })
            .await
    }

    /// The permissions of the key with this digest; `None`: every permission.
    pub fn permissions_of(&self, digest: &[u8]) -> Option<Vec<String>> {
        self.caches
            .key_permissions
            .get(digest)
            .map(|p| p.value().clone())
    }
}
