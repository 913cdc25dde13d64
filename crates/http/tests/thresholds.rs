//! Low-balance thresholds and auto-recharge over real sockets: `credits.balance_low`
//! once per crossing, a recharge grant right after the debit that went below, a
//! priced recharge charged on the customer's last card (paid, declined, no card),
//! the update endpoint, and every 400.

mod common;

use common::*;
use serde_json::{json, Value};

async fn debit(api: &Api, account: &str, amount: &str, key: &str) -> Value {
    let answer = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/debit"),
            json!({"amount": amount, "idempotency_key": key}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

/// A `cli` webhook endpoint subscribed to `events`: its id.
async fn cli_hook(api: &Api, events: &[&str]) -> String {
    let answer = api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": events}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

async fn account(api: &Api, id: &str) -> Value {
    api.get(&format!("/v1/customer-credits/accounts/{id}"))
        .await
        .body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossings_announce_once_and_a_debit_below_recharges() {
    let (_g, server, api, customer) = with_customer().await;
    let hook = cli_hook(&api, &["credits.balance_low", "credits.auto_recharged"]).await;
    let created = api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": customer, "initial_balance": "100",
                   "low_balance_threshold": "20",
                   "auto_recharge": {"threshold": "10", "amount": "50"}}),
        )
        .await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(created.body["low_balance_threshold"], "20");
    assert_eq!(
        created.body["auto_recharge"],
        json!({"threshold": "10", "amount": "50", "price": null, "currency": null})
    );
    let id = created.body["id"].as_str().unwrap().to_string();

    debit(&api, &id, "85", "d1").await; // 15: below 20, announced
    debit(&api, &id, "1", "d2").await; // 14: still below, not again
    let below_ten = debit(&api, &id, "5", "d3").await; // 9: below 10, recharged to 59
    assert_eq!(account(&api, &id).await["balance"], "59");
    debit(&api, &id, "45", "d4").await; // 14: below 20 again, announced again

    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending"))
        .await;
    let items = feed.body["items"].as_array().unwrap().clone();
    let types: Vec<&str> = items
        .iter()
        .map(|i| i["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "credits.balance_low",
            "credits.auto_recharged",
            "credits.balance_low"
        ]
    );
    let recharge: Value = serde_json::from_str(items[1]["body"].as_str().unwrap()).unwrap();
    assert_eq!(recharge["object"]["type"], "credit");
    assert_eq!(recharge["object"]["amount"], "50");
    assert_eq!(recharge["object"]["description"], "auto_recharge");
    assert_eq!(recharge["object"]["metadata"]["debit_id"], below_ten["id"]);
    let low: Value = serde_json::from_str(items[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(low["object"]["id"], id.as_str());
    // The recharge is a grant like any credit.
    let grants = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/grants?limit=100"
        ))
        .await;
    assert!(grants.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g["description"] == "auto_recharge" && g["amount"] == "50"));

    // Cleared, no recharge below the old threshold.
    let updated = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}"),
            json!({"auto_recharge": null}),
        )
        .await;
    assert_eq!(updated.status, 200, "{}", updated.body);
    assert!(updated.body["auto_recharge"].is_null());
    assert_eq!(
        updated.body["low_balance_threshold"], "20",
        "kept when absent"
    );
    debit(&api, &id, "10", "d5").await;
    assert_eq!(account(&api, &id).await["balance"], "4");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_thresholds_are_refused_naming_the_field() {
    let (_g, server, api, customer) = with_customer().await;
    for (extra, param) in [
        (json!({"low_balance_threshold": 5}), "low_balance_threshold"),
        (
            json!({"low_balance_threshold": "-1"}),
            "low_balance_threshold",
        ),
        (json!({"auto_recharge": "yes"}), "auto_recharge"),
        (
            json!({"auto_recharge": {"threshold": "1"}}),
            "auto_recharge.amount",
        ),
        (
            json!({"auto_recharge": {"amount": "1"}}),
            "auto_recharge.threshold",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "0"}}),
            "auto_recharge.amount",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "5", "price": 0, "currency": "usd"}}),
            "auto_recharge.price",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "5", "price": "500", "currency": "usd"}}),
            "auto_recharge.price",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "5", "price": 500}}),
            "auto_recharge.currency",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "5", "price": 500, "currency": "dollars"}}),
            "auto_recharge.currency",
        ),
        (
            json!({"auto_recharge": {"threshold": "1", "amount": "5", "currency": "usd"}}),
            "auto_recharge.price",
        ),
    ] {
        let mut body = json!({"customer_id": customer});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let answer = api
            .post("/v1/customer-credits/accounts", body.clone())
            .await;
        assert_eq!(
            assert_error(&answer, 400, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    let id = api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": customer}),
        )
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
    let bad = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}"),
            json!({"low_balance_threshold": "x"}),
        )
        .await;
    assert_eq!(
        assert_error(&bad, 400, "invalid_request_error")["param"],
        "low_balance_threshold"
    );
    assert_eq!(
        api.post("/v1/customer-credits/accounts/ca_missing", json!({}))
            .await
            .status,
        404
    );
    server.stop().await;
}

