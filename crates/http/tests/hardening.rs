//! Hardening over real sockets: no input stops the service, a write is never applied
//! twice while the projector stalls, writes wait for readiness.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::failing_log::*;
use common::*;
use serde_json::{json, Value};
use tally_projection::{Change, CheckpointStore, ProjectionStore, StoreError, Visit};

async fn customer(api: &Api) -> String {
    let answer = api.post("/v1/customers", json!({"email": "c@x.io"})).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

async fn account(api: &Api, customer: &str, name: &str, initial: &str) -> Answer {
    api.post(
        "/v1/customer-credits/accounts",
        json!({"customer_id": customer, "name": name, "initial_balance": initial}),
    )
    .await
}

async fn move_credits(api: &Api, kind: &str, account: &str, amount: &str, key: &str) -> Answer {
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/{kind}"),
        json!({"amount": amount, "idempotency_key": key}),
    )
    .await
}

/// The largest Decimal, the reproduction of the one-request outage, is refused at the
/// edge; amounts up to the limit are taken; the store's issuance total stops at its
/// limit with a 409 decided in apply; other stores keep working, before and after a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_amounts_never_stop_the_service() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let a = Api::new(&server.test_url, &create_store(&server, "a").await.test);
    let b = Api::new(&server.test_url, &create_store(&server, "b").await.test);
    let customer_a = customer(&a).await;
    for (amount, param) in [
        ("79228162514264337593543950335", "initial_balance"),
        ("1000000000000001", "initial_balance"),
        ("1000000000000000.000000000000000001", "initial_balance"),
    ] {
        let refused = account(&a, &customer_a, "x", amount).await;
        let error = assert_error(&refused, 400, "invalid_request_error");
        assert_eq!(error["param"], param, "{amount}");
    }
    // 1000 grants of the largest amount bring the issuance account to -1e18.
    let big = account(&a, &customer_a, "big", "1000000000000000").await;
    assert_eq!(big.status, 200, "{}", big.body);
    let big_id = big.body["id"].as_str().unwrap().to_string();
    // Fill the balance in accounts of at most 1e18 each: one account takes 999 more.
    for i in 0..999 {
        let answer =
            move_credits(&a, "credit", &big_id, "1000000000000000", &format!("k{i}")).await;
        assert_eq!(answer.status, 200, "credit {i}: {}", answer.body);
    }
    let full = a
        .get(&format!("/v1/customer-credits/accounts/{big_id}"))
        .await;
    assert_eq!(full.body["balance"], "1000000000000000000");
    // One more credit would take both the account and system:issuance past 1e18.
    let refused = move_credits(&a, "credit", &big_id, "1", "one-more").await;
    let error = assert_error(&refused, 409, "invalid_request_error");
    assert_eq!(error["code"], "amount_out_of_range");
    // A second account of the same store: the store's issuance total is at its limit.
    let second = account(&a, &customer_a, "second", "1").await;
    let error = assert_error(&second, 409, "invalid_request_error");
    assert_eq!(error["code"], "amount_out_of_range");
    // Nothing of the refused seed exists: the account was not created either.
    let listed = a
        .get(&format!(
            "/v1/customer-credits/accounts?customer_id={customer_a}"
        ))
        .await;
    assert_eq!(
        listed.body["data"].as_array().unwrap().len(),
        1,
        "{}",
        listed.body
    );
    // A debit brings the store back under the limit (consumption is its own account).
    let debit = move_credits(&a, "debit", &big_id, "5", "d1").await;
    assert_eq!(debit.status, 200, "{}", debit.body);
    // The other store is untouched and fast.
    let customer_b = customer(&b).await;
    let started = std::time::Instant::now();
    let fine = account(&b, &customer_b, "main", "10").await;
    assert_eq!(fine.status, 200, "{}", fine.body);
    assert!(started.elapsed() < Duration::from_secs(5));
    let ready = reqwest::get(format!("{}/readyz", server.test_url))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);

    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let b = Api::new(&server.test_url, &b.key);
    let ready = reqwest::get(format!("{}/readyz", server.test_url))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let after = account(&b, &customer_b, "after-restart", "1").await;
    assert_eq!(after.status, 200, "{}", after.body);
    let a = Api::new(&server.test_url, &a.key);
    let balance = a
        .get(&format!("/v1/customer-credits/accounts/{big_id}"))
        .await;
    assert_eq!(balance.body["balance"], "999999999999999995");
    server.stop().await;
}

