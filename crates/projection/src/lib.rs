//! The projection store: where projections (customers, meters, stored events, usage
//! buckets, balances) live, derived from the log.
//!
//! A small trait, [`ProjectionStore`], over an ordered byte key-value space. The one
//! write operation, [`ProjectionStore::apply`], writes a batch of changes together
//! with the log positions they bring the projection to, atomically: after a crash the
//! store holds some prefix of applied batches and exactly the positions matching it,
//! so a restart resumes where the projection really is (nothing applied twice, nothing
//! skipped). Durability of the store itself is not needed for correctness: the log is
//! durable, and a lost batch is simply applied again.
//!
//! Beside the projections there is an "aux" space for data that is not derived from
//! the log (a node's own hints, such as the event index's size for its next start).
//! It is excluded from digests and replays.

use std::ops::Bound;
use std::sync::Arc;

pub mod checkpoint;
pub mod memory;
pub mod packing;
pub mod priority;
pub mod read_advice;
pub mod read_cache;
pub mod sled_store;
#[cfg(any(test, feature = "test-util"))]
pub mod testsuite;
pub mod warm;

pub use checkpoint::CheckpointStore;
pub use memory::MemoryStore;
pub use packing::Packing;
pub use sled_store::SledStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("projection store: {0}")]
    Backend(String),
    /// A stored value that must have a fixed shape does not (fail-stop).
    #[error("projection store is corrupt: {0}")]
    Corrupt(String),
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Backend(e.to_string())
    }
}

/// One change: a value to put, or `None` to delete.
pub type Change = (Vec<u8>, Option<Vec<u8>>);

/// A change whose key and value are shared (`Arc`s), as the write-back layer keeps
/// them (`ProjectionStore::apply_shared`).
pub type SharedChange = (Arc<[u8]>, Option<Arc<[u8]>>);

/// What `ChangeSource::visit_changes` calls per change: its key, and its value or
/// `None` for a delete.
pub type ChangeVisit<'a> = dyn FnMut(&[u8], Option<&[u8]>) -> Result<(), StoreError> + 'a;

/// A batch of changes that a store may read more than once without copying it: a
/// checkpoint's frozen layer is written to the stage file, then key by key, straight
/// from the layer (a copy of a 200,000-key layer cost the checkpoint thread a sixth
/// of its time, and as much memory again as the layer).
pub trait ChangeSource {
    /// How many changes `visit_changes` visits.
    fn change_count(&self) -> usize;

    /// Visits every change in key order; an error stops the visit and is returned.
    fn visit_changes(&self, visit: &mut ChangeVisit<'_>) -> Result<(), StoreError>;
}

/// Owned (`Change`) and shared (`SharedChange`) batches alike.
impl<K: AsRef<[u8]>, V: AsRef<[u8]>> ChangeSource for Vec<(K, Option<V>)> {
    fn change_count(&self) -> usize {
        self.len()
    }

    fn visit_changes(&self, visit: &mut ChangeVisit<'_>) -> Result<(), StoreError> {
        self.iter()
            .try_for_each(|(key, value)| visit(key.as_ref(), value.as_ref().map(AsRef::as_ref)))
    }
}

/// Whether a scan continues after a visited entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    Continue,
    Stop,
}

pub trait ProjectionStore: Send + Sync + std::fmt::Debug {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// The key's value when a write-back layer holds a change of it not yet written
    /// to the durable store (`Some(None)`: deleted there), from memory; `None` when
    /// only the durable store can answer, and always for stores without a layer.
    /// A reader that only warms the durable store's pages (the projector's
    /// read-ahead) asks first: a key still in memory needs no read.
    fn unwritten(&self, _key: &[u8]) -> Option<Option<Vec<u8>>> {
        None
    }

