//! A usage record's events located without decoding them. A stored event is read
//! back by its position (record and index): a void confirms each voided event, a
//! rebuild reads the events of one customer and minute, `GET /v1/events/{id}`
//! reads one. Decoding the whole record of 100 events for one was most of a
//! void's CPU (docs/benchmarks.md, "One event decoded, not its record's hundred"); here the
//! record is split into its events' encodings and each is decoded when asked.

use tally_domain::usage::UsageEvent;
use tally_domain::Mode;

use crate::convert::check_format_version;
use crate::v1;
use crate::{mode_from_proto, usage_event_from_proto, DecodeError, Message};

/// A usage batch record whose events are still encoded, one `Vec<u8>` each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageFrames {
    pub store_id: String,
    pub mode: Mode,
    pub events: Vec<Vec<u8>>,
}

/// The usage batch `bytes` holds with its events left encoded, or `None` when the
/// record is of another kind. The version is checked as `decode_record` checks
/// it. (The record's `kind` is a oneof: a record holding a usage batch and then
/// another kind would be the other kind to `decode_record`; no build writes one.)
pub fn usage_frames(bytes: &[u8]) -> Result<Option<UsageFrames>, DecodeError> {
    let record = v1::LogRecordFrames::decode(bytes)?;
    check_format_version(record.format_version)?;
    let Some(batch) = record.usage_batch else {
        return Ok(None);
    };
    Ok(Some(UsageFrames {
        store_id: batch.store_id,
        mode: mode_from_proto(batch.mode)?,
        events: batch.events,
    }))
}

/// One event of `UsageFrames::events`, decoded.
pub fn decode_usage_event(bytes: &[u8]) -> Result<UsageEvent, DecodeError> {
    usage_event_from_proto(v1::UsageEvent::decode(bytes)?)
}
