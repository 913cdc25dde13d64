//! The shared projection-store suite against every implementation, plus sled's
//! persistence across reopen.

use tally_projection::{testsuite, MemoryStore, ProjectionStore, SledStore};

#[test]
fn memory_store_passes_the_suite() {
    testsuite::run_all(&MemoryStore::new());
}

#[test]
fn sled_store_passes_the_suite() {
    let dir = tempfile::tempdir().unwrap();
    testsuite::run_all(&SledStore::open(dir.path()).unwrap());
}

#[test]
fn sled_store_keeps_batches_and_positions_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let digest = {
        let store = SledStore::open(dir.path()).unwrap();
        store
            .apply(vec![(b"k".to_vec(), Some(b"v".to_vec()))], &[(2, 7)])
            .unwrap();
        store.flush().unwrap();
        store.digest().unwrap()
    };
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(store.position(2).unwrap(), 7);
    assert_eq!(store.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(store.digest().unwrap(), digest);
}

#[test]
fn checkpoint_store_passes_the_suite() {
    use std::time::Duration;
    use tally_projection::CheckpointStore;
    testsuite::run_all(&CheckpointStore::new(MemoryStore::new()));
    // Checkpoints after every apply, and never: both must read the same.
    testsuite::run_all(&CheckpointStore::with_limits(
        MemoryStore::new(),
        1,
        Duration::ZERO,
    ));
    let dir = tempfile::tempdir().unwrap();
    testsuite::run_all(&CheckpointStore::with_limits(
        SledStore::open(dir.path()).unwrap(),
        usize::MAX,
        Duration::from_secs(3600),
    ));
}

/// A restart without a checkpoint finds the last checkpoint's state and positions,
/// never a mix: the changes after it are simply re-applied from the log.
#[test]
fn checkpoint_store_restarts_from_its_last_checkpoint() {
    use std::time::Duration;
    use tally_projection::CheckpointStore;
    let dir = tempfile::tempdir().unwrap();
    let checkpointed = {
        let store = CheckpointStore::with_limits(
            SledStore::open(dir.path()).unwrap(),
            usize::MAX,
            Duration::from_secs(3600),
        );
        store
            .apply(vec![(b"k".to_vec(), Some(b"1".to_vec()))], &[(0, 10)])
            .unwrap();
        store.flush().unwrap();
        let digest = store.digest().unwrap();
        store
            .apply(
                vec![
                    (b"k".to_vec(), Some(b"2".to_vec())),
                    (b"j".to_vec(), Some(b"3".to_vec())),
                ],
                &[(0, 20)],
            )
            .unwrap();
        assert_eq!(store.position(0).unwrap(), 20);
        assert_eq!(store.get(b"k").unwrap().as_deref(), Some(&b"2"[..]));
        store.inner().flush().unwrap(); // the inner store is durable, the layer is not
        digest
    };
    let store = CheckpointStore::new(SledStore::open(dir.path()).unwrap());
    assert_eq!(store.position(0).unwrap(), 10);
    assert_eq!(store.get(b"k").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(store.get(b"j").unwrap(), None);
    assert_eq!(store.digest().unwrap(), checkpointed);
}

/// Every table byte: a read cache over all of them sees every read of the suite.
fn every_table() -> Vec<u8> {
    (0..=u8::MAX).collect()
}

#[test]
fn checkpoint_store_with_a_read_cache_passes_the_suite() {
    use std::time::Duration;
    use tally_projection::CheckpointStore;
    testsuite::run_all(&CheckpointStore::new(MemoryStore::new()).with_read_cache(&every_table()));
    // A checkpoint after every apply: every read can race a write.
    testsuite::run_all(
        &CheckpointStore::with_limits(MemoryStore::new(), 1, Duration::ZERO)
            .with_read_cache(&every_table()),
    );
    let dir = tempfile::tempdir().unwrap();
    testsuite::run_all(
        &CheckpointStore::with_limits(SledStore::open(dir.path()).unwrap(), 1, Duration::ZERO)
            .with_read_cache(&every_table()),
    );
}

/// A memory store whose reads take a while: a read then often spans a
/// checkpoint's write, the race the read cache must not lose.
#[derive(Debug)]
struct SlowReads(MemoryStore);

impl ProjectionStore for SlowReads {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, tally_projection::StoreError> {
        let value = self.0.get(key);
        std::thread::sleep(std::time::Duration::from_micros(200));
        value
    }
    fn scan(
        &self,
        start: std::ops::Bound<&[u8]>,
        end: std::ops::Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> tally_projection::Visit,
    ) -> Result<(), tally_projection::StoreError> {
        self.0.scan(start, end, reverse, visit)
    }
    fn apply(
        &self,
        changes: Vec<tally_projection::Change>,
        positions: &[(u32, u64)],
    ) -> Result<(), tally_projection::StoreError> {
        self.0.apply(changes, positions)
    }
    fn position(&self, partition: u32) -> Result<u64, tally_projection::StoreError> {
        self.0.position(partition)
    }
    fn flush(&self) -> Result<(), tally_projection::StoreError> {
        self.0.flush()
    }
    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, tally_projection::StoreError> {
        self.0.aux_get(key)
    }
    fn aux_put(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), tally_projection::StoreError> {
        self.0.aux_put(key, value)
    }
    fn aux_scan(
        &self,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> tally_projection::Visit,
    ) -> Result<(), tally_projection::StoreError> {
        self.0.aux_scan(visit)
    }
}

/// Readers fill the cache while checkpoints write new values of the same keys:
/// once a checkpoint has ended, a read answers the value it wrote, never one a
/// racing reader read before the write and kept (`read_cache`, "Never stale").
#[test]
fn a_read_cache_never_answers_a_value_a_checkpoint_replaced() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    use tally_projection::CheckpointStore;
    let store = Arc::new(
        CheckpointStore::with_limits(
            SlowReads(MemoryStore::new()),
            usize::MAX,
            Duration::from_secs(3600),
        )
        .with_read_cache(b"a"),
    );
    let keys: Vec<Vec<u8>> = (0..4).map(|k| format!("a{k}").into_bytes()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (store, keys, stop) = (store.clone(), keys.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for key in &keys {
                        store.get(key).unwrap();
                    }
                }
            })
        })
        .collect();
    for round in 0..300u32 {
        let value = round.to_be_bytes().to_vec();
        let changes = keys
            .iter()
            .map(|key| (key.clone(), Some(value.clone())))
            .collect();
        store.apply(changes, &[(0, u64::from(round) + 1)]).unwrap();
        store.checkpoint().unwrap();
        for key in &keys {
            assert_eq!(
                store.get(key).unwrap().as_deref(),
                Some(value.as_slice()),
                "round {round}: a stale row"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.join().unwrap();
    }
    assert!(store.cached_rows() > 0, "the readers filled the cache");
}
