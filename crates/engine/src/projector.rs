//! The projector: folds log records into the projection store.
//!
//! A chunk of entries is folded through an [`Overlay`] (so later records of the
//! chunk see earlier ones' writes) into one batch, committed atomically together with
//! the chunk's end position. Applying is a pure function of the records and the
//! projection: no clock, no randomness. Replaying the log into an empty store
//! therefore reproduces the projection byte for byte (`tally replay` checks this).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tally_domain::aggregate::{contribution, Aggregate, Contribution};
use tally_domain::meter::{EventView, Meter};
use tally_domain::record::Record;
use tally_domain::time::minute_bucket;
use tally_domain::usage::UsageEvent;
use tally_domain::Mode;
use tally_log::LogEntry;
use tally_projection::{scan_prefix, ProjectionStore, Visit};

use crate::codec;
use crate::error::EngineError;
use crate::keys::{self, Key, ALL_CUSTOMERS};
use crate::outcome::{outcome_key, Outcome};

/// Reads through to the store, with this chunk's pending writes on top.
pub struct Overlay<'a> {
    store: &'a dyn ProjectionStore,
    changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Decoded buckets of this chunk; encoded once at the end (a hot bucket is
    /// touched by many events of one chunk).
    aggregates: HashMap<Vec<u8>, Aggregate>,
    cache: Option<&'a BucketCache>,
    /// What the record being applied overwrote, newest last: rolled back when apply
    /// refuses the record, so a refused record leaves no trace but its outcome.
    journal: Vec<Undo>,
}

/// One overwritten value of the overlay (`None`: the key was not in the overlay).
enum Undo {
    Change(Vec<u8>, Option<Option<Vec<u8>>>),
    Aggregate(Vec<u8>, Option<Aggregate>),
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
#[derive(Debug, Default)]
pub struct BucketCache {
    buckets: HashMap<Vec<u8>, Aggregate>,
}

/// Buckets kept in the cache before it is emptied (bounds memory: ~150 B each).
pub const MAX_CACHED_BUCKETS: usize = 200_000;

impl<'a> Overlay<'a> {
    pub fn new(store: &'a dyn ProjectionStore) -> Self {
        Overlay {
            store,
            cache: None,
            changes: BTreeMap::new(),
            aggregates: HashMap::new(),
            journal: Vec::new(),
        }
    }

    /// Forgets the journal: the record applied so far stays.
    fn keep(&mut self) {
        self.journal.clear();
    }

    /// Undoes everything since the last `keep`.
    fn roll_back(&mut self) {
        while let Some(undo) = self.journal.pop() {
            match undo {
                Undo::Change(key, Some(previous)) => {
                    self.changes.insert(key, previous);
                }
                Undo::Change(key, None) => {
                    self.changes.remove(&key);
                }
                Undo::Aggregate(key, Some(previous)) => {
                    self.aggregates.insert(key, previous);
                }
                Undo::Aggregate(key, None) => {
                    self.aggregates.remove(&key);
                }
            }
        }
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError> {
        match self.changes.get(key) {
            Some(value) => Ok(value.clone()),
            None => Ok(self.store.get(key)?),
        }
    }

    /// Every entry under `prefix`: the store's, with this chunk's writes on top.
    pub fn prefix_entries(&self, prefix: &[u8]) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, EngineError> {
        let mut entries = BTreeMap::new();
        scan_prefix(self.store, prefix, false, &mut |k, v| {
            entries.insert(k.to_vec(), v.to_vec());
            Visit::Continue
        })?;
        for (key, value) in self.changes.range(prefix.to_vec()..) {
            if !key.starts_with(prefix) {
                break;
            }
            match value {
                Some(v) => entries.insert(key.clone(), v.clone()),
                None => entries.remove(key),
            };
        }
        Ok(entries)
    }

    pub fn contains(&self, key: &[u8]) -> Result<bool, EngineError> {
        Ok(self.get(key)?.is_some())
    }

    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.set(key, Some(value));
    }

