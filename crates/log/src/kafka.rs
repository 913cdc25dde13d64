//! The Kafka log: one topic with N partitions, written by an idempotent producer with
//! `acks=all`, read by partition-assigned consumers. Consumers commit their group
//! offset only after their projection write is durable (see `Log::commit`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

use crate::{Log, LogEntry, LogError, LogReader, MAX_RECORD_BYTES};

/// How long a produce may wait for the broker (including retries) before it fails.
pub const PRODUCE_TIMEOUT_MS: u64 = 30_000;
/// How long `read_end` and `read_many` wait for the first fetch of a new reader (it
/// connects first): long enough for a loaded broker, short enough that a truncated
/// log is reported within seconds of startup.
pub const FIRST_FETCH_WAIT_MS: u64 = 2_000;
/// How long `read_end` waits for a further fetch once the reader is streaming:
/// librdkafka fetches ahead, so records past the end would already be on their way;
/// a Kafka broker answers an empty fetch after `fetch.wait.max.ms`
/// (`KafkaConfig::fetch_wait_ms`, at most `MAX_FETCH_WAIT_MS`).
pub const END_READ_TAIL_WAIT_MS: u64 = 500;
/// How long a reader's fetch waits at the broker for records before an empty
/// answer, unless configured. Apache Kafka answers a waiting fetch as soon as a
/// record arrives, so there this only sets how often an idle reader asks (one fetch
/// per partition per wait). A broker that answers only when the wait ends (tansu)
/// makes every command decided in apply wait about this long: measured on tansu,
/// 50 ms gives commands of ~53 ms and 5 ms ~8 ms, at ~3x the idle CPU of the
/// broker and tally (docs/benchmarks.md, "Kafka: command latency").
pub const DEFAULT_FETCH_WAIT_MS: u64 = 50;
/// Longest configurable fetch wait: half of `END_READ_TAIL_WAIT_MS`, so `read_end`
/// always sees the broker's empty answer before it stops waiting for one.
pub const MAX_FETCH_WAIT_MS: u64 = END_READ_TAIL_WAIT_MS / 2;
/// Records per fetch while `read_end` and `read_many` scan forward.
const SCAN_BATCH: usize = 1_000;

/// Most records the producer puts in one batch (librdkafka's default, made explicit
/// because readers rely on it: see `REREAD_BACKS`).
const MAX_BATCH_RECORDS: u64 = 10_000;
/// How far back a reader opened at an offset re-reads when the broker served a later
/// one first: a broker that serves whole batches from their first record (tansu)
/// skips the rest of a batch when asked for an offset inside it, so the reader reads
/// from further back, growing until past the largest batch (`MAX_BATCH_RECORDS`).
pub(crate) const REREAD_BACKS: [u64; 5] = [1, 16, 256, 4_096, MAX_BATCH_RECORDS];
/// How long a reader waits before looking again for a record the broker numbered but
/// does not serve yet while it serves later ones (tansu numbers a batch, then writes
/// it: a concurrent producer's later batch can be readable first).
const GAP_RETRY_MS: u64 = 10;
/// How long such a record may stay unreadable before the reader gives up with a
/// corruption error: twice the time a producer waits for its write, so a slow write
/// always lands first; past it the broker lost a record it numbered, and skipping it
/// would make this node's projection differ from every replay.
pub const GAP_WAIT_LIMIT_MS: u64 = 2 * PRODUCE_TIMEOUT_MS;
/// Metadata and commit calls.
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;

/// Largest message the producer sends and the topic accepts: a whole record
/// (`MAX_RECORD_BYTES`) plus room for Kafka's own framing. Kafka's 1 MB default would
/// refuse valid ingest batches.
pub const MAX_MESSAGE_BYTES: usize = MAX_RECORD_BYTES + 64 * 1024;

