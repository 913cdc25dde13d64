//! The log's wire format: prost types generated from `proto/tally/v1/log.proto`, and
//! the explicit conversions between them and the domain types. Nothing else in the
//! workspace builds or reads protobuf by hand; here only the usage batch, the
//! hottest record, is written field by field (`usage_encode`) and read in frames
//! (`frames`), both held to prost's own bytes by tests.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tally.v1.rs"));
}

mod affiliate;
mod billing;
mod convert;
mod frames;
mod product;
mod settlement;
mod usage_encode;

pub use affiliate::*;
pub use billing::*;
pub use convert::*;
pub use frames::{decode_usage_event, usage_frames, UsageFrames};
pub use product::{product_from_proto, product_to_proto};
pub use prost::Message;
pub use settlement::*;
