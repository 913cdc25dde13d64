//! Credit grants over real sockets: every credit belongs to a grant, debits draw by
//! priority then soonest expiry then age (each entry naming its grant), expiry by
//! record time, voids, listings, and every error.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::time::format_iso8601_ms;

async fn grant(api: &Api, account: &str, body: Value) -> Value {
    let answer = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/grants"),
            body,
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

async fn grants(api: &Api, account: &str, query: &str) -> Vec<Value> {
    let answer = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}/grants?limit=100{query}"
        ))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["data"].as_array().unwrap().clone()
}

async fn balance(api: &Api, account: &str) -> String {
    api.get(&format!("/v1/customer-credits/accounts/{account}"))
        .await
        .body["balance"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn debit(api: &Api, account: &str, amount: &str, key: &str) -> Answer {
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/debit"),
        json!({"amount": amount, "idempotency_key": key}),
    )
    .await
}

/// The account's balance equals what its active grants have left.
async fn assert_balance_is_the_active_grants(api: &Api, account: &str) {
    let left: rust_decimal::Decimal = grants(api, account, "&status=active")
        .await
        .iter()
        .map(|g| {
            g["remaining"]
                .as_str()
                .unwrap()
                .parse::<rust_decimal::Decimal>()
                .unwrap()
        })
        .sum();
    assert_eq!(balance(api, account).await, left.normalize().to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debits_draw_by_priority_then_expiry_then_age_naming_each_grant() {
    let (_g, server, api, account) = with_account("10").await;
    let initial = grants(&api, &account, "").await;
    assert_eq!(initial.len(), 1);
    assert_eq!(initial[0]["object"], "credit_grant");
    assert_eq!(initial[0]["priority"], 50);
    assert!(initial[0]["expires_at"].is_null());
    assert_eq!(initial[0]["remaining"], "10");
    let initial_id = initial[0]["id"].as_str().unwrap().to_string();
    assert!(initial_id.starts_with("grt_"));

    let first = grant(
        &api,
        &account,
        json!({"amount": "5", "idempotency_key": "a", "priority": 10, "description": "promo"}),
    )
    .await;
    assert_eq!(first["status"], "active");
    assert_eq!(first["description"], "promo");
    let soon = format_iso8601_ms(server.clock.now_ms() + 60_000);
    let expiring = grant(
        &api,
        &account,
        json!({"amount": "5", "idempotency_key": "b", "expires_at": soon}),
    )
    .await;
    assert_eq!(expiring["expires_at"], soon.as_str());
    // The same idempotency key answers the same grant.
    let again = grant(
        &api,
        &account,
        json!({"amount": "5", "idempotency_key": "a", "priority": 10}),
    )
    .await;
    assert_eq!(again["id"], first["id"]);
    assert_eq!(balance(&api, &account).await, "20");

    let drawn = debit(&api, &account, "12", "d1").await;
    assert_eq!(drawn.status, 200, "{}", drawn.body);
    let mine: Vec<(String, String)> = drawn.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["account_id"] == account.as_str())
        .map(|e| {
            (
                e["grant_id"].as_str().unwrap().to_string(),
                e["amount"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        mine,
        vec![
            (first["id"].as_str().unwrap().to_string(), "-5".to_string()),
            (
                expiring["id"].as_str().unwrap().to_string(),
                "-5".to_string()
            ),
            (initial_id.clone(), "-2".to_string()),
        ]
    );
    let sum: rust_decimal::Decimal = drawn.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e["amount"]
                .as_str()
                .unwrap()
                .parse::<rust_decimal::Decimal>()
                .unwrap()
        })
        .sum();
    assert!(sum.is_zero(), "entries sum to zero");
    let consumed = grants(&api, &account, "&status=consumed").await;
    assert_eq!(consumed.len(), 2);
    assert_eq!(
        api.get(&format!("/v1/customer-credits/grants/{initial_id}"))
            .await
            .body["remaining"],
        "8"
    );
    // The account's entries name their grants too.
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}/entries?limit=100"
        ))
        .await;
    assert!(entries.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["grant_id"]
            .as_str()
            .is_some_and(|g| g.starts_with("grt_"))));
    assert_balance_is_the_active_grants(&api, &account).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_expires_at_its_instant_by_record_time() {
    let (_g, server, api, account) = with_account("1").await;
    let at = server.clock.now_ms() + 60_000;
    let expiring = grant(&api, &account, json!({"amount": "4", "idempotency_key": "e", "priority": 0, "expires_at": format_iso8601_ms(at)})).await;
    let id = expiring["id"].as_str().unwrap().to_string();
    server.clock.set_ms(at - 1);
    assert_eq!(balance(&api, &account).await, "5");
    server.clock.set_ms(at);
    // Expired from the instant on, before any record books it.
    let read = api.get(&format!("/v1/customer-credits/grants/{id}")).await;
    assert_eq!(read.body["status"], "expired");
    assert_eq!(read.body["remaining"], "0");
    assert_eq!(balance(&api, &account).await, "1");
    let before = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}?at={}",
            format_iso8601_ms(at)
        ))
        .await;
    assert_eq!(before.body["balance"], "1");
    // A debit recorded after the instant cannot use it.
    let refused = debit(&api, &account, "2", "late").await;
    assert_eq!(
        assert_error(&refused, 409, "invalid_request_error")["code"],
        "insufficient_balance"
    );
    let taken = debit(&api, &account, "1", "fits").await;
    assert_eq!(taken.status, 200, "{}", taken.body);
    // The expiry is booked before it: an `expiry` transaction moved 4 to forfeit.
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}/entries?limit=100"
        ))
        .await;
    let expiry = entries.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["grant_id"] == id.as_str() && e["amount"] == "-4")
        .cloned()
        .expect("an expiry entry");
    assert_eq!(expiry["created_at"], format_iso8601_ms(at).as_str());
    let tx = api
        .get(&format!(
            "/v1/customer-credits/transactions/{}",
            expiry["transaction_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(tx.body["type"], "expiry");
    assert_eq!(balance(&api, &account).await, "0");
    assert_eq!(grants(&api, &account, "&status=expired").await.len(), 1);
    assert_balance_is_the_active_grants(&api, &account).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voids_and_bad_input() {
    let (_g, server, api, account) = with_account("2").await;
    let voidable = grant(
        &api,
        &account,
        json!({"amount": "3", "idempotency_key": "v"}),
    )
    .await;
    let id = voidable["id"].as_str().unwrap().to_string();
    let voided = api
        .post(&format!("/v1/customer-credits/grants/{id}/void"), json!({}))
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    assert_eq!(voided.body["status"], "voided");
    assert_eq!(voided.body["remaining"], "0");
    assert_eq!(balance(&api, &account).await, "2");
    let twice = api
        .post(&format!("/v1/customer-credits/grants/{id}/void"), json!({}))
        .await;
    assert_eq!(
        assert_error(&twice, 409, "invalid_request_error")["code"],
        "grant_not_active"
    );
    let past = format_iso8601_ms(server.clock.now_ms() - 1);
    for (body, param) in [
        (json!({"idempotency_key": "k"}), "amount"),
        (json!({"amount": "1"}), "idempotency_key"),
        (
            json!({"amount": "1", "idempotency_key": "k", "priority": 101}),
            "priority",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "priority": -1}),
            "priority",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "priority": "1"}),
            "priority",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_at": past}),
            "expires_at",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_at": "soon"}),
            "expires_at",
        ),
    ] {
        let answer = api
            .post(
                &format!("/v1/customer-credits/accounts/{account}/grants"),
                body.clone(),
            )
            .await;
        assert_eq!(
            assert_error(&answer, 400, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    let bad_status = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}/grants?status=gone"
        ))
        .await;
    assert_eq!(
        assert_error(&bad_status, 400, "invalid_request_error")["param"],
        "status"
    );
    assert_eq!(
        api.get("/v1/customer-credits/grants/grt_missing")
            .await
            .status,
        404
    );
    assert_eq!(
        api.post("/v1/customer-credits/grants/grt_missing/void", json!({}))
            .await
            .status,
        404
    );
    assert_eq!(
        api.get("/v1/customer-credits/accounts/ca_missing/grants")
            .await
            .status,
        404
    );
    assert_balance_is_the_active_grants(&api, &account).await;
    // Closing the account voids what is left.
    let closed = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/close"),
            json!({}),
        )
        .await;
    assert_eq!(closed.status, 200, "{}", closed.body);
    assert!(grants(&api, &account, "&status=active").await.is_empty());
    server.stop().await;
}

