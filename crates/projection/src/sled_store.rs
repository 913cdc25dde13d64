//! sled implementation. Projections and positions share one tree, so a batch and its
//! positions commit atomically (`apply_batch` is atomic per tree).
//!
//! **Large batches are staged.** A sled batch takes a process-wide write lock that
//! stops every read until it ends, and holds every page it touches: checkpoints of
//! 50,000 keys as one batch took the ingest benchmark's server from ~450 MiB to
//! 1.8 GiB and stalled the projector's reads for the whole write. A batch of more
//! than [`SLED_ATOMIC_BATCH_MAX_KEYS`] changes is therefore written in three steps:
//! 1. the whole batch and its positions, encoded with a CRC-32, to a stage file
//!    beside sled's files ([`STAGE_FILE`]: written aside, fsynced, renamed into
//!    place, directory fsynced);
//! 2. the changes, one key at a time (a single insert takes no global lock);
//! 3. one small batch that writes the positions, a sled flush, and the stage file's
//!    removal (directory fsynced before the next checkpoint may begin).
//!
//! Why a file and not sled: a stage of ~200,000 keys is ~30 MB, and written as sled
//! values in one batch it held sled's global lock for 50-300 ms per checkpoint,
//! stalling every usage query and projector read behind it (the ingest benchmark's
//! query p99).
//!
//! Every change is a whole value (a put or a delete), never an increment, so writing
//! a staged batch twice is the same as writing it once. `open` finishes a stage a
//! crash interrupted (steps 2 and 3 again) before anything reads the store, so a
//! reader only ever sees a prefix of applied batches with exactly its positions;
//! `open_deferring_stage` hands it to the caller instead, to apply over the store. The
//! stage file is durable before step 2 begins, so if any write of step 2 survived a
//! crash, the stage did too; it is removed only after sled has flushed step 3, so a
//! checkpoint never loses its stage while partly written. Stores written by an
//! earlier build kept the stage in sled under `STAGE_PREFIX`; `open` still finishes
//! such a stage.
//!
//! **Layer copies.** The write-back layer above this store (`CheckpointStore`) holds
//! up to a checkpoint interval of applied log, which a SIGKILL loses and a restart
//! re-applies. Between checkpoints the layer's current contents are also written here
//! as a copy ([`LAYER_COPY_FILE`]: its changes, the positions they reach, and the
//! positions of the stored state it was made over; CRC-32, written aside, fsynced,
//! renamed). `open_deferring_stage` hands a copy over with the stage when it was made
//! over exactly the positions sled holds and reaches at least the stage's positions:
//! then it is that layer at a later point (the layer over sled took the stage in at
//! its start, or was the one the stage froze later, which the positions rule out).
//! While a staged batch is written, once its stage file is durable, the layer above
//! is copied over the positions sled holds when that batch is written (sled's
//! positions with the stage's over them): a restart that finds that stage
//! interrupted hands the copy over after it, and one that finds sled past the stage
//! finds the copy over what sled holds. Any other copy is stale and removed. A copy
//! is never needed for correctness: without it the log re-applies the same changes.

use std::io::Write;
use std::ops::Bound;
use std::path::{Path, PathBuf};

use crate::packing::{self, Packing, RowChanges, Segment, Slice};
use crate::{Change, ChangeSource, ProjectionStore, StoreError, Visit};

/// Positions live under this prefix, which sorts before every projection table
/// (their prefixes are printable letters) and is skipped by scans.
const POSITION_PREFIX: &[u8] = b"\x00pos\x00";
/// A checkpoint merged in several passes cuts its rows into ranges at quantiles
/// of the row keys of evenly spaced changes (`write_changes_in`), this many per
/// pass: enough for ranges of about equal size, and a key copied for one change
/// in thousands (a checkpoint of ~200,000 changes merges in four passes).
const ROW_SAMPLES_PER_PASS: usize = 64;
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
/// The stage of a large batch (module doc), in the store's directory.
pub const STAGE_FILE: &str = "checkpoint.stage";
/// Where the stage is written before it is renamed into place: a crash while
/// writing leaves only this, which `open` removes (its checkpoint never began).
const STAGE_FILE_PARTIAL: &str = "checkpoint.stage.partial";
/// The latest copy of the unwritten write-back layer (module doc, "Layer copies"),
/// in the store's directory.
pub const LAYER_COPY_FILE: &str = "layer.copy";
/// Where a layer copy is written before it is renamed into place.
const LAYER_COPY_FILE_PARTIAL: &str = "layer.copy.partial";
/// An earlier build's stage pieces lived under this prefix (module doc): below the
/// positions' end, so scans skip them.
const STAGE_PREFIX: &[u8] = b"\x00\x00stage\x00";
/// How long `open` waits for the directory's file lock. A process that exits frees
/// it at once, but a handle dropped inside this process frees it only when sled's
/// background flusher thread notices, up to a flush interval later; reopening a
/// store in the same process (tests, rebuilds) would otherwise fail at random.
pub const SLED_LOCK_WAIT_MS: u64 = 5_000;
/// Pause between attempts to take the file lock.
const SLED_LOCK_RETRY_MS: u64 = 20;
/// The key `settle_segments` writes and removes at open (the prefix of the keys
/// it writes after it).
const SETTLE_KEY: &[u8] = b"\x00settle\x00";
/// sled's data file in its directory.
const SLED_DATA_FILE: &str = "db";
/// Below this size (2,048 segments) the deactivation `settle_segments` waits for
/// takes milliseconds, and opening a small store (tests, tools) writes nothing.
const SETTLE_MIN_FILE_BYTES: u64 = 1 << 30;
/// What `settle_segments` writes to reach the next segment: more than one of
/// sled's segments (512 KiB).
const SETTLE_BYTES: usize = 640 * 1024;
/// The size of each value `settle_segments` writes: small enough to stay in
/// sled's log (sled moves large values to blob files, which would not fill it).
const SETTLE_VALUE_BYTES: usize = 1024;

pub struct SledStore {
    db: sled::Db,
    /// The store's directory: where the stage file lives.
    dir: PathBuf,
    projections: sled::Tree,
    aux: sled::Tree,
    /// The tables kept as rows (`packing`), as recorded in the store.
    packing: Packing,
    /// The slice directory (`packing::SLICE_PREFIX`) in memory: every slice
    /// written to this store.
    slices: parking_lot::RwLock<std::collections::BTreeSet<Slice>>,
}

