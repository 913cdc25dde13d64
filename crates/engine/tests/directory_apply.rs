//! Stores in apply: a store id recorded twice keeps its first record (a retried
//! idempotent store creation derives the same id), and a key revoked in between
//! stays revoked, whichever chunking the records are applied in.

use tally_domain::record::{Record, RecordMeta, StoreRecord};
use tally_engine::directory_access::key_id_of;
use tally_engine::keys;
use tally_engine::projector::{apply_chunk_in_memory, ProjectorState};
use tally_engine::stores::key_digest;
use tally_log::LogEntry;
use tally_projection::{MemoryStore, ProjectionStore};

fn store(name: &str, at: i64) -> StoreRecord {
    StoreRecord {
        store_id: "st_same".into(),
        name: name.into(),
        prod_key_sha256: key_digest("tally_prod_a"),
        test_key_sha256: key_digest("tally_test_a"),
        created_at_ms: at,
    }
}

#[test]
fn a_store_recorded_twice_keeps_its_first_record_and_its_revocations() {
    let records = [
        Record::StoreCreated(store("first", 1)),
        Record::ApiKeyRevoked {
            store_id: "st_same".into(),
            key_id: key_id_of(&key_digest("tally_test_a")),
        },
        Record::StoreCreated(store("second", 2)),
    ];
    let entries: Vec<LogEntry> = records
        .iter()
        .enumerate()
        .map(|(i, record)| LogEntry {
            partition: 0,
            offset: i as u64,
            next_offset: i as u64 + 1,
            payload: tally_proto::encode_record_with(record, &RecordMeta::default()),
        })
        .collect();
    for cut in 0..=entries.len() {
        let memory = MemoryStore::new();
        let mut state = ProjectorState::empty();
        for chunk in [&entries[..cut], &entries[cut..]] {
            apply_chunk_in_memory(&memory, &mut state, chunk, &entries).unwrap();
        }
        let stored = memory
            .get(&keys::Key::table(keys::STORE).text("st_same").into_bytes())
            .unwrap()
            .expect("the store");
        let stored = tally_engine::codec::decode_store(&stored).unwrap();
        assert_eq!(stored, store("first", 1), "cut {cut}");
        let test_key = keys::Key::table(keys::API_KEY)
            .tail(&key_digest("tally_test_a"))
            .into_bytes();
        assert_eq!(memory.get(&test_key).unwrap(), None, "revoked, cut {cut}");
        let prod_key = keys::Key::table(keys::API_KEY)
            .tail(&key_digest("tally_prod_a"))
            .into_bytes();
        assert!(memory.get(&prod_key).unwrap().is_some());
    }
}
