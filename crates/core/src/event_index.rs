//! The event index: which event ids each scope has stored, and where in the log each
//! stored event is, in memory at ~9 bytes per event (ARCHITECTURE.md, "Exact dedup
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
//! never drop a distinct event. The index keeps 38 of a fingerprint's 64 bits
//! (`key_of` and the shard): at 10M events about one new event in 27,000 meets an
//! unrelated candidate, which costs one extra read. Fingerprints must be stable
//! across builds (they are stored): the first 8 bytes of a SHA-256.

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
/// rest hold the record's number. Static check below: every index of a batch fits,
/// with the all-ones index left over for `REMOVED`.
const INDEX_BITS: u32 = 7;
const _: () = assert!(MAX_EVENTS_PER_BATCH < (1 << INDEX_BITS) - 1);

/// Record numbers below this pack into the 32 bits of a sorted run's entry (8 bytes
/// an event instead of 12: ~40 MB less at 10M events). Numbers are reused once their
/// record is pruned, so they stay below the most records the index ever held at
/// once; past 33 million of those (batches of one event, say), an event of a higher
/// number is kept in its shard's `wide` map instead, at ~30 bytes.
const NARROW_RECORDS: u64 = 1 << (u32::BITS - INDEX_BITS);

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

/// Shards of the index, by the fingerprint's top bits. One table of every event
/// copied the whole index whenever it grew (at 10M events a 285 MB table allocated
/// beside the old one, with every reader held behind the copy); a shard reorders
/// alone, a 64th of that.
pub const INDEX_SHARDS: usize = 64;
const SHARD_SHIFT: u32 = u64::BITS - INDEX_SHARDS.trailing_zeros();
const _: () = assert!(INDEX_SHARDS.is_power_of_two());

/// Events a size hint may reserve room for at start-up (~540 MB of runs): several
/// times the 10-million-event store the service is sized for. A larger index loads
/// by growing its runs as before; a damaged hint cannot reserve more than this.
pub const MAX_INDEX_SIZE_HINT: u64 = 1 << 26;

/// The size hint is rewritten when the index moved by an eighth of its last value:
/// an eighth too small a reservation costs one reallocation of some shards at start-up.
const SIZE_HINT_STEP_DIVISOR: u64 = 8;
/// ... and by at least this many events (a few records), so a small store does not
/// write its hint on every chunk.
const SIZE_HINT_MIN_STEP: u64 = 1_000;

/// A shard's recent table is merged into its sorted run when it holds more than
/// this fraction of the run: each merge copies the run once, so a smaller fraction
/// costs more copying per added event and a larger one more hash-table memory
/// (the table keeps its capacity, at ~17 bytes a slot, between merges).
const MERGE_FRACTION: usize = 16;
/// ... or more than this many events, so a small shard is not rewritten for every
/// record (a handful in this crate's tests, so they merge and compact often).
const MERGE_MIN_RECENT: usize = if cfg!(test) { 3 } else { 1_024 };
/// A sorted run is compacted (removed events dropped) once this fraction of it is
/// removed events: pruning removes a whole hour of records at a time.
const COMPACT_FRACTION: usize = 4;

/// The packed location of a removed event still in a sorted run (dropped at the
/// next merge or compaction). `pack` never yields it: an event's index within its
/// record stays below `MAX_EVENTS_PER_BATCH`, so its low bits are never all ones
/// (the assertion beside `INDEX_BITS`).
const REMOVED: u32 = u32::MAX;

/// A packed location as a sorted run's entry holds it, or `None` when its record's
/// number is too high for that (`NARROW_RECORDS`).
fn narrow(packed: u64) -> Option<u32> {
    // Below `NARROW_RECORDS` a record's number and index fill 32 bits at most.
    (packed >> INDEX_BITS < NARROW_RECORDS).then_some(packed as u32)
}

fn shard_of(print: u64) -> usize {
    (print >> SHARD_SHIFT) as usize
}