/// A projection store whose `apply` blocks while `stalled` is set (the projector
/// stalls with records durable in the log, as under a slow disk or a huge backfill)
/// and fails while `failing` is set (a full or broken disk).
#[derive(Debug)]
struct FaultyStore {
    inner: Arc<dyn ProjectionStore>,
    stalled: Arc<AtomicBool>,
    failing: Arc<AtomicBool>,
}

impl ProjectionStore for FaultyStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn unwritten(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.inner.unwritten(key)
    }
    fn retired_layers(&self) -> Option<u64> {
        self.inner.retired_layers()
    }
    fn scan(
        &self,
        start: std::ops::Bound<&[u8]>,
        end: std::ops::Bound<&[u8]>,
        reverse: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
    ) -> Result<(), StoreError> {
        self.inner.scan(start, end, reverse, visit)
    }
    fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
        while self.stalled.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Backend("injected write failure".into()));
        }
        self.inner.apply(changes, positions)
    }
    fn position(&self, partition: u32) -> Result<u64, StoreError> {
        self.inner.position(partition)
    }
    fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }
    fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.aux_get(key)
    }
    fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        self.inner.aux_put(key, value)
    }
    fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
        self.inner.aux_scan(visit)
    }
}

/// A server over a `FaultyStore` that never fails, and the flag that stalls it.
async fn stallable_server(dir: &std::path::Path) -> (Server, Arc<AtomicBool>) {
    stallable_server_with(dir, default_config()).await
}

async fn stallable_server_with(
    dir: &std::path::Path,
    config: tally_http::HttpConfig,
) -> (Server, Arc<AtomicBool>) {
    let stalled = Arc::new(AtomicBool::new(false));
    let flag = stalled.clone();
    let server = Server::start_with_store(
        dir,
        config,
        Arc::new(tally_domain::clock::ManualClock::new(wall_clock_ms())),
        move |sled| {
            Arc::new(FaultyStore {
                inner: Arc::new(CheckpointStore::new(sled)),
                stalled: flag,
                failing: Arc::default(),
            })
        },
    )
    .await;
    (server, stalled)
}

/// While the projector stalls, a debit answers `outcome_pending`; its retries and a
/// concurrent debit are durable too, yet once the projector resumes exactly one
/// debit is applied, the retry gets that transaction, the other debit is refused in
/// apply, and writes are refused while the lag is over its bound. An
/// `idempotency-key` create is answered with its one outcome, never twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_projector_never_double_applies() {
    // Three writes wait out the 400 ms apply wait before the keyed create; the bound leaves
    // a slow machine room so that the create is appended, not gated.
    const LAG_BOUND: Duration = Duration::from_millis(4_000);
    let (_guard, dir) = temp_dir();
    let (server, stalled) = stallable_server(&dir).await;
    server
        .engine
        .tune_waits(Duration::from_millis(400), LAG_BOUND);
    let api = Api::new(&server.test_url, &create_store(&server, "s").await.test);
    let customer_id = customer(&api).await;
    let created = account(&api, &customer_id, "main", "100").await;
    let account_id = created.body["id"].as_str().unwrap().to_string();

    stalled.store(true, Ordering::SeqCst);
    let first = move_credits(&api, "debit", &account_id, "100", "k1").await;
    let error = assert_error(&first, 503, "api_error");
    assert_eq!(error["code"], "outcome_pending");
    // The retry (same key) and another debit are decided on the stale balance and
    // appended; apply will sort them out in log order.
    let retry = move_credits(&api, "debit", &account_id, "100", "k1").await;
    assert_eq!(retry.status, 503, "{}", retry.body);
    let other = move_credits(&api, "debit", &account_id, "50", "k2").await;
    assert_eq!(other.status, 503, "{}", other.body);
    // A create with an idempotency-key: the client stops waiting, the write goes on.
    let pending_create = api
        .post_idempotent("/v1/customers", "create-1", json!({"email": "p@x.io"}))
        .await;
    let error = assert_error(&pending_create, 503, "api_error");
    assert_eq!(
        error["code"], "outcome_pending",
        "appended, then the client stopped waiting"
    );
    // Past the lag bound nothing more is appended.
    tokio::time::sleep(LAG_BOUND + Duration::from_millis(100)).await;
    let gated = api
        .post("/v1/customers", json!({"email": "late@x.io"}))
        .await;
    let error = assert_error(&gated, 503, "api_error");
    assert_eq!(error["code"], "projection_lagging");
    let ready = reqwest::get(format!("{}/readyz", server.test_url))
        .await
        .unwrap();
    assert_eq!(
        ready.status(),
        200,
        "reads and readiness stay up while writes wait"
    );

    stalled.store(false, Ordering::SeqCst);
    server.engine.wait_caught_up().await.unwrap();
    let again = move_credits(&api, "debit", &account_id, "100", "k1").await;
    assert_eq!(again.status, 200, "{}", again.body);
    let refused = move_credits(&api, "debit", &account_id, "50", "k2").await;
    let error = assert_error(&refused, 409, "invalid_request_error");
    assert_eq!(error["code"], "insufficient_balance");
    let balance = api
        .get(&format!("/v1/customer-credits/accounts/{account_id}"))
        .await;
    assert_eq!(balance.body["balance"], "0");
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account_id}/entries?limit=100"
        ))
        .await;
    let debits: Vec<&Value> = entries.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["amount"].as_str().is_some_and(|a| a.starts_with('-')))
        .collect();
    assert_eq!(debits.len(), 1, "{}", entries.body);
    assert_eq!(debits[0]["transaction_id"], again.body["id"]);

    // The keyed create finished in the background; its retry replays it.
    let replayed = api
        .post_idempotent("/v1/customers", "create-1", json!({"email": "p@x.io"}))
        .await;
    assert_eq!(replayed.status, 200, "{}", replayed.body);
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    let listed = api.get("/v1/customers?limit=100").await;
    let emails: Vec<&str> = listed.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["email"].as_str().unwrap())
        .collect();
    assert_eq!(emails.iter().filter(|e| **e == "p@x.io").count(), 1);
    assert!(!emails.contains(&"late@x.io"), "a gated write was appended");
    server.stop().await;
}

