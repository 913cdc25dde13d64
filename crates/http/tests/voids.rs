//! Voiding and amending stored usage events over real sockets (docs/api.md,
//! "Voiding events", "Amending an event"): every aggregation forgets a voided
//! event exactly (and counts an amendment's replacement instead), per customer and
//! for all customers, across a restart; the requests' errors; events read back.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::time::format_iso8601_ms;

/// One meter per aggregation over event `calls`, by aggregation.
async fn meters(api: &Api) -> Vec<(&'static str, String)> {
    let mut ids = Vec::new();
    for aggregation in AGGREGATIONS {
        ids.push((
            aggregation,
            calls_meter(api, aggregation, aggregation, Value::Null).await,
        ));
    }
    ids
}

/// Every meter's usage over the range, in minute windows, for `who` (a customer
/// id, or "" for all customers): comparable as a whole.
async fn usage_of(api: &Api, meters: &[(&str, String)], who: &str, range: &str) -> Vec<Value> {
    let mut all = Vec::new();
    for (aggregation, id) in meters {
        let mut usage = minute_usage(api, id, who, range).await;
        usage["meter"] = json!(aggregation);
        all.push(usage);
    }
    all
}

fn value_of<'a>(usage: &'a [Value], aggregation: &str) -> &'a Value {
    &usage.iter().find(|u| u["meter"] == aggregation).unwrap()["value"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voided_events_leave_every_aggregation_exactly_and_stay_taken() {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let a = customer(&api, "a").await;
    let b = customer(&api, "b").await;
    // `twin` receives a's events except the one voided below, under other ids: once
    // it is voided, a's usage must equal twin's in every meter and window.
    let twin = customer(&api, "twin").await;
    let meters = meters(&api).await;

    const MINUTE: i64 = 60_000;
    // Whole minutes after the meters' creation (they count from it).
    let base = (server.clock.now_ms() / MINUTE + 1) * MINUTE;
    server.clock.set_ms(base + 3 * MINUTE);
    let at = |ms: i64| format_iso8601_ms(base + ms);
    let event = |who: &str, id: &str, ms: i64, n: i64, s: &str| json!({"name": "calls", "customer_id": who, "event_id": id, "timestamp": at(ms), "properties": {"n": n, "s": s}});
    // e2 is a's largest value, the minute's largest and latest, and the only "y".
    let events = vec![
        event(&a, "e1", 10_000, 5, "x"),
        event(&a, "e2", 50_000, 9, "y"),
        event(&b, "e3", 30_000, 7, "x"),
        event(&a, "e4", 70_000, 3, "z"),
        event(&b, "e5", 80_000, 1, "x"),
        event(&twin, "t1", 10_000, 5, "x"),
        event(&twin, "t4", 70_000, 3, "z"),
    ];
    let ingested = api
        .post("/v1/events/ingest", json!({"events": events}))
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    server.engine.wait_caught_up().await.unwrap();
    let range = format!(
        "start={}&end={}",
        at(0).replace(':', "%3A"),
        at(2 * MINUTE).replace(':', "%3A")
    );
    let before = usage_of(&api, &meters, &a, &range).await;
    let twin_usage = usage_of(&api, &meters, &twin, &range).await;
    for aggregation in ["count", "sum", "max", "unique", "time_weighted_sum"] {
        assert_ne!(
            value_of(&before, aggregation),
            value_of(&twin_usage, aggregation),
            "{aggregation} counts e2 before the void"
        );
    }
    let all_before = usage_of(&api, &meters, "", &range).await;
    assert_eq!(value_of(&all_before, "max"), "9");
    assert_eq!(value_of(&all_before, "unique"), "3");

    // Refusals first: nothing is voided by any of them.
    let missing_reason = api
        .post("/v1/events/void", json!({"event_ids": ["e2"]}))
        .await;
    assert_eq!(
        assert_error(&missing_reason, 400, "invalid_request_error")["param"],
        "reason"
    );
    let blank_reason = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e2"], "reason": "  "}),
        )
        .await;
    assert_eq!(
        assert_error(&blank_reason, 400, "invalid_request_error")["param"],
        "reason"
    );
    let long_reason = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e2"], "reason": "r".repeat(501)}),
        )
        .await;
    assert_eq!(
        assert_error(&long_reason, 400, "invalid_request_error")["param"],
        "reason"
    );
    let none = api
        .post("/v1/events/void", json!({"event_ids": [], "reason": "x"}))
        .await;
    assert_eq!(
        assert_error(&none, 400, "invalid_request_error")["param"],
        "event_ids"
    );
    let too_many: Vec<String> = (0..101).map(|i| format!("e{i}")).collect();
    let many = api
        .post(
            "/v1/events/void",
            json!({"event_ids": too_many, "reason": "x"}),
        )
        .await;
    assert_eq!(
        assert_error(&many, 400, "invalid_request_error")["param"],
        "event_ids"
    );
    let not_strings = api
        .post("/v1/events/void", json!({"event_ids": "e2", "reason": "x"}))
        .await;
    assert_eq!(
        assert_error(&not_strings, 400, "invalid_request_error")["param"],
        "event_ids"
    );
    let unknown = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e1", "nope"], "reason": "x"}),
        )
        .await;
    let error = assert_error(&unknown, 404, "invalid_request_error");
    assert_eq!(error["code"], "event_not_found", "{}", unknown.body);
    assert_eq!(error["param"], "event_ids[1]");
    assert!(error["message"].as_str().unwrap().contains("nope"));
    // Ids are confirmed a slice at a time: one past the first slice is still
    // named at its place in the request.
    let mut late = vec!["e1"; 60];
    late.push("nope");
    let unknown = api
        .post("/v1/events/void", json!({"event_ids": late, "reason": "x"}))
        .await;
    let error = assert_error(&unknown, 404, "invalid_request_error");
    assert_eq!(error["param"], "event_ids[60]", "{}", unknown.body);
    let e1 = api.get("/v1/events/e1").await;
    assert_eq!(e1.body["voided"], false, "all or nothing: {}", e1.body);
    assert_eq!(e1.body["void_reason"], Value::Null);
    assert_eq!(usage_of(&api, &meters, &a, &range).await, before);

    // The void.
    let voided = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e2", "e2"], "reason": "sent twice by a retry bug"}),
        )
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    assert_eq!(
        voided.body,
        json!({"object": "event_void", "voided": ["e2"], "already_voided": []})
    );
    let after = usage_of(&api, &meters, &a, &range).await;
    assert_eq!(after, twin_usage, "a without e2 is its twin");
    let all = usage_of(&api, &meters, "", &range).await;
    assert_eq!(value_of(&all, "count"), "6");
    assert_eq!(value_of(&all, "sum"), "24");
    assert_eq!(value_of(&all, "max"), "7");
    assert_eq!(value_of(&all, "min"), "1");
    assert_eq!(value_of(&all, "unique"), "2");
    assert_eq!(value_of(&all, "latest"), "1");
    let latest_windows = &all.iter().find(|u| u["meter"] == "latest").unwrap()["windows"];
    assert_eq!(
        latest_windows[0][1], "7",
        "the first minute's latest is e3 now: {all:?}"
    );

    // A preview over the stored events, and a meter created and backfilled after
    // the void, leave it out too.
    let preview = api
        .post(
            "/v1/meters/preview",
            json!({"event_name": "calls", "aggregation": "max", "aggregation_property": "n",
                "customer_id": a, "start": at(0), "end": at(2 * MINUTE)}),
        )
        .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert_eq!(preview.body["value"], "5", "{}", preview.body);
    let late = api
        .post(
            "/v1/meters",
            json!({"name": "late max", "event_name": "calls", "aggregation": "max", "aggregation_property": "n"}),
        )
        .await;
    assert_eq!(late.status, 200, "{}", late.body);
    let late = late.body["id"].as_str().unwrap().to_string();
    let backfilled = api
        .post(
            &format!("/v1/meters/{late}/backfill"),
            json!({"start": at(0)}),
        )
        .await;
    assert_eq!(backfilled.status, 200, "{}", backfilled.body);
    server.engine.wait_caught_up().await.unwrap();
    let late_usage = usage_of(&api, &[("max", late)], &a, &range).await;
    assert_eq!(value_of(&late_usage, "max"), "5", "{late_usage:?}");

    // Voiding again changes nothing; the id stays taken.
    let again = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e2", "e1"], "reason": "again"}),
        )
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["voided"], json!(["e1"]));
    assert_eq!(again.body["already_voided"], json!(["e2"]));
    let unvoid_e1 = api
        .post(
            "/v1/events/ingest",
            json!({"events": [event(&a, "e2", 50_000, 9, "y"), event(&a, "e1", 10_000, 5, "x")]}),
        )
        .await;
    assert_eq!(unvoid_e1.status, 202, "{}", unvoid_e1.body);
    assert_eq!(unvoid_e1.body["duplicates"], 2, "{}", unvoid_e1.body);
    server.engine.wait_caught_up().await.unwrap();
    let without_e1 = usage_of(&api, &meters, &a, &range).await;
    assert_eq!(value_of(&without_e1, "count"), "1");
    assert_eq!(value_of(&without_e1, "max"), "3");

    // Read back: the event with its void; the listing leaves voided events out.
    let e2 = api.get("/v1/events/e2").await;
    assert_eq!(e2.status, 200, "{}", e2.body);
    assert_eq!(e2.body["voided"], true);
    assert_eq!(e2.body["void_reason"], "sent twice by a retry bug");
    assert!(e2.body["voided_at"].as_str().unwrap().ends_with('Z'));
    let ids = |body: &Value| -> Vec<String> {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().to_string())
            .collect()
    };
    let listed = api.get(&format!("/v1/events?customer_id={a}")).await;
    assert_eq!(ids(&listed.body), ["e4"], "{}", listed.body);
    let with_voided = api
        .get(&format!("/v1/events?customer_id={a}&include_voided=true"))
        .await;
    let mut all_ids = ids(&with_voided.body);
    all_ids.sort();
    assert_eq!(all_ids, ["e1", "e2", "e4"]);
    assert!(with_voided.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["voided"] == (e["event_id"] != "e4")));
    assert_eq!(
        assert_error(
            &api.get("/v1/events?include_voided=yes").await,
            400,
            "invalid_request_error"
        )["param"],
        "include_voided"
    );

    // A restart rebuilds nothing differently.
    let all_now = usage_of(&api, &meters, "", &range).await;
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(usage_of(&api, &meters, &a, &range).await, without_e1);
    assert_eq!(usage_of(&api, &meters, "", &range).await, all_now);
    server.stop().await;
    drop(guard);
}