/// The part of a fingerprint a shard keys on: its low 32 bits. With the shard's 6
/// top bits that is 38 bits of the fingerprint, so at 10M events a distinct event
/// meets an unrelated candidate about once in 27,000 lookups; the caller's exact
/// check against the log turns that into one extra read, never a lost event.
fn key_of(print: u64) -> u32 {
    print as u32
}

/// One event in a shard's sorted run: its key and its packed location (`narrow`),
/// 8 bytes.
#[derive(Debug, Clone, Copy)]
struct Entry([u32; 2]);

impl Entry {
    fn new(key: u32, packed: u32) -> Entry {
        Entry([key, packed])
    }

    fn key(&self) -> u32 {
        self.0[0]
    }

    fn packed(&self) -> u64 {
        u64::from(self.0[1])
    }

    fn is_removed(&self) -> bool {
        self.0[1] == REMOVED
    }
}

/// Entries a slot of a shard's directory aims to cover: a lookup reads its slot,
/// then searches about this many entries (a few cache lines), where a binary search
/// of a run of 150,000 takes ~17 probes, most of them cache misses.
const DIRECTORY_SLOT_ENTRIES: usize = 32;
/// The most key bits a directory resolves (8 MB of slots for a shard at most, for a
/// run of over 30 million events).
const MAX_DIRECTORY_BITS: u32 = 20;

/// Where each range of keys starts in a sorted run: slot `s` covers the keys whose
/// top `bits` bits are `s`, and `starts[s]..starts[s + 1]` holds them.
#[derive(Debug, Default)]
struct Directory {
    bits: u32,
    starts: Vec<usize>,
}

impl Directory {
    fn slot(bits: u32, key: u32) -> usize {
        if bits == 0 {
            0
        } else {
            (key >> (u32::BITS - bits)) as usize
        }
    }

    /// The directory of a sorted run (one pass).
    fn of(run: &[Entry]) -> Directory {
        let bits = (run.len() / DIRECTORY_SLOT_ENTRIES)
            .max(1)
            .ilog2()
            .min(MAX_DIRECTORY_BITS);
        let slots = 1usize << bits;
        let mut starts = Vec::with_capacity(slots + 1);
        for (at, entry) in run.iter().enumerate() {
            let slot = Directory::slot(bits, entry.key());
            while starts.len() <= slot {
                starts.push(at);
            }
        }
        while starts.len() <= slots {
            starts.push(run.len());
        }
        Directory { bits, starts }
    }

    /// The first position of `run` (the run this directory was built from) whose
    /// key is not below `key`.
    fn lower_bound(&self, run: &[Entry], key: u32) -> usize {
        let slot = Directory::slot(self.bits, key);
        let (Some(&low), Some(&high)) = (self.starts.get(slot), self.starts.get(slot + 1)) else {
            // No directory yet: the run is empty.
            return run.partition_point(|entry| entry.key() < key);
        };
        low + run[low..high].partition_point(|entry| entry.key() < key)
    }
}

/// The events of one shard: most in a sorted run (8 bytes each, no slack), the
/// ones added since its last merge in a small hash table. A hash table of every
/// event took ~28 bytes per event (16 bytes of pair, a control byte, and the
/// slack of a table sized by powers of two).
#[derive(Debug, Default)]
struct Shard {
    /// Sorted by key. Removed events stay as `REMOVED` until the next merge or
    /// compaction; `unsorted` entries at its end were loaded and not yet sorted.
    run: Vec<Entry>,
    /// Rebuilt whenever the run's order changes (a removal only marks an entry).
    directory: Directory,
    removed: usize,
    unsorted: usize,
    /// key -> packed location of the first recent event with that key.
    recent: FastMap<u32, u64>,
    /// Further recent events of a key already in `recent` (collisions: rare).
    recent_more: FastMap<u32, Vec<u64>>,
    recent_len: usize,
    /// Merged events whose location does not fit a run's entry (`NARROW_RECORDS`):
    /// key -> packed locations. Empty below 33 million records.
    wide: FastMap<u32, Vec<u64>>,
    wide_len: usize,
}

