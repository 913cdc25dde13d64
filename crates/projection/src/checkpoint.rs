//! Hot state in memory, the inner store as its checkpoint.
//!
//! [`CheckpointStore`] wraps a durable [`ProjectionStore`] (sled). Applied batches go
//! into an in-memory write-back layer, newest value per key, and reads see that layer
//! over the inner store. A **checkpoint** writes the whole layer and the positions it
//! brings the projection to in one atomic batch of the inner store. When the layer
//! holds [`CHECKPOINT_MAX_DIRTY_KEYS`] keys or its oldest change is
//! [`CHECKPOINT_EVERY_MS`] old (checked on every apply and on
//! [`ProjectionStore::tick`]), it is frozen and written by a background thread while
//! a fresh layer takes the next applies; reads see both layers until the write ends.
//! At most one checkpoint is in flight: an apply that finds the next one due before
//! the last ended waits (backpressure when apply outruns the disk). `flush` writes
//! everything synchronously. A failed checkpoint fails every later write (fail-stop).
//!
//! Why: a usage bucket is rewritten by every event that lands in it; in the layer
//! those rewrites coalesce, so the durable store sees one write per bucket per
//! checkpoint instead of one per chunk, and sled receives a few large batches instead
//! of many small ones.
//!
//! **Reads never wait for a writer.** A chunk's changes (~15,000 keys in the ingest
//! benchmark) first become a [`Pending`] list, sorted by key outside any lock and
//! published whole by swapping a pointer; reads look in it before the layers. Its
//! keys are then copied into the active layer, whose value map is concurrent (a
//! sharded hash map) and whose order is a few sorted runs swapped in whole (the
//! chunk's new keys as one run, merged with runs of similar length outside the
//! lock), so a read never waits for the merge, and the list is retired once every
//! key is in. A key of a merging chunk is found in the list first, so a `get` sees
//! every chunk whole; a
//! `scan` that overlapped the start of a merge collects again (`SCAN_ATTEMPTS`);
//! `scan_in_steps` does so for each window it takes (`SCAN_WINDOW`).
//! The lock over the layers guards only pointer swaps. Why: apply runs at background
//! priority (`priority`), and while it held a write lock over the merge (a slice of
//! keys at a time), a preempted apply held every request thread's read behind it for
//! the milliseconds until it ran again (measured under ingest: p90 2.9 ms, up to
//! 44 ms; docs/benchmarks.md, "Reads never wait for the projector").
//!
//! Crash safety (the checkpoint protocol): the inner store only ever holds a prefix
//! of applied batches together with exactly the positions that prefix reaches (each
//! checkpoint is one atomic inner batch). After a crash the projector resumes from
//! those positions and the log supplies the rest, so losing the layer loses nothing:
//! apply is deterministic, and re-applying the lost batches rebuilds the same state.
//! `position` answers from memory (what has been applied and is visible to reads),
//! which is what read-your-writes waits on.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::{RwLock, RwLockWriteGuard};

use crate::read_cache::ReadCache;
use crate::{Change, ChangeSource, ChangeVisit, ProjectionStore, SharedChange, StoreError, Visit};

/// Keys the layer holds before a checkpoint is started. Bounds memory (an entry is
/// ~200 bytes; the layer being written and the one filling both count) and the
/// work of one checkpoint.
pub const CHECKPOINT_MAX_DIRTY_KEYS: usize = 200_000;

/// Age of the oldest unwritten change that starts a checkpoint. Long enough that a
/// usage bucket's rewrites coalesce: with 10,000 customers a customer's minute
/// bucket is touched every few seconds, so a one-second checkpoint wrote ~4 sled
/// keys per ingested event (a third of the server's CPU), a 15-second one writes a
/// fraction of one. It also bounds how much of the log a restart re-applies.
pub const CHECKPOINT_EVERY_MS: u64 = 15_000;

/// How far past `max_dirty_keys` the active layer may grow while the previous
/// checkpoint is still being written, before applies wait for it: absorbs a slow
/// sled write without a latency spike, and still bounds memory (to 3x the limit in
/// all, with the layer being written).
pub const CHECKPOINT_BACKLOG_FACTOR: usize = 2;

/// The most keys a fresh layer's value map is sized for up front (~40 bytes of
/// table each): a larger `max_dirty_keys` grows the map as keys arrive instead of
/// reserving hundreds of MiB that a quiet server never fills.
pub const MAX_PRESIZED_LAYER_KEYS: usize = 1_000_000;

/// How often the active layer is copied to disk (`sled_store`, "Layer copies"),
/// except while a checkpoint's write is not yet durable. A SIGKILL then loses at
/// most this much of the log (plus a stage's write) instead of up to two checkpoint
/// intervals: a restart under ingest re-applied ~470,000 events (~8 s) before it
/// answered. A copy costs a walk of the layer under the writer's turn (at most
/// `LAYER_COPY_MAX_KEYS` keys) and a sequential write of it in the background.
pub const LAYER_COPY_EVERY_MS: u64 = 3_000;

/// The most keys a layer copy takes: it is walked while applies wait, and it keeps
/// alive, until written, the values later applies replace (the layer's values are
/// shared, `Arc`s, not copied). A larger layer (a raised `--checkpoint-keys`) is not
/// copied; the log re-applies it after a crash.
pub const LAYER_COPY_MAX_KEYS: usize = 400_000;

/// Shards of a layer's value map. A read waits only while the merge is inside the
/// one shard it needs (one insert), so many small shards make that rare.
pub const LAYER_SHARDS: usize = 128;

/// Times a scan collects the layers before it takes the writer's lock: a scan that
/// overlapped the start of a merge collects again (module doc), and chunks start
/// ~10 times a second under ingest, far apart next to a collection.
pub const SCAN_ATTEMPTS: usize = 4;

/// Entries `scan_in_steps` takes at a time from each sorted run of a layer
/// (`ScanWindow`). `scan` copies every layer entry of its range before visiting
/// the first, so that it sees the layers at one moment: the webhook dispatcher's
/// look for 256 due deliveries copied the whole due index the layers held (tens of
/// thousands of entries under a burst), ~a third of the server's CPU while
/// deliveries were behind (docs/benchmarks.md, "Due deliveries found a window at a
/// time"). Large enough that a scan that goes on takes few steps, each a search
/// per run and one range read of the inner store.
pub const SCAN_WINDOW: usize = 256;

/// A chunk's changes while they are merged into the active layer (module doc),
/// newest per key, sorted by key. Sorted, because a scan overlays the part of it
/// in its range: a hash map had to be walked whole (~15,000 keys) by every scan
/// that overlapped a merge, ~3% of the server's CPU under ingest.
#[derive(Debug, Default)]
struct Pending {
    entries: Vec<SharedChange>,
}

/// A layer's value of a key: shared, so a layer copy holds pointers, not the bytes
/// again (`None`: deleted).
type SharedValue = Option<Arc<[u8]>>;

impl Pending {
    fn new(mut changes: Vec<SharedChange>) -> Pending {
        // Stable: a key's changes stay in apply order, and the last one wins.
        changes.sort_by(|a, b| a.0.cmp(&b.0));
        let mut entries: Vec<SharedChange> = Vec::with_capacity(changes.len());
        for (key, value) in changes {
            match entries.last_mut() {
                Some((last, newest)) if *last == key => *newest = value,
                _ => entries.push((key, value)),
            }
        }
        Pending { entries }
    }

    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn get(&self, key: &[u8]) -> Option<&SharedValue> {
        self.entries
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|at| &self.entries[at].1)
    }

    /// The entries between two bounds, in key order.
    fn range(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> &[SharedChange] {
        sorted_range(&self.entries, |(key, _)| key, start, end)
    }
}

/// The part of `items` (sorted by `key_of`) between two bounds.
fn sorted_range<'a, T>(
    items: &'a [T],
    key_of: impl Fn(&T) -> &[u8],
    start: Bound<&[u8]>,
    end: Bound<&[u8]>,
) -> &'a [T] {
    let from = items.partition_point(|item| match start {
        Bound::Included(s) => key_of(item) < s,
        Bound::Excluded(s) => key_of(item) <= s,
        Bound::Unbounded => false,
    });
    let to = items.partition_point(|item| match end {
        Bound::Included(e) => key_of(item) <= e,
        Bound::Excluded(e) => key_of(item) < e,
        Bound::Unbounded => true,
    });
    items.get(from..to.max(from)).unwrap_or_default()
}

