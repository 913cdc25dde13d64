//! Every limit of the service, named, with the reason it exists.

/// Events per ingest or preview batch (docs/api.md): bounds request memory and the
/// size of one log record.
pub const MAX_EVENTS_PER_BATCH: usize = 100;
/// Event name length: names are matched exactly against meters, long names are abuse.
pub const MAX_EVENT_NAME_CHARS: usize = 128;
/// Caller-supplied event id length (docs/api.md).
pub const MAX_EVENT_ID_CHARS: usize = 255;
/// Properties per event: bounds per-event storage and filter evaluation cost.
pub const MAX_PROPERTIES_PER_EVENT: usize = 50;
/// Property key length.
pub const MAX_PROPERTY_KEY_CHARS: usize = 128;
/// String property value length.
pub const MAX_PROPERTY_STRING_CHARS: usize = 1024;
/// Numeric property magnitude: keeps sums of a billion events inside rust_decimal's
/// 28 significant digits, so aggregation stays exact.
pub const MAX_PROPERTY_NUMBER_ABS: i64 = 1_000_000_000_000_000_000;
/// How far in the future an event timestamp may be (clock skew of producers).
pub const MAX_EVENT_FUTURE_SKEW_MS: i64 = 5 * crate::time::MINUTE_MS;
/// How old an event may be; also the dedup horizon: an id is remembered at least as
/// long as an event carrying it can still be ingested.
pub const MAX_EVENT_AGE_MS: i64 = 35 * crate::time::DAY_MS;
/// Dedup horizon (docs/api.md): equal to the oldest ingestible event age.
pub const DEDUP_HORIZON_MS: i64 = MAX_EVENT_AGE_MS;
/// Filter clauses per meter: evaluation runs for every event, keep it bounded.
pub const MAX_FILTER_CLAUSES: usize = 20;
/// Values in an `in` clause.
pub const MAX_FILTER_IN_VALUES: usize = 100;
/// Meter name and unit label length.
pub const MAX_METER_NAME_CHARS: usize = 255;
/// External customer id (docs/api.md).
pub const MAX_EXTERNAL_ID_CHARS: usize = 255;
/// Email, customer name lengths.
pub const MAX_EMAIL_CHARS: usize = 320;
pub const MAX_NAME_CHARS: usize = 255;
/// Metadata keys per object and their sizes, as a Stripe-class API does.
pub const MAX_METADATA_KEYS: usize = 50;
pub const MAX_METADATA_KEY_CHARS: usize = 40;
pub const MAX_METADATA_VALUE_CHARS: usize = 500;
/// Cursor list page size (docs/api.md).
pub const MAX_PAGE_LIMIT: usize = 100;
pub const DEFAULT_PAGE_LIMIT: usize = 10;
/// Meters per store and environment (archived ones included: they keep their names).
/// Bounds the meter list every ingest request matches against.
pub const MAX_METERS_PER_SCOPE: usize = 500;
/// Meters on one event name: each event is folded into every meter on its name (two
/// buckets each), so this bounds the apply cost of one event.
pub const MAX_METERS_PER_EVENT_NAME: usize = 50;
/// Money on products and transactions is an integer in minor units; this bounds a
/// price (a hundred million in major units of a two-decimal currency), so sums of
/// prices, discounts and taxes stay far inside `i64`.
pub const MAX_PRICE_MINOR: i64 = 10_000_000_000;
/// Product description length.
pub const MAX_DESCRIPTION_CHARS: usize = 5_000;
/// URLs on products (images, product page, success page).
pub const MAX_URL_CHARS: usize = 2_048;
/// Images per product.
pub const MAX_PRODUCT_IMAGES: usize = 8;
/// Features per product: each is rendered on every embedded product.
pub const MAX_PRODUCT_FEATURES: usize = 50;
/// Usage prices per product: settlement folds every event of a priced meter into
/// each of them, so this bounds the work per event.
pub const MAX_USAGE_PRICES: usize = 20;
/// Custom checkout fields per product.
pub const MAX_CUSTOM_FIELDS: usize = 10;
/// Custom field key length (keys are identifiers: letters, digits, `_`).
pub const MAX_CUSTOM_FIELD_KEY_CHARS: usize = 64;
/// Longest free trial: two years.
pub const MAX_TRIAL_DAYS: u32 = 730;
/// Discount code length: codes are typed by customers at checkout.
pub const MAX_DISCOUNT_CODE_CHARS: usize = 64;
/// Products a discount may be restricted to: each is checked at creation.
pub const MAX_DISCOUNT_PRODUCTS: usize = 100;
/// The most redemptions a discount may allow (counted exactly, as a u32).
pub const MAX_DISCOUNT_REDEMPTIONS: u32 = 1_000_000_000;
/// Longest `repeating` discount: ten years of monthly renewals.
pub const MAX_DISCOUNT_MONTHS: u32 = 120;
/// Units (seats) on one checkout: with `MAX_PRICE_MINOR` the total stays inside `i64`.
pub const MAX_CHECKOUT_UNITS: i64 = 10_000;
/// Refund and dispute reason length.
pub const MAX_REASON_CHARS: usize = 500;
/// A tax rate, in percent.
pub const MAX_TAX_RATE_PERCENT: u32 = 100;

/// Whether `text` holds more than `max` characters (the `_CHARS` limits above count
/// characters, not bytes). A text of at most `max` bytes cannot, so the count is
/// taken only for longer ones: counting every event's name, id, property keys and
/// string values was ~1% of the server's CPU under ingest (docs/benchmarks.md,
/// "Character limits checked by length first").
pub fn more_chars_than(text: &str, max: usize) -> bool {
    text.len() > max && text.chars().count() > max
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        /// The same answer as counting, for any text and limit (multi-byte
        /// characters included, where bytes and characters differ).
        #[test]
        fn more_chars_than_counts(text in "\\PC{0,40}", max in 0usize..60) {
            prop_assert_eq!(super::more_chars_than(&text, max), text.chars().count() > max);
        }
    }
}
