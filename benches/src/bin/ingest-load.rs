//! End-to-end ingest load generator (the README's ingest benchmark).
//!
//! Starts a real `tally serve` (embedded log, fresh data dir; or the Kafka log on a
//! fresh topic with `--kafka-brokers`), creates 10k customers and 20 meters with
//! filters, then drives `POST /v1/events/ingest` with batches of 100 (`--batch-size`) realistic
//! events over many connections, while another task times usage queries. Reports
//! in one run:
//!   (a) sustained ingest events/s, (b) the raw append rate of the same log (the
//!   embedded one, or produce to the same broker) for records of the same shape,
//!   (c) a/b, (d) time from the last 202 until projections caught up, (e) p50/p99
//!   of a usage query under load, (f) the server's peak RSS, (g) the time a server
//!   SIGKILLed at the end takes to be ready again on its data dir (with
//!   `--kill-under-load`, killed the moment the load ends instead), (h) the server's
//!   CPU time (user + system) per event, from the first batch until the projection
//!   caught up: steadier than a rate on a shared machine, and it counts every part
//!   (HTTP edge, apply, checkpoints).
//!   With `--voids N`, after catching up it also voids N stored events picked at
//!   random (requests of 100 ids, one at a time) and reports each request's
//!   latency: a void answers once applied, so it is reflected in every usage query
//!   by then. With `--spread-days D` the events lie over the last D days (each
//!   batch at one random instant, as a store's history is ingested), so a void's
//!   events fall in minutes all over that history.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rand::Rng;
use tally_benches::{
    batch_body_at, cpu_seconds, meter_definitions_with, percentile, start_server_with,
    usage_record_bytes, DEFAULT_BATCH_EVENTS,
};
use tally_domain::limits::MAX_EVENTS_PER_BATCH;
use tally_log::testsuite::unique_topic;
use tally_log::Log;

#[derive(Parser, Debug)]
struct Args {
    /// The tally binary to run.
    #[arg(long, default_value = "target/release/tally")]
    tally_bin: String,
    /// Concurrent HTTP connections sending batches.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Stop after this many events have been acknowledged.
    #[arg(long, default_value_t = 2_000_000)]
    events: u64,
    /// Or after this many seconds, whichever comes first.
    #[arg(long, default_value_t = 60.0)]
    max_seconds: f64,
    #[arg(long, default_value_t = 10_000)]
    customers: usize,
    /// Events in each batch sent (1 to `MAX_EVENTS_PER_BATCH`, 100): a producer
    /// that sends each event on its own (1) or small batches pays the per-request
    /// cost per few events.
    #[arg(long, default_value_t = DEFAULT_BATCH_EVENTS, value_parser = batch_events)]
    batch_size: usize,
    /// Where the server keeps its data (default: a fresh temp dir).
    #[arg(long)]
    data_dir: Option<String>,
    /// Make the filtered numeric meter of each event name a `latest` or a
    /// `time_weighted_sum` meter (alternately) instead of max/min/average/sum: what
    /// the gauge folds cost on the same load.
    #[arg(long)]
    gauges: bool,
    /// After the load, void this many stored events (random ones, 100 per request)
    /// and time the requests.
    #[arg(long, default_value_t = 0)]
    voids: usize,
    /// Only `--voids` against the data dir an earlier run with `--data-dir` left
    /// (its key and stored batches are in `<data-dir>.ingest-load.json`): the cost
    /// of voids in a large store, measured again without loading it again. Copy the
    /// data dir first to keep it as loaded.
    #[arg(long)]
    voids_only: bool,
    /// Connections the void requests are sent over, each one request at a time (a
    /// client voiding many events at once may send them side by side).
    #[arg(long, default_value_t = 1)]
    void_connections: usize,
    /// With `--voids-only`, wait this long after the server is ready before the
    /// first void: whether a slow first void is the caches being cold or the
    /// start-up's own work.
    #[arg(long, default_value_t = 0)]
    settle_seconds: u64,
    /// Spread the events over the last this many days (at most 35): each batch is
    /// sent as a moment of the store's history (all its events at one random
    /// instant), and the meters are backfilled to count from then, so voids touch
    /// minutes all over the history.
    #[arg(long, default_value_t = 0)]
    spread_days: u32,
    /// Run the senders (not the querier, not the server) at this nice value: a
    /// diagnosis of how much of the query's tail is the load generator sharing the
    /// cores, as a generator on another machine would not. Linux only.
    #[arg(long)]
    senders_nice: Option<i32>,
    /// Run the load generator's querier thread at this nice value (a negative one
    /// needs root): a diagnosis of how much of the measured p99 is the querier
    /// itself waiting for a core it shares with the server. Linux only.
    #[arg(long, allow_negative_numbers = true)]
    querier_nice: Option<i32>,
    /// Serve on the Kafka log, a fresh topic of `KAFKA_PARTITIONS` partitions on
    /// this broker (H:P), instead of the embedded log; (b) is then the raw produce
    /// rate of the same records to a fresh topic of the same broker.
    #[arg(long)]
    kafka_brokers: Option<String>,
    /// Send this `Accept-Encoding` with every batch (e.g. `gzip`, what Python's
    /// `requests`, Go's `net/http` and browsers send): what compressing the ingest
    /// answers costs the server. The answers are read, not decompressed.
    #[arg(long)]
    accept_encoding: Option<String>,
    /// SIGKILL the server the moment the load ends, while the senders' last batches
    /// are in flight and its projector and checkpoints are busy, and time its
    /// restart on that data dir (as (g), which kills it idle after the catch-up);
    /// then stop, skipping the other measures but (a) and (f).
    #[arg(long)]
    kill_under_load: bool,
}

