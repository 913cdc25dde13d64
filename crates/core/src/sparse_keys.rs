//! Which keys of the sparse tables that apply asks about per event exist, held in
//! memory as hashes, so the usual answer ("no such row") costs no store read.
//!
//! The tables: voided events (`.`), fold-skipped rows (`_`: an event a meter did
//! not count because it was inactive) and voided counts (`'`: events voided per
//! meter, customer and minute). A void's rebuild asks the first two for every
//! event of the minute it reads back, and a void reads the count of each bucket it
//! takes an event out of; nearly always the answer is no. In a profile of the
//! void phase the first two were a quarter of the apply thread, most of it in
//! sled's tree walk (docs/benchmarks.md, "Sparse rows answered from memory"); in a store too
//! large for the page cache each absent count was a read of the disk. Backfilled rows
//! (`B`) are not held: adding them measured no faster on voids, and a large
//! backfill writes one per event and meter, which the start-up scan would read.
//!
//! A hash absent here means the key is absent from the projection: the set is
//! loaded from the store at start-up and takes every committed put of these tables
//! (`SparseKeys::puts_in`, then `note_committed` once the batch is in the store). A hash present is only "maybe": the caller reads the
//! store. Deletes are not taken out (a stale hash costs a read, never a wrong
//! answer). Each table has its own set: past `MAX_SPARSE_KEYS` rows a table's set
//! gives up and every question about that table goes to the store, as before it
//! existed, while the other tables keep their answers (a store with a million
//! voided counts still answers "not voided" and "not skipped" from memory).

use std::collections::HashSet;
use std::hash::BuildHasher;

use tally_projection::{scan_prefix, ProjectionStore, Visit};

use crate::error::EngineError;
use crate::keys;

/// The tables whose keys are held.
pub const SPARSE_TABLES: [u8; 3] = [keys::VOIDED_EVENT, keys::FOLD_SKIPPED, keys::VOIDED_COUNT];

/// Hashes held per table before its set gives up (bounds memory at ~20 bytes each,
/// ~20 MB a table, and the start-up scan that loads them to ~1 s a table).
/// Voids (a row per event, and per meter, customer and minute) and inactive-meter
/// skips are corrections and edge cases, far fewer than events; a store past it
/// still works, at a store read per question about that table.
pub const MAX_SPARSE_KEYS: usize = 1_000_000;

#[derive(Debug, Default)]
pub struct SparseKeys {
    hasher: foldhash::fast::RandomState,
    /// One per `SPARSE_TABLES` entry, in that order.
    tables: [TableKeys; SPARSE_TABLES.len()],
}

/// The hashes of one sparse table's rows.
#[derive(Debug, Default)]
struct TableKeys {
    present: HashSet<u64, foldhash::fast::RandomState>,
    /// Past `MAX_SPARSE_KEYS`: every key of the table may be present.
    saturated: bool,
}

/// A committed put of a sparse table: the table's place in `SPARSE_TABLES` and the
/// key's hash.
pub type SparsePut = (usize, u64);

/// The place of `key`'s table in `SPARSE_TABLES`, if it is one.
fn table_of(key: &[u8]) -> Option<usize> {
    key.first()
        .and_then(|table| SPARSE_TABLES.iter().position(|sparse| sparse == table))
}

impl SparseKeys {
    /// The keys a projection holds (a scan of each sparse table, stopped where its
    /// set gives up).
    pub fn load(store: &dyn ProjectionStore) -> Result<SparseKeys, EngineError> {
        let mut sparse = SparseKeys::default();
        for (at, table) in SPARSE_TABLES.into_iter().enumerate() {
            scan_prefix(store, &[table], false, &mut |key, _| {
                sparse.note_hash(at, sparse.hasher.hash_one(key));
                if sparse.tables[at].saturated {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            })?;
        }
        Ok(sparse)
    }

    /// Per table (its byte): the rows it knows of, and whether it gave up (then it
    /// answers "maybe" for every key of the table). Start-up logs them.
    pub fn known(&self) -> Vec<(char, usize, bool)> {
        SPARSE_TABLES
            .iter()
            .zip(&self.tables)
            .map(|(table, keys)| (char::from(*table), keys.present.len(), keys.saturated))
            .collect()
    }

    /// `false` only when the projection certainly holds no `key`: its table is
    /// sparse, its set has not given up, and no committed put had its hash.
    pub fn may_hold(&self, key: &[u8]) -> bool {
        match table_of(key) {
            None => true,
            Some(at) => {
                let table = &self.tables[at];
                table.saturated || table.present.contains(&self.hasher.hash_one(key))
            }
        }
    }

    /// The sparse puts in a batch, for `note_committed` once the batch is
    /// committed (the batch itself goes to the store).
    pub fn puts_in<K: AsRef<[u8]>, V>(&self, changes: &[(K, Option<V>)]) -> Vec<SparsePut> {
        changes
            .iter()
            .filter(|(_, value)| value.is_some())
            .filter_map(|(key, _)| {
                let key = key.as_ref();
                table_of(key).map(|at| (at, self.hasher.hash_one(key)))
            })
            .collect()
    }

    pub fn note_committed(&mut self, puts: Vec<SparsePut>) {
        for (at, hash) in puts {
            self.note_hash(at, hash);
        }
    }

    fn note_hash(&mut self, at: usize, hash: u64) {
        let Some(table) = self.tables.get_mut(at) else {
            return;
        };
        if table.saturated {
            return;
        }
        if table.present.len() >= MAX_SPARSE_KEYS {
            table.saturated = true;
            table.present = HashSet::default();
            return;
        }
        table.present.insert(hash);
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
        // A table that gave up answers "maybe"; the others still answer.
        let count = keys::voided_count_key("st", Mode::Test, "m", "c", 1);
        assert!(!sparse.may_hold(&count));
        sparse.tables[2].saturated = true;
        assert!(sparse.may_hold(&count));
        assert!(!sparse.may_hold(&keys::voided_event_key("st", Mode::Test, "e3")));
        sparse.tables[0].saturated = true;
        assert!(sparse.may_hold(&keys::voided_event_key("st", Mode::Test, "e3")));
        assert!(!sparse.may_hold(&keys::fold_skipped_key("st", Mode::Test, "m", "e9")));
    }

    #[test]
    fn a_table_past_the_bound_gives_up_alone() {
        let mut sparse = SparseKeys::default();
        let puts: Vec<SparsePut> = (0..=MAX_SPARSE_KEYS as u64).map(|h| (2, h)).collect();
        sparse.note_committed(puts);
        sparse.note_committed(vec![(0, 7)]);
        let known = sparse.known();
        assert_eq!(known[2], ('\'', 0, true), "the counts gave up");
        assert_eq!(known[0], ('.', 1, false), "the voided events did not");
        assert_eq!(known[1], ('_', 0, false));
    }
}
