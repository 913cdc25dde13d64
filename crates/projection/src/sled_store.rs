//! sled implementation. Projections and positions share one tree, so a batch and its
//! positions commit atomically (`apply_batch` is atomic per tree).
//!
//! **Large batches are staged.** A sled batch takes a process-wide write lock that
//! stops every read until it ends, and holds every page it touches: checkpoints of
//! 50,000 keys as one batch took the ingest benchmark's server from ~450 MiB to
//! 1.8 GiB and stalled the projector's reads for the whole write. A batch of more
//! than [`SLED_ATOMIC_BATCH_MAX_KEYS`] changes is therefore written in three steps:
//! 1. the whole batch and its positions, encoded, as a few stage values
//!    (`STAGE_PREFIX`), in one atomic sled batch;
//! 2. the changes, one key at a time (a single insert takes no global lock);
//! 3. one batch that removes the stage and writes the positions.
//!
//! Every change is a whole value (a put or a delete), never an increment, so writing
//! a staged batch twice is the same as writing it once. `open` finishes a stage a
//! crash interrupted (steps 2 and 3 again) before anything reads the store, so a
//! reader only ever sees a prefix of applied batches with exactly its positions.
//! sled writes its log in order, so if any write of step 2 survived a crash, the
//! stage written before it did too.

use std::ops::Bound;
use std::path::Path;

use crate::{Change, ProjectionStore, StoreError, Visit};

/// Positions live under this prefix, which sorts before every projection table
/// (their prefixes are printable letters) and is skipped by scans.
const POSITION_PREFIX: &[u8] = b"\x00pos\x00";
/// How often sled writes its buffers to disk in the background. Losing the last
/// interval on a crash is harmless: those batches are re-applied from the log.
pub const SLED_FLUSH_EVERY_MS: u64 = 500;
/// sled's page cache. Measured with the ingest benchmark: 256 MiB gave a 684 MiB
/// peak RSS, 64 MiB gives 429 MiB at the same throughput (within noise), and the hot
/// data (recent buckets) is small.
pub const SLED_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// Changes written in one atomic sled batch; a larger batch is staged (module doc).
/// Measured: sled's memory stays flat up to a few thousand keys per batch.
pub const SLED_ATOMIC_BATCH_MAX_KEYS: usize = 2_000;
/// The staged batch is split into values of at most this many bytes (sled keeps
/// large values whole in memory while writing them).
const STAGE_PIECE_BYTES: usize = 1 << 20;
/// Stage pieces live under this prefix: below the positions' end, so scans skip them.
const STAGE_PREFIX: &[u8] = b"\x00\x00stage\x00";
/// How long `open` waits for the directory's file lock. A process that exits frees
/// it at once, but a handle dropped inside this process frees it only when sled's
/// background flusher thread notices, up to a flush interval later; reopening a
/// store in the same process (tests, rebuilds) would otherwise fail at random.
pub const SLED_LOCK_WAIT_MS: u64 = 5_000;
/// Pause between attempts to take the file lock.
const SLED_LOCK_RETRY_MS: u64 = 20;

pub struct SledStore {
    db: sled::Db,
    projections: sled::Tree,
    aux: sled::Tree,
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SledStore")
    }
}

impl SledStore {
    pub fn open(dir: impl AsRef<Path>) -> Result<SledStore, StoreError> {
        let config = sled::Config::new()
            .path(dir.as_ref())
            .cache_capacity(SLED_CACHE_BYTES)
            .flush_every_ms(Some(SLED_FLUSH_EVERY_MS));
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_millis(SLED_LOCK_WAIT_MS);
        let db = loop {
            match config.open() {
                // sled reports a held lock as a plain I/O error ("Other"), so the
                // message is the only thing that tells it apart.
                Err(sled::Error::Io(e))
                    if e.to_string().contains("could not acquire lock")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(SLED_LOCK_RETRY_MS));
                }
                other => break other?,
            }
        };
        let projections = db.open_tree("projections")?;
        let aux = db.open_tree("aux")?;
        let store = SledStore {
            db,
            projections,
            aux,
        };
        store.finish_stage()?;
        Ok(store)
    }

    /// Finishes a staged batch a crash interrupted (module doc), if there is one.
    fn finish_stage(&self) -> Result<(), StoreError> {
        let mut encoded = Vec::new();
        let mut pieces = 0usize;
        for item in self.projections.scan_prefix(STAGE_PREFIX) {
            let (_, piece) = item?;
            encoded.extend_from_slice(&piece);
            pieces += 1;
        }
        if pieces == 0 {
            return Ok(());
        }
        let (changes, positions) = decode_stage(&encoded)?;
        self.materialize(changes, &positions, pieces)?;
        self.db.flush()?;
        Ok(())
    }

    /// Steps 2 and 3 of a staged batch.
    fn materialize(
        &self,
        changes: Vec<Change>,
        positions: &[(u32, u64)],
        pieces: usize,
    ) -> Result<(), StoreError> {
        // One key at a time: a sled batch takes a process-wide write lock that
        // stops every read (the projector's included) until it ends, a single
        // insert does not; step 2 needs no atomicity.
        for (key, value) in changes {
            match value {
                Some(v) => self.projections.insert(key, v)?,
                None => self.projections.remove(key)?,
            };
        }
        let mut last = sled::Batch::default();
        for piece in 0..pieces {
            last.remove(stage_key(piece));
        }
        for (partition, next_offset) in positions {
            last.insert(position_key(*partition), &next_offset.to_be_bytes());
        }
        self.projections.apply_batch(last)?;
        Ok(())
    }
}

