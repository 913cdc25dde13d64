//! Stores and API keys: creation (admin API, first start), and authentication of a
//! key against the listener's environment (docs/api.md, "Servers, environments, keys").

use sha2::{Digest, Sha256};
use tally_domain::record::{Record, StoreRecord};
use tally_domain::Mode;
use tally_projection::{scan_prefix, Visit};

use tally_core::error::EngineError;
use tally_core::ids::{
    derived_base62, new_id, random_base62, API_KEY_RANDOM_CHARS, ID_RANDOM_CHARS,
};
use tally_core::{keys, Scope};

use crate::Directory;

/// Key prefixes tell the environment at a glance (and in secret scanners).
pub const PROD_KEY_PREFIX: &str = "tally_prod_";
pub const TEST_KEY_PREFIX: &str = "tally_test_";
pub const DEFAULT_STORE_NAME: &str = "default";
pub const MAX_STORE_NAME_CHARS: usize = 255;

#[derive(Debug, Clone)]
pub struct CreatedStore {
    pub store_id: String,
    pub name: String,
    pub prod_key: String,
    pub test_key: String,
    pub created_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    Missing,
    Unknown,
    /// A valid key of the other environment.
    WrongEnvironment {
        key_mode: Mode,
    },
}

pub fn key_digest(key: &str) -> Vec<u8> {
    Sha256::digest(key.as_bytes()).to_vec()
}

/// A key that authenticated: its scope, and its digest, the key's handle for what
/// else is per key (its permissions, rate limit and idempotent responses). The
/// digest is of the key as looked up (trimmed), so everything per key names the
/// key that authenticated, however the header spaced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated {
    pub scope: Scope,
    pub digest: Vec<u8>,
}

impl Directory {
    pub fn authenticate(
        &self,
        key: Option<&str>,
        listener: Mode,
    ) -> Result<Authenticated, AuthError> {
        let key = key
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::Missing)?;
        let digest = key_digest(key);
        let scope = self
            .caches
            .api_keys
            .get(&digest)
            .map(|s| s.clone())
            .ok_or(AuthError::Unknown)?;
        if scope.mode != listener {
            return Err(AuthError::WrongEnvironment {
                key_mode: scope.mode,
            });
        }
        Ok(Authenticated { scope, digest })
    }

    /// Creates a store with a fresh pair of keys. The keys are returned once; only
    /// their SHA-256 digests are kept.
    pub async fn create_store(&self, name: &str) -> Result<CreatedStore, EngineError> {
        Ok(self.create_store_from(name, None).await?.0)
    }

    /// Creates a store. With a `seed` (secret bytes the admin API derives from its
    /// token and an idempotency key), the id and both keys derive from it, so a
    /// retry rebuilds the same answer without any key kept in the clear: it answers
    /// the store created first (`true`: a replay), or 409 `idempotency_key_reused`
    /// when that store has another name.
    pub async fn create_store_from(
        &self,
        name: &str,
        seed: Option<&[u8]>,
    ) -> Result<(CreatedStore, bool), EngineError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > MAX_STORE_NAME_CHARS {
            return Err(tally_domain::FieldError::invalid(
                "name",
                format!("`name` must be 1 to {MAX_STORE_NAME_CHARS} characters"),
            )
            .into());
        }
        let derive = |label: &str, chars: usize| {
            seed.map(|seed| {
                let mut labelled = seed.to_vec();
                labelled.extend_from_slice(label.as_bytes());
                derived_base62(&labelled, chars)
            })
        };
        let prod_key = format!(
            "{PROD_KEY_PREFIX}{}",
            derive("prod", API_KEY_RANDOM_CHARS)
                .unwrap_or_else(|| random_base62(API_KEY_RANDOM_CHARS))
        );
        let test_key = format!(
            "{TEST_KEY_PREFIX}{}",
            derive("test", API_KEY_RANDOM_CHARS)
                .unwrap_or_else(|| random_base62(API_KEY_RANDOM_CHARS))
        );
        let store_id = derive("store", ID_RANDOM_CHARS)
            .map(|chars| format!("st_{chars}"))
            .unwrap_or_else(|| new_id("st"));
        let created = |record: StoreRecord| CreatedStore {
            store_id: record.store_id.to_string(),
            name: record.name,
            prod_key: prod_key.clone(),
            test_key: test_key.clone(),
            created_at_ms: record.created_at_ms,
        };
        let first = |this: &Self| -> Result<Option<StoreRecord>, EngineError> {
            this.journal
                .store()
                .get(&keys::Key::table(keys::STORE).text(&store_id).into_bytes())?
                .map(|bytes| tally_core::codec::decode_store(&bytes))
                .transpose()
        };
        let replay = |existing: StoreRecord| {
            if existing.name == name {
                Ok((created(existing), true))
            } else {
                Err(EngineError::conflict(
                    "idempotency_key_reused",
                    "this idempotency key created a store of another name; use a new key",
                ))
            }
        };
        if seed.is_some() {
            if let Some(existing) = first(self)? {
                return replay(existing);
            }
        }
        let record = StoreRecord {
            store_id: store_id.clone().into(),
            name: name.to_string(),
            prod_key_sha256: key_digest(&prod_key),
            test_key_sha256: key_digest(&test_key),
            created_at_ms: self.journal.now_ms(),
        };
        self.journal
            .append_and_apply(&Record::StoreCreated(record.clone()))
            .await?;
        if seed.is_some() {
            // A concurrent retry may have been applied first: answer what won.
            if let Some(existing) = first(self)? {
                if existing != record {
                    return replay(existing);
                }
            }
        }
        Ok((created(record), false))
    }

    pub fn store_count(&self) -> Result<usize, EngineError> {
        let mut count = 0;
        scan_prefix(
            self.journal.store().as_ref(),
            &[keys::STORE],
            false,
            &mut |_, _| {
                count += 1;
                Visit::Continue
            },
        )?;
        Ok(count)
    }

    /// On first start with an empty data dir: creates the `default` store and returns
    /// its keys (to be printed once). `None` when any store exists.
    pub async fn bootstrap_default_store(&self) -> Result<Option<CreatedStore>, EngineError> {
        if self.store_count()? > 0 {
            return Ok(None);
        }
        self.create_store(DEFAULT_STORE_NAME).await.map(Some)
    }
}
