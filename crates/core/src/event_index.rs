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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use sha2::{Digest, Sha256};
use tally_domain::limits::{DEDUP_HORIZON_MS, MAX_EVENTS_PER_BATCH, MAX_EVENT_FUTURE_SKEW_MS};
use tally_domain::Mode;

use crate::error::EngineError;
use crate::series::FastMap;

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

/// Shards of the index, by the fingerprint's top bits. A hash table doubles when it
/// fills: one table of every event copied the whole index at once (at 10M events a
/// 285 MB table allocated beside the old one, with every reader held behind the
/// copy); a shard grows alone, a 64th of that.
pub const INDEX_SHARDS: usize = 64;
const SHARD_SHIFT: u32 = u64::BITS - INDEX_SHARDS.trailing_zeros();
const _: () = assert!(INDEX_SHARDS.is_power_of_two());

/// Events a size hint may reserve room for at start-up (~2 GB of tables): several
/// times the 10-million-event store the service is sized for. A larger index loads
/// by growing its tables as before; a damaged hint cannot reserve more than this.
pub const MAX_INDEX_SIZE_HINT: u64 = 1 << 26;

/// The size hint is rewritten when the index moved by an eighth of its last value:
/// an eighth too small a reservation costs one doubling of some shards at start-up.
const SIZE_HINT_STEP_DIVISOR: u64 = 8;
/// ... and by at least this many events (a few records), so a small store does not
/// write its hint on every chunk.
const SIZE_HINT_MIN_STEP: u64 = 1_000;

fn shard_of(print: u64) -> usize {
    (print >> SHARD_SHIFT) as usize
}

/// The fingerprints of one shard. Fingerprints are already uniform (SHA-256 bits),
/// so a fast hash is enough; it must still mix, as tests force small colliding ones.
#[derive(Debug, Default)]
struct Shard {
    /// fingerprint -> `record number << INDEX_BITS | index` of the first stored event
    /// with that fingerprint: 16 bytes per event plus the table's slack.
    events: FastMap<u64, u64>,
    /// Further events of a fingerprint already in `events` (collisions: rare).
    overflow: FastMap<u64, Vec<u64>>,
}

impl Shard {
    fn add(&mut self, print: u64, packed: u64) {
        match self.events.entry(print) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(packed);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.overflow.entry(print).or_default().push(packed);
            }
        }
    }

    fn remove(&mut self, print: u64, packed: u64) {
        let first = self.events.get(&print) == Some(&packed);
        let mut promoted = None;
        if let Some(more) = self.overflow.get_mut(&print) {
            more.retain(|p| *p != packed);
            if first {
                promoted = more.pop();
            }
            if more.is_empty() {
                self.overflow.remove(&print);
            }
        }
        if first {
            match promoted {
                Some(next) => self.events.insert(print, next),
                None => self.events.remove(&print),
            };
        }
    }

    fn len(&self) -> usize {
        self.events.len() + self.overflow.values().map(Vec::len).sum::<usize>()
    }
}

/// Record numbers and positions (one pair per record, ~100 events).
#[derive(Debug, Default)]
struct Records {
    /// record number -> position, and back.
    positions: FastMap<u64, (u32, u64)>,
    numbers: FastMap<(u32, u64), u64>,
    next_record: u64,
}

/// See the module docs. Shared between the projector (the only writer, after each
/// commit) and the request paths (dedup at ingest, event reads).
///
/// A record's number is registered before its events enter their shards and
/// forgotten after they leave, so a reader that finds an event can always place
/// it, except for an event pruned meanwhile, which no reader can still need (its
/// timestamp is older than ingest accepts).
#[derive(Debug)]
pub struct EventIndex {
    fingerprint: FingerprintFn,
    records: RwLock<Records>,
    shards: Box<[RwLock<Shard>]>,
    /// The size last given out as a hint (`size_hint_due`).
    hinted: AtomicU64,
}

impl Default for EventIndex {
    fn default() -> Self {
        EventIndex::with_fingerprint(fingerprint)
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|p| p.into_inner())
}

fn pack(number: u64, index: u32) -> u64 {
    (number << INDEX_BITS) | u64::from(index)
}

