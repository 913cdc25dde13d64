//! The log record format is versioned: a log written in another format is refused at
//! start-up with a message naming what to do; a single foreign record met later is a
//! recorded rejection (no record stops the projector).

use std::sync::Arc;

use tally_domain::clock::{Clock, ManualClock};
use tally_engine::{Engine, EngineError};
use tally_log::embedded::EmbeddedLog;
use tally_log::{Log, LogEntry};
use tally_projection::MemoryStore;
use tally_proto::{v1, Message};

/// A StoreCreated record as the first, unversioned releases wrote it.
fn record_of_version(format_version: u32) -> Vec<u8> {
    v1::LogRecord {
        recorded_at_ms: 1,
        format_version,
        base_updated_at_ms: None,
        request: None,
        kind: Some(v1::log_record::Kind::StoreCreated(v1::StoreCreated {
            store_id: "st_old".into(),
            name: "old".into(),
            prod_key_sha256: vec![1; 32],
            test_key_sha256: vec![2; 32],
            created_at_ms: 1,
        })),
    }
    .encode_to_vec()
}

async fn open_over(payload: Vec<u8>) -> Result<Arc<Engine>, EngineError> {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    log.append(b"k", payload).await.unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1));
    Engine::open(log, Arc::new(MemoryStore::new()), clock).await
}

#[tokio::test]
async fn a_log_of_another_format_is_refused_at_start_up() {
    for version in [0, tally_proto::LOG_FORMAT_VERSION + 1] {
        let error = open_over(record_of_version(version)).await.err().unwrap();
        let message = error.to_string();
        assert!(
            message.contains("another Tally version") && message.contains("new data dir"),
            "{message}"
        );
    }
    open_over(record_of_version(tally_proto::LOG_FORMAT_VERSION))
        .await
        .expect("the current format opens");
}

#[test]
fn a_foreign_record_inside_the_log_is_a_recorded_rejection() {
    let store = MemoryStore::new();
    let entry = |offset: u64, payload: Vec<u8>| LogEntry {
        partition: 0,
        offset,
        next_offset: offset + 1,
        payload,
    };
    let entries = [entry(0, record_of_version(0))];
    tally_engine::projector::apply_chunk_in_memory(
        &store,
        &mut tally_engine::projector::ProjectorState::empty(),
        &entries,
        &entries,
    )
    .unwrap();
    use tally_projection::ProjectionStore;
    let outcome = store
        .get(&tally_engine::outcome::outcome_key(0, 0))
        .unwrap()
        .map(|bytes| tally_engine::outcome::Outcome::decode(&bytes).unwrap())
        .expect("an outcome is recorded");
    assert!(
        format!("{outcome:?}").contains("record_format_unsupported"),
        "{outcome:?}"
    );
    assert_eq!(store.position(0).unwrap(), 1, "the projector moved on");
    let mut stores = 0;
    tally_projection::scan_prefix(&store, b"S", false, &mut |_, _| {
        stores += 1;
        tally_projection::Visit::Continue
    })
    .unwrap();
    assert_eq!(stores, 0, "nothing of the foreign record was applied");
}

/// A stored mode byte that is neither mode is corrupt storage: opening stops with a
/// message instead of filing the entry under a default mode.
#[tokio::test]
async fn an_unknown_stored_mode_byte_stops_start_up() {
    use tally_projection::ProjectionStore;
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    let store = Arc::new(MemoryStore::new());
    let mut key = vec![tally_engine::keys::API_KEY];
    key.extend_from_slice(&[7; 32]);
    let mut value = b"st_1".to_vec();
    value.push(b'x');
    store.apply(vec![(key, Some(value))], &[]).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1));
    let error = Engine::open(log, store, clock).await.err().unwrap();
    assert!(
        error.to_string().contains("unknown mode byte 0x78"),
        "{error}"
    );
}

/// A projection of the previous layout (applied records, no format stamp) or of
/// another version is refused at start-up, naming the fix; one this build wrote
/// opens again.
#[tokio::test]
async fn a_projection_of_another_format_is_refused_at_start_up() {
    use tally_projection::ProjectionStore;
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    let end = log
        .append(b"k", record_of_version(tally_proto::LOG_FORMAT_VERSION))
        .await
        .unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1));
    let open = |store: Arc<MemoryStore>| Engine::open(log.clone(), store, clock.clone());

    let old = Arc::new(MemoryStore::new());
    old.apply(Vec::new(), &[(0, 1)]).unwrap();
    let message = open(old).await.err().unwrap().to_string();
    assert!(
        message.contains("format version 1") && message.contains("delete the projection"),
        "{message}"
    );

    let future = Arc::new(MemoryStore::new());
    future
        .apply(
            vec![(b"V".to_vec(), Some(99u32.to_be_bytes().to_vec()))],
            &[(0, 1)],
        )
        .unwrap();
    let message = open(future).await.err().unwrap().to_string();
    assert!(message.contains("format version 99"), "{message}");

    // A projection this build applied records to carries the stamp and reopens.
    let current = Arc::new(MemoryStore::new());
    let engine = open(current.clone())
        .await
        .expect("an empty projection opens");
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let projector = engine.start_projector(shutdown);
    engine.wait_caught_up().await.unwrap();
    for task in projector {
        task.abort();
    }
    drop(engine);
    assert!(current.position(0).unwrap() > end, "the record was applied");
    open(current).await.expect("the stamped projection reopens");
}
