//! Meter revisions (docs/api.md, "Meter revisions"): a meter's filter or
//! aggregation property changes explicitly, and its usage is re-derived from the
//! stored events for every minute an event can still be ingested into.
//!
//! The service appends `MeterRevised` steps; apply decides them in log order. The
//! first step switches the meter to the new definition (revision + 1, and a `` ` ``
//! row so that apply decides the meter's new events from its definition, whatever
//! ingest matched); every step rebuilds the meter's buckets of its minutes as a void
//! rebuilds one (each customer's from its events of the minute, read back through
//! the `z` rows; then the all-customers bucket, as a void does; a
//! `time_weighted_sum` meter's held values span minutes, so each event's point is
//! set to what the new definition makes it, linearly, as ingest and voids change
//! them). Minutes are
//! rebuilt from the log's truth, so events applied meanwhile (already folded by the
//! new definition) are neither lost nor counted twice. Steps are bounded by the `z`
//! rows (records read back) their minutes hold.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use rust_decimal::Decimal;
use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::Scope;
use tally_domain::limits::{MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_SKEW_MS};
use tally_domain::meter::{revise_meter, Aggregation, Meter, MeterStatus, RevisionInput};
use tally_domain::record::Record;
use tally_domain::time::{minute_bucket, Window, MINUTE_MS};
use tally_projection::Visit;

use crate::apply::{load_meter, MeteringApplied};
use crate::charged;
use crate::usage::UsageQuery;
use crate::voids::{fetch, rebuild_customer, rebuild_minute_total, MinuteEvents, Uncounted};
use crate::Metering;
use tally_core::event_index::EventLocation;

/// `z` rows (usage records to read back) one step's minutes may hold, at least one
/// minute per step: bounds the records one apply reads and holds.
pub const REVISION_ROWS_PER_STEP: usize = 256;

/// Steps between two progress lines in the server's log.
const REVISION_PROGRESS_EVERY: usize = 100;

/// A customer whose usage a revision changes (over the re-derived history).
#[derive(Debug, Clone, PartialEq)]
pub struct RevisionChange {
    pub customer_id: String,
    pub before: Option<Decimal>,
    pub after: Option<Decimal>,
}

/// What a revision request did (or, on a dry run, would do).
#[derive(Debug, Clone)]
pub struct RevisionResult {
    pub dry_run: bool,
    /// The meter: revised, or as it is on a dry run.
    pub meter: Meter,
    pub changes: Vec<RevisionChange>,
}

/// Why a meter cannot be revised: archived.
pub fn check_revisable(meter: &Meter) -> Result<(), Outcome> {
    if meter.status != MeterStatus::Active {
        return Err(Outcome::rejected(
            "meter_not_active",
            "an archived meter cannot be revised; unarchive it first",
        ));
    }
    Ok(())
}

fn superseded() -> Outcome {
    Outcome::rejected(
        "resource_changed",
        "the meter was revised meanwhile by another request; read it and send the revision again",
    )
}

/// A `MeterRevised` step at its log position: switches the meter on its first
/// step, then rebuilds its buckets of `minutes`. With `corrections`, what each
/// event of those minutes was charged by its earlier definition less what the new
/// one charges (units taken back; negative: units to charge) is noted there, with
/// the record that stored it, for usage settlement (docs/api.md, "Meter
/// revisions").
pub fn apply_revision(
    overlay: &mut Overlay<'_>,
    revised: &Meter,
    minutes: &[i64],
    position: (u32, u64),
    at_ms: i64,
    applied: &mut MeteringApplied,
    mut corrections: Option<&mut Vec<Uncounted>>,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (revised.store_id.as_str(), revised.mode);
    let mut meter = load_meter(overlay, store_id, mode, &revised.id)?;
    if meter.revision.checked_add(1) == Some(revised.revision) {
        check_revisable(&meter)?;
        let before = meter.clone();
        let kept = charged::kept_definitions(overlay, &before)?;
        meter.filter = revised.filter.clone();
        meter.aggregation_property = revised.aggregation_property.clone();
        meter.revision = revised.revision;
        // A newer version: an update derived from the one before is refused (and
        // derived again), so it cannot put the old definition back.
        meter.updated_at_ms = at_ms.max(meter.updated_at_ms.saturating_add(1));
        overlay.put(
            keys::meter_key(store_id, mode, &meter.id),
            codec::encode_meter(&meter),
        );
        // The definitions usage was charged by: a store's records share one
        // partition, so this step's offset orders it with every usage record.
        let definitions = charged::with_revision(kept, &before, &meter, position);
        overlay.put(
            keys::revised_meter_key(store_id, mode, &meter.id),
            definitions
                .map(|d| codec::encode_meter_definitions(&d))
                .unwrap_or_default(),
        );
        applied.meters.push(meter.clone());
    } else if meter.revision != revised.revision
        || meter.filter != revised.filter
        || meter.aggregation_property != revised.aggregation_property
    {
        return Err(superseded().into());
    }
    let mut events = MinuteEvents::default();
    // Every record the rebuilds read (each customer's events: the whole minute),
    // asked for at once.
    let mut wanted = Vec::new();
    for &minute in minutes {
        for customer in events.customers(overlay, store_id, mode, minute)? {
            wanted.extend(events.of(overlay, store_id, mode, minute, &customer)?);
        }
    }
    fetch(overlay, &wanted)?;
    let charged = charged::is_charged(&meter);
    let definitions = match (charged, &corrections) {
        (true, Some(_)) => charged::kept_definitions(overlay, &meter)?,
        _ => None,
    };
    for &minute in minutes {
        let customers = events.customers(overlay, store_id, mode, minute)?;
        // Read only where corrections are made; written wherever charges can be.
        let revision = match (charged, &corrections) {
            (true, Some(_)) => charged::minute_revision(overlay, &meter, minute)?,
            _ => 0,
        };
        for customer in &customers {
            let locations = events.of(overlay, store_id, mode, minute, customer)?;
            if let (Some(out), true) = (corrections.as_deref_mut(), charged) {
                correct_charged(overlay, &meter, &definitions, revision, &locations, out)?;
            }
            rebuild_customer(overlay, &meter, customer, minute, &locations)?;
        }
        rebuild_minute_total(overlay, &mut events, &meter, minute)?;
        if charged {
            charged::note_minute_revision(overlay, &meter, minute);
        }
    }
    Ok(())
}

