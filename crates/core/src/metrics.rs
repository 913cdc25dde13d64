//! Counters and histograms for `/metrics` (Prometheus text format), kept as atomics
//! so recording costs a few nanoseconds on the hot path.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;

/// Upper bounds (seconds) of latency buckets: 100 µs to 10 s.
const LATENCY_BUCKETS_SECONDS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0, 10.0,
];

#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS_SECONDS.iter().zip(&self.buckets) {
            if seconds <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, bucket) in LATENCY_BUCKETS_SECONDS.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub log_append: Histogram,
    pub records_applied: AtomicU64,
    pub events_accepted: AtomicU64,
    pub events_duplicate: AtomicU64,
    /// (method, route, status) -> count.
    pub http_requests: DashMap<(String, String, u16), AtomicU64>,
    /// route -> latency.
    pub http_latency: DashMap<String, Histogram>,
}

impl Metrics {
    /// Counts a request. The label set stays bounded whatever clients send: methods
    /// outside the standard ones count as `OTHER` (HTTP allows any token as a
    /// method), routes are route templates or `unmatched`.
    pub fn record_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        const METHODS: [&str; 7] = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"];
        let method = METHODS
            .iter()
            .find(|m| **m == method)
            .copied()
            .unwrap_or("OTHER");
        self.http_requests
            .entry((method.to_string(), route.to_string(), status))
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
        self.http_latency
            .entry(route.to_string())
            .or_default()
            .observe(elapsed);
    }

    /// Renders everything; `positions` are (applied, end) per partition.
    pub fn render(&self, positions: &[(u64, u64)], log_kind: &str) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP tally_http_requests_total HTTP requests by method, route and status.\n",
        );
        out.push_str("# TYPE tally_http_requests_total counter\n");
        let mut rows: Vec<_> = self
            .http_requests
            .iter()
            .map(|e| (e.key().clone(), e.value().load(Ordering::Relaxed)))
            .collect();
        rows.sort();
        for ((method, route, status), count) in rows {
            let _ = writeln!(
                out,
                "tally_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
        out.push_str("# HELP tally_http_request_duration_seconds HTTP request latency by route.\n");
        out.push_str("# TYPE tally_http_request_duration_seconds histogram\n");
        let mut routes: Vec<String> = self.http_latency.iter().map(|e| e.key().clone()).collect();
        routes.sort();
        for route in routes {
            if let Some(h) = self.http_latency.get(&route) {
                h.render(
                    &mut out,
                    "tally_http_request_duration_seconds",
                    &format!("route=\"{route}\""),
                );
            }
        }
        out.push_str(
            "# HELP tally_log_append_duration_seconds Time for an append to become durable.\n",
        );
        out.push_str("# TYPE tally_log_append_duration_seconds histogram\n");
        self.log_append.render(
            &mut out,
            "tally_log_append_duration_seconds",
            &format!("log=\"{log_kind}\""),
        );
        out.push_str("# HELP tally_consumer_lag_bytes_or_records Log not yet applied to projections (bytes for the embedded log, records for Kafka).\n");
        out.push_str("# TYPE tally_consumer_lag_bytes_or_records gauge\n");
        for (partition, (applied, end)) in positions.iter().enumerate() {
            let _ = writeln!(
                out,
                "tally_consumer_lag_bytes_or_records{{partition=\"{partition}\"}} {}",
                end.saturating_sub(*applied)
            );
        }
        for (name, help, value) in [
            (
                "tally_records_applied_total",
                "Log records applied by the projector.",
                &self.records_applied,
            ),
            (
                "tally_events_accepted_total",
                "Usage events accepted (not duplicates).",
                &self.events_accepted,
            ),
            (
                "tally_events_duplicate_total",
                "Usage events dropped as duplicates.",
                &self.events_duplicate,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arbitrary_methods_share_one_label() {
        let metrics = Metrics::default();
        for i in 0..100 {
            metrics.record_request(&format!("M{i}"), "unmatched", 405, Duration::ZERO);
        }
        metrics.record_request("GET", "/healthz", 200, Duration::ZERO);
        assert_eq!(metrics.http_requests.len(), 2);
    }
}
