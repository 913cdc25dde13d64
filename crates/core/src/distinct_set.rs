//! A bucket's inline distinct values (`u` rows), held in memory as their stored
//! encoding: a count, then each value length-prefixed, in byte order.
//!
//! A set is read, grown and written back once per chunk that touches it. Held as a
//! `BTreeSet<Vec<u8>>`, every read decoded each value into an allocation of its own
//! and every write encoded them all again; with 10,000 customers one minute holds
//! ~1.5 million values at ingest's rate, ~100 bytes each that way, so the cache of
//! committed sets could not hold even the current minute and thrashed (docs/benchmarks.md,
//! "Distinct sets kept as their encoding"). Here a value costs its bytes plus eight,
//! a read is one validation pass, and a write is one copy.

use crate::error::EngineError;
use std::cmp::Ordering;

/// Bytes of the count and of each value's length prefix (u32, big-endian).
const PREFIX: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistinctSet {
    /// The stored encoding, kept current by every change.
    bytes: Vec<u8>,
    /// Where each value's length prefix starts in `bytes`, in value order.
    starts: Vec<u32>,
}

impl Default for DistinctSet {
    fn default() -> Self {
        DistinctSet {
            bytes: vec![0; PREFIX],
            starts: Vec::new(),
        }
    }
}

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let raw: [u8; PREFIX] = bytes.get(at..at.checked_add(PREFIX)?)?.try_into().ok()?;
    Some(u32::from_be_bytes(raw) as usize)
}

impl DistinctSet {
    /// A set from its stored encoding, taken as it is (validated, not copied).
    /// Values must be strictly ascending (as every writer leaves them): anything
    /// else is corrupt storage, never silently re-sorted.
    pub fn decode(bytes: Vec<u8>) -> Result<DistinctSet, EngineError> {
        let bad = || EngineError::Corrupt("a distinct-value set does not decode".into());
        let count = read_u32(&bytes, 0).ok_or_else(bad)?;
        // A count the bytes cannot hold is refused before it sizes an allocation.
        if count > bytes.len() / PREFIX {
            return Err(bad());
        }
        let mut starts = Vec::with_capacity(count);
        let mut at = PREFIX;
        let mut previous: Option<&[u8]> = None;
        for _ in 0..count {
            let len = read_u32(&bytes, at).ok_or_else(bad)?;
            let end = (at + PREFIX).checked_add(len).ok_or_else(bad)?;
            let value = bytes.get(at + PREFIX..end).ok_or_else(bad)?;
            if previous.is_some_and(|previous| previous >= value) {
                return Err(bad());
            }
            previous = Some(value);
            starts.push(u32::try_from(at).map_err(|_| bad())?);
            at = end;
        }
        if at != bytes.len() {
            return Err(bad());
        }
        Ok(DistinctSet { bytes, starts })
    }

    /// The stored encoding.
    pub fn encoded(&self) -> &[u8] {
        &self.bytes
    }

