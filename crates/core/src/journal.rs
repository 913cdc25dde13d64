//! The journal: how a request becomes a decision. A service appends its request as
//! a record, waits until the runtime has applied it, and reads the outcome apply
//! recorded under its position (applied, refused, or "same as" an earlier request).
//! The journal also keeps the node's write gate (writes refused before anything is
//! appended while the node cannot decide them) and its backpressure account (events
//! appended but not applied yet).

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tally_domain::clock::Clock;
use tally_domain::record::{Record, RecordMeta};
use tally_domain::Mode;
use tally_log::Log;
use tally_projection::ProjectionStore;
use tally_runtime::Runtime;

use crate::error::EngineError;
use crate::idempotency;
use crate::metrics::Metrics;
use crate::outcome;
use crate::Scope;

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
    /// Records appended by the request running in this scope, when one counts them:
    /// a request that appended nothing may safely run again (see the HTTP layer's
    /// catch-up before a 404).
    pub static APPENDED: std::cell::Cell<u64>;
}

/// How many times an update is derived again after apply refused it because the
/// resource changed meanwhile (`RETRIED_OUTCOMES`): a resource updated that hotly
/// answers the 409 rather than keep a request spinning.
pub const MAX_UPDATE_ATTEMPTS: usize = 5;

/// Refusals that mean "derived from a version that is gone": the update is derived
/// again from the current one.
const RETRIED_OUTCOMES: &[&str] = &[
    "resource_changed",
    "resource_missing",
    "account_balance_changed",
];

/// What an update derived from the current version of a resource.
pub enum Update<T> {
    /// Nothing to write (e.g. freezing a frozen account): answer with this.
    Unchanged(T),
    /// Append `record`, derived from the version stamped `base_updated_at_ms`;
    /// answer with `result` once applied.
    Write {
        record: Record,
        base_updated_at_ms: i64,
        result: T,
    },
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

/// Records this node appended and the projector has not applied yet, per partition,
/// by offset. Backpressure counts every event in it (with or without event_id), and
/// the write gate measures lag by its oldest entry.
#[derive(Debug, Default)]
struct Unapplied {
    partitions: Vec<std::collections::BTreeMap<u64, Appended>>,
    events: usize,
}

/// A record this node appended, not applied yet.
#[derive(Debug)]
struct Appended {
    at: Instant,
    events: usize,
    /// The record as appended, for the projector to take instead of decoding it
    /// again (`take_handed_off`); only usage records are handed over this way.
    handed_off: Option<(Record, RecordMeta)>,
}

pub struct Journal {
    log: Arc<dyn Log>,
    store: Arc<dyn ProjectionStore>,
    clock: Arc<dyn Clock>,
    /// Tails the log into the projections: watermarks, readiness, failure.
    runtime: Arc<Runtime>,
    unapplied: std::sync::Mutex<Unapplied>,
    /// Woken when applies free room under `MAX_UNAPPLIED_EVENTS`: ingest waiting for
    /// headroom sleeps on it instead of polling (each waiting request woke every 2
    /// ms to look), and goes on as soon as the apply that frees room commits.
    headroom: tokio::sync::Notify,
    /// The log's end offsets as last asked, and when (see `positions`).
    end_offsets: std::sync::Mutex<Option<(Instant, Vec<u64>)>>,
    /// `APPLY_WAIT_TIMEOUT_MS` and `MAX_APPLY_LAG_MS` unless tuned (tests shorten
    /// them to exercise the paths they guard without waiting half a minute).
    apply_wait_ms: AtomicU64,
    max_apply_lag_ms: AtomicU64,
    /// Test-mode clocks by store: (`to_ms`, the record time it was set at); kept
    /// current by the composition root after each commit (see `now_in`).
    test_clocks: dashmap::DashMap<String, (i64, i64)>,
    pub metrics: Metrics,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("log", &self.log.kind())
            .finish()
    }
}

