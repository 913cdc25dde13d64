//! A sled store that packs tables into rows reads exactly as a store of plain keys:
//! any batches of puts and deletes, any reopen, then every `get` and every scan
//! (any bounds, either direction, stopped anywhere) agree with the memory store.

use std::ops::Bound;

use proptest::prelude::*;
use tally_projection::{
    testsuite, Change, MemoryStore, Packing, ProjectionStore, SledStore, Visit,
};

/// Packed tables of the generated keys; `B` and `z` stay plain.
const PACKED: &[u8] = b"Au";

/// A key shaped as the service's scoped keys: table, scope text, mode byte, then
/// the component rows are packed by, a second text and an 8-byte minute.
fn scoped_key(
    table: u8,
    store: &str,
    mode: u8,
    entry: &str,
    customer: &str,
    minute: i64,
) -> Vec<u8> {
    let mut key = vec![table];
    key.extend_from_slice(store.as_bytes());
    key.push(0);
    key.push(mode);
    key.extend_from_slice(entry.as_bytes());
    key.push(0);
    key.extend_from_slice(customer.as_bytes());
    key.push(0);
    key.extend_from_slice(&((minute as u64) ^ (1 << 63)).to_be_bytes());
    key
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(b"ABuz".to_vec()),
        prop::sample::select(vec!["s1", "s2", "s"]),
        prop::sample::select(b"pt".to_vec()),
        prop::sample::select(vec!["m1", "m2", "m10", ""]),
        prop::sample::select(vec!["", "c1", "c2"]),
        prop::sample::select(vec![-1i64, 0, 5]),
    )
        .prop_map(|(table, store, mode, entry, customer, minute)| {
            scoped_key(table, store, mode, entry, customer, minute)
        })
}

fn change() -> impl Strategy<Value = Change> {
    (
        key(),
        prop::option::weighted(0.8, prop::collection::vec(any::<u8>(), 0..12)),
    )
}

/// A bound made from a generated key: the key itself, a prefix of it, or the end
/// of such a prefix, included or not.
fn bound() -> impl Strategy<Value = Bound<Vec<u8>>> {
    prop_oneof![
        1 => Just(Bound::Unbounded),
        4 => (key(), 0usize..40, any::<bool>(), any::<bool>()).prop_map(|(key, cut, end, inc)| {
            let mut bytes = key[..cut.min(key.len())].to_vec();
            if end {
                bytes = tally_projection::prefix_end(&bytes).unwrap_or(bytes);
            }
            if inc {
                Bound::Included(bytes)
            } else {
                Bound::Excluded(bytes)
            }
        }),
    ]
}

type Entries = Vec<(Vec<u8>, Vec<u8>)>;