/// Unwritten values, the newest per key (`None`: deleted): a hash map for reads and
/// overwrites, and the same keys in order for scans and the checkpoint's batch.
/// Both are concurrent: the projector merges while requests read (module doc).
///
/// Why both: most applies rewrite a key the layer already holds (a usage bucket
/// touched again), and an ordered insert compares long keys that share their first
/// ~60 bytes (scope and meter) about twenty times; in a profile of the ingest
/// benchmark that `memcmp` was a seventh of the server's CPU. Now an overwrite costs
/// one hash, and only a key new to the layer joins the order.
///
/// The order is a few sorted runs (`Runs`), not a skip list: a chunk's new keys
/// arrive sorted already (`Pending`), so they become one run, and runs of similar
/// length are merged, sequentially, into one. A skip list searched from its top for
/// every key, through pointers: its inserts were a seventh of the apply thread
/// (docs/benchmarks.md, "Interned bucket keys, sorted runs").
#[derive(Debug)]
struct Changes {
    values: DashMap<Arc<[u8]>, SharedValue, foldhash::fast::RandomState>,
    /// A key is added here after its value, so a key in order always has one.
    order: RwLock<Runs>,
}

/// Sorted runs of keys, pairwise disjoint (a key joins once, when new to its
/// layer), oldest first. Each run is at least twice as long as the next one
/// (`Changes::push_run` merges until it is), so a layer of n keys holds at most
/// log2(n) + 1 runs, and a key is merged at most that many times. A run is shared
/// as the vector it was merged into: turning it into a slice copied every merged
/// run once more.
type Runs = Vec<Arc<Vec<Arc<[u8]>>>>;

impl Default for Changes {
    fn default() -> Self {
        Changes::with_capacity(0)
    }
}

impl Changes {
    /// Sized for `keys` keys up front: growing the value map's shards one doubling
    /// at a time, while apply waits, was ~2% of the apply thread in a replay profile.
    fn with_capacity(keys: usize) -> Self {
        Changes {
            values: DashMap::with_capacity_and_hasher_and_shard_amount(
                keys,
                foldhash::fast::RandomState::default(),
                LAYER_SHARDS,
            ),
            order: RwLock::new(Runs::new()),
        }
    }
}

/// Two sorted, disjoint runs as one.
fn merge_runs(a: &[Arc<[u8]>], b: &[Arc<[u8]>]) -> Vec<Arc<[u8]>> {
    let mut merged = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a.iter().peekable(), b.iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x <= y => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, _) => b.next(),
        };
        match next {
            Some(key) => merged.push(key.clone()),
            None => return merged,
        }
    }
}

/// A frozen layer is written straight from its maps, in key order.
impl ChangeSource for Changes {
    fn change_count(&self) -> usize {
        self.len()
    }

    fn visit_changes(&self, visit: &mut ChangeVisit<'_>) -> Result<(), StoreError> {
        for key in &self.sorted_keys() {
            if let Some(value) = self.values.get(key) {
                visit(key, value.as_deref())?;
            }
        }
        Ok(())
    }
}

impl Changes {
    fn len(&self) -> usize {
        self.values.len()
    }

    /// Every key in order: the runs merged, smallest first, so each merge is about
    /// as long as what it has merged so far and the whole is linear in the keys.
    fn sorted_keys(&self) -> Vec<Arc<[u8]>> {
        self.runs()
            .iter()
            .rev()
            .fold(Vec::new(), |merged, run| merge_runs(&merged, run))
    }

    /// Every change in key order, as shared pointers: what a checkpoint writes.
    fn snapshot(&self) -> Vec<SharedChange> {
        let mut changes = Vec::with_capacity(self.len());
        for key in self.sorted_keys() {
            if let Some(value) = self.values.get(&key) {
                changes.push((key, value.clone()));
            }
        }
        changes
    }

    fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.values
            .get(key)
            .map(|value| value.as_deref().map(<[u8]>::to_vec))
    }

    /// The runs as they are now (readers take a copy of a few pointers).
    fn runs(&self) -> Runs {
        self.order.read().clone()
    }

    /// Takes a chunk's changes, sorted by key (the layer's only writer calls this).
    fn insert_sorted(&self, entries: &[SharedChange]) {
        let mut new_keys = Vec::new();
        for (key, value) in entries {
            if self.values.insert(key.clone(), value.clone()).is_none() {
                new_keys.push(key.clone());
            }
        }
        self.push_run(new_keys);
    }

    /// Adds a sorted run of keys new to the layer, merged with the newest runs
    /// while they are not at least twice its length. The merge runs outside the
    /// lock, which is taken only to swap the runs (module doc).
    fn push_run(&self, mut run: Vec<Arc<[u8]>>) {
        if run.is_empty() {
            return;
        }
        let mut runs = self.runs();
        while let Some(last) = runs.last() {
            if last.len() >= run.len().saturating_mul(2) {
                break;
            }
            run = merge_runs(last, &run);
            runs.pop();
        }
        runs.push(Arc::new(run));
        *self.order.write() = runs;
    }

    /// Adds to `window` the entries between two bounds that a scan in that
    /// direction meets first, up to the window's limit of each run (a newer layer's
    /// entries are added after, and replace them).
    fn collect_window(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, window: &mut ScanWindow) {
        for run in self.runs() {
            let keys = window.take(sorted_range(&run, |key| key, start, end), |key| key);
            for key in keys {
                if let Some(value) = self.values.get(key) {
                    window.entries.insert(key.clone(), value.clone());
                }
            }
        }
    }
}

/// What one step of a scan takes from the layers: at most `limit` entries of each
/// sorted run (and of a chunk being merged), from where the step starts, and the
/// key where the step ends, the earliest in scan order of the last keys taken from
/// runs that had more. Every layer entry up to that key is in `entries`; the ones
/// past it are dropped and met again by the next step.
struct ScanWindow {
    reverse: bool,
    limit: usize,
    entries: BTreeMap<Arc<[u8]>, SharedValue>,
    cut: Option<Arc<[u8]>>,
}

impl ScanWindow {
    fn new(reverse: bool, limit: usize) -> ScanWindow {
        ScanWindow {
            reverse,
            limit: limit.max(1),
            entries: BTreeMap::new(),
            cut: None,
        }
    }

    /// The part of a sorted `range` this step takes; when some of it is left for a
    /// later step, the step ends at the last key taken, or earlier.
    fn take<'a, T>(&mut self, range: &'a [T], key_of: impl Fn(&T) -> &Arc<[u8]>) -> &'a [T] {
        if range.len() <= self.limit {
            return range;
        }
        let (taken, last) = if self.reverse {
            let taken = &range[range.len() - self.limit..];
            (taken, &taken[0])
        } else {
            let taken = &range[..self.limit];
            (taken, &taken[self.limit - 1])
        };
        let last = key_of(last);
        let earlier = match &self.cut {
            None => true,
            Some(cut) if self.reverse => last > cut,
            Some(cut) => last < cut,
        };
        if earlier {
            self.cut = Some(last.clone());
        }
        taken
    }

    /// The entries up to the step's end, ordered so that `pop` yields them in scan
    /// order, and that end (`None`: the step reaches the scan's end).
    fn finish(mut self) -> (Vec<SharedChange>, Option<Arc<[u8]>>) {
        if let Some(cut) = &self.cut {
            let reverse = self.reverse;
            self.entries
                .retain(|key, _| if reverse { key >= cut } else { key <= cut });
        }
        let mut entries: Vec<SharedChange> = self.entries.into_iter().collect();
        if !self.reverse {
            entries.reverse();
        }
        (entries, self.cut)
    }
}

/// Unwritten changes and the positions they reach. Only the writer (one at a time)
/// changes a layer; its small fields are behind locks held for a copy.
#[derive(Debug, Default)]
struct Layer {
    changes: Changes,
    positions: parking_lot::Mutex<BTreeMap<u32, u64>>,
    /// When the oldest unwritten change or position was applied (`None`: the layer
    /// is empty).
    since: parking_lot::Mutex<Option<Instant>>,
    /// Set by its checkpoint once the inner store holds it durably while the write
    /// goes on (a staged batch's stage file): the layer above may then be copied
    /// over the positions this one reaches.
    durable: AtomicBool,
}

impl Layer {
    fn with_capacity(keys: usize) -> Self {
        Layer {
            changes: Changes::with_capacity(keys),
            ..Layer::default()
        }
    }

    /// The positions its changes reach, as the inner store takes them.
    fn positions(&self) -> Vec<(u32, u64)> {
        self.positions
            .lock()
            .iter()
            .map(|(p, o)| (*p, *o))
            .collect()
    }
}

