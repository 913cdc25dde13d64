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
use tally_core::keys;
use tally_domain::ids::MeterId;
use tally_domain::meter::{Aggregation, Meter, MeterFilter, MeterStatus};
use tally_domain::record::Record;
use tally_domain::time::Window;
use tally_domain::usage::{PropertyValue, UsageEvent};
use tally_domain::Mode;
use tally_engine::error::EngineError;
use tally_engine::event_index::EventIndex;
use tally_engine::projector::{
    apply_chunk, apply_chunk_in_memory, plan_chunk, DecodedChunk, Fetched, ProjectorState,
    StoredBatch,
};
use tally_engine::usage::UsageQuery;
use tally_log::LogEntry;
use tally_projection::{CheckpointStore, MemoryStore, ProjectionStore};

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
        Aggregation::Latest,
        Aggregation::TimeWeightedSum,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, aggregation)| Meter {
        id: format!("mtr_{i}").into(),
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
        revision: 1,
    })
    .collect()
}

#[derive(Debug, Clone)]
struct GenEvent {
    id: u8,
    customer: u8,
    minute: i64,
    /// Seconds into the minute: few, so timestamps tie (ordered by event id).
    second: i64,
    value: Option<i64>,
}

impl GenEvent {
    fn timestamp_ms(&self) -> i64 {
        T0 + self.minute * 60_000 + self.second * 1_000
    }
}

fn gen_event() -> impl Strategy<Value = GenEvent> {
    (
        0u8..30,
        0u8..3,
        0i64..5,
        prop_oneof![Just(0i64), Just(1), Just(59)],
        // Often one of a few values, so events of a minute share them (a void of a
        // shared `unique` value must leave it counted).
        proptest::option::of(prop_oneof![-50i64..50, 0i64..3]),
    )
        .prop_map(|(id, customer, minute, second, value)| GenEvent {
            id,
            customer,
            minute,
            second,
            value,
        })
}

fn usage_event(e: &GenEvent, meter_ids: &[MeterId]) -> UsageEvent {
    let mut properties = BTreeMap::new();
    if let Some(v) = e.value {
        properties.insert("v".to_string(), PropertyValue::Number(Decimal::new(v, 1)));
    }
    UsageEvent {
        event_id: format!("ev{}", e.id),
        name: "e".into(),
        customer_id: format!("cus_{}", e.customer).into(),
        external_customer_id: None,
        timestamp_ms: e.timestamp_ms(),
        properties,
        received_at_ms: T0,
        matched_meter_ids: meter_ids.to_vec(),
        event_id_assigned: false,
    }
}

/// Builds the log: meter records, then batches of events (duplicates included).
fn log_entries(batches: &[Vec<GenEvent>]) -> Vec<LogEntry> {
    let meters = meters();
    let ids: Vec<MeterId> = meters.iter().map(|m| m.id.clone()).collect();
    let mut records: Vec<Record> = meters.into_iter().map(Record::MeterUpserted).collect();
    for batch in batches {
        records.push(Record::UsageBatch {
            store_id: STORE.into(),
            mode: Mode::Test,
            events: batch.iter().map(|e| usage_event(e, &ids)).collect(),
            settles: false,
            matched_below: None,
        });
    }
    entries_of(&records)
}

/// The records as the entries of one partition, offsets 0, 1, 2...
fn entries_of(records: &[Record]) -> Vec<LogEntry> {
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
    let stored: Vec<&GenEvent> = batches
        .iter()
        .flatten()
        .filter(|e| seen.insert(e.id))
        .collect();
    reference_of(&stored, customer, aggregation)
}

/// The reference fold of the events that count (stored, not voided).
fn reference_of(
    stored: &[&GenEvent],
    customer: Option<u8>,
    aggregation: Aggregation,
) -> Option<Decimal> {
    let kept: Vec<&GenEvent> = stored
        .iter()
        .copied()
        .filter(|e| customer.is_none_or(|c| c == e.customer))
        .collect();
    let numbers: Vec<Decimal> = kept
        .iter()
        .filter_map(|e| e.value.map(|v| Decimal::new(v, 1)))
        .collect();
    // The events with a value, in time order (ties: the greater event id last).
    let mut points: Vec<(i64, String, u8, Decimal)> = kept
        .iter()
        .filter_map(|e| {
            let value = Decimal::new(e.value?, 1);
            Some((e.timestamp_ms(), format!("ev{}", e.id), e.customer, value))
        })
        .collect();
    points.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
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
        Aggregation::Latest => points.last().map(|p| p.3),
        Aggregation::TimeWeightedSum => {
            // Each customer's value holds until their next event, to the range's end.
            let mut area = Decimal::ZERO;
            for customer in 0u8..3 {
                let own: Vec<_> = points.iter().filter(|p| p.2 == customer).collect();
                for (i, point) in own.iter().enumerate() {
                    let until = own.get(i + 1).map_or(T0 + 3_600_000, |next| next.0);
                    area += point.3 * Decimal::from(until - point.0);
                }
            }
            Some(area / Decimal::from(3_600_000))
        }
    }
}

fn apply_in_chunks(entries: &[LogEntry], cuts: &[usize]) -> Arc<MemoryStore> {
    apply_in_chunks_with(entries, cuts, tally_engine::event_index::fingerprint)
}

/// `apply_in_chunks` with the event index fingerprinting ids with `fingerprint`.
fn apply_in_chunks_with(
    entries: &[LogEntry],
    cuts: &[usize],
    fingerprint: tally_engine::event_index::FingerprintFn,
) -> Arc<MemoryStore> {
    apply_in_chunks_over(Arc::new(MemoryStore::new()), entries, cuts, fingerprint)
}

/// `apply_in_chunks_with` over `store` (holding no position yet).
fn apply_in_chunks_over(
    store: Arc<MemoryStore>,
    entries: &[LogEntry],
    cuts: &[usize],
    fingerprint: tally_engine::event_index::FingerprintFn,
) -> Arc<MemoryStore> {
    let index = || Arc::new(EventIndex::with_fingerprint(fingerprint));
    let mut cut_points: Vec<usize> = cuts.iter().map(|c| c % (entries.len() + 1)).collect();
    cut_points.push(0);
    cut_points.push(entries.len());
    cut_points.sort_unstable();
    cut_points.dedup();
    // The live projector keeps its memory state (bucket cache, event index) across
    // chunks; a restart loads it from the store.
    let mut state = ProjectorState::load(store.as_ref(), index()).unwrap();
    for (i, window) in cut_points.windows(2).enumerate() {
        // A restart: resume from the stored position, as the projector does.
        let resume = store.position(0).unwrap() as usize;
        assert_eq!(resume, window[0]);
        if i % 2 == 1 {
            state = ProjectorState::load(store.as_ref(), index()).unwrap();
        }
        apply_chunk_in_memory(
            store.as_ref(),
            &mut state,
            &entries[window[0]..window[1]],
            entries,
        )
        .unwrap();
    }
    store
}

/// What happens after a chunk in `apply_with_checkpoints_and_crashes`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Crash {
    None,
    /// The layer and the bucket cache are lost; the projector resumes from the
    /// inner store's position.
    LosingTheLayer,
    /// A crash after the layer's stage was written whole, before sled held it:
    /// the restart loads the stage into the new layer (as `tally serve` loads an
    /// interrupted checkpoint) and resumes after it, with a cold bucket cache over
    /// buckets that only memory holds.
    KeepingTheStage,
}

fn gen_crash() -> impl Strategy<Value = Crash> {
    prop_oneof![
        Just(Crash::None),
        Just(Crash::LosingTheLayer),
        Just(Crash::KeepingTheStage)
    ]
}

/// Every key and value `store` shows (positions excluded).
fn contents(store: &dyn ProjectionStore) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut all = BTreeMap::new();
    store
        .scan(
            std::ops::Bound::Unbounded,
            std::ops::Bound::Unbounded,
            false,
            &mut |key, value| {
                all.insert(key.to_vec(), value.to_vec());
                tally_projection::Visit::Continue
            },
        )
        .unwrap();
    all
}