/// sled (0.34) marks every segment of its file active when it opens, and the first
/// write it flushes afterwards deactivates them all on sled's I/O thread, counting
/// the whole segment table for each one: work quadratic in the file's segments of
/// 512 KiB (~44,000 in a 22 GB store: ~4-5 s of a core), during which no write can
/// move on to a new segment. When nothing at start-up waited for it, the service
/// answered ready and then stalled its first checkpoint and the requests behind it
/// (a void took 2-4 s instead of ~0.1 s after a restart; docs/benchmarks.md, "Voids in a store
/// of ten million events"). So `open` of a large store starts that work with one
/// flushed write, then writes more than a segment's worth of keys (and removes
/// them): moving to the next segment waits until the deactivation is done, before
/// anything is served. The store's contents are as before.
fn settle_segments(
    db: &sled::Db,
    aux: &sled::Tree,
    dir: &Path,
    min_file_bytes: u64,
) -> Result<(), StoreError> {
    let file_bytes = std::fs::metadata(dir.join(SLED_DATA_FILE)).map_or(0, |m| m.len());
    if file_bytes < min_file_bytes {
        return Ok(());
    }
    let started = std::time::Instant::now();
    aux.insert(SETTLE_KEY, &[])?;
    aux.remove(SETTLE_KEY)?;
    db.flush()?;
    let value = vec![0u8; SETTLE_VALUE_BYTES];
    let keys = SETTLE_BYTES.div_ceil(SETTLE_VALUE_BYTES) as u32;
    let key = |i: u32| [SETTLE_KEY, &i.to_be_bytes()[..]].concat();
    for i in 0..keys {
        aux.insert(key(i), &value[..])?;
    }
    for i in 0..keys {
        aux.remove(key(i))?;
    }
    db.flush()?;
    tracing::info!(
        ms = started.elapsed().as_millis() as u64,
        file_bytes,
        "settled the store's segments"
    );
    Ok(())
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SledStore")
    }
}

/// A staged batch a crash interrupted, as `open_deferring_stage` hands it over: its
/// changes and the positions they bring the store to.
pub type InterruptedStage = (Vec<Change>, Vec<(u32, u64)>);

impl SledStore {
    /// Opens the store, finishing a checkpoint a crash interrupted first (module doc).
    /// A new store packs nothing; an existing one reads as it was written.
    pub fn open(dir: impl AsRef<Path>) -> Result<SledStore, StoreError> {
        SledStore::open_with(dir, Packing::none())
    }

    /// `open`, a new store packing the keys of `packing`'s tables into rows
    /// (`packing` module); an existing store keeps the packing it was created with.
    pub fn open_with(dir: impl AsRef<Path>, packing: Packing) -> Result<SledStore, StoreError> {
        let (store, stage) = SledStore::open_deferring_stage_with(dir, packing)?;
        if let Some((changes, positions)) = stage {
            let started = std::time::Instant::now();
            store.materialize(&changes, &positions, 0)?;
            tracing::info!(
                changes = changes.len(),
                ms = started.elapsed().as_millis() as u64,
                "finished the checkpoint a stop interrupted"
            );
        }
        Ok(store)
    }

    /// Opens the store and hands over a checkpoint a crash interrupted instead of
    /// finishing it: the caller applies it over the store (the service: into its
    /// write-back layer, which the next checkpoint writes, so a restart does not
    /// wait for ~200,000 sled inserts). Its stage file stays until that checkpoint's
    /// own stage replaces it (a superset: the layer holds it) or sled passes its
    /// positions; a stage whose positions sled has reached is already in sled (sled
    /// holds a prefix of applied batches with exactly its positions) and is removed.
    pub fn open_deferring_stage(
        dir: impl AsRef<Path>,
    ) -> Result<(SledStore, Option<InterruptedStage>), StoreError> {
        SledStore::open_deferring_stage_with(dir, Packing::none())
    }

    /// `open_deferring_stage` with `open_with`'s packing of a new store.
    pub fn open_deferring_stage_with(
        dir: impl AsRef<Path>,
        packing: Packing,
    ) -> Result<(SledStore, Option<InterruptedStage>), StoreError> {
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
        settle_segments(&db, &aux, dir.as_ref(), SETTLE_MIN_FILE_BYTES)?;
        let packing = match projections.get(packing::PACKING_KEY)? {
            Some(recorded) => Packing::decode(&recorded),
            // A new store records the packing it is created with; a store
            // written before packing existed keeps its keys as they are.
            None if projections.is_empty() && !packing.is_none() => {
                projections.insert(packing::PACKING_KEY, packing.encode())?;
                // Durable before any row is written: a store must never hold
                // rows without the record that says how to read them.
                db.flush()?;
                packing
            }
            None => Packing::none(),
        };
        let slices = parking_lot::RwLock::new(load_slices(&projections, &packing)?);
        let store = SledStore {
            db,
            dir: dir.as_ref().to_path_buf(),
            projections,
            aux,
            packing,
            slices,
        };
        let stage = store.interrupted_stage()?;
        let stage = store.with_layer_copy(stage)?;
        Ok((store, stage))
    }

    /// The tables this store keeps as rows.
    pub fn packing(&self) -> &Packing {
        &self.packing
    }

    /// The staged batch a crash interrupted (module doc), if there is one and sled
    /// has not passed it; an earlier build's stage kept in sled is finished here.
    fn interrupted_stage(&self) -> Result<Option<InterruptedStage>, StoreError> {
        remove_if_present(&self.dir.join(STAGE_FILE_PARTIAL))?;
        let path = self.dir.join(STAGE_FILE);
        let mut stage = match std::fs::read(&path) {
            Ok(bytes) => Some(decode_stage_file(&bytes)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_error("reading the checkpoint stage", e)),
        };
        if let Some((_, positions)) = &stage {
            let mut passed = true;
            for (partition, next_offset) in positions {
                passed &= self.position(*partition)? >= *next_offset;
            }
            // Whether sled had written the stage before the stop decides what a
            // layer copy made meanwhile was made over (`with_layer_copy`).
            tracing::info!(
                passed,
                "found the stage of a checkpoint a stop interrupted (passed: sled had written it already)"
            );
            if passed {
                remove_if_present(&path)?;
                fsync_dir(&self.dir)?;
                stage = None;
            }
        }
        // An earlier build's stage, kept in sled.
        let mut encoded = Vec::new();
        let mut pieces = 0usize;
        for item in self.projections.scan_prefix(STAGE_PREFIX) {
            let (_, piece) = item?;
            encoded.extend_from_slice(&piece);
            pieces += 1;
        }
        if pieces > 0 {
            let (changes, positions) = decode_stage(&encoded)?;
            self.materialize(&changes, &positions, pieces)?;
        }
        Ok(stage)
    }

