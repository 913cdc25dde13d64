//! The embedded log: append-only segment files under `<data-dir>/log/`.
//!
//! Layout: segments named by the offset of their first byte (`00000000000000000000.seg`);
//! offsets are byte positions in the concatenated stream. Each record is framed as
//! `[u32 LE payload length][u32 LE CRC32 of payload][payload]`.
//!
//! Durability: one writer thread owns the active segment. It takes every append that
//! is waiting (group commit), writes them with one `write`, fsyncs once, then answers
//! all of them. It writes zeros ahead of the records (`PREALLOCATE_BYTES`), so most
//! fsyncs flush data only, not a new file length. Readers only ever see bytes below
//! the durable end, so nothing that was not fsynced is served. On open, the last
//! segment is scanned and cut after its last whole record: the zeros written ahead,
//! and a torn tail (a crash mid-write, logged). A frame is never empty, so zeros
//! never read as records. A rolled segment and a cleanly closed log are cut to
//! their records.
//!
//! An I/O error while writing poisons the log: later appends fail fast, because after
//! a failed fsync the file's contents are unknown (the PostgreSQL fsync lesson). The
//! process must restart, which recovers from the files.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{oneshot, watch};

use crate::{Log, LogEntry, LogError, LogReader, MAX_RECORD_BYTES};

const FRAME_HEADER_BYTES: usize = 8;
/// Segment size before rolling: small enough that recovery scans little, large
/// enough that rolls (an fsync of the directory) are rare.
pub const SEGMENT_MAX_BYTES: u64 = 256 * 1024 * 1024;
/// Zeroed bytes the writer keeps written ahead of the active segment's end. An
/// append that grows its file makes every fsync write the inode too (ext4 commits
/// a journal transaction for the new size); appends into bytes already written
/// and synced are data-only fsyncs: ~25% less CPU and ~30% less time per fsync,
/// measured on this project's VM (docs/benchmarks.md, "Zeroed segment tails").
/// Large enough that extending (one more fsync that does write the inode) is rare,
/// small enough that writing zeros, and scanning them on open, is quick.
pub const PREALLOCATE_BYTES: u64 = 16 * 1024 * 1024;
/// Zero bytes written per `write` while extending a segment.
const ZERO_WRITE_BYTES: usize = 1024 * 1024;
/// Appends waiting for the writer thread; beyond this, appenders wait for room
/// (backpressure instead of unbounded memory).
pub const APPEND_QUEUE_CAPACITY: usize = 16 * 1024;
/// Most bytes one group commit writes before it fsyncs, so one huge burst cannot
/// delay the first appender's answer indefinitely.
pub const GROUP_COMMIT_MAX_BYTES: usize = 8 * 1024 * 1024;
/// The most bytes a crash can leave unacknowledged at the end of the log: one group
/// commit's worth plus one whole frame of the largest record (a group may exceed its
/// byte budget by the frame that crossed it). Recovery cuts a bad tail only when it
/// is no longer than this; anything longer is corruption of acknowledged records.
pub const TORN_TAIL_MAX_BYTES: u64 =
    (GROUP_COMMIT_MAX_BYTES + FRAME_HEADER_BYTES + MAX_RECORD_BYTES) as u64;
/// Bytes a reader asks for at once.
pub const READ_CHUNK_BYTES: usize = 1024 * 1024;
/// Bytes of payload a record read by position reads with its header: a usage
/// record of 100 events is ~27 KiB, so most records are read whole in one read; a
/// larger one reads its rest in a second, and a smaller one reads a few pages past
/// its end (cheaper than a second trip to the disk).
pub const FRAME_READ_GUESS_BYTES: usize = 32 * 1024;
/// Threads one `read_many` spreads its positioned reads over: scattered records of
/// a large log are disk reads, and a disk answers several at once faster than one
/// after another (a void reads a few hundred records its apply needs); a few are
/// enough to keep its queue full without crowding the blocking pool.
pub const READ_MANY_THREADS: usize = 8;
/// Reads below which `read_many` stays on the caller's thread: handing work to
/// other threads costs more than a few reads the page cache answers.
const READ_MANY_PARALLEL_FROM: usize = 4;
const SEGMENT_SUFFIX: &str = ".seg";

struct AppendRequest {
    payload: Vec<u8>,
    reply: oneshot::Sender<Result<u64, LogError>>,
}

struct Shared {
    dir: PathBuf,
    /// Base offsets of the segments, ascending.
    segment_bases: RwLock<Vec<u64>>,
    durable_end: watch::Sender<u64>,
    poisoned: AtomicBool,
}

pub struct EmbeddedLog {
    shared: Arc<Shared>,
    sender: Option<mpsc::SyncSender<AppendRequest>>,
    writer: Option<std::thread::JoinHandle<()>>,
    _lock: File,
}

impl std::fmt::Debug for EmbeddedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedLog")
            .field("dir", &self.shared.dir)
            .finish()
    }
}

fn segment_path(dir: &Path, base: u64) -> PathBuf {
    dir.join(format!("{base:020}{SEGMENT_SUFFIX}"))
}

