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
//! | `u` | store, mode, meter, customer, minute | the bucket's distinct values, up to `INLINE_DISTINCT_MAX` (codec.rs) |
//! | `U` | store, mode, meter, customer ("" = all), minute, distinct value | (empty): the all-customers bucket's values, and a customer bucket's past `INLINE_DISTINCT_MAX` |
//! | `a` | store, mode, account_id | CreditAccount (proto) |
//! | `b` | store, mode, account_id (or `system:*`) | balance (16-byte decimal), then the account's entry count (u64) and last `posted_at_ms` (i64): `codec::AccountTotals` |
//! | `n` | store, mode, customer_id, account name | account_id |
//! | `l` | store, mode, created_at, account_id | (empty) newest-first listing |
//! | `k` | store, mode, customer_id, created_at, account_id | (empty) per customer |
//! | `T` | store, mode, transaction_id | CreditTransaction (proto) with `entry_seqs`: each entry's seq in its account's `L` list (an entry id names its transaction, so a list cursor finds the entry here) |
//! | `r` | store, mode, reversed transaction_id | reversal transaction_id |
//! | `i` | store, mode, idempotency key | transaction_id |
//! | `L` | store, mode, account_id, seq | StoredEntry (proto), whose `posted_at_ms` never falls along the list: a balance `at` an instant bisects it |
//! | `W` | store, mode, created_at, event_id | LedgerEvent (proto), for webhooks |
//! | `w` | store, mode, endpoint_id | WebhookEndpoint (proto) |
//! | `D` | store, mode, endpoint_id, event_id | WebhookDelivery (proto) |
//! | `Q` | due_at, store, mode, endpoint_id, event_id | (empty) http deliveries due |
//! | `P` | store, mode, endpoint_id, created_at, event_id | (empty) cli feed, oldest first |
//! | `Y` | store, mode, endpoint_id, at, event_id, attempt | WebhookAttempt (proto) |
//! | `O` | partition, offset | Outcome (JSON) of a record apply refused (outcome.rs) |
//! | `B` | store, mode, meter_id, event_id | (empty) event folded by a backfill step |
//! | `I` | hex(api key sha256), idempotency key | claim: fingerprint, record time, response |
//! | `J` | claimed at (record time), `I` key | (empty) claims oldest first, for pruning |
//! | `R` | store, mode, product_id | product (protobuf) |
//! | `p` | store, mode, created_at, product_id | (empty) product listing, newest first |
//! | `Z` | store, mode, meter_id, product_id | (empty) the meter is priced on this active product |
//! | `d` | store, mode, discount_id | Discount (proto) |
//! | `e` | store, mode, code (lower case; rows of earlier builds: as given) | discount_id (a code names one discount whatever its case, deleted ones included) |
//! | `f` | store, mode, created_at, discount_id | (empty) discount listing |
//! | `o` | store, mode, checkout_id | Checkout (proto) |
//! | `t` | store, mode, transaction_id | Payment (proto): payments and refunds |
//! | `v` | store, mode, created_at, transaction_id | (empty) every payment and refund |
//! | `x` | store, mode, customer_id, created_at, transaction_id | (empty) per customer |
//! | `y` | store, mode, subscription_id, created_at, transaction_id | (empty) per subscription |
//! | `s` | store, mode, subscription_id | Subscription (proto) |
//! | `H` | store, mode, dispute_id | Dispute (proto) |
//! | `E` | store, mode, created_at, event_id | BillingEvent (proto), for webhooks |
//! | `g` | store, mode, country | tax rate in percent (decimal text) |
//! | `1` | store, mode, customer_id, meter_id | UsageBindings (proto): the customer's usage of the meter settled in credits |
//! | `2` | store, mode | (empty) the scope has usage bindings (one read per usage record decides whether to look further) |
//! | `3` | partition, offset | UsageSettled (proto): a usage record's settlement, pending until its record is applied |
//! | `4` | partition, offset | the usage record at that position is settled: the ids of the ledger transactions its settlement posted, one per line (the ledger audit reads them) |
//! | `5` | store, mode, source_id, price_id, period start | meter units the binding used in that period (16-byte decimal) |
//! | `6` | store, mode, source_id, price_id | SettlementTotals (proto) |
//! | `7` | store, mode, account_id | (empty) the account's exhaustion was announced and it has not held credits since |
//! | `8` | store, mode, created_at, checkout_id | (empty) checkout listing, newest first |
//! | `9` | mode, due_at, store, subscription_id | (empty) what is due on a subscription, soonest first (the scheduler's index) |
//! | `0` | store | the store's test clock: `to_ms` and the record time it was set at (two 8-byte ints) |
//! | `%` | store, mode, created_at, subscription_id | (empty) subscription listing, newest first |
//! | `&` | store, mode, customer_id, created_at, subscription_id | (empty) per customer |
//! | `$` | store, mode | StoreSettingsSet (proto): the store's billing settings |
//! | `(` | store, mode, invite_id | AffiliateInvite (proto) |
//! | `)` | store, mode, email | invite_id (one invitation per email) |
//! | `*` | store, mode, created_at, invite_id | (empty) invitation listing, newest first |
//! | `+` | store, mode, affiliate_id | Affiliate (proto) |
//! | `,` | store, mode, referral_code (lower case; rows of earlier builds: as generated) | affiliate_id |
//! | `-` | store, mode, created_at, affiliate_id | (empty) affiliate listing, newest first |
//! | `/` | store, mode | ModerationPolicy (proto): the store's moderation policy |
//! | `[` | sha256(api key) | the key's permissions, one per line (absent: every permission) |
//! | `]` | store, key_id | sha256(api key), mode byte, revoked byte (the admin API's handle on a key) |
//! | `<` | store, mode, reservation_id | ReservationState (proto): a credit reservation |
//! | `>` | store, mode, account_id | the account's live holds: (reservation id, amount, expiry) each (`codec::encode_holds`) |
//! | `=` | store, mode, idempotency key | reservation_id (a hold's idempotency key) |
//! | `{` | store, mode, grant_id | CreditGrant (proto): a credit grant |
//! | `}` | store, mode, account_id | the account's active grants in draw order (`codec::encode_active_grants`) |
//! | `~` | store, mode, account_id, created_at, grant_id | (empty) grant listing per account |
//! | `^` | store, mode, account_id | the account's grant count (8-byte int): the next grant's `seq` |
//! | `?` | mode, expires_at, store, account_id, grant_id | (empty) an active grant's expiry, soonest first (the expiry sweep's index) |
//! | `;` | store, mode, account_id | (empty) the account's available balance is below its low-balance threshold (announced once per crossing) |
//! | `#` | partition, offset | the ids of the transactions the record at that position booked itself (expiries, auto-recharges, a purchase's grants: a checkout's, a subscription period's), one per line (the ledger audit replays them) |
//! | `@` | store, mode, meter, customer ("" = all), minute | LatestPoint of a `latest` meter's bucket: timestamp, value, event id (codec.rs) |
//! | `\|` | store, mode, meter, customer ("" = all), minute | WeightedBucket of a `time_weighted_sum` meter: the changes of the held value in that minute (codec.rs, domain `gauge`) |
//! | `:` | store, mode, meter, customer, timestamp, event_id | the event's value (16-byte decimal): a `time_weighted_sum` meter's events in time order, to find the value before and after an event that arrives out of order; pruned past the stored-event retention (metering `prune_weighted_points`) |
//! | `z` | minute, store, mode, partition, offset | the events of the usage record at that position whose timestamps fall in that minute: (index in the record, customer id, prints of the distinct values it folded) each (`codec::push_minute_event`); a void rebuilds a customer's bucket from these, and finds the customers whose buckets make the all-customers one; pruned past what can still be voided |
//! | `.` | store, mode, event_id | VoidMark (`codec::encode_void`): the stored event is voided: when, by which record, why |
//! | `_` | store, mode, meter_id, event_id | (empty) the event matched the meter but was not folded (the meter was not active when its record applied) |
//! | `` ` `` | store, mode, meter_id | (a revised meter) the definitions usage settlement charged by, oldest first, each with the offset of the store's partition from which apply counted by it (`codec::MeterDefinitions`; empty: a revision of an earlier build, definitions unknown) |
//! | `0x02` | minute, store, mode, meter_id | the revision whose definition the meter's charged usage of that minute follows since a revision step rebuilt it (8-byte int); pruned with the `z` rows |
//! | `0x01` | store, mode, partition, offset, meter_id | (empty) the record at that position created or changed the meter: a usage record matched by a gateway that had not applied that position decides the meter's events in apply (ARCHITECTURE.md, "Meters the gateway did not know") |
//! | `!` | partition | the first offset of the partition whose records this node skipped as another node's and has not restored (8-byte int; ARCHITECTURE.md "Partitions and ownership") |
//!
//! The aux space (not derived from the log, outside digests) holds one key:
//! `EVENT_INDEX_SIZE_HINT`, the event index's size when last noted (8-byte int),
//! so that start-up sizes the index once instead of growing it while loading.

