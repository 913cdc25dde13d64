//! The changelog: a split cluster's checkpoints, per log partition, in a Kafka topic
//! beside the log, so a node that gains a partition restores its state from there
//! instead of re-reading the partition's history (deploy/README.md, "Restore from
//! the changelog").
//!
//! A writer of a partition writes in an **epoch** (a random id it draws when it
//! starts writing the partition): first a reset holding every row of the
//! partition, then per checkpoint the rows it changed (a deleted row is a
//! tombstone) and a marker with the log position the rows are the state at and the
//! offset of its epoch's reset. A checkpoint's marker is sent only once its rows
//! are acknowledged, so every marker closes a complete checkpoint; a checkpoint
//! cut off by a crash has no marker and is never read. A reader finds the newest
//! marker (reading backwards from the end in growing steps), then folds that
//! marker's epoch from its reset up to it: the records of any other writer in
//! between (a node that owned the partition a moment ago, an epoch abandoned after
//! a failed write) are skipped by their epoch. Every epoch's state at its marker is
//! the partition's state at that position, because apply is deterministic.
//!
//! Why not Kafka transactions and a compacted topic (the Kafka Streams way): the
//! development broker the tests run against (tansu 0.6) refuses `EndTxn`, and
//! without transactions compaction could mix a half-written checkpoint with the
//! one before it. Without compaction the topic keeps what retention keeps
//! (`CHANGELOG_RETENTION_MS`); a writer starts a new epoch (a fresh reset) when
//! its checkpoints since the last reset outgrow it or it gets old
//! (`ChangelogWriter`'s policy in `tally-core`), so a restore reads at most about
//! twice the partition's state, and never a reset retention may have deleted.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::kafka::{
    base_config, create_topic_named, kafka_error, KafkaConfig, ADMIN_TIMEOUT_MS, MAX_MESSAGE_BYTES,
    REREAD_BACKS,
};
use crate::LogError;

/// How long the changelog topic keeps records. A writer starts a new epoch well
/// within it (`CHANGELOG_EPOCH_MAX_AGE_MS` in `tally-core`), so the reset a
/// restore reads from is never the one retention deletes.
pub const CHANGELOG_RETENTION_MS: u64 = 7 * 24 * 3_600_000;
/// How long reading one partition's changelog may take before the restore falls
/// back to the log: bounds a restore stuck on an unreachable broker.
pub const CHANGELOG_READ_LIMIT_MS: u64 = 120_000;
/// How long one write (its rows, then its marker) may wait for the broker.
pub const CHANGELOG_WRITE_TIMEOUT_MS: u64 = 30_000;
/// Bytes of rows per changelog record: well under `MAX_MESSAGE_BYTES`, so a record
/// of rows plus one row of the largest size still fits.
const ROWS_PER_RECORD_BYTES: usize = 1024 * 1024;
/// How long one poll of the reader waits.
const READ_POLL_MS: u64 = 500;
/// Records the reader first reads back from the end to find the newest marker;
/// the step grows fourfold until one is found.
const MARKER_SEARCH_FIRST_STEP: i64 = 64;
/// Pause before retrying a send the producer's full queue refused.
const QUEUE_FULL_RETRY_MS: u64 = 5;

/// Record kinds (the first byte of a changelog record's value).
const RESET: u8 = b'x';
const ROWS: u8 = b'r';
const MARKER: u8 = b'm';

/// One partition's state as its changelog holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartitionSnapshot {
    /// The log position (next offset) the rows are the state at.
    pub position: u64,
    pub rows: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// Where a split cluster's checkpoints go, per log partition.
pub trait Changelog: Send + Sync + std::fmt::Debug {
    /// Writes one checkpoint of `partition`: `rows` (`None` deletes) and the
    /// position they bring it to. With `reset`, `rows` are the whole state and the
    /// write begins a new epoch. Returns once it is durable.
    fn write(
        &self,
        partition: u32,
        reset: bool,
        rows: &[(Vec<u8>, Option<Vec<u8>>)],
        position: u64,
    ) -> Result<(), LogError>;
    /// The newest complete checkpoint of `partition`, if any was written.
    fn read(&self, partition: u32) -> Result<Option<PartitionSnapshot>, LogError>;
    /// This node stopped writing `partition` (it moved away, or a write failed):
    /// its next write must be a reset.
    fn release(&self, partition: u32);
}

