//! Meter revisions over real sockets (docs/api.md, "Meter revisions"): a revised
//! meter's usage equals, in every aggregation and minute, that of a meter created
//! with the new definition and backfilled over the same events; the dry run
//! predicts exactly the changes the revision makes; events ingested and voided
//! afterwards follow the new definition; a restart keeps it all; the errors.

mod common;

use common::*;
use serde_json::{json, Value};
use tally_domain::clock::Clock;
use tally_domain::time::format_iso8601_ms;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revised_meter_is_the_meter_its_definition_would_have_been() {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let a = customer(&api, "a").await;
    let b = customer(&api, "b").await;
    const MINUTE: i64 = 60_000;
    let base = (server.clock.now_ms() / MINUTE + 1) * MINUTE;
    let only_x = json!({"conjunction": "and", "clauses": [{"property": "model", "operator": "eq", "value": "x"}]});
    let mut revised = Vec::new();
    for aggregation in AGGREGATIONS {
        revised.push((
            aggregation,
            calls_meter(&api, aggregation, aggregation, Value::Null).await,
        ));
    }
    server.clock.set_ms(base + 4 * MINUTE);
    let at = |ms: i64| format_iso8601_ms(base + ms);
    let event = |who: &str, id: &str, ms: i64, n: i64, s: &str, model: &str| json!({"name": "calls", "customer_id": who, "event_id": id, "timestamp": at(ms), "properties": {"n": n, "s": s, "model": model}});
    let ingested = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                event(&a, "e1", 10_000, 5, "p", "x"),
                event(&a, "e2", 20_000, 9, "q", "y"),
                event(&b, "e3", 30_000, 7, "p", "y"),
                event(&a, "e4", 70_000, 3, "r", "x"),
                event(&b, "e5", 80_000, 1, "q", "x"),
                event(&b, "e6", 130_000, 4, "q", "y"),
            ]}),
        )
        .await;
    assert_eq!(ingested.status, 202, "{}", ingested.body);
    server.engine.wait_caught_up().await.unwrap();
    let range = format!(
        "start={}&end={}",
        at(0).replace(':', "%3A"),
        at(4 * MINUTE).replace(':', "%3A")
    );

    // Refusals first: none changes a meter.
    let (_, count_meter) = &revised[0];
    let path = format!("/v1/meters/{count_meter}/revisions");
    let no_dry_run = api.post(&path, json!({"filter": only_x})).await;
    assert_eq!(
        assert_error(&no_dry_run, 400, "invalid_request_error")["param"],
        "dry_run"
    );
    let nothing = api.post(&path, json!({"dry_run": true})).await;
    assert_eq!(
        assert_error(&nothing, 400, "invalid_request_error")["param"],
        "filter"
    );
    let count_property = api
        .post(
            &path,
            json!({"aggregation_property": "n", "dry_run": false}),
        )
        .await;
    assert_eq!(
        assert_error(&count_property, 400, "invalid_request_error")["param"],
        "aggregation_property"
    );
    let bad_filter = api
        .post(&path, json!({"filter": {"clauses": "x"}, "dry_run": false}))
        .await;
    assert_eq!(bad_filter.status, 400, "{}", bad_filter.body);
    let unknown = api
        .post(
            "/v1/meters/mtr_nope/revisions",
            json!({"filter": only_x, "dry_run": true}),
        )
        .await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    let update = api
        .post(
            &format!("/v1/meters/{count_meter}"),
            json!({"filter": only_x}),
        )
        .await;
    assert_eq!(
        assert_error(&update, 400, "invalid_request_error")["code"],
        "meter_field_immutable"
    );
    let archived = calls_meter(&api, "archived", "sum", Value::Null).await;
    assert_eq!(
        api.post_without_body(&format!("/v1/meters/{archived}/archive"))
            .await
            .status,
        200
    );
    let inactive = api
        .post(
            &format!("/v1/meters/{archived}/revisions"),
            json!({"filter": only_x, "dry_run": false}),
        )
        .await;
    assert_eq!(
        assert_error(&inactive, 409, "invalid_request_error")["code"],
        "meter_not_active"
    );

    // Each meter revised to count model "x" only: the dry run's changes are the
    // revision's, and the meter is then its twin (created with that filter and
    // backfilled over the same events).
    let before: Vec<Value> = {
        let mut all = Vec::new();
        for (_, id) in &revised {
            all.push(minute_usage(&api, id, &a, &range).await);
        }
        all
    };
    for (aggregation, id) in &revised {
        let path = format!("/v1/meters/{id}/revisions");
        let dry = api
            .post(&path, json!({"filter": only_x, "dry_run": true}))
            .await;
        assert_eq!(dry.status, 200, "{}", dry.body);
        assert_eq!(dry.body["object"], "meter_revision");
        assert_eq!(dry.body["dry_run"], true);
        assert_eq!(dry.body["revision"], 2);
        assert_eq!(
            api.get(&format!("/v1/meters/{id}")).await.body["revision"],
            1
        );
        let applied = api
            .post(&path, json!({"filter": only_x, "dry_run": false}))
            .await;
        assert_eq!(applied.status, 200, "{}", applied.body);
        assert_eq!(applied.body["dry_run"], false);
        assert_eq!(applied.body["meter"]["revision"], 2);
        assert_eq!(applied.body["meter"]["filter"]["clauses"][0]["value"], "x");
        assert_eq!(
            dry.body["changes"], applied.body["changes"],
            "{aggregation}: the dry run predicts the revision"
        );
        if *aggregation == "count" {
            // a: 3 events to 2, b: 3 to 1 (min, for one, changes no total).
            assert_eq!(
                applied.body["changes"].as_array().unwrap().len(),
                2,
                "{}",
                applied.body
            );
        }
    }
    let mut twins = Vec::new();
    for (aggregation, _) in &revised {
        let twin = calls_meter(
            &api,
            &format!("twin {aggregation}"),
            aggregation,
            only_x.clone(),
        )
        .await;
        let backfilled = api
            .post(
                &format!("/v1/meters/{twin}/backfill"),
                json!({"start": at(0)}),
            )
            .await;
        assert_eq!(backfilled.status, 200, "{}", backfilled.body);
        twins.push(twin);
    }
    server.engine.wait_caught_up().await.unwrap();
    let compare = |label: &'static str| {
        let api = &api;
        let revised = &revised;
        let twins = &twins;
        let range = &range;
        let (a, b) = (a.clone(), b.clone());
        async move {
            for ((aggregation, id), twin) in revised.iter().zip(twins) {
                for who in [a.as_str(), b.as_str(), ""] {
                    assert_eq!(
                        minute_usage(api, id, who, range).await,
                        minute_usage(api, twin, who, range).await,
                        "{label}: {aggregation} for {who:?}"
                    );
                }
            }
        }
    };
    compare("revised").await;
    let after: Vec<Value> = {
        let mut all = Vec::new();
        for (_, id) in &revised {
            all.push(minute_usage(&api, id, &a, &range).await);
        }
        all
    };
    assert_ne!(before, after);

    // New events follow the new definition; so do voids.
    let more = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                event(&a, "e7", 140_000, 8, "s", "x"),
                event(&a, "e8", 150_000, 20, "t", "y"),
            ]}),
        )
        .await;
    assert_eq!(more.status, 202, "{}", more.body);
    let voided = api
        .post(
            "/v1/events/void",
            json!({"event_ids": ["e1", "e2"], "reason": "test"}),
        )
        .await;
    assert_eq!(voided.status, 200, "{}", voided.body);
    server.engine.wait_caught_up().await.unwrap();
    compare("after ingest and void").await;

    // A second revision of the sum meter changes its property; a restart keeps it.
    let (_, sum) = &revised[1];
    let second = api
        .post(
            &format!("/v1/meters/{sum}/revisions"),
            json!({"aggregation_property": "missing", "dry_run": false}),
        )
        .await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.body["meter"]["revision"], 3);
    assert_eq!(
        second.body["meter"]["filter"]["clauses"][0]["value"], "x",
        "kept"
    );
    assert_eq!(minute_usage(&api, sum, "", &range).await["value"], "0");
    let all_now: Vec<Value> = {
        let mut all = Vec::new();
        for (_, id) in &revised {
            all.push(minute_usage(&api, id, "", &range).await);
        }
        all
    };
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    for ((_, id), expected) in revised.iter().zip(&all_now) {
        assert_eq!(minute_usage(&api, id, "", &range).await, *expected);
    }
    assert_eq!(
        api.get(&format!("/v1/meters/{sum}")).await.body["revision"],
        3
    );
    server.stop().await;
    drop(guard);
}

