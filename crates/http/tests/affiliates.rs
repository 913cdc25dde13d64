//! Affiliates over real sockets: invitations (one per email), acceptance, the
//! page-based lists (every item exactly once for any page size), clicks,
//! conversions with the store's commission, refunds taking it back, suspension.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::{json, Value};

async fn setup() -> (tempfile::TempDir, Server, Api) {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    (guard, server, api)
}

fn ok(answer: &Answer) -> Value {
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body.clone()
}

async fn pay_checkout(api: &Api, body: Value) -> Value {
    let chk = ok(&api.post("/v1/checkouts", body).await);
    ok(&api
        .post(
            &format!("/v1/checkouts/{}/complete", chk["id"].as_str().unwrap()),
            json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/34"}),
        )
        .await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affiliates_join_convert_earn_and_give_back() {
    let (_g, server, api) = setup().await;
    // Bad page parameters name themselves.
    for (query, param) in [
        ("page=0", "page"),
        ("page_size=0", "page_size"),
        ("page_size=101", "page_size"),
    ] {
        let error = assert_error(
            &api.get(&format!("/v1/affiliates?{query}")).await,
            400,
            "invalid_request_error",
        );
        assert_eq!(error["param"], param);
    }
    let invite = ok(&api
        .post(
            "/v1/affiliates/invites",
            json!({"email": "Ann@Example.com", "name": "Ann"}),
        )
        .await);
    assert_eq!(invite["object"], "affiliate-invite");
    assert_eq!(invite["status"], "pending");
    // The prefixes docs/api.md lists: `inv_` for an invite.
    assert!(
        invite["id"].as_str().unwrap().starts_with("inv_"),
        "{invite}"
    );
    let twice = assert_error(
        &api.post(
            "/v1/affiliates/invites",
            json!({"email": "ann@example.com"}),
        )
        .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(twice["code"], "affiliate_invite_exists");
    let bad = assert_error(
        &api.post("/v1/affiliates/invites", json!({"email": "nope"}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad["param"], "email");
    // Invited, not joined: absent from the affiliates list.
    let none = ok(&api.get("/v1/affiliates").await);
    assert_eq!(none["items"], json!([]));
    assert_eq!(none["pagination"]["total_records"], 0);

    let id = invite["id"].as_str().unwrap();
    let aff = ok(&api
        .post(&format!("/v1/affiliates/invites/{id}/accept"), json!({}))
        .await);
    assert_eq!(aff["status"], "active");
    let code = aff["referral_code"].as_str().unwrap().to_string();
    assert_eq!(
        aff["referral_link"],
        format!("?ref={code}"),
        "no base URL set: the query alone"
    );
    let again = assert_error(
        &api.post(&format!("/v1/affiliates/invites/{id}/accept"), json!({}))
            .await,
        409,
        "invalid_request_error",
    );
    assert_eq!(again["code"], "invalid_state_transition");
    let invites = ok(&api.get("/v1/affiliates/invites").await);
    assert_eq!(invites["items"][0]["status"], "accepted");
    assert_error(
        &api.post("/v1/affiliates/invites/inv_nope/accept", json!({}))
            .await,
        404,
        "invalid_request_error",
    );
    assert_error(
        &api.get("/v1/affiliates/aff_nope").await,
        404,
        "invalid_request_error",
    );
    assert_error(
        &api.post("/v1/affiliates/aff_nope", json!({"status": "suspended"}))
            .await,
        404,
        "invalid_request_error",
    );

    // Settings: 10 % commission, links under the store's site.
    ok(&api
        .post(
            "/v1/store/settings",
            json!({"affiliate_commission_percent": "10", "referral_base_url": "https://shop.example/join"}),
        )
        .await);
    let aff_path = format!("/v1/affiliates/{}", aff["id"].as_str().unwrap());
    let aff = ok(&api.get(&aff_path).await);
    assert_eq!(
        aff["referral_link"],
        format!("https://shop.example/join?ref={code}")
    );
    // A base URL cleared gives the query alone again; one with a query of its own
    // gets `&ref=`; then back to the first.
    for (base, link) in [
        (Value::Null, format!("?ref={code}")),
        (
            json!("https://shop.example/join?lang=en"),
            format!("https://shop.example/join?lang=en&ref={code}"),
        ),
        (
            json!("https://shop.example/join"),
            format!("https://shop.example/join?ref={code}"),
        ),
    ] {
        let body = json!({ "referral_base_url": base });
        ok(&api.post("/v1/store/settings", body).await);
        assert_eq!(ok(&api.get(&aff_path).await)["referral_link"], link);
    }
    let bad_percent = assert_error(
        &api.post(
            "/v1/store/settings",
            json!({"affiliate_commission_percent": "150"}),
        )
        .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad_percent["param"], "affiliate_commission_percent");

    // Clicks.
    let clicked = ok(&api
        .post("/v1/affiliates/clicks", json!({"referral_code": code}))
        .await);
    assert_eq!(clicked["clicks"], 1);
    let unknown = assert_error(
        &api.post("/v1/affiliates/clicks", json!({"referral_code": "zzz"}))
            .await,
        404,
        "invalid_request_error",
    );
    assert_eq!(unknown["param"], "referral_code");

    // A referred checkout: one conversion, 10 % of 1999 = 199 (rounded down).
    let product = ok(&api
        .post(
            "/v1/products",
            json!({"name": "Kit", "price": 1999, "currency": "usd", "billing_type": "onetime",
                   "billing_period": "once"}),
        )
        .await)["id"]
        .clone();
    let customer = ok(&api.post("/v1/customers", json!({"email": "c@x.io"})).await)["id"].clone();
    let refused = assert_error(
        &api.post(
            "/v1/checkouts",
            json!({"product_id": product, "customer_id": customer, "affiliate_code": "zzz"}),
        )
        .await,
        404,
        "invalid_request_error",
    );
    assert_eq!(refused["param"], "affiliate_code");
    // A code is found whatever the case it is typed in.
    let typed = code.to_ascii_lowercase();
    let done = pay_checkout(
        &api,
        json!({"product_id": product, "customer_id": customer, "affiliate_code": typed}),
    )
    .await;
    let aff = ok(&api.get(&aff_path).await);
    assert_eq!(
        (aff["conversions"].clone(), aff["earnings"].clone()),
        (json!(1), json!(199))
    );
    assert_eq!(aff["currency"], "USD");

    // Refunding half takes back half the commission (rounded so the kept part
    // rounds down), the rest takes back the rest.
    let txn = done["transaction_id"].as_str().unwrap();
    ok(&api
        .post(
            "/v1/refunds",
            json!({"transaction_id": txn, "amount": 1000}),
        )
        .await);
    let aff = ok(&api.get(&aff_path).await);
    assert_eq!(aff["earnings"], 199 * 999 / 1999);
    ok(&api
        .post("/v1/refunds", json!({"transaction_id": txn}))
        .await);
    assert_eq!(ok(&api.get(&aff_path).await)["earnings"], 0);

    // Suspended: keeps what it has, earns and counts nothing new.
    let suspended = ok(&api.post(&aff_path, json!({"status": "suspended"})).await);
    assert_eq!(suspended["status"], "suspended");
    pay_checkout(
        &api,
        json!({"product_id": product, "customer_id": customer, "affiliate_code": code}),
    )
    .await;
    api.post("/v1/affiliates/clicks", json!({"referral_code": code}))
        .await;
    let aff = ok(&api.get(&aff_path).await);
    assert_eq!(
        (
            aff["conversions"].clone(),
            aff["earnings"].clone(),
            aff["clicks"].clone()
        ),
        (json!(1), json!(0), json!(1))
    );
    let bad_status = assert_error(
        &api.post(&aff_path, json!({"status": "gone"})).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad_status["param"], "status");
    assert_eq!(
        ok(&api.get("/v1/affiliates").await)["pagination"]["total_records"],
        1
    );
    server.stop().await;
}

async fn every_page(api: &Api, path: &str, size: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut page = 1;
    loop {
        let body = ok(&api
            .get(&format!("{path}?page={page}&page_size={size}"))
            .await);
        for item in body["items"].as_array().unwrap() {
            ids.push(item["id"].as_str().unwrap().to_string());
        }
        match body["pagination"]["next_page"].as_u64() {
            Some(next) => page = next as usize,
            None => return ids,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// Walking the pages of a page-based list returns every item exactly once, for
    /// any page size, and the counts add up.
    #[test]
    fn page_based_lists_return_every_item_once(count in 0usize..25, size in 1usize..12) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (_g, server, api) = setup().await;
            let mut created = Vec::new();
            for i in 0..count {
                // Distinct creation times, so newest first is one order.
                server.clock.advance_ms(1);
                let invite = ok(&api
                    .post("/v1/affiliates/invites", json!({"email": format!("a{i}@x.io")}))
                    .await);
                created.push(invite["id"].as_str().unwrap().to_string());
            }
            let listed = every_page(&api, "/v1/affiliates/invites", size).await;
            created.reverse();
            prop_assert_eq!(&listed, &created);
            let first = ok(&api.get(&format!("/v1/affiliates/invites?page_size={size}")).await);
            prop_assert_eq!(first["pagination"]["total_records"].as_u64().unwrap() as usize, count);
            prop_assert_eq!(
                first["pagination"]["total_pages"].as_u64().unwrap() as usize,
                count.div_ceil(size)
            );
            server.stop().await;
            Ok(())
        })?;
    }
}