/// The layer that takes applies, the one a background checkpoint is writing, and
/// the chunk being merged into the active layer. The lock over them guards only
/// these pointers (module doc).
#[derive(Debug, Default)]
struct Layers {
    active: Arc<Layer>,
    writing: Option<Arc<Layer>>,
    pending: Option<Arc<Pending>>,
}

/// The layers as one reader saw them, newest first; read without a lock.
struct Snapshot {
    pending: Option<Arc<Pending>>,
    active: Arc<Layer>,
    writing: Option<Arc<Layer>>,
}

#[derive(Debug)]
struct Shared<S> {
    inner: S,
    layers: RwLock<Layers>,
    /// Signalled when a background checkpoint ends.
    written: Condvar,
    /// Held while `writing` is set; `written` waits on it.
    writing_done: Mutex<()>,
    /// A background checkpoint failed: every later write fails (fail-stop).
    failed: Mutex<Option<String>>,
    /// When the last checkpoint completed (or the store opened).
    checkpointed_at: Mutex<std::time::Instant>,
    /// Chunks published so far: a scan that sees it move collects again.
    chunks_published: AtomicU64,
    /// Layers written and dropped from the reads (`retired_layers`); counted under
    /// the layers' write lock, before the drop, so a reader whose snapshot misses
    /// a layer sees the count that says so.
    retired_layers: AtomicU64,
    /// The keys a fresh layer is sized for (the checkpoint's key limit).
    layer_keys: usize,
    /// Rows of chosen tables as the inner store holds them (`with_read_cache`).
    cache: Option<ReadCache>,
}

/// A projection store with an in-memory write-back layer over a durable one.
#[derive(Debug)]
pub struct CheckpointStore<S> {
    shared: Arc<Shared<S>>,
    /// Serialises writers (applies and checkpoints).
    writer: Mutex<()>,
    max_dirty_keys: usize,
    every: Duration,
    /// Applies so far (a layer copy is due only when one came since the last copy).
    applies: AtomicU64,
    copies: Option<LayerCopies>,
}

/// When the active layer was last copied to the inner store, and whether a copy is
/// being written (`sled_store`, "Layer copies"; at most one at a time).
#[derive(Debug)]
struct LayerCopies {
    every: Duration,
    last: Mutex<Instant>,
    applies_copied: AtomicU64,
    in_flight: Arc<AtomicBool>,
}

impl<S: ProjectionStore + 'static> CheckpointStore<S> {
    pub fn new(inner: S) -> Self {
        Self::with_limits(
            inner,
            CHECKPOINT_MAX_DIRTY_KEYS,
            Duration::from_millis(CHECKPOINT_EVERY_MS),
        )
    }

    /// With other thresholds (tests force checkpoints at chosen points).
    pub fn with_limits(inner: S, max_dirty_keys: usize, every: Duration) -> Self {
        CheckpointStore {
            shared: Arc::new(Shared {
                inner,
                layers: RwLock::new(Layers::default()),
                written: Condvar::new(),
                writing_done: Mutex::new(()),
                failed: Mutex::new(None),
                checkpointed_at: Mutex::new(std::time::Instant::now()),
                chunks_published: AtomicU64::new(0),
                retired_layers: AtomicU64::new(0),
                layer_keys: max_dirty_keys.min(MAX_PRESIZED_LAYER_KEYS),
                cache: None,
            }),
            writer: Mutex::new(()),
            max_dirty_keys,
            every,
            applies: AtomicU64::new(0),
            copies: None,
        }
    }

    /// Keeps the inner store's rows of `tables` in memory between reads
    /// (`crate::read_cache`). Called on a new store, before it is shared.
    pub fn with_read_cache(mut self, tables: &[u8]) -> Self {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => shared.cache = Some(ReadCache::of_tables(tables)),
            None => tracing::warn!("a shared checkpoint store was not given a read cache"),
        }
        self
    }

    /// Rows its read cache holds (none without one).
    pub fn cached_rows(&self) -> usize {
        self.shared.cache.as_ref().map_or(0, ReadCache::len)
    }

    /// Also copies the active layer to the inner store every `every` (not while a
    /// checkpoint's write is not yet durable), if the inner store keeps copies
    /// (`sled_store`, "Layer copies").
    pub fn with_layer_copies(mut self, every: Duration) -> Self {
        if self.shared.inner.keeps_layer_copies() {
            self.copies = Some(LayerCopies {
                every,
                last: Mutex::new(Instant::now()),
                applies_copied: AtomicU64::new(0),
                in_flight: Arc::default(),
            });
        }
        self
    }

    /// Copies the active layer if a copy is due: `every` since the last one, an
    /// apply since, none in flight, no checkpoint in flight unless the inner store
    /// already holds its layer durably, and at most `LAYER_COPY_MAX_KEYS` keys. A
    /// copy while a checkpoint writes is made over the positions the inner store
    /// holds once that write ends (its stored positions with the written layer's
    /// over them): before that checkpoint is durable, a crash leaves the inner store
    /// where it was, and only the copy of the layer before it describes a layer over
    /// that, so none is taken then. The caller holds the writer's turn, so the layer
    /// and its positions hold still while they are copied. A copy that fails is
    /// logged, not fatal: the log re-applies what it would have saved.
    fn copy_layer_if_due(&self, active: &Arc<Layer>) {
        let Some(copies) = &self.copies else {
            return;
        };
        let applies = self.applies.load(Ordering::SeqCst);
        let due = !copies.in_flight.load(Ordering::SeqCst)
            && copies.applies_copied.load(Ordering::SeqCst) != applies
            && copies
                .last
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed()
                >= copies.every;
        // Checked first: most applies find no copy due and take no lock below.
        if !due {
            return;
        }
        let layers = self.shared.snapshot();
        if layers
            .writing
            .as_ref()
            .is_some_and(|writing| !writing.durable.load(Ordering::SeqCst))
            || !Arc::ptr_eq(&layers.active, active)
            || active.changes.len() > LAYER_COPY_MAX_KEYS
        {
            return;
        }
        let over = match self.shared.inner.stored_positions() {
            // Read before or after the write's positions land: the same either way.
            Ok(stored) => match &layers.writing {
                Some(writing) => {
                    let mut over: BTreeMap<u32, u64> = stored.into_iter().collect();
                    over.extend(writing.positions());
                    over.into_iter().collect()
                }
                None => stored,
            },
            Err(error) => {
                tracing::warn!(%error, "the layer was not copied: reading the stored positions failed");
                return;
            }
        };
        // In no particular order: a restart takes the copy in whole through an
        // `apply`, which sorts.
        let changes: Vec<SharedChange> = active
            .changes
            .values
            .iter()
            .map(|entry| (entry.key().clone(), entry.value().clone()))
            .collect();
        let positions = active.positions();
        *copies.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        copies.applies_copied.store(applies, Ordering::SeqCst);
        copies.in_flight.store(true, Ordering::SeqCst);
        let (shared, in_flight) = (self.shared.clone(), copies.in_flight.clone());
        let spawned = std::thread::Builder::new()
            .name("tally-layer-copy".into())
            .spawn(move || {
                if let Err(why) = crate::priority::run_as_background_thread() {
                    tracing::debug!("the layer copy runs at normal priority: {why}");
                }
                // A panic in the inner store must not leave `in_flight` set: dropping
                // the store waits for it.
                let saved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    shared.inner.save_layer_copy(&over, &changes, &positions)
                }));
                match saved {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "the layer was not copied; a restart re-applies more of the log")
                    }
                    Err(_) => tracing::warn!(
                        "the layer was not copied (the inner store panicked); a restart re-applies more of the log"
                    ),
                }
                in_flight.store(false, Ordering::SeqCst);
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "the layer was not copied: starting its thread failed");
            copies.in_flight.store(false, Ordering::SeqCst);
        }
    }

    /// One step of a scan over `lo..hi`: the layers' first `window` entries of
    /// each run (as a scan in that direction meets them) merged over the inner
    /// store's keys up to where that window ends. Answers where the next step
    /// starts after (`None`: the visitor stopped, or the step reached `hi`, or
    /// `lo` in reverse).
    fn scan_step(
        &self,
        lo: Bound<&[u8]>,
        hi: Bound<&[u8]>,
        reverse: bool,
        window: usize,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<Option<Arc<[u8]>>, StoreError> {
        let collect = |layers: &Snapshot| {
            let mut window = ScanWindow::new(reverse, window);
            if let Some(writing) = &layers.writing {
                writing.changes.collect_window(lo, hi, &mut window);
            }
            layers.active.changes.collect_window(lo, hi, &mut window);
            if let Some(pending) = &layers.pending {
                for (key, value) in window.take(pending.range(lo, hi), |(key, _)| key) {
                    window.entries.insert(key.clone(), value.clone());
                }
            }
            window.finish()
        };
        // A chunk published while the layers were collected may be half merged
        // into them: collect again (module doc); past `SCAN_ATTEMPTS`, with writers
        // held off.
        let mut collected = None;
        for _ in 0..SCAN_ATTEMPTS {
            let published = self.shared.chunks_published.load(Ordering::SeqCst);
            let window = collect(&self.shared.snapshot());
            if self.shared.chunks_published.load(Ordering::SeqCst) == published {
                collected = Some(window);
                break;
            }
        }
        let (mut pending, cut) = match collected {
            Some(window) => window,
            None => {
                let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
                collect(&self.shared.snapshot())
            }
        };
        // The inner store's keys up to where the layers' window ends.
        let (lo, hi) = match &cut {
            Some(cut) if reverse => (Bound::Included(&cut[..]), hi),
            Some(cut) => (lo, Bound::Included(&cut[..])),
            None => (lo, hi),
        };
        // `pending` is ordered so that `pop` yields the next key in scan order.
        let before = |a: &[u8], b: &[u8]| if reverse { a > b } else { a < b };
        let mut stopped = false;
        let emit = |visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit, k: &[u8], v: &SharedValue| match v
        {
            Some(v) => visit(k, v) == Visit::Stop,
            None => false,
        };
        self.shared.inner.scan(lo, hi, reverse, &mut |key, value| {
            while let Some((next, _)) = pending.last() {
                if !before(next, key) {
                    break;
                }
                let (next, change) = pending.pop().expect("checked");
                if emit(visit, &next, &change) {
                    stopped = true;
                    return Visit::Stop;
                }
            }
            if pending.last().is_some_and(|(next, _)| **next == *key) {
                let (next, change) = pending.pop().expect("checked");
                if emit(visit, &next, &change) {
                    stopped = true;
                    return Visit::Stop;
                }
                return Visit::Continue;
            }
            if visit(key, value) == Visit::Stop {
                stopped = true;
                return Visit::Stop;
            }
            Visit::Continue
        })?;
        if !stopped {
            while let Some((next, change)) = pending.pop() {
                if emit(visit, &next, &change) {
                    stopped = true;
                    break;
                }
            }
        }
        Ok(cut.filter(|_| !stopped))
    }

    /// The durable store underneath.
    pub fn inner(&self) -> &S {
        &self.shared.inner
    }

    /// Keys changed since the last completed checkpoint.
    pub fn dirty_keys(&self) -> usize {
        let layers = self.shared.snapshot();
        layers.active.changes.len() + layers.writing.as_ref().map_or(0, |w| w.changes.len())
    }

    /// Writes everything applied so far to the inner store (waiting for a background
    /// checkpoint first), in order, each layer as one atomic batch.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.wait_written()?;
        match self.shared.freeze() {
            Some(layer) => self.shared.write_here(&layer),
            None => Ok(()),
        }
    }

    /// Starts a background checkpoint of the active layer, after the previous one
    /// ends (an apply that outruns the disk waits here: backpressure).
    fn start_checkpoint(&self) -> Result<(), StoreError> {
        {
            let layers = self.shared.snapshot();
            let backlog = self
                .max_dirty_keys
                .saturating_mul(CHECKPOINT_BACKLOG_FACTOR);
            if layers.writing.is_some() && layers.active.changes.len() < backlog {
                // The previous checkpoint is still being written: keep applying (the
                // next apply checks again) rather than stall every waiting request.
                return self.shared.check_failed();
            }
        }
        self.shared.wait_written()?;
        if let Some(layer) = self.shared.freeze() {
            let shared = self.shared.clone();
            let spawned = spawn_checkpoint_thread().and_then(|builder| {
                builder.spawn(move || {
                    // Nothing waits on a checkpoint but the next one; requests
                    // come first (`priority`).
                    if let Err(why) = crate::priority::run_as_background_thread() {
                        tracing::warn!("the checkpoint runs at normal priority: {why}");
                    }
                    let layer = shared.snapshot().writing;
                    if let Some(layer) = layer {
                        // A panic in the inner store must not leave `writing` set
                        // forever (waiters would hang): it fails like an error.
                        let written =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                shared.write(&layer)
                            }));
                        let failure = match written {
                            Ok(Ok(())) => None,
                            Ok(Err(error)) => Some(error.to_string()),
                            Err(_) => Some("the inner store panicked".to_string()),
                        };
                        if let Some(failure) = failure {
                            shared.record_failure(failure);
                        }
                    }
                    let _done = shared
                        .writing_done
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    shared.written.notify_all();
                })
            });
            if let Err(why) = spawned {
                // No thread (the process is out of threads or memory): the layer
                // is frozen and must be written, or every later checkpoint (and
                // dropping the store) would wait for it forever.
                tracing::warn!("starting a checkpoint thread failed ({why}): writing it here");
                return self.shared.write_here(&layer);
            }
        }
        Ok(())
    }

    fn due(&self, layer: &Layer) -> bool {
        layer.changes.len() >= self.max_dirty_keys
            || layer
                .since
                .lock()
                .is_some_and(|since| since.elapsed() >= self.every)
    }
}

