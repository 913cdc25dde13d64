//! `tally serve --log kafka` end to end against a real Kafka-protocol broker
//! (`TALLY_TEST_KAFKA_BROKERS`, started by `.ci/run`): usage of several customers,
//! exact dedup, credits under concurrency, restarts (graceful and SIGKILL) that
//! resume from the projection's stored positions, several nodes on one topic
//! deciding alike, one of them killed under load, a cluster moving webhook delivery
//! off a killed node, and a split cluster sharing the projection (any node
//! answering, one killed under load).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tally_log::testsuite::node_port;

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
    // Up to 90 s: a restarted debug-build node catching up on a shared 2-core
    // machine took more than 30 once (CI, three nodes after a SIGKILL). A wait for
    // an exact value: only how long it may take changes, never what it must be.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while std::time::Instant::now() < deadline {
        if usage_value(http, base, key, meter).await == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What the node says of its progress, to tell a stalled node from a lost record.
    let metrics = match http.get(format!("{base}/metrics")).send().await {
        Ok(answer) => answer.text().await.unwrap_or_default(),
        Err(error) => error.to_string(),
    };
    let progress: Vec<&str> = metrics
        .lines()
        .filter(|line| {
            [
                "tally_projector_lag",
                "tally_records_applied",
                "tally_events_",
            ]
            .iter()
            .any(|name| line.starts_with(name))
        })
        .collect();
    panic!(
        "{base}: usage never reached {expected}: {}; {progress:?}",
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
    let (_, max) = post(&http, &format!("{base}/v1/meters"), &key, json!({"name": "max", "event_name": "e", "aggregation": "max", "aggregation_property": "n"})).await.unwrap();
    let max = max["id"].as_str().unwrap().to_string();
    let batch = |ids: std::ops::Range<usize>| -> Value {
        json!({"events": ids.map(|i| json!({"name": "e", "external_customer_id": format!("k{}", i % 6), "event_id": format!("ev{i}"), "properties": {"n": i}})).collect::<Vec<_>>()})
    };
    // A batch is one record, whatever partitions its customers' ids would fall in:
    // a store's records share a partition (an earlier build split the batch by
    // customer into up to one record per partition).
    let appends = || {
        metric_sum(
            &http,
            &served.prod_url,
            "tally_log_append_duration_seconds_count",
        )
    };
    let appended_before = appends().await;
    let (status, first) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        batch(0..60),
    )
    .await
    .unwrap();
    assert_eq!(status, 202, "{first}");
    assert_eq!(
        appends().await - appended_before,
        1.0,
        "six customers' events in one batch are one record"
    );
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

    // A void on Kafka: the largest two events leave the sum and the maximum (which
    // is rebuilt from records read back from the topic), and stay gone on restart;
    // so does an amendment.
    let (status, voided) = post(
        &http,
        &format!("{base}/v1/events/void"),
        &key,
        json!({"event_ids": ["ev99", "ev98"], "reason": "test"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{voided}");
    assert_eq!(voided["voided"], json!(["ev99", "ev98"]));
    wait_for_usage(&http, &base, &key, &meter, "4753").await;
    wait_for_usage(&http, &base, &key, &max, "97").await;
    // An amendment on Kafka: ev97 (the maximum now) is replaced by a larger value.
    let (status, amended) = post(
        &http,
        &format!("{base}/v1/events/ev97/amend"),
        &key,
        json!({"event": {"event_id": "ev97b", "properties": {"n": 200}}, "reason": "test"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{amended}");
    assert_eq!(amended["replacement"]["event_id"], "ev97b");
    wait_for_usage(&http, &base, &key, &meter, "4856").await;
    wait_for_usage(&http, &base, &key, &max, "200").await;
    assert!(served.terminate().success());
    let served = serve_with(dir.path(), &flags);
    let base = served.test_url.clone();
    assert_eq!(usage_value(&http, &base, &key, &meter).await, "4856");
    assert_eq!(usage_value(&http, &base, &key, &max).await, "200");
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
    let Some((replicas, [node_a, node_b])) = Replicas::start("tally-nodes") else {
        return;
    };
    let key = replicas.key.clone();
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

/// What one node creates, another node uses at once: a customer created through
/// node A is known to an ingest through node B right after A answered (B catches
/// up with the log before refusing an unknown customer), and a meter created
/// through A counts an event B takes right after (apply decides the meters B's
/// gateway had not applied yet). Each round creates both and ingests at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_node_creates_another_uses_at_once() {
    let Some((replicas, [node_a, node_b])) = Replicas::start("tally-at-once") else {
        return;
    };
    let key = replicas.key.clone();
    let http = reqwest::Client::new();
    let (a, b) = (node_a.test_url.clone(), node_b.test_url.clone());
    // Load through both nodes keeps their projectors busy, so B is usually behind
    // what A has just answered (an idle B applies A's records within the round
    // trip, and the test would prove nothing).
    let (status, noise) = post(
        &http,
        &format!("{a}/v1/customers"),
        &key,
        json!({"email": "noise@x.io", "external_id": "noise"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{noise}");
    let loading = Arc::new(AtomicBool::new(true));
    let load: Vec<_> = (0..2)
        .map(|sender| {
            let (http, key, loading) = (http.clone(), key.clone(), loading.clone());
            let node = if sender % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                let mut batch = 0;
                while loading.load(Ordering::Relaxed) {
                    let events: Vec<Value> = (0..100)
                        .map(|i| json!({"name": "noise", "external_customer_id": "noise", "event_id": format!("noise-{sender}-{batch}-{i}"), "properties": {"n": 1}}))
                        .collect();
                    let (status, answer) = post(
                        &http,
                        &format!("{node}/v1/events/ingest"),
                        &key,
                        json!({ "events": events }),
                    )
                    .await
                    .unwrap();
                    assert!(status == 202 || status == 503, "{answer}");
                    batch += 1;
                }
            })
        })
        .collect();
    const ROUNDS: usize = 10;
    let mut meters = Vec::new();
    for round in 0..ROUNDS {
        // Odd rounds create the customer last (B most often lacks the customer),
        // even rounds the meter (B most often knows the customer, not the meter).
        let meter_body = json!({"name": format!("m{round}"), "event_name": format!("call{round}"), "aggregation": "sum", "aggregation_property": "n"});
        let customer_body =
            json!({"email": format!("r{round}@x.io"), "external_id": format!("r{round}")});
        let (meters_url, customers_url) = (format!("{a}/v1/meters"), format!("{a}/v1/customers"));
        let ((status, meter), (customer_status, customer)) = if round % 2 == 1 {
            let meter = post(&http, &meters_url, &key, meter_body).await.unwrap();
            let customer = post(&http, &customers_url, &key, customer_body)
                .await
                .unwrap();
            (meter, customer)
        } else {
            let customer = post(&http, &customers_url, &key, customer_body)
                .await
                .unwrap();
            let meter = post(&http, &meters_url, &key, meter_body).await.unwrap();
            (meter, customer)
        };
        assert_eq!(status, 200, "{meter}");
        assert_eq!(customer_status, 200, "{customer}");
        let event = json!({"events": [{"name": format!("call{round}"), "external_customer_id": format!("r{round}"), "event_id": format!("ev{round}"), "properties": {"n": round + 1}}]});
        // Through B only; a 503 (B too far behind under the load: backpressure)
        // is sent again, as a client does after its Retry-After.
        let (status, answer) = post_retrying(
            &http,
            std::slice::from_ref(&b),
            0,
            "/v1/events/ingest",
            &key,
            &event,
        )
        .await;
        assert_eq!(status, 202, "round {round}: {answer}");
        meters.push(meter["id"].as_str().unwrap().to_string());
    }
    loading.store(false, Ordering::Relaxed);
    for sender in load {
        sender.await.unwrap();
    }
    for (round, meter) in meters.iter().enumerate() {
        for node in [&a, &b] {
            wait_for_usage(&http, node, &key, meter, &(round + 1).to_string()).await;
        }
    }
}

/// How long a client keeps retrying a request on the nodes.
const RETRY_FOR_SECONDS: u64 = 120;

/// Sends `body` to `nodes[first]`, and on a failure a client retries (no answer, a
/// 5xx) again to the next node with the same body (the same event ids or
/// idempotency key), until a node answers; returns that answer.
async fn post_retrying(
    http: &reqwest::Client,
    nodes: &[String],
    first: usize,
    path: &str,
    key: &str,
    body: &Value,
) -> (u16, Value) {
    // A bound on the whole, not on attempts: one attempt may wait for a partition
    // to move (up to the forwarding wait), and a test must fail, never hang CI.
    let deadline = std::time::Instant::now() + Duration::from_secs(RETRY_FOR_SECONDS);
    let mut attempt = 0;
    while std::time::Instant::now() < deadline {
        let node = &nodes[(first + attempt) % nodes.len()];
        attempt += 1;
        match post(http, &format!("{node}{path}"), key, body.clone()).await {
            Ok((status, answer)) if status < 500 => return (status, answer),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    panic!("no node answered {path} within {RETRY_FOR_SECONDS} s ({attempt} attempts)");
}

/// Full-replica nodes on a new topic: the first creates the default store, the
/// others follow it (no default store, no webhook dispatch).
struct Replicas {
    brokers: String,
    topic: String,
    dirs: Vec<tempfile::TempDir>,
    key: String,
}

impl Replicas {
    /// Starts `N` of them; `None` without a test broker.
    fn start<const N: usize>(topic_prefix: &str) -> Option<(Replicas, [Served; N])> {
        let brokers = tally_log::testsuite::test_brokers()?;
        let topic = tally_log::testsuite::unique_topic(topic_prefix);
        let dirs: Vec<_> = (0..N).map(|_| tempfile::tempdir().unwrap()).collect();
        let mut replicas = Replicas {
            brokers,
            topic,
            dirs,
            key: String::new(),
        };
        let nodes = std::array::from_fn(|n| {
            if n == 0 {
                let first = serve_with(replicas.dirs[0].path(), &replicas.flags());
                replicas.key = first.test_key.clone().expect("keys on first start");
                first
            } else {
                replicas.follower(n)
            }
        });
        Some((replicas, nodes))
    }

    fn flags(&self) -> Vec<&str> {
        kafka_flags(&self.brokers, &self.topic).to_vec()
    }

    /// (Re)starts follower `n` on its data dir.
    fn follower(&self, n: usize) -> Served {
        let mut flags = self.flags();
        flags.extend(["--no-default-store", "--no-webhook-dispatch"]);
        serve_with(self.dirs[n].path(), &flags)
    }
}

/// Three nodes on one topic take ingest and debits at once; one is SIGKILLed mid-load
/// and restarted. Clients retry what failed on another node with the same event ids
/// and idempotency keys. Afterwards every node answers the same exact usage total
/// and balance (each event counted once, exactly 100 of 240 debits of 1 against 100
/// succeeded), and the topic replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_survive_a_sigkill_under_load_and_agree() {
    let Some((replicas, [node_a, node_b, node_c])) = Replicas::start("tally-three") else {
        return;
    };
    let key = replicas.key.clone();
    let nodes = vec![
        node_a.test_url.clone(),
        node_b.test_url.clone(),
        node_c.test_url.clone(),
    ];
    let http = reqwest::Client::new();

    let (status, customer) = post_retrying(
        &http,
        &nodes,
        0,
        "/v1/customers",
        &key,
        &json!({"email": "three@x.io", "external_id": "three"}),
    )
    .await;
    assert_eq!(status, 200, "{customer}");
    let (status, meter) = post_retrying(&http, &nodes, 1, "/v1/meters", &key, &json!({"name": "tokens", "event_name": "call", "aggregation": "sum", "aggregation_property": "n"})).await;
    assert_eq!(status, 200, "{meter}");
    let meter = meter["id"].as_str().unwrap().to_string();
    let (status, account) = post_retrying(
        &http,
        &nodes,
        2,
        "/v1/customer-credits/accounts",
        &key,
        &json!({"customer_id": customer["id"], "initial_balance": "100"}),
    )
    .await;
    assert_eq!(status, 200, "{account}");
    let account = account["id"].as_str().unwrap().to_string();

    const BATCHES: usize = 40;
    const PER_BATCH: usize = 50;
    const DEBITS: usize = 240;
    let mut load = Vec::new();
    for batch in 0..BATCHES {
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        let events: Vec<Value> = (batch * PER_BATCH..(batch + 1) * PER_BATCH)
            .map(|i| json!({"name": "call", "external_customer_id": "three", "event_id": format!("ev{i}"), "properties": {"n": i}}))
            .collect();
        load.push(tokio::spawn(async move {
            let body = json!({ "events": events });
            post_retrying(&http, &nodes, batch, "/v1/events/ingest", &key, &body).await
        }));
    }
    for debit in 0..DEBITS {
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        let path = format!("/v1/customer-credits/accounts/{account}/debit");
        load.push(tokio::spawn(async move {
            let body = json!({"amount": "1", "idempotency_key": format!("debit-{debit}")});
            post_retrying(&http, &nodes, debit, &path, &key, &body).await
        }));
    }
    // Mid-load: node C dies without a chance to flush anything.
    tokio::time::sleep(Duration::from_millis(150)).await;
    node_c.kill();

    let mut debited = 0;
    for (i, task) in load.into_iter().enumerate() {
        let (status, answer) = task.await.unwrap();
        if i < BATCHES {
            assert_eq!(status, 202, "{answer}");
        } else if status == 200 {
            debited += 1;
        } else {
            assert_eq!(answer["error"]["code"], "insufficient_balance", "{answer}");
        }
    }
    assert_eq!(debited, 100, "exactly the balance is debited");

    // C comes back on its data dir and catches up with the topic.
    let node_c = replicas.follower(2);
    let nodes = vec![nodes[0].clone(), nodes[1].clone(), node_c.test_url.clone()];
    let total: usize = (0..BATCHES * PER_BATCH).sum();
    for node in &nodes {
        wait_for_usage(&http, node, &key, &meter, &total.to_string()).await;
        let (_, balance) = get(
            &http,
            &format!("{node}/v1/customer-credits/accounts/{account}"),
            &key,
        )
        .await;
        assert_eq!(balance["balance"], "0", "{node}: {balance}");
    }
    // Resending everything through any node adds nothing.
    let resent: Vec<Value> = (0..BATCHES * PER_BATCH)
        .step_by(25)
        .map(|i| json!({"name": "call", "external_customer_id": "three", "event_id": format!("ev{i}"), "properties": {"n": i}}))
        .collect();
    let (status, again) = post_retrying(
        &http,
        &nodes,
        2,
        "/v1/events/ingest",
        &key,
        &json!({ "events": resent }),
    )
    .await;
    assert_eq!((status, &again["accepted"]), (202, &json!(0)), "{again}");

    for node in [node_a, node_b, node_c] {
        assert!(node.terminate().success());
    }
    // Every node's live projection equals a single replay of the topic.
    let mut digests = Vec::new();
    for dir in &replicas.dirs {
        let (matched, replayed, live) = replay_with(dir.path(), &replicas.flags());
        assert!(matched, "replayed {replayed}, live {live}");
        digests.push(replayed);
    }
    assert!(
        digests.windows(2).all(|pair| pair[0] == pair[1]),
        "{digests:?}"
    );
}

/// Three nodes on one topic take 200 concurrent holds of 1 against a balance of 100
/// and their commits, each through any node: exactly 100 are held and committed,
/// and every node then shows a balance and an available balance of 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_through_three_nodes_hold_exactly_the_balance() {
    let Some((replicas, [node_a, node_b, node_c])) = Replicas::start("tally-holds") else {
        return;
    };
    let key = replicas.key.clone();
    let nodes = vec![
        node_a.test_url.clone(),
        node_b.test_url.clone(),
        node_c.test_url.clone(),
    ];
    let http = reqwest::Client::new();
    let (status, customer) = post_retrying(
        &http,
        &nodes,
        0,
        "/v1/customers",
        &key,
        &json!({"email": "holds@x.io"}),
    )
    .await;
    assert_eq!(status, 200, "{customer}");
    let (status, account) = post_retrying(
        &http,
        &nodes,
        1,
        "/v1/customer-credits/accounts",
        &key,
        &json!({"customer_id": customer["id"], "initial_balance": "100"}),
    )
    .await;
    assert_eq!(status, 200, "{account}");
    let account = account["id"].as_str().unwrap().to_string();

    let mut holds = Vec::new();
    for i in 0..200 {
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        let path = format!("/v1/customer-credits/accounts/{account}/reservations");
        holds.push(tokio::spawn(async move {
            let body = json!({"amount": "1", "idempotency_key": format!("hold-{i}")});
            post_retrying(&http, &nodes, i, &path, &key, &body).await
        }));
    }
    let mut held = Vec::new();
    for task in holds {
        let (status, answer) = task.await.unwrap();
        if status == 200 {
            held.push(answer["id"].as_str().unwrap().to_string());
        } else {
            assert_eq!(answer["error"]["code"], "insufficient_balance", "{answer}");
        }
    }
    assert_eq!(held.len(), 100, "exactly the balance is held");
    let mut commits = Vec::new();
    for (i, id) in held.into_iter().enumerate() {
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        commits.push(tokio::spawn(async move {
            let path = format!("/v1/customer-credits/reservations/{id}/commit");
            post_retrying(&http, &nodes, i + 1, &path, &key, &json!({})).await
        }));
    }
    for task in commits {
        let (status, answer) = task.await.unwrap();
        assert_eq!(
            (status, &answer["status"]),
            (200, &json!("committed")),
            "{answer}"
        );
    }
    for node in &nodes {
        let deadline = std::time::Instant::now() + Duration::from_secs(RETRY_FOR_SECONDS);
        loop {
            let (_, body) = get(
                &http,
                &format!("{node}/v1/customer-credits/accounts/{account}"),
                &key,
            )
            .await;
            if body["balance"] == "0" && body["available_balance"] == "0" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{node}: {body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for node in [node_a, node_b, node_c] {
        assert!(node.terminate().success());
    }
    let (matched, replayed, live) = replay_with(replicas.dirs[0].path(), &replicas.flags());
    assert!(matched, "replayed {replayed}, live {live}");
}

/// Corrections through three nodes on one topic: a void and an amendment of one
/// event racing through two nodes, and two amendments of another, are decided once
/// in log order (each outcome answered as it was decided); a revision through a
/// third node; every node then shows the same usage, the one the outcomes imply,
/// and a replay of the topic reproduces the projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrections_through_three_nodes_are_decided_once() {
    let Some((replicas, [node_a, node_b, node_c])) = Replicas::start("tally-fixes") else {
        return;
    };
    let key = replicas.key.clone();
    let nodes = vec![
        node_a.test_url.clone(),
        node_b.test_url.clone(),
        node_c.test_url.clone(),
    ];
    let http = reqwest::Client::new();
    let meter = |name: &str, aggregation: &str| json!({"name": name, "event_name": "e", "aggregation": aggregation, "aggregation_property": "n"});
    let (_, sum) = post_retrying(&http, &nodes, 0, "/v1/meters", &key, &meter("sum", "sum")).await;
    let (_, max) = post_retrying(&http, &nodes, 0, "/v1/meters", &key, &meter("max", "max")).await;
    let (sum, max) = (sum["id"].as_str().unwrap(), max["id"].as_str().unwrap());
    let customer = json!({"email": "k@x.io", "external_id": "k"});
    let (status, created) = post_retrying(&http, &nodes, 0, "/v1/customers", &key, &customer).await;
    assert_eq!(status, 200, "{created}");
    let events: Vec<Value> = (0..10)
        .map(|i| json!({"name": "e", "external_customer_id": "k", "event_id": format!("ev{i}"), "properties": {"n": i, "model": if i % 2 == 0 { "x" } else { "y" }}}))
        .collect();
    let (status, ingested) = post_retrying(
        &http,
        &nodes,
        0,
        "/v1/events/ingest",
        &key,
        &json!({"events": events}),
    )
    .await;
    assert_eq!(
        (status, &ingested["accepted"]),
        (202, &json!(10)),
        "{ingested}"
    );
    for node in &nodes {
        wait_for_usage(&http, node, &key, sum, "45").await;
    }

    // A void of ev9 through B races an amendment of it (n = 100) through C.
    let void = json!({"event_ids": ["ev9"], "reason": "race"});
    let amend = json!({"event": {"event_id": "ev9b", "properties": {"n": 100, "model": "y"}}, "reason": "race"});
    let ((void_status, voided), (amend_status, amended)) = tokio::join!(
        post_retrying(&http, &nodes, 1, "/v1/events/void", &key, &void),
        post_retrying(&http, &nodes, 2, "/v1/events/ev9/amend", &key, &amend),
    );
    assert_eq!(void_status, 200, "{voided}");
    if amend_status == 200 {
        // The amendment came first: the void found ev9 voided already.
        assert_eq!(voided["already_voided"], json!(["ev9"]), "{voided}");
    } else {
        assert_eq!(
            (amend_status, &amended["error"]["code"]),
            (409, &json!("event_voided")),
            "{amended}"
        );
        assert_eq!(voided["voided"], json!(["ev9"]), "{voided}");
    }
    // Two amendments of ev8 through B and C: exactly one lands.
    let to_50 = json!({"event": {"properties": {"n": 50, "model": "x"}}, "reason": "one"});
    let to_60 = json!({"event": {"properties": {"n": 60, "model": "x"}}, "reason": "two"});
    let (first, second) = tokio::join!(
        post_retrying(&http, &nodes, 1, "/v1/events/ev8/amend", &key, &to_50),
        post_retrying(&http, &nodes, 2, "/v1/events/ev8/amend", &key, &to_60),
    );
    let mut statuses = [first.0, second.0];
    statuses.sort();
    assert_eq!(statuses, [200, 409], "{} / {}", first.1, second.1);
    let landed = if first.0 == 200 { 50 } else { 60 };
    // A revision through A: only model "x" counts from now on, in all history.
    let only_x = json!({"filter": {"conjunction": "and", "clauses": [{"property": "model", "operator": "eq", "value": "x"}]}, "dry_run": false});
    let (status, revised) = post_retrying(
        &http,
        &nodes,
        0,
        &format!("/v1/meters/{sum}/revisions"),
        &key,
        &only_x,
    )
    .await;
    assert_eq!(status, 200, "{revised}");
    // x: ev0, ev2, ev4, ev6 and ev8's replacement.
    let expected_x = 12 + landed;
    let expected_max = if amend_status == 200 {
        100
    } else {
        7.max(landed)
    };
    for node in &nodes {
        wait_for_usage(&http, node, &key, sum, &expected_x.to_string()).await;
        wait_for_usage(&http, node, &key, max, &expected_max.to_string()).await;
    }
    for node in [node_a, node_b, node_c] {
        assert!(node.terminate().success());
    }
    let (matched, replayed, live) = replay_with(replicas.dirs[0].path(), &replicas.flags());
    assert!(matched, "replayed {replayed}, live {live}");
}

/// Whether the node at `base` reports owning `partition` in its cluster (`/metrics`).
async fn owns_partition(http: &reqwest::Client, base: &str, partition: u32) -> bool {
    let Ok(response) = http.get(format!("{base}/metrics")).send().await else {
        return false;
    };
    let text = response.text().await.unwrap_or_default();
    let line = format!("tally_cluster_partition_owned{{partition=\"{partition}\"}} 1");
    text.lines().any(|l| l.trim() == line)
}

/// Two nodes of one cluster (`--cluster`) split the partitions; the webhooks of a
/// store are delivered by the owner of its partition only. SIGKILL that owner: the
/// survivor takes the partition over and delivers what happens afterwards, each
/// event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_moves_webhook_delivery_off_a_killed_node() {
    use std::sync::{Arc, Mutex};
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let received: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let sink = sink.clone();
            async move {
                let id = headers
                    .get("tally-event-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                sink.lock().unwrap().push(id);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let topic = tally_log::testsuite::unique_topic("tally-cluster");
    let flags = kafka_flags(&brokers, &topic);
    let mut first_flags = flags.to_vec();
    first_flags.extend(["--cluster", "c"]);
    let mut second_flags = flags.to_vec();
    second_flags.extend(["--no-default-store", "--cluster", "c"]);
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let node_a = serve_with(dirs[0].path(), &first_flags);
    let node_b = serve_with(dirs[1].path(), &second_flags);
    let key = node_a.test_key.clone().expect("keys on first start");
    let store_id = node_a
        .stdout
        .iter()
        .find_map(|l| {
            l.split_once("\" (")?
                .1
                .split_once(')')
                .map(|(id, _)| id.to_string())
        })
        .expect("the banner names the created store");
    let partition = tally_log::partition_of(store_id.as_bytes(), 3);
    let http = reqwest::Client::new();
    let (a, b) = (node_a.test_url.clone(), node_b.test_url.clone());

    let (status, _) = post(
        &http,
        &format!("{a}/v1/webhooks"),
        &key,
        json!({"url": hook, "events": ["credits.granted"]}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let (_, customer) = post(
        &http,
        &format!("{a}/v1/customers"),
        &key,
        json!({"email": "c@x.io"}),
    )
    .await
    .unwrap();
    let (status, account) = post(
        &http,
        &format!("{a}/v1/customer-credits/accounts"),
        &key,
        json!({"customer_id": customer["id"], "initial_balance": "10"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{account}");
    let credit = |base: String, n: usize| {
        let (http, key) = (http.clone(), key.clone());
        let path = format!(
            "/v1/customer-credits/accounts/{}/credit",
            account["id"].as_str().unwrap()
        );
        async move {
            let (status, answer) = post(
                &http,
                &format!("{base}{path}"),
                &key,
                json!({"amount": "1", "idempotency_key": format!("credit-{n}")}),
            )
            .await
            .unwrap();
            assert_eq!(status, 200, "{answer}");
        }
    };
    for n in 0..4 {
        credit(a.clone(), n).await;
    }
    let distinct = |received: &Arc<Mutex<Vec<String>>>| {
        let ids = received.lock().unwrap().clone();
        ids.into_iter().collect::<std::collections::BTreeSet<_>>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while distinct(&received).len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster delivered {:?}",
            distinct(&received)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = distinct(&received);

    // Once the two nodes split the partitions between them (each owned by one, the
    // same answer twice in a row), kill the owner of the store's partition.
    let split = |owned: &[Vec<bool>]| {
        owned[0]
            .iter()
            .zip(&owned[1])
            .all(|(on_a, on_b)| on_a != on_b)
    };
    let mut previous: Option<Vec<Vec<bool>>> = None;
    let owned = loop {
        let mut owned = vec![Vec::new(), Vec::new()];
        for (i, base) in [&a, &b].into_iter().enumerate() {
            for p in 0..3 {
                owned[i].push(owns_partition(&http, base, p).await);
            }
        }
        if split(&owned) && previous.as_ref() == Some(&owned) {
            break owned;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the nodes never split the partitions: {owned:?}"
        );
        previous = Some(owned);
        tokio::time::sleep(Duration::from_millis(1_000)).await;
    };
    let (owner, survivor, survivor_url) = match owned[0][partition as usize] {
        true => (node_a, node_b, b.clone()),
        false => (node_b, node_a, a.clone()),
    };
    owner.kill();
    for n in 4..9 {
        credit(survivor_url.clone(), n).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while distinct(&received).len() < 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "after the owner died, the survivor delivered {:?}",
            distinct(&received).difference(&before).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while !owns_partition(&http, &survivor_url, partition).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the survivor never showed the partition"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = received.lock().unwrap().clone();
    for id in distinct(&received).difference(&before) {
        let times = all.iter().filter(|got| *got == id).count();
        assert_eq!(times, 1, "{id} was delivered {times} times");
    }
    assert!(survivor.terminate().success());
}

/// The sum of a node's `/metrics` samples whose line starts with `series`.
async fn metric_sum(http: &reqwest::Client, prod: &str, series: &str) -> f64 {
    let Ok(answer) = http.get(format!("{prod}/metrics")).send().await else {
        return 0.0;
    };
    let text = answer.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A node's cluster status (`/internal/v1/cluster`), if it answers one.
async fn cluster_status(http: &reqwest::Client, prod: &str, secret: &str) -> Option<Value> {
    let answer = http
        .get(format!("{prod}/internal/v1/cluster"))
        .header("x-tally-cluster-secret", secret)
        .send()
        .await
        .ok()?;
    answer.json().await.ok()
}

/// The partitions each node of a split cluster serves (`/internal/v1/cluster`).
async fn serving(http: &reqwest::Client, prod: &str, secret: &str) -> Option<Vec<u64>> {
    let status = cluster_status(http, prod, secret).await?;
    Some(
        status["serving"]
            .as_array()?
            .iter()
            .filter_map(Value::as_u64)
            .collect(),
    )
}

/// Where a node of a split cluster began skipping each partition it does not hold
/// in full (`skipped_from` of its cluster status).
async fn skipped_from(
    http: &reqwest::Client,
    prod: &str,
    secret: &str,
) -> Option<std::collections::BTreeMap<u64, f64>> {
    let status = cluster_status(http, prod, secret).await?;
    Some(
        status["skipped_from"]
            .as_object()?
            .iter()
            .filter_map(|(partition, from)| Some((partition.parse().ok()?, from.as_f64()?)))
            .collect(),
    )
}

/// Three nodes of a split cluster (`--cluster`, `--peers`): each projects in full
/// only its share of the partitions, and any node answers any request, forwarding
/// it to the node that serves the store. Six stores spread over the partitions take
/// ingest and debits through all three nodes; one node is SIGKILLed mid-load (its
/// partitions move, are restored by their new owners, and come back when it
/// restarts). Afterwards every node answers every store's exact usage total and a
/// balance of exactly 0 after exactly the balance's worth of debits, the same
/// bytes for a customer, and a full replica of the topic agrees. Checkpoints are
/// small (`--checkpoint-keys`), so the killed node has written its partitions to
/// the changelog and the survivors restore them from there, not from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_split_cluster_shares_the_projection_and_any_node_answers_exactly() {
    let Some(brokers) = tally_log::testsuite::test_brokers() else {
        return;
    };
    let topic = tally_log::testsuite::unique_topic("tally-split");
    let flags = kafka_flags(&brokers, &topic);
    let secret = "cluster-secret-".repeat(3);
    let admin = "admin-token-".repeat(4);
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (node_port(), node_port())).collect();
    let peers = ports
        .iter()
        .map(|(prod, _)| format!("http://127.0.0.1:{prod}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut node_flags = flags.to_vec();
    node_flags.extend([
        "--cluster",
        "split",
        "--peers",
        &peers,
        "--cluster-secret",
        &secret,
        "--admin-token",
        &admin,
        "--no-default-store",
        "--checkpoint-keys",
        "20",
    ]);
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let start = |i: usize| {
        serve_on(
            dirs[i].path(),
            &format!("127.0.0.1:{}", ports[i].0),
            &format!("127.0.0.1:{}", ports[i].1),
            &node_flags,
        )
    };
    let node_a = start(0);
    let node_b = start(1);
    let node_c = start(2);
    let prods: Vec<String> = ports
        .iter()
        .map(|(prod, _)| format!("http://127.0.0.1:{prod}"))
        .collect();
    let nodes: Vec<String> = ports
        .iter()
        .map(|(_, test)| format!("http://127.0.0.1:{test}"))
        .collect();
    let http = reqwest::Client::new();

    // The group splits the three partitions: every partition is served, and no
    // node serves them all.
    let mut split = false;
    for _ in 0..300 {
        let mut all = std::collections::BTreeSet::new();
        let mut largest = 0;
        for prod in &prods {
            let served = serving(&http, prod, &secret).await.unwrap_or_default();
            largest = largest.max(served.len());
            all.extend(served);
        }
        if all.len() == 3 && largest < 3 {
            split = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(split, "the cluster never split its partitions");
    // The status is the cluster's: without the secret it is refused.
    let refused = http
        .get(format!("{}/internal/v1/cluster", prods[0]))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);

    // At least this many stores, and more until every partition holds one: a
    // partition without a store is never written, and the node that serves it would
    // have nothing to hand over when it dies.
    const STORES: usize = 6;
    const PARTITIONS: u32 = 3;
    const BATCHES: usize = 6;
    const PER_BATCH: usize = 20;
    const BALANCE: usize = 30;
    const DEBITS: usize = 50;
    struct Store {
        key: String,
        meter: String,
        account: String,
        customer: String,
    }
    let mut stores = Vec::new();
    let mut partitions_with_a_store = std::collections::BTreeSet::new();
    for s in 0.. {
        if s >= STORES && partitions_with_a_store.len() == PARTITIONS as usize {
            break;
        }
        assert!(s < 10 * STORES, "stores never covered every partition");
        let created: Value = http
            .post(format!("{}/admin/v1/stores", prods[s % 3]))
            .bearer_auth(&admin)
            .json(&json!({"name": format!("store {s}")}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let key = created["api_keys"]["test"]
            .as_str()
            .unwrap_or_else(|| panic!("{created}"))
            .to_string();
        let store_id = created["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{created}"));
        partitions_with_a_store.insert(tally_log::partition_of(store_id.as_bytes(), PARTITIONS));
        let (status, customer) = post_retrying(
            &http,
            &nodes,
            s,
            "/v1/customers",
            &key,
            &json!({"email": "split@x.io", "external_id": "c"}),
        )
        .await;
        assert_eq!(status, 200, "{customer}");
        let (status, meter) = post_retrying(&http, &nodes, s + 1, "/v1/meters", &key, &json!({"name": "tokens", "event_name": "call", "aggregation": "sum", "aggregation_property": "n"})).await;
        assert_eq!(status, 200, "{meter}");
        let (status, account) = post_retrying(
            &http,
            &nodes,
            s + 2,
            "/v1/customer-credits/accounts",
            &key,
            &json!({"customer_id": customer["id"], "initial_balance": BALANCE.to_string()}),
        )
        .await;
        assert_eq!(status, 200, "{account}");
        stores.push(Store {
            key,
            meter: meter["id"].as_str().unwrap().to_string(),
            account: account["id"].as_str().unwrap().to_string(),
            customer: customer["id"].as_str().unwrap().to_string(),
        });
    }

    // Node C has written its partitions to the changelog before it dies.
    let written_by_c = |partition: u64| {
        let series = format!(
            "tally_changelog_writes_total{{outcome=\"written\",partition=\"{partition}\"}}"
        );
        let http = http.clone();
        let prod = prods[2].clone();
        async move { metric_sum(&http, &prod, &series).await }
    };
    let written_by_c_in_all = || async {
        let mut sum = 0.0;
        for partition in 0..u64::from(PARTITIONS) {
            sum += written_by_c(partition).await;
        }
        sum
    };
    let mut written = 0.0;
    for _ in 0..300 {
        written = written_by_c_in_all().await;
        if written > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(written > 0.0, "node C never wrote the changelog");

    let mut ingest = Vec::new();
    let mut debits = Vec::new();
    for (s, store) in stores.iter().enumerate() {
        for batch in 0..BATCHES {
            let (http, nodes, key) = (http.clone(), nodes.clone(), store.key.clone());
            let events: Vec<Value> = (batch * PER_BATCH..(batch + 1) * PER_BATCH)
                .map(|i| json!({"name": "call", "external_customer_id": "c", "event_id": format!("ev{i}"), "properties": {"n": i}}))
                .collect();
            ingest.push(tokio::spawn(async move {
                post_retrying(
                    &http,
                    &nodes,
                    s + batch,
                    "/v1/events/ingest",
                    &key,
                    &json!({ "events": events }),
                )
                .await
            }));
        }
        for debit in 0..DEBITS {
            let (http, nodes, key) = (http.clone(), nodes.clone(), store.key.clone());
            let path = format!("/v1/customer-credits/accounts/{}/debit", store.account);
            debits.push((
                s,
                tokio::spawn(async move {
                    let body = json!({"amount": "1", "idempotency_key": format!("debit-{debit}")});
                    post_retrying(&http, &nodes, s + debit, &path, &key, &body).await
                }),
            ));
        }
    }
    // Mid-load: node C dies; its partitions move to the others after the group's
    // session timeout, and they restore them from the changelog, then the log.
    // It dies once it serves partitions and has written each of them to the
    // changelog twice while serving it: a partition's first write after a node
    // gains it may be its reset at the very position the previous owner stopped
    // at (a survivor would then rightly restore it from the log alone), the next
    // one holds records applied since, so it is ahead of any survivor's mark.
    // A node writes its changelog only as it applies, and the load may be over
    // before C's share settles (a rebalance under load): a trickle of events no
    // meter counts keeps every store's partition applying until C dies.
    let trickling = Arc::new(AtomicBool::new(true));
    let trickle = {
        let (http, nodes, trickling) = (http.clone(), nodes.clone(), trickling.clone());
        let keys: Vec<String> = stores.iter().map(|store| store.key.clone()).collect();
        tokio::spawn(async move {
            let mut round = 0;
            while trickling.load(Ordering::Relaxed) {
                for (s, key) in keys.iter().enumerate() {
                    let events = json!({"events": [{"name": "noise", "external_customer_id": "c", "event_id": format!("noise-{round}"), "properties": {}}]});
                    let (status, answer) =
                        post_retrying(&http, &nodes, s + round, "/v1/events/ingest", key, &events)
                            .await;
                    assert_eq!(status, 202, "{answer}");
                }
                round += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let mut covered = false;
    let mut last = String::new();
    for _ in 0..100 {
        let owned = serving(&http, &prods[2], &secret).await.unwrap_or_default();
        let mut before = Vec::new();
        for partition in &owned {
            before.push(written_by_c(*partition).await);
        }
        let mut after = Vec::new();
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            after.clear();
            for partition in &owned {
                after.push(written_by_c(*partition).await);
            }
            if before.iter().zip(&after).all(|(b, a)| a - b >= 2.0) {
                break;
            }
        }
        let still = serving(&http, &prods[2], &secret).await.unwrap_or_default();
        // A survivor that still projects one of C's partitions (a rebalance keeps
        // what a node projects until the group decides, and tansu's group may leave
        // one undecided for a while) holds it already and rightly restores nothing.
        let mut shared = Vec::new();
        // A survivor restores from the changelog only a checkpoint past where it
        // began skipping the partition (before that it holds the records itself):
        // C's last checkpoint of each partition must be past every survivor's skip
        // mark, and every survivor must have one (C's checkpoints can trail the
        // records it applied, and a survivor may have projected a partition for a
        // while after C gained it).
        let mut behind = Vec::new();
        for prod in &prods[..2] {
            let theirs = serving(&http, prod, &secret).await.unwrap_or_default();
            shared.extend(owned.iter().filter(|p| theirs.contains(p)).copied());
            let marks = skipped_from(&http, prod, &secret).await.unwrap_or_default();
            for partition in &owned {
                let series = format!("tally_changelog_position{{partition=\"{partition}\"}}");
                let position = metric_sum(&http, &prods[2], &series).await;
                match marks.get(partition) {
                    Some(mark) if position > *mark => {}
                    mark => behind.push((*partition, position, mark.copied())),
                }
            }
        }
        if !owned.is_empty()
            && owned == still
            && shared.is_empty()
            && behind.is_empty()
            && before.iter().zip(&after).all(|(b, a)| a - b >= 2.0)
        {
            eprintln!(
                "node C dies serving {owned:?}, its changelog writes {before:?} then {after:?}"
            );
            covered = true;
            break;
        }
        last = format!(
            "served {owned:?} then {still:?}, writes {before:?} then {after:?}, also served by a survivor: {shared:?}, changelog not past a survivor's skip mark (partition, position, mark): {behind:?}"
        );
    }
    assert!(
        covered,
        "node C never wrote the partitions it alone serves ({last})"
    );
    node_c.kill();
    trickling.store(false, Ordering::Relaxed);
    trickle.await.unwrap();

    for task in ingest {
        let (status, answer) = task.await.unwrap();
        assert_eq!(status, 202, "{answer}");
    }
    let mut debited = vec![0; stores.len()];
    for (s, task) in debits {
        let (status, answer) = task.await.unwrap();
        if status == 200 {
            debited[s] += 1;
        } else {
            assert_eq!(answer["error"]["code"], "insufficient_balance", "{answer}");
        }
    }
    assert_eq!(
        debited,
        vec![BALANCE; stores.len()],
        "exactly the balance is debited"
    );
    // The survivors take C's partitions over once the group notices it is gone
    // (its session timeout). The load may be answered before then, and a C that
    // came back sooner would rejoin and get its partitions back with nothing
    // restored: wait for the move this test claims.
    let mut taken_over = false;
    let mut last = String::new();
    for _ in 0..600 {
        let mut all = std::collections::BTreeSet::new();
        for prod in &prods[..2] {
            all.extend(serving(&http, prod, &secret).await.unwrap_or_default());
        }
        if all.len() == PARTITIONS as usize {
            taken_over = true;
            break;
        }
        last = format!("{all:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        taken_over,
        "the survivors never served all partitions (last: {last})"
    );

    // C comes back on its data dir and its ports.
    let node_c = start(2);
    let total: usize = (0..BATCHES * PER_BATCH).sum();
    for store in &stores {
        let mut customer_bodies = Vec::new();
        for node in &nodes {
            wait_for_usage(&http, node, &store.key, &store.meter, &total.to_string()).await;
            let (_, balance) = get(
                &http,
                &format!("{node}/v1/customer-credits/accounts/{}", store.account),
                &store.key,
            )
            .await;
            assert_eq!(balance["balance"], "0", "{node}: {balance}");
            let body = http
                .get(format!("{node}/v1/customers/{}", store.customer))
                .header("x-api-key", &store.key)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            customer_bodies.push(body);
        }
        assert!(
            customer_bodies.windows(2).all(|pair| pair[0] == pair[1]),
            "{customer_bodies:?}"
        );
        // An error answered by another node keeps its one request id: the header
        // and the body name the same one.
        for node in &nodes {
            let answer = http
                .get(format!("{node}/v1/customers/cus_missing"))
                .header("x-api-key", &store.key)
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status(), 404);
            let header = answer.headers()["x-request-id"]
                .to_str()
                .unwrap()
                .to_string();
            let body: Value = answer.json().await.unwrap();
            assert_eq!(
                body["error"]["request_id"],
                header.as_str(),
                "{node}: {body}"
            );
        }
    }
    // Requests went through nodes that do not serve their store: forwarded.
    let mut forwarded = 0.0;
    for prod in &prods {
        forwarded += metric_sum(
            &http,
            prod,
            "tally_cluster_forwarded_requests_total{outcome=\"answered\"}",
        )
        .await;
    }
    assert!(forwarded > 0.0, "no request was forwarded");
    // The survivors restored C's partitions from the changelog.
    let mut restored = 0.0;
    for prod in &prods[..2] {
        restored += metric_sum(
            &http,
            prod,
            "tally_partitions_restored_from_changelog_total",
        )
        .await;
    }
    assert!(
        restored > 0.0,
        "no partition was restored from the changelog"
    );
    // C, restarted, has read little of the log when it gains a partition it had
    // skipped, while the changelog's snapshot of it is far ahead: C reads the log
    // up to the snapshot, then restores from it, instead of from its skip mark.
    let lines = node_c.stderr.lock().unwrap().clone();
    let restores = lines
        .iter()
        .filter(|line| line.contains("restoring a partition this node now owns"))
        .count();
    let from_changelog = lines
        .iter()
        .filter(|line| line.contains("restored a partition from the changelog"))
        .count();
    eprintln!(
        "restarted node C restored {restores} partitions, {from_changelog} from the changelog"
    );
    assert!(
        restores == 0 || from_changelog > 0,
        "restarted node C restored {restores} partitions, none from the changelog"
    );
    for node in [node_a, node_b, node_c] {
        assert!(node.terminate().success());
    }

    // A full replica of the topic (a node outside the cluster) agrees.
    let replica_dir = tempfile::tempdir().unwrap();
    let mut replica_flags = flags.to_vec();
    replica_flags.push("--no-default-store");
    let replica = serve_with(replica_dir.path(), &replica_flags);
    for store in &stores {
        wait_for_usage(
            &http,
            &replica.test_url,
            &store.key,
            &store.meter,
            &total.to_string(),
        )
        .await;
        let (_, balance) = get(
            &http,
            &format!(
                "{}/v1/customer-credits/accounts/{}",
                replica.test_url, store.account
            ),
            &store.key,
        )
        .await;
        assert_eq!(balance["balance"], "0", "{balance}");
    }
    assert!(replica.terminate().success());
    // And that replica is the topic's single replay, byte for byte.
    let (matched, replayed, live) = replay_with(replica_dir.path(), &flags);
    assert!(matched, "replayed {replayed}, live {live}");
}
