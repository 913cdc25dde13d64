//! What usage settlement charged for an event (docs/api.md, "Usage prices settled
//! in credits", "Meter revisions"): the meter units it added under the definition
//! its meter had when it was charged, so that a void gives back, and a revision
//! corrects, exactly what was charged.
//!
//! Apply counts a usage record's events by the meter's definition at the record's
//! position (a store's records share one partition, so offsets order them). A
//! revision switches the definition at its first step's offset and corrects a
//! minute's charged usage when a later step rebuilds that minute, noting the
//! revision in the minute's `REVISED_MINUTE` row. So an event was charged by the
//! definition of the later of two revisions: the one in force at its record's
//! offset, and the one that last rebuilt its minute. A revised meter's `` ` `` row
//! keeps its definitions for that (`codec::encode_meter_definitions`).

use rust_decimal::Decimal;
use tally_core::codec::{self, MeterDefinitions};
use tally_core::error::EngineError;
use tally_core::keys;
use tally_core::overlay::Overlay;
use tally_domain::meter::{Aggregation, EventView, Meter};
use tally_domain::usage::UsageEvent;

use crate::apply::settled_quantity;

/// Definitions a revised meter's row keeps, newest last: each is one meter
/// definition (a few hundred bytes) read with every revision step and every void of
/// the meter's events. Usage charged by a definition dropped from the row is taken
/// as charged by the current one (`charged_by`).
pub const MAX_KEPT_DEFINITIONS: usize = 32;

