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
/// a Kafka broker answers an empty fetch after `fetch.wait.max.ms` (50 ms, below).
pub const END_READ_TAIL_WAIT_MS: u64 = 500;
/// Records per fetch while `read_end` and `read_many` scan forward.
const SCAN_BATCH: usize = 1_000;

/// How far before a wanted offset `read_at` starts reading when the broker served
/// nothing at it: past the largest batch librdkafka forms under our load, then far
/// past it.
const READ_AT_BACKOFFS: [u64; 3] = [0, 256, 16_384];
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

fn kafka_error(e: impl std::fmt::Display) -> LogError {
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

fn base_config(brokers: &str) -> ClientConfig {
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
    let admin: AdminClient<DefaultClientContext> =
        base_config(&config.brokers).create().map_err(kafka_error)?;
    let settings = topic_settings(config);
    let topic = settings.iter().fold(
        NewTopic::new(
            &config.topic,
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
        let consumer: StreamConsumer = base_config(&self.config.brokers)
            // Readers are assigned partitions explicitly; the group id is required by
            // librdkafka but never used to commit (see `commit`).
            .set("group.id", format!("{}-reader", self.config.topic))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Never jump: a start offset the broker no longer has means records of
            // the log were deleted, and the projector must stop, not skip them.
            .set("auto.offset.reset", "error")
            .set("fetch.wait.max.ms", "50")
            .create()
            .map_err(kafka_error)?;
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(
                &self.config.topic,
                partition as i32,
                Offset::Offset(from_offset as i64),
            )
            .map_err(kafka_error)?;
        consumer.assign(&assignment).map_err(kafka_error)?;
        Ok(Box::new(KafkaReader {
            consumer,
            partition,
            next_offset: from_offset,
        }))
    }

    /// Reads forward from the offset, then, when the broker served nothing at it, from
    /// further back: brokers that serve only whole batches (tansu) skip a record in
    /// the middle of a batch when asked for exactly its offset.
    async fn read_at(&self, partition: u32, offset: u64) -> Result<Option<LogEntry>, LogError> {
        Ok(self.read_many(partition, &[offset]).await?.pop().flatten())
    }

    /// One forward read over the span of the offsets (a consumer per read would cost
    /// a connection each), repeated from further back for what it did not find.
    async fn read_many(
        &self,
        partition: u32,
        offsets: &[u64],
    ) -> Result<Vec<Option<LogEntry>>, LogError> {
        let mut found: std::collections::HashMap<u64, LogEntry> = Default::default();
        let mut missing: std::collections::BTreeSet<u64> = offsets.iter().copied().collect();
        for back in READ_AT_BACKOFFS {
            let (Some(&first), Some(&last)) = (missing.first(), missing.last()) else {
                break;
            };
            let from = first.saturating_sub(back);
            let mut reader = self.reader(partition, from).await?;
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
                for entry in entries {
                    if missing.remove(&entry.offset) {
                        found.insert(entry.offset, entry);
                    }
                }
                if missing.is_empty() || past {
                    break;
                }
            }
            if from == 0 {
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
        let mut reader = self.reader(partition, listed - 1).await?;
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

struct KafkaReader {
    consumer: StreamConsumer,
    partition: u32,
    next_offset: u64,
}

impl KafkaReader {
    /// Turns a message into an entry, dropping re-deliveries of offsets already read.
    fn accept(&mut self, message: rdkafka::message::OwnedMessage) -> Option<LogEntry> {
        let offset = message.offset() as u64;
        if offset < self.next_offset {
            return None;
        }
        self.next_offset = offset + 1;
        Some(LogEntry {
            partition: self.partition,
            offset,
            next_offset: offset + 1,
            payload: message.payload().unwrap_or_default().to_vec(),
        })
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
        let first = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => return Ok(entries),
            Ok(result) => result.map_err(consume_error)?,
        };
        entries.extend(self.accept(first.detach()));
        while entries.len() < max_records {
            let Some(result) = self.consumer.recv().now_or_never() else {
                break;
            };
            let message = result.map_err(consume_error)?.detach();
            entries.extend(self.accept(message));
        }
        Ok(entries)
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

    #[test]
    fn only_topics_that_keep_every_record_pass() {
        let config = KafkaConfig {
            brokers: String::new(),
            topic: "t".into(),
            partitions: 1,
            replication_factor: 3,
            min_insync_replicas: 2,
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
