//! The runtime over a real embedded log and a memory projection store, driving a
//! small test projection (records are `add <n>`, `copy <offset>`: add the number of
//! an earlier record, read back through prefetch; `wait`: not ready the first
//! times; `fail`: a storage failure).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tally_log::embedded::EmbeddedLog;
use tally_log::{Log, LogEntry};
use tally_projection::{MemoryStore, ProjectionStore};
use tally_runtime::{ApplyFailure, ChunkMode, Committed, Projection, Runtime, WaitError};

struct Summing {
    store: Arc<MemoryStore>,
    /// Chunks applied at once (must never exceed 1).
    in_apply: AtomicUsize,
    waits_left: AtomicUsize,
    fetches: AtomicUsize,
    /// Records of the chunks handed to `read_ahead`.
    read_ahead: AtomicUsize,
    committed: Mutex<Vec<Committed>>,
}

fn parse(payload: &[u8]) -> (String, u64) {
    let text = String::from_utf8_lossy(payload).to_string();
    let mut parts = text.split(' ');
    let verb = parts.next().unwrap_or_default().to_string();
    let number = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    (verb, number)
}

impl Projection for Summing {
    type Chunk = Vec<LogEntry>;
    type Fetched = HashMap<(u32, u64), Option<LogEntry>>;
    type Applied = ();

    fn decode(&self, entries: Vec<LogEntry>, _: tally_runtime::ChunkMode) -> Vec<LogEntry> {
        entries
    }

    fn plan(&self, chunk: &Vec<LogEntry>) -> Result<Vec<(u32, u64)>, String> {
        // Plans only the first copy: apply must ask for the rest.
        Ok(chunk
            .iter()
            .map(|e| parse(&e.payload))
            .find(|(verb, _)| verb == "copy")
            .map(|(_, offset)| vec![(0, offset)])
            .unwrap_or_default())
    }

    fn read_ahead(&self, chunk: &Arc<Vec<LogEntry>>) {
        self.read_ahead.fetch_add(chunk.len(), Ordering::SeqCst);
    }

    fn add_fetched(
        &self,
        fetched: &mut Self::Fetched,
        partition: u32,
        offset: u64,
        entry: Option<LogEntry>,
    ) -> Result<(), String> {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        fetched.insert((partition, offset), entry);
        Ok(())
    }

    fn apply(&self, chunk: &Vec<LogEntry>, fetched: &Self::Fetched) -> Result<(), ApplyFailure> {
        assert_eq!(
            self.in_apply.fetch_add(1, Ordering::SeqCst),
            0,
            "one chunk at a time"
        );
        let result = (|| {
            let mut sum = self
                .store
                .get(b"sum")
                .unwrap()
                .map(|b| u64::from_be_bytes(b.try_into().unwrap()))
                .unwrap_or(0);
            let mut missing = Vec::new();
            for entry in chunk {
                match parse(&entry.payload) {
                    (verb, n) if verb == "add" => sum += n,
                    (verb, offset) if verb == "copy" => match fetched.get(&(0, offset)) {
                        Some(Some(original)) => sum += parse(&original.payload).1,
                        Some(None) => return Err(ApplyFailure::Fatal("copy of nothing".into())),
                        None => missing.push((0, offset)),
                    },
                    (verb, _) if verb == "wait" => {
                        if self
                            .waits_left
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| w.checked_sub(1))
                            .is_ok()
                        {
                            return Err(ApplyFailure::NotYet);
                        }
                    }
                    _ => return Err(ApplyFailure::Fatal("the store failed".into())),
                }
            }
            if !missing.is_empty() {
                return Err(ApplyFailure::NeedRecords(missing));
            }
            let end = chunk.last().unwrap().next_offset;
            self.store
                .apply(
                    vec![(b"sum".to_vec(), Some(sum.to_be_bytes().to_vec()))],
                    &[(0, end)],
                )
                .map_err(|e| ApplyFailure::Fatal(e.to_string()))
        })();
        self.in_apply.fetch_sub(1, Ordering::SeqCst);
        result
    }

    fn after_commit(&self, _: (), committed: Committed) {
        self.committed.lock().unwrap().push(committed);
    }
}

fn summing(store: Arc<MemoryStore>, waits: usize) -> Arc<Summing> {
    Arc::new(Summing {
        store,
        in_apply: AtomicUsize::new(0),
        waits_left: AtomicUsize::new(waits),
        fetches: AtomicUsize::new(0),
        read_ahead: AtomicUsize::new(0),
        committed: Mutex::new(Vec::new()),
    })
}

