//! Bucket keys as apply holds them in memory: a small copyable [`BucketId`] (table,
//! interned series, minute) instead of the ~100-byte key the store is written with.
//!
//! Why: a bucket is looked up several times per event and matched meter (in the
//! chunk's overlay, in the projector's cache, and again when the cache learns the
//! commit), and every one of those lookups hashed and compared the whole encoded
//! key, behind a pointer. In a profile of the ingest benchmark that `memcmp` and
//! hashing were a quarter of the apply thread (docs/benchmarks.md, "Interned bucket keys").
//! Now a key's series (scope, meter, customer) is hashed once per lookup, to find
//! its [`SeriesId`], and the maps compare 16-byte ids.
//!
//! Ids are a process's own: they are never stored, and a key is encoded back
//! (`SeriesNames::key`) only where it is written. Whoever holds ids of one
//! [`SeriesNames`] must drop them when it is cleared (`BucketCache::absorb` does).

use std::collections::HashMap;

use crate::keys;

/// A hash map with a fast hash: apply's maps are looked up several times per
/// event, where std's SipHash was ~4% of the ingest profile.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A concurrent map with the same fast hash: the caches ingest reads for every
/// event (in-flight ids, customers) hashed with std's SipHash, ~2% of intake's and
/// the request workers' CPU under the ingest benchmark.
pub type FastDashMap<K, V> = dashmap::DashMap<K, V, foldhash::fast::RandomState>;

/// A `FastMap` that keeps insertion order, so the overlay's undo journal names an
/// entry by its index instead of holding a copy of its key.
pub type FastIndexMap<K, V> = indexmap::IndexMap<K, V, foldhash::fast::RandomState>;

/// A series (a bucket key without its table byte and minute: scope, meter,
/// customer) interned by a [`SeriesNames`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeriesId(u32);

#[cfg(test)]
impl SeriesId {
    /// The id a names table gives its `n`-th series: for tests that need ids alone.
    pub(crate) fn numbered(n: u32) -> SeriesId {
        SeriesId(n)
    }
}

/// A bucket (`A`, `@`, `|`), distinct-set (`u`) or meter-wide distinct-value
/// bucket (`U`, the keys' common part before the value) key in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BucketId {
    pub table: u8,
    pub series: SeriesId,
    pub minute: i64,
}

/// Length of the minute component that ends a bucket key.
const MINUTE_BYTES: usize = 8;

/// The series (the key without table byte and minute) and minute of a bucket or
/// distinct-set key; `None` for a key too short to be one.
pub fn series_of(key: &[u8]) -> Option<(&[u8], i64)> {
    let split = key.len().checked_sub(MINUTE_BYTES).filter(|at| *at > 1)?;
    Some((&key[1..split], keys::read_int(&key[split..])))
}

/// The id of the series at `index`. Past `u32::MAX` series the cache that owns
/// these names has long been cleared (`MAX_KNOWN_SERIES`); saturating keeps this
/// total all the same.
fn series_id(index: usize) -> SeriesId {
    SeriesId(u32::try_from(index).unwrap_or(u32::MAX))
}

/// The series interned so far, both ways: a series' id is its index in `series`.
///
/// Two levels: a series is split at its last component (`split_series`: for a bucket
/// key, the customer) into a prefix (scope and meter: a few dozen in a store) and
/// that last component (one per customer), each interned on its own, and the pair of
/// their indices is the series. Why: one set of whole series (~200,000 of ~80 bytes
/// under the ingest benchmark) missed the CPU caches on every look-up, through the
/// table, the entry and its boxed name, and compared the whole name: ~15% of the
/// apply thread (docs/benchmarks.md, "Usage batches encoded from the events"). The
/// prefixes stay in the caches, the last components are a twentieth of the series,
/// and the pairs are 8 bytes each. The split is a function of the bytes alone, so
/// equal series always meet in one id, whatever their components hold.
#[derive(Debug, Default)]
pub struct SeriesNames {
    prefixes: indexmap::IndexSet<Box<[u8]>, foldhash::fast::RandomState>,
    lasts: indexmap::IndexSet<Box<[u8]>, foldhash::fast::RandomState>,
    series: indexmap::IndexSet<(u32, u32), foldhash::fast::RandomState>,
}

/// A series cut before its last component: the bytes up to and including the last
/// `0` (a text component's terminator) that is not the series' final byte, and the
/// rest; a series without one is all last component.
fn split_series(series: &[u8]) -> (&[u8], &[u8]) {
    let body = &series[..series.len().saturating_sub(1)];
    match body.iter().rposition(|byte| *byte == 0) {
        Some(at) => series.split_at(at + 1),
        None => (&[], series),
    }
}

/// The index of `bytes` in `set`, added if new; saturating past `u32::MAX` as
/// `series_id` does.
fn intern_in(
    set: &mut indexmap::IndexSet<Box<[u8]>, foldhash::fast::RandomState>,
    bytes: &[u8],
) -> u32 {
    let index = match set.get_index_of(bytes) {
        Some(index) => index,
        None => set.insert_full(bytes.into()).0,
    };
    u32::try_from(index).unwrap_or(u32::MAX)
}

fn index_in(
    set: &indexmap::IndexSet<Box<[u8]>, foldhash::fast::RandomState>,
    bytes: &[u8],
) -> Option<u32> {
    set.get_index_of(bytes)
        .map(|index| u32::try_from(index).unwrap_or(u32::MAX))
}

