//! Credit reservations over real sockets: hold, commit (whole or part, twice),
//! release, expiry by record time, what debits and new holds may take, every error,
//! and 200 concurrent holds of 1 against a balance of 100.

mod common;

use common::*;
use serde_json::{json, Value};

async fn reserve(api: &Api, account: &str, body: Value) -> Answer {
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/reservations"),
        body,
    )
    .await
}

async fn balances(api: &Api, account: &str) -> (String, String) {
    let body = api
        .get(&format!("/v1/customer-credits/accounts/{account}"))
        .await
        .body;
    (
        body["balance"].as_str().unwrap().to_string(),
        body["available_balance"].as_str().unwrap().to_string(),
    )
}

fn id_of(answer: &Answer) -> String {
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_takes_from_the_available_balance_until_commit_or_release() {
    let (_g, server, api, account) = with_account("100").await;
    let held = reserve(
        &api,
        &account,
        json!({"amount": "30", "idempotency_key": "job-1"}),
    )
    .await;
    let rsv = id_of(&held);
    assert!(rsv.starts_with("rsv_"));
    assert_eq!(held.body["object"], "credit_reservation");
    assert_eq!(held.body["status"], "held");
    assert_eq!(held.body["amount"], "30");
    assert_eq!(held.body["account_id"], account.as_str());
    assert!(held.body["transaction_id"].is_null());
    assert_eq!(balances(&api, &account).await, ("100".into(), "70".into()));

    // The same idempotency key gives the same reservation; another amount is refused.
    let again = reserve(
        &api,
        &account,
        json!({"amount": "30", "idempotency_key": "job-1"}),
    )
    .await;
    assert_eq!(id_of(&again), rsv);
    let reused = reserve(
        &api,
        &account,
        json!({"amount": "31", "idempotency_key": "job-1"}),
    )
    .await;
    assert_eq!(
        assert_error(&reused, 409, "invalid_request_error")["code"],
        "idempotency_key_reused"
    );

    // Debits and new holds see only what is available.
    let debit = |amount: &'static str, key: &'static str| {
        let (api, account) = (api.clone(), account.clone());
        async move {
            api.post(
                &format!("/v1/customer-credits/accounts/{account}/debit"),
                json!({"amount": amount, "idempotency_key": key}),
            )
            .await
        }
    };
    let over = debit("71", "d-1").await;
    assert_eq!(
        assert_error(&over, 409, "invalid_request_error")["code"],
        "insufficient_balance"
    );
    assert_eq!(debit("70", "d-2").await.status, 200);
    let none_left = reserve(
        &api,
        &account,
        json!({"amount": "1", "idempotency_key": "job-2"}),
    )
    .await;
    assert_eq!(
        assert_error(&none_left, 409, "invalid_request_error")["code"],
        "insufficient_balance"
    );
    assert_eq!(balances(&api, &account).await, ("30".into(), "0".into()));

    // A partial commit debits that much and releases the rest; committing again
    // returns the same transaction.
    let too_much = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/commit"),
            json!({"amount": "31"}),
        )
        .await;
    assert_eq!(
        assert_error(&too_much, 400, "invalid_request_error")["param"],
        "amount"
    );
    let committed = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/commit"),
            json!({"amount": "20"}),
        )
        .await;
    assert_eq!(committed.status, 200, "{}", committed.body);
    assert_eq!(committed.body["status"], "committed");
    assert_eq!(committed.body["committed_amount"], "20");
    let tx = committed.body["transaction_id"]
        .as_str()
        .unwrap()
        .to_string();
    let twice = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/commit"),
            json!({}),
        )
        .await;
    assert_eq!(twice.body["transaction_id"], tx.as_str());
    let transaction = api
        .get(&format!("/v1/customer-credits/transactions/{tx}"))
        .await;
    assert_eq!(transaction.body["type"], "debit");
    assert_eq!(transaction.body["amount"], "20");
    assert_eq!(balances(&api, &account).await, ("10".into(), "10".into()));
    let release_committed = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/release"),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&release_committed, 409, "invalid_request_error")["code"],
        "reservation_committed"
    );

    // A release gives it all back; committing a released one is refused.
    let second = id_of(
        &reserve(
            &api,
            &account,
            json!({"amount": "10", "idempotency_key": "job-3"}),
        )
        .await,
    );
    assert_eq!(balances(&api, &account).await, ("10".into(), "0".into()));
    let released = api
        .post(
            &format!("/v1/customer-credits/reservations/{second}/release"),
            json!({}),
        )
        .await;
    assert_eq!(released.body["status"], "released");
    assert_eq!(balances(&api, &account).await, ("10".into(), "10".into()));
    let late = api
        .post(
            &format!("/v1/customer-credits/reservations/{second}/commit"),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&late, 409, "invalid_request_error")["code"],
        "reservation_released"
    );
    let fetched = api
        .get(&format!("/v1/customer-credits/reservations/{second}"))
        .await;
    assert_eq!(fetched.body["status"], "released");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_expires_at_its_instant_and_then_holds_nothing() {
    let (_g, server, api, account) = with_account("10").await;
    let rsv = id_of(
        &reserve(
            &api,
            &account,
            json!({"amount": "10", "idempotency_key": "k", "expires_in_seconds": 60}),
        )
        .await,
    );
    assert_eq!(balances(&api, &account).await, ("10".into(), "0".into()));
    server.clock.advance_ms(59_999);
    assert_eq!(
        api.get(&format!("/v1/customer-credits/reservations/{rsv}"))
            .await
            .body["status"],
        "held"
    );
    server.clock.advance_ms(1);
    assert_eq!(
        api.get(&format!("/v1/customer-credits/reservations/{rsv}"))
            .await
            .body["status"],
        "expired"
    );
    assert_eq!(balances(&api, &account).await, ("10".into(), "10".into()));
    let commit = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/commit"),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&commit, 409, "invalid_request_error")["code"],
        "reservation_expired"
    );
    // The credits are available again: a debit of all of them passes.
    let debit = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/debit"),
            json!({"amount": "10", "idempotency_key": "after"}),
        )
        .await;
    assert_eq!(debit.status, 200, "{}", debit.body);
    let release = api
        .post(
            &format!("/v1/customer-credits/reservations/{rsv}/release"),
            json!({}),
        )
        .await;
    assert_eq!(release.body["status"], "expired");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_field() {
    let (_g, server, api, account) = with_account("10").await;
    for (body, param) in [
        (json!({"idempotency_key": "k"}), "amount"),
        (json!({"amount": "0", "idempotency_key": "k"}), "amount"),
        (json!({"amount": "-1", "idempotency_key": "k"}), "amount"),
        (json!({"amount": 5, "idempotency_key": "k"}), "amount"),
        (json!({"amount": "1"}), "idempotency_key"),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_in_seconds": 0}),
            "expires_in_seconds",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_in_seconds": 86_401}),
            "expires_in_seconds",
        ),
        (
            json!({"amount": "1", "idempotency_key": "k", "expires_in_seconds": "60"}),
            "expires_in_seconds",
        ),
    ] {
        let answer = reserve(&api, &account, body.clone()).await;
        assert_eq!(
            assert_error(&answer, 400, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    let missing = reserve(
        &api,
        "ca_missing",
        json!({"amount": "1", "idempotency_key": "k"}),
    )
    .await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    for path in ["/v1/customer-credits/reservations/rsv_missing"] {
        assert_eq!(api.get(path).await.status, 404);
    }
    for action in ["commit", "release"] {
        let answer = api
            .post(
                &format!("/v1/customer-credits/reservations/rsv_missing/{action}"),
                json!({}),
            )
            .await;
        assert_eq!(answer.status, 404, "{action}: {}", answer.body);
    }
    // A closed account's holds end with it.
    let rsv = id_of(
        &reserve(
            &api,
            &account,
            json!({"amount": "4", "idempotency_key": "c"}),
        )
        .await,
    );
    let closed = api
        .post(
            &format!("/v1/customer-credits/accounts/{account}/close"),
            json!({}),
        )
        .await;
    assert_eq!(closed.status, 200, "{}", closed.body);
    assert_eq!(
        api.get(&format!("/v1/customer-credits/reservations/{rsv}"))
            .await
            .body["status"],
        "released"
    );
    let refused = reserve(
        &api,
        &account,
        json!({"amount": "1", "idempotency_key": "d"}),
    )
    .await;
    assert_eq!(
        assert_error(&refused, 409, "invalid_request_error")["code"],
        "account_closed"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_holds_of_one_against_one_hundred() {
    let (_g, server, api, account) = with_account("100").await;
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (api, account) = (api.clone(), account.clone());
        tasks.push(tokio::spawn(async move {
            let answer = reserve(
                &api,
                &account,
                json!({"amount": "1", "idempotency_key": format!("race-{i}")}),
            )
            .await;
            (answer.status, answer.body["error"]["code"].clone())
        }));
    }
    let (mut held, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            (200, _) => held += 1,
            (409, code) if code == "insufficient_balance" => refused += 1,
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!((held, refused), (100, 100));
    assert_eq!(balances(&api, &account).await, ("100".into(), "0".into()));
    server.stop().await;
}
