//! The projection runtime: what every projection needs from the log, and nothing
//! of what a projection means (ARCHITECTURE.md, "tally-runtime").
//!
//! One task per partition tails the log from the position the projection store
//! holds and hands each chunk of records to the registered [`Projection`] in three
//! steps, as TigerBeetle's state machine does:
//! 1. **prefetch**: the projection names the log records its apply will read back
//!    (`plan`), and the runtime fetches them from the log (`Log::read_at`), without
//!    holding the apply lock;
//! 2. **apply**: deterministic, one chunk at a time whatever its partition (chunks of
//!    different partitions may touch the same state); the projection commits the
//!    chunk with the positions it reaches. Apply may ask for more records (another
//!    partition's chunk committed in between) or to wait (a record of another
//!    partition it depends on is not applied yet); the runtime does both and retries;
//! 3. **after-commit**: the projection updates what it serves from memory, then the
//!    runtime moves the partition's watermark, which wakes writers waiting for their
//!    record (read-your-writes).
//!
//! A node that shares the projection with a cluster (ARCHITECTURE.md, "Partitions
//! and ownership") projects in full only the partitions its [`Ownership`] names; of
//! the others it applies only what every node needs (`ChunkMode::Shared`), and the
//! projection remembers where it began skipping. When the node gains such a
//! partition, its task first restores it (`ChunkMode::Restore`: the skipped records,
//! in log order, without moving the watermark), then tails it in full.
//!
//! It also keeps readiness (caught up with where the log ended at start-up), stops
//! on failure (a corrupt log, a failed commit: fail-stop, never skip), lets an idle
//! write-back store checkpoint, commits Kafka group offsets once the projection is
//! flushed, and replays the log into a store (`replay_log`, partitions in turns).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

mod watermark;

use tally_log::{Log, LogEntry, LogError};
use tally_projection::{ProjectionStore, StoreError};
use tokio::sync::watch;

/// Records handed to a projection at once: large enough to amortize the commit, small
/// enough that read-your-writes waits stay short.
pub const CHUNK_MAX_RECORDS: usize = 32;
/// How long a tailing read waits for records before the idle work (checkpoint tick).
pub const TAIL_WAIT_MS: u64 = 200;
/// Pause before retrying a chunk whose apply waits for another partition.
pub const WAIT_RETRY_MS: u64 = 20;
/// How long a read-your-writes wait sleeps before it looks again whether the
/// projector failed (a failure also wakes it; this covers a failure flagged while
/// the waiter was filing itself).
pub const WAIT_SLICE_MS: u64 = 500;
/// Pause before reopening a reader after a passing log failure.
pub const READ_RETRY_MS: u64 = 500;
/// Kafka mode: how often the projection is flushed and the group offsets committed.
pub const KAFKA_COMMIT_INTERVAL_MS: u64 = 1_000;
/// How often a long restore logs how far it got.
pub const RESTORE_PROGRESS_EVERY_MS: u64 = 5_000;
/// Consumer group name the runtime commits under (Kafka).
pub const PROJECTOR_GROUP: &str = "tally-projector";

/// How a chunk is to be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkMode {
    /// Every record (a partition this node projects).
    Full,
    /// Only the records every node needs whoever owns the partition (what routes a
    /// request to its owner); the projection notes where it began skipping the
    /// others (`Projection::skipped_from`). The watermark moves as usual.
    Shared,
    /// Records skipped earlier, being caught up with: everything but what `Shared`
    /// applied. The watermark stays; the projection moves its skip mark to the
    /// chunk's end, or clears it once that reaches `until` (the watermark).
    Restore { partition: u32, until: u64 },
}

/// Which partitions this node projects in full, and how far each partition it
/// skipped has been caught up with. A node alone projects every partition.
#[derive(Debug)]
pub struct Ownership {
    /// `None`: every partition.
    projecting: RwLock<Option<BTreeSet<u32>>>,
    /// Per partition: the first offset whose records were skipped and are not yet
    /// restored (`NOT_SKIPPED`: none).
    skipped_from: Vec<AtomicU64>,
}