use tally_domain::meter::Meter;
use tally_domain::Mode;

use crate::error::EngineError;

/// Aux key of the event index's size hint (module doc).
pub const EVENT_INDEX_SIZE_HINT: &[u8] = b"event-index-size";

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
pub const DISTINCT_SET: u8 = b'u';

pub const CREDIT_ACCOUNT: u8 = b'a';
pub const CREDIT_BALANCE: u8 = b'b';
pub const CREDIT_ACCOUNT_NAME: u8 = b'n';
pub const CREDIT_ACCOUNT_LIST: u8 = b'l';
pub const CREDIT_ACCOUNT_BY_CUSTOMER: u8 = b'k';
pub const CREDIT_TRANSACTION: u8 = b'T';
pub const CREDIT_REVERSED: u8 = b'r';
pub const CREDIT_IDEMPOTENCY: u8 = b'i';
pub const CREDIT_ENTRY: u8 = b'L';
// `j` (entry id to place), `h` (balance history) and `q` (entry count) were
// retired with projection format 9: `T`, `L` and `b` answer what they did. Not to
// be reused for another table while a projection of format 8 may still exist.
pub const WEBHOOK_EVENT: u8 = b'W';
pub const WEBHOOK_ENDPOINT: u8 = b'w';
pub const WEBHOOK_DELIVERY: u8 = b'D';
pub const WEBHOOK_DUE: u8 = b'Q';
pub const WEBHOOK_PENDING: u8 = b'P';
pub const WEBHOOK_ATTEMPT: u8 = b'Y';
pub const OUTCOME: u8 = b'O';
pub const BACKFILLED: u8 = b'B';
pub const IDEMPOTENCY: u8 = b'I';
pub const IDEMPOTENCY_EXPIRY: u8 = b'J';
pub const PRODUCT: u8 = b'R';
pub const PRODUCT_LIST: u8 = b'p';
pub const METER_PRICED: u8 = b'Z';
pub const DISCOUNT: u8 = b'd';
pub const DISCOUNT_CODE: u8 = b'e';
pub const DISCOUNT_LIST: u8 = b'f';
pub const CHECKOUT: u8 = b'o';
pub const PAYMENT: u8 = b't';
pub const PAYMENT_LIST: u8 = b'v';
pub const PAYMENT_BY_CUSTOMER: u8 = b'x';
pub const PAYMENT_BY_SUBSCRIPTION: u8 = b'y';
pub const SUBSCRIPTION: u8 = b's';
pub const DISPUTE: u8 = b'H';
pub const BILLING_EVENT: u8 = b'E';
pub const TAX_RATE: u8 = b'g';
pub const USAGE_BINDING: u8 = b'1';
pub const USAGE_BINDING_SCOPE: u8 = b'2';
pub const SETTLEMENT_PENDING: u8 = b'3';
pub const SETTLEMENT_DONE: u8 = b'4';
pub const SETTLEMENT_PERIOD_USAGE: u8 = b'5';
pub const SETTLEMENT_TOTALS: u8 = b'6';
pub const CREDIT_EXHAUSTED: u8 = b'7';
pub const CHECKOUT_LIST: u8 = b'8';
pub const SUBSCRIPTION_DUE: u8 = b'9';
pub const TEST_CLOCK: u8 = b'0';
pub const SUBSCRIPTION_LIST: u8 = b'%';
pub const SUBSCRIPTION_BY_CUSTOMER: u8 = b'&';
pub const STORE_SETTINGS: u8 = b'$';
pub const AFFILIATE_INVITE: u8 = b'(';
pub const AFFILIATE_INVITE_EMAIL: u8 = b')';
pub const AFFILIATE_INVITE_LIST: u8 = b'*';
pub const AFFILIATE: u8 = b'+';
pub const AFFILIATE_CODE: u8 = b',';
pub const AFFILIATE_LIST: u8 = b'-';
pub const MODERATION_POLICY: u8 = b'/';
pub const API_KEY_PERMISSIONS: u8 = b'[';
pub const API_KEY_ID: u8 = b']';
pub const PARTITION_SKIPPED: u8 = b'!';
pub const CREDIT_RESERVATION: u8 = b'<';
pub const CREDIT_HOLDS: u8 = b'>';
pub const CREDIT_RESERVATION_IDEMPOTENCY: u8 = b'=';
pub const CREDIT_GRANT: u8 = b'{';
pub const CREDIT_GRANTS_ACTIVE: u8 = b'}';
pub const CREDIT_GRANT_LIST: u8 = b'~';
pub const CREDIT_GRANT_SEQ: u8 = b'^';
pub const LEDGER_BOOKED: u8 = b'#';
pub const GRANT_DUE: u8 = b'?';
pub const CREDIT_BALANCE_LOW: u8 = b';';
pub const LATEST: u8 = b'@';
pub const WEIGHTED: u8 = b'|';
pub const WEIGHTED_POINT: u8 = b':';
pub const MINUTE_EVENTS: u8 = b'z';
pub const VOIDED_EVENT: u8 = b'.';
pub const FOLD_SKIPPED: u8 = b'_';

