//! Subscriptions over real sockets, driven by the test clock: renewals with their
//! `invoice` usage lines, each period charged once; dunning with the card that
//! declines renewals (past_due, three retries, unpaid); scheduled and immediate
//! cancels, pause and resume, invalid transitions; trials; the list; all of it
//! surviving a restart.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::subscription::LATE_USAGE_GRACE_MS as GRACE;
use tally_domain::time::{format_iso8601_ms, parse_iso8601_ms, DAY_MS};

async fn setup() -> (tempfile::TempDir, std::path::PathBuf, Server, Api, Keys) {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    (guard, dir, server, api, keys)
}

fn id(answer: &Answer) -> String {
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

async fn test_now(api: &Api) -> i64 {
    let clock = api.get("/v1/test-clock").await;
    assert_eq!(clock.status, 200, "{}", clock.body);
    parse_iso8601_ms(clock.body["now"].as_str().unwrap()).unwrap()
}

async fn advance(api: &Api, to_ms: i64) -> Answer {
    api.post(
        "/v1/test-clock/advance",
        json!({"to": format_iso8601_ms(to_ms)}),
    )
    .await
}

/// A subscription bought with `card`: (subscription id, customer id).
async fn subscribe(api: &Api, product: &str, card: &str) -> (String, String) {
    subscribe_with_expiry(api, product, card, "12/34").await
}

/// `subscribe` with a card of expiry `exp`.
async fn subscribe_with_expiry(
    api: &Api,
    product: &str,
    card: &str,
    exp: &str,
) -> (String, String) {
    let cus = id(&api
        .post("/v1/customers", json!({"email": "s@example.com"}))
        .await);
    let chk = id(&api
        .post(
            "/v1/checkouts",
            json!({"product_id": product, "customer_id": cus}),
        )
        .await);
    let paid = api
        .post(
            &format!("/v1/checkouts/{chk}/complete"),
            json!({"card_number": card, "cvc": "123", "exp": exp}),
        )
        .await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    (
        paid.body["subscription_id"].as_str().unwrap().to_string(),
        cus,
    )
}

async fn product(api: &Api, extra: Value) -> String {
    let mut body = json!({"name": "Pro", "price": 1000, "currency": "usd",
        "billing_type": "recurring", "billing_period": "every-month", "tax_mode": "exclusive"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    id(&api.post("/v1/products", body).await)
}

/// A product pricing the meter `calls` at 2 per unit on the invoice.
async fn invoiced_calls_product(api: &Api, calls: &str) -> String {
    product(
        api,
        json!({"usage_prices": [{"meter_id": calls, "unit_price": 2,
            "settlement_mode": "invoice"}]}),
    )
    .await
}

/// The `count` meter of `api_call` events most tests price.
async fn calls_meter(api: &Api) -> String {
    id(&api
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "api_call", "aggregation": "count"}),
        )
        .await)
}

/// `api_call` events of `cus` with these ids, at `at` (now when `None`).
async fn ingest_calls(api: &Api, cus: &str, ids: Vec<String>, at: Option<i64>) {
    let events: Vec<Value> = ids
        .iter()
        .map(|id| {
            let mut e = json!({"name": "api_call", "customer_id": cus, "event_id": id});
            if let Some(at) = at {
                e["timestamp"] = json!(format_iso8601_ms(at));
            }
            e
        })
        .collect();
    let answer = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(answer.status, 202, "{}", answer.body);
}

/// When the current period of the subscription at `path` ends.
async fn period_end(api: &Api, path: &str) -> i64 {
    let s = api.get(path).await.body;
    parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap()
}

async fn transactions(api: &Api, sub: &str) -> Vec<Value> {
    let list = api
        .get(&format!("/v1/transactions?subscription_id={sub}&limit=100"))
        .await
        .body;
    let mut data = list["data"].as_array().unwrap().clone();
    data.reverse(); // oldest first
    data
}

async fn event_types(api: &Api, hook: &str) -> Vec<String> {
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending?limit=100"))
        .await
        .body;
    feed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["event_type"].as_str().unwrap().to_string())
        .collect()
}