const NOT_SKIPPED: u64 = u64::MAX;

impl Ownership {
    /// Every partition of `partitions` projected in full.
    pub fn everything(partitions: u32) -> Ownership {
        Ownership {
            projecting: RwLock::new(None),
            skipped_from: (0..partitions)
                .map(|_| AtomicU64::new(NOT_SKIPPED))
                .collect(),
        }
    }

    /// Projects `partitions` in full from now on (`None`: all of them).
    pub fn set_projecting(&self, partitions: Option<BTreeSet<u32>>) {
        *self.projecting.write().unwrap_or_else(|p| p.into_inner()) = partitions;
    }

    /// Whether this node projects `partition` in full (restored or not).
    pub fn projects(&self, partition: u32) -> bool {
        self.projecting
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_none_or(|owned| owned.contains(&partition))
    }

    /// The partitions projected in full (`None`: all).
    pub fn projecting(&self) -> Option<BTreeSet<u32>> {
        self.projecting
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The first offset of `partition` whose records were skipped and are not yet
    /// restored.
    pub fn skipped_from(&self, partition: u32) -> Option<u64> {
        self.skipped_from
            .get(partition as usize)
            .map(|s| s.load(Ordering::SeqCst))
            .filter(|from| *from != NOT_SKIPPED)
    }

    fn note_skipped_from(&self, partition: u32, from: Option<u64>) {
        if let Some(slot) = self.skipped_from.get(partition as usize) {
            slot.store(from.unwrap_or(NOT_SKIPPED), Ordering::SeqCst);
        }
    }

    /// Whether `partition` is projected in full and holds every applied record:
    /// what this node answers about it is complete.
    pub fn serves(&self, partition: u32) -> bool {
        self.projects(partition) && self.skipped_from(partition).is_none()
    }

    /// Whether the record at `offset`, once under the watermark, was applied in
    /// full here (not skipped as another node's).
    pub fn applied_in_full(&self, partition: u32, offset: u64) -> bool {
        self.skipped_from(partition)
            .is_none_or(|from| offset < from)
    }
}

/// Why a chunk was not applied; the runtime retries the first two.
#[derive(Debug)]
pub enum ApplyFailure {
    /// Apply reads records it was not given: fetch these and retry.
    NeedRecords(Vec<(u32, u64)>),
    /// Apply depends on a record of another partition not applied yet: retry shortly.
    NotYet,
    /// The projection cannot go on (storage failure, corrupt state): stop.
    Fatal(String),
}

/// What the runtime knows about a committed chunk.
#[derive(Debug, Clone, Copy)]
pub struct Committed {
    pub partition: u32,
    /// Where the partition's next record starts: the new watermark.
    pub next_offset: u64,
    pub records: usize,
    /// A restored chunk (`ChunkMode::Restore`): the watermark did not move.
    pub restored: bool,
}

/// A projection the runtime drives. `decode` and `apply` run on the runtime's
/// background threads, one chunk at a time; everything else from the partition's
/// task.
pub trait Projection: Send + Sync + 'static {
    /// A chunk of entries, decoded once.
    type Chunk: Send + Sync + 'static;
    /// Records fetched for a chunk.
    type Fetched: Default + Send + 'static;
    /// What a committed chunk changed, for `after_commit`.
    type Applied: Send + 'static;

