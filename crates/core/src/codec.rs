//! Projection values: protobuf (via tally-proto) for objects, a fixed 66-byte layout
//! for usage buckets (they are the hottest writes).

use rust_decimal::Decimal;
use tally_domain::aggregate::Aggregate;
use tally_domain::customer::Customer;
use tally_domain::meter::Meter;
use tally_domain::record::StoreRecord;
use tally_proto::{v1, Message};

use crate::distinct_set::DistinctSet;
use crate::error::EngineError;

pub fn encode_customer(c: &Customer) -> Vec<u8> {
    tally_proto::customer_to_proto(c).encode_to_vec()
}

pub fn encode_product(p: &tally_domain::product::Product) -> Vec<u8> {
    tally_proto::product_to_proto(p).encode_to_vec()
}

pub fn decode_product(bytes: &[u8]) -> Result<tally_domain::product::Product, EngineError> {
    tally_proto::product_from_proto(v1::Product::decode(bytes).map_err(corrupt)?).map_err(corrupt)
}

/// One encode/decode pair per billing resource (all protobuf, via tally-proto).
macro_rules! proto_codec {
    ($encode:ident, $decode:ident, $ty:ty, $to:path, $from:path, $msg:ty) => {
        pub fn $encode(value: &$ty) -> Vec<u8> {
            $to(value).encode_to_vec()
        }

        pub fn $decode(bytes: &[u8]) -> Result<$ty, EngineError> {
            $from(<$msg>::decode(bytes).map_err(corrupt)?).map_err(corrupt)
        }
    };
}

proto_codec!(
    encode_discount,
    decode_discount,
    tally_domain::billing::Discount,
    tally_proto::discount_to_proto,
    tally_proto::discount_from_proto,
    v1::Discount
);
proto_codec!(
    encode_checkout,
    decode_checkout,
    tally_domain::billing::Checkout,
    tally_proto::checkout_to_proto,
    tally_proto::checkout_from_proto,
    v1::Checkout
);
proto_codec!(
    encode_payment,
    decode_payment,
    tally_domain::billing::Payment,
    tally_proto::payment_to_proto,
    tally_proto::payment_from_proto,
    v1::Payment
);
proto_codec!(
    encode_subscription,
    decode_subscription,
    tally_domain::billing::Subscription,
    tally_proto::subscription_to_proto,
    tally_proto::subscription_from_proto,
    v1::Subscription
);
proto_codec!(
    encode_dispute,
    decode_dispute,
    tally_domain::billing::Dispute,
    tally_proto::dispute_to_proto,
    tally_proto::dispute_from_proto,
    v1::Dispute
);
proto_codec!(
    encode_billing_event,
    decode_billing_event,
    tally_domain::record::BillingEvent,
    tally_proto::billing_event_to_proto,
    tally_proto::billing_event_from_proto,
    v1::BillingEvent
);

proto_codec!(
    encode_invite,
    decode_invite,
    tally_domain::affiliate::AffiliateInvite,
    tally_proto::invite_to_proto,
    tally_proto::invite_from_proto,
    v1::AffiliateInvite
);
proto_codec!(
    encode_affiliate,
    decode_affiliate,
    tally_domain::affiliate::Affiliate,
    tally_proto::affiliate_to_proto,
    tally_proto::affiliate_from_proto,
    v1::Affiliate
);
proto_codec!(
    encode_settlement,
    decode_settlement,
    tally_domain::record::UsageSettlement,
    tally_proto::settlement_to_proto,
    tally_proto::settlement_from_proto,
    v1::UsageSettled
);
proto_codec!(
    encode_settlement_totals,
    decode_settlement_totals,
    tally_domain::settlement::SettlementTotals,
    tally_proto::totals_to_proto,
    tally_proto::totals_from_proto,
    v1::SettlementTotals
);

/// A settlement period's row: its used units (16 bytes, as builds before per-period
/// amounts wrote it), then billed and debited (16 bytes each) when kept.
pub fn encode_period_settlement(period: &tally_domain::settlement::PeriodSettlement) -> Vec<u8> {
    let mut bytes = encode_decimal(period.used);
    if let Some((billed, debited)) = period.paid {
        bytes.extend(encode_decimal(billed));
        bytes.extend(encode_decimal(debited));
    }
    bytes
}

pub fn decode_period_settlement(
    bytes: &[u8],
) -> Result<tally_domain::settlement::PeriodSettlement, EngineError> {
    const DECIMAL_BYTES: usize = 16;
    let paid = match bytes.len() {
        DECIMAL_BYTES => None,
        n if n == 3 * DECIMAL_BYTES => Some((
            decode_decimal(&bytes[DECIMAL_BYTES..2 * DECIMAL_BYTES])?,
            decode_decimal(&bytes[2 * DECIMAL_BYTES..])?,
        )),
        n => {
            return Err(EngineError::Corrupt(format!(
                "a settlement period of {n} bytes"
            )))
        }
    };
    Ok(tally_domain::settlement::PeriodSettlement {
        used: decode_decimal(&bytes[..DECIMAL_BYTES])?,
        paid,
    })
}

