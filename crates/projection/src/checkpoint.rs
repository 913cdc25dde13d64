//! Hot state in memory, the inner store as its checkpoint.
//!
//! [`CheckpointStore`] wraps a durable [`ProjectionStore`] (sled). Applied batches go
//! into an in-memory write-back layer, newest value per key, and reads see that layer
//! over the inner store. A **checkpoint** writes the whole layer and the positions it
//! brings the projection to in one atomic batch of the inner store, then empties the
//! layer. A checkpoint is taken when the layer holds [`CHECKPOINT_MAX_DIRTY_KEYS`]
//! keys, when the oldest unwritten change is [`CHECKPOINT_EVERY_MS`] old (checked on
//! every apply and on [`ProjectionStore::tick`]), and on `flush`.
//!
//! Why: a usage bucket is rewritten by every event that lands in it; in the layer
//! those rewrites coalesce, so the durable store sees one write per bucket per
//! checkpoint instead of one per chunk, and sled receives a few large batches instead
//! of many small ones.
//!
//! Crash safety (the checkpoint protocol): the inner store only ever holds a prefix
//! of applied batches together with exactly the positions that prefix reaches (each
//! checkpoint is one atomic inner batch). After a crash the projector resumes from
//! those positions and the log supplies the rest, so losing the layer loses nothing:
//! apply is deterministic, and re-applying the lost batches rebuilds the same state.
//! `position` answers from memory (what has been applied and is visible to reads),
//! which is what read-your-writes waits on.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::{Change, ProjectionStore, StoreError, Visit};

/// Keys the layer holds before a checkpoint is forced. Bounds memory (a stored event
/// is ~300 bytes, so ~60 MiB at the bound) and the size of one inner batch.
pub const CHECKPOINT_MAX_DIRTY_KEYS: usize = 5_000;

/// Age of the oldest unwritten change that forces a checkpoint. Bounds how much of
/// the log a restart re-applies (about one second of records).
pub const CHECKPOINT_EVERY_MS: u64 = 1_000;

/// The write-back layer: unwritten changes and the positions they reach.
#[derive(Debug, Default)]
struct Layer {
    changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    positions: BTreeMap<u32, u64>,
    /// When the oldest unwritten change was applied (`None`: nothing unwritten).
    since: Option<Instant>,
}

/// A projection store with an in-memory write-back layer over a durable one.
#[derive(Debug)]
pub struct CheckpointStore<S> {
    inner: S,
    layer: RwLock<Layer>,
    /// Serialises writers (applies and checkpoints), so a checkpoint writes a layer no
    /// apply is changing; readers only take `layer`'s read lock.
    writer: Mutex<()>,
    max_dirty_keys: usize,
    every: Duration,
}

impl<S: ProjectionStore> CheckpointStore<S> {
    pub fn new(inner: S) -> Self {
        Self::with_limits(
            inner,
            CHECKPOINT_MAX_DIRTY_KEYS,
            Duration::from_millis(CHECKPOINT_EVERY_MS),
        )
    }

    /// With other thresholds (tests force checkpoints at chosen points).
    pub fn with_limits(inner: S, max_dirty_keys: usize, every: Duration) -> Self {
        CheckpointStore {
            inner,
            layer: RwLock::new(Layer::default()),
            writer: Mutex::new(()),
            max_dirty_keys,
            every,
        }
    }

    /// The durable store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Keys changed since the last checkpoint.
    pub fn dirty_keys(&self) -> usize {
        self.read_layer().changes.len()
    }

    /// Writes the layer and its positions to the inner store in one batch, then
    /// empties the layer. Readers see the layer until the inner batch is written.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.checkpoint_locked()
    }

    fn checkpoint_locked(&self) -> Result<(), StoreError> {
        let (changes, positions) = {
            let layer = self.read_layer();
            if layer.since.is_none() && layer.positions.is_empty() {
                return Ok(());
            }
            let changes: Vec<Change> = layer
                .changes
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let positions: Vec<(u32, u64)> =
                layer.positions.iter().map(|(p, o)| (*p, *o)).collect();
            (changes, positions)
        };
        // Only this writer changes the layer, so what was copied is still all of it.
        self.inner.apply(changes, &positions)?;
        let mut layer = self.layer.write().unwrap_or_else(|p| p.into_inner());
        *layer = Layer::default();
        Ok(())
    }

    fn due(&self, layer: &Layer) -> bool {
        layer.changes.len() >= self.max_dirty_keys
            || layer
                .since
                .is_some_and(|since| since.elapsed() >= self.every)
    }

    fn read_layer(&self) -> std::sync::RwLockReadGuard<'_, Layer> {
        self.layer.read().unwrap_or_else(|p| p.into_inner())
    }
}