/// A backfill over more events than one step folds runs in bounded steps off the
/// apply path, counts every skipped event once, and a repeat counts nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_runs_in_bounded_steps_and_counts_once() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &create_store(&server, "s").await.test);
    let customer_id = customer(&api).await;
    let meter = api
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "call", "aggregation": "count"}),
        )
        .await;
    assert_eq!(meter.status, 200, "{}", meter.body);
    let meter_id = meter.body["id"].as_str().unwrap().to_string();
    let now = tally_domain::clock::Clock::now_ms(server.clock.as_ref());
    let old = tally_domain::time::format_iso8601_ms(now - 3_600_000);
    let total = tally_engine::meters::BACKFILL_CHUNK_EVENTS * 2 + 300;
    for batch in 0..total.div_ceil(99) {
        let events: Vec<Value> = (0..99)
            .map(|i| batch * 99 + i)
            .filter(|n| *n < total)
            .map(|n| json!({"name": "call", "customer_id": customer_id, "event_id": format!("e{n}"), "timestamp": old}))
            .chain(std::iter::once(json!({"name": "other", "customer_id": customer_id, "timestamp": old})))
            .collect();
        let answer = api
            .post("/v1/events/ingest", json!({ "events": events }))
            .await;
        assert_eq!(answer.status, 202, "{}", answer.body);
    }
    server.engine.wait_caught_up().await.unwrap();
    let usage = |api: Api, meter_id: String| async move {
        api.get(&format!(
            "/v1/meters/{meter_id}/usage?start={}",
            tally_domain::time::format_iso8601_ms(now - 7_200_000)
        ))
        .await
        .body["value"]
            .clone()
    };
    assert_eq!(
        usage(api.clone(), meter_id.clone()).await,
        "0",
        "older events are not counted before a backfill"
    );
    let start = tally_domain::time::format_iso8601_ms(now - 7_200_000);
    for _ in 0..2 {
        let answer = api
            .post(
                &format!("/v1/meters/{meter_id}/backfill"),
                json!({ "start": start }),
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(
            usage(api.clone(), meter_id.clone()).await,
            total.to_string()
        );
    }
    server.stop().await;
}

