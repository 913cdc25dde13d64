//! `tally listen` end to end: a real server, a `cli` endpoint, a real local receiver;
//! the event arrives with its body and headers unchanged, its signature verifies
//! with `tally webhook verify`, the feed empties, and Ctrl-C/SIGTERM stops cleanly.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_forwards_acknowledges_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let (_, endpoint) = post(
        &http,
        &format!("{base}/v1/webhooks"),
        &key,
        json!({"delivery_mode": "cli", "events": ["credits.granted"]}),
    )
    .await
    .unwrap();
    let endpoint_id = endpoint["id"].as_str().unwrap().to_string();
    let secret = endpoint["secret"].as_str().unwrap().to_string();
    let (_, customer) = post(
        &http,
        &format!("{base}/v1/customers"),
        &key,
        json!({"email": "l@x.io"}),
    )
    .await
    .unwrap();
    let (_, account) = post(
        &http,
        &format!("{base}/v1/customer-credits/accounts"),
        &key,
        json!({"customer_id": customer["id"], "initial_balance": "3"}),
    )
    .await
    .unwrap();
    assert_eq!(account["balance"], "3");

    let received: Arc<Mutex<Vec<(HeaderMap, Bytes)>>> = Arc::default();
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/local",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push((headers, body));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = format!("http://{}/local", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let mut listen = tally()
        .args([
            "listen",
            "--forward-to",
            &local,
            "--webhook-id",
            &endpoint_id,
            "--api-key",
            &key,
            "--base-url",
            &base,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = listen.stdout.take().unwrap();
    let (line_tx, line_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = line_tx.send(line);
        }
    });
    let line = line_rx
        .recv_timeout(Duration::from_secs(15))
        .expect("one line per event");
    assert!(
        line.contains("credits.granted") && line.contains(" 200 "),
        "{line}"
    );

    let (headers, body) = received.lock().unwrap()[0].clone();
    let signature = headers["tally-signature"].to_str().unwrap().to_string();
    assert_eq!(headers["tally-event-type"], "credits.granted");
    let body_file = dir.path().join("body.json");
    std::fs::write(&body_file, &body).unwrap();
    let verified = tally()
        .args([
            "webhook",
            "verify",
            "--secret",
            &secret,
            "--header",
            &signature,
            "--body-file",
        ])
        .arg(&body_file)
        .output()
        .unwrap();
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stdout)
    );
    let forged = tally()
        .args([
            "webhook",
            "verify",
            "--secret",
            "whsec_wrong",
            "--header",
            &signature,
            "--body-file",
        ])
        .arg(&body_file)
        .output()
        .unwrap();
    assert_eq!(forged.status.code(), Some(1));

    let (_, feed) = get(
        &http,
        &format!("{base}/v1/webhooks/{endpoint_id}/events/pending"),
        &key,
    )
    .await;
    assert_eq!(
        feed["items"].as_array().unwrap().len(),
        0,
        "acknowledged with 200"
    );

    std::process::Command::new("kill")
        .args(["-TERM", &listen.id().to_string()])
        .status()
        .unwrap();
    let mut stopped = None;
    for _ in 0..100 {
        if let Some(status) = listen.try_wait().unwrap() {
            stopped = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(stopped.expect("listen stops on SIGTERM").success());
    served.terminate();
}