/// Applies `entries` through a checkpointing layer over `inner`, in chunks ending at
/// `cuts`, checkpointing after chunk `i` when `checkpoints[i]` and crashing as
/// `crashes[i]` says; at the end, a final checkpoint.
fn apply_with_checkpoints_and_crashes(
    entries: &[LogEntry],
    cuts: &[usize],
    checkpoints: &[bool],
    crashes: &[Crash],
    dirty_limit: usize,
) -> Arc<MemoryStore> {
    let inner = Arc::new(MemoryStore::new());
    // Background checkpoints start whenever the layer reaches `dirty_limit` keys; a
    // crash may land while one is being written.
    let layered = |inner: &Arc<MemoryStore>| {
        CheckpointStore::with_limits(
            inner.clone(),
            dirty_limit,
            std::time::Duration::from_secs(3600),
        )
    };
    let mut store = layered(&inner);
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (entries.len() + 1)).collect();
    ends.push(entries.len());
    ends.sort_unstable();
    ends.dedup();
    let mut state = ProjectorState::empty();
    let mut step = 0;
    loop {
        let position = store.position(0).unwrap() as usize;
        if position >= entries.len() {
            break;
        }
        let end = ends
            .iter()
            .copied()
            .find(|e| *e > position)
            .expect("the last end is the log's");
        apply_chunk_in_memory(&store, &mut state, &entries[position..end], entries).unwrap();
        if checkpoints.get(step).copied().unwrap_or(false) {
            store.checkpoint().unwrap();
        }
        let crash = crashes.get(step).copied().unwrap_or(Crash::None);
        if crash != Crash::None {
            // The stage: what the layers hold over the inner store, at the position
            // they reach (read before the old store is dropped, which waits for a
            // checkpoint in flight; the inner store then holds a prefix of it).
            let seen = contents(&store);
            let reached = store.position(0).unwrap();
            store = layered(&inner);
            if crash == Crash::KeepingTheStage {
                let written = contents(inner.as_ref());
                let mut stage: Vec<tally_projection::Change> = seen
                    .iter()
                    .filter(|(key, value)| written.get(*key) != Some(*value))
                    .map(|(key, value)| (key.clone(), Some(value.clone())))
                    .collect();
                stage.extend(
                    written
                        .keys()
                        .filter(|key| !seen.contains_key(*key))
                        .map(|key| (key.clone(), None)),
                );
                store.apply(stage, &[(0, reached)]).unwrap();
            }
            state = ProjectorState::load(&store, Arc::new(EventIndex::default())).unwrap();
        }
        step += 1;
    }
    store.flush().unwrap();
    assert_eq!(store.dirty_keys(), 0);
    inner
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

/// A usage record of one event received at `received_ms`.
fn batch_received(event: &GenEvent, received_ms: i64, meter_ids: &[MeterId]) -> Record {
    Record::UsageBatch {
        store_id: STORE.into(),
        mode: Mode::Test,
        events: vec![UsageEvent {
            received_at_ms: received_ms,
            ..usage_event(event, meter_ids)
        }],
        settles: false,
        matched_below: None,
    }
}

/// How many keys of `store` begin with `prefix`.
fn rows_under(store: &MemoryStore, prefix: &[u8]) -> usize {
    let mut rows = 0;
    tally_projection::scan_prefix(store, prefix, false, &mut |_, _| {
        rows += 1;
        tally_projection::Visit::Continue
    })
    .unwrap();
    rows
}

/// The usage of `meter` from `T0` to `end_ms` (one customer's, or all customers').
fn usage_of(
    engine: &tally_engine::Engine,
    meter: &Meter,
    customer: Option<u8>,
    end_ms: i64,
    window: Window,
) -> tally_engine::usage::UsageResult {
    let scope = tally_engine::Scope {
        store_id: STORE.into(),
        mode: Mode::Test,
    };
    let query = UsageQuery {
        meter_id: meter.id.to_string(),
        customer_id: customer.map(|c| format!("cus_{c}")),
        start_ms: T0,
        end_ms,
        window,
        group_by_customer: false,
    };
    engine.metering().query_usage(&scope, &query).unwrap()
}

/// All customers' usage of `meter_id` from `T0` to `end_ms`, read from `store`.
fn total_usage(store: Arc<MemoryStore>, meter_id: &str, end_ms: i64) -> Option<Decimal> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (engine, _dir) = runtime.block_on(engine_over(store));
    let scope = tally_engine::Scope {
        store_id: STORE.into(),
        mode: Mode::Test,
    };
    let query = UsageQuery {
        meter_id: meter_id.into(),
        customer_id: None,
        start_ms: T0,
        end_ms,
        window: Window::None,
        group_by_customer: false,
    };
    engine
        .metering()
        .query_usage(&scope, &query)
        .unwrap()
        .total
        .value
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
        apply_chunk_in_memory(whole.as_ref(), &mut ProjectorState::empty(), &entries, &entries).unwrap();
        prop_assert_eq!(chunked.digest().unwrap(), whole.digest().unwrap());

        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (engine, _dir) = runtime.block_on(engine_over(chunked));
        let scope = tally_engine::Scope { store_id: STORE.into(), mode: Mode::Test };
        for meter in meters() {
            for customer in [None, Some(0u8), Some(1), Some(2)] {
                let result = usage_of(&engine, &meter, customer, T0 + 3_600_000, Window::None);
                let expected = reference(&batches, customer, meter.aggregation).map(|d| d.normalize());
                prop_assert_eq!(result.total.value, expected, "{:?} customer {:?}", meter.aggregation, customer);
            }
        }
        // Minute windows add up to the total for additive aggregations.
        let result = engine.metering().query_usage(&scope, &UsageQuery {
            meter_id: "mtr_1".into(), customer_id: None, start_ms: T0, end_ms: T0 + 3_600_000,
            window: Window::Minute, group_by_customer: false,
        }).unwrap();
        let windows_sum: Decimal = result.total.windows.iter().filter_map(|w| w.value).sum();
        prop_assert_eq!(Some(windows_sum.normalize()), result.total.value);
    }
}

/// The log applied in the chunks ending at `cuts`, once it is checked against one
/// replay of the whole log: that application, and one through a checkpointing
/// layer with `checkpoints` and `crashes`, end in the replay's state.
fn chunked_agreeing_with_replay(
    entries: &[LogEntry],
    cuts: &[usize],
    checkpoints: &[bool],
    crashes: &[Crash],
) -> Result<Arc<MemoryStore>, TestCaseError> {
    let whole = Arc::new(MemoryStore::new());
    apply_chunk_in_memory(
        whole.as_ref(),
        &mut ProjectorState::empty(),
        entries,
        entries,
    )
    .unwrap();
    let chunked = apply_in_chunks(entries, cuts);
    prop_assert_eq!(chunked.digest().unwrap(), whole.digest().unwrap());
    let recovered = apply_with_checkpoints_and_crashes(entries, cuts, checkpoints, crashes, 7);
    prop_assert_eq!(recovered.digest().unwrap(), whole.digest().unwrap());
    Ok(chunked)
}

/// One step of a stream with voids: a usage record, a void of some ids, or an
/// amendment of one id (its replacement: the generated event, kept with the
/// amended event's customer).
#[derive(Debug, Clone)]
enum Step {
    Batch(Vec<GenEvent>),
    /// Events in records of their own: minutes whose events lie in many records
    /// (a void then merges the all-customers bucket from the customers' buckets
    /// rather than rebuilding it from the events).
    Singles(Vec<GenEvent>),
    Void(Vec<u8>),
    Amend(u8, GenEvent),
    /// A revision of every meter to count only events with `v > 0`, in two steps
    /// split at a minute (later batches still carry the matches of the old
    /// definition, as a gateway that had not seen it yet).
    Revise(i64),
}

/// The filter revisions switch to: `v > 0`.
fn positive_only() -> MeterFilter {
    MeterFilter {
        conjunction: tally_domain::meter::Conjunction::And,
        clauses: vec![tally_domain::meter::FilterClause {
            property: "v".into(),
            operator: tally_domain::meter::Operator::Gt,
            value: tally_domain::meter::FilterValue::Number(Decimal::ZERO),
        }],
    }
}

fn gen_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => proptest::collection::vec(gen_event(), 1..12).prop_map(Step::Batch),
        1 => proptest::collection::vec(gen_event(), 5..12).prop_map(Step::Singles),
        2 => proptest::collection::vec(0u8..30, 1..4).prop_map(Step::Void),
        2 => (0u8..30, gen_event()).prop_map(|(id, replacement)| Step::Amend(id, replacement)),
        1 => (0i64..6).prop_map(Step::Revise),
    ]
}

/// One usage record of `events`; the reference stores those whose id is new.
fn push_batch(
    records: &mut Vec<Record>,
    stored: &mut Vec<GenEvent>,
    events: &[GenEvent],
    ids: &[MeterId],
) {
    for e in events {
        if !stored.iter().any(|s| s.id == e.id) {
            stored.push(e.clone());
        }
    }
    records.push(Record::UsageBatch {
        store_id: STORE.into(),
        mode: Mode::Test,
        events: events.iter().map(|e| usage_event(e, ids)).collect(),
        settles: false,
        matched_below: None,
    });
}

/// One void record of `event_ids`; the reference takes them out when every one is
/// stored (a void naming an id not stored yet voids nothing).
fn push_void(
    records: &mut Vec<Record>,
    stored: &[GenEvent],
    voided: &mut HashSet<u8>,
    event_ids: &[u8],
) {
    if event_ids
        .iter()
        .all(|id| stored.iter().any(|s| s.id == *id))
    {
        voided.extend(event_ids.iter().copied());
    }
    records.push(Record::EventsVoided {
        store_id: STORE.into(),
        mode: Mode::Test,
        event_ids: event_ids.iter().map(|id| format!("ev{id}")).collect(),
        reason: "test".into(),
    });
}

