//! The projection key layout. Every table is one leading byte; variable-length
//! components end with a 0x00 separator (ids never contain it); integers are fixed
//! 8-byte big-endian with the sign bit flipped so byte order is numeric order.
//!
//! | table | key | value |
//! |---|---|---|
//! | `S` | store_id | StoreCreated (proto) |
//! | `K` | sha256(api key) | store_id + mode byte |
//! | `C` | store, mode, customer_id | Customer (proto) |
//! | `X` | store, mode, external_id | customer_id |
//! | `c` | store, mode, created_at, customer_id | (empty) newest-first listing |
//! | `M` | store, mode, meter_id | Meter (proto) |
//! | `N` | store, mode, meter name | meter_id |
//! | `m` | store, mode, created_at, meter_id | (empty) |
//! | `F` | store, mode, received_at, partition, offset | (index, fingerprint) of each event the usage record at that position stored (event_index.rs) |
//! | `G` | (none) | received_at below which `F` rows are pruned (8-byte int) |
//! | `V` | (none) | the projection's format version (u32; `projector::PROJECTION_FORMAT_VERSION`) |
//! | `A` | store, mode, meter, customer ("" = all), minute | Aggregate |
//! | `U` | store, mode, meter, customer ("" = all), minute, distinct value | (empty) |
//! | `a` | store, mode, account_id | CreditAccount (proto) |
//! | `b` | store, mode, account_id (or `system:*`) | balance (16-byte decimal) |
//! | `n` | store, mode, customer_id, account name | account_id |
//! | `l` | store, mode, created_at, account_id | (empty) newest-first listing |
//! | `k` | store, mode, customer_id, created_at, account_id | (empty) per customer |
//! | `T` | store, mode, transaction_id | CreditTransaction (proto) |
//! | `r` | store, mode, reversed transaction_id | reversal transaction_id |
//! | `i` | store, mode, idempotency key | transaction_id |
//! | `L` | store, mode, account_id, seq | StoredEntry (proto) |
//! | `j` | store, mode, entry_id | account_id, seq |
//! | `h` | store, mode, account_id, created_at, seq | balance after (16 bytes) |
//! | `q` | store, mode, account_id | next entry seq (u64) |
//! | `W` | store, mode, created_at, event_id | LedgerEvent (proto), for webhooks |
//! | `w` | store, mode, endpoint_id | WebhookEndpoint (proto) |
//! | `D` | store, mode, endpoint_id, event_id | WebhookDelivery (proto) |
//! | `Q` | due_at, store, mode, endpoint_id, event_id | (empty) http deliveries due |
//! | `P` | store, mode, endpoint_id, created_at, event_id | (empty) cli feed, oldest first |
//! | `Y` | store, mode, endpoint_id, at, event_id, attempt | WebhookAttempt (proto) |
//! | `O` | partition, offset | Outcome (JSON) of a record apply refused (outcome.rs) |
//! | `B` | store, mode, meter_id, event_id | (empty) event folded by a backfill step |

use tally_domain::Mode;

use crate::error::EngineError;

pub const STORE: u8 = b'S';
pub const API_KEY: u8 = b'K';
pub const CUSTOMER: u8 = b'C';
pub const CUSTOMER_EXTERNAL: u8 = b'X';
pub const CUSTOMER_LIST: u8 = b'c';
pub const METER: u8 = b'M';
pub const METER_NAME: u8 = b'N';
pub const METER_LIST: u8 = b'm';
pub const STORED_EVENTS: u8 = b'F';
pub const STORED_EVENTS_PRUNED: u8 = b'G';
pub const PROJECTION_FORMAT: u8 = b'V';
pub const AGGREGATE: u8 = b'A';
pub const UNIQUE: u8 = b'U';

pub const CREDIT_ACCOUNT: u8 = b'a';
pub const CREDIT_BALANCE: u8 = b'b';
pub const CREDIT_ACCOUNT_NAME: u8 = b'n';
pub const CREDIT_ACCOUNT_LIST: u8 = b'l';
pub const CREDIT_ACCOUNT_BY_CUSTOMER: u8 = b'k';
pub const CREDIT_TRANSACTION: u8 = b'T';
pub const CREDIT_REVERSED: u8 = b'r';
pub const CREDIT_IDEMPOTENCY: u8 = b'i';
pub const CREDIT_ENTRY: u8 = b'L';
pub const CREDIT_ENTRY_ID: u8 = b'j';
pub const CREDIT_BALANCE_HISTORY: u8 = b'h';
pub const CREDIT_ENTRY_SEQ: u8 = b'q';
pub const WEBHOOK_EVENT: u8 = b'W';
pub const WEBHOOK_ENDPOINT: u8 = b'w';
pub const WEBHOOK_DELIVERY: u8 = b'D';
pub const WEBHOOK_DUE: u8 = b'Q';
pub const WEBHOOK_PENDING: u8 = b'P';
pub const WEBHOOK_ATTEMPT: u8 = b'Y';
pub const OUTCOME: u8 = b'O';
pub const BACKFILLED: u8 = b'B';

/// The customer component of meter-wide (all customers) usage rows.
pub const ALL_CUSTOMERS: &str = "";