fn list_segments(dir: &Path) -> io::Result<Vec<u64>> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(dir)? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(stem) = name.strip_suffix(SEGMENT_SUFFIX) {
            if let Ok(base) = stem.parse::<u64>() {
                bases.push(base);
            }
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Where, after a bad frame at `from`, a run of valid frames starts that ends at
/// the last non-zero byte `data_end` or in the zeros after it (a payload may end
/// in zeros), up to `file_end`, if one does: the mark of corruption in the middle
/// of acknowledged records, as opposed to a torn write, after which nothing valid
/// follows. The region is at most `TORN_TAIL_MAX_BYTES` (checked before).
///
/// One exception: a run that follows a whole zeroed page is a torn write too. The
/// writer writes records over zeros it wrote ahead, and a power cut during the
/// fsync may persist a later page of the write and not an earlier one; corruption
/// of acknowledged records does not zero a whole page.
fn valid_frames_follow(
    file: &File,
    from: u64,
    data_end: u64,
    file_end: u64,
) -> io::Result<Option<u64>> {
    let readable_end = file_end.min(data_end + (FRAME_HEADER_BYTES + MAX_RECORD_BYTES) as u64);
    let mut region = vec![0u8; (readable_end - from) as usize];
    file.read_exact_at(&mut region, from)?;
    let data_len = (data_end - from) as usize;
    let header_at = |at: usize| -> Option<(usize, u32)> {
        let header = region.get(at..at + FRAME_HEADER_BYTES)?;
        let len = u32::from_le_bytes(header[0..4].try_into().ok()?) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().ok()?);
        (len > 0 && len <= MAX_RECORD_BYTES && at + FRAME_HEADER_BYTES + len <= region.len())
            .then_some((len, crc))
    };
    for start in 1..data_len {
        // Walk headers first (cheap); check checksums only for a run that ends
        // where the non-zero bytes end or in the zeros after them.
        let mut at = start;
        let mut frames = Vec::new();
        while at < data_len {
            let Some((len, crc)) = header_at(at) else {
                break;
            };
            frames.push((at, len, crc));
            at += FRAME_HEADER_BYTES + len;
        }
        if at < data_len || frames.is_empty() {
            continue;
        }
        let all_valid = frames.iter().all(|(at, len, crc)| {
            let payload = &region[at + FRAME_HEADER_BYTES..at + FRAME_HEADER_BYTES + len];
            crc32fast::hash(payload) == *crc
        });
        if all_valid && !zeroed_page_within(&region[..start], from) {
            return Ok(Some(from + start as u64));
        }
    }
    Ok(None)
}

/// Bytes of a page of the page cache, the unit a crash may lose out of a write.
const PAGE_BYTES: u64 = 4096;

/// Whether `bytes` (starting at file offset `offset`) hold a whole page-aligned
/// page of zeros.
fn zeroed_page_within(bytes: &[u8], offset: u64) -> bool {
    let first_page = offset.div_ceil(PAGE_BYTES) * PAGE_BYTES;
    let mut page = first_page;
    while page + PAGE_BYTES <= offset + bytes.len() as u64 {
        let at = (page - offset) as usize;
        if bytes[at..at + PAGE_BYTES as usize].iter().all(|b| *b == 0) {
            return true;
        }
        page += PAGE_BYTES;
    }
    false
}

/// Where the non-zero bytes of `file` end, looking back from `file_end` no
/// further than `floor`: the end of what a crash left of a write over the zeros
/// the writer keeps ahead (`floor` when only zeros follow it).
fn nonzero_end(file: &File, floor: u64, file_end: u64) -> io::Result<u64> {
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    let mut end = file_end;
    while end > floor {
        let start = end.saturating_sub(READ_CHUNK_BYTES as u64).max(floor);
        let bytes = &mut chunk[..(end - start) as usize];
        file.read_exact_at(bytes, start)?;
        if let Some(last) = bytes.iter().rposition(|b| *b != 0) {
            return Ok(start + last as u64 + 1);
        }
        end = start;
    }
    Ok(floor)
}

/// Every segment but the last is sealed: it must end exactly where the next begins
/// (a shorter one lost acknowledged records; frames are checked as they are read).
fn check_sealed_segments(dir: &Path, bases: &[u64]) -> Result<(), LogError> {
    for pair in bases.windows(2) {
        let path = segment_path(dir, pair[0]);
        let len = fs::metadata(&path)?.len();
        if pair[0] + len != pair[1] {
            return Err(LogError::Corrupt(format!(
                "segment {} holds {len} bytes but the next segment starts at log offset {}: records between {} and {} are missing",
                path.display(),
                pair[1],
                pair[0] + len,
                pair[1],
            )));
        }
    }
    Ok(())
}

/// Length of the valid prefix of a segment: where the first incomplete or corrupt
/// frame starts (or the file length when all frames are whole).
fn valid_prefix_len(file: &mut File) -> io::Result<u64> {
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(0))?;
    let mut reader = io::BufReader::with_capacity(READ_CHUNK_BYTES, file);
    let mut position = 0u64;
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let mut payload = Vec::new();
    loop {
        if position + FRAME_HEADER_BYTES as u64 > len {
            return Ok(position);
        }
        reader.read_exact(&mut header)?;
        let payload_len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        if payload_len == 0
            || payload_len > MAX_RECORD_BYTES
            || position + (FRAME_HEADER_BYTES + payload_len) as u64 > len
        {
            return Ok(position);
        }
        payload.resize(payload_len, 0);
        reader.read_exact(&mut payload)?;
        if crc32fast::hash(&payload) != crc {
            return Ok(position);
        }
        position += (FRAME_HEADER_BYTES + payload_len) as u64;
    }
}

impl EmbeddedLog {
    /// Opens (or creates) the log in `dir`, recovering a torn tail.
    pub fn open(dir: impl AsRef<Path>) -> Result<EmbeddedLog, LogError> {
        EmbeddedLog::open_with(dir, SegmentSizes::default())
    }

