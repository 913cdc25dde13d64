//! The overlay apply reads and writes through: the projection with the pending
//! writes of the chunk being applied on top, the buckets as last committed, the
//! stored events (the event index plus this chunk's), and the usage records fetched
//! for the chunk. Every context's apply functions take it; the projector
//! (`tally-engine`) creates one per chunk and commits what it holds.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use tally_domain::aggregate::Aggregate;
use tally_domain::ids::{MeterId, StoreId};
use tally_domain::meter::Meter;
use tally_domain::record::Record;
use tally_domain::usage::UsageEvent;
use tally_domain::Mode;
use tally_projection::warm::WarmRead;
use tally_projection::{scan_prefix, ProjectionStore, SharedChange, Visit};

use crate::codec;
use crate::distinct_set::DistinctSet;
use crate::error::EngineError;
use crate::event_index::{self, EventIndex, EventLocation};
use crate::keys::{self, BucketKey, StoredEventsKey};
use crate::meter_cache::MeterCache;
use crate::minute_maps::MinuteMaps;
use crate::outcome::Outcome;
use crate::scan_cache::ScanCache;
use crate::series::{BucketId, SeriesId, SeriesNames};
pub use crate::series::{FastDashMap, FastIndexMap, FastMap};
use crate::sparse_keys::SparseKeys;

/// A record that stores usage events (a usage batch, or an amendment with its
/// replacement at index 0), read back from the log for apply or a query. A usage
/// batch's events are decoded one by one as they are read: most reads back want
/// one event of a record's hundred (docs/benchmarks.md, "One event decoded, not its record's
/// hundred").
#[derive(Debug)]
pub struct StoredBatch {
    pub store_id: String,
    pub mode: Mode,
    events: StoredEvents,
}

/// A stored record's events.
#[derive(Debug)]
enum StoredEvents {
    /// Decoded with the record (an amendment's replacement).
    Decoded(Vec<UsageEvent>),
    /// Each event's encoding (`tally_proto::usage_frames`), decoded on its first
    /// read and kept.
    Framed {
        frames: Vec<Vec<u8>>,
        decoded: Box<[OnceLock<Box<UsageEvent>>]>,
    },
}

impl StoredEvents {
    fn len(&self) -> usize {
        match self {
            StoredEvents::Decoded(events) => events.len(),
            StoredEvents::Framed { frames, .. } => frames.len(),
        }
    }

    /// The event at `index`, `None` past the last; an event that does not decode
    /// is corrupt data.
    fn get(&self, index: usize) -> Result<Option<&UsageEvent>, EngineError> {
        let (frames, decoded) = match self {
            StoredEvents::Decoded(events) => return Ok(events.get(index)),
            StoredEvents::Framed { frames, decoded } => (frames, decoded),
        };
        let (Some(frame), Some(cell)) = (frames.get(index), decoded.get(index)) else {
            return Ok(None);
        };
        if let Some(event) = cell.get() {
            return Ok(Some(event));
        }
        let event = tally_proto::decode_usage_event(frame).map_err(|error| {
            EngineError::Corrupt(format!(
                "event {index} of a log record the event index points at does not decode: {error}"
            ))
        })?;
        // Two readers may decode it at once; both decoded the same bytes.
        Ok(Some(cell.get_or_init(|| Box::new(event))))
    }
}

impl StoredBatch {
    /// The stored events of the record in `payload`, or `None` when it stores none.
    pub fn decode(payload: &[u8]) -> Result<Option<StoredBatch>, EngineError> {
        let corrupt = |error: tally_proto::DecodeError| {
            EngineError::Corrupt(format!(
                "a log record the event index points at does not decode: {error}"
            ))
        };
        if let Some(batch) = tally_proto::usage_frames(payload).map_err(corrupt)? {
            let decoded = batch.events.iter().map(|_| OnceLock::new()).collect();
            return Ok(Some(StoredBatch {
                store_id: batch.store_id,
                mode: batch.mode,
                events: StoredEvents::Framed {
                    frames: batch.events,
                    decoded,
                },
            }));
        }
        match tally_proto::decode_record(payload).map_err(corrupt)? {
            (
                Record::UsageBatch {
                    store_id,
                    mode,
                    events,
                    ..
                },
                _,
            ) => Ok(Some(StoredBatch {
                store_id: store_id.to_string(),
                mode,
                events: StoredEvents::Decoded(events),
            })),
            (
                Record::EventAmended {
                    store_id,
                    mode,
                    replacement,
                    ..
                },
                _,
            ) => Ok(Some(StoredBatch {
                store_id: store_id.to_string(),
                mode,
                events: StoredEvents::Decoded(vec![replacement]),
            })),
            _ => Ok(None),
        }
    }

    /// The record borrowed, as apply reads records of its own chunk.
    pub fn view(&self) -> StoredRef<'_> {
        StoredRef {
            store_id: &self.store_id,
            mode: self.mode,
            events: EventsRef::Stored(&self.events),
        }
    }
}

/// Records fetched for a chunk, by position; `None`: the log holds no usage record
/// there.
pub type Fetched = HashMap<(u32, u64), Option<Arc<StoredBatch>>>;

/// Reads through to the store, with this chunk's pending writes on top.
pub struct Overlay<'a> {
    store: &'a dyn ProjectionStore,
    changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Decoded buckets of this chunk; encoded once at the end (a hot bucket is
    /// touched by many events of one chunk).
    aggregates: FastIndexMap<BucketId, Aggregate>,
    pub cache: Option<&'a mut BucketCache>,
    /// Which sparse rows exist, as committed (`contains` skips the store read when
    /// the answer is certainly no).
    pub sparse: Option<&'a SparseKeys>,
    /// What the record being applied overwrote, newest last: rolled back when apply
    /// refuses the record, so a refused record leaves no trace but its outcome.
    journal: Vec<Undo>,
    /// Stored events as of the last commit (this chunk's are in `new_events`).
    pub index: &'a EventIndex,
    fetched: &'a Fetched,
    /// The usage records of this chunk, by position (read by later records' apply).
    pub chunk: HashMap<(u32, u64), &'a Record>,
    /// Events this chunk stored (`inflight_key` -> where).
    new_events: FastMap<String, EventLocation>,
    /// Decoded distinct-value sets of this chunk (`u`), encoded once at the end.
    distinct_sets: FastIndexMap<BucketId, DistinctSet>,
    /// The series of this chunk's bucket ids when it has no cache (with one, the
    /// cache's names, so ids stay valid from chunk to chunk).
    names: SeriesNames,
    /// `F` rows this chunk deleted, with their events (for the index after commit).
    pub pruned: Vec<StoredRow>,
    /// This chunk deleted a distinct-value key (`U`): the cache's `held_values`
    /// may then name a value the chunk took out, so it is not asked.
    deleted_distinct_value: bool,
    /// The series of each meter's meter-wide buckets (`ALL_CUSTOMERS`), with the
    /// scope it was interned for: every event a meter matches folds into one of
    /// them, and building and interning its ~100-byte key for each was about a
    /// third of the apply thread's key building and interning
    /// (`meter_wide_aggregate`; docs/benchmarks.md, "Fewer keys per chunk, written once").
    meter_wide: FastMap<MeterId, (StoreId, Mode, SeriesId)>,
}

/// The entries on either side of a key (see `Overlay::neighbours`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Neighbours {
    pub before: Option<(Vec<u8>, Vec<u8>)>,
    pub after: Option<(Vec<u8>, Vec<u8>)>,
}

/// One overwritten value of the overlay (`None`: the key was not in the overlay).
enum Undo {
    Change(Vec<u8>, Option<Option<Vec<u8>>>),
    /// The bucket at this index of `aggregates` held this value; `None`: it was
    /// inserted (undone last-in first-out, so it is then the last entry).
    Aggregate(usize, Option<Aggregate>),
    NewEvent(String),
    /// A value added at this position of the distinct set at this index of
    /// `distinct_sets` (sets are never removed from the overlay before the commit,
    /// so indexes hold; undone last-in first-out, so the value is still there).
    DistinctAdded(usize, usize),
    /// The distinct set at this index held these values before it was cleared.
    DistinctCleared(usize, DistinctSet),
    /// This value was taken out of the distinct set at this index (undone by
    /// putting it back: a set keeps its values in order, so it returns to its place).
    DistinctRemoved(usize, Vec<u8>),
    /// The distinct set at this index was inserted empty, unread. Undone by a swap
    /// removal: the journal's older entries name lower indexes, and a set moved
    /// into its place was loaded later (a load is not journaled) or is undone.
    DistinctInserted(usize),
}

