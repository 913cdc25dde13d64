//! A split cluster's checkpoints, mirrored to the changelog: the store under the
//! checkpoint layer that, before each checkpoint reaches sled, writes the rows of
//! every partition this node owns to the partition's changelog, with the position
//! they are the state at (deploy/README.md, "Restore from the changelog").
//!
//! The rules that keep a changelog partition equal to the partition's state at its
//! last marker:
//! - only the partitions the cluster assigned this node are written, and none this
//!   node is still restoring (it holds a skip mark: its rows are not yet the state
//!   at the position);
//! - the first write of a partition since this node gained it (or since a write of
//!   it failed, or once the epoch is due: `Base::due`) is a reset holding every row
//!   of the partition, so nothing depends on what another node wrote or failed to
//!   write before;
//! - a checkpoint's changelog writes end before it reaches sled: a crash between
//!   the two re-applies the same records and writes the same rows again.
//!
//! A failed changelog write never fails the checkpoint: the partition's next write
//! is a reset again, and until then a restore reads the last complete checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;
use std::sync::{Arc, Mutex, OnceLock};

use tally_log::changelog::Changelog;
use tally_projection::{Change, ChangeSource, ProjectionStore, SharedChange, StoreError, Visit};
use tally_runtime::Ownership;

use crate::key_home::{key_home, KeyHome};
use crate::keys::{self, Key};

/// A checkpoint's rows of one partition, by key (`None`: deleted).
pub type PartitionRows = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// Stored rows (key, value), by partition.
pub type RowsByPartition = BTreeMap<u32, Vec<(Vec<u8>, Vec<u8>)>>;

/// Which partitions' changelogs a row goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPartitions {
    None,
    One(u32),
    /// Every partition's (`KeyHome::AllPartitions`).
    All,
}

impl RowPartitions {
    /// Whether the row goes to `partition`'s changelog.
    pub fn include(self, partition: u32) -> bool {
        match self {
            RowPartitions::None => false,
            RowPartitions::One(p) => p == partition,
            RowPartitions::All => true,
        }
    }
}

/// Resolves a row's home to the log partitions it belongs to.
pub struct Homes<'s> {
    store: &'s dyn ProjectionStore,
    partitions: u32,
    /// API keys (raw SHA-256) created in the batch being resolved, with their
    /// store: a claim may be made in the same checkpoint as its key.
    fresh_keys: BTreeMap<Vec<u8>, String>,
    /// Stores of the API keys looked up so far (by hex SHA-256): a key's claims
    /// are many rows, and a revoked key's lookup scans the `]` table.
    looked_up: std::cell::RefCell<BTreeMap<String, Option<String>>>,
}

