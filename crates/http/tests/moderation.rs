//! Prompt moderation over real sockets: the policy (terms, patterns, PII), its
//! validation, decisions and their reasons, and the metering of each screening.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_screened_by_the_store_policy_and_metered() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);

    // No policy: everything is allowed; the prompt's bounds name the field.
    let allowed = api
        .post("/v1/moderation/prompt", json!({"prompt": "hello"}))
        .await;
    assert_eq!(allowed.status, 200, "{}", allowed.body);
    assert_eq!(allowed.body["object"], "moderation_result");
    assert!(
        allowed.body["id"].as_str().unwrap().starts_with("mod_"),
        "{}",
        allowed.body
    );
    assert_eq!(allowed.body["decision"], "allow");
    assert_eq!(allowed.body["usage"]["units"], 1);
    for prompt in [json!(""), json!("a".repeat(32_769))] {
        let error = assert_error(
            &api.post("/v1/moderation/prompt", json!({"prompt": prompt}))
                .await,
            400,
            "invalid_request_error",
        );
        assert_eq!(error["param"], "prompt");
    }

    let bad = assert_error(
        &api.post("/v1/moderation/policy", json!({"flag_patterns": ["("]}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad["param"], "flag_patterns[0]");
    let bad_pii = assert_error(
        &api.post("/v1/moderation/policy", json!({"pii": {"card": "block"}}))
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(bad_pii["param"], "pii.card");
    let policy = api
        .post(
            "/v1/moderation/policy",
            json!({"deny_terms": ["Forbidden"], "flag_patterns": ["\\bpass(word)?\\b"],
                   "pii": {"card": "deny", "email": "flag"}}),
        )
        .await;
    assert_eq!(policy.status, 200, "{}", policy.body);
    assert_eq!(policy.body["deny_terms"], json!(["forbidden"]));
    assert_eq!(api.get("/v1/moderation/policy").await.body, policy.body);

    let screen = |prompt: &str| {
        let api = api.clone();
        let prompt = prompt.to_string();
        async move {
            api.post("/v1/moderation/prompt", json!({"prompt": prompt}))
                .await
                .body
        }
    };
    let denied = screen("this is ＦＯＲＢＩＤＤＥＮ, my password too").await;
    assert_eq!(denied["decision"], "deny");
    assert_eq!(
        denied["reasons"],
        json!(["deny_term:forbidden", "flag_pattern:0"])
    );
    assert_eq!(screen("my pass is x").await["decision"], "flag");
    assert_eq!(
        screen("card 4242-4242-4242-4242").await["reasons"],
        json!(["pii:card"])
    );
    assert_eq!(screen("mail ann@example.com").await["decision"], "flag");
    assert_eq!(screen("all fine").await["decision"], "allow");

    // Each screening for a known customer is a usage event a meter bills.
    let meter = api
        .post(
            "/v1/meters",
            json!({"name": "screened", "event_name": "moderation.prompt", "aggregation": "sum",
                   "aggregation_property": "units"}),
        )
        .await;
    let meter = meter.body["id"].as_str().unwrap().to_string();
    let customer = api
        .post(
            "/v1/customers",
            json!({"email": "m@x.io", "external_id": "user-1"}),
        )
        .await;
    let cus = customer.body["id"].as_str().unwrap().to_string();
    let metered = api
        .post(
            "/v1/moderation/prompt",
            json!({"prompt": "b".repeat(1_500), "external_id": "user-1"}),
        )
        .await;
    assert_eq!(metered.body["usage"]["units"], 2);
    assert_eq!(metered.body["external_id"], "user-1");
    assert_eq!(metered.body["metered"], true);
    let stranger = api
        .post(
            "/v1/moderation/prompt",
            json!({"prompt": "c", "external_id": "nobody"}),
        )
        .await;
    assert_eq!(stranger.body["metered"], false);
    server.engine.wait_caught_up().await.unwrap();
    let usage = api
        .get(&format!("/v1/meters/{meter}/usage?customer_id={cus}"))
        .await;
    assert_eq!(usage.body["value"], "2", "{}", usage.body);
    server.stop().await;
}