/// The tables the sled store keeps as rows (`tally_projection::packing`): every
/// one is keyed store, mode, meter, customer, minute, and a row leaves the meter
/// out, so it holds every meter's bucket of one customer and minute. Under the
/// ingest benchmark a checkpoint then writes one row per customer where it wrote a
/// key per meter, and sled's page table keeps that many fewer keys (docs/benchmarks.md,
/// "Bucket rows"). The distinct values of `U` stay keys of their own: each is a
/// key, not a bucket.
pub const BUCKET_ROW_TABLES: &[u8] = &[AGGREGATE, DISTINCT_SET, LATEST, WEIGHTED];

/// The tables whose rows the checkpoint store keeps in memory once read
/// (`tally_projection::read_cache`): rows read again and again and written seldom.
/// A debit reads its account three times (request, apply, the balance-low check)
/// and its holds and low-balance marker twice, which for most accounts do not
/// exist; the exhaustion marker likewise; and apply reads the format stamp once a
/// chunk. Idempotency keys, outcomes and reversal markers are read once each, under
/// a fresh key, so they are left out: they would only fill the cache.
pub const READ_CACHED_TABLES: &[u8] = &[
    CREDIT_ACCOUNT,
    CREDIT_HOLDS,
    CREDIT_BALANCE_LOW,
    CREDIT_EXHAUSTED,
    PROJECTION_FORMAT,
];

/// The packing a new projection store is created with.
pub fn bucket_rows() -> tally_projection::Packing {
    tally_projection::Packing::tables(BUCKET_ROW_TABLES)
}
pub const REVISED_METER: u8 = b'`';
pub const VOIDED_COUNT: u8 = b'\'';
pub const RECHARGE_PENDING: u8 = b'"';
/// Every printable byte is taken: the first table past them.
pub const METER_CHANGED: u8 = 0x01;
pub const REVISED_MINUTE: u8 = 0x02;

/// The `REVISED_MINUTE` row of a meter's minute: which revision's definition its
/// usage settled in credits follows (docs/api.md, "Meter revisions"). Minute first,
/// like the `z` rows, so the two are pruned together.
pub fn revised_minute_key(minute: i64, store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
    Key::table(REVISED_MINUTE)
        .int(minute)
        .text(store_id)
        .mode(mode)
        .text(meter_id)
        .into_bytes()
}

/// The minute of a `REVISED_MINUTE` key.
pub fn revised_minute_minute(key: &[u8]) -> Result<i64, EngineError> {
    key.get(1..9)
        .filter(|_| key.first() == Some(&REVISED_MINUTE))
        .map(read_int)
        .ok_or_else(|| EngineError::Corrupt("a revised-minute key does not decode".into()))
}