    /// `open` with segment sizes other than the defaults (tests).
    pub fn open_with(dir: impl AsRef<Path>, sizes: SegmentSizes) -> Result<EmbeddedLog, LogError> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("LOCK"))?;
        if lock.try_lock().is_err() {
            return Err(LogError::Locked(dir.display().to_string()));
        }
        let mut bases = list_segments(&dir)?;
        if bases.is_empty() {
            File::create(segment_path(&dir, 0))?.sync_all()?;
            fsync_dir(&dir)?;
            bases.push(0);
        }
        let active_base = *bases.last().expect("at least one segment");
        let active_path = segment_path(&dir, active_base);
        let mut active = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&active_path)?;
        check_sealed_segments(&dir, &bases)?;
        let file_len = active.metadata()?.len();
        let valid_len = valid_prefix_len(&mut active)?;
        // Past the records: the zeros the writer keeps ahead, after what a crash
        // left of a write that was never acknowledged (if anything).
        let data_end = nonzero_end(&active, valid_len, file_len)?;
        if data_end - valid_len > TORN_TAIL_MAX_BYTES {
            return Err(LogError::Corrupt(format!(
                "segment {} has a bad frame at log offset {} followed by {} more bytes, more than a crash can leave unacknowledged ({TORN_TAIL_MAX_BYTES}); refusing to drop acknowledged records. Restore the log from a backup, or cut the file at that offset by hand if you accept losing what follows",
                active_path.display(),
                active_base + valid_len,
                data_end - valid_len,
            )));
        }
        if valid_len < data_end {
            if let Some(at) = valid_frames_follow(&active, valid_len, data_end, file_len)? {
                return Err(LogError::Corrupt(format!(
                    "segment {} has a bad frame at log offset {}, yet valid frames follow from offset {} to its end: acknowledged records would be lost by cutting. Restore the log from a backup",
                    active_path.display(),
                    active_base + valid_len,
                    active_base + at,
                )));
            }
            tracing::warn!(
                segment = %active_path.display(),
                valid_bytes = valid_len,
                dropped_bytes = data_end - valid_len,
                "truncating torn or corrupt tail of the log (a crash during a write); those bytes were never acknowledged"
            );
        }
        if valid_len < file_len {
            // The writer writes zeros ahead again from here.
            active.set_len(valid_len)?;
            active.sync_all()?;
        }
        let end = active_base + valid_len;
        let (durable_end, _) = watch::channel(end);
        let shared = Arc::new(Shared {
            dir: dir.clone(),
            segment_bases: RwLock::new(bases),
            durable_end,
            poisoned: AtomicBool::new(false),
        });
        let (sender, receiver) = mpsc::sync_channel(APPEND_QUEUE_CAPACITY);
        let writer_shared = shared.clone();
        let writer = std::thread::Builder::new()
            .name("tally-log-writer".into())
            .spawn(move || writer_loop(writer_shared, receiver, active, active_base, end, sizes))?;
        fs::create_dir_all(dir.join("consumers"))?;
        Ok(EmbeddedLog {
            shared,
            sender: Some(sender),
            writer: Some(writer),
            _lock: lock,
        })
    }

    /// The directory this log lives in.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }
}