/// What adding a value to a bucket's inline distinct set did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DistinctAdd {
    /// The value was there already.
    Present,
    Added,
    /// The set holds `INLINE_DISTINCT_MAX` values: the value goes to its own key.
    Full,
}

/// Why apply did not apply a record.
#[derive(Debug)]
pub enum ApplyError {
    /// The record is refused (bad data, a decision that no longer holds): its outcome
    /// is recorded and the projector moves on.
    Refused(Outcome),
    /// The projection cannot be read or written (fail-stop), or the chunk must wait
    /// for another partition (`NotYetProjected`).
    Engine(EngineError),
}

impl From<EngineError> for ApplyError {
    fn from(error: EngineError) -> Self {
        ApplyError::Engine(error)
    }
}

impl From<Outcome> for ApplyError {
    fn from(outcome: Outcome) -> Self {
        ApplyError::Refused(outcome)
    }
}

/// Usage buckets as last committed, kept by the projector so a bucket touched again
/// in a later chunk is not read back from the store. The projector is the only writer
/// of buckets and updates this only after a successful commit, so it never holds a
/// value the store does not.
///
/// It also knows, per series (one meter and customer: a bucket key without its
/// table byte and minute), the newest minute the store holds a bucket of, so the
/// first event of a new minute does not look up a bucket that cannot exist (in a
/// profile of the ingest benchmark those lookups were a fifth of the server's CPU).
/// The map is kept only while it is `complete` (the cache started over a
/// projection with no bucket at all, and every commit since updated it), so "newer
/// than the newest known minute", or "a series it does not know", always means "not
/// in the store". A cache that started over stored buckets, or was emptied, reads
/// every bucket it does not hold. Distinct sets (`u`) are written with their
/// minute's bucket, so the same knowledge answers for them.
#[derive(Debug, Default)]
pub struct BucketCache {
    /// The series of every id below and of the overlays working over this cache.
    names: SeriesNames,
    pub buckets: MinuteMaps<Aggregate>,
    /// Distinct sets (`u`) as last committed, for the same reason as `buckets`:
    /// a set touched again by a later chunk is not read back (in a profile those
    /// reads, and the page reclamation sled does inside them, were a tenth of the
    /// server's CPU).
    pub distinct: MinuteMaps<DistinctSet>,
    /// What `distinct` weighs (`distinct_weight`), all sets together.
    distinct_bytes: usize,
    pub newest: FastMap<SeriesId, i64>,
    /// `newest` names every series the store holds buckets of.
    pub complete: bool,
    /// Values the meter-wide distinct buckets hold (their `U` keys) as last
    /// committed, by bucket (`BucketId` of table `U`). Every event of a `unique`
    /// meter puts its value's key in the meter-wide bucket; under ingest nearly all
    /// of those keys exist already (a minute's values repeat), and each rewrite went
    /// through the overlay, the write-back layer and the next checkpoint: ~16% of
    /// the keys a chunk wrote. A value found here is not written again. Only
    /// "held" is ever answered from here: a value not found is written as before.
    held_values: MinuteMaps<HashSet<Box<[u8]>, foldhash::fast::RandomState>>,
    /// Values in `held_values`, all buckets together.
    held_value_count: usize,
    /// Meter definitions as committed, decoded once (`Overlay::shared_meter`).
    meters: MeterCache,
    /// Scans of small tables as committed (`Overlay::committed_scan`).
    scans: ScanCache,
}

/// Buckets kept in the cache (bounds memory: ~100 B each, a map slot of a bucket id
/// and its aggregate). When a commit would pass it, the buckets of the oldest
/// minutes are dropped first (`evict_oldest_minutes`): usage arrives mostly for the
/// current minute, and with 10,000 customers and 20 meters one minute alone holds
/// ~200,000 buckets, so emptying the whole cache (as it once did) sent every later
/// fold back to sled and the ingest rate fell by half within a minute. Room for
/// two such minutes; each minute is its own map (`MinuteMaps`), so dropping one
/// frees its table instead of leaving tombstones that made one table of every
/// minute double to 2^20 slots (~100 MB; docs/benchmarks.md, "The bucket cache's
/// table, one per minute").
pub const MAX_CACHED_BUCKETS: usize = 450_000;
/// What eviction leaves of a cap (in percent): room for the next minutes' buckets,
/// so a full cache is not scanned again on every commit.
const EVICT_TO_PERCENT: usize = 75;
/// Bytes the cache's distinct sets may hold (bounds memory), evicted oldest minute
/// first too. A value weighs its bytes plus eight (`DistinctSet`). A miss costs
/// little while the set is in the write-back layer (a look-up and one validated
/// copy), so this only spares sets that went to sled a read: ingest's realistic
/// load (10,000 customers, ~30,000 events/s) puts ~35 MiB of values into one
/// minute's 50,000 sets and touches each every few seconds, and holding 48 MiB
/// instead of 4 MiB made no difference its runs could see (docs/benchmarks.md, "Distinct sets
/// kept as their encoding").
pub const MAX_CACHED_DISTINCT_BYTES: usize = 16 << 20;
/// Values of meter-wide distinct buckets the cache knows to be held
/// (`BucketCache::held_values`; bounds memory: ~80 B each), evicted oldest minute
/// first. The ingest benchmark's five `unique` meters of 1,000 users hold 5,000 a
/// minute; a value evicted is only written again once.
pub const MAX_KNOWN_DISTINCT_VALUES: usize = 200_000;
/// Series interned (and whose newest minute is kept) before the cache is emptied
/// (bounds memory: ~150 B each; an emptied cache costs one store scan per series
/// touched again, and a read of each bucket).
pub const MAX_KNOWN_SERIES: usize = 400_000;

impl BucketCache {
    /// A cache over a projection: `complete` when it holds no bucket.
    pub fn over(store: &dyn ProjectionStore) -> Result<BucketCache, EngineError> {
        let mut any = false;
        scan_prefix(store, &[keys::AGGREGATE], false, &mut |_, _| {
            any = true;
            Visit::Stop
        })?;
        Ok(BucketCache {
            complete: !any,
            ..BucketCache::default()
        })
    }

    /// A cache over a projection known to hold no bucket (`complete`).
    pub fn for_empty_store() -> BucketCache {
        BucketCache {
            complete: true,
            ..BucketCache::default()
        }
    }

    /// Whether the meter-wide distinct bucket `bucket` held `value` at the last commit.
    fn holds_value(&self, bucket: BucketId, value: &[u8]) -> bool {
        self.held_values
            .get(&bucket)
            .is_some_and(|values| values.contains(value))
    }

    /// The committed distinct set at `key`, moved out of the cache.
    fn take_distinct(&mut self, key: &BucketId) -> Option<DistinctSet> {
        let set = self.distinct.remove(key)?;
        self.distinct_bytes -= distinct_weight(&set);
        Some(set)
    }

    /// Brings the cache up to a commit: its buckets, and (while `complete`) the
    /// newest minute of each of their series.
    pub fn absorb(&mut self, committed: &mut Committed) {
        // Emptied whole, names and all: the commit's ids are then dropped with the
        // rest (it is in the store already), and the emptied cache is no longer
        // `complete`, so it reads what it does not hold.
        if self.names.len() > MAX_KNOWN_SERIES {
            *self = BucketCache::default();
            committed.buckets.clear();
            committed.distinct_sets.clear();
            committed.distinct_values.clear();
            return;
        }
        if self.buckets.len() + committed.buckets.len() > MAX_CACHED_BUCKETS {
            self.buckets
                .evict_oldest_minutes(eviction_target(MAX_CACHED_BUCKETS), |_| 1);
        }
        if self.complete {
            for bucket in committed.buckets.keys() {
                let newest = self.newest.entry(bucket.series).or_insert(bucket.minute);
                *newest = (*newest).max(bucket.minute);
            }
        }
        for (id, aggregate) in committed.buckets.drain(..) {
            self.buckets.insert(id, aggregate);
        }
        self.absorb_held_values(&mut committed.distinct_values);
        let incoming: usize = committed.distinct_sets.values().map(distinct_weight).sum();
        if self.distinct_bytes + incoming > MAX_CACHED_DISTINCT_BYTES {
            self.distinct_bytes = self
                .distinct
                .evict_oldest_minutes(eviction_target(MAX_CACHED_DISTINCT_BYTES), distinct_weight);
        }
        for (key, mut set) in committed.distinct_sets.drain(..) {
            set.shrink_to_fit();
            self.distinct_bytes += distinct_weight(&set);
            if let Some(old) = self.distinct.insert(key, set) {
                self.distinct_bytes -= distinct_weight(&old);
            }
        }
    }
}

