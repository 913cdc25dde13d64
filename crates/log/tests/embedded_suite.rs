//! The shared log suite against the embedded log (no broker needed).

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use tally_log::embedded::{EmbeddedLog, SegmentSizes};
use tally_log::testsuite::{self, LogFactory};
use tally_log::Log;

struct EmbeddedFactory {
    dir: PathBuf,
    sizes: SegmentSizes,
}

#[async_trait]
impl LogFactory for EmbeddedFactory {
    async fn open(&self) -> Arc<dyn Log> {
        // The previous handle may still be closing its writer thread; retry the lock.
        for _ in 0..100 {
            match EmbeddedLog::open_with(&self.dir, self.sizes) {
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
        sizes: SegmentSizes::default(),
    };
    testsuite::run_all(&factory).await;
}

/// The same suite on segments of a few records, zeros written ahead a few at a
/// time: every append rolls or extends a segment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_log_with_tiny_segments_passes_the_shared_suite() {
    let dir = tempfile::tempdir().unwrap();
    let factory = EmbeddedFactory {
        dir: dir.path().join("log"),
        sizes: SegmentSizes {
            max_bytes: 256,
            preallocate_bytes: 64,
        },
    };
    testsuite::run_all(&factory).await;
}
