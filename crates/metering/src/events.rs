//! Stored events, read back from the log: by id through the event index, and per
//! scope in receipt order through the `F` rows (`scan_stored_events`), for `GET
//! /v1/events`, meter previews, backfills and the ingest gateway's dedup.
//!
//! Stored events live only in the log (ARCHITECTURE.md, "Exact dedup without a key
//! per event"); a fingerprint hit is confirmed by reading the record and comparing
//! the event id exactly.

use std::collections::HashMap;
use std::ops::Bound;
use std::sync::Arc;

use tally_core::error::EngineError;
use tally_core::event_index::{decode_stored, EventLocation};
use tally_core::keys::StoredEventsKey;
use tally_core::overlay::{Fetched, StoredBatch};
use tally_core::pagination::{Page, PageRequest};
use tally_core::Scope;
use tally_domain::usage::UsageEvent;
use tally_domain::FieldError;
use tally_projection::Visit;

use crate::Metering;

/// `F` rows read per step of a scan of stored events: one synchronous projection
/// read, then one log read per row (bounds the memory of a step).
pub const STORED_EVENTS_SCAN_ROWS: usize = 64;

/// Filters of `GET /v1/events`.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub customer_id: Option<String>,
    pub name: Option<String>,
    pub meter_id: Option<String>,
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
    /// Voided events are left out unless this is set.
    pub include_voided: bool,
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
        tally_core::keys::Key::scoped(tally_core::keys::STORED_EVENTS, &scope.store_id, scope.mode)
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

/// How long a look-up by id that found nothing waits for this node to apply what
/// the log held, before it answers "not found": ingest answers once a batch is
/// durable, before it is applied, so an event acknowledged moments before may not
/// be in the index yet. Backpressure keeps the projector within
/// `MAX_UNAPPLIED_EVENTS` of the log (well under a second of apply); the bound only
/// keeps a stalled projector from holding the request.
pub const NOT_YET_APPLIED_WAIT_MS: u64 = 5_000;

impl Metering {
    /// The stored event `event_id` of the scope: where it is (with its `F` row's key)
    /// and the event, read from the log. A fingerprint hit on another id is skipped.
    pub async fn find_stored_event(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<Option<(StoredEventsKey, EventLocation, UsageEvent)>, EngineError> {
        let index = &self.caches.events;
        let print = index.fingerprint(&scope.store_id, scope.mode, event_id);
        for location in index.candidates(print) {
            let Some(batch) = self.read_batch(location.partition, location.offset).await? else {
                continue;
            };
            let view = batch.view();
            if let Some(event) =
                view.event_if(&scope.store_id, scope.mode, event_id, location.index)?
            {
                let mut received_at_ms = None;
                for stored in view.events() {
                    let at = stored?.received_at_ms;
                    received_at_ms = Some(received_at_ms.map_or(at, |min: i64| min.min(at)));
                }
                let row = StoredEventsKey {
                    store_id: scope.store_id.to_string(),
                    mode: scope.mode,
                    received_at_ms: received_at_ms.unwrap_or(0),
                    partition: location.partition,
                    offset: location.offset,
                };
                return Ok(Some((row, location, event.clone())));
            }
        }
        Ok(None)
    }

    /// Each of `event_ids` as stored in the scope (`None`: not a stored event): their
    /// records read at once (one pass over the log, through the cache), not one by
    /// one; with the records read for them (those the index's candidates point at,
    /// found or not).
    pub(crate) async fn stored_events(
        &self,
        scope: &Scope,
        event_ids: &[String],
    ) -> Result<(Vec<Option<UsageEvent>>, Fetched), EngineError> {
        let index = &self.caches.events;
        let candidates: Vec<Vec<EventLocation>> = event_ids
            .iter()
            .map(|id| index.candidates(index.fingerprint(&scope.store_id, scope.mode, id)))
            .collect();
        let mut positions: Vec<(u32, u64)> = candidates
            .iter()
            .flatten()
            .map(|l| (l.partition, l.offset))
            .collect();
        positions.sort_unstable();
        positions.dedup();
        let batches = self.read_batches(&positions).await?;
        let mut events = Vec::with_capacity(event_ids.len());
        for (id, locations) in event_ids.iter().zip(&candidates) {
            let mut found = None;
            for l in locations {
                let Some(Some(batch)) = batches.get(&(l.partition, l.offset)) else {
                    continue;
                };
                if let Some(event) =
                    batch
                        .view()
                        .event_if(&scope.store_id, scope.mode, id, l.index)?
                {
                    found = Some(event.clone());
                    break;
                }
            }
            events.push(found);
        }
        Ok((events, batches))
    }

    /// The usage record at a position the index or an `F` row names (see
    /// `read_batches`).
    pub async fn read_batch(
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
    pub async fn read_batches(&self, positions: &[(u32, u64)]) -> Result<Fetched, EngineError> {
        let cache = &self.caches.recent_records;
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
            let entries = self.journal.log().read_many(partition, &offsets).await?;
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
            self.journal.store().scan(
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
                if *row.store_id != *scope.store_id || row.mode != scope.mode {
                    continue;
                }
                let Some(Some(batch)) = batches.get(&(row.partition, row.offset)) else {
                    return Err(EngineError::Corrupt(format!(
                        "a stored-events row points at partition {} offset {}, which holds no usage record",
                        row.partition, row.offset
                    )));
                };
                let view = batch.view();
                let mut events: Vec<(u32, &UsageEvent)> = Vec::with_capacity(stored.len());
                for &(index, _) in &stored {
                    if let Some(event) = view.event(index)? {
                        events.push((index, event));
                    }
                }
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

    /// Whether this node has applied everything the log held when asked (waiting at
    /// most `NOT_YET_APPLIED_WAIT_MS`): a look-up by id that found nothing asks
    /// again only then, so an acknowledged event is found.
    pub async fn caught_up_before_not_found(&self) -> bool {
        self.journal
            .caught_up_within(std::time::Duration::from_millis(NOT_YET_APPLIED_WAIT_MS))
            .await
    }

    /// `find_stored_event`, asked again once this node has applied what the log
    /// held if it found nothing (`caught_up_before_not_found`).
    pub async fn find_stored_event_applied(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<Option<(StoredEventsKey, EventLocation, UsageEvent)>, EngineError> {
        match self.find_stored_event(scope, event_id).await? {
            None if self.caught_up_before_not_found().await => {
                self.find_stored_event(scope, event_id).await
            }
            found => Ok(found),
        }
    }

    pub async fn get_event(
        &self,
        scope: &Scope,
        event_id: &str,
    ) -> Result<UsageEvent, EngineError> {
        self.find_stored_event_applied(scope, event_id)
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
        let skip_voided = !filter.include_voided && self.any_voided(scope)?;
        let mut failure = None;
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
                    .is_none_or(|c| event.customer_id == **c)
                    && filter.name.as_ref().is_none_or(|n| *n == event.name)
                    && filter
                        .meter_id
                        .as_ref()
                        .is_none_or(|m| event.matched_meter_ids.iter().any(|id| id == m))
                    && filter.start_ms.is_none_or(|s| event.timestamp_ms >= s)
                    && filter.end_ms.is_none_or(|e| event.timestamp_ms < e);
                let keep = keep
                    && (!skip_voided
                        || match self.event_void(scope, &event.event_id) {
                            Ok(void) => void.is_none(),
                            Err(error) => {
                                failure = Some(error);
                                return Visit::Stop;
                            }
                        });
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
        if let Some(error) = failure {
            return Err(error);
        }
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