/// Notes, for each event at `locations` (one customer's of a minute the meter's
/// revision `revision` rebuilt last, 0: none), what it was charged less what the
/// meter charges for it now, where they differ. A voided event was given back
/// already; one whose charge is no longer known is left as it was (`charged_by`).
fn correct_charged(
    overlay: &Overlay<'_>,
    meter: &Meter,
    definitions: &Option<codec::MeterDefinitions>,
    revision: u32,
    locations: &[EventLocation],
    out: &mut Vec<Uncounted>,
) -> Result<(), EngineError> {
    for location in locations {
        let batch = overlay.batch_at(location.partition, location.offset)?;
        let Some(event) = batch.event(location.index)? else {
            return Err(EngineError::Corrupt(format!(
                "a minute-events row points at event {} of the record at partition {} offset {}, which has fewer",
                location.index, location.partition, location.offset
            )));
        };
        if event.name != meter.event_name
            || overlay.contains(&keys::voided_event_key(
                &meter.store_id,
                meter.mode,
                &event.event_id,
            ))?
        {
            continue;
        }
        let was = charged::charged_by(
            meter,
            definitions,
            revision,
            (location.partition, location.offset),
        );
        let quantity = charged::overcharged(overlay, was, meter, event)?;
        if !quantity.is_zero() {
            out.push(Uncounted {
                customer_id: event.customer_id.clone(),
                meter_id: meter.id.clone(),
                timestamp_ms: event.timestamp_ms,
                quantity,
                stored_by: (location.partition, location.offset),
            });
        }
    }
    Ok(())
}

/// The value a customer without usage has: zero for additive aggregations, none
/// for the others (as usage queries answer).
fn empty_value(aggregation: Aggregation) -> Option<Decimal> {
    match aggregation {
        Aggregation::Count
        | Aggregation::Sum
        | Aggregation::Unique
        | Aggregation::TimeWeightedSum => Some(Decimal::ZERO),
        Aggregation::Min | Aggregation::Max | Aggregation::Average | Aggregation::Latest => None,
    }
}

/// The customers whose value differs between `before` and `after`.
fn changes(
    aggregation: Aggregation,
    before: &BTreeMap<String, Option<Decimal>>,
    after: &BTreeMap<String, Option<Decimal>>,
) -> Vec<RevisionChange> {
    let customers: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    let value = |values: &BTreeMap<String, Option<Decimal>>, customer: &str| {
        values
            .get(customer)
            .copied()
            .unwrap_or_else(|| empty_value(aggregation))
            .map(|d| d.normalize())
    };
    customers
        .into_iter()
        .filter_map(|customer| {
            let (was, will) = (value(before, customer), value(after, customer));
            (was != will).then(|| RevisionChange {
                customer_id: customer.clone(),
                before: was,
                after: will,
            })
        })
        .collect()
}

