//! Voiding stored usage events (docs/api.md, "Voiding events"): the service checks
//! the request and appends one `EventsVoided` record; apply decides it in log order
//! and takes the events out of every meter they counted in, exactly.
//!
//! How a void subtracts (ARCHITECTURE.md, "Voids"):
//! - `count`, `sum` and `average` are sums: the event's buckets (its customer's and
//!   the meter-wide one) subtract its contribution; so do `min`, `max` and `latest`
//!   when the event is not the bucket's extreme or held point (its value then
//!   stays).
//! - A customer's bucket that held the event alone (the minute's `z` rows name no
//!   other event of the customer) is emptied without being read.
//! - `unique`, the meter-wide bucket: when the `z` rows' prints of distinct values
//!   show that no other event of the minute may hold the event's value, the value
//!   leaves the bucket and the event is subtracted, without reading records back.
//! - Otherwise a fold cannot be undone: a customer's bucket is rebuilt from its
//!   events that remain, read back from the log through the `z` rows (per minute,
//!   each usage record's events in it with their customer), and the meter-wide
//!   bucket is rebuilt from the minute's events when reading their records costs
//!   less than reading every customer's bucket of the minute (few records, or many
//!   customers per record), else by merging those buckets.
//! - `time_weighted_sum` is linear in the changes of the held value: the event's
//!   change is taken out and its successor's grows by as much (domain `gauge`).
//!
//! What a voided event had added to a meter that usage prices settle in credits
//! (`count` and `sum`) is handed back to the caller (`Uncounted`), with the record
//! that stored the event: billing takes it back from the period's usage and gives
//! back the credits it cost (docs/api.md, "Usage prices settled in credits").
//!
//! Which meters an event counted in is a function of what is stored: the meters
//! matched at ingest that were active and counting at its timestamp (a `_` row
//! marks one that was not active), and those a backfill folded it into (`B` rows);
//! for a revised meter, what its definition matches (docs/api.md, "Meter
//! revisions").

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tally_core::codec::{self, DistinctPrint, VoidMark};
use tally_core::error::EngineError;
use tally_core::event_index::{EventIndex, EventLocation};
use tally_core::keys::{self, BucketKey, Key, ALL_CUSTOMERS};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Fetched, Overlay};
use tally_core::Scope;
use tally_domain::aggregate::{Aggregate, Contribution};
use tally_domain::exact::exact_add;
use tally_domain::gauge::{keep_latest, LatestPoint};
use tally_domain::limits::{MAX_EVENT_ID_CHARS, MAX_REASON_CHARS};
use tally_domain::meter::{Aggregation, Meter};
use tally_domain::record::Record;
use tally_domain::time::minute_bucket;
use tally_domain::usage::UsageEvent;
use tally_domain::{FieldError, Mode};
use tally_projection::warm::WarmRead;
use tally_projection::ProjectionStore;

use crate::apply::{add_weighted_changes, contribution_of, fold_contribution, fold_weighted};
use crate::charged;
pub use crate::charged::was_folded;
use crate::recent::RecentRecords;
use crate::Metering;

/// Event ids one void may name: one log record, and a bounded rebuild.
pub const MAX_VOID_EVENTS: usize = 100;

/// Ids a void confirms per read of the log: a request of `MAX_VOID_EVENTS` is
/// read in four slices, so the rows of a slice's events are read ahead while the
/// next slice's records are read.
pub const CONFIRM_SLICE_IDS: usize = 25;

/// Records (of up to 100 events each) a minute's events may always lie in for its
/// all-customers bucket to be rebuilt from them, however few customers they hold:
/// one or two records cost less than any merge.
pub const REBUILD_FROM_EVENTS_MAX_RECORDS: usize = 4;

/// Customers' buckets that reading one record back from the log is worth, when a
/// minute's all-customers bucket is rebuilt: a record of 100 events is one read of
/// the log (which the page cache holds) and a decode of ~100-200 µs, while merging
/// reads each customer's bucket (two or three reads of the store, from a few µs
/// when cached to far more in a large store whose rows the caches do not hold).
/// A minute of a spread history (a few hundred events of as many customers in a
/// few records) is rebuilt from its events; a busy live minute (thousands of
/// records of 10,000 customers) by merging.
pub const CUSTOMERS_PER_RECORD_READ: usize = 8;

/// The record's content, as apply reads it.
#[derive(Debug, Clone, Copy)]
pub struct VoidStep<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub event_ids: &'a [String],
    pub reason: &'a str,
    /// The record's time: the void's `voided_at`.
    pub at_ms: i64,
    pub partition: u32,
    pub offset: u64,
    /// Stop once the records the rebuilds read back are known: the request side's
    /// run (`rebuild_records`) wants only those, and a rebuild that reads none (a
    /// merge of customers' buckets) is apply's work, not to be done twice.
    pub plan_only: bool,
}

/// What a voided event had added to one meter that settlement can charge (1 for a
/// `count` meter, the value for a `sum` meter), and where the record that stored
/// it lies.
#[derive(Debug, Clone, PartialEq)]
pub struct Uncounted {
    pub customer_id: tally_domain::ids::CustomerId,
    pub meter_id: tally_domain::ids::MeterId,
    pub timestamp_ms: i64,
    /// Units taken back; negative for units to charge (a revision's correction of
    /// an event the new definition charges more for).
    pub quantity: rust_decimal::Decimal,
    /// The storing record's (partition, offset).
    pub stored_by: (u32, u64),
}

