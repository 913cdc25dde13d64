//! The metering context: meters, usage folded into per-minute buckets, usage
//! queries and previews, stored events (read back from the log), backfills, voids,
//! amendments and meter revisions.
//!
//! Same inner shape as every context: its records (`MeterUpserted`, `UsageBatch`,
//! `MeterBackfill`, `EventsVoided`, `EventAmended`, `MeterRevised`), keys (tables
//! `M`, `N`, `m`, `F`, `G`, `A`, `u`, `U`, `B`, `@`, `|`, `:`, `z`, `.`, `_`, `` ` ``
//! of the core key space), apply ([`apply`], [`voids`], [`revisions`]: exact dedup,
//! meter rules, voids, amendments and revisions decided in log order), services
//! ([`meters`], [`voids`], [`revisions`]) and queries ([`usage`], [`events`]), and
//! the caches the ingest gateway reads (meters by scope, in-flight event ids, the
//! event index, recently read records), kept current by
//! [`Metering::after_commit`].
//!
//! Billing decides whether a meter may be archived (it may not while priced on a
//! product being sold); metering asks through its own port, [`Pricing`].

use std::sync::Arc;

use dashmap::DashMap;
use tally_core::event_index::EventIndex;
use tally_core::overlay::FastDashMap;
use tally_core::{codec, keys, pagination, EngineError, Journal, Scope};
use tally_domain::meter::Meter;

pub mod apply;
pub mod charged;
pub mod events;
pub mod meters;
pub mod recent;
pub mod revisions;
pub mod usage;
pub mod voids;

pub use apply::MeteringApplied;

/// What metering asks of billing: it owns this port, the composition root
/// implements it.
pub trait Pricing: Send + Sync {
    /// Whether the meter is priced on a product still being sold.
    fn meter_priced_on_active_product(
        &self,
        scope: &Scope,
        meter_id: &str,
    ) -> Result<bool, EngineError>;
}

/// In-memory views the hot paths need, kept current after each commit.
#[derive(Debug, Default)]
pub struct MeteringCaches {
    /// Every meter of a scope (archived too), for matching at ingest.
    pub meters: DashMap<Scope, Arc<Vec<Meter>>>,
    /// Event ids appended but not yet applied, with a fingerprint of the payload.
    /// Together with the event index this makes dedup exact under concurrent
    /// requests: a reservation is made atomically before the append and removed only
    /// after the projector has stored the event and updated the index.
    pub inflight_events: FastDashMap<String, u64>,
    /// Every stored event of the dedup horizon and where it is in the log
    /// (event_index.rs). The projector updates it after each commit.
    pub events: Arc<EventIndex>,
    /// Usage records recently read back from the log (events.rs).
    pub recent_records: Arc<recent::RecentRecords>,
}

pub struct Metering {
    journal: Arc<Journal>,
    caches: MeteringCaches,
    pricing: Arc<dyn Pricing>,
}

impl std::fmt::Debug for Metering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metering").finish()
    }
}

impl Metering {
    /// Metering over the journal's projection, its meters loaded; `index` is the
    /// event index the projector keeps.
    pub fn load(
        journal: Arc<Journal>,
        index: Arc<EventIndex>,
        recent_records: Arc<recent::RecentRecords>,
        pricing: Arc<dyn Pricing>,
    ) -> Result<Metering, EngineError> {
        let all = pagination::collect_prefix(
            journal.store().as_ref(),
            &[keys::METER],
            false,
            usize::MAX,
            |_, v| codec::decode_meter(v).map(Some),
        )?;
        let caches = MeteringCaches {
            events: index,
            recent_records,
            ..MeteringCaches::default()
        };
        let mut meters: std::collections::HashMap<Scope, Vec<Meter>> = Default::default();
        for m in all {
            let scope = Scope {
                store_id: m.store_id.clone(),
                mode: m.mode,
            };
            meters.entry(scope).or_default().push(m);
        }
        for (scope, list) in meters {
            caches.meters.insert(scope, Arc::new(list));
        }
        Ok(Metering {
            journal,
            caches,
            pricing,
        })
    }

    pub fn caches(&self) -> &MeteringCaches {
        &self.caches
    }

    /// Updates the caches from a committed chunk (the event index is updated by the
    /// projector before this runs, so a released reservation's id is already
    /// findable). Runs before waiters are woken.
    pub fn after_commit(&self, applied: MeteringApplied) {
        for meter in applied.meters {
            let scope = Scope {
                store_id: meter.store_id.clone(),
                mode: meter.mode,
            };
            let mut entry = self.caches.meters.entry(scope).or_default();
            let mut list: Vec<Meter> = entry.as_ref().clone();
            match list.iter_mut().find(|m| m.id == meter.id) {
                Some(existing) => *existing = meter,
                None => list.push(meter),
            }
            *entry = Arc::new(list);
        }
        for key in applied.event_keys {
            self.caches.inflight_events.remove(&key);
        }
    }
}
