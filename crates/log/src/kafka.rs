//! The Kafka log: one topic with N partitions, written by an idempotent producer with
//! `acks=all`, read by partition-assigned consumers. Consumers commit their group
//! offset only after their projection write is durable (see `Log::commit`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::{Log, LogEntry, LogError, LogReader};

/// How long a produce may wait for the broker (including retries) before it fails.
pub const PRODUCE_TIMEOUT_MS: u64 = 30_000;
/// Metadata and commit calls.
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;

#[derive(Debug, Clone)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic: String,
    pub partitions: u32,
    pub replication_factor: i32,
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
    let topic = NewTopic::new(
        &config.topic,
        config.partitions as i32,
        TopicReplication::Fixed(config.replication_factor),
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

    fn partition_count(&self) -> u32 {
        self.config.partitions
    }

    async fn append(&self, key: &[u8], payload: Vec<u8>) -> Result<u64, LogError> {
        let partition = self.partition_for(key);
        let record = FutureRecord::to(&self.config.topic)
            .partition(partition as i32)
            .key(key)
            .payload(&payload);
        let delivery = self
            .producer
            .send(record, Duration::from_millis(PRODUCE_TIMEOUT_MS))
            .await
            .map_err(|(e, _)| kafka_error(e))?;
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
            .set("auto.offset.reset", "earliest")
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
            Ok(result) => result.map_err(kafka_error)?,
        };
        entries.extend(self.accept(first.detach()));
        while entries.len() < max_records {
            let Some(result) = self.consumer.recv().now_or_never() else {
                break;
            };
            let message = result.map_err(kafka_error)?.detach();
            entries.extend(self.accept(message));
        }
        Ok(entries)
    }
}