    pub fn delete(&mut self, key: Vec<u8>) {
        self.set(key, None);
    }

    fn set(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        let previous = self.changes.insert(key.clone(), value);
        self.journal.push(Undo::Change(key, previous));
    }

    fn aggregate_mut(&mut self, key: Vec<u8>) -> Result<&mut Aggregate, EngineError> {
        if !self.aggregates.contains_key(&key) {
            let cached = self.cache.and_then(|c| c.buckets.get(&key)).cloned();
            let current = match cached {
                Some(aggregate) => aggregate,
                None => match self.store.get(&key)? {
                    Some(bytes) => codec::decode_aggregate(&bytes)?,
                    None => Aggregate::default(),
                },
            };
            self.journal.push(Undo::Aggregate(key.clone(), None));
            self.aggregates.insert(key.clone(), current.clone());
        } else {
            let previous = self.aggregates.get(&key).cloned();
            self.journal.push(Undo::Aggregate(key.clone(), previous));
        }
        self.aggregates
            .get_mut(&key)
            .ok_or_else(|| EngineError::Corrupt("bucket vanished from the overlay".into()))
    }

    /// The batch to commit, and the buckets it writes (for the cache).
    #[allow(clippy::type_complexity)]
    pub fn into_changes(self) -> (Vec<(Vec<u8>, Option<Vec<u8>>)>, HashMap<Vec<u8>, Aggregate>) {
        let mut changes = self.changes;
        for (key, aggregate) in &self.aggregates {
            changes.insert(key.clone(), Some(codec::encode_aggregate(aggregate)));
        }
        (changes.into_iter().collect(), self.aggregates)
    }
}

/// What a committed chunk changed, for the in-memory caches.
#[derive(Debug, Default)]
pub struct Applied {
    pub stores: Vec<tally_domain::record::StoreRecord>,
    pub meters: Vec<Meter>,
    /// In-flight dedup reservations that this chunk made durable.
    pub event_keys: Vec<String>,
    /// A customer was created or updated.
    pub customers_changed: bool,
    /// Cache keys (`customer_cache_key`) of external ids a customer update released.
    pub stale_external_ids: Vec<String>,
}

impl Applied {
    fn absorb(&mut self, other: Applied) {
        self.stores.extend(other.stores);
        self.meters.extend(other.meters);
        self.event_keys.extend(other.event_keys);
        self.customers_changed |= other.customers_changed;
        self.stale_external_ids.extend(other.stale_external_ids);
    }
}

/// The cache key of a customer id or external id within a scope.
pub fn customer_cache_key(store_id: &str, mode: Mode, id: &str) -> String {
    format!("{store_id}\u{0}{}\u{0}{id}", mode.key_byte() as char)
}

/// The in-flight key of an event id (see `Caches::inflight_events`).
pub fn inflight_key(store_id: &str, mode: Mode, event_id: &str) -> String {
    format!("{store_id}\u{0}{}\u{0}{event_id}", mode.key_byte() as char)
}

/// Folds `entries` (in log order) and commits them with the chunk's end positions.
pub fn apply_chunk(
    store: &dyn ProjectionStore,
    entries: &[LogEntry],
) -> Result<Applied, EngineError> {
    apply_chunk_cached(store, entries, &mut BucketCache::default())
}

/// `apply_chunk` reading buckets through `cache`, which it updates after the commit.
pub fn apply_chunk_cached(
    store: &dyn ProjectionStore,
    entries: &[LogEntry],
    cache: &mut BucketCache,
) -> Result<Applied, EngineError> {
    let mut overlay = Overlay::new(store);
    overlay.cache = Some(cache);
    let mut applied = Applied::default();
    let mut positions: BTreeMap<u32, u64> = BTreeMap::new();
    for entry in entries {
        apply_entry(&mut overlay, entry, &mut applied)?;
        positions.insert(entry.partition, entry.next_offset);
    }
    let positions: Vec<(u32, u64)> = positions.into_iter().collect();
    let (changes, buckets) = overlay.into_changes();
    store.apply(changes, &positions)?;
    if cache.buckets.len() + buckets.len() > MAX_CACHED_BUCKETS {
        cache.buckets.clear();
    }
    cache.buckets.extend(buckets);
    Ok(applied)
}

/// Applies one log entry, or records why not. Only storage failures (and the
/// cross-partition wait) leave as errors: bad data never stops the projector, and
/// neither does a panic in apply (a bug, logged loudly, that the apply fuzz test
/// exists to catch), which is refused like bad data.
fn apply_entry(
    overlay: &mut Overlay<'_>,
    entry: &LogEntry,
    applied: &mut Applied,
) -> Result<(), EngineError> {
    let refused = match tally_proto::decode_record(&entry.payload) {
        Err(error @ tally_proto::DecodeError::Version { .. }) => {
            // Start-up refuses a log of another format, so this is one foreign record
            // inside a log of ours (a node of another build sharing the topic, or
            // bytes that merely parse as a record): refused like any bad record, so
            // no record can stop the projector, and loudly, because mixing builds
            // on one log is unsupported (README, "Upgrading").
            tracing::error!(partition = entry.partition, offset = entry.offset, %error,
                "a log record of another format version is refused");
            Outcome::rejected("record_format_unsupported", error.to_string())
        }
        Err(error) => Outcome::rejected(
            "record_undecodable",
            format!("the log record does not decode: {error}"),
        ),
        Ok((record, _recorded_at_ms)) => {
            if let Record::UsageBatch {
                store_id,
                mode,
                events,
            } = &record
            {
                // Reservations end with the record, applied or refused.
                applied.event_keys.extend(
                    events
                        .iter()
                        .map(|event| inflight_key(store_id, *mode, &event.event_id)),
                );
            }
            let mut effects = Applied::default();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                apply_record(overlay, &record, entry, &mut effects)
            }));
            match result {
                Ok(Ok(())) => {
                    overlay.keep();
                    applied.absorb(effects);
                    return Ok(());
                }
                Ok(Err(ApplyError::Engine(error))) => {
                    overlay.roll_back();
                    return Err(error);
                }
                Ok(Err(ApplyError::Refused(outcome))) => outcome,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(partition = entry.partition, offset = entry.offset, panic = %what,
                        "BUG: apply panicked; the record is refused and the projector goes on");
                    Outcome::rejected("apply_failed", "the record could not be applied")
                }
            }
        }
    };
    overlay.roll_back();
    overlay.put(outcome_key(entry.partition, entry.offset), refused.encode());
    overlay.keep();
    Ok(())
}