pub fn encode_store_settings(
    store_id: &str,
    mode: tally_domain::Mode,
    settings: &tally_domain::subscription::StoreSettings,
) -> Vec<u8> {
    tally_proto::settings_to_proto(store_id, mode, settings).encode_to_vec()
}

pub fn decode_store_settings(
    bytes: &[u8],
) -> Result<tally_domain::subscription::StoreSettings, EngineError> {
    let message = v1::StoreSettingsSet::decode(bytes).map_err(corrupt)?;
    Ok(tally_proto::settings_from_proto(message)
        .map_err(corrupt)?
        .2)
}

pub fn encode_policy(
    store_id: &str,
    mode: tally_domain::Mode,
    policy: &tally_domain::moderation::Policy,
) -> Vec<u8> {
    tally_proto::policy_to_proto(store_id, mode, policy).encode_to_vec()
}

pub fn decode_policy(bytes: &[u8]) -> Result<tally_domain::moderation::Policy, EngineError> {
    let message = v1::ModerationPolicy::decode(bytes).map_err(corrupt)?;
    Ok(tally_proto::policy_from_proto(message).map_err(corrupt)?.2)
}

pub fn encode_bindings(bindings: &[tally_domain::settlement::UsageBinding]) -> Vec<u8> {
    tally_proto::bindings_to_proto(bindings).encode_to_vec()
}