/// `api`'s key against a restarted `server`.
fn api_at(server: &Server, api: &Api) -> Api {
    Api::new(&server.test_url, api.key())
}

/// A customer who paid a one-time product with `card`.
async fn customer_who_paid(api: &Api, card: &str) -> String {
    customer_who_paid_with(api, card, "12/34").await
}

/// `customer_who_paid` with a card of expiry `exp`.
async fn customer_who_paid_with(api: &Api, card: &str, exp: &str) -> String {
    let product = api
        .post(
            "/v1/products",
            json!({"name": "Starter", "price": 900, "currency": "usd"}),
        )
        .await;
    assert_eq!(product.status, 200, "{}", product.body);
    let customer = api
        .post("/v1/customers", json!({"email": "buyer@example.com"}))
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
    let checkout = api
        .post(
            "/v1/checkouts",
            json!({"product_id": product.body["id"], "customer_id": customer}),
        )
        .await;
    assert_eq!(checkout.status, 200, "{}", checkout.body);
    let paid = api
        .post(
            &format!(
                "/v1/checkouts/{}/complete",
                checkout.body["id"].as_str().unwrap()
            ),
            json!({"card_number": card, "cvc": "123", "exp": exp}),
        )
        .await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    customer
}

/// An account of `customer` holding 100 with a priced auto-recharge (50 credits
/// for 2,500 minor units below 10), debited to 5.
async fn priced_account_below(api: &Api, customer: &str, key: &str) -> (String, Value) {
    let created = api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": customer, "initial_balance": "100",
                   "auto_recharge": {"threshold": "10", "amount": "50", "price": 2500, "currency": "usd"}}),
        )
        .await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(
        created.body["auto_recharge"],
        json!({"threshold": "10", "amount": "50", "price": 2500, "currency": "USD"})
    );
    let id = created.body["id"].as_str().unwrap().to_string();
    let below = debit(api, &id, "95", key).await;
    (id, below)
}