#[cfg(test)]
thread_local! {
    /// Tests make starting a checkpoint thread fail, as a process out of threads.
    static NO_CHECKPOINT_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The builder of a background checkpoint's thread.
fn spawn_checkpoint_thread() -> std::io::Result<std::thread::Builder> {
    #[cfg(test)]
    if NO_CHECKPOINT_THREADS.with(std::cell::Cell::get) {
        return Err(std::io::Error::from(std::io::ErrorKind::WouldBlock));
    }
    Ok(std::thread::Builder::new().name("tally-checkpoint".into()))
}

/// Dropping waits for a checkpoint in flight, so nothing writes to the inner store
/// once its owner is gone (a reopen of the same store never races an old write).
impl<S> Drop for CheckpointStore<S> {
    fn drop(&mut self) {
        self.shared.wait_idle();
        // A layer copy in flight too: it writes into the store's directory.
        if let Some(copies) = &self.copies {
            while copies.in_flight.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

impl<S> Shared<S> {
    /// The layers' pointers, copied under the lock (held for three clones).
    fn snapshot(&self) -> Snapshot {
        let layers = self.layers.read();
        Snapshot {
            pending: layers.pending.clone(),
            active: layers.active.clone(),
            writing: layers.writing.clone(),
        }
    }

    fn lock_write(&self) -> RwLockWriteGuard<'_, Layers> {
        self.layers.write()
    }

    fn failed_is_none(&self) -> bool {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Fails every later write (fail-stop) and wakes whoever waits for a checkpoint.
    fn record_failure(&self, failure: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(failure);
        let _done = self.writing_done.lock().unwrap_or_else(|p| p.into_inner());
        self.written.notify_all();
    }

    /// Waits until no checkpoint is being written (or the one written failed).
    fn wait_idle(&self) {
        let mut done = self.writing_done.lock().unwrap_or_else(|p| p.into_inner());
        while self.layers.read().writing.is_some() && self.failed_is_none() {
            done = self
                .written
                .wait_timeout(done, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl<S: ProjectionStore> Shared<S> {
    fn check_failed(&self) -> Result<(), StoreError> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(error) => Err(StoreError::Backend(format!(
                "an earlier checkpoint failed: {error}"
            ))),
            None => Ok(()),
        }
    }

    /// Waits until no checkpoint is being written; fails if one failed.
    fn wait_written(&self) -> Result<(), StoreError> {
        self.wait_idle();
        self.check_failed()
    }

    /// Moves the active layer to `writing` (none may be in flight); returns it, or
    /// `None` when there is nothing to write.
    fn freeze(&self) -> Option<Arc<Layer>> {
        // An empty layer has no age: nothing to write. Only the writer fills the
        // layer, and the writer is here, so the answer holds under the lock below,
        // which then only swaps pointers (the fresh layer is allocated before it).
        (*self.layers.read().active.since.lock())?;
        let fresh = Arc::new(Layer::with_capacity(self.layer_keys));
        let mut layers = self.lock_write();
        // Writers are serialised and an apply merges its whole chunk before it
        // returns, so no chunk is half in the layer being frozen.
        debug_assert!(layers.pending.is_none());
        let layer = std::mem::replace(&mut layers.active, fresh);
        layers.writing = Some(layer.clone());
        Some(layer)
    }

    /// Writes a frozen layer in the caller's thread. A failure is recorded as a
    /// background checkpoint's is: later writes fail, and the layer left in
    /// `writing` is not waited for (dropping the store waited for it forever: a
    /// server whose last checkpoint failed on shutdown never exited).
    fn write_here(&self, layer: &Layer) -> Result<(), StoreError> {
        let written = self.write(layer);
        if let Err(error) = &written {
            self.record_failure(error.to_string());
        }
        written
    }

    /// Writes a frozen layer as one inner batch, then drops it from the reads.
    fn write(&self, layer: &Layer) -> Result<(), StoreError> {
        // A frozen layer holds still, so its changes are put in order once, for
        // the stage file and the inner store's writes alike: each walk merged the
        // runs and looked every key up in the value map, ~a third of the
        // checkpoint thread per walk (docs/benchmarks.md, "Bucket rows").
        let changes = layer.changes.snapshot();
        let positions = layer.positions();
        let durable = || layer.durable.store(true, Ordering::SeqCst);
        let apply = || {
            self.inner
                .apply_from_noting_durable(&changes, &positions, &durable)
        };
        match &self.cache {
            Some(cache) => cache.around_write(&changes, apply)?,
            None => apply()?,
        }
        {
            let mut layers = self.lock_write();
            self.retired_layers.fetch_add(1, Ordering::SeqCst);
            layers.writing = None;
        }
        *self
            .checkpointed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = std::time::Instant::now();
        Ok(())
    }
}

impl<S: ProjectionStore + 'static> ProjectionStore for CheckpointStore<S> {
    fn checkpoint_age(&self) -> Option<std::time::Duration> {
        Some(
            self.shared
                .checkpointed_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed(),
        )
    }

    fn dirty_keys(&self) -> usize {
        CheckpointStore::dirty_keys(self)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        match (self.unwritten(key), &self.shared.cache) {
            (Some(value), _) => Ok(value),
            (None, Some(cache)) if cache.holds_table(key) => {
                cache.read_through(key, || self.shared.inner.get(key))
            }
            (None, _) => self.shared.inner.get(key),
        }
    }

    fn retired_layers(&self) -> Option<u64> {
        Some(self.shared.retired_layers.load(Ordering::SeqCst))
    }

    fn unwritten(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        let layers = self.shared.snapshot();
        if let Some(value) = layers.pending.as_ref().and_then(|p| p.get(key)) {
            return Some(value.as_deref().map(<[u8]>::to_vec));
        }
        if let Some(value) = layers.active.changes.get(key) {
            return Some(value);
        }
        layers.writing.as_ref().and_then(|w| w.changes.get(key))
    }

    /// The inner store's entries merged with the layers': a key a layer holds is taken
    /// from the newest layer holding it (its value, or skipped when deleted there).
    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        // One step over the whole range: the layers as they were at one moment.
        self.scan_step(start, end, reverse, usize::MAX, visit)
            .map(drop)
    }

    fn scan_in_steps(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        let mut from = if reverse { end } else { start }.map(<[u8]>::to_vec);
        loop {
            let bound = from.as_ref().map(Vec::as_slice);
            let (lo, hi) = if reverse {
                (start, bound)
            } else {
                (bound, end)
            };
            match self.scan_step(lo, hi, reverse, SCAN_WINDOW, visit)? {
                Some(cut) => from = Bound::Excluded(cut.to_vec()),
                None => return Ok(()),
            }
        }
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        let shared = changes
            .into_iter()
            .map(|(key, value)| (key.into(), value.map(Arc::from)))
            .collect();
        self.apply_shared(shared, positions)
    }

    fn apply_shared(
        &self,
        changes: Vec<SharedChange>,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.check_failed()?;
        // Built before any lock is taken (module doc); a later change of a key wins.
        let pending = Arc::new(Pending::new(changes));
        let active = {
            let mut layers = self.shared.lock_write();
            // Positions alone publish nothing a scan could see half of.
            if !pending.is_empty() {
                layers.pending = Some(pending.clone());
                self.shared.chunks_published.fetch_add(1, Ordering::SeqCst);
            }
            let layer = &layers.active;
            layer.positions.lock().extend(positions.iter().copied());
            let mut since = layer.since.lock();
            if since.is_none() && (!pending.is_empty() || !positions.is_empty()) {
                *since = Some(Instant::now());
            }
            drop(since);
            layers.active.clone()
        };
        // Readers find these keys in `pending` until it is retired below.
        active.changes.insert_sorted(&pending.entries);
        if !pending.is_empty() {
            self.shared.lock_write().pending = None;
        }
        self.applies.fetch_add(1, Ordering::SeqCst);
        if self.due(&active) {
            self.start_checkpoint()?;
        } else {
            self.copy_layer_if_due(&active);
        }
        Ok(())
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        let layers = self.shared.snapshot();
        if let Some(next_offset) = layers.active.positions.lock().get(&partition) {
            return Ok(*next_offset);
        }
        if let Some(next_offset) = layers
            .writing
            .as_ref()
            .and_then(|w| w.positions.lock().get(&partition).copied())
        {
            return Ok(next_offset);
        }
        self.shared.inner.position(partition)
    }

    /// A checkpoint, then the inner store's flush: everything applied is durable.
    fn flush(&self) -> Result<(), StoreError> {
        self.checkpoint()?;
        self.shared.inner.flush()
    }

    /// The aux space is written through, so only the inner store needs flushing.
    fn flush_aux(&self) -> Result<(), StoreError> {
        self.shared.inner.flush()
    }

    fn tick(&self) -> Result<(), StoreError> {
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.check_failed()?;
        let active = self.shared.snapshot().active;
        if self.due(&active) {
            self.start_checkpoint()?;
        } else {
            self.copy_layer_if_due(&active);
        }
        Ok(())
    }

    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.shared.inner.aux_get(key)
    }

    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        self.shared.inner.aux_put(key, value)
    }

    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        self.shared.inner.aux_scan(visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use proptest::prelude::*;

    fn bound(kind: u8, key: &[u8]) -> Bound<&[u8]> {
        match kind % 3 {
            0 => Bound::Included(key),
            1 => Bound::Excluded(key),
            _ => Bound::Unbounded,
        }
    }

    proptest! {
        /// A chunk's sorted list answers like a map the changes were inserted into
        /// in order (the last change of a key wins), for every key and any bounds.
        #[test]
        fn pending_matches_a_map_of_its_changes(
            changes in proptest::collection::vec(
                (proptest::collection::vec(0u8..4, 0..4), proptest::option::of(0u8..255)),
                0..60,
            ),
            probes in proptest::collection::vec(
                (proptest::collection::vec(0u8..4, 0..4), 0u8..3, proptest::collection::vec(0u8..4, 0..4), 0u8..3),
                1..20,
            ),
        ) {
            let changes: Vec<Change> = changes
                .into_iter()
                .map(|(key, value)| (key, value.map(|v| vec![v])))
                .collect();
            let mut reference: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
            for (key, value) in &changes {
                reference.insert(key.clone(), value.clone());
            }
            let pending = Pending::new(
                changes.into_iter().map(|(k, v)| (k.into(), v.map(Arc::from))).collect(),
            );
            prop_assert_eq!(pending.entries.len(), reference.len());
            for (key, value) in &reference {
                prop_assert_eq!(
                    pending.get(key).map(|v| v.as_deref().map(<[u8]>::to_vec)),
                    Some(value.clone())
                );
            }
            for (start, start_kind, end, end_kind) in &probes {
                let (start, end) = (bound(*start_kind, start), bound(*end_kind, end));
                let valid = match (start, end) {
                    (Bound::Included(s) | Bound::Excluded(s), Bound::Included(e) | Bound::Excluded(e)) => {
                        s < e || (s == e && matches!((start, end), (Bound::Included(_), Bound::Included(_))))
                    }
                    _ => true,
                };
                let got: Vec<(Vec<u8>, Option<Vec<u8>>)> = pending
                    .range(start, end)
                    .iter()
                    .map(|(k, v)| (k.to_vec(), v.as_deref().map(<[u8]>::to_vec)))
                    .collect();
                let expected: Vec<(Vec<u8>, Option<Vec<u8>>)> = if valid {
                    reference
                        .range::<[u8], _>((start, end))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                } else {
                    Vec::new()
                };
                prop_assert_eq!(got, expected);
            }
        }
    }

    fn put(key: &str, value: &str) -> Change {
        (key.as_bytes().to_vec(), Some(value.as_bytes().to_vec()))
    }

    fn keys(store: &dyn ProjectionStore, reverse: bool) -> Vec<String> {
        let mut seen = Vec::new();
        store
            .scan(Bound::Unbounded, Bound::Unbounded, reverse, &mut |k, v| {
                seen.push(format!(
                    "{}={}",
                    String::from_utf8_lossy(k),
                    String::from_utf8_lossy(v)
                ));
                Visit::Continue
            })
            .unwrap();
        seen
    }

    #[test]
    fn nothing_reaches_the_inner_store_before_a_checkpoint() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        store.apply(vec![put("a", "1")], &[(0, 5)]).unwrap();
        assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(store.position(0).unwrap(), 5);
        assert_eq!(store.inner().get(b"a").unwrap(), None);
        assert_eq!(store.inner().position(0).unwrap(), 0);
        store.checkpoint().unwrap();
        assert_eq!(store.inner().get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(store.inner().position(0).unwrap(), 5);
        assert_eq!(store.dirty_keys(), 0);
    }

    #[test]
    fn unwritten_answers_only_for_keys_a_layer_holds() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        store
            .inner()
            .apply(vec![put("old", "0")], &[(0, 1)])
            .unwrap();
        store
            .apply(vec![put("a", "1"), (b"old".to_vec(), None)], &[(0, 2)])
            .unwrap();
        assert_eq!(store.unwritten(b"a"), Some(Some(b"1".to_vec())));
        assert_eq!(store.unwritten(b"old"), Some(None), "a delete is held too");
        assert_eq!(store.unwritten(b"never"), None);
        store.checkpoint().unwrap();
        assert_eq!(
            store.unwritten(b"a"),
            None,
            "written: only the inner store answers"
        );
        assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
    }

    #[test]
    fn retired_layers_counts_the_layers_written_and_dropped() {
        assert_eq!(
            MemoryStore::new().retired_layers(),
            None,
            "no layer, no count"
        );
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        let before = store.retired_layers();
        assert_eq!(before, Some(0));
        store.apply(vec![put("fresh", "1")], &[(0, 1)]).unwrap();
        assert_eq!(store.retired_layers(), before, "applied, still in memory");
        assert!(store.unwritten(b"fresh").is_some());
        store.checkpoint().unwrap();
        assert_eq!(store.retired_layers(), Some(1), "written and dropped");
        assert_eq!(store.unwritten(b"fresh"), None);
        assert_eq!(store.get(b"fresh").unwrap().as_deref(), Some(&b"1"[..]));
        store.checkpoint().unwrap();
        assert_eq!(
            store.retired_layers(),
            Some(1),
            "nothing to write, none dropped"
        );
    }

    /// The journal's promise (`retired_layers`): while the count read before a
    /// key was applied has not moved, the key is in memory; once a key is out of
    /// memory, the count has moved. Checkpoints run in the background all along.
    #[test]
    fn a_key_applied_after_the_count_is_in_memory_until_the_count_moves() {
        let store = Arc::new(CheckpointStore::with_limits(
            MemoryStore::new(),
            16,
            Duration::from_secs(60),
        ));
        let (sent, received) = std::sync::mpsc::channel::<(u32, Option<u64>)>();
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..20_000u32 {
                    let before = store.retired_layers();
                    let key = format!("k{i:06}");
                    store
                        .apply(vec![put(&key, "v")], &[(0, u64::from(i) + 1)])
                        .unwrap();
                    sent.send((i, before)).unwrap();
                }
            })
        };
        let (mut known_in_memory, mut read_through) = (0, 0);
        for (i, before) in received {
            let key = format!("k{i:06}");
            match store.unwritten(key.as_bytes()) {
                Some(value) => {
                    assert_eq!(value.as_deref(), Some(&b"v"[..]));
                    known_in_memory += 1;
                }
                None => {
                    assert_ne!(
                        store.retired_layers(),
                        before,
                        "{key} is out of memory but the count did not move"
                    );
                    assert_eq!(
                        store.get(key.as_bytes()).unwrap().as_deref(),
                        Some(&b"v"[..])
                    );
                    read_through += 1;
                }
            }
        }
        writer.join().unwrap();
        assert!(store.retired_layers().unwrap() > 0, "checkpoints ran");
        assert!(known_in_memory > 0, "{known_in_memory} / {read_through}");
    }

    #[test]
    fn scans_merge_the_layer_over_the_inner_store_in_both_directions() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        store
            .apply(vec![put("b", "old"), put("d", "old"), put("f", "old")], &[])
            .unwrap();
        store.checkpoint().unwrap();
        store
            .apply(
                vec![
                    put("a", "new"),
                    put("d", "new"),
                    (b"f".to_vec(), None),
                    put("g", "new"),
                ],
                &[],
            )
            .unwrap();
        let forward = keys(&store, false);
        assert_eq!(forward, ["a=new", "b=old", "d=new", "g=new"]);
        let mut backward = keys(&store, true);
        backward.reverse();
        assert_eq!(backward, forward);
        let mut first_two = Vec::new();
        store
            .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |k, _| {
                first_two.push(k.to_vec());
                if first_two.len() == 2 {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            })
            .unwrap();
        assert_eq!(first_two, [b"a".to_vec(), b"b".to_vec()]);
        store.checkpoint().unwrap();
        assert_eq!(keys(store.inner(), false), forward);
    }

    #[test]
    fn a_full_layer_or_an_old_change_forces_a_checkpoint() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 3, Duration::from_secs(60));
        store
            .apply(vec![put("a", "1"), put("b", "1")], &[(0, 2)])
            .unwrap();
        assert_eq!(store.inner().position(0).unwrap(), 0);
        store.apply(vec![put("c", "1")], &[(0, 3)]).unwrap();
        store.shared.wait_written().unwrap();
        assert_eq!(
            store.inner().position(0).unwrap(),
            3,
            "three keys: checkpointed"
        );

        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::ZERO);
        store.apply(vec![put("a", "1")], &[(1, 9)]).unwrap();
        store.shared.wait_written().unwrap();
        assert_eq!(
            store.inner().position(1).unwrap(),
            9,
            "every change is old at once"
        );
        store.apply(vec![], &[(1, 10)]).unwrap();
        store.tick().unwrap();
        store.shared.wait_written().unwrap();
        assert_eq!(
            store.inner().position(1).unwrap(),
            10,
            "positions alone are kept too"
        );
    }

    /// Every chunk rewrites the same keys (enough for several merge slices) with its
    /// number; a reader's scan must show one number everywhere, never going back,
    /// while chunks merge and checkpoints move layers to the inner store.
    #[test]
    fn readers_see_every_chunk_whole_while_it_merges() {
        const CHUNKS: u64 = 150;
        let width = 1_543;
        let store =
            CheckpointStore::with_limits(MemoryStore::new(), 2 * width, Duration::from_secs(60));
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let (mut last, mut scans) = (0u64, 0u64);
                        while !done.load(std::sync::atomic::Ordering::Relaxed) {
                            let mut seen = std::collections::BTreeSet::new();
                            let mut count = 0;
                            store
                                .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |_, v| {
                                    seen.insert(String::from_utf8(v.to_vec()).unwrap());
                                    count += 1;
                                    Visit::Continue
                                })
                                .unwrap();
                            if count == 0 {
                                continue;
                            }
                            assert_eq!(count, width, "every key, once");
                            assert_eq!(seen.len(), 1, "one chunk everywhere: {seen:?}");
                            let chunk: u64 = seen.first().unwrap().parse().unwrap();
                            assert!(chunk >= last, "chunk {chunk} seen after {last}");
                            (last, scans) = (chunk, scans + 1);
                        }
                        scans
                    })
                })
                .collect();
            for chunk in 1..=CHUNKS {
                let changes = (0..width)
                    .map(|k| put(&format!("k{k:05}"), &chunk.to_string()))
                    .collect();
                store.apply(changes, &[(0, chunk)]).unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            let scans: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
            assert!(scans > 0, "the readers read while chunks merged");
        });
        store.checkpoint().unwrap();
        assert_eq!(store.inner().position(0).unwrap(), CHUNKS);
        assert_eq!(
            store.inner().get(b"k00000").unwrap().as_deref(),
            Some(CHUNKS.to_string().as_bytes())
        );
    }

    /// An inner store whose writes fail with an error, or panic.
    #[derive(Debug, Default)]
    struct Broken {
        store: MemoryStore,
        panics: bool,
    }

    impl ProjectionStore for Broken {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.store.get(key)
        }
        fn scan(
            &self,
            start: Bound<&[u8]>,
            end: Bound<&[u8]>,
            reverse: bool,
            visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
        ) -> Result<(), StoreError> {
            self.store.scan(start, end, reverse, visit)
        }
        fn apply(&self, _: Vec<Change>, _: &[(u32, u64)]) -> Result<(), StoreError> {
            if self.panics {
                panic!("disk on fire")
            }
            Err(StoreError::Backend("No space left on device".into()))
        }
        fn keeps_layer_copies(&self) -> bool {
            true
        }
        fn save_layer_copy(
            &self,
            _: &[(u32, u64)],
            _: &dyn ChangeSource,
            _: &[(u32, u64)],
        ) -> Result<(), StoreError> {
            self.apply(Vec::new(), &[])
        }
        fn position(&self, partition: u32) -> Result<u64, StoreError> {
            self.store.position(partition)
        }
        fn flush(&self) -> Result<(), StoreError> {
            Ok(())
        }
        fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.store.aux_get(key)
        }
        fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
            self.store.aux_put(key, value)
        }
        fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
            self.store.aux_scan(visit)
        }
    }

    /// Waits until no layer copy is being written.
    fn copies_settled<S>(store: &CheckpointStore<S>) {
        let in_flight = &store.copies.as_ref().expect("copies on").in_flight;
        while in_flight.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn the_active_layer_is_copied_and_a_reopen_takes_the_latest_copy_in() {
        let dir = tempfile::tempdir().unwrap();
        let first = vec![put("a", "1"), put("b", "1")];
        let second = vec![put("b", "2"), (b"a".to_vec(), None), put("c", "2")];
        {
            let sled = crate::SledStore::open(dir.path()).unwrap();
            // No checkpoint comes on its own: only copies reach the disk.
            let store = CheckpointStore::with_limits(sled, 1_000_000, Duration::from_secs(3600))
                .with_layer_copies(Duration::ZERO);
            store.apply(first.clone(), &[(0, 3)]).unwrap();
            copies_settled(&store);
            store.apply(second.clone(), &[(0, 8)]).unwrap();
            copies_settled(&store);
            // Dropped unflushed, as a SIGKILL leaves it.
        }
        let (sled, handed) = crate::SledStore::open_deferring_stage(dir.path()).unwrap();
        assert_eq!(sled.position(0).unwrap(), 0, "nothing was checkpointed");
        let (changes, positions) = handed.expect("the copy is handed over");
        assert_eq!(positions, vec![(0, 8)], "the latest copy");
        let reopened = CheckpointStore::new(sled);
        reopened.apply(changes, &positions).unwrap();
        let reference = crate::MemoryStore::new();
        reference.apply(first, &[]).unwrap();
        reference.apply(second, &[(0, 8)]).unwrap();
        assert_eq!(keys(&reopened, false), keys(&reference, false));
        assert_eq!(reopened.get(b"b").unwrap(), Some(b"2".to_vec()));
        assert_eq!(reopened.position(0).unwrap(), 8);
    }

    #[test]
    fn no_copy_is_taken_while_a_checkpoint_writes_or_of_an_unchanged_layer() {
        let dir = tempfile::tempdir().unwrap();
        let sled = crate::SledStore::open(dir.path()).unwrap();
        let store = CheckpointStore::with_limits(sled, 1_000_000, Duration::from_secs(3600))
            .with_layer_copies(Duration::ZERO);
        let copy = dir.path().join(crate::sled_store::LAYER_COPY_FILE);
        store.tick().unwrap();
        copies_settled(&store);
        assert!(!copy.exists(), "nothing applied: nothing to copy");
        store.apply(vec![put("a", "1")], &[(0, 1)]).unwrap();
        copies_settled(&store);
        assert!(copy.exists());
        std::fs::remove_file(&copy).unwrap();
        store.tick().unwrap();
        copies_settled(&store);
        assert!(!copy.exists(), "no apply since the last copy");
        // Frozen as if a checkpoint were writing it: the next apply copies nothing.
        let frozen = store.shared.freeze().expect("a layer to freeze");
        store.apply(vec![put("b", "1")], &[(0, 2)]).unwrap();
        copies_settled(&store);
        assert!(
            !copy.exists(),
            "not while a checkpoint is in flight and not yet durable"
        );
        store.shared.write(&frozen).unwrap();
        store.tick().unwrap();
        copies_settled(&store);
        assert!(copy.exists(), "copied once the checkpoint ended");
    }

    /// What a checkpoint of the frozen `layer` does first: its stage file, durable,
    /// and the layer marked so (none of it in sled yet).
    fn stage_durably(store: &CheckpointStore<crate::SledStore>, layer: &Layer) {
        store
            .shared
            .inner
            .stage(&layer.changes.snapshot(), &layer.positions())
            .unwrap();
        layer.durable.store(true, Ordering::SeqCst);
    }

    /// One step of a server's life for `copies_and_crashes_restore_the_log`.
    #[derive(Debug, Clone)]
    enum Step {
        /// A chunk of the log (key, value or a delete), applied at the next position;
        /// every apply copies the layer when a copy may be taken.
        Apply(Vec<(u8, Option<u8>)>),
        /// A checkpoint freezes the active layer; with `durable`, its stage is then
        /// in place (a checkpoint that is not yet durable takes no copy over it).
        Freeze { durable: bool },
        /// The first this many changes of a durable frozen layer reach sled, its
        /// positions not yet.
        PartWritten(usize),
        /// The frozen layer's checkpoint ends.
        Written,
        /// SIGKILL and a restart: the layers are lost; the restart takes in what
        /// `open_deferring_stage` hands over and re-applies the log past its positions.
        Crash,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => proptest::collection::vec((0u8..12, proptest::option::of(0u8..4)), 1..6)
                .prop_map(Step::Apply),
            1 => any::<bool>().prop_map(|durable| Step::Freeze { durable }),
            1 => (0usize..8).prop_map(Step::PartWritten),
            1 => Just(Step::Written),
            1 => Just(Step::Crash),
        ]
    }

    /// A restart as the service makes it: sled with what it hands over applied to
    /// a fresh write-back layer, copies every apply, the log re-applied past the
    /// positions it reaches.
    fn restart(dir: &std::path::Path, log: &[Vec<Change>]) -> CheckpointStore<crate::SledStore> {
        let (sled, handed) = crate::SledStore::open_deferring_stage(dir).unwrap();
        let store = CheckpointStore::with_limits(sled, 1_000_000, Duration::from_secs(3600))
            .with_layer_copies(Duration::ZERO);
        if let Some((changes, positions)) = handed {
            store.apply(changes, &positions).unwrap();
            copies_settled(&store);
        }
        let from = store.position(0).unwrap() as usize;
        for (at, chunk) in log.iter().enumerate().skip(from) {
            store.apply(chunk.clone(), &[(0, at as u64 + 1)]).unwrap();
            copies_settled(&store);
        }
        store
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// For any log, any checkpoints (durable or not when the kill comes, partly
        /// written), any copies they allow and any crash points, a restart holds
        /// exactly the fold of the whole log, at its end.
        #[test]
        fn copies_and_crashes_restore_the_log(
            steps in proptest::collection::vec(step(), 1..40),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut log: Vec<Vec<Change>> = Vec::new();
            let mut store = restart(dir.path(), &log);
            let mut frozen: Option<Arc<Layer>> = None;
            for step in steps.into_iter().chain([Step::Crash]) {
                match step {
                    Step::Apply(chunk) => {
                        let chunk: Vec<Change> = chunk
                            .into_iter()
                            .map(|(key, value)| (vec![b'k', key], value.map(|v| vec![v])))
                            .collect();
                        log.push(chunk.clone());
                        store.apply(chunk, &[(0, log.len() as u64)]).unwrap();
                        copies_settled(&store);
                    }
                    Step::Freeze { durable } => {
                        if frozen.is_none() {
                            frozen = store.shared.freeze();
                            if let Some(layer) = frozen.as_ref().filter(|_| durable) {
                                stage_durably(&store, layer);
                            }
                        }
                    }
                    Step::PartWritten(n) => {
                        if let Some(layer) = frozen.as_ref().filter(|l| l.durable.load(Ordering::SeqCst)) {
                            let part: Vec<Change> = layer
                                .changes
                                .snapshot()
                                .into_iter()
                                .take(n)
                                .map(|(key, value)| (key.to_vec(), value.map(|v| v.to_vec())))
                                .collect();
                            store.shared.inner.apply(part, &[]).unwrap();
                        }
                    }
                    Step::Written => {
                        if let Some(layer) = frozen.take() {
                            store.shared.write(&layer).unwrap();
                        }
                    }
                    Step::Crash => {
                        if frozen.take().is_some() {
                            // Its write never ends: dropping must not wait for it.
                            store.shared.record_failure("killed".into());
                        }
                        drop(store);
                        store = restart(dir.path(), &log);
                        let reference = MemoryStore::new();
                        for chunk in &log {
                            reference.apply(chunk.clone(), &[]).unwrap();
                        }
                        prop_assert_eq!(keys(&store, false), keys(&reference, false));
                        prop_assert_eq!(store.position(0).unwrap(), log.len() as u64);
                    }
                }
            }
        }
    }

    /// A store whose next checkpoint is frozen and durable as a stage but none of
    /// it in sled yet, as a checkpoint thread leaves it between its stage and its
    /// sled inserts; `first` fills the frozen layer (past the single-batch size,
    /// so it is staged), `later` goes to the active layer above it and is copied.
    fn copied_over_a_durable_stage(
        dir: &std::path::Path,
        first: &[Change],
        later: &[Change],
    ) -> (CheckpointStore<crate::SledStore>, Arc<Layer>) {
        let sled = crate::SledStore::open(dir).unwrap();
        let store = CheckpointStore::with_limits(sled, 1_000_000, Duration::from_secs(3600))
            .with_layer_copies(Duration::ZERO);
        store.apply(first.to_vec(), &[(0, 10), (1, 3)]).unwrap();
        copies_settled(&store);
        let frozen = store.shared.freeze().expect("a layer to freeze");
        stage_durably(&store, &frozen);
        store.apply(later.to_vec(), &[(0, 14)]).unwrap();
        copies_settled(&store);
        (store, frozen)
    }

    #[test]
    fn a_copy_made_while_a_durable_stage_is_written_restores_above_it() {
        let first: Vec<Change> = (0..2 * crate::sled_store::SLED_ATOMIC_BATCH_MAX_KEYS)
            .map(|i| put(&format!("k{i:06}"), "1"))
            .collect();
        let later = vec![
            put("k000001", "2"),
            (b"k000002".to_vec(), None),
            put("z", "2"),
        ];
        let reference = crate::MemoryStore::new();
        reference.apply(first.clone(), &[(1, 3)]).unwrap();
        reference.apply(later.clone(), &[(0, 14)]).unwrap();
        // Killed before the stage reached sled, and killed after it did.
        for stage_written in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            {
                let (store, frozen) = copied_over_a_durable_stage(dir.path(), &first, &later);
                if stage_written {
                    store.shared.write(&frozen).unwrap();
                } else {
                    // The write never ends: dropping the store must not wait for it.
                    store.shared.record_failure("killed mid-checkpoint".into());
                }
                // Dropped with the active layer unwritten, as a SIGKILL leaves it.
            }
            let (sled, handed) = crate::SledStore::open_deferring_stage(dir.path()).unwrap();
            let (changes, positions) = handed.expect("the copy is handed over");
            // With the stage in sled, only the copy is handed over.
            let expected = if stage_written {
                vec![(0, 14)]
            } else {
                vec![(0, 14), (1, 3)]
            };
            assert_eq!(positions, expected, "stage written: {stage_written}");
            let reopened = CheckpointStore::new(sled);
            reopened.apply(changes, &positions).unwrap();
            assert_eq!(keys(&reopened, false), keys(&reference, false));
            assert_eq!(reopened.get(b"k000001").unwrap(), Some(b"2".to_vec()));
            assert_eq!(reopened.position(0).unwrap(), 14);
            assert_eq!(reopened.position(1).unwrap(), 3);
        }
    }

    #[test]
    fn a_failed_background_checkpoint_fails_later_writes_and_never_hangs() {
        let store = CheckpointStore::with_limits(
            Broken {
                panics: true,
                ..Broken::default()
            },
            1,
            Duration::ZERO,
        );
        store.apply(vec![put("a", "1")], &[(0, 1)]).unwrap();
        assert!(
            store.shared.wait_written().is_err(),
            "the failure is reported"
        );
        assert!(store.apply(vec![put("b", "1")], &[(0, 2)]).is_err());
        assert!(store.flush().is_err());
        assert_eq!(
            store.get(b"a").unwrap().as_deref(),
            Some(&b"1"[..]),
            "what was applied stays readable"
        );
        drop(store); // returns: nothing waits on the failed write
    }

    /// A process that cannot start a checkpoint's thread writes the layer in the
    /// applying thread instead of leaving it frozen for no one to write.
    #[test]
    fn a_checkpoint_without_a_thread_is_written_in_place() {
        // In a thread of its own (the hook is per thread), which reports what it
        // saw before it drops the store: a frozen layer no one writes would hang
        // the drop, and the test then fails on what was reported.
        let (finished, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            NO_CHECKPOINT_THREADS.with(|no| no.set(true));
            let store = CheckpointStore::with_limits(MemoryStore::new(), 1, Duration::ZERO);
            let applied = [
                store.apply(vec![put("a", "1")], &[(0, 1)]).is_ok(),
                store.apply(vec![put("b", "2")], &[(0, 2)]).is_ok(),
            ];
            let seen = (
                applied,
                store.retired_layers(),
                store.inner().position(0).unwrap(),
                store.inner().get(b"b").unwrap(),
            );
            let _ = finished.send(seen);
            drop(store);
        });
        let (applied, retired, position, stored) = outcome
            .recv_timeout(Duration::from_secs(10))
            .expect("an apply hung behind a checkpoint no thread writes");
        assert_eq!(applied, [true, true], "both applies succeed");
        assert_eq!(retired, Some(2), "both layers written");
        assert_eq!(position, 2);
        assert_eq!(stored.as_deref(), Some(&b"2"[..]));
    }

    /// A layer copy whose inner store panics or fails leaves the store droppable
    /// (dropping it waits for a copy in flight).
    #[test]
    fn a_failed_layer_copy_never_hangs_the_drop() {
        for panics in [true, false] {
            let (finished, outcome) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let store = CheckpointStore::with_limits(
                    Broken {
                        panics,
                        ..Broken::default()
                    },
                    1_000,
                    Duration::from_secs(3600),
                )
                .with_layer_copies(Duration::ZERO);
                store.apply(vec![put("a", "1")], &[(0, 1)]).unwrap();
                assert!(
                    store
                        .copies
                        .as_ref()
                        .unwrap()
                        .applies_copied
                        .load(Ordering::SeqCst)
                        > 0
                );
                drop(store);
                let _ = finished.send(());
            });
            assert!(
                outcome.recv_timeout(Duration::from_secs(10)).is_ok(),
                "dropping the store hung on a failed layer copy (panics: {panics})"
            );
        }
    }

    /// A checkpoint written in the caller's thread (a flush on shutdown) that fails
    /// reports it, fails later writes, and leaves the store droppable: the drop
    /// waited forever for the layer it left frozen.
    #[test]
    fn a_failed_synchronous_checkpoint_fails_later_writes_and_never_hangs() {
        // In a thread of its own: a store that hangs on drop (also when an assert
        // unwinds through it) fails the test instead of hanging it.
        let (finished, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let checked = std::panic::catch_unwind(|| {
                let store = CheckpointStore::with_limits(
                    Broken::default(),
                    1_000,
                    Duration::from_secs(3600),
                );
                store.apply(vec![put("a", "1")], &[(0, 1)]).unwrap();
                let error = store.checkpoint().unwrap_err();
                assert!(error.to_string().contains("No space left"), "{error}");
                let later = store.apply(vec![put("b", "1")], &[(0, 2)]).is_err();
                let flushed = store.flush().is_err();
                let readable = store.get(b"a").unwrap();
                drop(store);
                (later, flushed, readable)
            });
            let _ = finished.send(checked.map_err(|_| "panicked"));
        });
        let (later, flushed, readable) = outcome
            .recv_timeout(Duration::from_secs(10))
            .expect("dropping the store hung on the failed checkpoint")
            .unwrap();
        assert!(later, "a write after the failure fails");
        assert!(flushed, "a flush after the failure fails");
        assert_eq!(
            readable.as_deref(),
            Some(&b"1"[..]),
            "what was applied stays readable"
        );
    }
}
