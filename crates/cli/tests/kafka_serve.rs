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

/// `serve` flags for a 3-partition topic on the test broker.
fn kafka_flags<'a>(brokers: &'a str, topic: &'a str) -> [&'a str; 8] {
    [
        "--log",
        "kafka",
        "--kafka-brokers",
        brokers,
        "--kafka-topic",
        topic,
        "--kafka-partitions",
        "3",
    ]
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
    let flags = kafka_flags(&brokers, &topic);
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

/// A POST with an `idempotency-key`: status, raw body, and whether it was a replay.
async fn post_keyed(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    idempotency_key: &str,
    body: Value,
) -> (u16, String, bool) {
    let response = http
        .post(url)
        .header("x-api-key", key)
        .header("idempotency-key", idempotency_key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    (
        response.status().as_u16(),
        response.text().await.unwrap(),
        replayed,
    )
}

/// Two nodes on one topic take writes for one store at once. Decisions are taken in
/// apply, in log order, so: one idempotency key creates one customer whichever node
/// each retry reaches, and every retry gets the first response byte for byte; one
/// external_id is taken once; concurrent updates of one customer through both nodes
/// keep both changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_decide_keys_uniqueness_and_updates_once() {
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let topic = tally_log::testsuite::unique_topic("tally-nodes");
    let flags = kafka_flags(&brokers, &topic);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node_a = serve_with(dir_a.path(), &flags);
    let key = node_a.test_key.clone().expect("keys on first start");
    let mut flags_b = flags.to_vec();
    flags_b.extend(["--no-default-store", "--no-webhook-dispatch"]);
    let node_b = serve_with(dir_b.path(), &flags_b);
    let http = reqwest::Client::new();
    let nodes = [node_a.test_url.clone(), node_b.test_url.clone()];
    for _ in 0..200 {
        if get(&http, &format!("{}/v1/customers", nodes[1]), &key)
            .await
            .0
            == 200
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // One key, six concurrent sends over both nodes: one customer, one response.
    let sends: Vec<_> = (0..6)
        .map(|i| {
            let (http, url, key) = (
                http.clone(),
                format!("{}/v1/customers", nodes[i % 2]),
                key.clone(),
            );
            tokio::spawn(async move {
                post_keyed(&http, &url, &key, "one-key", json!({"email": "once@x.io"})).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for send in sends {
        answers.push(send.await.unwrap());
    }
    let (status, first_body, _) = answers[0].clone();
    assert_eq!(status, 200, "{first_body}");
    for (status, body, _) in &answers {
        assert_eq!(
            (*status, body),
            (200, &first_body),
            "every send answers the first response"
        );
    }
    assert_eq!(
        answers.iter().filter(|(_, _, replayed)| !replayed).count(),
        1
    );
    for node in &nodes {
        let (_, listed) = get(&http, &format!("{node}/v1/customers?limit=100"), &key).await;
        let once = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["email"] == "once@x.io")
            .count();
        assert_eq!(once, 1, "{listed}");
    }
    let (status, body, _) = post_keyed(
        &http,
        &format!("{}/v1/customers", nodes[1]),
        &key,
        "one-key",
        json!({"email": "other@x.io"}),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("idempotency_key_reused"), "{body}");

    // One external_id through both nodes at once: taken exactly once.
    let creates: Vec<_> = (0..6)
        .map(|i| {
            let (http, url, key) = (
                http.clone(),
                format!("{}/v1/customers", nodes[i % 2]),
                key.clone(),
            );
            tokio::spawn(async move {
                post(
                    &http,
                    &url,
                    &key,
                    json!({"email": format!("e{i}@x.io"), "external_id": "shared"}),
                )
                .await
                .unwrap()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for create in creates {
        let (status, body) = create.await.unwrap();
        if status == 409 {
            assert_eq!(body["error"]["code"], "external_id_taken", "{body}");
        }
        statuses.push(status);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 409).count(),
        5,
        "{statuses:?}"
    );

    // Updates of different fields through both nodes at once: neither is lost.
    let customer = serde_json::from_str::<Value>(&first_body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    for round in 0..8 {
        let url = |node: &str| format!("{node}/v1/customers/{customer}");
        let (url_a, url_b) = (url(&nodes[0]), url(&nodes[1]));
        let (a, b) = tokio::join!(
            post(&http, &url_a, &key, json!({"name": format!("n{round}")})),
            post(
                &http,
                &url_b,
                &key,
                json!({"metadata": {"round": round.to_string()}})
            ),
        );
        assert_eq!(a.unwrap().0, 200);
        assert_eq!(b.unwrap().0, 200);
        // Node A may not have applied node B's update yet; once both are applied,
        // both changes must show (a lost update would never show).
        let (name, marker) = (format!("n{round}"), round.to_string());
        let mut now = Value::Null;
        for _ in 0..100 {
            now = get(&http, &url_a, &key).await.1;
            if now["name"] == name.as_str() && now["metadata"]["round"] == marker.as_str() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(now["name"], name.as_str(), "{now}");
        assert_eq!(now["metadata"]["round"], marker.as_str(), "{now}");
    }
    assert!(node_b.terminate().success());
    assert!(node_a.terminate().success());
}