fn apply_record(
    overlay: &mut Overlay<'_>,
    record: &Record,
    entry: &LogEntry,
    applied: &mut Applied,
) -> Result<(), ApplyError> {
    match record {
        Record::StoreCreated(store) => {
            overlay.put(
                Key::table(keys::STORE).text(&store.store_id).into_bytes(),
                codec::encode_store(store),
            );
            for (hash, mode) in [
                (&store.prod_key_sha256, Mode::Prod),
                (&store.test_key_sha256, Mode::Test),
            ] {
                let mut value = store.store_id.as_bytes().to_vec();
                value.push(mode.key_byte());
                overlay.put(Key::table(keys::API_KEY).tail(hash).into_bytes(), value);
            }
            applied.stores.push(store.clone());
        }
        Record::CustomerUpserted(customer) => apply_customer(overlay, customer, applied)?,
        Record::MeterUpserted(meter) => apply_meter(overlay, meter, applied)?,
        Record::UsageBatch {
            store_id,
            mode,
            events,
        } => {
            let mut meters: HashMap<String, Meter> = HashMap::new();
            for (index, event) in events.iter().enumerate() {
                let event_key = Key::scoped(keys::EVENT, store_id, *mode)
                    .tail(event.event_id.as_bytes())
                    .into_bytes();
                // Exact dedup: the first record carrying an id wins, whatever came later.
                if overlay.contains(&event_key)? {
                    continue;
                }
                let suffix = Key::table(0)
                    .int(event.received_at_ms)
                    .tail(&entry.partition.to_be_bytes())
                    .uint(entry.offset)
                    .tail(&(index as u32).to_be_bytes())
                    .into_bytes()[1..]
                    .to_vec();
                let list_key = Key::scoped(keys::EVENT_LIST, store_id, *mode)
                    .tail(&suffix)
                    .into_bytes();
                overlay.put(list_key, event.event_id.as_bytes().to_vec());
                overlay.put(event_key, codec::encode_event(&suffix, event));
                for meter_id in &event.matched_meter_ids {
                    if !meters.contains_key(meter_id) {
                        let meter = load_meter(overlay, store_id, *mode, meter_id)?;
                        meters.insert(meter_id.clone(), meter);
                    }
                    let meter = &meters[meter_id];
                    if meter.accrues(event.timestamp_ms) {
                        fold_event(overlay, meter, event)?;
                    }
                }
            }
        }
        Record::CreditLedger {
            account,
            transaction,
            events,
        } => {
            let events = crate::ledger::apply_ledger_step(
                overlay,
                account.as_ref(),
                transaction.as_ref(),
                events,
            )?;
            crate::webhooks::schedule_deliveries(overlay, &events, entry.offset)?;
        }
        Record::WebhookEndpointUpserted(endpoint) => {
            crate::webhooks::apply_endpoint(overlay, endpoint)
        }
        Record::WebhookEndpointDeleted {
            store_id,
            mode,
            endpoint_id,
        } => overlay.delete(
            Key::scoped(keys::WEBHOOK_ENDPOINT, store_id, *mode)
                .text(endpoint_id)
                .into_bytes(),
        ),
        Record::WebhookAttempt(attempt) => crate::webhooks::apply_attempt(overlay, attempt)?,
        Record::MeterBackfill {
            store_id,
            mode,
            meter_id,
            start_ms,
            event_ids,
            finish,
            rescan_from_ms,
        } => {
            let mut meter = load_meter(overlay, store_id, *mode, meter_id)?;
            if *start_ms < meter.counts_from_ms {
                for event_id in event_ids {
                    backfill_event(overlay, &meter, *start_ms, event_id)?;
                }
                // A record without ids that does not finish predates chunked
                // backfills: it meant "all stored events" (a rescan from the start).
                let legacy = event_ids.is_empty() && !*finish;
                if *finish || legacy {
                    let from = if legacy { i64::MIN } else { *rescan_from_ms };
                    backfill_rescan(overlay, &meter, *start_ms, from)?;
                    meter.counts_from_ms = *start_ms;
                    overlay.put(
                        Key::scoped(keys::METER, store_id, *mode)
                            .text(meter_id)
                            .into_bytes(),
                        codec::encode_meter(&meter),
                    );
                    applied.meters.push(meter);
                }
            }
        }
    }
    Ok(())
}