/// `EventsVoided`: every id must name a stored event of the scope (else nothing is
/// voided); those not voided before are marked and taken out of their meters. With
/// `uncounted`, what they had added to meters settlement charges is noted there.
pub fn apply_void(
    overlay: &mut Overlay<'_>,
    step: VoidStep<'_>,
    mut uncounted: Option<&mut Vec<Uncounted>>,
) -> Result<(), ApplyError> {
    let VoidStep { store_id, mode, .. } = step;
    let mut fresh = Vec::new();
    let mut stored_by = Vec::new();
    let mut seen = BTreeSet::new();
    for (at, event_id) in step.event_ids.iter().enumerate() {
        if !seen.insert(event_id.as_str()) {
            continue;
        }
        let Some((event, location)) = overlay.stored_event_at(store_id, mode, event_id)? else {
            return Err(event_not_found(event_id, at).into());
        };
        if !overlay.contains(&keys::voided_event_key(store_id, mode, event_id))? {
            fresh.push(event);
            stored_by.push((location.partition, location.offset));
        }
    }
    let mark = codec::encode_void(&VoidMark {
        voided_at_ms: step.at_ms,
        partition: step.partition,
        offset: step.offset,
        reason: step.reason.to_string(),
    });
    for event in &fresh {
        overlay.put(
            keys::voided_event_key(store_id, mode, &event.event_id),
            mark.clone(),
        );
    }
    let meters = scope_meters(overlay, store_id, mode)?;
    warm_void(overlay, store_id, mode, &meters, &fresh);
    let mut minutes = MinuteEvents::default();
    // Events that are their customer's only one of the minute (most, in a long
    // history): their customer's buckets held them alone and are emptied without
    // being read; the others' are read ahead now.
    let mut alone = Vec::with_capacity(fresh.len());
    for event in &fresh {
        alone.push(minutes.alone(overlay, store_id, mode, event)?);
    }
    let shared: Vec<&UsageEvent> = fresh
        .iter()
        .zip(&alone)
        .filter(|(_, alone)| !**alone)
        .map(|(event, _)| event)
        .collect();
    warm_customer_buckets(overlay, &meters, &shared);
    // The `unique` meters whose every counted event has prints: those of the
    // meter's one definition, unless a backfill folded events (they have none).
    let printed: Vec<bool> = meters
        .iter()
        .map(|meter| {
            let voided = fresh.iter().any(|e| e.name == meter.event_name);
            Ok(voided
                && meter.aggregation == Aggregation::Unique
                && meter.revision == 1
                && !has_backfilled(overlay, meter)?)
        })
        .collect::<Result<_, EngineError>>()?;
    // Buckets to rebuild, each once: customers' (meter, customer, minute) first,
    // then the all-customers ones (meter, minute), which merge the customers'.
    let mut customer_rebuilds: BTreeSet<(usize, String, i64)> = BTreeSet::new();
    let mut all_rebuilds: BTreeSet<(usize, i64)> = BTreeSet::new();
    // Each revised meter's definitions, read once: what its events were charged by.
    let mut definitions: HashMap<usize, Option<codec::MeterDefinitions>> = HashMap::new();
    for ((event, alone), stored_by) in fresh.iter().zip(&alone).zip(&stored_by) {
        let minute = minute_bucket(event.timestamp_ms);
        for (at, meter) in meters.iter().enumerate() {
            if meter.event_name != event.name {
                continue;
            }
            // What settlement charged for the event: by the definition it was
            // charged by, which a revision not yet through its minute has changed.
            if let (Some(out), true) = (uncounted.as_deref_mut(), charged::is_charged(meter)) {
                let known = match definitions.entry(at) {
                    std::collections::hash_map::Entry::Occupied(known) => known.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(charged::kept_definitions(overlay, meter)?)
                    }
                };
                let revision = match meter.revision > 1 {
                    true => charged::minute_revision(overlay, meter, minute)?,
                    false => 0,
                };
                let was = charged::charged_by(meter, known, revision, *stored_by);
                let quantity = charged::charged_units(overlay, was, event)?;
                if quantity > rust_decimal::Decimal::ZERO {
                    out.push(Uncounted {
                        customer_id: event.customer_id.clone(),
                        meter_id: meter.id.clone(),
                        timestamp_ms: event.timestamp_ms,
                        quantity,
                        stored_by: *stored_by,
                    });
                }
            }
            if !was_folded(overlay, meter, event)? {
                continue;
            }
            count_voided(overlay, meter, event, minute)?;
            if meter.aggregation == Aggregation::TimeWeightedSum {
                unfold_weighted(overlay, meter, event)?;
                continue;
            }
            let unique = meter.aggregation == Aggregation::Unique;
            // Whether the event's value has other holders, looked up once for both
            // of its `unique` buckets.
            let value = match unique && printed[at] {
                true => distinct_value_alone(overlay, &mut minutes, meter, event)?,
                false => DistinctValue::Unknown,
            };
            let subtracted = if *alone && (!unique || meter.revision == 1) {
                empty_customer_bucket(overlay, meter, &event.customer_id, minute)?;
                true
            } else if unique {
                subtract_distinct(overlay, meter, &value, &event.customer_id, minute)?
            } else {
                subtract(overlay, meter, event, minute, &event.customer_id)?
            };
            if !subtracted {
                customer_rebuilds.insert((at, event.customer_id.to_string(), minute));
            }
            let subtracted = if unique {
                subtract_distinct(overlay, meter, &value, ALL_CUSTOMERS, minute)?
            } else {
                subtract(overlay, meter, event, minute, ALL_CUSTOMERS)?
            };
            if !subtracted {
                all_rebuilds.insert((at, minute));
            }
        }
    }
    // Every record the rebuilds read: the customers', and the whole minute's where
    // the all-customers bucket is rebuilt from its events. Asked for only now: most
    // voids rebuild nothing, and a chunk that lacks records is applied again, which
    // costs less than reading a minute's records that were not needed.
    let mut wanted = Vec::new();
    for (_, customer, minute) in &customer_rebuilds {
        wanted.extend(minutes.of(overlay, store_id, mode, *minute, customer)?);
    }
    for (_, minute) in &all_rebuilds {
        if let Some(all) = minutes.rebuild_from_events(overlay, store_id, mode, *minute)? {
            wanted.extend(all);
        }
    }
    fetch(overlay, &wanted)?;
    if step.plan_only {
        return Ok(());
    }
    for (at, customer, minute) in &customer_rebuilds {
        let locations = minutes.of(overlay, store_id, mode, *minute, customer)?;
        rebuild_customer(overlay, &meters[*at], customer, *minute, &locations)?;
    }
    for (at, minute) in &all_rebuilds {
        rebuild_minute_total(overlay, &mut minutes, &meters[*at], *minute)?;
    }
    Ok(())
}

