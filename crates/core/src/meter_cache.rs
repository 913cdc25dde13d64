//! Meter definitions as last committed, decoded once and shared, for apply.
//!
//! Why: a usage record folds each of its events into the meters ingest matched,
//! and apply read and decoded every one of those meters again for every record
//! (and scanned the scope's revised meters): ~7% of the apply thread under the
//! ingest benchmark (docs/benchmarks.md, "Meters decoded once"), for definitions that change a
//! few times a day. A definition is taken from here while no commit has written
//! its key since it was read; a chunk that writes meter or revision rows reads
//! through to the store as before (`Overlay::shared_meter`).
//!
//! Like the bucket cache that holds it, it only ever holds what was committed:
//! values are noted from store reads, never from a chunk's own writes, and every
//! commit forgets the meters it wrote (`MeterCache::forget_written`), before the
//! next chunk can read them.

use std::sync::Arc;

use tally_domain::meter::Meter;

use crate::keys;
use crate::series::FastMap;

/// Meter definitions kept (bounds memory: a definition with its filters weighs a
/// few hundred bytes). Past it the cache starts over; a store has tens of meters,
/// so only a process serving thousands of stores ever does.
pub const MAX_CACHED_METERS: usize = 10_000;

/// See the module docs.
#[derive(Debug, Default)]
pub struct MeterCache {
    /// Meter key (`keys::meter_key`) -> its committed definition.
    meters: FastMap<Vec<u8>, Arc<Meter>>,
    /// A scope's revised-meter prefix -> its revised meters (usually none).
    revised: FastMap<Vec<u8>, Vec<Arc<Meter>>>,
}

impl MeterCache {
    pub fn meter(&self, key: &[u8]) -> Option<Arc<Meter>> {
        self.meters.get(key).cloned()
    }

    /// Notes a definition read from the store (never one a chunk wrote).
    pub fn note_meter(&mut self, key: &[u8], meter: Arc<Meter>) {
        if self.meters.len() >= MAX_CACHED_METERS {
            self.meters.clear();
        }
        self.meters.insert(key.to_vec(), meter);
    }

    /// The revised meters of the scope whose revised-meter prefix is `prefix`.
    pub fn revised(&self, prefix: &[u8]) -> Option<Vec<Arc<Meter>>> {
        self.revised.get(prefix).cloned()
    }

    /// Notes a scope's revised meters, read from the store.
    pub fn note_revised(&mut self, prefix: &[u8], meters: Vec<Arc<Meter>>) {
        if self.revised.len() >= MAX_CACHED_METERS {
            self.revised.clear();
        }
        self.revised.insert(prefix.to_vec(), meters);
    }

    /// Forgets what a commit writing `written` (its keys, any tables) may have
    /// changed: each meter it wrote, and every scope's revised meters when it wrote
    /// a meter or a revision row (a revised meter's definition is a meter row).
    pub fn forget_written<'k>(&mut self, written: impl IntoIterator<Item = &'k [u8]>) {
        for key in written {
            match key.first() {
                Some(&keys::METER) => {
                    self.meters.remove(key);
                    self.revised.clear();
                }
                Some(&keys::REVISED_METER) => self.revised.clear(),
                _ => {}
            }
        }
    }
}

/// A plain active `count` meter for this crate's tests.
#[cfg(test)]
pub(crate) fn test_meter(id: &str, store_id: &str, mode: tally_domain::Mode, name: &str) -> Meter {
    use tally_domain::ids::{MeterId, StoreId};
    use tally_domain::meter::{Aggregation, MeterFilter, MeterStatus};
    Meter {
        id: MeterId::new(id),
        store_id: StoreId::new(store_id),
        mode,
        name: name.into(),
        event_name: "e".into(),
        aggregation: Aggregation::Count,
        aggregation_property: None,
        filter: MeterFilter::default(),
        unit_label: "units".into(),
        status: MeterStatus::Active,
        created_at_ms: 0,
        updated_at_ms: 0,
        counts_from_ms: 0,
        revision: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_domain::Mode;

    fn meter(id: &str) -> Arc<Meter> {
        Arc::new(test_meter(id, "st", Mode::Test, id))
    }

    #[test]
    fn a_commit_forgets_the_meters_it_wrote_and_every_revised_list() {
        let mut cache = MeterCache::default();
        let (a, b) = (
            keys::meter_key("st", Mode::Test, "a"),
            keys::meter_key("st", Mode::Test, "b"),
        );
        let prefix = keys::revised_meter_key("st", Mode::Test, "");
        cache.note_meter(&a, meter("a"));
        cache.note_meter(&b, meter("b"));
        cache.note_revised(&prefix, vec![meter("a")]);
        cache.forget_written([b"Zother".as_slice()]);
        assert!(cache.meter(&a).is_some() && cache.revised(&prefix).is_some());
        cache.forget_written([a.as_slice()]);
        assert!(cache.meter(&a).is_none(), "the written meter is forgotten");
        assert_eq!(cache.meter(&b).map(|m| m.id.to_string()), Some("b".into()));
        assert!(
            cache.revised(&prefix).is_none(),
            "a meter row may be a revised one"
        );
        cache.note_revised(&prefix, Vec::new());
        cache.forget_written([keys::revised_meter_key("st", Mode::Test, "b").as_slice()]);
        assert!(cache.revised(&prefix).is_none());
        assert!(cache.meter(&b).is_some());
    }
}