/// A customer, created or updated. Re-checks in log order that its external id is
/// not held by another customer (the service checked before appending, but another
/// node, or a retry of a write whose outcome was unknown, may have taken it since).
fn apply_customer(
    overlay: &mut Overlay<'_>,
    customer: &tally_domain::customer::Customer,
    applied: &mut Applied,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&customer.store_id, customer.mode);
    let key = Key::scoped(keys::CUSTOMER, store_id, mode)
        .text(&customer.id)
        .into_bytes();
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_customer(&b))
        .transpose()?;
    let external_key = |external: &str| {
        Key::scoped(keys::CUSTOMER_EXTERNAL, store_id, mode)
            .text(external)
            .into_bytes()
    };
    if let Some(external) = &customer.external_id {
        if let Some(holder) = overlay.get(&external_key(external))? {
            if holder != customer.id.as_bytes() {
                return Err(crate::customers::external_id_taken(external).into());
            }
        }
    }
    match &previous {
        None => overlay.put(
            Key::scoped(keys::CUSTOMER_LIST, store_id, mode)
                .int(customer.created_at_ms)
                .text(&customer.id)
                .into_bytes(),
            Vec::new(),
        ),
        Some(old) => {
            if let Some(old_external) = &old.external_id {
                if customer.external_id.as_ref() != Some(old_external) {
                    overlay.delete(external_key(old_external));
                    applied.stale_external_ids.push(customer_cache_key(
                        store_id,
                        mode,
                        old_external,
                    ));
                }
            }
        }
    }
    applied.customers_changed = true;
    if let Some(external) = &customer.external_id {
        overlay.put(external_key(external), customer.id.as_bytes().to_vec());
    }
    overlay.put(key, codec::encode_customer(customer));
    Ok(())
}