impl Drop for EmbeddedLog {
    fn drop(&mut self) {
        // Closing the channel lets the writer finish what is queued and exit.
        self.sender.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// Sizes of the embedded log's files; tests shrink them to see rolls and
/// extensions without writing hundreds of megabytes.
#[derive(Debug, Clone, Copy)]
pub struct SegmentSizes {
    /// Bytes of records in a segment before the next append rolls to a new one.
    pub max_bytes: u64,
    /// Zeroed bytes written ahead of the active segment's end.
    pub preallocate_bytes: u64,
}

impl Default for SegmentSizes {
    fn default() -> SegmentSizes {
        SegmentSizes {
            max_bytes: SEGMENT_MAX_BYTES,
            preallocate_bytes: PREALLOCATE_BYTES,
        }
    }
}

/// Makes the active segment's file at least `needed` bytes long by writing zeros
/// from `allocated` up to `needed + sizes.preallocate_bytes` (synced by the fsync
/// of the append that needed them); answers the new length.
fn extend_with_zeros(
    file: &File,
    allocated: u64,
    needed: u64,
    sizes: SegmentSizes,
) -> io::Result<u64> {
    if needed <= allocated {
        return Ok(allocated);
    }
    let target = needed.saturating_add(sizes.preallocate_bytes);
    let zeros = vec![0u8; ZERO_WRITE_BYTES];
    let mut at = allocated;
    while at < target {
        let n = usize::try_from(target - at)
            .map_or(ZERO_WRITE_BYTES, |left| left.min(ZERO_WRITE_BYTES));
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    Ok(target)
}

fn writer_loop(
    shared: Arc<Shared>,
    receiver: mpsc::Receiver<AppendRequest>,
    mut active: File,
    mut active_base: u64,
    mut end: u64,
    sizes: SegmentSizes,
) {
    // Bytes of the active file (records, then zeros written ahead); open leaves
    // the file exactly as long as its records.
    let mut allocated = end - active_base;
    let mut buffer = Vec::with_capacity(GROUP_COMMIT_MAX_BYTES);
    let mut group: Vec<(u64, oneshot::Sender<Result<u64, LogError>>)> = Vec::new();
    while let Ok(first) = receiver.recv() {
        let mut next = Some(first);
        buffer.clear();
        group.clear();
        let mut position = end;
        while let Some(request) = next.take() {
            let len = request.payload.len();
            buffer.extend_from_slice(&(len as u32).to_le_bytes());
            buffer.extend_from_slice(&crc32fast::hash(&request.payload).to_le_bytes());
            buffer.extend_from_slice(&request.payload);
            group.push((position, request.reply));
            position += (FRAME_HEADER_BYTES + len) as u64;
            if buffer.len() < GROUP_COMMIT_MAX_BYTES {
                next = receiver.try_recv().ok();
            }
        }
        if shared.poisoned.load(Ordering::SeqCst) {
            for (_, reply) in group.drain(..) {
                let _ = reply.send(Err(LogError::Poisoned));
            }
            continue;
        }
        let result = (|| -> io::Result<()> {
            if end - active_base + buffer.len() as u64 > sizes.max_bytes && end > active_base {
                // Roll: the new segment starts exactly where the old one ends, and
                // the old one is cut to its records (a sealed segment's length
                // says where its records end: `check_sealed_segments`).
                active.set_len(end - active_base)?;
                active.sync_all()?;
                let new_file = OpenOptions::new()
                    .create_new(true)
                    .read(true)
                    .write(true)
                    .open(segment_path(&shared.dir, end))?;
                fsync_dir(&shared.dir)?;
                active = new_file;
                active_base = end;
                allocated = 0;
                shared
                    .segment_bases
                    .write()
                    .expect("segment list lock")
                    .push(end);
            }
            let within = end - active_base;
            let needed = within + buffer.len() as u64;
            allocated = extend_with_zeros(&active, allocated, needed, sizes).unwrap_or_else(|error| {
                // Zeros ahead only spare fsyncs work: without them the append still
                // writes (and fails only if its own bytes do not fit). Not retried
                // before another `preallocate_bytes` of records.
                tracing::warn!(%error, "could not write zeros ahead of the log's end; appending without them");
                needed.saturating_add(sizes.preallocate_bytes)
            });
            active.write_all_at(&buffer, within)?;
            active.sync_data()
        })();
        match result {
            Ok(()) => {
                end = position;
                shared.durable_end.send_replace(end);
                for (offset, reply) in group.drain(..) {
                    let _ = reply.send(Ok(offset));
                }
            }
            Err(error) => {
                tracing::error!(%error, "log write or fsync failed; refusing further appends until restart");
                shared.poisoned.store(true, Ordering::SeqCst);
                for (_, reply) in group.drain(..) {
                    let _ = reply.send(Err(LogError::Io(io::Error::new(
                        error.kind(),
                        error.to_string(),
                    ))));
                }
            }
        }
    }
    // A clean close cuts the zeros written ahead, as the next open would.
    if !shared.poisoned.load(Ordering::SeqCst) && allocated > end - active_base {
        if let Err(error) = active
            .set_len(end - active_base)
            .and_then(|()| active.sync_all())
        {
            tracing::warn!(%error, "could not cut the log's zeroed tail at close; the next open will");
        }
    }
}

#[async_trait]
impl Log for EmbeddedLog {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn health(&self) -> Option<String> {
        self.shared
            .poisoned
            .load(Ordering::SeqCst)
            .then(|| LogError::Poisoned.to_string())
    }

    fn partition_count(&self) -> u32 {
        1
    }

    async fn append(&self, _key: &[u8], payload: Vec<u8>) -> Result<u64, LogError> {
        if payload.len() > MAX_RECORD_BYTES {
            return Err(LogError::RecordTooLarge(payload.len()));
        }
        if payload.is_empty() {
            // Frames are never empty, so a zeroed region of a file never reads as
            // a run of valid frames.
            return Err(LogError::EmptyRecord);
        }
        if self.shared.poisoned.load(Ordering::SeqCst) {
            return Err(LogError::Poisoned);
        }
        let sender = self.sender.as_ref().ok_or(LogError::Closed)?.clone();
        let (reply, answer) = oneshot::channel();
        let request = AppendRequest { payload, reply };
        // A full queue blocks; do that off the async worker threads.
        match sender.try_send(request) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(request)) => {
                tokio::task::spawn_blocking(move || sender.send(request))
                    .await
                    .map_err(|_| LogError::Closed)?
                    .map_err(|_| LogError::Closed)?;
            }
            Err(mpsc::TrySendError::Disconnected(_)) => return Err(LogError::Closed),
        }
        answer.await.map_err(|_| LogError::Closed)?
    }

    async fn read_at(&self, partition: u32, offset: u64) -> Result<Option<LogEntry>, LogError> {
        if partition != 0 {
            return Err(LogError::NoSuchPartition(partition));
        }
        let shared = self.shared.clone();
        let end = *shared.durable_end.borrow();
        if offset >= end {
            return Ok(None);
        }
        // Two small positioned reads (header, then payload) instead of a reader's
        // chunk: a listing reads many scattered records.
        Ok(Some(read_frame_at(&shared, offset, end)?))
    }

    async fn read_many(
        &self,
        partition: u32,
        offsets: &[u64],
    ) -> Result<Vec<Option<LogEntry>>, LogError> {
        if partition != 0 {
            return Err(LogError::NoSuchPartition(partition));
        }
        let end = *self.shared.durable_end.borrow();
        let read = move |shared: &Shared, offsets: &[u64]| -> io::Result<Vec<Option<LogEntry>>> {
            offsets
                .iter()
                .map(|&offset| {
                    (offset < end)
                        .then(|| read_frame_at(shared, offset, end))
                        .transpose()
                })
                .collect()
        };
        if offsets.len() < READ_MANY_PARALLEL_FROM {
            return Ok(read(&self.shared, offsets)?);
        }
        // Contiguous shares, answered in the order asked.
        let share = offsets.len().div_ceil(READ_MANY_THREADS);
        let mut reads = Vec::new();
        for part in offsets.chunks(share) {
            let (shared, part) = (self.shared.clone(), part.to_vec());
            reads.push(tokio::task::spawn_blocking(move || read(&shared, &part)));
        }
        let mut entries = Vec::with_capacity(offsets.len());
        for read in reads {
            entries.extend(read.await.map_err(|_| LogError::Closed)??);
        }
        Ok(entries)
    }

    async fn reader(
        &self,
        partition: u32,
        from_offset: u64,
    ) -> Result<Box<dyn LogReader>, LogError> {
        if partition != 0 {
            return Err(LogError::NoSuchPartition(partition));
        }
        Ok(Box::new(EmbeddedReader {
            shared: self.shared.clone(),
            durable_end: self.shared.durable_end.subscribe(),
            offset: from_offset,
            open_segment: None,
            buffer: Vec::new(),
        }))
    }

    async fn end_offset(&self, partition: u32) -> Result<u64, LogError> {
        if partition != 0 {
            return Err(LogError::NoSuchPartition(partition));
        }
        Ok(*self.shared.durable_end.borrow())
    }

    async fn commit(&self, group: &str, partition: u32, next_offset: u64) -> Result<(), LogError> {
        let dir = self.shared.dir.join("consumers");
        let path = dir.join(format!("{group}-{partition}"));
        let tmp = dir.join(format!("{group}-{partition}.tmp"));
        tokio::task::spawn_blocking(move || -> io::Result<()> {
            let mut file = File::create(&tmp)?;
            file.write_all(next_offset.to_string().as_bytes())?;
            file.sync_all()?;
            fs::rename(&tmp, &path)?;
            fsync_dir(&dir)
        })
        .await
        .map_err(|_| LogError::Closed)??;
        Ok(())
    }

    async fn committed(&self, group: &str, partition: u32) -> Result<Option<u64>, LogError> {
        let path = self
            .shared
            .dir
            .join("consumers")
            .join(format!("{group}-{partition}"));
        match fs::read_to_string(path) {
            Ok(text) => Ok(text.trim().parse().ok()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// The frame starting at `offset` (below the durable `end`), checked like a reader
/// checks it: an offset that is not a frame start reads as corruption.
fn read_frame_at(shared: &Shared, offset: u64, end: u64) -> io::Result<LogEntry> {
    // The segment holding `offset`, and where its bytes end (the next segment's
    // base, or the durable end for the last one).
    let (base, segment_end) = {
        let bases = shared.segment_bases.read().expect("segment list lock");
        let at = match bases.binary_search(&offset) {
            Ok(i) => i,
            Err(0) => 0,
            Err(i) => i - 1,
        };
        (
            bases[at],
            bases.get(at + 1).copied().map_or(end, |next| next.min(end)),
        )
    };
    let corrupt = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let file = File::open(segment_path(&shared.dir, base))?;
    // A record read by position is one of many scattered ones (a void's, a
    // listing's): the kernel's read-ahead would read on past it, up to a whole
    // read-ahead window of records nobody asked for, and on a cold page cache that
    // is most of the bytes read. Only advice: reading works without it.
    #[cfg(target_os = "linux")]
    if let Err(error) = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random) {
        tracing::debug!(%error, "could not advise random reads of a log segment");
    }
    // One read for the header and a usual record (`FRAME_READ_GUESS_BYTES`), so a
    // record read back is one trip to the disk, not two; a larger one reads its rest.
    let within = offset - base;
    let guess = usize::try_from(segment_end.saturating_sub(offset))
        .unwrap_or(usize::MAX)
        .min(FRAME_HEADER_BYTES + FRAME_READ_GUESS_BYTES);
    if guess < FRAME_HEADER_BYTES {
        return Err(corrupt(format!(
            "a frame header at offset {offset} runs past the log's end"
        )));
    }
    let mut frame = vec![0u8; guess];
    file.read_exact_at(&mut frame, within)?;
    let len = u32::from_le_bytes(frame[..4].try_into().expect("4")) as usize;
    let crc = u32::from_le_bytes(frame[4..8].try_into().expect("4"));
    if len == 0
        || len > MAX_RECORD_BYTES
        || offset + (FRAME_HEADER_BYTES + len) as u64 > segment_end
    {
        return Err(corrupt(format!(
            "corrupt frame length {len} in the log at offset {offset}"
        )));
    }
    let total = FRAME_HEADER_BYTES + len;
    if total > frame.len() {
        let read = frame.len();
        frame.resize(total, 0);
        file.read_exact_at(&mut frame[read..], within + read as u64)?;
    }
    frame.truncate(total);
    frame.drain(..FRAME_HEADER_BYTES);
    let payload = frame;
    if crc32fast::hash(&payload) != crc {
        return Err(corrupt(format!(
            "checksum mismatch in the log at offset {offset}"
        )));
    }
    Ok(LogEntry {
        partition: 0,
        offset,
        next_offset: offset + (FRAME_HEADER_BYTES + len) as u64,
        payload,
    })
}

struct EmbeddedReader {
    shared: Arc<Shared>,
    durable_end: watch::Receiver<u64>,
    offset: u64,
    /// (base, end-or-None-if-active, file) of the segment holding `offset`.
    open_segment: Option<(u64, Option<u64>, File)>,
    buffer: Vec<u8>,
}

impl EmbeddedReader {
    /// Finds and opens the segment holding `self.offset`.
    fn locate_segment(&mut self) -> io::Result<()> {
        if let Some((base, limit, _)) = &mut self.open_segment {
            if limit.is_none() {
                // The active segment may have been rolled since it was opened.
                let bases = self.shared.segment_bases.read().expect("segment list lock");
                *limit = bases.iter().copied().find(|b| *b > *base);
            }
            if self.offset >= *base && limit.is_none_or(|l| self.offset < l) {
                return Ok(());
            }
        }
        let bases = self
            .shared
            .segment_bases
            .read()
            .expect("segment list lock")
            .clone();
        let index = match bases.binary_search(&self.offset) {
            Ok(i) => i,
            Err(0) => 0,
            Err(i) => i - 1,
        };
        let base = bases[index];
        let limit = bases.get(index + 1).copied();
        let file = File::open(segment_path(&self.shared.dir, base))?;
        self.open_segment = Some((base, limit, file));
        Ok(())
    }

    fn read_available(&mut self, max_records: usize, end: u64) -> io::Result<Vec<LogEntry>> {
        let mut entries = Vec::new();
        while entries.len() < max_records && self.offset < end {
            self.locate_segment()?;
            let (base, limit, file) = self.open_segment.as_ref().expect("located");
            let readable_end = limit.map_or(end, |l| l.min(end));
            if self.offset >= readable_end {
                // At the end of a finished segment: the next one starts here.
                self.open_segment = None;
                continue;
            }
            let want = ((readable_end - self.offset) as usize).min(READ_CHUNK_BYTES);
            self.buffer.resize(want, 0);
            file.read_exact_at(&mut self.buffer, self.offset - base)?;
            let mut cursor = 0usize;
            let mut progressed = false;
            while entries.len() < max_records && cursor + FRAME_HEADER_BYTES <= self.buffer.len() {
                let len = u32::from_le_bytes(self.buffer[cursor..cursor + 4].try_into().expect("4"))
                    as usize;
                let crc =
                    u32::from_le_bytes(self.buffer[cursor + 4..cursor + 8].try_into().expect("4"));
                let frame_end = cursor + FRAME_HEADER_BYTES + len;
                let frame_offset = self.offset;
                // Bounded before anything is allocated: a garbage length is corruption.
                if len == 0
                    || len > MAX_RECORD_BYTES
                    || frame_offset + (FRAME_HEADER_BYTES + len) as u64 > readable_end
                {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("corrupt frame length {len} in the log at offset {frame_offset}"),
                    ));
                }
                if frame_end > self.buffer.len() {
                    if !progressed {
                        // A frame larger than the chunk: read exactly that frame.
                        let mut frame = vec![0u8; FRAME_HEADER_BYTES + len];
                        file.read_exact_at(&mut frame, self.offset - base)?;
                        self.buffer = frame;
                        continue;
                    }
                    break;
                }
                let payload = &self.buffer[cursor + FRAME_HEADER_BYTES..frame_end];
                if crc32fast::hash(payload) != crc {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("checksum mismatch in the log at offset {}", self.offset),
                    ));
                }
                let offset = self.offset;
                let next_offset = offset + (FRAME_HEADER_BYTES + len) as u64;
                entries.push(LogEntry {
                    partition: 0,
                    offset,
                    next_offset,
                    payload: payload.to_vec(),
                });
                self.offset = next_offset;
                cursor = frame_end;
                progressed = true;
            }
        }
        Ok(entries)
    }
}

