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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tally_core::error::EngineError;
use tally_core::event_index::{self, EventIndex};
use tally_core::idempotency;
use tally_core::keys::{self, StoredEventsKey};
use tally_core::outcome::{outcome_key, Outcome};
pub use tally_core::overlay::{
    customer_cache_key, inflight_key, ApplyError, BucketCache, Fetched, Overlay, StoredBatch,
    MAX_CACHED_BUCKETS,
};
use tally_core::sparse_keys::SparseKeys;
use tally_directory::DirectoryApplied;
use tally_domain::record::{RechargeOutcome, Record, RecordMeta};
use tally_log::changelog::{Changelog, PartitionSnapshot};
use tally_log::LogEntry;
use tally_metering::apply::BackfillStep;
use tally_metering::recent::RecentRecords;
use tally_metering::MeteringApplied;
use tally_projection::{scan_prefix, ProjectionStore, Visit};
use tally_runtime::ChunkMode;

/// The layout of the projection this build writes. Version 2 keeps stored events in
/// the log only (the `F` rows and the event index), where version 1 kept a copy of
/// each in the projection; version 3 keeps a customer's distinct values per minute
/// in one set (`u`) instead of a key each; version 5 adds usage settlement (tables
/// `1`-`7`: a purchase applied by version 4 bound no usage) and the checkout listing
/// (`8`); version 6 adds credit grants (tables `{`, `}`, `~`, `^`: every credit
/// unit belongs to a grant); version 7 adds where each event of a minute is (`z`,
/// which voids rebuild buckets from: an older projection lacks its events); version
/// 8 adds where each meter was created or changed (`0x01`, which usage records
/// matched by a gateway that had not applied it yet read: an older projection
/// lacks the rows, and a replay would not reproduce it); version 9 drops a credit
/// entry's id row (`j`), balance history (`h`) and the entry count's row (`q`): an
/// entry id names its transaction, whose row (`T`) says where the entry is listed,
/// a balance `at` an instant bisects the entry list (`L`), and the count lives in
/// the account's balance row (`b`); a projection of another version is
/// refused at start-up (it is rebuilt from the log by deleting it).
pub const PROJECTION_FORMAT_VERSION: u32 = 9;

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

/// A chunk of log entries, each decoded once (planning and apply both read them),
/// and how it is to be applied.
pub struct DecodedChunk {
    pub entries: Vec<LogEntry>,
    records: Vec<Result<(Record, RecordMeta), Outcome>>,
    mode: ChunkMode,
}

impl DecodedChunk {
    /// A chunk applied in full.
    pub fn new(entries: Vec<LogEntry>) -> DecodedChunk {
        DecodedChunk::with_mode(entries, ChunkMode::Full)
    }