async fn hook(api: &Api) -> String {
    id(&api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["subscription.active", "subscription.paid",
                "subscription.past_due", "subscription.unpaid", "subscription.expired",
                "subscription.canceled", "subscription.scheduled_cancel", "subscription.paused",
                "subscription.trialing", "subscription.update"]}),
        )
        .await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_bill_each_period_once_with_its_invoice_usage() {
    let (_g, dir, server, api, keys) = setup().await;
    let calls = calls_meter(&api).await;
    let prod = product(
        &api,
        json!({"usage_prices": [{"meter_id": calls, "unit_price": "2.5", "free_allowance": 2,
            "cap": 10, "settlement_mode": "invoice"}]}),
    )
    .await;
    let (sub, cus) = subscribe(&api, &prod, "4242424242424242").await;
    let start = test_now(&api).await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    // The renewal waits out the grace for late usage.
    assert_eq!(s["next_transaction_date"], format_iso8601_ms(end + GRACE));
    assert!(end > start);

    // Five calls in the first period: 5 - 2 free = 3 x 2.5 = 7.5 -> 8 minor units.
    let events: Vec<Value> = (0..5)
        .map(|i| json!({"name": "api_call", "customer_id": cus, "event_id": format!("p1-{i}")}))
        .collect();
    let ingested = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);

    // The next charge as of now: the base ahead and the usage to date, nothing written.
    server.engine.wait_caught_up().await.unwrap();
    let upcoming = api.get(&format!("/v1/subscriptions/{sub}/upcoming")).await;
    assert_eq!(upcoming.status, 200, "{}", upcoming.body);
    assert_eq!(upcoming.body["amount"], 1008);
    assert_eq!(upcoming.body["date"], format_iso8601_ms(end + GRACE));
    assert_eq!(upcoming.body["lines"][1]["quantity"], "3");
    assert_eq!(transactions(&api, &sub).await.len(), 1);

    // The clock never goes back, and exists in test mode only.
    let back = assert_error(
        &advance(&api, start - 1).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(back["param"], "to");
    let prod_api = Api::new(&server.prod_url, &keys.prod);
    assert_error(
        &prod_api.get("/v1/test-clock").await,
        400,
        "invalid_request_error",
    );

    // Within the grace, nothing is charged yet, and usage of the ended period that
    // arrives now is still billed with it: 6 - 2 = 4 x 2.5 = 10.
    let moved = advance(&api, end + 60_000).await;
    assert_eq!(moved.status, 200, "{}", moved.body);
    assert_eq!(test_now(&api).await, end + 60_000);
    assert_eq!(transactions(&api, &sub).await.len(), 1);
    let late = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "late-1",
                "timestamp": format_iso8601_ms(start + 120_000)}]}),
        )
        .await;
    assert_eq!(late.status, 202, "{}", late.body);
    advance(&api, end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2, "the checkout and one renewal: {txs:?}");
    let renewal = &txs[1];
    assert_eq!(renewal["amount"], 1010, "{renewal}");
    assert_eq!(renewal["period_start"], end);
    let lines = renewal["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["amount"], 1000);
    assert_eq!(lines[1]["meter_id"], calls.as_str());
    assert_eq!(lines[1]["quantity"], "4");
    assert_eq!(lines[1]["amount"], 10);
    let sum: i64 = lines.iter().map(|l| l["amount"].as_i64().unwrap()).sum();
    assert_eq!(sum, renewal["amount"].as_i64().unwrap());
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "active");
    assert_eq!(s["current_period_start_date"], format_iso8601_ms(end));
    assert_eq!(s["last_transaction_id"], renewal["id"]);

    // Advancing within the period runs nothing again; twice at once, once.
    let next_end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    advance(&api, end + GRACE + 2 * 60_000).await;
    assert_eq!(transactions(&api, &sub).await.len(), 2);
    // Events of the second period, one more of the first (after it was billed: it
    // goes on the next charge), then two racing advances past the second's end.
    api.post(
        "/v1/events/ingest",
        json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "p2-0"},
            {"name": "api_call", "customer_id": cus, "event_id": "late-2",
             "timestamp": format_iso8601_ms(start + 180_000)}]}),
    )
    .await;
    let (a, b) = tokio::join!(
        advance(&api, next_end + GRACE + 60_000),
        advance(&api, next_end + GRACE + 60_000)
    );
    assert!(a.status == 200 || b.status == 200, "{} {}", a.body, b.body);
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    // One call, within the free allowance (0); the late one: the first period's 7
    // calls bill 13, of which 10 were billed: 3.
    assert_eq!(txs[2]["lines"][1]["quantity"], "0");
    assert_eq!(txs[2]["lines"][2]["quantity"], "1", "{}", txs[2]);
    assert_eq!(txs[2]["lines"][2]["amount"], 3);
    assert_eq!(txs[2]["amount"], 1003);

    // A store without grace renews new subscriptions at the period's end.
    let no_grace = api
        .post("/v1/store/settings", json!({"late_usage_grace_seconds": 0}))
        .await;
    assert_eq!(no_grace.body["late_usage_grace_seconds"], 0);
    let (prompt, _) = subscribe(&api, &prod, "4242424242424242").await;
    let ps = api.get(&format!("/v1/subscriptions/{prompt}")).await.body;
    assert_eq!(ps["next_transaction_date"], ps["current_period_end_date"]);

    // Work that fell due while the service was down runs once when it is back: the
    // node's clock moves 40 days on during the restart, and the background scheduler
    // renews without any advance.
    let now = test_now(&api).await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let third_end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    let wall = server.clock.now_ms();
    server.stop().await;
    let clock = std::sync::Arc::new(tally_domain::clock::ManualClock::new(wall + 40 * DAY_MS));
    let server = Server::start_with_clock(&dir, default_config(), clock).await;
    let api = Api::new(&server.test_url, &keys.test);
    assert!(test_now(&api).await >= now + 40 * DAY_MS);
    assert!(third_end + GRACE < now + 40 * DAY_MS);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while transactions(&api, &sub).await.len() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the renewal due while down never ran"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 4, "once: {txs:?}");
    assert_eq!(txs[3]["amount"], 1000, "nothing late is billed twice");
    assert_eq!(txs[3]["period_start"], third_end);
    server.stop().await;
}