fn sum(store: &MemoryStore) -> u64 {
    store
        .get(b"sum")
        .unwrap()
        .map(|b| u64::from_be_bytes(b.try_into().unwrap()))
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tails_prefetches_retries_and_moves_the_watermark_after_commit() {
    let dir = tempfile::tempdir().unwrap();
    let log: Arc<dyn Log> = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    let first = log.append(b"k", b"add 5".to_vec()).await.unwrap();
    let second = log.append(b"k", b"add 7".to_vec()).await.unwrap();
    // One chunk: a record that is not ready the first three times, then two copies of
    // which the plan names only the first: apply asks for the second.
    log.append(b"k", b"wait".to_vec()).await.unwrap();
    log.append(b"k", format!("copy {first}").into_bytes())
        .await
        .unwrap();
    let last = log
        .append(b"k", format!("copy {second}").into_bytes())
        .await
        .unwrap();
    let store = Arc::new(MemoryStore::new());
    let runtime = Arc::new(Runtime::new(log.clone(), store.clone()).await.unwrap());
    assert!(!runtime.is_caught_up(), "five records to apply at start-up");
    let projection = summing(store.clone(), 3);
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let tasks = runtime.start(projection.clone(), shutdown);
    runtime
        .wait_applied(0, last, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(runtime.is_caught_up());
    assert_eq!(sum(&store), 24, "both copies applied once, after the waits");
    assert_eq!(projection.waits_left.load(Ordering::SeqCst), 0);
    assert_eq!(
        projection.fetches.load(Ordering::SeqCst),
        2,
        "the planned record, then the one apply asked for"
    );
    assert_eq!(runtime.applied(0), store.position(0).unwrap());
    let committed = projection.committed.lock().unwrap().clone();
    assert_eq!(committed.len(), 1, "{committed:?}");
    assert_eq!(committed[0].records, 5);
    assert_eq!(committed[0].next_offset, runtime.applied(0));
    assert_eq!(
        projection.read_ahead.load(Ordering::SeqCst),
        5,
        "the start-up chunk is read ahead once, however often it is retried"
    );
    // A failure stops the runtime; waiters learn it instead of timing out.
    let fail = log.append(b"k", b"fail".to_vec()).await.unwrap();
    let waited = runtime.wait_applied(0, fail, Duration::from_secs(10)).await;
    assert_eq!(waited, Err(WaitError::Failed));
    assert_eq!(
        projection.read_ahead.load(Ordering::SeqCst),
        5,
        "caught up: a live chunk is not read ahead"
    );
    assert!(runtime.has_failed());
    assert_eq!(sum(&store), 24, "nothing of the failed chunk was committed");
    stop.send_replace(true);
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reaches_the_state_of_the_live_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let log: Arc<dyn Log> = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    let mut offsets = Vec::new();
    for i in 0..100u64 {
        let payload = match offsets.get(i as usize / 2) {
            Some(earlier) if i % 3 == 0 => format!("copy {earlier}"),
            _ => format!("add {i}"),
        };
        offsets.push(log.append(b"k", payload.into_bytes()).await.unwrap());
    }
    let live = Arc::new(MemoryStore::new());
    let runtime = Arc::new(Runtime::new(log.clone(), live.clone()).await.unwrap());
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let _tasks = runtime.start(summing(live.clone(), 0), shutdown);
    let end = log.end_offset(0).await.unwrap();
    runtime
        .wait_reached(0, end, Duration::from_secs(10))
        .await
        .unwrap();
    let replayed = Arc::new(MemoryStore::new());
    let mut last = 0;
    let records = tally_runtime::replay_partition(
        log.as_ref(),
        replayed.as_ref(),
        summing(replayed.clone(), 0).as_ref(),
        0,
        |reached, to| {
            assert!(reached > last && reached <= to, "progress moves forward");
            last = reached;
        },
    )
    .await
    .unwrap();
    assert_eq!(records, 100);
    assert_eq!(last, end);
    assert_eq!(sum(&replayed), sum(&live));
    assert_eq!(replayed.digest().unwrap(), live.digest().unwrap());
}

/// A projection with two kinds of records, as a split cluster sees them: `add <n>`
/// (the owner's) and `key` (applied by every node). It honours `ChunkMode` as
/// `Projection` asks and keeps its skip mark under `skip`.
struct Sharing {
    store: Arc<MemoryStore>,
    committed: Mutex<Vec<Committed>>,
}

fn read_u64(store: &MemoryStore, key: &[u8]) -> Option<u64> {
    store
        .get(key)
        .unwrap()
        .map(|b| u64::from_be_bytes(b.try_into().unwrap()))
}

impl Projection for Sharing {
    type Chunk = (Vec<LogEntry>, ChunkMode);
    type Fetched = ();
    type Applied = ();

    fn decode(&self, entries: Vec<LogEntry>, mode: ChunkMode) -> Self::Chunk {
        (entries, mode)
    }

    fn plan(&self, _: &Self::Chunk) -> Result<Vec<(u32, u64)>, String> {
        Ok(Vec::new())
    }

    fn add_fetched(&self, _: &mut (), _: u32, _: u64, _: Option<LogEntry>) -> Result<(), String> {
        Ok(())
    }

    fn apply(&self, (entries, mode): &Self::Chunk, _: &()) -> Result<(), ApplyFailure> {
        let mut sum = read_u64(&self.store, b"sum").unwrap_or(0);
        let mut keys = read_u64(&self.store, b"keys").unwrap_or(0);
        let mut skip = read_u64(&self.store, b"skip");
        for entry in entries {
            let (verb, n) = parse(&entry.payload);
            let shared = verb == "key";
            let applies = match mode {
                ChunkMode::Full => true,
                ChunkMode::Shared => shared,
                ChunkMode::Restore { .. } => !shared,
            };
            if !applies {
                skip = skip.or(Some(entry.offset));
            } else if shared {
                keys += 1;
            } else {
                sum += n;
            }
        }
        if let ChunkMode::Restore { until, .. } = mode {
            let end = entries.last().map_or(*until, |e| e.next_offset);
            skip = (end < *until).then_some(end);
        }
        let positions: Vec<(u32, u64)> = match (mode, entries.last()) {
            (ChunkMode::Restore { .. }, _) | (_, None) => Vec::new(),
            (_, Some(last)) => vec![(0, last.next_offset)],
        };
        let changes = vec![
            (b"sum".to_vec(), Some(sum.to_be_bytes().to_vec())),
            (b"keys".to_vec(), Some(keys.to_be_bytes().to_vec())),
            (b"skip".to_vec(), skip.map(|s| s.to_be_bytes().to_vec())),
        ];
        self.store
            .apply(changes, &positions)
            .map_err(|e| ApplyFailure::Fatal(e.to_string()))
    }

    fn after_commit(&self, _: (), committed: Committed) {
        self.committed.lock().unwrap().push(committed);
    }

    fn skipped_from(&self, _: u32) -> Result<Option<u64>, String> {
        Ok(read_u64(&self.store, b"skip"))
    }
}

/// A node that does not project a partition applies only what every node needs and
/// marks where it began skipping; once it projects the partition, the runtime first
/// restores the skipped records (in order, the watermark standing still), then
/// applies new ones in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_gained_is_restored_before_anything_new_is_applied() {
    let dir = tempfile::tempdir().unwrap();
    let log: Arc<dyn Log> = Arc::new(EmbeddedLog::open(dir.path()).unwrap());
    let store = Arc::new(MemoryStore::new());
    let runtime = Arc::new(Runtime::new(log.clone(), store.clone()).await.unwrap());
    let ownership = runtime.ownership().clone();
    ownership.set_projecting(Some(Default::default()));
    let projection = Arc::new(Sharing {
        store: store.clone(),
        committed: Mutex::new(Vec::new()),
    });
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let _tasks = runtime.start(projection.clone(), shutdown);

    let key = log.append(b"k", b"key".to_vec()).await.unwrap();
    let first_add = log.append(b"k", b"add 1".to_vec()).await.unwrap();
    let mut last = first_add;
    for payload in ["key", "add 2", "key", "add 3"] {
        last = log.append(b"k", payload.as_bytes().to_vec()).await.unwrap();
    }
    runtime
        .wait_applied(0, last, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        read_u64(&store, b"sum"),
        Some(0),
        "another node's records are skipped"
    );
    assert_eq!(
        read_u64(&store, b"keys"),
        Some(3),
        "what every node needs is applied"
    );
    assert_eq!(
        ownership.skipped_from(0),
        Some(first_add),
        "the mark is the first skipped record"
    );
    assert!(!ownership.serves(0));
    assert!(!ownership.applied_in_full(0, first_add));
    assert!(ownership.applied_in_full(0, key));
    let watermark = runtime.applied(0);

    // Gained: restored, then served.
    ownership.set_projecting(None);
    for _ in 0..200 {
        if ownership.serves(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ownership.serves(0), "the partition was never restored");
    assert_eq!(
        read_u64(&store, b"sum"),
        Some(6),
        "the skipped records, once each"
    );
    assert_eq!(
        read_u64(&store, b"keys"),
        Some(3),
        "shared records are not applied twice"
    );
    assert_eq!(read_u64(&store, b"skip"), None);
    assert_eq!(
        runtime.applied(0),
        watermark,
        "a restore does not move the watermark"
    );
    let restored: Vec<Committed> = projection
        .committed
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.restored)
        .cloned()
        .collect();
    assert!(!restored.is_empty());
    assert!(restored.iter().all(|c| c.next_offset <= watermark));

    // And new records apply in full.
    let next = log.append(b"k", b"add 10".to_vec()).await.unwrap();
    runtime
        .wait_applied(0, next, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(read_u64(&store, b"sum"), Some(16));
    assert!(ownership.applied_in_full(0, next));
}