    /// The stage to hand over, with the layer copy applied after it when the copy is
    /// of the layer over what sled holds and reaches at least the stage's positions,
    /// or of the layer over what sled holds once that stage is written (made while
    /// the stage was written, after it was durable) (module doc, "Layer copies"); a
    /// stale or damaged copy is removed (the log re-applies what it held).
    fn with_layer_copy(
        &self,
        stage: Option<InterruptedStage>,
    ) -> Result<Option<InterruptedStage>, StoreError> {
        remove_if_present(&self.dir.join(LAYER_COPY_FILE_PARTIAL))?;
        let path = self.dir.join(LAYER_COPY_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(stage),
            Err(e) => return Err(io_error("reading the layer copy", e)),
        };
        let stored = position_map(&self.stored_positions()?);
        // What sled holds once the handed-over stage is written: a copy made while
        // that stage was written, after it was durable, was made over this.
        let staged = stage.as_ref().map(|(_, staged)| {
            let mut staged = position_map(staged);
            for (partition, offset) in &stored {
                staged.entry(*partition).or_insert(*offset);
            }
            staged
        });
        let usable = match decode_layer_copy_file(&bytes) {
            Err(error) => {
                tracing::warn!(%error, "the layer copy is damaged; the log re-applies it");
                None
            }
            Ok((over, (changes, positions))) => {
                let over = position_map(&over);
                let (base, over_stage) = if over == stored {
                    (Some(&stored), false)
                } else {
                    (staged.as_ref().filter(|staged| over == **staged), true)
                };
                base.and_then(|base| {
                    let reached = position_map(&positions);
                    let at = |p: &u32| reached.get(p).or(base.get(p)).copied().unwrap_or(0);
                    let beyond_stage = stage
                        .as_ref()
                        .is_none_or(|(_, staged)| staged.iter().all(|(p, o)| at(p) >= *o));
                    beyond_stage.then_some((changes, positions, over_stage))
                })
            }
        };
        let Some((copied, copied_positions, over_stage)) = usable else {
            remove_if_present(&path)?;
            return Ok(stage);
        };
        tracing::info!(
            changes = copied.len(),
            over_stage,
            "took in the copy of the layer a stop left unwritten; the log is re-applied from where it ends"
        );
        let (mut changes, positions) = stage.unwrap_or_default();
        let mut positions = position_map(&positions);
        positions.extend(copied_positions);
        // Later changes of a key win where the layer takes them (`apply`).
        changes.extend(copied);
        Ok(Some((changes, positions.into_iter().collect())))
    }

    /// Every partition's stored position (a layer copy records the ones it was made
    /// over).
    fn all_positions(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        let mut positions = Vec::new();
        for item in self.projections.scan_prefix(POSITION_PREFIX) {
            let (key, value) = item?;
            let partition = key
                .get(POSITION_PREFIX.len()..)
                .and_then(|tail| <[u8; 4]>::try_from(tail).ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| StoreError::Corrupt(format!("a position key {key:?}")))?;
            positions.push((partition, decode_position(partition, &value)?));
        }
        Ok(positions)
    }

    /// Steps 2 and 3 of a staged batch (`legacy_pieces`: an earlier build's stage
    /// values to remove with the positions).
    fn materialize(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
        legacy_pieces: usize,
    ) -> Result<(), StoreError> {
        // One key at a time: a sled batch takes a process-wide write lock that
        // stops every read (the projector's included) until it ends, a single
        // insert does not; step 2 needs no atomicity.
        let mut write = |key: &[u8], value: Option<&[u8]>| {
            match value {
                Some(v) => self.projections.insert(key, v)?,
                None => self.projections.remove(key)?,
            };
            Ok(())
        };
        self.write_changes(changes, &mut write)?;
        let mut last = sled::Batch::default();
        for piece in 0..legacy_pieces {
            last.remove(stage_key(piece));
        }
        for (partition, next_offset) in positions {
            last.insert(position_key(*partition), &next_offset.to_be_bytes());
        }
        self.projections.apply_batch(last)?;
        // The stage may go only once everything it holds is durable in sled.
        self.db.flush()?;
        remove_if_present(&self.dir.join(STAGE_FILE))?;
        fsync_dir(&self.dir)
    }
}

/// The slice directory of a packed store; built from its rows (and recorded)
/// when it has rows but no directory.
fn load_slices(
    projections: &sled::Tree,
    packing: &Packing,
) -> Result<std::collections::BTreeSet<Slice>, StoreError> {
    let mut slices = std::collections::BTreeSet::new();
    for item in projections.scan_prefix(packing::SLICE_PREFIX) {
        let (key, _) = item?;
        let slice = Slice::of(&key[packing::SLICE_PREFIX.len()..])
            .ok_or_else(|| StoreError::Corrupt(format!("a slice directory key {key:?}")))?;
        slices.insert(slice);
    }
    if slices.is_empty() {
        for table in packing.packed_tables() {
            for item in projections.range(vec![*table]..vec![*table + 1]) {
                let (row, value) = item?;
                packing::note_slices(&row, &value, &mut slices)?;
            }
        }
        for slice in &slices {
            projections.insert(slice.directory_key(), &[])?;
        }
    }
    Ok(slices)
}

fn io_error(what: &str, error: std::io::Error) -> StoreError {
    StoreError::Backend(format!("{what}: {error}"))
}

fn remove_if_present(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("removing the checkpoint stage", e)),
    }
}

fn fsync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("syncing the projection directory", e))
}

impl SledStore {
    /// Step 1 of a staged batch: the stage file, durable and in place.
    pub(crate) fn stage(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        self.write_durably(
            STAGE_FILE_PARTIAL,
            STAGE_FILE,
            "writing the checkpoint stage",
            &mut |out| write_stage(out, changes, positions),
        )
    }

    /// Writes `body` and the CRC-32 of it to `partial` in the store's directory,
    /// fsyncs it, renames it to `name` and fsyncs the directory: a crash leaves the
    /// old file or the new one whole, never half of one. Streamed through a running
    /// CRC: a buffer of a whole stage (tens of MB, freshly allocated and
    /// page-faulted in every checkpoint) cost the checkpoint thread a third of its
    /// time.
    fn write_durably(
        &self,
        partial: &str,
        name: &str,
        what: &str,
        body: &mut dyn FnMut(&mut dyn Write) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let partial = self.dir.join(partial);
        let file = std::fs::File::create(&partial).map_err(|e| io_error(what, e))?;
        let mut out = CrcWriter {
            inner: std::io::BufWriter::with_capacity(STAGE_WRITE_BUFFER_BYTES, file),
            crc: crc32fast::Hasher::new(),
        };
        body(&mut out)?;
        let crc = out.crc.finalize();
        let mut inner = out.inner;
        inner
            .write_all(&crc.to_be_bytes())
            .and_then(|()| inner.into_inner().map_err(|e| e.into_error()))
            .and_then(|file| file.sync_all())
            .and_then(|()| std::fs::rename(&partial, self.dir.join(name)))
            .map_err(|e| io_error(what, e))?;
        fsync_dir(&self.dir)
    }
}