    /// A chunk of entries, decoded once, to be applied as `mode` says.
    fn decode(&self, entries: Vec<LogEntry>, mode: ChunkMode) -> Self::Chunk;
    /// The positions of the records apply will read back (prefetch).
    fn plan(&self, chunk: &Self::Chunk) -> Result<Vec<(u32, u64)>, String>;
    /// Called with each chunk while the projection catches up with the log after a
    /// start, before it is applied: a projection may read ahead what apply will
    /// read (off the apply thread, without waiting for it), so apply finds it in
    /// the store's cache. Reads only: apply's result never depends on it.
    fn read_ahead(&self, _chunk: &Arc<Self::Chunk>) {}
    /// Adds the record at a position to `fetched` from records the projection
    /// already holds decoded (read back recently, by apply or a query), if it
    /// holds it: then the log is not read for it.
    fn fetch_cached(&self, _fetched: &mut Self::Fetched, _partition: u32, _offset: u64) -> bool {
        false
    }
    /// Adds a fetched record (`None`: the log holds none there) to `fetched`.
    fn add_fetched(
        &self,
        fetched: &mut Self::Fetched,
        partition: u32,
        offset: u64,
        entry: Option<LogEntry>,
    ) -> Result<(), String>;
    /// Applies the chunk and commits it with its positions. Deterministic: a pure
    /// function of the records, the projection and what was fetched.
    fn apply(
        &self,
        chunk: &Self::Chunk,
        fetched: &Self::Fetched,
    ) -> Result<Self::Applied, ApplyFailure>;
    /// After the commit, before the watermark moves.
    fn after_commit(&self, applied: Self::Applied, committed: Committed);
    /// Where the projection began skipping `partition`'s records (`ChunkMode::Shared`)
    /// and has not restored them yet; a projection that never skips has none.
    fn skipped_from(&self, _partition: u32) -> Result<Option<u64>, String> {
        Ok(None)
    }
    /// Reads a snapshot of `partition` for `restore_snapshot`, if the projection
    /// has a source of them (a split cluster's changelog). Runs on a blocking
    /// thread, so the read holds up no chunk of another partition.
    fn prefetch_snapshot(&self, _partition: u32) {}
    /// The log position of the snapshot `prefetch_snapshot` read for `partition`
    /// and `restore_snapshot` has not taken yet, if any.
    fn snapshot_position(&self, _partition: u32) -> Option<u64> {
        None
    }
    /// Before a restore from the log: restores `partition` from the snapshot
    /// `prefetch_snapshot` read, if its position is in `(from, until]`, committing
    /// it with a skip mark at that position; returns the position and what changed
    /// for `after_commit`. Runs on the apply thread; an error stops the projection.
    fn restore_snapshot(
        &self,
        _partition: u32,
        _from: u64,
        _until: u64,
    ) -> Result<Option<(u64, Self::Applied)>, String> {
        Ok(None)
    }
}

/// Why waiting for a record failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WaitError {
    #[error("the projector stopped")]
    Failed,
    #[error("timed out waiting for the projection")]
    Timeout,
}

/// A thread at background priority (`tally_projection::priority`) that runs the
/// runtime's CPU work one job at a time: on a saturated machine requests get the
/// CPU first, and nothing waits on one job for long. The runtime has two: one
/// applies chunks (so they apply one at a time whatever their partition), one
/// decodes them (so the next chunk is decoded while one applies, and no decode
/// stands in the request workers' queue). The blocking pool would not do: it also
/// runs queries, and a pool thread once lowered cannot be raised back.
struct BackgroundThread {
    /// Unbounded, yet never long: each partition's task waits for its job's
    /// answer before it sends another, so at most one job per partition waits.
    jobs: std::sync::mpsc::Sender<BackgroundJob>,
}

type BackgroundJob = Box<dyn FnOnce() + Send>;

impl BackgroundThread {
    fn start(name: &str) -> Result<BackgroundThread, RuntimeError> {
        let (jobs, queue) = std::sync::mpsc::channel::<BackgroundJob>();
        let thread = name.to_string();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                if let Err(why) = tally_projection::priority::run_as_background_thread() {
                    tracing::warn!("{thread} runs at normal priority: {why}");
                }
                // Ends when the runtime is dropped (the sender with it).
                for job in queue {
                    // A panicking job drops its answer, which its caller reports;
                    // the thread stays for the next one.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .map_err(|error| RuntimeError::Projection(format!("starting {name}: {error}")))?;
        Ok(BackgroundThread { jobs })
    }

    /// Runs `work` on the thread and waits for its answer.
    async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Box::new(move || {
                let _ = answer.send(work());
            }))
            .map_err(|_| "a projector thread has stopped".to_string())?;
        answered
            .await
            .map_err(|_| "a projector task panicked".to_string())
    }
}