/// With nothing else touching the account, the expiry sweep books an expiry at its
/// instant and `credits.expired` is delivered with the expiry transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_books_an_expiry_at_its_instant_and_announces_it() {
    let (_g, server, api, account) = with_account("0").await;
    let endpoint = api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["credits.expired"]}),
        )
        .await
        .body;
    let hook = endpoint["id"].as_str().unwrap().to_string();
    let at = server.clock.now_ms() + 60_000;
    let expiring = grant(
        &api,
        &account,
        json!({"amount": "7", "idempotency_key": "x", "expires_at": format_iso8601_ms(at)}),
    )
    .await;
    server.clock.set_ms(at + 5);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let items = loop {
        let feed = api
            .get(&format!("/v1/webhooks/{hook}/events/pending"))
            .await;
        let items = feed.body["items"].as_array().cloned().unwrap_or_default();
        if !items.is_empty() {
            break items;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no credits.expired within 20 s: {}",
            feed.body
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["event_type"], "credits.expired");
    let envelope: Value = serde_json::from_str(items[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(envelope["object"]["type"], "expiry");
    assert_eq!(envelope["object"]["amount"], "7");
    assert_eq!(
        envelope["object"]["created_at"],
        format_iso8601_ms(at).as_str()
    );
    let entries = envelope["object"]["entries"].as_array().unwrap().clone();
    assert!(entries
        .iter()
        .any(|e| e["grant_id"] == expiring["id"] && e["amount"] == "-7"));
    assert_eq!(balance(&api, &account).await, "0");
    // Booked, so the audit's view (the posted balance) agrees too: no step ran.
    let read = api
        .get(&format!(
            "/v1/customer-credits/grants/{}",
            expiring["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(read.body["status"], "expired");
    server.stop().await;
}