/// Partitions of the topics `--kafka-brokers` creates: the server's and the raw
/// baseline's alike, so (c) compares the same layout.
const KAFKA_PARTITIONS: u32 = 4;

/// How long (d) waits for the projection before the run fails: far past any
/// catch-up measured, short enough that a stuck server ends the run.
const CATCH_UP_GIVE_UP: Duration = Duration::from_secs(120);

/// How long a started server may take to answer `/readyz` before the run fails:
/// a restart of a 10M-event store re-applies its log tail in ~30 s; far past that
/// the server is stuck.
const READY_GIVE_UP: Duration = Duration::from_secs(600);

/// Event ids per void request: the most one request may name (the API's limit),
/// so (v) times full requests.
const VOID_IDS_PER_REQUEST: u64 = 100;

/// The ingest rate over the first tenth of the acknowledged events and over the
/// last tenth, from the load's progress samples (time, events): whether the rate
/// holds as the data grows. None for a run too short to have both.
fn first_and_last_tenth(progress: &[(f64, u64)]) -> Option<(f64, f64)> {
    let &(end, total) = progress.last()?;
    let reached = |events: u64| progress.iter().find(|(_, n)| *n >= events).copied();
    let (t1, n1) = reached(total / 10)?;
    let (t9, n9) = reached(total - total / 10)?;
    (t1 > 0.0 && end > t9 && n1 > 0).then(|| (n1 as f64 / t1, (total - n9) as f64 / (end - t9)))
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Raw appends of usage records over 32 appenders: to a fresh embedded log, or to a
/// fresh topic of `kafka_brokers`.
async fn raw_log_rate(seconds: f64, kafka_brokers: Option<&str>) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let log: Arc<dyn Log> = match kafka_brokers {
        None => Arc::new(tally_log::embedded::EmbeddedLog::open(dir.path())?),
        Some(brokers) => {
            let config = tally_log::kafka::KafkaConfig {
                brokers: brokers.to_string(),
                topic: unique_topic("tally-ingest-raw"),
                partitions: KAFKA_PARTITIONS,
                replication_factor: 1,
                min_insync_replicas: 1,
                fetch_wait_ms: tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
            };
            tally_log::kafka::create_topic(&config).await?;
            Arc::new(tally_log::kafka::KafkaLog::connect(config)?)
        }
    };
    let payloads: Arc<Vec<Vec<u8>>> =
        Arc::new((0..64).map(|b| usage_record_bytes(100, b)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for a in 0..32usize {
        let (log, payloads, stop, count) =
            (log.clone(), payloads.clone(), stop.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = a;
            while !stop.load(Ordering::Relaxed) {
                log.append(b"k", payloads[i % 64].clone()).await.unwrap();
                count.fetch_add(100, Ordering::Relaxed);
                i += 32;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    Ok(count.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.voids_only {
        return voids_only(&args).await;
    }
    let temp = tempfile::tempdir()?;
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| temp.path().display().to_string());
    let server_topic = unique_topic("tally-ingest");
    let partitions = KAFKA_PARTITIONS.to_string();
    let log_flags: Vec<&str> = match &args.kafka_brokers {
        None => Vec::new(),
        Some(brokers) => vec![
            "--log",
            "kafka",
            "--kafka-brokers",
            brokers,
            "--kafka-topic",
            &server_topic,
            "--kafka-partitions",
            &partitions,
        ],
    };
    let (child, base, key) = start_server_with(&args.tally_bin, &data_dir, &log_flags)?;
    let mut child = tally_benches::ServerChild(child);
    let pid = child.id();
    anyhow::ensure!(
        !key.is_empty(),
        "the server printed no test key (use an empty data dir)"
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.connections + 8)
        .build()?;

    let numeric: &[&str] = if args.gauges {
        &["latest", "time_weighted_sum"]
    } else {
        &["max", "min", "average", "sum"]
    };
    let meters = meter_definitions_with(numeric);
    eprintln!(
        "setup: {} customers, {} meters",
        args.customers,
        meters.len()
    );
    let setup = Instant::now();
    // Setup and usage queries go through the typed client; the ingest loop sends
    // prebuilt bodies and reads only the status, so the load generator takes as
    // little of the machine's CPU from the server as it can.
    let tally = tally_client::Client::new(&base, &key);
    let mut tasks = Vec::new();
    for worker in 0..32 {
        let (tally, customers) = (tally.clone(), args.customers);
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in (worker..customers).step_by(32) {
                let customer = tally
                    .create_customer(&tally_client::CustomerCreate {
                        email: format!("c{i}@example.com"),
                        external_id: Some(format!("customer-{i}")),
                        ..Default::default()
                    })
                    .await?;
                ids.push(customer.id);
            }
            Ok::<_, tally_client::Error>(ids)
        }));
    }
    let mut customer_ids = Vec::new();
    for t in tasks {
        customer_ids.extend(t.await??);
    }
    let mut meter_ids = Vec::new();
    for m in meters {
        let meter = tally
            .create_meter(&serde_json::from_value::<tally_client::MeterCreate>(m)?)
            .await?;
        meter_ids.push(meter.id);
    }
    // Spread: the meters count from the first instant events get, before any event
    // exists (a backfill with nothing to fold).
    let spread_ms = i64::from(args.spread_days) * 86_400_000;
    anyhow::ensure!(args.spread_days <= 35, "--spread-days is at most 35");
    let load_start_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    if spread_ms > 0 {
        let from = tally_domain::time::format_iso8601_ms(load_start_ms - spread_ms);
        for meter in &meter_ids {
            let answer = http
                .post(format!("{base}/v1/meters/{meter}/backfill"))
                .header("x-api-key", &key)
                .json(&serde_json::json!({"start": from}))
                .send()
                .await?;
            anyhow::ensure!(
                answer.status().is_success(),
                "backfill answered {}",
                answer.status()
            );
        }
    }
    eprintln!("setup took {:.1?}; loading...", setup.elapsed());

    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Batches answered 503 (and sent again).
    let shed = Arc::new(AtomicU64::new(0));
    let cpu_before = cpu_seconds(pid)?;
    let started = Instant::now();
    // Started after the server, so the server does not inherit the nice value.
    let sender_runtime = match args.senders_nice {
        None => None,
        Some(nice) => Some(
            tokio::runtime::Builder::new_multi_thread()
                .thread_name("senders")
                .on_thread_start(move || {
                    let this_thread = Some(rustix::thread::gettid());
                    rustix::process::setpriority_process(this_thread, nice)
                        .expect("--senders-nice: setting the senders' nice value");
                })
                .enable_all()
                .build()?,
        ),
    };
    let mut senders = Vec::new();
    for connection in 0..args.connections {
        let (http, base, key, acked, stop, shed) = (
            http.clone(),
            base.clone(),
            key.clone(),
            acked.clone(),
            stop.clone(),
            shed.clone(),
        );
        let (customers, target, size) = (args.customers, args.events, args.batch_size);
        let accept_encoding = args.accept_encoding.clone();
        let sender = async move {
            let mut batch = 0u64;
            let mut acked_batches = 0u64;
            let mut last_ok = Instant::now();
            while !stop.load(Ordering::Relaxed) && acked.load(Ordering::Relaxed) < target {
                let body = {
                    let mut rng = rand::rng();
                    let at = (spread_ms > 0).then(|| {
                        let ms = load_start_ms - rng.random_range(0..spread_ms);
                        tally_domain::time::format_iso8601_ms(ms)
                    });
                    batch_body_at(&mut rng, connection, batch, customers, at.as_deref(), size)
                };
                // Shared, so a resend copies nothing.
                let body = bytes::Bytes::from(body);
                batch += 1;
                // A 503 sheds load (the projection is behind): the same batch is
                // sent again after its Retry-After, as a client would; its event
                // ids make the resend safe (a stored event is a duplicate).
                loop {
                    let mut request = http
                        .post(format!("{base}/v1/events/ingest"))
                        .header("x-api-key", &key)
                        .header("content-type", "application/json");
                    if let Some(encoding) = &accept_encoding {
                        request = request.header("accept-encoding", encoding);
                    }
                    let response = request.body(body.clone()).send().await;
                    match response {
                        Ok(r) if r.status().as_u16() == 202 => {
                            let _ = r.bytes().await;
                            acked.fetch_add(size as u64, Ordering::Relaxed);
                            acked_batches = batch;
                            last_ok = Instant::now();
                            break;
                        }
                        Ok(r) if r.status().as_u16() == 503 => {
                            shed.fetch_add(1, Ordering::Relaxed);
                            let seconds = r
                                .headers()
                                .get("retry-after")
                                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                                .unwrap_or(1);
                            tokio::time::sleep(Duration::from_secs(seconds)).await;
                            if stop.load(Ordering::Relaxed) {
                                // The run is over: this batch stays unacknowledged.
                                break;
                            }
                        }
                        Ok(r) => panic!(
                            "ingest answered {}: {}",
                            r.status(),
                            r.text().await.unwrap_or_default()
                        ),
                        // `--kill-under-load` killed the server as the run ended.
                        Err(_) if stop.load(Ordering::Relaxed) => break,
                        Err(e) => panic!("ingest failed: {e}"),
                    }
                }
            }
            (last_ok, acked_batches)
        };
        senders.push(match &sender_runtime {
            Some(runtime) => runtime.spawn(sender),
            None => tokio::spawn(sender),
        });
    }
    let query_stop = Arc::new(AtomicBool::new(false));
    // The querier has its own thread and runtime (and client): on the senders'
    // runtime its answers waited behind 32 senders building batches, which timed
    // the load generator more than the server.
    let querier = {
        let (stop, base, key) = (query_stop.clone(), base.clone(), key.clone());
        let (customer_ids, meter_ids) = (customer_ids.clone(), meter_ids.clone());
        let nice = args.querier_nice;
        std::thread::spawn(move || {
            if let Some(nice) = nice {
                rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice)
                    .expect("--querier-nice: setting the querier's nice value");
            }
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the querier's runtime");
            let tally = tally_client::Client::new(&base, &key);
            runtime.block_on(async move {
                let mut latencies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let (c, m) = {
                        let mut rng = rand::rng();
                        (
                            customer_ids[rng.random_range(0..customer_ids.len())].clone(),
                            meter_ids[rng.random_range(0..meter_ids.len())].clone(),
                        )
                    };
                    let t = Instant::now();
                    let answered = tally
                        .meter_usage(
                            &m,
                            &tally_client::UsageQuery {
                                customer_id: Some(c),
                                window: Some("hour".into()),
                                ..Default::default()
                            },
                        )
                        .await;
                    match answered {
                        Ok(_) => latencies.push(t.elapsed()),
                        // `--kill-under-load` killed the server as the run ended.
                        Err(_) if stop.load(Ordering::Relaxed) => break,
                        Err(e) => panic!("a usage query under load: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                latencies
            })
        })
    };
    let mut peak_rss = 0;
    // (seconds since the start, events acknowledged), every half second: (j).
    let mut progress: Vec<(f64, u64)> = Vec::new();
    while acked.load(Ordering::Relaxed) < args.events
        && started.elapsed().as_secs_f64() < args.max_seconds
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
        peak_rss = peak_rss.max(rss_kib(pid, "VmRSS:"));
        progress.push((
            started.elapsed().as_secs_f64(),
            acked.load(Ordering::Relaxed),
        ));
        eprint!(
            "\r{} events acknowledged, {:.0} events/s   ",
            acked.load(Ordering::Relaxed),
            acked.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
        );
    }
    stop.store(true, Ordering::Relaxed);
    if args.kill_under_load {
        query_stop.store(true, Ordering::Relaxed);
        peak_rss = peak_rss.max(rss_kib(pid, "VmHWM:"));
        let _ = child.kill();
        let _ = child.wait();
        let rate = acked.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
        for s in senders {
            s.await?;
        }
        if let Some(runtime) = sender_runtime {
            // Its tasks are done; a runtime may not be dropped inside another one.
            runtime.shutdown_background();
        }
        querier
            .join()
            .map_err(|_| anyhow::anyhow!("the querier panicked"))?;
        let restart = time_restart(&http, &args.tally_bin, &data_dir, &log_flags).await?;
        eprintln!();
        println!("(a) ingest until the kill:        {rate:.0} events/s");
        println!(
            "(f) server peak RSS:              {:.0} MiB",
            peak_rss as f64 / 1024.0
        );
        println!("(g) ready after SIGKILL under load + restart: {restart:.2?}");
        return Ok(());
    }
    let mut last_ack = started;
    // Batches each connection had acknowledged: their events are stored.
    let mut stored_batches = Vec::new();
    for s in senders {
        let (last_ok, batches) = s.await?;
        last_ack = last_ack.max(last_ok);
        stored_batches.push(batches);
    }
    if let Some(runtime) = sender_runtime {
        // Its tasks are done; a runtime may not be dropped inside another one.
        runtime.shutdown_background();
    }
    let load_seconds = last_ack.duration_since(started).as_secs_f64();
    let total = acked.load(Ordering::Relaxed);
    eprintln!();
    // (d) catch-up: until every partition's lag gauge reads 0 (bytes of the
    // embedded log, records of Kafka; the last name is an older build's).
    let catch_up = loop {
        let metrics = http
            .get(format!("{base}/metrics"))
            .send()
            .await?
            .text()
            .await?;
        let lags: Vec<u64> = metrics
            .lines()
            .filter(|l| {
                [
                    "tally_projector_lag_bytes{",
                    "tally_projector_lag_records{",
                    "tally_consumer_lag_bytes_or_records{",
                ]
                .iter()
                .any(|name| l.starts_with(name))
            })
            .map(|l| {
                l.split_whitespace()
                    .last()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(u64::MAX)
            })
            .collect();
        if !lags.is_empty() && lags.iter().all(|lag| *lag == 0) {
            break last_ack.elapsed();
        }
        anyhow::ensure!(
            last_ack.elapsed() < CATCH_UP_GIVE_UP,
            "the projection did not catch up within {CATCH_UP_GIVE_UP:?} (lag gauges: {lags:?})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let cpu_per_event = (cpu_seconds(pid)? - cpu_before) / total as f64;
    query_stop.store(true, Ordering::Relaxed);
    if let Some(dir) = &args.data_dir {
        let saved = SavedLoad {
            key: key.clone(),
            stored_batches: stored_batches.clone(),
            batch_size: args.batch_size,
        };
        std::fs::write(saved_load_path(dir), serde_json::to_vec(&saved)?)?;
    }
    let voids = void_requests(
        &http,
        &base,
        &key,
        &stored_batches,
        args.batch_size,
        args.voids,
        args.void_connections,
    )
    .await?;
    let mut latencies = querier
        .join()
        .map_err(|_| anyhow::anyhow!("the querier panicked"))?;
    latencies.sort();
    peak_rss = peak_rss.max(rss_kib(pid, "VmHWM:"));
    // (g) restart: SIGKILL (the checkpoint layer is lost), then the time until
    // the restarted server is ready (it re-applies the log past sled's positions).
    let _ = child.kill();
    let _ = child.wait();
    let restart = time_restart(&http, &args.tally_bin, &data_dir, &log_flags).await?;

    let ingest_rate = total as f64 / load_seconds;
    let raw_rate = raw_log_rate(5.0, args.kafka_brokers.as_deref()).await?;
    let raw_name = if args.kafka_brokers.is_some() {
        "(b) raw Kafka produce, same broker:"
    } else {
        "(b) raw embedded-log appends:    "
    };
    println!(
        "events acknowledged:              {total} in {load_seconds:.1} s over {} connections, {} events a batch",
        args.connections, args.batch_size
    );
    println!("(a) sustained ingest:             {ingest_rate:.0} events/s");
    println!(
        "{raw_name} {raw_rate:.0} events/s (same record shape, 100 events/record, 32 appenders)"
    );
    println!(
        "(c) ratio a/b:                    {:.3}",
        ingest_rate / raw_rate
    );
    println!("(d) catch-up after last 202:      {catch_up:.2?}");
    println!(
        "(e) usage query under load:       p50 {:.2?}, p99 {:.2?} ({} queries)",
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0),
        latencies.len()
    );
    println!(
        "(f) server peak RSS:              {:.0} MiB",
        peak_rss as f64 / 1024.0
    );
    println!("(g) ready after SIGKILL + restart: {restart:.2?}");
    println!(
        "(h) server CPU per event:         {:.1} µs (user + system, until caught up)",
        cpu_per_event * 1e6
    );
    println!(
        "(i) batches answered 503:         {} (each sent again after its Retry-After)",
        shed.load(Ordering::Relaxed)
    );
    if let Some((first, last)) = first_and_last_tenth(&progress) {
        println!(
            "(j) last tenth / first tenth:     {last:.0} / {first:.0} events/s = {:.2} (flat as the data grows: the target is >= 0.8)",
            last / first
        );
    }
    print_voids(&voids);
    Ok(())
}

/// Starts the server on the data dir a killed one left, times it until ready
/// (`wait_ready`), and stops it.
async fn time_restart(
    http: &reqwest::Client,
    tally_bin: &str,
    data_dir: &str,
    log_flags: &[&str],
) -> anyhow::Result<Duration> {
    let restarted = Instant::now();
    let (child, base, _) = start_server_with(tally_bin, data_dir, log_flags)?;
    let mut child = tally_benches::ServerChild(child);
    let restart = wait_ready(http, &base, restarted).await?;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    Ok(restart)
}

/// How long after `started` the server at `base` answers `/readyz` 200 (it
/// re-applies the log past the store's positions first); an error past
/// `READY_GIVE_UP`.
async fn wait_ready(
    http: &reqwest::Client,
    base: &str,
    started: Instant,
) -> anyhow::Result<Duration> {
    loop {
        let answer = http.get(format!("{base}/readyz")).send().await;
        if answer.is_ok_and(|r| r.status().is_success()) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            started.elapsed() < READY_GIVE_UP,
            "the server was not ready within {READY_GIVE_UP:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a run on `--data-dir` leaves beside it for `--voids-only`: the test key
/// (printed only on an empty data dir) and the batches each connection stored.
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedLoad {
    key: String,
    stored_batches: Vec<u64>,
    /// Events per stored batch (files written before the option hold none: 100).
    #[serde(default = "default_batch_events")]
    batch_size: usize,
}

fn default_batch_events() -> usize {
    DEFAULT_BATCH_EVENTS
}

/// Parses `--batch-size`: a batch the server accepts.
fn batch_events(text: &str) -> Result<usize, String> {
    let events: usize = text.parse().map_err(|e| format!("{e}"))?;
    if (1..=MAX_EVENTS_PER_BATCH).contains(&events) {
        Ok(events)
    } else {
        Err(format!("a batch holds 1 to {MAX_EVENTS_PER_BATCH} events"))
    }
}

/// The file beside `data_dir` that holds its `SavedLoad`.
fn saved_load_path(data_dir: &str) -> String {
    format!("{}.ingest-load.json", data_dir.trim_end_matches('/'))
}

/// Voids `count` random stored events, `VOID_IDS_PER_REQUEST` per request, over
/// `concurrency` connections (each one request at a time): each request's latency,
/// sorted, and the time until the last was answered (all of them reflected in
/// every query).
async fn void_requests(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    stored_batches: &[u64],
    batch_size: usize,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    // The connections that stored batches: ids are picked among theirs.
    let stored: Vec<(usize, u64)> = stored_batches
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, batches)| *batches > 0)
        .collect();
    anyhow::ensure!(count == 0 || !stored.is_empty(), "no stored events to void");
    // Ids left to void, taken a request's worth at a time by whichever connection
    // is free.
    let left = AtomicU64::new(count as u64);
    let one_connection = || async {
        let mut latencies = Vec::new();
        loop {
            let take = left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(VOID_IDS_PER_REQUEST))
                })
                .map_or(0, |n| n.min(VOID_IDS_PER_REQUEST));
            if take == 0 {
                return anyhow::Ok(latencies);
            }
            let ids: Vec<String> = {
                let mut rng = rand::rng();
                (0..take)
                    .map(|_| {
                        let (connection, batches) = stored[rng.random_range(0..stored.len())];
                        let batch = rng.random_range(0..batches);
                        format!("c{connection}-{batch}-{}", rng.random_range(0..batch_size))
                    })
                    .collect()
            };
            let t = Instant::now();
            let answer = http
                .post(format!("{base}/v1/events/void"))
                .header("x-api-key", key)
                .json(&serde_json::json!({"event_ids": ids, "reason": "benchmark"}))
                .send()
                .await?;
            anyhow::ensure!(
                answer.status().is_success(),
                "void answered {}: {}",
                answer.status(),
                answer.text().await.unwrap_or_default()
            );
            let took = t.elapsed();
            latencies.push(took);
            eprint!("{took:.0?} ");
        }
    };
    let started = Instant::now();
    let mut void_latencies = Vec::new();
    for latencies in
        futures::future::join_all((0..concurrency.max(1)).map(|_| one_connection())).await
    {
        void_latencies.extend(latencies?);
    }
    let all = started.elapsed();
    void_latencies.sort();
    Ok((void_latencies, all))
}

