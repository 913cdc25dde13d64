//! Shared pieces of the benchmarks: realistic usage records, timing and percentiles.
//! Benchmarks are binaries (`src/bin`), never timed unit tests; each reports ratios
//! against a baseline measured in the same run, because the machines are shared.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rand::Rng;
use rust_decimal::Decimal;
use tally_domain::record::Record;
use tally_domain::usage::{PropertyValue, UsageEvent};
use tally_domain::Mode;

pub const EVENT_NAMES: [&str; 5] = [
    "api_call",
    "llm_tokens",
    "storage_bytes",
    "seat_active",
    "job_minutes",
];
pub const REGIONS: [&str; 4] = ["eu", "us", "apac", "sa"];
pub const MODELS: [&str; 3] = ["small", "medium", "large"];

/// One realistic event's properties (as the load generator sends them).
pub fn random_properties(rng: &mut impl Rng) -> BTreeMap<String, PropertyValue> {
    let mut p = BTreeMap::new();
    p.insert(
        "region".into(),
        PropertyValue::String(REGIONS[rng.random_range(0..4)].into()),
    );
    p.insert(
        "model".into(),
        PropertyValue::String(MODELS[rng.random_range(0..3)].into()),
    );
    p.insert(
        "tokens".into(),
        PropertyValue::Number(Decimal::from(rng.random_range(1..5000))),
    );
    p.insert(
        "bytes".into(),
        PropertyValue::Number(Decimal::new(rng.random_range(1..10_000_000), 2)),
    );
    p.insert(
        "user".into(),
        PropertyValue::String(format!("user_{}", rng.random_range(0..1000))),
    );
    p
}

/// An encoded usage-batch log record of `events` realistic events: the exact bytes
/// ingest appends for a batch of that size.
pub fn usage_record_bytes(events: usize, batch: u64) -> Vec<u8> {
    let mut rng = rand::rng();
    let events = (0..events)
        .map(|i| UsageEvent {
            event_id: format!("bench-{batch}-{i}"),
            name: EVENT_NAMES[rng.random_range(0..5)].into(),
            customer_id: format!("cus_{:024}", rng.random_range(0..10_000)).into(),
            external_customer_id: Some(format!("customer-{}", rng.random_range(0..10_000))),
            timestamp_ms: 1_800_000_000_000,
            properties: random_properties(&mut rng),
            received_at_ms: 1_800_000_000_000,
            matched_meter_ids: vec![
                "mtr_000000000000000000000001".into(),
                "mtr_000000000000000000000002".into(),
            ],
            event_id_assigned: false,
        })
        .collect();
    tally_proto::encode_record(
        &Record::UsageBatch {
            store_id: "st_bench".into(),
            mode: Mode::Test,
            events,
            settles: false,
            matched_below: Some(0),
        },
        1_800_000_000_000,
    )
}

/// The p-th percentile (0..=100) of sorted durations.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[index]
}

/// A server child that is killed when it goes out of scope still running: a run
/// that ends early (an error or a panic returning from `main` before its own
/// shutdown) leaves no server behind, holding a core of the machine.
#[derive(Debug)]
pub struct ServerChild(pub Child);