impl Shard {
    fn add(&mut self, key: u32, packed: u64) {
        match self.recent.entry(key) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(packed);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.recent_more.entry(key).or_default().push(packed);
            }
        }
        self.recent_len += 1;
        let live = self.run.len() - self.removed;
        if self.recent_len > (live / MERGE_FRACTION).max(MERGE_MIN_RECENT) {
            self.merge();
        }
    }

    /// Appends a loaded event to the run, unsorted (`settle` orders the run once).
    fn load(&mut self, key: u32, packed: u64) {
        match narrow(packed) {
            Some(packed) => {
                self.run.push(Entry::new(key, packed));
                self.unsorted += 1;
            }
            None => self.add_wide(key, packed),
        }
    }

    fn add_wide(&mut self, key: u32, packed: u64) {
        self.wide.entry(key).or_default().push(packed);
        self.wide_len += 1;
    }

    fn remove_wide(&mut self, key: u32, packed: u64) {
        if let Some(all) = self.wide.get_mut(&key) {
            if let Some(at) = all.iter().position(|p| *p == packed) {
                all.swap_remove(at);
                self.wide_len -= 1;
            }
            if all.is_empty() {
                self.wide.remove(&key);
            }
        }
    }

    /// Sorts what `load` appended.
    fn settle(&mut self) {
        if self.unsorted > 0 {
            self.sort_loaded();
            self.reindex();
        }
    }

    fn sort_loaded(&mut self) {
        if self.unsorted > 0 {
            self.run.sort_unstable_by_key(Entry::key);
            self.unsorted = 0;
        }
    }

    fn drop_removed(&mut self) {
        if self.removed > 0 {
            self.run.retain(|entry| !entry.is_removed());
            self.removed = 0;
        }
    }

    /// After the run's order or length changed: gives back slack a load or a
    /// compaction left, and rebuilds the directory.
    fn reindex(&mut self) {
        if self.run.capacity() > self.run.len() + self.run.len() / 8 {
            self.run.shrink_to_fit();
        }
        self.directory = Directory::of(&self.run);
    }

    fn remove(&mut self, key: u32, packed: u64) {
        if self.remove_recent(key, packed) {
            self.recent_len -= 1;
            return;
        }
        let Some(narrow) = narrow(packed) else {
            self.remove_wide(key, packed);
            return;
        };
        self.settle();
        let from = self.directory.lower_bound(&self.run, key);
        if let Some(entry) = self.run[from..]
            .iter_mut()
            .take_while(|entry| entry.key() == key)
            .find(|entry| entry.0[1] == narrow)
        {
            *entry = Entry::new(key, REMOVED);
            self.removed += 1;
            if self.removed > self.run.len() / COMPACT_FRACTION {
                self.compact();
            }
        }
    }

    fn remove_recent(&mut self, key: u32, packed: u64) -> bool {
        let first = self.recent.get(&key) == Some(&packed);
        let mut found = first;
        let mut promoted = None;
        if let Some(more) = self.recent_more.get_mut(&key) {
            if let Some(at) = more.iter().position(|p| *p == packed) {
                if !first {
                    more.swap_remove(at);
                    found = true;
                }
            }
            if first {
                promoted = more.pop();
            }
            if more.is_empty() {
                self.recent_more.remove(&key);
            }
        }
        if first {
            match promoted {
                Some(next) => self.recent.insert(key, next),
                None => self.recent.remove(&key),
            };
        }
        found
    }

    fn compact(&mut self) {
        self.sort_loaded();
        self.drop_removed();
        self.reindex();
    }

    /// Moves the recent events into the run: sorted on their own, then merged from
    /// the back into the run grown by exactly their number (no second copy of the
    /// run, no slack left behind).
    fn merge(&mut self) {
        self.sort_loaded();
        self.drop_removed();
        let mut fresh: Vec<Entry> = Vec::with_capacity(self.recent_len);
        // Drained, not taken: the tables keep their capacity between merges.
        let mut wide = Vec::new();
        let all = self.recent.drain().chain(
            self.recent_more
                .drain()
                .flat_map(|(key, more)| more.into_iter().map(move |packed| (key, packed))),
        );
        for (key, packed) in all {
            match narrow(packed) {
                Some(narrow) => fresh.push(Entry::new(key, narrow)),
                None => wide.push((key, packed)),
            }
        }
        for (key, packed) in wide {
            self.add_wide(key, packed);
        }
        self.recent_len = 0;
        fresh.sort_unstable_by_key(Entry::key);
        let old = self.run.len();
        self.run.reserve_exact(fresh.len());
        self.run.resize(old + fresh.len(), Entry::new(0, REMOVED));
        let (mut from_run, mut from_fresh, mut to) = (old, fresh.len(), old + fresh.len());
        while from_fresh > 0 {
            to -= 1;
            if from_run > 0 && self.run[from_run - 1].key() > fresh[from_fresh - 1].key() {
                from_run -= 1;
                self.run[to] = self.run[from_run];
            } else {
                from_fresh -= 1;
                self.run[to] = fresh[from_fresh];
            }
        }
        self.reindex();
    }

    /// The packed locations of every event with `key`, or `None` while loaded
    /// events wait to be sorted (the caller settles the shard and asks again).
    fn find(&self, key: u32) -> Option<Vec<u64>> {
        if self.unsorted > 0 {
            return None;
        }
        let mut found: Vec<u64> = self
            .recent
            .get(&key)
            .into_iter()
            .chain(self.recent_more.get(&key).into_iter().flatten())
            .chain(self.wide.get(&key).into_iter().flatten())
            .copied()
            .collect();
        let from = self.directory.lower_bound(&self.run, key);
        found.extend(
            self.run[from..]
                .iter()
                .take_while(|entry| entry.key() == key)
                .filter(|entry| !entry.is_removed())
                .map(Entry::packed),
        );
        Some(found)
    }

    fn len(&self) -> usize {
        self.run.len() - self.removed + self.recent_len + self.wide_len
    }
}

