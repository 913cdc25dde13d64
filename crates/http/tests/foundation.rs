//! Cross-cutting HTTP behaviour over real sockets: auth per environment, the error
//! body everywhere, request ids, idempotency replay (also across a restart), body
//! limit, rate limiting, admin API, health endpoints.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_work_only_on_their_own_listener() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;

    let ok = Api::new(&server.test_url, &keys.test)
        .get("/v1/meters")
        .await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.body["object"], "list");
    assert!(
        ok.headers.contains_key("x-request-id"),
        "request id on success too"
    );

    let missing = Api::new(&server.test_url, "").get("/v1/meters").await;
    assert_eq!(
        assert_error(&missing, 401, "authentication_error")["code"],
        "api_key_missing"
    );
    let unknown = Api::new(&server.test_url, "tally_test_nope")
        .get("/v1/meters")
        .await;
    assert_eq!(
        assert_error(&unknown, 401, "authentication_error")["code"],
        "api_key_invalid"
    );
    let crossed = Api::new(&server.test_url, &keys.prod)
        .get("/v1/meters")
        .await;
    let error = assert_error(&crossed, 401, "authentication_error");
    assert!(
        error["message"].as_str().unwrap().contains("production"),
        "{error}"
    );
    let crossed = Api::new(&server.prod_url, &keys.test)
        .get("/v1/meters")
        .await;
    assert!(
        assert_error(&crossed, 401, "authentication_error")["message"]
            .as_str()
            .unwrap()
            .contains("test")
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environments_never_share_data() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let test = Api::new(&server.test_url, &keys.test);
    let prod = Api::new(&server.prod_url, &keys.prod);
    let created = test
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "external_id": "u1"}),
        )
        .await;
    assert_eq!(created.status, 200);
    assert_eq!(created.body["mode"], "test");
    let id = created.body["id"].as_str().unwrap();
    assert_eq!(prod.get(&format!("/v1/customers/{id}")).await.status, 404);
    // The same external id is free in the other environment.
    let in_prod = prod
        .post(
            "/v1/customers",
            json!({"email": "a@b.co", "external_id": "u1"}),
        )
        .await;
    assert_eq!(in_prod.status, 200);
    assert_eq!(in_prod.body["mode"], "prod");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_has_the_error_body() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let http = reqwest::Client::new();

    let unknown_route = api.get("/v1/nothing-here").await;
    assert_eq!(
        assert_error(&unknown_route, 404, "invalid_request_error")["code"],
        "route_not_found"
    );
    let wrong_method = Api::finish_raw(
        http.delete(format!("{}/v1/meters", server.test_url))
            .header("x-api-key", &keys.test),
    )
    .await;
    assert_error(&wrong_method, 405, "invalid_request_error");

    // A create-customer request of this raw body with these headers (and the key).
    let raw_create = |headers: &[(&str, &str)], body: Vec<u8>| {
        let mut request = http
            .post(format!("{}/v1/customers", server.test_url))
            .header("x-api-key", &keys.test);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        Api::finish_raw(request.body(body))
    };
    let json_type = ("content-type", "application/json");
    let code_of = |answer: &Answer| assert_error(answer, 400, "invalid_request_error");

    let malformed = raw_create(&[json_type], b"{not json".to_vec()).await;
    assert_eq!(code_of(&malformed)["code"], "invalid_json");

    let customer = b"{\"email\": \"a@b.co\"}".to_vec();
    let wrong_type = raw_create(&[("content-type", "text/plain")], customer).await;
    assert_eq!(code_of(&wrong_type)["code"], "invalid_content_type");

    // A compressed body is named as such, not refused as "not valid JSON".
    let gzip_header = vec![0x1f, 0x8b, 0x08, 0, 0, 0, 0, 0, 4, 0xff];
    let compressed = raw_create(
        &[json_type, ("content-encoding", "gzip")],
        gzip_header.clone(),
    )
    .await;
    assert_eq!(code_of(&compressed)["code"], "invalid_content_encoding");
    // Every header and every coding of a list counts, not the first alone.
    for headers in [
        &[
            json_type,
            ("content-encoding", "identity"),
            ("content-encoding", "gzip"),
        ][..],
        &[json_type, ("content-encoding", "identity, gzip")][..],
        &[json_type, ("content-encoding", ",br")][..],
    ] {
        let answer = raw_create(headers, gzip_header.clone()).await;
        assert_eq!(
            code_of(&answer)["code"],
            "invalid_content_encoding",
            "{headers:?}"
        );
    }
    // `identity` is no compression: the body is read (and its bad field named).
    let bad_email = b"{\"email\": 42}".to_vec();
    let identity = raw_create(
        &[json_type, ("content-encoding", "Identity ")],
        bad_email.clone(),
    )
    .await;
    assert_eq!(code_of(&identity)["param"], "email");
    let identities = [
        json_type,
        ("content-encoding", "identity,"),
        ("content-encoding", "identity"),
    ];
    let identity = raw_create(&identities, bad_email).await;
    assert_eq!(code_of(&identity)["param"], "email");

    let not_object = api.post("/v1/customers", json!([1, 2])).await;
    assert_error(&not_object, 400, "invalid_request_error");

    let wrong_field_type = api.post("/v1/customers", json!({"email": 42})).await;
    assert_eq!(
        assert_error(&wrong_field_type, 400, "invalid_request_error")["param"],
        "email"
    );

    let huge = "x".repeat(1024 * 1024 + 10);
    let too_large = Api::finish_raw(
        http.post(format!("{}/v1/customers", server.test_url))
            .header("x-api-key", &keys.test)
            .header("content-type", "application/json")
            .body(format!("{{\"email\": \"{huge}\"}}")),
    )
    .await;
    assert_eq!(
        assert_error(&too_large, 413, "invalid_request_error")["code"],
        "body_too_large"
    );
    // A refused body ends the connection (the server reads only so much of one),
    // and the answer says so: a client that pooled it would send its next request
    // into a closing socket.
    assert_eq!(too_large.headers["connection"], "close");

    // A streamed body (no Content-Length) past the limit is refused the same way:
    // the server reads the rest of it (throwing it away) and answers 413 with the
    // error body, so the client, still sending, reads the answer.
    let chunks: Vec<Result<String, std::io::Error>> =
        (0..17).map(|_| Ok("y".repeat(64 * 1024))).collect();
    let streamed = http
        .post(format!("{}/v1/customers", server.test_url))
        .header("x-api-key", &keys.test)
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .expect("the client reads the refusal of a streamed body");
    let answer = Answer {
        status: streamed.status().as_u16(),
        headers: streamed.headers().clone(),
        body: streamed.json().await.unwrap_or_default(),
    };
    assert_eq!(
        assert_error(&answer, 413, "invalid_request_error")["code"],
        "body_too_large"
    );
    assert_eq!(answer.headers["connection"], "close");
    assert_eq!(
        api.get("/v1/customers").await.body["data"],
        json!([]),
        "nothing was created"
    );

    let missing = api.get("/v1/customers/cus_unknown").await;
    assert_eq!(
        assert_error(&missing, 404, "invalid_request_error")["code"],
        "resource_missing"
    );

    // The server names every request itself: a client's x-request-id is replaced.
    let mine = Api::finish_raw(
        http.get(format!("{}/v1/customers/cus_unknown", server.test_url))
            .header("x-api-key", &keys.test)
            .header("x-request-id", "req_chosen_by_the_client"),
    )
    .await;
    let id = assert_error(&mine, 404, "invalid_request_error")["request_id"].clone();
    assert_ne!(id, "req_chosen_by_the_client");
    assert!(id.as_str().unwrap().starts_with("req_"));

    // Answers are gzip-compressed for clients that accept it.
    let raw = http
        .get(format!("{}/v1/openapi.json", server.test_url))
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.headers()["content-encoding"], "gzip");
    // At gzip's fastest level (`COMPRESSION_LEVEL`): the gzip header's XFL byte
    // (RFC 1952, 2.3.1) is 4 for "fastest", 0 for the default level.
    let gz = raw.bytes().await.unwrap();
    assert_eq!(gz[..3], [0x1f, 0x8b, 0x08], "not a deflate gzip stream");
    assert_eq!(
        gz[8], 4,
        "XFL {}: not compressed at the fastest level",
        gz[8]
    );
    // Small answers are not: compressing them would cost more than it saves
    // (`MIN_COMPRESSED_BODY_BYTES`).
    let small = http
        .get(format!("{}/v1/customers/cus_unknown", server.test_url))
        .header("x-api-key", &keys.test)
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert!(
        small.headers().get("content-encoding").is_none(),
        "a small answer was compressed: {:?}",
        small.headers()
    );
    let body = small.bytes().await.unwrap();
    assert!(body.len() < usize::from(tally_http::MIN_COMPRESSED_BODY_BYTES));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()["error"]["code"],
        "resource_missing"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_replays_and_survives_restart() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let body = json!({"email": "idem@b.co"});
    let first = api
        .post_idempotent("/v1/customers", "key-1", body.clone())
        .await;
    assert_eq!(first.status, 200);
    let again = api
        .post_idempotent("/v1/customers", "key-1", body.clone())
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.body, first.body,
        "the first response, not a second customer"
    );
    assert_eq!(again.headers["idempotent-replayed"], "true");
    let reused = api
        .post_idempotent("/v1/customers", "key-1", json!({"email": "other@b.co"}))
        .await;
    assert_eq!(
        assert_error(&reused, 409, "invalid_request_error")["code"],
        "idempotency_key_reused"
    );
    // Errors are replayed too, byte for byte.
    let bad = api
        .post_idempotent("/v1/customers", "key-2", json!({"email": "nope"}))
        .await;
    assert_eq!(bad.status, 400);
    let bad_again = api
        .post_idempotent("/v1/customers", "key-2", json!({"email": "nope"}))
        .await;
    assert_eq!(bad_again.body, bad.body);

    let clock = server.clock.clone();
    server.stop().await;
    let server = Server::start_with_clock(&dir, default_config(), clock.clone()).await;
    let api = Api::new(&server.test_url, &keys.test);
    let after_restart = api
        .post_idempotent("/v1/customers", "key-1", body.clone())
        .await;
    assert_eq!(after_restart.body, first.body, "kept across a restart");
    let list = api.get("/v1/customers?limit=100").await;
    assert_eq!(
        list.body["data"].as_array().unwrap().len(),
        1,
        "exactly one customer was created"
    );

    // After 24 hours the key is forgotten and the request runs again.
    clock.advance_ms(24 * 60 * 60 * 1000 + 1);
    let expired = api.post_idempotent("/v1/customers", "key-1", body).await;
    assert_eq!(expired.status, 200);
    assert_ne!(expired.body["id"], first.body["id"]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_answers_429_with_headers() {
    let (_guard, dir) = temp_dir();
    let config = tally_http::HttpConfig {
        rate_limit_per_second: 1,
        rate_limit_burst: 3,
        ..default_config()
    };
    let server = Server::start(&dir, config).await;
    let keys = create_store(&server, "acme").await;
    let api = Api::new(&server.test_url, &keys.test);
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..5 {
        let answer = api.get("/v1/meters").await;
        statuses.push(answer.status);
        let header =
            |name: &str| -> u64 { answer.headers[name].to_str().unwrap().parse().unwrap() };
        // The limit is the bucket's size: what remains never exceeds it.
        assert_eq!(header("x-ratelimit-limit"), 3);
        assert!(header("x-ratelimit-remaining") <= header("x-ratelimit-limit"));
        last = Some(answer);
    }
    assert_eq!(&statuses[..3], &[200, 200, 200], "the burst is allowed");
    assert_eq!(statuses[4], 429);
    let limited = last.unwrap();
    assert_eq!(
        assert_error(&limited, 429, "rate_limit_error")["code"],
        "rate_limited"
    );
    for header in [
        "retry-after",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ] {
        assert!(limited.headers.contains_key(header), "{header}");
    }
    assert!(
        limited.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    assert_eq!(limited.headers["x-ratelimit-remaining"], "0");
    // Another key has its own bucket.
    let other = create_store(&server, "other").await;
    assert_eq!(
        Api::new(&server.test_url, &other.test)
            .get("/v1/meters")
            .await
            .status,
        200
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_needs_the_token_and_health_endpoints_answer() {
    let (_guard, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let http = reqwest::Client::new();
    let wrong = Api::finish_raw(
        http.post(format!("{}/admin/v1/stores", server.prod_url))
            .bearer_auth("wrong")
            .json(&json!({"name": "x"})),
    )
    .await;
    assert_error(&wrong, 401, "authentication_error");
    let on_test_listener = Api::finish_raw(
        http.post(format!("{}/admin/v1/stores", server.test_url))
            .bearer_auth("admin-secret")
            .json(&json!({"name": "x"})),
    )
    .await;
    assert_eq!(
        on_test_listener.status, 404,
        "admin API lives on the production listener"
    );
    let health = http
        .get(format!("{}/healthz", server.prod_url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let ready = http
        .get(format!("{}/readyz", server.test_url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let keys = create_store(&server, "metrics").await;
    Api::new(&server.test_url, &keys.test)
        .get("/v1/meters")
        .await;
    let metrics = http
        .get(format!("{}/metrics", server.prod_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Counters are process-wide (other tests of this binary count too).
    let count = |prefix: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {metrics}"))
    };
    assert!(
        count("tally_http_requests_total{method=\"GET\",route=\"/v1/meters\",status=\"200\"}")
            >= 1.0
    );
    assert!(count("tally_log_append_duration_seconds_count{log=\"embedded\"}") >= 1.0);
    assert_eq!(count("tally_projector_lag_bytes{partition=\"0\"}"), 0.0);
    assert!(count("tally_checkpoint_age_seconds") >= 0.0);
    assert!(count("tally_dedup_index_entries") >= 0.0);
    assert_eq!(count("tally_webhook_queue_depth"), 0.0);
    assert!(metrics.contains("# TYPE tally_http_request_duration_seconds histogram"));
    server.stop().await;

    let (_guard2, dir2) = temp_dir();
    let no_admin = Server::start(
        &dir2,
        tally_http::HttpConfig {
            admin_token: None,
            ..default_config()
        },
    )
    .await;
    let absent = Api::finish_raw(
        http.post(format!("{}/admin/v1/stores", no_admin.prod_url))
            .bearer_auth("admin-secret")
            .json(&json!({"name": "x"})),
    )
    .await;
    assert_eq!(
        assert_error(&absent, 404, "invalid_request_error")["code"],
        "route_not_found"
    );
    no_admin.stop().await;
}
