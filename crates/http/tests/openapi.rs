//! The OpenAPI document (docs/api.md, "OpenAPI document"): the committed copy is
//! current, the server serves it without a key, every documented operation is
//! routed, no route is registered outside it, and the real answers of the main
//! flows (successes and errors) conform to the schemas it documents.

mod common;

use std::collections::BTreeSet;

use common::*;
use serde_json::{json, Value};

fn document() -> Value {
    serde_json::from_str(&tally_http::openapi::document_json()).expect("the document is JSON")
}

#[test]
fn committed_document_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == tally_http::openapi::document_json(),
        "docs/openapi.json is stale: run `cargo run -p tally -- openapi --write docs/openapi.json`"
    );
}

#[test]
fn document_is_openapi_3_1_with_unique_operation_ids_and_documented_errors() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut ids = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"].as_str().unwrap().to_string();
            assert!(ids.insert(id.clone()), "operationId {id} twice");
            let responses = op["responses"].as_object().unwrap();
            assert!(
                responses.keys().any(|s| s.starts_with('2')),
                "{method} {path}: no success response"
            );
            if path.starts_with("/v1/") && path != "/v1/openapi.json" {
                for status in ["400", "401", "403", "429", "500", "503"] {
                    assert!(
                        responses.contains_key(status),
                        "{method} {path}: {status} undocumented"
                    );
                }
            }
            if path.contains('{') {
                assert!(responses.contains_key("404"), "{method} {path}: 404");
            }
        }
    }
    assert!(ids.len() >= 90, "{} operations", ids.len());
    // The documented bound is the enforced one.
    let page = doc["paths"]["/v1/affiliates"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "page")
        .unwrap()
        .clone();
    assert_eq!(
        page["schema"]["maximum"].as_u64(),
        Some(tally_http::routes::affiliates::MAX_PAGE_NUMBER as u64)
    );
}