/// Checkpoints fail (sled under the write-back layer refuses writes): the projector
/// stops, writes answer 503 and `/readyz` says so, and after a restart on a healthy
/// disk every acknowledged debit is there exactly once (a retry with its key returns
/// the same transaction) and nothing else was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_checkpoint_stops_writes_and_loses_nothing_acknowledged() {
    let (_guard, dir) = temp_dir();
    let failing = Arc::new(AtomicBool::new(false));
    let flag = failing.clone();
    let server = Server::start_with_store(
        &dir,
        default_config(),
        Arc::new(tally_domain::clock::ManualClock::new(wall_clock_ms())),
        move |sled| {
            let faulty = FaultyStore {
                inner: sled,
                stalled: Arc::default(),
                failing: flag,
            };
            Arc::new(CheckpointStore::with_limits(
                faulty,
                usize::MAX,
                Duration::from_millis(100),
            ))
        },
    )
    .await;
    server
        .engine
        .tune_waits(Duration::from_millis(400), Duration::from_millis(1_500));
    let keys = create_store(&server, "s").await;
    let api = Api::new(&server.test_url, &keys.test);
    let customer_id = customer(&api).await;
    let created = account(&api, &customer_id, "main", "1000").await;
    let account_id = created.body["id"].as_str().unwrap().to_string();
    let mut acknowledged = Vec::new();
    for i in 0..3 {
        let answer = move_credits(&api, "debit", &account_id, "1", &format!("ok{i}")).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        acknowledged.push((format!("ok{i}"), answer.body["id"].clone()));
    }

    failing.store(true, Ordering::SeqCst);
    let mut refused = None;
    for i in 0..50 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let key = format!("f{i}");
        let answer = move_credits(&api, "debit", &account_id, "1", &key).await;
        if answer.status == 200 {
            acknowledged.push((key, answer.body["id"].clone()));
            continue;
        }
        assert_eq!(answer.status, 503, "{}", answer.body);
        refused = Some(answer.body["error"]["code"].clone());
        if refused == Some(json!("projector_failed")) {
            break;
        }
    }
    assert_eq!(
        refused,
        Some(json!("projector_failed")),
        "a failed checkpoint stops writes"
    );
    let ready = reqwest::get(format!("{}/readyz", server.test_url))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    server.stop_after_fault().await;

    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    for (key, id) in &acknowledged {
        let again = move_credits(&api, "debit", &account_id, "1", key).await;
        assert_eq!(again.status, 200, "{}", again.body);
        assert_eq!(&again.body["id"], id, "acknowledged debit {key} kept");
    }
    // Debits whose answer was a 503 may have been durable in the log (their outcome
    // was unknown to the client); nothing beyond the attempted ones was applied.
    let balance: rust_decimal::Decimal = api
        .get(&format!("/v1/customer-credits/accounts/{account_id}"))
        .await
        .body["balance"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let applied = 1000 - balance.to_string().parse::<i64>().unwrap();
    assert!(
        applied >= acknowledged.len() as i64 && applied <= acknowledged.len() as i64 + 2,
        "{applied} debits applied, {} acknowledged",
        acknowledged.len()
    );
    server.stop().await;
}