/// An amendment voids the event and stores its replacement in one record: every
/// aggregation then counts the replacement instead, exactly (a's usage equals its
/// twin's, who sent the corrected event in the first place); refusals amend
/// nothing; the replacement's id is new or assigned; a restart keeps it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amended_events_are_replaced_in_every_aggregation() {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let a = customer(&api, "a").await;
    let twin = customer(&api, "twin").await;
    let meters = meters(&api).await;

    const MINUTE: i64 = 60_000;
    let base = (server.clock.now_ms() / MINUTE + 1) * MINUTE;
    server.clock.set_ms(base + 3 * MINUTE);
    let at = |ms: i64| format_iso8601_ms(base + ms);
    let event = |who: &str, id: &str, ms: i64, n: i64, s: &str| json!({"name": "calls", "customer_id": who, "event_id": id, "timestamp": at(ms), "properties": {"n": n, "s": s}});
    // e2 is wrong: it should have been at +70 s with n = 4 and s = "w", as t2 is.
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                event(&a, "e1", 10_000, 5, "x"),
                event(&a, "e2", 50_000, 9, "y"),
                event(&a, "e3", 20_000, 2, "x"),
                event(&twin, "t1", 10_000, 5, "x"),
                event(&twin, "t2", 70_000, 4, "w"),
            ]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    server.engine.wait_caught_up().await.unwrap();
    let range = format!(
        "start={}&end={}",
        at(0).replace(':', "%3A"),
        at(2 * MINUTE).replace(':', "%3A")
    );
    let before = usage_of(&api, &meters, &a, &range).await;
    let all_before = usage_of(&api, &meters, "", &range).await;

    // Refusals: each names what is wrong, and nothing is amended.
    let fix = json!({"timestamp": at(70_000), "properties": {"n": 4, "s": "w"}, "event_id": "e2b"});
    let refusals = [
        (json!({"event": fix}), 400, "reason"),
        (json!({"event": fix, "reason": " "}), 400, "reason"),
        (json!({"reason": "x"}), 400, "event"),
        (json!({"event": "e2b", "reason": "x"}), 400, "event"),
        (
            json!({"event": {"customer_id": twin}, "reason": "x"}),
            400,
            "event.customer_id",
        ),
        (
            json!({"event": {"external_customer_id": "twin"}, "reason": "x"}),
            400,
            "event.external_customer_id",
        ),
        (
            json!({"event": {"timestamp": "yesterday"}, "reason": "x"}),
            400,
            "event.timestamp",
        ),
        (
            json!({"event": {"properties": {"n": true}}, "reason": "x"}),
            400,
            "event.properties.n",
        ),
        (
            json!({"event": {"properties": [1]}, "reason": "x"}),
            400,
            "event.properties",
        ),
        (
            json!({"event": {"event_id": "e1"}, "reason": "x"}),
            409,
            "event.event_id",
        ),
    ];
    for (body, status, param) in refusals {
        let answer = api.post("/v1/events/e2/amend", body.clone()).await;
        assert_eq!(answer.status, status, "{body}: {}", answer.body);
        assert_eq!(
            answer.body["error"]["param"], param,
            "{body}: {}",
            answer.body
        );
    }
    let taken = api
        .post(
            "/v1/events/e2/amend",
            json!({"event": {"event_id": "t1"}, "reason": "x"}),
        )
        .await;
    assert_eq!(
        taken.body["error"]["code"], "event_id_taken",
        "{}",
        taken.body
    );
    let unknown = api
        .post(
            "/v1/events/nope/amend",
            json!({"event": fix, "reason": "x"}),
        )
        .await;
    let error = assert_error(&unknown, 404, "invalid_request_error");
    assert_eq!(error["code"], "event_not_found", "{}", unknown.body);
    assert_eq!(api.get("/v1/events/e2").await.body["voided"], false);
    assert_eq!(api.get("/v1/events/e2b").await.status, 404);
    assert_eq!(usage_of(&api, &meters, &a, &range).await, before);

    // The amendment.
    let amended = api
        .post(
            "/v1/events/e2/amend",
            json!({"event": fix, "reason": "n and s were mixed up"}),
        )
        .await;
    assert_eq!(amended.status, 200, "{}", amended.body);
    assert_eq!(amended.body["object"], "event_amendment");
    assert_eq!(amended.body["voided"], "e2");
    let replacement = &amended.body["replacement"];
    assert_eq!(replacement["event_id"], "e2b");
    assert_eq!(replacement["customer_id"], a.as_str());
    assert_eq!(replacement["name"], "calls");
    assert_eq!(replacement["timestamp"], at(70_000));
    assert_eq!(replacement["properties"], json!({"n": 4, "s": "w"}));
    assert_eq!(replacement["voided"], false);
    assert_eq!(replacement["matched_meters"].as_array().unwrap().len(), 8);
    assert_eq!(api.get("/v1/events/e2b").await.body, *replacement);
    let e2 = api.get("/v1/events/e2").await.body;
    assert_eq!(e2["voided"], true);
    assert_eq!(e2["void_reason"], "n and s were mixed up");

    // a's e3 is voided below through the twin's view: the twin has no e3, so first
    // check the amendment alone against all customers, then void e3 and compare.
    let all_after = usage_of(&api, &meters, "", &range).await;
    assert_ne!(all_after, all_before);
    assert_eq!(value_of(&all_after, "max"), "5", "{all_after:?}");
    assert_eq!(value_of(&all_after, "sum"), "20");
    let voided = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e3"], "reason": "no twin"}),
        )
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    let twin_usage = usage_of(&api, &meters, &twin, &range).await;
    assert_eq!(usage_of(&api, &meters, &a, &range).await, twin_usage);

    // Two amendments of one event at once: apply decides, exactly one lands.
    let (first, second) = tokio::join!(
        api.post(
            "/v1/events/e1/amend",
            json!({"event": {"properties": {"n": 6, "s": "x"}}, "reason": "one"}),
        ),
        api.post(
            "/v1/events/e1/amend",
            json!({"event": {"properties": {"n": 7, "s": "x"}}, "reason": "two"}),
        ),
    );
    let mut statuses = [first.status, second.status];
    statuses.sort();
    assert_eq!(statuses, [200, 409], "{} / {}", first.body, second.body);
    let loser = if first.status == 409 { &first } else { &second };
    assert_eq!(
        loser.body["error"]["code"], "event_voided",
        "{}",
        loser.body
    );
    let winner = if first.status == 200 { &first } else { &second };
    let e1b = winner.body["replacement"]["event_id"]
        .as_str()
        .unwrap()
        .to_string();

    // A voided event cannot be amended; the replacement's id is taken; an
    // amendment without an id gets one, and one renaming the event leaves the
    // meters of the old name.
    for voided_id in ["e2", "e3"] {
        let again = api
            .post(
                &format!("/v1/events/{voided_id}/amend"),
                json!({"event": {}, "reason": "again"}),
            )
            .await;
        let error = assert_error(&again, 409, "invalid_request_error");
        assert_eq!(error["code"], "event_voided", "{}", again.body);
    }
    let duplicate = api
        .post(
            "/v1/events/ingest",
            json!({"events": [event(&a, "e2b", 70_000, 4, "w")]}),
        )
        .await;
    assert_eq!(duplicate.body["duplicates"], 1, "{}", duplicate.body);
    let renamed = api
        .post(
            &format!("/v1/events/{e1b}/amend"),
            json!({"event": {"name": "other"}, "reason": "not a call"}),
        )
        .await;
    assert_eq!(renamed.status, 200, "{}", renamed.body);
    let assigned = renamed.body["replacement"]["event_id"].as_str().unwrap();
    assert!(assigned.starts_with("evt_"), "{assigned}");
    assert_eq!(renamed.body["replacement"]["timestamp"], at(10_000));
    assert_eq!(
        renamed.body["replacement"]["properties"],
        winner.body["replacement"]["properties"]
    );
    assert_eq!(renamed.body["replacement"]["matched_meters"], json!([]));
    server.engine.wait_caught_up().await.unwrap();
    let only_e2b = usage_of(&api, &meters, &a, &range).await;
    assert_eq!(value_of(&only_e2b, "count"), "1");
    assert_eq!(value_of(&only_e2b, "min"), "4");
    let listed = api.get(&format!("/v1/events?customer_id={a}")).await.body;
    let mut ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut expected = [assigned, "e2b"];
    expected.sort();
    assert_eq!(ids, expected, "{listed}");

    // A restart replays the amendments to the same usage.
    let all_now = usage_of(&api, &meters, "", &range).await;
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(usage_of(&api, &meters, &a, &range).await, only_e2b);
    assert_eq!(usage_of(&api, &meters, "", &range).await, all_now);
    server.stop().await;
    drop(guard);
}
