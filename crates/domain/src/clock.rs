//! The injected clock. Domain and engine code ask a [`Clock`] for the time, never the
//! operating system, so tests can move time forward without sleeping.

use std::sync::atomic::{AtomicI64, Ordering};

pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// A clock that only moves when told to; for tests and the test-clock API.
#[derive(Debug)]
pub struct ManualClock {
    now_ms: AtomicI64,
}

impl ManualClock {
    pub fn new(start_ms: i64) -> Self {
        ManualClock {
            now_ms: AtomicI64::new(start_ms),
        }
    }

    pub fn set_ms(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    pub fn advance_ms(&self, delta_ms: i64) {
        self.now_ms.fetch_add(delta_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