/// A meter, created or updated. Re-checks in log order that its name is free and,
/// for a new meter, the per-store and per-event-name limits.
fn apply_meter(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    applied: &mut Applied,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&meter.store_id, meter.mode);
    let key = Key::scoped(keys::METER, store_id, mode)
        .text(&meter.id)
        .into_bytes();
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_meter(&b))
        .transpose()?;
    let name_key = |name: &str| {
        Key::scoped(keys::METER_NAME, store_id, mode)
            .text(name)
            .into_bytes()
    };
    if let Some(holder_id) = overlay.get(&name_key(&meter.name))? {
        if holder_id != meter.id.as_bytes() {
            let holder_id = String::from_utf8_lossy(&holder_id).into_owned();
            let holder = load_meter(overlay, store_id, mode, &holder_id)?;
            return Err(crate::meters::meter_name_taken(&meter.name, &holder).into());
        }
    }
    match &previous {
        None => {
            let existing =
                overlay.prefix_entries(&Key::scoped(keys::METER, store_id, mode).into_bytes())?;
            let mut same_event = 0;
            for value in existing.values() {
                if codec::decode_meter(value)?.event_name == meter.event_name {
                    same_event += 1;
                }
            }
            crate::meters::check_meter_limits(existing.len(), same_event)?;
            overlay.put(
                Key::scoped(keys::METER_LIST, store_id, mode)
                    .int(meter.created_at_ms)
                    .text(&meter.id)
                    .into_bytes(),
                Vec::new(),
            );
        }
        Some(old) if old.name != meter.name => overlay.delete(name_key(&old.name)),
        Some(_) => {}
    }
    overlay.put(name_key(&meter.name), meter.id.as_bytes().to_vec());
    overlay.put(key, codec::encode_meter(meter));
    applied.meters.push(meter.clone());
    Ok(())
}

fn load_meter(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    meter_id: &str,
) -> Result<Meter, EngineError> {
    let key = Key::scoped(keys::METER, store_id, mode)
        .text(meter_id)
        .into_bytes();
    match overlay.get(&key)? {
        Some(bytes) => codec::decode_meter(&bytes),
        // With one partition the meter record always precedes; in Kafka mode the
        // control partition may lag, and the chunk is retried (see engine::projector_loop).
        None => Err(EngineError::NotYetProjected),
    }
}

