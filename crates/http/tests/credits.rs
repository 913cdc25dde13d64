//! The credits ledger over real sockets: every endpoint, every error, pagination
//! edges, and 200 concurrent debits against a balance of 100.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::time::format_iso8601_ms;

async fn account(api: &Api, body: Value) -> Value {
    let answer = api.post("/v1/customer-credits/accounts", body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

/// Opens an account and answers its id.
async fn account_id(api: &Api, body: Value) -> String {
    account(api, body).await["id"].as_str().unwrap().to_string()
}

/// The account's balance at instant `ms` (`?at=`).
async fn balance_at(api: &Api, account: &str, ms: i64) -> String {
    let answer = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account}?at={}",
            format_iso8601_ms(ms).replace('+', "%2B")
        ))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["balance"].as_str().unwrap().to_string()
}

async fn debit(api: &Api, account: &str, amount: &str, key: &str) -> Answer {
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/debit"),
        json!({"amount": amount, "idempotency_key": key}),
    )
    .await
}

async fn credit(api: &Api, account: &str, amount: &str, key: &str) -> Answer {
    api.post(
        &format!("/v1/customer-credits/accounts/{account}/credit"),
        json!({"amount": amount, "idempotency_key": key}),
    )
    .await
}

async fn balance(api: &Api, account: &str) -> String {
    api.get(&format!("/v1/customer-credits/accounts/{account}"))
        .await
        .body["balance"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounts_validate_default_and_seed_atomically() {
    let (_g, server, api, customer) = with_customer().await;
    let created = account(&api, json!({"customer_id": customer})).await;
    assert_eq!(created["object"], "customer_credits_account");
    assert_eq!(created["name"], "default");
    assert_eq!(created["unit_label"], "credits");
    assert_eq!(created["status"], "active");
    assert_eq!(created["balance"], "0");
    assert_eq!(created["customer_id"], customer);
    assert!(created["id"].as_str().unwrap().starts_with("ca_"));

    let seeded = account(&api, json!({"customer_id": customer, "name": "promo", "unit_label": "tokens", "initial_balance": "100.50"})).await;
    assert_eq!(seeded["balance"], "100.5");
    let taken = api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": customer, "name": "promo"}),
        )
        .await;
    assert_eq!(
        assert_error(&taken, 409, "invalid_request_error")["code"],
        "account_name_taken"
    );
    let other = api
        .post("/v1/customers", json!({"email": "o@x.io"}))
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_string();
    account(&api, json!({"customer_id": other, "name": "promo"})).await;

    for (body, status, param) in [
        (json!({}), 400, "customer_id"),
        (json!({"customer_id": "cus_nope"}), 404, "customer_id"),
        (
            json!({"customer_id": customer, "name": "x1", "initial_balance": "-1"}),
            400,
            "initial_balance",
        ),
        (
            json!({"customer_id": customer, "name": "x2", "initial_balance": 5}),
            400,
            "initial_balance",
        ),
        (
            json!({"customer_id": customer, "name": "x3", "initial_balance": "1e3"}),
            400,
            "initial_balance",
        ),
        (
            json!({"customer_id": customer, "name": "x4", "initial_balance": "0.0000000000000000001"}),
            400,
            "initial_balance",
        ),
        (json!({"customer_id": customer, "name": ""}), 400, "name"),
    ] {
        let answer = api
            .post("/v1/customer-credits/accounts", body.clone())
            .await;
        assert_eq!(
            assert_error(&answer, status, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    // A failed seed creates nothing.
    let listed = api
        .get(&format!(
            "/v1/customer-credits/accounts?customer_id={customer}"
        ))
        .await;
    assert_eq!(listed.body["data"].as_array().unwrap().len(), 2);
    // The environment of another listener sees none of it.
    assert_eq!(
        api.get(&format!(
            "/v1/customer-credits/accounts/{}",
            created["id"].as_str().unwrap()
        ))
        .await
        .status,
        200
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_debits_idempotency_and_refusals() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(&api, json!({"customer_id": customer})).await;
    let granted = credit(&api, &id, "10.25", "k1").await;
    assert_eq!(granted.status, 200, "{}", granted.body);
    assert_eq!(granted.body["type"], "credit");
    assert_eq!(granted.body["amount"], "10.25");
    let entries = granted.body["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    let sum: rust_decimal::Decimal = entries
        .iter()
        .map(|e| {
            e["amount"]
                .as_str()
                .unwrap()
                .parse::<rust_decimal::Decimal>()
                .unwrap()
        })
        .sum();
    assert!(sum.is_zero(), "double entry: {entries:?}");
    assert!(entries
        .iter()
        .any(|e| e["account_id"] == id.as_str() && e["amount"] == "10.25"));

    let again = credit(&api, &id, "10.25", "k1").await;
    assert_eq!(
        again.body["id"], granted.body["id"],
        "same key returns the original"
    );
    assert_eq!(balance(&api, &id).await, "10.25");
    let reused = credit(&api, &id, "3", "k1").await;
    assert_eq!(
        assert_error(&reused, 409, "invalid_request_error")["code"],
        "idempotency_key_reused"
    );
    let reused_as_debit = debit(&api, &id, "10.25", "k1").await;
    assert_eq!(
        assert_error(&reused_as_debit, 409, "invalid_request_error")["code"],
        "idempotency_key_reused"
    );

    let too_much = debit(&api, &id, "10.26", "k2").await;
    assert_eq!(
        assert_error(&too_much, 409, "invalid_request_error")["code"],
        "insufficient_balance"
    );
    assert_eq!(balance(&api, &id).await, "10.25", "nothing written");
    let consumed = debit(&api, &id, "0.25", "k3").await;
    assert_eq!(consumed.status, 200);
    assert_eq!(balance(&api, &id).await, "10");

    for (body, param) in [
        (json!({"amount": "1"}), "idempotency_key"),
        (json!({"idempotency_key": "x"}), "amount"),
        (json!({"amount": "0", "idempotency_key": "x"}), "amount"),
        (json!({"amount": "-2", "idempotency_key": "x"}), "amount"),
        (json!({"amount": 2, "idempotency_key": "x"}), "amount"),
        (
            json!({"amount": "1.0000000000000000001", "idempotency_key": "x"}),
            "amount",
        ),
        (
            json!({"amount": "99999999999999999999999999999", "idempotency_key": "x"}),
            "amount",
        ),
    ] {
        let answer = api
            .post(
                &format!("/v1/customer-credits/accounts/{id}/credit"),
                body.clone(),
            )
            .await;
        assert_eq!(
            assert_error(&answer, 400, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    assert_eq!(credit(&api, "ca_nope", "1", "k9").await.status, 404);

    // freeze -> refused; unfreeze -> accepted.
    let frozen = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}/freeze"),
            json!({}),
        )
        .await;
    assert_eq!(frozen.body["status"], "frozen");
    assert_eq!(
        api.get(&format!("/v1/customer-credits/accounts/{id}"))
            .await
            .body["balance"],
        "10",
        "frozen is readable"
    );
    assert_eq!(
        assert_error(
            &debit(&api, &id, "1", "k4").await,
            409,
            "invalid_request_error"
        )["code"],
        "account_frozen"
    );
    assert_eq!(
        assert_error(
            &credit(&api, &id, "1", "k5").await,
            409,
            "invalid_request_error"
        )["code"],
        "account_frozen"
    );
    let active = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}/unfreeze"),
            json!({}),
        )
        .await;
    assert_eq!(active.body["status"], "active");
    assert_eq!(debit(&api, &id, "1", "k6").await.status, 200);

    // close: the rest goes to forfeit, for good.
    let closed = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}/close"),
            json!({}),
        )
        .await;
    assert_eq!(closed.body["status"], "closed");
    assert_eq!(closed.body["balance"], "0");
    assert_eq!(
        assert_error(
            &credit(&api, &id, "1", "k7").await,
            409,
            "invalid_request_error"
        )["code"],
        "account_closed"
    );
    let refreeze = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}/freeze"),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&refreeze, 409, "invalid_request_error")["code"],
        "account_closed"
    );
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?limit=100"
        ))
        .await;
    let last = &entries.body["data"][0];
    assert_eq!(last["amount"], "-9", "the close forfeited the remaining 9");
    assert_eq!(last["balance_after"], "0");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reversals_mirror_once_and_balances_at_instants() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(
        &api,
        json!({"customer_id": customer, "initial_balance": "50"}),
    )
    .await;
    let t_after_seed = server.clock.now_ms();
    server.clock.advance_ms(1000);
    let spent = debit(&api, &id, "20", "d1").await.body;
    server.clock.advance_ms(1000);
    let reversed = api
        .post(
            &format!(
                "/v1/customer-credits/transactions/{}/reverse",
                spent["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(reversed.status, 200, "{}", reversed.body);
    assert_eq!(reversed.body["type"], "reversal");
    assert_eq!(reversed.body["reverses"], spent["id"]);
    for (original, mirror) in spent["entries"]
        .as_array()
        .unwrap()
        .iter()
        .zip(reversed.body["entries"].as_array().unwrap())
    {
        assert_eq!(original["account_id"], mirror["account_id"]);
        let a: rust_decimal::Decimal = original["amount"].as_str().unwrap().parse().unwrap();
        let b: rust_decimal::Decimal = mirror["amount"].as_str().unwrap().parse().unwrap();
        assert_eq!(a, -b);
    }
    assert_eq!(balance(&api, &id).await, "50");
    let twice = api
        .post(
            &format!(
                "/v1/customer-credits/transactions/{}/reverse",
                spent["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&twice, 409, "invalid_request_error")["code"],
        "transaction_already_reversed"
    );
    let original = api
        .get(&format!(
            "/v1/customer-credits/transactions/{}",
            spent["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(original.body["reversed_by"], reversed.body["id"]);
    assert_eq!(
        api.get("/v1/customer-credits/transactions/ctx_nope")
            .await
            .status,
        404
    );
    let reverse_reversal = api
        .post(
            &format!(
                "/v1/customer-credits/transactions/{}/reverse",
                reversed.body["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&reverse_reversal, 409, "invalid_request_error")["code"],
        "transaction_not_reversible"
    );

    // Reversing a credit that was already spent would go negative: refused.
    let granted = credit(&api, &id, "5", "c1").await.body;
    debit(&api, &id, "55", "d2").await;
    let negative = api
        .post(
            &format!(
                "/v1/customer-credits/transactions/{}/reverse",
                granted["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(
        assert_error(&negative, 409, "invalid_request_error")["code"],
        "insufficient_balance"
    );

    let at = |ms: i64| balance_at(&api, &id, ms);
    assert_eq!(
        at(t_after_seed - 1).await,
        "0",
        "before the account had anything"
    );
    assert_eq!(at(t_after_seed).await, "50");
    assert_eq!(
        at(t_after_seed + 1500).await,
        "30",
        "after the debit, before its reversal"
    );
    assert_eq!(at(server.clock.now_ms()).await, "0");
    assert_error(
        &api.get(&format!("/v1/customer-credits/accounts/{id}?at=yesterday"))
            .await,
        400,
        "invalid_request_error",
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_paginate_exactly_and_hide_system_accounts() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(&api, json!({"customer_id": customer})).await;
    for i in 0..5 {
        credit(&api, &id, &format!("{}", i + 1), &format!("e{i}")).await;
        server.clock.advance_ms(1);
    }
    let page = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?limit=2"
        ))
        .await;
    let amounts: Vec<&str> = page.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["amount"].as_str().unwrap())
        .collect();
    assert_eq!(amounts, vec!["5", "4"], "newest first, signed");
    assert_eq!(page.body["has_more"], true);
    let last_id = page.body["data"][1]["id"].as_str().unwrap();
    let next = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?limit=3&starting_after={last_id}"
        ))
        .await;
    let amounts: Vec<&str> = next.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["amount"].as_str().unwrap())
        .collect();
    assert_eq!(amounts, vec!["3", "2", "1"]);
    assert_eq!(next.body["has_more"], false);
    let oldest = next.body["data"][2]["id"].as_str().unwrap();
    let back = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?limit=2&ending_before={oldest}"
        ))
        .await;
    let amounts: Vec<&str> = back.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["amount"].as_str().unwrap())
        .collect();
    assert_eq!(amounts, vec!["3", "2"]);
    assert_eq!(back.body["has_more"], true);
    for bad in ["limit=0", "limit=101"] {
        assert_eq!(
            assert_error(
                &api.get(&format!("/v1/customer-credits/accounts/{id}/entries?{bad}"))
                    .await,
                400,
                "invalid_request_error"
            )["param"],
            "limit"
        );
        assert_eq!(
            assert_error(
                &api.get(&format!("/v1/customer-credits/accounts?{bad}"))
                    .await,
                400,
                "invalid_request_error"
            )["param"],
            "limit"
        );
    }
    let unknown = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?starting_after=ce_unknown"
        ))
        .await;
    assert_eq!(
        assert_error(&unknown, 404, "invalid_request_error")["param"],
        "starting_after"
    );
    let unknown = api
        .get("/v1/customer-credits/accounts?starting_after=ca_unknown")
        .await;
    assert_eq!(
        assert_error(&unknown, 404, "invalid_request_error")["param"],
        "starting_after"
    );

    let mut ids = vec![id.clone()];
    for i in 0..3 {
        server.clock.advance_ms(1);
        ids.push(
            account_id(
                &api,
                json!({"customer_id": customer, "name": format!("a{i}")}),
            )
            .await,
        );
    }
    ids.reverse();
    let all = api.get("/v1/customer-credits/accounts?limit=100").await;
    let listed: Vec<&str> = all.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        ids.iter().map(String::as_str).collect::<Vec<_>>(),
        "only customer accounts, newest first"
    );
    assert_eq!(all.body["has_more"], false);
    let two = api
        .get(&format!(
            "/v1/customer-credits/accounts?limit=2&starting_after={}",
            ids[1]
        ))
        .await;
    assert_eq!(two.body["data"].as_array().unwrap().len(), 2);
    assert_eq!(two.body["has_more"], false, "exactly two remain");
    // A customer that does not exist: 404 naming the filter (docs/api.md, "Lists").
    let none = api
        .get("/v1/customer-credits/accounts?customer_id=cus_other")
        .await;
    assert_eq!(
        assert_error(&none, 404, "invalid_request_error")["param"],
        "customer_id"
    );
    server.stop().await;
}

