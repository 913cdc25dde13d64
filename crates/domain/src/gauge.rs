//! The folds of the two aggregations over a value that holds until it changes (a
//! gauge: seats, stored gigabytes): `latest` and `time_weighted_sum`
//! (docs/api.md, "Meters").
//!
//! `latest` keeps, per minute bucket, the event with the greatest timestamp (ties:
//! the greater event id); buckets merge by keeping the later point, so the fold is
//! associative and commutative like the others.
//!
//! `time_weighted_sum` is an integral. Per customer the value is a step function: 0
//! before the first event, then each event's value from its timestamp until the
//! customer's next event (events ordered by timestamp, then event id). Write it as
//! a sum of steps: an event at `t` changes the held value by `d = v - v_before`.
//! Over a window `[a, b)` the integral is then
//!
//! ```text
//!   f(a) * (b - a)  +  sum over events in [a, b) of d * (b - t)
//! ```
//!
//! where `f(a)` is the value held at `a` (the sum of every earlier `d`). A minute
//! bucket keeps `sum d` and `sum d * (t - minute start)`, which is all the formula
//! needs, and it is linear: the all-customers bucket is the same sums over every
//! customer, and an event that arrives out of order only changes its own `d` and
//! its successor's. The integral is computed in value x milliseconds, exactly, and
//! turned into value x hours by one division at the end.

use rust_decimal::Decimal;

use crate::exact::{exact_add, exact_mul_int};
use crate::time::{HOUR_MS, MINUTE_MS};

/// A `latest` candidate: an event's timestamp, id and value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatestPoint {
    pub timestamp_ms: i64,
    pub event_id: String,
    pub value: Decimal,
}

impl LatestPoint {
    /// Whether this point is later than `other`: a greater timestamp, or the same
    /// timestamp and a greater event id.
    pub fn is_after(&self, other: &LatestPoint) -> bool {
        (self.timestamp_ms, self.event_id.as_str()) > (other.timestamp_ms, other.event_id.as_str())
    }
}

/// Keeps the later of `slot` and `candidate` in `slot`; true when it changed.
pub fn keep_latest(slot: &mut Option<LatestPoint>, candidate: &LatestPoint) -> bool {
    let later = slot.as_ref().is_none_or(|held| candidate.is_after(held));
    if later {
        *slot = Some(candidate.clone());
    }
    later
}

/// One minute of a time-weighted meter: the changes its events make to the held
/// value (`delta`, the sum of `d`) and their weight by position in the minute
/// (`delta_ms`, the sum of `d * (t - minute start)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightedBucket {
    pub delta: Decimal,
    pub delta_ms: Decimal,
    /// A sum left the exact range (only a hostile stream gets there): the bucket,
    /// and every window holding it or after it, has no value. Sticky.
    pub overflowed: bool,
}

impl WeightedBucket {
    /// Adds a change of `change` at `offset_ms` into the minute (0..60,000).
    pub fn add_change(&mut self, offset_ms: i64, change: Decimal) {
        if self.overflowed {
            return;
        }
        let sums = exact_add(self.delta, change).and_then(|delta| {
            let weighted = exact_mul_int(change, offset_ms)?;
            Some((delta, exact_add(self.delta_ms, weighted)?))
        });
        match sums {
            Some((delta, delta_ms)) => {
                self.delta = delta;
                self.delta_ms = delta_ms;
            }
            None => *self = WeightedBucket::overflowed(),
        }
    }

    fn overflowed() -> WeightedBucket {
        WeightedBucket {
            overflowed: true,
            ..WeightedBucket::default()
        }
    }
}

/// The change an event makes at `timestamp_ms` to a bucket (its minute's offset).
pub fn offset_in_minute(timestamp_ms: i64) -> i64 {
    timestamp_ms.rem_euclid(MINUTE_MS)
}

/// The time-weighted fold of one series: the value held going into the next window
/// and, per window, the area (value x ms) the buckets inside it add.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightedWindow {
    /// Sum of the `delta` of the window's buckets.
    pub delta: Decimal,
    /// Sum over the window's buckets of `delta * (window end - minute) - delta_ms`.
    pub area: Decimal,
    pub overflowed: bool,
}

impl WeightedWindow {
    /// Adds the bucket of the minute starting at `minute_ms` to a window ending at
    /// `end_ms`.
    pub fn add(&mut self, end_ms: i64, minute_ms: i64, bucket: &WeightedBucket) {
        if self.overflowed || bucket.overflowed {
            self.overflowed = true;
            return;
        }
        let sums = exact_add(self.delta, bucket.delta).and_then(|delta| {
            let held = exact_mul_int(bucket.delta, end_ms.checked_sub(minute_ms)?)?;
            let area = exact_add(self.area, exact_add(held, -bucket.delta_ms)?)?;
            Some((delta, area))
        });
        match sums {
            Some((delta, area)) => {
                self.delta = delta;
                self.area = area;
            }
            None => self.overflowed = true,
        }
    }

    /// The window's integral in value x ms, given the value held at its start, and
    /// the value held at its end; `None` when a sum left the exact range.
    pub fn close(
        &self,
        held: Option<Decimal>,
        start_ms: i64,
        end_ms: i64,
    ) -> (Option<Decimal>, Option<Decimal>) {
        if self.overflowed {
            return (None, None);
        }
        let Some(held) = held else {
            return (None, None);
        };
        let area = end_ms
            .checked_sub(start_ms)
            .and_then(|length| exact_mul_int(held, length))
            .and_then(|carried| exact_add(carried, self.area));
        (area, exact_add(held, self.delta))
    }
}

