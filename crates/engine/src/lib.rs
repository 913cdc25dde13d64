//! Tally's application services, between the HTTP facade and the log:
//!
//! - the **ingest gateway** ([`events`]): validates batches, resolves customers,
//!   deduplicates event ids exactly and appends accepted events to the log;
//! - the **projector** ([`projector`]): tails the log and folds records into the
//!   projection store (customers, meters, stored events, usage buckets);
//! - the control-plane services ([`stores`], [`customers`], [`meters`]) and the
//!   read side ([`usage`]).
//!
//! Every write is a record appended to the log; a write returns once its record is
//! applied to the projections (read-your-writes), except ingest, which answers 202
//! as soon as the batch is durable (decisions.md).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tally_domain::clock::Clock;
use tally_domain::meter::Meter;
use tally_domain::record::Record;
use tally_domain::Mode;
use tally_log::Log;
use tally_projection::{scan_prefix, ProjectionStore, Visit};
use tokio::sync::watch;

pub mod audit;
pub mod codec;
pub mod customers;
pub mod error;
pub mod event_index;
pub mod events;
pub mod ids;
pub mod keys;
pub mod ledger;
pub mod meters;
pub mod metrics;
pub mod outcome;
pub mod overlay;
pub mod pagination;
pub mod projector;
pub mod recent;
pub mod stores;
pub mod usage;
pub mod webhooks;

pub use error::EngineError;
pub use metrics::Metrics;

/// Records read at once by the ledger audit (the live projector's chunks are the
/// runtime's, `tally_runtime::CHUNK_MAX_RECORDS`).
pub const APPLY_CHUNK_MAX_RECORDS: usize = tally_runtime::CHUNK_MAX_RECORDS;
/// Accepted events not yet applied by the projector. Beyond this, ingest waits for
/// the projector (backpressure), so memory and catch-up time stay bounded.
pub const MAX_UNAPPLIED_EVENTS: usize = 20_000;
/// How long ingest waits for projector headroom before answering 503.
pub const BACKPRESSURE_WAIT_MS: u64 = 30_000;
/// How long a write waits for its record to be applied before answering 503.
pub const APPLY_WAIT_TIMEOUT_MS: u64 = 30_000;
/// Writes are refused (503, nothing appended) while a record this node appended has
/// waited longer than this to be applied: decisions would be taken on stale state,
/// and callers would only wait into a timeout.
pub const MAX_APPLY_LAG_MS: u64 = 10_000;
/// How often `positions` (metrics) asks the log for its end offsets, at most.
pub const POSITIONS_REFRESH_MS: u64 = 5_000;

tokio::task_local! {
    /// How long a write waits for its record to be applied, when not the default
    /// `APPLY_WAIT_TIMEOUT_MS`: the HTTP idempotency layer lets a keyed request go on
    /// in the background after its client stopped waiting, so its outcome is saved.
    pub static APPLY_WAIT: Duration;
}

/// Write locks striped by hash: a fixed set, so memory never grows with the ids
/// callers send (a lock for an unchecked path id costs nothing). Two keys may share
/// a stripe; no write path takes two locks of one set.
#[derive(Debug)]
struct WriteLocks(Vec<tokio::sync::Mutex<()>>);

/// Stripes per lock set: collisions are rare at this size (1 in 1,024 pairs of keys)
/// and cost only a short wait.
pub const WRITE_LOCK_STRIPES: usize = 1_024;

impl WriteLocks {
    fn new() -> WriteLocks {
        WriteLocks(
            (0..WRITE_LOCK_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        )
    }

    fn get(&self, key: &[u8]) -> &tokio::sync::Mutex<()> {
        &self.0[crc32fast::hash(key) as usize % WRITE_LOCK_STRIPES]
    }
}

/// A store and environment: the scope every API request acts in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub store_id: String,
    pub mode: Mode,
}