#[derive(Debug, Clone)]
pub struct Key(Vec<u8>);

impl Key {
    pub fn table(table: u8) -> Key {
        let mut bytes = Vec::with_capacity(64);
        bytes.push(table);
        Key(bytes)
    }

    /// A store-and-environment scoped key of `table`.
    pub fn scoped(table: u8, store_id: &str, mode: Mode) -> Key {
        Key::table(table).text(store_id).mode(mode)
    }

    pub fn text(mut self, component: &str) -> Key {
        self.0.extend_from_slice(component.as_bytes());
        self.0.push(0);
        self
    }

    pub fn mode(mut self, mode: Mode) -> Key {
        self.0.push(mode.key_byte());
        self
    }

    pub fn int(mut self, value: i64) -> Key {
        self.0
            .extend_from_slice(&((value as u64) ^ (1 << 63)).to_be_bytes());
        self
    }

    pub fn uint(mut self, value: u64) -> Key {
        self.0.extend_from_slice(&value.to_be_bytes());
        self
    }

    /// A final component without separator (caller-supplied ids, raw digests).
    pub fn tail(mut self, bytes: &[u8]) -> Key {
        self.0.extend_from_slice(bytes);
        self
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Reads an `int` component back.
pub fn read_int(bytes: &[u8]) -> i64 {
    let raw: [u8; 8] = bytes[..8].try_into().expect("8 bytes");
    (u64::from_be_bytes(raw) ^ (1 << 63)) as i64
}

/// The text after the last separator-terminated component at `start`.
pub fn read_text(bytes: &[u8], start: usize) -> Option<(&str, usize)> {
    let rest = bytes.get(start..)?;
    let end = rest.iter().position(|b| *b == 0)?;
    let text = std::str::from_utf8(&rest[..end]).ok()?;
    Some((text, start + end + 1))
}

/// Where a usage record's stored events are listed (table `F`): by scope, then
/// receipt time, then log position, so a scope's events list in receipt order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEventsKey {
    pub store_id: String,
    pub mode: Mode,
    pub received_at_ms: i64,
    pub partition: u32,
    pub offset: u64,
}

/// Bytes after the scope in an `F` key: receipt time, partition, offset.
const STORED_EVENTS_TAIL_BYTES: usize = 8 + 4 + 8;

impl StoredEventsKey {
    pub fn encode(&self) -> Vec<u8> {
        Key::scoped(STORED_EVENTS, &self.store_id, self.mode)
            .int(self.received_at_ms)
            .tail(&self.partition.to_be_bytes())
            .uint(self.offset)
            .into_bytes()
    }

    /// The key's prefix for one scope, optionally up to a receipt time.
    pub fn scope_prefix(store_id: &str, mode: Mode) -> Vec<u8> {
        Key::scoped(STORED_EVENTS, store_id, mode).into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<StoredEventsKey, EngineError> {
        let corrupt = || EngineError::Corrupt("a stored-events key does not decode".into());
        if bytes.first() != Some(&STORED_EVENTS) {
            return Err(corrupt());
        }
        let (store_id, at) = read_text(bytes, 1).ok_or_else(corrupt)?;
        let mode = read_mode(*bytes.get(at).ok_or_else(corrupt)?, "a stored-events key")?;
        let tail = bytes.get(at + 1..).ok_or_else(corrupt)?;
        if tail.len() != STORED_EVENTS_TAIL_BYTES {
            return Err(corrupt());
        }
        Ok(StoredEventsKey {
            store_id: store_id.to_string(),
            mode,
            received_at_ms: read_int(&tail[..8]),
            partition: u32::from_be_bytes(tail[8..12].try_into().expect("4")),
            offset: u64::from_be_bytes(tail[12..].try_into().expect("8")),
        })
    }
}

/// The mode a stored key or value names. Any byte but the two modes' is corrupt
/// storage: fail-stop, never a default that would file data under the other mode.
pub fn read_mode(byte: u8, what: &str) -> Result<Mode, EngineError> {
    Mode::from_key_byte(byte).ok_or_else(|| {
        EngineError::Corrupt(format!("{what} holds an unknown mode byte 0x{byte:02x}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_sort_numerically() {
        let a = Key::table(b'x').int(-5).into_bytes();
        let b = Key::table(b'x').int(3).into_bytes();
        let c = Key::table(b'x').int(1_000).into_bytes();
        assert!(a < b && b < c);
        assert_eq!(read_int(&b[1..]), 3);
        assert_eq!(read_int(&a[1..]), -5);
    }

    #[test]
    fn stored_events_keys_round_trip_and_sort_by_receipt() {
        let key = StoredEventsKey {
            store_id: "st_1".into(),
            mode: Mode::Test,
            received_at_ms: -3,
            partition: 7,
            offset: u64::MAX - 1,
        };
        assert_eq!(StoredEventsKey::decode(&key.encode()).unwrap(), key);
        let later = StoredEventsKey {
            received_at_ms: 5,
            offset: 0,
            ..key.clone()
        };
        assert!(key.encode() < later.encode());
        assert!(StoredEventsKey::decode(&key.encode()[..10]).is_err());
    }
}
