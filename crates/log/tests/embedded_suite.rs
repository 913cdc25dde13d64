//! The shared log suite against the embedded log (no broker needed).

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use tally_log::embedded::EmbeddedLog;
use tally_log::testsuite::{self, LogFactory};
use tally_log::Log;

struct EmbeddedFactory {
    dir: PathBuf,
}

#[async_trait]
impl LogFactory for EmbeddedFactory {
    async fn open(&self) -> Arc<dyn Log> {
        // The previous handle may still be closing its writer thread; retry the lock.
        for _ in 0..100 {
            match EmbeddedLog::open(&self.dir) {
                Ok(log) => return Arc::new(log),
                Err(tally_log::LogError::Locked(_)) => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await
                }
                Err(e) => panic!("open embedded log: {e}"),
            }
        }
        panic!("embedded log stayed locked");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_log_passes_the_shared_suite() {
    let dir = tempfile::tempdir().unwrap();
    let factory = EmbeddedFactory {
        dir: dir.path().join("log"),
    };
    testsuite::run_all(&factory).await;
}