impl BucketCache {
    /// Learns which meter-wide distinct values a commit wrote or deleted.
    fn absorb_held_values(&mut self, changed: &mut Vec<(BucketId, Box<[u8]>, bool)>) {
        let added = changed.iter().filter(|(_, _, held)| *held).count();
        if self.held_value_count + added > MAX_KNOWN_DISTINCT_VALUES {
            self.held_value_count = self
                .held_values
                .evict_oldest_minutes(eviction_target(MAX_KNOWN_DISTINCT_VALUES), |v| v.len());
        }
        for (bucket, value, held) in changed.drain(..) {
            let values = self.held_values.get_or_default(bucket);
            let known = if held {
                values.insert(value)
            } else {
                values.remove(&value)
            };
            match (known, held) {
                (true, true) => self.held_value_count += 1,
                (true, false) => self.held_value_count -= 1,
                _ => {}
            }
        }
    }
}

/// What a cached distinct set costs: its heap bytes and its map entry.
fn distinct_weight(set: &DistinctSet) -> usize {
    set.weight() + std::mem::size_of::<(BucketId, DistinctSet)>()
}

/// What eviction leaves of a cache's cap (`EVICT_TO_PERCENT` of it): the caches
/// drop their oldest minutes whole (`MinuteMaps::evict_oldest_minutes`).
fn eviction_target(cap: usize) -> usize {
    cap / 100 * EVICT_TO_PERCENT
}

impl<'a> Overlay<'a> {
    pub fn new(
        store: &'a dyn ProjectionStore,
        index: &'a EventIndex,
        fetched: &'a Fetched,
    ) -> Self {
        Overlay {
            store,
            cache: None,
            sparse: None,
            changes: BTreeMap::new(),
            aggregates: FastIndexMap::default(),
            journal: Vec::new(),
            index,
            fetched,
            chunk: HashMap::new(),
            new_events: FastMap::default(),
            distinct_sets: FastIndexMap::default(),
            names: SeriesNames::default(),
            pruned: Vec::new(),
            deleted_distinct_value: false,
            meter_wide: FastMap::default(),
        }
    }

    /// The names bucket ids of this overlay refer to.
    fn names(&mut self) -> &mut SeriesNames {
        match self.cache.as_deref_mut() {
            Some(cache) => &mut cache.names,
            None => &mut self.names,
        }
    }

    /// The id of a bucket or distinct-set key.
    fn bucket_id(&mut self, key: &[u8]) -> Result<BucketId, EngineError> {
        self.names().bucket(key).ok_or_else(|| {
            EngineError::Corrupt(format!("{key:?} is not a bucket or distinct-set key"))
        })
    }

