//! Rows of chosen tables as the inner store holds them, kept in memory between
//! reads: the read cache of a [`crate::CheckpointStore`].
//!
//! Why: a read the write-back layers cannot answer goes to sled, a walk of its
//! tree. Under debits of one account a request and its apply read the same few
//! rows again and again: the account (three times), and its holds (twice) and
//! low-balance marker, which do not exist (a miss walks the tree too). These were
//! 6 of a debit's 10 sled reads (docs/benchmarks.md, "Rows read again, kept in
//! memory"). The tables are chosen by the composition root: tables of rows that
//! are read often and written seldom, where a key read once is read again (not
//! idempotency keys, outcomes or anything keyed by a fresh id, whose misses would
//! only fill the cache).
//!
//! **Never stale.** An entry holds what the inner store holds for its key, or
//! nothing. A key a layer holds is answered by the layer before the cache is asked,
//! and the only writer of the inner store is a checkpoint, which (1) makes the
//! generation odd, (2) writes its layer, (3) removes that layer's keys from the
//! cache, (4) makes the generation even, and only then drops the layer from the
//! reads. A reader fills an entry only if the generation was even before its read
//! of the inner store and is unchanged when it inserts, under the shard lock that
//! step (3) also takes: a read that may have seen the store before a checkpoint's
//! write cannot insert after that checkpoint's removals. Entries of absent rows are
//! kept too (an absent row read again is the common case above).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;

use crate::{SharedChange, StoreError};

/// Rows the cache holds before it starts over (bounds memory: an account row with
/// its key and the map's slot is ~350 bytes, so ~17 MB at the cap). Starting over
/// costs one inner read per row read again; 50,000 covers the ledger benchmark's
/// 10,000 accounts with their markers several times over.
pub const READ_CACHE_MAX_ROWS: usize = 50_000;

/// See the module docs.
#[derive(Debug)]
pub struct ReadCache {
    /// Indexed by a key's first byte (its table).
    tables: [bool; 256],
    rows: DashMap<Box<[u8]>, Option<Arc<[u8]>>>,
    /// Odd while a checkpoint writes the inner store (module doc).
    generation: AtomicU64,
}

impl ReadCache {
    /// A cache of the rows whose keys start with one of `tables`.
    pub fn of_tables(tables: &[u8]) -> ReadCache {
        let mut cached = [false; 256];
        for table in tables {
            cached[usize::from(*table)] = true;
        }
        ReadCache {
            tables: cached,
            rows: DashMap::new(),
            generation: AtomicU64::new(0),
        }
    }

    /// Whether `key`'s table is cached.
    pub fn holds_table(&self, key: &[u8]) -> bool {
        key.first().is_some_and(|t| self.tables[usize::from(*t)])
    }

    /// Rows held now (for tests and metrics).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The inner store's value of `key` (of a cached table), from the cache, else
    /// read by `read` and kept when no checkpoint may have raced the read.
    pub fn read_through(
        &self,
        key: &[u8],
        read: impl FnOnce() -> Result<Option<Vec<u8>>, StoreError>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(row) = self.rows.get(key) {
            return Ok(row.as_deref().map(<[u8]>::to_vec));
        }
        let before = self.generation.load(Ordering::SeqCst);
        let value = read()?;
        if before.is_multiple_of(2) {
            if self.rows.len() >= READ_CACHE_MAX_ROWS {
                self.rows.clear();
            }
            if let Entry::Vacant(slot) = self.rows.entry(key.into()) {
                // Checked under the shard's lock, which a checkpoint's removal of
                // this key takes too (module doc).
                if self.generation.load(Ordering::SeqCst) == before {
                    slot.insert(value.as_deref().map(Arc::from));
                }
            }
        }
        Ok(value)
    }

    /// Steps (1)-(4) of the module doc around `write`, a checkpoint's write of
    /// `changes` to the inner store. A failed write empties the cache.
    pub fn around_write<T>(
        &self,
        changes: &[SharedChange],
        write: impl FnOnce() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let written = write();
        match &written {
            Ok(_) => {
                for (key, _) in changes {
                    if self.holds_table(key) {
                        self.rows.remove(&**key);
                    }
                }
            }
            Err(_) => self.rows.clear(),
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_its_tables_and_absent_rows_too() {
        let cache = ReadCache::of_tables(b"a");
        let mut reads = 0;
        for _ in 0..3 {
            let got = cache
                .read_through(b"a1", || {
                    reads += 1;
                    Ok(None)
                })
                .unwrap();
            assert_eq!(got, None);
        }
        assert_eq!(reads, 1, "an absent row is read once");
        assert!(!cache.holds_table(b"b1"));
        assert!(!cache.holds_table(b""));
    }

    #[test]
    fn a_write_removes_its_keys_and_a_racing_read_is_not_kept() {
        let cache = ReadCache::of_tables(b"a");
        cache
            .read_through(b"a1", || Ok(Some(b"old".to_vec())))
            .unwrap();
        let changes: Vec<SharedChange> =
            vec![(Arc::from(&b"a1"[..]), Some(Arc::from(&b"new"[..])))];
        cache.around_write(&changes, || Ok(())).unwrap();
        assert!(cache.is_empty(), "the written key was not removed");
        // A read of the store before a checkpoint's write, answered after the
        // whole checkpoint ended, must not be kept.
        let got = cache
            .read_through(b"a1", || {
                cache.around_write(&changes, || Ok(())).unwrap();
                Ok(Some(b"old".to_vec()))
            })
            .unwrap();
        assert_eq!(got.as_deref(), Some(&b"old"[..]));
        assert!(cache.is_empty(), "a read that raced a write was kept");
        // A read that starts while a checkpoint writes is not kept either.
        cache
            .around_write(&changes, || cache.read_through(b"a1", || Ok(None)))
            .unwrap();
        assert!(cache.is_empty(), "a read during a write was kept");
        let got = cache
            .read_through(b"a1", || Ok(Some(b"new".to_vec())))
            .unwrap();
        assert_eq!(got.as_deref(), Some(&b"new"[..]));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_failed_write_empties_the_cache() {
        let cache = ReadCache::of_tables(b"a");
        cache.read_through(b"a1", || Ok(None)).unwrap();
        let failed: Result<(), StoreError> =
            cache.around_write(&[], || Err(StoreError::Backend("disk".into())));
        assert!(failed.is_err());
        assert!(cache.is_empty());
    }

    #[test]
    fn starts_over_at_its_cap() {
        let cache = ReadCache::of_tables(b"a");
        for i in 0..=READ_CACHE_MAX_ROWS {
            let key = format!("a{i}");
            cache.read_through(key.as_bytes(), || Ok(None)).unwrap();
        }
        assert!(cache.len() <= READ_CACHE_MAX_ROWS);
    }
}