/// An entry list of every kind of entry (an initial balance, credits, grants, a
/// debit drawing from two grants, a reversal, a reservation's commit) walked one
/// entry at a time by `starting_after`, and back by `ending_before`, reads exactly
/// the list; a cursor naming another account's entry, or no entry, is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_cursors_find_entries_of_every_kind() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(
        &api,
        json!({"customer_id": customer, "initial_balance": "7"}),
    )
    .await;
    let other = account_id(&api, json!({"customer_id": customer, "name": "other"})).await;
    credit(&api, &other, "1", "o1").await;
    credit(&api, &id, "5", "c1").await;
    for (n, priority) in [(1, 10), (2, 20)] {
        let grant = api
            .post(
                &format!("/v1/customer-credits/accounts/{id}/grants"),
                json!({"amount": "3", "idempotency_key": format!("g{n}"), "priority": priority}),
            )
            .await;
        assert_eq!(grant.status, 200, "{}", grant.body);
    }
    // Drawn from the two grants of lower priority number first: split entries.
    let split = debit(&api, &id, "4", "d1").await;
    assert_eq!(split.status, 200, "{}", split.body);
    let spent = debit(&api, &id, "2", "d2").await.body;
    let reversal = api
        .post(
            &format!(
                "/v1/customer-credits/transactions/{}/reverse",
                spent["id"].as_str().unwrap()
            ),
            json!({}),
        )
        .await;
    assert_eq!(reversal.status, 200, "{}", reversal.body);
    let held = api
        .post(
            &format!("/v1/customer-credits/accounts/{id}/reservations"),
            json!({"amount": "2", "idempotency_key": "r1"}),
        )
        .await;
    assert_eq!(held.status, 200, "{}", held.body);
    let committed = api
        .post(
            &format!(
                "/v1/customer-credits/reservations/{}/commit",
                held.body["id"].as_str().unwrap()
            ),
            json!({"amount": "1"}),
        )
        .await;
    assert_eq!(committed.status, 200, "{}", committed.body);

    let page = |query: String| {
        let api = api.clone();
        let id = id.clone();
        async move {
            let answer = api
                .get(&format!(
                    "/v1/customer-credits/accounts/{id}/entries?{query}"
                ))
                .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            let ids: Vec<String> = answer.body["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["id"].as_str().unwrap().to_string())
                .collect();
            (ids, answer.body["has_more"] == true)
        }
    };
    let (all, more) = page("limit=100".into()).await;
    assert!(!more);
    // 7, 5, 3, 3, the debit split in two, 2, its reversal, the commit.
    assert_eq!(all.len(), 9, "{all:?}");
    let mut walked = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let query = match &cursor {
            Some(after) => format!("limit=1&starting_after={after}"),
            None => "limit=1".into(),
        };
        let (ids, more) = page(query).await;
        walked.extend(ids.iter().cloned());
        cursor = ids.last().cloned();
        if !more {
            break;
        }
    }
    assert_eq!(walked, all, "forward, one at a time");
    let mut back = Vec::new();
    let mut cursor = all.last().cloned().unwrap();
    back.push(cursor.clone());
    loop {
        let (ids, more) = page(format!("limit=1&ending_before={cursor}")).await;
        let Some(id) = ids.first() else { break };
        back.push(id.clone());
        cursor = id.clone();
        if !more {
            break;
        }
    }
    back.reverse();
    assert_eq!(back, all, "backward, one at a time");

    let other_entry = api
        .get(&format!("/v1/customer-credits/accounts/{other}/entries"))
        .await
        .body["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let last = all.last().unwrap();
    let named_wrong = format!("{}9", last);
    for cursor in [other_entry.as_str(), named_wrong.as_str(), "ce_", "nope"] {
        let answer = api
            .get(&format!(
                "/v1/customer-credits/accounts/{id}/entries?starting_after={cursor}"
            ))
            .await;
        assert_eq!(
            assert_error(&answer, 404, "invalid_request_error")["param"],
            "starting_after",
            "{cursor}"
        );
    }
    server.stop().await;
}