pub fn decode_bindings(
    bytes: &[u8],
) -> Result<Vec<tally_domain::settlement::UsageBinding>, EngineError> {
    tally_proto::bindings_from_proto(v1::UsageBindings::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

pub fn decode_customer(bytes: &[u8]) -> Result<Customer, EngineError> {
    tally_proto::customer_from_proto(v1::Customer::decode(bytes).map_err(corrupt)?).map_err(corrupt)
}

pub fn encode_meter(m: &Meter) -> Vec<u8> {
    tally_proto::meter_to_proto(m).encode_to_vec()
}

pub fn decode_meter(bytes: &[u8]) -> Result<Meter, EngineError> {
    tally_proto::meter_from_proto(v1::Meter::decode(bytes).map_err(corrupt)?).map_err(corrupt)
}

/// The first byte of a revised meter's definitions row (`keys::REVISED_METER`): an
/// empty row is a revision of an earlier build, whose definitions are unknown.
const METER_DEFINITIONS_V1: u8 = 1;

/// A revised meter's definitions, oldest first, each with the offset from which
/// apply counted usage by it, in `partition` (the store's, where its revisions and
/// usage records go).
#[derive(Debug, Clone, PartialEq)]
pub struct MeterDefinitions {
    pub partition: u32,
    pub definitions: Vec<(u64, Meter)>,
}

pub fn encode_meter_definitions(kept: &MeterDefinitions) -> Vec<u8> {
    let mut out = vec![METER_DEFINITIONS_V1];
    out.extend_from_slice(&kept.partition.to_be_bytes());
    for (from_offset, meter) in &kept.definitions {
        let bytes = encode_meter(meter);
        out.extend_from_slice(&encode_count(*from_offset));
        // A meter's definition is bounded far below 4 GiB (meter limits).
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

/// The definitions of [`encode_meter_definitions`]; `None` for an empty row.
pub fn decode_meter_definitions(bytes: &[u8]) -> Result<Option<MeterDefinitions>, EngineError> {
    let Some((&version, rest)) = bytes.split_first() else {
        return Ok(None);
    };
    if version != METER_DEFINITIONS_V1 {
        return Err(corrupt(format!(
            "a meter definitions row of unknown version {version}"
        )));
    }
    let short = || corrupt("a meter definitions row is cut short");
    let be_u32 = |b: &[u8]| -> Result<u32, EngineError> {
        Ok(u32::from_be_bytes(b.try_into().map_err(|_| short())?))
    };
    let partition = be_u32(rest.get(..4).ok_or_else(short)?)?;
    let mut rest = &rest[4..];
    let mut definitions = Vec::new();
    while !rest.is_empty() {
        let from_offset = decode_count(rest.get(..8).ok_or_else(short)?)?;
        let len = be_u32(rest.get(8..12).ok_or_else(short)?)? as usize;
        let end = 12usize.checked_add(len).ok_or_else(short)?;
        definitions.push((
            from_offset,
            decode_meter(rest.get(12..end).ok_or_else(short)?)?,
        ));
        rest = &rest[end..];
    }
    Ok(Some(MeterDefinitions {
        partition,
        definitions,
    }))
}

pub fn encode_store(s: &StoreRecord) -> Vec<u8> {
    v1::StoreCreated {
        store_id: s.store_id.to_string(),
        name: s.name.clone(),
        prod_key_sha256: s.prod_key_sha256.clone(),
        test_key_sha256: s.test_key_sha256.clone(),
        created_at_ms: s.created_at_ms,
    }
    .encode_to_vec()
}

pub fn decode_store(bytes: &[u8]) -> Result<StoreRecord, EngineError> {
    let s = v1::StoreCreated::decode(bytes).map_err(corrupt)?;
    Ok(StoreRecord {
        store_id: s.store_id.into(),
        name: s.name,
        prod_key_sha256: s.prod_key_sha256,
        test_key_sha256: s.test_key_sha256,
        created_at_ms: s.created_at_ms,
    })
}

const AGGREGATE_BYTES: usize = 8 + 8 + 16 + 17 + 17;

fn put_optional(bytes: &mut Vec<u8>, value: Option<Decimal>) {
    match value {
        Some(v) => {
            bytes.push(1);
            bytes.extend_from_slice(&v.serialize());
        }
        None => {
            bytes.push(0);
            bytes.extend_from_slice(&[0; 16]);
        }
    }
}

/// A count (a `'` row): eight bytes, big-endian.
pub fn encode_count(count: u64) -> Vec<u8> {
    count.to_be_bytes().to_vec()
}

pub fn decode_count(bytes: &[u8]) -> Result<u64, EngineError> {
    let raw: [u8; 8] = bytes
        .try_into()
        .map_err(|_| EngineError::Corrupt("a count of wrong size".into()))?;
    Ok(u64::from_be_bytes(raw))
}

pub fn encode_aggregate(a: &Aggregate) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(AGGREGATE_BYTES + 1);
    encode_aggregate_into(a, &mut bytes);
    bytes
}

/// `encode_aggregate`, written over `bytes` (a buffer reused from bucket to bucket).
pub fn encode_aggregate_into(a: &Aggregate, bytes: &mut Vec<u8>) {
    bytes.clear();
    bytes.extend_from_slice(&a.events.to_be_bytes());
    bytes.extend_from_slice(&a.numeric_events.to_be_bytes());
    bytes.extend_from_slice(&a.sum.serialize());
    put_optional(bytes, a.min);
    put_optional(bytes, a.max);
    if a.overflowed {
        bytes.push(1);
    }
}

pub fn decode_aggregate(bytes: &[u8]) -> Result<Aggregate, EngineError> {
    // One trailing byte marks an overflowed sum; it is absent otherwise.
    let overflowed = match bytes.len().checked_sub(AGGREGATE_BYTES) {
        Some(0) => false,
        Some(1) if bytes[AGGREGATE_BYTES] == 1 => true,
        _ => return Err(EngineError::Corrupt("aggregate of wrong size".into())),
    };
    let decimal = |at: usize| Decimal::deserialize(bytes[at..at + 16].try_into().expect("16"));
    let optional = |at: usize| (bytes[at] == 1).then(|| decimal(at + 1));
    Ok(Aggregate {
        events: u64::from_be_bytes(bytes[0..8].try_into().expect("8")),
        numeric_events: u64::from_be_bytes(bytes[8..16].try_into().expect("8")),
        sum: decimal(16),
        min: optional(32),
        max: optional(49),
        overflowed,
    })
}

/// Distinct values a customer's minute bucket keeps inline in its `u` set (one
/// projection key for the whole minute instead of one per value). Past it, values go
/// to one `U` key each, so a hostile cardinality never makes one value huge (each
/// checkpoint rewrites the set): ~1,024 x a short value is a few KiB.
pub const INLINE_DISTINCT_MAX: usize = 1_024;

/// A bucket's distinct values: a count, then each value length-prefixed, in order
/// (`DistinctSet` holds a set as this encoding).
pub fn encode_distinct_set(values: &DistinctSet) -> Vec<u8> {
    values.encoded().to_vec()
}

pub fn decode_distinct_set(bytes: Vec<u8>) -> Result<DistinctSet, EngineError> {
    DistinctSet::decode(bytes)
}

fn corrupt(e: impl std::fmt::Display) -> EngineError {
    EngineError::Corrupt(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_posted_transaction_row_says_where_each_entry_is_listed() {
        use tally_domain::ledger::{Entry, Transaction, TransactionKind};
        let entry = |n: usize, account: &str, amount: i64| Entry {
            id: tally_domain::ledger::entry_id("ctx_t1", n),
            account_id: account.into(),
            amount: Decimal::from(amount),
            grant_id: None,
        };
        let tx = Transaction {
            id: "ctx_t1".into(),
            store_id: "st_1".into(),
            mode: tally_domain::Mode::Test,
            kind: TransactionKind::Credit,
            account_id: "ca_1".into(),
            amount: Decimal::from(5),
            entries: vec![entry(1, "ca_1", 5), entry(2, "system:issuance", -5)],
            idempotency_key: None,
            description: None,
            metadata: Default::default(),
            reverses: None,
            created_at_ms: 1,
            grant_terms: None,
        };
        let row = encode_posted_transaction(&tx, vec![41, 0]);
        assert_eq!(
            decode_transaction(&row).unwrap(),
            tx,
            "the transaction reads as before"
        );
        assert_eq!(
            posted_entry_place(&row, "ce_t1_1").unwrap(),
            Some(("ca_1".to_string(), 41))
        );
        assert_eq!(posted_entry_place(&row, "ce_t1_3").unwrap(), None);
        // A row without positions (never written so) is corrupt, not "no entry".
        assert!(posted_entry_place(&encode_transaction(&tx), "ce_t1_1").is_err());
        let end = EntryListEnd {
            count: 7,
            last_posted_at_ms: -3,
        };
        assert_eq!(
            decode_entry_list_end(&encode_entry_list_end(end)).unwrap(),
            end
        );
        assert!(decode_entry_list_end(&[0; 8]).is_err());
        let totals = AccountTotals {
            balance: Decimal::new(-125, 1),
            entries: end,
        };
        assert_eq!(
            decode_account_totals(&encode_account_totals(totals)).unwrap(),
            totals
        );
        assert!(decode_account_totals(&encode_decimal(Decimal::ONE)).is_err());
    }

    #[test]
    fn minute_events_and_void_marks_round_trip_and_refuse_garbage() {
        let print = DistinctPrint::of("mtr_1", b"user_7");
        let events = [
            MinuteEvent {
                index: 0,
                customer: "cus_a".into(),
                prints: Some(vec![print, DistinctPrint::of("mtr_2", b"")]),
            },
            MinuteEvent {
                index: 99,
                customer: String::new(),
                prints: Some(Vec::new()),
            },
        ];
        let mut row = Vec::new();
        for event in &events {
            let prints = event.prints.as_deref().unwrap_or_default();
            push_minute_event(&mut row, event.index, &event.customer, prints);
        }
        assert_eq!(decode_minute_events(&row).unwrap(), events);
        for cut in 1..row.len() {
            // A cut row is refused, or (cut between events) holds fewer events.
            if let Ok(decoded) = decode_minute_events(&row[..cut]) {
                assert!(decoded.len() < events.len(), "{cut}");
            }
        }
        assert!(decode_minute_events(&row[..row.len() - 1]).is_err());
        assert!(decode_minute_events(&[0]).is_err());
        // A row written before prints: its events decode without them.
        let mut old = Vec::new();
        for (index, customer) in [(0u16, "cus_a"), (99, "")] {
            old.extend_from_slice(&index.to_be_bytes());
            old.extend_from_slice(customer.as_bytes());
            old.push(0);
        }
        let decoded = decode_minute_events(&old).unwrap();
        assert_eq!(decoded.len(), 2);
        assert_eq!((decoded[1].index, decoded[1].prints.clone()), (99, None));
        assert_ne!(print, DistinctPrint::of("mtr_1", b"user_8"));
        let mark = VoidMark {
            voided_at_ms: -5,
            partition: 3,
            offset: 12,
            reason: "duplicate — sent twice".into(),
        };
        assert_eq!(decode_void(&encode_void(&mark)).unwrap(), mark);
        assert!(decode_void(&encode_void(&mark)[..19]).is_err());
    }

    #[test]
    fn distinct_sets_round_trip_and_refuse_garbage() {
        let mut values = DistinctSet::default();
        for value in [&b"s:a"[..], b"", b"n:1.5"] {
            values.insert(value);
        }
        let bytes = encode_distinct_set(&values);
        assert_eq!(decode_distinct_set(bytes.clone()).unwrap(), values);
        assert!(decode_distinct_set(bytes[..bytes.len() - 1].to_vec()).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_distinct_set(longer).is_err());
        assert!(decode_distinct_set(vec![0, 0, 0, 9]).is_err());
    }

    #[test]
    fn aggregate_round_trips() {
        let mut a = Aggregate::default();
        a.add(Some("-1.25".parse().unwrap()));
        a.add(Some("7".parse().unwrap()));
        a.add(None);
        assert_eq!(decode_aggregate(&encode_aggregate(&a)).unwrap(), a);
        let empty = Aggregate::default();
        assert_eq!(decode_aggregate(&encode_aggregate(&empty)).unwrap(), empty);
        let mut overflowed = Aggregate::default();
        overflowed.add(Some(Decimal::MAX));
        overflowed.add(Some(Decimal::MAX));
        assert!(overflowed.overflowed);
        assert_eq!(
            decode_aggregate(&encode_aggregate(&overflowed)).unwrap(),
            overflowed
        );
    }
}

/// A `latest` bucket (`@`): timestamp (8 bytes), value (16), then the event id.
pub fn encode_latest(point: &tally_domain::gauge::LatestPoint) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(24 + point.event_id.len());
    bytes.extend_from_slice(&point.timestamp_ms.to_be_bytes());
    bytes.extend_from_slice(&point.value.serialize());
    bytes.extend_from_slice(point.event_id.as_bytes());
    bytes
}

pub fn decode_latest(bytes: &[u8]) -> Result<tally_domain::gauge::LatestPoint, EngineError> {
    let bad = || EngineError::Corrupt("a latest point does not decode".into());
    if bytes.len() < 24 {
        return Err(bad());
    }
    Ok(tally_domain::gauge::LatestPoint {
        timestamp_ms: i64::from_be_bytes(bytes[0..8].try_into().map_err(|_| bad())?),
        value: decode_decimal(&bytes[8..24])?,
        event_id: String::from_utf8(bytes[24..].to_vec()).map_err(|_| bad())?,
    })
}

/// A time-weighted bucket (`|`): delta (16 bytes), delta_ms (16), and one more
/// byte when the bucket overflowed.
pub fn encode_weighted(bucket: &tally_domain::gauge::WeightedBucket) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(33);
    bytes.extend_from_slice(&bucket.delta.serialize());
    bytes.extend_from_slice(&bucket.delta_ms.serialize());
    if bucket.overflowed {
        bytes.push(1);
    }
    bytes
}

pub fn decode_weighted(bytes: &[u8]) -> Result<tally_domain::gauge::WeightedBucket, EngineError> {
    let overflowed = match bytes.len() {
        32 => false,
        33 if bytes[32] == 1 => true,
        _ => {
            return Err(EngineError::Corrupt(
                "a time-weighted bucket of wrong size".into(),
            ))
        }
    };
    Ok(tally_domain::gauge::WeightedBucket {
        delta: decode_decimal(&bytes[0..16])?,
        delta_ms: decode_decimal(&bytes[16..32])?,
        overflowed,
    })
}

/// The first byte of a `z` row whose events carry fingerprints of their distinct
/// values ([`DistinctPrint`]). A row written before them starts with its first
/// event's index, whose high byte is 0 (indexes are below `MAX_EVENTS_PER_BATCH`),
/// so the two never mix up; such a row's events have no fingerprints, and a void
/// then rebuilds the buckets it would have decided from them.
pub const MINUTE_EVENTS_PRINTED: u8 = 0xFF;

/// A fingerprint of one distinct value an event folded into a `unique` meter: the
/// CRC-32 of the meter's id and of the value. Two events whose prints differ hold
/// different values; equal prints may hold the same value (or collide). A void
/// of a `unique` event reads them to learn, without reading the minute's records
/// back, that no other event of the minute holds its value (ARCHITECTURE.md, "Voids").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistinctPrint {
    pub meter: u32,
    pub value: u32,
}

impl DistinctPrint {
    pub fn of(meter_id: &str, value: &[u8]) -> DistinctPrint {
        DistinctPrint {
            meter: crc32fast::hash(meter_id.as_bytes()),
            value: crc32fast::hash(value),
        }
    }
}

/// One event of a `z` row: its index in the record, its customer, and the prints
/// of the distinct values it folded (`None` in a row written before prints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MinuteEvent {
    pub index: u32,
    pub customer: String,
    pub prints: Option<Vec<DistinctPrint>>,
}

