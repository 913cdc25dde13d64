//! Usage events: the validated shape, the raw shape the edge hands in, and the
//! validation rules of docs/api.md, "Usage events".

use std::collections::BTreeMap;
use std::str::FromStr;

use rust_decimal::Decimal;

use crate::error::FieldError;
use crate::ids::{CustomerId, MeterId};
use crate::limits::{
    more_chars_than, MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_SKEW_MS, MAX_EVENT_ID_CHARS,
    MAX_EVENT_NAME_CHARS, MAX_PROPERTIES_PER_EVENT, MAX_PROPERTY_KEY_CHARS,
    MAX_PROPERTY_NUMBER_ABS, MAX_PROPERTY_STRING_CHARS,
};
use crate::time::parse_iso8601_ms;

/// A property value: events carry only strings and numbers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PropertyValue {
    String(String),
    Number(Decimal),
}

impl PropertyValue {
    /// The numeric reading of a value: numbers, and strings that parse as decimals
    /// within the same bound as numbers (`MAX_PROPERTY_NUMBER_ABS`); a larger string
    /// is not a number.
    pub fn as_number(&self) -> Option<Decimal> {
        match self {
            PropertyValue::Number(n) => Some(*n),
            PropertyValue::String(s) => parse_property_number(s),
        }
    }

    /// Type-tagged canonical text; the identity used by `unique` aggregation.
    pub fn distinct_key(&self) -> String {
        match self {
            PropertyValue::String(s) => format!("s:{s}"),
            PropertyValue::Number(n) => format!("n:{}", canonical_decimal(*n)),
        }
    }
}

/// Parses decimal text exactly (plain or scientific notation); `None` when it is not a
/// number or does not fit rust_decimal.
pub fn parse_decimal(text: &str) -> Option<Decimal> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    Decimal::from_str_exact(text)
        .ok()
        .or_else(|| Decimal::from_scientific(text).ok())
}

/// A property number: a decimal within ±`MAX_PROPERTY_NUMBER_ABS`.
pub fn parse_property_number(text: &str) -> Option<Decimal> {
    parse_decimal(text).filter(|n| n.abs() <= Decimal::from(MAX_PROPERTY_NUMBER_ABS))
}

/// The canonical text of a decimal: no trailing zeros, no exponent ("12.50" -> "12.5").
pub fn canonical_decimal(value: Decimal) -> String {
    value.normalize().to_string()
}

/// A usage event as stored: validated, customer resolved, id fixed.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageEvent {
    pub event_id: String,
    pub name: String,
    pub customer_id: CustomerId,
    pub external_customer_id: Option<String>,
    pub timestamp_ms: i64,
    pub properties: BTreeMap<String, PropertyValue>,
    pub received_at_ms: i64,
    pub matched_meter_ids: Vec<MeterId>,
    pub event_id_assigned: bool,
}

impl UsageEvent {
    /// Whether another event carrying the same id has the same payload; a duplicate
    /// with a different payload earns the `duplicate_payload_differs` warning. An
    /// event sent without a timestamp means "now", so a retry of it is the same
    /// payload whenever it arrives: its timestamp is compared only when given.
    pub fn same_payload(&self, other: &ValidatedEvent, other_customer_id: &str) -> bool {
        self.name == other.name
            && self.customer_id == other_customer_id
            && (!other.timestamp_given || self.timestamp_ms == other.timestamp_ms)
            && self.properties == other.properties
    }
}

/// One event as the edge parsed it from JSON: types are checked, meaning is not.
#[derive(Debug, Clone, Default)]
pub struct RawUsageEvent {
    pub name: Option<String>,
    pub customer_id: Option<String>,
    pub external_customer_id: Option<String>,
    pub event_id: Option<String>,
    pub timestamp: Option<String>,
    pub properties: Vec<(String, RawPropertyValue)>,
}

#[derive(Debug, Clone)]
pub enum RawPropertyValue {
    String(String),
    /// The number's JSON text, parsed here exactly (never through a float).
    Number(String),
    /// Any other JSON type, named for the error message.
    Other(&'static str),
}

/// How the caller named the customer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CustomerRef {
    Id(String),
    External(String),
}

impl CustomerRef {
    /// The parameter an error about this reference names.
    pub fn param(&self) -> &'static str {
        match self {
            CustomerRef::Id(_) => "customer_id",
            CustomerRef::External(_) => "external_customer_id",
        }
    }
}

