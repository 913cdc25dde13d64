//! The directory context: stores and their API keys, and customers.
//!
//! Same inner shape as every context: the records it owns (`StoreCreated`,
//! `CustomerUpserted`), its keys (tables `S`, `K`, `C`, `X`, `c` of the core key
//! space), its apply ([`apply`]), its services ([`stores`], [`customers`]) and
//! queries, and the caches the hot paths read (API keys, customer ids), kept
//! current by [`Directory::after_commit`]. Other contexts reach customers only
//! through ports they own (metering's `Customers`, the ledger's `AccountHolders`).

use std::sync::Arc;

use dashmap::DashMap;
use tally_core::keys;
use tally_core::overlay::{customer_cache_key, FastDashMap};
use tally_core::{EngineError, Journal, Scope};
use tally_domain::record::StoreRecord;
use tally_domain::usage::CustomerRef;
use tally_domain::Mode;
use tally_projection::{scan_prefix, Visit};

pub mod access;
pub mod apply;
pub mod customers;
pub mod moderation;
pub mod stores;

/// Customer ids and external ids cached for ingest before the cache is emptied
/// (bounds memory; a miss costs one projection read).
pub const MAX_CACHED_CUSTOMERS: usize = 1_000_000;

/// In-memory views the hot paths need, kept current after each commit.
#[derive(Debug, Default)]
pub struct DirectoryCaches {
    /// sha256(api key) -> scope.
    pub api_keys: DashMap<Vec<u8>, Scope>,
    /// sha256(api key) -> permissions, for restricted keys (absent: every one).
    pub key_permissions: DashMap<Vec<u8>, Vec<String>>,
    /// Customer ids known to exist (`scope key + id`). Customers are never deleted,
    /// so an entry never goes stale.
    pub known_customers: FastDashMap<String, ()>,
    /// `scope key + external id` -> customer id. Filled by `resolve_customer` only
    /// when no customer changed while it looked the id up (see `customer_generation`).
    pub external_ids: FastDashMap<String, String>,
    /// Bumped (under its write lock) after a commit removed the mappings a customer
    /// update made stale; `resolve_customer` checks and inserts under the read lock,
    /// so a lookup that raced an update is never cached.
    pub customer_generation: std::sync::RwLock<u64>,
}

impl DirectoryCaches {
    /// Empties the customer caches when they hold `MAX_CACHED_CUSTOMERS`: checked
    /// before an insert, not on every look-up, because a `DashMap`'s length takes
    /// every shard's lock in turn (two maps' worth per ingested event).
    fn make_room_for_a_customer(&self) {
        self.make_room_below(MAX_CACHED_CUSTOMERS);
    }

    fn make_room_below(&self, cap: usize) {
        if self.known_customers.len() + self.external_ids.len() >= cap {
            self.known_customers.clear();
            self.external_ids.clear();
        }
    }
}

/// What a committed chunk changed in the directory.
#[derive(Debug, Default)]
pub struct DirectoryApplied {
    pub stores: Vec<StoreRecord>,
    /// Restricted keys created: digest, scope, permissions.
    pub keys_added: Vec<(Vec<u8>, Scope, Option<Vec<String>>)>,
    /// Digests of keys revoked.
    pub keys_revoked: Vec<Vec<u8>>,
    /// A customer was created or updated.
    pub customers_changed: bool,
    /// Cache keys (`customer_cache_key`) of external ids a customer update released.
    pub stale_external_ids: Vec<String>,
}

impl DirectoryApplied {
    pub fn absorb(&mut self, other: DirectoryApplied) {
        self.stores.extend(other.stores);
        self.keys_added.extend(other.keys_added);
        self.keys_revoked.extend(other.keys_revoked);
        self.customers_changed |= other.customers_changed;
        self.stale_external_ids.extend(other.stale_external_ids);
    }
}

#[derive(Debug)]
pub struct Directory {
    journal: Arc<Journal>,
    caches: DirectoryCaches,
}

