//! Several nodes on one Kafka topic (the README's "Scaling out" benchmark).
//!
//! For each cluster size in `--nodes` (default 1, 2 and 3): a fresh topic, that many
//! `tally serve --log kafka` processes on loopback ports forming one split cluster
//! (`--cluster`, `--peers`: each node projects only its share of the partitions and
//! forwards the rest), `--stores` stores (a store's records are one partition's,
//! so stores are what spreads the work), each with customers and the ingest
//! benchmarks' 20 meters, then batches of 100 realistic events for the stores in
//! turn, sent to the nodes in turn. When every node answers every store's usage
//! with every event, it reports each node's CPU seconds per million events (user +
//! system, from `/proc`), the acknowledged ingest rate, how long until every node
//! showed everything, and the forwarding overhead: a small read of one store sent
//! to the node that serves it and to one that forwards it, p50 and p99 of each.
//! `--replicas` measures the other deployment, every node a full replica.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tally_benches::{batch_body, cpu_seconds, meter_definitions, percentile, start_server_on};
use tally_log::testsuite::node_port;

/// Reads timed per store and route when measuring the forwarding overhead.
const OVERHEAD_SAMPLES: usize = 300;

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
    /// Stores the events are spread over (a store is one partition's).
    #[arg(long, default_value_t = 12)]
    stores: usize,
    /// Customers per store.
    #[arg(long, default_value_t = 100)]
    customers: usize,
    /// Partitions of each fresh topic.
    #[arg(long, default_value_t = 3)]
    partitions: u32,
    /// Every node a full replica (no `--peers`) instead of a split cluster.
    #[arg(long)]
    replicas: bool,
    /// Send each store's events to the node that serves it (as a client routing by
    /// store would), instead of to every node in turn (which forwards most of them).
    #[arg(long)]
    to_owner: bool,
    /// Give up waiting for the nodes to show every event after this many seconds.
    #[arg(long, default_value_t = 600)]
    max_wait_seconds: u64,
    /// Then SIGKILL the last node and time until the others serve every partition
    /// and answer every store's usage, once with the changelog (the default) and
    /// once with `--no-changelog` (restore from the log alone), each on a fresh
    /// cluster. Needs a split cluster of at least 2 nodes.
    #[arg(long)]
    failover: bool,
}

/// How long the failover measurement waits after the load before the kill: past
/// one checkpoint interval (`CHECKPOINT_EVERY_MS`, 15 s), so the killed node's last
/// checkpoint covers the load, as it would on a node that ran for a while.
const FAILOVER_SETTLE_MS: u64 = 16_000;

const SECRET: &str = "cluster-load-secret-0123456789abcdef";
const ADMIN: &str = "cluster-load-admin-0123456789abcdef";

struct Node {
    child: Child,
    prod: String,
    test: String,
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

struct Store {
    id: String,
    key: String,
    count_meters: Vec<String>,
    /// The test listener of the node serving the store (split cluster).
    owner: Option<String>,
}

/// Times from the SIGKILL of a node: until the others serve every partition again,
/// and until one of them answers every store's usage with every event.
#[derive(Clone)]
struct Failover {
    served_after: Duration,
    answered_after: Duration,
}

struct Outcome {
    failover: Option<Failover>,
    cpu_per_million: Vec<f64>,
    ingest_rate: f64,
    all_shown_after: Duration,
    /// (direct p50, p99), (forwarded p50, p99), when a store had a forwarding node.
    overhead: Option<((Duration, Duration), (Duration, Duration))>,
}

/// A client per store, of one node's test listener.
fn store_clients(node_test: &str, stores: &[Store]) -> Vec<tally_client::Client> {
    stores
        .iter()
        .map(|store| tally_client::Client::new(node_test, &store.key))
        .collect()
}

/// The events one node shows over all stores (`clients` from `store_clients`).
async fn shown_by(clients: &[tally_client::Client], stores: &[Store]) -> anyhow::Result<u64> {
    let mut shown = 0;
    for (tally, store) in clients.iter().zip(stores) {
        shown += events_shown(tally, store).await?;
    }
    Ok(shown)
}

/// The events of a store that a node shows: the sum of its count meters.
async fn events_shown(tally: &tally_client::Client, store: &Store) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for meter in &store.count_meters {
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

/// The partitions each node serves (`/internal/v1/cluster`).
async fn serving(http: &reqwest::Client, node: &Node) -> Vec<u32> {
    let answer = http
        .get(format!("{}/internal/v1/cluster", node.prod))
        .header("x-tally-cluster-secret", SECRET)
        .send()
        .await;
    let Ok(answer) = answer else {
        return Vec::new();
    };
    let status: serde_json::Value = answer.json().await.unwrap_or_default();
    status["serving"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_u64())
                .map(|p| p as u32)
                .collect()
        })
        .unwrap_or_default()
}