impl<'s> Homes<'s> {
    pub fn new(store: &'s dyn ProjectionStore, partitions: u32) -> Homes<'s> {
        Homes {
            store,
            partitions,
            fresh_keys: BTreeMap::new(),
            looked_up: Default::default(),
        }
    }

    /// Notes an `K` row of the batch (its store is in its value).
    fn note_key_row(&mut self, key: &[u8], value: Option<&[u8]>) {
        if let (Some(hash), Some(value)) = (key.strip_prefix(&[keys::API_KEY]), value) {
            if let Some(store) = store_of_key_row(value) {
                self.fresh_keys.insert(hash.to_vec(), store);
            }
        }
    }

    /// The partitions of the row at `key`.
    pub fn partitions(&self, key: &[u8]) -> Result<RowPartitions, StoreError> {
        let home = key_home(key).map_err(|error| StoreError::Corrupt(error.to_string()))?;
        Ok(match home {
            KeyHome::EveryNode | KeyHome::Node => RowPartitions::None,
            KeyHome::AllPartitions => RowPartitions::All,
            KeyHome::Position { partition, .. } => RowPartitions::One(partition),
            KeyHome::Store(store) => RowPartitions::One(self.store_partition(store)),
            KeyHome::ApiKey(hex_hash) => match self.api_key_store_once(hex_hash)? {
                Some(store) => RowPartitions::One(self.store_partition(&store)),
                None => RowPartitions::None,
            },
        })
    }

    fn store_partition(&self, store: &str) -> u32 {
        tally_log::partition_of(store.as_bytes(), self.partitions)
    }

    /// `api_key_store`, each key looked up once.
    fn api_key_store_once(&self, hex_hash: &str) -> Result<Option<String>, StoreError> {
        if let Some(store) = self.looked_up.borrow().get(hex_hash) {
            return Ok(store.clone());
        }
        let store = self.api_key_store(hex_hash)?;
        self.looked_up
            .borrow_mut()
            .insert(hex_hash.to_string(), store.clone());
        Ok(store)
    }

    /// The store of the API key with this hex SHA-256: its `K` row, or for a
    /// revoked key (no `K` row left) the `]` row that still names it.
    fn api_key_store(&self, hex_hash: &str) -> Result<Option<String>, StoreError> {
        let Ok(hash) = hex::decode(hex_hash) else {
            return Ok(None);
        };
        if let Some(store) = self.fresh_keys.get(&hash) {
            return Ok(Some(store.clone()));
        }
        let auth = Key::table(keys::API_KEY).tail(&hash).into_bytes();
        if let Some(value) = self.store.get(&auth)? {
            return Ok(store_of_key_row(&value));
        }
        let mut found = None;
        tally_projection::scan_prefix(
            self.store,
            &[keys::API_KEY_ID],
            false,
            &mut |key, value| {
                if value.starts_with(&hash) {
                    found = crate::keys::read_text(key, 1).map(|(store, _)| store.to_string());
                    return Visit::Stop;
                }
                Visit::Continue
            },
        )?;
        Ok(found)
    }
}

/// The store id of a `K` row's value (store id, then a mode byte).
fn store_of_key_row(value: &[u8]) -> Option<String> {
    let (_, store) = value.split_last()?;
    String::from_utf8(store.to_vec()).ok()
}

/// Every row of `store` that belongs to one of `wanted`, by partition.
pub fn rows_of_partitions(
    store: &dyn ProjectionStore,
    partitions: u32,
    wanted: &BTreeSet<u32>,
) -> Result<RowsByPartition, StoreError> {
    let homes = Homes::new(store, partitions);
    let mut rows = RowsByPartition::new();
    let mut failure = None;
    store.scan(
        Bound::Unbounded,
        Bound::Unbounded,
        false,
        &mut |key, value| {
            match homes.partitions(key) {
                Ok(home) => {
                    for partition in wanted.iter().filter(|p| home.include(**p)) {
                        rows.entry(*partition)
                            .or_default()
                            .push((key.to_vec(), value.to_vec()));
                    }
                }
                Err(error) => {
                    failure = Some(error);
                    return Visit::Stop;
                }
            }
            Visit::Continue
        },
    )?;
    match failure {
        Some(error) => Err(error),
        None => Ok(rows),
    }
}

/// What decides which partitions a checkpoint writes to the changelog.
#[derive(Debug)]
pub struct ChangelogWriter {
    changelog: Arc<dyn Changelog>,
    partitions: u32,
    /// The runtime's ownership, bound once the runtime exists (nothing is written
    /// before).
    ownership: OnceLock<Arc<Ownership>>,
    /// Partitions written since this node gained them, from a reset: their next
    /// write holds only the checkpoint's rows, until `Base::due` says it is time
    /// for a new reset.
    based: Mutex<BTreeMap<u32, Base>>,
}

/// Age of a changelog epoch past which the next write starts a new one: well
/// inside the topic's retention (`tally_log::changelog::CHANGELOG_RETENTION_MS`),
/// so the reset a restore reads from is never the one retention deletes.
pub const CHANGELOG_EPOCH_MAX_AGE_MS: u64 = 24 * 3_600_000;

/// Rows an epoch may write after its reset, at the least, before a new reset:
/// a restore reads the reset and everything after it, so past the reset's own
/// size (or this, for a small partition) a new reset costs less than reading on.
pub const CHANGELOG_REBASE_MIN_ROWS: usize = 10_000;

/// What this node wrote of one partition since its last reset.
#[derive(Debug, Clone, Copy)]
struct Base {
    reset_rows: usize,
    rows_since: usize,
    at: std::time::Instant,
}

impl Base {
    fn due(&self) -> bool {
        self.rows_since > self.reset_rows.max(CHANGELOG_REBASE_MIN_ROWS)
            || self.at.elapsed() >= std::time::Duration::from_millis(CHANGELOG_EPOCH_MAX_AGE_MS)
    }
}

impl ChangelogWriter {
    pub fn new(changelog: Arc<dyn Changelog>, partitions: u32) -> Arc<ChangelogWriter> {
        Arc::new(ChangelogWriter {
            changelog,
            partitions,
            ownership: OnceLock::new(),
            based: Mutex::new(BTreeMap::new()),
        })
    }

