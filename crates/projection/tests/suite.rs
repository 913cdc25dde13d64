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
