//! Customers, meters, ingest, preview and usage over real sockets.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::time::format_iso8601_ms;

async fn setup() -> (tempfile::TempDir, Server, Api) {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    (guard, server, api)
}

async fn meter(api: &Api, body: Value) -> Value {
    let answer = api.post("/v1/meters", body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn customers_validate_and_enforce_unique_external_ids() {
    let (_g, server, api) = setup().await;
    let no_email = api.post("/v1/customers", json!({"name": "x"})).await;
    assert_eq!(
        assert_error(&no_email, 400, "invalid_request_error")["param"],
        "email"
    );
    let bad_email = api
        .post("/v1/customers", json!({"email": "not-an-email"}))
        .await;
    assert_eq!(
        assert_error(&bad_email, 400, "invalid_request_error")["param"],
        "email"
    );
    let bad_country = api
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "country": "Germany"}),
        )
        .await;
    assert_eq!(
        assert_error(&bad_country, 400, "invalid_request_error")["param"],
        "country"
    );
    let bad_external = api
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "external_id": "has space"}),
        )
        .await;
    assert_eq!(
        assert_error(&bad_external, 400, "invalid_request_error")["param"],
        "external_id"
    );
    let long_external = api
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "external_id": "x".repeat(256)}),
        )
        .await;
    assert_eq!(long_external.status, 400);

    let created = api
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "name": "Ada", "country": "DE", "external_id": "  user_1 ", "metadata": {"plan": "pro"}}),
        )
        .await;
    assert_eq!(created.status, 200);
    assert_eq!(created.body["object"], "customer");
    assert_eq!(created.body["external_id"], "user_1", "trimmed");
    assert_eq!(created.body["metadata"]["plan"], "pro");
    let id = created.body["id"].as_str().unwrap();
    assert!(id.starts_with("cus_"));

    let taken = api
        .post(
            "/v1/customers",
            json!({"email": "b@b.co", "external_id": "user_1"}),
        )
        .await;
    assert_eq!(
        assert_error(&taken, 409, "invalid_request_error")["code"],
        "external_id_taken"
    );

    let fetched = api.get(&format!("/v1/customers/{id}")).await;
    assert_eq!(fetched.body, created.body);
    let by_external = api.get("/v1/customers?external_id=user_1").await;
    assert_eq!(by_external.body["data"][0]["id"], id);

    let updated = api
        .post(
            &format!("/v1/customers/{id}"),
            json!({"name": "Ada L.", "country": null}),
        )
        .await;
    assert_eq!(updated.status, 200);
    assert_eq!(updated.body["name"], "Ada L.");
    assert_eq!(updated.body["country"], Value::Null);
    assert_eq!(updated.body["email"], "a@b.co", "untouched fields stay");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_states_follow_the_spec_table() {
    let (_g, server, api) = setup().await;
    let created = meter(
        &api,
        json!({"name": "API calls", "event_name": "api_call", "aggregation": "count"}),
    )
    .await;
    assert_eq!(created["status"], "active");
    assert_eq!(
        created["filter"],
        json!({"conjunction": "and", "clauses": []})
    );
    assert_eq!(created["aggregation_property"], Value::Null);
    assert_eq!(created["unit_label"], "units");
    let id = created["id"].as_str().unwrap();

    let archived = api
        .post(&format!("/v1/meters/{id}/archive"), json!({}))
        .await;
    assert_eq!(archived.status, 200);
    assert_eq!(archived.body["status"], "archived");
    let again = api
        .post(&format!("/v1/meters/{id}/archive"), json!({}))
        .await;
    assert_eq!(
        again.body, archived.body,
        "archiving an archived meter changes nothing"
    );

    assert_eq!(
        api.get("/v1/meters").await.body["data"]
            .as_array()
            .unwrap()
            .len(),
        0,
        "not in the default listing"
    );
    assert_eq!(
        api.get("/v1/meters?status=archived").await.body["data"][0]["id"],
        id
    );
    assert_eq!(
        api.get("/v1/meters?status=all").await.body["data"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_error(
        &api.get("/v1/meters?status=weird").await,
        400,
        "invalid_request_error",
    );

    let taken = api
        .post(
            "/v1/meters",
            json!({"name": "API calls", "event_name": "x", "aggregation": "count"}),
        )
        .await;
    let error = assert_error(&taken, 409, "invalid_request_error");
    assert_eq!(error["code"], "meter_name_taken");
    assert_eq!(error["details"]["archived_holder"], true);
    assert_eq!(error["details"]["archived_holder_id"], id);

    let restored = api
        .post(&format!("/v1/meters/{id}/unarchive"), json!({}))
        .await;
    assert_eq!(restored.body["status"], "active");
    let unchanged = api
        .post(&format!("/v1/meters/{id}/unarchive"), json!({}))
        .await;
    assert_eq!(unchanged.body["status"], "active");
    let taken_active = api
        .post(
            "/v1/meters",
            json!({"name": "API calls", "event_name": "x", "aggregation": "count"}),
        )
        .await;
    let error = assert_error(&taken_active, 409, "invalid_request_error");
    assert!(
        error.get("details").is_none(),
        "no details when the holder is active"
    );

    let immutable = api
        .post(&format!("/v1/meters/{id}"), json!({"aggregation": "sum"}))
        .await;
    let error = assert_error(&immutable, 400, "invalid_request_error");
    assert_eq!(error["code"], "meter_field_immutable");
    assert_eq!(error["param"], "aggregation");
    // Meter fields an update does not take are named, not ignored.
    for field in ["status", "counts_from"] {
        let unknown = api
            .post(
                &format!("/v1/meters/{id}"),
                json!({field: "x", "name": "ignored?"}),
            )
            .await;
        let error = assert_error(&unknown, 400, "invalid_request_error");
        assert_eq!(error["code"], "parameter_unknown");
        assert_eq!(error["param"], field);
    }
    // A field that is no meter field is ignored, as in every request body.
    let renamed = api
        .post(
            &format!("/v1/meters/{id}"),
            json!({"name": "Calls", "unit_label": "calls", "colour": "blue"}),
        )
        .await;
    assert_eq!(renamed.status, 200, "{}", renamed.body);
    assert_eq!(renamed.body["name"], "Calls");
    assert_eq!(renamed.body["unit_label"], "calls");
    // The old name is free again.
    meter(
        &api,
        json!({"name": "API calls", "event_name": "x", "aggregation": "count"}),
    )
    .await;

    assert_eq!(
        api.post("/v1/meters/mtr_nope/archive", json!({}))
            .await
            .status,
        404
    );
    let bad_operator = api
        .post(
            "/v1/meters",
            json!({"name": "m2", "event_name": "e", "aggregation": "count",
                   "filter": {"conjunction": "and", "clauses": [{"property": "p", "operator": "approx", "value": 1}]}}),
        )
        .await;
    assert_eq!(
        assert_error(&bad_operator, 400, "invalid_request_error")["param"],
        "filter.clauses[0].operator"
    );
    // A string no event property can hold (longer than an event's string value may
    // be) is refused, in an `in` list too; the meter is not created.
    let too_long = "x".repeat(tally_domain::limits::MAX_PROPERTY_STRING_CHARS + 1);
    for value in [json!(too_long), json!(["a", too_long])] {
        let operator = if value.is_array() { "in" } else { "like" };
        let refused = api
            .post(
                "/v1/meters",
                json!({"name": "m-long", "event_name": "e", "aggregation": "count",
                       "filter": {"conjunction": "and", "clauses": [
                           {"property": "p", "operator": "eq", "value": 1},
                           {"property": "p", "operator": operator, "value": value}]}}),
            )
            .await;
        assert_eq!(
            assert_error(&refused, 400, "invalid_request_error")["param"],
            "filter.clauses[1].value"
        );
    }
    let listed = api.get("/v1/meters?status=all").await;
    assert!(
        listed.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["name"] != "m-long"),
        "{:?}",
        listed.body
    );
    let missing_property = api
        .post(
            "/v1/meters",
            json!({"name": "m3", "event_name": "e", "aggregation": "sum"}),
        )
        .await;
    assert_eq!(
        assert_error(&missing_property, 400, "invalid_request_error")["param"],
        "aggregation_property"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_is_all_or_nothing_and_names_the_field() {
    let (_g, server, api) = setup().await;
    customer(&api, "u1").await;
    let future = format_iso8601_ms(server.clock.now_ms() + 10 * 60 * 1000);
    let batch = json!({"events": [
        {"name": "api_call", "external_customer_id": "u1", "event_id": "a"},
        {"name": "api_call", "external_customer_id": "u1", "event_id": "b", "timestamp": future},
    ]});
    let refused = api.post("/v1/events/ingest", batch).await;
    let error = assert_error(&refused, 400, "invalid_request_error");
    assert_eq!(error["code"], "invalid_usage_event");
    assert_eq!(error["param"], "events[1].timestamp");
    assert_eq!(
        api.get("/v1/events/a").await.status,
        404,
        "nothing was written"
    );

    for (body, param) in [
        (json!({"events": []}), "events"),
        (json!({"events": "x"}), "events"),
        (json!({}), "events"),
        (
            json!({"events": [{"external_customer_id": "u1"}]}),
            "events[0].name",
        ),
        (
            json!({"events": [{"name": "ap\u{0}i_call", "external_customer_id": "u1"}]}),
            "events[0].name",
        ),
        (json!({"events": [{"name": "x"}]}), "events[0].customer_id"),
        (
            json!({"events": [{"name": "x", "customer_id": "c", "external_customer_id": "u1"}]}),
            "events[0].customer_id",
        ),
        (
            json!({"events": [{"name": "x", "external_customer_id": "nobody"}]}),
            "events[0].external_customer_id",
        ),
        (
            json!({"events": [{"name": "x", "external_customer_id": "u1", "event_id": "  "}]}),
            "events[0].event_id",
        ),
        (
            json!({"events": [{"name": "x", "external_customer_id": "u1", "properties": {"a": true}}]}),
            "events[0].properties.a",
        ),
        (
            json!({"events": [{"name": "x", "external_customer_id": "u1", "properties": {"a": "x".repeat(1025)}}]}),
            "events[0].properties.a",
        ),
        (
            json!({"events": [{"name": "x", "external_customer_id": "u1", "timestamp": "yesterday"}]}),
            "events[0].timestamp",
        ),
        (json!({"events": [7]}), "events[0]"),
    ] {
        let answer = api.post("/v1/events/ingest", body.clone()).await;
        assert_eq!(
            assert_error(&answer, 400, "invalid_request_error")["param"],
            param,
            "{body}"
        );
    }
    let too_many: Vec<Value> = (0..101)
        .map(|i| json!({"name": "x", "external_customer_id": "u1", "event_id": i.to_string()}))
        .collect();
    assert_eq!(
        api.post("/v1/events/ingest", json!({"events": too_many}))
            .await
            .status,
        400
    );
    let props: serde_json::Map<String, Value> =
        (0..51).map(|i| (format!("p{i}"), json!(i))).collect();
    let too_many_props = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "x", "external_customer_id": "u1", "properties": props}]}),
        )
        .await;
    assert_eq!(
        assert_error(&too_many_props, 400, "invalid_request_error")["param"],
        "events[0].properties"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_answers_are_compressed_for_clients_that_accept_gzip() {
    let (_guard, server, api) = setup().await;
    customer(&api, "u1").await;
    meter(
        &api,
        json!({"name": "calls", "event_name": "api_call", "aggregation": "count"}),
    )
    .await;
    let batch = |first: usize| {
        let events: Vec<Value> = (first..first + 40)
            .map(|i| json!({"name": "api_call", "external_customer_id": "u1", "event_id": format!("gz-{i}")}))
            .collect();
        json!({ "events": events })
    };
    let send = |body: Value, accept: Option<&'static str>| {
        let mut request = api
            .http
            .post(format!("{}/v1/events/ingest", api.base))
            .header("x-api-key", &api.key)
            .json(&body);
        if let Some(accept) = accept {
            request = request.header("accept-encoding", accept);
        }
        request.send()
    };
    // Accepted: the answer comes gzip-compressed (it is compressed where it is
    // written, on the intake runtime), once, and says it varies with the header.
    let gzipped = send(batch(0), Some("gzip")).await.unwrap();
    assert_eq!(gzipped.status(), 202);
    let headers = gzipped.headers().clone();
    assert_eq!(headers["content-encoding"], "gzip");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers.get_all("vary").iter().count(), 1, "{headers:?}");
    assert_eq!(headers["vary"], "accept-encoding");
    let raw = gzipped.bytes().await.unwrap();
    assert_eq!(raw[..3], [0x1f, 0x8b, 0x08], "not a gzip stream");
    assert_eq!(raw[8], 4, "not compressed at gzip's fastest level");
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&raw[..]), &mut json).unwrap();
    let first: Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(first["object"], "ingest_result");
    assert_eq!(first["accepted"], 40);
    assert_eq!(first["events"][39]["event_id"], "gz-39");
    // The same batch again, uncompressed: the same answer but for the duplicates.
    let plain = send(batch(0), None).await.unwrap();
    assert!(plain.headers().get("content-encoding").is_none());
    let mut again: Value = plain.json().await.unwrap();
    assert_eq!(again["duplicates"], 40);
    again["accepted"] = json!(40);
    again["duplicates"] = json!(0);
    for event in again["events"].as_array_mut().unwrap() {
        assert_eq!(event["duplicate"], true);
        assert_eq!(event["warnings"][0]["code"], "duplicate_event_id");
        event["duplicate"] = json!(false);
        event["warnings"] = json!([]);
    }
    assert!(again == first, "the answers differ: {again} / {first}");
    // Refused (q=0) or outranked by identity: not compressed.
    for accept in ["gzip;q=0", "gzip;q=0.5, identity"] {
        let answer = send(batch(100), Some(accept)).await.unwrap();
        assert_eq!(answer.status(), 202);
        assert!(
            answer.headers().get("content-encoding").is_none(),
            "{accept}"
        );
        let body: Value = answer.json().await.unwrap();
        assert_eq!(body["object"], "ingest_result", "{accept}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_is_exact_across_batches_within_batches_and_concurrent_requests() {
    let (_g, server, api) = setup().await;
    let cus = customer(&api, "u1").await;
    let count = meter(
        &api,
        json!({"name": "calls", "event_name": "api_call", "aggregation": "count"}),
    )
    .await;
    let first = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"name": "api_call", "customer_id": cus, "event_id": "e1"},
                {"name": "api_call", "customer_id": cus, "event_id": "e1"},
                {"name": "api_call", "customer_id": cus},
            ]}),
        )
        .await;
    assert_eq!(first.status, 202);
    assert_eq!(first.body["accepted"], 2);
    assert_eq!(first.body["duplicates"], 1);
    assert_eq!(first.body["events"][1]["duplicate"], true);
    assert!(
        first.body["events"][2]["event_id"]
            .as_str()
            .unwrap()
            .starts_with("evt_"),
        "assigned id"
    );
    let later = api
        .post("/v1/events/ingest", json!({"events": [
            {"name": "api_call", "customer_id": cus, "event_id": "e1", "properties": {"different": 1}}
        ]}))
        .await;
    assert_eq!(later.body["accepted"], 0);
    let codes: Vec<&str> = later.body["events"][0]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["code"].as_str().unwrap())
        .collect();
    assert_eq!(
        codes,
        vec!["duplicate_event_id", "duplicate_payload_differs"]
    );
    // A retry of the same JSON a minute later (no timestamp: "now" both times) is the
    // same payload; a different explicit timestamp is not.
    server.engine.wait_caught_up().await.unwrap();
    server.clock.advance_ms(60_000);
    let warnings = |answer: &Answer| -> Vec<String> {
        answer.body["events"][0]["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["code"].as_str().unwrap().to_string())
            .collect()
    };
    let retry = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"name": "api_call", "customer_id": cus, "event_id": "e1"}
            ]}),
        )
        .await;
    assert_eq!(
        warnings(&retry),
        vec!["duplicate_event_id"],
        "{}",
        retry.body
    );
    let back = format_iso8601_ms(server.clock.now_ms() - 3_600_000);
    let dated = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"name": "api_call", "customer_id": cus, "event_id": "e1", "timestamp": back}
            ]}),
        )
        .await;
    // An hour back is before the meter counts: `no_matching_meter` comes too, and
    // its message names the counting start rather than the properties.
    let early = dated.body["events"][0]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["code"] == "no_matching_meter")
        .unwrap_or_else(|| panic!("no no_matching_meter warning: {}", dated.body))
        .clone();
    let message = early["message"].as_str().unwrap();
    assert!(
        message.contains("before meter") && message.contains("counts_from"),
        "{message}"
    );
    let dated: Vec<String> = warnings(&dated)
        .into_iter()
        .filter(|code| code.starts_with("duplicate"))
        .collect();
    assert_eq!(
        dated,
        vec!["duplicate_event_id", "duplicate_payload_differs"]
    );

    // 20 concurrent requests carrying the same id: exactly one is accepted.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let api = api.clone();
        let cus = cus.clone();
        tasks.push(tokio::spawn(async move {
            api.post(
                "/v1/events/ingest",
                json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "race"}]}),
            )
            .await
            .body["accepted"]
                .as_u64()
                .unwrap()
        }));
    }
    let mut accepted = 0;
    for t in tasks {
        accepted += t.await.unwrap();
    }
    assert_eq!(accepted, 1);
    server.engine.wait_caught_up().await.unwrap();
    let usage = api
        .get(&format!(
            "/v1/meters/{}/usage?customer_id={cus}",
            count["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(
        usage.body["value"], "3",
        "e1, the assigned one, race: {}",
        usage.body
    );

    // Still exact after a restart (dedup state is durable).
    let clock = server.clock.clone();
    let dir = server_dir(&server);
    server.stop().await;
    let server = Server::start_with_clock(&dir, default_config(), clock).await;
    let api = Api::new(&server.test_url, &api.key);
    let replayed = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "api_call", "customer_id": cus, "event_id": "race"}]}),
        )
        .await;
    assert_eq!(replayed.body["duplicates"], 1);
    server.stop().await;
}

