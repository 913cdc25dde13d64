//! The checkpoint store's write-back layer against a reference map: any sequence of
//! batches (puts, overwrites, deletes, in any order within a batch) and checkpoints
//! reads the same as the reference, through gets, ranges and full scans in both
//! directions, before and after everything reaches the inner store.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::Duration;

use proptest::prelude::*;
use tally_projection::{CheckpointStore, MemoryStore, ProjectionStore, Visit};

/// One batch: (key number, value or delete) writes, then whether to checkpoint.
type Step = (Vec<(u8, Option<u8>)>, bool);

fn key(n: u8) -> Vec<u8> {
    // Long keys sharing a prefix, like projection keys; the number decides the order.
    let mut key = b"Astore\x00t\x00meter\x00".to_vec();
    key.push(n / 16);
    key.extend_from_slice(format!("customer-{:02}", n % 16).as_bytes());
    key
}

fn scan(
    store: &dyn ProjectionStore,
    start: Bound<&[u8]>,
    end: Bound<&[u8]>,
    reverse: bool,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut seen = Vec::new();
    store
        .scan(start, end, reverse, &mut |k, v| {
            seen.push((k.to_vec(), v.to_vec()));
            Visit::Continue
        })
        .unwrap();
    seen
}

/// Applies step `offset` (its writes, keyed by `key`, as one batch reaching
/// position `offset + 1`, then a checkpoint if it says so) to the store and to the
/// reference.
fn apply_step<N: Copy>(
    store: &CheckpointStore<MemoryStore>,
    reference: &mut BTreeMap<Vec<u8>, Vec<u8>>,
    offset: usize,
    (writes, checkpoint): &(Vec<(N, Option<u8>)>, bool),
    key: fn(N) -> Vec<u8>,
) {
    let mut changes = Vec::new();
    for (n, value) in writes {
        match value {
            Some(v) => reference.insert(key(*n), vec![*v]),
            None => reference.remove(&key(*n)),
        };
        changes.push((key(*n), value.map(|v| vec![v])));
    }
    store.apply(changes, &[(0, offset as u64 + 1)]).unwrap();
    if *checkpoint {
        store.checkpoint().unwrap();
    }
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            prop::collection::vec((0u8..48, prop::option::weighted(0.8, any::<u8>())), 0..12),
            prop::bool::weighted(0.2),
        ),
        1..30,
    )
}

proptest! {
    #[test]
    fn the_layer_reads_like_a_plain_map(steps in steps(), lo in 0u8..48, hi in 0u8..48) {
        // Never checkpoints on its own: only the steps decide.
        let store = CheckpointStore::with_limits(MemoryStore::new(), usize::MAX, Duration::from_secs(3600));
        let mut reference: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (offset, step) in steps.iter().enumerate() {
            apply_step(&store, &mut reference, offset, step, key);
            for n in 0..48 {
                prop_assert_eq!(store.get(&key(n)).unwrap(), reference.get(&key(n)).cloned());
            }
        }
        let all: Vec<_> = reference.clone().into_iter().collect();
        prop_assert_eq!(scan(&store, Bound::Unbounded, Bound::Unbounded, false), all.clone());
        let mut backward = scan(&store, Bound::Unbounded, Bound::Unbounded, true);
        backward.reverse();
        prop_assert_eq!(&backward, &all);
        let (lo, hi) = (key(lo.min(hi)), key(lo.max(hi)));
        let ranged: Vec<_> = reference
            .range::<[u8], _>((Bound::Included(&lo[..]), Bound::Excluded(&hi[..])))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        prop_assert_eq!(scan(&store, Bound::Included(&lo), Bound::Excluded(&hi), false), ranged);
        let ranged: Vec<_> = reference
            .range::<[u8], _>((Bound::Excluded(&lo[..]), Bound::Included(&hi[..])))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        prop_assert_eq!(scan(&store, Bound::Excluded(&lo), Bound::Included(&hi), false), ranged);
        store.checkpoint().unwrap();
        prop_assert_eq!(scan(store.inner(), Bound::Unbounded, Bound::Unbounded, false), all);
        prop_assert_eq!(store.inner().position(0).unwrap(), steps.len() as u64);
    }
}

/// A key of a wider space, so a layer holds more than `SCAN_WINDOW` entries in a
/// range and a scan crosses several of its steps.
fn wide_key(n: u16) -> Vec<u8> {
    let mut key = b"Astore\x00t\x00meter\x00".to_vec();
    key.extend_from_slice(format!("customer-{n:05}").as_bytes());
    key
}

/// Batches over the wide key space: (key number, value or delete), then whether to
/// checkpoint.
type WideStep = (Vec<(u16, Option<u8>)>, bool);

fn wide_steps() -> impl Strategy<Value = Vec<WideStep>> {
    prop::collection::vec(
        (
            prop::collection::vec(
                (0u16..3_000, prop::option::weighted(0.7, any::<u8>())),
                0..1_200,
            ),
            prop::bool::weighted(0.2),
        ),
        1..8,
    )
}

/// The scan of `lo..hi` (included, excluded) in one direction, stopped by the
/// visitor after `stop_after` entries; in steps (`scan_in_steps`) or not.
fn scan_stopping(
    store: &dyn ProjectionStore,
    (lo, hi): (&[u8], &[u8]),
    reverse: bool,
    stop_after: usize,
    in_steps: bool,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut seen = Vec::new();
    let mut visit = |k: &[u8], v: &[u8]| {
        seen.push((k.to_vec(), v.to_vec()));
        if seen.len() >= stop_after {
            Visit::Stop
        } else {
            Visit::Continue
        }
    };
    let (lo, hi) = (Bound::Included(lo), Bound::Excluded(hi));
    if in_steps {
        store.scan_in_steps(lo, hi, reverse, &mut visit).unwrap();
    } else {
        store.scan(lo, hi, reverse, &mut visit).unwrap();
    }
    seen
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Scans in steps take the layers a window at a time (`SCAN_WINDOW` entries of
    /// each run): whatever the layers hold over the inner store (deletes of stored
    /// keys included), any range in either direction, stopped anywhere or not at
    /// all, reads as the reference does, each key once and in order; and as a
    /// plain scan does.
    #[test]
    fn scans_in_windows_read_like_a_plain_map(
        steps in wide_steps(),
        lo in 0u16..3_000,
        hi in 0u16..3_000,
        reverse: bool,
        stop_after in prop_oneof![1usize..1_200, Just(usize::MAX)],
    ) {
        let store = CheckpointStore::with_limits(MemoryStore::new(), usize::MAX, Duration::from_secs(3600));
        let mut reference: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (offset, step) in steps.iter().enumerate() {
            apply_step(&store, &mut reference, offset, step, wide_key);
        }
        let (lo, hi) = (wide_key(lo.min(hi)), wide_key(lo.max(hi) + 1));
        let mut expected: Vec<_> = reference
            .range::<[u8], _>((Bound::Included(&lo[..]), Bound::Excluded(&hi[..])))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if reverse {
            expected.reverse();
        }
        expected.truncate(stop_after);
        for in_steps in [true, false] {
            prop_assert_eq!(
                scan_stopping(&store, (&lo, &hi), reverse, stop_after, in_steps),
                expected.clone()
            );
        }
    }
}