fn scanned(
    store: &dyn ProjectionStore,
    start: &Bound<Vec<u8>>,
    end: &Bound<Vec<u8>>,
    reverse: bool,
    stop_after: usize,
) -> Entries {
    // A memory store's range panics on inverted bounds, as std's does; both
    // stores answer such a range with nothing.
    if let (Some(s), Some(e)) = (key_of(start), key_of(end)) {
        if s > e || (s == e && !matches!((start, end), (Bound::Included(_), Bound::Included(_)))) {
            return Vec::new();
        }
    }
    let mut entries = Vec::new();
    store
        .scan(
            start.as_ref().map(Vec::as_slice),
            end.as_ref().map(Vec::as_slice),
            reverse,
            &mut |k, v| {
                entries.push((k.to_vec(), v.to_vec()));
                if entries.len() >= stop_after {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            },
        )
        .unwrap();
    entries
}

fn key_of(bound: &Bound<Vec<u8>>) -> Option<&Vec<u8>> {
    match bound {
        Bound::Included(k) | Bound::Excluded(k) => Some(k),
        Bound::Unbounded => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn a_packed_store_reads_as_plain_keys(
        batches in prop::collection::vec(prop::collection::vec(change(), 1..40), 1..6),
        reopen_after in 0usize..6,
        scans in prop::collection::vec((bound(), bound(), any::<bool>(), 1usize..400), 1..24),
        probes in prop::collection::vec(key(), 1..40),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut sled = SledStore::open_with(dir.path(), Packing::tables(PACKED)).unwrap();
        let memory = MemoryStore::new();
        for (i, batch) in batches.iter().enumerate() {
            sled.apply(batch.clone(), &[(0, i as u64 + 1)]).unwrap();
            memory.apply(batch.clone(), &[(0, i as u64 + 1)]).unwrap();
            if i == reopen_after {
                drop(sled);
                // Opened without a packing: the store reads as it was written.
                sled = SledStore::open(dir.path()).unwrap();
            }
        }
        for key in &probes {
            prop_assert_eq!(sled.get(key).unwrap(), memory.get(key).unwrap());
        }
        for (start, end, reverse, stop_after) in &scans {
            prop_assert_eq!(
                scanned(&sled, start, end, *reverse, *stop_after),
                scanned(&memory, start, end, *reverse, *stop_after),
                "scan {:?}..{:?} reverse {}", start, end, reverse
            );
        }
        prop_assert_eq!(sled.digest().unwrap(), memory.digest().unwrap());
        prop_assert_eq!(sled.position(0).unwrap(), batches.len() as u64);
    }
}

/// A batch past the atomic-batch limit goes through the stage and is written key by
/// key: the rows it touches merge the same way.
#[test]
fn a_staged_batch_packs_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let sled = SledStore::open_with(dir.path(), Packing::tables(PACKED)).unwrap();
    let memory = MemoryStore::new();
    let batch = |tag: u8, deletes: bool| -> Vec<Change> {
        (0..3_000i64)
            .map(|i| {
                let key = scoped_key(
                    b'A',
                    "s",
                    b'p',
                    &format!("m{}", i % 7),
                    &format!("c{}", i / 7 % 50),
                    i / 350,
                );
                let value = (!deletes || i % 3 != 0).then(|| vec![tag, (i % 251) as u8]);
                (key, value)
            })
            .collect()
    };
    for (n, (tag, deletes)) in [(1u8, false), (2, true)].into_iter().enumerate() {
        sled.apply(batch(tag, deletes), &[(0, n as u64 + 1)])
            .unwrap();
        memory
            .apply(batch(tag, deletes), &[(0, n as u64 + 1)])
            .unwrap();
    }
    assert_eq!(sled.digest().unwrap(), memory.digest().unwrap());
    let every = |store: &dyn ProjectionStore| {
        let mut n = 0;
        store
            .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |_, _| {
                n += 1;
                Visit::Continue
            })
            .unwrap();
        n
    };
    assert_eq!(every(&sled), 2_000, "a third of the keys deleted");
}

/// The shared suite's plain keys (tables `a`, `b`, `i`, `s`, `x`) read the same with
/// packed tables between them.
#[test]
fn a_packed_store_passes_the_suite() {
    let dir = tempfile::tempdir().unwrap();
    testsuite::run_all(&SledStore::open_with(dir.path(), Packing::tables(b"Acj")).unwrap());
}

/// A store keeps the packing it was created with; one created without keeps its
/// keys plain whatever a later open asks for.
#[test]
fn a_store_keeps_the_packing_it_was_created_with() {
    let key = scoped_key(b'A', "s", b'p', "m", "c", 1);
    let plain = tempfile::tempdir().unwrap();
    {
        let store = SledStore::open(plain.path()).unwrap();
        store
            .apply(vec![(key.clone(), Some(b"v".to_vec()))], &[(0, 1)])
            .unwrap();
        store.flush().unwrap();
    }
    let store = SledStore::open_with(plain.path(), Packing::tables(PACKED)).unwrap();
    assert_eq!(store.packing(), &Packing::none());
    assert_eq!(store.get(&key).unwrap().as_deref(), Some(&b"v"[..]));
    let packed = tempfile::tempdir().unwrap();
    drop(SledStore::open_with(packed.path(), Packing::tables(PACKED)).unwrap());
    let store = SledStore::open(packed.path()).unwrap();
    assert_eq!(store.packing(), &Packing::tables(PACKED));
}
