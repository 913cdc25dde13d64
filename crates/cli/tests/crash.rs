//! The crash test: `tally serve` is killed with SIGKILL while 16 clients ingest; a
//! torn half-record is left at the end of the log, as a crash mid-write would. After
//! a restart every acknowledged event is present exactly once, and the server starts
//! cleanly on the torn tail.

mod common;

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_events_survive_sigkill_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let key = served.test_key.clone().expect("first start prints keys");
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let (status, customer) = post(
        &http,
        &format!("{base}/v1/customers"),
        &key,
        json!({"email": "c@x.io", "external_id": "crash"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let customer_id = customer["id"].as_str().unwrap().to_string();
    let (status, meter) = post(
        &http,
        &format!("{base}/v1/meters"),
        &key,
        json!({"name": "all", "event_name": "tick", "aggregation": "count"}),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let meter_id = meter["id"].as_str().unwrap().to_string();

    let acknowledged: Arc<Mutex<Vec<String>>> = Arc::default();
    let attempted: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut clients = Vec::new();
    for client in 0..16 {
        let (http, base, key, customer_id) =
            (http.clone(), base.clone(), key.clone(), customer_id.clone());
        let (acknowledged, attempted) = (acknowledged.clone(), attempted.clone());
        clients.push(tokio::spawn(async move {
            for batch in 0..10_000 {
                let ids: Vec<String> = (0..10)
                    .map(|i| format!("c{client}-b{batch}-e{i}"))
                    .collect();
                attempted.lock().unwrap().extend(ids.iter().cloned());
                let events: Vec<_> = ids
                    .iter()
                    .map(|id| json!({"name": "tick", "customer_id": customer_id, "event_id": id}))
                    .collect();
                match post(
                    &http,
                    &format!("{base}/v1/events/ingest"),
                    &key,
                    json!({"events": events}),
                )
                .await
                {
                    Ok((202, _)) => acknowledged.lock().unwrap().extend(ids),
                    _ => break, // the server died
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    served.kill();
    for client in clients {
        client.await.unwrap();
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    let attempted = attempted.lock().unwrap().clone();
    assert!(
        acknowledged.len() >= 100,
        "load ran before the kill ({} acknowledged)",
        acknowledged.len()
    );

    // A crash mid-write leaves half a frame at the end of the active segment.
    let log_dir = dir.path().join("log");
    let mut segments: Vec<_> = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segments.sort();
    let mut tail = std::fs::OpenOptions::new()
        .append(true)
        .open(segments.last().unwrap())
        .unwrap();
    tail.write_all(&[200, 0, 0, 0, 9, 9, 9, 9, 1, 2, 3])
        .unwrap();
    drop(tail);

    let served = serve(dir.path());
    assert!(served.test_key.is_none(), "no new default store on restart");
    let base = served.test_url.clone();
    let (ready, _) = get(&http, &format!("{base}/readyz"), &key).await;
    assert_eq!(ready, 200);

    // Every acknowledged event is stored...
    for id in acknowledged.iter().step_by(7) {
        let (status, event) = get(&http, &format!("{base}/v1/events/{id}"), &key).await;
        assert_eq!(status, 200, "acknowledged event {id} lost");
        assert_eq!(event["event_id"], id.as_str());
    }
    // ...exactly once: re-sending all of them yields only duplicates, and the usage
    // count equals the number of distinct events stored.
    for chunk in acknowledged.chunks(100) {
        let events: Vec<_> = chunk
            .iter()
            .map(|id| json!({"name": "tick", "customer_id": customer_id, "event_id": id}))
            .collect();
        let (status, answer) = post(
            &http,
            &format!("{base}/v1/events/ingest"),
            &key,
            json!({"events": events}),
        )
        .await
        .unwrap();
        assert_eq!(status, 202);
        assert_eq!(
            answer["accepted"], 0,
            "an acknowledged event was missing: {answer}"
        );
    }
    let (_, usage) = get(&http, &format!("{base}/v1/meters/{meter_id}/usage"), &key).await;
    let counted: usize = usage["value"].as_str().unwrap().parse().unwrap();
    assert!(
        counted >= acknowledged.len(),
        "counted {counted} < acknowledged {}",
        acknowledged.len()
    );
    assert!(
        counted <= attempted.len(),
        "counted {counted} > attempted {}",
        attempted.len()
    );
    let exit = served.terminate();
    assert!(exit.success());
}