/// A balance `at` an instant is the balance after a prefix of the entry list, even
/// when a transaction was created earlier than the one listed before it (nodes'
/// clocks differ): the later entry counts from the earlier one's instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_at_instants_follow_the_list_when_clocks_disagree() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(&api, json!({"customer_id": customer})).await;
    let start = server.clock.now_ms();
    credit(&api, &id, "10", "c1").await;
    server.clock.advance_ms(10_000);
    credit(&api, &id, "5", "c2").await;
    // This node's clock is behind: the next credit is created before the last.
    server.clock.set_ms(start + 5_000);
    credit(&api, &id, "1", "c3").await;
    server.clock.set_ms(start + 20_000);
    let at = |ms: i64| balance_at(&api, &id, ms);
    assert_eq!(at(start - 1).await, "0");
    assert_eq!(at(start).await, "10");
    assert_eq!(
        at(start + 5_000).await,
        "10",
        "the third counts from the second's instant"
    );
    assert_eq!(at(start + 9_999).await, "10");
    assert_eq!(at(start + 10_000).await, "16");
    assert_eq!(at(start + 20_000).await, "16");
    let entries = api
        .get(&format!("/v1/customer-credits/accounts/{id}/entries"))
        .await
        .body;
    assert_eq!(
        entries["data"][0]["created_at"],
        format_iso8601_ms(start + 5_000),
        "an entry shows when its transaction was created"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_debits_against_one_hundred() {
    let (_g, server, api, customer) = with_customer().await;
    let id = account_id(
        &api,
        json!({"customer_id": customer, "initial_balance": "100"}),
    )
    .await;
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (api, id) = (api.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            debit(&api, &id, "1", &format!("race-{i}")).await.status
        }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            409 => refused += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, refused), (100, 100));
    assert_eq!(balance(&api, &id).await, "0");
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{id}/entries?limit=100"
        ))
        .await;
    assert!(entries.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["balance_after"].as_str().unwrap().parse::<i64>().unwrap() >= 0));
    server.stop().await;
}