/// Appends one event to a `z` row's value: its index in the record (below
/// `MAX_EVENTS_PER_BATCH`, so two bytes hold it), its customer's id ended by a 0
/// byte (ids never hold one), and its distinct values' prints (a two-byte count,
/// then eight bytes each; an event matches at most `MAX_METERS_PER_EVENT_NAME`
/// meters). A new row starts with [`MINUTE_EVENTS_PRINTED`].
pub fn push_minute_event(
    row: &mut Vec<u8>,
    index: u32,
    customer_id: &str,
    prints: &[DistinctPrint],
) {
    if row.is_empty() {
        row.push(MINUTE_EVENTS_PRINTED);
    }
    row.extend_from_slice(&(index as u16).to_be_bytes());
    row.extend_from_slice(customer_id.as_bytes());
    row.push(0);
    row.extend_from_slice(&(prints.len() as u16).to_be_bytes());
    for print in prints {
        row.extend_from_slice(&print.meter.to_be_bytes());
        row.extend_from_slice(&print.value.to_be_bytes());
    }
}

/// A `z` row's events, with their prints when the row has them.
pub fn decode_minute_events(bytes: &[u8]) -> Result<Vec<MinuteEvent>, EngineError> {
    let corrupt = || EngineError::Corrupt("a minute-events row does not decode".into());
    let (printed, mut bytes) = match bytes.split_first() {
        Some((&MINUTE_EVENTS_PRINTED, rest)) => (true, rest),
        _ => (false, bytes),
    };
    let mut events = Vec::new();
    while !bytes.is_empty() {
        let (index, rest) = bytes.split_first_chunk::<2>().ok_or_else(corrupt)?;
        let end = rest.iter().position(|b| *b == 0).ok_or_else(corrupt)?;
        let customer = std::str::from_utf8(&rest[..end]).map_err(|_| corrupt())?;
        bytes = &rest[end + 1..];
        let prints = if printed {
            let (count, rest) = bytes.split_first_chunk::<2>().ok_or_else(corrupt)?;
            let count = usize::from(u16::from_be_bytes(*count));
            let len = count.checked_mul(8).filter(|len| *len <= rest.len());
            let (held, rest) = rest.split_at(len.ok_or_else(corrupt)?);
            bytes = rest;
            Some(
                held.chunks_exact(8)
                    .map(|print| DistinctPrint {
                        meter: u32::from_be_bytes(print[..4].try_into().expect("4 of 8")),
                        value: u32::from_be_bytes(print[4..].try_into().expect("4 of 8")),
                    })
                    .collect(),
            )
        } else {
            None
        };
        events.push(MinuteEvent {
            index: u32::from(u16::from_be_bytes(*index)),
            customer: customer.to_string(),
            prints,
        });
    }
    Ok(events)
}