impl EventIndex {
    /// An index with another fingerprint function: tests force collisions with one.
    pub fn with_fingerprint(fingerprint: FingerprintFn) -> EventIndex {
        EventIndex {
            fingerprint,
            records: RwLock::default(),
            shards: (0..INDEX_SHARDS).map(|_| RwLock::default()).collect(),
            hinted: AtomicU64::new(0),
        }
    }

    pub fn fingerprint(&self, store_id: &str, mode: Mode, event_id: &str) -> u64 {
        (self.fingerprint)(store_id, mode, event_id)
    }

    /// Makes room for `events` more events at once (start-up, from a size hint),
    /// so loading does not grow every table by doubling it again and again.
    pub fn reserve(&self, events: u64) {
        let events = events.min(MAX_INDEX_SIZE_HINT) as usize;
        // Fingerprints spread evenly; a sixteenth more absorbs the unevenness.
        let per_shard = events / INDEX_SHARDS + events / INDEX_SHARDS / 16;
        for shard in self.shards.iter() {
            write(shard).events.reserve(per_shard);
        }
        write(&self.records)
            .positions
            .reserve(events / MAX_EVENTS_PER_BATCH);
    }

    /// Every stored event whose fingerprint is `print`: candidates to confirm.
    pub fn candidates(&self, print: u64) -> Vec<EventLocation> {
        let packed: Vec<u64> = {
            let shard = read(&self.shards[shard_of(print)]);
            let Some(first) = shard.events.get(&print) else {
                return Vec::new();
            };
            std::iter::once(first)
                .chain(shard.overflow.get(&print).into_iter().flatten())
                .copied()
                .collect()
        };
        let records = read(&self.records);
        packed
            .into_iter()
            .filter_map(|packed| {
                let (partition, offset) = *records.positions.get(&(packed >> INDEX_BITS))?;
                Some(EventLocation {
                    partition,
                    offset,
                    index: (packed & ((1 << INDEX_BITS) - 1)) as u32,
                })
            })
            .collect()
    }

    /// Adds the events one record stored (an `F` row was written).
    pub fn add_record(&self, partition: u32, offset: u64, stored: &[(u32, u64)]) {
        let number = {
            let mut records = write(&self.records);
            if records.numbers.contains_key(&(partition, offset)) {
                return;
            }
            let number = records.next_record;
            records.next_record += 1;
            records.positions.insert(number, (partition, offset));
            records.numbers.insert((partition, offset), number);
            number
        };
        self.each_shard(stored, |shard, index, print| {
            shard.add(print, pack(number, index))
        });
    }

    /// Forgets the events of one record (its `F` row was deleted: pruned).
    pub fn remove_record(&self, partition: u32, offset: u64, stored: &[(u32, u64)]) {
        let Some(number) = read(&self.records)
            .numbers
            .get(&(partition, offset))
            .copied()
        else {
            return;
        };
        self.each_shard(stored, |shard, index, print| {
            shard.remove(print, pack(number, index))
        });
        let mut records = write(&self.records);
        records.numbers.remove(&(partition, offset));
        records.positions.remove(&number);
    }

    /// Runs `change` for each event, under its shard's lock, taking each lock once
    /// (a record's ~100 events fall in most of the shards).
    fn each_shard(&self, stored: &[(u32, u64)], mut change: impl FnMut(&mut Shard, u32, u64)) {
        let mut order: Vec<(usize, u32, u64)> = stored
            .iter()
            .map(|(index, print)| (shard_of(*print), *index, *print))
            .collect();
        order.sort_unstable_by_key(|(shard, _, _)| *shard);
        for run in order.chunk_by(|a, b| a.0 == b.0) {
            let mut shard = write(&self.shards[run[0].0]);
            for (_, index, print) in run {
                change(&mut shard, *index, *print);
            }
        }
    }

    /// The index's size, when it moved by more than `SIZE_HINT_STEP_DIVISOR`th
    /// since the last size given out here (or `noted` at load): the caller stores
    /// it as the next start-up's hint. A few writes over a store's growth.
    pub fn size_hint_due(&self) -> Option<u64> {
        let len = self.len() as u64;
        let last = self.hinted.load(Ordering::Relaxed);
        let step = (last / SIZE_HINT_STEP_DIVISOR).max(SIZE_HINT_MIN_STEP);
        if len.abs_diff(last) < step {
            return None;
        }
        self.hinted.store(len, Ordering::Relaxed);
        Some(len)
    }

