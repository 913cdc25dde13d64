//! Usage queries, served from the minute buckets (never by scanning raw events), and
//! meter previews, which run a definition over stored events of a range.
//!
//! Usage resolution is one minute: a range is widened to whole minutes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Bound;

use rust_decimal::Decimal;
use tally_domain::aggregate::{contribution, Aggregate, Contribution};
use tally_domain::exact::exact_add;
use tally_domain::gauge::{
    self, keep_latest, ms_to_hours, LatestPoint, WeightedBucket, WeightedWindow,
};
use tally_domain::meter::{Aggregation, EventView, Meter, MeterDefinition};
use tally_domain::time::{Window, MINUTE_MS};
use tally_domain::usage::UsageEvent;
use tally_domain::FieldError;
use tally_projection::{scan_prefix, Visit};

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, BucketKey, BucketPart, ALL_CUSTOMERS};
use tally_core::Scope;

use crate::Metering;

/// Windows one query may return: bounds response size and work.
pub const MAX_USAGE_WINDOWS: usize = 100_000;
/// Customers one grouped query may return.
pub const MAX_USAGE_GROUPS: usize = 10_000;
/// Stored events a meter preview may scan before it stops (and says so).
pub const MAX_PREVIEW_SCAN_EVENTS: usize = 1_000_000;