/// value x ms in value x hours (one division, rounded only past 28 significant
/// digits).
pub fn ms_to_hours(area: Decimal) -> Option<Decimal> {
    area.checked_div(Decimal::from(HOUR_MS))
}

/// The changes of one customer's events, given as (timestamp, value) sorted by
/// timestamp then event id: each event's value minus the one before it (0 before
/// the first).
pub fn changes(points: &[(i64, Decimal)]) -> Vec<(i64, Option<Decimal>)> {
    let mut before = Decimal::ZERO;
    points
        .iter()
        .map(|(at, value)| {
            let change = value.checked_sub(before);
            before = *value;
            (*at, change)
        })
        .collect()
}

/// One customer's integral (value x ms) over each of `windows` (in order, not
/// overlapping), straight from its events given as (timestamp, value) sorted by
/// timestamp then event id: what a meter preview computes from stored events.
pub fn integrate(points: &[(i64, Decimal)], windows: &[(i64, i64)]) -> Vec<Option<Decimal>> {
    let mut next = 0;
    let mut held = Decimal::ZERO;
    windows
        .iter()
        .map(|(start, end)| {
            while let Some((_, value)) = points.get(next).filter(|(at, _)| at <= start) {
                held = *value;
                next += 1;
            }
            let mut area = Some(Decimal::ZERO);
            let mut from = *start;
            while let Some((at, value)) = points.get(next).filter(|(at, _)| at < end) {
                area = add_held(area, held, at.saturating_sub(from));
                from = *at;
                held = *value;
                next += 1;
            }
            add_held(area, held, end.saturating_sub(from))
        })
        .collect()
}

/// `area + held * length_ms`, exactly.
fn add_held(area: Option<Decimal>, held: Decimal, length_ms: i64) -> Option<Decimal> {
    exact_add(area?, exact_mul_int(held, length_ms)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn point(at: i64, id: &str, value: i64) -> LatestPoint {
        LatestPoint {
            timestamp_ms: at,
            event_id: id.into(),
            value: Decimal::from(value),
        }
    }

    #[test]
    fn latest_prefers_the_greater_timestamp_then_the_greater_event_id() {
        let mut slot = None;
        assert!(keep_latest(&mut slot, &point(10, "b", 1)));
        assert!(!keep_latest(&mut slot, &point(9, "z", 2)));
        assert!(!keep_latest(&mut slot, &point(10, "a", 3)));
        assert!(keep_latest(&mut slot, &point(10, "c", 4)));
        assert_eq!(slot.unwrap().value, Decimal::from(4));
    }

    #[test]
    fn two_held_for_ninety_minutes_is_three() {
        // One event of 2 at 00:00, the window is [00:00, 01:30).
        let mut bucket = WeightedBucket::default();
        bucket.add_change(0, Decimal::from(2));
        let mut window = WeightedWindow::default();
        window.add(90 * MINUTE_MS, 0, &bucket);
        let (area, held) = window.close(Some(Decimal::ZERO), 0, 90 * MINUTE_MS);
        assert_eq!(ms_to_hours(area.unwrap()), Some(Decimal::from(3)));
        assert_eq!(held, Some(Decimal::from(2)));
    }

    /// The integral of the step function, point by point, in value x ms.
    fn reference(points: &[(i64, Decimal)], start: i64, end: i64) -> Decimal {
        let mut area = Decimal::ZERO;
        for (i, (at, value)) in points.iter().enumerate() {
            let until = points.get(i + 1).map_or(end, |next| next.0).min(end);
            let from = (*at).max(start);
            if until > from {
                area += *value * Decimal::from(until - from);
            }
        }
        area
    }

    proptest! {
        /// Bucketed and windowed, the fold equals the integral of the step function
        /// over any window split.
        #[test]
        fn windows_of_buckets_integrate_the_step_function(
            mut raw in proptest::collection::vec((0i64..600_000, -1_000i64..1_000), 0..30),
            cuts in proptest::collection::vec(0i64..600_000, 0..5),
        ) {
            raw.sort_by_key(|(at, _)| *at);
            let points: Vec<(i64, Decimal)> =
                raw.iter().map(|(at, v)| (*at, Decimal::new(*v, 1))).collect();
            let mut buckets: BTreeMap<i64, WeightedBucket> = BTreeMap::new();
            for (at, change) in changes(&points) {
                buckets
                    .entry(at.div_euclid(MINUTE_MS))
                    .or_default()
                    .add_change(offset_in_minute(at), change.unwrap());
            }
            let mut bounds: Vec<i64> = cuts.iter().map(|c| c.div_euclid(MINUTE_MS) * MINUTE_MS).collect();
            bounds.extend([0, 600_000]);
            bounds.sort_unstable();
            bounds.dedup();
            let mut held = Some(Decimal::ZERO);
            let mut total = Decimal::ZERO;
            for pair in bounds.windows(2) {
                let mut window = WeightedWindow::default();
                for (minute, bucket) in buckets.range(pair[0] / MINUTE_MS..pair[1] / MINUTE_MS) {
                    window.add(pair[1], minute * MINUTE_MS, bucket);
                }
                let (area, next) = window.close(held, pair[0], pair[1]);
                prop_assert_eq!(area, Some(reference(&points, pair[0], pair[1])));
                total += area.unwrap();
                held = next;
            }
            prop_assert_eq!(total, reference(&points, 0, 600_000));
            let windows: Vec<(i64, i64)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
            let direct: Vec<Option<Decimal>> = windows
                .iter()
                .map(|(start, end)| Some(reference(&points, *start, *end)))
                .collect();
            prop_assert_eq!(integrate(&points, &windows), direct);
        }
    }
}
