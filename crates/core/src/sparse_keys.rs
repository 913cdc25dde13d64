//! Which keys of the sparse tables that apply asks about per event exist, held in
//! memory as hashes, so the usual answer ("no such row") costs no store read.
//!
//! The tables: voided events (`.`), fold-skipped rows (`_`: an event a meter did
//! not count because it was inactive) and voided counts (`'`: events voided per
//! meter, customer and minute). A void's rebuild asks the first two for every
//! event of the minute it reads back, and a void reads the count of each bucket it
//! takes an event out of; nearly always the answer is no. In a profile of the
//! void phase the first two were a quarter of the apply thread, most of it in
//! sled's tree walk (README, "Sparse rows answered from memory"); in a store too
//! large for the page cache each absent count was a read of the disk. Backfilled rows
//! (`B`) are not held: adding them measured no faster on voids, and a large
//! backfill writes one per event and meter, which the start-up scan would read.
//!
//! A hash absent here means the key is absent from the projection: the set is
//! loaded from the store at start-up and takes every committed put of these tables
//! (`SparseKeys::puts_in`, then `note_committed` once the batch is in the store). A hash present is only "maybe": the caller reads the
//! store. Deletes are not taken out (a stale hash costs a read, never a wrong
//! answer). Past `MAX_SPARSE_KEYS` the set gives up and every question goes to the
//! store, as before it existed.

use std::collections::HashSet;
use std::hash::BuildHasher;

use tally_projection::{scan_prefix, ProjectionStore, Visit};

use crate::error::EngineError;
use crate::keys;

/// The tables whose keys are held.
pub const SPARSE_TABLES: [u8; 3] = [keys::VOIDED_EVENT, keys::FOLD_SKIPPED, keys::VOIDED_COUNT];

/// Hashes held before the set gives up (bounds memory at ~20 bytes each, ~20 MB,
/// and the start-up scan that loads them to ~1 s).
/// Voids (a row per event, and per meter, customer and minute) and inactive-meter
/// skips are corrections and edge cases, far fewer than events; a store past it
/// still works, at a store read per question.
pub const MAX_SPARSE_KEYS: usize = 1_000_000;

#[derive(Debug, Default)]
pub struct SparseKeys {
    hasher: foldhash::fast::RandomState,
    present: HashSet<u64, foldhash::fast::RandomState>,
    /// Past `MAX_SPARSE_KEYS`: every key may be present.
    saturated: bool,
}

fn is_sparse(key: &[u8]) -> bool {
    key.first()
        .is_some_and(|table| SPARSE_TABLES.contains(table))
}

impl SparseKeys {
    /// The keys a projection holds (a scan of each sparse table).
    pub fn load(store: &dyn ProjectionStore) -> Result<SparseKeys, EngineError> {
        let mut sparse = SparseKeys::default();
        for table in SPARSE_TABLES {
            scan_prefix(store, &[table], false, &mut |key, _| {
                sparse.note(key);
                if sparse.saturated {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            })?;
        }
        Ok(sparse)
    }

    /// `false` only when the projection certainly holds no `key`: its table is
    /// sparse and no committed put had its hash.
    pub fn may_hold(&self, key: &[u8]) -> bool {
        self.saturated || !is_sparse(key) || self.present.contains(&self.hasher.hash_one(key))
    }

    /// A stored `key` (keys of other tables are ignored).
    fn note(&mut self, key: &[u8]) {
        if is_sparse(key) {
            self.note_hash(self.hasher.hash_one(key));
        }
    }

    /// The hashes of the sparse puts in a batch, for `note_committed` once the batch
    /// is committed (the batch itself goes to the store).
    pub fn puts_in<K: AsRef<[u8]>, V>(&self, changes: &[(K, Option<V>)]) -> Vec<u64> {
        changes
            .iter()
            .filter(|(key, value)| value.is_some() && is_sparse(key.as_ref()))
            .map(|(key, _)| self.hasher.hash_one(key.as_ref()))
            .collect()
    }

    pub fn note_committed(&mut self, hashes: Vec<u64>) {
        for hash in hashes {
            self.note_hash(hash);
        }
    }

    fn note_hash(&mut self, hash: u64) {
        if self.saturated {
            return;
        }
        if self.present.len() >= MAX_SPARSE_KEYS {
            self.saturated = true;
            self.present = HashSet::default();
            return;
        }
        self.present.insert(hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_domain::Mode;

    #[test]
    fn absent_means_absent_and_other_tables_always_may_hold() {
        let store = tally_projection::MemoryStore::new();
        let voided = keys::voided_event_key("st", Mode::Test, "e1");
        let skipped = keys::fold_skipped_key("st", Mode::Test, "m", "e2");
        store
            .apply(vec![(voided.clone(), Some(Vec::new()))], &[(0, 1)])
            .unwrap();
        let mut sparse = SparseKeys::load(&store).unwrap();
        assert!(sparse.may_hold(&voided), "loaded from the store");
        assert!(!sparse.may_hold(&skipped));
        assert!(!sparse.may_hold(&keys::voided_event_key("st", Mode::Test, "e2")));
        assert!(
            sparse.may_hold(b"Aanything"),
            "not a sparse table: ask the store"
        );
        let batch = vec![
            (skipped.clone(), Some(Vec::<u8>::new())),
            (keys::voided_event_key("st", Mode::Test, "gone"), None),
            (b"Aother".to_vec(), Some(Vec::new())),
        ];
        let puts = sparse.puts_in(&batch);
        assert_eq!(puts.len(), 1, "only the sparse put");
        sparse.note_committed(puts);
        assert!(sparse.may_hold(&skipped), "a committed put");
        sparse.saturated = true;
        assert!(sparse.may_hold(&keys::voided_event_key("st", Mode::Test, "e3")));
    }
}
