//! Metering's apply: meters, usage batches and backfill steps folded into the
//! projection in log order. Exact dedup is decided here (the first record carrying
//! an event id wins), and so are meter names and limits (ARCHITECTURE.md,
//! "Decisions in apply").

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rust_decimal::Decimal;
use tally_core::codec::{self, DistinctPrint};
use tally_core::error::EngineError;
use tally_core::event_index::{
    self, EventIndex, EventLocation, PRUNE_STEP_MS, STORED_EVENTS_RETENTION_MS,
};
use tally_core::keys::{self, BucketKey, Key, ListingKey, StoredEventsKey, ALL_CUSTOMERS};
use tally_core::overlay::{inflight_key, ApplyError, DistinctAdd, FastMap, Overlay, StoredRow};
use tally_core::series::BucketId;
use tally_domain::aggregate::{contribution, Aggregate, Contribution};
use tally_domain::gauge::{keep_latest, offset_in_minute, LatestPoint};
use tally_domain::ids::MeterId;
use tally_domain::limits::MAX_EVENT_AGE_MS;
use tally_domain::meter::{Aggregation, EventView, Meter, MeterStatus};
use tally_domain::record::Record;
use tally_domain::time::minute_bucket;
use tally_domain::usage::UsageEvent;
use tally_domain::Mode;
use tally_projection::{ProjectionStore, Visit};

/// What a committed chunk changed in metering.
#[derive(Debug, Default)]
pub struct MeteringApplied {
    pub meters: Vec<Meter>,
    /// In-flight dedup reservations that this chunk made durable (or refused).
    pub event_keys: Vec<String>,
}

impl MeteringApplied {
    pub fn absorb(&mut self, other: MeteringApplied) {
        self.meters.extend(other.meters);
        self.event_keys.extend(other.event_keys);
    }
}