/// A route can only be added through `utoipa_axum::routes!`, which documents it:
/// no plain axum routing call remains in the HTTP crate.
#[test]
fn no_route_is_registered_outside_the_document() {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let mut stack = vec![std::path::PathBuf::from(src)];
    let mut offenders = Vec::new();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in text.lines().enumerate() {
                if line.contains(".route(") || line.contains("routing::") {
                    offenders.push(format!("{}:{}: {line}", path.display(), n + 1));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "undocumented routing: {offenders:#?}");
}

/// Replaces each `{param}` of a documented path with a probe value.
fn concrete(template: &str) -> String {
    template
        .split('/')
        .map(|seg| {
            if seg.starts_with('{') {
                "doc_probe"
            } else {
                seg
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

#[tokio::test]
async fn served_document_matches_and_every_documented_operation_is_routed() {
    let (_dir, path) = temp_dir();
    let server = Server::start(&path, default_config()).await;
    let http = reqwest::Client::new();
    for base in [&server.prod_url, &server.test_url] {
        let served = http
            .get(format!("{base}/v1/openapi.json"))
            .send()
            .await
            .unwrap();
        assert_eq!(served.status(), 200);
        assert_eq!(
            served.text().await.unwrap(),
            tally_http::openapi::document_json()
        );
    }
    let doc = document();
    let mut probed = 0;
    for (template, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let url = format!("{}{}", server.prod_url, concrete(template));
            let request = match method.as_str() {
                "get" => http.get(&url),
                "post" => http.post(&url).json(&json!({})),
                "delete" => http.delete(&url),
                other => panic!("unexpected method {other}"),
            };
            let answer = Api::finish_raw(request).await;
            let code = answer.body["error"]["code"].as_str().unwrap_or("");
            assert!(
                answer.status != 405 && code != "route_not_found",
                "{method} {template} is documented but not routed: {} {}",
                answer.status,
                answer.body
            );
            probed += 1;
        }
    }
    assert!(probed >= 90);
    // And an undocumented route is not served.
    let answer = Api::finish_raw(http.get(format!("{}/v1/nothing-here", server.prod_url))).await;
    assert_eq!(answer.status, 404);
    assert_eq!(answer.body["error"]["code"], "route_not_found");
    server.stop().await;
}

/// Validates answers against the document: finds the documented operation of a
/// concrete path and method, and checks the body against the schema of its status.
struct Conformance {
    doc: Value,
    checked: BTreeSet<String>,
}

impl Conformance {
    fn new() -> Conformance {
        Conformance {
            doc: document(),
            checked: BTreeSet::new(),
        }
    }

    /// The documented path a concrete path matches (literal segments win).
    fn template(&self, path: &str) -> String {
        let path = path.split('?').next().unwrap();
        let segments: Vec<&str> = path.split('/').collect();
        let mut best: Option<(usize, String)> = None;
        for template in self.doc["paths"].as_object().unwrap().keys() {
            let parts: Vec<&str> = template.split('/').collect();
            if parts.len() != segments.len() {
                continue;
            }
            let mut literal = 0;
            let fits = parts.iter().zip(&segments).all(|(t, s)| {
                if t.starts_with('{') {
                    true
                } else {
                    literal += 1;
                    t == s
                }
            });
            if fits && best.as_ref().is_none_or(|(l, _)| literal > *l) {
                best = Some((literal, template.clone()));
            }
        }
        best.unwrap_or_else(|| panic!("{path} is not documented")).1
    }

    fn check(&mut self, method: &str, path: &str, answer: &Answer) {
        let template = self.template(path);
        let operation = &self.doc["paths"][&template][method];
        assert!(
            operation.is_object(),
            "{method} {template} is not documented"
        );
        let status = answer.status.to_string();
        let response = &operation["responses"][&status];
        assert!(
            response.is_object(),
            "{method} {template} answered {status}, which it does not document: {}",
            answer.body
        );
        let Some(schema) = response["content"]["application/json"]["schema"].as_object() else {
            return;
        };
        let mut root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"].clone(),
        });
        for (k, v) in schema {
            root[k] = v.clone();
        }
        let validator = jsonschema::draft202012::new(&root)
            .unwrap_or_else(|e| panic!("{method} {template}: schema does not compile: {e}"));
        let errors: Vec<String> = validator
            .iter_errors(&answer.body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(
            errors.is_empty(),
            "{method} {template} {status}: the answer does not conform: {errors:#?}\nbody: {}",
            answer.body
        );
        self.checked.insert(format!("{method} {template} {status}"));
    }
}

async fn get(api: &Api, c: &mut Conformance, path: &str) -> Value {
    let answer = api.get(path).await;
    c.check("get", path, &answer);
    answer.body
}

async fn post(api: &Api, c: &mut Conformance, path: &str, body: Value) -> Value {
    let answer = api.post(path, body).await;
    c.check("post", path, &answer);
    answer.body
}

async fn delete(api: &Api, c: &mut Conformance, path: &str) -> Value {
    let answer = Api::finish_raw(
        api.http
            .delete(format!("{}{path}", api.base))
            .header("x-api-key", &api.key),
    )
    .await;
    c.check("delete", path, &answer);
    answer.body
}

fn id(body: &Value) -> String {
    body["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {body}"))
        .to_string()
}

#[tokio::test]
async fn answers_of_the_main_flows_conform_to_the_document() {
    let (_dir, path) = temp_dir();
    let server = Server::start(&path, default_config()).await;
    let keys = create_store(&server, "conformance").await;
    let api = Api::new(&server.test_url, &keys.test);
    let c = &mut Conformance::new();

    // Customers.
    let cus = post(&api, c, "/v1/customers", json!({"email": "a@example.com", "name": "A", "external_id": "ext-1", "metadata": {"plan": "pro", "n": 3}})).await;
    let cus_id = id(&cus);
    get(&api, c, &format!("/v1/customers/{cus_id}")).await;
    post(
        &api,
        c,
        &format!("/v1/customers/{cus_id}"),
        json!({"name": null, "country": "DE"}),
    )
    .await;
    get(&api, c, "/v1/customers?limit=5").await;
    get(&api, c, "/v1/customers?external_id=ext-1").await;
    get(&api, c, "/v1/customers/cus_missing").await;
    post(&api, c, "/v1/customers", json!({"email": "not-an-email"})).await;
    post(
        &api,
        c,
        "/v1/customers",
        json!({"email": "b@example.com", "external_id": "ext-1"}),
    )
    .await;

    // Meters, events and usage.
    let meter = post(&api, c, "/v1/meters", json!({"name": "tokens", "event_name": "llm", "aggregation": "sum", "aggregation_property": "tokens", "filter": {"conjunction": "and", "clauses": [{"property": "model", "operator": "in", "value": ["a", "b"]}]}})).await;
    let mtr = id(&meter);
    let count = post(
        &api,
        c,
        "/v1/meters",
        json!({"name": "calls", "event_name": "llm", "aggregation": "count"}),
    )
    .await;
    let count_id = id(&count);
    get(&api, c, &format!("/v1/meters/{mtr}")).await;
    get(&api, c, "/v1/meters?status=all").await;
    post(
        &api,
        c,
        &format!("/v1/meters/{mtr}"),
        json!({"unit_label": "tokens"}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/meters/{mtr}"),
        json!({"status": "archived"}),
    )
    .await;
    let ingest = post(&api, c, "/v1/events/ingest", json!({"events": [
        {"event_id": "e1", "name": "llm", "customer_id": cus_id, "properties": {"tokens": 12, "model": "a"}},
        {"event_id": "e2", "name": "llm", "external_customer_id": "ext-1", "properties": {"tokens": "3.5", "model": "b"}},
        {"event_id": "e1", "name": "llm", "customer_id": cus_id, "properties": {"tokens": 1}},
        {"name": "other", "customer_id": cus_id},
    ]})).await;
    assert_eq!(ingest["accepted"], 3, "{ingest}");
    post(
        &api,
        c,
        "/v1/events/ingest",
        json!({"events": [{"name": "llm"}]}),
    )
    .await;
    post(
        &api,
        c,
        "/v1/events/preview",
        json!({"events": [{"name": "llm", "customer_id": cus_id}, {"name": ""}]}),
    )
    .await;
    get(&api, c, "/v1/events/e1").await;
    get(&api, c, &format!("/v1/events?customer_id={cus_id}&limit=2")).await;
    get(&api, c, "/v1/events?customer_id=cus_nobody").await;
    get(&api, c, &format!("/v1/meters/{mtr}/usage")).await;
    get(
        &api,
        c,
        &format!("/v1/meters/{mtr}/usage?window=minute&group_by=customer_id"),
    )
    .await;
    get(
        &api,
        c,
        &format!("/v1/meters/{mtr}/usage?customer_id={cus_id}&window=day"),
    )
    .await;
    get(&api, c, &format!("/v1/meters/{mtr}/usage?window=fortnight")).await;
    post(
        &api,
        c,
        &format!("/v1/meters/{mtr}/preview"),
        json!({"window": "hour"}),
    )
    .await;
    post(&api, c, "/v1/meters/preview", json!({"event_name": "llm", "aggregation": "max", "aggregation_property": "tokens", "customer_id": cus_id})).await;
    let start = tally_domain::time::format_iso8601_ms(wall_clock_ms() - 3_600_000);
    post(
        &api,
        c,
        &format!("/v1/meters/{count_id}/backfill"),
        json!({"start": start}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/meters/{count_id}/archive"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/meters/{count_id}/unarchive"),
        json!({}),
    )
    .await;

    // Customer credits.
    let account = post(
        &api,
        c,
        "/v1/customer-credits/accounts",
        json!({"customer_id": cus_id, "name": "default", "initial_balance": "10"}),
    )
    .await;
    let ca = id(&account);
    get(&api, c, &format!("/v1/customer-credits/accounts/{ca}")).await;
    get(
        &api,
        c,
        &format!("/v1/customer-credits/accounts?customer_id={cus_id}"),
    )
    .await;
    let credit = post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/credit"),
        json!({"amount": "5.5", "idempotency_key": "k1", "metadata": {"why": "gift"}}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/debit"),
        json!({"amount": "2", "idempotency_key": "k2"}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/debit"),
        json!({"amount": "1000", "idempotency_key": "k3"}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/debit"),
        json!({"amount": 3, "idempotency_key": "k4"}),
    )
    .await;
    get(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/entries"),
    )
    .await;
    let ctx = id(&credit);
    get(&api, c, &format!("/v1/customer-credits/transactions/{ctx}")).await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/transactions/{ctx}/reverse"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/freeze"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/unfreeze"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/customer-credits/accounts/{ca}/close"),
        json!({}),
    )
    .await;

    // Products, discounts, checkouts, transactions, subscriptions.
    let product = post(&api, c, "/v1/products", json!({"name": "Pro", "price": 1000, "currency": "usd", "billing_type": "recurring", "billing_period": "every-month", "usage_prices": [{"meter_id": mtr, "unit_price": "0.5"}], "features": [{"type": "custom", "description": "support"}], "custom_fields": [{"type": "text", "key": "team", "label": "Team"}]})).await;
    let prod = id(&product);
    let basic = post(&api, c, "/v1/products", json!({"name": "Basic", "price": 500, "currency": "usd", "billing_type": "recurring", "billing_period": "every-month"})).await;
    let basic_id = id(&basic);
    get(&api, c, &format!("/v1/products/{prod}")).await;
    get(&api, c, "/v1/products").await;
    post(
        &api,
        c,
        &format!("/v1/products/{prod}"),
        json!({"currency": "eur"}),
    )
    .await;
    let onetime = post(
        &api,
        c,
        "/v1/products",
        json!({"name": "Once", "price": 300, "currency": "usd"}),
    )
    .await;
    let once_id = id(&onetime);
    post(
        &api,
        c,
        &format!("/v1/products/{once_id}/archive"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/products/{once_id}/unarchive"),
        json!({}),
    )
    .await;
    let discount = post(&api, c, "/v1/discounts", json!({"name": "Ten", "code": "TEN", "type": "percentage", "amount": 10, "duration": "repeating", "duration_in_months": 2})).await;
    let dsc = id(&discount);
    get(&api, c, &format!("/v1/discounts/{dsc}")).await;
    get(&api, c, "/v1/discounts?discount_code=TEN").await;
    get(&api, c, "/v1/discounts").await;
    post(
        &api,
        c,
        &format!("/v1/discounts/{dsc}"),
        json!({"name": "Ten off"}),
    )
    .await;
    post(
        &api,
        c,
        "/v1/tax-rates",
        json!({"country": "DE", "rate": "19"}),
    )
    .await;
    get(&api, c, "/v1/tax-rates").await;
    let checkout = post(&api, c, "/v1/checkouts", json!({"product_id": prod, "customer_id": cus_id, "discount_code": "TEN", "metadata": {"src": "test"}})).await;
    let chk = id(&checkout);
    get(&api, c, &format!("/v1/checkouts/{chk}")).await;
    get(&api, c, "/v1/checkouts").await;
    post(
        &api,
        c,
        &format!("/v1/checkouts/{chk}/complete"),
        json!({"card_number": "4000000000000002", "cvc": "123", "exp": "12/40"}),
    )
    .await;
    let done = post(
        &api,
        c,
        &format!("/v1/checkouts/{chk}/complete"),
        json!({"card_number": "4242424242424242", "cvc": "123", "exp": "12/40"}),
    )
    .await;
    // A completed checkout is answered as it is to a retry, but a malformed retry is
    // still refused, naming the field (what the contract fuzzer found).
    let again = api
        .post(
            &format!("/v1/checkouts/{chk}/complete"),
            json!({"cvc": "12"}),
        )
        .await;
    c.check("post", &format!("/v1/checkouts/{chk}/complete"), &again);
    assert_eq!(
        assert_error(&again, 400, "invalid_request_error")["param"],
        "card_number"
    );
    let sub = done["subscription_id"]
        .as_str()
        .expect("a subscription")
        .to_string();
    let txn = done["transaction_id"]
        .as_str()
        .expect("a transaction")
        .to_string();
    get(&api, c, &format!("/v1/transactions/{txn}")).await;
    get(&api, c, &format!("/v1/transactions?customer_id={cus_id}")).await;
    get(&api, c, &format!("/v1/subscriptions/{sub}")).await;
    get(
        &api,
        c,
        &format!("/v1/subscriptions?customer_id={cus_id}&status=active"),
    )
    .await;
    get(&api, c, &format!("/v1/subscriptions/{sub}/upcoming")).await;
    get(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/upcoming?product_id={basic_id}"),
    )
    .await;
    let item = get(&api, c, &format!("/v1/subscriptions/{sub}")).await["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    post(&api, c, &format!("/v1/subscriptions/{sub}"), json!({"items": [{"id": item, "units": 2}], "update_behavior": "proration-charge", "metadata": {"k": "v"}})).await;
    post(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/upgrade"),
        json!({"product_id": basic_id, "update_behavior": "proration-none"}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/pause"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/pause"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/resume"),
        json!({}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/subscriptions/{sub}/cancel"),
        json!({"mode": "scheduled"}),
    )
    .await;
    let refund = post(
        &api,
        c,
        "/v1/refunds",
        json!({"transaction_id": txn, "amount": 1}),
    )
    .await;
    assert_eq!(refund["type"], "refund", "{refund}");
    post(
        &api,
        c,
        "/v1/refunds",
        json!({"transaction_id": txn, "amount": 1_000_000}),
    )
    .await;
    post(
        &api,
        c,
        "/v1/disputes",
        json!({"transaction_id": txn, "reason": "fraud"}),
    )
    .await;
    post(&api, c, "/v1/disputes", json!({"transaction_id": txn})).await;
    delete(&api, c, &format!("/v1/discounts/{dsc}")).await;

    // Store settings and the test clock.
    get(&api, c, "/v1/store/settings").await;
    post(&api, c, "/v1/store/settings", json!({"late_usage_grace_seconds": 60, "affiliate_commission_percent": "10", "referral_base_url": "https://example.com/r"})).await;
    let now = get(&api, c, "/v1/test-clock").await["now"]
        .as_str()
        .unwrap()
        .to_string();
    let later = tally_domain::time::format_iso8601_ms(
        tally_domain::time::parse_iso8601_ms(&now).unwrap() + 40 * 86_400_000,
    );
    post(&api, c, "/v1/test-clock/advance", json!({"to": later})).await;
    post(&api, c, "/v1/test-clock/advance", json!({"to": now})).await;
    get(&api, c, &format!("/v1/transactions?subscription_id={sub}")).await;

    // Affiliates and moderation.
    let invite = post(
        &api,
        c,
        "/v1/affiliates/invites",
        json!({"email": "Aff@Example.com", "name": "Aff"}),
    )
    .await;
    post(
        &api,
        c,
        "/v1/affiliates/invites",
        json!({"email": "aff@example.com"}),
    )
    .await;
    get(&api, c, "/v1/affiliates/invites?page=1&page_size=5").await;
    let affiliate = post(
        &api,
        c,
        &format!("/v1/affiliates/invites/{}/accept", id(&invite)),
        json!({}),
    )
    .await;
    let aff = id(&affiliate);
    post(
        &api,
        c,
        "/v1/affiliates/clicks",
        json!({"referral_code": affiliate["referral_code"]}),
    )
    .await;
    get(&api, c, "/v1/affiliates").await;
    get(&api, c, &format!("/v1/affiliates/{aff}")).await;
    post(
        &api,
        c,
        &format!("/v1/affiliates/{aff}"),
        json!({"status": "suspended"}),
    )
    .await;
    get(&api, c, "/v1/affiliates?page_size=500").await;
    post(
        &api,
        c,
        "/v1/moderation/policy",
        json!({"deny_terms": ["secret"], "flag_patterns": ["b.d"], "pii": {"email": "flag"}}),
    )
    .await;
    get(&api, c, "/v1/moderation/policy").await;
    post(
        &api,
        c,
        "/v1/moderation/prompt",
        json!({"prompt": "a secret bad mail a@b.co", "external_id": "ext-1"}),
    )
    .await;
    post(
        &api,
        c,
        "/v1/moderation/policy",
        json!({"deny_patterns": ["("]}),
    )
    .await;

    // Webhooks.
    let hook = post(
        &api,
        c,
        "/v1/webhooks",
        json!({"name": "h", "url": "https://example.com/hook", "events": ["credits.granted"]}),
    )
    .await;
    let wh = id(&hook);
    let cli = post(
        &api,
        c,
        "/v1/webhooks",
        json!({"delivery_mode": "cli", "events": ["subscription.paid", "checkout.completed"]}),
    )
    .await;
    let cli_id = id(&cli);
    get(&api, c, &format!("/v1/webhooks/{wh}")).await;
    get(&api, c, "/v1/webhooks").await;
    post(
        &api,
        c,
        &format!("/v1/webhooks/{wh}"),
        json!({"status": "disabled"}),
    )
    .await;
    post(
        &api,
        c,
        &format!("/v1/webhooks/{wh}"),
        json!({"delivery_mode": "cli"}),
    )
    .await;
    get(&api, c, &format!("/v1/webhooks/{wh}/secret")).await;
    post(
        &api,
        c,
        &format!("/v1/webhooks/{wh}/secret/rotate"),
        json!({}),
    )
    .await;
    get(&api, c, &format!("/v1/webhooks/{wh}/deliveries")).await;
    get(&api, c, &format!("/v1/webhooks/{wh}/events/pending")).await;
    get(&api, c, &format!("/v1/webhooks/{cli_id}/events/pending")).await;
    post(
        &api,
        c,
        &format!("/v1/webhooks/{cli_id}/events/evt_none/ack"),
        json!({"status": 200}),
    )
    .await;
    delete(&api, c, &format!("/v1/webhooks/{wh}")).await;

    // Keys: a restricted key is refused where it lacks the permission.
    let admin = Api::new(&server.prod_url, "");
    let store_id = {
        let answer = Api::finish_raw(
            admin
                .http
                .post(format!("{}/admin/v1/stores", server.prod_url))
                .bearer_auth("admin-secret")
                .json(&json!({"name": "second"})),
        )
        .await;
        c.check("post", "/admin/v1/stores", &answer);
        id(&answer.body)
    };
    let key = Api::finish_raw(
        admin
            .http
            .post(format!(
                "{}/admin/v1/stores/{store_id}/keys",
                server.prod_url
            ))
            .bearer_auth("admin-secret")
            .json(&json!({"mode": "test", "permissions": ["meters:read"]})),
    )
    .await;
    c.check("post", "/admin/v1/stores/x/keys", &key);
    let limited = Api::new(&server.test_url, key.body["key"].as_str().unwrap());
    get(&limited, c, "/v1/customers").await;
    get(&limited, c, "/v1/meters").await;
    let nobody = Api::new(&server.test_url, "tally_test_nope");
    get(&nobody, c, "/v1/meters").await;

    for expected in [
        "get /v1/customers/{id} 404",
        "post /v1/customers 400",
        "post /v1/customers 409",
        "post /v1/events/ingest 202",
        "post /v1/events/ingest 400",
        "post /v1/customer-credits/accounts/{id}/debit 409",
        "post /v1/checkouts/{id}/complete 402",
        "post /v1/checkouts/{id}/complete 200",
        "post /v1/subscriptions/{id}/pause 409",
        "get /v1/customers 403",
        "get /v1/meters 401",
        "post /v1/test-clock/advance 400",
    ] {
        assert!(c.checked.contains(expected), "not exercised: {expected}");
    }
    assert!(
        c.checked.len() >= 100,
        "{} answers checked",
        c.checked.len()
    );
    server.stop().await;
}

/// What the contract fuzzer found: actions documented without a body ignored a
/// malformed one, and `page` took any number.
#[tokio::test]
async fn actions_without_a_body_refuse_malformed_json_and_pages_are_bounded() {
    let (_dir, path) = temp_dir();
    let server = Server::start(&path, default_config()).await;
    let keys = create_store(&server, "fuzz findings").await;
    let api = Api::new(&server.test_url, &keys.test);
    let meter = api
        .post(
            "/v1/meters",
            json!({"name": "m", "event_name": "e", "aggregation": "count"}),
        )
        .await;
    let mtr = id(&meter.body);
    for body in ["\u{0}", "IO", "[1]", "null", "  "] {
        let answer = Api::finish_raw(
            api.http
                .post(format!("{}/v1/meters/{mtr}/archive", api.base))
                .header("x-api-key", &api.key)
                .header("content-type", "application/json")
                .body(body),
        )
        .await;
        let error = assert_error(&answer, 400, "invalid_request_error");
        assert_eq!(error["code"], "invalid_json", "{body:?}");
    }
    let still = api.get(&format!("/v1/meters/{mtr}")).await;
    assert_eq!(still.body["status"], "active");
    // No body, `{}`, and fields it does not take (ignored) all archive.
    let archived = api
        .post_without_body(&format!("/v1/meters/{mtr}/archive"))
        .await;
    assert_eq!(archived.status, 200, "{}", archived.body);
    let again = api
        .post(&format!("/v1/meters/{mtr}/unarchive"), json!({"why": "x"}))
        .await;
    assert_eq!(again.body["status"], "active", "{}", again.body);

    // An update whose fields are all optional may come without a body: no change.
    let unchanged = api.post_without_body(&format!("/v1/meters/{mtr}")).await;
    assert_eq!(unchanged.status, 200, "{}", unchanged.body);
    assert_eq!(unchanged.body["name"], meter.body["name"]);

    let max = tally_http::routes::affiliates::MAX_PAGE_NUMBER;
    let last = api.get(&format!("/v1/affiliates?page={max}")).await;
    assert_eq!(last.status, 200, "{}", last.body);
    assert_eq!(last.body["items"], json!([]));
    for path in ["/v1/affiliates", "/v1/affiliates/invites"] {
        let beyond = api.get(&format!("{path}?page={}", max + 1)).await;
        let error = assert_error(&beyond, 400, "invalid_request_error");
        assert_eq!(error["param"], "page");
    }
    server.stop().await;
}

/// The main flows carry request examples, and each conforms to its schema.
#[test]
fn request_examples_conform_to_their_schemas() {
    let doc = document();
    let mut examples = 0;
    for (template, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let content = &op["requestBody"]["content"]["application/json"];
            let Some(example) = content.get("example") else {
                continue;
            };
            let mut root = json!({
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "components": doc["components"].clone(),
            });
            for (k, v) in content["schema"].as_object().unwrap() {
                root[k] = v.clone();
            }
            let validator = jsonschema::draft202012::new(&root).unwrap();
            assert!(
                validator.is_valid(example),
                "{method} {template}: its example does not conform"
            );
            examples += 1;
        }
    }
    assert!(examples >= 10, "{examples} examples");
}
