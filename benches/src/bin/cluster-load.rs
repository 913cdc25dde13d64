//! Several nodes on one Kafka topic (the README's "Scaling out" benchmark).
//!
//! For each cluster size in `--nodes` (default 1, 2 and 3): a fresh topic, that many
//! `tally serve --log kafka` processes on loopback ports, customers and the ingest
//! benchmarks' 20 meters created through the first node, then batches of 100
//! realistic events sent to the nodes in turn. When every node's usage shows every
//! event, it reports each node's CPU seconds per million events (user + system, from
//! `/proc`), the acknowledged ingest rate and how long the slowest node took to show
//! everything. A node's share of the projection work is what scale-out must divide:
//! with every node a full replica it stays the same whatever the cluster size.
//! Forwarding overhead is reported once nodes forward requests (not yet: any node
//! answers from its own replica).

use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tally_benches::{batch_body, cpu_seconds, meter_definitions, start_server_with};

#[derive(Parser, Debug)]
#[command(about = "Per-node CPU per million ingested events with 1, 2 and 3 nodes on Kafka")]
struct Args {
    /// The tally binary to run.
    #[arg(long, default_value = "target/release/tally")]
    tally_bin: String,
    /// The Kafka-protocol broker (e.g. a local tansu).
    #[arg(long)]
    kafka_brokers: String,
    /// Cluster sizes to measure, in order.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 3])]
    nodes: Vec<usize>,
    /// Events to ingest per cluster size (in batches of 100).
    #[arg(long, default_value_t = 300_000)]
    events: u64,
    /// Concurrent HTTP connections sending batches (spread over the nodes).
    #[arg(long, default_value_t = 16)]
    connections: usize,
    #[arg(long, default_value_t = 1_000)]
    customers: usize,
    /// Partitions of each fresh topic.
    #[arg(long, default_value_t = 3)]
    partitions: u32,
    /// Give up waiting for the nodes to show every event after this many seconds.
    #[arg(long, default_value_t = 600)]
    max_wait_seconds: u64,
}

struct Node {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

struct Outcome {
    cpu_per_million: Vec<f64>,
    ingest_rate: f64,
    all_shown_after: Duration,
}

/// The usage every node shows for the count meters: the number of events applied.
async fn events_shown(
    tally: &tally_client::Client,
    count_meters: &[String],
) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for meter in count_meters {
        let usage = tally
            .meter_usage(meter, &tally_client::UsageQuery::default())
            .await?;
        total += usage
            .value
            .as_deref()
            .unwrap_or("0")
            .parse::<u64>()
            .unwrap_or(0);
    }
    Ok(total)
}