/// The log records applying `record` will read back (the committed events its event
/// ids' fingerprints point at, what its backfill step folds), added to `wanted`.
pub fn plan_record(
    store: &dyn ProjectionStore,
    index: &EventIndex,
    record: &Record,
    wanted: &mut BTreeSet<(u32, u64)>,
) -> Result<(), EngineError> {
    let locate = |wanted: &mut BTreeSet<(u32, u64)>, store_id: &str, mode: Mode, event_id: &str| {
        for location in index.candidates(index.fingerprint(store_id, mode, event_id)) {
            wanted.insert((location.partition, location.offset));
        }
    };
    match record {
        Record::UsageBatch {
            store_id,
            mode,
            events,
            ..
        } => {
            for event in events {
                locate(wanted, store_id, *mode, &event.event_id);
            }
        }
        Record::EventsVoided {
            store_id,
            mode,
            event_ids,
            ..
        } => {
            for event_id in event_ids {
                locate(wanted, store_id, *mode, event_id);
            }
        }
        Record::EventAmended {
            store_id,
            mode,
            event_id,
            replacement,
            ..
        } => {
            locate(wanted, store_id, *mode, event_id);
            locate(wanted, store_id, *mode, &replacement.event_id);
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
                locate(wanted, store_id, *mode, event_id);
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
    Ok(())
}

/// A usage record: each event not stored before (exact dedup, first in log order
/// wins) is folded into the buckets of the meters it matched, and the record's `F`
/// row names the events it stored.
pub fn apply_usage_batch(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    events: &[UsageEvent],
    (partition, offset): (u32, u64),
    matched_below: Option<u64>,
    mut counted: Option<&mut Vec<Counted>>,
) -> Result<(), ApplyError> {
    // Looked up once per event and matched meter: a fast hash (std's SipHash was ~2%
    // of the apply thread under the ingest benchmark).
    let mut meters: FastMap<MeterId, Arc<Meter>> = FastMap::default();
    let revised = revised_meters(overlay, store_id, mode)?;
    let unknown = match matched_below {
        Some(below) => meters_changed_since(overlay, store_id, mode, partition, below, offset)?,
        None => Vec::new(),
    };
    let mut stored = Vec::new();
    // The stored events by minute (`z` rows, one per minute the record's events fall
    // in): what a void rebuilds a bucket from.
    let mut minute_rows: BTreeMap<i64, Vec<u8>> = BTreeMap::new();
    for (index, event) in events.iter().enumerate() {
        // Exact dedup: the first record carrying an id wins, whatever came later
        // (an earlier event of this same record included).
        let key = inflight_key(store_id, mode, &event.event_id);
        let print = overlay.index.fingerprint(store_id, mode, &event.event_id);
        if overlay
            .find_stored(&key, print, store_id, mode, &event.event_id)?
            .is_some()
        {
            continue;
        }
        let location = EventLocation {
            partition,
            offset,
            index: index as u32,
        };
        overlay.note_stored(key, location);
        stored.push((index as u32, print));
        // The prints of the distinct values it folds, for its `z` row.
        let mut prints = Vec::new();
        for meter_id in &event.matched_meter_ids {
            if revised.iter().any(|m| m.id == *meter_id)
                || unknown.iter().any(|m| m.id == *meter_id)
            {
                continue;
            }
            if !meters.contains_key(meter_id) {
                let meter = shared_meter(overlay, store_id, mode, meter_id)?;
                meters.insert(meter_id.clone(), meter);
            }
            let meter = &meters[meter_id];
            let folded = fold_matched(overlay, meter, event, index, counted.as_deref_mut())?;
            note_print(&mut prints, meter, folded);
        }
        // A revised meter decides from its definition, whatever ingest matched with
        // the definition it knew (docs/api.md, "Meter revisions").
        let view = EventView {
            name: &event.name,
            timestamp_ms: event.timestamp_ms,
            properties: &event.properties,
        };
        for meter in revised.iter().filter(|m| m.matches(&view)) {
            let folded = fold_matched(overlay, meter, event, index, counted.as_deref_mut())?;
            note_print(&mut prints, meter, folded);
        }
        // Likewise a meter created or changed after what the gateway knew: its
        // definition decides, and an event it folds that ingest did not match gets
        // the marker of an event folded apart from ingest's match (a void reads it,
        // see `charged::was_folded`).
        for meter in unknown.iter().filter(|m| m.matches(&view)) {
            if meter.accrues(event.timestamp_ms) && !event.matched_meter_ids.contains(&meter.id) {
                overlay.put(
                    keys::backfilled_key(store_id, mode, &meter.id, &event.event_id),
                    Vec::new(),
                );
            }
            let folded = fold_matched(overlay, meter, event, index, counted.as_deref_mut())?;
            note_print(&mut prints, meter, folded);
        }
        codec::push_minute_event(
            minute_rows
                .entry(minute_bucket(event.timestamp_ms))
                .or_default(),
            index as u32,
            &event.customer_id,
            &prints,
        );
    }
    for (minute, row) in minute_rows {
        overlay.put(
            keys::minute_events_key(minute, store_id, mode, partition, offset),
            row,
        );
    }
    if !stored.is_empty() {
        let key = StoredEventsKey {
            store_id: store_id.to_string(),
            mode,
            received_at_ms: events.iter().map(|e| e.received_at_ms).min().unwrap_or(0),
            partition,
            offset,
        };
        overlay.put(key.encode(), event_index::encode_stored(&stored));
    }
    Ok(())
}

/// Folds a new event into a meter that matches it, if the meter is active and counts
/// from its timestamp; a matching meter that is not active gets the event's `_` row
/// (a void must know it was not folded, see `charged::was_folded`). What the event
/// contributed, when folded.
fn fold_matched(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    index: usize,
    counted: Option<&mut Vec<Counted>>,
) -> Result<Option<Contribution>, EngineError> {
    if meter.status != MeterStatus::Active {
        overlay.put(
            keys::fold_skipped_key(&meter.store_id, meter.mode, &meter.id, &event.event_id),
            Vec::new(),
        );
        return Ok(None);
    }
    if !meter.accrues(event.timestamp_ms) {
        return Ok(None);
    }
    let contribution = fold_event(overlay, meter, event)?;
    if let (Some(counted), Some(quantity)) = (counted, settled_quantity(meter, event)) {
        counted.push(Counted {
            event: index as u32,
            meter_id: meter.id.clone(),
            quantity,
        });
    }
    Ok(Some(contribution))
}

/// Notes the print of a distinct value the event folded into `meter` (its `z` row
/// carries them: a void of it learns from them whether another event of the minute
/// may hold the value).
fn note_print(prints: &mut Vec<DistinctPrint>, meter: &Meter, folded: Option<Contribution>) {
    if let Some(Contribution::Distinct(value)) = folded {
        prints.push(DistinctPrint::of(&meter.id, value.as_bytes()));
    }
}

/// The meters of a scope created or changed by a record of `partition` from
/// `below` up to (not including) `offset`: what a usage record's gateway did not
/// know when it matched the record's events (ARCHITECTURE.md, "Meters the gateway
/// did not know"). Revised meters are left out: apply decides them anyway. Usually
/// none, at the cost of one empty range read.
fn meters_changed_since(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    partition: u32,
    below: u64,
    offset: u64,
) -> Result<Vec<Meter>, EngineError> {
    let rows = overlay.range_entries(
        &keys::meter_changed_from(store_id, mode, partition, below),
        &keys::meter_changed_from(store_id, mode, partition, offset),
    )?;
    let mut unknown: Vec<Meter> = Vec::new();
    for key in rows.keys() {
        let meter_id = keys::meter_changed_id(key)?;
        if unknown.iter().any(|m| m.id == *meter_id) {
            continue;
        }
        let meter = load_meter(overlay, store_id, mode, meter_id)?;
        if meter.revision <= 1 {
            unknown.push(meter);
        }
    }
    Ok(unknown)
}

/// The revised meters of a scope (revision > 1), read from their `` ` `` rows: none
/// in most scopes. Read once while no commit writes a meter or revision row
/// (`Overlay::committed_revised`), not once per usage record.
pub fn revised_meters(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
) -> Result<Vec<Arc<Meter>>, EngineError> {
    let prefix = Key::scoped(keys::REVISED_METER, store_id, mode).into_bytes();
    if let Some(revised) = overlay.committed_revised(&prefix) {
        return Ok(revised);
    }
    let rows = overlay.prefix_entries(&prefix)?;
    let revised = rows
        .keys()
        .map(|key| shared_meter(overlay, store_id, mode, keys::revised_meter_id(key)?))
        .collect::<Result<Vec<_>, _>>()?;
    overlay.note_revised(&prefix, &revised);
    Ok(revised)
}

/// One new event's contribution to one meter, as usage settlement charges it
/// (docs/api.md, "Usage prices").
#[derive(Debug, Clone, PartialEq)]
pub struct Counted {
    /// The event's index in its record.
    pub event: u32,
    pub meter_id: MeterId,
    /// Meter units: 1 for a `count` meter, the value for a `sum` meter.
    pub quantity: Decimal,
}

/// The meter units an event adds that settlement can charge: a count meter's one
/// event, a sum meter's positive value. Other aggregations (and negative values)
/// do not add up to a quantity, so they are never settled in credits.
pub(crate) fn settled_quantity(meter: &Meter, event: &UsageEvent) -> Option<Decimal> {
    match meter.aggregation {
        Aggregation::Count => Some(Decimal::ONE),
        Aggregation::Sum => meter
            .aggregation_property
            .as_ref()
            .and_then(|p| event.properties.get(p))
            .and_then(|v| v.as_number())
            .filter(|n| *n > Decimal::ZERO),
        _ => None,
    }
}

/// A backfill step, as its record holds it.
#[derive(Debug, Clone, Copy)]
pub struct BackfillStep<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub meter_id: &'a str,
    pub start_ms: i64,
    pub event_ids: &'a [String],
    pub finish: bool,
    pub rescan_from_ms: i64,
}

/// A backfill step: folds the events it names (and, finishing, the events received
/// since its scan began) into the meter, then moves the meter's counting start.
pub fn apply_backfill(
    overlay: &mut Overlay<'_>,
    step: BackfillStep<'_>,
    applied: &mut MeteringApplied,
) -> Result<(), ApplyError> {
    let BackfillStep {
        store_id,
        mode,
        meter_id,
        start_ms,
        event_ids,
        finish,
        rescan_from_ms,
    } = step;
    let mut meter = load_meter(overlay, store_id, mode, meter_id)?;
    if start_ms < meter.counts_from_ms {
        for event_id in event_ids {
            backfill_event_id(overlay, &meter, start_ms, event_id)?;
        }
        // A record without ids that does not finish predates chunked
        // backfills: it meant "all stored events" (a rescan from the start).
        let legacy = event_ids.is_empty() && !finish;
        if finish || legacy {
            let from = if legacy { i64::MIN } else { rescan_from_ms };
            backfill_rescan(overlay, &meter, start_ms, from)?;
            meter.counts_from_ms = start_ms;
            overlay.put(
                keys::meter_key(store_id, mode, meter_id),
                codec::encode_meter(&meter),
            );
            applied.meters.push(meter);
        }
    }
    Ok(())
}

/// A meter, created or updated. Re-checks in log order that its name is free and,
/// for a new meter, the per-store and per-event-name limits.
pub fn apply_meter(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    base_updated_at_ms: Option<i64>,
    (partition, offset): (u32, u64),
    applied: &mut MeteringApplied,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&meter.store_id, meter.mode);
    let key = keys::meter_key(store_id, mode, &meter.id);
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_meter(&b))
        .transpose()?;
    tally_core::outcome::check_base(
        base_updated_at_ms,
        previous.as_ref().map(|m| m.updated_at_ms),
    )?;
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
                ListingKey::entry(
                    keys::METER_LIST,
                    store_id,
                    mode,
                    None,
                    meter.created_at_ms,
                    &meter.id,
                ),
                Vec::new(),
            );
        }
        Some(old) if old.name != meter.name => overlay.delete(name_key(&old.name)),
        Some(_) => {}
    }
    if meter.status == MeterStatus::Archived
        && previous
            .as_ref()
            .is_some_and(|old| old.status != MeterStatus::Archived)
    {
        // Decided again in log order: a product may have priced the meter after the
        // service looked (the `Z` index, which billing's apply keeps).
        let priced = keys::meter_priced_prefix(store_id, mode, &meter.id);
        if !overlay.first_entries(&priced, 1)?.is_empty() {
            return Err(crate::meters::meter_in_use().into());
        }
    }
    // The counting start belongs to backfills and the definition to revisions
    // (applied in log order): an update derived before one finished must not
    // move them back.
    let mut meter = meter.clone();
    if let Some(old) = &previous {
        meter.counts_from_ms = old.counts_from_ms;
        meter.filter.clone_from(&old.filter);
        meter
            .aggregation_property
            .clone_from(&old.aggregation_property);
        meter.revision = old.revision;
    }
    overlay.put(name_key(&meter.name), meter.id.as_bytes().to_vec());
    overlay.put(key, codec::encode_meter(&meter));
    // A usage record matched by a gateway that had not applied this one yet
    // decides the meter in apply (ARCHITECTURE.md, "Meters the gateway did not
    // know").
    overlay.put(
        keys::meter_changed_key(store_id, mode, partition, offset, &meter.id),
        Vec::new(),
    );
    applied.meters.push(meter);
    Ok(())
}