/// Whether `event` counted in `meter`: matched at ingest, the meter active when its
/// record applied (no `_` row) and counting from at or before its timestamp, or
/// folded by a backfill (a `B` row). The counting start only moves back, by a
/// backfill that folds what it uncovers, so the start now decides as the start then.
pub fn was_folded(
    overlay: &Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<bool, EngineError> {
    let backfilled = keys::backfilled_key(&meter.store_id, meter.mode, &meter.id, &event.event_id);
    let skipped = keys::fold_skipped_key(&meter.store_id, meter.mode, &meter.id, &event.event_id);
    if meter.revision > 1 {
        // A revised meter counts what its definition matches, whatever ingest
        // matched (apply decides its events from the definition too).
        let view = EventView {
            name: &event.name,
            timestamp_ms: event.timestamp_ms,
            properties: &event.properties,
        };
        return Ok(meter.counts_revised(
            &view,
            overlay.contains(&backfilled)?,
            overlay.contains(&skipped)?,
        ));
    }
    // Folded at ingest (matched, counting, not skipped) or by a backfill: the
    // in-memory test first, so the usual event costs one look-up, not two.
    let matched = event.matched_meter_ids.contains(&meter.id);
    if matched && event.timestamp_ms >= meter.counts_from_ms && !overlay.contains(&skipped)? {
        return Ok(true);
    }
    overlay.contains(&backfilled)
}

/// The units `event` adds to `meter` that settlement charges: zero when the meter
/// does not count it (or its aggregation is never settled in credits).
pub fn charged_units(
    overlay: &Overlay<'_>,
    meter: &Meter,
    event: &UsageEvent,
) -> Result<Decimal, EngineError> {
    if meter.event_name != event.name || !was_folded(overlay, meter, event)? {
        return Ok(Decimal::ZERO);
    }
    Ok(settled_quantity(meter, event).unwrap_or(Decimal::ZERO))
}

/// Whether settlement can charge usage of the meter at all (`count` and `sum`).
pub fn is_charged(meter: &Meter) -> bool {
    matches!(meter.aggregation, Aggregation::Count | Aggregation::Sum)
}

/// A meter's definitions as its `` ` `` row keeps them; `None` when unknown (a
/// revision of an earlier build) or never revised.
pub fn kept_definitions(
    overlay: &Overlay<'_>,
    meter: &Meter,
) -> Result<Option<MeterDefinitions>, EngineError> {
    if meter.revision <= 1 {
        return Ok(None);
    }
    match overlay.get(&keys::revised_meter_key(
        &meter.store_id,
        meter.mode,
        &meter.id,
    ))? {
        Some(bytes) => codec::decode_meter_definitions(&bytes),
        None => Ok(None),
    }
}

/// The definitions after a revision switched `before` to `after` at `position`:
/// the kept ones (or, at the first revision, `before` from the start), then
/// `after`, at most `MAX_KEPT_DEFINITIONS`. Unknown ones stay unknown (so do kept
/// ones of another partition: their offsets would not order with this one's).
pub fn with_revision(
    kept: Option<MeterDefinitions>,
    before: &Meter,
    after: &Meter,
    (partition, offset): (u32, u64),
) -> Option<MeterDefinitions> {
    let mut kept = match before.revision <= 1 {
        true => MeterDefinitions {
            partition,
            definitions: vec![(0, before.clone())],
        },
        false => kept.filter(|k| k.partition == partition)?,
    };
    kept.definitions.push((offset, after.clone()));
    let excess = kept.definitions.len().saturating_sub(MAX_KEPT_DEFINITIONS);
    kept.definitions.drain(..excess);
    Some(kept)
}

/// The revision a rebuild last brought the meter's minute to (0: none).
pub fn minute_revision(
    overlay: &Overlay<'_>,
    meter: &Meter,
    minute: i64,
) -> Result<u32, EngineError> {
    let key = keys::revised_minute_key(minute, &meter.store_id, meter.mode, &meter.id);
    match overlay.get(&key)? {
        Some(bytes) => Ok(u32::try_from(codec::decode_count(&bytes)?).unwrap_or(u32::MAX)),
        None => Ok(0),
    }
}

/// Notes that the meter's minute now follows the meter's current definition.
pub fn note_minute_revision(overlay: &mut Overlay<'_>, meter: &Meter, minute: i64) {
    overlay.put(
        keys::revised_minute_key(minute, &meter.store_id, meter.mode, &meter.id),
        codec::encode_count(u64::from(meter.revision)),
    );
}

/// The definition an event of `minute` stored by the record at `stored_by` was
/// charged by (module docs). A record of another partition than the revisions'
/// was written by an earlier build, which keyed usage by customer, before any
/// revision that kept definitions: it counts as the oldest. Where the definition
/// is no longer known (past `MAX_KEPT_DEFINITIONS`, or a revision of an earlier
/// build) the meter's current one stands in, as it did before definitions were
/// kept: a revision then corrects nothing, and a void gives back what the current
/// definition makes the event.
pub fn charged_by<'m>(
    meter: &'m Meter,
    kept: &'m Option<MeterDefinitions>,
    minute_revision: u32,
    (partition, offset): (u32, u64),
) -> &'m Meter {
    let Some(kept) = kept.as_ref().filter(|_| meter.revision > 1) else {
        return meter;
    };
    let offset = match partition == kept.partition {
        true => offset,
        false => 0,
    };
    let definitions = &kept.definitions;
    let at_offset = definitions
        .iter()
        .rev()
        .find(|(from, _)| *from <= offset)
        .map_or(1, |(_, d)| d.revision);
    let revision = at_offset.max(minute_revision);
    definitions
        .iter()
        .map(|(_, d)| d)
        .find(|d| d.revision == revision && revision < meter.revision)
        .unwrap_or(meter)
}