/// A changelog record, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangelogRecord {
    Reset {
        epoch: u64,
    },
    Rows {
        epoch: u64,
        rows: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    },
    Marker {
        epoch: u64,
        position: u64,
        reset_offset: i64,
    },
}

fn corrupt(what: &str) -> LogError {
    LogError::Corrupt(format!("a changelog record {what}"))
}

fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], LogError> {
    if bytes.len() < n {
        return Err(corrupt("is cut short"));
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

fn take_u64(bytes: &mut &[u8]) -> Result<u64, LogError> {
    Ok(u64::from_be_bytes(
        take(bytes, 8)?.try_into().expect("8 bytes"),
    ))
}

fn take_u32(bytes: &mut &[u8]) -> Result<u32, LogError> {
    Ok(u32::from_be_bytes(
        take(bytes, 4)?.try_into().expect("4 bytes"),
    ))
}

impl ChangelogRecord {
    pub fn epoch(&self) -> u64 {
        match self {
            ChangelogRecord::Reset { epoch }
            | ChangelogRecord::Rows { epoch, .. }
            | ChangelogRecord::Marker { epoch, .. } => *epoch,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            ChangelogRecord::Reset { epoch } => {
                out.push(RESET);
                out.extend_from_slice(&epoch.to_be_bytes());
            }
            ChangelogRecord::Rows { epoch, rows } => {
                out.push(ROWS);
                out.extend_from_slice(&epoch.to_be_bytes());
                for (key, value) in rows {
                    encode_row(&mut out, key, value.as_deref());
                }
            }
            ChangelogRecord::Marker {
                epoch,
                position,
                reset_offset,
            } => {
                out.push(MARKER);
                out.extend_from_slice(&epoch.to_be_bytes());
                out.extend_from_slice(&position.to_be_bytes());
                out.extend_from_slice(&reset_offset.to_be_bytes());
            }
        }
        out
    }

    pub fn decode(mut bytes: &[u8]) -> Result<ChangelogRecord, LogError> {
        let bytes = &mut bytes;
        let kind = take(bytes, 1)?[0];
        let epoch = take_u64(bytes)?;
        let record = match kind {
            RESET => ChangelogRecord::Reset { epoch },
            MARKER => ChangelogRecord::Marker {
                epoch,
                position: take_u64(bytes)?,
                reset_offset: take_u64(bytes)? as i64,
            },
            ROWS => {
                let mut rows = Vec::new();
                while !bytes.is_empty() {
                    let key_len = take_u32(bytes)? as usize;
                    let key = take(bytes, key_len)?.to_vec();
                    let value = match take(bytes, 1)?[0] {
                        0 => None,
                        1 => {
                            let len = take_u32(bytes)? as usize;
                            Some(take(bytes, len)?.to_vec())
                        }
                        _ => return Err(corrupt("has a row of an unknown shape")),
                    };
                    rows.push((key, value));
                }
                ChangelogRecord::Rows { epoch, rows }
            }
            _ => return Err(corrupt("is of an unknown kind")),
        };
        if !bytes.is_empty() && !matches!(record, ChangelogRecord::Rows { .. }) {
            return Err(corrupt("has trailing bytes"));
        }
        Ok(record)
    }
}

fn encode_row(out: &mut Vec<u8>, key: &[u8], value: Option<&[u8]>) {
    out.extend_from_slice(&(key.len() as u32).to_be_bytes());
    out.extend_from_slice(key);
    match value {
        None => out.push(0),
        Some(value) => {
            out.push(1);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
    }
}

/// The checkpoint a newest marker closes, folded from its epoch's records between
/// the epoch's reset and the marker (module doc).
#[derive(Debug)]
pub struct SnapshotFold {
    epoch: u64,
    rows: BTreeMap<Vec<u8>, Vec<u8>>,
    reset_seen: bool,
}

impl SnapshotFold {
    /// Folds the records of `epoch`.
    pub fn new(epoch: u64) -> SnapshotFold {
        SnapshotFold {
            epoch,
            rows: BTreeMap::new(),
            reset_seen: false,
        }
    }

    pub fn push(&mut self, record: ChangelogRecord) {
        if record.epoch() != self.epoch {
            return;
        }
        match record {
            ChangelogRecord::Reset { .. } => {
                self.rows.clear();
                self.reset_seen = true;
            }
            ChangelogRecord::Rows { rows, .. } => {
                for (key, value) in rows {
                    match value {
                        Some(value) => self.rows.insert(key, value),
                        None => self.rows.remove(&key),
                    };
                }
            }
            ChangelogRecord::Marker { .. } => {}
        }
    }

    /// The state at `position`, if the fold began at the epoch's reset.
    pub fn finish(self, position: u64) -> Option<PartitionSnapshot> {
        self.reset_seen.then_some(PartitionSnapshot {
            position,
            rows: self.rows,
        })
    }
}

/// The changelog topic of a log topic.
pub fn changelog_topic(log_topic: &str) -> String {
    format!("{log_topic}.changelog")
}

/// Creates the changelog topic beside the log's (idempotent): as many partitions
/// as the log, records kept `CHANGELOG_RETENTION_MS`.
pub async fn create_changelog_topic(config: &KafkaConfig) -> Result<bool, LogError> {
    let settings = [
        ("cleanup.policy", "delete".to_string()),
        ("retention.ms", CHANGELOG_RETENTION_MS.to_string()),
        (
            "min.insync.replicas",
            config.min_insync_replicas.to_string(),
        ),
        ("max.message.bytes", MAX_MESSAGE_BYTES.to_string()),
    ];
    create_topic_named(config, &changelog_topic(&config.topic), &settings).await
}

/// The epoch a partition is being written in, and where its reset is.
#[derive(Debug, Clone, Copy)]
struct Epoch {
    id: u64,
    reset_offset: i64,
}

/// The changelog in a Kafka topic.
pub struct KafkaChangelog {
    brokers: String,
    topic: String,
    producer: FutureProducer,
    epochs: Mutex<BTreeMap<u32, Epoch>>,
}

impl std::fmt::Debug for KafkaChangelog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaChangelog")
            .field("topic", &self.topic)
            .finish()
    }
}

/// A random epoch id (the standard library's per-process random hasher keys).
fn new_epoch_id() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

impl KafkaChangelog {
    /// The changelog of `config`'s log topic.
    pub fn connect(config: &KafkaConfig) -> Result<KafkaChangelog, LogError> {
        let producer: FutureProducer = base_config(&config.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("message.max.bytes", MAX_MESSAGE_BYTES.to_string())
            .set("message.timeout.ms", CHANGELOG_WRITE_TIMEOUT_MS.to_string())
            .create()
            .map_err(kafka_error)?;
        Ok(KafkaChangelog {
            brokers: config.brokers.clone(),
            topic: changelog_topic(&config.topic),
            producer,
            epochs: Mutex::new(BTreeMap::new()),
        })
    }

    /// Queues one record (waiting while the producer's queue is full).
    fn send(&self, partition: u32, value: &[u8]) -> Result<DeliveryFuture, LogError> {
        let started = Instant::now();
        loop {
            let record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic)
                .partition(partition as i32)
                .payload(value);
            match self.producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                    if started.elapsed() < Duration::from_millis(CHANGELOG_WRITE_TIMEOUT_MS) =>
                {
                    std::thread::sleep(Duration::from_millis(QUEUE_FULL_RETRY_MS));
                }
                Err((error, _)) => return Err(kafka_error(error)),
            }
        }
    }

    /// Waits for queued records; returns the offset of the first.
    fn delivered(deliveries: Vec<DeliveryFuture>) -> Result<Option<i64>, LogError> {
        let mut first = None;
        for delivery in deliveries {
            match futures::executor::block_on(delivery) {
                Ok(Ok(delivered)) => {
                    first.get_or_insert(delivered.offset);
                }
                Ok(Err((error, _))) => return Err(kafka_error(error)),
                Err(_) => return Err(LogError::Kafka("the producer went away".into())),
            }
        }
        Ok(first)
    }

    fn write_epoch(
        &self,
        partition: u32,
        reset: bool,
        rows: &[(Vec<u8>, Option<Vec<u8>>)],
        position: u64,
    ) -> Result<(), LogError> {
        let known = self
            .epochs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&partition)
            .copied();
        let mut deliveries = Vec::new();
        let epoch_id = match (reset, known) {
            (false, Some(epoch)) => epoch.id,
            (false, None) => {
                return Err(LogError::Kafka(format!(
                    "changelog partition {partition} has no epoch: its first write must be a reset"
                )))
            }
            (true, _) => {
                let id = new_epoch_id();
                deliveries
                    .push(self.send(partition, &ChangelogRecord::Reset { epoch: id }.encode())?);
                id
            }
        };
        let mut batch = Vec::new();
        let mut bytes = 0;
        for (key, value) in rows {
            bytes += key.len() + value.as_ref().map_or(0, Vec::len) + 9;
            batch.push((key.clone(), value.clone()));
            if bytes >= ROWS_PER_RECORD_BYTES {
                let record = ChangelogRecord::Rows {
                    epoch: epoch_id,
                    rows: std::mem::take(&mut batch),
                };
                deliveries.push(self.send(partition, &record.encode())?);
                bytes = 0;
            }
        }
        if !batch.is_empty() {
            let record = ChangelogRecord::Rows {
                epoch: epoch_id,
                rows: batch,
            };
            deliveries.push(self.send(partition, &record.encode())?);
        }
        // Every row is durable before the marker that closes them is sent.
        let first = Self::delivered(deliveries)?;
        let reset_offset = match (reset, known) {
            (true, _) => first.ok_or_else(|| LogError::Kafka("the reset has no offset".into()))?,
            (false, Some(epoch)) => epoch.reset_offset,
            (false, None) => unreachable!("refused above"),
        };
        let marker = ChangelogRecord::Marker {
            epoch: epoch_id,
            position,
            reset_offset,
        };
        Self::delivered(vec![self.send(partition, &marker.encode())?])?;
        if reset {
            self.epochs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    partition,
                    Epoch {
                        id: epoch_id,
                        reset_offset,
                    },
                );
        }
        Ok(())
    }

    /// Reads `partition` from `from` up to (not including) `until`, handing each
    /// record with its offset to `visit`.
    fn read_span(
        &self,
        partition: u32,
        from: i64,
        until: i64,
        started: Instant,
        mut visit: impl FnMut(i64, ChangelogRecord),
    ) -> Result<(), LogError> {
        let consumer: BaseConsumer = base_config(&self.brokers)
            .set("group.id", "tally-changelog-reader")
            .set("enable.auto.commit", "false")
            // A span retention deleted is an error (the restore falls back to
            // the log), never a jump to the end.
            .set("auto.offset.reset", "error")
            // A broker may hold a fetch for the whole wait (tansu does) even with
            // records to serve: short waits, and many records per fetch.
            .set("fetch.wait.max.ms", "50")
            .set("max.partition.fetch.bytes", MAX_MESSAGE_BYTES.to_string())
            .set("fetch.message.max.bytes", MAX_MESSAGE_BYTES.to_string())
            .create()
            .map_err(kafka_error)?;
        let seek = |offset: i64| -> Result<(), LogError> {
            let mut assignment = TopicPartitionList::new();
            assignment
                .add_partition_offset(&self.topic, partition as i32, Offset::Offset(offset))
                .map_err(kafka_error)?;
            consumer.assign(&assignment).map_err(kafka_error)
        };
        seek(from)?;
        let mut backs = REREAD_BACKS.iter();
        let mut next = from;
        while next < until {
            if started.elapsed() > Duration::from_millis(CHANGELOG_READ_LIMIT_MS) {
                return Err(LogError::Kafka(format!(
                    "reading changelog partition {partition} took over {CHANGELOG_READ_LIMIT_MS} ms"
                )));
            }
            match consumer.poll(Duration::from_millis(READ_POLL_MS)) {
                Some(Ok(message)) => {
                    let offset = message.offset();
                    if offset < next {
                        // A broker that serves a batch again from its start.
                        continue;
                    }
                    if offset > next {
                        // A broker that serves whole batches skipped the start of
                        // the one `next` is in: read again from further back.
                        let back = backs.next().ok_or_else(|| {
                            corrupt(&format!(
                                "at offset {next} of partition {partition} is never served"
                            ))
                        })?;
                        seek(next.saturating_sub(*back as i64).max(0))?;
                        continue;
                    }
                    if offset >= until {
                        break;
                    }
                    next = offset + 1;
                    visit(
                        offset,
                        ChangelogRecord::decode(message.payload().unwrap_or_default())?,
                    );
                }
                Some(Err(error)) => return Err(kafka_error(error)),
                None => {}
            }
        }
        Ok(())
    }
}