/// An event that passed validation; the customer is not resolved yet.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedEvent {
    pub name: String,
    pub customer: CustomerRef,
    pub event_id: Option<String>,
    pub timestamp_ms: i64,
    /// The sender gave the timestamp (otherwise it is the receipt time).
    pub timestamp_given: bool,
    pub properties: BTreeMap<String, PropertyValue>,
}

/// What an amendment changes of a stored event (docs/api.md, "Amending an event"):
/// each field given replaces the original's (`properties` whole); the customer
/// never changes.
#[derive(Debug, Clone, Default)]
pub struct EventChanges {
    pub event_id: Option<String>,
    pub name: Option<String>,
    pub timestamp: Option<String>,
    pub properties: Option<Vec<(String, RawPropertyValue)>>,
}

/// The replacement an amendment makes of `original`, validated as ingest validates
/// an event received at `now_ms` (a replacement is a new event); errors name the
/// field under `event.`.
pub fn amended_event(
    original: &UsageEvent,
    changes: &EventChanges,
    now_ms: i64,
) -> Result<ValidatedEvent, FieldError> {
    let properties = match &changes.properties {
        Some(given) => given.clone(),
        None => original
            .properties
            .iter()
            .map(|(key, value)| {
                let raw = match value {
                    PropertyValue::String(s) => RawPropertyValue::String(s.clone()),
                    PropertyValue::Number(n) => RawPropertyValue::Number(n.to_string()),
                };
                (key.clone(), raw)
            })
            .collect(),
    };
    let raw = RawUsageEvent {
        name: Some(
            changes
                .name
                .clone()
                .unwrap_or_else(|| original.name.clone()),
        ),
        customer_id: Some(original.customer_id.to_string()),
        external_customer_id: None,
        event_id: changes.event_id.clone(),
        timestamp: Some(
            changes
                .timestamp
                .clone()
                .unwrap_or_else(|| crate::time::format_iso8601_ms(original.timestamp_ms)),
        ),
        properties,
    };
    validate_event(raw, now_ms).map_err(|error| {
        let message = if error.param == "timestamp" && changes.timestamp.is_none() {
            format!(
                "the event's timestamp, which the replacement keeps, is not ingestible now ({}); give a `timestamp`, or void the event instead",
                error.message
            )
        } else {
            error.message
        };
        FieldError::new(error.code, format!("event.{}", error.param), message)
    })
}