    /// The usage record at a position: one of this chunk's, or one fetched for it.
    pub fn batch_at(&self, partition: u32, offset: u64) -> Result<StoredRef<'a>, EngineError> {
        // Borrowed for the chunk's lifetime, not the overlay's: a rebuild holds the
        // events it reads while it writes the overlay, without cloning them.
        let fetched: &'a Fetched = self.fetched;
        if let Some((store_id, mode, events)) = self
            .chunk
            .get(&(partition, offset))
            .copied()
            .and_then(Record::stored_events)
        {
            return Ok(StoredRef {
                store_id,
                mode,
                events: EventsRef::Chunk(events),
            });
        }
        match fetched.get(&(partition, offset)) {
            Some(Some(batch)) => Ok(batch.view()),
            Some(None) => Err(EngineError::Corrupt(format!(
                "the event index points at partition {partition} offset {offset}, where the log holds no usage record"
            ))),
            None => Err(EngineError::RecordsNeeded(vec![(partition, offset)])),
        }
    }

    /// The stored event `event_id` of a scope, if any: this chunk's, else the first
    /// committed candidate whose id matches exactly.
    pub fn stored_event(
        &self,
        store_id: &str,
        mode: Mode,
        event_id: &str,
    ) -> Result<Option<UsageEvent>, EngineError> {
        Ok(self
            .stored_event_at(store_id, mode, event_id)?
            .map(|(event, _)| event))
    }

    /// `stored_event`, with where it lies: the record that stored it (a void asks
    /// whether that record's usage was settled in credits).
    pub fn stored_event_at(
        &self,
        store_id: &str,
        mode: Mode,
        event_id: &str,
    ) -> Result<Option<(UsageEvent, EventLocation)>, EngineError> {
        let key = inflight_key(store_id, mode, event_id);
        let print = self.index.fingerprint(store_id, mode, event_id);
        Ok(self
            .locate_stored(&key, print, store_id, mode, event_id)?
            .map(|(event, location)| (event.clone(), location)))
    }

    /// `stored_event` given the id's in-flight key and fingerprint (apply computes
    /// them once per event and keeps them for the event it stores), borrowed.
    pub fn find_stored(
        &self,
        key: &str,
        print: u64,
        store_id: &str,
        mode: Mode,
        event_id: &str,
    ) -> Result<Option<&UsageEvent>, EngineError> {
        Ok(self
            .locate_stored(key, print, store_id, mode, event_id)?
            .map(|(event, _)| event))
    }

    fn locate_stored(
        &self,
        key: &str,
        print: u64,
        store_id: &str,
        mode: Mode,
        event_id: &str,
    ) -> Result<Option<(&UsageEvent, EventLocation)>, EngineError> {
        let chunk = self.new_events.get(key).copied();
        let mut missing = Vec::new();
        for location in chunk.into_iter().chain(self.index.candidates(print)) {
            if self.pruned.iter().any(|(key, _)| {
                (key.partition, key.offset) == (location.partition, location.offset)
            }) {
                continue;
            }
            match self.batch_at(location.partition, location.offset) {
                Ok(batch) => {
                    if let Some(event) = batch.event_if(store_id, mode, event_id, location.index)? {
                        return Ok(Some((event, location)));
                    }
                }
                Err(EngineError::RecordsNeeded(positions)) => missing.extend(positions),
                Err(error) => return Err(error),
            }
        }
        if missing.is_empty() {
            Ok(None)
        } else {
            Err(EngineError::RecordsNeeded(missing))
        }
    }

    pub fn note_stored(&mut self, key: String, location: EventLocation) {
        self.new_events.insert(key.clone(), location);
        self.journal.push(Undo::NewEvent(key));
    }

    /// Forgets the journal: the record applied so far stays.
    pub fn keep(&mut self) {
        self.journal.clear();
    }

    /// Undoes everything since the last `keep`.
    pub fn roll_back(&mut self) {
        self.roll_back_to(0);
    }

    /// Where the record's apply stands: `roll_back_to` it undoes what came after,
    /// so a part of a record can be refused while the rest of it stays (a purchase's
    /// credits that its account cannot take, the purchase itself kept).
    pub fn savepoint(&self) -> usize {
        self.journal.len()
    }

    /// Undoes everything since `savepoint` answered `mark`.
    pub fn roll_back_to(&mut self, mark: usize) {
        while self.journal.len() > mark {
            let Some(undo) = self.journal.pop() else {
                break;
            };
            match undo {
                Undo::Change(key, Some(previous)) => {
                    self.changes.insert(key, previous);
                }
                Undo::Change(key, None) => {
                    self.changes.remove(&key);
                }
                Undo::Aggregate(index, Some(previous)) => {
                    if let Some((_, aggregate)) = self.aggregates.get_index_mut(index) {
                        *aggregate = previous;
                    }
                }
                Undo::Aggregate(index, None) => {
                    self.aggregates.swap_remove_index(index);
                }
                Undo::NewEvent(key) => {
                    self.new_events.remove(&key);
                }
                Undo::DistinctAdded(index, position) => {
                    if let Some((_, set)) = self.distinct_sets.get_index_mut(index) {
                        set.remove_at(position);
                    }
                }
                Undo::DistinctCleared(index, values) => {
                    if let Some((_, set)) = self.distinct_sets.get_index_mut(index) {
                        *set = values;
                    }
                }
                Undo::DistinctRemoved(index, value) => {
                    if let Some((_, set)) = self.distinct_sets.get_index_mut(index) {
                        set.insert(&value);
                    }
                }
                Undo::DistinctInserted(index) => {
                    self.distinct_sets.swap_remove_index(index);
                }
            }
        }
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError> {
        match self.changes.get(key) {
            Some(value) => Ok(value.clone()),
            None if self.sparse.is_some_and(|sparse| !sparse.may_hold(key)) => Ok(None),
            None => Ok(self.store.get(key)?),
        }
    }

    /// The meter at `key` (`keys::meter_key`) as this chunk sees it, shared: a
    /// definition this chunk has not written is decoded once and kept in the cache
    /// until a commit writes it (`crate::meter_cache`).
    pub fn shared_meter(&mut self, key: &[u8]) -> Result<Option<Arc<Meter>>, EngineError> {
        if let Some(value) = self.changes.get(key) {
            return value
                .as_deref()
                .map(|bytes| codec::decode_meter(bytes).map(Arc::new))
                .transpose();
        }
        if let Some(meter) = self.cache.as_deref().and_then(|c| c.meters.meter(key)) {
            return Ok(Some(meter));
        }
        let Some(bytes) = self.store.get(key)? else {
            return Ok(None);
        };
        let meter = Arc::new(codec::decode_meter(&bytes)?);
        if let Some(cache) = self.cache.as_deref_mut() {
            cache.meters.note_meter(key, meter.clone());
        }
        Ok(Some(meter))
    }

    /// The revised meters of the scope whose revised-meter rows start with
    /// `prefix`, as committed, when the cache knows them and this chunk wrote no
    /// meter or revision row (else the caller reads them and may `note_revised`).
    pub fn committed_revised(&self, prefix: &[u8]) -> Option<Vec<Arc<Meter>>> {
        if self.writes_definitions() {
            return None;
        }
        self.cache.as_deref()?.meters.revised(prefix)
    }

    /// Notes a scope's revised meters as read by `committed_revised`'s caller; kept
    /// only when they are the committed ones (this chunk wrote no definition).
    pub fn note_revised(&mut self, prefix: &[u8], meters: &[Arc<Meter>]) {
        if self.writes_definitions() {
            return;
        }
        if let Some(cache) = self.cache.as_deref_mut() {
            cache.meters.note_revised(prefix, meters.to_vec());
        }
    }

    /// Whether this chunk wrote a meter or revision row.
    fn writes_definitions(&self) -> bool {
        definition_writes(&self.changes).next().is_some()
    }

    /// `prefix_entries` of a table whose scans the cache keeps
    /// (`crate::scan_cache`): the store's entries are taken from the cache when it
    /// holds them, else scanned and noted; this chunk's writes go on top as ever.
    pub fn committed_scan(
        &mut self,
        prefix: &[u8],
    ) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        if !ScanCache::keeps(prefix) {
            return self.prefix_entries(prefix);
        }
        let cached = self.cache.as_deref().and_then(|c| c.scans.scan(prefix));
        let committed = match cached {
            Some(entries) => entries,
            None => {
                let entries = Arc::new(self.stored_entries_where(prefix, |_| true)?);
                if let Some(cache) = self.cache.as_deref_mut() {
                    cache.scans.note_scan(prefix, entries.clone());
                }
                entries
            }
        };
        let mut entries = (*committed).clone();
        self.put_changes_on(prefix, &mut entries, |_| true);
        Ok(entries)
    }

    /// Every entry under `prefix`: the store's, with this chunk's writes on top.
    pub fn prefix_entries(&self, prefix: &[u8]) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        self.prefix_entries_where(prefix, |_| true)
    }

    /// `prefix_entries` keeping only the entries whose key passes `keep`: a sweep
    /// over a large table holds only what it selects.
    pub fn prefix_entries_where(
        &self,
        prefix: &[u8],
        keep: impl Fn(&[u8]) -> bool,
    ) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        let mut entries = self.stored_entries_where(prefix, &keep)?;
        self.put_changes_on(prefix, &mut entries, keep);
        Ok(entries)
    }

    /// The store's entries under `prefix` whose key passes `keep` (this chunk's
    /// writes left out).
    fn stored_entries_where(
        &self,
        prefix: &[u8],
        keep: impl Fn(&[u8]) -> bool,
    ) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        let mut entries = BTreeMap::new();
        scan_prefix(self.store, prefix, false, &mut |k, v| {
            if keep(k) {
                entries.insert(k.to_vec(), v.to_vec());
            }
            Visit::Continue
        })?;
        Ok(entries)
    }

    /// Puts this chunk's writes under `prefix` on top of `entries` (those whose key
    /// passes `keep`; a deletion takes the entry out).
    fn put_changes_on(
        &self,
        prefix: &[u8],
        entries: &mut BTreeMap<Vec<u8>, Vec<u8>>,
        keep: impl Fn(&[u8]) -> bool,
    ) {
        for (key, value) in self.changes.range(prefix.to_vec()..) {
            if !key.starts_with(prefix) {
                break;
            }
            match value {
                Some(v) if keep(key) => entries.insert(key.clone(), v.clone()),
                Some(_) => None,
                None => entries.remove(key),
            };
        }
    }

    /// The first `limit` entries under `prefix`, in key order, this chunk's writes
    /// included: reads no more of the store than it may need.
    pub fn first_entries(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        let pending: Vec<(&Vec<u8>, &Option<Vec<u8>>)> = self
            .changes
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .collect();
        // Enough store entries that `limit` survive this chunk's deletions.
        let wanted = limit + pending.iter().filter(|(_, v)| v.is_none()).count();
        let mut entries = BTreeMap::new();
        let mut seen = 0;
        scan_prefix(self.store, prefix, false, &mut |k, v| {
            entries.insert(k.to_vec(), v.to_vec());
            seen += 1;
            if seen >= wanted {
                Visit::Stop
            } else {
                Visit::Continue
            }
        })?;
        for (key, value) in pending {
            match value {
                Some(v) => entries.insert(key.clone(), v.clone()),
                None => entries.remove(key),
            };
        }
        Ok(entries.into_iter().take(limit).collect())
    }

    /// Every entry with a key from `start` up to (not including) `end`: the store's,
    /// with this chunk's writes on top.
    pub fn range_entries(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        let mut entries = BTreeMap::new();
        if start >= end {
            return Ok(entries);
        }
        let bounds = (
            std::ops::Bound::Included(start),
            std::ops::Bound::Excluded(end),
        );
        self.store.scan(bounds.0, bounds.1, false, &mut |k, v| {
            entries.insert(k.to_vec(), v.to_vec());
            Visit::Continue
        })?;
        for (key, value) in self.changes.range::<[u8], _>(bounds) {
            match value {
                Some(v) => entries.insert(key.clone(), v.clone()),
                None => entries.remove(key),
            };
        }
        Ok(entries)
    }

    /// The entries nearest `key` under `prefix` on each side (`key` itself left
    /// out), this chunk's writes included: what an event arriving out of order sits
    /// between in a time-ordered table.
    pub fn neighbours(&self, prefix: &[u8], key: &[u8]) -> Result<Neighbours, EngineError> {
        let end = tally_projection::prefix_end(prefix);
        let end_bound = match &end {
            Some(end) => std::ops::Bound::Excluded(end.as_slice()),
            None => std::ops::Bound::Unbounded,
        };
        let live = |k: &[u8]| !matches!(self.changes.get(k), Some(None));
        let mut before = None;
        self.store.scan(
            std::ops::Bound::Included(prefix),
            std::ops::Bound::Excluded(key),
            true,
            &mut |k, v| {
                if live(k) {
                    before = Some((k.to_vec(), v.to_vec()));
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            },
        )?;
        let mut after = None;
        self.store.scan(
            std::ops::Bound::Excluded(key),
            end_bound,
            false,
            &mut |k, v| {
                if live(k) {
                    after = Some((k.to_vec(), v.to_vec()));
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            },
        )?;
        let pending_before = self
            .changes
            .range::<[u8], _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Excluded(key),
            ))
            .rev()
            .find_map(|(k, v)| v.as_ref().map(|v| (k.clone(), v.clone())));
        let pending_after = self
            .changes
            .range::<[u8], _>((std::ops::Bound::Excluded(key), end_bound))
            .find_map(|(k, v)| v.as_ref().map(|v| (k.clone(), v.clone())));
        // `b` is this chunk's: it wins over the store's entry of the same key.
        let nearer = |a: Option<(Vec<u8>, Vec<u8>)>, b: Option<(Vec<u8>, Vec<u8>)>, later: bool| {
            match (a, b) {
                (Some(a), Some(b)) if a.0 != b.0 && (a.0 > b.0) == later => Some(a),
                (a, b) => b.or(a),
            }
        };
        Ok(Neighbours {
            before: nearer(before, pending_before, true),
            after: nearer(after, pending_after, false),
        })
    }

    /// Makes `reads` against the store ahead, several at once, so the reads apply
    /// then makes of them one by one find their pages in memory
    /// (`tally_projection::warm`). What this chunk wrote needs no read; nor do
    /// sparse rows the committed set says are absent.
    pub fn warm(&self, reads: &mut Vec<WarmRead>) {
        reads.sort_unstable();
        reads.dedup();
        reads.retain(|read| match read {
            WarmRead::Key(key) => {
                !self.changes.contains_key(key)
                    && self.sparse.is_none_or(|sparse| sparse.may_hold(key))
            }
            WarmRead::Prefix(_) => true,
        });
        tally_projection::warm::warm(self.store, reads);
    }

    pub fn contains(&self, key: &[u8]) -> Result<bool, EngineError> {
        if let Some(value) = self.changes.get(key) {
            return Ok(value.is_some());
        }
        if self.sparse.is_some_and(|sparse| !sparse.may_hold(key)) {
            return Ok(false);
        }
        Ok(self.store.get(key)?.is_some())
    }

    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.set(key, Some(value));
    }

    pub fn delete(&mut self, key: Vec<u8>) {
        self.set(key, None);
    }

    fn set(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        if value.is_none() && key.first() == Some(&keys::UNIQUE) {
            self.deleted_distinct_value = true;
        }
        let previous = self.changes.insert(key.clone(), value);
        self.journal.push(Undo::Change(key, previous));
    }

    /// The bucket at `key` as this chunk sees it (no change made).
    pub fn aggregate(&mut self, key: &[u8]) -> Result<Aggregate, EngineError> {
        let id = self.bucket_id(key)?;
        match self.aggregates.get(&id) {
            Some(aggregate) => Ok(*aggregate),
            None => self.committed_aggregate(id, key),
        }
    }

    /// The bucket `id` (at `key`) as committed: the cache's, else the store's.
    fn committed_aggregate(&mut self, id: BucketId, key: &[u8]) -> Result<Aggregate, EngineError> {
        if let Some(aggregate) = self.cache.as_deref().and_then(|c| c.buckets.get(&id)) {
            return Ok(*aggregate);
        }
        if self.absent_from_store(id) {
            return Ok(Aggregate::default());
        }
        match self.store.get(key)? {
            Some(bytes) => codec::decode_aggregate(&bytes),
            None => Ok(Aggregate::default()),
        }
    }

    /// The inline distinct set at `key` as this chunk sees it (a copy; no change
    /// made, so a set only read is not written back).
    pub fn distinct_values(&mut self, key: &[u8]) -> Result<DistinctSet, EngineError> {
        let id = self.bucket_id(key)?;
        if let Some(set) = self.distinct_sets.get(&id) {
            return Ok(set.clone());
        }
        let stored = match self.changes.get(key) {
            Some(value) => value.clone(),
            None => {
                if let Some(set) = self.cache.as_deref().and_then(|c| c.distinct.get(&id)) {
                    return Ok(set.clone());
                }
                if self.absent_from_store(id) {
                    None
                } else {
                    self.store.get(key)?
                }
            }
        };
        match stored {
            Some(bytes) => codec::decode_distinct_set(bytes),
            None => Ok(DistinctSet::default()),
        }
    }

    pub fn aggregate_mut(&mut self, key: Vec<u8>) -> Result<&mut Aggregate, EngineError> {
        Ok(self.aggregate_entry(key)?.1)
    }

    /// `aggregate_mut`, with the bucket's id.
    pub fn aggregate_entry(
        &mut self,
        key: Vec<u8>,
    ) -> Result<(BucketId, &mut Aggregate), EngineError> {
        let id = self.bucket_id(&key)?;
        self.aggregate_by_id(id, || key)
    }

    /// `aggregate_entry` of the meter-wide bucket (`ALL_CUSTOMERS`) of `meter` at
    /// `minute`, whose key `key()` builds: its series is interned once per meter
    /// and chunk, and the key is built only when the bucket is read.
    pub fn meter_wide_aggregate(
        &mut self,
        meter: &Meter,
        minute: i64,
        key: impl Fn() -> Vec<u8>,
    ) -> Result<(BucketId, &mut Aggregate), EngineError> {
        let known = self
            .meter_wide
            .get(&meter.id)
            .filter(|(store_id, mode, _)| *store_id == meter.store_id && *mode == meter.mode)
            .map(|(_, _, series)| *series);
        let id = match known {
            Some(series) => BucketId {
                table: keys::AGGREGATE,
                series,
                minute,
            },
            None => {
                let id = self.bucket_id(&key())?;
                self.meter_wide.insert(
                    meter.id.clone(),
                    (meter.store_id.clone(), meter.mode, id.series),
                );
                id
            }
        };
        self.aggregate_by_id(id, &key)
    }

    /// The bucket `id` for writing; `key()` builds its key if it must be read.
    fn aggregate_by_id(
        &mut self,
        id: BucketId,
        key: impl FnOnce() -> Vec<u8>,
    ) -> Result<(BucketId, &mut Aggregate), EngineError> {
        let (index, previous) = match self.aggregates.get_full(&id) {
            Some((index, _, aggregate)) => (index, Some(*aggregate)),
            None => {
                let current = self.committed_aggregate(id, &key())?;
                (self.aggregates.insert_full(id, current).0, None)
            }
        };
        self.journal.push(Undo::Aggregate(index, previous));
        self.aggregates
            .get_index_mut(index)
            .map(|(_, aggregate)| (id, aggregate))
            .ok_or_else(|| EngineError::Corrupt("bucket vanished from the overlay".into()))
    }

    /// Empties the bucket at `key` without reading it, where the caller knows every
    /// event it held is gone (a void of a customer's only event of its minute); an
    /// empty bucket is deleted at the commit, and a refused record restores it.
    pub fn empty_aggregate(&mut self, key: Vec<u8>) -> Result<(), EngineError> {
        let id = self.bucket_id(&key)?;
        let (index, previous) = match self.aggregates.get_full(&id) {
            Some((index, _, aggregate)) => (index, Some(*aggregate)),
            None => (
                self.aggregates.insert_full(id, Aggregate::default()).0,
                None,
            ),
        };
        self.journal.push(Undo::Aggregate(index, previous));
        if let Some((_, aggregate)) = self.aggregates.get_index_mut(index) {
            *aggregate = Aggregate::default();
        }
        Ok(())
    }

    /// Puts a meter-wide distinct value's key (`key()`, empty value) unless the
    /// cache knows `bucket` (its `U` bucket id) held `value` at the last commit and
    /// this chunk deleted no such key: a rewrite would change nothing.
    pub fn put_distinct_value(
        &mut self,
        bucket: BucketId,
        value: &[u8],
        key: impl FnOnce() -> Vec<u8>,
    ) {
        let held = !self.deleted_distinct_value
            && self
                .cache
                .as_deref()
                .is_some_and(|cache| cache.holds_value(bucket, value));
        if !held {
            self.put(key(), Vec::new());
        }
    }

    /// Whether the store cannot hold the bucket or distinct set `id`: the cache
    /// knows its series and the minute is newer than the newest stored one, or the
    /// cache is `complete` and does not know the series. Anything else is read
    /// (`store.get`, which answers from the write-back layer first). A series
    /// unknown to an incomplete cache (every series after a start over a store
    /// that holds buckets) was once learned with a backward walk of sled's tree to
    /// its last key; that walk clones sled's node and was a third of the catch-up's
    /// apply thread after a SIGKILL, where a point read costs less and finds the
    /// bucket it needs (docs/benchmarks.md, "A restart's catch-up reads buckets, not series").
    fn absent_from_store(&self, id: BucketId) -> bool {
        let Some(cache) = self.cache.as_deref() else {
            return false;
        };
        match cache.newest.get(&id.series) {
            Some(newest) => id.minute > *newest,
            None => cache.complete,
        }
    }

    /// Adds `value` to the inline distinct set at `key` (a `u` key), unless it is
    /// there or the set is full.
    pub fn add_distinct(&mut self, key: Vec<u8>, value: &[u8]) -> Result<DistinctAdd, EngineError> {
        let (index, set) = self.distinct_set_mut(key)?;
        if set.len() >= codec::INLINE_DISTINCT_MAX {
            return Ok(match set.contains(value) {
                true => DistinctAdd::Present,
                false => DistinctAdd::Full,
            });
        }
        match set.insert(value) {
            Some(position) => {
                self.journal.push(Undo::DistinctAdded(index, position));
                Ok(DistinctAdd::Added)
            }
            None => Ok(DistinctAdd::Present),
        }
    }

    /// Takes `value` out of the inline distinct set at `key` (a void of the only
    /// event that held it); whether the set held it (a value that came past a full
    /// set has its own key instead).
    pub fn remove_distinct(&mut self, key: Vec<u8>, value: &[u8]) -> Result<bool, EngineError> {
        let (index, set) = self.distinct_set_mut(key)?;
        if !set.remove(value) {
            return Ok(false);
        }
        self.journal
            .push(Undo::DistinctRemoved(index, value.to_vec()));
        Ok(true)
    }

    /// The inline distinct set at `key` for a change, loaded first if needed, with
    /// its index in `distinct_sets` (what the journal names).
    fn distinct_set_mut(&mut self, key: Vec<u8>) -> Result<(usize, &mut DistinctSet), EngineError> {
        let index = self.distinct_set_index(key)?;
        let (_, set) = self
            .distinct_sets
            .get_index_mut(index)
            .ok_or_else(|| EngineError::Corrupt("distinct set vanished from the overlay".into()))?;
        Ok((index, set))
    }

    /// Empties the inline distinct set at `key` (a void rebuilding its bucket); an
    /// emptied set is deleted at the commit.
    pub fn clear_distinct(&mut self, key: Vec<u8>) -> Result<(), EngineError> {
        let index = self.distinct_set_index(key)?;
        if let Some((_, set)) = self.distinct_sets.get_index_mut(index) {
            let values = std::mem::take(set);
            self.journal.push(Undo::DistinctCleared(index, values));
        }
        Ok(())
    }

    /// Empties the inline distinct set at `key` without reading it, where the
    /// caller knows it never held more than the inline set (a void of a customer's
    /// only event of its minute: a set of one value); deleted at the commit, and a
    /// refused record restores it (the cache then misses it and reads the store).
    pub fn empty_distinct(&mut self, key: Vec<u8>) -> Result<(), EngineError> {
        let id = self.bucket_id(&key)?;
        if self.distinct_sets.contains_key(&id) {
            return self.clear_distinct(key);
        }
        if let Some(cache) = self.cache.as_deref_mut() {
            // The commit puts back only sets that are not empty: one left in the
            // cache would outlive its deletion.
            cache.take_distinct(&id);
        }
        let (index, _) = self.distinct_sets.insert_full(id, DistinctSet::default());
        self.journal.push(Undo::DistinctInserted(index));
        Ok(())
    }

    /// The index in `distinct_sets` of the set at `key`, loaded first if needed.
    fn distinct_set_index(&mut self, key: Vec<u8>) -> Result<usize, EngineError> {
        let id = self.bucket_id(&key)?;
        Ok(match self.distinct_sets.get_index_of(&id) {
            Some(index) => index,
            None => {
                // The chunk's own write, if any, is newer than the committed cache. The
                // set is taken out of the cache rather than copied (a value is an
                // allocation); the commit puts it back, and a chunk that fails leaves a
                // miss, which reads the store.
                let cached = if self.changes.contains_key(&key) {
                    None
                } else {
                    self.cache.as_deref_mut().and_then(|c| c.take_distinct(&id))
                };
                let current = match cached {
                    Some(set) => set,
                    None => {
                        let stored = match self.changes.get(&key).cloned() {
                            Some(value) => value,
                            None if self.absent_from_store(id) => None,
                            None => self.store.get(&key)?,
                        };
                        match stored {
                            Some(bytes) => codec::decode_distinct_set(bytes)?,
                            None => Default::default(),
                        }
                    }
                };
                self.distinct_sets.insert_full(id, current).0
            }
        })
    }

    /// The batch to commit, and what the caches learn from it.
    pub fn into_changes(mut self) -> Result<Committed, EngineError> {
        if let Some(cache) = self.cache.as_deref_mut() {
            cache
                .meters
                .forget_written(definition_writes(&self.changes));
            cache
                .scans
                .forget_written(self.changes.keys().map(Vec::as_slice));
        }
        let mut stored = Vec::new();
        for (key, value) in self
            .changes
            .range(vec![keys::STORED_EVENTS]..vec![keys::STORED_EVENTS + 1])
        {
            if let Some(value) = value {
                stored.push((
                    StoredEventsKey::decode(key)?,
                    event_index::decode_stored(value)?,
                ));
            }
        }
        // Buckets and sets follow the other writes (a later write of a key wins), not
        // merged into their ordered map: the store takes a batch in any order.
        let names = match self.cache {
            Some(cache) => &cache.names,
            None => &self.names,
        };
        // Keys and values are written into these buffers and shared from there:
        // one allocation each, in the form the write-back layer keeps
        // (`ProjectionStore::apply_shared`).
        let (mut key, mut value) = (Vec::new(), Vec::new());
        let mut key_of = |id: &BucketId| -> Result<Arc<[u8]>, EngineError> {
            names
                .write_key(*id, &mut key)
                .ok_or_else(|| EngineError::Corrupt("a bucket's series was not interned".into()))?;
            Ok(Arc::from(&key[..]))
        };
        let mut distinct_values = Vec::new();
        for (key, value) in self
            .changes
            .range(vec![keys::UNIQUE]..vec![keys::UNIQUE + 1])
        {
            // A series not interned names no bucket the cache knows of.
            let bucket = BucketKey::distinct_value_split(key)
                .and_then(|at| Some((names.known_bucket(&key[..at])?, &key[at..])));
            if let Some((bucket, held)) = bucket {
                distinct_values.push((bucket, held.into(), value.is_some()));
            }
        }
        let mut changes: Vec<SharedChange> = Vec::with_capacity(
            self.changes.len() + self.aggregates.len() + self.distinct_sets.len(),
        );
        changes.extend(
            self.changes
                .into_iter()
                .map(|(key, value)| (key.into(), value.map(Arc::from))),
        );
        for (id, aggregate) in &self.aggregates {
            // Empty: a void took its last event out; no row, as if it never had one.
            let encoded = (*aggregate != Aggregate::default()).then(|| {
                codec::encode_aggregate_into(aggregate, &mut value);
                Arc::from(&value[..])
            });
            changes.push((key_of(id)?, encoded));
        }
        let mut distinct_sets = self.distinct_sets;
        for (id, set) in &distinct_sets {
            // An empty set is one a void emptied (or a refused record's new one): no
            // row, as for a bucket that never had a value.
            let encoded = (!set.is_empty()).then(|| Arc::from(set.encoded()));
            changes.push((key_of(id)?, encoded));
        }
        distinct_sets.retain(|_, set| !set.is_empty());
        Ok(Committed {
            changes,
            buckets: self.aggregates,
            distinct_sets,
            distinct_values,
            stored,
            pruned: self.pruned,
        })
    }
}