/// Folds one event into the meter's per-customer and all-customers minute buckets.
pub fn fold_event(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<(), EngineError> {
    let value = meter
        .aggregation_property
        .as_ref()
        .and_then(|p| event.properties.get(p));
    let minute = minute_bucket(event.timestamp_ms);
    let contribution = contribution(meter.aggregation, value);
    for customer in [event.customer_id.as_str(), ALL_CUSTOMERS] {
        let bucket = Key::scoped(keys::AGGREGATE, &meter.store_id, meter.mode)
            .text(&meter.id)
            .text(customer)
            .int(minute)
            .into_bytes();
        match &contribution {
            Contribution::Skipped => {}
            Contribution::Event { number } => overlay.aggregate_mut(bucket)?.add(*number),
            Contribution::Distinct(distinct) => {
                overlay.aggregate_mut(bucket)?.add(None);
                let unique = Key::scoped(keys::UNIQUE, &meter.store_id, meter.mode)
                    .text(&meter.id)
                    .text(customer)
                    .int(minute)
                    .tail(distinct.as_bytes())
                    .into_bytes();
                overlay.put(unique, Vec::new());
            }
        }
    }
    Ok(())
}

/// Folds one stored event into a meter being backfilled from `start_ms`, when it
/// is one the meter skipped (matched, timestamp in `[start_ms, counts_from)`) and
/// not folded by an earlier step (a marker per meter and event makes every step
/// safe to repeat).
fn backfill_event(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    start_ms: i64,
    event_id: &str,
) -> Result<(), EngineError> {
    let (store_id, mode) = (&meter.store_id, meter.mode);
    let Some(bytes) = overlay.get(
        &Key::scoped(keys::EVENT, store_id, mode)
            .tail(event_id.as_bytes())
            .into_bytes(),
    )?
    else {
        return Ok(());
    };
    let (_, event) = codec::decode_event(&bytes)?;
    let view = EventView {
        name: &event.name,
        timestamp_ms: event.timestamp_ms,
        properties: &event.properties,
    };
    let in_range = event.timestamp_ms >= start_ms && event.timestamp_ms < meter.counts_from_ms;
    if !in_range || !meter.matches(&view) {
        return Ok(());
    }
    let marker = Key::scoped(keys::BACKFILLED, store_id, mode)
        .text(&meter.id)
        .tail(event_id.as_bytes())
        .into_bytes();
    if overlay.contains(&marker)? {
        return Ok(());
    }
    overlay.put(marker, Vec::new());
    fold_event(overlay, meter, &event)
}

/// The finishing step's sweep: stored events received at or after `from_ms` (what
/// arrived while the service scanned), in receipt order. Bounded by what was
/// received during the backfill, not by the store's history.
fn backfill_rescan(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    start_ms: i64,
    from_ms: i64,
) -> Result<(), EngineError> {
    let prefix = Key::scoped(keys::EVENT_LIST, &meter.store_id, meter.mode).into_bytes();
    let from = Key::scoped(keys::EVENT_LIST, &meter.store_id, meter.mode)
        .int(from_ms)
        .into_bytes();
    let end = tally_projection::prefix_end(&prefix).unwrap_or_else(|| vec![0xff]);
    let mut ids = Vec::new();
    overlay.store.scan(
        std::ops::Bound::Included(&from),
        std::ops::Bound::Excluded(&end),
        false,
        &mut |_, value| {
            ids.push(String::from_utf8_lossy(value).into_owned());
            Visit::Continue
        },
    )?;
    // Events stored earlier in this same chunk are not in the store yet.
    for value in overlay
        .changes
        .range(from.clone()..end.clone())
        .filter_map(|(_, value)| value.as_ref())
    {
        ids.push(String::from_utf8_lossy(value).into_owned());
    }
    for id in ids {
        backfill_event(overlay, meter, start_ms, &id)?;
    }
    Ok(())
}

/// Applies the whole log of one partition into `store` (replay and tests).
pub async fn replay_partition(
    log: &dyn tally_log::Log,
    store: Arc<dyn ProjectionStore>,
    partition: u32,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, EngineError> {
    let end = log.end_offset(partition).await?;
    let from = store.position(partition)?;
    let mut records = 0u64;
    tally_log::read_range(
        log,
        partition,
        from,
        end,
        crate::APPLY_CHUNK_MAX_RECORDS,
        |entries| {
            records += entries.len() as u64;
            apply_chunk(store.as_ref(), entries)?;
            progress(entries.last().map_or(end, |e| e.next_offset), end);
            Ok::<(), EngineError>(())
        },
    )
    .await?;
    Ok(records)
}
