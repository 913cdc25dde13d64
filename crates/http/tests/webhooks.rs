//! Webhooks over real sockets: endpoints and secrets, signed HTTP delivery to a real
//! local receiver with the retry schedule run on the test clock, restart
//! mid-schedule, disabled endpoints, the cli feed and its acknowledgements, SSRF.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::webhook::verify_signature;

/// A local HTTP receiver answering a scripted sequence of statuses (then 200).
#[derive(Clone, Default)]
struct Receiver {
    answers: Arc<Mutex<VecDeque<u16>>>,
    received: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

impl Receiver {
    async fn start(answers: &[u16]) -> (Receiver, String) {
        let receiver = Receiver::default();
        receiver.answers.lock().unwrap().extend(answers);
        let state = receiver.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let state = state.clone();
                async move {
                    state.received.lock().unwrap().push((headers, body));
                    let status = state.answers.lock().unwrap().pop_front().unwrap_or(200);
                    StatusCode::from_u16(status).unwrap()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (receiver, url)
    }

    fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    async fn wait_for(&self, n: usize) {
        for _ in 0..100 {
            if self.count() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("receiver got {} requests, expected {n}", self.count());
    }
}

/// A new customer's new credits account: its id.
async fn new_account(api: &Api, key: &str) -> String {
    let customer = api
        .post("/v1/customers", json!({"email": format!("{key}@x.io")}))
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
    api.post(
        "/v1/customer-credits/accounts",
        json!({"customer_id": customer}),
    )
    .await
    .body["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn credit_event(api: &Api, amount: &str, key: &str) -> (String, String) {
    let account = new_account(api, key).await;
    let tx = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/credit"),
            json!({"amount": amount, "idempotency_key": key}),
        )
        .await;
    assert_eq!(tx.status, 200);
    (account, tx.body["id"].as_str().unwrap().to_string())
}

/// An HTTP endpoint at `url` subscribed to `credits.granted`: its id.
async fn credits_endpoint(api: &Api, url: &str) -> String {
    let created = api
        .post(
            "/v1/webhooks",
            json!({"url": url, "events": ["credits.granted"]}),
        )
        .await;
    assert_eq!(created.status, 200, "{}", created.body);
    created.body["id"].as_str().unwrap().to_string()
}

/// `n` credits of 1 on a new account (one `credits.granted` event each), keyed
/// `{key}{i}`.
async fn credits_of_one(api: &Api, key: &str, n: usize) {
    credits_of_one_each_after(api, key, n, || {}).await;
}

/// `credits_of_one`, calling `before` ahead of each credit: the credits' transaction
/// ids, in the order made.
async fn credits_of_one_each_after(
    api: &Api,
    key: &str,
    n: usize,
    before: impl Fn(),
) -> Vec<String> {
    let account = new_account(api, key).await;
    let mut made = Vec::with_capacity(n);
    for i in 0..n {
        before();
        let credit = api
            .post(
                &format!("/v1/customer-credits/accounts/{account}/credit"),
                json!({"amount": "1", "idempotency_key": format!("{key}{i}")}),
            )
            .await;
        assert_eq!(credit.status, 200, "{}", credit.body);
        made.push(credit.body["id"].as_str().unwrap().to_string());
    }
    made
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_secrets_and_validation() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let test = Api::new(&server.test_url, &keys.test);
    let prod = Api::new(&server.prod_url, &keys.prod);
    let created = test.post("/v1/webhooks", json!({"name": "local", "url": "http://127.0.0.1:9/hook", "delivery_mode": "http", "events": ["credits.granted"]})).await;
    assert_eq!(created.status, 200, "{}", created.body);
    let secret = created.body["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_") && secret.len() >= 6 + 43);
    assert_eq!(created.body["status"], "enabled");
    let id = created.body["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("wh_"));
    let fetched = test.get(&format!("/v1/webhooks/{id}")).await;
    assert!(
        fetched.body.get("secret").is_none(),
        "the secret is shown only at creation"
    );
    assert_eq!(
        test.get(&format!("/v1/webhooks/{id}/secret")).await.body["secret"],
        secret
    );
    assert_eq!(
        test.get("/v1/webhooks").await.body["data"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let unknown = test
        .post(
            "/v1/webhooks",
            json!({"url": "http://127.0.0.1:9/", "events": ["credits.granted", "nope.happened"]}),
        )
        .await;
    assert_eq!(
        assert_error(&unknown, 400, "invalid_request_error")["param"],
        "events[1]"
    );
    for url in [
        "http://hooks.example.com/x",
        "https://127.0.0.1/x",
        "https://10.0.0.8/",
        "https://169.254.169.254/",
        "https://localhost./",
    ] {
        let refused = prod
            .post(
                "/v1/webhooks",
                json!({"url": url, "events": ["credits.granted"]}),
            )
            .await;
        assert_eq!(
            assert_error(&refused, 400, "invalid_request_error")["param"],
            "url",
            "{url}"
        );
    }
    assert_eq!(
        prod.post(
            "/v1/webhooks",
            json!({"url": "https://hooks.example.com/x", "events": ["credits.granted"]})
        )
        .await
        .status,
        200
    );

    let updated = test
        .post(
            &format!("/v1/webhooks/{id}"),
            json!({"name": "renamed", "status": "disabled", "events": ["credits.consumed"]}),
        )
        .await;
    assert_eq!(updated.body["name"], "renamed");
    assert_eq!(updated.body["status"], "disabled");
    assert_eq!(updated.body["events"], json!(["credits.consumed"]));
    let rotated = test
        .post(&format!("/v1/webhooks/{id}/secret/rotate"), json!({}))
        .await;
    let new_secret = rotated.body["secret"].as_str().unwrap();
    assert_ne!(new_secret, secret);
    assert_eq!(
        test.get(&format!("/v1/webhooks/{id}/secret")).await.body["secret"],
        new_secret
    );
    let deleted = Api::finish_raw(
        reqwest::Client::new()
            .delete(format!("{}/v1/webhooks/{id}", server.test_url))
            .header("x-api-key", &keys.test),
    )
    .await;
    assert_eq!(deleted.body["deleted"], true);
    assert_eq!(test.get(&format!("/v1/webhooks/{id}")).await.status, 404);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_delivery_follows_the_retry_schedule_across_a_restart() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let (receiver, url) = Receiver::start(&[500, 500]).await;
    let (silent, silent_url) = Receiver::start(&[]).await;
    let endpoint = api
        .post(
            "/v1/webhooks",
            json!({"url": url, "events": ["credits.granted"]}),
        )
        .await
        .body;
    let endpoint_id = endpoint["id"].as_str().unwrap().to_string();
    let secret = endpoint["secret"].as_str().unwrap().to_string();
    api.post(
        "/v1/webhooks",
        json!({"url": silent_url, "events": ["credits.granted"], "status": "disabled"}),
    )
    .await;
    let (_, tx) = credit_event(&api, "12.5", "w1").await;
    let t0 = server.clock.now_ms();

    receiver.wait_for(1).await;
    let (headers, body) = receiver.received.lock().unwrap()[0].clone();
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers["tally-event-type"], "credits.granted");
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(envelope["eventType"], "credits.granted");
    assert_eq!(envelope["id"], headers["tally-event-id"].to_str().unwrap());
    assert!(envelope["created_at"].is_i64(), "epoch milliseconds");
    assert_eq!(envelope["object"]["id"], tx);
    assert_eq!(envelope["object"]["amount"], "12.5");
    let signature = headers["tally-signature"].to_str().unwrap();
    assert_eq!(
        verify_signature(signature, &secret, &body, t0 / 1000),
        Ok(()),
        "{signature}"
    );

    // Nothing more until the clock reaches +30 s.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(receiver.count(), 1);
    server.clock.advance_ms(30_000);
    receiver.wait_for(2).await;

    // Restart mid-schedule: the schedule lives in the log and the projection.
    let clock = server.clock.clone();
    server.stop().await;
    let server = Server::start_with_clock(&dir, default_config(), clock.clone()).await;
    let api = Api::new(&server.test_url, &keys.test);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(receiver.count(), 2, "no attempt repeated by the restart");
    clock.advance_ms(5 * 60_000 - 30_000);
    receiver.wait_for(3).await;
    // Delivered (200 on the third try): no further attempts, ever.
    clock.advance_ms(24 * 3_600_000);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(receiver.count(), 3);
    let bodies: Vec<Bytes> = receiver
        .received
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b)| b.clone())
        .collect();
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "the same bytes on every attempt"
    );

