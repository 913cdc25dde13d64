//! The aggregation fold: how one event changes a bucket, how buckets merge, and what
//! value a set of buckets has. Exact decimal arithmetic throughout.
//!
//! A bucket is the usage of one meter, one customer, one minute. `unique` keeps its
//! distinct values beside the bucket (see [`distinct_key`]); the bucket itself only
//! counts events, so merging buckets is associative and commutative.

use rust_decimal::Decimal;

use crate::exact::exact_add;
use crate::meter::Aggregation;
use crate::usage::PropertyValue;

/// The fold state of one bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aggregate {
    /// Events folded into the bucket (the `count` value).
    pub events: u64,
    /// Events that carried a numeric aggregation property.
    pub numeric_events: u64,
    pub sum: Decimal,
    pub min: Option<Decimal>,
    pub max: Option<Decimal>,
    /// The exact sum left rust_decimal's 28 significant digits: `sum` is no longer
    /// meaningful, and sum and average have no value. Sticky, and merged by `or`, so
    /// folding stays associative whatever the input.
    pub overflowed: bool,
}

/// What an event contributes to a meter, decided from its properties.
#[derive(Debug, Clone, PartialEq)]
pub enum Contribution {
    /// Counted as an event; `number` when the aggregation property was numeric.
    Event { number: Option<Decimal> },
    /// `unique`: the distinct value (type-tagged key).
    Distinct(String),
    /// The aggregation property is missing or unusable: the event is skipped.
    Skipped,
}

/// What one event contributes to a meter with `aggregation` over `property`.
pub fn contribution(
    aggregation: Aggregation,
    property_value: Option<&PropertyValue>,
) -> Contribution {
    match aggregation {
        Aggregation::Count => Contribution::Event { number: None },
        Aggregation::Unique => match property_value {
            Some(value) => Contribution::Distinct(value.distinct_key()),
            None => Contribution::Skipped,
        },
        _ => match property_value.and_then(PropertyValue::as_number) {
            Some(number) => Contribution::Event {
                number: Some(number),
            },
            None => Contribution::Skipped,
        },
    }
}

impl Aggregate {
    /// Folds one event in. `number` is the numeric property, when there is one.
    pub fn add(&mut self, number: Option<Decimal>) {
        self.events += 1;
        if let Some(n) = number {
            self.numeric_events += 1;
            self.add_to_sum(n);
            self.min = Some(self.min.map_or(n, |m| m.min(n)));
            self.max = Some(self.max.map_or(n, |m| m.max(n)));
        }
    }

    /// Inputs are bounded (limits::MAX_PROPERTY_NUMBER_ABS), so only a hostile stream
    /// leaves the exact range; then the bucket says so instead of rounding.
    fn add_to_sum(&mut self, n: Decimal) {
        if self.overflowed {
            return;
        }
        match exact_add(self.sum, n) {
            Some(sum) => self.sum = sum,
            None => {
                self.overflowed = true;
                self.sum = Decimal::ZERO;
            }
        }
    }

    pub fn merge(&mut self, other: &Aggregate) {
        self.events += other.events;
        self.numeric_events += other.numeric_events;
        self.overflowed |= other.overflowed;
        self.add_to_sum(other.sum);
        self.min = match (self.min, other.min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.max = match (self.max, other.max) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }

    /// The meter value of this (merged) bucket. `distinct_values` is used by
    /// `unique`; `latest` and `time_weighted_sum` have none here (see `gauge`). `None` when min/max/average have no data point, and for sum and
    /// average when the exact sum does not fit 28 significant digits.
    pub fn value(&self, aggregation: Aggregation, distinct_values: u64) -> Option<Decimal> {
        match aggregation {
            Aggregation::Count => Some(Decimal::from(self.events)),
            Aggregation::Sum => (!self.overflowed).then_some(self.sum),
            Aggregation::Average => {
                if self.numeric_events == 0 || self.overflowed {
                    None
                } else {
                    self.sum.checked_div(Decimal::from(self.numeric_events))
                }
            }
            Aggregation::Min => self.min,
            Aggregation::Max => self.max,
            Aggregation::Unique => Some(Decimal::from(distinct_values)),
            // Not a function of the counts: their folds are in `gauge`.
            Aggregation::Latest | Aggregation::TimeWeightedSum => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decimal() -> impl Strategy<Value = Decimal> {
        (-1_000_000_000i64..1_000_000_000, 0u32..6).prop_map(|(m, s)| Decimal::new(m, s))
    }

    proptest! {
        /// Folding a stream equals merging the folds of any split of it: this is
        /// what lets the projector fold per chunk and per bucket.
        #[test]
        fn fold_of_concatenation_is_merge_of_folds(
            values in proptest::collection::vec(proptest::option::of(decimal()), 0..60),
            split in 0usize..60,
        ) {
            let split = split.min(values.len());
            let mut whole = Aggregate::default();
            values.iter().for_each(|v| whole.add(*v));
            let mut left = Aggregate::default();
            values[..split].iter().for_each(|v| left.add(*v));
            let mut right = Aggregate::default();
            values[split..].iter().for_each(|v| right.add(*v));
            left.merge(&right);
            prop_assert_eq!(&left, &whole);
            let numbers: Vec<Decimal> = values.iter().flatten().copied().collect();
            prop_assert_eq!(whole.sum, numbers.iter().copied().sum::<Decimal>());
            prop_assert_eq!(whole.min, numbers.iter().copied().min());
            prop_assert_eq!(whole.max, numbers.iter().copied().max());
            prop_assert_eq!(whole.events as usize, values.len());
        }
    }

    #[test]
    fn average_is_exact_decimal() {
        let mut agg = Aggregate::default();
        for v in ["0.1", "0.2", "0.3"] {
            agg.add(Some(v.parse().unwrap()));
        }
        assert_eq!(agg.value(Aggregation::Sum, 0).unwrap().to_string(), "0.6");
        assert_eq!(
            agg.value(Aggregation::Average, 0)
                .unwrap()
                .normalize()
                .to_string(),
            "0.2"
        );
        assert_eq!(Aggregate::default().value(Aggregation::Min, 0), None);
    }

    #[test]
    fn contributions_skip_unusable_properties() {
        let s = PropertyValue::String("abc".into());
        assert_eq!(
            contribution(Aggregation::Sum, Some(&s)),
            Contribution::Skipped
        );
        assert_eq!(contribution(Aggregation::Sum, None), Contribution::Skipped);
        assert_eq!(
            contribution(Aggregation::Unique, Some(&s)),
            Contribution::Distinct("s:abc".into())
        );
        assert_eq!(
            contribution(Aggregation::Count, None),
            Contribution::Event { number: None }
        );
    }
}