/// Watermarks, readiness and the failure flag of the projection tasks, over one log
/// and one projection store.
pub struct Runtime {
    log: Arc<dyn Log>,
    store: Arc<dyn ProjectionStore>,
    applied: Vec<watermark::Watermark>,
    startup_end: Vec<u64>,
    ready: AtomicBool,
    failed: AtomicBool,
    /// Applies chunks, one at a time whatever their partition.
    apply_thread: BackgroundThread,
    /// Decodes chunks.
    decode_thread: BackgroundThread,
    ownership: Arc<Ownership>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("log", &self.log.kind())
            .finish()
    }
}

impl Runtime {
    /// A runtime starting from the positions `store` holds; readiness waits for the
    /// ends the log has now.
    pub async fn new(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
    ) -> Result<Runtime, RuntimeError> {
        let mut applied = Vec::new();
        let mut startup_end = Vec::new();
        let ownership = Arc::new(Ownership::everything(log.partition_count()));
        for partition in 0..log.partition_count() {
            applied.push(watermark::Watermark::new(store.position(partition)?));
            startup_end.push(log.end_offset(partition).await?);
        }
        let runtime = Runtime {
            log,
            store,
            applied,
            startup_end,
            ready: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            apply_thread: BackgroundThread::start("tally-apply")?,
            decode_thread: BackgroundThread::start("tally-decode")?,
            ownership,
        };
        runtime.update_readiness(None);
        Ok(runtime)
    }

    /// Which partitions this node projects in full (every one unless a cluster
    /// says otherwise through `Ownership::set_projecting`).
    pub fn ownership(&self) -> &Arc<Ownership> {
        &self.ownership
    }

    /// Where the log ended on `partition` at start-up.
    pub fn startup_end(&self, partition: u32) -> u64 {
        self.startup_end[partition as usize]
    }

    /// The partition's watermark: every record below it is applied and readable.
    pub fn applied(&self, partition: u32) -> u64 {
        self.applied[partition as usize].get()
    }

    /// Caught up with where the log ended at start-up (once true, stays true).
    pub fn is_caught_up(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn fail(&self, partition: u32, why: &str) {
        tracing::error!(partition, "projector stopped: {why}");
        self.failed.store(true, Ordering::SeqCst);
        // Waiters check `has_failed` when woken: none waits out its timeout.
        for watermark in &self.applied {
            watermark.release_all();
        }
    }

    /// Notes readiness, with `moving` (partition, new watermark) counted as reached:
    /// readiness is set before a watermark is published, so whoever the new
    /// watermark wakes sees it.
    fn update_readiness(&self, moving: Option<(u32, u64)>) {
        let caught_up = self.applied.iter().zip(&self.startup_end).enumerate().all(
            |(partition, (applied, end))| {
                let reached = match moving {
                    Some((p, next)) if p as usize == partition => next,
                    _ => applied.get(),
                };
                reached >= *end
            },
        );
        if caught_up {
            self.ready.store(true, Ordering::SeqCst);
        }
    }

    /// Waits until the record at `offset` of `partition` is applied, at most `wait`;
    /// gives up at once when the projector has stopped (it never will be applied).
    pub async fn wait_applied(
        &self,
        partition: u32,
        offset: u64,
        wait: Duration,
    ) -> Result<(), WaitError> {
        let watermark = &self.applied[partition as usize];
        let deadline = Instant::now() + wait;
        loop {
            if self.has_failed() {
                return Err(WaitError::Failed);
            }
            let Some(passed) = watermark.wait_past(offset) else {
                return Ok(());
            };
            // In slices, so a failure flagged between the check above and the
            // filing (whose release this waiter missed) is still seen.
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(WAIT_SLICE_MS));
            if slice.is_zero() {
                return Err(WaitError::Timeout);
            }
            if let Ok(Ok(())) = tokio::time::timeout(slice, passed).await {
                return Ok(());
            }
        }
    }