/// `--voids-only`: a server on the data dir a run with `--data-dir` left, timed
/// until ready, then only the voids.
async fn voids_only(args: &Args) -> anyhow::Result<()> {
    let data_dir = args
        .data_dir
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("--voids-only needs --data-dir"))?;
    let saved_path = saved_load_path(data_dir);
    let saved: SavedLoad = serde_json::from_slice(&std::fs::read(&saved_path).map_err(|e| {
        anyhow::anyhow!("{saved_path}: {e} (a run with --data-dir writes it after its load)")
    })?)?;
    let started = Instant::now();
    let (child, base, _) = start_server_with(&args.tally_bin, data_dir, &[])?;
    let mut child = tally_benches::ServerChild(child);
    let http = reqwest::Client::new();
    let ready = wait_ready(&http, &base, started).await?;
    tokio::time::sleep(Duration::from_secs(args.settle_seconds)).await;
    // A new pool for the voids: the readiness probe's connection, idle while
    // settling, may be closed by the server's header timeout
    // (`HEADER_READ_TIMEOUT_MS`) just as the first void is sent on it, which
    // failed the run with "error sending request".
    let http = reqwest::Client::new();
    eprintln!("ready after {ready:.2?}; voiding...");
    let voids = void_requests(
        &http,
        &base,
        &saved.key,
        &saved.stored_batches,
        saved.batch_size,
        args.voids,
        args.void_connections,
    )
    .await?;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    println!("ready after start:                {ready:.2?}");
    print_voids(&voids);
    Ok(())
}