/// In-memory views the hot paths need, kept current by the projector.
#[derive(Debug, Default)]
pub struct Caches {
    /// sha256(api key) -> scope.
    pub api_keys: DashMap<Vec<u8>, Scope>,
    /// Every meter of a scope (archived too), for matching at ingest.
    pub meters: DashMap<Scope, Arc<Vec<Meter>>>,
    /// Customer ids known to exist (`scope key + id`). Customers are never deleted,
    /// so an entry never goes stale.
    pub known_customers: DashMap<String, ()>,
    /// `scope key + external id` -> customer id. Filled by the gateway only when no
    /// customer changed while it looked the id up (see `customer_generation`).
    pub external_ids: DashMap<String, String>,
    /// Bumped (under its write lock) by the projector after it removed the mappings
    /// a customer update made stale; the gateway checks and inserts under the read
    /// lock, so a lookup that raced an update is never cached.
    pub customer_generation: std::sync::RwLock<u64>,
    /// Event ids appended but not yet applied, with a fingerprint of the payload.
    /// Together with the event index this makes dedup exact under concurrent
    /// requests: a reservation is made atomically before the append and removed only
    /// after the projector has stored the event and updated the index.
    pub inflight_events: DashMap<String, u64>,
    /// Every stored event of the dedup horizon and where it is in the log
    /// (event_index.rs). The projector updates it after each commit.
    pub events: Arc<event_index::EventIndex>,
    /// Usage records recently read back from the log (events.rs).
    pub recent_records: recent::RecentRecords,
}

/// What the projector decided about a record a caller appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Applied as written.
    Applied,
    /// A repeat of an earlier write (same idempotency key): nothing new was applied;
    /// the id of what the earlier write created.
    SameAs(String),
}

/// Records this node appended and the projector has not applied yet, per partition:
/// offset -> (when appended, events it carries). Backpressure counts every event in
/// it (with or without event_id), and the write gate measures lag by its oldest entry.
#[derive(Debug, Default)]
struct Unapplied {
    partitions: Vec<std::collections::BTreeMap<u64, (Instant, usize)>>,
    events: usize,
}

pub struct Engine {
    log: Arc<dyn Log>,
    store: Arc<dyn ProjectionStore>,
    clock: Arc<dyn Clock>,
    caches: Caches,
    /// Tails the log into `projection`: watermarks, readiness, failure.
    runtime: Arc<tally_runtime::Runtime>,
    projection: projector::StoreProjection,
    control_locks: WriteLocks,
    /// Serializes each credits account's balance check, append and apply.
    account_locks: WriteLocks,
    unapplied: std::sync::Mutex<Unapplied>,
    /// The log's end offsets as last asked, and when (see `positions`).
    end_offsets: std::sync::Mutex<Option<(Instant, Vec<u64>)>>,
    /// `APPLY_WAIT_TIMEOUT_MS` and `MAX_APPLY_LAG_MS` unless tuned (tests shorten
    /// them to exercise the paths they guard without waiting half a minute).
    apply_wait_ms: std::sync::atomic::AtomicU64,
    max_apply_lag_ms: std::sync::atomic::AtomicU64,
    pub metrics: Metrics,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("log", &self.log.kind())
            .finish()
    }
}

/// The engine is the projection the runtime drives: the store projection's apply,
/// then the caches and this node's backpressure accounting after each commit.
impl tally_runtime::Projection for Engine {
    type Chunk = projector::DecodedChunk;
    type Fetched = projector::Fetched;
    type Applied = projector::Applied;

    fn decode(&self, entries: Vec<tally_log::LogEntry>) -> Self::Chunk {
        self.projection.decode(entries)
    }

    fn plan(&self, chunk: &Self::Chunk) -> Result<Vec<(u32, u64)>, String> {
        self.projection.plan(chunk)
    }

    fn add_fetched(
        &self,
        fetched: &mut Self::Fetched,
        partition: u32,
        offset: u64,
        entry: Option<tally_log::LogEntry>,
    ) -> Result<(), String> {
        self.projection
            .add_fetched(fetched, partition, offset, entry)
    }

    fn apply(
        &self,
        chunk: &Self::Chunk,
        fetched: &Self::Fetched,
    ) -> Result<Self::Applied, tally_runtime::ApplyFailure> {
        self.projection.apply(chunk, fetched)
    }