/// The log of a stream with voids, and the reference's view of it: the stored
/// events (first id wins) less those a void took out (a void naming an id not
/// stored yet voids nothing), and whether the meters were revised.
fn log_with_voids(steps: &[Step]) -> (Vec<LogEntry>, Vec<GenEvent>, bool) {
    let created = meters();
    let ids: Vec<MeterId> = created.iter().map(|m| m.id.clone()).collect();
    let mut records: Vec<Record> = created.iter().cloned().map(Record::MeterUpserted).collect();
    let mut stored: Vec<GenEvent> = Vec::new();
    let mut voided = HashSet::new();
    let mut revised = false;
    for step in steps {
        match step {
            Step::Revise(split) => {
                revised = true;
                let first = T0.div_euclid(60_000);
                let minutes: Vec<i64> = (first..first + 5).collect();
                let (early, late) = minutes.split_at(*split.min(&5) as usize);
                for meter in &created {
                    let mut meter = meter.clone();
                    meter.filter = positive_only();
                    meter.revision = 2;
                    for part in [early, late] {
                        records.push(Record::MeterRevised {
                            meter: meter.clone(),
                            minutes: part.to_vec(),
                        });
                    }
                }
            }
            Step::Batch(events) => push_batch(&mut records, &mut stored, events, &ids),
            Step::Singles(events) => {
                for e in events {
                    push_batch(&mut records, &mut stored, std::slice::from_ref(e), &ids);
                }
            }
            Step::Void(event_ids) => push_void(&mut records, &stored, &mut voided, event_ids),
            Step::Amend(id, replacement) => {
                let mut replacement = replacement.clone();
                let original = stored.iter().find(|s| s.id == *id);
                if let Some(original) = original {
                    replacement.customer = original.customer;
                }
                // Applied when the event is stored and not voided, and the
                // replacement's id is new (voided ids stay taken).
                let applies = original.is_some()
                    && !voided.contains(id)
                    && !stored.iter().any(|s| s.id == replacement.id);
                if applies {
                    voided.insert(*id);
                    stored.push(replacement.clone());
                }
                records.push(Record::EventAmended {
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    event_id: format!("ev{id}"),
                    reason: "test".into(),
                    replacement: usage_event(&replacement, &ids),
                    matched_below: None,
                });
            }
        }
    }
    stored.retain(|e| !voided.contains(&e.id));
    (entries_of(&records), stored, revised)
}

/// A void committed by one chunk is known to the next chunk of the same projector
/// state (the in-memory sparse rows learn every commit): voiding the event again,
/// or amending it, is then refused instead of subtracting it a second time.
#[test]
fn a_void_is_seen_by_the_next_chunk_of_the_same_state() {
    let event = |id, customer, value| GenEvent {
        id,
        customer,
        minute: 0,
        second: 1,
        value: Some(value),
    };
    let steps = [
        Step::Batch(vec![event(1, 0, 5), event(2, 0, 7)]),
        Step::Void(vec![1]),
        Step::Void(vec![1]),
        Step::Amend(1, event(3, 0, 9)),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 1, "only event 2 counts");
    let whole = Arc::new(MemoryStore::new());
    apply_chunk_in_memory(
        whole.as_ref(),
        &mut ProjectorState::empty(),
        &entries,
        &entries,
    )
    .unwrap();
    // Chunks: [meters, batch] [first void] (state reloaded) [second void, amend]
    // (state kept from the chunk before).
    let first_void = entries.len() - 3;
    let chunked = apply_in_chunks(&entries, &[first_void, first_void + 1]);
    assert_eq!(chunked.digest().unwrap(), whole.digest().unwrap());
}

/// Events 1 and 2 in the first minute, 3 and 4 in the next, each its own record
/// and customer: a `unique` void of one rebuilds its minute from the other record
/// too, so voiding 1 or 3 reads a record back.
fn two_records_in_each_of_two_minutes() -> Step {
    let event = |id: u8, minute| GenEvent {
        id,
        customer: id,
        minute,
        second: 1,
        value: Some(i64::from(id)),
    };
    Step::Singles(vec![event(1, 0), event(2, 0), event(3, 1), event(4, 1)])
}

/// A chunk of several voids whose rebuilds read records back asks for every
/// record it lacks in one answer: one fetch after the plan's, not one attempt per
/// void (the second void asks too while the first is rolled back).
#[test]
fn a_chunk_of_voids_asks_for_every_record_it_lacks_at_once() {
    let steps = [
        two_records_in_each_of_two_minutes(),
        Step::Void(vec![1]),
        Step::Void(vec![3]),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 2, "events 2 and 4 count");
    let (store, mut state, chunk, mut fetched) = planned_last_chunk(&entries, 2);
    let Err(EngineError::RecordsNeeded(more)) = apply_chunk(&store, &mut state, &chunk, &fetched)
    else {
        panic!("the voids read their minutes' other records back");
    };
    // Both minutes' other records (events 2 and 4), in one answer.
    assert_eq!(more.len(), 2, "{more:?}");
    fetch_from(&entries, &mut fetched, more);
    apply_chunk(&store, &mut state, &chunk, &fetched).unwrap();
    let whole = apply_in_chunks(&entries, &[]);
    assert_eq!(store.digest().unwrap(), whole.digest().unwrap());
}

/// The gateway of a void works out which records its rebuilds read back
/// (`rebuild_records`: apply run on the committed projection) and hints them to
/// the record's plan: the plan then fetches exactly what apply would have asked
/// for, and the void applies at the first attempt, to the same projection.
#[test]
fn a_void_hinted_by_its_gateway_applies_at_the_first_attempt() {
    let steps = [two_records_in_each_of_two_minutes(), Step::Void(vec![1, 3])];
    let (entries, _, _) = log_with_voids(&steps);
    let (store, mut state, chunk, unhinted) = planned_last_chunk(&entries, 1);
    let ids = vec!["ev1".to_string(), "ev3".to_string()];
    let scope = tally_core::Scope {
        store_id: STORE.into(),
        mode: Mode::Test,
    };
    let mut hint =
        tally_metering::voids::rebuild_records(&store, &state.index, &unhinted, &scope, &ids);
    hint.sort_unstable();
    let Err(EngineError::RecordsNeeded(mut asked)) =
        apply_chunk(&store, &mut state, &chunk, &unhinted)
    else {
        panic!("without the hint the void reads its minutes' other records back");
    };
    asked.sort_unstable();
    assert_eq!(hint, asked, "the hint is what apply asks for");
    let recent = tally_metering::recent::RecentRecords::default();
    let digest = tally_metering::voids::void_digest(STORE, Mode::Test, &ids, "test");
    recent.hint(digest, hint.clone());
    let planned = plan_chunk(&store, &state.index, &chunk, Some(&recent)).unwrap();
    assert!(hint.iter().all(|p| planned.contains(p)), "{planned:?}");
    assert!(
        recent.take_hint(digest).is_empty(),
        "the plan took the hint"
    );
    let mut fetched = Fetched::new();
    fetch_from(&entries, &mut fetched, planned);
    if let Err(error) = apply_chunk(&store, &mut state, &chunk, &fetched) {
        panic!("the hinted void read more back: {error}");
    }
    let whole = apply_in_chunks(&entries, &[]);
    assert_eq!(store.digest().unwrap(), whole.digest().unwrap());
}

/// A void of an event whose value no other event of its minute holds, and that
/// holds no bucket's extreme or latest point, subtracts everywhere: the customer's
/// buckets held it alone, and the `z` rows' prints show its `unique` value leaves
/// the meter-wide bucket with it. No record is read back; the first attempt commits.
#[test]
fn a_void_that_no_bucket_needs_rebuilt_reads_no_records_back() {
    let event = |id: u8, second, value| GenEvent {
        id,
        customer: id,
        minute: 0,
        second,
        value: Some(value),
    };
    // Event 1 is neither the minute's min (3), max (7) nor latest (event 3).
    let steps = [
        Step::Singles(vec![event(1, 0, 5), event(2, 1, 3), event(3, 59, 7)]),
        Step::Void(vec![1]),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 2, "events 2 and 3 count");
    let (store, mut state, chunk, fetched) = planned_last_chunk(&entries, 1);
    assert_eq!(fetched.len(), 1, "the plan reads the voided event's record");
    if let Err(error) = apply_chunk(&store, &mut state, &chunk, &fetched) {
        panic!("the void read more back: {error}");
    }
    let whole = apply_in_chunks(&entries, &[]);
    assert_eq!(store.digest().unwrap(), whole.digest().unwrap());
    assert_eq!(
        unique_usage(Arc::new(store), None),
        Some(Decimal::from(2)),
        "3 and 7 remain"
    );
}

