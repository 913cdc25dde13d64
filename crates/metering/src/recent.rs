//! A cache of usage records recently read back from the log (event reads, listings,
//! dedup confirmations): records never change, so entries never go stale; it is
//! bounded by the records' bytes.
//!
//! It also carries read-back hints from a request to the apply of its record: the
//! gateway of a void works out which records the void's rebuilds will read
//! (voids.rs, `confirm_and_warm`), reads them into the cache, and notes their
//! positions under the record's content; planning that record takes the note, so
//! apply finds them fetched instead of asking for them and applying the chunk
//! again. A hint changes what is fetched, never what apply decides.

use std::collections::HashMap;
use std::sync::Arc;

use tally_core::overlay::StoredBatch;

/// Bytes of usage records (as stored in the log) the read cache keeps: a few hundred
/// full ingest batches; bounds the memory of listings and dedup confirmations.
pub const RECENT_RECORDS_MAX_BYTES: usize = 32 * 1024 * 1024;

/// Read-back hints kept at once: each is taken when its record is planned, so
/// only requests that never reached the log leave one behind; a few hundred void
/// requests in flight on one node is far beyond what its disk serves.
pub const READ_HINTS_MAX: usize = 1024;

/// Usage records recently read from the log, oldest evicted first, bounded by
/// [`RECENT_RECORDS_MAX_BYTES`]. Records never change, so an entry never goes stale.
#[derive(Debug, Default)]
pub struct RecentRecords {
    inner: std::sync::Mutex<RecentInner>,
    hints: std::sync::Mutex<Hints>,
}

/// Positions to fetch with a record, by a digest of the record's content; oldest
/// dropped first past [`READ_HINTS_MAX`].
#[derive(Debug, Default)]
struct Hints {
    positions: HashMap<u64, Vec<(u32, u64)>>,
    order: std::collections::VecDeque<u64>,
}

#[derive(Debug, Default)]
struct RecentInner {
    records: HashMap<(u32, u64), (usize, Arc<StoredBatch>)>,
    order: std::collections::VecDeque<(u32, u64)>,
    bytes: usize,
}

impl RecentRecords {
    pub fn get(&self, partition: u32, offset: u64) -> Option<Arc<StoredBatch>> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner
            .records
            .get(&(partition, offset))
            .map(|(_, b)| b.clone())
    }

    pub fn put(&self, partition: u32, offset: u64, bytes: usize, batch: Arc<StoredBatch>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if bytes > RECENT_RECORDS_MAX_BYTES
            || inner
                .records
                .insert((partition, offset), (bytes, batch))
                .is_some()
        {
            return;
        }
        inner.order.push_back((partition, offset));
        inner.bytes += bytes;
        while inner.bytes > RECENT_RECORDS_MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some((size, _)) = inner.records.remove(&oldest) {
                inner.bytes -= size;
            }
        }
    }

    /// Notes that the record whose content digests to `record` will read the
    /// records at `positions` (module doc).
    pub fn hint(&self, record: u64, positions: Vec<(u32, u64)>) {
        let mut hints = self.hints.lock().unwrap_or_else(|p| p.into_inner());
        if hints.positions.insert(record, positions).is_none() {
            hints.order.push_back(record);
        }
        while hints.order.len() > READ_HINTS_MAX {
            if let Some(oldest) = hints.order.pop_front() {
                hints.positions.remove(&oldest);
            }
        }
    }

    /// The positions noted for the record whose content digests to `record`, taken.
    pub fn take_hint(&self, record: u64) -> Vec<(u32, u64)> {
        let mut hints = self.hints.lock().unwrap_or_else(|p| p.into_inner());
        match hints.positions.remove(&record) {
            Some(positions) => {
                hints.order.retain(|held| *held != record);
                positions
            }
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_is_taken_once_and_the_oldest_go_past_the_bound() {
        let recent = RecentRecords::default();
        for record in 0..=READ_HINTS_MAX as u64 {
            recent.hint(record, vec![(0, record)]);
        }
        assert!(recent.take_hint(0).is_empty(), "the oldest was dropped");
        assert_eq!(recent.take_hint(1), vec![(0, 1)]);
        assert!(recent.take_hint(1).is_empty(), "taken once");
        let last = READ_HINTS_MAX as u64;
        assert_eq!(recent.take_hint(last), vec![(0, last)]);
        // Noted again under the same digest: the newer positions, held once.
        recent.hint(7, vec![(1, 1)]);
        assert_eq!(recent.take_hint(7), vec![(1, 1)]);
        assert!(recent.take_hint(7).is_empty());
    }
}