async fn measure(args: &Args, size: usize) -> anyhow::Result<Outcome> {
    let topic = format!(
        "tally-cluster-{size}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    let partitions = args.partitions.to_string();
    let flags = [
        "--log",
        "kafka",
        "--kafka-brokers",
        &args.kafka_brokers,
        "--kafka-topic",
        &topic,
        "--kafka-partitions",
        &partitions,
    ];
    let mut nodes = Vec::new();
    let mut key = String::new();
    for i in 0..size {
        let dir = tempfile::tempdir()?;
        let mut node_flags = flags.to_vec();
        if i > 0 {
            node_flags.extend(["--no-default-store", "--no-webhook-dispatch"]);
        }
        let (child, base, printed_key) = start_server_with(
            &args.tally_bin,
            &dir.path().display().to_string(),
            &node_flags,
        )?;
        if i == 0 {
            key = printed_key;
        }
        anyhow::ensure!(!base.is_empty(), "node {i} printed no address");
        nodes.push(Node {
            child,
            base,
            _dir: dir,
        });
    }
    anyhow::ensure!(!key.is_empty(), "the first node printed no test key");
    let clients: Vec<tally_client::Client> = nodes
        .iter()
        .map(|n| tally_client::Client::new(&n.base, &key))
        .collect();

    let mut count_meters = Vec::new();
    for (i, m) in meter_definitions().into_iter().enumerate() {
        let meter = clients[0]
            .create_meter(&serde_json::from_value::<tally_client::MeterCreate>(m)?)
            .await?;
        // Each event name's first meter counts its events.
        if i % 4 == 0 {
            count_meters.push(meter.id);
        }
    }
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let (tally, customers) = (clients[0].clone(), args.customers);
        tasks.push(tokio::spawn(async move {
            for i in (worker..customers).step_by(16) {
                tally
                    .create_customer(&tally_client::CustomerCreate {
                        email: format!("c{i}@example.com"),
                        external_id: Some(format!("customer-{i}")),
                        ..Default::default()
                    })
                    .await?;
            }
            Ok::<_, tally_client::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    // Every node must know every customer before events name them.
    let last = format!("customer-{}", args.customers - 1);
    for tally in &clients {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let query = tally_client::UsageQuery {
                external_customer_id: Some(last.clone()),
                ..Default::default()
            };
            if tally.meter_usage(&count_meters[0], &query).await.is_ok() {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "a node never saw the customers");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let cpu_before: Vec<f64> = nodes
        .iter()
        .map(|n| cpu_seconds(n.child.id()))
        .collect::<Result<_, _>>()?;
    let http = reqwest::Client::new();
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut senders = Vec::new();
    for connection in 0..args.connections {
        let base = nodes[connection % size].base.clone();
        let (http, key, acked) = (http.clone(), key.clone(), acked.clone());
        let (customers, target) = (args.customers, args.events);
        senders.push(tokio::spawn(async move {
            let mut batch = 0u64;
            while acked.fetch_add(100, Ordering::Relaxed) < target {
                let body = batch_body(&mut rand::rng(), connection, batch, customers);
                batch += 1;
                let response = http
                    .post(format!("{base}/v1/events/ingest"))
                    .header("x-api-key", &key)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                let status = response.status();
                anyhow::ensure!(
                    status.as_u16() == 202,
                    "ingest answered {status}: {}",
                    response.text().await.unwrap_or_default()
                );
            }
            Ok(())
        }));
    }
    for s in senders {
        s.await??;
    }
    let load_seconds = started.elapsed().as_secs_f64();
    let expected = args.events.div_ceil(100) * 100;
    let deadline = Instant::now() + Duration::from_secs(args.max_wait_seconds);
    for (i, tally) in clients.iter().enumerate() {
        loop {
            let shown = events_shown(tally, &count_meters).await?;
            if shown >= expected {
                anyhow::ensure!(shown == expected, "node {i} shows {shown} of {expected}");
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "node {i} shows {shown} of {expected} events after {} s",
                args.max_wait_seconds
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let all_shown_after = started.elapsed();
    let cpu_per_million = nodes
        .iter()
        .zip(&cpu_before)
        .map(
            |(n, before)| Ok((cpu_seconds(n.child.id())? - before) * 1_000_000.0 / expected as f64),
        )
        .collect::<anyhow::Result<_>>()?;
    Ok(Outcome {
        cpu_per_million,
        ingest_rate: expected as f64 / load_seconds,
        all_shown_after,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.customers > 0, "--customers must be at least 1");
    println!(
        "| nodes | CPU s per 1M events, each node | mean per node | ingest events/s | all nodes show every event after |"
    );
    println!("|---:|---|---:|---:|---:|");
    for &size in &args.nodes {
        anyhow::ensure!(size > 0, "a cluster has at least one node");
        eprintln!("measuring {size} node(s), {} events...", args.events);
        let outcome = measure(&args, size).await?;
        let each: Vec<String> = outcome
            .cpu_per_million
            .iter()
            .map(|c| format!("{c:.1}"))
            .collect();
        let mean = outcome.cpu_per_million.iter().sum::<f64>() / size as f64;
        println!(
            "| {size} | {} | {mean:.1} | {:.0} | {:.1} s |",
            each.join(" / "),
            outcome.ingest_rate,
            outcome.all_shown_after.as_secs_f64()
        );
    }
    println!("forwarding overhead: none measured (no request is forwarded: every node is a full replica)");
    Ok(())
}
