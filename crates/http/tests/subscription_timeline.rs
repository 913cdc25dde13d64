//! A property test of subscriptions over random timelines, through the real server:
//! usage, clock advances, cancels, pauses and resumes, with a card that pays or one
//! that declines renewals. Whatever happens:
//! - everything due up to the store's time has run, and the status is one the
//!   state machine allows with its dates ahead;
//! - no period is charged twice, and every transaction's lines add up to its amount;
//! - `invoice` usage is never billed twice nor more than was ingested; on a
//!   timeline that only uses, renews, switches products and changes units, exactly
//!   the usage of the closed periods is billed; on one that only uses and renews,
//!   each period is charged once;
//! - replaying the log gives the live projection's digest.

mod common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use serde_json::{json, Value};
use tally_domain::time::{format_iso8601_ms, parse_iso8601_ms, HOUR_MS, MINUTE_MS};
use tally_projection::{MemoryStore, ProjectionStore};

#[derive(Debug, Clone)]
enum Op {
    Use(u8),
    Advance(u16),
    Cancel {
        immediate: bool,
        pause: bool,
    },
    Pause,
    Resume,
    /// Move to the other product (`behavior` 0..3: immediately, carried, none).
    Switch(u8),
    /// Set the units of the main item.
    Units(u8),
}

/// Which ops a timeline draws from.
#[derive(Debug, Clone, Copy)]
enum Ops {
    /// Use and advance only.
    Clean,
    /// Also switches of product and changes of units: no usage may be lost.
    Changes,
    /// Everything, cancels, pauses and resumes included.
    Any,
}

fn op(ops: Ops) -> BoxedStrategy<Op> {
    let use_or_advance = prop_oneof![
        3 => (1u8..4).prop_map(Op::Use),
        3 => (1u16..900).prop_map(Op::Advance),
    ];
    match ops {
        Ops::Clean => return use_or_advance.boxed(),
        Ops::Changes => {
            return prop_oneof![
                6 => use_or_advance,
                2 => (0u8..3).prop_map(Op::Switch),
                1 => (1u8..4).prop_map(Op::Units),
            ]
            .boxed()
        }
        Ops::Any => {}
    }
    prop_oneof![
        6 => use_or_advance,
        1 => (any::<bool>(), any::<bool>()).prop_map(|(immediate, pause)| Op::Cancel { immediate, pause }),
        1 => Just(Op::Pause),
        1 => Just(Op::Resume),
        1 => (0u8..3).prop_map(Op::Switch),
        1 => (1u8..4).prop_map(Op::Units),
    ]
    .boxed()
}

fn date(value: &Value) -> Option<i64> {
    value.as_str().and_then(parse_iso8601_ms)
}