impl SledStore {
    /// Step 1 of a staged batch: returns how many stage values it wrote.
    fn stage(&self, changes: &[Change], positions: &[(u32, u64)]) -> Result<usize, StoreError> {
        let encoded = encode_stage(changes, positions);
        let mut batch = sled::Batch::default();
        let mut pieces = 0;
        for piece in encoded.chunks(STAGE_PIECE_BYTES) {
            batch.insert(stage_key(pieces), piece);
            pieces += 1;
        }
        self.projections.apply_batch(batch)?;
        Ok(pieces)
    }
}

fn stage_key(piece: usize) -> Vec<u8> {
    let mut key = STAGE_PREFIX.to_vec();
    key.extend_from_slice(&(piece as u64).to_be_bytes());
    key
}

/// `[count u64] ([key len u32][key][0 | 1 [value len u32][value]])* [count u64]
/// ([partition u32][offset u64])*`
fn encode_stage(changes: &[Change], positions: &[(u32, u64)]) -> Vec<u8> {
    let size: usize = changes
        .iter()
        .map(|(k, v)| 9 + k.len() + v.as_ref().map_or(0, Vec::len))
        .sum();
    let mut out = Vec::with_capacity(size + 16 + positions.len() * 12);
    out.extend_from_slice(&(changes.len() as u64).to_be_bytes());
    for (key, value) in changes {
        out.extend_from_slice(&(key.len() as u32).to_be_bytes());
        out.extend_from_slice(key);
        match value {
            Some(value) => {
                out.push(1);
                out.extend_from_slice(&(value.len() as u32).to_be_bytes());
                out.extend_from_slice(value);
            }
            None => out.push(0),
        }
    }
    out.extend_from_slice(&(positions.len() as u64).to_be_bytes());
    for (partition, offset) in positions {
        out.extend_from_slice(&partition.to_be_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
    }
    out
}

type Stage = (Vec<Change>, Vec<(u32, u64)>);

fn decode_stage(bytes: &[u8]) -> Result<Stage, StoreError> {
    fn corrupt() -> StoreError {
        StoreError::Corrupt("a staged checkpoint batch does not decode".into())
    }
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], StoreError> {
        if bytes.len() < n {
            return Err(corrupt());
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    fn int<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], StoreError> {
        take(bytes, N)?.try_into().map_err(|_| corrupt())
    }
    let mut rest = bytes;
    let count = u64::from_be_bytes(int(&mut rest)?);
    // Each change takes at least 5 bytes: a count past that is corrupt, not a reason
    // to reserve memory.
    if count > (rest.len() / 5) as u64 {
        return Err(corrupt());
    }
    let mut changes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let key_len = u32::from_be_bytes(int(&mut rest)?) as usize;
        let key = take(&mut rest, key_len)?.to_vec();
        let value = match take(&mut rest, 1)?[0] {
            0 => None,
            1 => {
                let value_len = u32::from_be_bytes(int(&mut rest)?) as usize;
                Some(take(&mut rest, value_len)?.to_vec())
            }
            _ => return Err(corrupt()),
        };
        changes.push((key, value));
    }
    let count = u64::from_be_bytes(int(&mut rest)?);
    if count > (rest.len() / 12) as u64 {
        return Err(corrupt());
    }
    let mut positions = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let partition = u32::from_be_bytes(int(&mut rest)?);
        let offset = u64::from_be_bytes(int(&mut rest)?);
        positions.push((partition, offset));
    }
    if !rest.is_empty() {
        return Err(corrupt());
    }
    Ok((changes, positions))
}

fn position_key(partition: u32) -> Vec<u8> {
    let mut key = POSITION_PREFIX.to_vec();
    key.extend_from_slice(&partition.to_be_bytes());
    key
}

/// Clamps a scan's lower bound so the position entries are never visited.
fn after_positions(start: Bound<&[u8]>) -> Bound<Vec<u8>> {
    let floor = crate::prefix_end(POSITION_PREFIX).expect("prefix has an end");
    match start {
        Bound::Included(s) if s >= floor.as_slice() => Bound::Included(s.to_vec()),
        Bound::Excluded(s) if s >= floor.as_slice() => Bound::Excluded(s.to_vec()),
        _ => Bound::Included(floor),
    }
}

