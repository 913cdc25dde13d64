//! The Kafka changelog against a real Kafka-protocol broker (`TALLY_TEST_KAFKA_BROKERS`,
//! started by `.ci/run`): checkpoints read back whole, a reset begins anew, and the
//! records of another writer of the same partition (a node that owned it a moment
//! ago) never mix into the snapshot read back.

use std::collections::BTreeMap;

use tally_log::changelog::{create_changelog_topic, Changelog, KafkaChangelog};
use tally_log::kafka::KafkaConfig;

fn rows(pairs: &[(&str, Option<&str>)]) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.map(|v| v.as_bytes().to_vec())))
        .collect()
}

fn state(pairs: &[(&str, &str)]) -> BTreeMap<Vec<u8>, Vec<u8>> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_read_back_whole_and_writers_never_mix() {
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let config = KafkaConfig {
        brokers,
        topic: tally_log::testsuite::unique_topic("tally-changelog"),
        partitions: 2,
        replication_factor: 1,
        min_insync_replicas: 1,
        fetch_wait_ms: tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
    };
    assert!(create_changelog_topic(&config).await.unwrap());
    assert!(!create_changelog_topic(&config).await.unwrap());
    tokio::task::spawn_blocking(move || {
        let first = KafkaChangelog::connect(&config).unwrap();
        assert_eq!(first.read(0).unwrap(), None, "nothing written yet");
        // A write that is not a reset needs an epoch first.
        assert!(first
            .write(0, false, &rows(&[("a", Some("1"))]), 1)
            .is_err());
        first
            .write(0, true, &rows(&[("a", Some("1")), ("b", Some("2"))]), 10)
            .unwrap();
        first
            .write(0, false, &rows(&[("a", None), ("c", Some("3"))]), 20)
            .unwrap();
        first.write(1, true, &rows(&[("z", Some("9"))]), 5).unwrap();
        let read = first.read(0).unwrap().expect("a checkpoint");
        assert_eq!(read.position, 20);
        assert_eq!(read.rows, state(&[("b", "2"), ("c", "3")]));
        assert_eq!(first.read(1).unwrap().unwrap().rows, state(&[("z", "9")]));

        // Another node gains partition 0 and writes it from a reset, while the
        // first still writes a checkpoint of its own: the newest marker's writer
        // is read, and only its records.
        let second = KafkaChangelog::connect(&config).unwrap();
        second
            .write(0, true, &rows(&[("d", Some("4"))]), 30)
            .unwrap();
        first
            .write(0, false, &rows(&[("e", Some("5"))]), 40)
            .unwrap();
        let read = second.read(0).unwrap().unwrap();
        assert_eq!(read.position, 40, "the first writer's marker is the newest");
        assert_eq!(read.rows, state(&[("b", "2"), ("c", "3"), ("e", "5")]));
        second
            .write(0, false, &rows(&[("f", Some("6"))]), 50)
            .unwrap();
        let read = first.read(0).unwrap().unwrap();
        assert_eq!(read.position, 50);
        assert_eq!(read.rows, state(&[("d", "4"), ("f", "6")]));

        // A checkpoint larger than one changelog record reads back whole.
        let big: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..3000)
            .map(|i| (format!("row{i:05}").into_bytes(), Some(vec![b'x'; 1000])))
            .collect();
        second.write(1, true, &big, 60).unwrap();
        let read = first.read(1).unwrap().unwrap();
        assert_eq!(read.position, 60);
        assert_eq!(read.rows.len(), 3000);
        // Partition 0 is untouched by it.
        assert_eq!(first.read(0).unwrap().unwrap().position, 50);
    })
    .await
    .unwrap();
}
