//! A cache of usage records recently read back from the log (event reads, listings,
//! dedup confirmations): records never change, so entries never go stale; it is
//! bounded by the records' bytes.

use std::collections::HashMap;
use std::sync::Arc;

use tally_core::overlay::StoredBatch;

/// Bytes of usage records (as stored in the log) the read cache keeps: a few hundred
/// full ingest batches; bounds the memory of listings and dedup confirmations.
pub const RECENT_RECORDS_MAX_BYTES: usize = 32 * 1024 * 1024;

/// Usage records recently read from the log, oldest evicted first, bounded by
/// [`RECENT_RECORDS_MAX_BYTES`]. Records never change, so an entry never goes stale.
#[derive(Debug, Default)]
pub struct RecentRecords {
    inner: std::sync::Mutex<RecentInner>,
}

#[derive(Debug, Default)]
struct RecentInner {
    records: HashMap<(u32, u64), (usize, Arc<StoredBatch>)>,
    order: std::collections::VecDeque<(u32, u64)>,
    bytes: usize,
}

impl RecentRecords {
    pub fn get(&self, partition: u32, offset: u64) -> Option<Arc<StoredBatch>> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner
            .records
            .get(&(partition, offset))
            .map(|(_, b)| b.clone())
    }

    pub fn put(&self, partition: u32, offset: u64, bytes: usize, batch: Arc<StoredBatch>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if bytes > RECENT_RECORDS_MAX_BYTES
            || inner
                .records
                .insert((partition, offset), (bytes, batch))
                .is_some()
        {
            return;
        }
        inner.order.push_back((partition, offset));
        inner.bytes += bytes;
        while inner.bytes > RECENT_RECORDS_MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some((size, _)) = inner.records.remove(&oldest) {
                inner.bytes -= size;
            }
        }
    }
}