async fn run(ops: Vec<Op>, declining: bool) -> Result<(), TestCaseError> {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "timeline").await;
    let api = Api::new(&server.test_url, &keys.test);
    let ok = |answer: &Answer| {
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.body["id"].as_str().unwrap().to_string()
    };
    let meter = ok(&api
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "call", "aggregation": "count"}),
        )
        .await);
    let product = ok(&api
        .post(
            "/v1/products",
            json!({"name": "P", "price": 100, "currency": "usd", "billing_type": "recurring",
                "billing_period": "every-month", "tax_mode": "exclusive",
                "usage_prices": [{"meter_id": meter, "unit_price": 1, "settlement_mode": "invoice"}]}),
        )
        .await);
    let other = ok(&api
        .post(
            "/v1/products",
            json!({"name": "Q", "price": 250, "currency": "usd", "billing_type": "recurring",
                "billing_period": "every-month", "tax_mode": "exclusive",
                "usage_prices": [{"meter_id": meter, "unit_price": 2, "settlement_mode": "invoice"}]}),
        )
        .await);
    let products = [product.clone(), other];
    let mut on = 0;
    // When each switch took effect, and the product it moved to.
    let mut switches: Vec<(i64, usize)> = Vec::new();
    // Successful immediate moves to the pricier product: each may charge one
    // proration at once (none while trialing).
    let mut immediate_upgrades = 0usize;
    let customer = ok(&api.post("/v1/customers", json!({"email": "t@x.io"})).await);
    let checkout = ok(&api
        .post(
            "/v1/checkouts",
            json!({"product_id": product, "customer_id": customer}),
        )
        .await);
    let card = if declining {
        "4000000000000341"
    } else {
        "4242424242424242"
    };
    let paid = api
        .post(
            &format!("/v1/checkouts/{checkout}/complete"),
            json!({"card_number": card, "cvc": "123", "exp": "12/34"}),
        )
        .await;
    prop_assert_eq!(paid.status, 200, "{}", paid.body);
    let sub = paid.body["subscription_id"].as_str().unwrap().to_string();
    let path = format!("/v1/subscriptions/{sub}");
    let now = |api: Api| async move { date(&api.get("/v1/test-clock").await.body["now"]).unwrap() };
    let start = date(&api.get(&path).await.body["current_period_start_date"]).unwrap();

    let mut ingested: Vec<i64> = Vec::new();
    for (n, op) in ops.iter().enumerate() {
        match op {
            Op::Use(k) => {
                let at = now(api.clone()).await;
                let events: Vec<Value> = (0..*k)
                    .map(|i| json!({"name": "call", "customer_id": customer, "event_id": format!("e{n}-{i}"),
                        "timestamp": format_iso8601_ms(at)}))
                    .collect();
                let answer = api
                    .post("/v1/events/ingest", json!({"events": events}))
                    .await;
                prop_assert_eq!(answer.status, 202, "{}", answer.body);
                ingested.extend(std::iter::repeat_n(at, *k as usize));
            }
            Op::Advance(hours) => {
                let to = now(api.clone()).await + i64::from(*hours) * HOUR_MS;
                let answer = api
                    .post(
                        "/v1/test-clock/advance",
                        json!({"to": format_iso8601_ms(to)}),
                    )
                    .await;
                prop_assert_eq!(answer.status, 200, "{}", answer.body);
            }
            Op::Cancel { immediate, pause } => {
                let body = json!({"mode": if *immediate { "immediate" } else { "scheduled" },
                    "onExecute": if *pause { "pause" } else { "cancel" }});
                let answer = api.post(&format!("{path}/cancel"), body).await;
                prop_assert!(
                    answer.status == 200
                        || answer.body["error"]["code"] == "invalid_state_transition",
                    "{}",
                    answer.body
                );
            }
            Op::Switch(behavior) => {
                let behavior = [
                    "proration-charge-immediately",
                    "proration-charge",
                    "proration-none",
                ][*behavior as usize];
                let answer = api
                    .post(
                        &format!("{path}/upgrade"),
                        json!({"product_id": products[1 - on], "update_behavior": behavior}),
                    )
                    .await;
                prop_assert!(
                    answer.status == 200
                        || answer.body["error"]["code"] == "invalid_state_transition"
                        || answer.body["error"]["code"] == "card_declined",
                    "{}",
                    answer.body
                );
                if answer.status == 200 {
                    on = 1 - on;
                    switches.push((date(&answer.body["updated_at"]).unwrap(), on));
                    if on == 1 && behavior == "proration-charge-immediately" {
                        immediate_upgrades += 1;
                    }
                }
            }
            Op::Units(units) => {
                let item = api.get(&path).await.body["items"][0]["id"].clone();
                let answer = api
                    .post(&path, json!({"items": [{"id": item, "units": units}]}))
                    .await;
                prop_assert!(
                    answer.status == 200
                        || answer.body["error"]["code"] == "invalid_state_transition",
                    "{}",
                    answer.body
                );
            }
            Op::Pause | Op::Resume => {
                let verb = if matches!(op, Op::Pause) {
                    "pause"
                } else {
                    "resume"
                };
                let answer = api.post(&format!("{path}/{verb}"), json!({})).await;
                prop_assert!(
                    answer.status == 200
                        || answer.body["error"]["code"] == "invalid_state_transition",
                    "{}",
                    answer.body
                );
            }
        }
    }
    server.engine.wait_caught_up().await.unwrap();
    let at = now(api.clone()).await;
    let s = api.get(&path).await.body;
    let status = s["status"].as_str().unwrap().to_string();
    match status.as_str() {
        "active" | "trialing" => prop_assert!(
            date(&s["next_transaction_date"]).unwrap() > at,
            "{} with its charge overdue: {}",
            status,
            s
        ),
        "scheduled_cancel" => prop_assert!(
            date(&s["current_period_end_date"]).unwrap() > at,
            "{} with its period over: {}",
            status,
            s
        ),
        "past_due" => prop_assert!(date(&s["next_retry_date"]).unwrap() > at, "{}", s),
        "canceled" | "paused" | "unpaid" => {}
        other => prop_assert!(false, "status {}", other),
    }
    if !declining {
        prop_assert!(status != "past_due" && status != "unpaid", "{}", s);
    }

    let list = api
        .get(&format!("/v1/transactions?subscription_id={sub}&limit=100"))
        .await
        .body;
    let txs = list["data"].as_array().unwrap().clone();
    let mut periods = std::collections::BTreeSet::new();
    let mut prorations = 0usize;
    let mut billed_usage = 0i64;
    let mut billed_usage_amount = 0i64;
    for tx in &txs {
        let lines = tx["lines"].as_array().unwrap();
        prop_assert!(tx["amount"].as_i64().unwrap() >= 0, "{}", tx);
        let sum: i64 = lines.iter().map(|l| l["amount"].as_i64().unwrap()).sum();
        prop_assert_eq!(sum, tx["amount"].as_i64().unwrap(), "{}", tx);
        // A proration is charged at the switch, not per period: switching up,
        // down and up again at one instant charges twice (the downgrade's credit
        // waits for the next charge), so prorations are counted against the
        // switches that may charge them, and only renewals are one per period.
        if tx["description"]
            .as_str()
            .is_some_and(|d| d.starts_with("proration of"))
        {
            prop_assert!(tx["amount"].as_i64().unwrap() > 0, "{}", tx);
            prorations += 1;
            continue;
        }
        prop_assert!(
            periods.insert((
                tx["period_start"].to_string(),
                tx["description"].to_string()
            )),
            "period charged twice: {:?}",
            txs
        );
        for line in lines.iter().filter(|l| !l["meter_id"].is_null()) {
            billed_usage += line["quantity"].as_str().unwrap().parse::<i64>().unwrap();
            billed_usage_amount += line["amount"].as_i64().unwrap();
        }
    }
    prop_assert!(
        prorations <= immediate_upgrades,
        "{} prorations charged for {} immediate upgrades: {:?}",
        prorations,
        immediate_upgrades,
        txs
    );
    prop_assert!(
        billed_usage <= ingested.len() as i64,
        "billed {} of {}",
        billed_usage,
        ingested.len()
    );

    // Switching products and units loses no usage: each closed period's usage is
    // billed once, before a switch at the old product's price.
    let kept = !declining
        && ops.iter().all(|o| {
            matches!(
                o,
                Op::Use(_) | Op::Advance(_) | Op::Switch(_) | Op::Units(_)
            )
        });
    if kept {
        let current = date(&s["current_period_start_date"]).unwrap();
        let floor = |t: i64| t.div_euclid(MINUTE_MS);
        let closed: Vec<i64> = ingested
            .iter()
            .copied()
            .filter(|t| floor(*t) < floor(current))
            .collect();
        prop_assert_eq!(
            billed_usage,
            closed.len() as i64,
            "usage of the closed periods, once"
        );
        // Each event at the price of the product it was used under: a switch
        // takes effect from its own minute on (usage counts by whole minutes).
        let unit_price = |t: i64| {
            let on = switches
                .iter()
                .rfind(|(at, _)| floor(*at) <= floor(t))
                .map_or(0, |(_, on)| *on);
            [1i64, 2][on]
        };
        let expected: i64 = closed.iter().map(|t| unit_price(*t)).sum();
        prop_assert_eq!(
            billed_usage_amount,
            expected,
            "each event at its product's price: {:?}",
            txs
        );
    }
    let clean = !declining && ops.iter().all(|o| matches!(o, Op::Use(_) | Op::Advance(_)));
    if clean {
        // One renewal per period end passed since the start.
        let mut ends = 0;
        let mut end = tally_domain::settlement::period_bounds(start, 1, start).1;
        while end + tally_domain::subscription::LATE_USAGE_GRACE_MS <= at {
            ends += 1;
            end = tally_domain::settlement::period_bounds(start, 1, end).1;
        }
        prop_assert_eq!(txs.len(), 1 + ends, "{:?}", txs);
    }

    let replayed: Arc<dyn ProjectionStore> = Arc::new(MemoryStore::new());
    tally_engine::projector::replay_partition(
        server.engine.log().as_ref(),
        replayed.clone(),
        0,
        |_, _| {},
    )
    .await
    .unwrap();
    prop_assert_eq!(
        replayed.digest().unwrap(),
        server.engine.store().digest().unwrap()
    );
    server.stop().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn subscriptions_stay_legal_and_bill_each_period_once(
        which in 0u8..3,
        declining in proptest::bool::weighted(0.3),
        ops in proptest::collection::vec(op(Ops::Any), 1..14),
        clean_ops in proptest::collection::vec(op(Ops::Clean), 1..14),
        change_ops in proptest::collection::vec(op(Ops::Changes), 1..14),
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (ops, declining) = match which {
            0 => (clean_ops, false),
            1 => (change_ops, false),
            _ => (ops, declining),
        };
        runtime.block_on(run(ops, declining))?;
    }
}