/// The prefix of a scope's `METER_CHANGED` rows at and after `offset` of
/// `partition`: where a usage record's look for meters its gateway did not know
/// begins, and (at the record's own offset) ends.
pub fn meter_changed_from(store_id: &str, mode: Mode, partition: u32, offset: u64) -> Vec<u8> {
    Key::scoped(METER_CHANGED, store_id, mode)
        .uint(u64::from(partition))
        .uint(offset)
        .into_bytes()
}

/// The `METER_CHANGED` row of a meter created or changed by the record at
/// `partition`/`offset` (ARCHITECTURE.md, "Meters the gateway did not know").
pub fn meter_changed_key(
    store_id: &str,
    mode: Mode,
    partition: u32,
    offset: u64,
    meter_id: &str,
) -> Vec<u8> {
    Key(meter_changed_from(store_id, mode, partition, offset))
        .text(meter_id)
        .into_bytes()
}

/// The meter id of a `METER_CHANGED` row's key.
pub fn meter_changed_id(key: &[u8]) -> Result<&str, EngineError> {
    let mut reader = KeyReader::new(key, METER_CHANGED, "a meter-changed key")?;
    reader.text()?;
    reader.mode()?;
    reader.uint()?;
    reader.uint()?;
    let id = reader.text()?;
    reader.end()?;
    Ok(id)
}

/// The `"` row of an account whose priced auto-recharge waits for its charge
/// (docs/api.md, "Thresholds and auto-recharge"); its value is the debit's id.
pub fn recharge_pending_key(store_id: &str, mode: Mode, account_id: &str) -> Vec<u8> {
    Key::scoped(RECHARGE_PENDING, store_id, mode)
        .text(account_id)
        .into_bytes()
}

/// The store, mode and account of a `"` row's key.
pub fn recharge_pending_of(key: &[u8]) -> Result<(&str, Mode, &str), EngineError> {
    let mut reader = KeyReader::new(key, RECHARGE_PENDING, "a pending-recharge key")?;
    let store = reader.text()?;
    let mode = reader.mode()?;
    let account = reader.text()?;
    reader.end()?;
    Ok((store, mode, account))
}

/// A meter's row (`M`).
pub fn meter_key(store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
    Key::scoped(METER, store_id, mode)
        .text(meter_id)
        .into_bytes()
}

/// The `` ` `` row of a revised meter: apply decides its events from its definition
/// (docs/api.md, "Meter revisions").
pub fn revised_meter_key(store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
    Key::scoped(REVISED_METER, store_id, mode)
        .text(meter_id)
        .into_bytes()
}

/// The meter id of a `` ` `` row's key.
pub fn revised_meter_id(key: &[u8]) -> Result<&str, EngineError> {
    let mut reader = KeyReader::new(key, REVISED_METER, "a revised-meter key")?;
    reader.text()?;
    reader.mode()?;
    let id = reader.text()?;
    reader.end()?;
    Ok(id)
}

/// The `z` row of one usage record's events in one minute.
pub fn minute_events_key(
    minute: i64,
    store_id: &str,
    mode: Mode,
    partition: u32,
    offset: u64,
) -> Vec<u8> {
    Key(minute_events_prefix(minute, store_id, mode))
        .tail(&partition.to_be_bytes())
        .uint(offset)
        .into_bytes()
}

/// The record position a `z` row is of (its last 12 bytes).
pub fn minute_events_position(key: &[u8]) -> Result<(u32, u64), EngineError> {
    let at = key
        .len()
        .checked_sub(12)
        .filter(|_| key.first() == Some(&MINUTE_EVENTS))
        .ok_or_else(|| EngineError::Corrupt("a minute-events key does not decode".into()))?;
    let partition = u32::from_be_bytes(key[at..at + 4].try_into().expect("4"));
    let offset = u64::from_be_bytes(key[at + 4..].try_into().expect("8"));
    Ok((partition, offset))
}

/// The prefix of the `z` rows of a scope in one minute.
pub fn minute_events_prefix(minute: i64, store_id: &str, mode: Mode) -> Vec<u8> {
    Key::table(MINUTE_EVENTS)
        .int(minute)
        .text(store_id)
        .mode(mode)
        .into_bytes()
}

/// The minute of a `z` row.
pub fn minute_events_minute(key: &[u8]) -> Result<i64, EngineError> {
    key.get(1..9)
        .filter(|_| key.first() == Some(&MINUTE_EVENTS))
        .map(read_int)
        .ok_or_else(|| EngineError::Corrupt("a minute-events key does not decode".into()))
}

/// The `.` row of a voided event.
pub fn voided_event_key(store_id: &str, mode: Mode, event_id: &str) -> Vec<u8> {
    Key::scoped(VOIDED_EVENT, store_id, mode)
        .tail(event_id.as_bytes())
        .into_bytes()
}

/// The `'` row counting the events of one customer and minute a meter no longer
/// counts because they were voided (an amendment voids too): what a correction of
/// billed usage names (docs/api.md, "Late usage and corrections").
pub fn voided_count_key(
    store_id: &str,
    mode: Mode,
    meter_id: &str,
    customer_id: &str,
    minute: i64,
) -> Vec<u8> {
    voided_count_prefix(store_id, mode, meter_id, customer_id)
        .int(minute)
        .into_bytes()
}

/// The `'` rows of one meter and customer, before their minute.
pub fn voided_count_prefix(store_id: &str, mode: Mode, meter_id: &str, customer_id: &str) -> Key {
    Key::scoped(VOIDED_COUNT, store_id, mode)
        .text(meter_id)
        .text(customer_id)
}

