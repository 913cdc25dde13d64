//! The ledger under SIGKILL: 16 clients credit and debit a few accounts while the
//! server is killed. After a restart every acknowledged transaction exists, retrying
//! every attempted idempotency key applies nothing twice, balances equal the sum of
//! the transactions that exist, and `tally ledger verify` passes.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rust_decimal::Decimal;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_transactions_survive_sigkill_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let (_, customer) = post(
        &http,
        &format!("{base}/v1/customers"),
        &key,
        json!({"email": "k@x.io"}),
    )
    .await
    .unwrap();
    let mut accounts = Vec::new();
    for i in 0..4 {
        let (_, a) = post(&http, &format!("{base}/v1/customer-credits/accounts"), &key, json!({"customer_id": customer["id"], "name": format!("a{i}"), "initial_balance": "50"})).await.unwrap();
        accounts.push(a["id"].as_str().unwrap().to_string());
    }
    // (account, operation, amount, idempotency key, acknowledged transaction id)
    type Attempt = (String, &'static str, &'static str, String, Option<String>);
    let attempts: Arc<Mutex<Vec<Attempt>>> = Arc::default();
    let mut clients = Vec::new();
    for client in 0..16 {
        let (http, base, key, accounts, attempts) = (
            http.clone(),
            base.clone(),
            key.clone(),
            accounts.clone(),
            attempts.clone(),
        );
        clients.push(tokio::spawn(async move {
            for n in 0..100_000 {
                let account = accounts[(client + n) % accounts.len()].clone();
                let (operation, amount) = if n % 3 == 0 {
                    ("credit", "2")
                } else {
                    ("debit", "1")
                };
                let idempotency_key = format!("c{client}-{n}");
                let index = {
                    let mut all = attempts.lock().unwrap();
                    all.push((
                        account.clone(),
                        operation,
                        amount,
                        idempotency_key.clone(),
                        None,
                    ));
                    all.len() - 1
                };
                let url = format!("{base}/v1/customer-credits/accounts/{account}/{operation}");
                match post(
                    &http,
                    &url,
                    &key,
                    json!({"amount": amount, "idempotency_key": idempotency_key}),
                )
                .await
                {
                    Ok((200, tx)) => {
                        attempts.lock().unwrap()[index].4 =
                            Some(tx["id"].as_str().unwrap().to_string())
                    }
                    Ok((409, _)) => {} // insufficient balance: refused, nothing written
                    Ok((status, body)) => panic!("unexpected {status}: {body}"),
                    Err(_) => break, // the server died
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    served.kill();
    for c in clients {
        c.await.unwrap();
    }
    let attempts = attempts.lock().unwrap().clone();
    let acknowledged: Vec<&Attempt> = attempts.iter().filter(|a| a.4.is_some()).collect();
    assert!(
        acknowledged.len() >= 50,
        "load ran before the kill ({})",
        acknowledged.len()
    );

    let served = serve(dir.path());
    let base = served.test_url.clone();
    for (_, _, _, _, tx) in &acknowledged {
        let (status, _) = get(
            &http,
            &format!(
                "{base}/v1/customer-credits/transactions/{}",
                tx.as_ref().unwrap()
            ),
            &key,
        )
        .await;
        assert_eq!(status, 200, "acknowledged transaction lost");
    }
    // Retry every attempt: acknowledged ones return their original transaction,
    // and no key ever yields a second transaction.
    let mut applied = std::collections::HashMap::new();
    for (account, operation, amount, idempotency_key, tx) in &attempts {
        let url = format!("{base}/v1/customer-credits/accounts/{account}/{operation}");
        let (status, body) = post(
            &http,
            &url,
            &key,
            json!({"amount": amount, "idempotency_key": idempotency_key}),
        )
        .await
        .unwrap();
        if let Some(original) = tx {
            assert_eq!(status, 200);
            assert_eq!(
                body["id"].as_str(),
                Some(original.as_str()),
                "a retry returns the original"
            );
        }
        if status == 200 {
            applied.insert(
                body["id"].as_str().unwrap().to_string(),
                (account.clone(), *operation, *amount),
            );
        }
    }
    for account in &accounts {
        let expected: Decimal = Decimal::from(50)
            + applied
                .values()
                .filter(|(a, _, _)| a == account)
                .map(|(_, op, amount)| {
                    let amount: Decimal = amount.parse().unwrap();
                    if *op == "credit" {
                        amount
                    } else {
                        -amount
                    }
                })
                .sum::<Decimal>();
        let (_, state) = get(
            &http,
            &format!("{base}/v1/customer-credits/accounts/{account}"),
            &key,
        )
        .await;
        assert_eq!(
            state["balance"]
                .as_str()
                .unwrap()
                .parse::<Decimal>()
                .unwrap(),
            expected,
            "{account}"
        );
    }
    assert!(served.terminate().success());
    verify_passing(dir.path());
}