/// Record numbers and positions (one pair per record, ~100 events).
#[derive(Debug, Default)]
struct Records {
    /// record number -> position, and back.
    positions: FastMap<u64, (u32, u64)>,
    numbers: FastMap<(u32, u64), u64>,
    next_record: u64,
    /// Numbers of forgotten records, given out again first, so numbers stay below
    /// the most records held at once (`NARROW_RECORDS`).
    free: Vec<u64>,
}

/// See the module docs. Shared between the projector (the only writer, after each
/// commit) and the request paths (dedup at ingest, event reads).
///
/// A record's number is registered before its events enter their shards and
/// forgotten after they leave, so a reader that finds an event can always place
/// it, except for an event pruned meanwhile, which no reader can still need (its
/// timestamp is older than ingest accepts). Such a reader may place it in the
/// record that took the pruned one's number since: a wrong candidate, which the
/// caller's exact check of the event id rejects like any other.
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
    /// so loading does not grow every run by doubling it again and again.
    pub fn reserve(&self, events: u64) {
        let events = events.min(MAX_INDEX_SIZE_HINT) as usize;
        // Fingerprints spread evenly; a sixteenth more absorbs the unevenness.
        let per_shard = events / INDEX_SHARDS + events / INDEX_SHARDS / 16;
        for shard in self.shards.iter() {
            write(shard).run.reserve_exact(per_shard);
        }
        write(&self.records)
            .positions
            .reserve(events / MAX_EVENTS_PER_BATCH);
    }

    /// Every stored event whose fingerprint agrees with `print` on the bits the
    /// index keeps (`key_of` and the shard): candidates to confirm.
    pub fn candidates(&self, print: u64) -> Vec<EventLocation> {
        let lock = &self.shards[shard_of(print)];
        let found = read(lock).find(key_of(print));
        let packed = match found {
            Some(packed) => packed,
            None => {
                let mut shard = write(lock);
                shard.settle();
                shard.find(key_of(print)).unwrap_or_default()
            }
        };
        if packed.is_empty() {
            return Vec::new();
        }
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
        let Some(number) = self.register(partition, offset) else {
            return;
        };
        self.each_shard(stored, |shard, index, print| {
            shard.add(key_of(print), pack(number, index))
        });
    }

    /// Adds the events of a record read at start-up: appended to the shards'
    /// runs unsorted, and sorted once by `finish_loading` (or by the first
    /// lookup or change of a shard), where adding them one by one would merge
    /// each shard's run again and again while it grows.
    pub fn load_record(&self, partition: u32, offset: u64, stored: &[(u32, u64)]) {
        let Some(number) = self.register(partition, offset) else {
            return;
        };
        self.each_shard(stored, |shard, index, print| {
            shard.load(key_of(print), pack(number, index))
        });
    }

    /// Sorts what `load_record` added.
    pub fn finish_loading(&self) {
        for shard in self.shards.iter() {
            write(shard).settle();
        }
    }

    /// Gives a record a number, or `None` when it has one (added before).
    fn register(&self, partition: u32, offset: u64) -> Option<u64> {
        let mut records = write(&self.records);
        if records.numbers.contains_key(&(partition, offset)) {
            return None;
        }
        let number = match records.free.pop() {
            Some(number) => number,
            None => {
                records.next_record += 1;
                records.next_record - 1
            }
        };
        records.positions.insert(number, (partition, offset));
        records.numbers.insert((partition, offset), number);
        Some(number)
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
            shard.remove(key_of(print), pack(number, index))
        });
        let mut records = write(&self.records);
        records.numbers.remove(&(partition, offset));
        records.positions.remove(&number);
        records.free.push(number);
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
    /// so records collide within and across shards, fully or only in the bits the
    /// index keeps.
    fn print_strategy() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        (0u64..4, 0u64..3, 0u64..6)
            .prop_map(|(shard, dropped, low)| (shard << 62) | (dropped << 40) | low)
    }

    /// How a step changes the index.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        Add,
        Load,
        Remove,
        FinishLoading,
    }

    fn step_strategy() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => Just(Step::Add),
            2 => Just(Step::Load),
            3 => Just(Step::Remove),
            1 => Just(Step::FinishLoading),
        ]
    }

    proptest::proptest! {
        /// Any sequence of records added, loaded and removed (twice, or never
        /// added, included), with merges, compactions and lazy sorting along the
        /// way, leaves exactly the reference model's candidates and size.
        #[test]
        fn any_adds_and_removals_match_a_reference_model(
            first_number in proptest::prop_oneof![proptest::strategy::Just(0), NARROW_RECORDS - 4..NARROW_RECORDS],
            steps in proptest::collection::vec(
                (step_strategy(), 0u64..12,
                 proptest::collection::vec(print_strategy(), 0..8)),
                0..80,
            ),
        ) {
            use std::collections::{BTreeMap, BTreeSet};
            let index = EventIndex::default();
            // Records numbered on both sides of what a run's entry holds.
            write(&index.records).next_record = first_number;
            // offset -> the events its record stored (what its `F` row says).
            let mut rows: BTreeMap<u64, Vec<(u32, u64)>> = BTreeMap::new();
            let mut model: BTreeMap<u64, Vec<(u32, u64)>> = BTreeMap::new();
            for (step, offset, prints) in steps {
                let stored = rows
                    .entry(offset)
                    .or_insert_with(|| prints.iter().enumerate().map(|(i, p)| (i as u32, *p)).collect())
                    .clone();
                match step {
                    Step::Add | Step::Load => {
                        if matches!(step, Step::Add) {
                            index.add_record(0, offset, &stored);
                        } else {
                            index.load_record(0, offset, &stored);
                        }
                        model.entry(offset).or_insert(stored);
                    }
                    Step::Remove => {
                        index.remove_record(0, offset, &stored);
                        model.remove(&offset);
                    }
                    Step::FinishLoading => index.finish_loading(),
                }
            }
            // The index answers for the bits it keeps: the shard and `key_of`.
            let kept = |print: u64| (shard_of(print), key_of(print));
            let mut expected: BTreeMap<(usize, u32), BTreeSet<EventLocation>> = BTreeMap::new();
            for (offset, stored) in &model {
                for (at, print) in stored {
                    expected.entry(kept(*print)).or_default().insert(EventLocation {
                        partition: 0,
                        offset: *offset,
                        index: *at,
                    });
                }
            }
            for shard in 0..4u64 {
                for dropped in 0..3u64 {
                    for low in 0..6u64 {
                        let print = (shard << 62) | (dropped << 40) | low;
                        let found = index.candidates(print);
                        let unique: BTreeSet<EventLocation> = found.iter().copied().collect();
                        proptest::prop_assert_eq!(unique.len(), found.len(), "a location at most once");
                        proptest::prop_assert_eq!(unique, expected.get(&kept(print)).cloned().unwrap_or_default());
                    }
                }
            }
            let size: usize = expected.values().map(BTreeSet::len).sum();
            proptest::prop_assert_eq!(index.len(), size);
        }

        /// The directory finds the first position of any key in any sorted run,
        /// skewed ones included, as a plain binary search does.
        #[test]
        fn directory_search_matches_a_binary_search(
            mut keys in proptest::collection::vec(proptest::prop_oneof![0u32..20, proptest::num::u32::ANY], 0..2_000),
            probes in proptest::collection::vec(proptest::prop_oneof![0u32..20, proptest::num::u32::ANY], 1..20),
        ) {
            keys.sort_unstable();
            let run: Vec<Entry> = keys.iter().map(|k| Entry::new(*k, 0)).collect();
            let directory = Directory::of(&run);
            for key in probes.into_iter().chain(keys.iter().copied()) {
                proptest::prop_assert_eq!(directory.lower_bound(&run, key), keys.partition_point(|k| *k < key));
            }
        }
    }

    #[test]
    fn entries_keep_their_key_and_location() {
        let packed = pack(NARROW_RECORDS - 1, MAX_EVENTS_PER_BATCH as u32 - 1);
        let entry = Entry::new(7, narrow(packed).expect("the highest narrow number fits"));
        assert_eq!((entry.key(), entry.packed()), (7, packed));
        assert!(!entry.is_removed());
        assert_eq!(
            narrow(pack(NARROW_RECORDS, 0)),
            None,
            "one number past it does not"
        );
        assert_eq!(std::mem::size_of::<Entry>(), 8, "no padding");
    }

    #[test]
    fn record_numbers_are_given_out_again_and_high_ones_stay_exact() {
        let index = EventIndex::default();
        index.add_record(0, 1, &[(0, 5)]);
        index.remove_record(0, 1, &[(0, 5)]);
        index.add_record(0, 2, &[(0, 6)]);
        assert_eq!(
            read(&index.records).next_record,
            1,
            "the freed number was reused"
        );
        // Records numbered past what a run's entry holds: kept in `wide`, found,
        // merged around and removed exactly.
        write(&index.records).next_record = NARROW_RECORDS - 1;
        let many: Vec<(u32, u64)> = (0..MERGE_MIN_RECENT as u32 + 1)
            .map(|i| (i, u64::from(i) + 5))
            .collect();
        index.add_record(0, 3, &[(0, 5), (1, 5)]);
        index.add_record(0, 4, &[(0, 5)]);
        index.add_record(0, 5, &many);
        let offsets = |print: u64| {
            let mut found: Vec<u64> = index.candidates(print).iter().map(|l| l.offset).collect();
            found.sort_unstable();
            found
        };
        assert_eq!(offsets(5), vec![3, 3, 4, 5]);
        assert_eq!(offsets(6), vec![2, 5]);
        index.remove_record(0, 4, &[(0, 5)]);
        assert_eq!(offsets(5), vec![3, 3, 5]);
        index.remove_record(0, 3, &[(0, 5), (1, 5)]);
        assert_eq!(offsets(5), vec![5]);
        assert_eq!(index.len(), 1 + many.len());
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