#[derive(Debug, Clone)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic: String,
    pub partitions: u32,
    pub replication_factor: i32,
    /// `min.insync.replicas` of the topic: with `acks=all`, a write is acknowledged
    /// only once this many replicas have it (2 in production; 1 for a one-broker
    /// development cluster).
    pub min_insync_replicas: i32,
    /// `fetch.wait.max.ms` of the log's readers (`DEFAULT_FETCH_WAIT_MS`), clamped to
    /// 1..=`MAX_FETCH_WAIT_MS`.
    pub fetch_wait_ms: u64,
}

/// The topic settings the log needs, set when tally creates the topic and checked
/// at start-up (`verify_topic`): the topic is the source of truth, so nothing may
/// delete or compact its records, and no out-of-sync replica may become leader.
pub fn topic_settings(config: &KafkaConfig) -> Vec<(&'static str, String)> {
    vec![
        ("retention.ms", "-1".into()),
        ("retention.bytes", "-1".into()),
        ("cleanup.policy", "delete".into()),
        ("unclean.leader.election.enable", "false".into()),
        (
            "min.insync.replicas",
            config.min_insync_replicas.to_string(),
        ),
        ("max.message.bytes", MAX_MESSAGE_BYTES.to_string()),
    ]
}

/// Why a topic's configuration could delete records of the log, if it could.
/// Settings a broker does not report are taken as unset (brokers report every
/// setting; development brokers only those given at creation).
pub fn topic_problem(configs: &[(String, Option<String>)]) -> Option<String> {
    let value = |name: &str| {
        configs
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.clone())
    };
    for name in ["retention.ms", "retention.bytes"] {
        if let Some(v) = value(name) {
            if v.trim() != "-1" {
                return Some(format!(
                    "{name}={v} deletes records of the log; it must be -1"
                ));
            }
        }
    }
    if let Some(policy) = value("cleanup.policy") {
        if policy.contains("compact") {
            return Some(format!(
                "cleanup.policy={policy} compacts away records that share a key; it must be delete (with infinite retention)"
            ));
        }
    }
    if value("unclean.leader.election.enable").is_some_and(|v| v.trim() == "true") {
        return Some("unclean.leader.election.enable=true can lose acknowledged records".into());
    }
    None
}

/// Refuses a topic that can delete records (see `topic_problem`).
pub async fn verify_topic(config: &KafkaConfig) -> Result<(), LogError> {
    let admin: AdminClient<DefaultClientContext> =
        base_config(&config.brokers).create().map_err(kafka_error)?;
    let options =
        AdminOptions::new().request_timeout(Some(Duration::from_millis(ADMIN_TIMEOUT_MS)));
    let results = admin
        .describe_configs([&ResourceSpecifier::Topic(&config.topic)], &options)
        .await
        .map_err(kafka_error)?;
    let resource = results
        .into_iter()
        .next()
        .ok_or_else(|| LogError::Kafka("describe topic: the broker answered nothing".into()))?
        .map_err(|code| LogError::Kafka(format!("describe topic {}: {code}", config.topic)))?;
    let configs: Vec<(String, Option<String>)> = resource
        .entries
        .iter()
        .map(|entry| (entry.name.clone(), entry.value.clone()))
        .collect();
    match topic_problem(&configs) {
        Some(problem) => Err(LogError::Corrupt(format!(
            "topic {} cannot hold the log: {problem}. Fix it with kafka-configs --alter, or point tally at another topic",
            config.topic
        ))),
        None => Ok(()),
    }
}

pub struct KafkaLog {
    config: KafkaConfig,
    producer: FutureProducer,
    /// One committing consumer per group, created on first use.
    committers: Mutex<HashMap<String, Arc<BaseConsumer>>>,
}

impl std::fmt::Debug for KafkaLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaLog")
            .field("config", &self.config)
            .finish()
    }
}

pub(crate) fn kafka_error(e: impl std::fmt::Display) -> LogError {
    LogError::Kafka(e.to_string())
}