impl Changelog for KafkaChangelog {
    fn write(
        &self,
        partition: u32,
        reset: bool,
        rows: &[(Vec<u8>, Option<Vec<u8>>)],
        position: u64,
    ) -> Result<(), LogError> {
        let written = self.write_epoch(partition, reset, rows, position);
        if written.is_err() {
            self.release(partition);
        }
        written
    }

    fn read(&self, partition: u32) -> Result<Option<PartitionSnapshot>, LogError> {
        let started = Instant::now();
        let probe: BaseConsumer = base_config(&self.brokers).create().map_err(kafka_error)?;
        let (low, high) = probe
            .fetch_watermarks(
                &self.topic,
                partition as i32,
                Duration::from_millis(ADMIN_TIMEOUT_MS),
            )
            .map_err(kafka_error)?;
        // The newest marker: read back from the end in growing steps.
        let mut marker = None;
        let mut step = MARKER_SEARCH_FIRST_STEP;
        let mut end = high;
        while marker.is_none() && end > low {
            let from = end.saturating_sub(step).max(low);
            self.read_span(partition, from, end, started, |offset, record| {
                if let ChangelogRecord::Marker {
                    epoch,
                    position,
                    reset_offset,
                } = record
                {
                    marker = Some((offset, epoch, position, reset_offset));
                }
            })?;
            end = from;
            step = step.saturating_mul(4);
        }
        let Some((marker_offset, epoch, position, reset_offset)) = marker else {
            return Ok(None);
        };
        if reset_offset < low {
            // Retention deleted the epoch's reset: the log has to do.
            return Ok(None);
        }
        let mut fold = SnapshotFold::new(epoch);
        self.read_span(
            partition,
            reset_offset,
            marker_offset,
            started,
            |_, record| fold.push(record),
        )?;
        Ok(fold.finish(position))
    }