/// Line (v): the void requests' latencies, and the time until all were answered.
fn print_voids((latencies, all): &(Vec<Duration>, Duration)) {
    if !latencies.is_empty() {
        println!(
            "(v) voids of {VOID_IDS_PER_REQUEST} events:          {} requests, p50 {:.2?}, p99 {:.2?}; all answered after {:.2?}",
            latencies.len(),
            percentile(latencies, 50.0),
            percentile(latencies, 99.0),
            all
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{batch_events, first_and_last_tenth, MAX_EVENTS_PER_BATCH};

    #[test]
    fn batch_sizes_are_those_the_server_accepts() {
        assert_eq!(batch_events("1"), Ok(1));
        assert_eq!(batch_events("100"), Ok(MAX_EVENTS_PER_BATCH));
        for refused in ["0", "101", "-1", "ten"] {
            assert!(batch_events(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn the_tenths_rates_follow_the_progress() {
        let steady: Vec<(f64, u64)> = (1..=100).map(|s| (s as f64, s * 1_000)).collect();
        let (first, last) = first_and_last_tenth(&steady).unwrap();
        assert_eq!((first, last), (1_000.0, 1_000.0));
        // 2,000 events/s for 50 s, then 1,000/s for 100 s.
        let slowing: Vec<(f64, u64)> = (1..=150)
            .map(|s| {
                (
                    s as f64,
                    if s <= 50 {
                        s * 2_000
                    } else {
                        100_000 + (s - 50) * 1_000
                    },
                )
            })
            .collect();
        let (first, last) = first_and_last_tenth(&slowing).unwrap();
        assert_eq!((first, last), (2_000.0, 1_000.0));
        assert_eq!(first_and_last_tenth(&[]), None);
        assert_eq!(
            first_and_last_tenth(&[(0.5, 0)]),
            None,
            "nothing acknowledged"
        );
    }
}