/// A card pays through its expiry month; the renewal after it is declined
/// (`expired_card`) and the subscription goes past due like any declined renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_on_file_that_expired_declines_the_renewal() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let prod = product(&api, json!({})).await;
    // A card of this month, by the store's clock.
    let (_, exp) = test_time_and_expiry(&api).await;
    // Good through its month: the checkout pays.
    let (sub, _) = subscribe_with_expiry(&api, &prod, "4242424242424242", &exp).await;
    let path = format!("/v1/subscriptions/{sub}");
    // The renewal falls in a later month: declined, nothing charged.
    let end = period_end(&api, &path).await;
    advance(&api, end + GRACE).await;
    let s = api.get(&path).await.body;
    assert_eq!(s["status"], "past_due", "{s}");
    assert_eq!(transactions(&api, &sub).await.len(), 1, "nothing charged");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_renewal_goes_past_due_retries_three_times_then_unpaid() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let hook = hook(&api).await;
    let prod = product(&api, json!({})).await;
    let (sub, _) = subscribe(&api, &prod, "4000000000000341").await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();

    let failed = end + GRACE;
    advance(&api, failed).await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "past_due", "{s}");
    assert_eq!(s["next_retry_date"], format_iso8601_ms(failed + DAY_MS));
    assert_eq!(transactions(&api, &sub).await.len(), 1, "nothing charged");

    advance(&api, failed + 2 * DAY_MS).await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "past_due");
    assert_eq!(s["payment_retries"], 1);
    assert_eq!(s["next_retry_date"], format_iso8601_ms(failed + 3 * DAY_MS));

    advance(&api, failed + 6 * DAY_MS).await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "unpaid", "{s}");
    assert_eq!(s["next_transaction_date"], Value::Null);
    assert_eq!(transactions(&api, &sub).await.len(), 1);
    assert_eq!(
        event_types(&api, &hook).await,
        vec![
            "subscription.active",
            "subscription.paid",
            "subscription.past_due",
            "subscription.update",
            "subscription.update",
            "subscription.unpaid",
            "subscription.expired"
        ]
    );
    // A body shows the subscription's last transaction as it was (a change without
    // a payment: the one paid before, read at the event).
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending?limit=100"))
        .await
        .body;
    let past_due: Value = feed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| serde_json::from_str::<Value>(i["body"].as_str().unwrap()).unwrap())
        .find(|b| b["eventType"] == "subscription.past_due")
        .unwrap();
    let object = &past_due["object"];
    assert!(object["last_transaction_id"].is_string(), "{past_due}");
    assert_eq!(
        object["last_transaction"]["id"], object["last_transaction_id"],
        "{past_due}"
    );
    // Nothing more is due on an unpaid subscription.
    advance(&api, end + 40 * DAY_MS).await;
    assert_eq!(transactions(&api, &sub).await.len(), 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_pauses_resumes_and_trials_follow_the_state_machine() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let hook = hook(&api).await;
    let prod = product(&api, json!({})).await;

    // The store's settings: the defaults, then a change checked field by field.
    let defaults = api.get("/v1/store/settings").await.body;
    assert_eq!(
        defaults,
        json!({"object": "store_settings", "default_cancel_mode": "scheduled",
               "late_usage_grace_seconds": GRACE / 1000, "affiliate_commission_percent": "0",
               "referral_base_url": null})
    );
    let bad = assert_error(
        &api.post(
            "/v1/store/settings",
            json!({"default_cancel_mode": "never"}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad["param"], "default_cancel_mode");
    let too_long = assert_error(
        &api.post(
            "/v1/store/settings",
            json!({"late_usage_grace_seconds": 999_999_999}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(too_long["param"], "late_usage_grace_seconds");
    let immediate = api
        .post(
            "/v1/store/settings",
            json!({"default_cancel_mode": "immediate"}),
        )
        .await;
    assert_eq!(immediate.body["default_cancel_mode"], "immediate");
    assert_eq!(immediate.body["late_usage_grace_seconds"], GRACE / 1000);
    let (quick, _) = subscribe(&api, &prod, "4242424242424242").await;
    let quick_cancel = api
        .post(&format!("/v1/subscriptions/{quick}/cancel"), json!({}))
        .await;
    assert_eq!(
        quick_cancel.body["status"], "canceled",
        "the store's default"
    );
    api.post(
        "/v1/store/settings",
        json!({"default_cancel_mode": "scheduled"}),
    )
    .await;
    // Newest first is decided by time, not by random ids.
    server.clock.advance_ms(1);

    // Scheduled cancel (the default): at the period's end, canceled.
    let (sub, _) = subscribe(&api, &prod, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let scheduled = api.post(&format!("{path}/cancel"), json!({})).await;
    assert_eq!(scheduled.status, 200, "{}", scheduled.body);
    assert_eq!(scheduled.body["status"], "scheduled_cancel");
    assert_eq!(scheduled.body["cancel_at_period_end"], true);
    let again = assert_error(
        &api.post(&format!("{path}/cancel"), json!({"mode": "scheduled"}))
            .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(again["code"], "invalid_state_transition");
    assert!(again["message"]
        .as_str()
        .unwrap()
        .contains("scheduled_cancel"));
    let bad = assert_error(
        &api.post(&format!("{path}/cancel"), json!({"mode": "later"}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad["param"], "mode");
    let end =
        parse_iso8601_ms(scheduled.body["current_period_end_date"].as_str().unwrap()).unwrap();
    advance(&api, end + 1).await;
    let s = api.get(&path).await.body;
    assert_eq!(s["status"], "canceled");
    assert_eq!(s["canceled_at"], format_iso8601_ms(end));
    assert_eq!(transactions(&api, &sub).await.len(), 1, "no renewal");
    let resume = assert_error(
        &api.post(&format!("{path}/resume"), json!({})).await,
        409,
        "invalid_request_error",
    );
    assert_eq!(resume["code"], "invalid_state_transition");

    // Scheduled with onExecute pause: paused at the end; resume starts a new period
    // due at once.
    let (paused_sub, _) = subscribe(&api, &prod, "4242424242424242").await;
    let ppath = format!("/v1/subscriptions/{paused_sub}");
    api.post(
        &format!("{ppath}/cancel"),
        json!({"mode": "scheduled", "onExecute": "pause"}),
    )
    .await;
    let pend = period_end(&api, &ppath).await;
    advance(&api, pend + 1).await;
    assert_eq!(api.get(&ppath).await.body["status"], "paused");
    let resumed = api.post(&format!("{ppath}/resume"), json!({})).await;
    assert_eq!(resumed.body["status"], "active", "{}", resumed.body);
    let now = test_now(&api).await;
    advance(&api, now + 1).await;
    assert_eq!(
        transactions(&api, &paused_sub).await.len(),
        2,
        "charged on resume"
    );

    // Pause and resume within the period; pausing twice is refused.
    let (third, _) = subscribe(&api, &prod, "4242424242424242").await;
    let tpath = format!("/v1/subscriptions/{third}");
    assert_eq!(
        api.post(&format!("{tpath}/pause"), json!({})).await.body["status"],
        "paused"
    );
    assert_error(
        &api.post(&format!("{tpath}/pause"), json!({})).await,
        409,
        "invalid_request_error",
    );
    assert_eq!(
        api.post(&format!("{tpath}/resume"), json!({})).await.body["status"],
        "active"
    );
    let immediate = api
        .post(&format!("{tpath}/cancel"), json!({"mode": "immediate"}))
        .await;
    assert_eq!(immediate.body["status"], "canceled");

    // A trial: trialing, then the first period is charged when it ends.
    let trial = product(&api, json!({"name": "Trial", "trial_period_days": 7})).await;
    let (trialing, _) = subscribe(&api, &trial, "4242424242424242").await;
    let trpath = format!("/v1/subscriptions/{trialing}");
    let s = api.get(&trpath).await.body;
    assert_eq!(s["status"], "trialing");
    let trial_end = parse_iso8601_ms(s["trial_end_date"].as_str().unwrap()).unwrap();
    advance(&api, trial_end + 1).await;
    let s = api.get(&trpath).await.body;
    assert_eq!(s["status"], "active", "{s}");
    let txs = transactions(&api, &trialing).await;
    assert_eq!(txs.len(), 2);
    assert_eq!(txs[1]["amount"], 1000);
    assert_eq!(txs[1]["period_start"], trial_end);

    // A discount expires by the test clock too.
    let at = test_now(&api).await;
    let code = api
        .post(
            "/v1/discounts",
            json!({"name": "Soon", "code": "SOON", "type": "percentage", "amount": 10,
                   "duration": "once", "expiry_date": format_iso8601_ms(at + 2 * DAY_MS)}),
        )
        .await;
    assert_eq!(code.body["status"], "active", "{}", code.body);
    advance(&api, at + 3 * DAY_MS).await;
    assert_eq!(
        api.get("/v1/discounts?discount_code=SOON").await.body["status"],
        "expired"
    );

    // Lists filter by status and customer.
    let canceled = api.get("/v1/subscriptions?status=canceled").await.body;
    let ids: Vec<&str> = canceled["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![third.as_str(), sub.as_str(), quick.as_str()]);
    // A listed subscription is the object a retrieve answers: its customer and last
    // transaction embedded, not ids alone.
    for listed in canceled["data"].as_array().unwrap() {
        let id = listed["id"].as_str().unwrap();
        let retrieved = api.get(&format!("/v1/subscriptions/{id}")).await.body;
        assert_eq!(listed, &retrieved);
        assert!(listed["customer"]["email"].is_string(), "{listed}");
        assert!(listed["last_transaction"]["amount"].is_number(), "{listed}");
    }
    assert_error(
        &api.get("/v1/subscriptions?status=gone").await,
        400,
        "invalid_request_error",
    );
    for path in [
        "/v1/subscriptions?customer_id=cus_nope",
        "/v1/transactions?customer_id=cus_nope",
    ] {
        let missing = assert_error(&api.get(path).await, 404, "invalid_request_error");
        assert_eq!(missing["param"], "customer_id");
    }

    let types = event_types(&api, &hook).await;
    for expected in [
        "subscription.scheduled_cancel",
        "subscription.canceled",
        "subscription.paused",
        "subscription.trialing",
    ] {
        assert!(
            types.iter().any(|t| t == expected),
            "{expected} in {types:?}"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_upgrades_are_prorated_by_the_time_left() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let hook = hook(&api).await;
    let basic = product(&api, json!({"name": "Basic"})).await;
    let pro = product(&api, json!({"name": "Pro", "price": 3000})).await;
    let euro = product(&api, json!({"name": "Euro", "currency": "eur"})).await;
    let yearly = product(
        &api,
        json!({"name": "Yearly", "billing_period": "every-year"}),
    )
    .await;
    let (sub, _) = subscribe(&api, &basic, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let s = api.get(&path).await.body;
    let start = parse_iso8601_ms(s["current_period_start_date"].as_str().unwrap()).unwrap();
    let end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    let item = s["items"][0]["id"].as_str().unwrap().to_string();
    let prorated = |old: i64, new: i64, at: i64| {
        let (left, total) = ((end - at) / 1000, (end - start) / 1000);
        let exact = (new - old) as f64 * left as f64 / total as f64;
        exact.round() as i64
    };

    // Bad input names its field; nothing changes.
    for (body, param) in [
        (json!({"product_id": euro}), "product_id"),
        (json!({"product_id": yearly}), "product_id"),
        (
            json!({"product_id": pro, "update_behavior": "later"}),
            "update_behavior",
        ),
        (json!({}), "product_id"),
    ] {
        let error = assert_error(
            &api.post(&format!("{path}/upgrade"), body).await,
            400,
            "invalid_request_error",
        );
        assert_eq!(error["param"], param);
    }
    let missing = assert_error(
        &api.post(
            &format!("{path}/upgrade"),
            json!({"product_id": "prod_nope"}),
        )
        .await,
        404,
        "invalid_request_error",
    );
    assert_eq!(missing["param"], "product_id");
    // So is an item id the subscription does not have, or a product it names.
    for (item, param) in [
        (json!({"id": "si_nope", "units": 2}), "items[0].id"),
        (
            json!({"product_id": "prod_nope", "units": 2}),
            "items[0].product_id",
        ),
    ] {
        let missing = assert_error(
            &api.post(&path, json!({ "items": [item] })).await,
            404,
            "invalid_request_error",
        );
        assert_eq!(missing["code"], "resource_missing");
        assert_eq!(missing["param"], param);
    }
    // Metadata has a checkout's limits: too many keys, a key or a value too long.
    {
        use tally_domain::limits::{
            MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS,
        };
        let many: serde_json::Map<String, Value> = (0..=MAX_METADATA_KEYS)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect();
        let long_key = "k".repeat(MAX_METADATA_KEY_CHARS + 1);
        for (metadata, param) in [
            (Value::Object(many), "metadata".to_string()),
            (
                json!({ long_key.clone(): "v" }),
                format!("metadata.{long_key}"),
            ),
            (
                json!({"a": "v".repeat(MAX_METADATA_VALUE_CHARS + 1)}),
                "metadata.a".to_string(),
            ),
        ] {
            let refused = assert_error(
                &api.post(&path, json!({ "metadata": metadata })).await,
                400,
                "invalid_request_error",
            );
            assert_eq!(refused["param"], param.as_str());
        }
        assert_eq!(
            api.get(&path).await.body["metadata"],
            json!({}),
            "nothing kept"
        );
    }

    // A third of the way in, an upgrade is charged now: the difference for the time
    // left. The preview says so first, writing nothing.
    let third = start + (end - start) / 3;
    advance(&api, third).await;
    let preview = api.get(&format!("{path}/upcoming?product_id={pro}")).await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(
        preview.body["proration_now"]["amount"],
        prorated(1000, 3000, third)
    );
    assert_eq!(
        preview.body["lines"][0]["amount"], 3000,
        "the next period at Pro"
    );
    assert_eq!(transactions(&api, &sub).await.len(), 1);
    assert_eq!(
        api.get(&path).await.body["product"]["id"],
        basic.as_str(),
        "a preview changes nothing"
    );
    let upgraded = api
        .post(&format!("{path}/upgrade"), json!({"product_id": pro}))
        .await;
    assert_eq!(upgraded.status, 200, "{}", upgraded.body);
    assert_eq!(upgraded.body["product"]["id"], pro.as_str());
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2);
    assert_eq!(txs[1]["amount"], prorated(1000, 3000, third), "{}", txs[1]);
    assert!(txs[1]["lines"][0]["description"]
        .as_str()
        .unwrap()
        .starts_with("proration"));

    // Two units, carried to the renewal (the default for updates).
    let more = api
        .post(&path, json!({"items": [{"id": item, "units": 2}]}))
        .await;
    assert_eq!(more.status, 200, "{}", more.body);
    assert_eq!(more.body["items"][0]["units"], 2);
    assert_eq!(
        more.body["pending_lines"][0]["amount"],
        prorated(3000, 6000, third)
    );
    assert_eq!(
        transactions(&api, &sub).await.len(),
        2,
        "nothing charged now"
    );

    // An add-on item, not prorated; removing the main item is refused.
    let added = api
        .post(
            &path,
            json!({"items": [{"product_id": basic, "units": 1}], "update_behavior": "proration-none"}),
        )
        .await;
    assert_eq!(added.status, 200, "{}", added.body);
    let items = added.body["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    let addon = items[1]["id"].as_str().unwrap().to_string();
    let refused = assert_error(
        &api.post(&path, json!({"items": [{"id": item, "units": 0}]}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(refused["param"], "items[0].units");
    let wrong_currency = assert_error(
        &api.post(&path, json!({"items": [{"product_id": euro}]}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(wrong_currency["param"], "items[0].product_id");

    // Half way, a downgrade back to Basic credits the time left to the renewal.
    let half = start + (end - start) / 2;
    advance(&api, half).await;
    let down = api
        .post(
            &format!("{path}/upgrade"),
            json!({"product_id": basic, "update_behavior": "proration-charge"}),
        )
        .await;
    assert_eq!(down.status, 200, "{}", down.body);
    let credit = prorated(2 * 3000 + 1000, 2 * 1000 + 1000, half);
    assert!(credit < 0);
    assert_eq!(down.body["pending_lines"][1]["amount"], credit);

    // The renewal: the items for the next period plus what was carried.
    advance(&api, end + GRACE).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    let renewal = &txs[2];
    let expected = 2 * 1000 + 1000 + prorated(3000, 6000, third) + credit;
    assert_eq!(renewal["amount"], expected, "{renewal}");
    let sum: i64 = renewal["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["amount"].as_i64().unwrap())
        .sum();
    assert_eq!(sum, expected);
    let s = api.get(&path).await.body;
    assert_eq!(s["pending_lines"], json!([]));

    // Removing the add-on; a canceled subscription changes no more.
    let removed = api
        .post(&path, json!({"items": [{"id": addon, "units": 0}]}))
        .await;
    assert_eq!(removed.body["items"].as_array().unwrap().len(), 1);
    api.post(&format!("{path}/cancel"), json!({"mode": "immediate"}))
        .await;
    let frozen = assert_error(
        &api.post(&format!("{path}/upgrade"), json!({"product_id": pro}))
            .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(frozen["code"], "invalid_state_transition");
    assert!(
        event_types(&api, &hook)
            .await
            .iter()
            .filter(|t| *t == "subscription.update")
            .count()
            >= 4
    );
    server.stop().await;
}

/// A correction of usage already billed (a void, an amendment) is credited on the
/// next charge, one `usage correction` line naming the meter and the period, and
/// the upcoming charge shows it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrections_of_billed_usage_are_credited_on_the_next_charge() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let calls = calls_meter(&api).await;
    let prod = product(
        &api,
        json!({"usage_prices": [{"meter_id": calls, "unit_price": "2.5", "free_allowance": 2,
            "settlement_mode": "invoice"}]}),
    )
    .await;
    let (sub, cus) = subscribe(&api, &prod, "4242424242424242").await;
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    // Six calls in the first period: 6 - 2 free = 4 x 2.5 = 10.
    let events: Vec<Value> = (0..6)
        .map(|i| json!({"name": "api_call", "customer_id": cus, "event_id": format!("c{i}")}))
        .collect();
    let ingested = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    advance(&api, end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2, "{txs:?}");
    assert_eq!(txs[1]["amount"], 1010, "{}", txs[1]);

    // Two of the billed calls were sent by mistake, one more was sent twice under
    // another id and is amended away (renamed out of the meter).
    let voided = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["c0", "c1"], "reason": "test traffic"}),
        )
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    let amended = api
        .post(
            "/v1/events/c2/amend",
            json!({"event": {"name": "api_call.retry"}, "reason": "a retry"}),
        )
        .await;
    assert_eq!(amended.status, 200, "{}", amended.body);
    server.engine.wait_caught_up().await.unwrap();
    // 3 calls now: 1 billable, 2.5 -> 3; billed 10: 7 back, 3 units fewer.
    let upcoming = api.get(&format!("/v1/subscriptions/{sub}/upcoming")).await;
    assert_eq!(upcoming.status, 200, "{}", upcoming.body);
    let correction = upcoming.body["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| {
            l["description"]
                .as_str()
                .unwrap()
                .starts_with("usage correction of meter")
        })
        .cloned()
        .unwrap_or_else(|| panic!("no correction line: {}", upcoming.body));
    assert_eq!(correction["meter_id"], calls.as_str());
    assert_eq!(correction["quantity"], "-3");
    assert_eq!(correction["amount"], -7);
    let description = correction["description"].as_str().unwrap();
    assert!(
        description.contains(&format_iso8601_ms(end)),
        "names the period: {correction}"
    );
    // Two voids and one amendment: three events of the period taken out.
    assert!(
        description.ends_with(": 3 events voided"),
        "names the corrected events: {correction}"
    );
    assert_eq!(upcoming.body["amount"], 993, "{}", upcoming.body);

    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let next_end = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    advance(&api, next_end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    assert_eq!(txs[2]["amount"], 993, "{}", txs[2]);
    // Credited once: the charge after it has no correction.
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    let later = parse_iso8601_ms(s["current_period_end_date"].as_str().unwrap()).unwrap();
    advance(&api, later + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 4, "{txs:?}");
    assert_eq!(txs[3]["amount"], 1000, "{}", txs[3]);
    server.stop().await;
}

/// The `usage of meter` lines of a transaction or preview: (description, quantity,
/// amount).
fn usage_lines(charge: &Value) -> Vec<(String, String, i64)> {
    charge["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| !l["meter_id"].is_null())
        .map(|l| {
            (
                l["description"].as_str().unwrap().to_string(),
                l["quantity"].as_str().unwrap().to_string(),
                l["amount"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_before_an_upgrade_is_billed_at_the_price_it_was_used_under() {
    let (_g, dir, server, api, keys) = setup().await;
    let calls = calls_meter(&api).await;
    let basic = product(
        &api,
        json!({"name": "Basic", "usage_prices": [{"meter_id": calls, "unit_price": 2,
            "settlement_mode": "invoice"}]}),
    )
    .await;
    let pro = product(
        &api,
        json!({"name": "Pro", "price": 3000, "usage_prices": [{"meter_id": calls,
            "unit_price": 1, "settlement_mode": "invoice"}]}),
    )
    .await;
    let (sub, cus) = subscribe(&api, &basic, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let end = period_end(&api, &path).await;
    let ingest = |ids: Vec<String>, at: Option<i64>| ingest_calls(&api, &cus, ids, at);
    // Five calls under Basic (2 each), then the upgrade a minute later, then three
    // calls under Pro (1 each).
    let before = test_now(&api).await;
    ingest((0..5).map(|i| format!("b{i}")).collect(), None).await;
    advance(&api, before + 60_000).await;
    let preview = api.get(&format!("{path}/upcoming?product_id={pro}")).await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    let previewed = usage_lines(&preview.body);
    assert!(previewed[0].0.contains("under Basic"), "{previewed:?}");
    assert_eq!((previewed[0].1.as_str(), previewed[0].2), ("5", 10));
    let upgraded = api
        .post(
            &format!("{path}/upgrade"),
            json!({"product_id": pro, "update_behavior": "proration-none"}),
        )
        .await;
    assert_eq!(upgraded.status, 200, "{}", upgraded.body);
    let upgraded_at = test_now(&api).await;
    advance(&api, upgraded_at + 120_000).await;
    ingest((0..3).map(|i| format!("p{i}")).collect(), None).await;
    server.engine.wait_caught_up().await.unwrap();

    let upcoming = api.get(&format!("{path}/upcoming")).await;
    assert_eq!(upcoming.status, 200, "{}", upcoming.body);
    let lines = usage_lines(&upcoming.body);
    assert_eq!(lines.len(), 2, "{}", upcoming.body);
    assert!(lines[0].0.contains("under Basic"), "{lines:?}");
    assert_eq!((lines[0].1.as_str(), lines[0].2), ("5", 10), "{lines:?}");
    assert_eq!((lines[1].1.as_str(), lines[1].2), ("3", 3), "{lines:?}");
    assert_eq!(upcoming.body["amount"], 3013, "{}", upcoming.body);

    // Kept across a restart, and billed once at the renewal.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    advance(&api, end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2, "{txs:?}");
    assert_eq!(txs[1]["amount"], 3013, "{}", txs[1]);
    assert_eq!(
        usage_lines(&txs[1]),
        lines,
        "the renewal bills what the preview showed"
    );

    // A call of the Basic minutes that arrives late is billed at Basic's price with
    // the next charge; the period after the renewal starts at Pro's prices alone.
    let late = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "late",
                "timestamp": format_iso8601_ms(before)}]}),
        )
        .await;
    assert_eq!(late.status, 202, "{}", late.body);
    server.engine.wait_caught_up().await.unwrap();
    let next_end = period_end(&api, &path).await;
    advance(&api, next_end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    let lines = usage_lines(&txs[2]);
    assert!(
        lines
            .iter()
            .any(|(d, q, a)| d.starts_with("late usage of meter") && q == "1" && *a == 2),
        "{lines:?}"
    );
    assert_eq!(txs[2]["amount"], 3002, "{}", txs[2]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_of_a_period_that_ended_during_a_pause_is_billed_at_the_resume() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let calls = calls_meter(&api).await;
    let prod = invoiced_calls_product(&api, &calls).await;
    // Paused mid-period, resumed after the period ended: the period's usage is
    // billed with the resume's charge.
    let (sub, cus) = subscribe(&api, &prod, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let events: Vec<Value> = (0..5)
        .map(|i| json!({"name": "api_call", "customer_id": cus, "event_id": format!("a{i}")}))
        .collect();
    let ingested = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    let now = test_now(&api).await;
    advance(&api, now + 60_000).await;
    assert_eq!(
        api.post(&format!("{path}/pause"), json!({})).await.status,
        200
    );
    let end = period_end(&api, &path).await;
    advance(&api, end + 5 * DAY_MS).await;
    let resumed = api.post(&format!("{path}/resume"), json!({})).await;
    assert_eq!(resumed.status, 200, "{}", resumed.body);
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2, "{txs:?}");
    let usage: Vec<(String, i64)> = txs[1]["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["amount"].as_i64() != Some(0) && !l["meter_id"].is_null())
        .map(|l| {
            (
                l["description"].as_str().unwrap().to_string(),
                l["amount"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(usage.len(), 1, "{}", txs[1]);
    assert_eq!(usage[0].1, 10, "five calls at 2: {}", txs[1]);
    assert!(usage[0].0.contains(&format_iso8601_ms(end)), "{usage:?}");
    assert_eq!(txs[1]["amount"], 1010, "{}", txs[1]);
    // Billed once: the next renewal bills only its own period's usage (none).
    let next_end = period_end(&api, &path).await;
    advance(&api, next_end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    assert_eq!(txs[2]["amount"], 1000, "{}", txs[2]);

    // A scheduled pause bills the period's usage at its end; the resume does not
    // bill it again.
    let (sub, cus) = subscribe(&api, &prod, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let events: Vec<Value> = (0..3)
        .map(|i| json!({"name": "api_call", "customer_id": cus, "event_id": format!("s{i}")}))
        .collect();
    let ingested = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    let scheduled = api
        .post(
            &format!("{path}/cancel"),
            json!({"mode": "scheduled", "onExecute": "pause"}),
        )
        .await;
    assert_eq!(scheduled.status, 200, "{}", scheduled.body);
    let end =
        parse_iso8601_ms(scheduled.body["current_period_end_date"].as_str().unwrap()).unwrap();
    advance(&api, end + DAY_MS).await;
    assert_eq!(api.get(&path).await.body["status"], "paused");
    let resumed = api.post(&format!("{path}/resume"), json!({})).await;
    assert_eq!(resumed.status, 200, "{}", resumed.body);
    let txs = transactions(&api, &sub).await;
    let amounts: Vec<i64> = txs.iter().map(|t| t["amount"].as_i64().unwrap()).collect();
    assert_eq!(
        amounts,
        [1000, 6, 1000],
        "checkout, final usage, resume: {txs:?}"
    );
    server.stop().await;
}

/// Usage of the last period of a scheduled cancel that arrives after its final
/// charge, within the grace, is billed once the grace passed, in a charge of its
/// own; an immediate cancel during the grace bills nothing more; one with nothing
/// late charges nothing and emits nothing; all of it across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_usage_of_a_scheduled_cancels_last_period_is_billed_after_the_grace() {
    let (_g, dir, server, api, keys) = setup().await;
    let hook = hook(&api).await;
    let calls = calls_meter(&api).await;
    let prod = invoiced_calls_product(&api, &calls).await;
    let start = test_now(&api).await;
    // Three subscriptions, each cancelled (or paused) at the period's end.
    let (late, late_cus) = subscribe(&api, &prod, "4242424242424242").await;
    let (quiet, quiet_cus) = subscribe(&api, &prod, "4242424242424242").await;
    let (paused, paused_cus) = subscribe(&api, &prod, "4242424242424242").await;
    for (sub, body) in [
        (&late, json!({})),
        (&quiet, json!({})),
        (&paused, json!({"mode": "scheduled", "onExecute": "pause"})),
    ] {
        let answer = api
            .post(&format!("/v1/subscriptions/{sub}/cancel"), body)
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    for (cus, tag) in [(&late_cus, "l"), (&quiet_cus, "q"), (&paused_cus, "p")] {
        let ids = (0..3).map(|i| format!("{tag}{i}")).collect();
        ingest_calls(&api, cus, ids, None).await;
    }
    let path = format!("/v1/subscriptions/{late}");
    let end = period_end(&api, &path).await;

    // The period's end: each charges its final usage (3 calls at 2) and ends.
    advance(&api, end + 60_000).await;
    for sub in [&late, &quiet, &paused] {
        let amounts: Vec<i64> = transactions(&api, sub)
            .await
            .iter()
            .map(|t| t["amount"].as_i64().unwrap())
            .collect();
        assert_eq!(amounts, [1000, 6], "checkout and final usage of {sub}");
    }
    let s = api.get(&path).await.body;
    assert_eq!(s["status"], "canceled");
    assert_eq!(s["next_transaction_date"], Value::Null, "{s}");
    assert_error(
        &api.get(&format!("{path}/upcoming")).await,
        404,
        "invalid_request_error",
    );
    // Within the grace: two late calls of the period, and one after it (never
    // billed: the subscription had ended); the paused one is cancelled now,
    // which bills nothing more, so its late call is not billed either.
    let in_period = Some(start + 120_000);
    let late_calls = vec!["l-late-1".into(), "l-late-2".into()];
    ingest_calls(&api, &late_cus, late_calls, in_period).await;
    ingest_calls(&api, &late_cus, vec!["l-after".into()], None).await;
    ingest_calls(&api, &paused_cus, vec!["p-late".into()], in_period).await;
    let canceled = api
        .post(
            &format!("/v1/subscriptions/{paused}/cancel"),
            json!({"mode": "immediate"}),
        )
        .await;
    assert_eq!(canceled.body["status"], "canceled", "{}", canceled.body);
    let events_before = event_types(&api, &hook).await.len();

    // What is due survives a restart.
    server.engine.wait_caught_up().await.unwrap();
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    advance(&api, end + GRACE + 60_000).await;
    let txs = transactions(&api, &late).await;
    let amounts: Vec<i64> = txs.iter().map(|t| t["amount"].as_i64().unwrap()).collect();
    assert_eq!(amounts, [1000, 6, 4], "the two late calls at 2: {txs:?}");
    let charge = &txs[2];
    assert_eq!(charge["description"], "late usage of Pro", "{charge}");
    let lines = charge["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 1, "{charge}");
    assert!(
        lines[0]["description"]
            .as_str()
            .unwrap()
            .starts_with(&format!("late usage of meter {calls}")),
        "{charge}"
    );
    assert_eq!(lines[0]["quantity"], "2");
    let s = api.get(&path).await.body;
    assert_eq!(s["status"], "canceled");
    assert_eq!(s["last_transaction_id"], charge["id"]);
    for sub in [&quiet, &paused] {
        assert_eq!(
            transactions(&api, sub).await.len(),
            2,
            "nothing late: {sub}"
        );
    }
    // The late charge says it was paid; the quiet one emitted nothing.
    let types = event_types(&api, &hook).await;
    assert_eq!(
        types[events_before..],
        ["subscription.paid".to_string()],
        "{types:?}"
    );
    // Billed once: nothing more is due on any of them.
    advance(&api, end + 40 * DAY_MS).await;
    assert_eq!(transactions(&api, &late).await.len(), 3);
    server.stop().await;
}

/// A scheduled cancel made after the period ended, in the late-usage grace before
/// the renewal, ends the subscription in the same request with the period's
/// usage billed (and with `onExecute` `pause`, pauses it): it is never left
/// `scheduled_cancel` with its period over, waiting for the scheduler.
#[tokio::test]
async fn a_scheduled_cancel_after_the_periods_end_ends_it_in_the_request() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let calls = calls_meter(&api).await;
    let prod = invoiced_calls_product(&api, &calls).await;
    let (cancel, cancel_cus) = subscribe(&api, &prod, "4242424242424242").await;
    let (pause, _) = subscribe(&api, &prod, "4242424242424242").await;
    let ids = (0..3).map(|i| format!("c{i}")).collect();
    ingest_calls(&api, &cancel_cus, ids, None).await;
    let path = format!("/v1/subscriptions/{cancel}");
    let end = period_end(&api, &path).await;
    // Exactly at the end, then inside the grace: the renewal is not due yet.
    for at in [end, end + GRACE / 2] {
        let moved = advance(&api, at).await;
        assert_eq!(moved.status, 200, "{}", moved.body);
        let s = api.get(&path).await.body;
        assert_eq!(s["status"], "active", "{s}");
        assert_eq!(transactions(&api, &cancel).await.len(), 1, "no renewal yet");
    }
    server.engine.wait_caught_up().await.unwrap();
    for (sub, body, status) in [
        (&cancel, json!({"mode": "scheduled"}), "canceled"),
        (
            &pause,
            json!({"mode": "scheduled", "onExecute": "pause"}),
            "paused",
        ),
    ] {
        let answer = api
            .post(&format!("/v1/subscriptions/{sub}/cancel"), body)
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.body["status"], status, "{}", answer.body);
        let stored = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
        assert_eq!(stored["status"], status, "{stored}");
    }
    // The period's usage (3 calls at 2) was billed by that request, once; the
    // renewal never comes.
    let amounts = |txs: Vec<Value>| -> Vec<i64> {
        txs.iter().map(|t| t["amount"].as_i64().unwrap()).collect()
    };
    assert_eq!(amounts(transactions(&api, &cancel).await), [1000, 6]);
    assert_eq!(amounts(transactions(&api, &pause).await), [1000]);
    advance(&api, end + 40 * DAY_MS).await;
    assert_eq!(amounts(transactions(&api, &cancel).await), [1000, 6]);
    assert_eq!(amounts(transactions(&api, &pause).await), [1000]);
    server.stop().await;
}

/// The balance of `customer`'s credits account `name` ("none" without one).
async fn balance_named(api: &Api, customer: &str, name: &str) -> String {
    let list = api
        .get(&format!(
            "/v1/customer-credits/accounts?customer_id={customer}"
        ))
        .await
        .body;
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|account| account["name"] == name)
        .map_or("none".to_string(), |account| {
            account["balance"].as_str().unwrap().to_string()
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_grants_its_credits_for_each_period_it_pays() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let features = json!([{"type": "customer_credits",
        "customer_credits": {"amount": "5", "bucket_name": "monthly"}}]);
    let prod = product(&api, json!({"features": features})).await;
    let pricier = product(
        &api,
        json!({"name": "Max", "price": 2000, "features": features}),
    )
    .await;
    let balance = |cus: String| {
        let api = api.clone();
        async move { balance_named(&api, &cus, "monthly").await }
    };
    let (sub, cus) = subscribe(&api, &prod, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    assert_eq!(balance(cus.clone()).await, "5", "the checkout's period");
    // An upgrade charges a proration: no new period, no credits.
    let upgraded = api
        .post(&format!("{path}/upgrade"), json!({"product_id": pricier}))
        .await;
    assert_eq!(upgraded.status, 200, "{}", upgraded.body);
    assert_eq!(
        transactions(&api, &sub).await.len(),
        2,
        "the proration was charged"
    );
    assert_eq!(balance(cus.clone()).await, "5");
    // Each renewal pays a period: its credits, once, however the clock moves.
    for n in 1..=2 {
        let end = period_end(&api, &path).await;
        advance(&api, end + GRACE + 60_000).await;
        advance(&api, end + GRACE + 120_000).await;
        assert_eq!(balance(cus.clone()).await, (5 + 5 * n).to_string());
    }
    // A declined renewal pays nothing and grants nothing.
    let (sub, cus) = subscribe(&api, &prod, "4000000000000341").await;
    let path = format!("/v1/subscriptions/{sub}");
    let end = period_end(&api, &path).await;
    advance(&api, end + GRACE + 60_000).await;
    assert_eq!(api.get(&path).await.body["status"], "past_due");
    assert_eq!(balance(cus.clone()).await, "5");
    server.stop().await;
}

/// An add-on item's product grants its credits when the item is added, and again
/// for each period a charge pays while it is on; a change of its units waits for
/// the next period, and a removed item grants nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_on_item_grants_its_credits_when_added_and_for_each_period() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let main = product(
        &api,
        json!({"features": [{"type": "customer_credits",
            "customer_credits": {"amount": "5", "bucket_name": "monthly"}}]}),
    )
    .await;
    let addon = product(
        &api,
        json!({"name": "Credits add-on", "price": 100, "features": [{"type": "customer_credits",
            "customer_credits": {"amount": "7", "bucket_name": "extra"}}]}),
    )
    .await;
    let balances = |cus: String| {
        let api = api.clone();
        async move {
            (
                balance_named(&api, &cus, "monthly").await,
                balance_named(&api, &cus, "extra").await,
            )
        }
    };
    let (sub, cus) = subscribe(&api, &main, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    assert_eq!(balances(cus.clone()).await, ("5".into(), "none".into()));
    // Added with 2 units: 2 x 7 at once, into its own bucket.
    let updated = set_items(&api, &path, json!([{"product_id": addon, "units": 2}])).await;
    let item = item_of(&updated, &addon);
    assert_eq!(balances(cus.clone()).await, ("5".into(), "14".into()));
    // A product the subscription has an item of already is refused as a new item
    // (its units are set on that item instead), and grants nothing.
    for product in [&addon, &main] {
        let refused = assert_error(
            &api.post(
                &path,
                json!({"items": [{"product_id": product, "units": 1}]}),
            )
            .await,
            400,
            "invalid_request_error",
        );
        assert_eq!(refused["param"], "items[0].product_id", "{refused}");
    }
    assert_eq!(balances(cus.clone()).await, ("5".into(), "14".into()));
    // 3 units: nothing until the next period. An item sent without units keeps
    // its own.
    set_items(&api, &path, json!([{"id": item, "units": 3}])).await;
    let kept = set_items(&api, &path, json!([{"id": item}])).await;
    let units = kept["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == item.as_str())
        .map(|i| i["units"].clone());
    assert_eq!(units, Some(json!(3)), "{kept}");
    assert_eq!(balances(cus.clone()).await, ("5".into(), "14".into()));
    // A renewal pays a period: 5 for the product, 3 x 7 for the item, once
    // however the clock moves.
    let end = period_end(&api, &path).await;
    advance(&api, end + GRACE + 60_000).await;
    advance(&api, end + GRACE + 120_000).await;
    assert_eq!(balances(cus.clone()).await, ("10".into(), "35".into()));
    // Removed: the next renewal grants the product's credits only.
    set_items(&api, &path, json!([{"id": item, "units": 0}])).await;
    let end = period_end(&api, &path).await;
    advance(&api, end + GRACE + 60_000).await;
    assert_eq!(balances(cus.clone()).await, ("15".into(), "35".into()));
    server.stop().await;
}

/// An add-on item's `invoice` usage prices bill like the main product's, for the
/// usage from when the item was added until it is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_on_items_usage_prices_bill_its_usage_while_it_is_on() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let calls = calls_meter(&api).await;
    let main = product(&api, json!({"name": "Pro"})).await;
    let addon = product(
        &api,
        json!({"name": "Calls add-on", "price": 100, "usage_prices": [{"meter_id": calls,
            "unit_price": 2, "settlement_mode": "invoice"}]}),
    )
    .await;
    let (sub, cus) = subscribe(&api, &main, "4242424242424242").await;
    let path = format!("/v1/subscriptions/{sub}");
    let end = period_end(&api, &path).await;
    let ingest = |ids: &[&str], at: i64| {
        let api = api.clone();
        let events: Vec<Value> = ids
            .iter()
            .map(|i| {
                json!({"name": "api_call", "customer_id": cus, "event_id": i,
                       "timestamp": format_iso8601_ms(at)})
            })
            .collect();
        async move {
            let answer = api
                .post("/v1/events/ingest", json!({"events": events}))
                .await;
            assert_eq!(answer.status, 202, "{}", answer.body);
        }
    };
    // A call before the add-on: no price of its bills it.
    let start = test_now(&api).await;
    ingest(&["before"], start).await;
    advance(&api, start + 60_000).await;
    let updated = set_items(
        &api,
        &path,
        json!([{"product_id": addon, "price_id": addon, "units": 1}]),
    )
    .await;
    let item = item_of(&updated, &addon);
    ingest(&["a1", "a2", "a3"], start + 120_000).await;
    server.engine.wait_caught_up().await.unwrap();
    advance(&api, end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 2, "{txs:?}");
    assert_eq!(
        usage_lines(&txs[1]),
        vec![(format!("usage of meter {calls}"), "3".to_string(), 6)],
        "{}",
        txs[1]
    );

    // Next period: a call, the item removed, another call; the charge after it
    // bills the first only, naming the add-on it was used under.
    let next_end = period_end(&api, &path).await;
    let now = test_now(&api).await;
    ingest(&["b1"], now).await;
    advance(&api, now + 60_000).await;
    set_items(&api, &path, json!([{"id": item, "units": 0}])).await;
    ingest(&["b2"], now + 120_000).await;
    server.engine.wait_caught_up().await.unwrap();
    advance(&api, next_end + GRACE + 60_000).await;
    let txs = transactions(&api, &sub).await;
    assert_eq!(txs.len(), 3, "{txs:?}");
    let lines = usage_lines(&txs[2]);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].0.contains("under Calls add-on"), "{lines:?}");
    assert_eq!((lines[0].1.as_str(), lines[0].2), ("1", 2), "{lines:?}");
    server.stop().await;
}