    /// Records that the stored hint says `events` (after a load).
    pub fn note_hinted(&self, events: u64) {
        self.hinted.store(events, Ordering::Relaxed);
    }

    /// Stored events the index knows (for metrics, size hints and tests).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|shard| read(shard).len()).sum()
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

    /// A fingerprint drawn from few values, spread over the shards by its top bits,
    /// so records collide within and across shards.
    fn print_strategy() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        (0u64..4, 0u64..6).prop_map(|(shard, low)| (shard << 62) | low)
    }

    proptest::proptest! {
        /// Any sequence of records added and removed (twice, or never added,
        /// included) leaves exactly the reference model's candidates and size.
        #[test]
        fn any_adds_and_removals_match_a_reference_model(
            steps in proptest::collection::vec(
                (proptest::bool::weighted(0.7), 0u64..12,
                 proptest::collection::vec(print_strategy(), 0..8)),
                0..60,
            ),
        ) {
            use std::collections::{BTreeMap, BTreeSet};
            let index = EventIndex::default();
            // offset -> the events its record stored (what its `F` row says).
            let mut rows: BTreeMap<u64, Vec<(u32, u64)>> = BTreeMap::new();
            let mut model: BTreeMap<u64, Vec<(u32, u64)>> = BTreeMap::new();
            for (add, offset, prints) in steps {
                let stored = rows
                    .entry(offset)
                    .or_insert_with(|| prints.iter().enumerate().map(|(i, p)| (i as u32, *p)).collect())
                    .clone();
                if add {
                    index.add_record(0, offset, &stored);
                    model.entry(offset).or_insert(stored);
                } else {
                    index.remove_record(0, offset, &stored);
                    model.remove(&offset);
                }
            }
            let mut expected: BTreeMap<u64, BTreeSet<EventLocation>> = BTreeMap::new();
            for (offset, stored) in &model {
                for (at, print) in stored {
                    expected.entry(*print).or_default().insert(EventLocation {
                        partition: 0,
                        offset: *offset,
                        index: *at,
                    });
                }
            }
            for shard in 0..4u64 {
                for low in 0..6u64 {
                    let print = (shard << 62) | low;
                    let found: BTreeSet<EventLocation> = index.candidates(print).into_iter().collect();
                    proptest::prop_assert_eq!(found, expected.get(&print).cloned().unwrap_or_default());
                }
            }
            let size: usize = expected.values().map(BTreeSet::len).sum();
            proptest::prop_assert_eq!(index.len(), size);
        }
    }

    #[test]
    fn size_hints_follow_growth_and_shrinking_in_steps() {
        let index = EventIndex::default();
        index.reserve(10);
        assert!(index.is_empty(), "a reservation holds no events");
        assert_eq!(index.size_hint_due(), None, "an empty index needs no hint");
        let record = |offset: u64, n: u64| -> Vec<(u32, u64)> {
            (0..n).map(|i| (i as u32, (offset << 32) | i)).collect()
        };
        index.add_record(0, 1, &record(1, SIZE_HINT_MIN_STEP - 1));
        assert_eq!(index.size_hint_due(), None, "below the minimum step");
        index.add_record(0, 2, &record(2, 1));
        assert_eq!(index.size_hint_due(), Some(SIZE_HINT_MIN_STEP));
        assert_eq!(index.size_hint_due(), None, "given out once");
        index.remove_record(0, 2, &record(2, 1));
        assert_eq!(index.size_hint_due(), None, "one event is not a step");
        index.remove_record(0, 1, &record(1, SIZE_HINT_MIN_STEP - 1));
        assert_eq!(index.size_hint_due(), Some(0), "shrinking is noted too");
    }

    #[test]
    fn stored_rows_round_trip() {
        let rows = vec![(0, u64::MAX), (99, 7)];
        assert_eq!(decode_stored(&encode_stored(&rows)).unwrap(), rows);
        assert!(decode_stored(&[0; 13]).is_err());
    }
}
