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
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = KafkaConfig {
        brokers,
        topic: format!("tally-suite-{nanos}"),
        partitions: 3,
        replication_factor: 1,
    };
    assert!(create_topic(&config).await.unwrap(), "topic is new");
    assert!(
        !create_topic(&config).await.unwrap(),
        "creating twice is idempotent"
    );
    let factory = KafkaFactory { config };
    testsuite::run_all(&factory).await;
}