fn server_dir(server: &Server) -> std::path::PathBuf {
    server.data_dir.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_reports_per_event_and_writes_nothing() {
    let (_g, server, api) = setup().await;
    let cus = customer(&api, "u1").await;
    let tokens = meter(&api, json!({"name": "tokens", "event_name": "llm", "aggregation": "sum", "aggregation_property": "tokens",
        "filter": {"conjunction": "and", "clauses": [{"property": "model", "operator": "eq", "value": "big"}]}})).await;
    api.post("/v1/events/ingest", json!({"events": [{"name": "llm", "customer_id": cus, "event_id": "stored", "properties": {"tokens": 5, "model": "big"}}]})).await;
    let preview = api
        .post("/v1/events/preview", json!({"events": [
            {"name": "llm", "external_customer_id": "u1", "properties": {"tokens": 1, "model": "big"}},
            {"name": "llm", "external_customer_id": "u1", "properties": {"model": "small"}},
            {"name": "llm", "external_customer_id": "ghost"},
            {"name": "llm", "customer_id": cus, "event_id": "stored", "properties": {"tokens": 5, "model": "big"}},
            {"name": "llm", "customer_id": cus, "event_id": "twice", "properties": {"tokens": 1, "model": "big"}},
            {"name": "llm", "customer_id": cus, "event_id": "twice", "properties": {"tokens": 1, "model": "big"}},
        ]}))
        .await;
    assert_eq!(preview.status, 200);
    let events = preview.body["events"].as_array().unwrap();
    assert_eq!(preview.body["valid"], false);
    assert_eq!(events[0]["valid"], true);
    assert_eq!(events[0]["customer_id"], cus);
    assert_eq!(events[0]["matched_meters"], json!([tokens["id"]]));
    assert!(events[0]["event_id"].as_str().unwrap().starts_with("evt_"));
    assert_eq!(events[1]["matched_meters"], json!([]));
    assert_eq!(events[1]["warnings"][0]["code"], "no_matching_meter");
    assert_eq!(events[2]["valid"], false);
    assert_eq!(events[2]["error"]["code"], "invalid_usage_event");
    assert_eq!(
        events[2]["error"]["param"],
        "events[2].external_customer_id"
    );
    assert_eq!(events[3]["duplicate"], true, "against a stored event");
    assert!(events[3]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .all(|w| w["code"] != "duplicate_payload_differs"));
    assert_eq!(events[4]["duplicate"], false);
    assert_eq!(
        events[5]["duplicate"], true,
        "against an earlier entry of the batch"
    );
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(
        api.get("/v1/events/twice").await.status,
        404,
        "preview stored nothing"
    );
    let listed = api.get("/v1/events?limit=100").await;
    assert_eq!(listed.body["data"].as_array().unwrap().len(), 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_exact_for_every_aggregation_and_window() {
    let (_g, server, api) = setup().await;
    let a = customer(&api, "a").await;
    let b = customer(&api, "b").await;
    let mut meters = std::collections::HashMap::new();
    for aggregation in ["count", "sum", "average", "min", "max", "unique"] {
        let property = if aggregation == "count" {
            Value::Null
        } else if aggregation == "unique" {
            json!("user")
        } else {
            json!("n")
        };
        let body = meter(&api, json!({"name": aggregation, "event_name": "e", "aggregation": aggregation, "aggregation_property": property,
            "filter": {"conjunction": "or", "clauses": [{"property": "region", "operator": "in", "value": ["eu", "us"]}]}})).await;
        meters.insert(aggregation, body["id"].as_str().unwrap().to_string());
    }
    let now = server.clock.now_ms();
    let hour_ago = format_iso8601_ms(now - 3_600_000);
    let events = json!({"events": [
        {"name": "e", "customer_id": a, "event_id": "1", "properties": {"n": 0.1, "user": "x", "region": "eu"}},
        {"name": "e", "customer_id": a, "event_id": "2", "properties": {"n": "0.2", "user": "y", "region": "eu"}},
        {"name": "e", "customer_id": a, "event_id": "3", "properties": {"n": 10, "user": "x", "region": "us"}},
        {"name": "e", "customer_id": b, "event_id": "4", "properties": {"n": -3, "user": "x", "region": "eu"}},
        {"name": "e", "customer_id": b, "event_id": "5", "properties": {"n": 7, "user": "z", "region": "apac"}},
        {"name": "e", "customer_id": b, "event_id": "6", "properties": {"user": "w", "region": "eu"}},
        {"name": "other", "customer_id": b, "event_id": "7", "properties": {"n": 100, "region": "eu"}},
        {"name": "e", "customer_id": a, "event_id": "8", "timestamp": hour_ago, "properties": {"n": 1000, "region": "eu"}},
    ]});
    let ingested = api.post("/v1/events/ingest", events).await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    let warned = &ingested.body["events"][5]["warnings"];
    assert!(warned
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w["code"] == "aggregation_property_missing"));
    server.engine.wait_caught_up().await.unwrap();
    let value = |body: &Value| body["value"].clone();
    let usage = |aggregation: &str, query: String| {
        let api = api.clone();
        let id = meters[aggregation].clone();
        async move {
            api.get(&format!("/v1/meters/{id}/usage?{query}"))
                .await
                .body
        }
    };
    // Event 8 predates the meters: it does not count. Event 5 is filtered out (apac).
    assert_eq!(
        value(&usage("count", format!("customer_id={a}")).await),
        "3"
    );
    assert_eq!(
        value(&usage("sum", format!("customer_id={a}")).await),
        "10.3"
    );
    assert_eq!(value(&usage("sum", String::new()).await), "7.3");
    assert_eq!(
        value(&usage("average", format!("customer_id={b}")).await),
        "-3"
    );
    assert_eq!(value(&usage("min", String::new()).await), "-3");
    assert_eq!(
        value(&usage("max", "external_customer_id=a".into()).await),
        "10"
    );
    assert_eq!(
        value(&usage("unique", String::new()).await),
        "3",
        "x, y and w across customers"
    );
    assert_eq!(
        value(&usage("unique", format!("customer_id={a}")).await),
        "2"
    );
    assert_eq!(value(&usage("count", String::new()).await), "5");

    let grouped = usage("sum", "group_by=customer_id".into()).await;
    let groups = grouped["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2);
    let for_a = groups.iter().find(|g| g["customer_id"] == a).unwrap();
    assert_eq!(for_a["value"], "10.3");

    let minute = usage("count", "window=minute".into()).await;
    let windows = minute["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 1, "only windows with usage: {minute}");
    assert_eq!(windows[0]["value"], "5");
    assert!(windows[0]["start"].as_str().unwrap().ends_with(":00.000Z"));

    let empty_min = usage(
        "min",
        format!(
            "customer_id={a}&start={}&end={}",
            format_iso8601_ms(now - 7_200_000),
            hour_ago
        ),
    )
    .await;
    assert_eq!(empty_min["value"], Value::Null, "no data point");
    let empty_count = usage(
        "count",
        format!(
            "start={}&end={}",
            format_iso8601_ms(now - 7_200_000),
            hour_ago
        ),
    )
    .await;
    assert_eq!(empty_count["value"], "0");

    assert_error(
        &api.get(&format!("/v1/meters/{}/usage?window=week", meters["count"]))
            .await,
        400,
        "invalid_request_error",
    );
    assert_error(
        &api.get("/v1/meters/mtr_nope/usage").await,
        404,
        "invalid_request_error",
    );
    assert_error(
        &api.get(&format!(
            "/v1/meters/{}/usage?customer_id=cus_nope",
            meters["count"]
        ))
        .await,
        404,
        "invalid_request_error",
    );

    // Backfill opts the meter in to the older event 8.
    let backfilled = api
        .post(
            &format!("/v1/meters/{}/backfill", meters["sum"]),
            json!({"start": format_iso8601_ms(now - 2 * 3_600_000)}),
        )
        .await;
    assert_eq!(backfilled.status, 200, "{}", backfilled.body);
    assert_eq!(
        value(&usage("sum", format!("customer_id={a}")).await),
        "1010.3"
    );
    let again = api
        .post(
            &format!("/v1/meters/{}/backfill", meters["sum"]),
            json!({"start": format_iso8601_ms(now - 2 * 3_600_000)}),
        )
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(
        value(&usage("sum", format!("customer_id={a}")).await),
        "1010.3",
        "a second backfill counts nothing twice"
    );

    // Archived meters stop accruing; recorded usage stays.
    api.post(
        &format!("/v1/meters/{}/archive", meters["count"]),
        json!({}),
    )
    .await;
    api.post("/v1/events/ingest", json!({"events": [{"name": "e", "customer_id": a, "event_id": "9", "properties": {"region": "eu"}}]})).await;
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(value(&usage("count", String::new()).await), "5");

    // Meter preview runs a definition over stored events.
    let preview = api
        .post("/v1/meters/preview", json!({"event_name": "e", "aggregation": "sum", "aggregation_property": "n",
            "start": format_iso8601_ms(now - 2 * 3_600_000), "end": format_iso8601_ms(now + 60_000)}))
        .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(
        preview.body["value"], "1014.3",
        "all stored `e` events, no filter"
    );
    let existing = api
        .post(
            &format!("/v1/meters/{}/preview", meters["max"]),
            json!({"customer_id": b}),
        )
        .await;
    assert_eq!(
        existing.body["value"], "-3",
        "region filter applies: only event 4"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursor_pagination_edges() {
    let (_g, server, api) = setup().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(customer(&api, &format!("p{i}")).await);
        server.clock.advance_ms(1);
    }
    ids.reverse(); // newest first
    let page = api.get("/v1/customers?limit=2").await;
    let got: Vec<&str> = page.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(got, vec![ids[0].as_str(), ids[1].as_str()]);
    assert_eq!(page.body["has_more"], true);
    let next = api
        .get(&format!("/v1/customers?limit=2&starting_after={}", ids[1]))
        .await;
    assert_eq!(next.body["data"][0]["id"], ids[2]);
    assert_eq!(next.body["has_more"], true);
    let last = api
        .get(&format!("/v1/customers?limit=2&starting_after={}", ids[3]))
        .await;
    assert_eq!(last.body["data"].as_array().unwrap().len(), 1);
    assert_eq!(
        last.body["has_more"], false,
        "exact: nothing after the last one"
    );
    let exact = api
        .get(&format!("/v1/customers?limit=3&starting_after={}", ids[1]))
        .await;
    assert_eq!(exact.body["has_more"], false, "exactly the rest");
    let before = api
        .get(&format!("/v1/customers?limit=2&ending_before={}", ids[3]))
        .await;
    let got: Vec<&str> = before.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        got,
        vec![ids[1].as_str(), ids[2].as_str()],
        "still newest first"
    );
    assert_eq!(before.body["has_more"], true);
    for bad in ["limit=0", "limit=101", "limit=abc"] {
        assert_eq!(
            assert_error(
                &api.get(&format!("/v1/customers?{bad}")).await,
                400,
                "invalid_request_error"
            )["param"],
            "limit"
        );
    }
    let unknown = api.get("/v1/customers?starting_after=cus_unknown").await;
    assert_eq!(
        assert_error(&unknown, 404, "invalid_request_error")["param"],
        "starting_after"
    );
    assert_eq!(
        api.get("/v1/customers?limit=100").await.body["data"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    // A parameter given more than once takes its last value, as a repeated key of
    // a JSON body does, whichever order the values come in.
    for (query, len) in [("limit=5&limit=1", 1), ("limit=1&limit=3", 3)] {
        let page = api.get(&format!("/v1/customers?{query}")).await;
        assert_eq!(page.status, 200, "{query}");
        assert_eq!(page.body["data"].as_array().unwrap().len(), len, "{query}");
    }
    let invalid_last = api.get("/v1/customers?limit=2&limit=0").await;
    assert_eq!(
        assert_error(&invalid_last, 400, "invalid_request_error")["param"],
        "limit"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_external_id_is_never_resolved_from_a_stale_cache() {
    let (_g, server, api) = setup().await;
    let id = customer(&api, "before").await;
    let event = |external: &str, event_id: &str| json!({"events": [{"name": "e", "external_customer_id": external, "event_id": event_id}]});
    let first = api.post("/v1/events/ingest", event("before", "x1")).await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert_eq!(first.body["events"][0]["customer_id"], id);
    let updated = api
        .post(
            &format!("/v1/customers/{id}"),
            json!({"external_id": "after"}),
        )
        .await;
    assert_eq!(updated.status, 200);
    let stale = api.post("/v1/events/ingest", event("before", "x2")).await;
    assert_eq!(
        assert_error(&stale, 400, "invalid_request_error")["param"],
        "events[0].external_customer_id"
    );
    let fresh = api.post("/v1/events/ingest", event("after", "x3")).await;
    assert_eq!(fresh.body["events"][0]["customer_id"], id);
    // The released id can now name another customer.
    let other = customer(&api, "before").await;
    let reused = api.post("/v1/events/ingest", event("before", "x4")).await;
    assert_eq!(reused.body["events"][0]["customer_id"], other);
    server.stop().await;
}

/// `GET /v1/events` reads the log through the scope's stored-event rows: newest
/// received first (within one batch, last first), cursors in both directions inside
/// and across batches, filters, duplicates never listed, and an unknown cursor named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_listing_walks_batches_in_both_directions() {
    let (_g, server, api) = setup().await;
    let a = customer(&api, "la").await;
    let b = customer(&api, "lb").await;
    let mut sent = Vec::new(); // oldest first
    let t0 = server.clock.now_ms();
    for batch in 0..4 {
        let events: Vec<Value> = (0..3)
            .map(|i| {
                let id = format!("b{batch}e{i}");
                let customer = if i == 1 { &b } else { &a };
                sent.push((id.clone(), customer.clone()));
                json!({"name": "call", "customer_id": customer, "event_id": id})
            })
            .collect();
        let mut events = events;
        if batch == 2 {
            // A duplicate of an earlier batch's event: never listed twice.
            events.push(json!({"name": "call", "customer_id": a, "event_id": "b0e0"}));
        }
        let response = api
            .post("/v1/events/ingest", json!({ "events": events }))
            .await;
        assert_eq!(response.status, 202, "{}", response.body);
        server.clock.advance_ms(1_000);
    }
    server.engine.wait_caught_up().await.unwrap();
    let newest_first: Vec<String> = sent.iter().rev().map(|(id, _)| id.clone()).collect();
    let ids = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().to_string())
            .collect()
    };
    // Forward in pages of 5: across batches, and from the middle of one.
    let mut walked = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/events?limit=5&starting_after={c}"),
            None => "/v1/events?limit=5".to_string(),
        };
        let page = api.get(&path).await;
        assert_eq!(page.status, 200, "{}", page.body);
        let got = ids(&page.body);
        walked.extend(got.clone());
        if page.body["has_more"] == false {
            break;
        }
        cursor = got.last().cloned();
    }
    assert_eq!(walked, newest_first);
    // Backward from the oldest: the newer neighbours, still newest first.
    let before = api
        .get(&format!(
            "/v1/events?limit=4&ending_before={}",
            newest_first[7]
        ))
        .await;
    assert_eq!(ids(&before.body), newest_first[3..7].to_vec());
    assert_eq!(before.body["has_more"], true);
    // Filters.
    let only_b = api
        .get(&format!("/v1/events?limit=100&customer_id={b}"))
        .await;
    let expected: Vec<String> = sent
        .iter()
        .rev()
        .filter(|(_, c)| *c == b)
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(ids(&only_b.body), expected);
    // Time filters (on the event timestamp: here the receipt time, a second apart).
    let between = api
        .get(&format!(
            "/v1/events?limit=100&start={}&end={}",
            format_iso8601_ms(t0 + 1_000),
            format_iso8601_ms(t0 + 3_000)
        ))
        .await;
    assert_eq!(between.status, 200, "{}", between.body);
    assert_eq!(
        ids(&between.body),
        newest_first[3..9].to_vec(),
        "batches 1 and 2"
    );
    let unknown = api.get("/v1/events?starting_after=nope").await;
    assert_eq!(
        assert_error(&unknown, 404, "invalid_request_error")["param"],
        "starting_after"
    );
    // A customer that does not exist is a 404 naming the filter, as on usage.
    for (query, param) in [
        ("customer_id=cus_nope", "customer_id"),
        ("external_customer_id=nobody", "external_customer_id"),
    ] {
        let missing = api.get(&format!("/v1/events?{query}")).await;
        assert_eq!(
            assert_error(&missing, 404, "invalid_request_error")["param"],
            param
        );
    }
    let one = api.get("/v1/events/b0e0").await;
    assert_eq!(
        one.body["customer_id"], a,
        "the first event with the id is kept"
    );
    server.stop().await;
}

/// `latest` and `time_weighted_sum` over HTTP: events sent out of order, a value
/// held into a range from before it, ties on the timestamp, windows, groups and a
/// preview that reads the events before its range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_and_time_weighted_sum_hold_values_until_they_change() {
    let (_g, server, api) = setup().await;
    let a = customer(&api, "a").await;
    let b = customer(&api, "b").await;
    let missing = api
        .post(
            "/v1/meters",
            json!({"name": "x", "event_name": "seats", "aggregation": "time_weighted_sum"}),
        )
        .await;
    assert_eq!(
        assert_error(&missing, 400, "invalid_request_error")["param"],
        "aggregation_property"
    );
    let unknown = api
        .post(
            "/v1/meters",
            json!({"name": "x", "event_name": "seats", "aggregation": "gauge", "aggregation_property": "n"}),
        )
        .await;
    let message = assert_error(&unknown, 400, "invalid_request_error")["message"].clone();
    assert!(
        message
            .as_str()
            .unwrap()
            .contains("latest, time_weighted_sum"),
        "{message}"
    );
    let weighted = meter(&api, json!({"name": "seat hours", "event_name": "seats", "aggregation": "time_weighted_sum", "aggregation_property": "n"})).await;
    let latest = meter(&api, json!({"name": "seats now", "event_name": "seats", "aggregation": "latest", "aggregation_property": "n"})).await;
    assert_eq!(weighted["aggregation"], "time_weighted_sum");
    assert_eq!(latest["aggregation"], "latest");
    let (weighted, latest) = (
        weighted["id"].as_str().unwrap().to_string(),
        latest["id"].as_str().unwrap().to_string(),
    );

    // Whole hours after the meters' creation, so that hour windows are whole.
    const HOUR: i64 = 3_600_000;
    let base = (server.clock.now_ms() / HOUR + 1) * HOUR;
    server.clock.set_ms(base + 3 * HOUR);
    let at = |minutes: i64| format_iso8601_ms(base + minutes * 60_000);
    let event = |customer: &str, id: &str, minutes: i64, n: i64| json!({"name": "seats", "customer_id": customer, "event_id": id, "timestamp": at(minutes), "properties": {"n": n}});
    // a: 2 from 0:00, 0 from 0:30, 4 from 1:30, sent last first.
    // b: 10 and 7 at 1:00 (the same instant: "b2" is later by id).
    for batch in [
        vec![event(&a, "a3", 90, 4), event(&b, "b2", 60, 7)],
        vec![event(&a, "a1", 0, 2), event(&b, "b1", 60, 10)],
        vec![event(&a, "a2", 30, 0)],
    ] {
        let ingested = api
            .post("/v1/events/ingest", json!({"events": batch}))
            .await;
        assert_eq!(ingested.status, 202, "{}", ingested.body);
    }
    server.engine.wait_caught_up().await.unwrap();
    let usage = |id: &str, query: String| {
        let api = api.clone();
        let path = format!("/v1/meters/{id}/usage?{query}");
        async move {
            let answer = api.get(&path).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            answer.body
        }
    };
    let range = |from: i64, to: i64| {
        format!(
            "start={}&end={}",
            at(from).replace(':', "%3A"),
            at(to).replace(':', "%3A")
        )
    };

    // a over 0:00-2:00: 2 x 0.5 h + 0 x 1 h + 4 x 0.5 h.
    let for_a = usage(&weighted, format!("customer_id={a}&{}", range(0, 120))).await;
    assert_eq!(for_a["value"], "3");
    let for_b = usage(&weighted, format!("customer_id={b}&{}", range(0, 180))).await;
    assert_eq!(for_b["value"], "14", "7 (not 10) held for two hours");
    let hourly = usage(
        &weighted,
        format!("customer_id={a}&window=hour&{}", range(0, 180)),
    )
    .await;
    let values: Vec<&Value> = hourly["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["value"])
        .collect();
    assert_eq!(values, ["1", "2", "4"], "{hourly}");
    assert_eq!(hourly["value"], "7");
    // A range after the last event: the value held from before it counts.
    let late = range(120, 180);
    assert_eq!(
        usage(&weighted, format!("customer_id={a}&{late}")).await["value"],
        "4"
    );
    let all = usage(&weighted, format!("group_by=customer_id&{late}")).await;
    assert_eq!(all["value"], "11");
    let groups = all["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{all}");
    let group = |id: &str| groups.iter().find(|g| g["customer_id"] == id).unwrap()["value"].clone();
    assert_eq!((group(&a), group(&b)), (json!("4"), json!("7")));
    // A quarter of an hour of 2: not a whole number of hours.
    assert_eq!(
        usage(&weighted, format!("customer_id={a}&{}", range(15, 30))).await["value"],
        "0.5"
    );
    assert_eq!(
        usage(&weighted, format!("customer_id={a}&{}", range(1, 2))).await["value"],
        "0.0333333333333333333333333333",
        "one minute of 2, in hours, rounded past 28 digits"
    );

    // latest: a's 0 at 0:30 is later than its 2 at 0:00; a's 4 at 1:30 is the
    // latest of all; b's tie goes to "b2".
    let latest_a = usage(
        &latest,
        format!("customer_id={a}&window=hour&{}", range(0, 180)),
    )
    .await;
    assert_eq!(latest_a["value"], "4");
    let values: Vec<&Value> = latest_a["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["value"])
        .collect();
    assert_eq!(
        values,
        ["0", "4"],
        "the third hour has no event: {latest_a}"
    );
    assert_eq!(
        usage(&latest, format!("customer_id={b}&{}", range(0, 180))).await["value"],
        "7"
    );
    assert_eq!(usage(&latest, range(0, 180)).await["value"], "4");
    assert_eq!(usage(&latest, range(0, 75)).await["value"], "7");
    assert_eq!(
        usage(&latest, format!("customer_id={a}&{late}")).await["value"],
        Value::Null
    );

    // A preview integrates stored events, reading those before its range too.
    let preview = api
        .post(
            &format!("/v1/meters/{weighted}/preview"),
            json!({"start": at(120), "end": at(180)}),
        )
        .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(preview.body["value"], "11");
    let preview = api
        .post(
            "/v1/meters/preview",
            json!({"event_name": "seats", "aggregation": "latest", "aggregation_property": "n", "start": at(0), "end": at(75)}),
        )
        .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(preview.body["value"], "7");
}

/// A test store's usage follows its test clock: events ingested after an advance
/// take the test time as their default timestamp, and a usage query without a range
/// covers the 35 days before the test time, so it finds them (docs/api.md, "Test
/// clock").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_without_a_range_follows_an_advanced_test_clock() {
    let (_g, server, api) = setup().await;
    let a = customer(&api, "a").await;
    let counted = meter(
        &api,
        json!({"name": "calls", "event_name": "call", "aggregation": "count"}),
    )
    .await;
    let id = counted["id"].as_str().unwrap();
    let later = format_iso8601_ms(server.clock.now_ms() + 60 * 24 * 3_600_000);
    let advanced = api
        .post("/v1/test-clock/advance", json!({"to": later}))
        .await;
    assert_eq!(advanced.status, 200, "{}", advanced.body);
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [{"name": "call", "customer_id": a}]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    server.engine.wait_caught_up().await.unwrap();
    let usage = api.get(&format!("/v1/meters/{id}/usage")).await;
    assert_eq!(usage.status, 200, "{}", usage.body);
    assert_eq!(usage.body["value"], "1", "{}", usage.body);
    assert!(
        usage.body["end"].as_str().unwrap() > later.as_str(),
        "the default range ends after the test time: {}",
        usage.body
    );
    server.stop().await;
}

/// The ingest warning for an unusable aggregation property says which way it is
/// unusable, and a `unique` meter takes any value: it counts strings too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_aggregation_property_is_named_for_what_it_lacks() {
    let (_g, server, api) = setup().await;
    let a = customer(&api, "a").await;
    let sum = meter(&api, json!({"name": "sum", "event_name": "e", "aggregation": "sum", "aggregation_property": "n"})).await;
    let unique = meter(&api, json!({"name": "unique", "event_name": "e", "aggregation": "unique", "aggregation_property": "n"})).await;
    let (sum, unique) = (sum["id"].as_str().unwrap(), unique["id"].as_str().unwrap());
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                {"name": "e", "customer_id": a, "properties": {"n": "many"}},
                {"name": "e", "customer_id": a, "properties": {}},
            ]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    let warned = |event: usize| -> Vec<String> {
        ingested.body["events"][event]["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["code"] == "aggregation_property_missing")
            .map(|w| w["message"].as_str().unwrap().to_owned())
            .collect()
    };
    let not_a_number = warned(0);
    assert_eq!(not_a_number.len(), 1, "{not_a_number:?}");
    assert!(not_a_number[0].contains(sum), "{not_a_number:?}");
    assert!(not_a_number[0].contains("not a number"), "{not_a_number:?}");
    let lacking = warned(1);
    assert_eq!(lacking.len(), 2, "{lacking:?}");
    for meter in [sum, unique] {
        assert!(
            lacking
                .iter()
                .any(|m| m.contains(meter) && m.contains("lacks it")),
            "{lacking:?}"
        );
    }
    server.stop().await;
}