impl Metering {
    /// `POST /v1/meters/{id}/revisions`: on a dry run, the customers whose usage the
    /// revision would change (their buckets now against the stored events run
    /// through the new definition); otherwise the revision, applied step by step,
    /// and the customers whose usage it changed.
    pub async fn revise_meter(
        &self,
        scope: &Scope,
        id: &str,
        input: &RevisionInput,
        dry_run: bool,
    ) -> Result<RevisionResult, EngineError> {
        let meter = self.get_meter(scope, id)?;
        let revised = revise_meter(&meter, input)?;
        check_revisable(&meter)?;
        self.journal.wait_caught_up().await?;
        let (start_ms, end_ms) = self.revised_history(scope);
        let before = self.values_by_customer(scope, id, start_ms, end_ms)?;
        if dry_run {
            let holders = before.keys().cloned().collect();
            let after = self
                .preview_by_customer(scope, &revised, start_ms, end_ms, &holders)
                .await?;
            return Ok(RevisionResult {
                dry_run,
                changes: changes(meter.aggregation, &before, &after),
                meter,
            });
        }
        tracing::info!(
            meter_id = id,
            revision = revised.revision,
            "revision started"
        );
        let (mut from, mut steps, mut first) = (minute_bucket(start_ms), 0usize, true);
        loop {
            let (minutes, next) = self.revision_minutes(scope, from, minute_bucket(end_ms))?;
            if first || !minutes.is_empty() {
                let step = Record::MeterRevised {
                    meter: revised.clone(),
                    minutes,
                };
                self.journal.append_and_decide(&step).await?;
                first = false;
                steps += 1;
                if steps.is_multiple_of(REVISION_PROGRESS_EVERY) {
                    tracing::info!(meter_id = id, steps, "revision in progress");
                }
            }
            match next {
                Some(minute) => from = minute,
                None => break,
            }
        }
        tracing::info!(meter_id = id, steps, "revision finished");
        let after = self.values_by_customer(scope, id, start_ms, end_ms)?;
        Ok(RevisionResult {
            dry_run,
            changes: changes(meter.aggregation, &before, &after),
            meter: self.get_meter(scope, id)?,
        })
    }

    /// The history a revision re-derives: every minute an event can be ingested
    /// into now (all of its events are stored), in the scope's business time.
    fn revised_history(&self, scope: &Scope) -> (i64, i64) {
        let now = self.journal.now_in(scope);
        let start = (now - MAX_EVENT_AGE_MS).div_euclid(MINUTE_MS) * MINUTE_MS;
        let end = (now + MAX_EVENT_FUTURE_SKEW_MS).div_euclid(MINUTE_MS) * MINUTE_MS + MINUTE_MS;
        (start, end)
    }

    /// Each customer's value of the meter over the range, from its buckets.
    fn values_by_customer(
        &self,
        scope: &Scope,
        meter_id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<BTreeMap<String, Option<Decimal>>, EngineError> {
        let result = self.query_usage(
            scope,
            &UsageQuery {
                meter_id: meter_id.to_string(),
                customer_id: None,
                start_ms,
                end_ms,
                window: Window::None,
                group_by_customer: true,
            },
        )?;
        Ok(result
            .groups
            .unwrap_or_default()
            .into_iter()
            .filter_map(|group| Some((group.customer_id?, group.value)))
            .collect())
    }

    /// The minutes (`minute_bucket` numbers) of one step, from `from` on (before
    /// `end`): the scope's minutes with `z` rows, until they hold
    /// `REVISION_ROWS_PER_STEP` rows; and where the next step begins, if anything
    /// is left.
    fn revision_minutes(
        &self,
        scope: &Scope,
        from: i64,
        end: i64,
    ) -> Result<(Vec<i64>, Option<i64>), EngineError> {
        let lower = Key::table(keys::MINUTE_EVENTS).int(from).into_bytes();
        let upper = Key::table(keys::MINUTE_EVENTS).int(end).into_bytes();
        let (mut minutes, mut rows, mut next) = (Vec::<i64>::new(), 0usize, None);
        let mut failure = None;
        self.journal.store().scan(
            Bound::Included(&lower),
            Bound::Excluded(&upper),
            false,
            &mut |key, _| {
                let minute = match keys::minute_events_minute(key) {
                    Ok(minute) => minute,
                    Err(error) => {
                        failure = Some(error);
                        return Visit::Stop;
                    }
                };
                if !key.starts_with(&keys::minute_events_prefix(
                    minute,
                    &scope.store_id,
                    scope.mode,
                )) {
                    return Visit::Continue;
                }
                if minutes.last() != Some(&minute) {
                    if rows >= REVISION_ROWS_PER_STEP {
                        next = Some(minute);
                        return Visit::Stop;
                    }
                    minutes.push(minute);
                }
                rows += 1;
                Visit::Continue
            },
        )?;
        match failure {
            Some(error) => Err(error),
            None => Ok((minutes, next)),
        }
    }
}