    fn release(&self, partition: u32) {
        self.epochs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&partition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(pairs: &[(&str, Option<&str>)]) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        pairs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.map(|v| v.as_bytes().to_vec())))
            .collect()
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        for record in [
            ChangelogRecord::Reset { epoch: 7 },
            ChangelogRecord::Rows {
                epoch: 7,
                rows: rows(&[("a", Some("1")), ("b", None), ("", Some(""))]),
            },
            ChangelogRecord::Marker {
                epoch: 7,
                position: 12,
                reset_offset: 3,
            },
        ] {
            assert_eq!(ChangelogRecord::decode(&record.encode()).unwrap(), record);
        }
        assert!(ChangelogRecord::decode(b"").is_err());
        assert!(ChangelogRecord::decode(b"q12345678").is_err());
        let mut cut = ChangelogRecord::Rows {
            epoch: 1,
            rows: rows(&[("abc", Some("def"))]),
        }
        .encode();
        cut.pop();
        assert!(ChangelogRecord::decode(&cut).is_err());
    }

    #[test]
    fn the_fold_takes_its_epoch_from_its_reset_on() {
        let mut fold = SnapshotFold::new(1);
        fold.push(ChangelogRecord::Rows {
            epoch: 1,
            rows: rows(&[("stale", Some("x"))]),
        });
        fold.push(ChangelogRecord::Reset { epoch: 1 });
        fold.push(ChangelogRecord::Rows {
            epoch: 1,
            rows: rows(&[("a", Some("1")), ("b", Some("2"))]),
        });
        // Another writer's records in between are not this epoch's.
        fold.push(ChangelogRecord::Reset { epoch: 2 });
        fold.push(ChangelogRecord::Rows {
            epoch: 2,
            rows: rows(&[("z", Some("9"))]),
        });
        fold.push(ChangelogRecord::Rows {
            epoch: 1,
            rows: rows(&[("a", None)]),
        });
        let snapshot = fold.finish(9).unwrap();
        assert_eq!(snapshot.position, 9);
        assert_eq!(
            snapshot.rows,
            BTreeMap::from([(b"b".to_vec(), b"2".to_vec())])
        );
        // Without its reset, an epoch is no state.
        assert_eq!(SnapshotFold::new(3).finish(1), None);
    }
}