/// The keys of the meter and revision rows (`keys::METER`, `keys::REVISED_METER`)
/// among a chunk's writes: what the meter cache must not answer for.
fn definition_writes(changes: &BTreeMap<Vec<u8>, Option<Vec<u8>>>) -> impl Iterator<Item = &[u8]> {
    [keys::METER, keys::REVISED_METER]
        .into_iter()
        .flat_map(|table| changes.range(vec![table]..vec![table + 1]))
        .map(|(key, _)| key.as_slice())
}

/// An `F` row: which events the usage record at the key's position stored.
pub type StoredRow = (StoredEventsKey, Vec<(u32, u64)>);

/// A usage record as apply and queries read it back (borrowed from the chunk or
/// from a fetched `StoredBatch`).
pub struct StoredRef<'b> {
    store_id: &'b str,
    mode: Mode,
    events: EventsRef<'b>,
}

/// Where a `StoredRef`'s events are.
#[derive(Clone, Copy)]
enum EventsRef<'b> {
    /// A record of the chunk being applied, decoded whole.
    Chunk(&'b [UsageEvent]),
    Stored(&'b StoredEvents),
}

impl<'b> StoredRef<'b> {
    /// How many events the record stores.
    pub fn len(&self) -> usize {
        match self.events {
            EventsRef::Chunk(events) => events.len(),
            EventsRef::Stored(events) => events.len(),
        }
    }

    /// Whether the record stores no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The event at `index`, `None` past the last (an event that does not decode
    /// is an error: corrupt data).
    pub fn event(&self, index: u32) -> Result<Option<&'b UsageEvent>, EngineError> {
        match self.events {
            EventsRef::Chunk(events) => Ok(events.get(index as usize)),
            EventsRef::Stored(events) => events.get(index as usize),
        }
    }

    /// The event at `index` when it is `event_id` of this scope.
    pub fn event_if(
        &self,
        store_id: &str,
        mode: Mode,
        event_id: &str,
        index: u32,
    ) -> Result<Option<&'b UsageEvent>, EngineError> {
        if self.store_id != store_id || self.mode != mode {
            return Ok(None);
        }
        Ok(self
            .event(index)?
            .filter(|event| event.event_id == event_id))
    }

    /// Every event of the record, in order.
    pub fn events(&self) -> impl Iterator<Item = Result<&'b UsageEvent, EngineError>> + '_ {
        (0..self.len()).filter_map(|index| self.event(index as u32).transpose())
    }
}