/// A `time_weighted_sum` revision re-derives the last 35 days and keeps what a
/// customer held when they begin: the dry run counts that held value as the
/// revision does, and the revised meter is its twin over the days re-derived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_weighted_revision_keeps_the_value_held_before_its_history() {
    let (guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let a = customer(&api, "a").await;
    const MINUTE: i64 = 60_000;
    const HOUR: i64 = 60 * MINUTE;
    const DAY: i64 = 24 * HOUR;
    let only_x = json!({"conjunction": "and", "clauses": [{"property": "model", "operator": "eq", "value": "x"}]});
    let meter = calls_meter(&api, "seats", "time_weighted_sum", Value::Null).await;
    let base = (server.clock.now_ms() / MINUTE + 1) * MINUTE;
    let event = |id: &str, at: i64, n: i64, model: &str| json!({"name": "calls", "customer_id": a, "event_id": id, "timestamp": format_iso8601_ms(at), "properties": {"n": n, "model": model}});
    server.clock.set_ms(base + MINUTE);
    let old = api
        .post(
            "/v1/events/ingest",
            json!({"events": [event("old", base, 4, "x")]}),
        )
        .await;
    assert_eq!(old.status, 202, "{}", old.body);
    server.engine.wait_caught_up().await.unwrap();
    // 36 days on: `old` is before the history a revision re-derives.
    let now = base + 36 * DAY;
    server.clock.set_ms(now);
    let recent = api
        .post(
            "/v1/events/ingest",
            json!({"events": [
                event("y1", now - HOUR, 10, "y"),
                event("x1", now - 30 * MINUTE, 6, "x"),
            ]}),
        )
        .await;
    assert_eq!(recent.status, 202, "{}", recent.body);
    server.engine.wait_caught_up().await.unwrap();
    let value = |api: &Api| {
        let path = format!(
            "/v1/meters/{meter}/usage?customer_id={a}&start={}&end={}",
            format_iso8601_ms(now - 2 * HOUR).replace(':', "%3A"),
            format_iso8601_ms(now).replace(':', "%3A")
        );
        let api = api.clone();
        async move { api.get(&path).await.body["value"].clone() }
    };
    // 4 for an hour, 10 for half an hour, 6 for half an hour.
    assert_eq!(value(&api).await, "12");
    let path = format!("/v1/meters/{meter}/revisions");
    let dry = api
        .post(&path, json!({"filter": only_x, "dry_run": true}))
        .await;
    assert_eq!(dry.status, 200, "{}", dry.body);
    let applied = api
        .post(&path, json!({"filter": only_x, "dry_run": false}))
        .await;
    assert_eq!(applied.status, 200, "{}", applied.body);
    assert_eq!(dry.body["changes"], applied.body["changes"]);
    let changes = applied.body["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{}", applied.body);
    assert_eq!(changes[0]["customer_id"], a.as_str());
    // `y1` no longer counts: 4 held for an hour and a half, until `x1`.
    assert_eq!(value(&api).await, "9");
    // A restart keeps it.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    server.clock.set_ms(now);
    let api = Api::new(&server.test_url, &keys.test);
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(value(&api).await, "9");
    server.stop().await;
    drop(guard);
}
