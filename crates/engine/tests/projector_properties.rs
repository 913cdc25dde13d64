//! Property tests of the projector: any usage stream, with duplicate event ids,
//! applied in any chunking (each chunk boundary is a restart point: the store keeps
//! only committed batches and the position), gives
//! - the same projection digest as applying the whole log at once (replay), and
//! - the same usage values as a reference fold over the deduplicated events
//!   (first occurrence wins).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use proptest::prelude::*;
use rust_decimal::Decimal;
use tally_domain::meter::{Aggregation, Meter, MeterFilter, MeterStatus};
use tally_domain::record::Record;
use tally_domain::time::Window;
use tally_domain::usage::{PropertyValue, UsageEvent};
use tally_domain::Mode;
use tally_engine::projector::{apply_chunk, apply_chunk_cached, BucketCache};
use tally_engine::usage::UsageQuery;
use tally_log::LogEntry;
use tally_projection::{MemoryStore, ProjectionStore};

const STORE: &str = "st_prop";
const T0: i64 = 1_800_000_000_000;

fn meters() -> Vec<Meter> {
    [
        Aggregation::Count,
        Aggregation::Sum,
        Aggregation::Min,
        Aggregation::Max,
        Aggregation::Unique,
        Aggregation::Average,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, aggregation)| Meter {
        id: format!("mtr_{i}"),
        store_id: STORE.into(),
        mode: Mode::Test,
        name: format!("m{i}"),
        event_name: "e".into(),
        aggregation,
        aggregation_property: (aggregation != Aggregation::Count).then(|| "v".to_string()),
        filter: MeterFilter::default(),
        unit_label: "units".into(),
        status: MeterStatus::Active,
        created_at_ms: T0,
        updated_at_ms: T0,
        counts_from_ms: T0,
    })
    .collect()
}

#[derive(Debug, Clone)]
struct GenEvent {
    id: u8,
    customer: u8,
    minute: i64,
    value: Option<i64>,
}

fn gen_event() -> impl Strategy<Value = GenEvent> {
    (0u8..30, 0u8..3, 0i64..5, proptest::option::of(-50i64..50)).prop_map(
        |(id, customer, minute, value)| GenEvent {
            id,
            customer,
            minute,
            value,
        },
    )
}

fn usage_event(e: &GenEvent, meter_ids: &[String]) -> UsageEvent {
    let mut properties = BTreeMap::new();
    if let Some(v) = e.value {
        properties.insert("v".to_string(), PropertyValue::Number(Decimal::new(v, 1)));
    }
    UsageEvent {
        event_id: format!("ev{}", e.id),
        name: "e".into(),
        customer_id: format!("cus_{}", e.customer),
        external_customer_id: None,
        timestamp_ms: T0 + e.minute * 60_000 + 1_000,
        properties,
        received_at_ms: T0,
        matched_meter_ids: meter_ids.to_vec(),
        event_id_assigned: false,
    }
}

/// Builds the log: meter records, then batches of events (duplicates included).
fn log_entries(batches: &[Vec<GenEvent>]) -> Vec<LogEntry> {
    let meters = meters();
    let ids: Vec<String> = meters.iter().map(|m| m.id.clone()).collect();
    let mut records: Vec<Record> = meters.into_iter().map(Record::MeterUpserted).collect();
    for batch in batches {
        records.push(Record::UsageBatch {
            store_id: STORE.into(),
            mode: Mode::Test,
            events: batch.iter().map(|e| usage_event(e, &ids)).collect(),
        });
    }
    records
        .iter()
        .enumerate()
        .map(|(i, r)| LogEntry {
            partition: 0,
            offset: i as u64,
            next_offset: i as u64 + 1,
            payload: tally_proto::encode_record(r, T0),
        })
        .collect()
}

/// The reference: dedup by id (first wins), then fold each meter's definition.
fn reference(
    batches: &[Vec<GenEvent>],
    customer: Option<u8>,
    aggregation: Aggregation,
) -> Option<Decimal> {
    let mut seen = HashSet::new();
    let kept: Vec<&GenEvent> = batches
        .iter()
        .flatten()
        .filter(|e| seen.insert(e.id))
        .filter(|e| customer.is_none_or(|c| c == e.customer))
        .collect();
    let numbers: Vec<Decimal> = kept
        .iter()
        .filter_map(|e| e.value.map(|v| Decimal::new(v, 1)))
        .collect();
    match aggregation {
        Aggregation::Count => Some(Decimal::from(kept.len())),
        Aggregation::Sum => Some(numbers.iter().copied().sum()),
        Aggregation::Min => numbers.iter().copied().min(),
        Aggregation::Max => numbers.iter().copied().max(),
        Aggregation::Average => (!numbers.is_empty())
            .then(|| numbers.iter().copied().sum::<Decimal>() / Decimal::from(numbers.len())),
        Aggregation::Unique => Some(Decimal::from(
            numbers
                .iter()
                .map(|n| n.normalize().to_string())
                .collect::<HashSet<_>>()
                .len(),
        )),
    }
}