    /// Waits until `partition` is applied up to `end` (exclusive), at most `wait`.
    pub async fn wait_reached(
        &self,
        partition: u32,
        end: u64,
        wait: Duration,
    ) -> Result<(), WaitError> {
        if end == 0 {
            return Ok(());
        }
        self.wait_applied(partition, end - 1, wait).await
    }

    /// Starts one task per partition driving `projection`; they stop when `shutdown`
    /// turns true.
    pub fn start<P: Projection>(
        self: &Arc<Self>,
        projection: Arc<P>,
        shutdown: watch::Receiver<bool>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..self.log.partition_count())
            .map(|partition| {
                let runtime = self.clone();
                let projection = projection.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move { runtime.tail(partition, projection, shutdown).await })
            })
            .collect()
    }

    async fn tail<P: Projection>(
        self: Arc<Self>,
        partition: u32,
        projection: Arc<P>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let commits_offsets = self.log.keeps_consumer_offsets();
        let mut last_commit = Instant::now();
        let mut committed = 0u64;
        let mut reader = None;
        // A partition gained: whether its snapshot was read, and the snapshot's
        // position while the log is read (records every node needs only) up to it.
        let mut snapshot_read = false;
        let mut reading_up_to: Option<u64> = None;
        match projection.skipped_from(partition) {
            Ok(from) => self.ownership.note_skipped_from(partition, from),
            Err(why) => return self.fail(partition, &why),
        }
        loop {
            if *shutdown.borrow() {
                break;
            }
            let projects = self.ownership.projects(partition);
            if !projects {
                snapshot_read = false;
                reading_up_to = None;
            }
            if projects && self.ownership.skipped_from(partition).is_some() {
                if !snapshot_read {
                    let task = projection.clone();
                    if let Err(error) =
                        tokio::task::spawn_blocking(move || task.prefetch_snapshot(partition)).await
                    {
                        self.fail(
                            partition,
                            &format!("reading a snapshot of partition {partition}: {error}"),
                        );
                        return;
                    }
                    snapshot_read = true;
                    // A snapshot ahead of what this node has read of the log (a node
                    // that just started): read up to it first, so the restore can
                    // start from it instead of the skip mark.
                    reading_up_to = projection
                        .snapshot_position(partition)
                        .filter(|at| *at > self.applied(partition));
                    if let Some(at) = reading_up_to {
                        tracing::info!(
                            partition,
                            read = self.applied(partition),
                            snapshot = at,
                            "reading the log up to the changelog's snapshot before restoring"
                        );
                    }
                }
                if reading_up_to.is_none_or(|at| self.applied(partition) >= at) {
                    // Gained: catch up with what was skipped before applying anything new.
                    if let Err(why) = self.restore(partition, &projection).await {
                        self.fail(partition, &why);
                        return;
                    }
                    snapshot_read = false;
                    reading_up_to = None;
                    continue;
                }
            }
            let mode = if projects && self.ownership.skipped_from(partition).is_none() {
                ChunkMode::Full
            } else {
                ChunkMode::Shared
            };
            let next = self.applied(partition);
            if reader.is_none() {
                match self.log.reader(partition, next).await {
                    Ok(r) => reader = Some(r),
                    Err(error) => {
                        tracing::error!(%error, partition, "cannot open log reader; retrying");
                        tokio::time::sleep(Duration::from_millis(READ_RETRY_MS)).await;
                        continue;
                    }
                }
            }
            let batch = tokio::select! {
                _ = shutdown.changed() => break,
                batch = reader.as_mut().expect("opened").next_batch(CHUNK_MAX_RECORDS, Duration::from_millis(TAIL_WAIT_MS)) => batch,
            };
            let entries = match batch {
                Ok(entries) => entries,
                Err(error) if error.is_corruption() => {
                    // Acknowledged records are damaged: never skip them (fail-stop).
                    self.fail(
                        partition,
                        &format!("the log is corrupt ({error}); restore it from a backup"),
                    );
                    return;
                }
                Err(error) => {
                    tracing::error!(%error, partition, "log read failed; reopening the reader");
                    reader = None;
                    tokio::time::sleep(Duration::from_millis(READ_RETRY_MS)).await;
                    continue;
                }
            };
            if entries.is_empty() {
                // Nothing more to read (the log's end, or a slow fetch) short of the
                // snapshot: restore from the mark rather than wait on.
                reading_up_to = None;
                // Idle: write back what a write-back store holds once it is due, so a
                // quiet projection does not keep a restart's replay long.
                let store = self.store.clone();
                let ticked = tokio::task::spawn_blocking(move || store.tick()).await;
                if !matches!(ticked, Ok(Ok(()))) {
                    self.fail(partition, "the projection checkpoint could not be written");
                    return;
                }
            } else if let Err(why) = self.apply(partition, &projection, entries, mode).await {
                self.fail(partition, &why);
                return;
            }
            if commits_offsets
                && last_commit.elapsed() >= Duration::from_millis(KAFKA_COMMIT_INTERVAL_MS)
            {
                let next = self.applied(partition);
                if next > committed {
                    // Commit only what is durable in the projection.
                    match self.store.flush() {
                        Ok(()) => match self.log.commit(PROJECTOR_GROUP, partition, next).await {
                            Ok(()) => committed = next,
                            Err(error) => tracing::warn!(%error, "kafka offset commit failed"),
                        },
                        Err(error) => tracing::warn!(%error, "projection flush failed"),
                    }
                }
                last_commit = Instant::now();
            }
        }
    }

    /// Applies the records of `partition` this node skipped, from its skip mark up
    /// to the watermark, chunk by chunk (each commit moves the mark), while the
    /// partition stays projected here; the watermark does not move meanwhile.
    async fn restore<P: Projection>(
        &self,
        partition: u32,
        projection: &Arc<P>,
    ) -> Result<(), String> {
        let Some(skipped) = self.ownership.skipped_from(partition) else {
            return Ok(());
        };
        let until = self.applied(partition);
        let task = projection.clone();
        let snapshot = self
            .apply_thread
            .run(move || task.restore_snapshot(partition, skipped, until))
            .await??;
        let from = match snapshot {
            Some((at, applied)) => {
                self.ownership
                    .note_skipped_from(partition, projection.skipped_from(partition)?);
                projection.after_commit(
                    applied,
                    Committed {
                        partition,
                        next_offset: until,
                        records: 0,
                        restored: true,
                    },
                );
                at
            }
            None => skipped,
        };
        tracing::info!(
            partition,
            from,
            until,
            "restoring a partition this node now owns"
        );
        let started = Instant::now();
        let mut range = tally_log::RangeReader::open(
            self.log.as_ref(),
            partition,
            from,
            until,
            CHUNK_MAX_RECORDS,
        )
        .await
        .map_err(|error| format!("reading the log to restore partition {partition}: {error}"))?;
        let mut restored = 0usize;
        let mut reported = Instant::now();
        while let Some(entries) = range
            .next_chunk()
            .await
            .map_err(|error| format!("reading the log to restore partition {partition}: {error}"))?
        {
            restored += entries.len();
            let reached = entries.last().map_or(until, |e| e.next_offset);
            self.apply(
                partition,
                projection,
                entries,
                ChunkMode::Restore { partition, until },
            )
            .await?;
            if reported.elapsed() >= Duration::from_millis(RESTORE_PROGRESS_EVERY_MS) {
                tracing::info!(partition, reached, until, "restoring");
                reported = Instant::now();
            }
            if !self.ownership.projects(partition) {
                tracing::info!(
                    partition,
                    "partition moved away while restoring it; restore paused"
                );
                return Ok(());
            }
        }
        // An empty range (nothing was skipped after all) still clears the mark.
        if self.ownership.skipped_from(partition).is_some() {
            self.apply(
                partition,
                projection,
                Vec::new(),
                ChunkMode::Restore { partition, until },
            )
            .await?;
        }
        tracing::info!(
            partition,
            records = restored,
            seconds = started.elapsed().as_secs_f64(),
            "partition restored"
        );
        Ok(())
    }

    /// Prefetches, applies and commits one chunk, then moves the watermark (a
    /// restored chunk moves the partition's skip mark instead).
    async fn apply<P: Projection>(
        &self,
        partition: u32,
        projection: &Arc<P>,
        entries: Vec<LogEntry>,
        mode: ChunkMode,
    ) -> Result<(), String> {
        let records = entries.len();
        let restored = matches!(mode, ChunkMode::Restore { .. });
        let next_offset = match entries.last() {
            Some(entry) => entry.next_offset,
            None => self.applied(partition),
        };
        // Decoded and planned on the background thread, and dropped on the apply
        // thread: a chunk holds thousands of events, and building, planning and
        // freeing them on a request worker (at normal priority) was ~2% of the
        // server's CPU under ingest, in front of the requests that worker serves.
        let decoder = projection.clone();
        let (chunk, wanted) = self
            .decode_thread
            .run(move || {
                let chunk = decoder.decode(entries, mode);
                let wanted = decoder.plan(&chunk);
                (Arc::new(chunk), wanted)
            })
            .await?;
        if !self.is_caught_up() {
            projection.read_ahead(&chunk);
        }
        let mut fetched = P::Fetched::default();
        let mut wanted = wanted?;
        let mut chunk = Some(chunk);
        loop {
            if let Err(error) = fetch(
                self.log.as_ref(),
                projection.as_ref(),
                &mut fetched,
                &wanted,
            )
            .await
            {
                // The records are durable; a read that failed is retried.
                tracing::error!(%error, partition, "reading records for apply failed; retrying");
                tokio::time::sleep(Duration::from_millis(READ_RETRY_MS)).await;
                continue;
            }
            let task_projection = projection.clone();
            let task_chunk = chunk
                .take()
                .ok_or("a chunk was applied after it was dropped")?;
            let (returned, outcome, kept) = self
                .apply_thread
                .run(move || {
                    let outcome = task_projection.apply(&task_chunk, &fetched);
                    // Kept only to be applied again; otherwise freed here.
                    let kept = outcome.is_err().then_some(task_chunk);
                    (fetched, outcome, kept)
                })
                .await?;
            fetched = returned;
            chunk = kept;
            match outcome {
                Ok(applied) => {
                    let committed = Committed {
                        partition,
                        next_offset,
                        records,
                        restored,
                    };
                    if mode != ChunkMode::Full {
                        self.ownership
                            .note_skipped_from(partition, projection.skipped_from(partition)?);
                    }
                    projection.after_commit(applied, committed);
                    if !restored {
                        self.update_readiness(Some((partition, next_offset)));
                        self.applied[partition as usize].publish(next_offset);
                    }
                    return Ok(());
                }
                Err(ApplyFailure::NeedRecords(more)) => wanted = more,
                Err(ApplyFailure::NotYet) => {
                    wanted = Vec::new();
                    tokio::time::sleep(Duration::from_millis(WAIT_RETRY_MS)).await;
                }
                Err(ApplyFailure::Fatal(why)) => {
                    return Err(format!("a record could not be applied: {why}"))
                }
            }
        }
    }
}