/// Positions as a map without the partitions at 0 (absent and 0 are the same).
fn position_map(positions: &[(u32, u64)]) -> std::collections::BTreeMap<u32, u64> {
    positions.iter().copied().filter(|(_, o)| *o > 0).collect()
}

/// `[count u64] ([partition u32][offset u64])*`
fn write_positions(out: &mut dyn Write, positions: &[(u32, u64)]) -> std::io::Result<()> {
    out.write_all(&(positions.len() as u64).to_be_bytes())?;
    for (partition, offset) in positions {
        out.write_all(&partition.to_be_bytes())?;
        out.write_all(&offset.to_be_bytes())?;
    }
    Ok(())
}

/// A layer copy file: the positions it was made over, the encoded stage of the
/// layer, then the CRC-32 of both.
fn decode_layer_copy_file(bytes: &[u8]) -> Result<(Vec<(u32, u64)>, Stage), StoreError> {
    let mut rest = checksummed(bytes, || {
        StoreError::Corrupt(format!(
            "the layer copy ({LAYER_COPY_FILE}) fails its checksum"
        ))
    })?;
    let over = decode_positions(&mut rest)?;
    Ok((over, decode_stage(rest)?))
}

/// The bytes before a file's trailing CRC-32, if it matches them; else `corrupt()`.
fn checksummed(bytes: &[u8], corrupt: impl Fn() -> StoreError) -> Result<&[u8], StoreError> {
    let split = bytes.len().checked_sub(4).ok_or_else(&corrupt)?;
    let (encoded, crc) = bytes.split_at(split);
    if crc32fast::hash(encoded).to_be_bytes() != crc {
        return Err(corrupt());
    }
    Ok(encoded)
}

/// The stage file's write buffer: large enough that a checkpoint of ~30 MB makes a
/// few hundred writes, small enough to cost nothing resident.
const STAGE_WRITE_BUFFER_BYTES: usize = 1 << 20;