fn apply_in_chunks(entries: &[LogEntry], cuts: &[usize]) -> Arc<MemoryStore> {
    let store = Arc::new(MemoryStore::new());
    let mut cut_points: Vec<usize> = cuts.iter().map(|c| c % (entries.len() + 1)).collect();
    cut_points.push(0);
    cut_points.push(entries.len());
    cut_points.sort_unstable();
    cut_points.dedup();
    // The live projector keeps a bucket cache across chunks; a restart loses it.
    let mut cache = BucketCache::default();
    for (i, window) in cut_points.windows(2).enumerate() {
        // A restart: resume from the stored position, as the projector does.
        let resume = store.position(0).unwrap() as usize;
        assert_eq!(resume, window[0]);
        if i % 2 == 1 {
            cache = BucketCache::default();
        }
        apply_chunk_cached(store.as_ref(), &entries[window[0]..window[1]], &mut cache).unwrap();
    }
    store
}

/// An engine reading `store`; the temp dir of its (unused) log lives as long as the guard.
async fn engine_over(store: Arc<MemoryStore>) -> (Arc<tally_engine::Engine>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(tally_log::embedded::EmbeddedLog::open(dir.path()).unwrap());
    let clock = Arc::new(tally_domain::clock::ManualClock::new(T0 + 3_600_000));
    let engine = tally_engine::Engine::open_detached(log, store, clock)
        .await
        .unwrap();
    (engine, dir)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn chunked_application_matches_replay_and_the_reference_fold(
        batches in proptest::collection::vec(proptest::collection::vec(gen_event(), 1..12), 1..8),
        cuts in proptest::collection::vec(0usize..20, 0..6),
    ) {
        let entries = log_entries(&batches);
        let chunked = apply_in_chunks(&entries, &cuts);
        let whole = Arc::new(MemoryStore::new());
        apply_chunk(whole.as_ref(), &entries).unwrap();
        prop_assert_eq!(chunked.digest().unwrap(), whole.digest().unwrap());

        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (engine, _dir) = runtime.block_on(engine_over(chunked));
        let scope = tally_engine::Scope { store_id: STORE.into(), mode: Mode::Test };
        for meter in meters() {
            for customer in [None, Some(0u8), Some(1), Some(2)] {
                let result = engine.query_usage(&scope, &UsageQuery {
                    meter_id: meter.id.clone(),
                    customer_id: customer.map(|c| format!("cus_{c}")),
                    start_ms: T0,
                    end_ms: T0 + 3_600_000,
                    window: Window::None,
                    group_by_customer: false,
                }).unwrap();
                let expected = reference(&batches, customer, meter.aggregation).map(|d| d.normalize());
                prop_assert_eq!(result.total.value, expected, "{:?} customer {:?}", meter.aggregation, customer);
            }
        }
        // Minute windows add up to the total for additive aggregations.
        let result = engine.query_usage(&scope, &UsageQuery {
            meter_id: "mtr_1".into(), customer_id: None, start_ms: T0, end_ms: T0 + 3_600_000,
            window: Window::Minute, group_by_customer: false,
        }).unwrap();
        let windows_sum: Decimal = result.total.windows.iter().filter_map(|w| w.value).sum();
        prop_assert_eq!(Some(windows_sum.normalize()), result.total.value);
    }
}

#[test]
fn the_first_event_wins_whatever_comes_later() {
    let batches = vec![
        vec![GenEvent {
            id: 1,
            customer: 0,
            minute: 0,
            value: Some(10),
        }],
        vec![GenEvent {
            id: 1,
            customer: 1,
            minute: 3,
            value: Some(99),
        }],
    ];
    let store = apply_in_chunks(&log_entries(&batches), &[]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (engine, _dir) = runtime.block_on(engine_over(store));
    let scope = tally_engine::Scope {
        store_id: STORE.into(),
        mode: Mode::Test,
    };
    let event = engine.get_event(&scope, "ev1").unwrap();
    assert_eq!(event.customer_id, "cus_0");
}
