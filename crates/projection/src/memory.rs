//! In-memory implementation: for unit tests of the engine and for `tally replay`'s
//! comparisons. Same semantics as sled, nothing durable.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::RwLock;

use crate::{Change, ProjectionStore, StoreError, Visit};

#[derive(Debug, Default)]
pub struct MemoryStore {
    projections: RwLock<BTreeMap<Vec<u8>, Vec<u8>>>,
    positions: RwLock<BTreeMap<u32, u64>>,
    aux: RwLock<BTreeMap<Vec<u8>, Vec<u8>>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }
}

impl ProjectionStore for MemoryStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.projections.read().expect("lock").get(key).cloned())
    }

    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        let map = self.projections.read().expect("lock");
        let range = map.range::<[u8], _>((start, end));
        let iter: Box<dyn Iterator<Item = (&Vec<u8>, &Vec<u8>)>> = if reverse {
            Box::new(range.rev())
        } else {
            Box::new(range)
        };
        for (k, v) in iter {
            if visit(k, v) == Visit::Stop {
                break;
            }
        }
        Ok(())
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        let mut map = self.projections.write().expect("lock");
        let mut stored_positions = self.positions.write().expect("lock");
        for (key, value) in changes {
            match value {
                Some(v) => map.insert(key, v),
                None => map.remove(&key),
            };
        }
        for (partition, offset) in positions {
            stored_positions.insert(*partition, *offset);
        }
        Ok(())
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        Ok(self
            .positions
            .read()
            .expect("lock")
            .get(&partition)
            .copied()
            .unwrap_or(0))
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.aux.read().expect("lock").get(key).cloned())
    }

    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        let mut aux = self.aux.write().expect("lock");
        match value {
            Some(v) => aux.insert(key.to_vec(), v.to_vec()),
            None => aux.remove(key),
        };
        Ok(())
    }

    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        for (k, v) in self.aux.read().expect("lock").iter() {
            if visit(k, v) == Visit::Stop {
                break;
            }
        }
        Ok(())
    }
}
