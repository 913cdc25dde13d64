//! The suite every [`ProjectionStore`] passes (run from `tests/`).

use std::ops::Bound;

use crate::{scan_prefix, ProjectionStore, Visit};

fn collect(store: &dyn ProjectionStore, prefix: &[u8], reverse: bool) -> Vec<Vec<u8>> {
    let mut keys = Vec::new();
    scan_prefix(store, prefix, reverse, &mut |k, _| {
        keys.push(k.to_vec());
        Visit::Continue
    })
    .unwrap();
    keys
}

/// Puts, deletes, ordered and reversed prefix scans, early stop, positions, digest.
pub fn basic_semantics(store: &dyn ProjectionStore) {
    assert_eq!(store.position(0).unwrap(), 0);
    let empty_digest = store.digest().unwrap();
    store
        .apply(
            vec![
                (b"a/1".to_vec(), Some(b"one".to_vec())),
                (b"a/2".to_vec(), Some(b"two".to_vec())),
                (b"a/3".to_vec(), Some(b"three".to_vec())),
                (b"b/1".to_vec(), Some(b"other".to_vec())),
            ],
            &[(0, 42)],
        )
        .unwrap();
    assert_eq!(store.position(0).unwrap(), 42);
    assert_eq!(store.position(1).unwrap(), 0, "positions are per partition");
    assert_eq!(store.get(b"a/2").unwrap().as_deref(), Some(&b"two"[..]));
    // What a layer answers from memory is what a read sees.
    for key in [&b"a/2"[..], b"b/1", b"absent"] {
        if let Some(held) = store.unwritten(key) {
            assert_eq!(held, store.get(key).unwrap());
        }
    }
    assert_eq!(
        collect(store, b"a/", false),
        vec![b"a/1".to_vec(), b"a/2".to_vec(), b"a/3".to_vec()]
    );
    assert_eq!(
        collect(store, b"a/", true),
        vec![b"a/3".to_vec(), b"a/2".to_vec(), b"a/1".to_vec()]
    );
    let mut first = Vec::new();
    store
        .scan(
            Bound::Excluded(&b"a/1"[..]),
            Bound::Unbounded,
            false,
            &mut |k, _| {
                first.push(k.to_vec());
                Visit::Stop
            },
        )
        .unwrap();
    assert_eq!(
        first,
        vec![b"a/2".to_vec()],
        "scan stops when told; exclusive start"
    );
    let full_digest = store.digest().unwrap();
    assert_ne!(full_digest, empty_digest);
    store
        .apply(vec![(b"a/2".to_vec(), None)], &[(0, 50)])
        .unwrap();
    assert_eq!(store.get(b"a/2").unwrap(), None);
    assert_eq!(collect(store, b"a/", false).len(), 2);
    assert_ne!(store.digest().unwrap(), full_digest);
    // Positions never show up in scans or digests.
    let mut all = 0;
    store
        .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |_, _| {
            all += 1;
            Visit::Continue
        })
        .unwrap();
    assert_eq!(all, 3);
}

/// Aux data is separate from projections and left out of the digest.
pub fn aux_is_separate(store: &dyn ProjectionStore) {
    let before = store.digest().unwrap();
    store.aux_put(b"idem/1", Some(b"response")).unwrap();
    assert_eq!(
        store.aux_get(b"idem/1").unwrap().as_deref(),
        Some(&b"response"[..])
    );
    assert_eq!(store.get(b"idem/1").unwrap(), None);
    assert_eq!(store.digest().unwrap(), before);
    let mut seen = 0;
    store
        .aux_scan(&mut |_, _| {
            seen += 1;
            Visit::Continue
        })
        .unwrap();
    assert_eq!(seen, 1);
    store.aux_put(b"idem/1", None).unwrap();
    assert_eq!(store.aux_get(b"idem/1").unwrap(), None);
}

/// A batch far larger than any one write of the backend (sled stages it): every
/// put and delete lands, with its positions, and nothing else shows in scans.
pub fn large_batches(store: &dyn ProjectionStore) {
    const KEYS: usize = 7_000;
    let key = |i: usize| format!("big/{i:06}").into_bytes();
    let puts = (0..KEYS).map(|i| (key(i), Some(i.to_string().into_bytes())));
    store.apply(puts.collect(), &[(3, 1_000)]).unwrap();
    assert_eq!(store.position(3).unwrap(), 1_000);
    assert_eq!(collect(store, b"big/", false).len(), KEYS);
    let deletes = (0..KEYS).step_by(2).map(|i| (key(i), None));
    let rewrites = (1..KEYS).step_by(2).map(|i| (key(i), Some(b"x".to_vec())));
    store
        .apply(deletes.chain(rewrites).collect(), &[(3, 2_000)])
        .unwrap();
    assert_eq!(store.position(3).unwrap(), 2_000);
    assert_eq!(store.get(&key(2)).unwrap(), None);
    assert_eq!(store.get(&key(3)).unwrap().as_deref(), Some(&b"x"[..]));
    let mut all = 0;
    store
        .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |k, _| {
            all += usize::from(k.starts_with(b"big/"));
            Visit::Continue
        })
        .unwrap();
    assert_eq!(all, KEYS / 2);
    let everything = (0..KEYS).map(|i| (key(i), None)).collect();
    store.apply(everything, &[(3, 3_000)]).unwrap();
    assert!(collect(store, b"big/", false).is_empty());
}

/// `apply_shared` writes what `apply` writes: puts, deletes, a key's later change
/// winning over its earlier one in the same batch, and the positions.
pub fn shared_changes(store: &dyn ProjectionStore) {
    let shared = |key: &str, value: Option<&str>| -> crate::SharedChange {
        (
            std::sync::Arc::from(key.as_bytes()),
            value.map(|v| std::sync::Arc::from(v.as_bytes())),
        )
    };
    store
        .apply_shared(
            vec![
                shared("sh/a", Some("1")),
                shared("sh/b", Some("2")),
                shared("sh/a", Some("3")),
            ],
            &[(5, 10)],
        )
        .unwrap();
    assert_eq!(store.get(b"sh/a").unwrap().as_deref(), Some(&b"3"[..]));
    assert_eq!(store.get(b"sh/b").unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(store.position(5).unwrap(), 10);
    store
        .apply_shared(vec![shared("sh/b", None)], &[(5, 11)])
        .unwrap();
    assert_eq!(collect(store, b"sh/", false), vec![b"sh/a".to_vec()]);
    assert_eq!(store.position(5).unwrap(), 11);
}

pub fn run_all(store: &dyn ProjectionStore) {
    basic_semantics(store);
    aux_is_separate(store);
    large_batches(store);
    shared_changes(store);
}