impl Drop for ServerChild {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl std::ops::Deref for ServerChild {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for ServerChild {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// Starts `tally serve` on `data_dir`: the child, the test API's base URL, and the
/// test key (printed only when the data dir was empty).
pub fn start_server(tally_bin: &str, data_dir: &str) -> anyhow::Result<(Child, String, String)> {
    start_server_with(tally_bin, data_dir, &[])
}

/// `start_server` with more `tally serve` flags (e.g. a Kafka log).
pub fn start_server_with(
    tally_bin: &str,
    data_dir: &str,
    flags: &[&str],
) -> anyhow::Result<(Child, String, String)> {
    start_server_on(tally_bin, data_dir, "127.0.0.1:0", "127.0.0.1:0", flags)
}

/// Where a started server's log goes: a file per listener under the directory
/// `TALLY_BENCH_SERVER_LOGS` names (to see what a run did), else nowhere.
fn server_log(listen: &str) -> anyhow::Result<Stdio> {
    match std::env::var_os("TALLY_BENCH_SERVER_LOGS") {
        Some(dir) => {
            let name = format!("tally-{}.log", listen.replace([':', '.'], "_"));
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(std::path::Path::new(&dir).join(name))?;
            Ok(Stdio::from(file))
        }
        None => Ok(Stdio::null()),
    }
}

/// `start_server_with` on the given listener addresses (a node whose address its
/// peers must know before it starts).
pub fn start_server_on(
    tally_bin: &str,
    data_dir: &str,
    listen: &str,
    test_listen: &str,
    flags: &[&str],
) -> anyhow::Result<(Child, String, String)> {
    let mut child = Command::new(tally_bin)
        .args([
            "serve",
            "--data-dir",
            data_dir,
            "--listen",
            listen,
            "--test-listen",
            test_listen,
        ])
        .args([
            "--rate-limit-per-second",
            "100000000",
            "--rate-limit-burst",
            "100000000",
        ])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(server_log(listen)?)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut base, mut key) = (String::new(), String::new());
    for line in lines.by_ref() {
        let line = line?;
        if let Some(rest) = line.trim().strip_prefix("test API:") {
            base = rest.split_whitespace().next().unwrap_or("").to_string();
        }
        if let Some(rest) = line.trim().strip_prefix("test key:") {
            key = rest.trim().to_string();
        }
        // The last line of the banner: "Try: ..." after a first start, "stores:"
        // on a data dir that has them.
        if line.starts_with("Try:") || line.trim().starts_with("stores:") {
            break;
        }
    }
    if base.is_empty() {
        // Its output ended without an address: it stopped at start (another
        // server holding the data dir, a bad flag). Say so now rather than poll
        // an empty address until a readiness limit runs out.
        let _ = child.kill();
        let status = child.wait()?;
        anyhow::bail!(
            "`{tally_bin} serve --data-dir {data_dir}` ended ({status}) before printing its \
             address (another server on that data dir? TALLY_BENCH_SERVER_LOGS=DIR keeps \
             its log)"
        );
    }
    Ok((child, base, key))
}

/// The 20 meters of the ingest benchmarks: per event name a count, a filtered sum,
/// a filtered numeric aggregation and a filtered unique count.
pub fn meter_definitions() -> Vec<serde_json::Value> {
    meter_definitions_with(&["max", "min", "average", "sum"])
}

/// `meter_definitions` with the filtered numeric aggregation of each event name
/// taken in turn from `numeric` (e.g. `latest` and `time_weighted_sum`, to measure
/// what they cost against the plain folds).
pub fn meter_definitions_with(numeric: &[&str]) -> Vec<serde_json::Value> {
    let mut meters = Vec::new();
    for (i, name) in EVENT_NAMES.iter().enumerate() {
        meters.push(
            serde_json::json!({"name": format!("{name} count"), "event_name": name, "aggregation": "count"}),
        );
        meters.push(serde_json::json!({"name": format!("{name} tokens eu"), "event_name": name, "aggregation": "sum", "aggregation_property": "tokens",
            "filter": {"conjunction": "and", "clauses": [{"property": "region", "operator": "eq", "value": "eu"}]}}));
        meters.push(serde_json::json!({"name": format!("{name} max bytes large"), "event_name": name, "aggregation": numeric[i % numeric.len()], "aggregation_property": "bytes",
            "filter": {"conjunction": "or", "clauses": [{"property": "model", "operator": "in", "value": ["large", "medium"]}, {"property": "tokens", "operator": "gt", "value": 4000}]}}));
        meters.push(serde_json::json!({"name": format!("{name} unique users"), "event_name": name, "aggregation": "unique", "aggregation_property": "user",
            "filter": {"conjunction": "and", "clauses": [{"property": "user", "operator": "like", "value": "user_"}]}}));
    }
    meters
}

/// Events in a benchmark batch unless a benchmark is told otherwise: the most a
/// batch may hold (`MAX_EVENTS_PER_BATCH`), as a producer that batches sends.
pub const DEFAULT_BATCH_EVENTS: usize = tally_domain::limits::MAX_EVENTS_PER_BATCH;

/// A body of `DEFAULT_BATCH_EVENTS` realistic events for `POST /v1/events/ingest`,
/// with event ids unique per connection and batch, for customers
/// `customer-0..customers`.
pub fn batch_body(rng: &mut impl Rng, connection: usize, batch: u64, customers: usize) -> String {
    batch_body_at(
        rng,
        connection,
        batch,
        customers,
        None,
        DEFAULT_BATCH_EVENTS,
    )
}

/// A body of `events` events like `batch_body`'s, all carrying `timestamp` (ISO
/// 8601) if one is given, as a batch sent at one moment of a store's history does.
pub fn batch_body_at(
    rng: &mut impl Rng,
    connection: usize,
    batch: u64,
    customers: usize,
    timestamp: Option<&str>,
    events: usize,
) -> String {
    let mut body = String::with_capacity(200 * events + 16);
    body.push_str("{\"events\":[");
    let at = timestamp
        .map(|t| format!("\"timestamp\":\"{t}\","))
        .unwrap_or_default();
    for i in 0..events {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            "{{{at}\"name\":\"{}\",\"external_customer_id\":\"customer-{}\",\"event_id\":\"c{connection}-{batch}-{i}\",\"properties\":{{\"region\":\"{}\",\"model\":\"{}\",\"tokens\":{},\"bytes\":{}.{:02},\"user\":\"user_{}\"}}}}",
            EVENT_NAMES[rng.random_range(0..5)],
            rng.random_range(0..customers),
            REGIONS[rng.random_range(0..4)],
            MODELS[rng.random_range(0..3)],
            rng.random_range(1..5000),
            rng.random_range(1..100_000),
            rng.random_range(0..100),
            rng.random_range(0..1000),
        ));
    }
    body.push_str("]}");
    body
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`; 100 on
/// Linux everywhere we run).
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// User + system CPU seconds the process has used so far.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("unreadable /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> { Ok(fields[i].parse::<f64>()?) };
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after the name.
    Ok((ticks(11)? + ticks(12)?) / CLOCK_TICKS_PER_SECOND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_stops_at_start_is_an_error_naming_its_data_dir() {
        let error = start_server_on("false", "/nowhere", "127.0.0.1:0", "127.0.0.1:0", &[])
            .expect_err("a server that printed no address");
        let message = error.to_string();
        assert!(message.contains("/nowhere"), "{message}");
        assert!(message.contains("before printing its address"), "{message}");
    }

    #[test]
    fn a_batch_body_holds_the_events_asked_for_with_unique_ids() {
        for events in [1, 10, DEFAULT_BATCH_EVENTS] {
            let body = batch_body_at(&mut rand::rng(), 3, 7, 10, None, events);
            let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
            let ids: std::collections::BTreeSet<&str> = parsed["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["event_id"].as_str().unwrap())
                .collect();
            assert_eq!(ids.len(), events);
            assert!(ids.iter().all(|id| id.starts_with("c3-7-")));
        }
    }
}
