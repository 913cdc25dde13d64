//! `tally ledger verify` and `tally ledger export` against real data dirs.

mod common;

use common::*;
use rust_decimal::Decimal;
use serde_json::json;
use tally_domain::ledger::{Account, AccountStatus, Entry, Transaction, TransactionKind};
use tally_domain::record::Record;
use tally_domain::Mode;
use tally_log::Log;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_passes_on_a_real_ledger_and_export_lists_every_entry() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let (_, customer) = post(
        &http,
        &format!("{base}/v1/customers"),
        &key,
        json!({"email": "v@x.io"}),
    )
    .await
    .unwrap();
    let url = format!("{base}/v1/customer-credits/accounts");
    let (_, a) = post(
        &http,
        &url,
        &key,
        json!({"customer_id": customer["id"], "initial_balance": "100"}),
    )
    .await
    .unwrap();
    let (_, b) = post(
        &http,
        &url,
        &key,
        json!({"customer_id": customer["id"], "name": "b"}),
    )
    .await
    .unwrap();
    let (a, b) = (
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    );
    post(
        &http,
        &format!("{url}/{a}/debit"),
        &key,
        json!({"amount": "30.5", "idempotency_key": "1"}),
    )
    .await
    .unwrap();
    post(
        &http,
        &format!("{url}/{b}/credit"),
        &key,
        json!({"amount": "7", "idempotency_key": "2"}),
    )
    .await
    .unwrap();
    let (_, spent) = post(
        &http,
        &format!("{url}/{b}/debit"),
        &key,
        json!({"amount": "2", "idempotency_key": "3"}),
    )
    .await
    .unwrap();
    post(
        &http,
        &format!(
            "{base}/v1/customer-credits/transactions/{}/reverse",
            spent["id"].as_str().unwrap()
        ),
        &key,
        json!({}),
    )
    .await
    .unwrap();
    post(&http, &format!("{url}/{b}/close"), &key, json!({}))
        .await
        .unwrap();
    assert!(served.terminate().success());

    let report = verify_passing(dir.path());
    let value = |label: &str| report.value(label);
    assert_eq!(value("accounts:"), "2");
    assert_eq!(
        value("transactions:"),
        "6",
        "seed, debit, credit, debit, reversal, close"
    );
    assert_eq!(value("total issued:"), "107");
    assert_eq!(
        value("total consumed:"),
        "30.5",
        "the reversed debit gives its 2 back"
    );
    assert_eq!(value("total forfeited:"), "7");
    let digest = value("digest:");
    let again = tally()
        .args(["ledger", "verify", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&again.stdout).contains(&digest),
        "the digest is stable"
    );

    let csv = dir.path().join("entries.csv");
    let export = tally()
        .args(["ledger", "export", "--format", "csv", "--output"])
        .arg(&csv)
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(export.status.success());
    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(
        rows[0],
        "transaction_id,type,created_at,store_id,mode,entry_id,account_id,customer_id,amount,grant_id"
    );
    // Two entries per transaction, and the close's account entry split in two: it
    // drew from the credit's grant and from the grant the reversal gave back.
    assert_eq!(rows.len(), 1 + 13, "two entries per transaction, one split");
    let sum: Decimal = rows[1..]
        .iter()
        .map(|r| r.split(',').nth(8).unwrap().parse::<Decimal>().unwrap())
        .sum();
    assert!(sum.is_zero(), "all entries sum to zero");
    // A customer account's entries name the grant they gave to or drew from, as
    // `GET /v1/customer-credits/transactions/{id}` shows them.
    assert!(rows[1..]
        .iter()
        .filter(|r| r.split(',').nth(6).is_some_and(|a| a.starts_with("ca_")))
        .all(|r| r.rsplit(',').next().is_some_and(|g| g.starts_with("grt_"))));
    let jsonl = tally()
        .args(["ledger", "export", "--format", "jsonl", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&jsonl.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 13);
    assert!(lines
        .iter()
        .any(|l| l["account_id"] == "system:forfeit" && l["amount"] == "7"));
}

fn account(id: &str) -> Account {
    Account {
        id: id.into(),
        store_id: "st_x".into(),
        mode: Mode::Test,
        customer_id: "cus_x".into(),
        name: id.into(),
        unit_label: "credits".into(),
        status: AccountStatus::Active,
        created_at_ms: 1,
        updated_at_ms: 1,
        low_balance_threshold: None,
        auto_recharge: None,
    }
}

