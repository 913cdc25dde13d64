//! Webhook delivery benchmark (docs/benchmarks.md, "Webhook deliveries per endpoint"):
//! starts `tally serve`, a local receiver answering 200 (after `--latency-ms`), and
//! `--endpoints` endpoints (one by default), each on a path of its own and
//! subscribed to `credits.granted`; makes `--events` credits over `--connections`
//! connections, each one event; and times until every endpoint has every event.
//! Prints (a) credits/s (the rate events are made), (b) deliveries/s from the first
//! credit to the last delivery, (c) b / (a x endpoints) (at 1 or near it delivery
//! keeps up with the events), (d) a delivery's lag after its credit was answered,
//! p50/p99, and (e) the most requests the receiver held at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;
use tally_benches::{percentile, start_server};

/// Credits made on one account: under its limit of active grants (every credit is one).
const CREDITS_PER_ACCOUNT: usize = 500;

#[derive(Parser, Debug)]
#[command(
    about = "Webhook deliveries per second to one endpoint or several, against the rate events are made"
)]
struct Args {
    #[arg(long, default_value = "target/release/tally")]
    tally_bin: String,
    /// Endpoints subscribed, each receiving every event.
    #[arg(long, default_value_t = 1)]
    endpoints: usize,
    /// Credits made, one `credits.granted` event each.
    #[arg(long, default_value_t = 5_000)]
    events: usize,
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// How long the receiver takes to answer each delivery.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Gives up waiting for deliveries after this long.
    #[arg(long, default_value_t = 120)]
    max_seconds: u64,
}

/// What the receiver saw: when each transaction's event first arrived.
#[derive(Default)]
struct Seen {
    /// By (endpoint number, transaction id).
    arrived: Mutex<HashMap<(usize, String), Instant>>,
    now: AtomicUsize,
    most: AtomicUsize,
}

/// Serves the receiver on a free port; answers its URL.
async fn receiver(seen: Arc<Seen>, latency: Duration) -> anyhow::Result<String> {
    use axum::body::Bytes;
    use axum::http::StatusCode;
    let app = axum::Router::new().route(
        "/hook/{n}",
        axum::routing::post(
            move |axum::extract::Path(n): axum::extract::Path<usize>, body: Bytes| {
                let seen = seen.clone();
                async move {
                    let at_once = seen.now.fetch_add(1, Ordering::SeqCst) + 1;
                    seen.most.fetch_max(at_once, Ordering::SeqCst);
                    if !latency.is_zero() {
                        tokio::time::sleep(latency).await;
                    }
                    let envelope: serde_json::Value =
                        serde_json::from_slice(&body).unwrap_or_default();
                    if let Some(tx) = envelope["object"]["id"].as_str() {
                        seen.arrived
                            .lock()
                            .expect("receiver lock")
                            .entry((n, tx.to_string()))
                            .or_insert_with(Instant::now);
                    }
                    seen.now.fetch_sub(1, Ordering::SeqCst);
                    StatusCode::OK
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let temp = tempfile::tempdir()?;
    let (child, base, key) = start_server(&args.tally_bin, &temp.path().display().to_string())?;
    let _child = tally_benches::ServerChild(child);
    let seen = Arc::new(Seen::default());
    let url = receiver(seen.clone(), Duration::from_millis(args.latency_ms)).await?;
    let http = reqwest::Client::new();
    let post = |path: &str, body: serde_json::Value| {
        http.post(format!("{base}{path}"))
            .header("x-api-key", &key)
            .json(&body)
            .send()
    };
    for n in 0..args.endpoints {
        let endpoint = post(
            "/v1/webhooks",
            json!({"url": format!("{url}/{n}"), "events": ["credits.granted"]}),
        )
        .await?;
        anyhow::ensure!(
            endpoint.status() == 200,
            "creating an endpoint: {}",
            endpoint.text().await?
        );
    }
    let expected = args.events * args.endpoints;
    let customer: serde_json::Value = post("/v1/customers", json!({"email": "bench@x.io"}))
        .await?
        .json()
        .await?;
    // Every credit is a grant, and an account holds at most 1,000 active ones.
    let mut credit_urls = Vec::new();
    for n in 0..args.events.div_ceil(CREDITS_PER_ACCOUNT) {
        let account: serde_json::Value = post(
            "/v1/customer-credits/accounts",
            json!({"customer_id": customer["id"], "name": format!("acct-{n}")}),
        )
        .await?
        .json()
        .await?;
        anyhow::ensure!(account["id"].is_string(), "creating an account: {account}");
        credit_urls.push(format!(
            "{base}/v1/customer-credits/accounts/{}/credit",
            account["id"].as_str().unwrap_or_default()
        ));
    }
    let credit_urls = Arc::new(credit_urls);

    eprintln!(
        "making {} credits over {} connections...",
        args.events, args.connections
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let (http, urls, key) = (http.clone(), credit_urls.clone(), key.clone());
        let events = args.events;
        tasks.push(tokio::spawn(async move {
            let mut answered = Vec::new();
            for i in (c..events).step_by(args.connections) {
                let response = http
                    .post(&urls[i % urls.len()])
                    .header("x-api-key", &key)
                    .json(&json!({"amount": "1", "idempotency_key": format!("w{i}")}))
                    .send()
                    .await?;
                let status = response.status();
                let tx: serde_json::Value = response.json().await?;
                anyhow::ensure!(status == 200, "a credit answered {status}: {tx}");
                answered.push((
                    tx["id"].as_str().unwrap_or_default().to_string(),
                    Instant::now(),
                ));
            }
            Ok(answered)
        }));
    }
    let mut answered = Vec::new();
    for task in tasks {
        answered.extend(task.await??);
    }
    let made = started.elapsed();
    let deadline = started + Duration::from_secs(args.max_seconds);
    loop {
        let arrived = seen.arrived.lock().expect("receiver lock").len();
        if arrived >= expected || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let arrived = seen.arrived.lock().expect("receiver lock").clone();
    let last = arrived.values().max().copied().unwrap_or(started);
    let mut lags: Vec<Duration> = answered
        .iter()
        .flat_map(|(tx, at)| {
            (0..args.endpoints).filter_map(|n| {
                arrived
                    .get(&(n, tx.clone()))
                    .map(|got| got.saturating_duration_since(*at))
            })
        })
        .collect();
    lags.sort();
    let credits_per_s = args.events as f64 / made.as_secs_f64();
    let delivered_per_s =
        arrived.len() as f64 / last.duration_since(started).as_secs_f64().max(1e-9);
    println!(
        "(a) credits (events made):   {credits_per_s:.0}/s ({} in {made:.2?})",
        args.events
    );
    println!(
        "(b) deliveries:              {delivered_per_s:.0}/s ({} of {} delivered{})",
        arrived.len(),
        expected,
        if arrived.len() < expected {
            ", gave up waiting"
        } else {
            ""
        }
    );
    println!(
        "(c) b / (a x endpoints):     {:.2}",
        delivered_per_s / (credits_per_s * args.endpoints as f64)
    );
    println!(
        "(d) lag after the credit:    p50 {:.2?}, p99 {:.2?}",
        percentile(&lags, 50.0),
        percentile(&lags, 99.0)
    );
    println!(
        "(e) most requests at once:   {}",
        seen.most.load(Ordering::SeqCst)
    );
    Ok(())
}