#[async_trait]
impl LogReader for EmbeddedReader {
    async fn next_batch(
        &mut self,
        max_records: usize,
        wait: Duration,
    ) -> Result<Vec<LogEntry>, LogError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let end = *self.durable_end.borrow_and_update();
            if self.offset < end {
                return Ok(self.read_available(max_records.max(1), end)?);
            }
            match tokio::time::timeout_at(deadline, self.durable_end.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Err(LogError::Closed),
                Err(_) => return Ok(Vec::new()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn torn_tail_is_truncated_and_never_served() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = EmbeddedLog::open(dir.path()).unwrap();
            log.append(b"k", b"first".to_vec()).await.unwrap();
            log.append(b"k", b"second".to_vec()).await.unwrap();
        }
        // Simulate a crash mid-write: half a frame at the end of the segment.
        let path = segment_path(dir.path(), 0);
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&100u32.to_le_bytes()).unwrap();
        file.write_all(&[1, 2, 3, 4, 5, 6]).unwrap();
        drop(file);
        let log = EmbeddedLog::open(dir.path()).unwrap();
        let mut reader = log.reader(0, 0).await.unwrap();
        let entries = reader
            .next_batch(10, Duration::from_millis(10))
            .await
            .unwrap();
        let payloads: Vec<_> = entries.iter().map(|e| e.payload.clone()).collect();
        assert_eq!(payloads, vec![b"first".to_vec(), b"second".to_vec()]);
        // And appends continue cleanly after the truncation point.
        log.append(b"k", b"third".to_vec()).await.unwrap();
        let more = reader
            .next_batch(10, Duration::from_millis(100))
            .await
            .unwrap();
        assert_eq!(more.len(), 1);
        assert_eq!(more[0].payload, b"third");
    }

    #[tokio::test]
    async fn corrupt_checksum_in_tail_is_truncated() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = EmbeddedLog::open(dir.path()).unwrap();
            log.append(b"k", b"good".to_vec()).await.unwrap();
            log.append(b"k", b"flipped".to_vec()).await.unwrap();
        }
        let path = segment_path(dir.path(), 0);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&path, bytes).unwrap();
        let log = EmbeddedLog::open(dir.path()).unwrap();
        assert_eq!(
            log.end_offset(0).await.unwrap(),
            (FRAME_HEADER_BYTES + 4) as u64
        );
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    /// A bad frame followed by valid ones is corruption of acknowledged records:
    /// start-up stops and names the offset instead of cutting them away.
    #[tokio::test]
    async fn corruption_before_valid_frames_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = EmbeddedLog::open(dir.path()).unwrap();
            for payload in [&b"one"[..], b"two", b"three"] {
                log.append(b"k", payload.to_vec()).await.unwrap();
            }
        }
        let path = segment_path(dir.path(), 0);
        let mut bytes = fs::read(&path).unwrap();
        bytes[FRAME_HEADER_BYTES] ^= 0xff; // the first payload's first byte
        fs::write(&path, &bytes).unwrap();
        match EmbeddedLog::open(dir.path()) {
            Err(LogError::Corrupt(message)) => {
                assert!(message.contains("offset 0"), "{message}");
                assert!(
                    message.contains(&format!("offset {}", FRAME_HEADER_BYTES + 3)),
                    "{message}"
                );
            }
            other => panic!("expected corruption, got {other:?}"),
        }
        assert_eq!(fs::read(&path).unwrap(), bytes, "nothing was cut");
    }

    /// A sealed segment shorter than the gap to the next one lost records; a
    /// garbage frame length in a sealed segment is reported, never allocated.
    #[tokio::test]
    async fn sealed_segments_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let first = [frame(b"a"), frame(b"b")].concat();
        fs::write(segment_path(dir.path(), 0), &first).unwrap();
        fs::write(
            segment_path(dir.path(), first.len() as u64 + 5),
            frame(b"c"),
        )
        .unwrap();
        assert!(matches!(
            EmbeddedLog::open(dir.path()),
            Err(LogError::Corrupt(_))
        ));

        let dir = tempfile::tempdir().unwrap();
        let mut garbage = frame(b"a");
        garbage.extend_from_slice(&u32::MAX.to_le_bytes());
        garbage.extend_from_slice(&[0; 4]);
        fs::write(segment_path(dir.path(), 0), &garbage).unwrap();
        fs::write(segment_path(dir.path(), garbage.len() as u64), frame(b"c")).unwrap();
        let log = EmbeddedLog::open(dir.path()).unwrap();
        let mut reader = log.reader(0, 0).await.unwrap();
        let mut failure = None;
        for _ in 0..3 {
            match reader.next_batch(10, Duration::from_millis(10)).await {
                Ok(_) => {}
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let error = failure.expect("the garbage frame is reported");
        assert!(error.is_corruption(), "{error}");
        assert!(
            log.append(b"k", Vec::new()).await.is_err(),
            "empty records are refused"
        );
    }

    /// Small sizes, so a test sees zeros written ahead and rolls.
    const SMALL: SegmentSizes = SegmentSizes {
        max_bytes: 600,
        preallocate_bytes: 8 * 1024,
    };

    async fn payloads(log: &EmbeddedLog) -> Vec<Vec<u8>> {
        let mut reader = log.reader(0, 0).await.unwrap();
        let mut all = Vec::new();
        loop {
            let batch = reader
                .next_batch(1_000, Duration::from_millis(20))
                .await
                .unwrap();
            if batch.is_empty() {
                return all;
            }
            all.extend(batch.into_iter().map(|e| e.payload));
        }
    }

    /// What a crash leaves on disk while the log is open: the files as they are
    /// (zeros written ahead included), in a directory no process holds.
    fn crash_copy(from: &Path) -> tempfile::TempDir {
        let to = tempfile::tempdir().unwrap();
        for base in list_segments(from).unwrap() {
            fs::copy(segment_path(from, base), segment_path(to.path(), base)).unwrap();
        }
        to
    }

    #[tokio::test]
    async fn zeros_written_ahead_are_no_records_after_a_crash() {
        // The default sizes too: their zeros are more than a torn write can be.
        for sizes in [SMALL, SegmentSizes::default()] {
            zeros_after_a_crash(sizes).await;
        }
    }

    async fn zeros_after_a_crash(sizes: SegmentSizes) {
        let dir = tempfile::tempdir().unwrap();
        let log = EmbeddedLog::open_with(dir.path(), sizes).unwrap();
        for payload in [&b"one"[..], b"two\0\0"] {
            log.append(b"k", payload.to_vec()).await.unwrap();
        }
        let end = log.end_offset(0).await.unwrap();
        let file_len = fs::metadata(segment_path(dir.path(), 0)).unwrap().len();
        assert!(
            file_len > end + sizes.preallocate_bytes / 2,
            "{file_len} {end}"
        );

        let crashed = crash_copy(dir.path());
        let reopened = EmbeddedLog::open_with(crashed.path(), sizes).unwrap();
        assert_eq!(reopened.end_offset(0).await.unwrap(), end);
        reopened.append(b"k", b"three".to_vec()).await.unwrap();
        assert_eq!(
            payloads(&reopened).await,
            vec![b"one".to_vec(), b"two\0\0".to_vec(), b"three".to_vec()]
        );
        drop(reopened);
        // A clean close leaves the file exactly as long as its records.
        let len = fs::metadata(segment_path(crashed.path(), 0)).unwrap().len();
        assert_eq!(len, end + (FRAME_HEADER_BYTES + 5) as u64);
    }

    /// The variable that makes `appends_go_on_when_zeros_cannot_be_written_ahead`
    /// run as the child it starts (the data dir to use).
    const NO_ROOM_CHILD_DIR: &str = "TALLY_LOG_TEST_NO_ROOM_DIR";

    /// A file-size limit below the zeros written ahead (`PREALLOCATE_BYTES`), set
    /// for a child process (`ulimit -f`, in KiB, with SIGXFSZ ignored so that a
    /// write past it fails with EFBIG instead of killing the process): the zeros
    /// cannot all be written, and appends must go on without them, as when a disk
    /// is nearly full. What was appended reads back, and again after a reopen.
    #[tokio::test]
    async fn appends_go_on_when_zeros_cannot_be_written_ahead() {
        const LIMIT_KIB: u64 = 4 * 1024;
        const _: () = assert!(LIMIT_KIB * 1024 < PREALLOCATE_BYTES);
        if let Ok(dir) = std::env::var(NO_ROOM_CHILD_DIR) {
            let dir = Path::new(&dir);
            let log = EmbeddedLog::open_with(dir, SegmentSizes::default()).unwrap();
            let records: Vec<Vec<u8>> = (0..50)
                .map(|i| format!("record {i}").into_bytes())
                .collect();
            for record in &records {
                log.append(b"k", record.clone())
                    .await
                    .expect("an append succeeds without zeros ahead");
            }
            let end = log.end_offset(0).await.unwrap();
            let len = fs::metadata(segment_path(dir, 0)).unwrap().len();
            assert!(
                len <= LIMIT_KIB * 1024,
                "the limit held the zeros back: {len} bytes"
            );
            assert_eq!(payloads(&log).await, records);
            drop(log);
            let reopened = EmbeddedLog::open_with(dir, SegmentSizes::default()).unwrap();
            assert_eq!(reopened.end_offset(0).await.unwrap(), end);
            assert_eq!(payloads(&reopened).await, records);
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                r#"trap "" XFSZ; ulimit -f {LIMIT_KIB}; exec "$0" "$@""#
            ))
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "embedded::tests::appends_go_on_when_zeros_cannot_be_written_ahead",
                "--nocapture",
            ])
            .env(NO_ROOM_CHILD_DIR, dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "the child failed: {status}");
        // The child ran the case, not nothing: it left its records.
        assert!(fs::metadata(segment_path(dir.path(), 0)).unwrap().len() > 0);
    }

    /// A log of one record ("kept"), as a crash leaves it: the crashed copy, where
    /// its record ends, and its segment open for writing what else the crash left.
    async fn one_record_crashed() -> (tempfile::TempDir, u64, File) {
        let dir = tempfile::tempdir().unwrap();
        let log = EmbeddedLog::open_with(dir.path(), SMALL).unwrap();
        log.append(b"k", b"kept".to_vec()).await.unwrap();
        let end = log.end_offset(0).await.unwrap();
        let crashed = crash_copy(dir.path());
        let file = OpenOptions::new()
            .write(true)
            .open(segment_path(crashed.path(), 0))
            .unwrap();
        (crashed, end, file)
    }

    #[tokio::test]
    async fn a_torn_write_over_zeros_is_cut() {
        let (crashed, end, file) = one_record_crashed().await;
        // Half of an unacknowledged frame landed over the zeros.
        file.write_all_at(&frame(b"never acknowledged")[..12], end)
            .unwrap();
        drop(file);
        let reopened = EmbeddedLog::open_with(crashed.path(), SMALL).unwrap();
        assert_eq!(reopened.end_offset(0).await.unwrap(), end);
        reopened.append(b"k", b"next".to_vec()).await.unwrap();
        assert_eq!(
            payloads(&reopened).await,
            vec![b"kept".to_vec(), b"next".to_vec()]
        );
    }

    /// A power cut during an fsync over zeros may persist a later page of the write
    /// and not an earlier one: valid frames after a zeroed page are that torn write,
    /// not corruption of acknowledged records. Without the zeroed page they are.
    #[tokio::test]
    async fn valid_frames_after_a_zeroed_page_are_a_torn_write() {
        for with_zero_page in [true, false] {
            let (crashed, end, file) = one_record_crashed().await;
            let lost_page_ends = (end / PAGE_BYTES + 2) * PAGE_BYTES;
            // The write's first bytes landed, its next page did not (zeros), and the
            // frames after it did.
            let mut garbage = vec![0xabu8; 40];
            if !with_zero_page {
                garbage.resize((lost_page_ends - end) as usize, 0xab);
            }
            file.write_all_at(&garbage, end).unwrap();
            file.write_all_at(&[frame(b"later"), frame(b"last")].concat(), lost_page_ends)
                .unwrap();
            drop(file);
            match EmbeddedLog::open_with(crashed.path(), SMALL) {
                Ok(reopened) => {
                    assert!(with_zero_page, "corruption was cut away");
                    assert_eq!(reopened.end_offset(0).await.unwrap(), end);
                    assert_eq!(payloads(&reopened).await, vec![b"kept".to_vec()]);
                }
                Err(LogError::Corrupt(message)) => {
                    assert!(!with_zero_page, "a torn write refused: {message}");
                    assert!(message.contains("valid frames follow"), "{message}");
                }
                Err(other) => panic!("{other:?}"),
            }
        }
    }

    /// Corruption of acknowledged records is found behind the zeros written ahead
    /// too, even when the last record ends in zero bytes.
    #[tokio::test]
    async fn corruption_before_valid_frames_and_zeros_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let log = EmbeddedLog::open_with(dir.path(), SMALL).unwrap();
        for payload in [&b"one"[..], b"two", b"three\0\0"] {
            log.append(b"k", payload.to_vec()).await.unwrap();
        }
        let crashed = crash_copy(dir.path());
        let path = segment_path(crashed.path(), 0);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(b"X", FRAME_HEADER_BYTES as u64).unwrap();
        drop(file);
        let before = fs::read(&path).unwrap();
        match EmbeddedLog::open_with(crashed.path(), SMALL) {
            Err(LogError::Corrupt(message)) => {
                assert!(message.contains("valid frames follow"), "{message}")
            }
            other => panic!("expected corruption, got {other:?}"),
        }
        assert_eq!(fs::read(&path).unwrap(), before, "nothing was cut");
    }

    #[tokio::test]
    async fn rolled_segments_are_cut_to_their_records() {
        let dir = tempfile::tempdir().unwrap();
        let written: Vec<Vec<u8>> = (0..40)
            .map(|i| format!("record {i:03}").into_bytes())
            .collect();
        {
            let log = EmbeddedLog::open_with(dir.path(), SMALL).unwrap();
            for payload in &written {
                log.append(b"k", payload.clone()).await.unwrap();
            }
            let bases = list_segments(dir.path()).unwrap();
            assert!(bases.len() > 1, "{bases:?}");
            // Sealed segments hold exactly their records while the log runs.
            check_sealed_segments(dir.path(), &bases).unwrap();
            let crashed = crash_copy(dir.path());
            let reopened = EmbeddedLog::open_with(crashed.path(), SMALL).unwrap();
            assert_eq!(payloads(&reopened).await, written);
        }
        let log = EmbeddedLog::open(dir.path()).unwrap();
        assert_eq!(payloads(&log).await, written);
    }

    #[tokio::test]
    async fn a_second_process_cannot_open_the_same_dir() {
        let dir = tempfile::tempdir().unwrap();
        let _log = EmbeddedLog::open(dir.path()).unwrap();
        assert!(matches!(
            EmbeddedLog::open(dir.path()),
            Err(LogError::Locked(_))
        ));
    }
}
