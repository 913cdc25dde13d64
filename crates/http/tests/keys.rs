//! API keys with permissions and their revocation, over real sockets and across a
//! restart: a restricted key gets 403 `permission_error` naming what it lacks, a
//! revoked key 401 at once.

mod common;

use common::*;
use serde_json::{json, Value};

async fn admin(server: &Server, method: reqwest::Method, path: &str, body: Value) -> Answer {
    Api::finish_raw(
        reqwest::Client::new()
            .request(method, format!("{}{path}", server.prod_url))
            .bearer_auth("admin-secret")
            .json(&body),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_keys_are_held_to_their_permissions_and_revoked_keys_refused() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let store = admin(
        &server,
        reqwest::Method::POST,
        "/admin/v1/stores",
        json!({"name": "k"}),
    )
    .await;
    assert_eq!(store.status, 200, "{}", store.body);
    let store_id = store.body["id"].as_str().unwrap().to_string();
    let test_key = store.body["api_keys"]["test"].as_str().unwrap().to_string();
    let test_key_id = store.body["api_key_ids"]["test"]
        .as_str()
        .unwrap()
        .to_string();
    let keys_path = format!("/admin/v1/stores/{store_id}/keys");

    let bad = admin(
        &server,
        reqwest::Method::POST,
        &keys_path,
        json!({"mode": "test", "permissions": ["meters:delete"]}),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.body["error"]["param"], "permissions[0]");
    let nowhere = admin(
        &server,
        reqwest::Method::POST,
        "/admin/v1/stores/st_nope/keys",
        json!({"mode": "test", "permissions": ["all"]}),
    )
    .await;
    assert_eq!(nowhere.status, 404);
    let unauthorized = Api::finish_raw(
        reqwest::Client::new()
            .post(format!("{}{keys_path}", server.prod_url))
            .json(&json!({"mode": "test", "permissions": ["all"]})),
    )
    .await;
    assert_eq!(unauthorized.status, 401);

    let created = admin(
        &server,
        reqwest::Method::POST,
        &keys_path,
        json!({"mode": "test", "permissions": ["meters:write", "events:read"]}),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(
        created.body["permissions"],
        json!(["events:read", "meters:write"])
    );
    let restricted = Api::new(&server.test_url, created.body["key"].as_str().unwrap());
    let key_id = created.body["id"].as_str().unwrap().to_string();

    // Write includes read; anything else is 403 naming the permission.
    assert_eq!(restricted.get("/v1/meters").await.status, 200);
    let meter = restricted
        .post(
            "/v1/meters",
            json!({"name": "calls", "event_name": "call", "aggregation": "count"}),
        )
        .await;
    assert_eq!(meter.status, 200, "{}", meter.body);
    let denied = assert_error(
        &restricted.get("/v1/customers").await,
        403,
        "permission_error",
    );
    assert_eq!(denied["code"], "permission_denied");
    assert!(denied["message"]
        .as_str()
        .unwrap()
        .contains("customers:read"));
    let ingest = assert_error(
        &restricted
            .post(
                "/v1/events/ingest",
                json!({"events": [{"name": "call", "customer_id": "cus_x"}]}),
            )
            .await,
        403,
        "permission_error",
    );
    assert!(ingest["message"].as_str().unwrap().contains("events:write"));
    // However a header spaces the key, what is per key (its permissions here) names
    // the key that authenticated: a padded restricted key is no less restricted.
    // HTTP/1 parsers trim a header's spaces; HTTP/2, which the listeners also
    // speak, keeps them (a key with a trailing space had every permission there).
    let spaced = format!("{} ", restricted.key);
    assert_eq!(
        h2_post(
            &server.test_url,
            "/v1/customers",
            &spaced,
            r#"{"email": "a@b.io"}"#
        )
        .await,
        403
    );
    assert_eq!(
        h2_post(
            &server.test_url,
            "/v1/meters",
            &spaced,
            r#"{"name": "calls2", "event_name": "call", "aggregation": "count"}"#
        )
        .await,
        200
    );
    // And for the admin token.
    let (status, body) = h2_post_with(
        &server.prod_url,
        "/admin/v1/stores",
        "",
        &[("authorization", "Bearer admin-secret ")],
        r#"{"name": "over h2"}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // The same goes for an idempotency key: spaced or not, one request.
    let customer = r#"{"email": "h2@b.io"}"#;
    let (first, created) = h2_post_with(
        &server.test_url,
        "/v1/customers",
        &test_key,
        &[("idempotency-key", "once")],
        customer,
    )
    .await;
    let (again, replayed) = h2_post_with(
        &server.test_url,
        "/v1/customers",
        &test_key,
        &[("idempotency-key", "once ")],
        customer,
    )
    .await;
    assert_eq!((first, again), (200, 200), "{created} {replayed}");
    assert_eq!(created["id"], replayed["id"], "one customer for one key");
    let padded = format!(" {}\t", restricted.key);
    let authenticated = server
        .engine
        .directory()
        .authenticate(Some(&padded), tally_domain::Mode::Test)
        .expect("a padded key authenticates");
    assert_eq!(
        server
            .engine
            .directory()
            .permissions_of(&authenticated.digest),
        Some(vec!["events:read".to_string(), "meters:write".to_string()])
    );

    // Survives a restart; then revoked: 401 at once, revoking again is 409.
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    let restricted = Api::new(&server.test_url, &restricted.key);
    assert_eq!(restricted.get("/v1/meters").await.status, 200);
    assert_eq!(restricted.get("/v1/customers").await.status, 403);
    let revoked = admin(
        &server,
        reqwest::Method::DELETE,
        &format!("{keys_path}/{key_id}"),
        json!({}),
    )
    .await;
    assert_eq!(revoked.status, 200, "{}", revoked.body);
    assert_error(
        &restricted.get("/v1/meters").await,
        401,
        "authentication_error",
    );
    let twice = admin(
        &server,
        reqwest::Method::DELETE,
        &format!("{keys_path}/{key_id}"),
        json!({}),
    )
    .await;
    assert_eq!(twice.status, 409, "{}", twice.body);
    assert_eq!(twice.body["error"]["code"], "api_key_revoked");

    // A store's own key can be revoked by its id too.
    let full = Api::new(&server.test_url, &test_key);
    assert_eq!(full.get("/v1/customers").await.status, 200);
    let gone = admin(
        &server,
        reqwest::Method::DELETE,
        &format!("{keys_path}/{test_key_id}"),
        json!({}),
    )
    .await;
    assert_eq!(gone.status, 200, "{}", gone.body);
    assert_eq!(full.get("/v1/customers").await.status, 401);
    server.stop().await;
    let server = Server::start(&dir, default_config()).await;
    assert_eq!(
        Api::new(&server.test_url, &test_key)
            .get("/v1/customers")
            .await
            .status,
        401
    );
    server.stop().await;
}

/// POSTs `body` over HTTP/2 with prior knowledge (no upgrade), as a client of the
/// listeners may, and answers the status.
async fn h2_post(base: &str, path: &str, key: &str, body: &str) -> u16 {
    h2_post_with(base, path, key, &[], body).await.0
}

/// `h2_post` with more headers; answers the status and the body.
async fn h2_post_with(
    base: &str,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Value) {
    let authority = base.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let mut request = hyper::Request::post(format!("{base}{path}"))
        .header("x-api-key", key)
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(http_body_util::Full::new(hyper::body::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let answer = sender.send_request(request).await.unwrap();
    let status = answer.status().as_u16();
    let bytes = http_body_util::BodyExt::collect(answer.into_body())
        .await
        .unwrap()
        .to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn create_idempotent(server: &Server, key: &str, name: &str) -> Answer {
    Api::finish_raw(
        reqwest::Client::new()
            .post(format!("{}/admin/v1/stores", server.prod_url))
            .bearer_auth("admin-secret")
            .header("idempotency-key", key)
            .json(&json!({ "name": name })),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_store_creation_answers_the_same_store_across_retries_and_restarts() {
    let (_g, dir) = temp_dir();
    let server = Server::start(&dir, default_config()).await;
    let first = create_idempotent(&server, "create-acme-1", "acme").await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let retry = create_idempotent(&server, "create-acme-1", "acme").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.body, first.body, "the same store and keys");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    // The keys work; another idempotency key makes another store.
    let test_key = first.body["api_keys"]["test"].as_str().unwrap().to_string();
    let api = Api::new(&server.test_url, &test_key);
    assert_eq!(api.get("/v1/meters").await.status, 200);
    let other = create_idempotent(&server, "create-acme-2", "acme").await;
    assert_ne!(other.body["id"], first.body["id"]);
    // The same key for another name is refused.
    let reused = create_idempotent(&server, "create-acme-1", "globex").await;
    assert_eq!(
        assert_error(&reused, 409, "invalid_request_error")["code"],
        "idempotency_key_reused"
    );
    // A retry never brings back a key revoked since.
    let test_key_id = first.body["api_key_ids"]["test"].as_str().unwrap();
    let revoke = admin(
        &server,
        reqwest::Method::DELETE,
        &format!(
            "/admin/v1/stores/{}/keys/{test_key_id}",
            first.body["id"].as_str().unwrap()
        ),
        json!({}),
    )
    .await;
    assert_eq!(revoke.status, 200, "{}", revoke.body);
    server.stop().await;

    let server = Server::start(&dir, default_config()).await;
    let after_restart = create_idempotent(&server, "create-acme-1", "acme").await;
    assert_eq!(after_restart.body, first.body);
    let api = Api::new(&server.test_url, &test_key);
    assert_eq!(
        assert_error(&api.get("/v1/meters").await, 401, "authentication_error")["code"],
        "api_key_invalid"
    );
    // A blank key is refused, naming the header.
    let blank = create_idempotent(&server, " ", "acme").await;
    assert_eq!(
        assert_error(&blank, 400, "invalid_request_error")["param"],
        "idempotency-key"
    );
    server.stop().await;
}