/// `load_meter`, shared: decoded once while no commit writes it (the usage path,
/// where every record reads each meter its events matched).
pub fn shared_meter(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    meter_id: &str,
) -> Result<Arc<Meter>, EngineError> {
    match overlay.shared_meter(&keys::meter_key(store_id, mode, meter_id))? {
        Some(meter) => Ok(meter),
        None => Err(EngineError::NotYetProjected),
    }
}

pub fn load_meter(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    meter_id: &str,
) -> Result<Meter, EngineError> {
    let key = keys::meter_key(store_id, mode, meter_id);
    match overlay.get(&key)? {
        Some(bytes) => codec::decode_meter(&bytes),
        // With one partition the meter record always precedes; in Kafka mode the
        // control partition may lag, and the runtime retries the chunk (`ApplyFailure::NotYet`).
        None => Err(EngineError::NotYetProjected),
    }
}

/// The per-customer minute buckets a usage record's events fold into, keyed as
/// `fold_contribution` keys them: for each matched meter its bucket (`A`), and its
/// distinct set (`u`) when `keeps_sets` says the meter is `unique`. What a catch-up
/// reads ahead (engine `StoreProjection::read_ahead`). The meter-wide buckets are a
/// few per minute and stay in the bucket cache; a revised meter's matches are
/// decided in apply, so they are left out. Only a hint: reading them changes nothing.
pub fn bucket_keys_of<'a>(
    store_id: &'a str,
    mode: Mode,
    events: &'a [UsageEvent],
    keeps_sets: impl Fn(&str) -> bool + Copy + 'a,
) -> impl Iterator<Item = Vec<u8>> + 'a {
    events.iter().flat_map(move |event| {
        let minute = minute_bucket(event.timestamp_ms);
        event.matched_meter_ids.iter().flat_map(move |meter_id| {
            let tables: &[u8] = if keeps_sets(meter_id) {
                &[keys::AGGREGATE, keys::DISTINCT_SET]
            } else {
                &[keys::AGGREGATE]
            };
            tables.iter().map(move |table| {
                BucketKey::from_minute(*table, store_id, mode, meter_id, &event.customer_id, minute)
            })
        })
    })
}