    /// How many write-back layers have been written to the durable store and
    /// dropped from memory so far; `None` for stores without a layer. A change
    /// applied after a reader saw `Some(n)` is still in a layer while this is still
    /// `Some(n)`, so `unwritten` answering `None` then means that no change of the
    /// key was applied since: a key known to be fresh (the outcome of a record
    /// appended after the count was read) is then known absent without a read of
    /// the durable store, where a miss walks its tree.
    fn retired_layers(&self) -> Option<u64> {
        None
    }

    /// Visits keys in `[start, end)` in ascending order, or descending with `reverse`.
    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError>;

    /// `scan`, for a visitor that usually stops early and reads each key on its
    /// own: a write-back layer is read a window at a time (`checkpoint::SCAN_WINDOW`
    /// entries of each sorted run), so the scan copies about what it visits, not
    /// every unwritten entry of its range. Each window sees every chunk whole, but
    /// a chunk merged while the scan goes on may show only in its later windows.
    /// The default is `scan`.
    fn scan_in_steps(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        self.scan(start, end, reverse, visit)
    }

    /// Writes `changes` and the new positions `(partition, next_offset)` atomically.
    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError>;

    /// `apply` of shared changes: the write-back layer keeps them as they are,
    /// where `apply` makes each key and value an `Arc` (an allocation and a copy
    /// per key and per value, ~5% of the apply thread under ingest). The default
    /// copies them into owned changes.
    fn apply_shared(
        &self,
        changes: Vec<SharedChange>,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        let owned = changes
            .into_iter()
            .map(|(key, value)| (key.to_vec(), value.map(|v| v.to_vec())))
            .collect();
        self.apply(owned, positions)
    }

    /// `apply` from borrowed changes (a checkpoint's layer). Stores that copy what
    /// they write anyway read the source directly; the default collects it.
    fn apply_from(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        let mut owned = Vec::with_capacity(changes.change_count());
        changes.visit_changes(&mut |key, value| {
            owned.push((key.to_vec(), value.map(<[u8]>::to_vec)));
            Ok(())
        })?;
        self.apply(owned, positions)
    }

    /// `apply_from` that calls `durable` once the whole batch and its positions
    /// would survive a crash while the write goes on (a staged batch: once its stage
    /// file is in place), so a layer copy may then be made over the positions it
    /// reaches (`sled_store`, "Layer copies"). The default never calls it: no copy
    /// is made while such a store writes.
    fn apply_from_noting_durable(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
        _durable: &dyn Fn(),
    ) -> Result<(), StoreError> {
        self.apply_from(changes, positions)
    }

    /// The next log offset to apply for `partition` (0 when nothing was applied).
    fn position(&self, partition: u32) -> Result<u64, StoreError>;

    /// Makes everything applied so far durable (on graceful shutdown, before a Kafka
    /// offset commit).
    fn flush(&self) -> Result<(), StoreError>;

    /// Makes the aux space durable. Stores that write projections back lazily need
    /// not checkpoint for this.
    fn flush_aux(&self) -> Result<(), StoreError> {
        self.flush()
    }

    /// Whether `save_layer_copy` keeps copies (a write-back layer above copies itself
    /// only then).
    fn keeps_layer_copies(&self) -> bool {
        false
    }

    /// Every partition's position as this store holds it: what a layer copy was made
    /// over.
    fn stored_positions(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        Ok(Vec::new())
    }

    /// Keeps a durable copy of the write-back layer above this store, not yet
    /// checkpointed: its changes, the positions they reach, and the stored positions
    /// (`over`) it was made over. A restart that finds the copy still over what the
    /// store holds takes it in instead of re-applying that part of the log
    /// (`sled_store`, "Layer copies"). Stores that keep none ignore it.
    fn save_layer_copy(
        &self,
        _over: &[(u32, u64)],
        _changes: &dyn ChangeSource,
        _positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        Ok(())
    }