    fn after_commit(&self, applied: Self::Applied, committed: tally_runtime::Committed) {
        self.after_apply(applied);
        self.metrics
            .records_applied
            .fetch_add(committed.records as u64, Ordering::Relaxed);
        self.note_applied(committed.partition, committed.next_offset);
    }
}

/// Refuses a log whose first record is of another format version, before anything is
/// served: a data dir (or topic) written by an older Tally is named, with what to do,
/// instead of failing on its first record somewhere in the projector.
async fn check_log_format(log: &dyn Log, partition: u32) -> Result<(), EngineError> {
    let mut foreign = None;
    // Offset 0 holds the first record in both logs; `until = 1` reads just it.
    tally_log::read_range(log, partition, 0, 1, 1, |entries| {
        if let Some(entry) = entries.first() {
            if let Err(error @ tally_proto::DecodeError::Version { .. }) =
                tally_proto::decode_record(&entry.payload)
            {
                foreign = Some(error);
            }
        }
        Ok::<(), EngineError>(())
    })
    .await?;
    match foreign {
        Some(error) => Err(EngineError::Corrupt(format!(
            "the log was written by another Tally version (partition {partition}): {error}. Keep serving it with the Tally that wrote it, or start this version on a new data dir (or Kafka topic)"
        ))),
        None => Ok(()),
    }
}