    /// The per-customer buckets the chunk's usage records fold into
    /// (`tally_metering::apply::bucket_keys_of`), for reading ahead.
    pub fn bucket_keys<'a>(
        &'a self,
        keeps_sets: &'a dyn Fn(&str, tally_domain::Mode, &str) -> bool,
    ) -> impl Iterator<Item = Vec<u8>> + 'a {
        self.records.iter().flat_map(move |record| {
            let batch = match record {
                Ok((
                    Record::UsageBatch {
                        store_id,
                        mode,
                        events,
                        ..
                    },
                    _,
                )) => {
                    let mode = *mode;
                    let keeps = move |meter_id: &str| keeps_sets(store_id, mode, meter_id);
                    Some(tally_metering::apply::bucket_keys_of(
                        store_id, mode, events, keeps,
                    ))
                }
                _ => None,
            };
            batch.into_iter().flatten()
        })
    }

    pub fn with_mode(entries: Vec<LogEntry>, mode: ChunkMode) -> DecodedChunk {
        DecodedChunk::handed_off(entries, mode, Vec::new())
    }

    /// Like `with_mode`, taking the records handed over for some entries (one
    /// option per entry, in order; missing ones are decoded) instead of decoding
    /// those.
    pub fn handed_off(
        entries: Vec<LogEntry>,
        mode: ChunkMode,
        handed_off: Vec<Option<(Record, RecordMeta)>>,
    ) -> DecodedChunk {
        let mut handed_off = handed_off.into_iter();
        let records = entries
            .iter()
            .map(|entry| match handed_off.next().flatten() {
                Some(record) => Ok(record),
                None => decode_entry(entry),
            })
            .collect();
        DecodedChunk {
            entries,
            records,
            mode,
        }
    }

    /// Whether `mode` applies the entry at `index` (see `ChunkMode`): a record that
    /// does not decode is nobody's to share, so it goes with the owner's records.
    fn applies(&self, index: usize) -> bool {
        let shared =
            matches!(&self.records[index], Ok((record, _)) if record.applies_on_every_node());
        match self.mode {
            ChunkMode::Full => true,
            ChunkMode::Shared => shared,
            ChunkMode::Restore { .. } => !shared,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn decode_entry(entry: &LogEntry) -> Result<(Record, RecordMeta), Outcome> {
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
        Ok(decoded) => Ok(decoded),
    }
}

/// What the projector keeps in memory between chunks: the bucket cache, the
/// event index and the sparse rows (all only ever hold what was committed).
#[derive(Debug)]
pub struct ProjectorState {
    pub buckets: BucketCache,
    pub index: Arc<EventIndex>,
    pub sparse: SparseKeys,
}

impl ProjectorState {
    /// The state over a projection: the index loaded from its `F` rows.
    pub fn load(
        store: &dyn ProjectionStore,
        index: Arc<EventIndex>,
    ) -> Result<ProjectorState, EngineError> {
        // Sized once from the last noted size: growing a table of millions of
        // events by doubling it while loading was most of a restart's start-up.
        // It is only a hint (aux, outside the projection): one of another length
        // is ignored and rewritten below.
        let hint = store
            .aux_get(keys::EVENT_INDEX_SIZE_HINT)?
            .and_then(|bytes| <[u8; 8]>::try_from(bytes.as_slice()).ok())
            .map_or(0, u64::from_be_bytes);
        index.reserve(hint);
        index.note_hinted(hint);
        let started = std::time::Instant::now();
        let mut failure = None;
        scan_prefix(store, &[keys::STORED_EVENTS], false, &mut |key, value| {
            match StoredEventsKey::decode(key)
                .and_then(|k| Ok((k, event_index::decode_stored(value)?)))
            {
                Ok((key, stored)) => {
                    index.load_record(key.partition, key.offset, &stored);
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
        index.finish_loading();
        tracing::info!(
            events = index.len(),
            hint,
            ms = started.elapsed().as_millis() as u64,
            "loaded the event index"
        );
        note_index_size(store, &index);
        let sparse = SparseKeys::load(store)?;
        for (table, rows, saturated) in sparse.known() {
            tracing::info!(%table, rows, saturated, "loaded a sparse table's row set");
        }
        Ok(ProjectorState {
            buckets: BucketCache::over(store)?,
            index,
            sparse,
        })
    }

    /// A fresh state over an empty projection (only: it takes the store to hold no
    /// bucket, see `BucketCache::complete`; `load` checks).
    pub fn empty() -> ProjectorState {
        ProjectorState {
            buckets: BucketCache::for_empty_store(),
            index: Arc::new(EventIndex::default()),
            sparse: SparseKeys::default(),
        }
    }
}

/// What a committed chunk changed, for each context's caches.
#[derive(Debug, Default)]
pub struct Applied {
    pub directory: DirectoryApplied,
    pub metering: MeteringApplied,
    pub billing: BillingApplied,
}

/// What a committed chunk changed in billing.
#[derive(Debug, Default)]
pub struct BillingApplied {
    /// A usage record left a settlement pending: the settler has work.
    pub settlements_pending: bool,
    /// Test clocks set: (store, `to_ms`, record time).
    pub test_clocks: Vec<(String, i64, i64)>,
}

impl Applied {
    fn absorb(&mut self, other: Applied) {
        self.directory.absorb(other.directory);
        self.metering.absorb(other.metering);
        self.billing.settlements_pending |= other.billing.settlements_pending;
        self.billing.test_clocks.extend(other.billing.test_clocks);
    }
}

/// The records applying `chunk` will read: the committed events its event ids'
/// fingerprints point at, what its backfill steps fold, and what the gateway of a
/// void hinted its rebuilds read (`hints`: recent.rs of metering). Reads the
/// projection only; the caller fetches these from the log before [`apply_chunk`].
pub fn plan_chunk(
    store: &dyn ProjectionStore,
    index: &EventIndex,
    chunk: &DecodedChunk,
    hints: Option<&RecentRecords>,
) -> Result<BTreeSet<(u32, u64)>, EngineError> {
    let mut wanted = BTreeSet::new();
    for (at, record) in chunk.records.iter().enumerate() {
        if let (true, Ok((record, _))) = (chunk.applies(at), record) {
            tally_metering::apply::plan_record(store, index, record, &mut wanted)?;
            if let Some(hints) = hints {
                wanted.extend(tally_metering::voids::hinted_records(hints, record));
            }
        }
    }
    // This chunk's own records are read from the chunk.
    for entry in &chunk.entries {
        wanted.remove(&(entry.partition, entry.offset));
    }
    Ok(wanted)
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
    overlay.cache = Some(&mut state.buckets);
    overlay.sparse = Some(&state.sparse);
    for (at, (entry, record)) in chunk.entries.iter().zip(&chunk.records).enumerate() {
        if let (true, Ok((record, _))) = (chunk.applies(at), record) {
            if record.stored_events().is_none() {
                continue;
            }
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
    // Partitions of the chunk known to hold a skip mark (each looked up once).
    let mut marked = BTreeSet::new();
    // Records the chunk's records lack, every one's: the attempt is then dropped.
    let mut missing = Vec::new();
    for (at, (entry, record)) in chunk.entries.iter().zip(&chunk.records).enumerate() {
        if !matches!(chunk.mode, ChunkMode::Restore { .. }) {
            positions.insert(entry.partition, entry.next_offset);
        }
        if !chunk.applies(at) {
            // Another node's record: remember where skipping began (the restore
            // starts there when this node gains the partition).
            if marked.insert(entry.partition) {
                let mark = keys::partition_skipped_key(entry.partition);
                if overlay.get(&mark)?.is_none() {
                    overlay.put(mark, entry.offset.to_be_bytes().to_vec());
                    overlay.keep();
                }
            }
            continue;
        }
        if let Some((_, _, events)) = record.as_ref().ok().and_then(|(r, _)| r.stored_events()) {
            if let Some(received) = events.iter().map(|e| e.received_at_ms).min() {
                tally_metering::apply::prune_stored_events(&mut overlay, received)?;
            }
        }
        match apply_entry(&mut overlay, entry, record, &mut applied) {
            // The record is rolled back; the records after it still say what they
            // lack, so one fetch serves the whole chunk's next attempt instead of
            // one attempt per record that reads back (a chunk of several voids).
            // What they do meanwhile is dropped with the attempt.
            Err(EngineError::RecordsNeeded(more)) => missing.extend(more),
            other => other?,
        }
    }
    if !missing.is_empty() {
        missing.sort_unstable();
        missing.dedup();
        return Err(EngineError::RecordsNeeded(missing));
    }
    if let ChunkMode::Restore { partition, until } = chunk.mode {
        // The skip mark moves with what is restored, in the same commit: a crash
        // mid-restore resumes where the last restored chunk ended.
        let mark = keys::partition_skipped_key(partition);
        let end = chunk.entries.last().map_or(until, |e| e.next_offset);
        if end >= until {
            overlay.delete(mark);
        } else {
            overlay.put(mark, end.to_be_bytes().to_vec());
        }
        overlay.keep();
    }
    let positions: Vec<(u32, u64)> = positions.into_iter().collect();
    let mut committed = overlay.into_changes()?;
    let sparse_puts = state.sparse.puts_in(&committed.changes);
    store.apply_shared(std::mem::take(&mut committed.changes), &positions)?;
    state.sparse.note_committed(sparse_puts);
    for (key, stored) in &committed.pruned {
        index.remove_record(key.partition, key.offset, stored);
    }
    for (key, stored) in &committed.stored {
        index.add_record(key.partition, key.offset, stored);
    }
    note_index_size(store, &index);
    state.buckets.absorb(&mut committed);
    Ok(applied)
}

/// Stores the event index's size as the next start-up's hint when it has moved
/// (`EventIndex::size_hint_due`). Only a hint: a failed write is logged, never
/// fails the chunk (which is committed already when this runs).
fn note_index_size(store: &dyn ProjectionStore, index: &EventIndex) {
    if let Some(events) = index.size_hint_due() {
        if let Err(error) = store.aux_put(keys::EVENT_INDEX_SIZE_HINT, Some(&events.to_be_bytes()))
        {
            tracing::warn!(%error, "could not note the event index's size for the next start");
        }
    }
}

/// Plans, fetches through `read` and applies one chunk, synchronously (tests and
/// tools that hold their records in memory).
pub fn apply_chunk_reading(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    entries: &[LogEntry],
    read: impl FnMut(u32, u64) -> Result<Option<Vec<u8>>, EngineError>,
) -> Result<Applied, EngineError> {
    apply_chunk_reading_as(store, state, entries, ChunkMode::Full, read)
}

/// `apply_chunk_reading` with the chunk applied as `mode` says.
pub fn apply_chunk_reading_as(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    entries: &[LogEntry],
    mode: ChunkMode,
    mut read: impl FnMut(u32, u64) -> Result<Option<Vec<u8>>, EngineError>,
) -> Result<Applied, EngineError> {
    let chunk = DecodedChunk::with_mode(entries.to_vec(), mode);
    let mut fetched = Fetched::new();
    let mut wanted: Vec<(u32, u64)> = plan_chunk(store, &state.index, &chunk, None)?
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
    apply_chunk_in_memory_as(store, state, entries, ChunkMode::Full, log)
}

/// `apply_chunk_in_memory` with the chunk applied as `mode` says.
pub fn apply_chunk_in_memory_as(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    entries: &[LogEntry],
    mode: ChunkMode,
    log: &[LogEntry],
) -> Result<Applied, EngineError> {
    apply_chunk_reading_as(store, state, entries, mode, |partition, offset| {
        Ok(log
            .iter()
            .find(|e| e.partition == partition && e.offset == offset)
            .map(|e| e.payload.clone()))
    })
}

/// Applies one log entry, or records why not. Only storage failures (and the
/// cross-partition wait) leave as errors: bad data never stops the projector, and
/// neither does a panic in apply (a bug, logged loudly, that the apply fuzz test
/// exists to catch), which is refused like bad data.
fn apply_entry<'a>(
    overlay: &mut Overlay<'a>,
    entry: &LogEntry,
    record: &'a Result<(Record, RecordMeta), Outcome>,
    applied: &mut Applied,
) -> Result<(), EngineError> {
    let refused = match record {
        Err(outcome) => outcome.clone(),
        Ok((record, meta)) => {
            if let Some((store_id, mode, events)) = record.stored_events() {
                // Reservations end with the record, applied or refused.
                applied.metering.event_keys.extend(
                    events
                        .iter()
                        .map(|event| inflight_key(store_id, mode, &event.event_id)),
                );
            }
            let mut effects = Applied::default();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                apply_keyed(overlay, record, meta, entry, &mut effects)
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

/// Applies a record under its request's idempotency key, if it carries one: the
/// key is claimed for the record, or the record is refused as a repeat
/// (ARCHITECTURE.md "Idempotency keys").
fn apply_keyed(
    overlay: &mut Overlay<'_>,
    record: &Record,
    meta: &RecordMeta,
    entry: &LogEntry,
    applied: &mut Applied,
) -> Result<(), ApplyError> {
    // What every node applies (stores, API keys) is applied apart from its store's
    // other records on a node that does not own the store (ARCHITECTURE.md,
    // "Partitions and ownership"), so it takes no part in their idempotency keys:
    // the admin API that writes it sends none, and one in its envelope is ignored.
    let request = meta
        .request
        .as_ref()
        .filter(|_| !record.applies_on_every_node());
    if let Some(request) = request {
        idempotency::check(overlay, request, meta.recorded_at_ms)?;
    }
    apply_record(overlay, record, meta, entry, applied)?;
    if let Some(request) = request {
        idempotency::claim(overlay, request, meta.recorded_at_ms)?;
    }
    Ok(())
}

fn apply_record(
    overlay: &mut Overlay<'_>,
    record: &Record,
    meta: &RecordMeta,
    entry: &LogEntry,
    applied: &mut Applied,
) -> Result<(), ApplyError> {
    let base = meta.base_updated_at_ms;
    match record {
        Record::StoreCreated(store) => {
            tally_directory::apply::apply_store(overlay, store, &mut applied.directory)?
        }
        Record::CustomerUpserted(customer) => {
            tally_directory::apply::apply_customer(overlay, customer, base, &mut applied.directory)?
        }
        Record::MeterUpserted(meter) => tally_metering::apply::apply_meter(
            overlay,
            meter,
            base,
            (entry.partition, entry.offset),
            &mut applied.metering,
        )?,
        Record::ProductUpserted(product) => {
            tally_billing::apply::apply_product(overlay, product, base)?
        }
        Record::DiscountUpserted(discount) => {
            tally_billing::apply::apply_discount(overlay, discount, base)?
        }
        Record::CheckoutCreated(checkout) => {
            tally_billing::apply::apply_checkout_created(overlay, checkout)?
        }
        Record::CheckoutCompleted(completion) => {
            let (events, grants) = tally_billing::apply::apply_checkout_completed(
                overlay,
                completion,
                meta.recorded_at_ms,
                &tally_directory::apply::stored_customer,
            )?;
            schedule_billing_events(overlay, &events, entry.offset)?;
            let checkout = &completion.checkout;
            book_purchase_grants(
                overlay,
                (&checkout.store_id, checkout.mode),
                &grants,
                meta.recorded_at_ms,
                entry,
            )?;
        }
        Record::RefundCreated(refund) => {
            let events = tally_billing::apply::apply_refund(overlay, refund)?;
            schedule_billing_events(overlay, &events, entry.offset)?;
        }
        Record::DisputeOpened(dispute) => {
            let events = tally_billing::apply::apply_dispute(overlay, dispute)?;
            schedule_billing_events(overlay, &events, entry.offset)?;
        }
        Record::TaxRateSet {
            store_id,
            mode,
            country,
            rate_percent,
        } => tally_billing::apply::apply_tax_rate(overlay, store_id, *mode, country, *rate_percent),
        Record::UsageBatch {
            store_id,
            mode,
            events,
            settles,
            matched_below,
        } => {
            // Usage settled in credits: metering says what each new event added to
            // each meter, billing leaves it for settlement. Only records the
            // gateway marked pay for the accounting, or, when that gateway had not
            // applied everything before the record, those a purchase binds now (one
            // completed through another node moments before binds them too).
            let behind = matched_below.is_some_and(|below| below < entry.offset);
            let settles = *settles
                || (behind
                    && tally_billing::settlement::is_bound_by(
                        |key| overlay.get(key),
                        store_id,
                        *mode,
                        events,
                    )?);
            let mut counted = Vec::new();
            tally_metering::apply::apply_usage_batch(
                overlay,
                store_id,
                *mode,
                events,
                (entry.partition, entry.offset),
                *matched_below,
                settles.then_some(&mut counted),
            )?;
            let mut left = false;
            if !counted.is_empty() {
                let units = counted.iter().filter_map(|c| {
                    let event = events.get(c.event as usize)?;
                    Some(tally_billing::settlement::NewUnits {
                        customer_id: &event.customer_id,
                        meter_id: &c.meter_id,
                        timestamp_ms: event.timestamp_ms,
                        quantity: c.quantity,
                    })
                });
                left = tally_billing::settlement::leave_units(
                    overlay,
                    store_id,
                    *mode,
                    units,
                    entry.partition,
                    entry.offset,
                )?;
                applied.billing.settlements_pending |= left;
            }
            if settles && !left {
                tally_billing::settlement::settled_nothing(overlay, entry.partition, entry.offset)?;
            }
        }
        Record::SubscriptionChanged {
            subscription,
            payment,
        } => {
            let (events, grants) = tally_billing::lifecycle::apply_subscription_changed(
                overlay,
                subscription,
                payment.as_ref(),
                base,
                &tally_directory::apply::stored_customer,
            )?;
            schedule_billing_events(overlay, &events, entry.offset)?;
            book_purchase_grants(
                overlay,
                (&subscription.store_id, subscription.mode),
                &grants,
                meta.recorded_at_ms,
                entry,
            )?;
        }
        Record::AffiliateInviteCreated(invite) => {
            tally_billing::affiliates::apply_invite_created(overlay, invite)?
        }
        Record::AffiliateJoined {
            invite_id,
            affiliate,
        } => tally_billing::affiliates::apply_affiliate_joined(overlay, invite_id, affiliate)?,
        Record::AffiliateUpserted(affiliate) => {
            tally_billing::affiliates::apply_affiliate_upserted(overlay, affiliate, base)?
        }
        Record::AffiliateClicked {
            store_id,
            mode,
            referral_code,
        } => tally_billing::affiliates::apply_click(overlay, store_id, *mode, referral_code)?,
        Record::ApiKeyCreated {
            store_id,
            key_id,
            mode,
            key_sha256,
            permissions,
            ..
        } => tally_directory::access::apply_key_created(
            overlay,
            store_id,
            key_id,
            *mode,
            key_sha256,
            permissions,
            &mut applied.directory,
        )?,
        Record::ApiKeyRevoked { store_id, key_id } => tally_directory::access::apply_key_revoked(
            overlay,
            store_id,
            key_id,
            &mut applied.directory,
        )?,
        Record::ModerationPolicySet {
            store_id,
            mode,
            policy,
        } => tally_directory::moderation::apply_policy(overlay, store_id, *mode, policy),
        Record::StoreSettingsSet {
            store_id,
            mode,
            settings,
        } => tally_billing::lifecycle::apply_store_settings(overlay, store_id, *mode, settings),
        Record::TestClockSet { store_id, to_ms } => {
            tally_billing::lifecycle::apply_test_clock(
                overlay,
                store_id,
                *to_ms,
                meta.recorded_at_ms,
            )?;
            applied
                .billing
                .test_clocks
                .push((store_id.to_string(), *to_ms, meta.recorded_at_ms));
        }
        Record::UsageSettled(settlement) => {
            apply_settlement(overlay, settlement, meta.recorded_at_ms, entry)?
        }
        Record::MeterBackfill {
            store_id,
            mode,
            meter_id,
            start_ms,
            event_ids,
            finish,
            rescan_from_ms,
        } => tally_metering::apply::apply_backfill(
            overlay,
            BackfillStep {
                store_id,
                mode: *mode,
                meter_id,
                start_ms: *start_ms,
                event_ids,
                finish: *finish,
                rescan_from_ms: *rescan_from_ms,
            },
            &mut applied.metering,
        )?,
        Record::CreditLedger {
            account,
            transaction,
            events,
        } => {
            // The ledger decides; the events it emits leave as data, and the
            // notifications context schedules their deliveries.
            let events = tally_ledger::apply_ledger_step(
                overlay,
                account.as_ref(),
                transaction.as_ref(),
                events,
                base,
                meta.recorded_at_ms,
            )?;
            schedule_ledger_events(overlay, &events, entry)?;
        }
        Record::EventsVoided {
            store_id,
            mode,
            event_ids,
            reason,
        } => {
            // Most scopes never settle in credits: one read, and nothing collected.
            let settles = tally_billing::settlement::scope_settles(overlay, store_id, *mode)?;
            let mut uncounted = Vec::new();
            tally_metering::voids::apply_void(
                overlay,
                tally_metering::voids::VoidStep {
                    store_id,
                    mode: *mode,
                    event_ids,
                    reason,
                    at_ms: meta.recorded_at_ms,
                    partition: entry.partition,
                    offset: entry.offset,
                    plan_only: false,
                },
                settles.then_some(&mut uncounted),
            )?;
            applied.billing.settlements_pending |=
                leave_corrections(overlay, (store_id, *mode), &uncounted, &[], entry)?;
        }
        Record::AutoRechargeSettled(settled) => {
            // The ledger decides (the pending recharge, the grant); billing keeps
            // the payment only with the grant it paid for.
            let (events, booked) = tally_ledger::thresholds::apply_recharge_settled(
                overlay,
                settled,
                meta.recorded_at_ms,
            )?;
            if let (true, RechargeOutcome::Paid(payment)) = (booked, &settled.outcome) {
                tally_billing::apply::apply_recharge_payment(overlay, payment)?;
            }
            schedule_ledger_events(overlay, &events, entry)?;
        }
        Record::MeterRevised { meter, minutes } => {
            // What the new definition charges differently for usage settled in
            // credits is corrected like a void's (most scopes settle nothing).
            let settles =
                tally_billing::settlement::scope_settles(overlay, &meter.store_id, meter.mode)?;
            let mut corrected = Vec::new();
            tally_metering::revisions::apply_revision(
                overlay,
                meter,
                minutes,
                (entry.partition, entry.offset),
                meta.recorded_at_ms,
                &mut applied.metering,
                settles.then_some(&mut corrected),
            )?;
            applied.billing.settlements_pending |= leave_corrections(
                overlay,
                (&meter.store_id, meter.mode),
                &corrected,
                &[],
                entry,
            )?;
        }
        Record::EventAmended {
            store_id,
            mode,
            event_id,
            reason,
            replacement,
            matched_below,
        } => {
            applied.billing.settlements_pending |= apply_amendment(
                overlay,
                tally_metering::voids::VoidStep {
                    store_id,
                    mode: *mode,
                    event_ids: std::slice::from_ref(event_id),
                    reason,
                    at_ms: meta.recorded_at_ms,
                    partition: entry.partition,
                    offset: entry.offset,
                    plan_only: false,
                },
                replacement,
                *matched_below,
                entry,
            )?
        }
        Record::CreditExpiriesDue {
            store_id,
            mode,
            account_id,
        } => {
            let events = tally_ledger::apply::apply_expiries_due(
                overlay,
                store_id,
                *mode,
                account_id,
                meta.recorded_at_ms,
            )?;
            schedule_ledger_events(overlay, &events, entry)?;
        }
        Record::CreditReservation(step) => {
            let events = tally_ledger::reservations::apply_reservation_step(
                overlay,
                step,
                meta.recorded_at_ms,
            )?;
            schedule_ledger_events(overlay, &events, entry)?;
        }
        Record::WebhookEndpointUpserted(endpoint) => {
            tally_notifications::apply_endpoint(overlay, endpoint, base)?
        }
        Record::WebhookEndpointDeleted {
            store_id,
            mode,
            endpoint_id,
        } => tally_notifications::apply_endpoint_deleted(overlay, store_id, *mode, endpoint_id),
        Record::WebhookAttempt(attempt) => tally_notifications::apply_attempt(overlay, attempt)?,
        Record::IdempotentResponse(response) => {
            idempotency::apply_response(overlay, response, meta.recorded_at_ms)?
        }
    }
    Ok(())
}

/// `UsageSettled`: billing decides the settlement, the ledger books its debits and
/// the credits a void gives back, and their events are scheduled.
fn apply_settlement(
    overlay: &mut Overlay<'_>,
    settlement: &tally_domain::record::UsageSettlement,
    recorded_at_ms: i64,
    entry: &LogEntry,
) -> Result<(), ApplyError> {
    // Both callbacks push into `events`; a cell lets them share it.
    let events = std::cell::RefCell::new(Vec::new());
    tally_billing::settlement::apply_usage_settled(
        overlay,
        settlement,
        recorded_at_ms,
        &mut |overlay, debit| {
            let request = ledger_usage_request(debit, "usage of meter");
            let (taken, emitted) = tally_ledger::apply_usage_debit(overlay, &request)?;
            events.borrow_mut().extend(emitted);
            Ok(taken)
        },
        &mut |overlay, refund| {
            let request = ledger_usage_request(refund, "usage voided of meter");
            // A credit the ledger refuses (past its limits) gives nothing back; the
            // settlement stands.
            let mark = overlay.savepoint();
            match tally_ledger::apply_usage_refund(overlay, &request) {
                Ok((given, emitted)) => {
                    events.borrow_mut().extend(emitted);
                    Ok(given)
                }
                Err(ApplyError::Refused(_)) => {
                    overlay.roll_back_to(mark);
                    Ok(rust_decimal::Decimal::ZERO)
                }
                Err(error) => Err(error),
            }
        },
    )?;
    schedule_ledger_events(overlay, &events.into_inner(), entry)?;
    Ok(())
}

/// `EventAmended`: metering voids the event and stores the replacement; billing
/// takes the original's settled usage back and charges the replacement when a
/// purchase binds it now (decided here in log order, as for a usage record applied
/// behind). True when a settlement was left.
fn apply_amendment(
    overlay: &mut Overlay<'_>,
    step: tally_metering::voids::VoidStep<'_>,
    replacement: &tally_domain::usage::UsageEvent,
    matched_below: Option<u64>,
    entry: &LogEntry,
) -> Result<bool, ApplyError> {
    let (store_id, mode) = (step.store_id, step.mode);
    // A scope no purchase ever bound settles nothing: one read, nothing collected.
    if !tally_billing::settlement::scope_settles(overlay, store_id, mode)? {
        tally_metering::voids::apply_amend(overlay, step, replacement, matched_below, None)?;
        return Ok(false);
    }
    let (mut uncounted, mut counted) = (Vec::new(), Vec::new());
    tally_metering::voids::apply_amend(
        overlay,
        step,
        replacement,
        matched_below,
        Some((&mut uncounted, &mut counted)),
    )?;
    let bound = tally_billing::settlement::is_bound_by(
        |key| overlay.get(key),
        store_id,
        mode,
        std::slice::from_ref(replacement),
    )?;
    let new_units: Vec<_> = match bound {
        true => counted
            .iter()
            .map(|c| tally_billing::settlement::NewUnits {
                customer_id: &replacement.customer_id,
                meter_id: &c.meter_id,
                timestamp_ms: replacement.timestamp_ms,
                quantity: c.quantity,
            })
            .collect(),
        false => Vec::new(),
    };
    let left = leave_corrections(overlay, (store_id, mode), &uncounted, &new_units, entry)?;
    if bound && !left {
        // The replacement settles like a usage record's events, with nothing to
        // charge yet (a revision may charge it later).
        tally_billing::settlement::settled_nothing(overlay, entry.partition, entry.offset)?;
    }
    Ok(left)
}

/// What a correction record leaves for usage settlement (docs/api.md, "Usage prices
/// settled in credits"): the voided events' units (or a revision's differences),
/// negated, for those whose storing record's usage was settled or is pending (the
/// others were never charged), and an amendment's replacement's units; pending
/// under the correction's own position, so the settler appends them after the
/// settlement of the usage they take back.
fn leave_corrections(
    overlay: &mut Overlay<'_>,
    (store_id, mode): (&str, tally_domain::Mode),
    uncounted: &[tally_metering::voids::Uncounted],
    replacement: &[tally_billing::settlement::NewUnits<'_>],
    entry: &LogEntry,
) -> Result<bool, EngineError> {
    let mut units = Vec::with_capacity(uncounted.len() + replacement.len());
    // Whether each storing record left a settlement, asked once per record.
    let mut left: std::collections::HashMap<(u32, u64), bool> = Default::default();
    for u in uncounted {
        let (partition, offset) = u.stored_by;
        let was_left = match left.get(&u.stored_by) {
            Some(known) => *known,
            None => {
                let known = tally_billing::settlement::was_left(overlay, partition, offset)?;
                left.insert(u.stored_by, known);
                known
            }
        };
        if was_left {
            units.push(tally_billing::settlement::NewUnits {
                customer_id: &u.customer_id,
                meter_id: &u.meter_id,
                timestamp_ms: u.timestamp_ms,
                quantity: -u.quantity,
            });
        }
    }
    units.extend(replacement.iter().copied());
    if units.is_empty() {
        return Ok(false);
    }
    tally_billing::settlement::leave_units(
        overlay,
        store_id,
        mode,
        units,
        entry.partition,
        entry.offset,
    )
}

/// A settlement's debit or take-back as the ledger books it: `what` names the
/// transaction's kind of usage in its description.
fn ledger_usage_request<'a>(
    request: &'a tally_billing::settlement::UsageDebit<'a>,
    what: &str,
) -> tally_ledger::UsageDebit<'a> {
    tally_ledger::UsageDebit {
        store_id: request.store_id,
        mode: request.mode,
        customer_id: request.customer_id,
        account_name: request.account_name,
        amount: request.amount,
        transaction_id: request.transaction_id.clone(),
        description: format!("{what} {}", request.meter_id),
        metadata: [
            ("meter_id".to_string(), request.meter_id.to_string()),
            ("source_id".to_string(), request.source_id.to_string()),
        ]
        .into(),
        created_at_ms: request.created_at_ms,
    }
}

/// The credits a purchase grants (a checkout, a subscription's paid period),
/// booked with its record (docs/api.md, "Checkouts"). One the account cannot take
/// (frozen, closed, past a limit) is dropped alone, rolled back to a savepoint: the
/// purchase was paid and stays.
fn book_purchase_grants(
    overlay: &mut Overlay<'_>,
    (store_id, mode): (&str, tally_domain::Mode),
    grants: &[tally_billing::apply::CheckoutGrant],
    recorded_at_ms: i64,
    entry: &LogEntry,
) -> Result<(), ApplyError> {
    let mut granted = Vec::new();
    for grant in grants {
        let request = tally_ledger::PurchaseGrant {
            store_id,
            mode,
            customer_id: &grant.customer_id,
            account_name: &grant.account_name,
            unit_label: &grant.unit_label,
            amount: grant.amount,
            key: &grant.key,
            description: "granted by a purchase",
            // Ledger time, as every ledger step (the record's).
            created_at_ms: recorded_at_ms,
        };
        let mark = overlay.savepoint();
        match tally_ledger::apply_purchase_grant(overlay, &request) {
            Ok(events) => granted.extend(events),
            Err(ApplyError::Refused(outcome)) => {
                overlay.roll_back_to(mark);
                tracing::warn!(key = %grant.key, ?outcome, "a purchase's credits were not granted");
            }
            Err(error) => return Err(error),
        }
    }
    schedule_ledger_events_booking(
        overlay,
        &granted,
        entry,
        &[
            tally_ledger::EVENT_CREDITS_EXPIRED,
            tally_ledger::thresholds::EVENT_CREDITS_AUTO_RECHARGED,
            tally_ledger::EVENT_CREDITS_GRANTED,
        ],
    )?;
    Ok(())
}

/// The ledger's events leave as data: the notifications context schedules them, and
/// the expiries and auto-recharges the record booked (apply builds those
/// transactions itself; no record carries them) are named under its position for
/// the audit (`#`).
fn schedule_ledger_events(
    overlay: &mut Overlay<'_>,
    events: &[tally_domain::record::LedgerEvent],
    entry: &LogEntry,
) -> Result<(), EngineError> {
    schedule_ledger_events_booking(
        overlay,
        events,
        entry,
        &[
            tally_ledger::EVENT_CREDITS_EXPIRED,
            tally_ledger::thresholds::EVENT_CREDITS_AUTO_RECHARGED,
        ],
    )
}

/// Schedules a record's ledger events, and names (in the `#` row the ledger audit
/// replays) the transactions apply booked itself: those of the events of
/// `booked_types` (expiries; a purchase's grants too).
fn schedule_ledger_events_booking(
    overlay: &mut Overlay<'_>,
    events: &[tally_domain::record::LedgerEvent],
    entry: &LogEntry,
    booked_types: &[&str],
) -> Result<(), EngineError> {
    let booked: Vec<&str> = events
        .iter()
        .filter(|e| booked_types.contains(&e.event_type.as_str()))
        .filter_map(|e| e.transaction_id.as_deref())
        .collect();
    if !booked.is_empty() {
        overlay.put(
            keys::ledger_booked_key(entry.partition, entry.offset),
            booked.join("\n").into_bytes(),
        );
    }
    let heads: Vec<_> = events
        .iter()
        .map(tally_notifications::EventHead::ledger)
        .collect();
    tally_notifications::schedule_deliveries(overlay, &heads, entry.offset)
}

/// Billing's events leave as data; the notifications context schedules them.
fn schedule_billing_events(
    overlay: &mut Overlay<'_>,
    events: &[tally_domain::record::BillingEvent],
    offset: u64,
) -> Result<(), EngineError> {
    let heads: Vec<_> = events
        .iter()
        .map(|event| {
            let (store_id, mode) = event.object.scope();
            tally_notifications::EventHead {
                id: &event.id,
                event_type: &event.event_type,
                created_at_ms: event.created_at_ms,
                store_id,
                mode,
                event_key: tally_billing::apply::event_key(store_id, mode, event),
                unstored: None,
            }
        })
        .collect();
    tally_notifications::schedule_deliveries(overlay, &heads, offset)
}

/// The projection over one store, as the runtime drives it (tally-runtime): decode,
/// plan, fetch and apply; the engine adds its caches in `after_commit`, a replay
/// needs nothing more.
pub struct StoreProjection {
    store: Arc<dyn ProjectionStore>,
    state: std::sync::Mutex<ProjectorState>,
    /// Usage records read back recently, decoded once for apply and queries alike
    /// (a void's gateway reads the records apply then rebuilds from).
    recent: Arc<RecentRecords>,
    /// A split cluster's changelog and the log's partition count: a partition this
    /// node gains is restored from there when it can (`restore::restore_partition`).
    changelog: std::sync::OnceLock<(Arc<dyn Changelog>, u32)>,
    /// Snapshots read for partitions about to be restored (`prefetch_snapshot`),
    /// with how long the read took: read off the apply thread, applied on it.
    prefetched: std::sync::Mutex<BTreeMap<u32, (PartitionSnapshot, std::time::Duration)>>,
    /// Where chunks go to be read ahead while catching up (`read_ahead`): started
    /// with the first such chunk; `None` if its thread could not start.
    read_ahead: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<Arc<DecodedChunk>>>>,
}

/// Chunks waiting to be read ahead. One: the reader runs beside apply on the same
/// chunk, and a chunk that finds it still busy is not read ahead (apply reads its
/// buckets itself, as without it); a longer queue would read pages that sled's
/// cache evicts again before apply gets there.
const READ_AHEAD_QUEUE: usize = 1;

/// Reads what apply will read for the chunk's buckets, as apply reads it
/// (`Overlay::committed_aggregate`, `Overlay::distinct_set_index`): nothing for a
/// key the layer holds, else the key itself. A failed read is left to apply, which
/// reads the same pages.
fn read_chunk_ahead(store: &dyn ProjectionStore, chunk: &DecodedChunk) {
    // By meter id alone: ids are unique across stores, and a lookup by `&str` then
    // needs no key of its own per event.
    let sets: std::cell::RefCell<std::collections::HashMap<String, bool>> = Default::default();
    let keeps_sets = |store_id: &str, mode: tally_domain::Mode, meter_id: &str| {
        if let Some(keeps) = sets.borrow().get(meter_id) {
            return *keeps;
        }
        let keeps = tally_metering::apply::keeps_distinct_sets(store, store_id, mode, meter_id);
        sets.borrow_mut().insert(meter_id.to_string(), keeps);
        keeps
    };
    let mut read: std::collections::HashSet<Vec<u8>> = std::collections::HashSet::new();
    for key in chunk.bucket_keys(&keeps_sets) {
        if store.unwritten(&key).is_some() || read.contains(&key) {
            continue;
        }
        if store.get(&key).is_err() {
            break;
        }
        read.insert(key);
    }
}

/// Starts the thread that reads ahead the buckets of the chunks it is sent
/// (`Projection::read_ahead`). It holds the store weakly and ends when the
/// projection (the sender) is dropped.
fn start_read_ahead(
    store: std::sync::Weak<dyn ProjectionStore>,
) -> Option<std::sync::mpsc::SyncSender<Arc<DecodedChunk>>> {
    let (sender, chunks) = std::sync::mpsc::sync_channel::<Arc<DecodedChunk>>(READ_AHEAD_QUEUE);
    let started = std::thread::Builder::new()
        .name("tally-read-ahead".into())
        .spawn(move || {
            if let Err(why) = tally_projection::priority::run_as_background_thread() {
                tracing::warn!("reading ahead at normal priority: {why}");
            }
            while let Ok(chunk) = chunks.recv() {
                let Some(store) = store.upgrade() else { break };
                read_chunk_ahead(store.as_ref(), &chunk);
            }
        });
    match started {
        Ok(_) => Some(sender),
        Err(error) => {
            tracing::warn!(%error, "no read-ahead: its thread did not start");
            None
        }
    }
}

impl std::fmt::Debug for StoreProjection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreProjection").finish()
    }
}

impl StoreProjection {
    /// The projection over `store`, its event index loaded into `index`; records
    /// it reads back go through `recent` (shared with metering's queries).
    pub fn load(
        store: Arc<dyn ProjectionStore>,
        index: Arc<EventIndex>,
        recent: Arc<RecentRecords>,
    ) -> Result<StoreProjection, EngineError> {
        let state = ProjectorState::load(store.as_ref(), index)?;
        Ok(StoreProjection {
            store,
            state: std::sync::Mutex::new(state),
            recent,
            changelog: std::sync::OnceLock::new(),
            prefetched: Default::default(),
            read_ahead: std::sync::OnceLock::new(),
        })
    }

    /// Restores the partitions this node gains from `changelog` (of a log with
    /// `partitions` partitions) where it holds a usable snapshot.
    pub fn set_changelog(&self, changelog: Arc<dyn Changelog>, partitions: u32) {
        let _ = self.changelog.set((changelog, partitions));
    }
}

impl tally_runtime::Projection for StoreProjection {
    type Chunk = DecodedChunk;
    type Fetched = Fetched;
    type Applied = Applied;

    fn decode(&self, entries: Vec<LogEntry>, mode: ChunkMode) -> DecodedChunk {
        DecodedChunk::with_mode(entries, mode)
    }

    /// After a start every bucket apply folds is a cold read of sled (its pages
    /// read back from the file), and the catch-up keeps one core busy with apply
    /// while the other idles: a thread of its own reads the chunk's buckets beside
    /// apply, which then finds their pages in sled's cache (docs/benchmarks.md, "Reading ahead
    /// while catching up").
    fn read_ahead(&self, chunk: &Arc<DecodedChunk>) {
        let reader = self
            .read_ahead
            .get_or_init(|| start_read_ahead(Arc::downgrade(&self.store)));
        if let Some(reader) = reader {
            // Full: the reader is still on an earlier chunk; this one goes unread.
            let _ = reader.try_send(chunk.clone());
        }
    }

    fn plan(&self, chunk: &DecodedChunk) -> Result<Vec<(u32, u64)>, String> {
        let index = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .index
            .clone();
        plan_chunk(self.store.as_ref(), &index, chunk, Some(&self.recent))
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
            Some(entry) => {
                let batch = StoredBatch::decode(&entry.payload)
                    .map_err(|error| error.to_string())?
                    .map(Arc::new);
                if let Some(batch) = &batch {
                    self.recent
                        .put(partition, offset, entry.payload.len(), batch.clone());
                }
                batch
            }
            None => None,
        };
        fetched.insert((partition, offset), batch);
        Ok(())
    }

    fn fetch_cached(&self, fetched: &mut Fetched, partition: u32, offset: u64) -> bool {
        match self.recent.get(partition, offset) {
            Some(batch) => {
                fetched.insert((partition, offset), Some(batch));
                true
            }
            None => false,
        }
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

    fn prefetch_snapshot(&self, partition: u32) {
        let Some((changelog, _)) = self.changelog.get() else {
            return;
        };
        let started = std::time::Instant::now();
        // A snapshot read for an earlier gain of the partition is not this one's.
        self.prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&partition);
        match changelog.read(partition) {
            Ok(Some(snapshot)) => {
                self.prefetched
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(partition, (snapshot, started.elapsed()));
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(partition, %error, "reading the changelog failed; restoring from the log");
            }
        }
    }

    fn snapshot_position(&self, partition: u32) -> Option<u64> {
        self.prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&partition)
            .map(|(snapshot, _)| snapshot.position)
    }

    fn restore_snapshot(
        &self,
        partition: u32,
        from: u64,
        until: u64,
    ) -> Result<Option<(u64, Applied)>, String> {
        let Some((_, partitions)) = self.changelog.get() else {
            return Ok(None);
        };
        let started = std::time::Instant::now();
        let prefetched = self
            .prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&partition);
        let Some((snapshot, read)) = prefetched else {
            return Ok(None);
        };
        // Usable when it is ahead of what this node holds, and not ahead of what it
        // has read of the partition (the log restore cannot go back).
        if snapshot.position <= from || snapshot.position > until {
            tracing::info!(
                partition,
                from,
                until,
                snapshot = snapshot.position,
                "the changelog's snapshot is not usable here; restoring from the log"
            );
            return Ok(None);
        }
        let position = snapshot.position;
        let rows = snapshot.rows.len();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let applied = crate::restore::restore_partition(
            self.store.as_ref(),
            &mut state,
            *partitions,
            partition,
            snapshot,
        )
        .map_err(|error| error.to_string())?;
        tally_core::metrics::Metrics::restored_from_changelog();
        tracing::info!(
            partition,
            position,
            rows,
            read_ms = read.as_millis() as u64,
            apply_ms = started.elapsed().as_millis() as u64,
            "restored a partition from the changelog"
        );
        Ok(Some((position, applied)))
    }

    fn skipped_from(&self, partition: u32) -> Result<Option<u64>, String> {
        skipped_from(self.store.as_ref(), partition).map_err(|error| error.to_string())
    }
}

/// Where the projection began skipping `partition`'s records as another node's
/// (and has not restored them yet).
pub fn skipped_from(
    store: &dyn ProjectionStore,
    partition: u32,
) -> Result<Option<u64>, EngineError> {
    match store.get(&keys::partition_skipped_key(partition))? {
        None => Ok(None),
        Some(bytes) => Ok(Some(u64::from_be_bytes(
            bytes.as_slice().try_into().map_err(|_| {
                EngineError::Corrupt(format!(
                    "the skip mark of partition {partition} is not 8 bytes"
                ))
            })?,
        ))),
    }
}

/// Applies every partition of the log into `store` (replay, audits' catch-up), from
/// the positions the store holds, through the runtime's replay (partitions in
/// turns); `progress` gets (partition, reached, end).
pub async fn replay_log(
    log: &dyn tally_log::Log,
    store: Arc<dyn ProjectionStore>,
    progress: impl FnMut(u32, u64, u64),
) -> Result<u64, EngineError> {
    let projection = StoreProjection::load(
        store.clone(),
        Arc::new(EventIndex::default()),
        Arc::default(),
    )?;
    tally_runtime::replay_log(log, store.as_ref(), &projection, progress)
        .await
        .map_err(EngineError::from)
}

/// Applies the whole log of one partition into `store` (replay and tests), from
/// the position the store holds, through the runtime's replay.
pub async fn replay_partition(
    log: &dyn tally_log::Log,
    store: Arc<dyn ProjectionStore>,
    partition: u32,
    progress: impl FnMut(u64, u64),
) -> Result<u64, EngineError> {
    let projection = StoreProjection::load(
        store.clone(),
        Arc::new(EventIndex::default()),
        Arc::default(),
    )?;
    tally_runtime::replay_partition(log, store.as_ref(), &projection, partition, progress)
        .await
        .map_err(EngineError::from)
}
