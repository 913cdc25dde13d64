//! Raw log append throughput: the baseline later throughput is measured against.
//!
//! For each log (embedded; Kafka when `--kafka-brokers` is given) and each cell of
//! batch size (events per record: 1, 10, 100) x concurrent appenders (1, 16), appends
//! realistic usage records for `--seconds` and reports records/s, events/s and append
//! latency percentiles. Every append is durable (fsync / acks=all) before it counts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tally_benches::{percentile, usage_record_bytes};
use tally_log::Log;

#[derive(Parser, Debug)]
struct Args {
    /// Seconds per cell.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Also benchmark rdkafka produce to this broker (H:P).
    #[arg(long)]
    kafka_brokers: Option<String>,
}

async fn run_cell(
    log: Arc<dyn Log>,
    events_per_record: usize,
    appenders: usize,
    seconds: f64,
) -> (f64, Vec<Duration>) {
    let payloads: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..64)
            .map(|b| usage_record_bytes(events_per_record, b))
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for appender in 0..appenders {
        let (log, payloads, stop, count) =
            (log.clone(), payloads.clone(), stop.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = appender;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("customer-{}", i % 97);
                let t = Instant::now();
                log.append(key.as_bytes(), payloads[i % payloads.len()].clone())
                    .await
                    .expect("append");
                latencies.push(t.elapsed());
                count.fetch_add(1, Ordering::Relaxed);
                i += appenders;
            }
            latencies
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    (count.load(Ordering::Relaxed) as f64 / elapsed, latencies)
}

async fn bench(name: &str, log: Arc<dyn Log>, seconds: f64) {
    println!("{name}:");
    println!(
        "  {:>6} {:>9} {:>12} {:>12} {:>10} {:>10}",
        "events", "appenders", "records/s", "events/s", "p50", "p99"
    );
    for events in [1usize, 10, 100] {
        for appenders in [1usize, 16] {
            let (rate, latencies) = run_cell(log.clone(), events, appenders, seconds).await;
            println!(
                "  {:>6} {:>9} {:>12.0} {:>12.0} {:>10.2?} {:>10.2?}",
                events,
                appenders,
                rate,
                rate * events as f64,
                percentile(&latencies, 50.0),
                percentile(&latencies, 99.0)
            );
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "record sizes: 1 event = {} B, 10 events = {} B, 100 events = {} B",
        usage_record_bytes(1, 0).len(),
        usage_record_bytes(10, 0).len(),
        usage_record_bytes(100, 0).len()
    );
    let dir = tempfile::tempdir()?;
    let embedded: Arc<dyn Log> = Arc::new(tally_log::embedded::EmbeddedLog::open(dir.path())?);
    bench(
        "embedded log (fsync per group commit)",
        embedded,
        args.seconds,
    )
    .await;
    if let Some(brokers) = args.kafka_brokers {
        let config = tally_log::kafka::KafkaConfig {
            brokers,
            topic: format!("tally-bench-{}", std::process::id()),
            partitions: 4,
            replication_factor: 1,
            min_insync_replicas: 1,
            fetch_wait_ms: tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
        };
        tally_log::kafka::create_topic(&config).await?;
        let kafka: Arc<dyn Log> = Arc::new(tally_log::kafka::KafkaLog::connect(config)?);
        bench(
            "kafka via rdkafka (idempotent, acks=all)",
            kafka,
            args.seconds,
        )
        .await;
    }
    Ok(())
}
