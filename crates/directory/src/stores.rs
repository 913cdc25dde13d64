//! Stores and API keys: creation (admin API, first start), and authentication of a
//! key against the listener's environment (docs/api.md, "Servers, environments, keys").

use sha2::{Digest, Sha256};
use tally_domain::record::{Record, StoreRecord};
use tally_domain::Mode;
use tally_projection::{scan_prefix, Visit};

use tally_core::error::EngineError;
use tally_core::ids::{new_id, random_base62, API_KEY_RANDOM_CHARS};
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

impl Directory {
    pub fn authenticate(&self, key: Option<&str>, listener: Mode) -> Result<Scope, AuthError> {
        let key = key
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::Missing)?;
        let scope = self
            .caches
            .api_keys
            .get(&key_digest(key))
            .map(|s| s.clone())
            .ok_or(AuthError::Unknown)?;
        if scope.mode != listener {
            return Err(AuthError::WrongEnvironment {
                key_mode: scope.mode,
            });
        }
        Ok(scope)
    }

    /// Creates a store with a fresh pair of keys. The keys are returned once; only
    /// their SHA-256 digests are kept.
    pub async fn create_store(&self, name: &str) -> Result<CreatedStore, EngineError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > MAX_STORE_NAME_CHARS {
            return Err(tally_domain::FieldError::invalid(
                "name",
                "`name` must be 1 to 255 characters",
            )
            .into());
        }
        let prod_key = format!("{PROD_KEY_PREFIX}{}", random_base62(API_KEY_RANDOM_CHARS));
        let test_key = format!("{TEST_KEY_PREFIX}{}", random_base62(API_KEY_RANDOM_CHARS));
        let record = StoreRecord {
            store_id: new_id("st").into(),
            name: name.to_string(),
            prod_key_sha256: key_digest(&prod_key),
            test_key_sha256: key_digest(&test_key),
            created_at_ms: self.journal.now_ms(),
        };
        self.journal
            .append_and_apply(&Record::StoreCreated(record.clone()))
            .await?;
        Ok(CreatedStore {
            store_id: record.store_id.to_string(),
            name: record.name,
            prod_key,
            test_key,
            created_at_ms: record.created_at_ms,
        })
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
