//! Tally's pure domain: the types every other crate speaks, the validation rules of
//! docs/api.md, meter filter evaluation and the aggregation folds.
//!
//! Nothing here does I/O, spawns tasks or reads the wall clock: time comes in through
//! [`clock::Clock`], so renewals, retries and horizons are testable without sleeping.

#[macro_use]
mod macros;

pub mod access;
pub mod affiliate;
pub mod aggregate;
pub mod billing;
pub mod clock;
pub mod customer;
pub mod error;
pub mod exact;
pub mod gauge;
pub mod grant;
pub mod ids;
pub mod ledger;
pub mod limits;
pub mod meter;
pub mod mode;
pub mod moderation;
pub mod product;
pub mod record;
pub mod reservation;
pub mod settlement;
pub mod subscription;
pub mod time;
pub mod usage;
pub mod webhook;

pub use error::FieldError;
pub use mode::Mode;