fn transaction(
    id: &str,
    account_id: &str,
    kind: TransactionKind,
    entries: &[(&str, i64)],
) -> Transaction {
    Transaction {
        id: id.into(),
        store_id: "st_x".into(),
        mode: Mode::Test,
        kind,
        account_id: account_id.into(),
        amount: Decimal::from(entries[0].1.abs()),
        entries: entries
            .iter()
            .enumerate()
            .map(|(i, (account, amount))| Entry {
                id: format!("{id}-{i}"),
                account_id: (*account).into(),
                amount: Decimal::from(*amount),
                grant_id: None,
            })
            .collect(),
        idempotency_key: None,
        description: None,
        metadata: Default::default(),
        reverses: None,
        created_at_ms: 2,
        grant_terms: None,
    }
}

/// Forged transactions in the log are refused by apply (verify passes); had apply let
/// them through, the audit's own arithmetic names each violation and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_every_violation_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let mut offsets = Vec::new();
    {
        let log = tally_log::embedded::EmbeddedLog::open(dir.path().join("log")).unwrap();
        let records = [
            Record::CreditLedger {
                account: Some(account("ca_a")),
                transaction: None,
                events: vec![],
            },
            Record::CreditLedger {
                account: None,
                transaction: Some(transaction(
                    "ctx_unbalanced",
                    "ca_a",
                    TransactionKind::Credit,
                    &[("ca_a", 10), ("system:issuance", -9)],
                )),
                events: vec![],
            },
            Record::CreditLedger {
                account: None,
                transaction: Some(transaction(
                    "ctx_overdraw",
                    "ca_a",
                    TransactionKind::Debit,
                    &[("ca_a", -50), ("system:consumption", 50)],
                )),
                events: vec![],
            },
        ];
        for record in &records {
            offsets.push(
                log.append(b"k", tally_proto::encode_record(record, 1))
                    .await
                    .unwrap(),
            );
        }
    }
    // Apply refuses the forged transactions, so the ledger is sound and verify says
    // so, naming nothing.
    let first = tally()
        .args(["ledger", "verify", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert_eq!(first.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("transactions:    0"), "{stdout}");
    // A projector with a bug would have applied them: simulate it by erasing their
    // refusals from the projection. The audit's own arithmetic must catch it.
    {
        use tally_projection::ProjectionStore;
        let store = tally_projection::SledStore::open(dir.path().join("projections")).unwrap();
        let erased = offsets[1..]
            .iter()
            .map(|offset| (tally_engine::outcome::outcome_key(0, *offset), None))
            .collect();
        store.apply(erased, &[]).unwrap();
        store.flush().unwrap();
    }
    let output = tally()
        .args(["ledger", "verify", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("VIOLATION: transaction ctx_unbalanced has entries summing to 1"),
        "{stdout}"
    );
    assert!(
        stdout
            .contains("VIOLATION: account ca_a went negative (-40) with transaction ctx_overdraw"),
        "{stdout}"
    );
}

/// Usage settled in credits posts debits decided in apply; the audit replays them
/// (named by each settlement's claim) and `tally replay` reproduces the projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_and_replay_cover_usage_settled_in_credits() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let call = |path: &str, body: serde_json::Value| {
        let (http, key, url) = (http.clone(), key.clone(), format!("{base}{path}"));
        async move {
            let (status, body) = post(&http, &url, &key, body).await.unwrap();
            assert!(status < 300, "{url}: {status} {body}");
            body
        }
    };
    let meter = call(
        "/v1/meters",
        json!({"name": "calls", "event_name": "api_call", "aggregation": "count"}),
    )
    .await;
    let product = call(
        "/v1/products",
        json!({"name": "Pro", "price": 1000, "currency": "usd", "billing_type": "recurring",
               "billing_period": "every-month",
               "features": [{"type": "customer_credits",
                   "customer_credits": {"amount": "3", "bucket_name": "api"}}],
               "usage_prices": [{"meter_id": meter["id"], "unit_price": "0.5",
                   "settlement_mode": "credits", "target_account_name": "api"}]}),
    )
    .await;
    let customer = call("/v1/customers", json!({"email": "u@x.io"})).await;
    let checkout = call(
        "/v1/checkouts",
        json!({"product_id": product["id"], "customer_id": customer["id"]}),
    )
    .await;
    let paid = call(
        &format!(
            "/v1/checkouts/{}/complete",
            checkout["id"].as_str().unwrap()
        ),
        json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/34"}),
    )
    .await;
    // Ten calls in three requests: 5 credits billed, 3 held, 2 short.
    for ids in [
        vec!["a", "b", "c", "d"],
        vec!["e", "f", "g"],
        vec!["h", "i", "j"],
    ] {
        let events: Vec<_> = ids
            .iter()
            .map(|id| json!({"name": "api_call", "customer_id": customer["id"], "event_id": id}))
            .collect();
        call("/v1/events/ingest", json!({"events": events})).await;
    }
    let sub = format!(
        "{base}/v1/subscriptions/{}",
        paid["subscription_id"].as_str().unwrap()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, body) = get(&http, &sub, &key).await;
        if body["usage_settlement"][0]["quantity"] == "10" {
            assert_eq!(body["usage_settlement"][0]["debited"], "3", "{body}");
            assert_eq!(body["usage_settlement"][0]["shortfall"], "2", "{body}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never settled: {body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(served.terminate().success());

    let report = verify_passing(dir.path());
    let value = |label: &str| report.value(label);
    assert_eq!(value("total issued:"), "3");
    assert_eq!(value("total consumed:"), "3");

    let replay = tally()
        .args(["replay", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&replay.stdout);
    let digest = |label: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(label).map(|d| d.trim().to_string()))
            .unwrap_or_else(|| panic!("no `{label}` in {text}"))
    };
    assert!(replay.status.success(), "{text}");
    assert_eq!(
        digest("replayed projection digest:"),
        digest("live projection digest:")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_counts_what_apply_books_itself_auto_recharges_and_purchase_grants() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let call = |path: &str, body: serde_json::Value| {
        let (http, key, url) = (http.clone(), key.clone(), format!("{base}{path}"));
        async move {
            let (status, body) = post(&http, &url, &key, body).await.unwrap();
            assert_eq!(status, 200, "{url}: {body}");
            body
        }
    };
    let customer = call("/v1/customers", json!({"email": "r@x.io"})).await;
    // A checkout of `product` for the customer, paid with the test card that succeeds.
    let buy = |product: &serde_json::Value| {
        let (call, body) = (
            &call,
            json!({"product_id": product["id"], "customer_id": customer["id"]}),
        );
        async move {
            let checkout = call("/v1/checkouts", body).await;
            let complete = format!(
                "/v1/checkouts/{}/complete",
                checkout["id"].as_str().unwrap()
            );
            call(
                &complete,
                json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/34"}),
            )
            .await;
        }
    };
    let account = call(
        "/v1/customer-credits/accounts",
        json!({"customer_id": customer["id"], "initial_balance": "10",
            "auto_recharge": {"threshold": "5", "amount": "20"}}),
    )
    .await;
    let debit = format!(
        "/v1/customer-credits/accounts/{}/debit",
        account["id"].as_str().unwrap()
    );
    // 10 - 3 - 3 = 4, below 5: a free recharge of 20 is booked right after.
    for n in 0..2 {
        call(
            &debit,
            json!({"amount": "3", "idempotency_key": format!("d{n}")}),
        )
        .await;
    }
    let product = call(
        "/v1/products",
        json!({"name": "Pack", "price": 500, "currency": "usd",
            "features": [{"type": "customer_credits",
                "customer_credits": {"amount": "5", "bucket_name": "pack"}}]}),
    )
    .await;
    buy(&product).await;
    // A monthly product's credits: at the checkout and at the renewal (a record of
    // the subscription's).
    let monthly = call(
        "/v1/products",
        json!({"name": "Monthly", "price": 900, "currency": "usd", "billing_type": "recurring",
            "billing_period": "every-month",
            "features": [{"type": "customer_credits",
                "customer_credits": {"amount": "4", "bucket_name": "monthly"}}]}),
    )
    .await;
    buy(&monthly).await;
    let clock = reqwest::Client::new()
        .get(format!("{base}/v1/test-clock"))
        .header("x-api-key", &key)
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    let now = tally_domain::time::parse_iso8601_ms(clock["now"].as_str().unwrap()).unwrap();
    let to = tally_domain::time::format_iso8601_ms(now + 40 * tally_domain::time::DAY_MS);
    call("/v1/test-clock/advance", json!({"to": to})).await;
    assert!(served.terminate().success());

    let report = verify_passing(dir.path());
    let value = |label: &str| report.value(label);
    assert_eq!(value("accounts:"), "3", "the grants' accounts too");
    assert_eq!(
        value("transactions:"),
        "7",
        "seed, two debits, the recharge, the pack's grant, the monthly checkout's and renewal's"
    );
    assert_eq!(value("total issued:"), "43");
    assert_eq!(value("total consumed:"), "6");
}
