//! Warming a store's pages for reads an apply is about to make: the reads are
//! made ahead, several at once, and their answers dropped, so the apply (one
//! thread, one read after another) finds the pages in memory. A large store's
//! rows are disk reads, and a disk answers several at once faster than one after
//! another (ARCHITECTURE.md, "Voids": a void reads scattered buckets of a long
//! history). Warming never changes what a read answers: it only reads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::{scan_prefix, ProjectionStore, Visit};

/// Threads one warm spreads its reads over: enough to keep a disk's queue full,
/// few enough not to crowd a small machine's cores (each read mostly waits).
pub const WARM_THREADS: usize = 8;

/// Reads below which warming is not worth threads: the apply reads them itself.
pub const WARM_PARALLEL_FROM: usize = 16;

/// Rows one warmed prefix visits at most: a warm loads pages, and a prefix past
/// this is a scan the apply makes anyway (and reads in order, cheaply).
pub const WARM_PREFIX_MAX_ROWS: usize = 4096;

/// One read to make ahead.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WarmRead {
    /// A point read of this key.
    Key(Vec<u8>),
    /// A scan of the keys under this prefix.
    Prefix(Vec<u8>),
}

/// Makes `reads` against `store`, spread over up to `WARM_THREADS` threads, and
/// drops their answers. A failed read is left to the apply, which makes it again
/// and reports it; keys a write-back layer holds need no read. Each thread takes
/// the next read not yet taken, so all stay busy until the last reads: a fixed
/// share each left the disk's queue short while the threads with slow shares
/// (a minute's scan of several rows) finished alone.
///
/// The threads are a pool that lives as long as the process: a thread started
/// per warm came with a fresh allocator heap, and the kernel zeroing its new
/// pages was half of a void's CPU (docs/benchmarks.md, "Warm threads that stay").
pub fn warm(store: &dyn ProjectionStore, reads: &[WarmRead]) {
    if reads.len() < WARM_PARALLEL_FROM {
        return;
    }
    // No pool (its threads did not start): the apply reads the rows itself.
    let Some(pool) = pool() else { return };
    let next = AtomicUsize::new(0);
    pool.scope(|scope| {
        for _ in 0..WARM_THREADS.min(reads.len()) {
            scope.spawn(|_| {
                // A warm that panicked (a bug in a store's read) is the apply's
                // to meet when it reads the same rows, not a panic of the scope
                // in the middle of an apply.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    warm_taking(store, reads, &next)
                }));
            });
        }
    });
}

/// The warm threads, started at the first warm.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(WARM_THREADS)
            .thread_name(|_| "tally-warm".into())
            .build()
            .map_err(|error| tracing::warn!(%error, "no warm threads: reads are not made ahead"))
            .ok()
    })
    .as_ref()
}