/// A void of one of a customer's several events of a minute, whose `unique` value
/// no other event of the minute holds (the `z` rows' prints say so), takes the
/// value out of the customer's bucket too without reading the customer's other
/// records back: a busy customer's minute is not re-read for one void.
#[test]
fn a_void_in_a_customers_busy_minute_reads_none_of_its_other_records() {
    let event = |id: u8, customer, second, value| GenEvent {
        id,
        customer,
        minute: 0,
        second,
        value: Some(value),
    };
    // Event 2 is neither an extreme nor the latest point, for its customer or all.
    let steps = [
        Step::Singles(vec![
            event(1, 0, 1, 3),
            event(2, 0, 2, 5),
            event(3, 0, 3, 7),
            event(4, 1, 4, 9),
        ]),
        Step::Void(vec![2]),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 3, "events 1, 3 and 4 count");
    let (store, mut state, chunk, fetched) = planned_last_chunk(&entries, 1);
    assert_eq!(fetched.len(), 1, "the plan reads the voided event's record");
    if let Err(error) = apply_chunk(&store, &mut state, &chunk, &fetched) {
        panic!("the void read more back: {error}");
    }
    let store = Arc::new(store);
    assert_eq!(
        unique_usage(store.clone(), Some(0)),
        Some(Decimal::from(2)),
        "3 and 7 remain for customer 0"
    );
    assert_eq!(
        unique_usage(store, None),
        Some(Decimal::from(3)),
        "3, 7 and 9 remain"
    );
}

/// A store that applied every entry but the last `last`, those as one chunk, and
/// the records its plan asks for.
fn planned_last_chunk(
    entries: &[LogEntry],
    last: usize,
) -> (MemoryStore, ProjectorState, DecodedChunk, Fetched) {
    let at = entries.len() - last;
    let store = MemoryStore::new();
    let mut state = ProjectorState::empty();
    apply_chunk_in_memory(&store, &mut state, &entries[..at], entries).unwrap();
    let chunk = DecodedChunk::new(entries[at..].to_vec());
    let mut fetched = Fetched::new();
    let planned = plan_chunk(&store, &state.index, &chunk, None).unwrap();
    fetch_from(entries, &mut fetched, planned);
    (store, state, chunk, fetched)
}

/// Reads the records at `positions` from `entries` into `fetched`, as the runtime's
/// fetch does from the log.
fn fetch_from(
    entries: &[LogEntry],
    fetched: &mut Fetched,
    positions: impl IntoIterator<Item = (u32, u64)>,
) {
    for (partition, offset) in positions {
        let entry = entries
            .iter()
            .find(|e| (e.partition, e.offset) == (partition, offset))
            .unwrap();
        let batch = StoredBatch::decode(&entry.payload).unwrap().map(Arc::new);
        fetched.insert((partition, offset), batch);
    }
}

/// `customer`'s usage (`None`: all customers) of the `unique` meter over the first
/// hour, answered by an engine over `store`.
fn unique_usage(store: Arc<MemoryStore>, customer: Option<u8>) -> Option<Decimal> {
    let (engine, _dir) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(engine_over(store));
    let unique = meters()
        .into_iter()
        .find(|m| m.aggregation == Aggregation::Unique)
        .unwrap();
    usage_of(&engine, &unique, customer, T0 + 3_600_000, Window::None)
        .total
        .value
}

/// Two events of one minute hold the same `unique` value (customers apart): a void
/// of one leaves the value in the meter-wide bucket, which the other still holds.
/// Their prints are equal, so the bucket is rebuilt from the minute's records.
#[test]
fn a_void_keeps_a_distinct_value_another_event_of_the_minute_holds() {
    let event = |id: u8, value| GenEvent {
        id,
        customer: id,
        minute: 0,
        second: 1,
        value: Some(value),
    };
    let steps = [
        Step::Singles(vec![event(1, 5), event(2, 5), event(3, 6)]),
        Step::Void(vec![1]),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 2, "events 2 and 3 count");
    let store = apply_in_chunks(&entries, &[entries.len() - 1]);
    assert_eq!(
        unique_usage(store, None),
        Some(Decimal::from(2)),
        "5 and 6 remain"
    );
}

/// The in-memory sparse rows learn each commit's voided counts (`'` rows) too: a
/// second void in the same customer's minute, in the next chunk of the same state,
/// reads the count the first wrote instead of starting again from none.
#[test]
fn voided_counts_add_up_across_chunks_of_the_same_state() {
    let event = |id| GenEvent {
        id,
        customer: 0,
        minute: 0,
        second: 1,
        value: Some(5),
    };
    let steps = [
        Step::Batch(vec![event(1), event(2), event(3)]),
        Step::Void(vec![1]),
        Step::Void(vec![2]),
    ];
    let (entries, counted, _) = log_with_voids(&steps);
    assert_eq!(counted.len(), 1, "only event 3 counts");
    let whole = apply_in_chunks(&entries, &[]);
    // Chunks: [meters, batch] [first void] (state reloaded) [second void] (state
    // kept from the chunk before).
    let first_void = entries.len() - 2;
    let chunked = apply_in_chunks(&entries, &[first_void, first_void + 1]);
    assert_eq!(chunked.digest().unwrap(), whole.digest().unwrap());
}

/// The bucket cache remembers which values the meter-wide `unique` buckets hold,
/// so a value seen again is not rewritten; a void that deletes one must make it
/// forget it. Here one projector state applies every record as its own chunk: a
/// value stored, voided, then brought back by another customer's event counts
/// again (a cache that kept the voided value would skip writing it back).
#[test]
fn a_distinct_value_voided_then_seen_again_is_held_again() {
    let event = |id, customer| GenEvent {
        id,
        customer,
        minute: 0,
        second: 1,
        value: Some(5),
    };
    let steps = [
        Step::Batch(vec![event(1, 0)]),
        Step::Void(vec![1]),
        Step::Batch(vec![event(2, 1)]),
    ];
    assert_eq!(
        unique_after_chunks_of_one_record(&steps, None),
        Some(Decimal::ONE)
    );
}

/// Likewise a customer's inline set: a void of the customer's only event of the
/// minute empties the set unread, and must take it out of the cache too, or the
/// customer's next event of that minute would find the voided value still there.
#[test]
fn a_customers_set_emptied_by_a_void_is_not_found_again_in_the_cache() {
    let event = |id, value| GenEvent {
        id,
        customer: 0,
        minute: 0,
        second: 1,
        value: Some(value),
    };
    let steps = [
        Step::Batch(vec![event(1, 5)]),
        Step::Void(vec![1]),
        Step::Batch(vec![event(2, 6)]),
    ];
    assert_eq!(
        unique_after_chunks_of_one_record(&steps, Some(0)),
        Some(Decimal::ONE)
    );
}

/// Applies the log of `steps` (where only the last event counts) with one
/// projector state, each record its own chunk, checks the store against one chunk
/// of everything, and answers `customer`'s `unique` usage.
fn unique_after_chunks_of_one_record(steps: &[Step], customer: Option<u8>) -> Option<Decimal> {
    let (entries, counted, _) = log_with_voids(steps);
    assert_eq!(counted.len(), 1, "only the last event counts");
    let whole = apply_in_chunks(&entries, &[]);
    let store = Arc::new(MemoryStore::new());
    let mut state = ProjectorState::load(store.as_ref(), Arc::new(EventIndex::default())).unwrap();
    for at in 0..entries.len() {
        apply_chunk_in_memory(store.as_ref(), &mut state, &entries[at..=at], &entries).unwrap();
    }
    assert_eq!(store.digest().unwrap(), whole.digest().unwrap());
    unique_usage(store, customer)
}

