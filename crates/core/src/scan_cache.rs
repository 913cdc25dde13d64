//! Whole small tables as last committed, per scope, for apply: the webhook
//! endpoints a ledger step or a billing event is delivered to.
//!
//! Why: every ledger step asks which of its store's endpoints subscribe to its
//! events, a scan of the store's endpoint rows, and the scan went to sled on
//! every debit (where there are none, too): a sixth of the apply thread under
//! debits of one account (docs/benchmarks.md, "Rows read again, kept in memory").
//! Endpoints change a few times a day.
//!
//! Like the meter cache beside it, it only holds what was committed: entries are
//! noted from store scans, never from a chunk's writes (`Overlay` puts the chunk's
//! own writes on top), and every commit that writes a row of a cached table
//! forgets that table's scans (`ScanCache::forget_written`) before the next chunk
//! reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::keys;
use crate::series::FastMap;

/// The tables whose scans are kept.
pub const SCAN_CACHED_TABLES: &[u8] = &[keys::WEBHOOK_ENDPOINT];

/// Scans kept (bounds memory: a scope's endpoints are a few rows of a few hundred
/// bytes). Past it the cache starts over; one scope (store and mode) is one scan.
pub const MAX_CACHED_SCANS: usize = 10_000;

/// A scan's entries, key to value.
pub type Entries = BTreeMap<Vec<u8>, Vec<u8>>;

/// See the module docs.
#[derive(Debug, Default)]
pub struct ScanCache {
    scans: FastMap<Vec<u8>, Arc<Entries>>,
}

impl ScanCache {
    /// Whether scans under `prefix` may be kept.
    pub fn keeps(prefix: &[u8]) -> bool {
        prefix
            .first()
            .is_some_and(|table| SCAN_CACHED_TABLES.contains(table))
    }

    /// The committed entries under `prefix`, if kept.
    pub fn scan(&self, prefix: &[u8]) -> Option<Arc<Entries>> {
        self.scans.get(prefix).cloned()
    }

    /// Notes a scan of the store (never of a chunk's writes).
    pub fn note_scan(&mut self, prefix: &[u8], entries: Arc<Entries>) {
        if !ScanCache::keeps(prefix) {
            return;
        }
        if self.scans.len() >= MAX_CACHED_SCANS {
            self.scans.clear();
        }
        self.scans.insert(prefix.to_vec(), entries);
    }

    /// Forgets every scan of a table a commit writing `written` (its keys) wrote.
    pub fn forget_written<'k>(&mut self, written: impl IntoIterator<Item = &'k [u8]>) {
        for key in written {
            if let Some(table) = key.first().filter(|t| SCAN_CACHED_TABLES.contains(t)) {
                self.scans.retain(|prefix, _| prefix.first() != Some(table));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(pairs: &[(&[u8], &[u8])]) -> Arc<Entries> {
        Arc::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect(),
        )
    }

    #[test]
    fn a_write_of_the_table_forgets_its_scans_and_only_those() {
        let w = keys::WEBHOOK_ENDPOINT;
        let mut cache = ScanCache::default();
        cache.note_scan(&[w, b's', b'1'], entries(&[(&[w, b's', b'1', b'e'], b"v")]));
        cache.note_scan(&[w, b's', b'2'], entries(&[]));
        cache.forget_written([b"Zother".as_slice()]);
        assert!(cache.scan(&[w, b's', b'1']).is_some());
        cache.forget_written([[w, b's', b'2', b'x'].as_slice()]);
        assert!(cache.scan(&[w, b's', b'1']).is_none());
        assert!(cache.scan(&[w, b's', b'2']).is_none());
    }

    #[test]
    fn keeps_only_its_tables() {
        let mut cache = ScanCache::default();
        cache.note_scan(b"Zscope", entries(&[]));
        assert!(cache.scan(b"Zscope").is_none());
    }
}