impl ProjectionStore for SledStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.projections.get(key)?.map(|v| v.to_vec()))
    }

    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        let start = after_positions(start);
        let end = match end {
            Bound::Included(e) => Bound::Included(e.to_vec()),
            Bound::Excluded(e) => Bound::Excluded(e.to_vec()),
            Bound::Unbounded => Bound::Unbounded,
        };
        let range = self.projections.range::<Vec<u8>, _>((start, end));
        let iter: Box<dyn Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>> = if reverse {
            Box::new(range.rev())
        } else {
            Box::new(range)
        };
        for item in iter {
            let (k, v) = item?;
            if visit(&k, &v) == Visit::Stop {
                break;
            }
        }
        Ok(())
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        if changes.len() > SLED_ATOMIC_BATCH_MAX_KEYS {
            let pieces = self.stage(&changes, positions)?;
            return self.materialize(changes, positions, pieces);
        }
        let mut batch = sled::Batch::default();
        for (key, value) in changes {
            match value {
                Some(v) => batch.insert(key, v),
                None => batch.remove(key),
            }
        }
        for (partition, next_offset) in positions {
            batch.insert(position_key(*partition), &next_offset.to_be_bytes());
        }
        self.projections.apply_batch(batch)?;
        Ok(())
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        match self.projections.get(position_key(partition))? {
            None => Ok(0),
            // A malformed position must not read as 0: that would re-apply the
            // whole log over existing state (fail-stop instead).
            Some(value) => <[u8; 8]>::try_from(value.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| {
                    StoreError::Corrupt(format!(
                        "the stored position of partition {partition} is {} bytes, not 8",
                        value.len()
                    ))
                }),
        }
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.aux.get(key)?.map(|v| v.to_vec()))
    }

    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        match value {
            Some(v) => self.aux.insert(key, v)?,
            None => self.aux.remove(key)?,
        };
        Ok(())
    }

    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        for item in self.aux.iter() {
            let (k, v) = item?;
            if visit(&k, &v) == Visit::Stop {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(n: usize, tag: &str) -> Vec<Change> {
        (0..n)
            .map(|i| {
                let key = format!("k/{i:06}").into_bytes();
                // Every third key deleted: a stage carries deletes as well as puts.
                let value = (i % 3 != 0).then(|| format!("{tag}{i}").into_bytes());
                (key, value)
            })
            .collect()
    }

    #[test]
    fn a_stage_interrupted_by_a_crash_is_finished_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let batch = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS + 7, "v");
        let expected = {
            let reference = crate::MemoryStore::new();
            reference.apply(batch.clone(), &[(0, 77), (1, 5)]).unwrap();
            reference.digest().unwrap()
        };
        {
            let store = SledStore::open(dir.path()).unwrap();
            store.apply(changes(10, "old"), &[(0, 10)]).unwrap();
            // The crash: step 1 and part of step 2 written, step 3 never.
            store.stage(&batch, &[(0, 77), (1, 5)]).unwrap();
            let mut part = sled::Batch::default();
            for (key, value) in batch.iter().take(SLED_ATOMIC_BATCH_MAX_KEYS) {
                match value {
                    Some(v) => part.insert(key.as_slice(), v.as_slice()),
                    None => part.remove(key.as_slice()),
                }
            }
            store.projections.apply_batch(part).unwrap();
            assert_eq!(store.position(0).unwrap(), 10, "not yet finished");
            store.db.flush().unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(store.position(0).unwrap(), 77);
        assert_eq!(store.position(1).unwrap(), 5);
        assert_eq!(store.digest().unwrap(), expected);
        assert_eq!(store.projections.scan_prefix(STAGE_PREFIX).count(), 0);
    }

    #[test]
    fn open_waits_for_a_lock_another_handle_is_about_to_free() {
        let dir = tempfile::tempdir().unwrap();
        let first = SledStore::open(dir.path()).unwrap();
        first.apply(changes(3, "v"), &[(0, 3)]).unwrap();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            first.db.flush().unwrap();
            drop(first);
        });
        // Held for 300 ms yet: without the wait this fails at once.
        let second = SledStore::open(dir.path()).unwrap();
        assert_eq!(second.position(0).unwrap(), 3);
        dropper.join().unwrap();
    }

    #[test]
    fn stages_round_trip_and_bad_ones_are_corrupt_not_panics() {
        let batch = changes(50, "v");
        let positions = vec![(0, 1), (7, u64::MAX)];
        let encoded = encode_stage(&batch, &positions);
        assert_eq!(decode_stage(&encoded).unwrap(), (batch, positions));
        for cut in [0, 1, 8, 20, encoded.len() - 1] {
            assert!(matches!(
                decode_stage(&encoded[..cut]),
                Err(StoreError::Corrupt(_))
            ));
        }
        let mut huge = encoded.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(decode_stage(&huge).is_err());
        let mut trailing = encoded;
        trailing.push(0);
        assert!(decode_stage(&trailing).is_err());
    }
}
