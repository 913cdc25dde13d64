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

/// The series interned so far, both ways: a series' id is its index in the set.
#[derive(Debug, Default)]
pub struct SeriesNames {
    names: indexmap::IndexSet<Box<[u8]>, foldhash::fast::RandomState>,
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
        let index = match self.names.get_index_of(series) {
            Some(index) => index,
            None => self.names.insert_full(series.into()).0,
        };
        series_id(index)
    }

    /// The id of a bucket key's series if it is interned here (a look-up only).
    pub fn known_bucket(&self, key: &[u8]) -> Option<BucketId> {
        let (series, minute) = series_of(key)?;
        Some(BucketId {
            table: key[0],
            series: series_id(self.names.get_index_of(series)?),
            minute,
        })
    }

    /// The series' bytes (`None`: not interned here).
    pub fn name(&self, series: SeriesId) -> Option<&[u8]> {
        self.names
            .get_index(series.0 as usize)
            .map(|name| &name[..])
    }

    /// The store key of a bucket (`None`: its series is not interned here).
    pub fn key(&self, bucket: BucketId) -> Option<Vec<u8>> {
        let mut key = Vec::new();
        self.write_key(bucket, &mut key)?;
        Some(key)
    }

    /// `key`, written over `out` (a buffer reused from key to key).
    pub fn write_key(&self, bucket: BucketId, out: &mut Vec<u8>) -> Option<()> {
        let name = self.name(bucket.series)?;
        out.clear();
        out.reserve(1 + name.len() + MINUTE_BYTES);
        out.push(bucket.table);
        out.extend_from_slice(name);
        keys::write_int(out, bucket.minute);
        Some(())
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
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
}