    pub fn len(&self) -> usize {
        self.starts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Bytes the set holds on the heap (the cache weighs sets by it).
    pub fn weight(&self) -> usize {
        self.bytes.capacity() + self.starts.capacity() * std::mem::size_of::<u32>()
    }

    /// Gives back the room left for growth (a set kept in a cache grows no more
    /// until a later chunk takes it out again).
    pub fn shrink_to_fit(&mut self) {
        self.bytes.shrink_to_fit();
        self.starts.shrink_to_fit();
    }

    /// The value at `index` in order.
    fn value(&self, index: usize) -> &[u8] {
        // `decode` and every change keep `starts` true to `bytes`; the fallbacks
        // only keep a broken invariant from panicking in apply.
        let Some(at) = self.starts.get(index).map(|start| *start as usize) else {
            return &[];
        };
        let len = read_u32(&self.bytes, at).unwrap_or(0);
        self.bytes
            .get(at + PREFIX..at + PREFIX + len)
            .unwrap_or_default()
    }

    /// `Ok(index)` of `value`, or `Err(index)` where it would go.
    fn search(&self, value: &[u8]) -> Result<usize, usize> {
        let (mut low, mut high) = (0, self.starts.len());
        while low < high {
            let middle = low + (high - low) / 2;
            match self.value(middle).cmp(value) {
                Ordering::Less => low = middle + 1,
                Ordering::Greater => high = middle,
                Ordering::Equal => return Ok(middle),
            }
        }
        Err(low)
    }

    pub fn contains(&self, value: &[u8]) -> bool {
        self.search(value).is_ok()
    }

    /// Adds `value`; `Some(index)` where it went (what `remove_at` takes back), or
    /// `None` when it was there. Values are bounded by the event size limits, so
    /// the offsets of a set of at most `codec::INLINE_DISTINCT_MAX` fit a u32.
    pub fn insert(&mut self, value: &[u8]) -> Option<usize> {
        let index = self.search(value).err()?;
        let at = self
            .starts
            .get(index)
            .map_or(self.bytes.len(), |start| *start as usize);
        let added = PREFIX + value.len();
        // Opened in place (no entry built aside): the values after `at` move up.
        let old_len = self.bytes.len();
        self.bytes.resize(old_len + added, 0);
        self.bytes.copy_within(at..old_len, at + added);
        self.bytes[at..at + PREFIX].copy_from_slice(&(value.len() as u32).to_be_bytes());
        self.bytes[at + PREFIX..at + added].copy_from_slice(value);
        for start in &mut self.starts[index..] {
            *start += added as u32;
        }
        self.starts.insert(index, at as u32);
        self.write_count();
        Some(index)
    }

    /// Takes out `value`; whether it was there.
    pub fn remove(&mut self, value: &[u8]) -> bool {
        match self.search(value) {
            Ok(index) => {
                self.remove_at(index);
                true
            }
            Err(_) => false,
        }
    }

    /// Takes out the value at `index` (undoing the `insert` that returned it).
    pub fn remove_at(&mut self, index: usize) {
        if index >= self.starts.len() {
            return;
        }
        let at = self.starts[index] as usize;
        let removed = PREFIX + self.value(index).len();
        if at + removed > self.bytes.len() {
            return;
        }
        self.bytes.drain(at..at + removed);
        self.starts.remove(index);
        for start in &mut self.starts[index..] {
            *start -= removed as u32;
        }
        self.write_count();
    }

    fn write_count(&mut self) {
        let count = (self.starts.len() as u32).to_be_bytes();
        self.bytes[..PREFIX].copy_from_slice(&count);
    }

    /// The values in byte order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.starts.len()).map(|index| self.value(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// The reference encoding: count, then each value length-prefixed, in order.
    fn reference_encoding(values: &BTreeSet<Vec<u8>>) -> Vec<u8> {
        let mut bytes = (values.len() as u32).to_be_bytes().to_vec();
        for value in values {
            bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
            bytes.extend_from_slice(value);
        }
        bytes
    }

    proptest! {
        /// Any sequence of inserts and undos of the latest insert leaves the set,
        /// its encoding and its decoding equal to a `BTreeSet` doing the same.
        #[test]
        fn inserts_and_undos_match_a_btreeset(
            steps in proptest::collection::vec(
                (proptest::collection::vec(0u8..4, 0..4), any::<bool>()), 0..80)
        ) {
            let mut set = DistinctSet::default();
            let mut reference = BTreeSet::new();
            let mut undo: Vec<(usize, Vec<u8>)> = Vec::new();
            for (value, take_back) in steps {
                if take_back {
                    if let Some((index, value)) = undo.pop() {
                        set.remove_at(index);
                        reference.remove(&value);
                    }
                } else {
                    let added = set.insert(&value);
                    prop_assert_eq!(added.is_some(), reference.insert(value.clone()));
                    if let Some(index) = added {
                        undo.push((index, value));
                    }
                }
                prop_assert_eq!(set.len(), reference.len());
                let encoding = reference_encoding(&reference);
                prop_assert_eq!(set.encoded(), encoding.as_slice());
                let values: Vec<&[u8]> = set.iter().collect();
                let expected: Vec<&[u8]> = reference.iter().map(Vec::as_slice).collect();
                prop_assert_eq!(values, expected);
                prop_assert_eq!(&DistinctSet::decode(set.encoded().to_vec()).unwrap(), &set);
                for probe in [&b""[..], b"\x00", b"\x01\x02", b"\x03\x03\x03"] {
                    prop_assert_eq!(set.contains(probe), reference.contains(probe));
                }
            }
        }
    }

    #[test]
    fn garbage_and_unordered_encodings_are_refused() {
        let mut set = DistinctSet::default();
        for value in [&b"b"[..], b"a", b"user_1"] {
            set.insert(value);
        }
        let bytes = set.encoded().to_vec();
        assert!(DistinctSet::decode(bytes[..bytes.len() - 1].to_vec()).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(DistinctSet::decode(longer).is_err());
        assert!(DistinctSet::decode(vec![0, 0, 0, 9]).is_err());
        assert!(DistinctSet::decode(vec![0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(DistinctSet::decode(Vec::new()).is_err());
        // "b" before "a": not in order.
        let unordered = [0, 0, 0, 2, 0, 0, 0, 1, b'b', 0, 0, 0, 1, b'a'];
        assert!(DistinctSet::decode(unordered.to_vec()).is_err());
        // The same value twice.
        let twice = [0, 0, 0, 2, 0, 0, 0, 1, b'a', 0, 0, 0, 1, b'a'];
        assert!(DistinctSet::decode(twice.to_vec()).is_err());
        assert_eq!(
            DistinctSet::decode(vec![0, 0, 0, 0]).unwrap(),
            DistinctSet::default()
        );
    }
}