/// A voided event's mark (table `.`): when it was voided, by the record at which
/// position, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoidMark {
    pub voided_at_ms: i64,
    pub partition: u32,
    pub offset: u64,
    pub reason: String,
}

pub fn encode_void(mark: &VoidMark) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(20 + mark.reason.len());
    bytes.extend_from_slice(&mark.voided_at_ms.to_be_bytes());
    bytes.extend_from_slice(&mark.partition.to_be_bytes());
    bytes.extend_from_slice(&mark.offset.to_be_bytes());
    bytes.extend_from_slice(mark.reason.as_bytes());
    bytes
}

pub fn decode_void(bytes: &[u8]) -> Result<VoidMark, EngineError> {
    if bytes.len() < 20 {
        return Err(EngineError::Corrupt(
            "a void mark is shorter than 20 bytes".into(),
        ));
    }
    Ok(VoidMark {
        voided_at_ms: i64::from_be_bytes(bytes[..8].try_into().expect("8")),
        partition: u32::from_be_bytes(bytes[8..12].try_into().expect("4")),
        offset: u64::from_be_bytes(bytes[12..20].try_into().expect("8")),
        reason: String::from_utf8(bytes[20..].to_vec())
            .map_err(|_| EngineError::Corrupt("a void reason is not UTF-8".into()))?,
    })
}

