//! Which log partition every projection row belongs to: what a split cluster's
//! changelog writes per partition, and what a node clears before it restores one
//! partition from it (ARCHITECTURE.md, "Partitions and ownership").
//!
//! A store's records all go to one partition (`Record::partition_key`), so a row
//! that names a store belongs to that store's partition; rows keyed by a record's
//! position belong to the position's partition. Two kinds belong to no partition:
//! what every node applies whoever owns the store (stores and API keys: a node
//! needs them to route any request), and a node's own bookkeeping (format stamp,
//! skip marks); the stored-event prune line belongs to every partition.

use crate::error::EngineError;
use crate::keys::{self, KeyReader};

/// Where a projection row belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHome<'k> {
    /// Applied on every node (`Record::applies_on_every_node`): never written to a
    /// changelog, never cleared by a restore.
    EveryNode,
    /// This node's own bookkeeping: likewise.
    Node,
    /// Node-wide, carried by every partition's changelog: the stored-event prune
    /// line (`G`). A restore keeps the later of its own and the snapshot's (a
    /// prune deletes every row below its cut, so the line only says when the next
    /// prune runs).
    AllPartitions,
    /// A store's row: the store's partition (`tally_log::partition_of` of its id).
    Store(&'k str),
    /// A row of the record at this position.
    Position { partition: u32, offset: u64 },
    /// An idempotency claim, made by the API key with this hex SHA-256: the
    /// partition of the key's store.
    ApiKey(&'k str),
}

/// Tables whose key starts with the store id.
const STORE_FIRST: &[u8] = &[
    keys::CUSTOMER,
    keys::CUSTOMER_EXTERNAL,
    keys::CUSTOMER_LIST,
    keys::METER,
    keys::METER_NAME,
    keys::METER_LIST,
    keys::STORED_EVENTS,
    keys::AGGREGATE,
    keys::UNIQUE,
    keys::DISTINCT_SET,
    keys::CREDIT_ACCOUNT,
    keys::CREDIT_BALANCE,
    keys::CREDIT_ACCOUNT_NAME,
    keys::CREDIT_ACCOUNT_LIST,
    keys::CREDIT_ACCOUNT_BY_CUSTOMER,
    keys::CREDIT_TRANSACTION,
    keys::CREDIT_REVERSED,
    keys::CREDIT_IDEMPOTENCY,
    keys::CREDIT_ENTRY,
    keys::WEBHOOK_EVENT,
    keys::WEBHOOK_ENDPOINT,
    keys::WEBHOOK_DELIVERY,
    keys::WEBHOOK_PENDING,
    keys::WEBHOOK_ATTEMPT,
    keys::BACKFILLED,
    keys::PRODUCT,
    keys::PRODUCT_LIST,
    keys::METER_PRICED,
    keys::DISCOUNT,
    keys::DISCOUNT_CODE,
    keys::DISCOUNT_LIST,
    keys::CHECKOUT,
    keys::PAYMENT,
    keys::PAYMENT_LIST,
    keys::PAYMENT_BY_CUSTOMER,
    keys::PAYMENT_BY_SUBSCRIPTION,
    keys::SUBSCRIPTION,
    keys::DISPUTE,
    keys::BILLING_EVENT,
    keys::TAX_RATE,
    keys::USAGE_BINDING,
    keys::USAGE_BINDING_SCOPE,
    keys::SETTLEMENT_PERIOD_USAGE,
    keys::SETTLEMENT_TOTALS,
    keys::CREDIT_EXHAUSTED,
    keys::CHECKOUT_LIST,
    keys::TEST_CLOCK,
    keys::SUBSCRIPTION_LIST,
    keys::SUBSCRIPTION_BY_CUSTOMER,
    keys::STORE_SETTINGS,
    keys::AFFILIATE_INVITE,
    keys::AFFILIATE_INVITE_EMAIL,
    keys::AFFILIATE_INVITE_LIST,
    keys::AFFILIATE,
    keys::AFFILIATE_CODE,
    keys::AFFILIATE_LIST,
    keys::MODERATION_POLICY,
    keys::CREDIT_RESERVATION,
    keys::CREDIT_HOLDS,
    keys::CREDIT_RESERVATION_IDEMPOTENCY,
    keys::CREDIT_GRANT,
    keys::CREDIT_GRANTS_ACTIVE,
    keys::CREDIT_GRANT_LIST,
    keys::CREDIT_GRANT_SEQ,
    keys::CREDIT_BALANCE_LOW,
    keys::LATEST,
    keys::WEIGHTED,
    keys::WEIGHTED_POINT,
    keys::VOIDED_EVENT,
    keys::FOLD_SKIPPED,
    keys::REVISED_METER,
    keys::METER_CHANGED,
    keys::VOIDED_COUNT,
    keys::RECHARGE_PENDING,
];

/// Tables keyed by a record's position, the partition as an 8-byte integer.
const POSITION_FIRST: &[u8] = &[
    keys::LEDGER_BOOKED,
    keys::SETTLEMENT_PENDING,
    keys::SETTLEMENT_DONE,
];

/// Where the row at `key` belongs. A key of no known table, or one that does not
/// decode, is corrupt storage.
pub fn key_home(key: &[u8]) -> Result<KeyHome<'_>, EngineError> {
    let Some(&table) = key.first() else {
        return Err(EngineError::Corrupt("an empty projection key".into()));
    };
    let what = "a projection key";
    match table {
        keys::STORE | keys::API_KEY | keys::API_KEY_PERMISSIONS | keys::API_KEY_ID => {
            Ok(KeyHome::EveryNode)
        }
        keys::PROJECTION_FORMAT | keys::PARTITION_SKIPPED => Ok(KeyHome::Node),
        keys::STORED_EVENTS_PRUNED => Ok(KeyHome::AllPartitions),
        keys::OUTCOME => {
            // Partition as 4 bytes, then the offset (`outcome::outcome_key`).
            let partition = key
                .get(1..5)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes);
            let offset = key
                .get(5..13)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_be_bytes);
            match (partition, offset) {
                (Some(partition), Some(offset)) => Ok(KeyHome::Position { partition, offset }),
                _ => Err(EngineError::Corrupt(
                    "an outcome key does not decode".into(),
                )),
            }
        }
        keys::IDEMPOTENCY => Ok(KeyHome::ApiKey(KeyReader::new(key, table, what)?.text()?)),
        keys::IDEMPOTENCY_EXPIRY => {
            // The claim's time, then the whole claim key.
            let claim = key
                .get(9..)
                .ok_or_else(|| EngineError::Corrupt("a claim-expiry key does not decode".into()))?;
            key_home(claim)
        }
        keys::MINUTE_EVENTS | keys::REVISED_MINUTE | keys::WEBHOOK_DUE => {
            let mut reader = KeyReader::new(key, table, what)?;
            reader.int()?;
            Ok(KeyHome::Store(reader.text()?))
        }
        keys::SUBSCRIPTION_DUE | keys::GRANT_DUE => {
            let mut reader = KeyReader::new(key, table, what)?;
            reader.mode()?;
            reader.int()?;
            Ok(KeyHome::Store(reader.text()?))
        }
        _ if POSITION_FIRST.contains(&table) => {
            let mut reader = KeyReader::new(key, table, what)?;
            let partition = u32::try_from(reader.uint()?)
                .map_err(|_| EngineError::Corrupt("a position key names no partition".into()))?;
            let offset = reader.uint()?;
            Ok(KeyHome::Position { partition, offset })
        }
        _ if STORE_FIRST.contains(&table) => {
            Ok(KeyHome::Store(KeyReader::new(key, table, what)?.text()?))
        }
        _ => Err(EngineError::Corrupt(format!(
            "a projection key of unknown table {:?}",
            table as char
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Key;
    use tally_domain::Mode;

    /// Every table constant of `keys.rs`, read from its source: a table added
    /// there without a home here fails this test.
    fn every_table() -> Vec<u8> {
        let source = include_str!("keys.rs");
        source
            .lines()
            .filter_map(|line| line.strip_prefix("pub const "))
            .filter(|line| line.contains(": u8 = b'"))
            .map(|line| {
                let (_, literal) = line.split_once(" = b'").expect("a byte literal");
                match literal.strip_prefix('\\') {
                    Some(escaped) => escaped.as_bytes()[0],
                    None => literal.as_bytes()[0],
                }
            })
            .collect()
    }

    #[test]
    fn every_table_has_a_home() {
        let tables = every_table();
        assert!(tables.len() >= 90, "found {} tables", tables.len());
        for table in tables {
            // The widest key shape any table reads: two 8-byte integers, then a
            // store id, a mode and more text.
            let mut key = vec![table];
            if table == keys::SUBSCRIPTION_DUE || table == keys::GRANT_DUE {
                key.push(Mode::Test.key_byte());
            }
            key.extend_from_slice(&Key::table(0).uint(3).uint(9).into_bytes()[1..]);
            let scoped = Key::scoped(0, "st_1", Mode::Test).text("x").into_bytes();
            let key_store_first = [&[table][..], &scoped[1..]].concat();
            if table == keys::IDEMPOTENCY_EXPIRY {
                // The claim's time, then a whole claim key.
                key = Key::table(table)
                    .int(3)
                    .tail(&Key::table(keys::IDEMPOTENCY).text("ab").into_bytes())
                    .into_bytes();
            }
            let home = key_home(&key_store_first).or_else(|_| key_home(&key));
            assert!(home.is_ok(), "table {:?}: {home:?}", table as char);
        }
        assert!(key_home(&[0xff, 1]).is_err());
        assert!(key_home(&[]).is_err());
    }

    #[test]
    fn rows_belong_to_the_store_or_position_they_name() {
        let scoped = |table| {
            Key::scoped(table, "st_9", Mode::Prod)
                .text("cus_1")
                .into_bytes()
        };
        assert_eq!(
            key_home(&scoped(keys::CUSTOMER)).unwrap(),
            KeyHome::Store("st_9")
        );
        assert_eq!(
            key_home(&scoped(keys::AGGREGATE)).unwrap(),
            KeyHome::Store("st_9")
        );
        assert_eq!(
            key_home(&keys::minute_events_key(7, "st_9", Mode::Prod, 2, 5)).unwrap(),
            KeyHome::Store("st_9")
        );
        assert_eq!(
            key_home(&keys::grant_due_key(Mode::Prod, 7, "st_9", "acc", "grt")).unwrap(),
            KeyHome::Store("st_9")
        );
        assert_eq!(
            key_home(&keys::ledger_booked_key(4, 11)).unwrap(),
            KeyHome::Position {
                partition: 4,
                offset: 11
            }
        );
        assert_eq!(
            key_home(&crate::outcome::outcome_key(3, 12)).unwrap(),
            KeyHome::Position {
                partition: 3,
                offset: 12
            }
        );
        let claim = Key::table(keys::IDEMPOTENCY)
            .text("abcd")
            .tail(b"key-1")
            .into_bytes();
        assert_eq!(key_home(&claim).unwrap(), KeyHome::ApiKey("abcd"));
        let expiry = Key::table(keys::IDEMPOTENCY_EXPIRY)
            .int(5)
            .tail(&claim)
            .into_bytes();
        assert_eq!(key_home(&expiry).unwrap(), KeyHome::ApiKey("abcd"));
        let store = Key::table(keys::STORE).text("st_9").into_bytes();
        assert_eq!(key_home(&store).unwrap(), KeyHome::EveryNode);
        assert_eq!(
            key_home(&keys::partition_skipped_key(1)).unwrap(),
            KeyHome::Node
        );
    }
}