impl Engine {
    /// Loads the caches from the projection and notes where the log ends, so
    /// readiness can be reported once the projection has caught up.
    ///
    /// Refuses a projection that is ahead of the log (see `open_detached`).
    pub async fn open(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<Engine>, EngineError> {
        Engine::open_inner(log, store, clock, true, event_index::EventIndex::default()).await
    }

    /// `open` with an event index of another fingerprint function (tests force
    /// fingerprint collisions with one).
    pub async fn open_with_index(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
        clock: Arc<dyn Clock>,
        index: event_index::EventIndex,
    ) -> Result<Arc<Engine>, EngineError> {
        Engine::open_inner(log, store, clock, true, index).await
    }

    /// An engine over a projection that was built from records not in `log` (tests
    /// that fold synthetic entries, then query): the position check of `open` is
    /// skipped, so its projector must never be started.
    pub async fn open_detached(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<Engine>, EngineError> {
        Engine::open_inner(log, store, clock, false, event_index::EventIndex::default()).await
    }

    async fn open_inner(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
        clock: Arc<dyn Clock>,
        check_positions: bool,
        index: event_index::EventIndex,
    ) -> Result<Arc<Engine>, EngineError> {
        let partitions = log.partition_count();
        projector::check_projection_format(store.as_ref(), partitions)?;
        for partition in 0..partitions {
            let position = store.position(partition)?;
            if check_positions && !log.covers(partition, position).await? {
                // The log lost records the projection has applied (a truncated log, a
                // restored backup, a recreated topic): new records would land below
                // the position and be skipped. Refuse rather than serve.
                let end = log.end_offset(partition).await?;
                return Err(EngineError::Corrupt(format!(
                    "the projection is ahead of the log on partition {partition} (applied up to {position}, log ends at {end}); rebuild the projection with `tally replay` or restore the log"
                )));
            }
            if check_positions && log.end_offset(partition).await? > 0 {
                check_log_format(log.as_ref(), partition).await?;
            }
        }
        let index = Arc::new(index);
        let projection = projector::StoreProjection::load(store.clone(), index.clone())?;
        let runtime = Arc::new(
            tally_runtime::Runtime::new(log.clone(), store.clone())
                .await
                .map_err(EngineError::from)?,
        );
        let engine = Engine {
            log,
            store,
            clock,
            caches: Caches {
                events: index,
                ..Caches::default()
            },
            runtime,
            projection,
            control_locks: WriteLocks::new(),
            account_locks: WriteLocks::new(),
            unapplied: std::sync::Mutex::new(Unapplied {
                partitions: vec![Default::default(); partitions as usize],
                events: 0,
            }),
            end_offsets: std::sync::Mutex::new(None),
            apply_wait_ms: APPLY_WAIT_TIMEOUT_MS.into(),
            max_apply_lag_ms: MAX_APPLY_LAG_MS.into(),
            metrics: Metrics::default(),
        };
        engine.load_caches()?;
        Ok(Arc::new(engine))
    }

    fn load_caches(&self) -> Result<(), EngineError> {
        let mut corrupt = None;
        scan_prefix(self.store.as_ref(), &[keys::API_KEY], false, &mut |k, v| {
            let read = v
                .split_last()
                .ok_or_else(|| EngineError::Corrupt("an API key entry is empty".into()))
                .and_then(|(mode_byte, store_id)| {
                    Ok((keys::read_mode(*mode_byte, "an API key entry")?, store_id))
                });
            match read {
                Ok((mode, store_id)) => {
                    let scope = Scope {
                        store_id: String::from_utf8_lossy(store_id).into_owned(),
                        mode,
                    };
                    self.caches.api_keys.insert(k[1..].to_vec(), scope);
                    Visit::Continue
                }
                Err(error) => {
                    corrupt = Some(error);
                    Visit::Stop
                }
            }
        })?;
        if let Some(error) = corrupt {
            return Err(error);
        }
        let all = pagination::collect_prefix(
            self.store.as_ref(),
            &[keys::METER],
            false,
            usize::MAX,
            |_, v| codec::decode_meter(v).map(Some),
        )?;
        let mut meters: std::collections::HashMap<Scope, Vec<Meter>> = Default::default();
        for m in all {
            let scope = Scope {
                store_id: m.store_id.clone(),
                mode: m.mode,
            };
            meters.entry(scope).or_default().push(m);
        }
        for (scope, list) in meters {
            self.caches.meters.insert(scope, Arc::new(list));
        }
        Ok(())
    }

    pub fn log(&self) -> &Arc<dyn Log> {
        &self.log
    }

    pub fn store(&self) -> &Arc<dyn ProjectionStore> {
        &self.store
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn caches(&self) -> &Caches {
        &self.caches
    }

    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Ready once every partition has been applied up to where the log ended at
    /// start-up (`/readyz`), while the projector has not failed and the log takes
    /// appends (a poisoned log, a fatal producer error).
    pub fn is_ready(&self) -> bool {
        self.runtime.is_caught_up() && !self.runtime.has_failed() && self.log.health().is_none()
    }

    /// Per partition: (applied next offset, durable end offset). The ends are asked
    /// of the log at most once per `POSITIONS_REFRESH_MS`, however often this is
    /// called (`/metrics` is unauthenticated: scrapes must not each reach Kafka).
    pub async fn positions(&self) -> Vec<(u64, u64)> {
        let cached = {
            let cache = self.end_offsets.lock().unwrap_or_else(|p| p.into_inner());
            cache
                .as_ref()
                .filter(|(at, _)| at.elapsed() < Duration::from_millis(POSITIONS_REFRESH_MS))
                .map(|(_, ends)| ends.clone())
        };
        let ends = match cached {
            Some(ends) => ends,
            None => {
                let mut ends = Vec::new();
                for partition in 0..self.log.partition_count() {
                    ends.push(self.log.end_offset(partition).await.unwrap_or(0));
                }
                *self.end_offsets.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now(), ends.clone()));
                ends
            }
        };
        ends.into_iter()
            .enumerate()
            .map(|(partition, end)| {
                let applied = self.runtime.applied(partition as u32);
                (applied, end.max(applied))
            })
            .collect()
    }

    /// The lock serializing control-plane writes of one scope (uniqueness checks of
    /// meter names and external ids happen under it; apply re-checks them).
    pub fn control_lock(&self, scope: &Scope) -> &tokio::sync::Mutex<()> {
        let mut key = scope.store_id.as_bytes().to_vec();
        key.push(scope.mode.key_byte());
        self.control_locks.get(&key)
    }

    /// Takes a write lock, waiting at most the apply wait: a write that waits longer
    /// would only queue behind one the projector has not applied (503, nothing
    /// written).
    pub async fn acquire<'a>(
        &self,
        lock: &'a tokio::sync::Mutex<()>,
    ) -> Result<tokio::sync::MutexGuard<'a, ()>, EngineError> {
        tokio::time::timeout(self.apply_wait(), lock.lock())
            .await
            .map_err(|_| EngineError::Unavailable {
                code: "write_busy",
                message: "another write of this store or account is still waiting for the projection; nothing was written, retry shortly",
            })
    }

    /// Whether writes may be taken now: refused (503, nothing appended) before the
    /// projection caught up after start-up, after the projector failed, while the log
    /// is failed, and while this node's writes wait too long to be applied.
    pub fn check_writable(&self) -> Result<(), EngineError> {
        if self.runtime.has_failed() {
            return Err(EngineError::Unavailable {
                code: "projector_failed",
                message: "the projector stopped on a storage failure; writes are refused until an operator restarts the node (see its log)",
            });
        }
        if let Some(problem) = self.log.health() {
            tracing::warn!(%problem, "write refused: the log is failed");
            return Err(EngineError::Unavailable {
                code: "log_unavailable",
                message:
                    "the event log is failed (see the node's log); nothing was written, retry later",
            });
        }
        if !self.runtime.is_caught_up() {
            return Err(EngineError::Unavailable {
                code: "not_ready",
                message: "the node is catching up with the log after a start; nothing was written, retry shortly",
            });
        }
        if self.apply_lag() > Duration::from_millis(self.max_apply_lag_ms.load(Ordering::Relaxed)) {
            return Err(EngineError::Unavailable {
                code: "projection_lagging",
                message: "the projection is behind the log; nothing was written, retry shortly",
            });
        }
        Ok(())
    }

    /// How long a write waits for its record to be applied before answering
    /// `outcome_pending` (default `APPLY_WAIT_TIMEOUT_MS`).
    pub fn apply_wait(&self) -> Duration {
        Duration::from_millis(self.apply_wait_ms.load(Ordering::Relaxed))
    }

    /// Overrides the apply wait and the write gate's lag bound.
    pub fn tune_waits(&self, apply_wait: Duration, max_apply_lag: Duration) {
        self.apply_wait_ms
            .store(apply_wait.as_millis() as u64, Ordering::Relaxed);
        self.max_apply_lag_ms
            .store(max_apply_lag.as_millis() as u64, Ordering::Relaxed);
    }

    /// How long the oldest record this node appended has waited to be applied.
    pub fn apply_lag(&self) -> Duration {
        let unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
        // Offsets grow in append order, so each partition's first entry is its oldest.
        unapplied
            .partitions
            .iter()
            .filter_map(|p| p.first_key_value().map(|(_, (at, _))| at.elapsed()))
            .max()
            .unwrap_or_default()
    }

    /// Accepted events this node appended that are not applied yet.
    pub fn unapplied_events(&self) -> usize {
        self.unapplied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .events
    }

    /// Appends a record; returns (partition, offset) once it is durable.
    pub async fn append(&self, record: &Record) -> Result<(u32, u64), EngineError> {
        self.check_writable()?;
        let key = record.partition_key();
        let payload = tally_proto::encode_record(record, self.clock.now_ms());
        let partition = self.log.partition_for(&key);
        let started = Instant::now();
        let offset = self.log.append(&key, payload).await?;
        self.metrics.log_append.observe(started.elapsed());
        let events = match record {
            Record::UsageBatch { events, .. } => events.len(),
            _ => 0,
        };
        let mut unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
        if self.runtime.applied(partition) <= offset {
            unapplied.partitions[partition as usize].insert(offset, (Instant::now(), events));
            unapplied.events += events;
        }
        Ok((partition, offset))
    }

    /// Forgets this node's appends below `next_offset` of `partition` (applied).
    fn note_applied(&self, partition: u32, next_offset: u64) {
        let mut unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
        let pending = &mut unapplied.partitions[partition as usize];
        let still = pending.split_off(&next_offset);
        let done: usize = pending.values().map(|(_, events)| events).sum();
        *pending = still;
        unapplied.events = unapplied.events.saturating_sub(done);
    }

    /// Waits until the projector has applied the record at `offset`.
    pub async fn wait_applied(&self, partition: u32, offset: u64) -> Result<(), EngineError> {
        let wait = APPLY_WAIT
            .try_with(|wait| *wait)
            .unwrap_or_else(|_| self.apply_wait());
        match self.runtime.wait_applied(partition, offset, wait).await {
            Ok(()) => Ok(()),
            Err(tally_runtime::WaitError::Failed) => Err(EngineError::Unavailable {
                code: "projector_failed",
                message: "the write is durable, but the projector stopped on a storage failure; retry with the same idempotency key once the node is restarted",
            }),
            Err(tally_runtime::WaitError::Timeout) => Err(EngineError::ApplyTimeout),
        }
    }

    /// Waits while too many accepted events are unapplied (see MAX_UNAPPLIED_EVENTS).
    pub async fn wait_for_projector_headroom(&self) -> Result<(), EngineError> {
        let started = Instant::now();
        while self.unapplied_events() > MAX_UNAPPLIED_EVENTS {
            if started.elapsed() > Duration::from_millis(BACKPRESSURE_WAIT_MS) {
                return Err(EngineError::ApplyTimeout);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }

    /// Appends a record and waits until it is visible in the projections; a record
    /// the projector refused answers with its recorded rejection.
    pub async fn append_and_apply(&self, record: &Record) -> Result<(), EngineError> {
        self.append_and_decide(record).await.map(|_| ())
    }

    /// Appends a record, waits for the projector, and returns what it decided: the
    /// decision is taken in apply, in log order (see `outcome`), and read back here.
    pub async fn append_and_decide(&self, record: &Record) -> Result<Decision, EngineError> {
        let (partition, offset) = self.append(record).await?;
        self.wait_applied(partition, offset).await?;
        match self.store.get(&outcome::outcome_key(partition, offset))? {
            None => Ok(Decision::Applied),
            Some(bytes) => match outcome::Outcome::decode(&bytes)? {
                outcome::Outcome::SameAs { id } => Ok(Decision::SameAs(id)),
                rejected => Err(rejected.into()),
            },
        }
    }

    /// Waits until everything durable in the log at this moment is applied.
    pub async fn wait_caught_up(&self) -> Result<(), EngineError> {
        for partition in 0..self.log.partition_count() {
            let end = self.log.end_offset(partition).await?;
            self.runtime
                .wait_reached(partition, end, Duration::from_millis(APPLY_WAIT_TIMEOUT_MS))
                .await
                .map_err(|_| EngineError::ApplyTimeout)?;
        }
        Ok(())
    }

    /// Starts the projection runtime: one task per partition; they stop when
    /// `shutdown` turns true.
    pub fn start_projector(
        self: &Arc<Self>,
        shutdown: watch::Receiver<bool>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.runtime.start(self.clone(), shutdown)
    }

    /// Updates the caches from a committed chunk. Runs before waiters are woken, so
    /// a write that returns is visible to every later request.
    fn after_apply(&self, applied: projector::Applied) {
        for store in applied.stores {
            for (hash, mode) in [
                (store.prod_key_sha256, Mode::Prod),
                (store.test_key_sha256, Mode::Test),
            ] {
                self.caches.api_keys.insert(
                    hash,
                    Scope {
                        store_id: store.store_id.clone(),
                        mode,
                    },
                );
            }
        }
        for meter in applied.meters {
            let scope = Scope {
                store_id: meter.store_id.clone(),
                mode: meter.mode,
            };
            let mut entry = self.caches.meters.entry(scope).or_default();
            let mut list: Vec<Meter> = entry.as_ref().clone();
            match list.iter_mut().find(|m| m.id == meter.id) {
                Some(existing) => *existing = meter,
                None => list.push(meter),
            }
            *entry = Arc::new(list);
        }
        for key in applied.event_keys {
            self.caches.inflight_events.remove(&key);
        }
        if applied.customers_changed {
            let mut generation = self
                .caches
                .customer_generation
                .write()
                .unwrap_or_else(|p| p.into_inner());
            for key in &applied.stale_external_ids {
                self.caches.external_ids.remove(key);
            }
            *generation += 1;
        }
    }

    /// Flushes the projection (graceful shutdown).
    pub fn flush(&self) -> Result<(), EngineError> {
        self.store.flush()?;
        Ok(())
    }
}
