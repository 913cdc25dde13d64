//! The ingest gateway: validates batches, resolves customers, matches meters and
//! deduplicates event ids, then appends the accepted events to the log.
//!
//! Ingest and preview run the same [`Engine::evaluate_batch`]; preview stops before
//! reserving or writing anything.
//!
//! Dedup is exact: an event id is a duplicate when it is stored (the event index,
//! confirmed by reading the original from the log), in flight (appended, not yet
//! applied: `Caches::inflight_events`), or earlier in the same batch. Ingest
//! reserves an id in the in-flight map before it looks the id up, so two concurrent
//! requests carrying the same id cannot both be accepted, and an id the projector
//! stores meanwhile is in the index before its reservation goes. The projector
//! deduplicates once more in log order, so a replay, or two nodes racing on Kafka,
//! still keep exactly the first event.
//!
//! Stored events are read from the log: by id through the index, and per scope in
//! receipt order through the `F` rows (`scan_stored_events`).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tally_domain::meter::{Aggregation, EventView, Meter, MeterStatus};
use tally_domain::record::Record;
use tally_domain::usage::{validate_event, CustomerRef, RawUsageEvent, UsageEvent, ValidatedEvent};
use tally_domain::FieldError;
use tally_projection::Visit;

use crate::error::EngineError;
use crate::event_index::{decode_stored, EventLocation};
use crate::ids::new_id;
use crate::keys::StoredEventsKey;
use crate::overlay::{customer_cache_key, inflight_key, StoredBatch};
use crate::pagination::{Page, PageRequest};
use crate::{Engine, Scope};

/// `F` rows read per step of a scan of stored events: one synchronous projection
/// read, then one log read per row (bounds the memory of a step).
pub const STORED_EVENTS_SCAN_ROWS: usize = 64;

/// Customer ids and external ids cached for ingest before the cache is emptied
/// (bounds memory; a miss costs one projection read).
pub const MAX_CACHED_CUSTOMERS: usize = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub code: &'static str,
    pub message: String,
}

/// What ingest or preview says about one event.
#[derive(Debug, Clone)]
pub struct EventReport {
    pub valid: bool,
    /// For an invalid event; `param` is the full path (`events[3].timestamp`).
    pub error: Option<FieldError>,
    pub event_id: Option<String>,
    pub customer_id: Option<String>,
    pub duplicate: bool,
    pub matched_meters: Vec<String>,
    pub warnings: Vec<Warning>,
}

#[derive(Debug, Clone)]
pub struct IngestOutcome {
    pub accepted: usize,
    pub duplicates: usize,
    pub events: Vec<EventReport>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evaluation {
    Preview,
    Ingest,
}

struct Evaluated<'a> {
    reports: Vec<EventReport>,
    accepted: Vec<UsageEvent>,
    reservations: Reservations<'a>,
}

/// An event that passed validation and customer resolution, before dedup.
struct Candidate {
    event: ValidatedEvent,
    customer_id: String,
    event_id: String,
    /// The service assigned the id (such events are never duplicates).
    assigned: bool,
}

/// The in-flight reservations one ingest request made. Dropping it releases them
/// (an error, a failed append, a client that went away mid-request), so an id is
/// never left reserved with nothing appended; once the batch is appended,
/// `hand_over` leaves them to the projector, which releases them when it applies the
/// record.
struct Reservations<'a> {
    inflight: &'a DashMap<String, u64>,
    keys: Vec<String>,
}

impl<'a> Reservations<'a> {
    fn new(inflight: &'a DashMap<String, u64>) -> Self {
        Reservations {
            inflight,
            keys: Vec::new(),
        }
    }

    /// Reserves `key` unless it is in flight already; returns the fingerprint of the
    /// reservation holding it, if another does.
    fn reserve(&mut self, key: &str, print: u64) -> Option<u64> {
        match self.inflight.entry(key.to_string()) {
            Entry::Occupied(inflight) => Some(*inflight.get()),
            Entry::Vacant(slot) => {
                slot.insert(print);
                self.keys.push(key.to_string());
                None
            }
        }
    }

    fn release(&mut self, key: &str) {
        self.inflight.remove(key);
        self.keys.retain(|k| k != key);
    }

    fn hand_over(mut self) {
        self.keys.clear();
    }
}

impl Drop for Reservations<'_> {
    fn drop(&mut self) {
        for key in &self.keys {
            self.inflight.remove(key);
        }
    }
}