/// The `B` row of an event a backfill folded into a meter.
pub fn backfilled_key(store_id: &str, mode: Mode, meter_id: &str, event_id: &str) -> Vec<u8> {
    let mut key = backfilled_prefix(store_id, mode, meter_id);
    key.extend_from_slice(event_id.as_bytes());
    key
}

/// The prefix of every `B` row of one meter.
pub fn backfilled_prefix(store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
    Key::scoped(BACKFILLED, store_id, mode)
        .text(meter_id)
        .into_bytes()
}

/// The `_` row of an event its meter matched but did not fold.
pub fn fold_skipped_key(store_id: &str, mode: Mode, meter_id: &str, event_id: &str) -> Vec<u8> {
    Key::scoped(FOLD_SKIPPED, store_id, mode)
        .text(meter_id)
        .tail(event_id.as_bytes())
        .into_bytes()
}

/// The `:` row of one event of a `time_weighted_sum` meter.
pub fn weighted_point_key(bucket_prefix: &[u8], timestamp_ms: i64, event_id: &str) -> Vec<u8> {
    Key(bucket_prefix.to_vec())
        .int(timestamp_ms)
        .text(event_id)
        .into_bytes()
}

/// The prefix of the `:` rows of one meter and customer.
pub fn weighted_points_prefix(
    store_id: &str,
    mode: Mode,
    meter_id: &str,
    customer: &str,
) -> Vec<u8> {
    Key::scoped(WEIGHTED_POINT, store_id, mode)
        .text(meter_id)
        .text(customer)
        .into_bytes()
}

/// The timestamp of a `:` row whose meter and customer prefix is `prefix`.
pub fn weighted_point_timestamp(prefix: &[u8], key: &[u8]) -> Result<i64, EngineError> {
    key.get(prefix.len()..prefix.len() + 8)
        .filter(|_| key.starts_with(prefix))
        .map(read_int)
        .ok_or_else(|| EngineError::Corrupt("a time-weighted event key does not decode".into()))
}

/// The `?` row of an active grant's expiry.
pub fn grant_due_key(
    mode: Mode,
    expires_at_ms: i64,
    store_id: &str,
    account_id: &str,
    grant_id: &str,
) -> Vec<u8> {
    Key::table(GRANT_DUE)
        .mode(mode)
        .int(expires_at_ms)
        .text(store_id)
        .text(account_id)
        .text(grant_id)
        .into_bytes()
}

/// The key range `[start, end)` of the rows of a time-ordered index (`?`, `9`: table,
/// mode, instant, then text) that are due at or before `until_ms`. A sweep scans
/// this range rather than the whole index, because a scan over the write-back layer
/// copies its range out of memory before it visits the first row: the once-a-second
/// grant sweep copied every future expiry (20,000 in the ledger benchmark) to read
/// none. `end` is the instant `until_ms` followed by 0xff, which sorts after every
/// row at that instant (ids are ASCII) and before the next instant.
pub fn due_until(table: u8, mode: Mode, until_ms: i64) -> (Vec<u8>, Vec<u8>) {
    let start = Key::table(table).mode(mode).into_bytes();
    let mut end = Key::table(table).mode(mode).int(until_ms).into_bytes();
    end.push(0xff);
    (start, end)
}

/// A `?` row read back: (expires at, store, account id).
pub fn read_grant_due(key: &[u8]) -> Result<(i64, String, String), EngineError> {
    let bad = || EngineError::Corrupt("a grant expiry row does not decode".into());
    let at = key.get(2..10).map(read_int).ok_or_else(bad)?;
    let (store, next) = read_text(key, 10).ok_or_else(bad)?;
    let (account, _) = read_text(key, next).ok_or_else(bad)?;
    Ok((at, store.to_string(), account.to_string()))
}

/// The `#` row of the record at a position: the expiries its apply booked.
pub fn ledger_booked_key(partition: u32, offset: u64) -> Vec<u8> {
    Key::table(LEDGER_BOOKED)
        .uint(u64::from(partition))
        .uint(offset)
        .into_bytes()
}

/// The `!` row of a partition.
pub fn partition_skipped_key(partition: u32) -> Vec<u8> {
    Key::table(PARTITION_SKIPPED)
        .uint(u64::from(partition))
        .into_bytes()
}

/// The `Z` rows of one meter: one per active product pricing it. Billing's apply
/// writes them; metering's apply reads them to refuse archiving a priced meter.
pub fn meter_priced_prefix(store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
    Key::scoped(METER_PRICED, store_id, mode)
        .text(meter_id)
        .into_bytes()
}

/// The `4` row of the usage record at a position: it is settled, and the value
/// names the ledger transactions its settlement posted.
pub fn settlement_done_key(partition: u32, offset: u64) -> Vec<u8> {
    Key::table(SETTLEMENT_DONE)
        .uint(u64::from(partition))
        .uint(offset)
        .into_bytes()
}

