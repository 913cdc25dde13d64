//! The shared log suite against a real Kafka-protocol broker.
//!
//! Needs `TALLY_TEST_KAFKA_BROKERS` (e.g. `127.0.0.1:9092`); `.ci/run` starts a tansu
//! broker and sets it. Without it the test says so and passes only outside CI: in CI
//! (`CI=true`) a missing broker is a failure, so the Kafka path is never silently
//! untested.

use std::sync::Arc;

use async_trait::async_trait;
use tally_log::kafka::{create_topic, KafkaConfig, KafkaLog};
use tally_log::testsuite::{self, LogFactory};
use tally_log::Log;

struct KafkaFactory {
    config: KafkaConfig,
}

#[async_trait]
impl LogFactory for KafkaFactory {
    async fn open(&self) -> Arc<dyn Log> {
        Arc::new(KafkaLog::connect(self.config.clone()).expect("connect to kafka"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_log_passes_the_shared_suite() {
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let config = KafkaConfig {
        brokers,
        topic: tally_log::testsuite::unique_topic("tally-suite"),
        partitions: 3,
        replication_factor: 1,
        min_insync_replicas: 1,
        fetch_wait_ms: tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
    };
    assert!(create_topic(&config).await.unwrap(), "topic is new");
    assert!(
        !create_topic(&config).await.unwrap(),
        "creating twice is idempotent"
    );
    let factory = KafkaFactory { config };
    testsuite::run_all(&factory).await;
}

/// A topic whose settings can delete records is refused; the one tally creates is
/// accepted. Against the real broker: the settings are read back from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_that_can_delete_records_are_refused() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let config = |topic: String| KafkaConfig {
        brokers: brokers.clone(),
        topic,
        partitions: 1,
        replication_factor: 1,
        min_insync_replicas: 1,
        fetch_wait_ms: tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
    };
    let kept = config(tally_log::testsuite::unique_topic("tally-kept"));
    assert!(create_topic(&kept).await.unwrap());
    tally_log::kafka::verify_topic(&kept).await.unwrap();

    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("broker.address.family", "v4")
        .create()
        .unwrap();
    for (name, value) in [("retention.ms", "60000"), ("cleanup.policy", "compact")] {
        let topic =
            tally_log::testsuite::unique_topic(&format!("tally-{}", name.replace('.', "-")));
        let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set(name, value);
        admin
            .create_topics([&new], &AdminOptions::new())
            .await
            .unwrap()
            .into_iter()
            .for_each(|r| {
                r.unwrap();
            });
        let refused = tally_log::kafka::verify_topic(&config(topic)).await;
        match refused {
            Err(tally_log::LogError::Corrupt(message)) => {
                assert!(message.contains(name), "{message}")
            }
            other => panic!("{name}={value} accepted: {other:?}"),
        }
    }
}
