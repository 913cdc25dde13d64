//! The event index: which event ids each scope has stored, and where in the log each
//! stored event is, in memory at ~26 bytes per event (ARCHITECTURE.md, "Exact dedup
//! without a key per event").
//!
//! Stored events live only in the log. The projection keeps one row per applied
//! usage record (table `F`, see keys.rs): the record's position and, for every event
//! it stored, the event's index in the record and a 64-bit fingerprint of
//! (store, mode, event_id). This index is the in-memory view of that table: loaded
//! from it at start-up and updated from the `F` rows each committed chunk writes or
//! deletes, so it never holds what the projection does not.
//!
//! A fingerprint hit is only a candidate: the caller reads the record at the
//! location and compares the event id exactly, so a collision can cost a read but
//! never drop a distinct event. Fingerprints must be stable across builds (they are
//! stored): the first 8 bytes of a SHA-256.

use std::collections::HashMap;
use std::sync::RwLock;

use sha2::{Digest, Sha256};
use tally_domain::limits::{DEDUP_HORIZON_MS, MAX_EVENTS_PER_BATCH, MAX_EVENT_FUTURE_SKEW_MS};
use tally_domain::Mode;

use crate::error::EngineError;

/// How long a stored event stays in the index and in `GET /v1/events`, counted from
/// its receipt: the dedup horizon (an event older than that cannot be ingested, so
/// its id cannot recur), plus the future skew an event's timestamp may have, plus a
/// day for clocks of nodes that disagree on "now".
pub const STORED_EVENTS_RETENTION_MS: i64 = DEDUP_HORIZON_MS + MAX_EVENT_FUTURE_SKEW_MS + DAY_MS;
const DAY_MS: i64 = 24 * 60 * 60 * 1000;
/// Pruning moves in whole hours of receipt time: at most one scan of the `F` table
/// per hour of records, and the same cut on replay as live.
pub const PRUNE_STEP_MS: i64 = 60 * 60 * 1000;

/// Computes the fingerprint of an event id within a scope.
pub type FingerprintFn = fn(store_id: &str, mode: Mode, event_id: &str) -> u64;

/// Bits of a packed location that hold the event's index within its record; the
/// rest hold the record's number. Static check below: every index of a batch fits.
const INDEX_BITS: u32 = 16;
const _: () = assert!(MAX_EVENTS_PER_BATCH < (1 << INDEX_BITS));

/// The stable fingerprint (stored in the `F` table; never change it).
pub fn fingerprint(store_id: &str, mode: Mode, event_id: &str) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(store_id.as_bytes());
    hasher.update([0, mode.key_byte(), 0]);
    hasher.update(event_id.as_bytes());
    let digest = hasher.finalize();
    u64::from_be_bytes(digest[..8].try_into().expect("a SHA-256 has 32 bytes"))
}

/// Where one stored event is: its record's position and its index in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventLocation {
    pub partition: u32,
    pub offset: u64,
    pub index: u32,
}

/// The events one applied usage record stored: `(index in the record, fingerprint)`,
/// as the `F` row's value holds them.
pub fn encode_stored(events: &[(u32, u64)]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(events.len() * 12);
    for (index, print) in events {
        bytes.extend_from_slice(&index.to_be_bytes());
        bytes.extend_from_slice(&print.to_be_bytes());
    }
    bytes
}