/// Validates one event. Errors name the field relative to the event (`timestamp`);
/// callers prefix `events[N]`.
/// Takes the raw event by value: its strings move into the validated one (a copy
/// of each was a visible share of intake's allocations under the ingest benchmark).
pub fn validate_event(raw: RawUsageEvent, now_ms: i64) -> Result<ValidatedEvent, FieldError> {
    let invalid = |param: &str, message: String| {
        FieldError::new("invalid_usage_event", param.to_string(), message)
    };
    let name = match raw.name {
        None => return Err(invalid("name", "`name` is required".into())),
        Some(name) => name,
    };
    if name.trim().is_empty() || more_chars_than(&name, MAX_EVENT_NAME_CHARS) {
        return Err(invalid(
            "name",
            format!("`name` must be 1 to {MAX_EVENT_NAME_CHARS} characters"),
        ));
    }
    // A name is matched against meters' `event_name`s, which cannot hold control
    // characters: an event named with one (a NUL, a line break) could never be
    // metered, and would only show up in listings as an unreadable name.
    if has_control_characters(&name) {
        return Err(invalid(
            "name",
            "`name` may not contain control characters".into(),
        ));
    }
    let customer = match (raw.customer_id, raw.external_customer_id) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "customer_id",
                "give exactly one of `customer_id` and `external_customer_id`, not both".into(),
            ))
        }
        (None, None) => {
            return Err(invalid(
                "customer_id",
                "one of `customer_id` and `external_customer_id` is required".into(),
            ))
        }
        (Some(id), None) => {
            if id.trim().is_empty() {
                return Err(invalid("customer_id", "`customer_id` is empty".into()));
            }
            CustomerRef::Id(trimmed_owned(id))
        }
        (None, Some(external)) => {
            if external.trim().is_empty() {
                return Err(invalid(
                    "external_customer_id",
                    "`external_customer_id` is empty".into(),
                ));
            }
            CustomerRef::External(trimmed_owned(external))
        }
    };
    let event_id = match raw.event_id {
        None => None,
        Some(id) => {
            let trimmed = id.trim();
            if trimmed.is_empty() || more_chars_than(trimmed, MAX_EVENT_ID_CHARS) {
                return Err(invalid(
                    "event_id",
                    format!(
                        "`event_id` must be 1 to {MAX_EVENT_ID_CHARS} characters after trimming"
                    ),
                ));
            }
            Some(trimmed_owned(id))
        }
    };
    let timestamp_given = raw.timestamp.is_some();
    let timestamp_ms = match &raw.timestamp {
        None => now_ms,
        Some(text) => parse_iso8601_ms(text).ok_or_else(|| {
            invalid(
                "timestamp",
                "`timestamp` must be an ISO 8601 instant with an offset, e.g. 2026-01-31T12:00:00Z"
                    .into(),
            )
        })?,
    };
    if timestamp_ms > now_ms + MAX_EVENT_FUTURE_SKEW_MS {
        return Err(invalid(
            "timestamp",
            format!(
                "`timestamp` is more than {} minutes in the future",
                MAX_EVENT_FUTURE_SKEW_MS / crate::time::MINUTE_MS
            ),
        ));
    }
    if timestamp_ms < now_ms - MAX_EVENT_AGE_MS {
        return Err(invalid(
            "timestamp",
            format!(
                "`timestamp` is older than {} days",
                MAX_EVENT_AGE_MS / crate::time::DAY_MS
            ),
        ));
    }
    if raw.properties.len() > MAX_PROPERTIES_PER_EVENT {
        return Err(invalid(
            "properties",
            format!("at most {MAX_PROPERTIES_PER_EVENT} properties per event"),
        ));
    }
    let mut properties = BTreeMap::new();
    for (key, value) in raw.properties {
        // Named only when refused: formatting it for every property of every
        // accepted event was a visible share of ingest's validation time.
        let param = || format!("properties.{key}");
        if key.is_empty() || more_chars_than(&key, MAX_PROPERTY_KEY_CHARS) {
            return Err(invalid(
                &param(),
                format!("property keys must be 1 to {MAX_PROPERTY_KEY_CHARS} characters"),
            ));
        }
        let value = match value {
            RawPropertyValue::String(s) => {
                if more_chars_than(&s, MAX_PROPERTY_STRING_CHARS) {
                    return Err(invalid(
                        &param(),
                        format!("string values are at most {MAX_PROPERTY_STRING_CHARS} characters"),
                    ));
                }
                PropertyValue::String(s)
            }
            RawPropertyValue::Number(text) => {
                let number = parse_property_number(&text).ok_or_else(|| {
                    invalid(
                        &param(),
                        format!("numbers must be within ±{MAX_PROPERTY_NUMBER_ABS} with at most 28 significant digits"),
                    )
                })?;
                PropertyValue::Number(number.normalize())
            }
            RawPropertyValue::Other(kind) => {
                return Err(invalid(
                    &param(),
                    format!("property values must be strings or numbers, not {kind}"),
                ))
            }
        };
        properties.insert(key, value);
    }
    Ok(ValidatedEvent {
        name,
        customer,
        event_id,
        timestamp_ms,
        timestamp_given,
        properties,
    })
}

/// Whether `text` holds a control character (`char::is_control`). An ASCII text is
/// checked byte by byte, where the two agree; decoding every event's name into
/// characters showed in ingest's validation profile (docs/benchmarks.md,
/// "Character limits checked by length first").
fn has_control_characters(text: &str) -> bool {
    if text.is_ascii() {
        text.bytes().any(|b| b.is_ascii_control())
    } else {
        text.chars().any(char::is_control)
    }
}

/// `text` without surrounding whitespace, reusing its allocation when there is none
/// to take off (the common case).
fn trimmed_owned(text: String) -> String {
    if text.trim().len() == text.len() {
        text
    } else {
        text.trim().to_string()
    }
}

