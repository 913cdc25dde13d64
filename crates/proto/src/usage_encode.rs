//! A usage batch record encoded straight from the domain's events, without
//! building prost's message for it first.
//!
//! Every ingest request appends one usage batch of up to a hundred events, and the
//! generic path (`encode_record_with` over `v1::UsageBatch`) copied each event's
//! strings, property names and values into owned prost structs only to write them
//! out and drop them: ~17% of the intake thread under the ingest benchmark, most of
//! it those copies (docs/benchmarks.md, "Usage batches encoded from the events").
//! This module writes the same bytes from borrowed fields. The bytes are prost's, to
//! the byte: field order, skipped defaults (proto3 skips an empty string, a zero
//! number, a false bool and a map entry's empty key; a oneof and an `optional` field
//! are written when set), and a map in key order (the build generates `BTreeMap`s).
//! The tests below hold it to `Message::encode` of the generic path for any batch.

use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tally_domain::record::RecordMeta;
use tally_domain::usage::{canonical_decimal, PropertyValue, UsageEvent};
use tally_domain::Mode;

use crate::convert::{mode_to_proto, request_key_to_proto, LOG_FORMAT_VERSION};
use crate::v1;

/// `LogRecord.usage_batch`'s field number (proto/tally/v1/log.proto).
const USAGE_BATCH_TAG: u32 = 13;

/// The fields of a `Record::UsageBatch`, borrowed.
pub(crate) struct UsageBatchRef<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub events: &'a [UsageEvent],
    pub settles: bool,
    pub matched_below: Option<u64>,
}

/// The record `batch` with its envelope `meta`, as `encode_record_with` writes it.
pub(crate) fn encode_usage_batch(batch: &UsageBatchRef<'_>, meta: &RecordMeta) -> Vec<u8> {
    // The envelope's own fields come before the oneof `kind` in the message, so
    // prost writes them first; the batch follows as field 13.
    let envelope = v1::LogRecord {
        recorded_at_ms: meta.recorded_at_ms,
        format_version: LOG_FORMAT_VERSION,
        base_updated_at_ms: meta.base_updated_at_ms,
        request: meta.request.as_ref().map(request_key_to_proto),
        kind: None,
    };
    let mut body = Vec::with_capacity(batch.events.len() * 160 + 64);
    let mut scratch = Vec::new();
    put_str(1, batch.store_id, &mut body);
    let mode = mode_to_proto(batch.mode);
    if mode != 0 {
        prost::encoding::int32::encode(2, &mode, &mut body);
    }
    for event in batch.events {
        scratch.clear();
        put_event(event, &mut scratch);
        put_bytes(3, &scratch, &mut body);
    }
    if batch.settles {
        prost::encoding::bool::encode(4, &true, &mut body);
    }
    if let Some(below) = batch.matched_below {
        prost::encoding::uint64::encode(5, &below, &mut body);
    }
    let mut out = Vec::with_capacity(
        envelope.encoded_len()
            + key_len(USAGE_BATCH_TAG)
            + encoded_len_varint(body.len() as u64)
            + body.len(),
    );
    envelope
        .encode(&mut out)
        .expect("a Vec grows to take any message");
    put_bytes(USAGE_BATCH_TAG, &body, &mut out);
    out
}

/// One `UsageEvent` message's fields (without its own key and length).
fn put_event(event: &UsageEvent, out: &mut Vec<u8>) {
    put_str(1, &event.event_id, out);
    put_str(2, &event.name, out);
    put_str(3, event.customer_id.as_str(), out);
    if event.timestamp_ms != 0 {
        prost::encoding::int64::encode(4, &event.timestamp_ms, out);
    }
    for (name, value) in &event.properties {
        let number;
        let (value_tag, text) = match value {
            PropertyValue::String(s) => (1, s.as_str()),
            PropertyValue::Number(n) => {
                number = canonical_decimal(*n);
                (2, number.as_str())
            }
        };
        // The map entry: its key (skipped when empty, as prost skips a default
        // key) and its value, a `PropertyValue` whose oneof is always set.
        let value_len = str_len(value_tag, text);
        let entry_len = if name.is_empty() { 0 } else { str_len(1, name) }
            + key_len(2)
            + encoded_len_varint(value_len as u64)
            + value_len;
        encode_key(5, WireType::LengthDelimited, out);
        encode_varint(entry_len as u64, out);
        put_str(1, name, out);
        encode_key(2, WireType::LengthDelimited, out);
        encode_varint(value_len as u64, out);
        put_raw_str(value_tag, text, out);
    }
    if event.received_at_ms != 0 {
        prost::encoding::int64::encode(6, &event.received_at_ms, out);
    }
    for meter in &event.matched_meter_ids {
        put_raw_str(7, meter.as_str(), out);
    }
    if event.event_id_assigned {
        prost::encoding::bool::encode(8, &true, out);
    }
    if let Some(external) = &event.external_customer_id {
        put_raw_str(9, external, out);
    }
}

/// A proto3 string field: skipped when empty.
fn put_str(tag: u32, text: &str, out: &mut Vec<u8>) {
    if !text.is_empty() {
        put_raw_str(tag, text, out);
    }
}

/// A string written whatever it holds (a oneof's, an `optional`'s or a repeated
/// field's element).
fn put_raw_str(tag: u32, text: &str, out: &mut Vec<u8>) {
    put_bytes(tag, text.as_bytes(), out);
}

fn put_bytes(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// The encoded length of a string field written by `put_raw_str`.
fn str_len(tag: u32, text: &str) -> usize {
    key_len(tag) + encoded_len_varint(text.len() as u64) + text.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode_record_with;
    use proptest::prelude::*;
    use tally_domain::record::Record;

    /// The generic path: the prost message built from the domain and encoded.
    fn generic(record: &Record, meta: &RecordMeta) -> Vec<u8> {
        let Record::UsageBatch {
            store_id,
            mode,
            events,
            settles,
            matched_below,
        } = record
        else {
            unreachable!("only usage batches here")
        };
        v1::LogRecord {
            recorded_at_ms: meta.recorded_at_ms,
            format_version: LOG_FORMAT_VERSION,
            base_updated_at_ms: meta.base_updated_at_ms,
            request: meta.request.as_ref().map(request_key_to_proto),
            kind: Some(v1::log_record::Kind::UsageBatch(v1::UsageBatch {
                store_id: store_id.to_string(),
                mode: mode_to_proto(*mode),
                events: events.iter().map(crate::usage_event_to_proto).collect(),
                settles: *settles,
                matched_below: *matched_below,
            })),
        }
        .encode_to_vec()
    }

    proptest! {
        /// Decoding these bytes back is `convert`'s round-trip test, over the
        /// same records.
        #[test]
        fn a_batch_encodes_to_prosts_bytes((record, meta) in crate::convert::tests::usage_batch()) {
            prop_assert_eq!(encode_record_with(&record, &meta), generic(&record, &meta));
        }
    }
}
