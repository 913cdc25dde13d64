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