impl SeriesNames {
    /// The id of a bucket or distinct-set key; `None` for a key too short to be one.
    pub fn bucket(&mut self, key: &[u8]) -> Option<BucketId> {
        let (series, minute) = series_of(key)?;
        Some(BucketId {
            table: key[0],
            series: self.intern(series),
            minute,
        })
    }

    fn intern(&mut self, series: &[u8]) -> SeriesId {
        let (prefix, last) = split_series(series);
        let pair = (
            intern_in(&mut self.prefixes, prefix),
            intern_in(&mut self.lasts, last),
        );
        series_id(self.series.insert_full(pair).0)
    }

    /// The id of a bucket key's series if it is interned here (a look-up only).
    pub fn known_bucket(&self, key: &[u8]) -> Option<BucketId> {
        let (series, minute) = series_of(key)?;
        let (prefix, last) = split_series(series);
        let pair = (
            index_in(&self.prefixes, prefix)?,
            index_in(&self.lasts, last)?,
        );
        Some(BucketId {
            table: key[0],
            series: series_id(self.series.get_index_of(&pair)?),
            minute,
        })
    }

    /// The series' two parts (`None`: not interned here).
    fn parts(&self, series: SeriesId) -> Option<(&[u8], &[u8])> {
        let (prefix, last) = self.series.get_index(series.0 as usize)?;
        Some((
            self.prefixes.get_index(*prefix as usize)?,
            self.lasts.get_index(*last as usize)?,
        ))
    }

    /// The store key of a bucket (`None`: its series is not interned here).
    pub fn key(&self, bucket: BucketId) -> Option<Vec<u8>> {
        let mut key = Vec::new();
        self.write_key(bucket, &mut key)?;
        Some(key)
    }

    /// `key`, written over `out` (a buffer reused from key to key).
    pub fn write_key(&self, bucket: BucketId, out: &mut Vec<u8>) -> Option<()> {
        let (prefix, last) = self.parts(bucket.series)?;
        out.clear();
        out.reserve(1 + prefix.len() + last.len() + MINUTE_BYTES);
        out.push(bucket.table);
        out.extend_from_slice(prefix);
        out.extend_from_slice(last);
        keys::write_int(out, bucket.minute);
        Some(())
    }

    /// How many series are interned.
    pub fn len(&self) -> usize {
        self.series.len()
    }

    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::BucketKey;
    use tally_domain::Mode;

    #[test]
    fn a_key_round_trips_and_equal_series_share_an_id() {
        let mut names = SeriesNames::default();
        let a = BucketKey::from_minute(keys::AGGREGATE, "st", Mode::Prod, "m", "c", -120_000);
        let u = BucketKey::from_minute(keys::DISTINCT_SET, "st", Mode::Prod, "m", "c", 60_000);
        let other = BucketKey::from_minute(keys::AGGREGATE, "st", Mode::Test, "m", "c", 0);
        let (ia, iu, io) = (
            names.bucket(&a).unwrap(),
            names.bucket(&u).unwrap(),
            names.bucket(&other).unwrap(),
        );
        assert_eq!(ia.series, iu.series, "one series across tables and minutes");
        assert_ne!(ia.series, io.series);
        assert_eq!((ia.table, ia.minute), (keys::AGGREGATE, -120_000));
        for (key, id) in [(a, ia), (u, iu), (other, io)] {
            assert_eq!(names.key(id), Some(key));
        }
        assert_eq!(names.len(), 2);
        assert_eq!(names.bucket(b"short"), None);
    }

    /// Any bytes as keys (zeros anywhere, so the split lands anywhere): two keys
    /// share a series id exactly when their series bytes are equal, every id gives
    /// its key back, and a look-up agrees with interning.
    fn key_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let byte = prop_oneof![Just(0u8), Just(b'a'), Just(b'b'), any::<u8>()];
        (
            prop_oneof![Just(keys::AGGREGATE), Just(keys::DISTINCT_SET)],
            proptest::collection::vec(byte, 1..8),
            prop_oneof![Just(0i64), Just(60_000), any::<i64>()],
        )
            .prop_map(|(table, series, minute)| {
                let mut key = vec![table];
                key.extend_from_slice(&series);
                keys::write_int(&mut key, minute);
                key
            })
    }

    proptest::proptest! {
        #[test]
        fn series_share_an_id_exactly_when_their_bytes_are_equal(
            keys in proptest::collection::vec(key_bytes(), 1..40),
        ) {
            let mut names = SeriesNames::default();
            let ids: Vec<BucketId> = keys.iter().map(|k| names.bucket(k).unwrap()).collect();
            for (key, id) in keys.iter().zip(&ids) {
                proptest::prop_assert_eq!(names.key(*id), Some(key.clone()));
                proptest::prop_assert_eq!(names.known_bucket(key), Some(*id));
            }
            for (a, ia) in keys.iter().zip(&ids) {
                for (b, ib) in keys.iter().zip(&ids) {
                    let same = series_of(a).unwrap().0 == series_of(b).unwrap().0;
                    proptest::prop_assert_eq!(same, ia.series == ib.series);
                }
            }
            let distinct: std::collections::HashSet<&[u8]> =
                keys.iter().map(|k| series_of(k).unwrap().0).collect();
            proptest::prop_assert_eq!(names.len(), distinct.len());
            proptest::prop_assert_eq!(SeriesNames::default().known_bucket(&keys[0]), None);
        }
    }
}
