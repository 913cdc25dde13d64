//! Metrics through the `metrics` facade, exported in the Prometheus text format by
//! `metrics-exporter-prometheus` (`GET /metrics`). Names follow Prometheus
//! conventions: the unit in the name (`_seconds`, `_bytes`), `_total` on counters.
//!
//! Counters and histograms are recorded where things happen; the gauges that
//! describe state (projector lag, checkpoint age, dedup index size, webhook queue)
//! are set from a [`Gauges`] snapshot when `/metrics` is scraped, so nothing on a
//! hot path maintains them. The recorder is process-wide (the facade's design):
//! every engine of one process records into it.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Upper bounds (seconds) of latency buckets: 100 µs to 10 s.
const LATENCY_BUCKETS_SECONDS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0, 10.0,
];

/// HTTP methods that get their own label; any other token counts as `OTHER`, so
/// the label set stays bounded whatever clients send.
const METHODS: [&str; 7] = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// How often histogram samples are folded into their buckets. The exporter keeps
/// raw samples until then; without upkeep an unscraped server's memory would grow
/// with every request.
pub const METRICS_UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Request counters and latency histograms by label set, registered once: a
/// request then costs an atomic add and a sample push, no label allocation.
type RequestHandles =
    dashmap::DashMap<(&'static str, String, u16), (metrics::Counter, metrics::Histogram)>;
static REQUESTS: OnceLock<RequestHandles> = OnceLock::new();

/// Installs the process's recorder the first time (every later call shares it).
fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS_SECONDS)
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "another metrics recorder is installed; /metrics shows only what it renders"
            );
        }
        describe();
        let upkeep = handle.clone();
        let spawned = std::thread::Builder::new()
            .name("tally-metrics-upkeep".into())
            .spawn(move || loop {
                std::thread::sleep(METRICS_UPKEEP_EVERY);
                upkeep.run_upkeep();
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "no metrics upkeep thread; histograms fold at scrapes only");
        }
        handle
    })
}

fn describe() {
    describe_counter!(
        "tally_http_requests_total",
        "HTTP requests by method, route and status."
    );
    describe_histogram!(
        "tally_http_request_duration_seconds",
        metrics::Unit::Seconds,
        "HTTP request latency by route."
    );
    describe_histogram!(
        "tally_log_append_duration_seconds",
        metrics::Unit::Seconds,
        "Time for an append to become durable."
    );
    describe_counter!(
        "tally_changelog_writes_total",
        "Checkpoints of a partition written to a split cluster's changelog, by outcome (written, failed) and partition."
    );
    describe_gauge!(
        "tally_changelog_position",
        "Per partition, the log position of the last checkpoint this node wrote to the changelog: where a node that gains the partition would restore it from."
    );
    describe_counter!(
        "tally_partitions_restored_from_changelog_total",
        "Partitions this node gained and restored from the changelog rather than the log."
    );
    describe_counter!(
        "tally_records_applied_total",
        "Log records applied by the projector."
    );
    describe_counter!(
        "tally_events_accepted_total",
        "Usage events accepted (not duplicates)."
    );
    describe_counter!(
        "tally_events_duplicate_total",
        "Usage events dropped as duplicates."
    );
    describe_gauge!(
        "tally_projector_lag_bytes",
        metrics::Unit::Bytes,
        "Embedded log not yet applied to the projections, per partition."
    );
    describe_gauge!(
        "tally_projector_lag_records",
        "Kafka records not yet applied to the projections, per partition."
    );
    describe_gauge!(
        "tally_projector_apply_lag_seconds",
        metrics::Unit::Seconds,
        "How long this node's oldest write has waited to be applied."
    );
    describe_gauge!(
        "tally_checkpoint_age_seconds",
        metrics::Unit::Seconds,
        "Time since the projections' last completed checkpoint to sled."
    );
    describe_gauge!(
        "tally_checkpoint_dirty_keys",
        "Projection keys changed since the last completed checkpoint."
    );
    describe_gauge!(
        "tally_dedup_index_entries",
        "Stored events the in-memory dedup index remembers."
    );
    describe_gauge!(
        "tally_cluster_partitions_owned",
        "Partitions of the log this node owns in its cluster (--cluster)."
    );
    describe_gauge!(
        "tally_cluster_partition_owned",
        "1 when this node owns the partition in its cluster (--cluster), else 0."
    );
    describe_gauge!(
        "tally_cluster_partition_serving",
        "1 when this node serves the partition (projects it in full, restored) in a split cluster (--peers), else 0."
    );
    describe_counter!(
        "tally_cluster_forwarded_requests_total",
        "Requests forwarded to the node serving their store (split cluster), by outcome: answered, unavailable, failed."
    );
    describe_gauge!(
        "tally_webhook_queue_depth",
        "Webhook deliveries waiting for an attempt (counted up to a bound)."
    );
}

/// State gauges, read when `/metrics` is scraped.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// (applied, end) per partition.
    pub positions: Vec<(u64, u64)>,
    /// `embedded` (positions in bytes) or `kafka` (in records).
    pub log_kind: &'static str,
    pub apply_lag: Duration,
    /// None when the projection store has no checkpoints.
    pub checkpoint_age: Option<Duration>,
    pub checkpoint_dirty_keys: usize,
    pub dedup_index_entries: usize,
    pub webhook_queue_depth: usize,
}