/// The state after `steps`, however chunked and whatever the checkpoint and crash
/// points, is the reference fold of the events that count: for every aggregation,
/// per customer and for all, over the whole hour and minute by minute.
fn voids_agree_with_the_reference(
    steps: &[Step],
    cuts: &[usize],
    checkpoints: &[bool],
    crashes: &[Crash],
) -> Result<(), TestCaseError> {
    let (entries, counted, revised) = log_with_voids(steps);
    let chunked = chunked_agreeing_with_replay(&entries, cuts, checkpoints, crashes)?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (engine, _dir) = runtime.block_on(engine_over(chunked));
    for meter in meters() {
        // A revised meter counts what its new definition matches, of every event.
        let counted: Vec<&GenEvent> = counted
            .iter()
            .filter(|e| !revised || e.value.is_some_and(|v| v > 0))
            .collect();
        for customer in [None, Some(0u8), Some(1), Some(2)] {
            let result = usage_of(&engine, &meter, customer, T0 + 3_600_000, Window::None);
            let expected =
                reference_of(&counted, customer, meter.aggregation).map(|d| d.normalize());
            prop_assert_eq!(
                result.total.value,
                expected,
                "{:?} customer {:?}",
                meter.aggregation,
                customer
            );
            // Minute by minute too: a rebuilt bucket is exact on its own.
            let minutes = usage_of(&engine, &meter, customer, T0 + 5 * 60_000, Window::Minute);
            if meter.aggregation != Aggregation::TimeWeightedSum {
                // Listed: the minutes where a counted event contributes, as if
                // the voided ones never came.
                let listed: Vec<i64> = minutes
                    .total
                    .windows
                    .iter()
                    .map(|w| (w.start_ms - T0) / 60_000)
                    .collect();
                let mut used: Vec<i64> = counted
                    .iter()
                    .filter(|e| customer.is_none_or(|c| c == e.customer))
                    .filter(|e| meter.aggregation == Aggregation::Count || e.value.is_some())
                    .map(|e| e.minute)
                    .collect();
                used.sort_unstable();
                used.dedup();
                prop_assert_eq!(
                    listed,
                    used,
                    "{:?} customer {:?}",
                    meter.aggregation,
                    customer
                );
                for window in &minutes.total.windows {
                    let minute = (window.start_ms - T0) / 60_000;
                    let in_minute: Vec<&GenEvent> = counted
                        .iter()
                        .copied()
                        .filter(|e| e.minute == minute)
                        .collect();
                    let expected = reference_of(&in_minute, customer, meter.aggregation)
                        .map(|d| d.normalize());
                    prop_assert_eq!(
                        window.value,
                        expected,
                        "{:?} customer {:?} minute {}",
                        meter.aggregation,
                        customer,
                        minute
                    );
                }
            }
        }
    }
    Ok(())
}

