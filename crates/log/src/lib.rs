//! The log: Tally's source of truth. One trait, [`Log`], and two implementations:
//! [`embedded::EmbeddedLog`] (durable files under the data dir; the default) and
//! [`kafka::KafkaLog`] (rdkafka, for deployments that outgrow one machine).
//!
//! The log moves opaque byte payloads; what they mean is the business of
//! `tally-proto`. An append returns only once the record is durable (fsynced, or
//! acknowledged by all in-sync replicas). Offsets are per partition, strictly
//! increasing, and every read entry says where the next one starts, so a consumer
//! that stores `next_offset` resumes without loss or replay.

use std::time::Duration;

use async_trait::async_trait;

pub mod changelog;
pub mod embedded;
pub mod kafka;
pub mod membership;
#[cfg(any(test, feature = "test-util"))]
pub mod testsuite;

/// Largest payload one record may carry: a full ingest batch (100 events of 50
/// properties of 1 KiB) is ~5 MiB, so 16 MiB leaves room and still catches garbage
/// lengths while recovering a torn tail.
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;

/// The partition of `key` among `partitions` (a stable CRC32 of the key): where
/// `Log::partition_for` sends it, also for a node that asks without a log at hand.
pub fn partition_of(key: &[u8], partitions: u32) -> u32 {
    crc32fast::hash(key) % partitions.max(1)
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("record of {0} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")]
    RecordTooLarge(usize),
    #[error("records may not be empty")]
    EmptyRecord,
    #[error("the log stopped accepting appends after an earlier write or fsync failure")]
    Poisoned,
    #[error("the log is closed")]
    Closed,
    #[error("partition {0} does not exist")]
    NoSuchPartition(u32),
    #[error("kafka: {0}")]
    Kafka(String),
    /// The append may or may not have been written (a produce timeout, a lost
    /// connection, a failed write or fsync after bytes reached the file).
    #[error("the append's outcome is unknown: {0}")]
    OutcomeUnknown(String),
    #[error("data directory {0} is locked by another process")]
    Locked(String),
    /// Records the log acknowledged are damaged or missing: stop, never skip.
    #[error("the log is corrupt: {0}")]
    Corrupt(String),
}

impl LogError {
    /// Whether the error says stored records are damaged (as opposed to a passing
    /// failure worth retrying).
    /// Whether an append that failed with this error may still have been written.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, LogError::OutcomeUnknown(_) | LogError::Io(_))
    }

    pub fn is_corruption(&self) -> bool {
        match self {
            LogError::Corrupt(_) => true,
            LogError::Io(error) => error.kind() == std::io::ErrorKind::InvalidData,
            _ => false,
        }
    }
}

/// One record read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub partition: u32,
    pub offset: u64,
    /// Where the following record starts; what a consumer stores to resume.
    pub next_offset: u64,
    pub payload: Vec<u8>,
}

#[async_trait]
pub trait Log: Send + Sync + 'static {
    /// Short name for logs and metrics (`embedded`, `kafka`).
    fn kind(&self) -> &'static str;

    fn partition_count(&self) -> u32;

    /// The partition records with this key go to. Stable across processes and
    /// versions (CRC32 of the key), so one customer's records stay in one order.
    fn partition_for(&self, key: &[u8]) -> u32 {
        partition_of(key, self.partition_count())
    }

    /// Appends one record to the partition of `key`; returns its offset once durable.
    async fn append(&self, key: &[u8], payload: Vec<u8>) -> Result<u64, LogError>;

    /// A reader of one partition, starting at `from_offset` (0 = the beginning).
    async fn reader(
        &self,
        partition: u32,
        from_offset: u64,
    ) -> Result<Box<dyn LogReader>, LogError>;

    /// The offset the next record of `partition` will get: everything below is durable.
    async fn end_offset(&self, partition: u32) -> Result<u64, LogError>;

    /// The end offset as a reader of `partition` sees it now: at least `end_offset`.
    /// Replays and audits, where a record missed is a wrong answer, end here. Brokers
    /// whose reported end can lag the records they serve (see the Kafka log) read
    /// forward to find it, which costs a fetch round trip; the others answer
    /// `end_offset`.
    async fn read_end(&self, partition: u32) -> Result<u64, LogError> {
        self.end_offset(partition).await
    }

    /// Records that consumer `group` has durably processed `partition` up to
    /// `next_offset` (exclusive). Kafka commits the group offset.
    async fn commit(&self, group: &str, partition: u32, next_offset: u64) -> Result<(), LogError>;

    /// The last committed `next_offset` of `group` on `partition`, if any.
    async fn committed(&self, group: &str, partition: u32) -> Result<Option<u64>, LogError>;

    /// Whether the log holds every record below `next_offset` of `partition` (a
    /// consumer that applied up to there is not ahead of the log).
    async fn covers(&self, partition: u32, next_offset: u64) -> Result<bool, LogError> {
        Ok(self.end_offset(partition).await? >= next_offset)
    }

    /// The record starting at `offset` of `partition`: a position a consumer read
    /// before and kept (the event index points at records this way). `None` when the
    /// log holds no record there (below its start, or at or past its end).
    ///
    /// The default opens a reader there; a log with cheap random access overrides it.
    async fn read_at(&self, partition: u32, offset: u64) -> Result<Option<LogEntry>, LogError> {
        if offset >= self.end_offset(partition).await? {
            return Ok(None);
        }
        let mut reader = self.reader(partition, offset).await?;
        let entries = reader
            .next_batch(1, Duration::from_millis(RANGE_READ_WAIT_MS))
            .await?;
        Ok(entries.into_iter().next().filter(|e| e.offset == offset))
    }

    /// `read_at` for several offsets of one partition, answered in the order asked. A
    /// log whose every read is costly (Kafka: a consumer per read) reads the span
    /// once instead.
    async fn read_many(
        &self,
        partition: u32,
        offsets: &[u64],
    ) -> Result<Vec<Option<LogEntry>>, LogError> {
        let mut entries = Vec::with_capacity(offsets.len());
        for offset in offsets {
            entries.push(self.read_at(partition, *offset).await?);
        }
        Ok(entries)
    }

    /// Whether consumers keep their progress in the log (`commit`) for others to read:
    /// Kafka consumer groups do; the embedded log's single process needs no commit
    /// cadence (its consumer's position lives in the projection).
    fn keeps_consumer_offsets(&self) -> bool {
        false
    }

    /// Whether other processes (other Tally nodes) may append to this log, so it may
    /// hold records this node has not applied although it acknowledged everything
    /// it appended itself. Kafka: yes; the embedded log belongs to one process.
    fn shared_between_nodes(&self) -> bool {
        false
    }

    /// Why the log cannot take appends now, if it cannot (a poisoned embedded log
    /// after a failed write or fsync, a fatal producer error). Cheap: no I/O, so
    /// readiness probes and the write gate may call it on every request.
    fn health(&self) -> Option<String> {
        None
    }
}

