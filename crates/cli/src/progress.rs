//! Progress of long jobs (`tally replay`, `tally ledger verify|export`): an
//! indicatif bar when stderr is a terminal, otherwise a plain line at most every
//! `PLAIN_LINE_EVERY` (logs and CI see that the job moves without a line per
//! record).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a job without a terminal reports.
pub const PLAIN_LINE_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Progress {
    label: &'static str,
    bar: Option<ProgressBar>,
    last_line: Instant,
    partition: Option<u32>,
}

impl Progress {
    pub fn new(label: &'static str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {percent:>3}% {msg} ({elapsed}, eta {eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_prefix(label);
            bar
        });
        Progress {
            label,
            bar,
            last_line: Instant::now(),
            partition: None,
        }
    }

    /// `at` of `end` (log positions) reached in `partition`, `records` done so far.
    pub fn update(&mut self, partition: u32, at: u64, end: u64, records: Option<u64>) {
        let records = records
            .map(|r| format!(", {r} records"))
            .unwrap_or_default();
        match &self.bar {
            Some(bar) => {
                if self.partition != Some(partition) {
                    bar.set_length(end.max(1));
                    self.partition = Some(partition);
                }
                bar.set_position(at.min(end));
                bar.set_message(format!("partition {partition}{records}"));
            }
            None => {
                if self.last_line.elapsed() >= PLAIN_LINE_EVERY {
                    self.last_line = Instant::now();
                    eprintln!(
                        "{}: partition {partition} {at}/{end} ({:.0}%){records}",
                        self.label,
                        at as f64 * 100.0 / end.max(1) as f64
                    );
                }
            }
        }
    }

    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
