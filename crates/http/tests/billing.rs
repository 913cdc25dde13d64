//! Billing over real sockets: discounts (statuses, codes, lookups), checkouts with
//! every test card, transactions with tax and discounts, refunds, disputes, credit
//! grants, the webhook bodies of billing events, concurrent redemptions of a
//! limited discount, and all of it surviving a restart.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;

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

async fn product(api: &Api, extra: Value) -> String {
    let mut body = json!({
        "name": "Pro",
        "price": 1900,
        "currency": "usd",
        "billing_type": "recurring",
        "billing_period": "every-month",
        "tax_mode": "exclusive",
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    id(&api.post("/v1/products", body).await)
}

async fn customer(api: &Api, country: &str) -> String {
    id(&api
        .post(
            "/v1/customers",
            json!({"email": "ada@example.com", "country": country}),
        )
        .await)
}

const CARD: &str = "4242424242424242";

async fn pay(api: &Api, checkout: &str, card: &str) -> Answer {
    api.post(
        &format!("/v1/checkouts/{checkout}/complete"),
        json!({"card_number": card, "cvc": "123", "exp": "12/34"}),
    )
    .await
}

async fn delete(api: &Api, path: &str) -> Answer {
    Api::finish_raw(
        api.http
            .delete(format!("{}{path}", api.base))
            .header("x-api-key", &api.key),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discounts_are_created_found_by_id_or_code_updated_and_deleted() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let prod = product(&api, json!({})).await;
    let created = api
        .post(
            "/v1/discounts",
            json!({"name": "Launch", "code": "LAUNCH", "type": "percentage", "amount": 15,
                   "duration": "repeating", "duration_in_months": 3,
                   "applies_to_products": [prod], "max_redemptions": 10}),
        )
        .await;
    let disc = id(&created);
    let d = &created.body;
    assert!(disc.starts_with("dis_"));
    assert_eq!(d["object"], "discount");
    assert_eq!(d["status"], "active");
    assert_eq!(d["percentage"], 15);
    assert_eq!(d["redeem_count"], 0);
    assert_eq!(d["duration_in_months"], 3);

    let by_code = api.get("/v1/discounts?discount_code=LAUNCH").await;
    assert_eq!(by_code.body["id"], disc.as_str());
    let by_id = api.get(&format!("/v1/discounts?discount_id={disc}")).await;
    assert_eq!(by_id.body["code"], "LAUNCH");
    assert_error(
        &api.get("/v1/discounts").await,
        400,
        "invalid_request_error",
    );
    assert_error(
        &api.get(&format!(
            "/v1/discounts?discount_id={disc}&discount_code=LAUNCH"
        ))
        .await,
        400,
        "invalid_request_error",
    );
    let missing = assert_error(
        &api.get("/v1/discounts?discount_code=NOPE").await,
        404,
        "invalid_request_error",
    );
    assert_eq!(missing["param"], "discount_code");

    // Every rule names its field.
    let bad = [
        (
            json!({"code": "A", "type": "fixed", "amount": 5, "currency": "usd"}),
            "name",
        ),
        (
            json!({"name": "x", "code": "A B", "type": "fixed", "amount": 5, "currency": "usd"}),
            "code",
        ),
        (
            json!({"name": "x", "code": "A", "type": "half", "amount": 5}),
            "type",
        ),
        (
            json!({"name": "x", "code": "A", "type": "fixed", "amount": 5}),
            "currency",
        ),
        (
            json!({"name": "x", "code": "A", "type": "percentage", "amount": 101}),
            "amount",
        ),
        (
            json!({"name": "x", "code": "A", "type": "percentage", "amount": 5, "duration": "repeating"}),
            "duration_in_months",
        ),
        (
            json!({"name": "x", "code": "A", "type": "percentage", "amount": 5, "max_redemptions": 0}),
            "max_redemptions",
        ),
        (
            json!({"name": "x", "code": "A", "type": "percentage", "amount": 5, "expiry_date": "soon"}),
            "expiry_date",
        ),
    ];
    for (body, param) in bad {
        let error = assert_error(
            &api.post("/v1/discounts", body.clone()).await,
            400,
            "invalid_request_error",
        );
        assert_eq!(error["param"], param, "{body}");
    }
    let unknown = assert_error(
        &api.post(
            "/v1/discounts",
            json!({"name": "x", "code": "B", "type": "percentage", "amount": 5, "applies_to_products": ["prod_nope"]}),
        )
        .await,
        404,
        "invalid_request_error",
    );
    assert_eq!(unknown["param"], "applies_to_products[0]");
    let taken = assert_error(
        &api.post(
            "/v1/discounts",
            json!({"name": "again", "code": "LAUNCH", "type": "percentage", "amount": 5}),
        )
        .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(taken["code"], "discount_code_taken");
    // Codes are what customers type: another case is the same code, found and taken.
    let other_case = assert_error(
        &api.post(
            "/v1/discounts",
            json!({"name": "again", "code": "launch", "type": "percentage", "amount": 5}),
        )
        .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(other_case["code"], "discount_code_taken");
    let by_code = api.get("/v1/discounts?discount_code=Launch").await;
    assert_eq!(by_code.status, 200, "{}", by_code.body);
    assert_eq!(by_code.body["code"], "LAUNCH", "kept as created");

    // draft -> active; scheduled until its start; expired at its expiry date.
    let now = server.clock.now_ms();
    let start = tally_domain::time::format_iso8601_ms(now + 60_000);
    let end = tally_domain::time::format_iso8601_ms(now + 120_000);
    let later = api
        .post(
            "/v1/discounts",
            json!({"name": "Later", "code": "LATER", "type": "fixed", "amount": 500, "currency": "usd",
                   "starts_at": start, "expiry_date": end}),
        )
        .await;
    assert_eq!(later.body["status"], "scheduled", "{}", later.body);
    let later_id = id(&later);
    server.clock.advance_ms(61_000);
    let path = format!("/v1/discounts/{later_id}");
    assert_eq!(api.get(&path).await.body["status"], "active");
    server.clock.advance_ms(60_000);
    assert_eq!(api.get(&path).await.body["status"], "expired");

    let draft = api
        .post(
            "/v1/discounts",
            json!({"name": "Draft", "code": "DRAFT", "type": "percentage", "amount": 5, "status": "draft"}),
        )
        .await;
    assert_eq!(draft.body["status"], "draft");
    let draft_id = id(&draft);
    let path = format!("/v1/discounts/{draft_id}");
    let immutable = assert_error(
        &api.post(&path, json!({"amount": 50})).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(immutable["code"], "discount_field_immutable");
    let activated = api.post(&path, json!({"status": "active"})).await;
    assert_eq!(activated.body["status"], "active", "{}", activated.body);
    let deleted = delete(&api, &path).await;
    assert_eq!(deleted.status, 200, "{}", deleted.body);
    assert_eq!(deleted.body["status"], "deleted");
    assert_eq!(api.get(&path).await.body["status"], "deleted");
    // A deleted code is not free again.
    let reused = api
        .post(
            "/v1/discounts",
            json!({"name": "x", "code": "DRAFT", "type": "percentage", "amount": 5}),
        )
        .await;
    assert_eq!(reused.status, 409, "{}", reused.body);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkout_charges_once_with_discount_and_tax_and_starts_a_subscription() {
    let (_g, dir, server, api, keys) = setup().await;
    let prod = product(
        &api,
        json!({"features": [{"type": "customer_credits",
            "customer_credits": {"amount": "250.5", "unit_label": "tokens", "bucket_name": "main"}}]}),
    )
    .await;
    let rate = api
        .post("/v1/tax-rates", json!({"country": "DE", "rate": "19"}))
        .await;
    assert_eq!(rate.status, 200, "{}", rate.body);
    api.post("/v1/tax-rates", json!({"country": "AT", "rate": "20"}))
        .await;
    let rates = api.get("/v1/tax-rates").await.body;
    assert_eq!(
        rates["data"],
        json!([{"object": "tax_rate", "country": "AT", "rate": "20"},
               {"object": "tax_rate", "country": "DE", "rate": "19"}])
    );
    let cus = customer(&api, "DE").await;
    api.post(
        "/v1/discounts",
        json!({"name": "Ten", "code": "TEN", "type": "percentage", "amount": 10,
               "duration": "repeating", "duration_in_months": 3, "max_redemptions": 1}),
    )
    .await;
    let hook = api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["checkout.completed", "subscription.active",
                "subscription.paid", "subscription.trialing", "refund.created", "dispute.created"]}),
        )
        .await;
    let hook = id(&hook);

    let created = api
        .post(
            "/v1/checkouts",
            json!({"product_id": prod, "customer_id": cus, "units": 2, "discount_code": "TEN",
                   "metadata": {"order": 7}}),
        )
        .await;
    let chk = id(&created);
    assert_eq!(created.body["status"], "open");
    // 2 x 1900 = 3800, less 10% = 3420, plus 19% tax (649.8 -> 650) = 4070.
    assert_eq!(created.body["amount"], 4070);

    // Declined cards answer 402 with their code; nothing is charged, the checkout stays open.
    for (card, code) in [
        ("4000000000000002", "card_declined"),
        ("4000000000009995", "insufficient_funds"),
        ("4000000000000127", "incorrect_cvc"),
    ] {
        let error = assert_error(&pay(&api, &chk, card).await, 402, "card_error");
        assert_eq!(error["code"], code);
    }
    let bad_cvc = assert_error(
        &api.post(
            &format!("/v1/checkouts/{chk}/complete"),
            json!({"card_number": CARD, "cvc": "1", "exp": "12/34"}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad_cvc["param"], "cvc");
    // A card past its expiry month (by the store's clock) is declined too, naming
    // the expiry; one good through this month pays (below, with the test card).
    let expired = assert_error(
        &api.post(
            &format!("/v1/checkouts/{chk}/complete"),
            json!({"card_number": CARD, "cvc": "123", "exp": "01/20"}),
        )
        .await,
        402,
        "card_error",
    );
    assert_eq!(expired["code"], "expired_card", "{expired}");
    assert_eq!(expired["param"], "exp", "{expired}");
    assert_eq!(
        api.get(&format!("/v1/checkouts/{chk}")).await.body["status"],
        "open"
    );
    assert_eq!(
        api.get("/v1/transactions").await.body["data"],
        json!([]),
        "nothing charged"
    );

    // Listed, newest first, with a cursor.
    server.clock.advance_ms(1);
    let other = id(&api
        .post(
            "/v1/checkouts",
            json!({"product_id": prod, "customer_id": cus}),
        )
        .await);
    let listed = api.get("/v1/checkouts?limit=1").await.body;
    assert_eq!(listed["data"][0]["id"], other.as_str());
    assert_eq!(listed["has_more"], true);
    let next = api
        .get(&format!("/v1/checkouts?limit=1&starting_after={other}"))
        .await
        .body;
    assert_eq!(next["data"][0]["id"], chk.as_str());
    // A listed checkout is the object a retrieve answers.
    assert_eq!(
        next["data"][0],
        api.get(&format!("/v1/checkouts/{chk}")).await.body
    );

    let paid = pay(&api, &chk, CARD).await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    assert_eq!(paid.body["status"], "completed");
    let txn = paid.body["transaction_id"].as_str().unwrap().to_string();
    let sub = paid.body["subscription_id"].as_str().unwrap().to_string();
    assert_eq!(paid.body["customer_id"], cus.as_str());
    // Paying again answers the same completion, never a second charge.
    let again = pay(&api, &chk, CARD).await;
    assert_eq!(again.body["transaction_id"], txn.as_str());

    let t = api.get(&format!("/v1/transactions/{txn}")).await.body;
    assert_eq!(t["object"], "transaction");
    assert_eq!(t["type"], "payment");
    assert_eq!(t["status"], "paid");
    assert_eq!(t["amount"], 3800);
    assert_eq!(t["discount_amount"], 380);
    assert_eq!(t["tax_amount"], 650);
    assert_eq!(t["amount_paid"], 4070);
    assert_eq!(t["tax_country"], "DE");
    assert_eq!(t["currency"], "USD");
    assert_eq!(t["subscription"], sub.as_str());
    assert_eq!(t["order"], chk.as_str());

    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "active");
    assert_eq!(s["product"]["id"], prod.as_str());
    assert_eq!(s["customer"]["id"], cus.as_str());
    assert_eq!(s["items"][0]["units"], 2);
    assert_eq!(s["last_transaction_id"], txn.as_str());
    assert_eq!(s["last_transaction"]["amount_paid"], 4070);
    assert_eq!(s["discount"]["discountCode"], "TEN");
    assert_eq!(s["discount"]["durationInMonths"], 3);
    assert!(s["next_transaction_date"].as_str().is_some());

    // The one redemption the code allowed is used: the code is exhausted.
    let disc = api.get("/v1/discounts?discount_code=TEN").await.body;
    assert_eq!(disc["redeem_count"], 1);
    assert_eq!(disc["status"], "expired");
    let exhausted = assert_error(
        &api.post(
            "/v1/checkouts",
            json!({"product_id": prod, "customer_id": cus, "discount_code": "TEN"}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(exhausted["code"], "discount_exhausted");
    assert_eq!(exhausted["param"], "discount_code");

    // The feature's credits, times the units, once however often completed.
    let accounts = api
        .get(&format!("/v1/customer-credits/accounts?customer_id={cus}"))
        .await
        .body;
    let main = accounts["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "main")
        .expect("the account the feature names")
        .clone();
    assert_eq!(main["balance"], "501");

    // Refunds: part, too much, the rest, a refund of a refund.
    let part = api
        .post(
            "/v1/refunds",
            json!({"transaction_id": txn, "amount": 1000, "reason": "goodwill"}),
        )
        .await;
    assert_eq!(part.status, 200, "{}", part.body);
    assert_eq!(part.body["type"], "refund");
    assert_eq!(part.body["amount"], 1000);
    let t = api.get(&format!("/v1/transactions/{txn}")).await.body;
    assert_eq!(
        (t["refunded_amount"].clone(), t["status"].clone()),
        (json!(1000), json!("partially_refunded"))
    );
    let too_much = assert_error(
        &api.post(
            "/v1/refunds",
            json!({"transaction_id": txn, "amount": 3071}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(too_much["code"], "refund_exceeds_remaining");
    assert_eq!(too_much["param"], "amount");
    // Nothing or less: one message, naming the range that is accepted.
    for amount in [0, -5] {
        let refused = assert_error(
            &api.post(
                "/v1/refunds",
                json!({"transaction_id": txn, "amount": amount}),
            )
            .await,
            400,
            "invalid_request_error",
        );
        assert_eq!(refused["param"], "amount");
        assert!(
            refused["message"].as_str().unwrap().contains("from 1 to"),
            "{refused}"
        );
    }
    let rest = api
        .post("/v1/refunds", json!({"transaction_id": txn}))
        .await;
    assert_eq!(rest.body["amount"], 3070, "{}", rest.body);
    let t = api.get(&format!("/v1/transactions/{txn}")).await.body;
    assert_eq!(t["status"], "refunded");
    let refund_id = rest.body["id"].as_str().unwrap();
    let of_refund = assert_error(
        &api.post("/v1/refunds", json!({"transaction_id": refund_id}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(of_refund["code"], "transaction_not_refundable");
    assert_error(
        &api.post("/v1/refunds", json!({"transaction_id": "txn_nope"}))
            .await,
        404,
        "invalid_request_error",
    );

    // Disputes, once per payment.
    let dispute = api
        .post("/v1/disputes", json!({"transaction_id": txn}))
        .await;
    assert_eq!(dispute.status, 200, "{}", dispute.body);
    assert_eq!(dispute.body["object"], "dispute");
    let twice = assert_error(
        &api.post("/v1/disputes", json!({"transaction_id": txn}))
            .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(twice["code"], "dispute_exists");

    // Lists by customer and by subscription.
    let by_customer = api
        .get(&format!("/v1/transactions?customer_id={cus}"))
        .await
        .body;
    assert_eq!(by_customer["data"].as_array().unwrap().len(), 3);
    let by_sub = api
        .get(&format!("/v1/transactions?subscription_id={sub}&limit=1"))
        .await
        .body;
    assert_eq!(by_sub["data"].as_array().unwrap().len(), 1);
    assert_eq!(by_sub["has_more"], true);

    // The events, with the resource as `object`.
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending"))
        .await
        .body;
    let bodies: Vec<Value> = feed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| serde_json::from_str(i["body"].as_str().unwrap()).unwrap())
        .collect();
    let types: Vec<&str> = bodies
        .iter()
        .map(|b| b["eventType"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        vec![
            "checkout.completed",
            "subscription.active",
            "subscription.paid",
            "refund.created",
            "refund.created",
            "dispute.created"
        ]
    );
    assert_eq!(bodies[0]["object"]["id"], chk.as_str());
    assert_eq!(bodies[1]["object"]["object"], "subscription");
    // The subscription's last transaction, as it was at the event: paid, nothing
    // refunded yet (it was refunded in full since).
    let last = &bodies[2]["object"]["last_transaction"];
    assert_eq!(last["id"], txn.as_str(), "{}", bodies[2]);
    assert_eq!(
        (last["amount_paid"].clone(), last["refunded_amount"].clone()),
        (json!(4070), json!(0))
    );
    assert_eq!(bodies[2]["object"]["last_transaction_id"], txn.as_str());
    // Its customer as it was, whole, as a retrieve embeds it.
    let customer_then = &bodies[2]["object"]["customer"];
    assert_eq!(customer_then["id"], cus.as_str(), "{}", bodies[2]);
    assert!(customer_then["email"].is_string(), "{}", bodies[2]);
    assert_eq!(customer_then["country"], "DE");
    assert_eq!(bodies[3]["object"]["amount"], 1000);
    assert_eq!(bodies[5]["object"]["transaction_id"], txn.as_str());

    // Everything survives a restart.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    let t = api.get(&format!("/v1/transactions/{txn}")).await.body;
    assert_eq!(
        (t["refunded_amount"].clone(), t["disputed"].clone()),
        (json!(4070), json!(true))
    );
    assert_eq!(
        api.get("/v1/discounts?discount_code=TEN").await.body["redeem_count"],
        1
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkouts_refuse_bad_input_and_live_payments_and_start_trials() {
    let (_g, _dir, server, api, keys) = setup().await;
    let trial = product(&api, json!({"trial_period_days": 14})).await;
    let cus = customer(&api, "US").await;
    for (body, status, param) in [
        (json!({"customer_id": cus}), 400, "product_id"),
        (
            json!({"product_id": "prod_nope", "customer_id": cus}),
            404,
            "product_id",
        ),
        (json!({"product_id": trial}), 400, "customer_id"),
        (
            json!({"product_id": trial, "customer_id": "cus_nope"}),
            404,
            "customer_id",
        ),
        (
            json!({"product_id": trial, "customer_id": cus, "units": 0}),
            400,
            "units",
        ),
        (
            json!({"product_id": trial, "customer_id": cus, "discount_code": "NOPE"}),
            404,
            "discount_code",
        ),
        (
            json!({"product_id": trial, "customer": {"email": "not-an-email"}}),
            400,
            "customer.email",
        ),
        (
            json!({"product_id": trial, "customer_id": cus, "success_url": "ftp://x"}),
            400,
            "success_url",
        ),
    ] {
        let error = assert_error(
            &api.post("/v1/checkouts", body.clone()).await,
            status,
            "invalid_request_error",
        );
        assert_eq!(error["param"], param, "{body}");
    }
    // A fixed discount of another currency, a discount for another product.
    let other = product(&api, json!({"name": "Other"})).await;
    api.post(
        "/v1/discounts",
        json!({"name": "Eur", "code": "EUR5", "type": "fixed", "amount": 500, "currency": "eur"}),
    )
    .await;
    api.post("/v1/discounts", json!({"name": "Only", "code": "ONLY", "type": "percentage", "amount": 5, "applies_to_products": [other]})).await;
    for (code, expected) in [
        ("EUR5", "discount_currency_mismatch"),
        ("ONLY", "discount_not_applicable"),
    ] {
        let error = assert_error(
            &api.post(
                "/v1/checkouts",
                json!({"product_id": trial, "customer_id": cus, "discount_code": code}),
            )
            .await,
            400,
            "invalid_request_error",
        );
        assert_eq!(error["code"], expected);
    }

    // A new customer from an email; a trial: trialing, nothing charged, no paid event.
    let created = api
        .post(
            "/v1/checkouts",
            json!({"product_id": trial, "customer": {"email": "new@example.com"}}),
        )
        .await;
    let chk = id(&created);
    let new_customer = created.body["customer_id"].as_str().unwrap().to_string();
    assert_eq!(
        api.get(&format!("/v1/customers/{new_customer}")).await.body["email"],
        "new@example.com"
    );
    let paid = pay(&api, &chk, "4000000000000341").await;
    assert_eq!(paid.status, 200, "{}", paid.body);
    let sub = paid.body["subscription_id"].as_str().unwrap();
    let s = api.get(&format!("/v1/subscriptions/{sub}")).await.body;
    assert_eq!(s["status"], "trialing");
    assert!(s["trial_end_date"].as_str().is_some());
    let txn = paid.body["transaction_id"].as_str().unwrap();
    assert_eq!(
        api.get(&format!("/v1/transactions/{txn}")).await.body["amount_paid"],
        0
    );

    // Live mode has no payment provider; disputes are simulated in test mode only.
    let live = Api::new(&server.prod_url, &keys.prod);
    let live_product = product(&live, json!({})).await;
    let live_customer = customer(&live, "US").await;
    let live_checkout = id(&live
        .post(
            "/v1/checkouts",
            json!({"product_id": live_product, "customer_id": live_customer}),
        )
        .await);
    let error = assert_error(
        &pay(&live, &live_checkout, CARD).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(error["code"], "payment_provider_not_configured");
    let error = assert_error(
        &live
            .post("/v1/disputes", json!({"transaction_id": "txn_x"}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(error["code"], "test_mode_only");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_completions_never_redeem_a_discount_past_its_limit() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let prod = product(
        &api,
        json!({"billing_type": "onetime", "billing_period": "once"}),
    )
    .await;
    let cus = customer(&api, "US").await;
    api.post(
        "/v1/discounts",
        json!({"name": "Three", "code": "THREE", "type": "fixed", "amount": 100, "currency": "usd", "max_redemptions": 3}),
    )
    .await;
    let mut checkouts = Vec::new();
    for _ in 0..8 {
        checkouts.push(id(&api
            .post(
                "/v1/checkouts",
                json!({"product_id": prod, "customer_id": cus, "discount_code": "THREE"}),
            )
            .await));
    }
    let answers = futures::future::join_all(checkouts.iter().map(|chk| pay(&api, chk, CARD))).await;
    let ok = answers.iter().filter(|a| a.status == 200).count();
    for refused in answers.iter().filter(|a| a.status != 200) {
        let error = assert_error(refused, 400, "invalid_request_error");
        assert!(
            ["discount_exhausted"].contains(&error["code"].as_str().unwrap()),
            "{}",
            refused.body
        );
    }
    assert_eq!(ok, 3);
    let disc = api.get("/v1/discounts?discount_code=THREE").await.body;
    assert_eq!(disc["redeem_count"], 3);
    assert_eq!(disc["status"], "expired");
    let payments = api.get("/v1/transactions").await.body;
    assert_eq!(payments["data"].as_array().unwrap().len(), 3);
    for p in payments["data"].as_array().unwrap() {
        assert_eq!(p["amount_paid"], 1800);
        assert_eq!(p["subscription"], Value::Null);
    }
    // The limit cannot go below what was redeemed; raising it revives the code.
    let path = format!("/v1/discounts/{}", disc["id"].as_str().unwrap());
    let below = assert_error(
        &api.post(&path, json!({"max_redemptions": 2})).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(below["param"], "max_redemptions");
    let raised = api.post(&path, json!({"max_redemptions": 4})).await;
    assert_eq!(raised.body["status"], "active", "{}", raised.body);
    assert_eq!(raised.body["redeem_count"], 3);
    server.stop().await;
}

/// Polls a resource until `done` holds (the settler runs after the usage is
/// applied), failing with the last body after a generous deadline.
async fn until(api: &Api, path: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let body = api.get(path).await.body;
        if done(&body) {
            return body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never settled: {body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn settled<'a>(sub: &'a Value, meter: &str) -> &'a Value {
    sub["usage_settlement"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["meter_id"] == meter)
        .unwrap_or(&Value::Null)
}

/// Waits until the subscription's settlement of `meter` is `expected` (the settler
/// runs after the usage is applied).
async fn settles_to(api: &Api, sub_path: &str, meter: &str, expected: Value) {
    until(api, sub_path, |s| settled(s, meter) == &expected).await;
}

/// Buys `prod` for `cus` with the test card, a millisecond after whatever was sent
/// before, then moves the clock on a millisecond (usage after it is charged):
/// answers the subscription's id.
async fn subscribe(server: &Server, api: &Api, prod: &str, cus: &str) -> String {
    server.clock.advance_ms(1);
    let chk = id(&api
        .post(
            "/v1/checkouts",
            json!({"product_id": prod, "customer_id": cus}),
        )
        .await);
    let paid = pay(api, &chk, CARD).await;
    server.clock.advance_ms(1);
    paid.body["subscription_id"].as_str().unwrap().to_string()
}

/// Meters `calls` (count of `api_call`) and `tokens` (sum of `llm`'s `n`), and a
/// product granting `credits` into the account `api` and settling both in credits
/// there: calls at 0.5 after `free_calls` free ones, tokens at 0.01. Answers
/// (calls, tokens, product).
async fn priced_in_credits(api: &Api, credits: &str, free_calls: u32) -> (String, String, String) {
    let calls = id(&api
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "api_call", "aggregation": "count"}),
        )
        .await);
    let tokens = id(&api
        .post(
            "/v1/meters",
            json!({"name": "tokens", "event_name": "llm", "aggregation": "sum",
                   "aggregation_property": "n"}),
        )
        .await);
    let prod = product(
        api,
        json!({
            "features": [{"type": "customer_credits",
                "customer_credits": {"amount": credits, "unit_label": "credits", "bucket_name": "api"}}],
            "usage_prices": [
                {"meter_id": calls, "unit_price": "0.5", "settlement_mode": "credits",
                 "target_account_name": "api", "free_allowance": free_calls},
                {"meter_id": tokens, "unit_price": "0.01", "settlement_mode": "credits",
                 "target_account_name": "api"},
            ]
        }),
    )
    .await;
    (calls, tokens, prod)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_priced_in_credits_is_debited_once_per_event_and_never_below_zero() {
    let (_g, dir, server, api, keys) = setup().await;
    let (calls, tokens, prod) = priced_in_credits(&api, "10", 2).await;
    let meter = |body: Value| {
        let api = api.clone();
        async move { id(&api.post("/v1/meters", body).await) }
    };
    // Credits are debited event by event: only count and sum meters settle so.
    let peak = meter(
        json!({"name": "peak", "event_name": "llm", "aggregation": "max",
        "aggregation_property": "n"}),
    )
    .await;
    let refused = assert_error(
        &api.post(
            "/v1/products",
            json!({"name": "Peak", "price": 100, "currency": "usd", "billing_type": "recurring",
                   "billing_period": "every-month",
                   "usage_prices": [{"meter_id": peak, "unit_price": 1, "settlement_mode": "credits"}]}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(refused["param"], "usage_prices[0].settlement_mode");
    let cus = customer(&api, "US").await;
    let hook = id(&api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["credits.consumed", "customer_credits.exhausted"]}),
        )
        .await);
    // Usage before the purchase is not charged.
    api.post(
        "/v1/events/ingest",
        json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "early"}]}),
    )
    .await;
    let sub = subscribe(&server, &api, &prod, &cus).await;
    let sub_path = format!("/v1/subscriptions/{sub}");

    // Four calls (one sent twice): 2 free, 2 x 0.5 = 1 credit.
    let ingest = |events: Value| {
        let api = api.clone();
        async move {
            let answer = api
                .post("/v1/events/ingest", json!({"events": events}))
                .await;
            assert_eq!(answer.status, 202, "{}", answer.body);
        }
    };
    ingest(json!([
        {"name": "api_call", "customer_id": cus, "event_id": "c1"},
        {"name": "api_call", "customer_id": cus, "event_id": "c2"},
        {"name": "api_call", "customer_id": cus, "event_id": "c3"},
        {"name": "api_call", "customer_id": cus, "event_id": "c1"},
    ]))
    .await;
    ingest(json!([{"name": "api_call", "customer_id": cus, "event_id": "c4"}])).await;
    ingest(json!([{"name": "api_call", "customer_id": cus, "event_id": "c2"}])).await;
    let s = until(&api, &sub_path, |s| settled(s, &calls)["quantity"] == "4").await;
    assert_eq!(settled(&s, &calls)["billed"], "1");
    assert_eq!(settled(&s, &calls)["debited"], "1");

    // 300 tokens at 0.01 = 3 credits.
    ingest(
        json!([{"name": "llm", "customer_id": cus, "event_id": "t1", "properties": {"n": 300}}]),
    )
    .await;
    until(&api, &sub_path, |s| settled(s, &tokens)["debited"] == "3").await;

    // 1000 tokens = 10 credits, but 6 are left: 6 are taken, 4 are short.
    ingest(
        json!([{"name": "llm", "customer_id": cus, "event_id": "t2", "properties": {"n": 1000}}]),
    )
    .await;
    settles_to(
        &api,
        &sub_path,
        &tokens,
        json!({"meter_id": tokens, "account_name": "api", "quantity": "1300",
                "billed": "13", "debited": "9", "shortfall": "4"}),
    )
    .await;
    // Empty already: nothing more is taken, the shortfall grows.
    ingest(json!([{"name": "api_call", "customer_id": cus, "event_id": "c5"}])).await;
    settles_to(
        &api,
        &sub_path,
        &calls,
        json!({"meter_id": calls, "account_name": "api", "quantity": "5",
                "billed": "1.5", "debited": "1", "shortfall": "0.5"}),
    )
    .await;

    let accounts = api
        .get(&format!("/v1/customer-credits/accounts?customer_id={cus}"))
        .await
        .body;
    let account = accounts["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "api")
        .expect("the account the feature granted into")
        .clone();
    assert_eq!(account["balance"], "0");

    // One debit per usage record: 0.5 (c1-c3, two of them free), 0.5 (c4), 3, then 6
    // and the exhaustion; the later shortfall announces nothing.
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending?limit=100"))
        .await
        .body;
    let bodies: Vec<Value> = feed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| serde_json::from_str(i["body"].as_str().unwrap()).unwrap())
        .collect();
    let types: Vec<&str> = bodies
        .iter()
        .map(|b| b["eventType"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        vec![
            "credits.consumed",
            "credits.consumed",
            "credits.consumed",
            "credits.consumed",
            "customer_credits.exhausted"
        ],
        "{feed}"
    );

    // A grant refills the account; the next shortfall is announced again.
    let account_id = account["id"].as_str().unwrap();
    let credit = api
        .post(
            &format!("/v1/customer-credits/accounts/{account_id}/credit"),
            json!({"amount": "0.25", "idempotency_key": "refill"}),
        )
        .await;
    assert_eq!(credit.status, 200, "{}", credit.body);
    ingest(json!([{"name": "api_call", "customer_id": cus, "event_id": "c6"}])).await;
    let s = until(&api, &sub_path, |s| settled(s, &calls)["quantity"] == "6").await;
    assert_eq!(settled(&s, &calls)["debited"], "1.25");
    assert_eq!(settled(&s, &calls)["shortfall"], "0.75");

    // A canceled subscription settles nothing more, and its customer is warned.
    let refill = api
        .post(
            &format!("/v1/customer-credits/accounts/{account_id}/credit"),
            json!({"amount": "5", "idempotency_key": "refill-2"}),
        )
        .await;
    assert_eq!(refill.status, 200, "{}", refill.body);
    let canceled = api
        .post(&format!("{sub_path}/cancel"), json!({"mode": "immediate"}))
        .await;
    assert_eq!(canceled.body["status"], "canceled", "{}", canceled.body);
    server.clock.advance_ms(1);
    let after = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "c7"}]}),
        )
        .await;
    assert_eq!(
        after.body["events"][0]["warnings"][0]["code"], "customer_has_no_active_subscription",
        "{}",
        after.body
    );
    server.engine.wait_caught_up().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &calls)["quantity"], "6", "{s}");
    assert_eq!(
        api.get(&format!("/v1/customer-credits/accounts/{account_id}"))
            .await
            .body["balance"],
        "5"
    );

    // Everything survives a restart, and nothing is settled twice.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &calls)["debited"], "1.25");
    assert_eq!(settled(&s, &tokens)["debited"], "9");
    let account = api
        .get(&format!("/v1/customer-credits/accounts/{account_id}"))
        .await
        .body;
    assert_eq!(account["balance"], "5");
    server.stop().await;
}

/// Where each partition of the server's log ends.
async fn log_ends(server: &Server) -> Vec<u64> {
    let log = server.engine.log();
    let mut ends = Vec::new();
    for partition in 0..log.partition_count() {
        ends.push(log.read_end(partition).await.unwrap());
    }
    ends
}

/// The records appended to the server's log since `ends`.
async fn records_since(server: &Server, ends: &[u64]) -> usize {
    let log = server.engine.log();
    let mut count = 0;
    for (partition, from) in ends.iter().enumerate() {
        let until = log.read_end(partition as u32).await.unwrap();
        tally_log::read_range(
            log.as_ref(),
            partition as u32,
            *from,
            until,
            100,
            |entries| {
                count += entries.len();
                Ok::<(), tally_log::LogError>(())
            },
        )
        .await
        .unwrap();
    }
    count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkouts_credits_are_granted_by_its_completion_record() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let prod = product(
        &api,
        json!({"features": [{"type": "customer_credits",
            "customer_credits": {"amount": "5", "bucket_name": "bucket"}}]}),
    )
    .await;
    let checkout = |cus: String| {
        let api = api.clone();
        let prod = prod.clone();
        async move {
            id(&api
                .post(
                    "/v1/checkouts",
                    json!({"product_id": prod, "customer_id": cus, "units": 3}),
                )
                .await)
        }
    };
    let pay = json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/34"});

    // One record completes the checkout and grants its credits (the account
    // created with them): a crash cannot keep one without the other.
    let cus = customer(&api, "US").await;
    let chk = checkout(cus.clone()).await;
    let before = log_ends(&server).await;
    let done = api
        .post(&format!("/v1/checkouts/{chk}/complete"), pay.clone())
        .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(records_since(&server, &before).await, 1, "one record");
    let accounts = api
        .get(&format!("/v1/customer-credits/accounts?customer_id={cus}"))
        .await
        .body;
    assert_eq!(accounts["data"][0]["name"], "bucket", "{accounts}");
    assert_eq!(accounts["data"][0]["balance"], "15", "{accounts}");
    let again = api
        .post(&format!("/v1/checkouts/{chk}/complete"), pay.clone())
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
    let account = accounts["data"][0]["id"].as_str().unwrap();
    let balance = api
        .get(&format!("/v1/customer-credits/accounts/{account}"))
        .await
        .body;
    assert_eq!(balance["balance"], "15", "granted once: {balance}");

    // A frozen account of that name takes nothing, and the purchase still completes
    // (it was paid).
    let frozen_owner = customer(&api, "US").await;
    let frozen = id(&api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": frozen_owner, "name": "bucket"}),
        )
        .await);
    let froze = api
        .post(
            &format!("/v1/customer-credits/accounts/{frozen}/freeze"),
            json!({}),
        )
        .await;
    assert_eq!(froze.status, 200, "{}", froze.body);
    let chk = checkout(frozen_owner).await;
    let done = api
        .post(&format!("/v1/checkouts/{chk}/complete"), pay)
        .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.body["status"], "completed");
    let balance = api
        .get(&format!("/v1/customer-credits/accounts/{frozen}"))
        .await
        .body;
    assert_eq!(balance["balance"], "0", "{balance}");

    // Replaying the log grants the same, to the same accounts and ids.
    server.engine.wait_caught_up().await.unwrap();
    let replayed: std::sync::Arc<dyn tally_projection::ProjectionStore> =
        std::sync::Arc::new(tally_projection::MemoryStore::new());
    for partition in 0..server.engine.log().partition_count() {
        tally_engine::projector::replay_partition(
            server.engine.log().as_ref(),
            replayed.clone(),
            partition,
            |_, _| {},
        )
        .await
        .unwrap();
    }
    assert_eq!(
        replayed.digest().unwrap(),
        server.engine.store().digest().unwrap()
    );
    server.stop().await;
}

/// The ledger's audit replays the log's transactions (debits and credits of usage
/// settled in credits included) to the balances the projection holds.
async fn assert_ledger_audits_clean(server: &Server) {
    let mut audit = tally_engine::audit::replay_ledger(
        server.engine.log().as_ref(),
        server.engine.store().as_ref(),
        |_, _| {},
        |_, _, _, _| {},
    )
    .await
    .unwrap();
    server
        .engine
        .ledger()
        .check_projected_balances(&mut audit)
        .unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

/// The customer's first credit account's id.
async fn first_account(api: &Api, cus: &str) -> String {
    let accounts = api
        .get(&format!("/v1/customer-credits/accounts?customer_id={cus}"))
        .await
        .body;
    accounts["data"][0]["id"].as_str().unwrap().to_string()
}

/// The account's balance, read through the API.
async fn balance(api: &Api, account_id: &str) -> String {
    let account = api
        .get(&format!("/v1/customer-credits/accounts/{account_id}"))
        .await;
    assert_eq!(account.status, 200, "{}", account.body);
    account.body["balance"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voided_usage_settled_in_credits_gives_back_what_it_cost() {
    let (_g, dir, server, api, keys) = setup().await;
    let (calls, tokens, prod) = priced_in_credits(&api, "20", 1).await;
    let cus = customer(&api, "US").await;
    let ingest = |events: Value| {
        let api = api.clone();
        async move {
            let answer = api
                .post("/v1/events/ingest", json!({"events": events}))
                .await;
            assert_eq!(answer.status, 202, "{}", answer.body);
        }
    };
    // Usage before the purchase is never charged, so its void gives nothing back.
    ingest(json!([{"name": "api_call", "customer_id": cus, "event_id": "early"}])).await;
    let sub = subscribe(&server, &api, &prod, &cus).await;
    let sub_path = format!("/v1/subscriptions/{sub}");

    // Three calls: one free, two at 0.5; 300 tokens at 0.01: 3 credits.
    ingest(json!([
        {"name": "api_call", "customer_id": cus, "event_id": "c1"},
        {"name": "api_call", "customer_id": cus, "event_id": "c2"},
        {"name": "api_call", "customer_id": cus, "event_id": "c3"},
        {"name": "llm", "customer_id": cus, "event_id": "t1", "properties": {"n": 300}},
    ]))
    .await;
    until(&api, &sub_path, |s| {
        settled(s, &calls)["debited"] == "1" && settled(s, &tokens)["debited"] == "3"
    })
    .await;
    let account_id = first_account(&api, &cus).await;
    assert_eq!(balance(&api, &account_id).await, "16");

    let hook = id(&api
        .post(
            "/v1/webhooks",
            json!({"delivery_mode": "cli", "events": ["credits.granted"]}),
        )
        .await);
    let void = |ids: Value| {
        let api = api.clone();
        async move {
            let answer = api
                .post(
                    "/v1/events/void",
                    json!({"event_ids": ids, "reason": "test traffic"}),
                )
                .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
        }
    };
    // One billable call voided: the period used 2 instead of 3, 0.5 comes back as
    // a credit naming the meter and the purchase.
    void(json!(["c3"])).await;
    settles_to(
        &api,
        &sub_path,
        &calls,
        json!({"meter_id": calls, "account_name": "api", "quantity": "2",
                "billed": "0.5", "debited": "0.5", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "16.5");
    let entries = api
        .get(&format!(
            "/v1/customer-credits/accounts/{account_id}/entries?limit=1"
        ))
        .await
        .body;
    let tx_id = entries["data"][0]["transaction_id"].as_str().unwrap();
    let tx = api
        .get(&format!("/v1/customer-credits/transactions/{tx_id}"))
        .await
        .body;
    assert_eq!(tx["type"], "credit", "{tx}");
    assert_eq!(tx["amount"], "0.5", "{tx}");
    assert_eq!(tx["description"], format!("usage voided of meter {calls}"));
    assert_eq!(tx["metadata"]["source_id"], sub.as_str(), "{tx}");

    // The next one takes the last billable unit back; the last one was free, so it
    // gives nothing; nor does the one from before the purchase.
    void(json!(["c2"])).await;
    until(&api, &sub_path, |s| settled(s, &calls)["quantity"] == "1").await;
    assert_eq!(balance(&api, &account_id).await, "17");
    void(json!(["c1", "early"])).await;
    let s = until(&api, &sub_path, |s| settled(s, &calls)["quantity"] == "0").await;
    assert_eq!(settled(&s, &calls)["billed"], "0");
    assert_eq!(settled(&s, &calls)["debited"], "0");
    assert_eq!(balance(&api, &account_id).await, "17");

    // An amendment takes back the old event's 3 credits and charges the
    // replacement's 1, in one settlement.
    let amended = api
        .post(
            "/v1/events/t1/amend",
            json!({"event": {"event_id": "t1b", "properties": {"n": 100}}, "reason": "miscounted"}),
        )
        .await;
    assert_eq!(amended.status, 200, "{}", amended.body);
    settles_to(
        &api,
        &sub_path,
        &tokens,
        json!({"meter_id": tokens, "account_name": "api", "quantity": "100",
                "billed": "1", "debited": "1", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "19");
    // Each credit given back was announced: c3's, c2's and the amendment's (one
    // settlement: 3 back and 1 charged net to 2 back).
    let feed = api
        .get(&format!("/v1/webhooks/{hook}/events/pending?limit=100"))
        .await
        .body;
    let granted: Vec<String> = feed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let body: Value = serde_json::from_str(i["body"].as_str().unwrap()).unwrap();
            assert_eq!(body["eventType"], "credits.granted", "{body}");
            body["object"]["amount"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(granted, ["0.5", "0.5", "2"], "{feed}");

    // The ledger's audit replays the credits given back like any transaction.
    assert_ledger_audits_clean(&server).await;

    // Nothing is given back twice after a restart.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(balance(&api, &account_id).await, "19");
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &calls)["quantity"], "0");
    assert_eq!(settled(&s, &tokens)["debited"], "1");
    server.stop().await;
}

/// A meter revision corrects usage settled in credits: each charged event is
/// charged what the new definition makes it, more or less, and a void after it
/// gives back what the event was last charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meter_revision_corrects_usage_settled_in_credits() {
    let (_g, dir, server, api, keys) = setup().await;
    let (calls, tokens, prod) = priced_in_credits(&api, "20", 1).await;
    let cus = customer(&api, "US").await;
    let sub = subscribe(&server, &api, &prod, &cus).await;
    let sub_path = format!("/v1/subscriptions/{sub}");
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"name": "llm", "customer_id": cus, "event_id": "t1", "properties": {"n": 300, "m": 100}},
                {"name": "llm", "customer_id": cus, "event_id": "t2", "properties": {"n": 100, "m": 400}},
                {"name": "api_call", "customer_id": cus, "event_id": "c1", "properties": {"region": "eu"}},
                {"name": "api_call", "customer_id": cus, "event_id": "c2", "properties": {"region": "us"}},
                {"name": "api_call", "customer_id": cus, "event_id": "c3", "properties": {"region": "us"}},
            ]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    // 400 tokens at 0.01, and two calls past the free one at 0.5: 5 of 20.
    until(&api, &sub_path, |s| {
        settled(s, &calls)["debited"] == "1" && settled(s, &tokens)["debited"] == "4"
    })
    .await;
    let account_id = first_account(&api, &cus).await;
    assert_eq!(balance(&api, &account_id).await, "15");
    let revise = |meter: &str, body: Value| {
        let (api, path) = (api.clone(), format!("/v1/meters/{meter}/revisions"));
        async move {
            let answer = api.post(&path, body).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            answer.body
        }
    };

    // A dry run charges nothing.
    revise(
        &tokens,
        json!({"aggregation_property": "m", "dry_run": true}),
    )
    .await;
    // By `m` the tokens are 500: t1 is charged 2 credits less, t2 3 more.
    revise(
        &tokens,
        json!({"aggregation_property": "m", "dry_run": false}),
    )
    .await;
    settles_to(
        &api,
        &sub_path,
        &tokens,
        json!({"meter_id": tokens, "account_name": "api", "quantity": "500",
                "billed": "5", "debited": "5", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "14");
    // Only calls from the EU: c1, which is free; the two billable ones come back.
    let eu = json!({"conjunction": "and", "clauses": [{"property": "region", "operator": "eq", "value": "eu"}]});
    revise(&calls, json!({"filter": eu, "dry_run": false})).await;
    settles_to(
        &api,
        &sub_path,
        &calls,
        json!({"meter_id": calls, "account_name": "api", "quantity": "1",
                "billed": "0", "debited": "0", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "15");

    // A void gives back what the event was last charged: t2's 400 by `m`.
    let voided = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["t2"], "reason": "test traffic"}),
        )
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    settles_to(
        &api,
        &sub_path,
        &tokens,
        json!({"meter_id": tokens, "account_name": "api", "quantity": "100",
                "billed": "1", "debited": "1", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "19");
    // Revising again by what was charged already changes nothing more; back to
    // `n`, t1 is charged 2 more.
    revise(&calls, json!({"filter": eu, "dry_run": false})).await;
    revise(
        &tokens,
        json!({"aggregation_property": "n", "dry_run": false}),
    )
    .await;
    settles_to(
        &api,
        &sub_path,
        &tokens,
        json!({"meter_id": tokens, "account_name": "api", "quantity": "300",
                "billed": "3", "debited": "3", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account_id).await, "17");
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &calls)["quantity"], "1", "{s}");

    // The ledger's audit replays the corrections like any transaction, and
    // nothing is corrected twice after a restart.
    assert_ledger_audits_clean(&server).await;
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(balance(&api, &account_id).await, "17");
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &tokens)["debited"], "3", "{s}");
    assert_eq!(settled(&s, &calls)["debited"], "0", "{s}");
    server.stop().await;
}

/// An add-on item's `credits` usage prices settle while the item is on the
/// subscription, and stop when it is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_on_items_credit_prices_settle_while_it_is_on() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let main = product(&api, json!({"name": "Base"})).await;
    let (calls, _tokens, addon) = priced_in_credits(&api, "20", 1).await;
    let cus = customer(&api, "US").await;
    let sub = subscribe(&server, &api, &main, &cus).await;
    let sub_path = format!("/v1/subscriptions/{sub}");
    let account = id(&api
        .post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": cus, "name": "api", "initial_balance": "10"}),
        )
        .await);
    let ingest = |id: &str| {
        let api = api.clone();
        let body = json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": id}]});
        async move {
            let answer = api.post("/v1/events/ingest", body).await;
            assert_eq!(answer.status, 202, "{}", answer.body);
        }
    };
    ingest("before").await;
    server.clock.advance_ms(1);
    let updated = set_items(
        &api,
        &sub_path,
        json!([{"product_id": addon, "price_id": addon, "units": 1}]),
    )
    .await;
    let item = item_of(&updated, &addon);
    // The item's product grants its 20 credits into the account as it is added.
    assert_eq!(balance(&api, &account).await, "30");
    server.clock.advance_ms(1);
    // Three calls while it is on: one free, two at 0.5.
    for id in ["c1", "c2", "c3"] {
        ingest(id).await;
    }
    settles_to(
        &api,
        &sub_path,
        &calls,
        json!({"meter_id": calls, "account_name": "api", "quantity": "3",
                "billed": "1", "debited": "1", "shortfall": "0"}),
    )
    .await;
    assert_eq!(balance(&api, &account).await, "29");
    // Removed: later calls are not charged.
    set_items(&api, &sub_path, json!([{"id": item, "units": 0}])).await;
    server.clock.advance_ms(1);
    ingest("after").await;
    server.engine.wait_caught_up().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let s = api.get(&sub_path).await.body;
    assert_eq!(settled(&s, &calls)["quantity"], "3", "{s}");
    assert_eq!(balance(&api, &account).await, "29");
    server.stop().await;
}