pub struct Committed {
    pub changes: Vec<SharedChange>,
    pub buckets: FastIndexMap<BucketId, Aggregate>,
    pub distinct_sets: FastIndexMap<BucketId, DistinctSet>,
    /// The meter-wide distinct values (`U` keys) written (`true`) or deleted, by
    /// bucket, for the cache's `held_values`.
    pub distinct_values: Vec<(BucketId, Box<[u8]>, bool)>,
    pub stored: Vec<StoredRow>,
    pub pruned: Vec<StoredRow>,
}

/// The cache key of a customer id or external id within a scope.
pub fn customer_cache_key(store_id: &str, mode: Mode, id: &str) -> String {
    scoped_cache_key(store_id, mode, id)
}

/// The in-flight key of an event id (see metering's `MeteringCaches::inflight_events`).
pub fn inflight_key(store_id: &str, mode: Mode, event_id: &str) -> String {
    scoped_cache_key(store_id, mode, event_id)
}

/// `store NUL mode NUL id`, the key of the in-memory caches. Built by hand: both
/// keys are built for every ingested event, and `format!` cost more than the pushes
/// (~2% of intake's CPU under the ingest benchmark).
fn scoped_cache_key(store_id: &str, mode: Mode, id: &str) -> String {
    let mut key = String::with_capacity(store_id.len() + id.len() + 3);
    key.push_str(store_id);
    key.push('\u{0}');
    key.push(mode.key_byte() as char);
    key.push('\u{0}');
    key.push_str(id);
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter_cache::test_meter;

    fn bucket(customer: &str, minute: i64) -> Vec<u8> {
        BucketKey::from_minute(keys::AGGREGATE, "st", Mode::Test, "m", customer, minute)
    }

    /// What the overlay would commit: buckets, and non-empty sets with their values.
    type Pending = (Vec<(Vec<u8>, Aggregate)>, Vec<(Vec<u8>, Vec<Vec<u8>>)>);

    /// What the overlay would commit, as comparable values.
    fn pending(overlay: &Overlay<'_>) -> Pending {
        let names = &overlay.cache.as_deref().unwrap().names;
        let key = |id: &BucketId| names.key(*id).unwrap();
        let mut buckets: Vec<_> = overlay
            .aggregates
            .iter()
            .map(|(k, v)| (key(k), *v))
            .collect();
        buckets.sort_by(|a, b| a.0.cmp(&b.0));
        let mut sets: Vec<_> = overlay
            .distinct_sets
            .iter()
            .filter(|(_, set)| !set.is_empty())
            .map(|(k, set)| (key(k), set.iter().map(<[u8]>::to_vec).collect::<Vec<_>>()))
            .collect();
        sets.sort();
        (buckets, sets)
    }

    /// A meter-wide bucket found through the series remembered for its meter is
    /// the bucket its key names: per scope (a meter id in another store or
    /// environment is another series) and per minute.
    #[test]
    fn meter_wide_buckets_are_their_meters_scope_and_minute() {
        let meter = |store_id: &str, mode: Mode| test_meter("m", store_id, mode, "m");
        let folds = [
            ("st", Mode::Test, 0, 1),
            ("st", Mode::Prod, 0, 2),
            ("st2", Mode::Test, 0, 3),
            ("st", Mode::Test, 1, 4),
            ("st", Mode::Test, 0, 5),
        ];
        let key = |store_id: &str, mode: Mode, minute: i64| {
            BucketKey::from_minute(
                keys::AGGREGATE,
                store_id,
                mode,
                "m",
                keys::ALL_CUSTOMERS,
                minute,
            )
        };
        let store = tally_projection::MemoryStore::new();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let (mut remembered, mut by_key) = (
            BucketCache::for_empty_store(),
            BucketCache::for_empty_store(),
        );
        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.cache = Some(&mut remembered);
        let mut expected = Overlay::new(&store, &index, &fetched);
        expected.cache = Some(&mut by_key);
        for (store_id, mode, minute, n) in folds {
            let n = Some(rust_decimal::Decimal::from(n));
            overlay
                .meter_wide_aggregate(&meter(store_id, mode), minute, || {
                    key(store_id, mode, minute)
                })
                .unwrap()
                .1
                .add(n);
            expected
                .aggregate_mut(key(store_id, mode, minute))
                .unwrap()
                .add(n);
        }
        assert_eq!(pending(&overlay).0.len(), 4);
        assert_eq!(pending(&overlay), pending(&expected));
    }

    /// A meter definition is decoded once and shared while unchanged; a chunk that
    /// writes it sees its own write, and every later chunk the committed one.
    #[test]
    fn a_meter_is_read_anew_once_a_commit_writes_it() {
        let meter = |name: &str| test_meter("m", "st", Mode::Test, name);
        let key = keys::meter_key("st", Mode::Test, "m");
        let revised = keys::Key::scoped(keys::REVISED_METER, "st", Mode::Test).into_bytes();
        let store = tally_projection::MemoryStore::new();
        store
            .apply(
                vec![(key.clone(), Some(codec::encode_meter(&meter("v1"))))],
                &[],
            )
            .unwrap();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut cache = BucketCache::for_empty_store();
        let name =
            |overlay: &mut Overlay<'_>| overlay.shared_meter(&key).unwrap().unwrap().name.clone();

        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.cache = Some(&mut cache);
        assert_eq!(name(&mut overlay), "v1");
        assert_eq!(overlay.committed_revised(&revised), None);
        overlay.note_revised(&revised, &[]);
        assert_eq!(overlay.committed_revised(&revised), Some(Vec::new()));
        // A refused record's write is gone after the roll back.
        overlay.keep();
        overlay.put(key.clone(), codec::encode_meter(&meter("refused")));
        assert_eq!(name(&mut overlay), "refused");
        overlay.roll_back();
        assert_eq!(name(&mut overlay), "v1");
        // This chunk writes the meter: it reads its own write, and no revised list
        // from the cache (a revised meter's definition is a meter row).
        overlay.put(key.clone(), codec::encode_meter(&meter("v2")));
        overlay.keep();
        assert_eq!(name(&mut overlay), "v2");
        assert_eq!(overlay.committed_revised(&revised), None);
        let mut committed = overlay.into_changes().unwrap();
        store
            .apply_shared(std::mem::take(&mut committed.changes), &[(0, 1)])
            .unwrap();
        cache.absorb(&mut committed);

        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.cache = Some(&mut cache);
        assert_eq!(
            name(&mut overlay),
            "v2",
            "the commit's write, not the v1 cached"
        );
        assert_eq!(overlay.committed_revised(&revised), None, "forgotten too");
    }

    #[test]
    fn roll_back_restores_buckets_and_sets_touched_or_created_since_keep() {
        let store = tally_projection::MemoryStore::new();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut cache = BucketCache::for_empty_store();
        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.cache = Some(&mut cache);
        let set = |customer: &str| {
            BucketKey::from_minute(keys::DISTINCT_SET, "st", Mode::Test, "m", customer, 0)
        };
        for customer in ["a", "b"] {
            overlay
                .aggregate_mut(bucket(customer, 0))
                .unwrap()
                .add(Some(rust_decimal::Decimal::ONE));
            overlay.add_distinct(set(customer), b"x").unwrap();
        }
        overlay.keep();
        let kept = pending(&overlay);
        // The refused record: rewrites a kept bucket twice, creates two, adds values
        // to a kept set and to a new one.
        for customer in ["b", "c", "b", "d"] {
            overlay
                .aggregate_mut(bucket(customer, 0))
                .unwrap()
                .add(Some(rust_decimal::Decimal::TEN));
            overlay.add_distinct(set(customer), b"y").unwrap();
        }
        assert_ne!(pending(&overlay), kept);
        overlay.roll_back();
        assert_eq!(pending(&overlay), kept);
        // The overlay still works after a roll back (indexes stay valid).
        overlay.aggregate_mut(bucket("c", 0)).unwrap().add(None);
        overlay.keep();
        assert_eq!(pending(&overlay).0.len(), 3);
    }

    #[test]
    fn roll_back_to_a_savepoint_keeps_what_came_before_it() {
        let store = tally_projection::MemoryStore::new();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.put(b"a".to_vec(), b"1".to_vec());
        overlay.put(b"b".to_vec(), b"1".to_vec());
        let mark = overlay.savepoint();
        // The part refused: rewrites one key, adds one, deletes one.
        overlay.put(b"a".to_vec(), b"2".to_vec());
        overlay.put(b"c".to_vec(), b"2".to_vec());
        overlay.delete(b"b".to_vec());
        overlay.roll_back_to(mark);
        assert_eq!(overlay.get(b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(overlay.get(b"b").unwrap(), Some(b"1".to_vec()));
        assert_eq!(overlay.get(b"c").unwrap(), None);
        // The record as a whole still rolls back to its start.
        overlay.roll_back();
        assert_eq!(overlay.get(b"a").unwrap(), None);
        assert_eq!(overlay.get(b"b").unwrap(), None);
    }

    #[test]
    fn a_cache_past_its_series_cap_empties_whole_and_reads_the_store_again() {
        let store = tally_projection::MemoryStore::new();
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut cache = BucketCache::for_empty_store();
        for n in 0..=MAX_KNOWN_SERIES {
            cache.names.bucket(&bucket(&format!("c{n}"), 0)).unwrap();
        }
        let mut committed = {
            let mut overlay = Overlay::new(&store, &index, &fetched);
            overlay.cache = Some(&mut cache);
            overlay
                .aggregate_mut(bucket("x", 60_000))
                .unwrap()
                .add(Some(rust_decimal::Decimal::TEN));
            overlay.keep();
            overlay.into_changes().unwrap()
        };
        store
            .apply_shared(std::mem::take(&mut committed.changes), &[(0, 1)])
            .unwrap();
        cache.absorb(&mut committed);
        assert!(cache.names.is_empty() && cache.buckets.is_empty() && cache.newest.is_empty());
        assert!(!cache.complete, "the newest minutes are unknown again");
        // The next chunk interns afresh and finds the bucket in the store.
        let mut overlay = Overlay::new(&store, &index, &fetched);
        overlay.cache = Some(&mut cache);
        let mut expected = Aggregate::default();
        expected.add(Some(rust_decimal::Decimal::TEN));
        assert_eq!(overlay.aggregate(&bucket("x", 60_000)).unwrap(), expected);
    }

    #[test]
    fn eviction_drops_the_oldest_minutes_whole_and_keeps_the_newest() {
        let mut cache = MinuteMaps::default();
        let mut names = SeriesNames::default();
        // 40 buckets per minute, minutes 0..10: 400 in all, cap 200 -> keep 150.
        for minute in 0..10 {
            for c in 0..40 {
                let id = names.bucket(&bucket(&format!("c{c}"), minute * 60_000));
                cache.insert(id.unwrap(), minute);
            }
        }
        let kept = cache.evict_oldest_minutes(eviction_target(200), |_| 1);
        assert_eq!(kept, 120, "three whole minutes fit in 150");
        assert_eq!(cache.len(), 120);
        for c in 0..40 {
            for minute in 0..10 {
                let id = names.known_bucket(&bucket(&format!("c{c}"), minute * 60_000));
                assert_eq!(cache.get(&id.unwrap()).is_some(), minute >= 7);
            }
        }
        // Weighted: minute 9 alone weighs more than the target, so nothing stays.
        let target = eviction_target(200);
        let kept = cache.evict_oldest_minutes(target, |minute| (*minute as usize) * 10);
        assert_eq!((kept, cache.len()), (0, 0));
    }

    fn usage_event(id: &str, received_at_ms: i64) -> UsageEvent {
        UsageEvent {
            event_id: id.into(),
            name: "llm".into(),
            customer_id: "cus_1".into(),
            external_customer_id: None,
            timestamp_ms: 60_000,
            properties: [(
                "tokens".to_string(),
                tally_domain::usage::PropertyValue::Number(rust_decimal::Decimal::new(15, 1)),
            )]
            .into(),
            received_at_ms,
            matched_meter_ids: vec!["mtr_1".into()],
            event_id_assigned: false,
        }
    }

    #[test]
    fn a_stored_usage_record_reads_each_event_as_the_whole_record_decodes_it() {
        let events = vec![
            usage_event("a", 5),
            usage_event("b", 3),
            usage_event("c", 4),
        ];
        let record = Record::UsageBatch {
            store_id: "st".into(),
            mode: Mode::Test,
            events: events.clone(),
            settles: false,
            matched_below: None,
        };
        let batch = StoredBatch::decode(&tally_proto::encode_record(&record, 1))
            .unwrap()
            .unwrap();
        let view = batch.view();
        assert_eq!(view.len(), 3);
        // Out of order, and one read twice: each as the record holds it.
        for index in [2u32, 0, 2, 1] {
            let read = view.event(index).unwrap().unwrap();
            assert_eq!(format!("{read:?}"), format!("{:?}", events[index as usize]));
        }
        assert!(view.event(3).unwrap().is_none());
        assert_eq!(
            view.event_if("st", Mode::Test, "b", 1)
                .unwrap()
                .unwrap()
                .event_id,
            "b"
        );
        assert!(view.event_if("st", Mode::Test, "a", 1).unwrap().is_none());
        assert!(view.event_if("st", Mode::Prod, "b", 1).unwrap().is_none());
        let all: Vec<&UsageEvent> = view.events().collect::<Result<_, _>>().unwrap();
        assert_eq!(
            format!("{all:?}"),
            format!("{:?}", events.iter().collect::<Vec<_>>())
        );
    }

    #[test]
    fn an_event_that_does_not_decode_is_corrupt_and_its_neighbours_still_read() {
        use tally_proto::{v1, Message};
        let good = tally_proto::usage_event_to_proto(&usage_event("a", 1)).encode_to_vec();
        let payload = v1::LogRecordFrames {
            format_version: tally_proto::LOG_FORMAT_VERSION,
            usage_batch: Some(v1::UsageBatchFrames {
                store_id: "st".into(),
                mode: v1::Mode::Test as i32,
                // A field key with wire type 7, which protobuf does not have.
                events: vec![good, vec![0x0f]],
            }),
        }
        .encode_to_vec();
        let batch = StoredBatch::decode(&payload).unwrap().unwrap();
        let view = batch.view();
        assert_eq!(view.event(0).unwrap().unwrap().event_id, "a");
        assert!(matches!(view.event(1), Err(EngineError::Corrupt(_))));
        assert!(view.events().any(|read| read.is_err()));
    }

    #[test]
    fn an_amendment_stores_its_replacement_and_other_records_store_nothing() {
        let replacement = usage_event("a", 9);
        let amended = Record::EventAmended {
            store_id: "st".into(),
            mode: Mode::Prod,
            event_id: "a".into(),
            reason: "typo".into(),
            replacement: replacement.clone(),
            matched_below: None,
        };
        let batch = StoredBatch::decode(&tally_proto::encode_record(&amended, 1))
            .unwrap()
            .unwrap();
        let read = batch
            .view()
            .event_if("st", Mode::Prod, "a", 0)
            .unwrap()
            .unwrap();
        assert_eq!(format!("{read:?}"), format!("{replacement:?}"));
        let voided = Record::EventsVoided {
            store_id: "st".into(),
            mode: Mode::Prod,
            event_ids: vec!["a".into()],
            reason: "dup".into(),
        };
        assert!(StoredBatch::decode(&tally_proto::encode_record(&voided, 1))
            .unwrap()
            .is_none());
        assert!(matches!(
            StoredBatch::decode(&[0x0f]),
            Err(EngineError::Corrupt(_))
        ));
    }
}