#[async_trait]
pub trait LogReader: Send {
    /// Up to `max_records` entries in log order. Waits up to `wait` for the first one;
    /// an empty vector means nothing arrived in time.
    async fn next_batch(
        &mut self,
        max_records: usize,
        wait: Duration,
    ) -> Result<Vec<LogEntry>, LogError>;
}

/// How long a bounded read waits for its next chunk before concluding the log ends
/// earlier than `until` (records below an end offset are durable, so only a broken or
/// shrunken log trips this).
pub const RANGE_READ_WAIT_MS: u64 = 5_000;

/// The one reader for bounded reads (replays, audits, start-up checks): the records
/// of `partition` in `[from, until)`, in log order, in chunks of at most
/// `max_records`. [`read_range`] drives it with a callback; a caller whose work per
/// chunk is async pulls chunks itself.
pub struct RangeReader {
    reader: Option<Box<dyn LogReader>>,
    at: u64,
    until: u64,
    max_records: usize,
}

impl RangeReader {
    pub async fn open(
        log: &dyn Log,
        partition: u32,
        from: u64,
        until: u64,
        max_records: usize,
    ) -> Result<RangeReader, LogError> {
        let reader = if from < until {
            Some(log.reader(partition, from).await?)
        } else {
            None
        };
        Ok(RangeReader {
            reader,
            at: from,
            until,
            max_records,
        })
    }

    /// The next chunk; `None` once `until` is reached or the log ends before it.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<LogEntry>>, LogError> {
        let Some(reader) = self.reader.as_mut() else {
            return Ok(None);
        };
        while self.at < self.until {
            let mut entries = reader
                .next_batch(self.max_records, Duration::from_millis(RANGE_READ_WAIT_MS))
                .await?;
            if entries.is_empty() {
                break;
            }
            let read = entries.len();
            entries.retain(|entry| entry.offset < self.until);
            if entries.len() < read {
                self.at = self.until;
            } else if let Some(last) = entries.last() {
                self.at = last.next_offset;
            }
            if !entries.is_empty() {
                return Ok(Some(entries));
            }
        }
        self.reader = None;
        Ok(None)
    }

    /// The offset reached: `until`, or less when the log ended before it.
    pub fn reached(&self) -> u64 {
        self.at
    }
}

/// Hands the records of `partition` in `[from, until)` to `visit` in log order, in
/// chunks of at most `max_records` (see [`RangeReader`]). Returns the offset
/// reached: `until`, or less when the log ends before it.
pub async fn read_range<E: From<LogError>>(
    log: &dyn Log,
    partition: u32,
    from: u64,
    until: u64,
    max_records: usize,
    mut visit: impl FnMut(&[LogEntry]) -> Result<(), E>,
) -> Result<u64, E> {
    let mut range = RangeReader::open(log, partition, from, until, max_records).await?;
    while let Some(entries) = range.next_chunk().await? {
        visit(&entries)?;
    }
    Ok(range.reached())
}
