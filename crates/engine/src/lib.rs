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

use std::sync::atomic::{AtomicBool, Ordering};
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
pub mod stores;
pub mod usage;
pub mod webhooks;

pub use error::EngineError;
pub use metrics::Metrics;

/// Records the projector folds into one atomic store batch: large enough to amortize
/// the batch commit, small enough that read-your-writes waits stay short (sled also
/// slows down on very large batches: measured 94k inserts/s at 1k keys per batch,
/// 41k/s at 100k).
pub const APPLY_CHUNK_MAX_RECORDS: usize = 32;
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
/// Kafka mode: how often the projection is flushed and the group offsets committed.
pub const KAFKA_COMMIT_INTERVAL_MS: u64 = 1_000;
/// Kafka mode: pause before retrying a chunk whose meter is not projected yet.
pub const NOT_YET_PROJECTED_RETRY_MS: u64 = 20;
/// Consumer group name the projector commits under (Kafka).
pub const PROJECTOR_GROUP: &str = "tally-projector";

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
    pub recent_records: events::RecentRecords,
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
    applied: Vec<watch::Sender<u64>>,
    control_locks: WriteLocks,
    /// Serializes each credits account's balance check, append and apply.
    account_locks: WriteLocks,
    /// One chunk is applied at a time, whatever its partition: chunks of different
    /// partitions read-modify-write shared keys (all-customers buckets, system
    /// balances, the dedup entry of an id sent for two customers), so concurrent
    /// application would lose updates. Also guards the projector's memory state.
    apply_lock: Arc<std::sync::Mutex<projector::ProjectorState>>,
    ready: AtomicBool,
    failed: AtomicBool,
    startup_end: Vec<u64>,
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
        let mut applied = Vec::new();
        let mut startup_end = Vec::new();
        for partition in 0..partitions {
            let position = store.position(partition)?;
            let end = log.end_offset(partition).await?;
            if check_positions && !log.covers(partition, position).await? {
                // The log lost records the projection has applied (a truncated log, a
                // restored backup, a recreated topic): new records would land below
                // the position and be skipped. Refuse rather than serve.
                return Err(EngineError::Corrupt(format!(
                    "the projection is ahead of the log on partition {partition} (applied up to {position}, log ends at {end}); rebuild the projection with `tally replay` or restore the log"
                )));
            }
            if check_positions && end > 0 {
                check_log_format(log.as_ref(), partition).await?;
            }
            applied.push(watch::channel(position).0);
            startup_end.push(end);
        }
        let state = projector::ProjectorState::load(store.as_ref(), Arc::new(index))?;
        let engine = Engine {
            log,
            store,
            clock,
            caches: Caches {
                events: state.index.clone(),
                ..Caches::default()
            },
            applied,
            control_locks: WriteLocks::new(),
            account_locks: WriteLocks::new(),
            apply_lock: Arc::new(std::sync::Mutex::new(state)),
            ready: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            startup_end,
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
        engine.update_readiness();
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
        self.ready.load(Ordering::SeqCst)
            && !self.failed.load(Ordering::SeqCst)
            && self.log.health().is_none()
    }

    fn update_readiness(&self) {
        let caught_up = self
            .applied
            .iter()
            .zip(&self.startup_end)
            .all(|(applied, end)| *applied.borrow() >= *end);
        if caught_up {
            self.ready.store(true, Ordering::SeqCst);
        }
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
        self.applied
            .iter()
            .zip(ends)
            .map(|(applied, end)| {
                let applied = *applied.borrow();
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
        if self.failed.load(Ordering::SeqCst) {
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
        if !self.ready.load(Ordering::SeqCst) {
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
        if *self.applied[partition as usize].borrow() <= offset {
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
        let mut applied = self.applied[partition as usize].subscribe();
        let wait = APPLY_WAIT
            .try_with(|wait| *wait)
            .unwrap_or_else(|_| self.apply_wait());
        let deadline = Instant::now() + wait;
        // Polls `failed` too: a projector that stopped will never apply the record.
        loop {
            if self.failed.load(Ordering::SeqCst) {
                return Err(EngineError::Unavailable {
                    code: "projector_failed",
                    message: "the write is durable, but the projector stopped on a storage failure; retry with the same idempotency key once the node is restarted",
                });
            }
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(500));
            if slice.is_zero() {
                return Err(EngineError::ApplyTimeout);
            }
            if let Ok(Ok(_)) =
                tokio::time::timeout(slice, applied.wait_for(|next| *next > offset)).await
            {
                return Ok(());
            }
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
            if end > 0 {
                let mut applied = self.applied[partition as usize].subscribe();
                let outcome = tokio::time::timeout(
                    Duration::from_millis(APPLY_WAIT_TIMEOUT_MS),
                    applied.wait_for(|next| *next >= end),
                )
                .await;
                if !matches!(outcome, Ok(Ok(_))) {
                    return Err(EngineError::ApplyTimeout);
                }
            }
        }
        Ok(())
    }

    /// Starts one projector task per partition; they stop when `shutdown` turns true.
    pub fn start_projector(
        self: &Arc<Self>,
        shutdown: watch::Receiver<bool>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..self.log.partition_count())
            .map(|partition| {
                let engine = self.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move { engine.projector_loop(partition, shutdown).await })
            })
            .collect()
    }

    async fn projector_loop(self: Arc<Self>, partition: u32, mut shutdown: watch::Receiver<bool>) {
        let kafka = self.log.kind() == "kafka";
        let mut last_commit = Instant::now();
        let mut committed = 0u64;
        let mut reader = None;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let next = *self.applied[partition as usize].borrow();
            if reader.is_none() {
                match self.log.reader(partition, next).await {
                    Ok(r) => reader = Some(r),
                    Err(error) => {
                        tracing::error!(%error, partition, "cannot open log reader; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
            let batch = tokio::select! {
                _ = shutdown.changed() => break,
                batch = reader.as_mut().expect("opened").next_batch(APPLY_CHUNK_MAX_RECORDS, Duration::from_millis(200)) => batch,
            };
            let entries = match batch {
                Ok(entries) => entries,
                Err(error) if error.is_corruption() => {
                    // Acknowledged records are damaged: never skip them (fail-stop).
                    tracing::error!(%error, partition, "projector stopped: the log is corrupt; restore it from a backup");
                    self.failed.store(true, Ordering::SeqCst);
                    return;
                }
                Err(error) => {
                    tracing::error!(%error, partition, "log read failed; reopening the reader");
                    reader = None;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            if entries.is_empty() {
                // Idle: write back what a write-back store holds once it is due, so a
                // quiet projection does not keep a restart's replay long.
                let store = self.store.clone();
                let ticked = tokio::task::spawn_blocking(move || store.tick()).await;
                if !matches!(ticked, Ok(Ok(()))) {
                    tracing::error!(
                        partition,
                        "projector stopped: the projection checkpoint could not be written"
                    );
                    self.failed.store(true, Ordering::SeqCst);
                    return;
                }
            }
            if let Some(last) = entries.last() {
                let next_offset = last.next_offset;
                let count = entries.len();
                let chunk = Arc::new(projector::DecodedChunk::new(entries));
                let mut fetched = projector::Fetched::new();
                let mut wanted: Vec<(u32, u64)> = match projector::plan_chunk(
                    self.store.as_ref(),
                    &self.caches.events,
                    &chunk,
                ) {
                    Ok(wanted) => wanted.into_iter().collect(),
                    Err(error) => {
                        tracing::error!(%error, partition, "projector stopped: a chunk could not be planned");
                        self.failed.store(true, Ordering::SeqCst);
                        return;
                    }
                };
                loop {
                    if let Err(error) =
                        projector::fetch_records(self.log.as_ref(), wanted.drain(..), &mut fetched)
                            .await
                    {
                        // A log read failed (the record itself is durable): retry.
                        tracing::error!(%error, partition, "reading records for apply failed; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                    let store = self.store.clone();
                    let apply_lock = self.apply_lock.clone();
                    let shared_chunk = chunk.clone();
                    let shared_fetched = std::mem::take(&mut fetched);
                    let result = tokio::task::spawn_blocking(move || {
                        let mut state = apply_lock
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner());
                        let outcome = projector::apply_chunk(
                            store.as_ref(),
                            &mut state,
                            &shared_chunk,
                            &shared_fetched,
                        );
                        (shared_fetched, outcome)
                    })
                    .await;
                    let (returned, outcome) = match result {
                        Ok(pair) => pair,
                        Err(join_error) => {
                            tracing::error!(%join_error, "projector task panicked");
                            self.failed.store(true, Ordering::SeqCst);
                            return;
                        }
                    };
                    fetched = returned;
                    match outcome {
                        Ok(applied) => {
                            self.after_apply(applied);
                            break;
                        }
                        Err(EngineError::RecordsNeeded(more)) => wanted = more,
                        Err(EngineError::NotYetProjected) => {
                            tokio::time::sleep(Duration::from_millis(NOT_YET_PROJECTED_RETRY_MS))
                                .await;
                        }
                        Err(error) => {
                            tracing::error!(%error, partition, "projector stopped: a record could not be applied");
                            self.failed.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
                self.metrics
                    .records_applied
                    .fetch_add(count as u64, Ordering::Relaxed);
                self.note_applied(partition, next_offset);
                self.applied[partition as usize].send_replace(next_offset);
                self.update_readiness();
            }
            if kafka && last_commit.elapsed() >= Duration::from_millis(KAFKA_COMMIT_INTERVAL_MS) {
                let next = *self.applied[partition as usize].borrow();
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