/// Reads ahead, several at once, the rows a void of `events` reads first: each
/// event's minute (`z` rows, which say whether the event is its customer's only
/// one) and its meter-wide bucket in every meter of its name (the meter-wide `U`
/// keys are deleted by value, not read, except by a merge or a revised meter's
/// rebuild, which are left to read them). In a long history these are scattered
/// disk reads, most of a void's time when made one after another.
fn warm_void(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    meters: &[Meter],
    events: &[UsageEvent],
) {
    let mut reads = void_reads(store_id, mode, meters, events);
    overlay.warm(&mut reads);
}

/// What `warm_void` reads for `events`.
fn void_reads(
    store_id: &str,
    mode: Mode,
    meters: &[Meter],
    events: &[UsageEvent],
) -> Vec<WarmRead> {
    let mut reads = Vec::new();
    for event in events {
        let minute = minute_bucket(event.timestamp_ms);
        reads.push(WarmRead::Prefix(keys::minute_events_prefix(
            minute, store_id, mode,
        )));
        push_bucket_reads(&mut reads, meters, &event.name, ALL_CUSTOMERS, minute);
    }
    reads
}

/// Reads ahead the customer buckets a void of `events` still reads: those of
/// events that are not their customer's only one of the minute (the others'
/// buckets are emptied unread).
fn warm_customer_buckets(overlay: &Overlay<'_>, meters: &[Meter], events: &[&UsageEvent]) {
    let mut reads = Vec::new();
    for event in events {
        let minute = minute_bucket(event.timestamp_ms);
        push_bucket_reads(&mut reads, meters, &event.name, &event.customer_id, minute);
    }
    overlay.warm(&mut reads);
}

/// The rows of `slot`'s buckets in `minute` a void of an event named `event_name`
/// reads, in every meter of that name: their aggregates, the points of `latest`
/// meters, and a customer's sets of `unique` ones (the meter-wide bucket has
/// none). The store keeps each of these tables' buckets of one slot and minute,
/// every meter's, in one row (`keys::BUCKET_ROW_TABLES`), so one key per table
/// reads the row: a key per meter made the warm threads read the same row several
/// times at once.
fn push_bucket_reads(
    reads: &mut Vec<WarmRead>,
    meters: &[Meter],
    event_name: &str,
    slot: &str,
    minute: i64,
) {
    let named = || meters.iter().filter(|m| m.event_name == event_name);
    let wanted = [
        (keys::AGGREGATE, named().next()),
        (
            keys::LATEST,
            named().find(|m| m.aggregation == Aggregation::Latest),
        ),
        (
            keys::DISTINCT_SET,
            named().find(|m| m.aggregation == Aggregation::Unique && slot != ALL_CUSTOMERS),
        ),
    ];
    for (table, meter) in wanted {
        if let Some(meter) = meter {
            reads.push(WarmRead::Key(BucketKey::of_meter(
                table, meter, slot, minute,
            )));
        }
    }
}

/// Empties a customer's bucket of `meter` in `minute` that held only the event
/// being voided, without reading it: its aggregate, its point (`latest`) and its
/// values (`unique`: a set of one value, never past the inline set).
fn empty_customer_bucket(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    customer: &str,
    minute: i64,
) -> Result<(), EngineError> {
    let bucket = |table| BucketKey::of_meter(table, meter, customer, minute);
    overlay.empty_aggregate(bucket(keys::AGGREGATE))?;
    match meter.aggregation {
        Aggregation::Latest => overlay.delete(bucket(keys::LATEST)),
        Aggregation::Unique => overlay.empty_distinct(bucket(keys::DISTINCT_SET))?,
        _ => {}
    }
    Ok(())
}

/// One more event of the customer's `minute` that `meter` no longer counts (the
/// `'` row a correction line of billed usage names).
fn count_voided(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    minute: i64,
) -> Result<(), EngineError> {
    let key = keys::voided_count_key(
        &meter.store_id,
        meter.mode,
        &meter.id,
        &event.customer_id,
        minute,
    );
    let count = match overlay.get(&key)? {
        Some(bytes) => codec::decode_count(&bytes)?,
        None => 0,
    };
    // A minute holds far fewer than u64::MAX events: saturating never bites.
    overlay.put(key, codec::encode_count(count.saturating_add(1)));
    Ok(())
}