pub fn encode_decimal(value: Decimal) -> Vec<u8> {
    value.serialize().to_vec()
}

pub fn decode_decimal(bytes: &[u8]) -> Result<Decimal, EngineError> {
    let raw: [u8; 16] = bytes
        .try_into()
        .map_err(|_| EngineError::Corrupt("decimal of wrong size".into()))?;
    Ok(Decimal::deserialize(raw))
}

pub fn encode_reservation(r: &tally_domain::reservation::Reservation) -> Vec<u8> {
    tally_proto::reservation_to_proto(r).encode_to_vec()
}

pub fn decode_reservation(
    bytes: &[u8],
) -> Result<tally_domain::reservation::Reservation, EngineError> {
    tally_proto::reservation_from_proto(v1::ReservationState::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

/// An account's live holds: `([id len u16][id][expires_at i64][amount 16 bytes])*`.
pub fn encode_holds(holds: &[tally_domain::reservation::Hold]) -> Vec<u8> {
    let mut out = Vec::with_capacity(holds.len() * 56);
    for hold in holds {
        let id = hold.reservation_id.as_bytes();
        // Ids are generated (`rsv_` and 24 characters), far below u16::MAX.
        out.extend_from_slice(&(id.len().min(usize::from(u16::MAX)) as u16).to_be_bytes());
        out.extend_from_slice(&id[..id.len().min(usize::from(u16::MAX))]);
        out.extend_from_slice(&hold.expires_at_ms.to_be_bytes());
        out.extend_from_slice(&hold.amount.serialize());
    }
    out
}

pub fn decode_holds(mut bytes: &[u8]) -> Result<Vec<tally_domain::reservation::Hold>, EngineError> {
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], EngineError> {
        if bytes.len() < n {
            return Err(EngineError::Corrupt(
                "an account's hold list is cut short".into(),
            ));
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    let mut holds = Vec::new();
    while !bytes.is_empty() {
        let len = u16::from_be_bytes(take(&mut bytes, 2)?.try_into().expect("2 bytes"));
        let id = String::from_utf8(take(&mut bytes, usize::from(len))?.to_vec())
            .map_err(|_| EngineError::Corrupt("a hold's reservation id is not UTF-8".into()))?;
        let expires_at_ms = i64::from_be_bytes(take(&mut bytes, 8)?.try_into().expect("8 bytes"));
        let amount = Decimal::deserialize(take(&mut bytes, 16)?.try_into().expect("16 bytes"));
        holds.push(tally_domain::reservation::Hold {
            reservation_id: id.into(),
            amount,
            expires_at_ms,
        });
    }
    Ok(holds)
}

pub fn encode_grant(g: &tally_domain::grant::Grant) -> Vec<u8> {
    tally_proto::grant_to_proto(g).encode_to_vec()
}

pub fn decode_grant(bytes: &[u8]) -> Result<tally_domain::grant::Grant, EngineError> {
    tally_proto::grant_from_proto(v1::CreditGrant::decode(bytes).map_err(corrupt)?).map_err(corrupt)
}

/// An account's active grants: `([id len u16][id][remaining 16 bytes][priority u32]
/// [has expiry u8][expires_at i64][seq u64])*`.
pub fn encode_active_grants(grants: &[tally_domain::grant::ActiveGrant]) -> Vec<u8> {
    let mut out = Vec::with_capacity(grants.len() * 64);
    for grant in grants {
        let id = grant.id.as_bytes();
        let len = id.len().min(usize::from(u16::MAX));
        out.extend_from_slice(&(len as u16).to_be_bytes());
        out.extend_from_slice(&id[..len]);
        out.extend_from_slice(&grant.remaining.serialize());
        out.extend_from_slice(&grant.priority.to_be_bytes());
        out.push(u8::from(grant.expires_at_ms.is_some()));
        out.extend_from_slice(&grant.expires_at_ms.unwrap_or(0).to_be_bytes());
        out.extend_from_slice(&grant.seq.to_be_bytes());
    }
    out
}

pub fn decode_active_grants(
    mut bytes: &[u8],
) -> Result<Vec<tally_domain::grant::ActiveGrant>, EngineError> {
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], EngineError> {
        if bytes.len() < n {
            return Err(EngineError::Corrupt(
                "an account's active grant list is cut short".into(),
            ));
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    let mut grants = Vec::new();
    while !bytes.is_empty() {
        let len = u16::from_be_bytes(take(&mut bytes, 2)?.try_into().expect("2 bytes"));
        let id = String::from_utf8(take(&mut bytes, usize::from(len))?.to_vec())
            .map_err(|_| EngineError::Corrupt("a grant id is not UTF-8".into()))?;
        let remaining = Decimal::deserialize(take(&mut bytes, 16)?.try_into().expect("16 bytes"));
        let priority = u32::from_be_bytes(take(&mut bytes, 4)?.try_into().expect("4 bytes"));
        let has_expiry = take(&mut bytes, 1)?[0];
        let expires = i64::from_be_bytes(take(&mut bytes, 8)?.try_into().expect("8 bytes"));
        let seq = u64::from_be_bytes(take(&mut bytes, 8)?.try_into().expect("8 bytes"));
        let expires_at_ms = match has_expiry {
            0 => None,
            1 => Some(expires),
            _ => {
                return Err(EngineError::Corrupt(
                    "a grant's expiry flag is not 0 or 1".into(),
                ))
            }
        };
        grants.push(tally_domain::grant::ActiveGrant {
            id: id.into(),
            remaining,
            priority,
            expires_at_ms,
            seq,
        });
    }
    Ok(grants)
}

pub fn encode_account(a: &tally_domain::ledger::Account) -> Vec<u8> {
    tally_proto::account_to_proto(a).encode_to_vec()
}

pub fn decode_account(bytes: &[u8]) -> Result<tally_domain::ledger::Account, EngineError> {
    tally_proto::account_from_proto(v1::CreditAccount::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

pub fn encode_transaction(t: &tally_domain::ledger::Transaction) -> Vec<u8> {
    tally_proto::transaction_to_proto(t).encode_to_vec()
}

/// A posted transaction's row: the transaction and, parallel to its entries, where
/// each sits in its account's entry list (`entry_seqs`, 0 for a system account's).
pub fn encode_posted_transaction(
    t: &tally_domain::ledger::Transaction,
    entry_seqs: Vec<u64>,
) -> Vec<u8> {
    let mut proto = tally_proto::transaction_to_proto(t);
    proto.entry_seqs = entry_seqs;
    proto.encode_to_vec()
}

/// Where the entry `entry_id` of a stored transaction row sits: its account and its
/// place in that account's entry list. `None` when the row holds no such entry.
pub fn posted_entry_place(
    bytes: &[u8],
    entry_id: &str,
) -> Result<Option<(String, u64)>, EngineError> {
    let mut proto = v1::CreditTransaction::decode(bytes).map_err(corrupt)?;
    let Some(index) = proto.entries.iter().position(|e| e.id == entry_id) else {
        return Ok(None);
    };
    let seq = proto.entry_seqs.get(index).copied().ok_or_else(|| {
        EngineError::Corrupt(format!(
            "transaction {} holds {} entries and {} entry positions",
            proto.id,
            proto.entries.len(),
            proto.entry_seqs.len()
        ))
    })?;
    Ok(Some((proto.entries.swap_remove(index).account_id, seq)))
}

pub fn decode_transaction(bytes: &[u8]) -> Result<tally_domain::ledger::Transaction, EngineError> {
    tally_proto::transaction_from_proto(v1::CreditTransaction::decode(bytes).map_err(corrupt)?)
        .map_err(corrupt)
}

/// A customer account's entry as stored for listing.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEntry {
    pub id: String,
    pub transaction_id: String,
    pub account_id: String,
    pub amount: Decimal,
    pub created_at_ms: i64,
    /// When the entry counts for a balance `at` an instant: never earlier than the
    /// account's previous entry's (docs/api.md, "Customer credits").
    pub posted_at_ms: i64,
    pub balance_after: Decimal,
    pub grant_id: Option<String>,
}

pub fn encode_entry(e: &StoredEntry) -> Vec<u8> {
    v1::StoredEntry {
        id: e.id.clone(),
        transaction_id: e.transaction_id.clone(),
        account_id: e.account_id.clone(),
        amount: tally_domain::usage::canonical_decimal(e.amount),
        created_at_ms: e.created_at_ms,
        balance_after: tally_domain::usage::canonical_decimal(e.balance_after),
        grant_id: e.grant_id.clone(),
        posted_at_ms: e.posted_at_ms,
    }
    .encode_to_vec()
}

pub fn decode_entry(bytes: &[u8]) -> Result<StoredEntry, EngineError> {
    let e = v1::StoredEntry::decode(bytes).map_err(corrupt)?;
    let decimal = |text: &str| {
        tally_domain::usage::parse_decimal(text)
            .ok_or_else(|| EngineError::Corrupt("entry decimal".into()))
    };
    Ok(StoredEntry {
        amount: decimal(&e.amount)?,
        balance_after: decimal(&e.balance_after)?,
        id: e.id,
        transaction_id: e.transaction_id,
        account_id: e.account_id,
        created_at_ms: e.created_at_ms,
        posted_at_ms: e.posted_at_ms,
        grant_id: e.grant_id,
    })
}

/// An account's entry list so far (part of its `b` row, [`AccountTotals`]): how
/// many entries it holds and the `posted_at_ms` of the last, which the next may
/// not fall below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EntryListEnd {
    pub count: u64,
    pub last_posted_at_ms: i64,
}

pub fn encode_entry_list_end(end: EntryListEnd) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(16);
    bytes.extend_from_slice(&end.count.to_be_bytes());
    bytes.extend_from_slice(&end.last_posted_at_ms.to_be_bytes());
    bytes
}

pub fn decode_entry_list_end(bytes: &[u8]) -> Result<EntryListEnd, EngineError> {
    let fixed: [u8; 16] = bytes.try_into().map_err(|_| {
        EngineError::Corrupt(format!(
            "an entry list's end holds {} bytes, not 16",
            bytes.len()
        ))
    })?;
    let (mut count, mut last) = ([0u8; 8], [0u8; 8]);
    count.copy_from_slice(&fixed[..8]);
    last.copy_from_slice(&fixed[8..]);
    Ok(EntryListEnd {
        count: u64::from_be_bytes(count),
        last_posted_at_ms: i64::from_be_bytes(last),
    })
}

/// An account's row (table `b`): its balance as posted and, for a customer
/// account, its entry list so far (a system account lists nothing). One row, so a
/// posting updates one key per account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccountTotals {
    pub balance: Decimal,
    pub entries: EntryListEnd,
}

pub fn encode_account_totals(totals: AccountTotals) -> Vec<u8> {
    let mut bytes = encode_decimal(totals.balance);
    bytes.extend_from_slice(&encode_entry_list_end(totals.entries));
    bytes
}

pub fn decode_account_totals(bytes: &[u8]) -> Result<AccountTotals, EngineError> {
    if bytes.len() != 32 {
        return Err(EngineError::Corrupt(format!(
            "an account's totals hold {} bytes, not 32",
            bytes.len()
        )));
    }
    let (balance, entries) = bytes.split_at(16);
    Ok(AccountTotals {
        balance: decode_decimal(balance)?,
        entries: decode_entry_list_end(entries)?,
    })
}
