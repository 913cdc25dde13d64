//! A cache keyed by bucket, held as one hash map per minute, so that dropping the
//! oldest minutes frees their maps whole.
//!
//! Why not one map: the bucket cache is bounded by dropping its oldest minutes
//! (`overlay::MAX_CACHED_BUCKETS`). Removing a third of a full hash table's entries
//! leaves most of their slots as tombstones, which new entries do not fill first;
//! once the table's free slots ran out it grew to twice its size although it held
//! fewer entries than before. In a heap profile of ten million ingested events the
//! bucket cache's table had doubled to 2^20 slots (~100 MB, allocated while the
//! 50 MB one it replaced was still alive) under a cap chosen to keep it at 2^19
//! (docs/benchmarks.md, "The bucket cache's table, one per minute"). A map per
//! minute never erases inside a table: a minute is dropped as a whole map.

use std::collections::BTreeMap;

use crate::series::{BucketId, FastMap};

/// Entries keyed by bucket, grouped by the bucket's minute.
#[derive(Debug)]
pub struct MinuteMaps<V> {
    minutes: BTreeMap<i64, FastMap<BucketId, V>>,
    len: usize,
}

impl<V> Default for MinuteMaps<V> {
    fn default() -> Self {
        MinuteMaps {
            minutes: BTreeMap::new(),
            len: 0,
        }
    }
}

impl<V> MinuteMaps<V> {
    pub fn get(&self, id: &BucketId) -> Option<&V> {
        self.minutes.get(&id.minute)?.get(id)
    }

    pub fn insert(&mut self, id: BucketId, value: V) -> Option<V> {
        let old = self.minutes.entry(id.minute).or_default().insert(id, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    pub fn remove(&mut self, id: &BucketId) -> Option<V> {
        let minute = self.minutes.get_mut(&id.minute)?;
        let old = minute.remove(id)?;
        self.len -= 1;
        if minute.is_empty() {
            self.minutes.remove(&id.minute);
        }
        Some(old)
    }

    /// The value at `id`, inserted as `V::default()` when absent.
    pub fn get_or_default(&mut self, id: BucketId) -> &mut V
    where
        V: Default,
    {
        let minute = self.minutes.entry(id.minute).or_default();
        let len = &mut self.len;
        minute.entry(id).or_insert_with(|| {
            *len += 1;
            V::default()
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops the oldest minutes, each whole, until what stays weighs at most
    /// `target` (the newest minute alone may weigh more: it is then dropped too);
    /// returns the weight kept. Dropping is always safe for a cache: it only saves
    /// reads of what the store holds.
    pub fn evict_oldest_minutes(&mut self, target: usize, weight: impl Fn(&V) -> usize) -> usize {
        let mut kept = 0usize;
        let mut oldest_kept = None;
        for (minute, entries) in self.minutes.iter().rev() {
            let minute_weight: usize = entries.values().map(&weight).sum();
            if kept + minute_weight > target {
                break;
            }
            kept += minute_weight;
            oldest_kept = Some(*minute);
        }
        self.minutes = match oldest_kept {
            Some(oldest) => self.minutes.split_off(&oldest),
            None => BTreeMap::new(),
        };
        self.len = self.minutes.values().map(FastMap::len).sum();
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::series::SeriesId;

    fn id(series: u32, minute: i64) -> BucketId {
        BucketId {
            table: b'A',
            series: SeriesId::numbered(series),
            minute,
        }
    }

    #[test]
    fn counts_entries_across_minutes() {
        let mut maps = MinuteMaps::default();
        assert_eq!(maps.insert(id(1, 60), 1), None);
        assert_eq!(maps.insert(id(1, 60), 2), Some(1));
        assert_eq!(maps.insert(id(2, 120), 3), None);
        *maps.get_or_default(id(3, 120)) += 4;
        *maps.get_or_default(id(3, 120)) += 4;
        assert_eq!(maps.len(), 3);
        assert_eq!(maps.get(&id(3, 120)), Some(&8));
        assert_eq!(maps.get(&id(3, 60)), None);
        assert_eq!(maps.remove(&id(1, 60)), Some(2));
        assert_eq!(maps.remove(&id(1, 60)), None);
        assert_eq!(maps.len(), 2);
        assert!(!maps.minutes.contains_key(&60), "an emptied minute goes");
    }

    #[test]
    fn evicts_whole_minutes_oldest_first() {
        let mut maps = MinuteMaps::default();
        for minute in 0..4 {
            for series in 0..10 {
                maps.insert(id(series, minute * 60), 1usize);
            }
        }
        // Room for two and a half minutes: the two newest stay whole.
        assert_eq!(maps.evict_oldest_minutes(25, |v| *v), 20);
        assert_eq!(maps.len(), 20);
        assert!(maps.get(&id(0, 60)).is_none());
        assert!(maps.get(&id(9, 120)).is_some() && maps.get(&id(9, 180)).is_some());
        // A newest minute heavier than the target goes too.
        assert_eq!(maps.evict_oldest_minutes(5, |v| *v), 0);
        assert!(maps.is_empty());
    }
}