/// A failed produce: nothing was written only when the broker refused the message
/// outright; a timeout or a lost connection leaves the outcome unknown (the broker
/// may have appended it), which callers must not report as "nothing written".
fn produce_error(error: KafkaError) -> LogError {
    use RDKafkaErrorCode as Code;
    let refused = match &error {
        KafkaError::MessageProduction(code) => matches!(
            code,
            Code::QueueFull
                | Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::UnknownTopicOrPartition
                | Code::UnknownPartition
                | Code::UnknownTopic
                | Code::TopicAuthorizationFailed
                | Code::NotEnoughReplicas
                | Code::InvalidMessage
                | Code::InvalidRecord
        ),
        _ => false,
    };
    if refused {
        kafka_error(error)
    } else {
        LogError::OutcomeUnknown(error.to_string())
    }
}

pub(crate) fn base_config(brokers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        // Only the loopback/test broker and the compose cluster are targets; keep
        // address families predictable.
        .set("broker.address.family", "v4");
    config
}

/// Creates the topic (idempotent: an existing topic is fine).
pub async fn create_topic(config: &KafkaConfig) -> Result<bool, LogError> {
    create_topic_named(config, &config.topic, &topic_settings(config)).await
}

/// Creates topic `name` with `config`'s partitions and replication and
/// `settings`; `false` when it exists already.
pub(crate) async fn create_topic_named(
    config: &KafkaConfig,
    name: &str,
    settings: &[(&'static str, String)],
) -> Result<bool, LogError> {
    let admin: AdminClient<DefaultClientContext> =
        base_config(&config.brokers).create().map_err(kafka_error)?;
    let topic = settings.iter().fold(
        NewTopic::new(
            name,
            config.partitions as i32,
            TopicReplication::Fixed(config.replication_factor),
        ),
        |topic, (name, value)| topic.set(name, value),
    );
    let options =
        AdminOptions::new().operation_timeout(Some(Duration::from_millis(ADMIN_TIMEOUT_MS)));
    let results = admin
        .create_topics([&topic], &options)
        .await
        .map_err(kafka_error)?;
    match results.into_iter().next() {
        Some(Ok(_)) => Ok(true),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(false),
        Some(Err((name, code))) => Err(LogError::Kafka(format!("create topic {name}: {code}"))),
        None => Err(LogError::Kafka(
            "create topic: the broker answered nothing".into(),
        )),
    }
}

impl KafkaLog {
    pub fn connect(config: KafkaConfig) -> Result<KafkaLog, LogError> {
        let producer: FutureProducer = base_config(&config.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("batch.num.messages", MAX_BATCH_RECORDS.to_string())
            .set("message.max.bytes", MAX_MESSAGE_BYTES.to_string())
            .set("message.timeout.ms", PRODUCE_TIMEOUT_MS.to_string())
            .create()
            .map_err(kafka_error)?;
        Ok(KafkaLog {
            config,
            producer,
            committers: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    fn committer(&self, group: &str) -> Result<Arc<BaseConsumer>, LogError> {
        let mut committers = self.committers.lock().expect("committers lock");
        if let Some(c) = committers.get(group) {
            return Ok(c.clone());
        }
        let consumer: BaseConsumer = base_config(&self.config.brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(kafka_error)?;
        let consumer = Arc::new(consumer);
        committers.insert(group.to_string(), consumer.clone());
        Ok(consumer)
    }

    /// A reader of `partition` handing over records from exactly `from_offset`.
    /// `listed` is the broker's end offset (`end_offset`), which on every broker is
    /// one past the first record of some batch (Kafka: the last record; tansu: the
    /// newest batch written). A start at or past that record begins there, where
    /// the broker serves whole batches; an earlier start is anchored by the reader
    /// itself (see `Cursor`).
    fn open_reader(
        &self,
        partition: u32,
        from_offset: u64,
        listed: u64,
    ) -> Result<KafkaReader, LogError> {
        let batch_start = listed.saturating_sub(1);
        let (start, resume_at) = if from_offset == 0 || listed == 0 {
            // The first record starts a batch; an empty partition has none to skip.
            (from_offset, Some(from_offset))
        } else if from_offset >= batch_start {
            (batch_start, Some(batch_start))
        } else {
            (from_offset, None)
        };
        let consumer: StreamConsumer = base_config(&self.config.brokers)
            // Readers are assigned partitions explicitly; the group id is required by
            // librdkafka but never used to commit (see `commit`).
            .set("group.id", format!("{}-reader", self.config.topic))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Never jump: a start offset the broker no longer has means records of
            // the log were deleted, and the projector must stop, not skip them.
            .set("auto.offset.reset", "error")
            .set(
                "fetch.wait.max.ms",
                self.config
                    .fetch_wait_ms
                    .clamp(1, MAX_FETCH_WAIT_MS)
                    .to_string(),
            )
            .create()
            .map_err(kafka_error)?;
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(
                &self.config.topic,
                partition as i32,
                Offset::Offset(start as i64),
            )
            .map_err(kafka_error)?;
        consumer.assign(&assignment).map_err(kafka_error)?;
        Ok(KafkaReader {
            consumer,
            topic: self.config.topic.clone(),
            cursor: Cursor {
                partition,
                next_offset: from_offset,
                resume_at,
                gap: false,
            },
            pending: None,
        })
    }
}

#[async_trait]
impl Log for KafkaLog {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn keeps_consumer_offsets(&self) -> bool {
        true
    }

    fn shared_between_nodes(&self) -> bool {
        true
    }

    fn partition_count(&self) -> u32 {
        self.config.partitions
    }

    fn health(&self) -> Option<String> {
        self.producer.client().fatal_error().map(|(code, reason)| {
            format!("fatal producer error {code:?}: {reason}; restart the node")
        })
    }

    async fn append(&self, key: &[u8], payload: Vec<u8>) -> Result<u64, LogError> {
        if payload.len() > MAX_RECORD_BYTES {
            return Err(LogError::RecordTooLarge(payload.len()));
        }
        if payload.is_empty() {
            return Err(LogError::EmptyRecord);
        }
        let partition = self.partition_for(key);
        let record = FutureRecord::to(&self.config.topic)
            .partition(partition as i32)
            .key(key)
            .payload(&payload);
        let delivery = self
            .producer
            .send(record, Duration::from_millis(PRODUCE_TIMEOUT_MS))
            .await
            .map_err(|(e, _)| produce_error(e))?;
        Ok(delivery.offset as u64)
    }

    async fn reader(
        &self,
        partition: u32,
        from_offset: u64,
    ) -> Result<Box<dyn LogReader>, LogError> {
        if partition >= self.config.partitions {
            return Err(LogError::NoSuchPartition(partition));
        }
        let listed = match from_offset {
            0 => 0,
            _ => self.end_offset(partition).await?,
        };
        Ok(Box::new(self.open_reader(
            partition,
            from_offset,
            listed,
        )?))
    }

    async fn read_at(&self, partition: u32, offset: u64) -> Result<Option<LogEntry>, LogError> {
        Ok(self.read_many(partition, &[offset]).await?.pop().flatten())
    }

    /// One forward read over the span of the offsets (a consumer per read would cost
    /// a connection each); the reader starts exactly at the first (see `KafkaReader`).
    async fn read_many(
        &self,
        partition: u32,
        offsets: &[u64],
    ) -> Result<Vec<Option<LogEntry>>, LogError> {
        let mut found: HashMap<u64, LogEntry> = HashMap::new();
        let (Some(&first), Some(&last)) = (offsets.iter().min(), offsets.iter().max()) else {
            return Ok(Vec::new());
        };
        let mut reader = self.reader(partition, first).await?;
        loop {
            let entries = match reader
                .next_batch(SCAN_BATCH, Duration::from_millis(FIRST_FETCH_WAIT_MS))
                .await
            {
                Ok(entries) => entries,
                // "Offset out of range": nothing is stored from there.
                Err(error) if error.is_corruption() => break,
                Err(error) => return Err(error),
            };
            if entries.is_empty() {
                break;
            }
            let past = entries.iter().any(|e| e.offset >= last);
            found.extend(entries.into_iter().map(|e| (e.offset, e)));
            if past {
                break;
            }
        }
        Ok(offsets.iter().map(|o| found.get(o).cloned()).collect())
    }

    /// The broker's end offset first (cheap, and enough on a restart that applied
    /// nothing new); when it says no, the end a reader sees.
    async fn covers(&self, partition: u32, next_offset: u64) -> Result<bool, LogError> {
        if next_offset == 0 || self.end_offset(partition).await? >= next_offset {
            return Ok(true);
        }
        match self.read_end(partition).await {
            Ok(end) => Ok(end >= next_offset),
            // "Offset out of range": the log is shorter than the broker said.
            Err(error) if error.is_corruption() => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Reads forward from just below the broker's end offset until a fetch brings
    /// nothing more. Some brokers answer "latest offset" below records they serve:
    /// tansu 0.6 answers with the newest batch by modification time plus one (not
    /// the batch with the highest offset, and below that batch's last record), so
    /// concurrent producers leave records past the answer. Kafka answers its high
    /// watermark, and this costs one fetch that returns the record just below it and
    /// one empty fetch.
    async fn read_end(&self, partition: u32) -> Result<u64, LogError> {
        let listed = self.end_offset(partition).await?;
        if listed == 0 {
            // No batch at all: nothing to read forward from.
            return Ok(0);
        }
        let mut end = listed;
        let mut reader = self.open_reader(partition, listed - 1, listed)?;
        let mut wait = Duration::from_millis(FIRST_FETCH_WAIT_MS);
        loop {
            let entries = reader.next_batch(SCAN_BATCH, wait).await?;
            match entries.last() {
                Some(last) => end = end.max(last.next_offset),
                None => return Ok(end),
            }
            wait = Duration::from_millis(END_READ_TAIL_WAIT_MS);
        }
    }

    async fn end_offset(&self, partition: u32) -> Result<u64, LogError> {
        let committer = self.committer("tally-metadata")?;
        let topic = self.config.topic.clone();
        tokio::task::spawn_blocking(move || {
            committer
                .fetch_watermarks(
                    &topic,
                    partition as i32,
                    Duration::from_millis(ADMIN_TIMEOUT_MS),
                )
                .map(|(_, high)| high.max(0) as u64)
                .map_err(kafka_error)
        })
        .await
        .map_err(|_| LogError::Closed)?
    }

    async fn commit(&self, group: &str, partition: u32, next_offset: u64) -> Result<(), LogError> {
        let committer = self.committer(group)?;
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(
            &self.config.topic,
            partition as i32,
            Offset::Offset(next_offset as i64),
        )
        .map_err(kafka_error)?;
        tokio::task::spawn_blocking(move || {
            committer
                .commit(&list, CommitMode::Sync)
                .map_err(kafka_error)
        })
        .await
        .map_err(|_| LogError::Closed)?
    }

    async fn committed(&self, group: &str, partition: u32) -> Result<Option<u64>, LogError> {
        let committer = self.committer(group)?;
        let mut list = TopicPartitionList::new();
        list.add_partition(&self.config.topic, partition as i32);
        let committed = tokio::task::spawn_blocking(move || {
            committer
                .committed_offsets(list, Duration::from_millis(ADMIN_TIMEOUT_MS))
                .map_err(kafka_error)
        })
        .await
        .map_err(|_| LogError::Closed)??;
        Ok(committed.elements().first().and_then(|e| match e.offset() {
            Offset::Offset(o) if o >= 0 => Some(o as u64),
            _ => None,
        }))
    }
}

/// A failed read: an offset out of range (records deleted under the reader) is
/// corruption of the log, never a reason to start elsewhere.
fn consume_error(error: KafkaError) -> LogError {
    match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange) => {
            LogError::Corrupt(format!(
                "the reader's offset is out of range: {error}; records of the log were deleted"
            ))
        }
        _ => kafka_error(error),
    }
}

/// A partition reader that hands over every record exactly once, in offset order,
/// starting exactly at its offset. Kafka offsets of our topics are dense (no
/// compaction, no transactions), so an offset past the next expected one is a record
/// the broker did not serve, never a hole: the reader reads again instead of jumping.
/// Two brokers' behaviours make such gaps (tansu does both; Kafka neither): serving
/// whole batches from their first record, which skips the rest of a batch when asked
/// for an offset inside it, and numbering a batch before it is readable, which lets
/// a concurrent producer's later batch be served first.
struct KafkaReader {
    consumer: StreamConsumer,
    topic: String,
    cursor: Cursor,
    /// The record at `next_offset`, found while closing a gap.
    pending: Option<LogEntry>,
}

/// Where a reader stands (apart from its consumer, whose messages borrow it).
struct Cursor {
    partition: u32,
    next_offset: u64,
    /// An offset at or before `next_offset` where a batch starts, so reading from it
    /// skips nothing: one past the last record the consumer served (a later offset
    /// came next, so that record ended its batch), or where the reader began when
    /// that was a batch's start. `None` until known.
    resume_at: Option<u64>,
    /// The broker served an offset past `next_offset`; read again before going on.
    gap: bool,
}

impl Cursor {
    /// Turns a message into an entry: records before the next one (re-deliveries, or
    /// read from further back) are dropped, and an offset past the next one marks a
    /// gap (and is dropped too: it is read again once the gap is closed).
    fn accept(&mut self, message: &rdkafka::message::BorrowedMessage<'_>) -> Option<LogEntry> {
        self.take(message.offset() as u64, || {
            message.payload().unwrap_or_default().to_vec()
        })
    }

    /// `accept` on a message's offset; `payload` is called only for the entry.
    fn take(&mut self, offset: u64, payload: impl FnOnce() -> Vec<u8>) -> Option<LogEntry> {
        if offset > self.next_offset {
            self.gap = true;
            return None;
        }
        self.resume_at = Some(offset + 1);
        if offset < self.next_offset {
            return None;
        }
        self.next_offset = offset + 1;
        Some(LogEntry {
            partition: self.partition,
            offset,
            next_offset: offset + 1,
            payload: payload(),
        })
    }
}

impl KafkaReader {
    /// Reads from `from` until the record at `next_offset` (found) or a later one or
    /// nothing for a while (not found).
    async fn look_from(&mut self, from: u64) -> Result<Option<LogEntry>, LogError> {
        self.consumer
            .seek(
                &self.topic,
                self.cursor.partition as i32,
                Offset::Offset(from as i64),
                Duration::from_millis(ADMIN_TIMEOUT_MS),
            )
            .map_err(kafka_error)?;
        loop {
            let wait = Duration::from_millis(FIRST_FETCH_WAIT_MS);
            let message = match tokio::time::timeout(wait, self.consumer.recv()).await {
                Err(_) => return Ok(None),
                Ok(result) => result.map_err(consume_error)?,
            };
            if let Some(entry) = self.cursor.accept(&message) {
                return Ok(Some(entry));
            }
            if self.cursor.gap {
                return Ok(None);
            }
        }
    }

    /// Reads again until the broker serves the record at `next_offset`: from where a
    /// batch starts before it when that is known (the batch holding it is still
    /// being written), else from further and further back (the reader began inside
    /// a batch); gives up after `GAP_WAIT_LIMIT_MS`.
    async fn close_gap(&mut self) -> Result<(), LogError> {
        let started = std::time::Instant::now();
        loop {
            self.cursor.gap = false;
            let next = self.cursor.next_offset;
            let froms: Vec<u64> = match self.cursor.resume_at {
                Some(resume_at) => vec![resume_at],
                None => REREAD_BACKS
                    .iter()
                    .map(|b| next.saturating_sub(*b))
                    .collect(),
            };
            for from in froms {
                if let Some(entry) = self.look_from(from).await? {
                    self.pending = Some(entry);
                    return Ok(());
                }
                self.cursor.gap = false;
                if from == 0 || self.cursor.resume_at.is_some() {
                    break;
                }
            }
            if started.elapsed() > Duration::from_millis(GAP_WAIT_LIMIT_MS) {
                return Err(LogError::Corrupt(format!(
                    "partition {} serves records past offset {next} but not that one, for over {GAP_WAIT_LIMIT_MS} ms: the broker lost a record it numbered",
                    self.cursor.partition
                )));
            }
            tokio::time::sleep(Duration::from_millis(GAP_RETRY_MS)).await;
        }
    }
}

#[async_trait]
impl LogReader for KafkaReader {
    async fn next_batch(
        &mut self,
        max_records: usize,
        wait: Duration,
    ) -> Result<Vec<LogEntry>, LogError> {
        let mut entries = Vec::new();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.cursor.gap {
                self.close_gap().await?;
            }
            entries.extend(self.pending.take());
            // Re-deliveries of records already handed over do not end the wait.
            while entries.is_empty() && !self.cursor.gap {
                let message = match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                    Err(_) => return Ok(entries),
                    Ok(result) => result.map_err(consume_error)?,
                };
                entries.extend(self.cursor.accept(&message));
            }
            while entries.len() < max_records && !self.cursor.gap {
                let Some(result) = self.consumer.recv().now_or_never() else {
                    break;
                };
                entries.extend(self.cursor.accept(&result.map_err(consume_error)?));
            }
            // A gap before anything was handed over is closed now: an empty answer
            // means "nothing more yet", which a later record already disproves.
            if !entries.is_empty() || !self.cursor.gap {
                return Ok(entries);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Vec<(String, Option<String>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), Some(v.to_string())))
            .collect()
    }

    fn cursor(next_offset: u64, resume_at: Option<u64>) -> Cursor {
        Cursor {
            partition: 0,
            next_offset,
            resume_at,
            gap: false,
        }
    }

    fn offsets_taken(cursor: &mut Cursor, served: &[u64]) -> Vec<u64> {
        served
            .iter()
            .filter_map(|&o| cursor.take(o, Vec::new))
            .map(|e| e.offset)
            .collect()
    }

    #[test]
    fn a_cursor_hands_over_each_offset_once_and_never_jumps() {
        // Read from further back, with re-deliveries: only 5.. in order, once.
        let mut c = cursor(5, None);
        assert_eq!(offsets_taken(&mut c, &[3, 4, 5, 6, 5, 6, 7]), vec![5, 6, 7]);
        assert_eq!((c.next_offset, c.resume_at, c.gap), (8, Some(8), false));
        // A later batch served before the one at 8: nothing taken, a gap, and the
        // place to read again is where the missing batch starts.
        assert_eq!(offsets_taken(&mut c, &[11, 12]), Vec::<u64>::new());
        assert_eq!((c.next_offset, c.resume_at, c.gap), (8, Some(8), true));
        // A reader that began inside a batch and was served the next batch first
        // knows no batch start yet: it must look further back.
        let mut c = cursor(20, None);
        assert_eq!(offsets_taken(&mut c, &[24]), Vec::<u64>::new());
        assert_eq!((c.resume_at, c.gap), (None, true));
    }

    #[test]
    fn only_topics_that_keep_every_record_pass() {
        let config = KafkaConfig {
            brokers: String::new(),
            topic: "t".into(),
            partitions: 1,
            replication_factor: 3,
            min_insync_replicas: 2,
            fetch_wait_ms: DEFAULT_FETCH_WAIT_MS,
        };
        let ours: Vec<(String, Option<String>)> = topic_settings(&config)
            .into_iter()
            .map(|(n, v)| (n.to_string(), Some(v)))
            .collect();
        assert_eq!(topic_problem(&ours), None);
        assert_eq!(topic_problem(&[]), None, "unreported settings are unset");
        for bad in [
            ("retention.ms", "604800000"),
            ("retention.bytes", "1073741824"),
            ("cleanup.policy", "compact,delete"),
            ("unclean.leader.election.enable", "true"),
        ] {
            let problem = topic_problem(&settings(&[bad])).expect("refused");
            assert!(problem.contains(bad.0), "{problem}");
        }
    }
}