/// Whether the meter as stored is `unique` (keeps distinct sets); false when the
/// store does not hold it or cannot be read.
pub fn keeps_distinct_sets(
    store: &dyn ProjectionStore,
    store_id: &str,
    mode: Mode,
    meter_id: &str,
) -> bool {
    let key = keys::meter_key(store_id, mode, meter_id);
    match store.get(&key) {
        Ok(Some(bytes)) => {
            codec::decode_meter(&bytes).is_ok_and(|meter| meter.aggregation == Aggregation::Unique)
        }
        _ => false,
    }
}

/// Folds one event into the meter's per-customer and all-customers minute buckets.
pub fn fold_event(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<Contribution, EngineError> {
    let contribution = fold_minute(
        overlay,
        meter,
        event,
        &[event.customer_id.as_str(), ALL_CUSTOMERS],
    )?;
    if let (
        Contribution::Event {
            number: Some(value),
        },
        Aggregation::TimeWeightedSum,
    ) = (&contribution, meter.aggregation)
    {
        fold_weighted(overlay, meter, event, *value)?;
    }
    Ok(contribution)
}

/// What an event contributes to a meter (its aggregation property's value).
pub fn contribution_of(meter: &Meter, event: &UsageEvent) -> Contribution {
    let value = meter
        .aggregation_property
        .as_ref()
        .and_then(|p| event.properties.get(p));
    contribution(meter.aggregation, value)
}

/// Folds one event into the minute buckets of `slots` (its customer, and
/// `ALL_CUSTOMERS` for the meter-wide bucket): everything but `time_weighted_sum`,
/// whose fold is not local to a minute. A void rebuilds one slot with this.
pub fn fold_minute(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    slots: &[&str],
) -> Result<Contribution, EngineError> {
    fold_contribution(overlay, meter, event, contribution_of(meter, event), slots)
}

/// The minute bucket of `customer` (whose key `bucket` builds) for writing; the
/// meter-wide one (`ALL_CUSTOMERS`) through the series the overlay remembers for
/// the meter, so its key is built only when it is read.
fn slot_aggregate<'o>(
    overlay: &'o mut Overlay<'_>,
    meter: &Meter,
    customer: &str,
    minute: i64,
    bucket: impl Fn() -> Vec<u8>,
) -> Result<(BucketId, &'o mut Aggregate), EngineError> {
    if customer == ALL_CUSTOMERS {
        overlay.meter_wide_aggregate(meter, minute, bucket)
    } else {
        overlay.aggregate_entry(bucket())
    }
}