/// Fetches the records at `wanted` into `fetched`, one partition at a time
/// (`Log::read_many`: one pass over the span where single reads are costly).
async fn fetch<P: Projection>(
    log: &dyn Log,
    projection: &P,
    fetched: &mut P::Fetched,
    wanted: &[(u32, u64)],
) -> Result<(), RuntimeError> {
    let mut by_partition: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
    for (partition, offset) in wanted {
        if !projection.fetch_cached(fetched, *partition, *offset) {
            by_partition.entry(*partition).or_default().push(*offset);
        }
    }
    for (partition, offsets) in by_partition {
        let entries = log.read_many(partition, &offsets).await?;
        for (offset, entry) in offsets.into_iter().zip(entries) {
            projection
                .add_fetched(fetched, partition, offset, entry)
                .map_err(RuntimeError::Projection)?;
        }
    }
    Ok(())
}

/// What stops a replay or the runtime's set-up.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Projection(String),
}

/// Applies `partition` of `log` into `projection` from the position `store` holds up
/// to the log's end now, chunk by chunk through the same prefetch and apply as the
/// live runtime (replays, audits' catch-up, tests); `progress` gets (reached, end).
/// A record that depends on one of another partition not applied yet is an error
/// here; [`replay_log`] takes the partitions in turns instead.
pub async fn replay_partition<P: Projection>(
    log: &dyn Log,
    store: &dyn ProjectionStore,
    projection: &P,
    partition: u32,
    progress: impl FnMut(u64, u64),
) -> Result<u64, RuntimeError> {
    let turn = replay_turn(log, store, projection, partition, progress).await?;
    if turn.blocked {
        return Err(RuntimeError::Projection(format!(
            "partition {partition} depends on a record of another partition that is not applied"
        )));
    }
    Ok(turn.records)
}