impl Directory {
    /// The directory over the journal's projection, its API keys loaded.
    pub fn load(journal: Arc<Journal>) -> Result<Directory, EngineError> {
        let directory = Directory {
            journal,
            caches: DirectoryCaches::default(),
        };
        let mut corrupt = None;
        let store = directory.journal.store().clone();
        scan_prefix(store.as_ref(), &[keys::API_KEY], false, &mut |k, v| {
            let read = v
                .split_last()
                .ok_or_else(|| EngineError::Corrupt("an API key entry is empty".into()))
                .and_then(|(mode_byte, store_id)| {
                    Ok((keys::read_mode(*mode_byte, "an API key entry")?, store_id))
                });
            match read {
                Ok((mode, store_id)) => {
                    let scope = Scope {
                        store_id: String::from_utf8_lossy(store_id).into_owned().into(),
                        mode,
                    };
                    directory.caches.api_keys.insert(k[1..].to_vec(), scope);
                    Visit::Continue
                }
                Err(error) => {
                    corrupt = Some(error);
                    Visit::Stop
                }
            }
        })?;
        if let Some(error) = corrupt {
            return Err(error);
        }
        scan_prefix(
            store.as_ref(),
            &[keys::API_KEY_PERMISSIONS],
            false,
            &mut |k, v| {
                let permissions = String::from_utf8_lossy(v)
                    .lines()
                    .map(str::to_string)
                    .collect();
                directory
                    .caches
                    .key_permissions
                    .insert(k[1..].to_vec(), permissions);
                Visit::Continue
            },
        )?;
        Ok(directory)
    }

    pub fn caches(&self) -> &DirectoryCaches {
        &self.caches
    }

    /// Updates the caches from a committed chunk. Runs before waiters are woken, so
    /// a write that returns is visible to every later request.
    pub fn after_commit(&self, applied: DirectoryApplied) {
        for store in applied.stores {
            for (hash, mode) in [
                (store.prod_key_sha256, Mode::Prod),
                (store.test_key_sha256, Mode::Test),
            ] {
                self.caches.api_keys.insert(
                    hash,
                    Scope {
                        store_id: store.store_id.clone(),
                        mode,
                    },
                );
            }
        }
        for (digest, scope, permissions) in applied.keys_added {
            if let Some(permissions) = permissions {
                self.caches
                    .key_permissions
                    .insert(digest.clone(), permissions);
            }
            self.caches.api_keys.insert(digest, scope);
        }
        for digest in &applied.keys_revoked {
            self.caches.api_keys.remove(digest);
            self.caches.key_permissions.remove(digest);
        }
        if applied.customers_changed {
            let mut generation = self
                .caches
                .customer_generation
                .write()
                .unwrap_or_else(|p| p.into_inner());
            for key in &applied.stale_external_ids {
                self.caches.external_ids.remove(key);
            }
            *generation += 1;
        }
    }

    /// Resolves a customer reference (an id or an external id) to a customer id
    /// through the caches, falling back to the projection.
    pub fn resolve_customer(
        &self,
        scope: &Scope,
        customer: &CustomerRef,
    ) -> Result<Option<String>, EngineError> {
        let caches = &self.caches;
        match customer {
            CustomerRef::Id(id) => {
                let key = customer_cache_key(&scope.store_id, scope.mode, id);
                if caches.known_customers.contains_key(&key) {
                    return Ok(Some(id.clone()));
                }
                let exists = self.customer_exists(scope, id)?;
                if exists {
                    caches.make_room_for_a_customer();
                    caches.known_customers.insert(key, ());
                }
                Ok(exists.then(|| id.clone()))
            }
            CustomerRef::External(external) => {
                let key = customer_cache_key(&scope.store_id, scope.mode, external);
                if let Some(id) = caches.external_ids.get(&key) {
                    return Ok(Some(id.clone()));
                }
                let before = *caches
                    .customer_generation
                    .read()
                    .unwrap_or_else(|p| p.into_inner());
                let found = self.customer_id_by_external(scope, external)?;
                if let Some(id) = &found {
                    let generation = caches
                        .customer_generation
                        .read()
                        .unwrap_or_else(|p| p.into_inner());
                    if *generation == before {
                        caches.make_room_for_a_customer();
                        caches.external_ids.insert(key, id.clone());
                    }
                }
                Ok(found)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_customer_caches_empty_before_an_insert_would_pass_their_cap() {
        let caches = DirectoryCaches::default();
        caches.known_customers.insert("a".into(), ());
        caches.external_ids.insert("x".into(), "a".into());
        caches.make_room_below(3);
        assert_eq!(
            (caches.known_customers.len(), caches.external_ids.len()),
            (1, 1),
            "below the cap nothing is dropped"
        );
        caches.known_customers.insert("b".into(), ());
        caches.make_room_below(3);
        assert!(caches.known_customers.is_empty() && caches.external_ids.is_empty());
    }
}