/// The transaction ids a `4` row holds.
pub fn settlement_transactions(value: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(value)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The customer component of meter-wide (all customers) usage rows.
pub const ALL_CUSTOMERS: &str = "";

/// Room a key starts with: a bucket key with the service's own ids (store, meter
/// and customer ids of ~30 characters each, separators, minute) is ~100 bytes, and
/// starting at 64 cost every bucket key built in apply a second allocation and a
/// copy (`Key::text` growing it: ~1% of the apply thread under the ingest
/// benchmark). Longer ids still grow it; shorter keys cost nothing more (one
/// allocation either way).
const KEY_CAPACITY: usize = 128;

#[derive(Debug, Clone)]
pub struct Key(Vec<u8>);

impl Key {
    pub fn table(table: u8) -> Key {
        let mut bytes = Vec::with_capacity(KEY_CAPACITY);
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
        write_int(&mut self.0, value);
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

/// Writes an `int` component: big-endian with the sign bit flipped, so keys sort
/// by value.
pub fn write_int(into: &mut Vec<u8>, value: i64) {
    into.extend_from_slice(&((value as u64) ^ (1 << 63)).to_be_bytes());
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

/// Reads a key back component by component, in the order `Key` built it: the one
/// decoder behind every typed key below. Any mismatch is corrupt storage.
pub(crate) struct KeyReader<'k> {
    bytes: &'k [u8],
    at: usize,
    what: &'static str,
}

impl<'k> KeyReader<'k> {
    pub(crate) fn new(bytes: &'k [u8], table: u8, what: &'static str) -> Result<Self, EngineError> {
        let reader = KeyReader { bytes, at: 1, what };
        if bytes.first() != Some(&table) {
            return Err(reader.corrupt());
        }
        Ok(reader)
    }

    fn corrupt(&self) -> EngineError {
        EngineError::Corrupt(format!("{} does not decode", self.what))
    }

    pub(crate) fn text(&mut self) -> Result<&'k str, EngineError> {
        let (text, next) = read_text(self.bytes, self.at).ok_or_else(|| self.corrupt())?;
        self.at = next;
        Ok(text)
    }

    pub(crate) fn mode(&mut self) -> Result<Mode, EngineError> {
        let byte = *self.bytes.get(self.at).ok_or_else(|| self.corrupt())?;
        self.at += 1;
        read_mode(byte, self.what)
    }

    pub(crate) fn fixed(&mut self) -> Result<[u8; 8], EngineError> {
        let raw: [u8; 8] = self
            .bytes
            .get(self.at..self.at + 8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| self.corrupt())?;
        self.at += 8;
        Ok(raw)
    }

    pub(crate) fn int(&mut self) -> Result<i64, EngineError> {
        Ok(read_int(&self.fixed()?))
    }

    pub(crate) fn uint(&mut self) -> Result<u64, EngineError> {
        Ok(u64::from_be_bytes(self.fixed()?))
    }

    pub(crate) fn end(self) -> Result<(), EngineError> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(self.corrupt())
        }
    }
}

/// A minute bucket of a meter's usage (`A`) or, for `unique`, one distinct value of
/// it (`U`, the value's type-tagged text last): scope, meter, customer
/// (`ALL_CUSTOMERS` for the meter-wide bucket), minute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketKey {
    pub store_id: String,
    pub mode: Mode,
    pub meter_id: String,
    pub customer: String,
    pub minute: i64,
}

impl BucketKey {
    /// Where the buckets (`table` `A` or `U`) of one meter and customer from
    /// `minute` on begin: the bounds of a series scan.
    pub fn from_minute(
        table: u8,
        store_id: &str,
        mode: Mode,
        meter_id: &str,
        customer: &str,
        minute: i64,
    ) -> Vec<u8> {
        Key::scoped(table, store_id, mode)
            .text(meter_id)
            .text(customer)
            .int(minute)
            .into_bytes()
    }

    /// `from_minute` for a bucket of `meter` (its store, mode and id).
    pub fn of_meter(table: u8, meter: &Meter, customer: &str, minute: i64) -> Vec<u8> {
        BucketKey::from_minute(
            table,
            &meter.store_id,
            meter.mode,
            &meter.id,
            customer,
            minute,
        )
    }

    /// The prefix of every bucket of one meter (`A`).
    pub fn meter_prefix(store_id: &str, mode: Mode, meter_id: &str) -> Vec<u8> {
        Key::scoped(AGGREGATE, store_id, mode)
            .text(meter_id)
            .into_bytes()
    }

    pub fn encode(&self) -> Vec<u8> {
        BucketKey::from_minute(
            AGGREGATE,
            &self.store_id,
            self.mode,
            &self.meter_id,
            &self.customer,
            self.minute,
        )
    }

    /// The key of one distinct value of this bucket (`U`): the bucket's components,
    /// then the value's text with no separator.
    pub fn encode_distinct(&self, value: &str) -> Vec<u8> {
        BucketKey::distinct(
            &self.store_id,
            self.mode,
            &self.meter_id,
            &self.customer,
            self.minute,
            value,
        )
    }

    /// `encode_distinct` from borrowed parts (the projector's hot path).
    pub fn distinct(
        store_id: &str,
        mode: Mode,
        meter_id: &str,
        customer: &str,
        minute: i64,
        value: &str,
    ) -> Vec<u8> {
        let mut key = BucketKey::from_minute(UNIQUE, store_id, mode, meter_id, customer, minute);
        key.extend_from_slice(value.as_bytes());
        key
    }

    /// Where a distinct-value key (`U`) ends its bucket part (table, scope, meter,
    /// customer, minute) and its value begins; `None` for a key that is not one.
    pub fn distinct_value_split(bytes: &[u8]) -> Option<usize> {
        let mut key = KeyReader::new(bytes, UNIQUE, "a distinct-value key").ok()?;
        key.text().ok()?;
        key.mode().ok()?;
        key.text().ok()?;
        key.text().ok()?;
        key.int().ok()?;
        Some(key.at)
    }