/// Filters of `GET /v1/events`.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub customer_id: Option<String>,
    pub name: Option<String>,
    pub meter_id: Option<String>,
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
}

/// A hash of what the sender sent (for "payload differs" between requests in
/// flight): the timestamp counts only when given (see `UsageEvent::same_payload`).
fn fingerprint(event: &ValidatedEvent, customer_id: &str) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    event.name.hash(&mut hasher);
    customer_id.hash(&mut hasher);
    event
        .timestamp_given
        .then_some(event.timestamp_ms)
        .hash(&mut hasher);
    event.properties.hash(&mut hasher);
    hasher.finish()
}

fn duplicate_warnings(report: &mut EventReport, payload_differs: bool) {
    report.duplicate = true;
    report.warnings.push(Warning {
        code: "duplicate_event_id",
        message: "an event with this event_id was already ingested; this one is ignored".into(),
    });
    if payload_differs {
        report.warnings.push(Warning {
            code: "duplicate_payload_differs",
            message: "the ignored duplicate's payload differs from the event that was kept".into(),
        });
    }
}

fn bound_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(key) => Bound::Included(key.as_slice()),
        Bound::Excluded(key) => Bound::Excluded(key.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

fn bound_key(bound: &Bound<Vec<u8>>) -> Option<&[u8]> {
    match bound {
        Bound::Included(key) | Bound::Excluded(key) => Some(key),
        Bound::Unbounded => None,
    }
}

/// The bounds of the `F` rows of a scope that can hold events with timestamps in
/// `[start_ms, end_ms)`: an event's timestamp is at most the future skew after its
/// receipt and at most the oldest ingestible age before it.
pub fn received_between(
    scope: &Scope,
    start_ms: Option<i64>,
    end_ms: Option<i64>,
) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    use tally_domain::limits::{MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_SKEW_MS};
    let (mut lower, mut upper) = scope_rows(scope);
    let at = |received_ms: i64| {
        crate::keys::Key::scoped(crate::keys::STORED_EVENTS, &scope.store_id, scope.mode)
            .int(received_ms)
            .into_bytes()
    };
    if let Some(start) = start_ms {
        lower = Bound::Included(at(start.saturating_sub(MAX_EVENT_FUTURE_SKEW_MS)));
    }
    if let Some(end) = end_ms {
        let end = at(end.saturating_add(MAX_EVENT_AGE_MS));
        if bound_key(&upper).is_none_or(|scope_end| end.as_slice() < scope_end) {
            upper = Bound::Excluded(end);
        }
    }
    (lower, upper)
}

/// The bounds of every `F` row of a scope.
pub fn scope_rows(scope: &Scope) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    let prefix = StoredEventsKey::scope_prefix(&scope.store_id, scope.mode);
    let end = tally_projection::prefix_end(&prefix).unwrap_or_else(|| vec![0xff]);
    (Bound::Included(prefix), Bound::Excluded(end))
}