/// A writer that keeps the CRC-32 of everything written through it.
struct CrcWriter<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.crc.update(&bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn stage_key(piece: usize) -> Vec<u8> {
    let mut key = STAGE_PREFIX.to_vec();
    key.extend_from_slice(&(piece as u64).to_be_bytes());
    key
}

/// A stage file: the encoded stage, then the CRC-32 of it.
fn decode_stage_file(bytes: &[u8]) -> Result<Stage, StoreError> {
    decode_stage(checksummed(bytes, || {
        StoreError::Corrupt(format!(
            "the checkpoint stage ({STAGE_FILE}) fails its checksum; the projection \
             cannot be finished from it: delete the projections directory to rebuild \
             it from the log"
        ))
    })?)
}

/// `[count u64] ([key len u32][key][0 | 1 [value len u32][value]])* [count u64]
/// ([partition u32][offset u64])*`
fn write_stage(
    out: &mut dyn Write,
    changes: &dyn ChangeSource,
    positions: &[(u32, u64)],
) -> Result<(), StoreError> {
    let io = |e: std::io::Error| io_error("writing the checkpoint stage", e);
    out.write_all(&(changes.change_count() as u64).to_be_bytes())
        .map_err(io)?;
    changes.visit_changes(&mut |key, value| {
        out.write_all(&(key.len() as u32).to_be_bytes())
            .map_err(io)?;
        out.write_all(key).map_err(io)?;
        match value {
            Some(value) => {
                out.write_all(&[1]).map_err(io)?;
                out.write_all(&(value.len() as u32).to_be_bytes())
                    .map_err(io)?;
                out.write_all(value).map_err(io)
            }
            None => out.write_all(&[0]).map_err(io),
        }
    })?;
    write_positions(out, positions).map_err(io)
}

/// The stage's encoding in memory (an earlier build's stage pieces, and tests).
#[cfg(test)]
fn encode_stage(changes: &Vec<Change>, positions: &[(u32, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    write_stage(&mut out, changes, positions).expect("writing to a Vec cannot fail");
    out
}

type Stage = (Vec<Change>, Vec<(u32, u64)>);

fn undecodable() -> StoreError {
    StoreError::Corrupt("a staged checkpoint batch does not decode".into())
}

/// The next `n` bytes of `bytes`, which moves past them.
fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], StoreError> {
    if bytes.len() < n {
        return Err(undecodable());
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

fn int<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], StoreError> {
    take(bytes, N)?.try_into().map_err(|_| undecodable())
}

/// What `write_positions` wrote, from the front of `bytes`.
fn decode_positions(rest: &mut &[u8]) -> Result<Vec<(u32, u64)>, StoreError> {
    let count = u64::from_be_bytes(int(rest)?);
    // 12 bytes each: a count past that is corrupt, not a reason to reserve memory.
    if count > (rest.len() / 12) as u64 {
        return Err(undecodable());
    }
    let mut positions = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let partition = u32::from_be_bytes(int(rest)?);
        let offset = u64::from_be_bytes(int(rest)?);
        positions.push((partition, offset));
    }
    Ok(positions)
}

fn decode_stage(bytes: &[u8]) -> Result<Stage, StoreError> {
    let mut rest = bytes;
    let count = u64::from_be_bytes(int(&mut rest)?);
    // Each change takes at least 5 bytes: a count past that is corrupt, not a reason
    // to reserve memory.
    if count > (rest.len() / 5) as u64 {
        return Err(undecodable());
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
            _ => return Err(undecodable()),
        };
        changes.push((key, value));
    }
    let positions = decode_positions(&mut rest)?;
    if !rest.is_empty() {
        return Err(undecodable());
    }
    Ok((changes, positions))
}

/// A stored position. A malformed one must not read as 0: that would re-apply the
/// whole log over existing state (fail-stop instead).
fn decode_position(partition: u32, value: &[u8]) -> Result<u64, StoreError> {
    <[u8; 8]>::try_from(value)
        .map(u64::from_be_bytes)
        .map_err(|_| {
            StoreError::Corrupt(format!(
                "the stored position of partition {partition} is {} bytes, not 8",
                value.len()
            ))
        })
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

impl SledStore {
    /// Visits sled's keys in a range as they are (`Visit::Stop` when the visitor
    /// stopped).
    fn scan_keys(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<Visit, StoreError> {
        self.scan_rows(
            after_positions(start),
            packing::owned(end),
            reverse,
            &mut |k, v| Ok(visit(k, v)),
        )
    }

    fn scan_rows(
        &self,
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
        reverse: bool,
        visit: &mut packing::RawVisit<'_>,
    ) -> Result<Visit, StoreError> {
        if packing::is_empty_range(&packing::as_ref(&start), &packing::as_ref(&end)) {
            return Ok(Visit::Continue);
        }
        let range = self.projections.range::<Vec<u8>, _>((start, end));
        let iter: Box<dyn Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>> = if reverse {
            Box::new(range.rev())
        } else {
            Box::new(range)
        };
        for item in iter {
            let (k, v) = item?;
            if visit(&k, &v)? == Visit::Stop {
                return Ok(Visit::Stop);
            }
        }
        Ok(Visit::Continue)
    }

    /// Visits the keys of one packed table in a range (`packing` module doc): slice
    /// by slice, each slice's rows filtered to its entry.
    fn scan_packed(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<Visit, StoreError> {
        let slices: Vec<Slice> = match packing::single_slice(start, end) {
            Some(slice) => vec![slice],
            None => self
                .slices
                .read()
                .iter()
                .filter(|slice| slice.meets(start, end))
                .cloned()
                .collect(),
        };
        let ordered: Box<dyn Iterator<Item = &Slice>> = if reverse {
            Box::new(slices.iter().rev())
        } else {
            Box::new(slices.iter())
        };
        for slice in ordered {
            let Some((from, to)) = slice.row_bounds(start, end) else {
                continue;
            };
            let visited = self.scan_rows(from, to, reverse, &mut |row, value| {
                Ok(match packing::find(value, slice.entry())? {
                    Some(value) => visit(&slice.key_in(row), &value),
                    None => Visit::Continue,
                })
            })?;
            if visited == Visit::Stop {
                return Ok(Visit::Stop);
            }
        }
        Ok(Visit::Continue)
    }

    /// Hands `write` every change as a sled key and value: plain keys as they are,
    /// the keys of packed tables merged into their rows (each row read once). A
    /// large batch's rows are merged in several passes over the changes, each
    /// taking one range of the row keys (`packing::ROW_PASS_CHANGES`).
    fn write_changes(
        &self,
        changes: &dyn ChangeSource,
        write: &mut crate::ChangeVisit<'_>,
    ) -> Result<(), StoreError> {
        let passes = RowChanges::passes_for(changes.change_count());
        self.write_changes_in(changes, write, passes)
    }

    /// `write_changes` in `passes` passes. The first writes the plain keys, lists
    /// new slices, and (one pass) gathers the rows or (several) samples the row
    /// keys of evenly spaced changes (`ROW_SAMPLES_PER_PASS`), whose quantiles
    /// cut the rows into ranges of about equal numbers of changes. Any cut is
    /// correct: the ranges cover every row key, the first from the lowest, the
    /// last to the highest.
    fn write_changes_in(
        &self,
        changes: &dyn ChangeSource,
        write: &mut crate::ChangeVisit<'_>,
        passes: usize,
    ) -> Result<(), StoreError> {
        let passes = passes.max(1);
        let mut rows = RowChanges::default();
        let sample_every =
            (changes.change_count() / passes.saturating_mul(ROW_SAMPLES_PER_PASS)).max(1);
        let mut samples: Vec<Vec<u8>> = Vec::new();
        let mut packed = 0usize;
        let mut new_slices = std::collections::BTreeSet::new();
        {
            let known = self.slices.read();
            let mut last: Vec<u8> = Vec::new();
            changes.visit_changes(&mut |key, value| {
                if !self.packing.packs(key) {
                    return write(key, value);
                }
                if passes <= 1 {
                    rows.add(key, value)?;
                } else if packed.is_multiple_of(sample_every) {
                    let mut row = Vec::new();
                    packing::row_key_into(key, &mut row)?;
                    samples.push(row);
                }
                packed += 1;
                // Changes come in key order, so a slice's come together: one
                // look-up each.
                // (Deletes write no row, so only puts list a slice.)
                let put_prefix = value.and_then(|_| packing::slice_prefix(key));
                if let Some(prefix) = put_prefix.filter(|p| *p != last.as_slice()) {
                    if !known.contains(prefix) {
                        new_slices.extend(Slice::of(prefix));
                    }
                    last.clear();
                    last.extend_from_slice(prefix);
                }
                Ok(())
            })?;
        }
        // Listed before any row of theirs is written (a crash may leave a slice
        // listed without rows: read as empty, never the other way round).
        for slice in &new_slices {
            write(&slice.directory_key(), Some(&[]))?;
        }
        self.slices.write().extend(new_slices);
        if passes <= 1 {
            return self.write_rows(&rows, write);
        }
        samples.sort_unstable();
        let per_pass = samples.len().div_ceil(passes).max(1);
        let mut cuts: Vec<Vec<u8>> = samples.into_iter().step_by(per_pass).skip(1).collect();
        cuts.dedup();
        let bounds: Vec<Option<Vec<u8>>> = std::iter::once(None)
            .chain(cuts.into_iter().map(Some))
            .chain(std::iter::once(None))
            .collect();
        for range in bounds.windows(2) {
            let mut rows = RowChanges::between(range[0].clone(), range[1].clone());
            changes.visit_changes(&mut |key, value| match self.packing.packs(key) {
                true => rows.add(key, value),
                false => Ok(()),
            })?;
            self.write_rows(&rows, write)?;
        }
        Ok(())
    }

    /// Writes gathered rows, each merged with its stored value.
    fn write_rows(
        &self,
        rows: &RowChanges,
        write: &mut crate::ChangeVisit<'_>,
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        rows.merged(
            &mut |row| Ok(self.projections.get(row)?.map(|v| v.to_vec())),
            write,
        )
    }
}

impl ProjectionStore for SledStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if self.packing.packs(key) {
            let (row, entry) = packing::split(key)?;
            return match self.projections.get(row)? {
                Some(row) => packing::find(&row, entry),
                None => Ok(None),
            };
        }
        Ok(self.projections.get(key)?.map(|v| v.to_vec()))
    }

    fn scan(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        if self.packing.is_none() {
            self.scan_keys(start, end, reverse, visit)?;
            return Ok(());
        }
        let mut segments = self.packing.segments(start, end);
        if reverse {
            segments.reverse();
        }
        for segment in segments {
            let visited = match segment {
                Segment::Plain(from, to) => {
                    self.scan_keys(packing::as_ref(&from), packing::as_ref(&to), reverse, visit)?
                }
                Segment::Packed(from, to) => {
                    self.scan_packed(packing::as_ref(&from), packing::as_ref(&to), reverse, visit)?
                }
            };
            if visited == Visit::Stop {
                break;
            }
        }
        Ok(())
    }

    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        self.apply_from(&changes, positions)
    }

    fn apply_from(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        self.apply_from_noting_durable(changes, positions, &|| {})
    }

    /// A staged batch is durable once its stage file is in place (a restart finds
    /// the stage and hands it over, or finds sled past it); a single sled batch is
    /// durable only at sled's next flush, so it reports nothing.
    fn apply_from_noting_durable(
        &self,
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
        durable: &dyn Fn(),
    ) -> Result<(), StoreError> {
        if changes.change_count() > SLED_ATOMIC_BATCH_MAX_KEYS {
            self.stage(changes, positions)?;
            durable();
            return self.materialize(changes, positions, 0);
        }
        let mut batch = sled::Batch::default();
        self.write_changes(changes, &mut |key, value| {
            match value {
                Some(v) => batch.insert(key, v),
                None => batch.remove(key),
            }
            Ok(())
        })?;
        for (partition, next_offset) in positions {
            batch.insert(position_key(*partition), &next_offset.to_be_bytes());
        }
        self.projections.apply_batch(batch)?;
        Ok(())
    }

    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        match self.projections.get(position_key(partition))? {
            None => Ok(0),
            Some(value) => decode_position(partition, &value),
        }
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    fn keeps_layer_copies(&self) -> bool {
        true
    }

    fn stored_positions(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        self.all_positions()
    }

    /// A layer copy (module doc, "Layer copies"), durable and in place like a stage:
    /// the positions it was made over, then the layer as a stage.
    fn save_layer_copy(
        &self,
        over: &[(u32, u64)],
        changes: &dyn ChangeSource,
        positions: &[(u32, u64)],
    ) -> Result<(), StoreError> {
        self.write_durably(
            LAYER_COPY_FILE_PARTIAL,
            LAYER_COPY_FILE,
            "writing the layer copy",
            &mut |out| {
                write_positions(out, over).map_err(|e| io_error("writing the layer copy", e))?;
                write_stage(out, changes, positions)
            },
        )
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

    /// The crash's leftovers: a store at position 10 with a stage written by
    /// `write_stage` and the first keys of step 2 applied, then reopened.
    fn crash_mid_checkpoint(
        dir: &Path,
        batch: &[Change],
        write_stage: impl FnOnce(&SledStore),
    ) -> SledStore {
        {
            let store = SledStore::open(dir).unwrap();
            store.apply(changes(10, "old"), &[(0, 10)]).unwrap();
            write_stage(&store);
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
        SledStore::open(dir).unwrap()
    }

    fn reference_digest(batch: &[Change], positions: &[(u32, u64)]) -> String {
        let reference = crate::MemoryStore::new();
        reference.apply(batch.to_vec(), positions).unwrap();
        reference.digest().unwrap()
    }

    #[test]
    fn settling_the_segments_leaves_the_store_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let batch = changes(50, "v");
        let before = {
            let store = SledStore::open(dir.path()).unwrap();
            store.apply(batch.clone(), &[(0, 9)]).unwrap();
            store.aux_put(b"a", Some(b"1")).unwrap();
            store.digest().unwrap()
        };
        let store = SledStore::open(dir.path()).unwrap();
        let written = store.db.size_on_disk().unwrap();
        // Forced on this small store: more than a segment written and removed.
        settle_segments(&store.db, &store.aux, dir.path(), 0).unwrap();
        assert!(
            store.db.size_on_disk().unwrap() > written,
            "the settle writes reached sled's log"
        );
        assert_eq!(store.digest().unwrap(), before);
        assert_eq!(store.position(0).unwrap(), 9);
        let aux: Vec<_> = store
            .aux
            .iter()
            .keys()
            .map(|k| k.unwrap().to_vec())
            .collect();
        assert_eq!(aux, vec![b"a".to_vec()], "no settle key is left behind");
    }

    #[test]
    fn a_stage_interrupted_by_a_crash_is_finished_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let batch = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS + 7, "v");
        let positions = [(0, 77), (1, 5)];
        let store = crash_mid_checkpoint(dir.path(), &batch, |store| {
            store.stage(&batch.to_vec(), &positions).unwrap();
        });
        assert_eq!(store.position(0).unwrap(), 77);
        assert_eq!(store.position(1).unwrap(), 5);
        assert_eq!(
            store.digest().unwrap(),
            reference_digest(&batch, &positions)
        );
        assert!(!dir.path().join(STAGE_FILE).exists(), "the stage is gone");
    }

    #[test]
    fn a_deferred_stage_is_handed_over_and_kept_until_a_checkpoint_passes_it() {
        let dir = tempfile::tempdir().unwrap();
        let batch = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS + 7, "v");
        let positions = [(0, 77), (1, 5)];
        drop(crash_mid_checkpoint(dir.path(), &batch, |store| {
            store.stage(&batch.to_vec(), &positions).unwrap();
        }));
        // `crash_mid_checkpoint` reopened with `open`, which finished the stage:
        // stage again, interrupted the same way, and reopen deferring it.
        {
            let store = SledStore::open(dir.path()).unwrap();
            store.stage(&batch.to_vec(), &[(0, 99), (1, 5)]).unwrap();
            store.db.flush().unwrap();
        }
        let (sled, stage) = SledStore::open_deferring_stage(dir.path()).unwrap();
        let (staged, staged_positions) = stage.expect("the interrupted stage is handed over");
        assert_eq!(staged_positions, vec![(0, 99), (1, 5)]);
        assert_eq!(sled.position(0).unwrap(), 77, "sled is left as it was");
        assert!(dir.path().join(STAGE_FILE).exists(), "kept until written");
        let store = crate::CheckpointStore::new(sled);
        store.apply(staged, &staged_positions).unwrap();
        assert_eq!(store.position(0).unwrap(), 99);
        assert_eq!(
            store.digest().unwrap(),
            reference_digest(&batch, &[(0, 99), (1, 5)])
        );
        store.flush().unwrap();
        assert!(!dir.path().join(STAGE_FILE).exists(), "written, then gone");
        drop(store);
        let sled = SledStore::open(dir.path()).unwrap();
        assert_eq!(sled.position(0).unwrap(), 99);
        assert_eq!(
            sled.digest().unwrap(),
            reference_digest(&batch, &[(0, 99), (1, 5)])
        );
    }

    #[test]
    fn a_stage_sled_has_passed_is_dropped_not_written_again() {
        let stale = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS + 7, "stale");
        for open_deferring in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = SledStore::open(dir.path()).unwrap();
                store.stage(&stale, &[(0, 50)]).unwrap();
                // A later checkpoint reached sled with positions past the stage's.
                store.apply(changes(10, "newer"), &[(0, 60)]).unwrap();
                store.db.flush().unwrap();
            }
            assert!(
                dir.path().join(STAGE_FILE).exists(),
                "the stale stage is left"
            );
            let store = if open_deferring {
                let (store, stage) = SledStore::open_deferring_stage(dir.path()).unwrap();
                assert!(stage.is_none(), "a passed stage is not handed over");
                store
            } else {
                SledStore::open(dir.path()).unwrap()
            };
            assert!(!dir.path().join(STAGE_FILE).exists());
            assert_eq!(store.position(0).unwrap(), 60);
            assert_eq!(
                store.digest().unwrap(),
                reference_digest(&changes(10, "newer"), &[(0, 60)]),
                "the stale stage wrote nothing over the newer values"
            );
        }
    }

    #[test]
    fn an_earlier_builds_stage_in_sled_is_finished_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let batch = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS + 7, "v");
        let positions = [(0, 77)];
        let store = crash_mid_checkpoint(dir.path(), &batch, |store| {
            // The earlier build's step 1: the encoded stage as sled values.
            let mut pieces = sled::Batch::default();
            for (i, piece) in encode_stage(&batch, &positions).chunks(1 << 16).enumerate() {
                pieces.insert(stage_key(i), piece);
            }
            store.projections.apply_batch(pieces).unwrap();
        });
        assert_eq!(store.position(0).unwrap(), 77);
        assert_eq!(
            store.digest().unwrap(),
            reference_digest(&batch, &positions)
        );
        assert_eq!(store.projections.scan_prefix(STAGE_PREFIX).count(), 0);
    }

    #[test]
    fn a_stage_cut_while_written_is_dropped_and_a_damaged_one_stops_the_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = SledStore::open(dir.path()).unwrap();
            store.apply(changes(10, "old"), &[(0, 10)]).unwrap();
            store.flush().unwrap();
        }
        // Cut before its rename: the checkpoint never began.
        std::fs::write(dir.path().join(STAGE_FILE_PARTIAL), b"half a stage").unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(store.position(0).unwrap(), 10);
        assert!(!dir.path().join(STAGE_FILE_PARTIAL).exists());
        store.stage(&changes(5, "new"), &[(0, 15)]).unwrap();
        drop(store);
        let path = dir.path().join(STAGE_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[20] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        match SledStore::open(dir.path()) {
            Err(StoreError::Corrupt(message)) => assert!(message.contains(STAGE_FILE)),
            other => panic!("a damaged stage opened: {other:?}"),
        }
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

    /// A store at position 10 holding `changes(10, "old")`, with a layer copy made
    /// over position `over` that reaches `reaches` (and a stage, if given).
    fn store_with_copy(
        dir: &Path,
        over: u64,
        reaches: u64,
        stage: Option<(&[Change], u64)>,
    ) -> Vec<Change> {
        let copied = changes(7, "copy");
        let store = SledStore::open(dir).unwrap();
        store.apply(changes(10, "old"), &[(0, 10)]).unwrap();
        if let Some((staged, at)) = stage {
            store.stage(&staged.to_vec(), &[(0, at)]).unwrap();
        }
        store
            .save_layer_copy(&[(0, over), (3, 0)], &copied, &[(0, reaches), (1, 4)])
            .unwrap();
        store.db.flush().unwrap();
        copied
    }

    #[test]
    fn a_layer_copy_over_what_sled_holds_is_handed_over_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let copied = store_with_copy(dir.path(), 10, 25, None);
        let (sled, handed) = SledStore::open_deferring_stage(dir.path()).unwrap();
        let (changes, positions) = handed.expect("the copy is handed over");
        assert_eq!(changes, copied);
        assert_eq!(positions, vec![(0, 25), (1, 4)]);
        assert_eq!(sled.position(0).unwrap(), 10, "sled is left as it was");
        assert!(
            dir.path().join(LAYER_COPY_FILE).exists(),
            "kept: a second crash before the next checkpoint needs it again"
        );
    }

    #[test]
    fn a_layer_copy_over_other_positions_or_damaged_is_removed_not_used() {
        for (over, damage) in [(9, false), (11, false), (10, true)] {
            let dir = tempfile::tempdir().unwrap();
            store_with_copy(dir.path(), over, 25, None);
            let path = dir.path().join(LAYER_COPY_FILE);
            if damage {
                let mut bytes = std::fs::read(&path).unwrap();
                bytes[30] ^= 1;
                std::fs::write(&path, bytes).unwrap();
            }
            let (sled, handed) = SledStore::open_deferring_stage(dir.path()).unwrap();
            assert!(handed.is_none(), "over {over}, damaged {damage}: not used");
            assert!(!path.exists(), "a stale or damaged copy is removed");
            assert_eq!(
                sled.digest().unwrap(),
                reference_digest(&changes(10, "old"), &[(0, 10)])
            );
        }
    }

    /// A store at 10 with a stage at 20 and a copy made over `over` reaching 25:
    /// both are handed over, the copy's changes last (they win); the reopened store.
    fn stage_then_copy_handed_over(dir: &Path, staged: &[Change], over: u64) -> SledStore {
        let copied = store_with_copy(dir, over, 25, Some((staged, 20)));
        let (sled, handed) = SledStore::open_deferring_stage(dir).unwrap();
        let (changes, positions) = handed.expect("stage and copy");
        let mut expected = staged.to_vec();
        expected.extend(copied);
        assert_eq!(changes, expected, "the copy's changes come last and win");
        assert_eq!(positions, vec![(0, 25), (1, 4)]);
        sled
    }

    #[test]
    fn a_layer_copy_goes_after_an_older_stage_and_never_before_a_newer_one() {
        let staged = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS, "staged");
        // The copy reaches past the stage: the layer took the stage in, then more.
        let dir = tempfile::tempdir().unwrap();
        stage_then_copy_handed_over(dir.path(), &staged, 10);
        // The stage reaches past the copy: it froze the copied layer later.
        let dir = tempfile::tempdir().unwrap();
        store_with_copy(dir.path(), 10, 25, Some((&staged, 30)));
        let (_, handed) = SledStore::open_deferring_stage(dir.path()).unwrap();
        let (changes, positions) = handed.expect("the stage");
        assert_eq!(changes, staged, "the older copy is not used");
        assert_eq!(positions, vec![(0, 30)]);
        assert!(!dir.path().join(LAYER_COPY_FILE).exists());
    }

    #[test]
    fn a_layer_copy_over_a_stage_being_written_goes_after_that_stage_only() {
        let staged = changes(3 * SLED_ATOMIC_BATCH_MAX_KEYS, "staged");
        // Made over sled with the stage written (sled at 10, the stage at 20).
        let dir = tempfile::tempdir().unwrap();
        let sled = stage_then_copy_handed_over(dir.path(), &staged, 20);
        assert_eq!(sled.position(0).unwrap(), 10, "sled is left as it was");
        // Made over another stage's positions: neither what sled holds nor what it
        // holds once this stage is written.
        for stage_at in [19, 30] {
            let dir = tempfile::tempdir().unwrap();
            store_with_copy(dir.path(), 20, 25, Some((&staged, stage_at)));
            let (_, handed) = SledStore::open_deferring_stage(dir.path()).unwrap();
            let (changes, positions) = handed.expect("the stage");
            assert_eq!(changes, staged, "stage at {stage_at}: the copy is not used");
            assert_eq!(positions, vec![(0, stage_at)]);
            assert!(!dir.path().join(LAYER_COPY_FILE).exists());
        }
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

    /// Twenty keys of one scope, customer and minute (one per meter) are one sled
    /// row; a delete of every entry removes the row.
    #[test]
    fn a_packed_tables_keys_share_one_row() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open_with(dir.path(), Packing::tables(b"A")).unwrap();
        let key = |meter: usize| {
            let mut key = b"Astore\0p".to_vec();
            key.extend_from_slice(format!("meter{meter:02}\0customer\0").as_bytes());
            key.extend_from_slice(&7u64.to_be_bytes());
            key
        };
        let rows = |store: &SledStore| store.projections.scan_prefix(b"A").count();
        store
            .apply(
                (0..20).map(|m| (key(m), Some(vec![m as u8]))).collect(),
                &[(0, 1)],
            )
            .unwrap();
        assert_eq!(rows(&store), 1);
        assert_eq!(store.get(&key(13)).unwrap(), Some(vec![13]));
        store
            .apply((0..19).map(|m| (key(m), None)).collect(), &[(0, 2)])
            .unwrap();
        assert_eq!(rows(&store), 1);
        assert_eq!(store.get(&key(13)).unwrap(), None);
        assert_eq!(store.get(&key(19)).unwrap(), Some(vec![19]));
        store.apply(vec![(key(19), None)], &[(0, 3)]).unwrap();
        assert_eq!(rows(&store), 0);
    }

    /// A batch merged into its rows in several passes (as a large checkpoint is)
    /// leaves sled holding exactly what one pass leaves: every row, plain key and
    /// slice listed, with rows whose changes come from many slices and rows that
    /// already held entries.
    #[test]
    fn rows_merged_in_passes_are_the_rows_of_one_pass() {
        let key = |meter: usize, customer: usize, minute: u64| {
            let mut key = b"Astore\0p".to_vec();
            key.extend_from_slice(format!("m{meter:02}\0c{customer:03}\0").as_bytes());
            key.extend_from_slice(&minute.to_be_bytes());
            key
        };
        let first: Vec<Change> = (0..5)
            .flat_map(|m| (0..40).map(move |c| (key(m, c, 1), Some(vec![m as u8, 1]))))
            .collect();
        let mut second: Vec<Change> = (0..8)
            .flat_map(|m| {
                (0..40).map(move |c| {
                    let value = (c % 7 != 0).then(|| vec![m as u8, c as u8]);
                    (key(m, c, 1 + (c as u64 % 2)), value)
                })
            })
            .chain((0..30).map(|i| (format!("Zplain{i:02}").into_bytes(), Some(vec![i]))))
            .collect();
        second.sort_by(|a, b| a.0.cmp(&b.0));
        let contents = |passes: usize| {
            let dir = tempfile::tempdir().unwrap();
            let store = SledStore::open_with(dir.path(), Packing::tables(b"A")).unwrap();
            store.apply(first.clone(), &[(0, 1)]).unwrap();
            let mut write = |key: &[u8], value: Option<&[u8]>| {
                match value {
                    Some(v) => store.projections.insert(key, v)?,
                    None => store.projections.remove(key)?,
                };
                Ok(())
            };
            store.write_changes_in(&second, &mut write, passes).unwrap();
            store
                .projections
                .iter()
                .map(|item| item.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
                .collect::<Vec<_>>()
        };
        let one = contents(1);
        assert!(one.iter().any(|(k, _)| k.starts_with(b"Zplain")));
        for passes in [2, 3, 7] {
            assert_eq!(contents(passes), one, "{passes} passes");
        }
    }

    /// A packed store without a slice directory (written before there was one)
    /// builds it from its rows on open: a scan across meters finds them all.
    #[test]
    fn a_missing_slice_directory_is_built_from_the_rows() {
        let dir = tempfile::tempdir().unwrap();
        let key = |meter: &str, customer: &str| {
            let mut key = b"Astore\0p".to_vec();
            key.extend_from_slice(format!("{meter}\0{customer}\0").as_bytes());
            key.extend_from_slice(&7u64.to_be_bytes());
            key
        };
        let keys = [key("m1", "a"), key("m1", "b"), key("m2", "a")];
        let every = |store: &SledStore| {
            let mut seen = Vec::new();
            store
                .scan(Bound::Unbounded, Bound::Unbounded, false, &mut |k, _| {
                    seen.push(k.to_vec());
                    Visit::Continue
                })
                .unwrap();
            seen
        };
        {
            let store = SledStore::open_with(dir.path(), Packing::tables(b"A")).unwrap();
            store
                .apply(
                    keys.iter().map(|k| (k.clone(), Some(vec![1]))).collect(),
                    &[(0, 1)],
                )
                .unwrap();
            assert_eq!(every(&store), keys.to_vec());
            let listed: Vec<_> = store
                .projections
                .scan_prefix(packing::SLICE_PREFIX)
                .map(|item| item.unwrap().0)
                .collect();
            assert_eq!(listed.len(), 2, "one per meter");
            for key in listed {
                store.projections.remove(key).unwrap();
            }
            store.flush().unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(every(&store), keys.to_vec());
    }
}
