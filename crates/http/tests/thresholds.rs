//! Low-balance thresholds and auto-recharge over real sockets: `credits.balance_low`
//! once per crossing, a recharge grant right after the debit that went below, the
//! update endpoint, and every 400.

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

async fn account(api: &Api, id: &str) -> Value {
    api.get(&format!("/v1/customer-credits/accounts/{id}"))
        .await
        .body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossings_announce_once_and_a_debit_below_recharges() {
    let (_g, server, api, customer) = with_customer().await;
    let hook = api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["credits.balance_low", "credits.auto_recharged"]}),
        )
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
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
        json!({"threshold": "10", "amount": "50"})
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