    /// Starts writing, for the partitions `ownership` assigns.
    pub fn bind(&self, ownership: Arc<Ownership>) {
        let _ = self.ownership.set(ownership);
    }

    /// The partitions assigned to this node by its cluster (none before the first
    /// assignment: a node then projects everything, and writes nothing).
    fn assigned(&self) -> BTreeSet<u32> {
        self.ownership
            .get()
            .and_then(|ownership| ownership.projecting())
            .unwrap_or_default()
    }

    /// Writes the changelog of a checkpoint about to reach `inner`.
    fn write(
        &self,
        inner: &dyn ProjectionStore,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        let assigned = self.assigned();
        let mut based = self.based.lock().unwrap_or_else(|p| p.into_inner());
        for lost in based.keys().filter(|p| !assigned.contains(p)) {
            self.changelog.release(*lost);
        }
        based.retain(|p, base| assigned.contains(p) && !base.due());
        if assigned.is_empty() {
            return Ok(());
        }
        // The checkpoint's rows of the assigned partitions, and the skip marks it
        // moves.
        let mut homes = Homes::new(inner, self.partitions);
        changes.visit_changes(&mut |key, value| {
            homes.note_key_row(key, value);
            Ok(())
        })?;
        let mut rows: BTreeMap<u32, PartitionRows> = BTreeMap::new();
        let mut marks: BTreeMap<u32, bool> = BTreeMap::new();
        changes.visit_changes(&mut |key, value| {
            if key.first() == Some(&keys::PARTITION_SKIPPED) {
                if let Some(partition) = skip_mark_partition(key) {
                    marks.insert(partition, value.is_some());
                }
            }
            let home = homes.partitions(key)?;
            for partition in assigned.iter().filter(|p| home.include(**p)) {
                rows.entry(*partition)
                    .or_default()
                    .insert(key.to_vec(), value.map(<[u8]>::to_vec));
            }
            Ok(())
        })?;
        let mut writable = BTreeSet::new();
        for partition in &assigned {
            let restoring = match marks.get(partition) {
                Some(marked) => *marked,
                None => inner
                    .get(&keys::partition_skipped_key(*partition))?
                    .is_some(),
            };
            if restoring {
                based.remove(partition);
            } else {
                writable.insert(*partition);
            }
        }
        let unbased: BTreeSet<u32> = writable
            .iter()
            .filter(|p| !based.contains_key(p))
            .copied()
            .collect();
        let mut whole = if unbased.is_empty() {
            BTreeMap::new()
        } else {
            rows_of_partitions(inner, self.partitions, &unbased)?
        };
        for partition in writable {
            let reset = unbased.contains(&partition);
            let mut batch = rows.remove(&partition).unwrap_or_default();
            if reset {
                for (key, value) in whole.remove(&partition).unwrap_or_default() {
                    batch.entry(key).or_insert(Some(value));
                }
                // After a reset a deleted row is simply absent.
                batch.retain(|_, value| value.is_some());
            } else if batch.is_empty() {
                continue;
            }
            let position = match positions.iter().find(|(p, _)| *p == partition) {
                Some((_, next)) => *next,
                None => inner.position(partition)?,
            };
            let batch: Vec<Change> = batch.into_iter().collect();
            match self.changelog.write(partition, reset, &batch, position) {
                Ok(()) => {
                    crate::metrics::Metrics::changelog_written("written", partition);
                    crate::metrics::Metrics::changelog_position(partition, position);
                    tracing::debug!(
                        partition,
                        position,
                        reset,
                        rows = batch.len(),
                        "wrote a checkpoint to the changelog"
                    );
                    if reset {
                        based.insert(
                            partition,
                            Base {
                                reset_rows: batch.len(),
                                rows_since: 0,
                                at: std::time::Instant::now(),
                            },
                        );
                    } else if let Some(base) = based.get_mut(&partition) {
                        base.rows_since = base.rows_since.saturating_add(batch.len());
                    }
                }
                Err(error) => {
                    crate::metrics::Metrics::changelog_written("failed", partition);
                    tracing::warn!(partition, %error,
                        "writing the changelog failed; its next checkpoint writes the whole partition");
                    based.remove(&partition);
                }
            }
        }
        Ok(())
    }
}

/// The partition of a `!` row's key.
fn skip_mark_partition(key: &[u8]) -> Option<u32> {
    let raw: [u8; 8] = key.get(1..9)?.try_into().ok()?;
    u32::try_from(u64::from_be_bytes(raw)).ok()
}

/// A projection store that mirrors its writes to the changelog first (module doc).
#[derive(Debug)]
pub struct ChangelogStore<S> {
    inner: S,
    writer: Arc<ChangelogWriter>,
}

impl<S: ProjectionStore> ChangelogStore<S> {
    pub fn new(inner: S, writer: Arc<ChangelogWriter>) -> Self {
        ChangelogStore { inner, writer }
    }
}

impl<S: ProjectionStore> ProjectionStore for ChangelogStore<S> {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }

