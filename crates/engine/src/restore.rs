//! Restoring one partition from its changelog snapshot (deploy/README.md, "Restore
//! from the changelog"): the node's own rows of the partition give way to the
//! snapshot's, in one commit with a skip mark at the snapshot's position, so the
//! runtime's log restore then applies only the records after it.

use std::collections::BTreeSet;

use tally_core::changelog_store::rows_of_partitions;
use tally_core::error::EngineError;
use tally_core::event_index;
use tally_core::key_home::{key_home, KeyHome};
use tally_core::keys::{self, StoredEventsKey};
use tally_core::overlay::BucketCache;
use tally_log::changelog::PartitionSnapshot;
use tally_projection::{Change, ProjectionStore};

use crate::projector::{Applied, ProjectorState};

/// Replaces `partition`'s rows in `store` with `snapshot`'s and marks the partition
/// skipped from the snapshot's position. Rows of records at or past that position
/// stay: only what every node applies can have written them here (the node skipped
/// the rest), and the log restore will not apply those records again. Returns what
/// the caches must learn (the partition's meters and test clocks).
pub fn restore_partition(
    store: &dyn ProjectionStore,
    state: &mut ProjectorState,
    partitions: u32,
    partition: u32,
    snapshot: PartitionSnapshot,
) -> Result<Applied, EngineError> {
    let own = rows_of_partitions(store, partitions, &BTreeSet::from([partition]))?
        .remove(&partition)
        .unwrap_or_default();
    let mut changes: Vec<Change> = Vec::with_capacity(own.len() + snapshot.rows.len() + 1);
    let mut removed_events = Vec::new();
    let mut own_prune_line = None;
    for (key, value) in own {
        if key.first() == Some(&keys::STORED_EVENTS) {
            removed_events.push((key.clone(), value));
        } else if key.first() == Some(&keys::STORED_EVENTS_PRUNED) {
            own_prune_line = Some(value);
            continue;
        }
        if snapshot.rows.contains_key(&key) {
            continue;
        }
        let later = matches!(key_home(&key)?, KeyHome::Position { offset, .. } if offset >= snapshot.position);
        if !later {
            changes.push((key, None));
        }
    }
    let mut applied = Applied::default();
    let mut added_events = Vec::new();
    for (key, value) in snapshot.rows {
        match key_home(&key)? {
            KeyHome::EveryNode | KeyHome::Node => continue,
            // The later prune line (module doc of `key_home`): both are 8-byte
            // ordered integers.
            KeyHome::AllPartitions if own_prune_line.as_ref().is_some_and(|own| *own >= value) => {
                continue
            }
            _ => {}
        }
        match key.first() {
            Some(&keys::STORED_EVENTS) => added_events.push((key.clone(), value.clone())),
            Some(&keys::METER) => applied
                .metering
                .meters
                .push(tally_core::codec::decode_meter(&value)?),
            _ => {}
        }
        changes.push((key, Some(value)));
    }
    changes.push((
        keys::partition_skipped_key(partition),
        Some(snapshot.position.to_be_bytes().to_vec()),
    ));
    let sparse_puts = state.sparse.puts_in(&changes);
    store.apply(changes, &[])?;
    state.sparse.note_committed(sparse_puts);
    for (key, value) in removed_events {
        let key = StoredEventsKey::decode(&key)?;
        state.index.remove_record(
            key.partition,
            key.offset,
            &event_index::decode_stored(&value)?,
        );
    }
    for (key, value) in added_events {
        let key = StoredEventsKey::decode(&key)?;
        state.index.add_record(
            key.partition,
            key.offset,
            &event_index::decode_stored(&value)?,
        );
    }
    // Cached buckets of the partition's stores may be the node's stale ones.
    state.buckets = BucketCache::default();
    applied.billing.test_clocks = tally_billing::lifecycle::test_clocks(store)?;
    Ok(applied)
}
