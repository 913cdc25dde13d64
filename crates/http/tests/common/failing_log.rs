//! A log that fails or holds appends on demand (fault injection), over the real
//! embedded log: for the tests that claim the service answers 5xx/503, loses
//! nothing acknowledged, and keeps working while its log is slow.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tally_domain::clock::ManualClock;
use tally_projection::CheckpointStore;

use super::{default_config, wall_clock_ms, Server};

/// A log whose appends fail: with nothing written (`NOT_WRITTEN`: a log poisoned by a
/// failed fsync) or with an unknown outcome (`UNKNOWN`: an I/O error mid-append); or
/// wait (`STALLED` for ever, `ATTEMPTS_HELD` for webhook attempts until released).
pub struct FailingLog {
    inner: Arc<dyn tally_log::Log>,
    failing: Arc<std::sync::atomic::AtomicU8>,
}

/// A server over `dir` whose log fails as the returned flag says (`HEALTHY` at first).
pub async fn start_with_failing_log(
    dir: &std::path::Path,
) -> (Server, Arc<std::sync::atomic::AtomicU8>) {
    let failing = Arc::new(std::sync::atomic::AtomicU8::new(HEALTHY));
    let flag = failing.clone();
    let server = Server::start_with_faults(
        dir,
        default_config(),
        Arc::new(ManualClock::new(wall_clock_ms())),
        move |inner| {
            Arc::new(FailingLog {
                inner,
                failing: flag,
            })
        },
        |sled| Arc::new(CheckpointStore::new(sled)),
    )
    .await;
    (server, failing)
}

pub const HEALTHY: u8 = 0;
pub const NOT_WRITTEN: u8 = 1;
pub const UNKNOWN: u8 = 2;
/// Appends never finish (a hung disk or broker).
pub const STALLED: u8 = 3;
/// Only the records of idempotent responses fail, with nothing written.
pub const RESPONSES_NOT_WRITTEN: u8 = 4;

/// Webhook attempt records wait, unwritten, while the mode stays this (a slow
/// disk under the dispatcher's records); everything else is written.
pub const ATTEMPTS_HELD: u8 = 5;

fn is_response_record(payload: &[u8]) -> bool {
    matches!(
        tally_proto::decode_record(payload),
        Ok((tally_domain::record::Record::IdempotentResponse(_), _))
    )
}

fn is_attempt_record(payload: &[u8]) -> bool {
    matches!(
        tally_proto::decode_record(payload),
        Ok((tally_domain::record::Record::WebhookAttempt(_), _))
    )
}

#[async_trait::async_trait]
impl tally_log::Log for FailingLog {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn partition_count(&self) -> u32 {
        self.inner.partition_count()
    }
    async fn append(&self, key: &[u8], payload: Vec<u8>) -> Result<u64, tally_log::LogError> {
        match self.failing.load(Ordering::SeqCst) {
            NOT_WRITTEN => Err(tally_log::LogError::Poisoned),
            UNKNOWN => Err(tally_log::LogError::Io(std::io::Error::other(
                "injected append failure",
            ))),
            STALLED => std::future::pending().await,
            RESPONSES_NOT_WRITTEN if is_response_record(&payload) => {
                Err(tally_log::LogError::Poisoned)
            }
            ATTEMPTS_HELD if is_attempt_record(&payload) => {
                while self.failing.load(Ordering::SeqCst) == ATTEMPTS_HELD {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                self.inner.append(key, payload).await
            }
            _ => self.inner.append(key, payload).await,
        }
    }
    async fn reader(
        &self,
        partition: u32,
        from_offset: u64,
    ) -> Result<Box<dyn tally_log::LogReader>, tally_log::LogError> {
        self.inner.reader(partition, from_offset).await
    }
    async fn end_offset(&self, partition: u32) -> Result<u64, tally_log::LogError> {
        self.inner.end_offset(partition).await
    }
    async fn commit(
        &self,
        group: &str,
        partition: u32,
        next_offset: u64,
    ) -> Result<(), tally_log::LogError> {
        self.inner.commit(group, partition, next_offset).await
    }
    async fn committed(
        &self,
        group: &str,
        partition: u32,
    ) -> Result<Option<u64>, tally_log::LogError> {
        self.inner.committed(group, partition).await
    }
}