impl Journal {
    pub fn new(
        log: Arc<dyn Log>,
        store: Arc<dyn ProjectionStore>,
        clock: Arc<dyn Clock>,
        runtime: Arc<Runtime>,
    ) -> Journal {
        let partitions = log.partition_count() as usize;
        Journal {
            log,
            store,
            clock,
            runtime,
            unapplied: std::sync::Mutex::new(Unapplied {
                partitions: (0..partitions).map(|_| Default::default()).collect(),
                events: 0,
            }),
            headroom: tokio::sync::Notify::new(),
            end_offsets: std::sync::Mutex::new(None),
            apply_wait_ms: APPLY_WAIT_TIMEOUT_MS.into(),
            max_apply_lag_ms: MAX_APPLY_LAG_MS.into(),
            test_clocks: dashmap::DashMap::new(),
            metrics: Metrics,
        }
    }

    pub fn log(&self) -> &Arc<dyn Log> {
        &self.log
    }

    pub fn store(&self) -> &Arc<dyn ProjectionStore> {
        &self.store
    }

    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The scope's business time (docs/api.md, "Test clock"): the wall clock in
    /// production; in test mode the store's test clock, which starts at the wall
    /// clock, jumps forward when advanced and moves on with the wall clock from there.
    pub fn now_in(&self, scope: &Scope) -> i64 {
        let now = self.now_ms();
        match scope.mode {
            Mode::Test => match self.test_clocks.get(scope.store_id.as_ref()) {
                Some(clock) => test_time(clock.0, clock.1, now),
                None => now,
            },
            Mode::Prod => now,
        }
    }

    /// The latest time any test store shows (the wall clock when none is ahead).
    pub fn latest_test_time(&self) -> i64 {
        let now = self.now_ms();
        self.test_clocks
            .iter()
            .map(|clock| test_time(clock.0, clock.1, now))
            .fold(now, i64::max)
    }