/// `fold_minute` with the event's contribution already worked out (a rebuild
/// needs it before it folds).
pub fn fold_contribution(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    contribution: Contribution,
    slots: &[&str],
) -> Result<Contribution, EngineError> {
    let minute = minute_bucket(event.timestamp_ms);
    for customer in slots.iter().copied() {
        // Built from borrowed parts (no owned `BucketKey`): this runs per event, per
        // matched meter, twice.
        let (store_id, mode, meter_id) = (&meter.store_id, meter.mode, &meter.id);
        let bucket =
            || BucketKey::from_minute(keys::AGGREGATE, store_id, mode, meter_id, customer, minute);
        match &contribution {
            Contribution::Skipped => {}
            Contribution::Event { number } => {
                slot_aggregate(overlay, meter, customer, minute, bucket)?
                    .1
                    .add(*number)
            }
            Contribution::Distinct(distinct) => {
                let (id, aggregate) = slot_aggregate(overlay, meter, customer, minute, bucket)?;
                aggregate.add(None);
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
                    // Its `U` keys share the series and minute of the bucket's `A` key.
                    let values = BucketId {
                        table: keys::UNIQUE,
                        ..id
                    };
                    overlay.put_distinct_value(values, distinct.as_bytes(), || {
                        BucketKey::distinct(store_id, mode, meter_id, customer, minute, distinct)
                    });
                }
            }
        }
    }
    if let (
        Contribution::Event {
            number: Some(value),
        },
        Aggregation::Latest,
    ) = (&contribution, meter.aggregation)
    {
        fold_latest(overlay, meter, event, *value, slots)?;
    }
    Ok(contribution)
}