/// What a meter charges for `event` now, and what it was charged by `was`
/// (`charged_by`): the difference a correction hands to settlement, as units taken
/// back (negative: units to charge).
pub fn overcharged(
    overlay: &Overlay<'_>,
    was: &Meter,
    now: &Meter,
    event: &UsageEvent,
) -> Result<Decimal, EngineError> {
    let charged = charged_units(overlay, was, event)?;
    let due = charged_units(overlay, now, event)?;
    Ok(charged.checked_sub(due).unwrap_or(Decimal::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_domain::ids::{MeterId, StoreId};
    use tally_domain::meter::{MeterFilter, MeterStatus};
    use tally_domain::Mode;

    fn meter(revision: u32, property: &str) -> Meter {
        Meter {
            id: MeterId::new("mtr_1"),
            store_id: StoreId::new("st"),
            mode: Mode::Test,
            name: "tokens".into(),
            event_name: "llm".into(),
            aggregation: Aggregation::Sum,
            aggregation_property: Some(property.into()),
            filter: MeterFilter::default(),
            unit_label: "units".into(),
            status: MeterStatus::Active,
            created_at_ms: 0,
            updated_at_ms: 0,
            counts_from_ms: 0,
            revision,
        }
    }

    #[test]
    fn an_event_was_charged_by_the_later_of_its_records_revision_and_its_minutes() {
        // Revision 2 took over at offset 100 of partition 0, revision 3 at 200.
        let kept = with_revision(None, &meter(1, "a"), &meter(2, "b"), (0, 100));
        let kept = with_revision(kept, &meter(2, "b"), &meter(3, "c"), (0, 200));
        let now = meter(3, "c");
        let property = |offset, minute| {
            charged_by(&now, &kept, minute, (0, offset))
                .aggregation_property
                .clone()
        };
        assert_eq!(property(5, 0).as_deref(), Some("a"));
        assert_eq!(property(100, 0).as_deref(), Some("b"));
        assert_eq!(property(150, 0).as_deref(), Some("b"));
        assert_eq!(property(250, 0).as_deref(), Some("c"));
        // A minute revision 2 rebuilt (and corrected) before revision 3 took over.
        assert_eq!(property(5, 2).as_deref(), Some("b"));
        assert_eq!(property(5, 3).as_deref(), Some("c"));
        // A record of another partition (an earlier build's) is the oldest.
        let other = charged_by(&now, &kept, 0, (1, 250));
        assert_eq!(other.aggregation_property.as_deref(), Some("a"));
        // Unknown definitions: the current one stands in.
        assert_eq!(charged_by(&now, &None, 0, (0, 5)), &now);
        // A meter never revised charges by its one definition.
        let plain = meter(1, "a");
        assert_eq!(charged_by(&plain, &None, 0, (0, 5)), &plain);
    }

    #[test]
    fn kept_definitions_are_bounded_and_drop_the_oldest() {
        let mut kept = None;
        for revision in 1..(MAX_KEPT_DEFINITIONS as u32 + 5) {
            kept = with_revision(
                kept,
                &meter(revision, "p"),
                &meter(revision + 1, "p"),
                (0, u64::from(revision) * 10),
            );
        }
        assert_eq!(
            kept.as_ref().unwrap().definitions.len(),
            MAX_KEPT_DEFINITIONS
        );
        let now = meter(MAX_KEPT_DEFINITIONS as u32 + 5, "p");
        // The first revisions are dropped: what they charged is no longer known,
        // and the current definition stands in; the kept ones still answer
        // (revision r took over at offset (r - 1) * 10).
        assert_eq!(charged_by(&now, &kept, 0, (0, 5)), &now);
        assert_eq!(charged_by(&now, &kept, 0, (0, 100)).revision, 11);
        // Unknown definitions stay unknown; so do those of another partition.
        assert_eq!(
            with_revision(None, &meter(3, "p"), &meter(4, "p"), (0, 9)),
            None
        );
        assert_eq!(with_revision(kept, &now, &meter(40, "p"), (1, 9)), None);
    }

    #[test]
    fn definitions_round_trip_through_their_row() {
        let kept = with_revision(None, &meter(1, "a"), &meter(2, "b"), (3, 100)).unwrap();
        let bytes = codec::encode_meter_definitions(&kept);
        assert_eq!(codec::decode_meter_definitions(&bytes).unwrap(), Some(kept));
        assert_eq!(codec::decode_meter_definitions(&[]).unwrap(), None);
        assert!(codec::decode_meter_definitions(&bytes[..bytes.len() - 1]).is_err());
        assert!(codec::decode_meter_definitions(&bytes[..3]).is_err());
        assert!(codec::decode_meter_definitions(&[9]).is_err());
    }
}