/// Events of one minute and two customers with mostly distinct values: a void there
/// meets a customer with other events in the minute, whose value it alone holds
/// (the customer's `unique` bucket then subtracts by prints, not by a rebuild).
fn gen_busy_minute_step() -> impl Strategy<Value = Step> {
    let event = (
        0u8..30,
        0u8..2,
        prop_oneof![Just(0i64), Just(1), Just(59)],
        proptest::option::of(-50i64..50),
    )
        .prop_map(|(id, customer, second, value)| GenEvent {
            id,
            customer,
            minute: 0,
            second,
            value,
        });
    prop_oneof![
        3 => proptest::collection::vec(event.clone(), 1..12).prop_map(Step::Batch),
        1 => proptest::collection::vec(event, 5..12).prop_map(Step::Singles),
        2 => proptest::collection::vec(0u8..30, 1..4).prop_map(Step::Void),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Voids subtract exactly (and amendments replace exactly, and revisions
    /// re-derive exactly), for every aggregation, per customer and for all
    /// customers, however the records are chunked and whatever the checkpoint and
    /// crash points: the state is the reference fold of the events that count.
    #[test]
    fn voided_events_leave_every_aggregation_as_if_never_stored(
        steps in proptest::collection::vec(gen_step(), 1..10),
        cuts in proptest::collection::vec(0usize..20, 0..6),
        checkpoints in proptest::collection::vec(any::<bool>(), 0..8),
        crashes in proptest::collection::vec(gen_crash(), 0..8),
    ) {
        voids_agree_with_the_reference(&steps, &cuts, &checkpoints, &crashes)?;
    }

    /// The same, with every event in one busy minute of two customers.
    #[test]
    fn voids_in_a_busy_minute_leave_every_aggregation_as_if_never_stored(
        steps in proptest::collection::vec(gen_busy_minute_step(), 1..10),
        cuts in proptest::collection::vec(0usize..20, 0..6),
        checkpoints in proptest::collection::vec(any::<bool>(), 0..8),
        crashes in proptest::collection::vec(gen_crash(), 0..8),
    ) {
        voids_agree_with_the_reference(&steps, &cuts, &checkpoints, &crashes)?;
    }
}

/// One step of a stream in which meters come into being while events arrive.
#[derive(Debug, Clone)]
enum LateStep {
    /// The next of `meters()` is created.
    Meter,
    /// A usage record matched by a gateway that had applied all but the last `lag`
    /// records before it: it matched only the meters created below that point.
    Batch {
        events: Vec<GenEvent>,
        lag: usize,
    },
    Void(Vec<u8>),
    /// An amendment of one id, matched by a gateway lagging likewise.
    Amend {
        id: u8,
        replacement: GenEvent,
        lag: usize,
    },
}

fn gen_late_step() -> impl Strategy<Value = LateStep> {
    prop_oneof![
        2 => Just(LateStep::Meter),
        4 => (proptest::collection::vec(gen_event(), 1..8), 0usize..5)
            .prop_map(|(events, lag)| LateStep::Batch { events, lag }),
        1 => proptest::collection::vec(0u8..30, 1..3).prop_map(LateStep::Void),
        // Amended ids among the few generated first (0..30), so most name a
        // stored event.
        2 => (0u8..8, gen_event(), 0usize..5)
            .prop_map(|(id, replacement, lag)| LateStep::Amend { id, replacement, lag }),
    ]
}

/// The log of a stream of `LateStep`s, and the reference's view: for each meter
/// created, the events that count in it (stored by a record after the meter's,
/// first id wins, not voided), whatever its gateway knew.
fn log_with_late_meters(steps: &[LateStep]) -> (Vec<LogEntry>, Vec<(Meter, Vec<GenEvent>)>) {
    let all = meters();
    let mut records: Vec<Record> = Vec::new();
    // Each meter created, with the offset of its record.
    let mut created: Vec<(Meter, u64)> = Vec::new();
    // Each stored event, with the offset of its record.
    let mut stored: Vec<(GenEvent, u64)> = Vec::new();
    let mut voided = HashSet::new();
    for step in steps {
        let offset = records.len() as u64;
        let known_below = |lag: usize| {
            let below = offset.saturating_sub(lag as u64);
            let known: Vec<MeterId> = created
                .iter()
                .filter(|(_, at)| *at < below)
                .map(|(m, _)| m.id.clone())
                .collect();
            (below, known)
        };
        match step {
            LateStep::Meter => {
                if let Some(meter) = all.get(created.len()) {
                    created.push((meter.clone(), offset));
                    records.push(Record::MeterUpserted(meter.clone()));
                }
            }
            LateStep::Batch { events, lag } => {
                let (below, known) = known_below(*lag);
                for e in events {
                    if !stored.iter().any(|(s, _)| s.id == e.id) {
                        stored.push((e.clone(), offset));
                    }
                }
                records.push(Record::UsageBatch {
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    events: events.iter().map(|e| usage_event(e, &known)).collect(),
                    settles: false,
                    matched_below: Some(below),
                });
            }
            LateStep::Void(event_ids) => {
                if event_ids
                    .iter()
                    .all(|id| stored.iter().any(|(s, _)| s.id == *id))
                {
                    voided.extend(event_ids.iter().copied());
                }
                records.push(Record::EventsVoided {
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    event_ids: event_ids.iter().map(|id| format!("ev{id}")).collect(),
                    reason: "test".into(),
                });
            }
            LateStep::Amend {
                id,
                replacement,
                lag,
            } => {
                let (below, known) = known_below(*lag);
                let mut replacement = replacement.clone();
                let original = stored.iter().find(|(s, _)| s.id == *id);
                if let Some((original, _)) = original {
                    replacement.customer = original.customer;
                }
                // As in `log_with_voids`: applied when the event is stored and not
                // voided and the replacement's id is new.
                let applies = original.is_some()
                    && !voided.contains(id)
                    && !stored.iter().any(|(s, _)| s.id == replacement.id);
                if applies {
                    voided.insert(*id);
                    stored.push((replacement.clone(), offset));
                }
                records.push(Record::EventAmended {
                    store_id: STORE.into(),
                    mode: Mode::Test,
                    event_id: format!("ev{id}"),
                    reason: "test".into(),
                    replacement: usage_event(&replacement, &known),
                    matched_below: Some(below),
                });
            }
        }
    }
    let counted = created
        .into_iter()
        .map(|(meter, at)| {
            let events = stored
                .iter()
                .filter(|(e, by)| *by > at && !voided.contains(&e.id))
                .map(|(e, _)| e.clone())
                .collect();
            (meter, events)
        })
        .collect();
    (entries_of(&records), counted)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// A meter created (or changed) after what a usage record's gateway had applied
    /// still counts the record's events, exactly once, as the log orders them; a
    /// void then subtracts them from it exactly; and chunking, checkpoints and
    /// crashes change nothing.
    #[test]
    fn meters_the_gateway_did_not_know_count_events_in_log_order(
        steps in proptest::collection::vec(gen_late_step(), 1..16),
        cuts in proptest::collection::vec(0usize..20, 0..6),
        checkpoints in proptest::collection::vec(any::<bool>(), 0..8),
        crashes in proptest::collection::vec(gen_crash(), 0..8),
    ) {
        let (entries, counted) = log_with_late_meters(&steps);
        let chunked = chunked_agreeing_with_replay(&entries, &cuts, &checkpoints, &crashes)?;

        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (engine, _dir) = runtime.block_on(engine_over(chunked));
        for (meter, events) in &counted {
            let events: Vec<&GenEvent> = events.iter().collect();
            for customer in [None, Some(0u8), Some(1), Some(2)] {
                let result = usage_of(&engine, meter, customer, T0 + 3_600_000, Window::None);
                let expected = reference_of(&events, customer, meter.aggregation).map(|d| d.normalize());
                prop_assert_eq!(result.total.value, expected, "{:?} customer {:?}", meter.aggregation, customer);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Hot state in memory with sled as the checkpoint: whatever the checkpoint and
    /// crash points, recovery (last checkpoint + the log from its positions) ends in
    /// exactly the state of one replay of the whole log.
    #[test]
    fn any_checkpoint_and_crash_points_recover_the_replayed_state(
        batches in proptest::collection::vec(proptest::collection::vec(gen_event(), 1..12), 1..8),
        cuts in proptest::collection::vec(0usize..20, 0..6),
        checkpoints in proptest::collection::vec(any::<bool>(), 0..8),
        crashes in proptest::collection::vec(gen_crash(), 0..8),
        dirty_limit in prop_oneof![Just(usize::MAX), 1usize..40],
    ) {
        let entries = log_entries(&batches);
        let recovered =
            apply_with_checkpoints_and_crashes(&entries, &cuts, &checkpoints, &crashes, dirty_limit);
        let whole = Arc::new(MemoryStore::new());
        apply_chunk_in_memory(whole.as_ref(), &mut ProjectorState::empty(), &entries, &entries).unwrap();
        prop_assert_eq!(recovered.position(0).unwrap(), whole.position(0).unwrap());
        prop_assert_eq!(recovered.digest().unwrap(), whole.digest().unwrap());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// What a catch-up reads ahead covers what apply reads: every per-customer
    /// bucket (`A`) and distinct set (`u`) that applying the log stores is among the
    /// chunk's read-ahead keys, and every key read ahead is one of those tables.
    #[test]
    fn reading_ahead_covers_every_bucket_apply_stores(
        batches in proptest::collection::vec(proptest::collection::vec(gen_event(), 1..12), 1..6),
    ) {
        let entries = log_entries(&batches);
        let store = MemoryStore::new();
        apply_chunk_in_memory(&store, &mut ProjectorState::empty(), &entries, &entries).unwrap();
        let chunk = tally_engine::projector::DecodedChunk::new(entries);
        let keeps_sets = |store_id: &str, mode: Mode, meter_id: &str| {
            tally_metering::apply::keeps_distinct_sets(&store, store_id, mode, meter_id)
        };
        let read: HashSet<Vec<u8>> = chunk.bucket_keys(&keeps_sets).collect();
        for key in &read {
            prop_assert!(matches!(key.first(), Some(&keys::AGGREGATE) | Some(&keys::DISTINCT_SET)));
        }
        let mut stored = Vec::new();
        for table in [keys::AGGREGATE, keys::DISTINCT_SET] {
            tally_projection::scan_prefix(&store, &[table], false, &mut |key, _| {
                stored.push(key.to_vec());
                tally_projection::Visit::Continue
            })
            .unwrap();
        }
        let mut per_customer = 0;
        for key in stored {
            let (bucket, _) = keys::BucketKey::decode(&key).unwrap();
            if bucket.customer != keys::ALL_CUSTOMERS {
                per_customer += 1;
                prop_assert!(read.contains(&key), "not read ahead: {}", String::from_utf8_lossy(&key));
            }
        }
        prop_assert!(per_customer > 0);
    }
}

/// A fingerprint under which most ids collide: a hit must be confirmed exactly.
fn colliding(_: &str, _: Mode, event_id: &str) -> u64 {
    (event_id.len() % 2) as u64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Dedup stays exact when fingerprints collide all the time: no distinct event is
    /// dropped as a false duplicate, and no id is counted twice, in any chunking
    /// with restarts.
    #[test]
    fn forced_fingerprint_collisions_neither_drop_nor_double_count(
        batches in proptest::collection::vec(proptest::collection::vec(gen_event(), 1..12), 1..8),
        cuts in proptest::collection::vec(0usize..20, 0..6),
    ) {
        let entries = log_entries(&batches);
        let store = apply_in_chunks_with(&entries, &cuts, colliding);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (engine, _dir) = runtime.block_on(engine_over(store));
        let scope = tally_engine::Scope { store_id: STORE.into(), mode: Mode::Test };
        for (meter, aggregation) in [("mtr_0", Aggregation::Count), ("mtr_1", Aggregation::Sum)] {
            for customer in [None, Some(0u8), Some(1), Some(2)] {
                let result = engine.metering().query_usage(&scope, &UsageQuery {
                    meter_id: meter.into(),
                    customer_id: customer.map(|c| format!("cus_{c}")),
                    start_ms: T0,
                    end_ms: T0 + 3_600_000,
                    window: Window::None,
                    group_by_customer: false,
                }).unwrap();
                let expected = reference(&batches, customer, aggregation).map(|d| d.normalize());
                prop_assert_eq!(result.total.value, expected, "{:?} customer {:?}", aggregation, customer);
            }
        }
    }
}

/// Through the service, over a real log: the first event wins, it is what
/// `get_event` and the listing return, and ingest reports the later one as a
/// duplicate whose payload differs, also when every id's fingerprint collides.
#[test]
fn the_first_event_wins_whatever_comes_later() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let log: Arc<dyn tally_log::Log> =
            Arc::new(tally_log::embedded::EmbeddedLog::open(dir.path().join("log")).unwrap());
        let store: Arc<dyn ProjectionStore> = Arc::new(MemoryStore::new());
        let clock = Arc::new(tally_domain::clock::ManualClock::new(T0 + 60_000));
        // The store and its meters, then two events under one id for two customers.
        let mut records: Vec<Record> = meters().into_iter().map(Record::MeterUpserted).collect();
        for (customer, value) in [(0u8, 10i64), (1, 99)] {
            let event = GenEvent {
                id: 1,
                customer,
                minute: 0,
                second: 1,
                value: Some(value),
            };
            records.push(Record::UsageBatch {
                store_id: STORE.into(),
                mode: Mode::Test,
                events: vec![
                    usage_event(&event, &["mtr_0".into()]),
                    usage_event(
                        &GenEvent {
                            id: 2 + customer * 10,
                            ..event
                        },
                        &["mtr_0".into()],
                    ),
                ],
                settles: false,
                matched_below: None,
            });
        }
        for record in &records {
            log.append(b"k", tally_proto::encode_record(record, T0))
                .await
                .unwrap();
        }
        let engine = tally_engine::Engine::open_with_index(
            log,
            store,
            clock,
            EventIndex::with_fingerprint(colliding),
        )
        .await
        .unwrap();
        let (_stop, shutdown) = tokio::sync::watch::channel(false);
        let _projector = engine.start_projector(shutdown);
        engine.wait_caught_up().await.unwrap();
        let scope = tally_engine::Scope {
            store_id: STORE.into(),
            mode: Mode::Test,
        };
        let event = engine.metering().get_event(&scope, "ev1").await.unwrap();
        assert_eq!(event.customer_id, "cus_0");
        for id in ["ev2", "ev12"] {
            assert_eq!(
                engine
                    .metering()
                    .get_event(&scope, id)
                    .await
                    .unwrap()
                    .event_id,
                id
            );
        }
        assert!(
            engine.metering().get_event(&scope, "ev3").await.is_err(),
            "a colliding id that was never sent is not found"
        );
        let page = engine
            .metering()
            .list_events(
                &scope,
                &tally_engine::events::EventFilter::default(),
                &tally_engine::pagination::PageRequest {
                    limit: 10,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let ids: Vec<&str> = page.data.iter().map(|e| e.event_id.as_str()).collect();
        assert_eq!(
            ids,
            ["ev12", "ev2", "ev1"],
            "newest record first, last event of a record first"
        );
        let count = engine
            .metering()
            .query_usage(
                &scope,
                &UsageQuery {
                    meter_id: "mtr_0".into(),
                    customer_id: None,
                    start_ms: T0,
                    end_ms: T0 + 3_600_000,
                    window: Window::None,
                    group_by_customer: false,
                },
            )
            .unwrap();
        assert_eq!(count.total.value, Some(Decimal::from(3)));
    });
}

/// Stored events older than the retention leave the index and the `F` rows once a
/// record received past it is applied, whatever the chunking and restarts (the same
/// cut live and on replay), and stay counted in usage.
#[test]
fn stored_events_past_the_retention_are_pruned_at_the_same_records() {
    use tally_engine::event_index::{PRUNE_STEP_MS, STORED_EVENTS_RETENTION_MS};
    let old = GenEvent {
        id: 1,
        customer: 0,
        minute: 0,
        second: 1,
        value: Some(1),
    };
    let ids: Vec<MeterId> = meters().iter().map(|m| m.id.clone()).collect();
    let mut records: Vec<Record> = meters().into_iter().map(Record::MeterUpserted).collect();
    let batch = |event: &GenEvent, received: i64| batch_received(event, received, &ids);
    records.push(batch(&old, T0));
    // Received just inside the retention of the first: nothing is pruned yet.
    let inside = T0 + STORED_EVENTS_RETENTION_MS;
    records.push(batch(
        &GenEvent {
            id: 2,
            ..old.clone()
        },
        inside,
    ));
    // An hour later the first record's receipt is below the cut.
    records.push(batch(
        &GenEvent {
            id: 3,
            ..old.clone()
        },
        inside + 2 * PRUNE_STEP_MS,
    ));
    let entries = entries_of(&records);
    let stored_rows = |store: &MemoryStore| rows_under(store, b"F");
    let meters_end = meters().len();
    let mut digests = Vec::new();
    for cuts in [
        vec![],
        vec![meters_end + 1],
        vec![meters_end + 1, meters_end + 2],
    ] {
        let store = apply_in_chunks(&entries, &cuts);
        let state = ProjectorState::load(store.as_ref(), Arc::new(EventIndex::default())).unwrap();
        assert_eq!(
            state.index.len(),
            2,
            "the first event is pruned (cuts {cuts:?})"
        );
        assert_eq!(stored_rows(&store), 2);
        digests.push(store.digest().unwrap());
        assert_eq!(
            total_usage(store, "mtr_0", T0 + 3_600_000),
            Some(Decimal::from(3)),
            "pruned events stay counted"
        );
    }
    assert!(
        digests.windows(2).all(|w| w[0] == w[1]),
        "the same cut for every chunking"
    );
    // Before the last record, nothing was pruned.
    let store = apply_in_chunks(&entries[..entries.len() - 1], &[]);
    assert_eq!(stored_rows(&store), 2);
}

/// The `z` rows (where each event of a minute is, for voids) go once no event of
/// their minute can be voided any more: the same rows for every chunking.
#[test]
fn minute_event_rows_no_void_can_need_are_pruned() {
    use tally_domain::limits::MAX_EVENT_AGE_MS;
    use tally_engine::event_index::{PRUNE_STEP_MS, STORED_EVENTS_RETENTION_MS};
    let ids: Vec<MeterId> = meters().iter().map(|m| m.id.clone()).collect();
    let event = |id: u8, minute: i64| GenEvent {
        id,
        customer: 0,
        minute,
        second: 0,
        value: Some(1),
    };
    let mut records: Vec<Record> = meters().into_iter().map(Record::MeterUpserted).collect();
    records.push(batch_received(&event(1, 0), T0, &ids));
    records.push(batch_received(&event(2, 1), T0, &ids));
    // A revision of the `count` meter over both minutes: its revision rows go
    // with the minutes' `z` rows.
    let mut revised = meters()[0].clone();
    revised.filter = positive_only();
    revised.revision = 2;
    let first = T0.div_euclid(60_000);
    records.push(Record::MeterRevised {
        meter: revised,
        minutes: vec![first, first + 1],
    });
    let later = STORED_EVENTS_RETENTION_MS + MAX_EVENT_AGE_MS + 2 * PRUNE_STEP_MS;
    records.push(batch_received(&event(3, later / 60_000), T0 + later, &ids));
    let entries = entries_of(&records);
    let before_last = apply_in_chunks(&entries[..entries.len() - 1], &[]);
    assert_eq!(rows_under(&before_last, b"z"), 2, "one row per minute");
    assert_eq!(rows_under(&before_last, &[keys::REVISED_MINUTE]), 2);
    let meters_end = meters().len();
    let mut digests = Vec::new();
    for cuts in [vec![], vec![meters_end + 1], vec![meters_end + 2]] {
        let store = apply_in_chunks(&entries, &cuts);
        assert_eq!(
            rows_under(&store, b"z"),
            1,
            "only the last minute's (cuts {cuts:?})"
        );
        assert_eq!(
            rows_under(&store, &[keys::REVISED_MINUTE]),
            0,
            "cuts {cuts:?}"
        );
        digests.push(store.digest().unwrap());
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]));
}

/// `unique` keeps a customer's distinct values of a minute in one set, up to
/// `INLINE_DISTINCT_MAX`, and one key per value past it: the count stays exact on
/// both sides of the limit, for the customer and meter-wide, in any chunking, and
/// after voids of a value on each side.
#[test]
fn distinct_values_past_the_inline_set_stay_exact() {
    use tally_engine::codec::INLINE_DISTINCT_MAX;
    let ids: Vec<MeterId> = meters().iter().map(|m| m.id.clone()).collect();
    let distinct = INLINE_DISTINCT_MAX + 150;
    let mut records: Vec<Record> = meters().into_iter().map(Record::MeterUpserted).collect();
    let events: Vec<UsageEvent> = (0..distinct + 40)
        .map(|i| {
            let base = GenEvent {
                id: 0,
                customer: 0,
                minute: 0,
                second: 1,
                // Each value once, then 40 repeats of values already seen.
                value: Some((i % distinct) as i64),
            };
            UsageEvent {
                event_id: format!("ev{i}"),
                ..usage_event(&base, &ids)
            }
        })
        .collect();
    for batch in events.chunks(100) {
        records.push(Record::UsageBatch {
            store_id: STORE.into(),
            mode: Mode::Test,
            events: batch.to_vec(),
            settles: false,
            matched_below: None,
        });
    }
    // Two values no other event holds, one in the customer's inline set and one
    // past it (its own key): a void takes each out of the customer's bucket
    // without a rebuild, from where it is.
    let voided = [500, INLINE_DISTINCT_MAX + 100];
    records.push(Record::EventsVoided {
        store_id: STORE.into(),
        mode: Mode::Test,
        event_ids: voided.iter().map(|i| format!("ev{i}")).collect(),
        reason: "test".into(),
    });
    let distinct = distinct - voided.len();
    let entries = entries_of(&records);
    let whole = apply_in_chunks(&entries, &[]);
    let chunked = apply_in_chunks(&entries, &[8, 10, 15, 17]);
    assert_eq!(whole.digest().unwrap(), chunked.digest().unwrap());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (engine, _dir) = runtime.block_on(engine_over(chunked));
    let scope = tally_engine::Scope {
        store_id: STORE.into(),
        mode: Mode::Test,
    };
    for customer in [None, Some("cus_0".to_string())] {
        let result = engine
            .metering()
            .query_usage(
                &scope,
                &UsageQuery {
                    meter_id: "mtr_4".into(),
                    customer_id: customer.clone(),
                    start_ms: T0,
                    end_ms: T0 + 3_600_000,
                    window: Window::None,
                    group_by_customer: false,
                },
            )
            .unwrap();
        assert_eq!(
            result.total.value,
            Some(Decimal::from(distinct)),
            "customer {customer:?}"
        );
    }
}

/// A time-weighted meter's time-ordered points older than the retention cut are
/// pruned (all but the last one before the cut, which later events still follow),
/// the same whatever the chunking, and the integral stays.
#[test]
fn time_weighted_points_before_the_retention_are_pruned_and_the_integral_stays() {
    use tally_metering::apply::WEIGHTED_POINTS_RETENTION_MS;
    const DAY: i64 = 86_400_000;
    let ids: Vec<MeterId> = meters().iter().map(|m| m.id.clone()).collect();
    let weighted = meters()
        .into_iter()
        .find(|m| m.aggregation == Aggregation::TimeWeightedSum)
        .unwrap();
    let mut records: Vec<Record> = meters().into_iter().map(Record::MeterUpserted).collect();
    let batch = |id: u8, minute: i64, value: i64, received: i64| {
        let event = GenEvent {
            id,
            customer: 0,
            minute,
            second: 0,
            value: Some(value),
        };
        batch_received(&event, received, &ids)
    };
    for minute in 0..3 {
        records.push(batch(minute as u8, minute, 10 * (minute + 1), T0));
    }
    let later = 80 * DAY;
    assert!(later > WEIGHTED_POINTS_RETENTION_MS + 2 * 60_000);
    records.push(batch(10, later / 60_000, 40, T0 + later));
    let entries = entries_of(&records);
    let points = |store: &MemoryStore| rows_under(store, b":");
    let meters_end = meters().len();
    let mut digests = Vec::new();
    for cuts in [
        vec![],
        vec![meters_end + 3],
        vec![meters_end + 1, meters_end + 3],
    ] {
        let store = apply_in_chunks(&entries, &cuts);
        assert_eq!(
            points(&store),
            2,
            "the last point before the cut and the new one"
        );
        digests.push(store.digest().unwrap());
        let total = total_usage(store, &weighted.id, T0 + later + 60_000);
        // 1 for a minute, 2 for a minute, 3 until `later`, then 4 for a minute
        // (`usage_event` reads values in tenths).
        let area = Decimal::from(60_000)
            + Decimal::from(2 * 60_000)
            + Decimal::from(3 * (later - 2 * 60_000))
            + Decimal::from(4 * 60_000);
        assert_eq!(
            total,
            Some((area / Decimal::from(3_600_000)).normalize()),
            "cuts {cuts:?}"
        );
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]));
    let store = apply_in_chunks(&entries[..entries.len() - 1], &[]);
    assert_eq!(points(&store), 3, "nothing pruned before the late event");
}

/// Start-up sizes the event index from the hint in the aux space, and writes the
/// size it loaded back when the hint was a step off, so the next start reserves
/// the right room; a hint within a step stays as it is.
#[test]
fn loading_the_event_index_notes_its_size_for_the_next_start() {
    use tally_engine::event_index::encode_stored;
    use tally_engine::keys::{StoredEventsKey, EVENT_INDEX_SIZE_HINT};
    let store = MemoryStore::new();
    let changes = (0..30u64)
        .map(|offset| {
            let key = StoredEventsKey {
                store_id: "st_1".into(),
                mode: Mode::Test,
                received_at_ms: 0,
                partition: 0,
                offset,
            };
            let stored: Vec<(u32, u64)> = (0..100u32)
                .map(|i| (i, (offset << 40) | u64::from(i)))
                .collect();
            (key.encode(), Some(encode_stored(&stored)))
        })
        .collect();
    store.apply(changes, &[]).unwrap();
    let hint = |store: &MemoryStore| {
        store
            .aux_get(EVENT_INDEX_SIZE_HINT)
            .unwrap()
            .map(|bytes| u64::from_be_bytes(bytes.try_into().unwrap()))
    };
    let load = || ProjectorState::load(&store, Arc::new(EventIndex::default())).unwrap();
    store
        .aux_put(EVENT_INDEX_SIZE_HINT, Some(&5u64.to_be_bytes()))
        .unwrap();
    assert_eq!(load().index.len(), 3_000);
    assert_eq!(hint(&store), Some(3_000), "a hint far off is rewritten");
    store
        .aux_put(EVENT_INDEX_SIZE_HINT, Some(&2_900u64.to_be_bytes()))
        .unwrap();
    assert_eq!(load().index.len(), 3_000);
    assert_eq!(hint(&store), Some(2_900), "a hint within a step stays");
    store.aux_put(EVENT_INDEX_SIZE_HINT, Some(b"bad")).unwrap();
    assert_eq!(
        load().index.len(),
        3_000,
        "a malformed hint is only ignored"
    );
    assert_eq!(hint(&store), Some(3_000));
}

/// One step of a stream whose usage is settled in credits: a usage record, a void,
/// or a revision of the `count` and `sum` meters to filter `filter` (0: every
/// event, 1: `v > 0`, 2: `v < 1`), in two steps split at a minute; an incomplete
/// one leaves its second step to the end of the log, where a later revision
/// refuses it (or, if none came, it completes).
#[derive(Debug, Clone)]
enum ChargeStep {
    Batch(Vec<GenEvent>),
    Void(Vec<u8>),
    Revise {
        filter: u8,
        split: i64,
        complete: bool,
    },
}

fn gen_charge_step() -> impl Strategy<Value = ChargeStep> {
    prop_oneof![
        4 => proptest::collection::vec(gen_event(), 1..8).prop_map(ChargeStep::Batch),
        2 => proptest::collection::vec(0u8..30, 1..4).prop_map(ChargeStep::Void),
        2 => (0u8..3, 0i64..6, any::<bool>())
            .prop_map(|(filter, split, complete)| ChargeStep::Revise { filter, split, complete }),
    ]
}

fn charge_filter(filter: u8) -> MeterFilter {
    let clause = |operator, value| tally_domain::meter::FilterClause {
        property: "v".into(),
        operator,
        value: tally_domain::meter::FilterValue::Number(value),
    };
    match filter {
        1 => positive_only(),
        2 => MeterFilter {
            conjunction: tally_domain::meter::Conjunction::And,
            clauses: vec![clause(tally_domain::meter::Operator::Lt, Decimal::ONE)],
        },
        _ => MeterFilter::default(),
    }
}

/// What settlement is owed for `e` by the `count` or `sum` meter under `filter`.
fn charge_due(e: &GenEvent, aggregation: Aggregation, filter: u8) -> Decimal {
    let value = e.value.map(|v| Decimal::new(v, 1));
    let matched = match filter {
        1 => value.is_some_and(|v| v > Decimal::ZERO),
        2 => value.is_some_and(|v| v < Decimal::ONE),
        _ => true,
    };
    match (matched, aggregation) {
        (true, Aggregation::Count) => Decimal::ONE,
        (true, Aggregation::Sum) => value.filter(|v| *v > Decimal::ZERO).unwrap_or_default(),
        _ => Decimal::ZERO,
    }
}

/// The log of a settled stream, the events that stay stored, and the filter the
/// meters end with.
fn log_with_charges(steps: &[ChargeStep]) -> (Vec<LogEntry>, Vec<GenEvent>, u8) {
    let charged: Vec<Meter> = meters().into_iter().take(2).collect();
    let ids: Vec<MeterId> = charged.iter().map(|m| m.id.clone()).collect();
    let mut records: Vec<Record> = charged.iter().cloned().map(Record::MeterUpserted).collect();
    let (mut stored, mut voided, mut stale) = (Vec::<GenEvent>::new(), HashSet::new(), Vec::new());
    let (mut revision, mut last_filter) = (1u32, 0u8);
    let first = T0.div_euclid(60_000);
    let minutes: Vec<i64> = (first..first + 5).collect();
    for step in steps {
        match step {
            ChargeStep::Batch(events) => {
                push_batch(&mut records, &mut stored, events, &ids);
                if let Some(Record::UsageBatch { settles, .. }) = records.last_mut() {
                    *settles = true;
                }
            }
            ChargeStep::Void(event_ids) => push_void(&mut records, &stored, &mut voided, event_ids),
            ChargeStep::Revise {
                filter,
                split,
                complete,
            } => {
                revision += 1;
                last_filter = *filter;
                let (early, late) = minutes.split_at((*split).min(5) as usize);
                for meter in &charged {
                    let mut meter = meter.clone();
                    meter.filter = charge_filter(*filter);
                    meter.revision = revision;
                    let step = |part: &[i64]| Record::MeterRevised {
                        meter: meter.clone(),
                        minutes: part.to_vec(),
                    };
                    records.push(step(early));
                    match complete {
                        true => records.push(step(late)),
                        false => stale.push(step(late)),
                    }
                }
            }
        }
    }
    records.extend(stale);
    stored.retain(|e| !voided.contains(&e.id));
    (entries_of(&records), stored, last_filter)
}

/// `entries` applied in chunks ending at `cuts` (every other chunk after a
/// restart) over a store whose scope settles usage in credits.
fn apply_settled_in_chunks(entries: &[LogEntry], cuts: &[usize]) -> Arc<MemoryStore> {
    let store = Arc::new(MemoryStore::new());
    let settles = tally_core::keys::Key::scoped(keys::USAGE_BINDING_SCOPE, STORE, Mode::Test);
    store
        .apply(vec![(settles.into_bytes(), Some(Vec::new()))], &[])
        .unwrap();
    apply_in_chunks_over(store, entries, cuts, tally_engine::event_index::fingerprint)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    /// Usage settled in credits follows every correction exactly: whatever the
    /// interleaving of usage, voids and revisions (steps of a revision a later one
    /// supersedes included), and however the log is chunked, the units left for
    /// settlement add up, per meter, to what the meter's final definition charges
    /// for the events that stay.
    #[test]
    fn settled_units_follow_voids_and_revisions(
        steps in proptest::collection::vec(gen_charge_step(), 1..14),
        cuts in proptest::collection::vec(0usize..40, 0..6),
    ) {
        let (entries, stored, filter) = log_with_charges(&steps);
        let store = apply_settled_in_chunks(&entries, &cuts);
        // Chunked as a replay of the whole log is.
        let whole = apply_settled_in_chunks(&entries, &[]);
        prop_assert_eq!(store.digest().unwrap(), whole.digest().unwrap());
        let mut left: BTreeMap<String, Decimal> = BTreeMap::new();
        for (key, value) in contents(store.as_ref()) {
            if key.first() == Some(&keys::SETTLEMENT_PENDING) {
                for units in tally_core::codec::decode_settlement(&value).unwrap().units {
                    *left.entry(units.meter_id.to_string()).or_default() += units.quantity;
                }
            }
        }
        for meter in meters().into_iter().take(2) {
            let due: Decimal = stored
                .iter()
                .map(|e| charge_due(e, meter.aggregation, filter))
                .sum();
            let got = left.get(meter.id.as_str()).copied().unwrap_or_default();
            prop_assert_eq!(got.normalize(), due.normalize(), "{:?}", meter.aggregation);
        }
    }
}