    /// A bucket key (`A`, `@`, `|`), a distinct-set key (`u`), or a distinct-value
    /// key (`U`) with its value.
    pub fn decode(bytes: &[u8]) -> Result<(BucketKey, BucketPart<'_>), EngineError> {
        let table = match bytes.first() {
            Some(&table @ (AGGREGATE | DISTINCT_SET | UNIQUE | LATEST | WEIGHTED)) => table,
            _ => AGGREGATE,
        };
        let mut key = KeyReader::new(bytes, table, "a usage bucket key")?;
        let bucket = BucketKey {
            store_id: key.text()?.to_string(),
            mode: key.mode()?,
            meter_id: key.text()?.to_string(),
            customer: key.text()?.to_string(),
            minute: key.int()?,
        };
        if table == UNIQUE {
            return Ok((bucket, BucketPart::Distinct(&bytes[key.at..])));
        }
        key.end()?;
        let part = match table {
            DISTINCT_SET => BucketPart::DistinctSet,
            LATEST => BucketPart::Latest,
            WEIGHTED => BucketPart::Weighted,
            _ => BucketPart::Aggregate,
        };
        Ok((bucket, part))
    }
}

/// Which part of a bucket a bucket key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketPart<'k> {
    /// `A`: counts, sum, min, max.
    Aggregate,
    /// `u`: a set of distinct values (the value holds them).
    DistinctSet,
    /// `U`: one distinct value (the key's tail).
    Distinct(&'k [u8]),
    /// `@`: a `latest` meter's latest point.
    Latest,
    /// `|`: a `time_weighted_sum` meter's changes.
    Weighted,
}

/// A webhook delivery due over HTTP (`Q`): due time first, so the dispatcher scans
/// what is due in due order across every store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueKey {
    pub due_at_ms: i64,
    pub store_id: String,
    pub mode: Mode,
    pub endpoint_id: String,
    pub event_id: String,
}

impl DueKey {
    pub fn encode(&self) -> Vec<u8> {
        Key::table(WEBHOOK_DUE)
            .int(self.due_at_ms)
            .text(&self.store_id)
            .mode(self.mode)
            .text(&self.endpoint_id)
            .text(&self.event_id)
            .into_bytes()
    }

    /// Where entries due after `due_at_ms` begin (the end of a "due now" scan).
    pub fn after(due_at_ms: i64) -> Vec<u8> {
        Key::table(WEBHOOK_DUE)
            .int(due_at_ms.saturating_add(1))
            .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<DueKey, EngineError> {
        let mut key = KeyReader::new(bytes, WEBHOOK_DUE, "a due-delivery key")?;
        let due = DueKey {
            due_at_ms: key.int()?,
            store_id: key.text()?.to_string(),
            mode: key.mode()?,
            endpoint_id: key.text()?.to_string(),
            event_id: key.text()?.to_string(),
        };
        key.end()?;
        Ok(due)
    }
}

/// A webhook delivery waiting for a cli listener (`P`): oldest first by event time,
/// then log offset, then place within the record, so two events of one ledger step
/// keep their order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingKey {
    pub store_id: String,
    pub mode: Mode,
    pub endpoint_id: String,
    pub created_at_ms: i64,
    pub offset: u64,
    pub place: u64,
    pub event_id: String,
}

impl PendingKey {
    /// The prefix of one endpoint's pending deliveries.
    pub fn prefix(store_id: &str, mode: Mode, endpoint_id: &str) -> Vec<u8> {
        Key::scoped(WEBHOOK_PENDING, store_id, mode)
            .text(endpoint_id)
            .into_bytes()
    }

    pub fn encode(&self) -> Vec<u8> {
        Key::scoped(WEBHOOK_PENDING, &self.store_id, self.mode)
            .text(&self.endpoint_id)
            .int(self.created_at_ms)
            .uint(self.offset)
            .uint(self.place)
            .text(&self.event_id)
            .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<PendingKey, EngineError> {
        let mut key = KeyReader::new(bytes, WEBHOOK_PENDING, "a pending-delivery key")?;
        let pending = PendingKey {
            store_id: key.text()?.to_string(),
            mode: key.mode()?,
            endpoint_id: key.text()?.to_string(),
            created_at_ms: key.int()?,
            offset: key.uint()?,
            place: key.uint()?,
            event_id: key.text()?.to_string(),
        };
        key.end()?;
        Ok(pending)
    }
}

/// An entry of a newest-first listing (`c` customers, `m` meters, `l` credit
/// accounts, `k` credit accounts per customer): scope, the owner for a per-owner
/// listing (the customer of `k`), creation time, id. The entry's value is empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListingKey {
    pub table: u8,
    pub store_id: String,
    pub mode: Mode,
    pub owner: Option<String>,
    pub created_at_ms: i64,
    pub id: String,
}

impl ListingKey {
    /// The prefix every entry of one listing shares.
    pub fn prefix(table: u8, store_id: &str, mode: Mode, owner: Option<&str>) -> Vec<u8> {
        let key = Key::scoped(table, store_id, mode);
        match owner {
            Some(owner) => key.text(owner),
            None => key,
        }
        .into_bytes()
    }

    pub fn encode(&self) -> Vec<u8> {
        ListingKey::entry(
            self.table,
            &self.store_id,
            self.mode,
            self.owner.as_deref(),
            self.created_at_ms,
            &self.id,
        )
    }

    /// The encoded entry of one listed resource (what `encode` gives, without
    /// building the struct first).
    pub fn entry(
        table: u8,
        store_id: &str,
        mode: Mode,
        owner: Option<&str>,
        created_at_ms: i64,
        id: &str,
    ) -> Vec<u8> {
        let mut key = ListingKey::prefix(table, store_id, mode, owner);
        key.extend_from_slice(Key::table(0).int(created_at_ms).text(id).as_bytes()[1..].as_ref());
        key
    }