    fn unwritten(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.inner.unwritten(key)
    }

    fn retired_layers(&self) -> Option<u64> {
        self.inner.retired_layers()
    }

    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        self.inner.scan(start, end, reverse, visit)
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        self.writer.write(&self.inner, &changes, positions)?;
        self.inner.apply(changes, positions)
    }

    fn apply_shared(
        &self,
        changes: Vec<SharedChange>,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        self.writer.write(&self.inner, &changes, positions)?;
        self.inner.apply_shared(changes, positions)
    }

    fn apply_from(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        self.writer.write(&self.inner, changes, positions)?;
        self.inner.apply_from(changes, positions)
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        self.inner.position(partition)
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }

    fn flush_aux(&self) -> Result<(), StoreError> {
        self.inner.flush_aux()
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
    use tally_domain::Mode;
    use tally_log::changelog::PartitionSnapshot;
    use tally_log::LogError;
    use tally_projection::MemoryStore;

    /// What the store wrote: (partition, reset, rows, position) per write.
    type Written = Vec<(u32, bool, Vec<Change>, u64)>;

    /// A changelog in memory that records writes and fails them on demand.
    #[derive(Debug, Default)]
    struct Recorded {
        written: Mutex<Written>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Changelog for Recorded {
        fn write(
            &self,
            partition: u32,
            reset: bool,
            rows: &[Change],
            position: u64,
        ) -> Result<(), LogError> {
            if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(LogError::Kafka("refused".into()));
            }
            self.written
                .lock()
                .unwrap()
                .push((partition, reset, rows.to_vec(), position));
            Ok(())
        }
        fn read(&self, _: u32) -> Result<Option<PartitionSnapshot>, LogError> {
            Ok(None)
        }
        fn release(&self, _: u32) {}
    }

    const PARTITIONS: u32 = 2;

    /// A store id on `partition`.
    fn store_on(partition: u32) -> String {
        (0..)
            .map(|i| format!("st_{i}"))
            .find(|s| tally_log::partition_of(s.as_bytes(), PARTITIONS) == partition)
            .unwrap()
    }

    fn customer(store: &str, id: &str) -> Vec<u8> {
        Key::scoped(keys::CUSTOMER, store, Mode::Test)
            .text(id)
            .into_bytes()
    }

    fn put(key: Vec<u8>) -> Change {
        (key, Some(b"v".to_vec()))
    }

    fn take(recorded: &Recorded) -> Written {
        std::mem::take(&mut *recorded.written.lock().unwrap())
    }

    #[test]
    fn only_assigned_partitions_are_written_and_the_first_write_is_whole() {
        let recorded = Arc::new(Recorded::default());
        let writer = ChangelogWriter::new(recorded.clone(), PARTITIONS);
        let store = ChangelogStore::new(MemoryStore::new(), writer.clone());
        let (zero, one) = (store_on(0), store_on(1));
        let api_key = Key::table(keys::STORE).text(&zero).into_bytes();

        // Before the runtime is bound (and before any assignment) nothing is written.
        store
            .apply(
                vec![put(customer(&zero, "a")), put(customer(&one, "b"))],
                &[(0, 1)],
            )
            .unwrap();
        assert!(take(&recorded).is_empty());

        let ownership = Arc::new(Ownership::everything(PARTITIONS));
        ownership.set_projecting(Some(BTreeSet::from([0])));
        writer.bind(ownership.clone());
        // The first write of partition 0 is a reset with all its rows; partition 1's
        // rows and what every node applies are not written.
        store
            .apply(
                vec![
                    put(customer(&zero, "c")),
                    put(customer(&one, "d")),
                    put(api_key),
                ],
                &[(0, 2)],
            )
            .unwrap();
        assert_eq!(
            take(&recorded),
            vec![(
                0,
                true,
                vec![put(customer(&zero, "a")), put(customer(&zero, "c"))],
                2
            )]
        );
        // Later writes hold the checkpoint's rows, deletes included.
        store
            .apply(
                vec![(customer(&zero, "a"), None), put(customer(&one, "e"))],
                &[(0, 3), (1, 9)],
            )
            .unwrap();
        assert_eq!(
            take(&recorded),
            vec![(0, false, vec![(customer(&zero, "a"), None)], 3)]
        );
        // A checkpoint without rows of the partition writes nothing.
        store
            .apply(vec![put(customer(&one, "f"))], &[(1, 10)])
            .unwrap();
        assert!(take(&recorded).is_empty());
    }

    #[test]
    fn a_restoring_partition_or_a_failed_write_makes_the_next_write_whole() {
        let recorded = Arc::new(Recorded::default());
        let writer = ChangelogWriter::new(recorded.clone(), PARTITIONS);
        let store = ChangelogStore::new(MemoryStore::new(), writer.clone());
        let ownership = Arc::new(Ownership::everything(PARTITIONS));
        ownership.set_projecting(Some(BTreeSet::from([1])));
        writer.bind(ownership);
        let one = store_on(1);
        store
            .apply(vec![put(customer(&one, "a"))], &[(1, 1)])
            .unwrap();
        assert_eq!(take(&recorded).len(), 1);

        // Partition 1 is being restored: not written.
        let mark = keys::partition_skipped_key(1);
        store
            .apply(
                vec![
                    put(customer(&one, "b")),
                    (mark.clone(), Some(5u64.to_be_bytes().to_vec())),
                ],
                &[],
            )
            .unwrap();
        store.apply(vec![put(customer(&one, "c"))], &[]).unwrap();
        assert!(take(&recorded).is_empty());
        // Restored: the next write is whole.
        store.apply(vec![(mark, None)], &[]).unwrap();
        let written = take(&recorded);
        assert_eq!(written.len(), 1);
        assert!(written[0].1, "a reset");
        assert_eq!(written[0].2.len(), 3, "{written:?}");
        assert_eq!(written[0].3, 1, "the stored position");

        // A failed write fails nothing, and the next write is whole again.
        recorded
            .fail
            .store(true, std::sync::atomic::Ordering::SeqCst);
        store
            .apply(vec![put(customer(&one, "d"))], &[(1, 2)])
            .unwrap();
        assert_eq!(
            store.get(&customer(&one, "d")).unwrap(),
            Some(b"v".to_vec())
        );
        recorded
            .fail
            .store(false, std::sync::atomic::Ordering::SeqCst);
        store
            .apply(vec![put(customer(&one, "e"))], &[(1, 3)])
            .unwrap();
        let written = take(&recorded);
        assert_eq!(written.len(), 1);
        assert!(written[0].1, "a reset after a failure");
        assert_eq!(written[0].2.len(), 5);
    }

    #[test]
    fn an_epoch_that_outgrew_its_reset_starts_again_from_one() {
        let recorded = Arc::new(Recorded::default());
        let writer = ChangelogWriter::new(recorded.clone(), PARTITIONS);
        let store = ChangelogStore::new(MemoryStore::new(), writer.clone());
        let ownership = Arc::new(Ownership::everything(PARTITIONS));
        ownership.set_projecting(Some(BTreeSet::from([0])));
        writer.bind(ownership);
        let zero = store_on(0);
        store
            .apply(vec![put(customer(&zero, "a"))], &[(0, 1)])
            .unwrap();
        let many: Vec<Change> = (0..=CHANGELOG_REBASE_MIN_ROWS)
            .map(|i| put(customer(&zero, &format!("c{i}"))))
            .collect();
        store.apply(many, &[(0, 2)]).unwrap();
        let resets: Vec<bool> = take(&recorded).iter().map(|w| w.1).collect();
        assert_eq!(resets, vec![true, false]);
        store
            .apply(vec![put(customer(&zero, "b"))], &[(0, 3)])
            .unwrap();
        let written = take(&recorded);
        assert!(written[0].1, "a new reset");
        assert_eq!(written[0].2.len(), CHANGELOG_REBASE_MIN_ROWS + 3);
    }

    #[test]
    fn a_claim_goes_with_its_api_keys_store_even_once_the_key_is_revoked() {
        let store = MemoryStore::new();
        let zero = store_on(0);
        let one = store_on(1);
        let hash = [7u8; 32];
        let claim = Key::table(keys::IDEMPOTENCY)
            .text(&hex::encode(hash))
            .tail(b"k")
            .into_bytes();
        let homes = Homes::new(&store, PARTITIONS);
        assert_eq!(homes.partitions(&claim).unwrap(), RowPartitions::None);
        // The key's `K` row names its store.
        let auth = Key::table(keys::API_KEY).tail(&hash).into_bytes();
        let scope = [one.as_bytes(), &[Mode::Test.key_byte()]].concat();
        store.apply(vec![(auth.clone(), Some(scope))], &[]).unwrap();
        assert_eq!(
            Homes::new(&store, PARTITIONS).partitions(&claim).unwrap(),
            RowPartitions::One(1)
        );
        // Revoked: the `]` row still names it.
        let index = Key::table(keys::API_KEY_ID)
            .text(&zero)
            .text("key_1")
            .into_bytes();
        let value = [&hash[..], &[Mode::Test.key_byte(), 1]].concat();
        store
            .apply(vec![(auth, None), (index, Some(value))], &[])
            .unwrap();
        assert_eq!(
            Homes::new(&store, PARTITIONS).partitions(&claim).unwrap(),
            RowPartitions::One(0)
        );
    }
}