/// Polls the account until `done` holds (the scheduler charges about once a second).
async fn account_until(api: &Api, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..100 {
        let now = account(api, id).await;
        if done(&now) {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("account {id} never got there: {}", account(api, id).await);
}

async fn customer_transactions(api: &Api, customer: &str) -> Vec<Value> {
    let list = api
        .get(&format!(
            "/v1/transactions?customer_id={customer}&limit=100"
        ))
        .await;
    assert_eq!(list.status, 200, "{}", list.body);
    list.body["data"].as_array().unwrap().clone()
}

/// The customer's transactions that paid an auto-recharge.
async fn recharge_payments(api: &Api, customer: &str) -> Vec<Value> {
    customer_transactions(api, customer)
        .await
        .into_iter()
        .filter(|t| {
            t["description"]
                .as_str()
                .unwrap()
                .starts_with("auto_recharge")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priced_recharge_is_charged_on_the_last_card_then_granted() {
    let (guard, server, api, _) = with_customer().await;
    let hook = cli_hook(
        &api,
        &["credits.auto_recharged", "credits.auto_recharge_failed"],
    )
    .await;
    let customer = customer_who_paid(&api, "4242424242424242").await;
    let (id, below) = priced_account_below(&api, &customer, "p1").await;
    // Charged first: nothing is booked with the debit itself.
    assert_eq!(below["amount"], "95");
    let after = account_until(&api, &id, |a| a["balance"] == "55").await;
    assert_eq!(after["auto_recharge"]["price"], 2500, "kept after a charge");
    // A second debit further below while nothing is pending recharges again, once.
    debit(&api, &id, "50", "p2").await;
    account_until(&api, &id, |a| a["balance"] == "55").await;
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
    assert_eq!(
        account(&api, &id).await["balance"],
        "55",
        "one recharge per debit"
    );

    let payments = recharge_payments(&api, &customer).await;
    assert_eq!(payments.len(), 2, "{payments:?}");
    for payment in &payments {
        assert_eq!(payment["amount"], 2500);
        assert_eq!(payment["currency"], "USD");
        assert_eq!(payment["status"], "paid");
        assert_eq!(payment["card_last4"], "4242");
    }
    let grants = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/grants?limit=100"
        ))
        .await;
    let paid_by: Vec<&Value> = grants.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["description"] == "auto_recharge")
        .map(|g| &g["metadata"]["payment_id"])
        .collect();
    assert_eq!(paid_by.len(), 2, "{}", grants.body);
    for payment in &payments {
        assert!(
            paid_by.contains(&&payment["id"]),
            "each grant names its payment"
        );
    }
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending"))
        .await;
    assert_eq!(feed.status, 200, "{}", feed.body);
    let types: Vec<&str> = feed.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["credits.auto_recharged", "credits.auto_recharged"]);

    // A restart keeps the recharges, booked once, and charges nothing more.
    server.stop().await;
    let server = Server::start(guard.path(), default_config()).await;
    server.engine.wait_caught_up().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    assert_eq!(account(&api_at(&server, &api), &id).await["balance"], "55");
    let count = customer_transactions(&api_at(&server, &api), &customer)
        .await
        .len();
    assert_eq!(count, 3, "the checkout and two recharges");
    server.stop().await;
}

/// The last card's expiry is kept with its payment: once its month is over (by
/// the store's clock), a priced recharge on it is declined like any decline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_card_on_file_declines_a_priced_recharge() {
    let (_g, server, api, _) = with_customer().await;
    // A card of this month, by the store's clock.
    let (now, exp) = test_time_and_expiry(&api).await;
    let customer = customer_who_paid_with(&api, "4242424242424242", &exp).await;
    // Two months on, the card has expired.
    let later = now + 62 * tally_domain::time::DAY_MS;
    let moved = api
        .post(
            "/v1/test-clock/advance",
            json!({"to": tally_domain::time::format_iso8601_ms(later)}),
        )
        .await;
    assert_eq!(moved.status, 200, "{}", moved.body);
    let (id, _) = priced_account_below(&api, &customer, "x1").await;
    let after = account_until(&api, &id, |a| a["auto_recharge"].is_null()).await;
    assert_eq!(after["balance"], "5", "nothing booked");
    assert_eq!(
        recharge_payments(&api, &customer).await,
        Vec::<Value>::new()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_or_missing_card_books_nothing_and_clears_the_recharge() {
    let (_g, server, api, unpaid) = with_customer().await;
    let hook = cli_hook(
        &api,
        &["credits.auto_recharged", "credits.auto_recharge_failed"],
    )
    .await;
    // The card that pays once and declines every later charge, and a customer who
    // never paid.
    let declining = customer_who_paid(&api, "4000000000000341").await;
    let mut accounts = Vec::new();
    for (n, customer) in [&declining, &unpaid].into_iter().enumerate() {
        let (id, _) = priced_account_below(&api, customer, &format!("q{n}")).await;
        let after = account_until(&api, &id, |a| a["auto_recharge"].is_null()).await;
        assert_eq!(after["balance"], "5", "nothing booked");
        accounts.push(id);
    }
    // No payment was kept for either.
    for customer in [&declining, &unpaid] {
        assert_eq!(recharge_payments(&api, customer).await, Vec::<Value>::new());
    }
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending"))
        .await;
    let items = feed.body["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{}", feed.body);
    for (item, id) in items.iter().zip(&accounts) {
        assert_eq!(item["event_type"], "credits.auto_recharge_failed");
        let body: Value = serde_json::from_str(item["body"].as_str().unwrap()).unwrap();
        assert_eq!(body["object"]["id"], id.as_str());
        assert!(body["object"]["auto_recharge"].is_null(), "{body}");
    }
    // Cleared: a later debit below recharges nothing.
    debit(&api, &accounts[0], "1", "p9").await;
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    assert_eq!(account(&api, &accounts[0]).await["balance"], "4");
    server.stop().await;
}
