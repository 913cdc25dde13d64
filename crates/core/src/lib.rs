//! What every bounded context of Tally shares, and nothing that belongs to one:
//!
//! - the [`journal`]: a request becomes a record appended to the log; the caller
//!   waits until the projector has applied it and reads the decision apply recorded
//!   (ARCHITECTURE.md, "Decisions in apply"), behind one write gate and one
//!   backpressure account per node;
//! - the projection's one key space ([`keys`]: a table byte per table, so contexts
//!   never collide) and value codec ([`codec`]);
//! - the [`overlay`] every context's apply reads and writes through, one per chunk,
//!   with its journal of undos, so a refused record leaves only its [`outcome`];
//! - the event index ([`event_index`]) the overlay and the ingest gateway consult;
//! - errors ([`error`]), cursor [`pagination`], [`ids`] and node [`metrics`].
//!
//! Contexts (directory, metering, ledger, notifications) depend on this crate and
//! never on each other: where one needs another, it owns a small trait (a port) that
//! the composition root (`tally-engine`) implements.

pub mod changelog_store;
pub mod codec;
pub mod distinct_set;
pub mod error;
pub mod event_index;
pub mod idempotency;
pub mod ids;
pub mod journal;
pub mod key_home;
pub mod keys;
pub mod meter_cache;
pub mod metrics;
pub mod minute_maps;
pub mod outcome;
pub mod overlay;
pub mod pagination;
pub mod scan_cache;
pub mod series;
pub mod sparse_keys;

pub use error::EngineError;
pub use journal::{Decision, Journal, Update, APPENDED, APPLY_WAIT};
pub use metrics::Metrics;

use tally_domain::Mode;

/// A store and environment: the scope every API request acts in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub store_id: tally_domain::ids::StoreId,
    pub mode: Mode,
}
