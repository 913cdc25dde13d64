//! Where ingest work runs: a runtime of its own whose threads have background
//! priority (`tally_projection::priority`), like apply and checkpoints.
//!
//! Decoding, validating and appending a batch of 100 events takes a few
//! milliseconds of CPU, and the async workers run their tasks in turn: a usage
//! query that arrived behind a few dozen batches waited for all of them. On the
//! intake runtime those batches no longer stand in the workers' queue, and when
//! the cores are saturated the scheduler gives a request thread the core before
//! an intake thread (docs/benchmarks.md, "Background work yields the CPU to requests"). What
//! a batch waits for (the log's group commit, the projector's headroom) works
//! across runtimes: those are tokio's channels and timers.

use std::future::Future;
use std::sync::OnceLock;

use tracing::Instrument;

use crate::error::ApiError;

/// Threads of the intake runtime: one per core, as tokio's default for workers.
fn intake_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// The intake runtime, started on first use and kept for the process's life (a
/// runtime may not be dropped inside another one). `None`: it could not start,
/// and intake runs where it is called.
fn intake() -> Option<&'static tokio::runtime::Runtime> {
    static INTAKE: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    INTAKE
        .get_or_init(|| {
            let built = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(intake_threads())
                .thread_name("tally-intake")
                .on_thread_start(|| {
                    if let Err(why) = tally_projection::priority::run_as_background_thread() {
                        tracing::warn!("intake runs at normal priority: {why}");
                    }
                })
                .enable_all()
                .build();
            match built {
                Ok(runtime) => Some(runtime),
                Err(error) => {
                    tracing::warn!(%error, "no intake runtime; ingest runs on the request workers");
                    None
                }
            }
        })
        .as_ref()
}

/// Runs `work` on the intake runtime and waits for its answer.
pub(crate) async fn run<T: Send + 'static>(
    work: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    let Some(runtime) = intake() else {
        return work.await;
    };
    // The request's span (its id) goes along, so what ingest logs names it. A
    // task whose request timed out or was dropped still finishes: the client
    // retries with the same event ids, and dedup keeps one.
    match runtime
        .spawn(work.instrument(tracing::Span::current()))
        .await
    {
        Ok(answer) => answer,
        Err(join_error) => {
            tracing::error!(%join_error, "an intake task failed");
            Err(ApiError::internal("internal error; it has been logged"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_on_the_intake_threads_at_background_priority() {
        let (thread, nice) = run(async {
            let thread = std::thread::current().name().map(str::to_string);
            #[cfg(target_os = "linux")]
            let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid())).ok();
            #[cfg(not(target_os = "linux"))]
            let nice = None::<i32>;
            Ok((thread, nice))
        })
        .await
        .unwrap();
        assert_eq!(thread.as_deref(), Some("tally-intake"));
        if cfg!(target_os = "linux") {
            assert!(nice >= Some(tally_projection::priority::BACKGROUND_NICE));
        }
        // An error comes back as the work's own.
        let refused = run(async { Err::<(), _>(ApiError::internal("no")) }).await;
        assert!(refused.is_err());
    }
}
