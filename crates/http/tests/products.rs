//! Products over real sockets: create with every part, validation naming the field,
//! update rules, archive, lists, and the meter-archive rule (docs/api.md, "Meters") in both
//! directions (decided by the service and again in apply), across a restart.

mod common;

use common::*;
use serde_json::{json, Value};

async fn setup() -> (tempfile::TempDir, std::path::PathBuf, Server, Api, Keys) {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    (guard, dir, server, api, keys)
}

async fn meter(api: &Api, name: &str) -> String {
    let answer = api
        .post(
            "/v1/meters",
            json!({"name": name, "event_name": "tokens", "aggregation": "sum", "aggregation_property": "n"}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body["id"].as_str().unwrap().to_string()
}

fn pro(meter_id: &str) -> Value {
    json!({
        "name": "Pro",
        "description": "For teams",
        "price": 1900,
        "currency": "usd",
        "billing_type": "recurring",
        "billing_period": "every-month",
        "tax_mode": "inclusive",
        "trial_period_days": 14,
        "image_urls": ["https://img.example.com/pro.png"],
        "features": [
            {"type": "customer_credits", "description": "Monthly credits",
             "customer_credits": {"amount": "1000.5", "unit_label": "tokens", "bucket_name": "main"}},
            {"type": "custom", "description": "Priority support"}
        ],
        "usage_prices": [
            {"meter_id": meter_id, "unit_price": 0.25, "free_allowance": 100, "cap": 10000,
             "settlement_mode": "invoice"}
        ],
        "custom_fields": [
            {"type": "text", "key": "company", "label": "Company", "text": {"minimum_length": 2, "max_length": 80}}
        ]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn products_are_created_read_listed_and_updated_with_every_part() {
    let (_g, _dir, server, api, _keys) = setup().await;
    let meter_id = meter(&api, "input tokens").await;
    let created = api.post("/v1/products", pro(&meter_id)).await;
    assert_eq!(created.status, 200, "{}", created.body);
    let product = &created.body;
    let id = product["id"].as_str().unwrap();
    assert!(id.starts_with("prod_"));
    assert_eq!(product["object"], "product");
    assert_eq!(product["mode"], "test");
    assert_eq!(product["currency"], "USD");
    assert_eq!(product["price"], 1900);
    assert_eq!(product["status"], "active");
    assert_eq!(product["tax_mode"], "inclusive");
    assert_eq!(product["tax_category"], "saas");
    assert_eq!(product["recurring_interval"], "month");
    assert_eq!(product["recurring_interval_count"], 1);
    assert_eq!(product["trial_period_days"], 14);
    assert_eq!(product["image_url"], "https://img.example.com/pro.png");
    assert_eq!(
        product["features"][0]["customer_credits"]["amount"],
        "1000.5"
    );
    assert_eq!(product["features"][1]["customer_credits"], Value::Null);
    let price = &product["usage_prices"][0];
    assert_eq!(price["meter_id"], meter_id.as_str());
    assert_eq!(price["unit_price"].to_string(), "0.25");
    assert_eq!(price["free_allowance"], 100);
    assert_eq!(price["target_account"], "customer");
    assert_eq!(price["target_account_name"], "default");
    assert_eq!(price["trial_usage_mode"], "free");
    assert_eq!(product["custom_fields"][0]["text"]["max_length"], 80);

    let read = api.get(&format!("/v1/products/{id}")).await;
    assert_eq!(read.status, 200);
    assert_eq!(&read.body, product);

    // Update: a new price and name; the usage price keeps its id.
    let updated = api
        .post(
            &format!("/v1/products/{id}"),
            json!({"name": "Pro 2", "price": 2900, "usage_prices": [{"meter_id": meter_id, "unit_price": "0.5"}]}),
        )
        .await;
    assert_eq!(updated.status, 200, "{}", updated.body);
    assert_eq!(updated.body["name"], "Pro 2");
    assert_eq!(updated.body["price"], 2900);
    assert_eq!(updated.body["usage_prices"][0]["id"], price["id"]);
    assert_eq!(
        updated.body["usage_prices"][0]["unit_price"].to_string(),
        "0.5"
    );
    assert_eq!(updated.body["created_at"], product["created_at"]);
    let immutable = api
        .post(&format!("/v1/products/{id}"), json!({"currency": "EUR"}))
        .await;
    let error = assert_error(&immutable, 400, "invalid_request_error");
    assert_eq!(
        (error["code"].as_str(), error["param"].as_str()),
        (Some("product_field_immutable"), Some("currency"))
    );

    // Lists: newest first, active by default, archived on request. The test clock
    // stands still: move it, so the second product is newer (within one
    // millisecond the order is the ids').
    server.clock.advance_ms(1);
    let second = api
        .post(
            "/v1/products",
            json!({"name": "Top-up", "price": 500, "currency": "USD"}),
        )
        .await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.body["billing_type"], "onetime");
    assert_eq!(second.body["billing_period"], "once");
    assert_eq!(second.body["recurring_interval"], Value::Null);
    let list = api.get("/v1/products?limit=1").await;
    assert_eq!(list.body["object"], "list");
    assert_eq!(list.body["data"][0]["id"], second.body["id"]);
    assert_eq!(list.body["has_more"], true);
    let next = api
        .get(&format!(
            "/v1/products?limit=1&starting_after={}",
            second.body["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(next.body["data"][0]["id"], id);
    assert_eq!(next.body["has_more"], false);
    let archived = api
        .post(&format!("/v1/products/{id}/archive"), json!({}))
        .await;
    assert_eq!(archived.body["status"], "archived");
    let again = api
        .post(&format!("/v1/products/{id}/archive"), json!({}))
        .await;
    assert_eq!(
        (again.status, &again.body["updated_at"]),
        (200, &archived.body["updated_at"])
    );
    let active = api.get("/v1/products").await;
    assert_eq!(active.body["data"].as_array().unwrap().len(), 1);
    let only_archived = api.get("/v1/products?status=archived").await;
    assert_eq!(only_archived.body["data"][0]["id"], id);
    let bad_status = api.get("/v1/products?status=gone").await;
    assert_eq!(
        assert_error(&bad_status, 400, "invalid_request_error")["param"],
        "status"
    );
    let missing = api.get("/v1/products/prod_nope").await;
    assert_error(&missing, 404, "invalid_request_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_product_input_is_a_400_naming_the_field_and_writes_nothing() {
    let (_g, _dir, _server, api, _keys) = setup().await;
    let meter_id = meter(&api, "m").await;
    let with = |patch: Value| {
        let mut body = pro(&meter_id);
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases = [
        (json!({"name": null}), "name"),
        (json!({"price": "19"}), "price"),
        (json!({"price": 19.5}), "price"),
        (json!({"price": -1}), "price"),
        (json!({"currency": "dollars"}), "currency"),
        (json!({"currency": "zzz"}), "currency"),
        (json!({"currency": "XTS"}), "currency"),
        (json!({"billing_period": "weekly"}), "billing_period"),
        (json!({"billing_period": "once"}), "billing_period"),
        (json!({"tax_category": "food"}), "tax_category"),
        (
            json!({"features": [{"type": "customer_credits"}]}),
            "features[0].customer_credits",
        ),
        (
            json!({"features": [{"type": "customer_credits", "customer_credits": {"amount": "-5"}}]}),
            "features[0].customer_credits.amount",
        ),
        (json!({"features": "all"}), "features"),
        (
            json!({"usage_prices": [{"meter_id": meter_id, "unit_price": 1, "settlement_mode": "later"}]}),
            "usage_prices[0].settlement_mode",
        ),
        (
            json!({"usage_prices": [{"meter_id": meter_id, "unit_price": 1, "free_allowance": 10, "cap": 5}]}),
            "usage_prices[0].cap",
        ),
        (json!({"image_urls": ["ftp://x"]}), "image_urls[0]"),
        (
            json!({"custom_fields": [{"type": "text", "key": "a b", "label": "A"}]}),
            "custom_fields[0].key",
        ),
        (json!({"trial_period_days": 9999}), "trial_period_days"),
    ];
    for (patch, param) in cases {
        let answer = api.post("/v1/products", with(patch.clone())).await;
        let error = assert_error(&answer, 400, "invalid_request_error");
        assert_eq!(error["param"], param, "{patch}: {}", answer.body);
    }
    // A meter that does not exist: 404 naming it, like any id a body names.
    let unknown = api
        .post(
            "/v1/products",
            with(json!({"usage_prices": [{"meter_id": "mtr_missing", "unit_price": 1}]})),
        )
        .await;
    let error = assert_error(&unknown, 404, "invalid_request_error");
    assert_eq!(
        (error["code"].as_str(), error["param"].as_str()),
        (Some("resource_missing"), Some("usage_prices[0].meter_id"))
    );
    let onetime_invoice = api
        .post(
            "/v1/products",
            json!({"name": "x", "price": 1, "currency": "USD", "usage_prices": [{"meter_id": meter_id, "unit_price": 1}]}),
        )
        .await;
    assert_eq!(
        assert_error(&onetime_invoice, 400, "invalid_request_error")["param"],
        "usage_prices[0].settlement_mode"
    );
    let list = api.get("/v1/products?status=all").await;
    assert_eq!(list.body["data"], json!([]), "nothing was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meter_priced_on_an_active_product_cannot_be_archived_until_the_product_is() {
    let (_g, dir, server, api, keys) = setup().await;
    let meter_id = meter(&api, "priced").await;
    let unpriced = meter(&api, "free").await;
    let product = api.post("/v1/products", pro(&meter_id)).await;
    assert_eq!(product.status, 200, "{}", product.body);
    let product_id = product.body["id"].as_str().unwrap().to_string();

    let refused = api
        .post(&format!("/v1/meters/{meter_id}/archive"), json!({}))
        .await;
    let error = assert_error(&refused, 409, "invalid_request_error");
    assert_eq!(error["code"], "meter_in_use");
    let meter_now = api.get(&format!("/v1/meters/{meter_id}")).await;
    assert_eq!(meter_now.body["status"], "active");
    // A meter nobody prices archives as before; pricing it afterwards is refused.
    let archived = api
        .post(&format!("/v1/meters/{unpriced}/archive"), json!({}))
        .await;
    assert_eq!(archived.status, 200);
    let pricing_archived = api
        .post(
            &format!("/v1/products/{product_id}"),
            json!({"usage_prices": [{"meter_id": unpriced, "unit_price": 1}]}),
        )
        .await;
    let error = assert_error(&pricing_archived, 409, "invalid_request_error");
    assert_eq!(
        (error["code"].as_str(), error["param"].as_str()),
        (Some("meter_not_active"), Some("usage_prices[0].meter_id"))
    );

    // The rule survives a restart (it lives in the projection, rebuilt from the log).
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    let still_refused = api
        .post(&format!("/v1/meters/{meter_id}/archive"), json!({}))
        .await;
    assert_eq!(still_refused.status, 409, "{}", still_refused.body);

    // Archiving the product releases the meter; unarchiving the product then fails
    // because its meter is archived.
    let archived_product = api
        .post(&format!("/v1/products/{product_id}/archive"), json!({}))
        .await;
    assert_eq!(archived_product.status, 200);
    let meter_archived = api
        .post(&format!("/v1/meters/{meter_id}/archive"), json!({}))
        .await;
    assert_eq!(meter_archived.status, 200, "{}", meter_archived.body);
    let unarchive = api
        .post(&format!("/v1/products/{product_id}/unarchive"), json!({}))
        .await;
    assert_eq!(
        assert_error(&unarchive, 409, "invalid_request_error")["code"],
        "meter_not_active"
    );
    // Removing the usage charge is the other remedy (docs/api.md, "Meters").
    let unpriced_product = api
        .post(
            &format!("/v1/products/{product_id}"),
            json!({"usage_prices": []}),
        )
        .await;
    assert_eq!(unpriced_product.status, 200, "{}", unpriced_product.body);
    let unarchived = api
        .post(&format!("/v1/products/{product_id}/unarchive"), json!({}))
        .await;
    assert_eq!(unarchived.body["status"], "active");
    server.stop().await;
}
