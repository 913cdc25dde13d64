//! `tally serve --log kafka` end to end against a real Kafka-protocol broker
//! (`TALLY_TEST_KAFKA_BROKERS`, started by `.ci/run`): usage from customers spread
//! over partitions, exact dedup, credits under concurrency, and restarts (graceful
//! and SIGKILL) that resume from the projection's stored positions.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

async fn usage_value(http: &reqwest::Client, base: &str, key: &str, meter: &str) -> String {
    let (_, usage) = get(http, &format!("{base}/v1/meters/{meter}/usage"), key).await;
    usage["value"].as_str().unwrap_or_default().to_string()
}

/// Polls until the asynchronous projection shows `expected`.
async fn wait_for_usage(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    meter: &str,
    expected: &str,
) {
    for _ in 0..200 {
        if usage_value(http, base, key, meter).await == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "usage never reached {expected}: {}",
        usage_value(http, base, key, meter).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serving_on_kafka_is_exact_and_survives_restarts() {
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let topic = tally_log::testsuite::unique_topic("tally-serve");
    let flags = [
        "--log",
        "kafka",
        "--kafka-brokers",
        &brokers,
        "--kafka-topic",
        &topic,
        "--kafka-partitions",
        "3",
    ];
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(dir.path(), &flags);
    let key = served.test_key.clone().expect("keys on first start");
    let base = served.test_url.clone();
    let http = reqwest::Client::new();

    let mut customers = Vec::new();
    for i in 0..6 {
        let (status, c) = post(
            &http,
            &format!("{base}/v1/customers"),
            &key,
            json!({"email": format!("k{i}@x.io"), "external_id": format!("k{i}")}),
        )
        .await
        .unwrap();
        assert_eq!(status, 200);
        customers.push(c["id"].as_str().unwrap().to_string());
    }
    let (_, meter) = post(&http, &format!("{base}/v1/meters"), &key, json!({"name": "sum", "event_name": "e", "aggregation": "sum", "aggregation_property": "n"})).await.unwrap();
    let meter = meter["id"].as_str().unwrap().to_string();
    let batch = |ids: std::ops::Range<usize>| -> Value {
        json!({"events": ids.map(|i| json!({"name": "e", "external_customer_id": format!("k{}", i % 6), "event_id": format!("ev{i}"), "properties": {"n": i}})).collect::<Vec<_>>()})
    };
    let (status, first) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        batch(0..60),
    )
    .await
    .unwrap();
    assert_eq!(status, 202, "{first}");
    let (_, again) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        batch(30..90),
    )
    .await
    .unwrap();
    assert_eq!(again["duplicates"], 30);
    // 0 + 1 + ... + 89
    wait_for_usage(&http, &base, &key, &meter, "4005").await;

    let accounts = format!("{base}/v1/customer-credits/accounts");
    let (_, account) = post(
        &http,
        &accounts,
        &key,
        json!({"customer_id": customers[0], "initial_balance": "10"}),
    )
    .await
    .unwrap();
    let account = account["id"].as_str().unwrap().to_string();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (http, url, key) = (
            http.clone(),
            format!("{accounts}/{account}/debit"),
            key.clone(),
        );
        tasks.push(tokio::spawn(async move {
            post(
                &http,
                &url,
                &key,
                json!({"amount": "1", "idempotency_key": format!("r{i}")}),
            )
            .await
            .unwrap()
            .0
        }));
    }
    let mut ok = 0;
    for t in tasks {
        if t.await.unwrap() == 200 {
            ok += 1;
        }
    }
    assert_eq!(ok, 10);
    assert!(served.terminate().success());

    // Graceful restart: everything is there, nothing applied twice.
    let served = serve_with(dir.path(), &flags);
    assert!(served.test_key.is_none());
    let base = served.test_url.clone();
    assert_eq!(usage_value(&http, &base, &key, &meter).await, "4005");
    let (_, balance) = get(
        &http,
        &format!("{base}/v1/customer-credits/accounts/{account}"),
        &key,
    )
    .await;
    assert_eq!(balance["balance"], "0");
    let (_, more) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        batch(80..100),
    )
    .await
    .unwrap();
    assert_eq!(more["accepted"], 10);
    wait_for_usage(&http, &base, &key, &meter, "4950").await;
    served.kill();

    // After SIGKILL the projection resumes from its stored positions.
    let served = serve_with(dir.path(), &flags);
    let base = served.test_url.clone();
    assert_eq!(usage_value(&http, &base, &key, &meter).await, "4950");
    let (_, replayed) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        batch(0..100),
    )
    .await
    .unwrap();
    assert_eq!(replayed["accepted"], 0, "every id is known after the crash");
    assert!(served.terminate().success());
}