/// Asks for the records at `locations` that neither the chunk nor its fetch holds.
pub(crate) fn fetch(overlay: &Overlay<'_>, locations: &[EventLocation]) -> Result<(), EngineError> {
    let mut missing = Vec::new();
    for location in locations {
        if let Err(EngineError::RecordsNeeded(more)) =
            overlay.batch_at(location.partition, location.offset)
        {
            missing.extend(more);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    missing.sort_unstable();
    missing.dedup();
    Err(EngineError::RecordsNeeded(missing))
}

/// Rebuilds the all-customers bucket of `meter` in `minute`, after its customers'
/// buckets are right: from the minute's events when that reads less
/// (`rebuild_from_events`), else by merging the customers' buckets.
pub(crate) fn rebuild_minute_total(
    overlay: &mut Overlay<'_>,
    minutes: &mut MinuteEvents,
    meter: &Meter,
    minute: i64,
) -> Result<(), EngineError> {
    let (store_id, mode) = (meter.store_id.as_str(), meter.mode);
    match minutes.rebuild_from_events(overlay, store_id, mode, minute)? {
        Some(all) => rebuild_customer(overlay, meter, ALL_CUSTOMERS, minute, &all),
        None => {
            let customers = minutes.customers(overlay, store_id, mode, minute)?;
            rebuild_all(overlay, meter, minute, &customers)
        }
    }
}

/// `EventAmended`: the event must be stored and not voided, and the replacement's id
/// new (else nothing is applied); the event is voided as `apply_void` does, then
/// the replacement is stored and folded as a usage record's event at index 0 of this
/// record. `settle` collects, when given, what the voided event had added to meters
/// settlement charges, and what the replacement adds (`counted`, at index 0).
pub fn apply_amend(
    overlay: &mut Overlay<'_>,
    step: VoidStep<'_>,
    replacement: &UsageEvent,
    matched_below: Option<u64>,
    settle: Option<(&mut Vec<Uncounted>, &mut Vec<crate::apply::Counted>)>,
) -> Result<(), ApplyError> {
    let VoidStep { store_id, mode, .. } = step;
    let [event_id] = step.event_ids else {
        return Err(Outcome::rejected("parameter_invalid", "an amendment names one event").into());
    };
    let Some(event) = overlay.stored_event(store_id, mode, event_id)? else {
        return Err(amended_not_found(event_id).into());
    };
    if overlay.contains(&keys::voided_event_key(store_id, mode, event_id))? {
        return Err(event_voided(event_id).into());
    }
    if replacement.customer_id != event.customer_id {
        return Err(Outcome::rejected(
            "parameter_invalid",
            "a replacement keeps the amended event's customer",
        )
        .with_param("event.customer_id")
        .into());
    }
    if overlay
        .stored_event(store_id, mode, &replacement.event_id)?
        .is_some()
    {
        return Err(event_id_taken(&replacement.event_id).into());
    }
    let (uncounted, counted) = match settle {
        Some((uncounted, counted)) => (Some(uncounted), Some(counted)),
        None => (None, None),
    };
    apply_void(overlay, step, uncounted)?;
    crate::apply::apply_usage_batch(
        overlay,
        store_id,
        mode,
        std::slice::from_ref(replacement),
        (step.partition, step.offset),
        matched_below,
        counted,
    )
}

/// An amendment of an event that is not stored.
pub fn amended_not_found(event_id: &str) -> Outcome {
    Outcome::rejected(
        "event_not_found",
        format!("no stored event '{event_id}' in this environment; nothing was amended"),
    )
    .with_param("event_id")
}

/// An amendment of an event already voided (by a void, or an earlier amendment).
pub fn event_voided(event_id: &str) -> Outcome {
    Outcome::rejected(
        "event_voided",
        format!("event '{event_id}' is voided; a voided event cannot be amended"),
    )
}

/// An amendment whose replacement names an id a stored event holds (voided ones
/// included: an id is never reused).
pub fn event_id_taken(event_id: &str) -> Outcome {
    Outcome::rejected(
        "event_id_taken",
        format!("event id '{event_id}' is taken by a stored event (voided ones included); give a new one, or none to have one assigned"),
    )
    .with_param("event.event_id")
}

/// The `z` rows of the minutes a void touches, read once each: every stored event
/// of the minute, with its customer.
#[derive(Default)]
pub(crate) struct MinuteEvents {
    minutes: HashMap<i64, Minute>,
}

/// One minute's stored events, and whether its all-customers bucket is rebuilt
/// from them (decided once: a void asks it per event and per bucket it rebuilds).
struct Minute {
    events: Vec<(EventLocation, String)>,
    /// Each event's prints of distinct values (`None`: its row predates prints).
    prints: Vec<Option<Vec<DistinctPrint>>>,
    from_events: Option<bool>,
}

impl MinuteEvents {
    fn load(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        minute: i64,
    ) -> Result<&mut Minute, EngineError> {
        Ok(match self.minutes.entry(minute) {
            std::collections::hash_map::Entry::Occupied(slot) => slot.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let mut events = Vec::new();
                let mut prints = Vec::new();
                let prefix = keys::minute_events_prefix(minute, store_id, mode);
                for (key, row) in overlay.prefix_entries(&prefix)? {
                    let (partition, offset) = keys::minute_events_position(&key)?;
                    for event in codec::decode_minute_events(&row)? {
                        let location = EventLocation {
                            partition,
                            offset,
                            index: event.index,
                        };
                        events.push((location, event.customer));
                        prints.push(event.prints);
                    }
                }
                slot.insert(Minute {
                    events,
                    prints,
                    from_events: None,
                })
            }
        })
    }

    /// Whether `event` is its customer's only stored event of its minute: the
    /// minute's `z` rows name one event of the customer, and it is this one (its
    /// record, read back for the void, says so). Then every bucket of the customer
    /// in that minute held this event alone.
    pub(crate) fn alone(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        event: &UsageEvent,
    ) -> Result<bool, EngineError> {
        let minute = minute_bucket(event.timestamp_ms);
        let [location] = self.of(overlay, store_id, mode, minute, &event.customer_id)?[..] else {
            return Ok(false);
        };
        let batch = overlay.batch_at(location.partition, location.offset)?;
        Ok(batch
            .event(location.index)?
            .is_some_and(|held| held.event_id == event.event_id))
    }

    /// Whether `event` is the only event of its minute whose prints hold `print` (of
    /// its value in a `unique` meter): then no other event of the minute holds the
    /// value, and it leaves the meter-wide bucket with the event. False when a row
    /// of the minute has no prints, another event holds the print (the same value,
    /// or a collision), or the one holder is not known to be this event.
    pub(crate) fn holds_alone(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        event: &UsageEvent,
        print: DistinctPrint,
    ) -> Result<bool, EngineError> {
        let minute = self.load(overlay, store_id, mode, minute_bucket(event.timestamp_ms))?;
        let mut holder = None;
        for ((location, _), prints) in minute.events.iter().zip(&minute.prints) {
            let Some(prints) = prints else {
                return Ok(false);
            };
            if prints.contains(&print) {
                if holder.is_some() {
                    return Ok(false);
                }
                holder = Some(*location);
            }
        }
        let Some(location) = holder else {
            return Ok(false);
        };
        // The voided event's own record is at hand (the void read it); another
        // record is not, and then the bucket is rebuilt.
        Ok(
            match overlay.batch_at(location.partition, location.offset) {
                Ok(batch) => batch
                    .event(location.index)?
                    .is_some_and(|held| held.event_id == event.event_id),
                Err(EngineError::RecordsNeeded(_)) => false,
                Err(error) => return Err(error),
            },
        )
    }

    /// Where the minute's events of `customer` are.
    pub(crate) fn of(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        minute: i64,
        customer: &str,
    ) -> Result<Vec<EventLocation>, EngineError> {
        Ok(self
            .load(overlay, store_id, mode, minute)?
            .events
            .iter()
            .filter(|(_, c)| c == customer)
            .map(|(location, _)| *location)
            .collect())
    }

    /// Every stored event of the minute, when rebuilding its all-customers bucket
    /// from them costs less than merging its customers' buckets: they lie in at
    /// most `REBUILD_FROM_EVENTS_MAX_RECORDS` records, or in few enough for their
    /// customers (`CUSTOMERS_PER_RECORD_READ` per record); `None` otherwise.
    pub(crate) fn rebuild_from_events(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        minute: i64,
    ) -> Result<Option<Vec<EventLocation>>, EngineError> {
        let minute = self.load(overlay, store_id, mode, minute)?;
        let events = &minute.events;
        let cheaper = *minute.from_events.get_or_insert_with(|| {
            let records: BTreeSet<(u32, u64)> = events
                .iter()
                .map(|(l, _)| (l.partition, l.offset))
                .collect();
            records.len() <= REBUILD_FROM_EVENTS_MAX_RECORDS || {
                let customers: BTreeSet<&str> = events.iter().map(|(_, c)| c.as_str()).collect();
                records.len().saturating_mul(CUSTOMERS_PER_RECORD_READ) <= customers.len()
            }
        });
        Ok(cheaper.then(|| events.iter().map(|(location, _)| *location).collect()))
    }

    /// The customers with stored events in the minute.
    pub(crate) fn customers(
        &mut self,
        overlay: &Overlay<'_>,
        store_id: &str,
        mode: Mode,
        minute: i64,
    ) -> Result<BTreeSet<String>, EngineError> {
        Ok(self
            .load(overlay, store_id, mode, minute)?
            .events
            .iter()
            .map(|(_, customer)| customer.clone())
            .collect())
    }
}

fn event_not_found(event_id: &str, at: usize) -> Outcome {
    Outcome::rejected(
        "event_not_found",
        format!(
            "no stored event '{event_id}' in this environment (an event can be voided while GET /v1/events/{{event_id}} returns it); nothing was voided"
        ),
    )
    .with_param(&format!("event_ids[{at}]"))
}

/// Every meter of a scope, archived ones included (they keep their usage).
fn scope_meters(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
) -> Result<Vec<Meter>, EngineError> {
    overlay
        .prefix_entries(&Key::scoped(keys::METER, store_id, mode).into_bytes())?
        .values()
        .map(|bytes| codec::decode_meter(bytes))
        .collect()
}

/// Takes an event out of a bucket of its minute (`slot`: its customer's, or
/// `ALL_CUSTOMERS`) by subtraction, where that is exact: always for `count`, `sum`
/// and `average`; for `min`, `max` and `latest` when the event is not the bucket's
/// extreme or held point (the bucket's value stays, its counts drop), which in a
/// busy bucket is nearly always. `false` when it is, or when the sum overflowed:
/// then the bucket is rebuilt.
fn subtract(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    minute: i64,
    slot: &str,
) -> Result<bool, EngineError> {
    let number = match contribution_of(meter, event) {
        Contribution::Skipped | Contribution::Distinct(_) => return Ok(true),
        Contribution::Event { number } => number,
    };
    if meter.aggregation == Aggregation::Latest {
        let point = BucketKey::of_meter(keys::LATEST, meter, slot, minute);
        let held = overlay
            .get(&point)?
            .map(|bytes| codec::decode_latest(&bytes))
            .transpose()?;
        if held.is_none_or(|held| held.event_id == event.event_id) {
            return Ok(false);
        }
    }
    let key = BucketKey::of_meter(keys::AGGREGATE, meter, slot, minute);
    let bucket = overlay.aggregate_mut(key)?;
    let extreme = match meter.aggregation {
        Aggregation::Min => bucket.min,
        Aggregation::Max => bucket.max,
        _ => None,
    };
    if bucket.overflowed || (extreme.is_some() && extreme == number) {
        return Ok(false);
    }
    let events = bucket.events.checked_sub(1);
    let (numeric_events, sum) = match number {
        Some(n) => (
            bucket.numeric_events.checked_sub(1),
            exact_add(bucket.sum, -n),
        ),
        None => (Some(bucket.numeric_events), Some(bucket.sum)),
    };
    match (events, numeric_events, sum) {
        // Its last event gone, the bucket is empty (and not stored).
        (Some(0), _, _) => {
            *bucket = Aggregate::default();
            Ok(true)
        }
        (Some(events), Some(numeric_events), Some(sum)) => {
            bucket.events = events;
            bucket.numeric_events = numeric_events;
            bucket.sum = sum;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// What a voided event's value is to a `unique` meter's buckets of its minute.
enum DistinctValue {
    /// The event had no value to count: folding left the buckets as they were.
    Skipped,
    /// No other event of the minute may hold it (`MinuteEvents::holds_alone`).
    Alone(String),
    /// Not known (another holder, a row without prints, a record not at hand):
    /// the buckets are rebuilt.
    Unknown,
}

fn distinct_value_alone(
    overlay: &Overlay<'_>,
    minutes: &mut MinuteEvents,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<DistinctValue, EngineError> {
    let value = match contribution_of(meter, event) {
        Contribution::Distinct(value) => value,
        Contribution::Skipped => return Ok(DistinctValue::Skipped),
        Contribution::Event { .. } => return Ok(DistinctValue::Unknown),
    };
    let print = DistinctPrint::of(&meter.id, value.as_bytes());
    Ok(
        match minutes.holds_alone(overlay, &meter.store_id, meter.mode, event, print)? {
            true => DistinctValue::Alone(value),
            false => DistinctValue::Unknown,
        },
    )
}

/// `unique`, the bucket of `slot` (a customer, or `ALL_CUSTOMERS`) in `minute`:
/// takes the event out without a rebuild when its value has no other holder
/// (`DistinctValue::Alone`): one event fewer, and its value gone, from a
/// customer's inline set or else from its own `U` key (where it came past a full
/// set; the meter-wide bucket keeps only those). A void in a busy minute, of the
/// customer or of all, then reads none of its other records back. False when that
/// is not known (the bucket is then rebuilt).
fn subtract_distinct(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    value: &DistinctValue,
    slot: &str,
    minute: i64,
) -> Result<bool, EngineError> {
    let value = match value {
        DistinctValue::Alone(value) => value,
        DistinctValue::Skipped => return Ok(true),
        DistinctValue::Unknown => return Ok(false),
    };
    let bucket =
        overlay.aggregate_mut(BucketKey::of_meter(keys::AGGREGATE, meter, slot, minute))?;
    match bucket.events.checked_sub(1) {
        // Its last event gone, the bucket is empty (and not stored).
        Some(0) => *bucket = Aggregate::default(),
        Some(events) => bucket.events = events,
        None => return Ok(false),
    }
    let in_set = slot != ALL_CUSTOMERS
        && overlay.remove_distinct(
            BucketKey::of_meter(keys::DISTINCT_SET, meter, slot, minute),
            value.as_bytes(),
        )?;
    if !in_set {
        overlay.delete(BucketKey::distinct(
            &meter.store_id,
            meter.mode,
            &meter.id,
            slot,
            minute,
            value,
        ));
    }
    Ok(true)
}

/// Whether a backfill folded any event into `meter` (a `B` row; one short read).
fn has_backfilled(overlay: &Overlay<'_>, meter: &Meter) -> Result<bool, EngineError> {
    let prefix = keys::backfilled_prefix(&meter.store_id, meter.mode, &meter.id);
    Ok(!overlay.first_entries(&prefix, 1)?.is_empty())
}

/// Rebuilds a customer's bucket of `meter` in `minute` from the events that still
/// count in it (`locations`: the customer's events of the minute, already fetched);
/// with `ALL_CUSTOMERS` and every event of the minute, the all-customers bucket.
pub(crate) fn rebuild_customer(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    customer: &str,
    minute: i64,
    locations: &[EventLocation],
) -> Result<(), EngineError> {
    let (store_id, mode, meter_id) = (meter.store_id.as_str(), meter.mode, meter.id.as_str());
    let weighted = meter.aggregation == Aggregation::TimeWeightedSum && customer != ALL_CUSTOMERS;
    let mut events = Vec::with_capacity(locations.len());
    for location in locations {
        let batch = overlay.batch_at(location.partition, location.offset)?;
        match batch.event(location.index)? {
            // Another event name never counted in the meter, nor holds one of its
            // time-weighted points (a meter's event name is fixed).
            Some(event) if event.name != meter.event_name => {}
            Some(event) => events.push((event, contribution_of(meter, event))),
            None => {
                return Err(EngineError::Corrupt(format!(
                    "a minute-events row points at event {} of the record at partition {} offset {}, which has fewer",
                    location.index, location.partition, location.offset
                )))
            }
        }
    }
    let bucket = |table| BucketKey::from_minute(table, store_id, mode, meter_id, customer, minute);
    // Empty the bucket, then fold what remains.
    *overlay.aggregate_mut(bucket(keys::AGGREGATE))? = Aggregate::default();
    if meter.aggregation == Aggregation::Unique {
        // The meter-wide bucket keeps its values as `U` keys only (folding never
        // gives it a set): clearing one would only read a row that is not there.
        if customer != ALL_CUSTOMERS {
            overlay.clear_distinct(bucket(keys::DISTINCT_SET))?;
        }
        if meter.revision > 1 {
            // A revision rebuilds its minutes over several steps: until this one's,
            // the bucket may hold values of the earlier definition, which only a
            // scan finds.
            for key in overlay.prefix_entries(&bucket(keys::UNIQUE))?.into_keys() {
                overlay.delete(key);
            }
        } else {
            // Under the meter's one definition every value the bucket holds is the
            // contribution of one of these events (each folded event has its `z`
            // row): deleting theirs empties it without scanning the store, which
            // was a fifth of a void's apply.
            for (_, contribution) in &events {
                if let Contribution::Distinct(value) = contribution {
                    overlay.delete(BucketKey::distinct(
                        store_id, mode, meter_id, customer, minute, value,
                    ));
                }
            }
        }
    }
    if meter.aggregation == Aggregation::Latest {
        overlay.delete(bucket(keys::LATEST));
    }
    for (event, contribution) in events {
        let counted =
            !overlay.contains(&keys::voided_event_key(store_id, mode, &event.event_id))?
                && was_folded(overlay, meter, event)?;
        if counted {
            let contribution = fold_contribution(overlay, meter, event, contribution, &[customer])?;
            if weighted {
                let value = match contribution {
                    Contribution::Event { number } => number,
                    _ => None,
                };
                set_weighted_point(overlay, meter, event, value)?;
            }
        } else if weighted {
            set_weighted_point(overlay, meter, event, None)?;
        }
    }
    Ok(())
}

/// `time_weighted_sum` (a revision): makes the event's point hold `value` (`None`:
/// no point), taking out the one it holds when that differs. Folds are linear in
/// the points, so the buckets end as if the series had always been this one,
/// whatever order a minute's events are set in; the event's minute is all this
/// touches that is not already its neighbours' (docs/api.md, "Meter revisions").
fn set_weighted_point(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
    value: Option<rust_decimal::Decimal>,
) -> Result<(), EngineError> {
    let prefix =
        keys::weighted_points_prefix(&meter.store_id, meter.mode, &meter.id, &event.customer_id);
    let key = keys::weighted_point_key(&prefix, event.timestamp_ms, &event.event_id);
    let held = overlay
        .get(&key)?
        .map(|bytes| codec::decode_decimal(&bytes))
        .transpose()?;
    if held == value {
        return Ok(());
    }
    unfold_weighted(overlay, meter, event)?;
    if let Some(value) = value {
        fold_weighted(overlay, meter, event, value)?;
    }
    Ok(())
}

/// Rebuilds the all-customers bucket of `meter` in `minute` from the (rebuilt)
/// buckets of the customers with events in it: it is their merge, as folding
/// makes it; `unique` keeps the values some customer still holds.
pub(crate) fn rebuild_all(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    minute: i64,
    customers: &BTreeSet<String>,
) -> Result<(), EngineError> {
    let (store_id, mode, meter_id) = (meter.store_id.as_str(), meter.mode, meter.id.as_str());
    let bucket = |table, customer: &str| {
        BucketKey::from_minute(table, store_id, mode, meter_id, customer, minute)
    };
    let mut total = Aggregate::default();
    let mut latest: Option<LatestPoint> = None;
    let mut values: BTreeSet<Vec<u8>> = BTreeSet::new();
    for customer in customers {
        total.merge(&overlay.aggregate(&bucket(keys::AGGREGATE, customer))?);
        match meter.aggregation {
            Aggregation::Latest => {
                if let Some(bytes) = overlay.get(&bucket(keys::LATEST, customer))? {
                    keep_latest(&mut latest, &codec::decode_latest(&bytes)?);
                }
            }
            Aggregation::Unique => {
                let set = overlay.distinct_values(&bucket(keys::DISTINCT_SET, customer))?;
                values.extend(set.iter().map(<[u8]>::to_vec));
                let prefix = bucket(keys::UNIQUE, customer);
                for key in overlay.prefix_entries(&prefix)?.into_keys() {
                    values.insert(key[prefix.len()..].to_vec());
                }
            }
            _ => {}
        }
    }
    *overlay.aggregate_mut(bucket(keys::AGGREGATE, ALL_CUSTOMERS))? = total;
    match (meter.aggregation, latest) {
        (Aggregation::Latest, Some(point)) => overlay.put(
            bucket(keys::LATEST, ALL_CUSTOMERS),
            codec::encode_latest(&point),
        ),
        (Aggregation::Latest, None) => overlay.delete(bucket(keys::LATEST, ALL_CUSTOMERS)),
        _ => {}
    }
    if meter.aggregation == Aggregation::Unique {
        let prefix = bucket(keys::UNIQUE, ALL_CUSTOMERS);
        let held = overlay.prefix_entries(&prefix)?;
        for key in held.keys() {
            if !values.contains(&key[prefix.len()..]) {
                overlay.delete(key.clone());
            }
        }
        for value in values {
            let mut key = prefix.clone();
            key.extend_from_slice(&value);
            if !held.contains_key(&key) {
                overlay.put(key, Vec::new());
            }
        }
    }
    Ok(())
}

/// Takes a `time_weighted_sum` event out: its change of the held value (its value
/// minus its predecessor's) leaves its minute, and its successor's change grows by
/// as much, per customer and for all customers; its point is deleted.
fn unfold_weighted(
    overlay: &mut Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<(), EngineError> {
    let (store_id, mode, meter_id) = (&meter.store_id, meter.mode, &meter.id);
    let prefix = keys::weighted_points_prefix(store_id, mode, meter_id, &event.customer_id);
    let key = keys::weighted_point_key(&prefix, event.timestamp_ms, &event.event_id);
    let Some(bytes) = overlay.get(&key)? else {
        // No numeric value: it never changed the held value.
        return Ok(());
    };
    let value = codec::decode_decimal(&bytes)?;
    let around = overlay.neighbours(&prefix, &key)?;
    let before = match &around.before {
        Some((_, bytes)) => codec::decode_decimal(bytes)?,
        None => rust_decimal::Decimal::ZERO,
    };
    let change = value.checked_sub(before);
    let mut changes = vec![(event.timestamp_ms, change.map(|c| -c))];
    if let Some((next, _)) = &around.after {
        changes.push((keys::weighted_point_timestamp(&prefix, next)?, change));
    }
    add_weighted_changes(overlay, meter, &event.customer_id, &changes)?;
    overlay.delete(key);
    Ok(())
}

/// What a void request did: the ids it voided, and those voided before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VoidResult {
    pub voided: Vec<String>,
    pub already_voided: Vec<String>,
}

/// A stored event's void, as `GET /v1/events/{id}` shows it.
pub type EventVoid = VoidMark;

/// The ids of a void request, checked: 1 to `MAX_VOID_EVENTS`, each a valid event
/// id; repeats are voided once.
pub fn check_void_request(event_ids: &[String], reason: &str) -> Result<(), FieldError> {
    if event_ids.is_empty() || event_ids.len() > MAX_VOID_EVENTS {
        return Err(FieldError::invalid(
            "event_ids",
            format!("give 1 to {MAX_VOID_EVENTS} event ids"),
        ));
    }
    for (at, id) in event_ids.iter().enumerate() {
        if id.is_empty() || id.chars().count() > MAX_EVENT_ID_CHARS {
            return Err(FieldError::invalid(
                format!("event_ids[{at}]"),
                format!("an event id is 1 to {MAX_EVENT_ID_CHARS} characters"),
            ));
        }
    }
    check_reason(reason)
}

/// The reason of a void or an amendment: 1 to `MAX_REASON_CHARS` characters.
pub fn check_reason(reason: &str) -> Result<(), FieldError> {
    if reason.trim().is_empty() || reason.chars().count() > MAX_REASON_CHARS {
        return Err(FieldError::invalid(
            "reason",
            format!("give a reason of 1 to {MAX_REASON_CHARS} characters"),
        ));
    }
    Ok(())
}

/// A digest of a void record's content: the key its read-back hint is noted under
/// (recent.rs). Two requests of the same content share it; the first planned takes
/// the hint, the other fetches what it lacks as without one.
pub fn void_digest(store_id: &str, mode: Mode, event_ids: &[String], reason: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (store_id, mode, event_ids, reason).hash(&mut hasher);
    hasher.finish()
}

/// The records a void record's plan adds from its hint, if its gateway left one.
pub fn hinted_records(recent: &RecentRecords, record: &Record) -> Vec<(u32, u64)> {
    match record {
        Record::EventsVoided {
            store_id,
            mode,
            event_ids,
            reason,
        } => recent.take_hint(void_digest(store_id, *mode, event_ids, reason)),
        _ => Vec::new(),
    }
}

/// The records beyond the voided events' own (`records`, read by the gateway) that
/// apply of a void of `event_ids` will read back to rebuild buckets: apply itself
/// (`apply_void`), run on the committed projection and dropped, says which it
/// lacks. Only a hint: apply decides again from the projection it then reads.
pub fn rebuild_records(
    store: &dyn ProjectionStore,
    index: &EventIndex,
    records: &Fetched,
    scope: &Scope,
    event_ids: &[String],
) -> Vec<(u32, u64)> {
    let mut overlay = Overlay::new(store, index, records);
    let step = VoidStep {
        store_id: &scope.store_id,
        mode: scope.mode,
        event_ids,
        reason: "",
        at_ms: 0,
        partition: 0,
        offset: 0,
        plan_only: true,
    };
    match apply_void(&mut overlay, step, None) {
        Err(ApplyError::Engine(EngineError::RecordsNeeded(positions))) => positions,
        _ => Vec::new(),
    }
}

impl Metering {
    /// `POST /v1/events/void`: every id must be a stored event of the scope (the
    /// first that is not is a 404 naming it, and nothing is voided). Decided in
    /// apply; the answer says which ids this request voided.
    pub async fn void_events(
        &self,
        scope: &Scope,
        event_ids: &[String],
        reason: &str,
    ) -> Result<VoidResult, EngineError> {
        check_void_request(event_ids, reason)?;
        self.confirm_and_warm(scope, event_ids, reason).await?;
        let record = Record::EventsVoided {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            event_ids: event_ids.to_vec(),
            reason: reason.to_string(),
        };
        let (_, (partition, offset)) = self.journal.append_and_decide_at(&record).await?;
        let mut result = VoidResult::default();
        let mut seen = BTreeSet::new();
        for event_id in event_ids {
            if !seen.insert(event_id.as_str()) {
                continue;
            }
            let mine = self
                .event_void(scope, event_id)?
                .is_some_and(|mark| (mark.partition, mark.offset) == (partition, offset));
            if mine {
                result.voided.push(event_id.clone());
            } else {
                result.already_voided.push(event_id.clone());
            }
        }
        Ok(result)
    }

    /// Checks that every id is a stored event of the scope (the first that is not
    /// is a 404 naming it), a slice of `CONFIRM_SLICE_IDS` ids at a time, and
    /// while a slice's records are read from the log, reads ahead the rows apply
    /// will read first for the slices before it (`warm_void`'s): in a long
    /// history both are scattered disk reads, which then share the disk's queue
    /// instead of following each other. Apply reads the same rows again, from the
    /// caches. The slices follow the log's order of where the ids may be stored,
    /// so each reads its own stretch of it (on Kafka a read of several records is
    /// one pass over their span). Each slice then works out which records apply's
    /// rebuilds will read back (`rebuild_records`), beside the next slices' reads;
    /// those are read into the cache and hinted to the record's plan
    /// (recent.rs), so apply runs once instead of twice.
    async fn confirm_and_warm(
        &self,
        scope: &Scope,
        event_ids: &[String],
        reason: &str,
    ) -> Result<(), EngineError> {
        let meters = self
            .caches
            .meters
            .get(scope)
            .map(|meters| Arc::clone(&meters))
            .unwrap_or_default();
        let index = &self.caches.events;
        let mut order: Vec<(Option<(u32, u64)>, usize)> = event_ids
            .iter()
            .enumerate()
            .map(|(at, id)| {
                let candidates =
                    index.candidates(index.fingerprint(&scope.store_id, scope.mode, id));
                let first = candidates.iter().map(|l| (l.partition, l.offset)).min();
                (first, at)
            })
            .collect();
        order.sort_unstable();
        let mut stored = vec![false; event_ids.len()];
        let mut warming = Vec::new();
        for slice in order.chunks(CONFIRM_SLICE_IDS) {
            let ids: Vec<String> = slice.iter().map(|&(_, at)| event_ids[at].clone()).collect();
            let (events, records) = self.stored_events(scope, &ids).await?;
            for (&(_, at), event) in slice.iter().zip(&events) {
                stored[at] = event.is_some();
            }
            let events: Vec<UsageEvent> = events.into_iter().flatten().collect();
            let mut reads = void_reads(&scope.store_id, scope.mode, &meters, &events);
            reads.sort_unstable();
            reads.dedup();
            let store = Arc::clone(self.journal.store());
            let index = Arc::clone(&self.caches.events);
            let scope = scope.clone();
            let ids: Vec<String> = events.into_iter().map(|e| e.event_id).collect();
            warming.push(tokio::task::spawn_blocking(move || {
                tally_projection::warm::warm(store.as_ref(), &reads);
                rebuild_records(store.as_ref(), &index, &records, &scope, &ids)
            }));
        }
        if stored.contains(&false) {
            // Ids not found may be events acknowledged moments before and not yet
            // applied (`caught_up_before_not_found`): asked again once they would
            // be. The void is appended after their batches, so apply finds them.
            let missing: Vec<usize> = (0..event_ids.len()).filter(|&at| !stored[at]).collect();
            if self.caught_up_before_not_found().await {
                let ids: Vec<String> = missing.iter().map(|&at| event_ids[at].clone()).collect();
                let (events, _) = self.stored_events(scope, &ids).await?;
                for (&at, event) in missing.iter().zip(&events) {
                    stored[at] = event.is_some();
                }
            }
            if let Some(at) = stored.iter().position(|stored| !stored) {
                return Err(event_not_found(&event_ids[at], at).into());
            }
        }
        let mut rebuilds = BTreeSet::new();
        for task in warming {
            // A read ahead that failed is only a read apply makes itself.
            if let Ok(positions) = task.await {
                rebuilds.extend(positions);
            }
        }
        if rebuilds.is_empty() {
            return Ok(());
        }
        let rebuilds: Vec<(u32, u64)> = rebuilds.into_iter().collect();
        // Read (into the cache) and noted for the record's plan; a read that fails
        // here is one apply makes itself.
        if self.read_batches(&rebuilds).await.is_ok() {
            let record = void_digest(&scope.store_id, scope.mode, event_ids, reason);
            self.caches.recent_records.hint(record, rebuilds);
        }
        Ok(())
    }

    /// The void of a stored event, if it is voided.
    pub fn event_void(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<Option<EventVoid>, EngineError> {
        self.journal
            .store()
            .get(&keys::voided_event_key(
                &scope.store_id,
                scope.mode,
                event_id,
            ))?
            .map(|bytes| codec::decode_void(&bytes))
            .transpose()
    }

    /// Whether any event of the scope is voided (listings skip the per-event look
    /// up while none is).
    pub fn any_voided(&self, scope: &Scope) -> Result<bool, EngineError> {
        let prefix = Key::scoped(keys::VOIDED_EVENT, &scope.store_id, scope.mode).into_bytes();
        let mut any = false;
        tally_projection::scan_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            &mut |_, _| {
                any = true;
                tally_projection::Visit::Stop
            },
        )?;
        Ok(any)
    }
}