/// Appends fail: ingest, debits and creates answer 503 (`log_unavailable`, or
/// `outcome_unknown` when the log cannot say whether it wrote) and leave nothing
/// behind; once the log recovers, writes go on, and after a restart exactly
/// the acknowledged writes are there (usage counts only the accepted events).
/// A keyed request whose response cannot be recorded at first (the log refuses
/// appends for a while) records it once the log is back: the retry replays it,
/// instead of finding the key taken without an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_refused_by_the_log_is_recorded_when_it_is_back() {
    let (_guard, dir) = temp_dir();
    let (server, failing) = start_with_failing_log(&dir).await;
    // A retry that found no response would answer 409 after this wait.
    server
        .engine
        .tune_waits(Duration::from_millis(3_000), Duration::from_millis(10_000));
    let api = Api::new(&server.test_url, &create_store(&server, "s").await.test);
    failing.store(RESPONSES_NOT_WRITTEN, Ordering::SeqCst);
    let healer = failing.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        healer.store(HEALTHY, Ordering::SeqCst);
    });
    let first = api
        .post_idempotent("/v1/customers", "k", json!({"email": "k@x.io"}))
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let retry = api
        .post_idempotent("/v1/customers", "k", json!({"email": "k@x.io"}))
        .await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_appends_answer_503_and_lose_nothing_acknowledged() {
    let (_guard, dir) = temp_dir();
    let (server, failing) = start_with_failing_log(&dir).await;
    let keys = create_store(&server, "s").await;
    let api = Api::new(&server.test_url, &keys.test);
    let customer_id = customer(&api).await;
    let created = account(&api, &customer_id, "main", "100").await;
    let account_id = created.body["id"].as_str().unwrap().to_string();
    let meter = api
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "call", "aggregation": "count"}),
        )
        .await;
    assert_eq!(meter.status, 200, "{}", meter.body);
    let meter_id = meter.body["id"].as_str().unwrap().to_string();
    let ingest = |id: &str| json!({"events": [{"event_id": id, "name": "call", "customer_id": customer_id}]});

    let mut acknowledged_debits = Vec::new();
    let mut accepted_events = 0;
    for round in 0..6 {
        let fault = match round {
            1 | 5 => NOT_WRITTEN,
            3 => UNKNOWN,
            _ => HEALTHY,
        };
        let fail = fault != HEALTHY;
        failing.store(fault, Ordering::SeqCst);
        let debit = move_credits(&api, "debit", &account_id, "1", &format!("d{round}")).await;
        let sent = api
            .post("/v1/events/ingest", ingest(&format!("e{round}")))
            .await;
        let create = api.post("/v1/customers", json!({"email": "x@x.io"})).await;
        if fail {
            for answer in [&debit, &sent, &create] {
                let error = assert_error(answer, 503, "api_error");
                let code = if fault == UNKNOWN {
                    "outcome_unknown"
                } else {
                    "log_unavailable"
                };
                assert_eq!(error["code"], code, "{}", answer.body);
            }
        } else {
            assert_eq!(debit.status, 200, "{}", debit.body);
            assert!(sent.status == 202 || sent.status == 200, "{}", sent.body);
            assert_eq!(create.status, 200, "{}", create.body);
            acknowledged_debits.push(debit.body["id"].clone());
            accepted_events += 1;
        }
    }
    server.stop().await;

    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    let balance = api
        .get(&format!("/v1/customer-credits/accounts/{account_id}"))
        .await
        .body["balance"]
        .clone();
    assert_eq!(
        balance,
        json!((100 - acknowledged_debits.len()).to_string()),
        "exactly the acknowledged debits"
    );
    let customers = api.get("/v1/customers?limit=100").await;
    assert_eq!(
        customers.body["data"].as_array().unwrap().len(),
        1 + accepted_events,
        "exactly the acknowledged creates"
    );
    server.engine.wait_caught_up().await.unwrap();
    let usage = api
        .get(&format!(
            "/v1/meters/{meter_id}/usage?customer_id={customer_id}"
        ))
        .await;
    assert_eq!(
        usage.body["value"],
        json!(accepted_events.to_string()),
        "exactly the accepted events: {}",
        usage.body
    );
    server.stop().await;
}

/// An ingest request dropped while its append hangs (its client went away, a timeout
/// fired) leaves no event id reserved: the same events sent again are accepted, not
/// reported as duplicates of events that were never written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_ingest_leaves_no_id_reserved() {
    let (_guard, dir) = temp_dir();
    let (server, failing) = start_with_failing_log(&dir).await;
    let keys = create_store(&server, "s").await;
    let api = Api::new(&server.test_url, &keys.test);
    let customer_id = customer(&api).await;
    let scope = server
        .engine
        .directory()
        .caches()
        .api_keys
        .iter()
        .map(|entry| entry.value().clone())
        .find(|scope| scope.mode == tally_domain::Mode::Test)
        .unwrap();
    let raw = |id: &str| {
        Ok(tally_domain::usage::RawUsageEvent {
            name: Some("call".into()),
            customer_id: Some(customer_id.clone()),
            external_customer_id: None,
            event_id: Some(id.into()),
            timestamp: None,
            properties: Vec::new(),
        })
    };
    failing.store(STALLED, Ordering::SeqCst);
    let raws = vec![raw("gone-1"), raw("gone-2")];
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        server.engine.gateway().ingest_events(&scope, raws),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the append hangs, so the request is dropped"
    );
    failing.store(HEALTHY, Ordering::SeqCst);
    let sent = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"event_id": "gone-1", "name": "call", "customer_id": customer_id},
                {"event_id": "gone-2", "name": "call", "customer_id": customer_id},
            ]}),
        )
        .await;
    assert_eq!(sent.status, 202, "{}", sent.body);
    assert_eq!(sent.body["accepted"], 2, "{}", sent.body);
    assert_eq!(sent.body["duplicates"], 0, "{}", sent.body);
    server.stop().await;
}