impl<S: ProjectionStore> ProjectionStore for CheckpointStore<S> {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(value) = self.read_layer().changes.get(key) {
            return Ok(value.clone());
        }
        self.inner.get(key)
    }

    /// The inner store's entries merged with the layer's: a key the layer holds is
    /// taken from the layer (its value, or skipped when deleted there).
    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        let mut pending: Vec<(Vec<u8>, Option<Vec<u8>>)> = self
            .read_layer()
            .changes
            .range::<[u8], _>((start, end))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !reverse {
            pending.reverse();
        }
        // `pending` is now ordered so that `pop` yields the next key in scan order.
        let before = |a: &[u8], b: &[u8]| if reverse { a > b } else { a < b };
        let mut stopped = false;
        let emit =
            |visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit, k: &[u8], v: &Option<Vec<u8>>| match v {
                Some(v) => visit(k, v) == Visit::Stop,
                None => false,
            };
        self.inner.scan(start, end, reverse, &mut |key, value| {
            while let Some((next, _)) = pending.last() {
                if !before(next, key) {
                    break;
                }
                let (next, change) = pending.pop().expect("checked");
                if emit(visit, &next, &change) {
                    stopped = true;
                    return Visit::Stop;
                }
            }
            if pending
                .last()
                .is_some_and(|(next, _)| next.as_slice() == key)
            {
                let (next, change) = pending.pop().expect("checked");
                if emit(visit, &next, &change) {
                    stopped = true;
                    return Visit::Stop;
                }
                return Visit::Continue;
            }
            if visit(key, value) == Visit::Stop {
                stopped = true;
                return Visit::Stop;
            }
            Visit::Continue
        })?;
        if !stopped {
            while let Some((next, change)) = pending.pop() {
                if emit(visit, &next, &change) {
                    break;
                }
            }
        }
        Ok(())
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let due = {
            let mut layer = self.layer.write().unwrap_or_else(|p| p.into_inner());
            if !changes.is_empty() && layer.since.is_none() {
                layer.since = Some(Instant::now());
            }
            for (key, value) in changes {
                layer.changes.insert(key, value);
            }
            for (partition, next_offset) in positions {
                layer.positions.insert(*partition, *next_offset);
            }
            if layer.since.is_none() && !layer.positions.is_empty() {
                // Positions alone (records that changed nothing) still age.
                layer.since = Some(Instant::now());
            }
            self.due(&layer)
        };
        if due {
            self.checkpoint_locked()?;
        }
        Ok(())
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        if let Some(next_offset) = self.read_layer().positions.get(&partition) {
            return Ok(*next_offset);
        }
        self.inner.position(partition)
    }

    /// A checkpoint, then the inner store's flush: everything applied is durable.
    fn flush(&self) -> Result<(), StoreError> {
        self.checkpoint()?;
        self.inner.flush()
    }

    /// The aux space is written through, so only the inner store needs flushing.
    fn flush_aux(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }

    fn tick(&self) -> Result<(), StoreError> {
        let due = self.due(&self.read_layer());
        if due {
            self.checkpoint()?;
        }
        Ok(())
    }

    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.aux_get(key)
    }

    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        self.inner.aux_put(key, value)
    }

    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        self.inner.aux_scan(visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    fn put(key: &str, value: &str) -> Change {
        (key.as_bytes().to_vec(), Some(value.as_bytes().to_vec()))
    }

    fn keys(store: &dyn ProjectionStore, reverse: bool) -> Vec<String> {
        let mut seen = Vec::new();
        store
            .scan(Bound::Unbounded, Bound::Unbounded, reverse, &mut |k, v| {
                seen.push(format!(
                    "{}={}",
                    String::from_utf8_lossy(k),
                    String::from_utf8_lossy(v)
                ));
                Visit::Continue
            })
            .unwrap();
        seen
    }

    #[test]
    fn nothing_reaches_the_inner_store_before_a_checkpoint() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        store.apply(vec![put("a", "1")], &[(0, 5)]).unwrap();
        assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(store.position(0).unwrap(), 5);
        assert_eq!(store.inner().get(b"a").unwrap(), None);
        assert_eq!(store.inner().position(0).unwrap(), 0);
        store.checkpoint().unwrap();
        assert_eq!(store.inner().get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(store.inner().position(0).unwrap(), 5);
        assert_eq!(store.dirty_keys(), 0);
    }

    #[test]
    fn scans_merge_the_layer_over_the_inner_store_in_both_directions() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::from_secs(60));
        store
            .apply(vec![put("b", "old"), put("d", "old"), put("f", "old")], &[])
            .unwrap();
        store.checkpoint().unwrap();
        store
            .apply(
                vec![
                    put("a", "new"),
                    put("d", "new"),
                    (b"f".to_vec(), None),
                    put("g", "new"),
                ],
                &[],
            )
            .unwrap();
        let forward = keys(&store, false);
        assert_eq!(forward, ["a=new", "b=old", "d=new", "g=new"]);
        let mut backward = keys(&store, true);
        backward.reverse();
        assert_eq!(backward, forward);
        let mut first_two = Vec::new();
        store
            .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |k, _| {
                first_two.push(k.to_vec());
                if first_two.len() == 2 {
                    Visit::Stop
                } else {
                    Visit::Continue
                }
            })
            .unwrap();
        assert_eq!(first_two, [b"a".to_vec(), b"b".to_vec()]);
        store.checkpoint().unwrap();
        assert_eq!(keys(store.inner(), false), forward);
    }

    #[test]
    fn a_full_layer_or_an_old_change_forces_a_checkpoint() {
        let store = CheckpointStore::with_limits(MemoryStore::new(), 3, Duration::from_secs(60));
        store
            .apply(vec![put("a", "1"), put("b", "1")], &[(0, 2)])
            .unwrap();
        assert_eq!(store.inner().position(0).unwrap(), 0);
        store.apply(vec![put("c", "1")], &[(0, 3)]).unwrap();
        assert_eq!(
            store.inner().position(0).unwrap(),
            3,
            "three keys: checkpointed"
        );

        let store = CheckpointStore::with_limits(MemoryStore::new(), 100, Duration::ZERO);
        store.apply(vec![put("a", "1")], &[(1, 9)]).unwrap();
        assert_eq!(
            store.inner().position(1).unwrap(),
            9,
            "every change is old at once"
        );
        store.apply(vec![], &[(1, 10)]).unwrap();
        store.tick().unwrap();
        assert_eq!(
            store.inner().position(1).unwrap(),
            10,
            "positions alone are kept too"
        );
    }
}