pub fn decode_stored(bytes: &[u8]) -> Result<Vec<(u32, u64)>, EngineError> {
    if !bytes.len().is_multiple_of(12) {
        return Err(EngineError::Corrupt(format!(
            "a stored-events row holds {} bytes, not a multiple of 12",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(12)
        .map(|c| {
            (
                u32::from_be_bytes(c[..4].try_into().expect("4")),
                u64::from_be_bytes(c[4..].try_into().expect("8")),
            )
        })
        .collect())
}

#[derive(Debug, Default)]
struct Inner {
    /// fingerprint -> `record number << INDEX_BITS | index` of the first stored event
    /// with that fingerprint: 16 bytes per event plus the table's slack.
    events: HashMap<u64, u64>,
    /// Further events of a fingerprint already in `events` (collisions: rare).
    overflow: HashMap<u64, Vec<u64>>,
    /// record number -> position, and back (one pair per record, ~100 events).
    records: HashMap<u64, (u32, u64)>,
    numbers: HashMap<(u32, u64), u64>,
    next_record: u64,
}

impl Inner {
    fn location(&self, packed: u64) -> Option<EventLocation> {
        let (partition, offset) = *self.records.get(&(packed >> INDEX_BITS))?;
        Some(EventLocation {
            partition,
            offset,
            index: (packed & ((1 << INDEX_BITS) - 1)) as u32,
        })
    }
}

/// See the module docs. Shared between the projector (the only writer, after each
/// commit) and the request paths (dedup at ingest, event reads).
#[derive(Debug)]
pub struct EventIndex {
    fingerprint: FingerprintFn,
    inner: RwLock<Inner>,
}

impl Default for EventIndex {
    fn default() -> Self {
        EventIndex::with_fingerprint(fingerprint)
    }
}

impl EventIndex {
    /// An index with another fingerprint function: tests force collisions with one.
    pub fn with_fingerprint(fingerprint: FingerprintFn) -> EventIndex {
        EventIndex {
            fingerprint,
            inner: RwLock::new(Inner::default()),
        }
    }

    pub fn fingerprint(&self, store_id: &str, mode: Mode, event_id: &str) -> u64 {
        (self.fingerprint)(store_id, mode, event_id)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Every stored event whose fingerprint is `print`: candidates to confirm.
    pub fn candidates(&self, print: u64) -> Vec<EventLocation> {
        let inner = self.read();
        let Some(first) = inner.events.get(&print) else {
            return Vec::new();
        };
        std::iter::once(first)
            .chain(inner.overflow.get(&print).into_iter().flatten())
            .filter_map(|packed| inner.location(*packed))
            .collect()
    }

    /// Adds the events one record stored (an `F` row was written).
    pub fn add_record(&self, partition: u32, offset: u64, stored: &[(u32, u64)]) {
        let mut inner = self.write();
        if inner.numbers.contains_key(&(partition, offset)) {
            return;
        }
        let number = inner.next_record;
        inner.next_record += 1;
        inner.records.insert(number, (partition, offset));
        inner.numbers.insert((partition, offset), number);
        for (index, print) in stored {
            let packed = (number << INDEX_BITS) | u64::from(*index);
            match inner.events.entry(*print) {
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(packed);
                }
                std::collections::hash_map::Entry::Occupied(_) => {
                    inner.overflow.entry(*print).or_default().push(packed);
                }
            }
        }
    }

    /// Forgets the events of one record (its `F` row was deleted: pruned).
    pub fn remove_record(&self, partition: u32, offset: u64, stored: &[(u32, u64)]) {
        let mut inner = self.write();
        let Some(number) = inner.numbers.remove(&(partition, offset)) else {
            return;
        };
        inner.records.remove(&number);
        for (index, print) in stored {
            let packed = (number << INDEX_BITS) | u64::from(*index);
            let first = inner.events.get(print) == Some(&packed);
            let mut promoted = None;
            if let Some(more) = inner.overflow.get_mut(print) {
                more.retain(|p| *p != packed);
                if first {
                    promoted = more.pop();
                }
                if more.is_empty() {
                    inner.overflow.remove(print);
                }
            }
            if first {
                match promoted {
                    Some(next) => inner.events.insert(*print, next),
                    None => inner.events.remove(print),
                };
            }
        }
    }

    /// Stored events the index knows (for metrics and tests).
    pub fn len(&self) -> usize {
        let inner = self.read();
        inner.events.len() + inner.overflow.values().map(Vec::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn colliding(_: &str, _: Mode, event_id: &str) -> u64 {
        event_id.len() as u64
    }

    #[test]
    fn collisions_keep_every_location_and_removal_is_exact() {
        let index = EventIndex::with_fingerprint(colliding);
        index.add_record(0, 10, &[(0, 1), (1, 1), (2, 2)]);
        index.add_record(0, 20, &[(0, 1)]);
        let mut found = index.candidates(1);
        found.sort();
        assert_eq!(found.len(), 3);
        assert_eq!(found[0].offset, 10);
        assert_eq!(found[2].offset, 20);
        index.remove_record(0, 10, &[(0, 1), (1, 1), (2, 2)]);
        assert_eq!(
            index.candidates(1),
            vec![EventLocation {
                partition: 0,
                offset: 20,
                index: 0
            }]
        );
        assert!(index.candidates(2).is_empty());
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn stored_rows_round_trip() {
        let rows = vec![(0, u64::MAX), (99, 7)];
        assert_eq!(decode_stored(&encode_stored(&rows)).unwrap(), rows);
        assert!(decode_stored(&[0; 13]).is_err());
    }
}