/// Applies every partition of `log` into `projection` from the positions `store`
/// holds up to the log's ends, the way the live runtime does: in turns, so a
/// partition whose next record depends on a record of another partition not applied
/// yet (a customer's usage before its store's meter, on Kafka) waits while the
/// others go on. `progress` gets (partition, reached, end).
pub async fn replay_log<P: Projection>(
    log: &dyn Log,
    store: &dyn ProjectionStore,
    projection: &P,
    mut progress: impl FnMut(u32, u64, u64),
) -> Result<u64, RuntimeError> {
    let mut pending: Vec<u32> = (0..log.partition_count()).collect();
    let mut records = 0;
    while !pending.is_empty() {
        let mut blocked = Vec::new();
        let mut moved = false;
        for partition in pending {
            let turn = replay_turn(log, store, projection, partition, |at, end| {
                progress(partition, at, end)
            })
            .await?;
            records += turn.records;
            moved |= turn.records > 0;
            if turn.blocked {
                blocked.push(partition);
            }
        }
        if !blocked.is_empty() && !moved {
            return Err(RuntimeError::Projection(format!(
                "partitions {blocked:?} depend on records no partition holds"
            )));
        }
        pending = blocked;
    }
    Ok(records)
}

/// How far one turn of a partition's replay got.
struct Turn {
    records: u64,
    /// Stopped before the end: the next chunk depends on another partition.
    blocked: bool,
}