/// Makes the reads `next` hands out, one at a time, until none is left or one
/// fails (the store is then failing: the apply meets it).
fn warm_taking(store: &dyn ProjectionStore, reads: &[WarmRead], next: &AtomicUsize) {
    while let Some(read) = reads.get(next.fetch_add(1, Ordering::Relaxed)) {
        let done = match read {
            WarmRead::Key(key) if store.unwritten(key).is_some() => Ok(()),
            WarmRead::Key(key) => store.get(key).map(drop),
            WarmRead::Prefix(prefix) => {
                let mut rows = 0;
                scan_prefix(store, prefix, false, &mut |_, _| {
                    rows += 1;
                    if rows < WARM_PREFIX_MAX_ROWS {
                        Visit::Continue
                    } else {
                        Visit::Stop
                    }
                })
            }
        };
        if done.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Bound;

    use super::*;
    use crate::memory::MemoryStore;
    use crate::{Change, StoreError};

    /// A store that counts the reads made of it, and the threads that made them
    /// (or panics at each read: a bug in a store).
    #[derive(Debug, Default)]
    struct Counting {
        inner: MemoryStore,
        gets: AtomicUsize,
        scanned_rows: AtomicUsize,
        readers: std::sync::Mutex<std::collections::HashSet<std::thread::ThreadId>>,
        panics: bool,
        /// Each read waits this long, as a disk read does: every thread of a
        /// warm then takes some of its reads.
        read_takes: std::time::Duration,
    }

    impl ProjectionStore for Counting {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            assert!(!self.panics, "a store's read that panics");
            std::thread::sleep(self.read_takes);
            self.gets.fetch_add(1, Ordering::Relaxed);
            self.readers
                .lock()
                .unwrap()
                .insert(std::thread::current().id());
            self.inner.get(key)
        }
        fn scan(
            &self,
            start: Bound<&[u8]>,
            end: Bound<&[u8]>,
            reverse: bool,
            visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit,
        ) -> Result<(), StoreError> {
            self.inner.scan(start, end, reverse, &mut |k, v| {
                self.scanned_rows.fetch_add(1, Ordering::Relaxed);
                visit(k, v)
            })
        }
        fn apply(&self, changes: Vec<Change>, positions: &[(u32, u64)]) -> Result<(), StoreError> {
            self.inner.apply(changes, positions)
        }
        fn position(&self, partition: u32) -> Result<u64, StoreError> {
            self.inner.position(partition)
        }
        fn flush(&self) -> Result<(), StoreError> {
            Ok(())
        }
        fn aux_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.aux_get(key)
        }
        fn aux_put(&self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
            self.inner.aux_put(key, value)
        }
        fn aux_scan(&self, visit: &mut dyn FnMut(&[u8], &[u8]) -> Visit) -> Result<(), StoreError> {
            self.inner.aux_scan(visit)
        }
    }

    fn rows(store: &dyn ProjectionStore) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut rows = Vec::new();
        scan_prefix(store, b"", false, &mut |k, v| {
            rows.push((k.to_vec(), v.to_vec()));
            Visit::Continue
        })
        .unwrap();
        rows
    }

    #[test]
    fn warming_makes_every_read_once_and_changes_nothing() {
        let store = Counting::default();
        let changes: Vec<Change> = (0..100u32)
            .map(|i| (format!("k{i:03}").into_bytes(), Some(vec![i as u8])))
            .collect();
        store.apply(changes, &[(0, 7)]).unwrap();
        let before = rows(&store);
        store.scanned_rows.store(0, Ordering::Relaxed);
        // Present and absent keys, and a prefix of ten rows.
        let mut reads: Vec<WarmRead> = (50..150u32)
            .map(|i| WarmRead::Key(format!("k{i:03}").into_bytes()))
            .collect();
        reads.push(WarmRead::Prefix(b"k01".to_vec()));
        warm(&store, &reads);
        assert_eq!(store.gets.load(Ordering::Relaxed), 100);
        assert_eq!(store.scanned_rows.load(Ordering::Relaxed), 10);
        assert_eq!(rows(&store), before);
        assert_eq!(store.position(0).unwrap(), 7);
    }

    #[test]
    fn a_few_reads_are_left_to_the_apply() {
        let store = Counting::default();
        let reads: Vec<WarmRead> = (0..WARM_PARALLEL_FROM - 1)
            .map(|i| WarmRead::Key(vec![i as u8]))
            .collect();
        warm(&store, &reads);
        assert_eq!(store.gets.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn warms_share_threads_that_stay() {
        let store = Counting {
            read_takes: std::time::Duration::from_millis(1),
            ..Counting::default()
        };
        let reads: Vec<WarmRead> = (0..4 * WARM_PARALLEL_FROM)
            .map(|i| WarmRead::Key(vec![i as u8]))
            .collect();
        for _ in 0..5 {
            warm(&store, &reads);
        }
        assert_eq!(store.gets.load(Ordering::Relaxed), 5 * reads.len());
        let readers = store.readers.lock().unwrap();
        // Threads started per warm would be new ones each time (a `ThreadId` is
        // never reused): up to five times as many.
        assert!(
            readers.len() <= WARM_THREADS,
            "{} threads read for five warms",
            readers.len()
        );
        assert!(!readers.contains(&std::thread::current().id()));
    }

    #[test]
    fn a_read_that_panics_is_left_to_the_apply() {
        let store = Counting {
            panics: true,
            ..Counting::default()
        };
        let reads: Vec<WarmRead> = (0..2 * WARM_PARALLEL_FROM)
            .map(|i| WarmRead::Key(vec![i as u8]))
            .collect();
        warm(&store, &reads);
        // The pool outlives the panics: the next warm still reads.
        let store = Counting::default();
        warm(&store, &reads);
        assert_eq!(store.gets.load(Ordering::Relaxed), reads.len());
    }
}