/// The engine's handle on the recorder (one per process underneath).
#[derive(Debug, Clone, Copy, Default)]
pub struct Metrics;

impl Metrics {
    fn ensure(&self) {
        handle();
    }

    /// Counts a request and its latency (route templates or `unmatched` only).
    pub fn record_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        self.ensure();
        let method = METHODS
            .iter()
            .find(|m| **m == method)
            .copied()
            .unwrap_or("OTHER");
        let requests = REQUESTS.get_or_init(Default::default);
        let key = (method, route.to_string(), status);
        let record = |(counter, histogram): &(metrics::Counter, metrics::Histogram)| {
            counter.increment(1);
            histogram.record(elapsed.as_secs_f64());
        };
        if let Some(handles) = requests.get(&key) {
            return record(&handles);
        }
        let handles = requests.entry(key).or_insert_with(|| {
            (
                counter!(
                    "tally_http_requests_total",
                    "method" => method,
                    "route" => route.to_string(),
                    "status" => status.to_string()
                ),
                histogram!(
                    "tally_http_request_duration_seconds",
                    "route" => route.to_string()
                ),
            )
        });
        record(&handles);
    }

    pub fn log_append(&self, log_kind: &'static str, elapsed: Duration) {
        self.ensure();
        histogram!("tally_log_append_duration_seconds", "log" => log_kind)
            .record(elapsed.as_secs_f64());
    }

    /// Counts a request forwarded to another node of a split cluster.
    pub fn forwarded(&self, outcome: &'static str) {
        self.ensure();
        counter!("tally_cluster_forwarded_requests_total", "outcome" => outcome).increment(1);
    }

    /// Counts one partition's checkpoint written to the changelog (or failed). The
    /// partition label is bounded by the log's partition count.
    pub fn changelog_written(outcome: &'static str, partition: u32) {
        counter!("tally_changelog_writes_total", "outcome" => outcome, "partition" => partition.to_string())
            .increment(1);
    }

    /// Notes the position of the checkpoint of `partition` last written to the
    /// changelog.
    pub fn changelog_position(partition: u32, position: u64) {
        gauge!("tally_changelog_position", "partition" => partition.to_string())
            .set(position as f64);
    }

    /// Counts a partition restored from the changelog.
    pub fn restored_from_changelog() {
        counter!("tally_partitions_restored_from_changelog_total").increment(1);
    }

    pub fn records_applied(&self, records: u64) {
        self.ensure();
        counter!("tally_records_applied_total").increment(records);
    }

    pub fn events(&self, accepted: u64, duplicates: u64) {
        self.ensure();
        counter!("tally_events_accepted_total").increment(accepted);
        counter!("tally_events_duplicate_total").increment(duplicates);
    }

    /// Sets the state gauges and renders everything in the Prometheus text format.
    pub fn render(&self, gauges: &Gauges) -> String {
        let handle = handle();
        let lag_name = if gauges.log_kind == "kafka" {
            "tally_projector_lag_records"
        } else {
            "tally_projector_lag_bytes"
        };
        for (partition, (applied, end)) in gauges.positions.iter().enumerate() {
            gauge!(lag_name, "partition" => partition.to_string())
                .set(end.saturating_sub(*applied) as f64);
        }
        gauge!("tally_projector_apply_lag_seconds").set(gauges.apply_lag.as_secs_f64());
        if let Some(age) = gauges.checkpoint_age {
            gauge!("tally_checkpoint_age_seconds").set(age.as_secs_f64());
        }
        gauge!("tally_checkpoint_dirty_keys").set(gauges.checkpoint_dirty_keys as f64);
        gauge!("tally_dedup_index_entries").set(gauges.dedup_index_entries as f64);
        gauge!("tally_webhook_queue_depth").set(gauges.webhook_queue_depth as f64);
        handle.run_upkeep();
        handle.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text_with_bounded_method_labels() {
        let metrics = Metrics;
        for i in 0..50 {
            metrics.record_request(&format!("M{i}"), "unit-test-route", 405, Duration::ZERO);
        }
        metrics.record_request("GET", "unit-test-route", 200, Duration::from_millis(3));
        metrics.log_append("embedded", Duration::from_micros(300));
        let text = metrics.render(&Gauges {
            positions: vec![(10, 25)],
            log_kind: "embedded",
            checkpoint_age: Some(Duration::from_millis(1500)),
            dedup_index_entries: 7,
            ..Gauges::default()
        });
        let other: Vec<_> = text
            .lines()
            .filter(|l| l.starts_with("tally_http_requests_total") && l.contains("unit-test-route"))
            .collect();
        assert_eq!(other.len(), 2, "{other:#?}");
        assert!(text.contains(
            "tally_http_requests_total{method=\"OTHER\",route=\"unit-test-route\",status=\"405\"} 50"
        ));
        assert!(text.contains("# TYPE tally_http_request_duration_seconds histogram"));
        assert!(text.contains("tally_projector_lag_bytes{partition=\"0\"} 15"));
        assert!(text.contains("tally_checkpoint_age_seconds 1.5"));
        assert!(text.contains("tally_dedup_index_entries 7"));
        assert!(text
            .contains("tally_log_append_duration_seconds_bucket{log=\"embedded\",le=\"0.0005\"}"));
    }
}