async fn replay_turn<P: Projection>(
    log: &dyn Log,
    store: &dyn ProjectionStore,
    projection: &P,
    partition: u32,
    mut progress: impl FnMut(u64, u64),
) -> Result<Turn, RuntimeError> {
    let end = log.read_end(partition).await?;
    let from = store.position(partition)?;
    let mut range =
        tally_log::RangeReader::open(log, partition, from, end, CHUNK_MAX_RECORDS).await?;
    let mut records = 0u64;
    while let Some(entries) = range.next_chunk().await? {
        let next_offset = entries.last().map_or(end, |e| e.next_offset);
        let count = entries.len();
        let chunk = projection.decode(entries, ChunkMode::Full);
        let mut fetched = P::Fetched::default();
        let mut wanted = projection.plan(&chunk).map_err(RuntimeError::Projection)?;
        loop {
            fetch(log, projection, &mut fetched, &wanted).await?;
            match projection.apply(&chunk, &fetched) {
                Ok(applied) => {
                    projection.after_commit(
                        applied,
                        Committed {
                            partition,
                            next_offset,
                            records: count,
                            restored: false,
                        },
                    );
                    break;
                }
                Err(ApplyFailure::NeedRecords(more)) => wanted = more,
                // Nothing of the chunk is committed: the next turn starts with it.
                Err(ApplyFailure::NotYet) => {
                    return Ok(Turn {
                        records,
                        blocked: true,
                    })
                }
                Err(ApplyFailure::Fatal(why)) => return Err(RuntimeError::Projection(why)),
            }
        }
        records += count as u64;
        progress(next_offset, end);
    }
    Ok(Turn {
        records,
        blocked: false,
    })
}