    let attempts = api
        .get(&format!("/v1/webhooks/{endpoint_id}/deliveries"))
        .await
        .body["data"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(attempts.len(), 3);
    let offsets: Vec<i64> = attempts
        .iter()
        .rev()
        .map(|a| {
            tally_domain::time::parse_iso8601_ms(a["created_at"].as_str().unwrap()).unwrap() - t0
        })
        .collect();
    assert_eq!(offsets, vec![0, 30_000, 300_000]);
    let statuses: Vec<Value> = attempts
        .iter()
        .rev()
        .map(|a| a["status_code"].clone())
        .collect();
    assert_eq!(statuses, vec![json!(500), json!(500), json!(200)]);
    assert_eq!(attempts[0]["delivered"], true);
    // A failed attempt says why in `failure_reason`; no attempt has a top-level
    // `error`, the key of error answers alone.
    assert!(attempts[0]["failure_reason"].is_null(), "{}", attempts[0]);
    assert!(attempts[2]["failure_reason"].is_string(), "{}", attempts[2]);
    assert!(attempts.iter().all(|a| a.get("error").is_none()));
    assert_eq!(silent.count(), 0, "a disabled endpoint receives nothing");

    // A manual resend sends the same body again.
    let event_id = attempts[0]["event_id"].as_str().unwrap();
    let resent = api
        .post(
            &format!("/v1/webhooks/{endpoint_id}/events/{event_id}/resend"),
            json!({}),
        )
        .await;
    assert_eq!(resent.body["manual"], true);
    assert_eq!(receiver.count(), 4);
    assert_eq!(receiver.received.lock().unwrap()[3].1, bodies[0]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_feed_lists_oldest_first_until_acknowledged() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let endpoint = api.post("/v1/webhooks", json!({"delivery_mode": "cli", "events": ["credits.consumed", "customer_credits.exhausted"]})).await.body;
    let id = endpoint["id"].as_str().unwrap().to_string();
    let secret = endpoint["secret"].as_str().unwrap().to_string();
    let http_endpoint = api
        .post(
            "/v1/webhooks",
            json!({"url": "http://127.0.0.1:9/", "events": ["credits.granted"]}),
        )
        .await
        .body;
    let (account, _) = credit_event(&api, "5", "c1").await;
    server.clock.advance_ms(10);
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/debit"),
        json!({"amount": "5", "idempotency_key": "d1"}),
    )
    .await;

    let feed = api.get(&format!("/v1/webhooks/{id}/events/pending")).await;
    assert_eq!(feed.status, 200, "{}", feed.body);
    let items = feed.body["items"].as_array().unwrap().clone();
    let types: Vec<&str> = items
        .iter()
        .map(|i| i["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        vec!["credits.consumed", "customer_credits.exhausted"]
    );
    for item in &items {
        assert_eq!(item["object"], "webhook_event");
        let body = item["body"].as_str().unwrap();
        let envelope: Value = serde_json::from_str(body).unwrap();
        assert_eq!(envelope["id"], item["id"]);
        assert_eq!(item["headers"]["Content-Type"], "application/json");
        let signature = item["headers"]["tally-signature"].as_str().unwrap();
        assert_eq!(
            verify_signature(
                signature,
                &secret,
                body.as_bytes(),
                server.clock.now_ms() / 1000
            ),
            Ok(())
        );
    }
    assert_eq!(
        serde_json::from_str::<Value>(items[1]["body"].as_str().unwrap()).unwrap()["object"]
            ["balance"],
        "0"
    );
    for bad in ["limit=0", "limit=101"] {
        assert_eq!(
            assert_error(
                &api.get(&format!("/v1/webhooks/{id}/events/pending?{bad}"))
                    .await,
                400,
                "invalid_request_error"
            )["param"],
            "limit"
        );
    }
    let http_id = http_endpoint["id"].as_str().unwrap();
    assert_eq!(
        assert_error(
            &api.get(&format!("/v1/webhooks/{http_id}/events/pending"))
                .await,
            400,
            "invalid_request_error"
        )["code"],
        "webhook_not_cli"
    );
    assert_eq!(
        api.get(&format!("/v1/webhooks/{id}/events/pending?limit=1"))
            .await
            .body["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let first = items[0]["id"].as_str().unwrap();
    let failed = api
        .post(
            &format!("/v1/webhooks/{id}/events/{first}/ack"),
            json!({"status": 500}),
        )
        .await;
    assert_eq!(failed.body["delivered"], false);
    assert_eq!(
        api.get(&format!("/v1/webhooks/{id}/events/pending"))
            .await
            .body["items"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "still pending"
    );
    let ok = api
        .post(
            &format!("/v1/webhooks/{id}/events/{first}/ack"),
            json!({"status": 200}),
        )
        .await;
    assert_eq!(ok.body["delivered"], true);
    let remaining = api
        .get(&format!("/v1/webhooks/{id}/events/pending"))
        .await
        .body["items"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(remaining.len(), 1);
    assert_eq!(remaining[0]["id"], items[1]["id"]);
    assert_eq!(
        api.post(
            &format!("/v1/webhooks/{id}/events/{first}/ack"),
            json!({"status": 200})
        )
        .await
        .status,
        409
    );
    assert_eq!(
        api.post(
            &format!("/v1/webhooks/{id}/events/whevt_nope/ack"),
            json!({"status": 200})
        )
        .await
        .status,
        404
    );
    assert_eq!(
        assert_error(
            &api.post(
                &format!("/v1/webhooks/{id}/events/{first}/ack"),
                json!({"status": "ok"})
            )
            .await,
            400,
            "invalid_request_error"
        )["param"],
        "status"
    );
    let attempts = api.get(&format!("/v1/webhooks/{id}/deliveries")).await.body["data"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(attempts, 2, "both acknowledgements are recorded attempts");
    server.stop().await;
}

/// Every spelling of an internal address is refused when the endpoint is saved, the
/// parser-differential one (`\\@`) included; names are checked again after DNS
/// resolution at delivery (the dispatcher's resolver, unit-tested beside it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_refuse_internal_addresses_in_every_spelling() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let prod = Api::new(&server.prod_url, &keys.prod);
    let test = Api::new(&server.test_url, &keys.test);
    for url in [
        "https://127.1/hook",
        "https://0x7f.0.0.1/",
        "https://2130706433/",
        "https://127.0.0.1\\@example.com/",
        "https://user@example.com/",
        "https://[::ffff:a9fe:a9fe]/",
        "https://[64:ff9b::a00:1]/",
    ] {
        let refused = prod
            .post(
                "/v1/webhooks",
                json!({"url": url, "events": ["credits.granted"]}),
            )
            .await;
        let error = assert_error(&refused, 400, "invalid_request_error");
        assert_eq!(error["param"], "url", "{url}");
    }
    // Test endpoints: loopback yes, private and metadata addresses no.
    for (url, status) in [
        ("http://127.0.0.1:9/hook", 200),
        ("http://localhost:9/hook", 200),
        ("http://10.0.0.5:22/", 400),
        ("http://169.254.169.254/latest/meta-data", 400),
        ("http://192.168.1.1/", 400),
    ] {
        let answer = test
            .post(
                "/v1/webhooks",
                json!({"url": url, "events": ["credits.granted"]}),
            )
            .await;
        assert_eq!(answer.status, status, "{url}: {}", answer.body);
    }
    server.stop().await;
}

/// One store's black-holed endpoint (accepts connections, never answers) with more
/// due deliveries than a dispatcher poll takes cannot delay another store's
/// delivery: each endpoint holds at most its own cap of in-flight slots and the
/// scan moves past the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_endpoint_does_not_delay_other_stores() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let a = Api::new(&server.test_url, &create_store(&server, "a").await.test);
    let b = Api::new(&server.test_url, &create_store(&server, "b").await.test);
    // The black hole: accepts and holds connections, never reads or answers.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_url = format!("http://{}/hook", hole.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    credits_endpoint(&a, &hole_url).await;
    // More deliveries than one poll takes (DISPATCH_BATCH), all older than B's.
    credits_of_one(&a, "a", tally_http::webhooks::DISPATCH_BATCH + 40).await;
    // B's delivery is due strictly after every one of A's.
    server.clock.advance_ms(1);
    let (receiver, url) = Receiver::start(&[]).await;
    credits_endpoint(&b, &url).await;
    let started = std::time::Instant::now();
    credit_event(&b, "5", "b").await;
    // Well inside one delivery timeout of the black hole (10 s).
    receiver.wait_for(1).await;
    assert!(
        started.elapsed() < Duration::from_millis(tally_http::webhooks::DELIVERY_TIMEOUT_MS),
        "B's delivery waited {:?}",
        started.elapsed()
    );
    server.stop().await;
}

/// An endpoint that answers at once receives more than its concurrent slots' worth
/// each poll interval, and never more than `MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT`
/// requests at once. With the slots as the only allowance a poll took 4 of one
/// endpoint, so 400 deliveries needed at least 100 polls of 100 ms (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_endpoint_is_not_held_to_its_slots_per_poll() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const EVENTS: usize = 400;
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &create_store(&server, "fast").await.test);
    let now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let events = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let app = {
        let (now, most, events) = (now.clone(), most.clone(), events.clone());
        axum::Router::new().route(
            "/hook",
            axum::routing::post(move |headers: HeaderMap| {
                let (now, most, events) = (now.clone(), most.clone(), events.clone());
                async move {
                    let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(at_once, Ordering::SeqCst);
                    // Long enough for deliveries to overlap when they may.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let id = headers["tally-event-id"].to_str().unwrap().to_string();
                    events.lock().unwrap().insert(id);
                    now.fetch_sub(1, Ordering::SeqCst);
                    StatusCode::OK
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    credits_endpoint(&api, &url).await;
    credits_of_one(&api, "fast", EVENTS).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    while events.lock().unwrap().len() < EVENTS && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let delivered = events.lock().unwrap().len();
    assert_eq!(delivered, EVENTS, "every event delivered, once each");
    let most = most.load(Ordering::SeqCst);
    assert!(
        (2..=tally_http::webhooks::MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT).contains(&most),
        "{most} deliveries at once"
    );
    server.stop().await;
}

/// The receiver's answer frees a delivery's slot, not the attempt's record (a log
/// append and its fsync): with the log holding every attempt record unwritten, an
/// endpoint still receives all its deliveries, more than its
/// `MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT` slots' worth, each once. With the slots
/// held until the record was written, it received only its slots' worth. Once the
/// records are written, each delivery has its one attempt and none is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_record_of_attempts_does_not_hold_an_endpoints_slots() {
    use common::failing_log::{start_with_failing_log, ATTEMPTS_HELD, HEALTHY};
    use std::sync::atomic::Ordering;
    const EVENTS: usize = 3 * tally_http::webhooks::MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT;
    let (_g, dir) = temp_dir();
    let (server, log) = start_with_failing_log(&dir).await;
    let api = Api::new(&server.test_url, &create_store(&server, "held").await.test);
    let (receiver, url) = Receiver::start(&[]).await;
    let endpoint = credits_endpoint(&api, &url).await;
    let event_ids = || -> Vec<String> {
        receiver
            .received
            .lock()
            .unwrap()
            .iter()
            .map(|(headers, _)| headers["tally-event-id"].to_str().unwrap().to_string())
            .collect()
    };

    log.store(ATTEMPTS_HELD, Ordering::SeqCst);
    credits_of_one(&api, "held", EVENTS).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while event_ids().len() < EVENTS && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut received = event_ids();
    received.sort();
    received.dedup();
    assert_eq!(
        received.len(),
        EVENTS,
        "every event delivered while the attempts wait to be recorded"
    );

    log.store(HEALTHY, Ordering::SeqCst);
    let recorded = || async {
        api.get(&format!("/v1/webhooks/{endpoint}/deliveries?limit=100"))
            .await
            .body["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|attempt| attempt["status_code"] == 200)
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while recorded().await < EVENTS && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(recorded().await, EVENTS, "one delivered attempt per event");
    // A few dispatcher polls later, nothing was sent twice.
    tokio::time::sleep(Duration::from_millis(
        5 * tally_http::webhooks::DISPATCH_POLL_MS,
    ))
    .await;
    assert_eq!(event_ids().len(), EVENTS, "no event delivered twice");
    server.stop().await;
}

/// A test store's deliveries follow its test clock: the events of a renewal the
/// clock ran are delivered at once, and a failed attempt is retried when the clock
/// passes its retry time, not the wall clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_of_a_test_store_follow_its_test_clock() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    // The checkout's event is delivered; the renewal's first attempt fails.
    let (receiver, url) = Receiver::start(&[200, 500, 200]).await;
    let hook = api
        .post(
            "/v1/webhooks",
            json!({"url": url, "delivery_mode": "http", "events": ["subscription.paid"]}),
        )
        .await;
    assert_eq!(hook.status, 200, "{}", hook.body);
    let product = api
        .post(
            "/v1/products",
            json!({"name": "P", "price": 100, "currency": "usd", "billing_type": "recurring",
                   "billing_period": "every-month"}),
        )
        .await
        .body["id"]
        .clone();
    let customer = api
        .post("/v1/customers", json!({"email": "w@x.io"}))
        .await
        .body["id"]
        .clone();
    let checkout = api
        .post(
            "/v1/checkouts",
            json!({"product_id": product, "customer_id": customer}),
        )
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
    let paid = api
        .post(
            &format!("/v1/checkouts/{checkout}/complete"),
            json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/34"}),
        )
        .await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    receiver.wait_for(1).await;
    let sub = paid.body["subscription_id"].as_str().unwrap();
    let next = api.get(&format!("/v1/subscriptions/{sub}")).await.body["next_transaction_date"]
        .as_str()
        .unwrap()
        .to_string();
    let renewal_at = tally_domain::time::parse_iso8601_ms(&next).unwrap();
    let advanced = api
        .post(
            "/v1/test-clock/advance",
            json!({"to": tally_domain::time::format_iso8601_ms(renewal_at)}),
        )
        .await;
    assert_eq!(advanced.status, 200, "{}", advanced.body);
    // Due at the test time, though the wall clock is a month behind.
    receiver.wait_for(2).await;
    // The retry is 30 s later by the test clock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(receiver.count(), 2, "no retry before its time");
    api.post(
        "/v1/test-clock/advance",
        json!({"to": tally_domain::time::format_iso8601_ms(renewal_at + 31_000)}),
    )
    .await;
    receiver.wait_for(3).await;
    // Scheduled by the test clock, but signed at the wall clock: a receiver checks
    // the signature's time against its own clock (docs/api.md, "Webhooks").
    let wall_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    for (headers, _) in receiver.received.lock().unwrap().iter() {
        let signature = headers["tally-signature"].to_str().unwrap();
        let signed_at: i64 = signature
            .strip_prefix("t=")
            .and_then(|rest| rest.split(',').next())
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            (signed_at - wall_s).abs() < 300,
            "signed at {signed_at}, the wall clock is at {wall_s}: {signature}"
        );
    }
    server.stop().await;
}

/// The endpoint list and the deliveries list keep the cursor contract: `limit`,
/// `has_more`, `starting_after`, `ending_before`, 404 naming an unknown cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_lists_keep_the_cursor_contract() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let (receiver, url) = Receiver::start(&[]).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        server.clock.advance_ms(1);
        let body = if i == 0 {
            json!({"url": url, "delivery_mode": "http", "events": ["credits.granted"]})
        } else {
            json!({"delivery_mode": "cli", "events": ["credits.granted"]})
        };
        let hook = api.post("/v1/webhooks", body).await;
        assert_eq!(hook.status, 200, "{}", hook.body);
        ids.push(hook.body["id"].as_str().unwrap().to_string());
    }
    let first = api.get("/v1/webhooks?limit=2").await.body;
    let listed: Vec<&str> = first["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, vec![ids[2].as_str(), ids[1].as_str()]);
    assert_eq!(first["has_more"], true);
    let next = api
        .get(&format!("/v1/webhooks?limit=2&starting_after={}", ids[1]))
        .await
        .body;
    assert_eq!(next["data"][0]["id"], ids[0].as_str());
    assert_eq!(next["has_more"], false);
    let back = api
        .get(&format!("/v1/webhooks?limit=1&ending_before={}", ids[0]))
        .await
        .body;
    assert_eq!(back["data"][0]["id"], ids[1].as_str());
    assert_eq!(back["has_more"], true);
    let unknown = assert_error(
        &api.get("/v1/webhooks?starting_after=wh_nope").await,
        404,
        "invalid_request_error",
    );
    assert_eq!(unknown["param"], "starting_after");

    // Three deliveries to the http endpoint, paged two at a time.
    for i in 0..3 {
        credit_event(&api, "1", &format!("k{i}")).await;
    }
    receiver.wait_for(3).await;
    let path = format!("/v1/webhooks/{}/deliveries", ids[0]);
    // The receiver sees a POST before the dispatcher appends its attempt record.
    recorded_attempts(&api, &path, 3).await;
    let page = api.get(&format!("{path}?limit=2")).await.body;
    assert_eq!(page["data"].as_array().unwrap().len(), 2, "{page}");
    assert_eq!(page["has_more"], true);
    let last = page["data"][1]["id"].as_str().unwrap().to_string();
    let rest = api
        .get(&format!("{path}?limit=2&starting_after={last}"))
        .await
        .body;
    assert_eq!(rest["data"].as_array().unwrap().len(), 1, "{rest}");
    assert_eq!(rest["has_more"], false);
    let unknown = assert_error(
        &api.get(&format!("{path}?starting_after=wha_1_1_whevt_nope"))
            .await,
        404,
        "invalid_request_error",
    );
    assert_eq!(unknown["param"], "starting_after");
    server.stop().await;
}

/// Waits until `path` lists `n` recorded attempts: the dispatcher records an attempt
/// in the log after the endpoint answered, so the receiver can count a delivery the
/// list does not show yet.
async fn recorded_attempts(api: &Api, path: &str, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let listed = api.get(&format!("{path}?limit=100")).await.body;
        let count = listed["data"].as_array().map_or(0, Vec::len);
        if count >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{count} of {n} attempts recorded: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An endpoint receives its deliveries in the order they fell due, as far as its
/// `MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT` slots allow: while the receiver holds
/// every request open, the first requests are the oldest events, and each answer
/// lets in the next oldest. With a task per delivery waiting for a slot, the order
/// was the runtime's (the newest of a poll's batch often went first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_receives_its_deliveries_oldest_first() {
    use tally_http::webhooks::MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT as SLOTS;
    const EVENTS: usize = 3 * SLOTS;
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &create_store(&server, "order").await.test);
    // Records each request's transaction id as it arrives, then waits for a permit
    // the test hands out one at a time.
    let arrived = Arc::new(Mutex::new(Vec::<String>::new()));
    let answers = Arc::new(tokio::sync::Semaphore::new(0));
    let app = {
        let (arrived, answers) = (arrived.clone(), answers.clone());
        axum::Router::new().route(
            "/hook",
            axum::routing::post(move |body: Bytes| {
                let (arrived, answers) = (arrived.clone(), answers.clone());
                async move {
                    let envelope: Value = serde_json::from_slice(&body).unwrap();
                    let id = envelope["object"]["id"].as_str().unwrap().to_string();
                    arrived.lock().unwrap().push(id);
                    answers.acquire().await.unwrap().forget();
                    StatusCode::OK
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    credits_endpoint(&api, &url).await;
    // Each event falls due a millisecond after the one before.
    let credited =
        credits_of_one_each_after(&api, "order", EVENTS, || server.clock.advance_ms(1)).await;
    let wait_for = |n: usize| {
        let arrived = arrived.clone();
        async move {
            for _ in 0..200 {
                if arrived.lock().unwrap().len() >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            panic!(
                "{} requests arrived, expected {n}",
                arrived.lock().unwrap().len()
            );
        }
    };
    wait_for(SLOTS).await;
    // Some polls later, still only the slots' worth, and those the oldest.
    tokio::time::sleep(Duration::from_millis(
        3 * tally_http::webhooks::DISPATCH_POLL_MS,
    ))
    .await;
    let mut first: Vec<String> = arrived.lock().unwrap().clone();
    assert_eq!(first.len(), SLOTS, "{first:?}");
    first.sort();
    let mut oldest = credited[..SLOTS].to_vec();
    oldest.sort();
    assert_eq!(first, oldest, "the first requests are the oldest events");
    // From here each answer lets exactly one more in: the next oldest.
    for (n, next) in credited.iter().enumerate().skip(SLOTS) {
        answers.add_permits(1);
        wait_for(n + 1).await;
        assert_eq!(
            &arrived.lock().unwrap()[n],
            next,
            "request {n} is the next oldest event"
        );
    }
    answers.add_permits(SLOTS);
    server.stop().await;
}
