//! The projector: folds log records into the projection store.
//!
//! A chunk of entries is folded through an [`Overlay`] (so later records of the
//! chunk see earlier ones' writes) into one batch, committed atomically together with
//! the chunk's end position. Applying is a pure function of the records and the
//! projection: no clock, no randomness. Replaying the log into an empty store
//! therefore reproduces the projection byte for byte (`tally replay` checks this).
//!
//! Stored events live only in the log (event_index.rs). A chunk is applied in two
//! steps: [`plan_chunk`] names the records it will read (the originals its event ids'
//! fingerprints point at, the events a backfill folds), the caller fetches them from
//! the log, then [`apply_chunk`] applies it as a pure function of the records, the
//! projection and what was fetched. A record apply needs but was not given stops the
//! chunk with [`EngineError::RecordsNeeded`]; the caller fetches those and retries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tally_domain::aggregate::{contribution, Contribution};
use tally_domain::meter::{EventView, Meter};
use tally_domain::record::Record;
use tally_domain::time::minute_bucket;
use tally_domain::usage::UsageEvent;
use tally_domain::Mode;
use tally_log::LogEntry;
use tally_projection::{scan_prefix, ProjectionStore, Visit};

use crate::codec;
use crate::error::EngineError;
use crate::event_index::{
    self, EventIndex, EventLocation, PRUNE_STEP_MS, STORED_EVENTS_RETENTION_MS,
};
use crate::keys::{self, BucketKey, Key, ListingKey, StoredEventsKey, ALL_CUSTOMERS};
use crate::outcome::{outcome_key, Outcome};
use crate::overlay::DistinctAdd;
use crate::overlay::StoredRow;
pub use crate::overlay::{
    customer_cache_key, inflight_key, ApplyError, BucketCache, Fetched, Overlay, StoredBatch,
    MAX_CACHED_BUCKETS,
};

/// The layout of the projection this build writes. Version 2 keeps stored events in
/// the log only (the `F` rows and the event index), where version 1 kept a copy of
/// each in the projection; version 3 keeps a customer's distinct values per minute
/// in one set (`u`) instead of a key each; a projection of another version is refused at start-up
/// (it is rebuilt from the log by deleting it).
pub const PROJECTION_FORMAT_VERSION: u32 = 3;

/// Refuses a projection of another layout: one that holds applied records but no
/// (or another) format version.
pub fn check_projection_format(
    store: &dyn ProjectionStore,
    partitions: u32,
) -> Result<(), EngineError> {
    let stamp = store.get(&[keys::PROJECTION_FORMAT])?;
    let found = match stamp.as_deref() {
        Some(bytes) => Some(u32::from_be_bytes(bytes.try_into().map_err(|_| {
            EngineError::Corrupt("the projection format stamp is not 4 bytes".into())
        })?)),
        None => None,
    };
    let mut applied = false;
    for partition in 0..partitions {
        applied |= store.position(partition)? > 0;
    }
    match found {
        Some(PROJECTION_FORMAT_VERSION) => Ok(()),
        None if !applied => Ok(()),
        other => Err(EngineError::Corrupt(format!(
            "the projection has format version {} and this Tally writes version {PROJECTION_FORMAT_VERSION}; stop Tally, delete the projection directory (<data-dir>/projections; the log keeps everything) and start again: the projection is rebuilt from the log",
            other.map_or("1".to_string(), |v| v.to_string())
        ))),
    }
}

/// A chunk of log entries, each decoded once (planning and apply both read them).
pub struct DecodedChunk {
    pub entries: Vec<LogEntry>,
    records: Vec<Result<Record, Outcome>>,
}