/// `latest`: the event replaces its minute's point (in each slot: its customer's,
/// all customers') when it is later (domain `gauge`).
fn fold_latest(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    value: Decimal,
    slots: &[&str],
) -> Result<(), EngineError> {
    let point = LatestPoint {
        timestamp_ms: event.timestamp_ms,
        event_id: event.event_id.clone(),
        value,
    };
    let minute = minute_bucket(event.timestamp_ms);
    for customer in slots.iter().copied() {
        let key = BucketKey::from_minute(
            keys::LATEST,
            &meter.store_id,
            meter.mode,
            &meter.id,
            customer,
            minute,
        );
        let mut held = overlay
            .get(&key)?
            .map(|bytes| codec::decode_latest(&bytes))
            .transpose()?;
        if keep_latest(&mut held, &point) {
            overlay.put(key, codec::encode_latest(&point));
        }
    }
    Ok(())
}

/// Old points of a time-weighted series pruned per event folded: bounds the work
/// of one event; a series is pruned down over the events that follow.
pub const WEIGHTED_PRUNE_PER_EVENT: usize = 64;

/// How long a time-weighted point is kept, counted back from the receipt of the
/// event being folded: any event that may still be voided (received within the
/// stored-event retention, its timestamp at most the oldest ingestible age before
/// that) keeps its point and its predecessor's, which a void needs.
pub const WEIGHTED_POINTS_RETENTION_MS: i64 = STORED_EVENTS_RETENTION_MS + MAX_EVENT_AGE_MS;

/// Deletes the points older than `before_key` (the point an event was folded after)
/// when that point lies before the retention cut of `received_ms`: every event
/// folded later (ingested, or backfilled from stored events) is newer than the cut,
/// so its predecessor is `before_key` or later, and the older points are never read
/// again; nor does a void, which only reaches events within the retention. The
/// buckets keep their integral; only the lookup table shrinks.
fn prune_weighted_points(
    overlay: &mut Overlay<'_>,
    prefix: &[u8],
    before_key: &[u8],
    received_ms: i64,
) -> Result<(), EngineError> {
    let cut = received_ms.saturating_sub(WEIGHTED_POINTS_RETENTION_MS);
    if keys::weighted_point_timestamp(prefix, before_key)? >= cut {
        return Ok(());
    }
    for (old, _) in overlay.first_entries(prefix, WEIGHTED_PRUNE_PER_EVENT)? {
        if old.as_slice() >= before_key {
            break;
        }
        overlay.delete(old);
    }
    Ok(())
}

/// `time_weighted_sum`: the event changes the held value by its value minus the
/// value of the customer's event just before it in time, and its successor's change
/// by the opposite (domain `gauge`). Per customer and for all customers.
pub(crate) fn fold_weighted(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    value: Decimal,
) -> Result<(), EngineError> {
    let (store_id, mode, meter_id) = (&meter.store_id, meter.mode, &meter.id);
    let prefix = keys::weighted_points_prefix(store_id, mode, meter_id, &event.customer_id);
    let key = keys::weighted_point_key(&prefix, event.timestamp_ms, &event.event_id);
    let around = overlay.neighbours(&prefix, &key)?;
    let before = match &around.before {
        Some((before_key, bytes)) => {
            prune_weighted_points(overlay, &prefix, before_key, event.received_at_ms)?;
            codec::decode_decimal(bytes)?
        }
        None => Decimal::ZERO,
    };
    let change = value.checked_sub(before);
    let successor = match &around.after {
        Some((next, _)) => Some((
            keys::weighted_point_timestamp(&prefix, next)?,
            change.map(|c| -c),
        )),
        None => None,
    };
    let own = (event.timestamp_ms, change);
    match successor {
        Some(next) => add_weighted_changes(overlay, meter, &event.customer_id, &[own, next])?,
        None => add_weighted_changes(overlay, meter, &event.customer_id, &[own])?,
    }
    overlay.put(key, codec::encode_decimal(value));
    Ok(())
}