    /// A store's test clock as the projection holds it (`to_ms` set at `at_ms`).
    pub fn note_test_clock(&self, store_id: &str, to_ms: i64, at_ms: i64) {
        self.test_clocks
            .insert(store_id.to_string(), (to_ms, at_ms));
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
            .filter_map(|p| {
                p.first_key_value()
                    .map(|(_, appended)| appended.at.elapsed())
            })
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

    /// Whether this node serves the store: it projects the store's partition in
    /// full and has restored it (always, unless it shares the projection with a
    /// cluster). Background work acts only on the stores it serves.
    pub fn serves_store(&self, store_id: &str) -> bool {
        self.runtime
            .ownership()
            .serves(self.log.partition_for(store_id.as_bytes()))
    }

    /// Appends a record; returns (partition, offset) once it is durable.
    pub async fn append(&self, record: &Record) -> Result<(u32, u64), EngineError> {
        self.append_with(record, None).await
    }

    /// Appends a record with its envelope: for an update, the `updated_at_ms` of the
    /// version it was derived from (apply refuses it if that changed meanwhile); and,
    /// when it is the first record of a request sent with an `idempotency-key`, that
    /// key (see `idempotency`).
    pub async fn append_with(
        &self,
        record: &Record,
        base_updated_at_ms: Option<i64>,
    ) -> Result<(u32, u64), EngineError> {
        self.append_record(Cow::Borrowed(record), base_updated_at_ms)
            .await
    }

    /// Appends a record and hands it to this node's projector as it is, which then
    /// applies it without decoding it from the log (the same record, since decoding
    /// what was encoded gives it back: a property test in `tally-proto` holds that).
    /// For ingest's usage records: decoding them again was ~5% of the server's CPU
    /// under the ingest benchmark. Held until applied, so bounded by
    /// `MAX_UNAPPLIED_EVENTS` like the rest of the backpressure account; a record the
    /// projector read before it was handed over is decoded as any other.
    pub async fn append_handing_off(&self, record: Record) -> Result<(u32, u64), EngineError> {
        self.append_record(Cow::Owned(record), None).await
    }

    /// The records at these positions (partition, offset) that were handed over
    /// (`append_handing_off`) and not taken yet, in the order asked.
    pub fn take_handed_off(
        &self,
        positions: impl Iterator<Item = (u32, u64)>,
    ) -> Vec<Option<(Record, RecordMeta)>> {
        let mut unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
        positions
            .map(|(partition, offset)| {
                unapplied
                    .partitions
                    .get_mut(partition as usize)
                    .and_then(|pending| pending.get_mut(&offset))
                    .and_then(|appended| appended.handed_off.take())
            })
            .collect()
    }

    /// Appends `record` and notes it in the backpressure account; an owned record
    /// is kept there for the projector (`append_handing_off`).
    async fn append_record(
        &self,
        record: Cow<'_, Record>,
        base_updated_at_ms: Option<i64>,
    ) -> Result<(u32, u64), EngineError> {
        self.check_writable()?;
        let key = record.partition_key();
        let meta = RecordMeta {
            recorded_at_ms: self.clock.now_ms(),
            base_updated_at_ms,
            request: idempotency::request_key_for(&key),
        };
        let payload = tally_proto::encode_record_with(&record, &meta);
        let partition = self.log.partition_for(&key);
        let started = Instant::now();
        let offset = self.log.append(&key, payload).await?;
        // Outside a counting scope there is nothing to count.
        let _ = APPENDED.try_with(|appended| appended.set(appended.get() + 1));
        self.metrics.log_append(self.log.kind(), started.elapsed());
        let events = record
            .stored_events()
            .map_or(0, |(_, _, events)| events.len());
        let mut unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
        if self.runtime.applied(partition) <= offset {
            unapplied.partitions[partition as usize].insert(
                offset,
                Appended {
                    at: Instant::now(),
                    events,
                    handed_off: match record {
                        Cow::Owned(record) => Some((record, meta)),
                        Cow::Borrowed(_) => None,
                    },
                },
            );
            unapplied.events += events;
        }
        Ok((partition, offset))
    }

    /// Forgets this node's appends below `next_offset` of `partition` (applied).
    pub fn note_applied(&self, partition: u32, next_offset: u64) {
        let done = {
            let mut unapplied = self.unapplied.lock().unwrap_or_else(|p| p.into_inner());
            let pending = &mut unapplied.partitions[partition as usize];
            let still = pending.split_off(&next_offset);
            let done = std::mem::replace(pending, still);
            let events: usize = done.values().map(|appended| appended.events).sum();
            unapplied.events = unapplied.events.saturating_sub(events);
            if events > 0 && unapplied.events <= MAX_UNAPPLIED_EVENTS {
                self.headroom.notify_waiters();
            }
            done
        };
        // Records handed over but decoded instead are freed outside the lock.
        drop(done);
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
        if self.unapplied_events() <= MAX_UNAPPLIED_EVENTS {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_millis(BACKPRESSURE_WAIT_MS);
        loop {
            // Registered before the count is read: room freed between the two still
            // wakes this wait (`note_applied` notifies under the same lock).
            let freed = self.headroom.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.unapplied_events() <= MAX_UNAPPLIED_EVENTS {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(EngineError::ApplyTimeout);
            }
        }
    }

    /// Appends a record and waits until it is visible in the projections; a record
    /// the projector refused answers with its recorded rejection.
    pub async fn append_and_apply(&self, record: &Record) -> Result<(), EngineError> {
        self.append_and_decide(record).await.map(|_| ())
    }

    /// Appends a record, waits for the projector, and returns what it decided: the
    /// decision is taken in apply, in log order (see `outcome`), and read back here.
    pub async fn append_and_decide(&self, record: &Record) -> Result<Decision, EngineError> {
        self.append_and_decide_with(record, None).await
    }

    /// `append_and_decide` for an update derived from the version stamped
    /// `base_updated_at_ms` (see `append_with`).
    pub async fn append_and_decide_with(
        &self,
        record: &Record,
        base_updated_at_ms: Option<i64>,
    ) -> Result<Decision, EngineError> {
        self.decide_at(record, base_updated_at_ms)
            .await
            .map(|(decision, _)| decision)
    }

    /// `append_and_decide`, with the record's position: a caller that reads back
    /// what apply recorded under it.
    pub async fn append_and_decide_at(
        &self,
        record: &Record,
    ) -> Result<(Decision, (u32, u64)), EngineError> {
        self.decide_at(record, None).await
    }

    async fn decide_at(
        &self,
        record: &Record,
        base_updated_at_ms: Option<i64>,
    ) -> Result<(Decision, (u32, u64)), EngineError> {
        // Read before the append, so the record's outcome, if apply records one,
        // comes after it (`decided`).
        let retired = self.store.retired_layers();
        let position = self.append_with(record, base_updated_at_ms).await?;
        Ok((self.decided(record, position, retired).await?, position))
    }

    /// What apply decided about `record`, appended at `(partition, offset)`: waits
    /// for it to be applied (for a caller that had to act between the append and the
    /// wait, as ingest hands its in-flight reservations over).
    pub async fn decision(
        &self,
        record: &Record,
        position: (u32, u64),
    ) -> Result<Decision, EngineError> {
        self.decided(record, position, None).await
    }

    /// `decision`; `retired` is the store's `retired_layers` read before the record
    /// was appended. While it has not moved, the outcome apply recorded (if any) is
    /// still in memory, so a record applied without one (the common case) is known
    /// to be without one without a read of sled, where the miss walked its tree
    /// (~4% of the request threads under debits; docs/benchmarks.md, "Fresh keys
    /// known absent").
    async fn decided(
        &self,
        record: &Record,
        (partition, offset): (u32, u64),
        retired: Option<u64>,
    ) -> Result<Decision, EngineError> {
        self.wait_applied(partition, offset).await?;
        if !record.applies_on_every_node()
            && !self.runtime.ownership().applied_in_full(partition, offset)
        {
            // The partition moved to another node of the cluster before this node
            // applied the record: its owner decides it.
            return Err(EngineError::Unavailable {
                code: "partition_moved",
                message: "the write is durable, but its store moved to another node of the cluster before this one decided it; retry with the same idempotency key",
            });
        }
        let key = outcome::outcome_key(partition, offset);
        let outcome = match self.store.unwritten(&key) {
            Some(outcome) => outcome,
            None if retired.is_some() && self.store.retired_layers() == retired => None,
            None => self.store.get(&key)?,
        };
        let decision = match outcome {
            None => Decision::Applied,
            Some(bytes) => match outcome::Outcome::decode(&bytes)? {
                outcome::Outcome::SameAs { id } => Decision::SameAs(id),
                rejected => return Err(rejected.into()),
            },
        };
        Ok(decision)
    }

    /// Runs an update without any lock (ARCHITECTURE.md "Decisions in apply"):
    /// `derive` reads the current version and says what to write; apply writes it
    /// only on top of that version. If another write got there first, the update is
    /// derived again, at most `MAX_UPDATE_ATTEMPTS` times.
    pub async fn update<T>(
        &self,
        mut derive: impl FnMut() -> Result<Update<T>, EngineError>,
    ) -> Result<T, EngineError> {
        let mut attempt = 1;
        loop {
            let (record, base, result) = match derive()? {
                Update::Unchanged(result) => return Ok(result),
                Update::Write {
                    record,
                    base_updated_at_ms,
                    result,
                } => (record, base_updated_at_ms, result),
            };
            match self.append_and_decide_with(&record, Some(base)).await {
                Ok(_) => return Ok(result),
                Err(EngineError::Conflict { code, .. })
                    if RETRIED_OUTCOMES.contains(&code) && attempt < MAX_UPDATE_ATTEMPTS =>
                {
                    attempt += 1;
                    // The refused record claimed no idempotency key: the next one may.
                    idempotency::give_back();
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Stamps an update of the version stamped `*updated_at_ms` (see `update_time`)
    /// and returns that base stamp, which the update's record carries.
    pub fn restamp(&self, updated_at_ms: &mut i64) -> i64 {
        let base = *updated_at_ms;
        *updated_at_ms = self.update_time(base);
        base
    }

    /// The `updated_at_ms` of an update derived from the version stamped `base`:
    /// now, and always later than the base, so versions stay distinct even within
    /// one millisecond.
    pub fn update_time(&self, base: i64) -> i64 {
        self.now_ms().max(base.saturating_add(1))
    }

    /// The watermark of the store's partition: every record of the store below it
    /// is applied here, and what it changed is in the caches. What a gateway reads
    /// before it decides from those caches (ARCHITECTURE.md, "Meters the gateway
    /// did not know").
    pub fn applied_for_store(&self, store_id: &str) -> u64 {
        self.runtime
            .applied(self.log.partition_for(store_id.as_bytes()))
    }

    /// `wait_caught_up`, given up after `limit`: whether the node caught up.
    pub async fn caught_up_within(&self, limit: Duration) -> bool {
        matches!(
            tokio::time::timeout(limit, self.wait_caught_up()).await,
            Ok(Ok(()))
        )
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
}

/// A test clock set to `to_ms` at `at_ms`, read at wall time `now_ms`: it moves on
/// with the wall clock, and never shows less than `to_ms`.
pub fn test_time(to_ms: i64, at_ms: i64, now_ms: i64) -> i64 {
    to_ms.saturating_add(now_ms.saturating_sub(at_ms).max(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use tally_domain::clock::ManualClock;
    use tally_domain::ids::StoreId;
    use tally_domain::usage::UsageEvent;

    fn batch(first: usize, events: usize) -> Record {
        Record::UsageBatch {
            store_id: StoreId::from("st_1".to_string()),
            mode: Mode::Test,
            events: (first..first + events)
                .map(|n| UsageEvent {
                    event_id: format!("e{n}"),
                    name: "api_call".into(),
                    customer_id: "cus_1".to_string().into(),
                    external_customer_id: None,
                    timestamp_ms: 0,
                    properties: BTreeMap::new(),
                    received_at_ms: 0,
                    matched_meter_ids: Vec::new(),
                    event_id_assigned: false,
                })
                .collect(),
            settles: false,
            matched_below: None,
        }
    }

    /// Ingest past `MAX_UNAPPLIED_EVENTS` waits, and the apply that frees room
    /// releases it at once (no poll interval, no timeout).
    #[tokio::test]
    async fn headroom_waits_until_applies_free_room() {
        let dir = tempfile::tempdir().unwrap();
        let log: Arc<dyn Log> =
            Arc::new(tally_log::embedded::EmbeddedLog::open(dir.path()).unwrap());
        let store: Arc<dyn ProjectionStore> =
            Arc::new(tally_projection::memory::MemoryStore::new());
        // A runtime that is never started: nothing applies but `note_applied` below.
        let runtime = Arc::new(Runtime::new(log.clone(), store.clone()).await.unwrap());
        let journal = Arc::new(Journal::new(
            log,
            store,
            Arc::new(ManualClock::new(0)),
            runtime,
        ));
        const PER_RECORD: usize = 100;
        let mut last = (0, 0);
        let mut appended = 0;
        while appended <= MAX_UNAPPLIED_EVENTS {
            last = journal
                .append_handing_off(batch(appended, PER_RECORD))
                .await
                .unwrap();
            appended += PER_RECORD;
        }
        assert_eq!(journal.unapplied_events(), appended);
        let waiting = tokio::spawn({
            let journal = journal.clone();
            async move { journal.wait_for_projector_headroom().await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !waiting.is_finished(),
            "it waits while the projector is behind"
        );
        // Applying all but the last record leaves room.
        let (partition, offset) = last;
        journal.note_applied(partition, offset);
        tokio::time::timeout(Duration::from_secs(2), waiting)
            .await
            .expect("released by the apply that freed room")
            .unwrap()
            .unwrap();
        assert_eq!(journal.unapplied_events(), PER_RECORD);
        // With room, it does not wait at all.
        journal.wait_for_projector_headroom().await.unwrap();
    }
}