    /// Called by the projector when it is idle: a store with a write-back layer
    /// checkpoints it if a checkpoint is due. Nothing to do for the others.
    fn tick(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Time since the last completed checkpoint, for stores that checkpoint
    /// (`/metrics`); None for the others.
    fn checkpoint_age(&self) -> Option<std::time::Duration> {
        None
    }

    /// Keys changed since the last completed checkpoint (0 for stores that write
    /// through).
    fn dirty_keys(&self) -> usize {
        0
    }

    /// SHA-256 over every projection key and value in order (positions and aux
    /// excluded): equal digests mean equal projected state.
    fn digest(&self) -> Result<String, StoreError> {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        self.scan(Bound::Unbounded, Bound::Unbounded, false, &mut |k, v| {
            hasher.update((k.len() as u64).to_le_bytes());
            hasher.update(k);
            hasher.update((v.len() as u64).to_le_bytes());
            hasher.update(v);
            Visit::Continue
        })?;
        Ok(hex::encode(hasher.finalize()))
    }

    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError>;
    /// Visits the aux space in ascending key order.
    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError>;
}

/// Visits every key starting with `prefix`.
pub fn scan_prefix(
    store: &dyn ProjectionStore,
    prefix: &[u8],
    reverse: bool,
    visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
) -> Result<(), StoreError> {
    match prefix_end(prefix) {
        Some(end) => store.scan(
            Bound::Included(prefix),
            Bound::Excluded(&end),
            reverse,
            visit,
        ),
        None => store.scan(Bound::Included(prefix), Bound::Unbounded, reverse, visit),
    }
}

/// The smallest key greater than every key with this prefix (`None`: no such key).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// How many entries [`differences`] reads from each store per step: bounds its memory
/// on stores of any size.
const DIFF_CHUNK: usize = 1024;

/// One key whose value differs between two stores (`None`: absent on that side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub key: Vec<u8>,
    pub left: Option<Vec<u8>>,
    pub right: Option<Vec<u8>>,
}

/// The first `limit` keys (in key order) whose values differ between `left` and
/// `right`: what an operator needs when two digests disagree. Reads both stores in
/// chunks of [`DIFF_CHUNK`] entries, never whole.
pub fn differences(
    left: &dyn ProjectionStore,
    right: &dyn ProjectionStore,
    limit: usize,
) -> Result<Vec<Difference>, StoreError> {
    type Entry = (Vec<u8>, Vec<u8>);
    fn chunk(store: &dyn ProjectionStore, after: Option<&[u8]>) -> Result<Vec<Entry>, StoreError> {
        let mut entries = Vec::with_capacity(DIFF_CHUNK);
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        store.scan(start, Bound::Unbounded, false, &mut |k, v| {
            entries.push((k.to_vec(), v.to_vec()));
            if entries.len() == DIFF_CHUNK {
                Visit::Stop
            } else {
                Visit::Continue
            }
        })?;
        Ok(entries)
    }
    let mut found = Vec::new();
    if limit == 0 {
        return Ok(found);
    }
    let mut after: Option<Vec<u8>> = None;
    loop {
        let a = chunk(left, after.as_deref())?;
        let b = chunk(right, after.as_deref())?;
        // Only keys up to the smaller full chunk's last key are known on both sides.
        let full_last = |entries: &[Entry]| {
            (entries.len() == DIFF_CHUNK).then(|| entries[entries.len() - 1].0.clone())
        };
        let bound = match (full_last(&a), full_last(&b)) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        let within = |key: &Vec<u8>| bound.as_ref().is_none_or(|bound| key <= bound);
        let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
        loop {
            let next_a = a.peek().filter(|(k, _)| within(k)).map(|(k, _)| k.clone());
            let next_b = b.peek().filter(|(k, _)| within(k)).map(|(k, _)| k.clone());
            let difference = match (next_a, next_b) {
                (None, None) => break,
                (Some(ka), Some(kb)) if ka == kb => {
                    let ((key, va), (_, vb)) = (a.next().unwrap(), b.next().unwrap());
                    (va != vb).then_some(Difference {
                        key,
                        left: Some(va),
                        right: Some(vb),
                    })
                }
                (Some(ka), kb) if kb.as_ref().is_none_or(|kb| &ka < kb) => {
                    let (key, va) = a.next().unwrap();
                    Some(Difference {
                        key,
                        left: Some(va),
                        right: None,
                    })
                }
                _ => {
                    let (key, vb) = b.next().unwrap();
                    Some(Difference {
                        key,
                        left: None,
                        right: Some(vb),
                    })
                }
            };
            if let Some(difference) = difference {
                found.push(difference);
                if found.len() == limit {
                    return Ok(found);
                }
            }
        }
        match bound {
            Some(bound) => after = Some(bound),
            None => return Ok(found),
        }
    }
}