impl DecodedChunk {
    pub fn new(entries: Vec<LogEntry>) -> DecodedChunk {
        let records = entries.iter().map(decode_entry).collect();
        DecodedChunk { entries, records }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn decode_entry(entry: &LogEntry) -> Result<Record, Outcome> {
    match tally_proto::decode_record(&entry.payload) {
        Err(error @ tally_proto::DecodeError::Version { .. }) => {
            // Start-up refuses a log of another format, so this is one foreign record
            // inside a log of ours (a node of another build sharing the topic, or
            // bytes that merely parse as a record): refused like any bad record, so
            // no record can stop the projector, and loudly, because mixing builds
            // on one log is unsupported (README, "Upgrading").
            tracing::error!(partition = entry.partition, offset = entry.offset, %error,
                "a log record of another format version is refused");
            Err(Outcome::rejected(
                "record_format_unsupported",
                error.to_string(),
            ))
        }
        Err(error) => Err(Outcome::rejected(
            "record_undecodable",
            format!("the log record does not decode: {error}"),
        )),
        Ok((record, _recorded_at_ms)) => Ok(record),
    }
}

/// What the projector keeps in memory between chunks: the bucket cache and the
/// event index (both only ever hold what was committed).
#[derive(Debug)]
pub struct ProjectorState {
    pub buckets: BucketCache,
    pub index: Arc<EventIndex>,
}

impl ProjectorState {
    /// The state over a projection: the index loaded from its `F` rows.
    pub fn load(
        store: &dyn ProjectionStore,
        index: Arc<EventIndex>,
    ) -> Result<ProjectorState, EngineError> {
        let mut failure = None;
        scan_prefix(store, &[keys::STORED_EVENTS], false, &mut |key, value| {
            match StoredEventsKey::decode(key)
                .and_then(|k| Ok((k, event_index::decode_stored(value)?)))
            {
                Ok((key, stored)) => {
                    index.add_record(key.partition, key.offset, &stored);
                    Visit::Continue
                }
                Err(error) => {
                    failure = Some(error);
                    Visit::Stop
                }
            }
        })?;
        if let Some(error) = failure {
            return Err(error);
        }
        Ok(ProjectorState {
            buckets: BucketCache::default(),
            index,
        })
    }

    /// A fresh state over an empty projection.
    pub fn empty() -> ProjectorState {
        ProjectorState {
            buckets: BucketCache::default(),
            index: Arc::new(EventIndex::default()),
        }
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

/// The records applying `chunk` will read: the committed events its event ids'
/// fingerprints point at, and what its backfill steps fold. Reads the projection
/// only; the caller fetches these from the log before [`apply_chunk`].
pub fn plan_chunk(
    store: &dyn ProjectionStore,
    index: &EventIndex,
    chunk: &DecodedChunk,
) -> Result<BTreeSet<(u32, u64)>, EngineError> {
    let mut wanted = BTreeSet::new();
    let locate = |wanted: &mut BTreeSet<(u32, u64)>, store_id: &str, mode: Mode, event_id: &str| {
        for location in index.candidates(index.fingerprint(store_id, mode, event_id)) {
            wanted.insert((location.partition, location.offset));
        }
    };
    for record in chunk.records.iter().flatten() {
        match record {
            Record::UsageBatch {
                store_id,
                mode,
                events,
            } => {
                for event in events {
                    locate(&mut wanted, store_id, *mode, &event.event_id);
                }
            }
            Record::MeterBackfill {
                store_id,
                mode,
                event_ids,
                finish,
                rescan_from_ms,
                ..
            } => {
                for event_id in event_ids {
                    locate(&mut wanted, store_id, *mode, event_id);
                }
                if *finish || event_ids.is_empty() {
                    let from = if *finish { *rescan_from_ms } else { i64::MIN };
                    for (key, _) in stored_rows_from(store, store_id, *mode, from)? {
                        wanted.insert((key.partition, key.offset));
                    }
                }
            }
            _ => {}
        }
    }
    // This chunk's own records are read from the chunk.
    for entry in &chunk.entries {
        wanted.remove(&(entry.partition, entry.offset));
    }
    Ok(wanted)
}

/// The `F` rows of a scope received at or after `from_ms`, in receipt order.
fn stored_rows_from(
    store: &dyn ProjectionStore,
    store_id: &str,
    mode: Mode,
    from_ms: i64,
) -> Result<Vec<StoredRow>, EngineError> {
    let prefix = StoredEventsKey::scope_prefix(store_id, mode);
    let from = Key::scoped(keys::STORED_EVENTS, store_id, mode)
        .int(from_ms)
        .into_bytes();
    let end = tally_projection::prefix_end(&prefix).unwrap_or_else(|| vec![0xff]);
    let mut rows = Vec::new();
    let mut failure = None;
    store.scan(
        std::ops::Bound::Included(&from),
        std::ops::Bound::Excluded(&end),
        false,
        &mut |key, value| match StoredEventsKey::decode(key)
            .and_then(|k| Ok((k, event_index::decode_stored(value)?)))
        {
            Ok(row) => {
                rows.push(row);
                Visit::Continue
            }
            Err(error) => {
                failure = Some(error);
                Visit::Stop
            }
        },
    )?;
    match failure {
        Some(error) => Err(error),
        None => Ok(rows),
    }
}

/// Folds `chunk` (in log order) and commits it with the chunk's end positions, then
/// brings `state` up to the commit. `fetched` holds the records [`plan_chunk`] named.
pub fn apply_chunk(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    chunk: &DecodedChunk,
    fetched: &Fetched,
) -> Result<Applied, EngineError> {
    let index = state.index.clone();
    let mut overlay = Overlay::new(store, &index, fetched);
    overlay.cache = Some(&state.buckets);
    for (entry, record) in chunk.entries.iter().zip(&chunk.records) {
        if let Ok(record @ Record::UsageBatch { .. }) = record {
            overlay
                .chunk
                .insert((entry.partition, entry.offset), record);
        }
    }
    let mut applied = Applied::default();
    let mut positions: BTreeMap<u32, u64> = BTreeMap::new();
    let stamp = vec![keys::PROJECTION_FORMAT];
    if overlay.get(&stamp)?.is_none() {
        overlay.put(stamp, PROJECTION_FORMAT_VERSION.to_be_bytes().to_vec());
        overlay.keep();
    }
    for (entry, record) in chunk.entries.iter().zip(&chunk.records) {
        if let Ok(Record::UsageBatch { events, .. }) = record {
            if let Some(received) = events.iter().map(|e| e.received_at_ms).min() {
                prune_stored_events(&mut overlay, received)?;
            }
        }
        apply_entry(&mut overlay, entry, record, &mut applied)?;
        positions.insert(entry.partition, entry.next_offset);
    }
    let positions: Vec<(u32, u64)> = positions.into_iter().collect();
    let committed = overlay.into_changes()?;
    store.apply(committed.changes, &positions)?;
    for (key, stored) in &committed.pruned {
        index.remove_record(key.partition, key.offset, stored);
    }
    for (key, stored) in &committed.stored {
        index.add_record(key.partition, key.offset, stored);
    }
    let cache = &mut state.buckets;
    if cache.buckets.len() + committed.buckets.len() > MAX_CACHED_BUCKETS {
        cache.buckets.clear();
    }
    cache.buckets.extend(committed.buckets);
    Ok(applied)
}

/// Plans, fetches through `read` and applies one chunk, synchronously (tests and
/// tools that hold their records in memory).
pub fn apply_chunk_reading(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    entries: &[LogEntry],
    mut read: impl FnMut(u32, u64) -> Result<Option<Vec<u8>>, EngineError>,
) -> Result<Applied, EngineError> {
    let chunk = DecodedChunk::new(entries.to_vec());
    let mut fetched = Fetched::new();
    let mut wanted: Vec<(u32, u64)> = plan_chunk(store, &state.index, &chunk)?
        .into_iter()
        .collect();
    loop {
        for (partition, offset) in wanted.drain(..) {
            let batch = match read(partition, offset)? {
                Some(payload) => StoredBatch::decode(&payload)?.map(Arc::new),
                None => None,
            };
            fetched.insert((partition, offset), batch);
        }
        match apply_chunk(store, state, &chunk, &fetched) {
            Err(EngineError::RecordsNeeded(more)) => wanted = more,
            other => return other,
        }
    }
}

/// `apply_chunk_reading` over a log held in memory (`log` holds every entry the
/// chunk may point back at): property tests and fuzzing.
pub fn apply_chunk_in_memory(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    entries: &[LogEntry],
    log: &[LogEntry],
) -> Result<Applied, EngineError> {
    apply_chunk_reading(store, state, entries, |partition, offset| {
        Ok(log
            .iter()
            .find(|e| e.partition == partition && e.offset == offset)
            .map(|e| e.payload.clone()))
    })
}

/// Deletes the `F` rows received before the retention cut of `received_ms` (whole
/// hours; the cut reached is stored, so live, restarted and replayed projections
/// prune at the same records). Runs between records, never rolled back.
fn prune_stored_events(overlay: &mut Overlay<'_>, received_ms: i64) -> Result<(), EngineError> {
    let cut = received_ms
        .saturating_sub(STORED_EVENTS_RETENTION_MS)
        .div_euclid(PRUNE_STEP_MS)
        .saturating_mul(PRUNE_STEP_MS);
    let mark = Key::table(keys::STORED_EVENTS_PRUNED).into_bytes();
    let done = match overlay.get(&mark)? {
        Some(bytes) if bytes.len() == 8 => keys::read_int(&bytes),
        Some(_) => {
            return Err(EngineError::Corrupt(
                "the pruning mark is not 8 bytes".into(),
            ))
        }
        None => i64::MIN,
    };
    if cut <= done {
        return Ok(());
    }
    let mut old = Vec::new();
    // Holds only the rows it prunes (an undecodable key is kept, then refused below).
    let is_old =
        |key: &[u8]| StoredEventsKey::decode(key).map_or(true, |key| key.received_at_ms < cut);
    for (key, value) in overlay.prefix_entries_where(&[keys::STORED_EVENTS], is_old)? {
        let key = StoredEventsKey::decode(&key)?;
        old.push((key, event_index::decode_stored(&value)?));
    }
    for (key, stored) in old {
        overlay.delete(key.encode());
        overlay.pruned.push((key, stored));
    }
    overlay.put(mark, Key::table(0).int(cut).into_bytes()[1..].to_vec());
    overlay.keep();
    Ok(())
}

/// Applies one log entry, or records why not. Only storage failures (and the
/// cross-partition wait) leave as errors: bad data never stops the projector, and
/// neither does a panic in apply (a bug, logged loudly, that the apply fuzz test
/// exists to catch), which is refused like bad data.
fn apply_entry<'a>(
    overlay: &mut Overlay<'a>,
    entry: &LogEntry,
    record: &'a Result<Record, Outcome>,
    applied: &mut Applied,
) -> Result<(), EngineError> {
    let refused = match record {
        Err(outcome) => outcome.clone(),
        Ok(record) => {
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
                apply_record(overlay, record, entry, &mut effects)
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
            let mut stored = Vec::new();
            for (index, event) in events.iter().enumerate() {
                // Exact dedup: the first record carrying an id wins, whatever came later
                // (an earlier event of this same record included).
                let key = inflight_key(store_id, *mode, &event.event_id);
                let print = overlay.index.fingerprint(store_id, *mode, &event.event_id);
                if overlay
                    .find_stored(&key, print, store_id, *mode, &event.event_id)?
                    .is_some()
                {
                    continue;
                }
                let location = EventLocation {
                    partition: entry.partition,
                    offset: entry.offset,
                    index: index as u32,
                };
                overlay.note_stored(key, location);
                stored.push((index as u32, print));
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
            if !stored.is_empty() {
                let key = StoredEventsKey {
                    store_id: store_id.clone(),
                    mode: *mode,
                    received_at_ms: events.iter().map(|e| e.received_at_ms).min().unwrap_or(0),
                    partition: entry.partition,
                    offset: entry.offset,
                };
                overlay.put(key.encode(), event_index::encode_stored(&stored));
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
                    backfill_event_id(overlay, &meter, *start_ms, event_id)?;
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
            ListingKey {
                table: keys::CUSTOMER_LIST,
                store_id: store_id.clone(),
                mode,
                owner: None,
                created_at_ms: customer.created_at_ms,
                id: customer.id.clone(),
            }
            .encode(),
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
                ListingKey {
                    table: keys::METER_LIST,
                    store_id: store_id.clone(),
                    mode,
                    owner: None,
                    created_at_ms: meter.created_at_ms,
                    id: meter.id.clone(),
                }
                .encode(),
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
        // Built from borrowed parts (no owned `BucketKey`): this runs per event, per
        // matched meter, twice.
        let (store_id, mode, meter_id) = (&meter.store_id, meter.mode, &meter.id);
        let bucket =
            || BucketKey::from_minute(keys::AGGREGATE, store_id, mode, meter_id, customer, minute);
        match &contribution {
            Contribution::Skipped => {}
            Contribution::Event { number } => overlay.aggregate_mut(bucket())?.add(*number),
            Contribution::Distinct(distinct) => {
                overlay.aggregate_mut(bucket())?.add(None);
                // A customer's minute keeps its values in one set; the meter-wide bucket
                // (values of every customer) and a full set keep one key per value.
                let inline = if customer == ALL_CUSTOMERS {
                    DistinctAdd::Full
                } else {
                    let set = BucketKey::from_minute(
                        keys::DISTINCT_SET,
                        store_id,
                        mode,
                        meter_id,
                        customer,
                        minute,
                    );
                    overlay.add_distinct(set, distinct.as_bytes())?
                };
                if inline == DistinctAdd::Full {
                    let value =
                        BucketKey::distinct(store_id, mode, meter_id, customer, minute, distinct);
                    overlay.put(value, Vec::new());
                }
            }
        }
    }
    Ok(())
}

/// Folds the stored event `event_id` into a meter being backfilled from `start_ms`
/// (see [`backfill_event`]); an id the scope never stored is skipped.
fn backfill_event_id(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    start_ms: i64,
    event_id: &str,
) -> Result<(), EngineError> {
    match overlay.stored_event(&meter.store_id, meter.mode, event_id)? {
        Some(event) => backfill_event(overlay, meter, start_ms, &event),
        None => Ok(()),
    }
}

/// Folds one stored event into a meter being backfilled from `start_ms`, when it
/// is one the meter skipped (matched, timestamp in `[start_ms, counts_from)`) and
/// not folded by an earlier step (a marker per meter and event makes every step
/// safe to repeat).
fn backfill_event(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    start_ms: i64,
    event: &UsageEvent,
) -> Result<(), EngineError> {
    let view = EventView {
        name: &event.name,
        timestamp_ms: event.timestamp_ms,
        properties: &event.properties,
    };
    let in_range = event.timestamp_ms >= start_ms && event.timestamp_ms < meter.counts_from_ms;
    if !in_range || !meter.matches(&view) {
        return Ok(());
    }
    let marker = Key::scoped(keys::BACKFILLED, &meter.store_id, meter.mode)
        .text(&meter.id)
        .tail(event.event_id.as_bytes())
        .into_bytes();
    if overlay.contains(&marker)? {
        return Ok(());
    }
    overlay.put(marker, Vec::new());
    fold_event(overlay, meter, event)
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
    let prefix = StoredEventsKey::scope_prefix(&meter.store_id, meter.mode);
    let from = Key::scoped(keys::STORED_EVENTS, &meter.store_id, meter.mode)
        .int(from_ms)
        .into_bytes();
    // Rows stored earlier in this same chunk are in the overlay, not the store yet.
    let mut rows = Vec::new();
    for (key, value) in overlay.prefix_entries(&prefix)? {
        if key >= from {
            rows.push((
                StoredEventsKey::decode(&key)?,
                event_index::decode_stored(&value)?,
            ));
        }
    }
    let mut events = Vec::new();
    let mut missing = Vec::new();
    for (key, stored) in rows {
        match overlay.batch_at(key.partition, key.offset) {
            Ok(batch) => events.extend(
                stored
                    .iter()
                    .filter_map(|(index, _)| batch.events.get(*index as usize).cloned()),
            ),
            Err(EngineError::RecordsNeeded(more)) => missing.extend(more),
            Err(error) => return Err(error),
        }
    }
    if !missing.is_empty() {
        return Err(EngineError::RecordsNeeded(missing));
    }
    for event in &events {
        backfill_event(overlay, meter, start_ms, event)?;
    }
    Ok(())
}

/// The projection over one store, as the runtime drives it (tally-runtime): decode,
/// plan, fetch and apply; the engine adds its caches in `after_commit`, a replay
/// needs nothing more.
pub struct StoreProjection {
    store: Arc<dyn ProjectionStore>,
    state: std::sync::Mutex<ProjectorState>,
}

impl std::fmt::Debug for StoreProjection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreProjection").finish()
    }
}

impl StoreProjection {
    /// The projection over `store`, its event index loaded into `index`.
    pub fn load(
        store: Arc<dyn ProjectionStore>,
        index: Arc<EventIndex>,
    ) -> Result<StoreProjection, EngineError> {
        let state = ProjectorState::load(store.as_ref(), index)?;
        Ok(StoreProjection {
            store,
            state: std::sync::Mutex::new(state),
        })
    }
}

impl tally_runtime::Projection for StoreProjection {
    type Chunk = DecodedChunk;
    type Fetched = Fetched;
    type Applied = Applied;

    fn decode(&self, entries: Vec<LogEntry>) -> DecodedChunk {
        DecodedChunk::new(entries)
    }

    fn plan(&self, chunk: &DecodedChunk) -> Result<Vec<(u32, u64)>, String> {
        let index = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .index
            .clone();
        plan_chunk(self.store.as_ref(), &index, chunk)
            .map(|wanted| wanted.into_iter().collect())
            .map_err(|error| error.to_string())
    }

    fn add_fetched(
        &self,
        fetched: &mut Fetched,
        partition: u32,
        offset: u64,
        entry: Option<LogEntry>,
    ) -> Result<(), String> {
        let batch = match entry {
            Some(entry) => StoredBatch::decode(&entry.payload)
                .map_err(|error| error.to_string())?
                .map(Arc::new),
            None => None,
        };
        fetched.insert((partition, offset), batch);
        Ok(())
    }

    fn apply(
        &self,
        chunk: &DecodedChunk,
        fetched: &Fetched,
    ) -> Result<Applied, tally_runtime::ApplyFailure> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        apply_chunk(self.store.as_ref(), &mut state, chunk, fetched).map_err(|error| match error {
            EngineError::RecordsNeeded(more) => tally_runtime::ApplyFailure::NeedRecords(more),
            EngineError::NotYetProjected => tally_runtime::ApplyFailure::NotYet,
            other => tally_runtime::ApplyFailure::Fatal(other.to_string()),
        })
    }

    fn after_commit(&self, _: Applied, _: tally_runtime::Committed) {}
}

/// Applies the whole log of one partition into `store` (replay and tests), from
/// the position the store holds, through the runtime's replay.
pub async fn replay_partition(
    log: &dyn tally_log::Log,
    store: Arc<dyn ProjectionStore>,
    partition: u32,
    progress: impl FnMut(u64, u64),
) -> Result<u64, EngineError> {
    let projection = StoreProjection::load(store.clone(), Arc::new(EventIndex::default()))?;
    tally_runtime::replay_partition(log, store.as_ref(), &projection, partition, progress)
        .await
        .map_err(EngineError::from)
}