    /// The id of the entry `key` of the listing whose prefix is `prefix`.
    pub fn id_in<'k>(prefix: &[u8], key: &'k [u8]) -> Result<&'k str, EngineError> {
        let corrupt = || EngineError::Corrupt("a listing entry does not decode".into());
        if !key.starts_with(prefix) || key.len() < prefix.len() + 8 {
            return Err(corrupt());
        }
        let (id, end) = read_text(key, prefix.len() + 8).ok_or_else(corrupt)?;
        if end != key.len() {
            return Err(corrupt());
        }
        Ok(id)
    }
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
    fn a_due_range_holds_exactly_the_rows_due_by_its_instant() {
        let row = |mode, at| grant_due_key(mode, at, "st_1", "cca_1", "grt_1");
        for until in [-1, 0, 1_700_000_000_000, i64::MAX - 1, i64::MAX] {
            let (start, end) = due_until(GRANT_DUE, Mode::Prod, until);
            let inside = |key: &[u8]| start.as_slice() <= key && key < end.as_slice();
            assert!(inside(&row(Mode::Prod, until)), "due at {until}");
            assert!(inside(&row(Mode::Prod, i64::MIN)));
            if let Some(later) = until.checked_add(1) {
                assert!(!inside(&row(Mode::Prod, later)), "not due at {later}");
            }
            assert!(!inside(&row(Mode::Test, until)), "another mode");
        }
        let (start, end) = due_until(SUBSCRIPTION_DUE, Mode::Test, 5);
        let sub = Key::table(SUBSCRIPTION_DUE)
            .mode(Mode::Test)
            .int(5)
            .text("st_1")
            .text("sub_1")
            .into_bytes();
        assert!(start < sub && sub < end);
    }

    #[test]
    fn bucket_keys_round_trip_and_sort_by_minute() {
        let bucket = BucketKey {
            store_id: "st_1".into(),
            mode: Mode::Test,
            meter_id: "mtr_1".into(),
            customer: ALL_CUSTOMERS.into(),
            minute: -2,
        };
        assert_eq!(
            BucketKey::decode(&bucket.encode()).unwrap(),
            (bucket.clone(), BucketPart::Aggregate)
        );
        let distinct = bucket.encode_distinct("s:user 1");
        assert_eq!(
            BucketKey::decode(&distinct).unwrap(),
            (bucket.clone(), BucketPart::Distinct("s:user 1".as_bytes()))
        );
        let set =
            BucketKey::from_minute(DISTINCT_SET, "st_1", Mode::Test, "mtr_1", ALL_CUSTOMERS, -2);
        assert_eq!(
            BucketKey::decode(&set).unwrap(),
            (bucket.clone(), BucketPart::DistinctSet)
        );
        let later = BucketKey {
            minute: 3,
            ..bucket.clone()
        };
        assert!(bucket.encode() < later.encode());
        assert!(later
            .encode()
            .starts_with(&BucketKey::meter_prefix("st_1", Mode::Test, "mtr_1")));
        let mut trailing = bucket.encode();
        trailing.push(0);
        assert!(BucketKey::decode(&trailing).is_err());
    }

    #[test]
    fn delivery_keys_round_trip_and_refuse_garbage() {
        let due = DueKey {
            due_at_ms: -7,
            store_id: "st_1".into(),
            mode: Mode::Test,
            endpoint_id: "we_1".into(),
            event_id: "evt_1".into(),
        };
        assert_eq!(DueKey::decode(&due.encode()).unwrap(), due);
        assert!(due.encode() < DueKey::after(-7));
        let pending = PendingKey {
            store_id: "st_1".into(),
            mode: Mode::Prod,
            endpoint_id: "we_1".into(),
            created_at_ms: 42,
            offset: 9,
            place: 1,
            event_id: "evt_2".into(),
        };
        assert_eq!(PendingKey::decode(&pending.encode()).unwrap(), pending);
        assert!(pending
            .encode()
            .starts_with(&PendingKey::prefix("st_1", Mode::Prod, "we_1")));
        let mut bad_mode = due.encode();
        bad_mode[9 + "st_1".len() + 1] = b'?';
        assert!(DueKey::decode(&bad_mode).is_err());
        assert!(DueKey::decode(&pending.encode()).is_err(), "another table");
        assert!(PendingKey::decode(&pending.encode()[..20]).is_err());
    }

    #[test]
    fn listing_keys_round_trip_and_sort_by_creation() {
        let entry = |created_at_ms, id: &str, owner: Option<&str>| ListingKey {
            table: CREDIT_ACCOUNT_BY_CUSTOMER,
            store_id: "st_1".into(),
            mode: Mode::Prod,
            owner: owner.map(str::to_string),
            created_at_ms,
            id: id.into(),
        };
        let older = entry(5, "acct_b", Some("cus_1"));
        let newer = entry(6, "acct_a", Some("cus_1"));
        assert!(older.encode() < newer.encode());
        let prefix = ListingKey::prefix(
            CREDIT_ACCOUNT_BY_CUSTOMER,
            "st_1",
            Mode::Prod,
            Some("cus_1"),
        );
        assert_eq!(
            ListingKey::id_in(&prefix, &newer.encode()).unwrap(),
            "acct_a"
        );
        let other = ListingKey::prefix(
            CREDIT_ACCOUNT_BY_CUSTOMER,
            "st_1",
            Mode::Prod,
            Some("cus_2"),
        );
        assert!(
            ListingKey::id_in(&other, &newer.encode()).is_err(),
            "another owner's entry"
        );
        let mut trailing = newer.encode();
        trailing.push(b'x');
        assert!(ListingKey::id_in(&prefix, &trailing).is_err());
        let unowned = entry(6, "cus_9", None);
        let prefix = ListingKey::prefix(CREDIT_ACCOUNT_BY_CUSTOMER, "st_1", Mode::Prod, None);
        assert_eq!(
            ListingKey::id_in(&prefix, &unowned.encode()).unwrap(),
            "cus_9"
        );
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