impl FromStr for PropertyValue {
    type Err = ();
    /// Reads the `distinct_key` form back.
    fn from_str(text: &str) -> Result<Self, ()> {
        if let Some(s) = text.strip_prefix("s:") {
            Ok(PropertyValue::String(s.to_string()))
        } else if let Some(n) = text.strip_prefix("n:") {
            parse_decimal(n).map(PropertyValue::Number).ok_or(())
        } else {
            Err(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    fn raw() -> RawUsageEvent {
        RawUsageEvent {
            name: Some("api_call".into()),
            customer_id: Some("cus_1".into()),
            ..Default::default()
        }
    }

    fn stored(timestamp_ms: i64) -> UsageEvent {
        UsageEvent {
            event_id: "e1".into(),
            name: "api_call".into(),
            customer_id: "cus_1".into(),
            external_customer_id: Some("ext".into()),
            timestamp_ms,
            properties: [
                ("n".to_string(), PropertyValue::Number(Decimal::new(125, 2))),
                ("s".to_string(), PropertyValue::String("x".into())),
            ]
            .into_iter()
            .collect(),
            received_at_ms: timestamp_ms,
            matched_meter_ids: Vec::new(),
            event_id_assigned: false,
        }
    }

    proptest::proptest! {
        /// The byte-wise check answers as decoding does, for any text (ASCII and
        /// C0/C1 controls included).
        #[test]
        fn control_characters_found_as_by_chars(text in "[\\x00-\\x7f\\u{80}-\\u{a0}é]{0,12}|\\PC{0,12}") {
            proptest::prop_assert_eq!(
                has_control_characters(&text),
                text.chars().any(char::is_control)
            );
        }
    }

    /// The limits count characters: a text of two-byte characters is accepted up
    /// to the limit (twice as many bytes) and refused one character past it.
    #[test]
    fn text_limits_count_characters_not_bytes() {
        let wide = |n: usize| "é".repeat(n);
        let field = |event: RawUsageEvent| validate_event(event, NOW).map_err(|e| e.param);
        let named = |n| RawUsageEvent {
            name: Some(wide(n)),
            ..raw()
        };
        assert!(field(named(MAX_EVENT_NAME_CHARS)).is_ok());
        assert_eq!(field(named(MAX_EVENT_NAME_CHARS + 1)).unwrap_err(), "name");
        let with_id = |n| RawUsageEvent {
            event_id: Some(wide(n)),
            ..raw()
        };
        assert!(field(with_id(MAX_EVENT_ID_CHARS)).is_ok());
        assert_eq!(
            field(with_id(MAX_EVENT_ID_CHARS + 1)).unwrap_err(),
            "event_id"
        );
        let with_property = |key: usize, value: usize| RawUsageEvent {
            properties: vec![(wide(key), RawPropertyValue::String(wide(value)))],
            ..raw()
        };
        assert!(field(with_property(
            MAX_PROPERTY_KEY_CHARS,
            MAX_PROPERTY_STRING_CHARS
        ))
        .is_ok());
        assert!(field(with_property(MAX_PROPERTY_KEY_CHARS + 1, 1))
            .unwrap_err()
            .starts_with("properties."));
        assert!(field(with_property(1, MAX_PROPERTY_STRING_CHARS + 1))
            .unwrap_err()
            .starts_with("properties."));
    }

    #[test]
    fn an_amendment_keeps_what_it_does_not_change() {
        let original = stored(NOW - 60_000);
        let kept = amended_event(&original, &EventChanges::default(), NOW).unwrap();
        assert_eq!(kept.name, original.name);
        assert_eq!(kept.timestamp_ms, original.timestamp_ms);
        assert_eq!(kept.properties, original.properties);
        assert_eq!(kept.customer, CustomerRef::Id("cus_1".into()));
        assert_eq!(kept.event_id, None);
        let changes = EventChanges {
            event_id: Some(" e2 ".into()),
            name: Some("other".into()),
            properties: Some(vec![("m".into(), RawPropertyValue::Number("2".into()))]),
            ..Default::default()
        };
        let changed = amended_event(&original, &changes, NOW).unwrap();
        assert_eq!(changed.event_id.as_deref(), Some("e2"));
        assert_eq!(changed.name, "other");
        assert_eq!(
            changed.properties.keys().collect::<Vec<_>>(),
            ["m"],
            "properties are replaced whole"
        );
    }

    #[test]
    fn a_name_with_a_control_character_is_refused_naming_it() {
        for name in ["ca\u{0}ll", "call\n", "a\u{7f}b", "\u{85}x"] {
            let error = validate_event(
                RawUsageEvent {
                    name: Some(name.into()),
                    ..raw()
                },
                NOW,
            )
            .unwrap_err();
            assert_eq!(
                (error.code, error.param.as_str()),
                ("invalid_usage_event", "name"),
                "{name:?}"
            );
        }
        // Letters of any script, spaces inside and punctuation stay valid.
        for name in ["api.call", "appel d'API", "呼び出し", "a-b_c:d"] {
            let raw = RawUsageEvent {
                name: Some(name.into()),
                ..raw()
            };
            assert!(validate_event(raw, NOW).is_ok(), "{name:?}");
        }
    }

    #[test]
    fn an_amendment_names_fields_under_event() {
        let original = stored(NOW - 60_000);
        let bad = EventChanges {
            properties: Some(vec![("n".into(), RawPropertyValue::Other("a boolean"))]),
            ..Default::default()
        };
        let error = amended_event(&original, &bad, NOW).unwrap_err();
        assert_eq!(error.param, "event.properties.n");
        // A kept timestamp that is too old now says so, and how to go on.
        let old = stored(NOW - MAX_EVENT_AGE_MS - 1);
        let error = amended_event(&old, &EventChanges::default(), NOW).unwrap_err();
        assert_eq!(error.param, "event.timestamp");
        assert!(
            error.message.contains("void the event"),
            "{}",
            error.message
        );
        let given = EventChanges {
            timestamp: Some(crate::time::format_iso8601_ms(NOW - 1_000)),
            ..Default::default()
        };
        assert_eq!(
            amended_event(&old, &given, NOW).unwrap().timestamp_ms,
            NOW - 1_000
        );
    }

    #[test]
    fn customer_reference_needs_exactly_one() {
        let mut both = raw();
        both.external_customer_id = Some("x".into());
        assert_eq!(
            validate_event(both.clone(), NOW).unwrap_err().param,
            "customer_id"
        );
        let mut neither = raw();
        neither.customer_id = None;
        assert_eq!(
            validate_event(neither.clone(), NOW).unwrap_err().param,
            "customer_id"
        );
    }

    #[test]
    fn timestamps_outside_the_window_are_invalid() {
        let mut future = raw();
        future.timestamp = Some(crate::time::format_iso8601_ms(NOW + 6 * 60_000));
        assert_eq!(
            validate_event(future.clone(), NOW).unwrap_err().param,
            "timestamp"
        );
        let mut old = raw();
        old.timestamp = Some(crate::time::format_iso8601_ms(NOW - 36 * 86_400_000));
        assert_eq!(
            validate_event(old.clone(), NOW).unwrap_err().param,
            "timestamp"
        );
        let mut ok = raw();
        ok.timestamp = Some(crate::time::format_iso8601_ms(NOW - 34 * 86_400_000));
        assert!(validate_event(ok.clone(), NOW).is_ok());
    }

    #[test]
    fn numbers_are_exact_and_bounded() {
        let mut event = raw();
        event.properties = vec![("tokens".into(), RawPropertyValue::Number("0.1".into()))];
        let valid = validate_event(event.clone(), NOW).unwrap();
        assert_eq!(
            valid.properties["tokens"],
            PropertyValue::Number(Decimal::new(1, 1))
        );
        event.properties = vec![("tokens".into(), RawPropertyValue::Number("1e30".into()))];
        assert_eq!(
            validate_event(event.clone(), NOW).unwrap_err().param,
            "properties.tokens"
        );
        event.properties = vec![("flag".into(), RawPropertyValue::Other("a boolean"))];
        assert_eq!(
            validate_event(event.clone(), NOW).unwrap_err().param,
            "properties.flag"
        );
    }

    #[test]
    fn whitespace_event_id_is_invalid_and_ids_are_trimmed() {
        let mut event = raw();
        event.event_id = Some("   ".into());
        assert_eq!(
            validate_event(event.clone(), NOW).unwrap_err().param,
            "event_id"
        );
        event.event_id = Some("  abc ".into());
        assert_eq!(
            validate_event(event.clone(), NOW)
                .unwrap()
                .event_id
                .as_deref(),
            Some("abc")
        );
        // Customer references are trimmed too, and kept as given when there is
        // nothing to trim.
        event.customer_id = Some(" cus_1\t".into());
        let valid = validate_event(event.clone(), NOW).unwrap();
        assert_eq!(valid.customer, CustomerRef::Id("cus_1".into()));
        event.customer_id = None;
        event.external_customer_id = Some("user-7".into());
        let valid = validate_event(event, NOW).unwrap();
        assert_eq!(valid.customer, CustomerRef::External("user-7".into()));
    }
}