impl Engine {
    /// The active meters of the scope that consume this event now.
    fn matching_meters<'m>(meters: &'m [Meter], event: &ValidatedEvent) -> Vec<&'m Meter> {
        let view = EventView {
            name: &event.name,
            timestamp_ms: event.timestamp_ms,
            properties: &event.properties,
        };
        meters
            .iter()
            .filter(|m| {
                m.status == MeterStatus::Active
                    && event.timestamp_ms >= m.counts_from_ms
                    && m.matches(&view)
            })
            .collect()
    }

    /// Resolves a customer reference through the caches (see `Caches`), falling back
    /// to the projection.
    fn resolve_customer(
        &self,
        scope: &Scope,
        customer: &CustomerRef,
    ) -> Result<Option<String>, EngineError> {
        let caches = self.caches();
        if caches.known_customers.len() + caches.external_ids.len() > MAX_CACHED_CUSTOMERS {
            caches.known_customers.clear();
            caches.external_ids.clear();
        }
        match customer {
            CustomerRef::Id(id) => {
                let key = customer_cache_key(&scope.store_id, scope.mode, id);
                if caches.known_customers.contains_key(&key) {
                    return Ok(Some(id.clone()));
                }
                let exists = self.customer_exists(scope, id)?;
                if exists {
                    caches.known_customers.insert(key, ());
                }
                Ok(exists.then(|| id.clone()))
            }
            CustomerRef::External(external) => {
                let key = customer_cache_key(&scope.store_id, scope.mode, external);
                if let Some(id) = caches.external_ids.get(&key) {
                    return Ok(Some(id.clone()));
                }
                let before = *caches
                    .customer_generation
                    .read()
                    .unwrap_or_else(|p| p.into_inner());
                let found = self.customer_id_by_external(scope, external)?;
                if let Some(id) = &found {
                    let generation = caches
                        .customer_generation
                        .read()
                        .unwrap_or_else(|p| p.into_inner());
                    if *generation == before {
                        caches.external_ids.insert(key, id.clone());
                    }
                }
                Ok(found)
            }
        }
    }

    /// The stored event `event_id` of the scope: where it is (with its `F` row's key)
    /// and the event, read from the log. A fingerprint hit on another id is skipped.
    pub async fn find_stored_event(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<Option<(StoredEventsKey, EventLocation, UsageEvent)>, EngineError> {
        let index = &self.caches().events;
        let print = index.fingerprint(&scope.store_id, scope.mode, event_id);
        for location in index.candidates(print) {
            let Some(batch) = self.read_batch(location.partition, location.offset).await? else {
                continue;
            };
            if let Some(event) =
                batch
                    .view()
                    .event_if(&scope.store_id, scope.mode, event_id, location.index)
            {
                let row = StoredEventsKey {
                    store_id: scope.store_id.clone(),
                    mode: scope.mode,
                    received_at_ms: batch
                        .events
                        .iter()
                        .map(|e| e.received_at_ms)
                        .min()
                        .unwrap_or(0),
                    partition: location.partition,
                    offset: location.offset,
                };
                return Ok(Some((row, location, event.clone())));
            }
        }
        Ok(None)
    }

    /// The usage record at a position the index or an `F` row names (see
    /// `read_batches`).
    async fn read_batch(
        &self,
        partition: u32,
        offset: u64,
    ) -> Result<Option<Arc<StoredBatch>>, EngineError> {
        Ok(self
            .read_batches(&[(partition, offset)])
            .await?
            .remove(&(partition, offset))
            .flatten())
    }

    /// The usage records at positions the index or `F` rows name (`None`: another
    /// kind of record), through the cache of recently read records (a retried batch
    /// points at one record a hundred times; a listing page reads its records again
    /// on the next page), reading what is missing one partition at a time
    /// (`Log::read_many`: one pass over the span on Kafka).
    async fn read_batches(
        &self,
        positions: &[(u32, u64)],
    ) -> Result<HashMap<(u32, u64), Option<Arc<StoredBatch>>>, EngineError> {
        let cache = &self.caches().recent_records;
        let mut batches = HashMap::new();
        let mut missing: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
        for &(partition, offset) in positions {
            match cache.get(partition, offset) {
                Some(batch) => {
                    batches.insert((partition, offset), Some(batch));
                }
                None => missing.entry(partition).or_default().push(offset),
            }
        }
        for (partition, offsets) in missing {
            let entries = self.log().read_many(partition, &offsets).await?;
            for (offset, entry) in offsets.into_iter().zip(entries) {
                let Some(entry) = entry else {
                    return Err(EngineError::Corrupt(format!(
                        "a stored event points at partition {partition} offset {offset}, which the log does not hold"
                    )));
                };
                let batch = StoredBatch::decode(&entry.payload)?.map(Arc::new);
                if let Some(batch) = &batch {
                    cache.put(partition, offset, entry.payload.len(), batch.clone());
                }
                batches.insert((partition, offset), batch);
            }
        }
        Ok(batches)
    }

    /// Visits the scope's stored events whose `F` rows fall in `(lower, upper)`, row by
    /// row, in receipt order (newest first when `reverse`): `visit` gets the row and its
    /// events (index in the record, event) in the same order, and may stop.
    pub async fn scan_stored_events(
        &self,
        scope: &Scope,
        lower: Bound<Vec<u8>>,
        upper: Bound<Vec<u8>>,
        reverse: bool,
        mut visit: impl FnMut(&StoredEventsKey, Vec<(u32, &UsageEvent)>) -> Visit,
    ) -> Result<(), EngineError> {
        let (mut lower, mut upper) = (lower, upper);
        loop {
            let mut rows = Vec::new();
            let mut failure = None;
            self.store().scan(
                bound_ref(&lower),
                bound_ref(&upper),
                reverse,
                &mut |key, value| {
                    match StoredEventsKey::decode(key).and_then(|k| Ok((k, decode_stored(value)?)))
                    {
                        Ok(row) => rows.push((key.to_vec(), row)),
                        Err(error) => {
                            failure = Some(error);
                            return Visit::Stop;
                        }
                    }
                    if rows.len() >= STORED_EVENTS_SCAN_ROWS {
                        Visit::Stop
                    } else {
                        Visit::Continue
                    }
                },
            )?;
            if let Some(error) = failure {
                return Err(error);
            }
            let full = rows.len() >= STORED_EVENTS_SCAN_ROWS;
            let Some((last_key, _)) = rows.last() else {
                return Ok(());
            };
            let last_key = last_key.clone();
            let positions: Vec<(u32, u64)> = rows
                .iter()
                .map(|(_, (row, _))| (row.partition, row.offset))
                .collect();
            let batches = self.read_batches(&positions).await?;
            for (_, (row, stored)) in rows {
                if row.store_id != scope.store_id || row.mode != scope.mode {
                    continue;
                }
                let Some(Some(batch)) = batches.get(&(row.partition, row.offset)) else {
                    return Err(EngineError::Corrupt(format!(
                        "a stored-events row points at partition {} offset {}, which holds no usage record",
                        row.partition, row.offset
                    )));
                };
                let mut events: Vec<(u32, &UsageEvent)> = stored
                    .iter()
                    .filter_map(|(index, _)| batch.events.get(*index as usize).map(|e| (*index, e)))
                    .collect();
                if reverse {
                    events.reverse();
                }
                if visit(&row, events) == Visit::Stop {
                    return Ok(());
                }
            }
            if !full {
                return Ok(());
            }
            if reverse {
                upper = Bound::Excluded(last_key);
            } else {
                lower = Bound::Excluded(last_key);
            }
        }
    }

    async fn evaluate_batch(
        &self,
        scope: &Scope,
        raws: &[Result<RawUsageEvent, FieldError>],
        evaluation: Evaluation,
    ) -> Result<Evaluated<'_>, EngineError> {
        let now = self.now_ms();
        let meters = self
            .caches()
            .meters
            .get(scope)
            .map(|m| m.clone())
            .unwrap_or_default();
        let invalid = |index: usize, e: FieldError| {
            let param = if e.param.is_empty() {
                format!("events[{index}]")
            } else {
                format!("events[{index}].{}", e.param)
            };
            FieldError::new("invalid_usage_event", param, e.message)
        };
        // Phase 1: validate, resolve and match every event; nothing is reserved yet.
        let mut reports = Vec::with_capacity(raws.len());
        let mut candidates: Vec<Option<Candidate>> = Vec::with_capacity(raws.len());
        for (index, raw) in raws.iter().enumerate() {
            let mut report = EventReport {
                valid: false,
                error: None,
                event_id: None,
                customer_id: None,
                duplicate: false,
                matched_meters: Vec::new(),
                warnings: Vec::new(),
            };
            let validated = raw
                .as_ref()
                .map_err(|e| e.clone())
                .and_then(|raw| validate_event(raw, now));
            let validated = match validated {
                Ok(v) => v,
                Err(e) => {
                    report.error = Some(invalid(index, e));
                    reports.push(report);
                    candidates.push(None);
                    continue;
                }
            };
            let Some(customer_id) = self.resolve_customer(scope, &validated.customer)? else {
                let (param, what) = match &validated.customer {
                    CustomerRef::Id(id) => ("customer_id", format!("no customer with id '{id}'")),
                    CustomerRef::External(e) => (
                        "external_customer_id",
                        format!("no customer with external_id '{e}'"),
                    ),
                };
                report.error = Some(invalid(
                    index,
                    FieldError::new("invalid_usage_event", param, what),
                ));
                reports.push(report);
                candidates.push(None);
                continue;
            };
            let assigned = validated.event_id.is_none();
            let event_id = validated.event_id.clone().unwrap_or_else(|| new_id("evt"));
            let matched = Self::matching_meters(&meters, &validated);
            if matched.is_empty() {
                report.warnings.push(Warning {
                    code: "no_matching_meter",
                    message: format!(
                        "no active meter consumes events named '{}' with these properties",
                        validated.name
                    ),
                });
            }
            for meter in &matched {
                let Some(property) = &meter.aggregation_property else {
                    continue;
                };
                let usable = match validated.properties.get(property) {
                    None => false,
                    Some(v) => meter.aggregation == Aggregation::Unique || v.as_number().is_some(),
                };
                if !usable {
                    report.warnings.push(Warning {
                        code: "aggregation_property_missing",
                        message: format!(
                            "meter {} aggregates property '{property}', which this event lacks or holds no number in; the meter skips it",
                            meter.id
                        ),
                    });
                }
            }
            report.valid = true;
            report.event_id = Some(event_id.clone());
            report.customer_id = Some(customer_id.clone());
            report.matched_meters = matched.iter().map(|m| m.id.clone()).collect();
            reports.push(report);
            candidates.push(Some(Candidate {
                event: validated,
                customer_id,
                event_id,
                assigned,
            }));
        }
        if evaluation == Evaluation::Ingest {
            if let Some(error) = reports.iter().find_map(|r| r.error.clone()) {
                return Err(error.into());
            }
        }
        // Phase 2: dedup (and, for ingest, reserve) in batch order: the first wins.
        // On an error the reservations are dropped, which releases them.
        let mut reservations = Reservations::new(&self.caches().inflight_events);
        let accepted = self
            .dedup_batch(
                scope,
                &mut reports,
                candidates,
                evaluation,
                now,
                &mut reservations,
            )
            .await?;
        Ok(Evaluated {
            reports,
            accepted,
            reservations,
        })
    }

    async fn dedup_batch(
        &self,
        scope: &Scope,
        reports: &mut [EventReport],
        candidates: Vec<Option<Candidate>>,
        evaluation: Evaluation,
        now: i64,
        reservations: &mut Reservations<'_>,
    ) -> Result<Vec<UsageEvent>, EngineError> {
        let mut accepted = Vec::new();
        let mut in_batch: HashMap<String, u64> = HashMap::new();
        for (report, candidate) in reports.iter_mut().zip(candidates) {
            let Some(Candidate {
                event: validated,
                customer_id,
                event_id,
                assigned,
            }) = candidate
            else {
                continue;
            };
            let print = fingerprint(&validated, &customer_id);
            if !assigned {
                if let Some(earlier) = in_batch.get(&event_id) {
                    duplicate_warnings(report, *earlier != print);
                    continue;
                }
                in_batch.insert(event_id.clone(), print);
                let key = inflight_key(&scope.store_id, scope.mode, &event_id);
                // In flight elsewhere? For ingest, reserve first (no lock is held across
                // the log read below): an id the projector stores meanwhile is in the
                // index before its reservation is released, so the lookup sees it.
                let inflight = match evaluation {
                    Evaluation::Preview => self.caches().inflight_events.get(&key).map(|p| *p),
                    Evaluation::Ingest => reservations.reserve(&key, print),
                };
                let duplicate_of = match inflight {
                    Some(inflight) => Some(inflight != print),
                    None => self
                        .find_stored_event(scope, &event_id)
                        .await?
                        .map(|(_, _, stored)| !stored.same_payload(&validated, &customer_id)),
                };
                if let Some(differs) = duplicate_of {
                    if inflight.is_none() && evaluation == Evaluation::Ingest {
                        reservations.release(&key);
                    }
                    duplicate_warnings(report, differs);
                    continue;
                }
            }
            let matched_meter_ids = report.matched_meters.clone();
            accepted.push(UsageEvent {
                event_id,
                name: validated.name,
                customer_id,
                external_customer_id: match validated.customer {
                    CustomerRef::External(e) => Some(e),
                    CustomerRef::Id(_) => None,
                },
                timestamp_ms: validated.timestamp_ms,
                properties: validated.properties,
                received_at_ms: now,
                matched_meter_ids,
                event_id_assigned: assigned,
            });
        }
        Ok(accepted)
    }

    /// `POST /v1/events/preview`: the ingest evaluation, writing nothing.
    pub async fn preview_events(
        &self,
        scope: &Scope,
        raws: &[Result<RawUsageEvent, FieldError>],
    ) -> Result<Vec<EventReport>, EngineError> {
        Ok(self
            .evaluate_batch(scope, raws, Evaluation::Preview)
            .await?
            .reports)
    }

    /// `POST /v1/events/ingest`: all or nothing; returns once the batch is durable.
    pub async fn ingest_events(
        &self,
        scope: &Scope,
        raws: &[Result<RawUsageEvent, FieldError>],
    ) -> Result<IngestOutcome, EngineError> {
        self.wait_for_projector_headroom().await?;
        let evaluated = self.evaluate_batch(scope, raws, Evaluation::Ingest).await?;
        let accepted = evaluated.accepted.len();
        let duplicates = evaluated.reports.iter().filter(|r| r.duplicate).count();
        if accepted > 0 {
            // One record per partition, so one customer's events keep their order on
            // Kafka. On the embedded log that is always a single record.
            let mut by_partition: HashMap<u32, Vec<UsageEvent>> = HashMap::new();
            for event in evaluated.accepted {
                let key = format!("{}/{}", scope.store_id, event.customer_id);
                by_partition
                    .entry(self.log().partition_for(key.as_bytes()))
                    .or_default()
                    .push(event);
            }
            for (_, events) in by_partition {
                let record = Record::UsageBatch {
                    store_id: scope.store_id.clone(),
                    mode: scope.mode,
                    events,
                };
                // On an error, returning drops the reservations: nothing durable
                // holds the ids, so a retry is accepted (and if the outcome was in fact
                // written, apply keeps the first in log order).
                self.append(&record).await?;
            }
        }
        evaluated.reservations.hand_over();
        self.metrics
            .events_accepted
            .fetch_add(accepted as u64, Ordering::Relaxed);
        self.metrics
            .events_duplicate
            .fetch_add(duplicates as u64, Ordering::Relaxed);
        Ok(IngestOutcome {
            accepted,
            duplicates,
            events: evaluated.reports,
        })
    }

    pub async fn get_event(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<UsageEvent, EngineError> {
        self.find_stored_event(scope, event_id)
            .await?
            .map(|(_, _, event)| event)
            .ok_or_else(|| EngineError::not_found("event", event_id))
    }

    /// `GET /v1/events`: stored events, newest received first (within one record,
    /// last first), read from the log through the scope's `F` rows.
    pub async fn list_events(
        &self,
        scope: &Scope,
        filter: &EventFilter,
        page: &PageRequest,
    ) -> Result<Page<UsageEvent>, EngineError> {
        // (towards older, cursor row, cursor index)
        let cursor = match (&page.starting_after, &page.ending_before) {
            (Some(_), Some(_)) => {
                return Err(FieldError::invalid(
                    "ending_before",
                    "give at most one of `starting_after` and `ending_before`",
                )
                .into())
            }
            (Some(id), None) => Some((true, self.cursor_event(scope, id, "starting_after").await?)),
            (None, Some(id)) => Some((false, self.cursor_event(scope, id, "ending_before").await?)),
            (None, None) => None,
        };
        let (mut lower, mut upper) = received_between(scope, filter.start_ms, filter.end_ms);
        let towards_newer = matches!(cursor, Some((false, _)));
        // The cursor's row bounds the scan too, when it is the tighter bound (keys of
        // one scope compare by receipt time, then position).
        match &cursor {
            Some((true, (row, _))) => {
                let at = row.encode();
                if bound_key(&upper).is_none_or(|end| at.as_slice() < end) {
                    upper = Bound::Included(at);
                }
            }
            Some((false, (row, _))) => {
                let at = row.encode();
                if bound_key(&lower).is_none_or(|start| at.as_slice() > start) {
                    lower = Bound::Included(at);
                }
            }
            None => {}
        }
        let limit = page.limit;
        let mut items = Vec::with_capacity(limit + 1);
        self.scan_stored_events(scope, lower, upper, !towards_newer, |row, events| {
            for (index, event) in events {
                if let Some((older, (cursor_row, cursor_index))) = &cursor {
                    if row == cursor_row
                        && ((*older && index >= *cursor_index)
                            || (!*older && index <= *cursor_index))
                    {
                        continue;
                    }
                }
                let keep = filter
                    .customer_id
                    .as_ref()
                    .is_none_or(|c| *c == event.customer_id)
                    && filter.name.as_ref().is_none_or(|n| *n == event.name)
                    && filter
                        .meter_id
                        .as_ref()
                        .is_none_or(|m| event.matched_meter_ids.contains(m))
                    && filter.start_ms.is_none_or(|s| event.timestamp_ms >= s)
                    && filter.end_ms.is_none_or(|e| event.timestamp_ms < e);
                if keep {
                    items.push(event.clone());
                    if items.len() > limit {
                        return Visit::Stop;
                    }
                }
            }
            Visit::Continue
        })
        .await?;
        Ok(Page::from_scan(items, limit, towards_newer))
    }

    /// Where a listing cursor's event is: its `F` row and index.
    async fn cursor_event(
        &self,
        scope: &Scope,
        event_id: &str,
        param: &str,
    ) -> Result<(StoredEventsKey, u32), EngineError> {
        match self.find_stored_event(scope, event_id).await? {
            Some((row, location, _)) => Ok((row, location.index)),
            None => Err(EngineError::NotFound {
                resource: "event",
                id: event_id.to_string(),
                param: Some(param.to_string()),
            }),
        }
    }
}