/// An event whose batch was acknowledged but not yet applied (the projector stalls
/// between the two) is found by its id and can be voided: a look-up that finds
/// nothing waits for the node to apply what the log held, and answers then
/// (docs/api.md: ingest answers once the batch is durable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_event_is_found_and_voided_before_it_is_applied() {
    let (_guard, dir) = temp_dir();
    let (server, stalled) = stallable_server(&dir).await;
    let api = Api::new(&server.test_url, &create_store(&server, "s").await.test);
    let customer_id = customer(&api).await;

    stalled.store(true, Ordering::SeqCst);
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"event_id": "late-1", "name": "call", "customer_id": customer_id}]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    let resume = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        stalled.store(false, Ordering::SeqCst);
    };
    let (found, voided, ()) = tokio::join!(
        api.get("/v1/events/late-1"),
        api.post(
            "/v1/events/void",
            json!({"event_ids": ["late-1"], "reason": "sent by mistake"}),
        ),
        resume
    );
    assert_eq!(found.status, 200, "{}", found.body);
    assert_eq!(found.body["event_id"], "late-1");
    assert_eq!(voided.status, 200, "{}", voided.body);
    assert_eq!(voided.body["voided"], json!(["late-1"]));
    let unknown = api.get("/v1/events/never-sent").await;
    assert_error(&unknown, 404, "invalid_request_error");
    server.stop().await;
}

/// A connection that sends nothing, or stops in the middle of its headers, is
/// closed after `HEADER_READ_TIMEOUT_MS`, so silent clients cannot keep the
/// listener's connection slots (`MAX_CONNECTIONS`) from everyone else; a client
/// that speaks is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let address = server.test_url.trim_start_matches("http://").to_string();
    let mut silent = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut halting = tokio::net::TcpStream::connect(&address).await.unwrap();
    halting.write_all(b"GET /healthz HT").await.unwrap();
    let healthy = reqwest::get(format!("{}/healthz", server.test_url))
        .await
        .unwrap();
    assert_eq!(healthy.status(), 200);
    let deadline = Duration::from_millis(tally_http::HEADER_READ_TIMEOUT_MS + 5_000);
    for (what, stream) in [("silent", &mut silent), ("halting", &mut halting)] {
        let mut byte = [0u8; 64];
        let read = tokio::time::timeout(deadline, stream.read(&mut byte))
            .await
            .unwrap_or_else(|_| panic!("the {what} connection is still open"));
        // Closed: an end of stream, a reset, or at most an error answer first.
        if let Ok(n) = read {
            if n > 0 {
                let text = String::from_utf8_lossy(&byte[..n]).to_string();
                assert!(!text.contains(" 200 "), "{what}: {text}");
            }
        }
    }
    server.stop().await;
}

/// A request that outlives its deadline is stopped with 503 `request_timeout` and
/// the error body every error has (request id, trace id, `retry-after`); the write
/// it made is kept, and its idempotency-key answers the outcome once applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_answers_503_with_the_error_body() {
    let (_guard, dir) = temp_dir();
    let config = tally_http::HttpConfig {
        request_timeout_ms: 300,
        ..default_config()
    };
    let (server, stalled) = stallable_server_with(&dir, config).await;
    let api = Api::new(&server.test_url, &create_store(&server, "s").await.test);
    stalled.store(true, Ordering::SeqCst);
    let late = api
        .post_idempotent("/v1/customers", "late-1", json!({"email": "late@x.io"}))
        .await;
    let error = assert_error(&late, 503, "api_error");
    assert_eq!(error["code"], "request_timeout", "{}", late.body);
    assert_eq!(late.body["trace_id"], error["request_id"]);
    assert!(late.headers.contains_key("retry-after"));
    stalled.store(false, Ordering::SeqCst);
    server.engine.wait_caught_up().await.unwrap();
    let mut retried = api
        .post_idempotent("/v1/customers", "late-1", json!({"email": "late@x.io"}))
        .await;
    for _ in 0..50 {
        if retried.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retried = api
            .post_idempotent("/v1/customers", "late-1", json!({"email": "late@x.io"}))
            .await;
    }
    assert_eq!(retried.status, 200, "{}", retried.body);
    let listed = api.get("/v1/customers?limit=100").await;
    let created = listed.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["email"] == "late@x.io")
        .count();
    assert_eq!(created, 1, "one customer for the key: {}", listed.body);
    server.stop().await;
}

