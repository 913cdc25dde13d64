//! The composition root of Tally's contexts: it builds the journal and the
//! contexts over one log and one projection store, wires each context's ports to
//! the context that answers them, and is the projection the runtime drives (the
//! projector dispatches each record to its context's apply, then hands each context
//! what its commit changed).
//!
//! - [`tally_directory`]: stores, API keys, customers;
//! - [`tally_metering`]: meters, usage, stored events, backfills;
//! - [`tally_ingest`]: the ingest gateway;
//! - [`tally_ledger`]: credits accounts and transactions, the audit;
//! - [`tally_notifications`]: webhook endpoints and deliveries;
//! - [`tally_billing`]: products (and, as they are built, checkouts, transactions,
//!   subscriptions).
//!
//! Metering and billing ask each other through ports (metering's `Pricing`,
//! billing's `Meters`); the billing half is bound once both exist ([`BillingPort`]).

use std::sync::Arc;
use std::time::Duration;

use tally_billing::Billing;
use tally_directory::Directory;
use tally_domain::clock::Clock;
use tally_domain::usage::CustomerRef;
use tally_ingest::Gateway;
use tally_ledger::Ledger;
use tally_log::Log;
use tally_metering::Metering;
use tally_notifications::Notifications;
use tally_projection::ProjectionStore;
use tokio::sync::watch;

pub mod projector;
pub mod restore;

pub use tally_billing as billing;
pub use tally_billing::products;
pub use tally_core::journal::APPLY_WAIT_TIMEOUT_MS;
pub use tally_core::{
    codec, error, event_index, idempotency, ids, keys, metrics, outcome, overlay, pagination,
    Decision, EngineError, Journal, Metrics, Scope, APPENDED, APPLY_WAIT,
};
pub use tally_directory::access as directory_access;
pub use tally_directory::{customers, stores};
pub use tally_ingest as ingest;
pub use tally_ledger as ledger;
pub use tally_ledger::audit;
pub use tally_metering::{events, meters, usage, voids};
pub use tally_notifications::{dispatcher, webhooks};
pub use tally_runtime::Ownership;

/// The directory, as the ports of the contexts that need customers see it.
struct DirectoryPort(Arc<Directory>);

impl tally_ingest::Customers for DirectoryPort {
    fn resolve_customer(
        &self,
        scope: &Scope,
        customer: &CustomerRef,
    ) -> Result<Option<String>, EngineError> {
        self.0.resolve_customer(scope, customer)
    }
}

impl tally_ledger::AccountHolders for DirectoryPort {
    fn customer_exists(&self, scope: &Scope, id: &str) -> Result<bool, EngineError> {
        self.0.customer_exists(scope, id)
    }
}

/// Metering's `Pricing` port, answered by billing. Bound after both contexts are
/// built (each needs the other's port); nothing asks before the engine is returned.
/// It holds billing weakly: billing holds metering through its own port, and a
/// strong link back would be a cycle that keeps the log and store open after the
/// engine is dropped.
#[derive(Debug, Default)]
pub struct BillingPort(std::sync::OnceLock<std::sync::Weak<Billing>>);

impl tally_metering::Pricing for BillingPort {
    fn meter_priced_on_active_product(
        &self,
        scope: &Scope,
        meter_id: &str,
    ) -> Result<bool, EngineError> {
        match self.0.get().and_then(std::sync::Weak::upgrade) {
            Some(billing) => billing.meter_priced_on_active_product(scope, meter_id),
            None => Err(EngineError::Unavailable {
                code: "not_ready",
                message: "billing is not running (the engine is shutting down)",
            }),
        }
    }
}