#[derive(Debug, Clone)]
pub struct UsageQuery {
    pub meter_id: String,
    /// A resolved customer id; `None` for all customers.
    pub customer_id: Option<String>,
    pub start_ms: i64,
    pub end_ms: i64,
    pub window: Window,
    pub group_by_customer: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WindowValue {
    pub start_ms: i64,
    pub end_ms: i64,
    pub value: Option<Decimal>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UsageSeries {
    pub customer_id: Option<String>,
    pub value: Option<Decimal>,
    pub windows: Vec<WindowValue>,
}

#[derive(Debug, Clone)]
pub struct UsageResult {
    pub meter: Meter,
    pub start_ms: i64,
    pub end_ms: i64,
    pub total: UsageSeries,
    pub groups: Option<Vec<UsageSeries>>,
}

/// Accumulates buckets, distinct values or single events into windows.
struct WindowFold {
    aggregation: Aggregation,
    windows: Vec<(i64, i64)>,
    aggregates: Vec<Aggregate>,
    distinct: Vec<HashSet<Vec<u8>>>,
    all_distinct: HashSet<Vec<u8>>,
    /// `latest`: each window's latest point.
    latest: Vec<Option<LatestPoint>>,
    /// `time_weighted_sum`: each window's changes, and the value held when the
    /// range begins (the changes of every earlier minute; `None` past the exact
    /// range).
    weighted: Vec<WeightedWindow>,
    held_at_start: Option<Decimal>,
    /// `time_weighted_sum` over single events (a preview): each window's area in
    /// value x ms, integrated from the events themselves.
    areas: Option<Vec<Option<Decimal>>>,
}

impl WindowFold {
    fn new(
        aggregation: Aggregation,
        start_ms: i64,
        end_ms: i64,
        window: Window,
    ) -> Result<WindowFold, EngineError> {
        let mut windows = Vec::new();
        let mut at = window.start_of(start_ms, start_ms);
        while at < end_ms {
            let end = window.end_of(at, end_ms).min(end_ms);
            windows.push((at.max(start_ms), end));
            if windows.len() > MAX_USAGE_WINDOWS {
                return Err(FieldError::invalid(
                    "window",
                    format!("the range holds more than {MAX_USAGE_WINDOWS} windows; use a larger window or a shorter range"),
                )
                .into());
            }
            at = end;
        }
        let count = windows.len();
        Ok(WindowFold {
            aggregation,
            windows,
            aggregates: vec![Aggregate::default(); count],
            distinct: vec![HashSet::new(); count],
            all_distinct: HashSet::new(),
            latest: vec![None; count],
            weighted: vec![WeightedWindow::default(); count],
            held_at_start: Some(Decimal::ZERO),
            areas: None,
        })
    }

    /// One stored event (a preview's): its contribution, and for `latest` its point.
    fn add_single(&mut self, event: &UsageEvent, contribution: &Contribution) {
        if let (Aggregation::Latest, Contribution::Event { number: Some(n) }) =
            (self.aggregation, contribution)
        {
            let point = LatestPoint {
                timestamp_ms: event.timestamp_ms,
                event_id: event.event_id.clone(),
                value: *n,
            };
            self.add_latest(event.timestamp_ms, &point);
        }
        self.add_event(event.timestamp_ms, contribution);
    }

    fn add_latest(&mut self, minute_ms: i64, point: &LatestPoint) {
        if let Some(i) = self.window_of(minute_ms) {
            keep_latest(&mut self.latest[i], point);
        }
    }

    /// A time-weighted bucket: inside a window it adds to it; before the range it
    /// adds to the value held when the range begins.
    fn add_weighted(&mut self, minute_ms: i64, bucket: &WeightedBucket) {
        let before_range = self
            .windows
            .first()
            .is_some_and(|(start, _)| minute_ms < *start);
        if before_range {
            self.held_at_start = match self.held_at_start {
                Some(held) if !bucket.overflowed => exact_add(held, bucket.delta),
                _ => None,
            };
        } else if let Some(i) = self.window_of(minute_ms) {
            let end = self.windows[i].1;
            self.weighted[i].add(end, minute_ms, bucket);
        }
    }

    /// A preview's time-weighted areas, integrated from each customer's events.
    fn set_areas_from_events(
        &mut self,
        customers: impl Iterator<Item = Vec<(i64, String, Decimal)>>,
    ) {
        let mut areas = vec![Some(Decimal::ZERO); self.windows.len()];
        for mut events in customers {
            events.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
            let points: Vec<(i64, Decimal)> = events.iter().map(|(at, _, v)| (*at, *v)).collect();
            for (sum, area) in areas
                .iter_mut()
                .zip(gauge::integrate(&points, &self.windows))
            {
                *sum = sum.zip(area).and_then(|(sum, area)| exact_add(sum, area));
            }
        }
        self.areas = Some(areas);
    }

    /// Each window's time-weighted area (value x ms), in order.
    fn weighted_areas(&mut self) -> Vec<Option<Decimal>> {
        if let Some(areas) = self.areas.take() {
            return areas;
        }
        let mut held = self.held_at_start;
        let mut areas = Vec::with_capacity(self.windows.len());
        for (i, (start, end)) in self.windows.iter().enumerate() {
            let (area, next) = self.weighted[i].close(held, *start, *end);
            areas.push(area);
            held = next;
        }
        areas
    }

    /// The values of `latest` and `time_weighted_sum`, per window and in total.
    fn gauge_values(&mut self) -> (Vec<Option<Decimal>>, Option<Decimal>) {
        if self.aggregation == Aggregation::Latest {
            let mut total: Option<LatestPoint> = None;
            for point in self.latest.iter().flatten() {
                keep_latest(&mut total, point);
            }
            let values = self
                .latest
                .iter()
                .map(|p| p.as_ref().map(|p| p.value))
                .collect();
            return (values, total.map(|p| p.value));
        }
        let areas = self.weighted_areas();
        let total = areas
            .iter()
            .try_fold(Decimal::ZERO, |sum, area| exact_add(sum, (*area)?))
            .and_then(ms_to_hours);
        let values = areas.into_iter().map(|a| a.and_then(ms_to_hours)).collect();
        (values, total)
    }

    fn window_of(&self, at_ms: i64) -> Option<usize> {
        let index = self.windows.partition_point(|(start, _)| *start <= at_ms);
        let index = index.checked_sub(1)?;
        (at_ms < self.windows[index].1).then_some(index)
    }

    fn add_bucket(&mut self, minute_ms: i64, aggregate: &Aggregate) {
        if let Some(i) = self.window_of(minute_ms) {
            self.aggregates[i].merge(aggregate);
        }
    }

    fn add_distinct(&mut self, minute_ms: i64, value: &[u8]) {
        if let Some(i) = self.window_of(minute_ms) {
            self.distinct[i].insert(value.to_vec());
            self.all_distinct.insert(value.to_vec());
        }
    }

    fn add_event(&mut self, at_ms: i64, contribution: &Contribution) {
        let Some(i) = self.window_of(at_ms) else {
            return;
        };
        match contribution {
            Contribution::Skipped => {}
            Contribution::Event { number } => self.aggregates[i].add(*number),
            Contribution::Distinct(value) => {
                self.aggregates[i].add(None);
                self.distinct[i].insert(value.as_bytes().to_vec());
                self.all_distinct.insert(value.as_bytes().to_vec());
            }
        }
    }

    fn finish(self, customer_id: Option<String>) -> UsageSeries {
        if matches!(
            self.aggregation,
            Aggregation::Latest | Aggregation::TimeWeightedSum
        ) {
            return self.finish_gauge(customer_id);
        }
        let mut total = Aggregate::default();
        let mut windows = Vec::with_capacity(self.windows.len());
        for (i, (start, end)) in self.windows.iter().enumerate() {
            total.merge(&self.aggregates[i]);
            // Only windows that hold usage are listed (a 35-day hourly query would
            // otherwise be 840 mostly empty rows); `window=none` always has its one.
            if self.aggregates[i].events == 0 && self.windows.len() > 1 {
                continue;
            }
            windows.push(WindowValue {
                start_ms: *start,
                end_ms: *end,
                value: self.aggregates[i]
                    .value(self.aggregation, self.distinct[i].len() as u64)
                    .map(|v| v.normalize()),
            });
        }
        UsageSeries {
            customer_id,
            value: total
                .value(self.aggregation, self.all_distinct.len() as u64)
                .map(|v| v.normalize()),
            windows,
        }
    }

    /// `finish` for `latest` and `time_weighted_sum`: a window is listed when it
    /// holds events or, time-weighted, when a value held through it adds to it.
    fn finish_gauge(mut self, customer_id: Option<String>) -> UsageSeries {
        let (values, total) = self.gauge_values();
        let single = self.windows.len() == 1;
        let windows = self
            .windows
            .iter()
            .zip(values)
            .zip(&self.aggregates)
            .filter(|((_, value), aggregate)| {
                single || aggregate.events > 0 || value.is_some_and(|v| !v.is_zero())
            })
            .map(|(((start, end), value), _)| WindowValue {
                start_ms: *start,
                end_ms: *end,
                value: value.map(|v| v.normalize()),
            })
            .collect();
        UsageSeries {
            customer_id,
            value: total.map(|v| v.normalize()),
            windows,
        }
    }
}

/// Widens a range to whole minutes and checks it.
pub fn minute_range(start_ms: i64, end_ms: i64) -> Result<(i64, i64), FieldError> {
    if end_ms <= start_ms {
        return Err(FieldError::invalid("end", "`end` must be after `start`"));
    }
    let start = start_ms.div_euclid(MINUTE_MS) * MINUTE_MS;
    let end = (end_ms + MINUTE_MS - 1).div_euclid(MINUTE_MS) * MINUTE_MS;
    Ok((start, end))
}

impl Metering {
    fn usage_series(
        &self,
        meter: &Meter,
        customer: &str,
        start_ms: i64,
        end_ms: i64,
        window: Window,
    ) -> Result<UsageSeries, EngineError> {
        let mut fold = WindowFold::new(meter.aggregation, start_ms, end_ms, window)?;
        let (first, last) = (start_ms.div_euclid(MINUTE_MS), end_ms.div_euclid(MINUTE_MS));
        let bounds = |table| {
            // A time-weighted value at the range's start is the sum of every change
            // before it: its buckets are read from the beginning.
            let first = if table == keys::WEIGHTED {
                i64::MIN
            } else {
                first
            };
            let at = |minute| BucketKey::of_meter(table, meter, customer, minute);
            (at(first), at(last))
        };
        // Buckets carry counts and numbers; for `unique`, the distinct values are keys
        // of their own beside them, and `latest` and `time_weighted_sum` have a
        // table each beside them too.
        let mut tables = vec![keys::AGGREGATE];
        match meter.aggregation {
            Aggregation::Unique => tables.extend([keys::DISTINCT_SET, keys::UNIQUE]),
            Aggregation::Latest => tables.push(keys::LATEST),
            Aggregation::TimeWeightedSum => tables.push(keys::WEIGHTED),
            _ => {}
        }
        for table in tables {
            let (from, to) = bounds(table);
            let mut failure = None;
            self.journal.store().scan(
                Bound::Included(&from),
                Bound::Excluded(&to),
                false,
                &mut |key, value| {
                    let folded = BucketKey::decode(key).and_then(|(bucket, part)| {
                        let minute_ms = bucket.minute.saturating_mul(MINUTE_MS);
                        match part {
                            BucketPart::Distinct(distinct) => {
                                fold.add_distinct(minute_ms, distinct)
                            }
                            BucketPart::DistinctSet => {
                                for distinct in codec::decode_distinct_set(value.to_vec())?.iter() {
                                    fold.add_distinct(minute_ms, distinct);
                                }
                            }
                            BucketPart::Aggregate => {
                                fold.add_bucket(minute_ms, &codec::decode_aggregate(value)?)
                            }
                            BucketPart::Latest => {
                                fold.add_latest(minute_ms, &codec::decode_latest(value)?)
                            }
                            BucketPart::Weighted => {
                                fold.add_weighted(minute_ms, &codec::decode_weighted(value)?)
                            }
                        }
                        Ok(())
                    });
                    match folded {
                        Ok(()) => Visit::Continue,
                        Err(error) => {
                            failure = Some(error);
                            Visit::Stop
                        }
                    }
                },
            )?;
            if let Some(error) = failure {
                return Err(error);
            }
        }
        let customer_id = (customer != ALL_CUSTOMERS).then(|| customer.to_string());
        Ok(fold.finish(customer_id))
    }

    /// Customers with any usage of the meter in the range.
    fn customers_with_usage(
        &self,
        meter: &Meter,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<BTreeSet<String>, EngineError> {
        let prefix = BucketKey::meter_prefix(&meter.store_id, meter.mode, &meter.id);
        let (mut first, last) = (start_ms.div_euclid(MINUTE_MS), end_ms.div_euclid(MINUTE_MS));
        if meter.aggregation == Aggregation::TimeWeightedSum {
            // A value held from before the range counts in it.
            first = i64::MIN;
        }
        let mut customers = BTreeSet::new();
        let mut failure = None;
        scan_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            &mut |key, _| match BucketKey::decode(key) {
                Ok((bucket, _)) => {
                    if bucket.customer != ALL_CUSTOMERS
                        && bucket.minute >= first
                        && bucket.minute < last
                    {
                        customers.insert(bucket.customer);
                    }
                    Visit::Continue
                }
                Err(error) => {
                    failure = Some(error);
                    Visit::Stop
                }
            },
        )?;
        if let Some(error) = failure {
            return Err(error);
        }
        Ok(customers)
    }

    /// A customer's usage over the whole minutes from the one `start_ms` falls in to
    /// the one `end_ms` falls in (excluded): consecutive ranges count each event once
    /// (renewals bill `invoice` usage prices so). `None`: the value left the exact
    /// range, or the range is empty.
    pub fn period_usage(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<Option<Decimal>, EngineError> {
        let meter = self.get_meter(scope, meter_id)?;
        let start = start_ms.div_euclid(MINUTE_MS) * MINUTE_MS;
        let end = end_ms.div_euclid(MINUTE_MS) * MINUTE_MS;
        if end <= start {
            return Ok(Some(Decimal::ZERO));
        }
        let series = self.usage_series(&meter, customer_id, start, end, Window::None)?;
        Ok(series.value)
    }

    /// The events of a customer in the same whole minutes as `period_usage` that a
    /// meter stopped counting because they were voided or amended (docs/api.md,
    /// "Late usage and corrections").
    pub fn period_voided_events(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<u64, EngineError> {
        let prefix = keys::voided_count_prefix(&scope.store_id, scope.mode, meter_id, customer_id);
        let from = prefix
            .clone()
            .int(start_ms.div_euclid(MINUTE_MS))
            .into_bytes();
        let to = prefix.int(end_ms.div_euclid(MINUTE_MS)).into_bytes();
        let (mut total, mut failure) = (0u64, None);
        self.journal.store().scan(
            Bound::Included(&from),
            Bound::Excluded(&to),
            false,
            &mut |_, value| match codec::decode_count(value) {
                Ok(count) => {
                    total = total.saturating_add(count);
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
            None => Ok(total),
        }
    }

    /// `GET /v1/meters/{id}/usage`.
    pub fn query_usage(
        &self,
        scope: &Scope,
        query: &UsageQuery,
    ) -> Result<UsageResult, EngineError> {
        let meter = self.get_meter(scope, &query.meter_id)?;
        let (start_ms, end_ms) = minute_range(query.start_ms, query.end_ms)?;
        let customer = query.customer_id.as_deref().unwrap_or(ALL_CUSTOMERS);
        let total = self.usage_series(&meter, customer, start_ms, end_ms, query.window)?;
        let groups = if query.group_by_customer && query.customer_id.is_none() {
            let customers = self.customers_with_usage(&meter, start_ms, end_ms)?;
            if customers.len() > MAX_USAGE_GROUPS {
                return Err(FieldError::invalid(
                    "group_by",
                    format!("more than {MAX_USAGE_GROUPS} customers; filter by customer"),
                )
                .into());
            }
            Some(
                customers
                    .iter()
                    .map(|c| self.usage_series(&meter, c, start_ms, end_ms, query.window))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        } else {
            None
        };
        Ok(UsageResult {
            meter,
            start_ms,
            end_ms,
            total,
            groups,
        })
    }

    /// Each customer's value of `meter` (a revised definition, not stored yet) over
    /// the stored events with timestamps in the range, counted as the revision will
    /// count them (`Meter::counts_revised`): a revision's dry run. For
    /// `time_weighted_sum` the value each customer held when the range begins counts
    /// too (it is not re-derived), for `holders` as well (customers the meter counts
    /// now, who may have no event in the range).
    pub(crate) async fn preview_by_customer(
        &self,
        scope: &Scope,
        meter: &Meter,
        start_ms: i64,
        end_ms: i64,
        holders: &BTreeSet<String>,
    ) -> Result<std::collections::BTreeMap<String, Option<Decimal>>, EngineError> {
        let (lower, upper) = crate::events::received_between(scope, Some(start_ms), Some(end_ms));
        let weighted = meter.aggregation == Aggregation::TimeWeightedSum;
        let mut points: HashMap<String, Vec<(i64, String, Decimal)>> = HashMap::new();
        let mut folds: HashMap<String, WindowFold> = HashMap::new();
        let store = self.journal.store();
        let mut failure = None;
        self.scan_stored_events(scope, lower, upper, false, |_, events| {
            for (_, event) in events {
                if event.timestamp_ms < start_ms
                    || event.timestamp_ms >= end_ms
                    || event.name != meter.event_name
                {
                    continue;
                }
                let view = EventView {
                    name: &event.name,
                    timestamp_ms: event.timestamp_ms,
                    properties: &event.properties,
                };
                let marks = (|| -> Result<Option<(bool, bool)>, EngineError> {
                    let (store_id, mode) = (&scope.store_id, scope.mode);
                    if store
                        .get(&keys::voided_event_key(store_id, mode, &event.event_id))?
                        .is_some()
                    {
                        return Ok(None);
                    }
                    let backfilled =
                        keys::backfilled_key(store_id, mode, &meter.id, &event.event_id);
                    let skipped =
                        keys::fold_skipped_key(store_id, mode, &meter.id, &event.event_id);
                    Ok(Some((
                        store.get(&backfilled)?.is_some(),
                        store.get(&skipped)?.is_some(),
                    )))
                })();
                let (backfilled, skipped) = match marks {
                    Ok(Some(marks)) => marks,
                    Ok(None) => continue,
                    Err(error) => {
                        failure = Some(error);
                        return Visit::Stop;
                    }
                };
                if !meter.counts_revised(&view, backfilled, skipped) {
                    continue;
                }
                if weighted {
                    if let Contribution::Event { number: Some(n) } =
                        crate::apply::contribution_of(meter, event)
                    {
                        points
                            .entry(event.customer_id.to_string())
                            .or_default()
                            .push((event.timestamp_ms, event.event_id.clone(), n));
                    }
                    continue;
                }
                let fold = match folds.entry(event.customer_id.to_string()) {
                    std::collections::hash_map::Entry::Occupied(fold) => fold.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        match WindowFold::new(meter.aggregation, start_ms, end_ms, Window::None) {
                            Ok(fold) => slot.insert(fold),
                            Err(error) => {
                                failure = Some(error);
                                return Visit::Stop;
                            }
                        }
                    }
                };
                fold.add_single(event, &crate::apply::contribution_of(meter, event));
            }
            Visit::Continue
        })
        .await?;
        if let Some(error) = failure {
            return Err(error);
        }
        if weighted {
            let customers: BTreeSet<String> = points.keys().chain(holders).cloned().collect();
            let mut values = std::collections::BTreeMap::new();
            for customer in customers {
                let mut series = points.remove(&customer).unwrap_or_default();
                // Sorted before any event at the range's start ("" is the least id).
                if let Some(held) = self.held_before(scope, &meter.id, &customer, start_ms)? {
                    series.push((start_ms, String::new(), held));
                }
                let mut fold = WindowFold::new(meter.aggregation, start_ms, end_ms, Window::None)?;
                fold.set_areas_from_events(std::iter::once(series));
                let value = fold.finish(Some(customer.clone())).value;
                values.insert(customer, value);
            }
            return Ok(values);
        }
        Ok(folds
            .into_iter()
            .map(|(customer, fold)| {
                let value = fold.finish(Some(customer.clone())).value;
                (customer, value)
            })
            .collect())
    }

    /// The value a customer's `time_weighted_sum` series holds just before `at_ms`:
    /// its latest point before then (never pruned: a point is dropped only when a
    /// later one before the retention cut holds instead).
    fn held_before(
        &self,
        scope: &Scope,
        meter_id: &str,
        customer_id: &str,
        at_ms: i64,
    ) -> Result<Option<Decimal>, EngineError> {
        let prefix =
            keys::weighted_points_prefix(&scope.store_id, scope.mode, meter_id, customer_id);
        let upper = keys::weighted_point_key(&prefix, at_ms, "");
        let mut held = None;
        self.journal.store().scan(
            Bound::Included(&prefix),
            Bound::Excluded(&upper),
            true,
            &mut |_, value| {
                held = Some(codec::decode_decimal(value));
                Visit::Stop
            },
        )?;
        held.transpose()
    }

    /// `POST /v1/meters/preview` and `/v1/meters/{id}/preview`: runs a definition over
    /// stored events with timestamps in the range. Returns the series, the events
    /// scanned and matched, and whether the scan stopped at its limit.
    pub async fn preview_meter(
        &self,
        scope: &Scope,
        definition: &MeterDefinition,
        customer_id: Option<&str>,
        start_ms: i64,
        end_ms: i64,
        window: Window,
    ) -> Result<(UsageSeries, usize, usize, bool), EngineError> {
        if end_ms <= start_ms {
            return Err(FieldError::invalid("end", "`end` must be after `start`").into());
        }
        let mut fold = WindowFold::new(definition.aggregation, start_ms, end_ms, window)?;
        let weighted = definition.aggregation == Aggregation::TimeWeightedSum;
        // Only rows received when an event of the range could be; a time-weighted
        // value also holds from earlier events.
        let from = (!weighted).then_some(start_ms);
        let (lower, upper) = crate::events::received_between(scope, from, Some(end_ms));
        // time_weighted_sum: each customer's events up to the range's end.
        let mut points: HashMap<String, Vec<(i64, String, Decimal)>> = HashMap::new();
        let (mut scanned, mut matched, mut truncated) = (0usize, 0usize, false);
        // Voided events count nowhere, in a preview neither.
        let skip_voided = self.any_voided(scope)?;
        let mut failure = None;
        self.scan_stored_events(scope, lower, upper, false, |_, events| {
            for (_, event) in events {
                scanned += 1;
                if scanned > MAX_PREVIEW_SCAN_EVENTS {
                    truncated = true;
                    return Visit::Stop;
                }
                let before_range = event.timestamp_ms < start_ms;
                if (before_range && !weighted)
                    || event.timestamp_ms >= end_ms
                    || customer_id.is_some_and(|c| event.customer_id != *c)
                    || event.name != definition.event_name
                {
                    continue;
                }
                if skip_voided {
                    match self.event_void(scope, &event.event_id) {
                        Ok(Some(_)) => continue,
                        Ok(None) => {}
                        Err(error) => {
                            failure = Some(error);
                            return Visit::Stop;
                        }
                    }
                }
                let view = EventView {
                    name: &event.name,
                    timestamp_ms: event.timestamp_ms,
                    properties: &event.properties,
                };
                if definition.filter.matches(&view) {
                    let value = definition
                        .aggregation_property
                        .as_ref()
                        .and_then(|p| event.properties.get(p));
                    let contribution = contribution(definition.aggregation, value);
                    if let (true, Contribution::Event { number: Some(n) }) =
                        (weighted, &contribution)
                    {
                        points
                            .entry(event.customer_id.to_string())
                            .or_default()
                            .push((event.timestamp_ms, event.event_id.clone(), *n));
                    }
                    if before_range {
                        continue;
                    }
                    matched += 1;
                    fold.add_single(event, &contribution);
                }
            }
            Visit::Continue
        })
        .await?;
        if let Some(error) = failure {
            return Err(error);
        }
        if weighted {
            fold.set_areas_from_events(points.into_values());
        }
        Ok((
            fold.finish(customer_id.map(str::to_string)),
            scanned.min(MAX_PREVIEW_SCAN_EVENTS),
            matched,
            truncated,
        ))
    }
}