/// Adds changes of a customer's held value, each at its instant (`None`: it did
/// not fit 28 digits, and the bucket says so), to the `time_weighted_sum` buckets of
/// their minutes, the customer's and the all-customers one (domain `gauge`).
pub fn add_weighted_changes(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    customer: &str,
    changes: &[(i64, Option<Decimal>)],
) -> Result<(), EngineError> {
    for (at_ms, change) in changes {
        for slot in [customer, ALL_CUSTOMERS] {
            let bucket_key = BucketKey::from_minute(
                keys::WEIGHTED,
                &meter.store_id,
                meter.mode,
                &meter.id,
                slot,
                minute_bucket(*at_ms),
            );
            let mut bucket = overlay
                .get(&bucket_key)?
                .map(|bytes| codec::decode_weighted(&bytes))
                .transpose()?
                .unwrap_or_default();
            match change {
                Some(change) => bucket.add_change(offset_in_minute(*at_ms), *change),
                None => bucket.overflowed = true,
            }
            overlay.put(bucket_key, codec::encode_weighted(&bucket));
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
    // A voided event counts nowhere, in a meter backfilled later included.
    if overlay.contains(&keys::voided_event_key(
        &meter.store_id,
        meter.mode,
        &event.event_id,
    ))? {
        return Ok(());
    }
    let marker = keys::backfilled_key(&meter.store_id, meter.mode, &meter.id, &event.event_id);
    if overlay.contains(&marker)? {
        return Ok(());
    }
    overlay.put(marker, Vec::new());
    fold_event(overlay, meter, event).map(drop)
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
            Ok(batch) => {
                for (index, _) in &stored {
                    if let Some(event) = batch.event(*index)? {
                        events.push(event.clone());
                    }
                }
            }
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

/// Deletes the `F` rows received before the retention cut of `received_ms` (whole
/// hours; the cut reached is stored, so live, restarted and replayed projections
/// prune at the same records). Runs between records, never rolled back.
pub fn prune_stored_events(overlay: &mut Overlay<'_>, received_ms: i64) -> Result<(), EngineError> {
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
    prune_minute_rows(overlay, cut)?;
    overlay.put(mark, Key::table(0).int(cut).into_bytes()[1..].to_vec());
    overlay.keep();
    Ok(())
}

/// Deletes the `z` rows no void can need any more: an event of a minute is received
/// at most the oldest ingestible age after it, and can be voided until the
/// stored-event retention after its receipt, whose cut is `stored_cut_ms`. The
/// rows are ordered by minute first, so this reads little more than it deletes.
fn prune_minute_rows(overlay: &mut Overlay<'_>, stored_cut_ms: i64) -> Result<(), EngineError> {
    let before = minute_bucket(
        stored_cut_ms
            .saturating_sub(MAX_EVENT_AGE_MS)
            .saturating_sub(tally_domain::time::MINUTE_MS),
    );
    // A minute's revision rows go with its `z` rows: only a rebuild reads them.
    type MinuteOf = fn(&[u8]) -> Result<i64, EngineError>;
    let tables: [(u8, MinuteOf); 2] = [
        (keys::MINUTE_EVENTS, keys::minute_events_minute),
        (keys::REVISED_MINUTE, keys::revised_minute_minute),
    ];
    for (table, minute_of) in tables {
        loop {
            let rows = overlay.first_entries(&[table], MINUTE_ROWS_PRUNE_STEP)?;
            let fetched = rows.len();
            let mut deleted = 0;
            for (key, _) in rows {
                if minute_of(&key)? >= before {
                    break;
                }
                overlay.delete(key);
                deleted += 1;
            }
            if deleted < MINUTE_ROWS_PRUNE_STEP || fetched == 0 {
                break;
            }
        }
    }
    Ok(())
}

/// `z` rows read per step of their pruning (bounds one read's memory).
const MINUTE_ROWS_PRUNE_STEP: usize = 4_096;

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