#[async_trait::async_trait]
impl tally_billing::Customers for DirectoryPort {
    fn customer_country(
        &self,
        scope: &Scope,
        customer_id: &str,
    ) -> Result<Option<Option<String>>, EngineError> {
        match self.0.get_customer(scope, customer_id) {
            Ok(customer) => Ok(Some(customer.country)),
            Err(EngineError::NotFound { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    async fn create_customer(&self, scope: &Scope, email: &str) -> Result<String, EngineError> {
        let input = tally_domain::customer::CustomerInput {
            email: tally_domain::customer::Patch::Set(email.to_string()),
            ..Default::default()
        };
        Ok(self.0.create_customer(scope, &input).await?.id.to_string())
    }
}

/// Billing's `Credits` port, answered by the ledger: the priced auto-recharges
/// waiting for their charge.
struct LedgerPort(Ledger);

#[async_trait::async_trait]
impl tally_billing::Credits for LedgerPort {
    fn recharges_due(&self, limit: usize) -> Result<Vec<tally_billing::RechargeDue>, EngineError> {
        Ok(self
            .0
            .pending_recharges(limit)?
            .into_iter()
            .filter_map(|pending| {
                // Its terms are read now: a recharge whose price was removed
                // meanwhile was dropped by that update.
                let recharge = pending.account.auto_recharge?;
                Some(tally_billing::RechargeDue {
                    scope: pending.scope,
                    account_id: pending.account.id.to_string(),
                    customer_id: pending.account.customer_id.to_string(),
                    debit_id: pending.debit_id,
                    amount: recharge.amount,
                    unit_label: pending.account.unit_label,
                    price: recharge.price?,
                })
            })
            .collect())
    }
}

/// The gateway's `Settlements` port, answered by billing.
struct SettlementsPort(Arc<Billing>);

impl tally_ingest::Settlements for SettlementsPort {
    fn settles(
        &self,
        scope: &Scope,
        events: &[tally_domain::usage::UsageEvent],
    ) -> Result<bool, EngineError> {
        self.0.settles(scope, events)
    }

    fn any_priced(&self, scope: &Scope) -> Result<bool, EngineError> {
        self.0.scope_prices_meters(scope)
    }

    fn priced(&self, scope: &Scope, meter_id: &str) -> Result<bool, EngineError> {
        self.0.meter_priced_on_active_product(scope, meter_id)
    }

    fn billed(
        &self,
        scope: &Scope,
        customer_id: &str,
        meter_id: &str,
    ) -> Result<bool, EngineError> {
        self.0.usage_is_billed(scope, customer_id, meter_id)
    }
}

/// Billing's `Meters` port, answered by metering.
struct MeteringPort(Arc<Metering>);

impl tally_billing::Meters for MeteringPort {
    fn meter_info(
        &self,
        scope: &Scope,
        meter_id: &str,
    ) -> Result<Option<tally_billing::MeterInfo>, EngineError> {
        match self.0.get_meter(scope, meter_id) {
            Ok(meter) => Ok(Some(tally_billing::MeterInfo {
                status: meter.status,
                aggregation: meter.aggregation,
                revision: meter.revision,
            })),
            Err(EngineError::NotFound { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    fn period_usage(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<Option<rust_decimal::Decimal>, EngineError> {
        match self
            .0
            .period_usage(scope, meter_id, customer_id, start_ms, end_ms)
        {
            Err(EngineError::NotFound { .. }) => Ok(None),
            other => other,
        }
    }

    fn period_voided_events(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<u64, EngineError> {
        self.0
            .period_voided_events(scope, meter_id, customer_id, start_ms, end_ms)
    }
}

/// Webhook deliveries `/metrics` counts at most (a scrape stays cheap under any
/// backlog; the gauge then reads this value).
pub const MAX_QUEUE_DEPTH_COUNTED: usize = 100_000;

/// The usage event each screening records (docs/api.md, "Moderation").
pub const MODERATION_EVENT: &str = "moderation.prompt";

/// A screened prompt.
#[derive(Debug, Clone)]
pub struct Moderated {
    pub id: String,
    pub decision: tally_domain::moderation::Decision,
    pub reasons: Vec<String>,
    pub units: u64,
    /// Whether a usage event recorded it (the external id named a customer).
    pub metered: bool,
}

pub struct Engine {
    journal: Arc<Journal>,
    directory: Arc<Directory>,
    metering: Arc<Metering>,
    gateway: Gateway,
    ledger: Ledger,
    notifications: Arc<Notifications>,
    billing: Arc<Billing>,
    projection: projector::StoreProjection,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("log", &self.journal.log().kind())
            .finish()
    }
}

/// The engine is the projection the runtime drives: the store projection's apply,
/// then each context's caches and this node's backpressure accounting after each
/// commit.
impl tally_runtime::Projection for Engine {
    type Chunk = projector::DecodedChunk;
    type Fetched = projector::Fetched;
    type Applied = projector::Applied;

    fn decode(
        &self,
        entries: Vec<tally_log::LogEntry>,
        mode: tally_runtime::ChunkMode,
    ) -> Self::Chunk {
        // This node's own usage records come as they were appended, not decoded
        // (`Journal::append_handing_off`).
        let handed_off = self
            .journal
            .take_handed_off(entries.iter().map(|entry| (entry.partition, entry.offset)));
        projector::DecodedChunk::handed_off(entries, mode, handed_off)
    }

    fn skipped_from(&self, partition: u32) -> Result<Option<u64>, String> {
        self.projection.skipped_from(partition)
    }

    fn prefetch_snapshot(&self, partition: u32) {
        self.projection.prefetch_snapshot(partition)
    }

    fn snapshot_position(&self, partition: u32) -> Option<u64> {
        self.projection.snapshot_position(partition)
    }

    fn restore_snapshot(
        &self,
        partition: u32,
        from: u64,
        until: u64,
    ) -> Result<Option<(u64, Self::Applied)>, String> {
        self.projection.restore_snapshot(partition, from, until)
    }

    fn plan(&self, chunk: &Self::Chunk) -> Result<Vec<(u32, u64)>, String> {
        self.projection.plan(chunk)
    }

    fn read_ahead(&self, chunk: &std::sync::Arc<Self::Chunk>) {
        self.projection.read_ahead(chunk)
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

    fn fetch_cached(&self, fetched: &mut Self::Fetched, partition: u32, offset: u64) -> bool {
        self.projection.fetch_cached(fetched, partition, offset)
    }

    fn apply(
        &self,
        chunk: &Self::Chunk,
        fetched: &Self::Fetched,
    ) -> Result<Self::Applied, tally_runtime::ApplyFailure> {
        self.projection.apply(chunk, fetched)
    }

    fn after_commit(&self, applied: Self::Applied, committed: tally_runtime::Committed) {
        self.directory.after_commit(applied.directory);
        self.metering.after_commit(applied.metering);
        if applied.billing.settlements_pending {
            self.billing.wake_settler();
        }
        for (store, to_ms, at_ms) in &applied.billing.test_clocks {
            self.journal.note_test_clock(store, *to_ms, *at_ms);
        }
        self.journal
            .metrics
            .records_applied(committed.records as u64);
        if !committed.restored {
            self.journal
                .note_applied(committed.partition, committed.next_offset);
        }
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
    /// Builds the contexts over the projection and notes where the log ends, so
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
        let recent = Arc::new(tally_metering::recent::RecentRecords::default());
        let projection =
            projector::StoreProjection::load(store.clone(), index.clone(), recent.clone())?;
        let runtime = Arc::new(
            tally_runtime::Runtime::new(log.clone(), store.clone())
                .await
                .map_err(EngineError::from)?,
        );
        let journal = Arc::new(Journal::new(log, store.clone(), clock, runtime));
        for (store_id, to_ms, at_ms) in tally_billing::lifecycle::test_clocks(store.as_ref())? {
            journal.note_test_clock(&store_id, to_ms, at_ms);
        }
        let directory = Arc::new(Directory::load(journal.clone())?);
        let pricing = Arc::new(BillingPort::default());
        let metering = Arc::new(Metering::load(
            journal.clone(),
            index,
            recent,
            pricing.clone(),
        )?);
        let port = Arc::new(DirectoryPort(directory.clone()));
        let billing = Arc::new(Billing::new(
            journal.clone(),
            tally_billing::Ports {
                meters: Arc::new(MeteringPort(metering.clone())),
                customers: port.clone(),
                credits: Arc::new(LedgerPort(Ledger::new(journal.clone(), port.clone()))),
                test_payments: Arc::new(tally_billing::TestCards),
                live_payments: None,
            },
        ));
        // Bound once, here, before anything can ask.
        let _ = pricing.0.set(Arc::downgrade(&billing));
        Ok(Arc::new(Engine {
            billing: billing.clone(),
            gateway: Gateway::new(
                journal.clone(),
                metering.clone(),
                port.clone(),
                Arc::new(SettlementsPort(billing.clone())),
            ),
            ledger: Ledger::new(journal.clone(), port),
            notifications: Arc::new(Notifications::new(journal.clone())),
            journal,
            directory,
            metering,
            projection,
        }))
    }

    /// `POST /v1/moderation/prompt`: screens `prompt` with the store's policy and
    /// meters it: a usage event `moderation.prompt` with property `units`, for the
    /// customer `external_id` names (when it names one), so a meter can bill it.
    pub async fn moderate(
        &self,
        scope: &Scope,
        prompt: Option<&str>,
        external_id: Option<&str>,
    ) -> Result<Moderated, EngineError> {
        use tally_domain::moderation::{check_prompt, units, Screener};
        let prompt = check_prompt(prompt)?;
        let screener = Screener::new(self.directory.moderation_policy(scope)?)?;
        let (decision, reasons) = screener.screen(prompt);
        let units = units(prompt);
        let id = tally_core::ids::new_id("mod");
        let mut metered = false;
        if let Some(external) = external_id {
            let reference = CustomerRef::External(external.to_string());
            if self
                .directory
                .resolve_customer(scope, &reference)?
                .is_some()
            {
                let raw = tally_domain::usage::RawUsageEvent {
                    name: Some(MODERATION_EVENT.into()),
                    customer_id: None,
                    external_customer_id: Some(external.to_string()),
                    event_id: Some(id.clone()),
                    timestamp: None,
                    properties: vec![(
                        "units".into(),
                        tally_domain::usage::RawPropertyValue::Number(units.to_string()),
                    )],
                };
                self.gateway.ingest_events(scope, vec![Ok(raw)]).await?;
                metered = true;
            }
        }
        Ok(Moderated {
            id,
            decision,
            reasons,
            units,
            metered,
        })
    }

    /// Appending, waiting for decisions, the write gate, node metrics.
    /// Restores the partitions this node gains from a split cluster's changelog
    /// where it can (deploy/README.md, "Restore from the changelog").
    pub fn set_changelog(
        &self,
        changelog: Arc<dyn tally_log::changelog::Changelog>,
        partitions: u32,
    ) {
        self.projection.set_changelog(changelog, partitions);
    }

    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    /// Stores, API keys, customers.
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Meters, usage, stored events, backfills.
    pub fn metering(&self) -> &Metering {
        &self.metering
    }

    /// Ingest and preview of usage events.
    pub fn gateway(&self) -> &Gateway {
        &self.gateway
    }

    /// Credits accounts and transactions.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Products.
    pub fn billing(&self) -> &Billing {
        &self.billing
    }

    /// Webhook endpoints and deliveries (shared with the dispatcher).
    pub fn notifications(&self) -> &Arc<Notifications> {
        &self.notifications
    }

    pub fn metrics(&self) -> &Metrics {
        &self.journal.metrics
    }

    /// The state `/metrics` shows: projector lag per partition and in time, the
    /// checkpoint's age and backlog, the dedup index, the webhook queue.
    pub async fn gauges(&self) -> Result<metrics::Gauges, EngineError> {
        Ok(metrics::Gauges {
            positions: self.positions().await,
            log_kind: self.log().kind(),
            apply_lag: self.apply_lag(),
            checkpoint_age: self.store().checkpoint_age(),
            checkpoint_dirty_keys: self.store().dirty_keys(),
            dedup_index_entries: self.metering.caches().events.len(),
            webhook_queue_depth: self
                .notifications
                .queued_deliveries(MAX_QUEUE_DEPTH_COUNTED)?,
        })
    }

    pub fn log(&self) -> &Arc<dyn Log> {
        self.journal.log()
    }

    pub fn store(&self) -> &Arc<dyn ProjectionStore> {
        self.journal.store()
    }

    pub fn now_ms(&self) -> i64 {
        self.journal.now_ms()
    }

    /// See `Journal::is_ready`.
    pub fn is_ready(&self) -> bool {
        self.journal.is_ready()
    }

    /// See `Journal::positions`.
    pub async fn positions(&self) -> Vec<(u64, u64)> {
        self.journal.positions().await
    }

    /// See `Journal::check_writable`.
    pub fn check_writable(&self) -> Result<(), EngineError> {
        self.journal.check_writable()
    }

    pub fn apply_wait(&self) -> Duration {
        self.journal.apply_wait()
    }

    pub fn apply_lag(&self) -> Duration {
        self.journal.apply_lag()
    }

    pub fn tune_waits(&self, apply_wait: Duration, max_apply_lag: Duration) {
        self.journal.tune_waits(apply_wait, max_apply_lag)
    }

    /// Waits until everything durable in the log at this moment is applied.
    pub async fn wait_caught_up(&self) -> Result<(), EngineError> {
        self.journal.wait_caught_up().await
    }

    /// Starts the projection runtime: one task per partition; they stop when
    /// `shutdown` turns true.
    pub fn start_projector(
        self: &Arc<Self>,
        shutdown: watch::Receiver<bool>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = self
            .journal
            .runtime()
            .clone()
            .start(self.clone(), shutdown.clone());
        // Usage settled in credits leaves the projector as pending settlements;
        // the settler turns them into the ledger's records.
        tasks.push(tokio::spawn(
            self.billing.clone().run_settler(shutdown.clone()),
        ));
        // Grants past their expiry instant, booked even when nothing else touches
        // their account.
        tasks.push(tokio::spawn(tally_ledger::grants::run_expiry_sweep(
            self.journal.clone(),
            shutdown.clone(),
        )));
        // Renewals, trial ends, retries and scheduled cancels, on the stores' clocks.
        tasks.push(tokio::spawn(self.billing.clone().run_scheduler(shutdown)));
        tasks
    }

    /// Flushes the projection (graceful shutdown).
    pub fn flush(&self) -> Result<(), EngineError> {
        self.journal.store().flush()?;
        Ok(())
    }
}