/// A shared store is a store (a checkpointing layer over a store that outlives it, as
/// in crash tests).
impl<S: ProjectionStore + ?Sized> ProjectionStore for std::sync::Arc<S> {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        (**self).get(key)
    }
    fn unwritten(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        (**self).unwritten(key)
    }
    fn retired_layers(&self) -> Option<u64> {
        (**self).retired_layers()
    }
    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        (**self).scan(start, end, reverse, visit)
    }
    fn scan_in_steps(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        (**self).scan_in_steps(start, end, reverse, visit)
    }
    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        (**self).apply(changes, positions)
    }
    fn apply_shared(
        &self,
        changes: Vec<SharedChange>,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        (**self).apply_shared(changes, positions)
    }
    fn apply_from(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        (**self).apply_from(changes, positions)
    }
    fn apply_from_noting_durable(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
        durable: &dyn Fn(),
    ) -> Result<(), StoreError> {
        (**self).apply_from_noting_durable(changes, positions, durable)
    }
    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        (**self).position(partition)
    }
    fn flush(&self) -> Result<(), StoreError> {
        (**self).flush()
    }
    fn flush_aux(&self) -> Result<(), StoreError> {
        (**self).flush_aux()
    }
    fn keeps_layer_copies(&self) -> bool {
        (**self).keeps_layer_copies()
    }
    fn stored_positions(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        (**self).stored_positions()
    }
    fn save_layer_copy(
        &self,
        over: &[(u32, u64)],
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        (**self).save_layer_copy(over, changes, positions)
    }
    fn tick(&self) -> Result<(), StoreError> {
        (**self).tick()
    }
    fn checkpoint_age(&self) -> Option<std::time::Duration> {
        (**self).checkpoint_age()
    }
    fn dirty_keys(&self) -> usize {
        (**self).dirty_keys()
    }
    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        (**self).aux_get(key)
    }
    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        (**self).aux_put(key, value)
    }
    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        (**self).aux_scan(visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn store_of(entries: &BTreeMap<u16, u8>) -> MemoryStore {
        let store = MemoryStore::new();
        let changes = entries
            .iter()
            .map(|(k, v)| (k.to_be_bytes().to_vec(), Some(vec![*v])))
            .collect();
        store.apply(changes, &[]).unwrap();
        store
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any two stores (larger than a chunk, so chunk edges fall anywhere): the
        /// differences are exactly those of a comparison of the whole maps, in order.
        #[test]
        fn differences_are_those_of_the_whole_maps(
            left in prop::collection::btree_map(0u16..4000, 0u8..3, 0..2500),
            right in prop::collection::btree_map(0u16..4000, 0u8..3, 0..2500),
            limit in 1usize..5000,
        ) {
            let keys: std::collections::BTreeSet<u16> =
                left.keys().chain(right.keys()).copied().collect();
            let expected: Vec<Difference> = keys
                .into_iter()
                .filter(|k| left.get(k) != right.get(k))
                .map(|k| Difference {
                    key: k.to_be_bytes().to_vec(),
                    left: left.get(&k).map(|v| vec![*v]),
                    right: right.get(&k).map(|v| vec![*v]),
                })
                .take(limit)
                .collect();
            let found = differences(&store_of(&left), &store_of(&right), limit).unwrap();
            prop_assert_eq!(found, expected);
        }
    }
}