/// A body that stops arriving is answered 408 `body_read_timeout` (not 413: its
/// size was never the matter), a body whose chunked framing is broken 400
/// `body_unreadable`; both with the error body and `Connection: close`, since the
/// rest of such a body is still on the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_or_breaks_is_named_for_what_it_is() {
    let (_guard, dir) = temp_dir();
    let config = tally_http::HttpConfig {
        body_read_timeout_ms: 300,
        ..default_config()
    };
    let server = Server::start(&dir, config).await;
    let keys = create_store(&server, "s").await;
    let address = server.test_url.trim_start_matches("http://").to_string();
    let head = |framing: &str| {
        format!(
            "POST /v1/customers HTTP/1.1\r\nhost: x\r\nx-api-key: {}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n",
            keys.test
        )
    };
    let cases = [
        (
            format!("{}{{\"email\":", head("content-length: 100")),
            "408",
            "body_read_timeout",
        ),
        (
            format!(
                "{}zz\r\n{{}}\r\n0\r\n\r\n",
                head("transfer-encoding: chunked")
            ),
            "400",
            "body_unreadable",
        ),
    ];
    for (request, status, code) in cases {
        let text = exchange_raw(&address, request.as_bytes(), "").await;
        assert!(text.starts_with(&format!("http/1.1 {status}")), "{text}");
        assert!(text.contains(&format!("\"code\":\"{code}\"")), "{text}");
        assert!(text.contains("\"trace_id\""), "{text}");
        assert!(text.contains("connection: close"), "{text}");
    }
    server.stop().await;
}

/// A client that sends a whole body past the limit before it reads (what most
/// clients do) reads the 413 and its error body, not a reset: the server reads
/// the refused body to its end before it answers and closes, whether the body's
/// length was declared or it came chunked. A client that waits for
/// `100-continue` is refused at once and never asked for the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_a_body_past_the_limit_reads_the_refusal() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "s").await;
    let address = server.test_url.trim_start_matches("http://").to_string();
    // Larger than loopback socket buffers take, within what the server drains.
    let size = 7 * tally_http::extract::MAX_BODY_BYTES;
    let head = |framing: &str| {
        format!(
            "POST /v1/customers HTTP/1.1\r\nhost: x\r\nx-api-key: {}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n",
            keys.test
        )
    };
    let declared = [
        head(&format!("content-length: {size}")).into_bytes(),
        vec![b' '; size],
    ]
    .concat();
    let mut chunked = head("transfer-encoding: chunked").into_bytes();
    let chunk = 64 * 1024;
    for _ in 0..size / chunk {
        chunked.extend_from_slice(format!("{chunk:x}\r\n").as_bytes());
        chunked.extend_from_slice(&vec![b' '; chunk]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    for (what, request) in [("declared", declared), ("chunked", chunked)] {
        let text = exchange_raw(&address, &request, what).await;
        assert!(text.starts_with("http/1.1 413"), "{what}: {text}");
        assert!(
            text.contains("\"code\":\"body_too_large\""),
            "{what}: {text}"
        );
        assert!(text.contains("connection: close"), "{what}: {text}");
    }

    // Headers only: a server that asked for the body would wait for it here.
    let waiting = head(&format!("content-length: {size}\r\nexpect: 100-continue"));
    let text = exchange_raw(&address, waiting.as_bytes(), "expect: 100-continue").await;
    assert!(text.starts_with("http/1.1 413"), "{text}");
    assert!(!text.contains("100 continue"), "{text}");

    let api = Api::new(&server.test_url, &keys.test);
    assert_eq!(api.get("/v1/customers").await.body["data"], json!([]));
    server.stop().await;
}

/// Sends `request` as raw bytes on a new connection and reads until the server
/// closes it (at most 10 s): the answer, lowercased. `what` names the case in a
/// failure.
async fn exchange_raw(address: &str, request: &[u8], what: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream
        .write_all(request)
        .await
        .unwrap_or_else(|error| panic!("{what}: the request could not be sent: {error}"));
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .unwrap_or_else(|_| panic!("{what}: the server did not answer and close"))
        .unwrap_or_else(|error| panic!("{what}: the answer could not be read: {error}"));
    String::from_utf8_lossy(&answer).to_lowercase()
}