async fn timed_reads(
    http: &reqwest::Client,
    base: &str,
    store: &Store,
) -> anyhow::Result<(Duration, Duration)> {
    let mut samples = Vec::with_capacity(OVERHEAD_SAMPLES);
    for _ in 0..OVERHEAD_SAMPLES {
        let started = Instant::now();
        let answer = http
            .get(format!("{base}/v1/meters/{}", store.count_meters[0]))
            .header("x-api-key", &store.key)
            .send()
            .await?;
        anyhow::ensure!(
            answer.status() == 200,
            "a read answered {}",
            answer.status()
        );
        answer.bytes().await?;
        samples.push(started.elapsed());
    }
    samples.sort_unstable();
    Ok((percentile(&samples, 50.0), percentile(&samples, 99.0)))
}

async fn measure(args: &Args, size: usize, changelog: bool) -> anyhow::Result<Outcome> {
    let topic = format!(
        "tally-cluster-{size}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    let partitions = args.partitions.to_string();
    let ports: Vec<(u16, u16)> = (0..size).map(|_| (node_port(), node_port())).collect();
    let peers = ports
        .iter()
        .map(|(prod, _)| format!("http://127.0.0.1:{prod}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut flags = vec![
        "--log",
        "kafka",
        "--kafka-brokers",
        &args.kafka_brokers,
        "--kafka-topic",
        &topic,
        "--kafka-partitions",
        &partitions,
        "--admin-token",
        ADMIN,
        "--no-default-store",
    ];
    if !args.replicas {
        flags.extend([
            "--cluster",
            "bench",
            "--peers",
            &peers,
            "--cluster-secret",
            SECRET,
        ]);
        if !changelog {
            flags.push("--no-changelog");
        }
    } else {
        flags.push("--no-webhook-dispatch");
    }
    let mut nodes = Vec::new();
    for (prod, test) in &ports {
        let dir = tempfile::tempdir()?;
        let (child, base, _) = start_server_on(
            &args.tally_bin,
            &dir.path().display().to_string(),
            &format!("127.0.0.1:{prod}"),
            &format!("127.0.0.1:{test}"),
            &flags,
        )?;
        anyhow::ensure!(!base.is_empty(), "a node printed no address");
        nodes.push(Node {
            child,
            prod: format!("http://127.0.0.1:{prod}"),
            test: base,
            _dir: dir,
        });
    }
    let http = reqwest::Client::new();
    if !args.replicas {
        // Wait until the cluster serves every partition, and every node some (all
        // have joined: no rebalance moves a store while the stores are set up).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut all = std::collections::BTreeSet::new();
            let mut idle = 0;
            for node in &nodes {
                let served = serving(&http, node).await;
                idle += usize::from(served.is_empty());
                all.extend(served);
            }
            if all.len() == args.partitions as usize
                && (idle == 0 || size > args.partitions as usize)
            {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the cluster never served every partition"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let mut stores = Vec::new();
    for s in 0..args.stores {
        let created: serde_json::Value = http
            .post(format!("{}/admin/v1/stores", nodes[s % size].prod))
            .bearer_auth(ADMIN)
            .json(&serde_json::json!({"name": format!("bench store {s}")}))
            .send()
            .await?
            .json()
            .await?;
        let key = created["api_keys"]["test"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no store created: {created}"))?
            .to_string();
        let tally = tally_client::Client::new(&nodes[s % size].test, &key);
        let mut count_meters = Vec::new();
        for (i, m) in meter_definitions().into_iter().enumerate() {
            let meter = tally
                .create_meter(&serde_json::from_value::<tally_client::MeterCreate>(m)?)
                .await?;
            // Each event name's first meter counts its events.
            if i % 4 == 0 {
                count_meters.push(meter.id);
            }
        }
        let creates = (0..args.customers).map(|i| {
            let tally = tally.clone();
            async move {
                tally
                    .create_customer(&tally_client::CustomerCreate {
                        email: format!("c{i}@example.com"),
                        external_id: Some(format!("customer-{i}")),
                        ..Default::default()
                    })
                    .await
            }
        });
        for created in futures::future::join_all(creates).await {
            created?;
        }
        let id = created["id"].as_str().unwrap_or_default().to_string();
        let mut owner = None;
        if !args.replicas {
            let partition = tally_log::partition_of(id.as_bytes(), args.partitions);
            for node in &nodes {
                if owner.is_none() && serving(&http, node).await.contains(&partition) {
                    owner = Some(node.test.clone());
                }
            }
        }
        stores.push(Store {
            id,
            key,
            count_meters,
            owner,
        });
    }
    let stores = Arc::new(stores);

    let cpu_before: Vec<f64> = nodes
        .iter()
        .map(|n| cpu_seconds(n.child.id()))
        .collect::<Result<_, _>>()?;
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut senders = Vec::new();
    for connection in 0..args.connections {
        let base = nodes[connection % size].test.clone();
        let (http, stores, acked) = (http.clone(), stores.clone(), acked.clone());
        let (customers, target, to_owner) = (args.customers, args.events, args.to_owner);
        senders.push(tokio::spawn(async move {
            let mut batch = 0u64;
            while acked.fetch_add(100, Ordering::Relaxed) < target {
                let store = &stores[(connection + batch as usize) % stores.len()];
                let base = match (&store.owner, to_owner) {
                    (Some(owner), true) => owner,
                    _ => &base,
                };
                let body = batch_body(&mut rand::rng(), connection, batch, customers);
                batch += 1;
                let response = http
                    .post(format!("{base}/v1/events/ingest"))
                    .header("x-api-key", &store.key)
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
    for (i, node) in nodes.iter().enumerate() {
        let clients = store_clients(&node.test, &stores);
        loop {
            let shown = shown_by(&clients, &stores).await?;
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

    // Forwarding overhead: the first store, read through the node that serves it
    // and through one that does not.
    let mut overhead = None;
    if !args.replicas && size > 1 {
        let store = &stores[0];
        let partition = tally_log::partition_of(store.id.as_bytes(), args.partitions);
        let mut owner = None;
        let mut other = None;
        for node in &nodes {
            if serving(&http, node).await.contains(&partition) {
                owner = owner.or(Some(node));
            } else {
                other = other.or(Some(node));
            }
        }
        if let (Some(owner), Some(other)) = (owner, other) {
            let direct = timed_reads(&http, &owner.test, store).await?;
            let forwarded = timed_reads(&http, &other.test, store).await?;
            overhead = Some((direct, forwarded));
        }
    }
    let failover = if args.failover {
        Some(fail_over(args, &http, &mut nodes, &stores, expected).await?)
    } else {
        None
    };
    Ok(Outcome {
        failover,
        cpu_per_million,
        ingest_rate: expected as f64 / load_seconds,
        all_shown_after,
        overhead,
    })
}

/// SIGKILLs the last node and times the others taking its partitions over
/// (`Failover`).
async fn fail_over(
    args: &Args,
    http: &reqwest::Client,
    nodes: &mut Vec<Node>,
    stores: &[Store],
    expected: u64,
) -> anyhow::Result<Failover> {
    tokio::time::sleep(Duration::from_millis(FAILOVER_SETTLE_MS)).await;
    let mut killed = nodes.pop().expect("at least two nodes");
    killed.child.kill()?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.max_wait_seconds);
    loop {
        let mut all = std::collections::BTreeSet::new();
        for node in nodes.iter() {
            all.extend(serving(http, node).await);
        }
        if all.len() == args.partitions as usize {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the partitions never moved");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let served_after = started.elapsed();
    let clients = store_clients(&nodes[0].test, stores);
    loop {
        // A node still taking partitions over may fail a read: not yet.
        let shown = shown_by(&clients, stores).await.unwrap_or(0);
        if shown == expected {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "after the failover a node shows {shown} of {expected} events"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Failover {
        served_after,
        answered_after: started.elapsed(),
    })
}

/// One row of the main table.
fn print_row(nodes: &str, outcome: &Outcome) {
    let each: Vec<String> = outcome
        .cpu_per_million
        .iter()
        .map(|c| format!("{c:.1}"))
        .collect();
    let mean = outcome.cpu_per_million.iter().sum::<f64>() / each.len() as f64;
    let (direct, forwarded) = match outcome.overhead {
        Some(((d50, d99), (f50, f99))) => (
            format!("{} / {}", ms(d50), ms(d99)),
            format!("{} / {}", ms(f50), ms(f99)),
        ),
        None => ("-".to_string(), "-".to_string()),
    };
    println!(
        "| {nodes} | {} | {mean:.1} | {:.0} | {:.1} s | {direct} | {forwarded} |",
        each.join(" / "),
        outcome.ingest_rate,
        outcome.all_shown_after.as_secs_f64()
    );
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.customers > 0, "--customers must be at least 1");
    anyhow::ensure!(args.stores > 0, "--stores must be at least 1");
    anyhow::ensure!(
        !args.failover || (!args.replicas && args.nodes.iter().all(|n| *n >= 2)),
        "--failover needs a split cluster of at least 2 nodes (--nodes 2,3)"
    );
    let mut failovers = Vec::new();
    println!(
        "{} cluster, {} stores over {} partitions, events sent {}",
        if args.replicas {
            "full-replica"
        } else {
            "split"
        },
        args.stores,
        args.partitions,
        if args.to_owner && !args.replicas {
            "to each store's node"
        } else {
            "to every node in turn"
        }
    );
    println!(
        "| nodes | CPU s per 1M events, each node | mean per node | ingest events/s | all nodes show every event after | read direct p50 / p99 | read forwarded p50 / p99 |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &size in &args.nodes {
        anyhow::ensure!(size > 0, "a cluster has at least one node");
        eprintln!("measuring {size} node(s), {} events...", args.events);
        let outcome = measure(&args, size, true).await?;
        print_row(&size.to_string(), &outcome);
        if let Some(with_changelog) = &outcome.failover {
            eprintln!("measuring the failover of {size} node(s) without the changelog...");
            let without = measure(&args, size, false).await?;
            print_row(&format!("{size} (no changelog)"), &without);
            let from_log = without.failover.expect("a failover was measured");
            failovers.push((size, with_changelog.clone(), from_log));
        }
    }
    if !failovers.is_empty() {
        println!();
        println!("Failover: the last node SIGKILLed {} s after the load; time from the kill until the others serve every partition / answer every store's usage with every event:", FAILOVER_SETTLE_MS / 1000);
        println!("| nodes | restore from the changelog | restore from the log alone |");
        println!("|---:|---:|---:|");
        for (size, changelog, log) in failovers {
            println!(
                "| {size} | {:.1} s / {:.1} s | {:.1} s / {:.1} s |",
                changelog.served_after.as_secs_f64(),
                changelog.answered_after.as_secs_f64(),
                log.served_after.as_secs_f64(),
                log.answered_after.as_secs_f64()
            );
        }
    }
    Ok(())
}
