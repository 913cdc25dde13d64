//! The body of `POST /v1/events/ingest` and `/v1/events/preview`, decoded straight
//! from the bytes into raw events.
//!
//! Ingest is the hottest request: decoding a whole `serde_json::Value` tree per batch
//! and then copying every string out of it cost a tenth of the server's CPU under the
//! ingest benchmark (README, "Benchmarks"). This decoder visits the JSON once, keeps
//! only the six fields an event has, and moves each string into the raw event. It
//! answers exactly what the generic `JsonObject` path answered: the same errors with
//! the same parameters and messages, unknown fields ignored, the last of repeated
//! keys winning (docs/api.md, "Errors, request ids, limits"); the tests below hold it
//! to that.

use std::fmt;

use axum::extract::{FromRequest, Request};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use tally_domain::limits::MAX_EVENTS_PER_BATCH;
use tally_domain::usage::{RawPropertyValue, RawUsageEvent};
use tally_domain::FieldError;

use crate::error::ApiError;
use crate::extract::{invalid_json, not_an_object, number_text, read_json_body};

/// The key under which serde_json (with `arbitrary_precision`, as this workspace
/// builds it) hands a number to a visitor: a one-entry map. A map whose first key is
/// this is a number, exactly as `serde_json::Value` itself decides.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// The events of an ingest or preview body, each parsed or refused with the field
/// that is wrong (relative to the event; the gateway prefixes `events[N]`).
#[derive(Debug)]
pub struct UsageEvents(pub Vec<Result<RawUsageEvent, FieldError>>);

impl<S: Send + Sync> FromRequest<S> for UsageEvents {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<Self, Self::Rejection> {
        // No body at all reads as `{}`, which has no `events`.
        let body = match read_json_body(request).await? {
            None => Body::Object(None),
            Some(bytes) => {
                crate::intake::run(async move { decode(&bytes).map_err(|e| invalid_json(&e)) })
                    .await?
            }
        };
        match body {
            Body::NotObject => Err(not_an_object()),
            Body::Object(None | Some(Events::Null)) => Err(ApiError::bad_request(
                "parameter_missing",
                "`events` is required",
            )
            .with_param("events")),
            Body::Object(Some(Events::Array { events, count }))
                if (1..=MAX_EVENTS_PER_BATCH).contains(&count) =>
            {
                Ok(UsageEvents(events))
            }
            Body::Object(Some(Events::Array { .. })) => Err(ApiError::invalid_param(
                "events",
                format!("`events` must hold 1 to {MAX_EVENTS_PER_BATCH} events"),
            )),
            Body::Object(Some(Events::NotArray)) => Err(ApiError::invalid_param(
                "events",
                "`events` must be an array",
            )),
        }
    }
}

fn decode(bytes: &[u8]) -> Result<Body, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let body = deserializer.deserialize_any(BodyVisitor)?;
    deserializer.end()?;
    Ok(body)
}

/// The whole body: an object (with its last `events`, if any) or something else.
enum Body {
    NotObject,
    Object(Option<Events>),
}

enum Events {
    Null,
    NotArray,
    /// The first `MAX_EVENTS_PER_BATCH` events, and how many the array held.
    Array {
        events: Vec<Result<RawUsageEvent, FieldError>>,
        count: usize,
    },
}

/// What the decoder reads and drops. Not `serde::de::IgnoredAny`: serde_json skips
/// that without its recursion limit, and a body nested past the limit must stay
/// invalid JSON wherever the nesting stands, as when the body was read whole.
/// Unknown fields are rare, so reading them costs nothing that matters.
type Skipped = Value;

/// Drains what is left of a map the decoder does not keep.
fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<Skipped, Skipped>()?.is_some() {}
    Ok(())
}

fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<Skipped>()?.is_some() {}
    Ok(())
}

/// A map key, compared without allocating (keys are read borrowed or transient).
struct Key<'k>(&'k [&'static str]);

/// Which of the wanted names a key is (`Some(index)`), the number token, or another.
#[derive(PartialEq)]
enum KeyIs {
    Wanted(usize),
    Number,
    Other,
}

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = KeyIs;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<KeyIs, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for Key<'_> {
    type Value = KeyIs;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<KeyIs, E> {
        Ok(if key == NUMBER_TOKEN {
            KeyIs::Number
        } else {
            self.0
                .iter()
                .position(|wanted| *wanted == key)
                .map_or(KeyIs::Other, KeyIs::Wanted)
        })
    }
}

/// A visitor that is its own seed: it reads whatever JSON value comes
/// (`deserialize_any`), so it can name a wrong type in its own words.
macro_rules! seed_of_any {
    ($visitor:ty, $value:ty) => {
        impl<'de> DeserializeSeed<'de> for $visitor {
            type Value = $value;

            fn deserialize<D: Deserializer<'de>>(
                self,
                deserializer: D,
            ) -> Result<Self::Value, D::Error> {
                deserializer.deserialize_any(self)
            }
        }
    };
}

/// Every scalar JSON type but null, for a visitor that wants a container.
macro_rules! any_scalar_but_null {
    ($value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    any_scalar_but_null!(Body::NotObject);

    fn visit_unit<E: de::Error>(self) -> Result<Body, E> {
        Ok(Body::NotObject)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Body, A::Error> {
        drain_seq(seq)?;
        Ok(Body::NotObject)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body, A::Error> {
        let mut events = None;
        let mut first = true;
        while let Some(key) = map.next_key_seed(Key(&["events"]))? {
            if first && key == KeyIs::Number {
                map.next_value::<Skipped>()?;
                drain_map(map)?;
                return Ok(Body::NotObject);
            }
            first = false;
            match key {
                KeyIs::Wanted(_) => events = Some(map.next_value_seed(EventsVisitor)?),
                _ => {
                    map.next_value::<Skipped>()?;
                }
            }
        }
        Ok(Body::Object(events))
    }
}

struct EventsVisitor;

seed_of_any!(EventsVisitor, Events);

impl<'de> Visitor<'de> for EventsVisitor {
    type Value = Events;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of events")
    }

    any_scalar_but_null!(Events::NotArray);

    fn visit_unit<E: de::Error>(self) -> Result<Events, E> {
        Ok(Events::Null)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Events, A::Error> {
        // An object or (with `arbitrary_precision`) a number: neither is an array.
        drain_map(map)?;
        Ok(Events::NotArray)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Events, A::Error> {
        let mut events = Vec::new();
        let mut count = 0;
        // Past the limit the batch is refused whole; the rest is only counted (and
        // checked to be JSON), never kept.
        while count < MAX_EVENTS_PER_BATCH {
            match seq.next_element_seed(EventVisitor)? {
                Some(event) => events.push(event),
                None => return Ok(Events::Array { events, count }),
            }
            count += 1;
        }
        while seq.next_element::<Skipped>()?.is_some() {
            count += 1;
        }
        Ok(Events::Array { events, count })
    }
}

/// The fields of an event, in the order their type errors are reported.
const EVENT_FIELDS: [&str; 6] = [
    "properties",
    "name",
    "customer_id",
    "external_customer_id",
    "event_id",
    "timestamp",
];

fn invalid(param: &str, message: &str) -> FieldError {
    FieldError::new(
        "invalid_usage_event",
        param.to_string(),
        message.to_string(),
    )
}

fn not_an_event() -> Result<RawUsageEvent, FieldError> {
    Err(invalid("", "each event must be a JSON object"))
}

struct EventVisitor;

seed_of_any!(EventVisitor, Result<RawUsageEvent, FieldError>);

impl<'de> Visitor<'de> for EventVisitor {
    type Value = Result<RawUsageEvent, FieldError>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an event")
    }

    any_scalar_but_null!(not_an_event());

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(not_an_event())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq)?;
        Ok(not_an_event())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // `properties` (index 0) is read by `PropertiesSeed`, the others as values.
        let mut fields: [Option<Value>; 6] = Default::default();
        let mut properties = Ok(None);
        let mut first = true;
        while let Some(key) = map.next_key_seed(Key(&EVENT_FIELDS))? {
            if first && key == KeyIs::Number {
                map.next_value::<Skipped>()?;
                drain_map(map)?;
                return Ok(not_an_event());
            }
            first = false;
            match key {
                // The last of repeated keys wins, as in a JSON object read whole.
                KeyIs::Wanted(0) => properties = map.next_value_seed(PropertiesSeed)?,
                KeyIs::Wanted(index) => fields[index] = Some(map.next_value()?),
                _ => {
                    map.next_value::<Skipped>()?;
                }
            }
        }
        let [_, name, customer_id, external_customer_id, event_id, timestamp] = fields;
        Ok(event_of(
            properties,
            [name, customer_id, external_customer_id, event_id, timestamp],
        ))
    }
}

/// An event's `properties` as `raw_properties` reads them from a `Value`, decoded
/// without building one: the value tree (a map hashing every name, a `Value` per
/// entry, then copied into the raw shape) was ~15% of the intake thread under the
/// ingest benchmark (docs/benchmarks.md, "Usage batches encoded from the events").
struct PropertiesSeed;

type RawProperties = Result<Option<Vec<(String, RawPropertyValue)>>, FieldError>;

fn not_an_object_property() -> RawProperties {
    Err(invalid("properties", "`properties` must be an object"))
}

/// Names up to this many are checked for repeats by a scan; a larger object gets
/// an index, so a body of many names stays linear to decode.
const PROPERTY_SCAN_MAX: usize = 16;

seed_of_any!(PropertiesSeed, RawProperties);

impl<'de> Visitor<'de> for PropertiesSeed {
    type Value = RawProperties;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of properties")
    }

    any_scalar_but_null!(not_an_object_property());

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq)?;
        Ok(not_an_object_property())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries: Vec<(String, RawPropertyValue)> = Vec::new();
        let mut index: Option<std::collections::HashMap<String, usize>> = None;
        while let Some(name) = map.next_key::<String>()? {
            if entries.is_empty() && name == NUMBER_TOKEN {
                // A number, as serde_json hands one over: not an object.
                number_of(&mut map)?;
                return Ok(not_an_object_property());
            }
            let value = map.next_value_seed(PropertyValueSeed)?;
            // A repeated name keeps its first place and takes the last value, as
            // `serde_json::Map` (insertion-ordered in this workspace) does.
            let at = match &index {
                Some(index) => index.get(&name).copied(),
                None => entries.iter().position(|(known, _)| *known == name),
            };
            match at {
                Some(at) => entries[at].1 = value,
                None => {
                    if let Some(index) = &mut index {
                        index.insert(name.clone(), entries.len());
                    } else if entries.len() == PROPERTY_SCAN_MAX {
                        let mut built: std::collections::HashMap<String, usize> = entries
                            .iter()
                            .enumerate()
                            .map(|(at, (known, _))| (known.clone(), at))
                            .collect();
                        built.insert(name.clone(), entries.len());
                        index = Some(built);
                    }
                    entries.push((name, value));
                }
            }
        }
        Ok(Ok(Some(entries)))
    }
}

/// The number in a map whose first key is `NUMBER_TOKEN`, read as `Value` reads
/// it: its text must parse, and the map is left for serde_json to close, which
/// refuses the body if anything follows, as it does under `Value`.
fn number_of<'de, A: MapAccess<'de>>(map: &mut A) -> Result<serde_json::Number, A::Error> {
    let text: String = map.next_value()?;
    text.parse().map_err(de::Error::custom)
}

/// One property's value in its raw shape, as `raw_properties` types a `Value`.
struct PropertyValueSeed;

seed_of_any!(PropertyValueSeed, RawPropertyValue);

impl<'de> Visitor<'de> for PropertyValueSeed {
    type Value = RawPropertyValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a property value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::Other("a boolean"))
    }

    // serde_json hands numbers over as maps (`arbitrary_precision`); these are
    // here for completeness and read as `Value` would.
    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::Number(number_text(&value.into())))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::Number(number_text(&value.into())))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        Ok(match serde_json::Number::from_f64(value) {
            Some(number) => RawPropertyValue::Number(number_text(&number)),
            None => RawPropertyValue::Other("null"),
        })
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::String(value.to_owned()))
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::String(value))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(RawPropertyValue::Other("null"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq)?;
        Ok(RawPropertyValue::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let Some(first) = map.next_key_seed(Key(&[]))? else {
            return Ok(RawPropertyValue::Other("an object"));
        };
        if first == KeyIs::Number {
            return Ok(RawPropertyValue::Number(number_text(&number_of(&mut map)?)));
        }
        map.next_value::<Skipped>()?;
        drain_map(map)?;
        Ok(RawPropertyValue::Other("an object"))
    }
}

/// An event's `properties` in their raw shape (values typed, not yet validated);
/// absent or null reads as `None`.
pub fn raw_properties(
    value: Option<Value>,
) -> Result<Option<Vec<(String, RawPropertyValue)>>, FieldError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(props)) => Ok(Some(
            props
                .into_iter()
                .map(|(k, v)| {
                    let value = match v {
                        Value::String(s) => RawPropertyValue::String(s),
                        Value::Number(n) => RawPropertyValue::Number(number_text(&n)),
                        Value::Bool(_) => RawPropertyValue::Other("a boolean"),
                        Value::Null => RawPropertyValue::Other("null"),
                        Value::Array(_) => RawPropertyValue::Other("an array"),
                        Value::Object(_) => RawPropertyValue::Other("an object"),
                    };
                    (k, value)
                })
                .collect(),
        )),
        Some(_) => Err(invalid("properties", "`properties` must be an object")),
    }
}

/// One event's fields (in `EVENT_FIELDS` order) read as values into its raw shape:
/// the generic path, which the tests hold the decoder to.
#[cfg(test)]
fn raw_event(fields: [Option<Value>; 6]) -> Result<RawUsageEvent, FieldError> {
    let [properties, name, customer_id, external_customer_id, event_id, timestamp] = fields;
    event_of(
        raw_properties(properties),
        [name, customer_id, external_customer_id, event_id, timestamp],
    )
}

/// An event from its properties, read already, and its other fields in
/// `EVENT_FIELDS` order; type errors name the first wrong field in that order.
fn event_of(
    properties: RawProperties,
    fields: [Option<Value>; 5],
) -> Result<RawUsageEvent, FieldError> {
    let [name, customer_id, external_customer_id, event_id, timestamp] = fields;
    let properties = properties?.unwrap_or_default();
    let text = |value: Option<Value>, name: &str| match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(name, &format!("`{name}` must be a string"))),
    };
    Ok(RawUsageEvent {
        name: text(name, EVENT_FIELDS[1])?,
        customer_id: text(customer_id, EVENT_FIELDS[2])?,
        external_customer_id: text(external_customer_id, EVENT_FIELDS[3])?,
        event_id: text(event_id, EVENT_FIELDS[4])?,
        timestamp: text(timestamp, EVENT_FIELDS[5])?,
        properties,
    })
}

#[cfg(test)]
mod tests {
    //! The decoder against the generic path it replaced: parse the body as a
    //! `serde_json::Value` and read each event from the tree. Both must give the same
    //! events, or the same refusal, for any body.
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The reference: what the handler did with a `JsonObject` before this decoder.
    fn reference(bytes: &[u8]) -> Result<Vec<Result<RawUsageEvent, FieldError>>, String> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("json: {e}"))?;
        let Value::Object(body) = value else {
            return Err("not an object".into());
        };
        let items = match body.get("events") {
            None | Some(Value::Null) => return Err("missing".into()),
            Some(Value::Array(items)) if (1..=MAX_EVENTS_PER_BATCH).contains(&items.len()) => items,
            Some(Value::Array(_)) => return Err("count".into()),
            Some(_) => return Err("not an array".into()),
        };
        Ok(items
            .iter()
            .map(|item| {
                let Value::Object(object) = item else {
                    return not_an_event();
                };
                let mut fields: [Option<Value>; 6] = Default::default();
                for (index, name) in EVENT_FIELDS.iter().enumerate() {
                    fields[index] = object.get(*name).cloned();
                }
                raw_event(fields)
            })
            .collect())
    }

    fn decoded(bytes: &[u8]) -> Result<Vec<Result<RawUsageEvent, FieldError>>, String> {
        match decode(bytes).map_err(|e| format!("json: {e}"))? {
            Body::NotObject => Err("not an object".into()),
            Body::Object(None | Some(Events::Null)) => Err("missing".into()),
            Body::Object(Some(Events::NotArray)) => Err("not an array".into()),
            Body::Object(Some(Events::Array { events, count })) => {
                if (1..=MAX_EVENTS_PER_BATCH).contains(&count) {
                    assert_eq!(events.len(), count);
                    Ok(events)
                } else {
                    Err("count".into())
                }
            }
        }
    }

    /// Comparable text of an outcome (the domain types implement no `PartialEq`).
    fn shown(outcome: Result<Vec<Result<RawUsageEvent, FieldError>>, String>) -> String {
        match outcome {
            Err(e) => format!("refused: {e}"),
            Ok(events) => events
                .iter()
                .map(|e| match e {
                    Ok(raw) => format!("{raw:?}"),
                    Err(f) => format!("error {} {} {}", f.code, f.param, f.message),
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    fn same(bytes: &[u8]) {
        let (want, got) = (shown(reference(bytes)), shown(decoded(bytes)));
        // A syntax error's text may name another position; both must refuse it.
        if want.starts_with("refused: json") {
            assert!(got.starts_with("refused: json"), "{got}");
        } else {
            assert_eq!(want, got, "body: {}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn known_bodies_decode_as_the_value_tree_did() {
        let bodies = [
            json!({"events": [{"name": "a", "event_id": "e1", "customer_id": "c", "timestamp": "2026-01-01T00:00:00Z", "properties": {"n": 1.50, "s": "x", "b": true, "z": null, "a": [1], "o": {"k": 1}}}]}),
            json!({"events": [{"name": 5}, {"properties": []}, 7, "x", null, [1], {"name": "ok", "extra": {"deep": [1, 2]}}]}),
            json!({"events": [{"name": "a", "customer_id": 3, "event_id": false}]}),
            json!({"events": []}),
            json!({"events": null}),
            json!({"events": {"name": "a"}}),
            json!({"events": 12}),
            json!({"other": 1}),
            json!({}),
            json!([1, 2]),
            json!(5),
            json!("events"),
            json!(null),
            json!({"events": (0..101).map(|i| json!({"name": format!("n{i}")})).collect::<Vec<_>>()}),
            json!({"events": (0..100).map(|i| json!({"name": format!("n{i}")})).collect::<Vec<_>>()}),
        ];
        for body in bodies {
            same(body.to_string().as_bytes());
        }
        // Many names, some repeated, past the scan's limit: first place, last value.
        let names: Vec<String> = (0..40)
            .chain([3, 0, 17, 39, 16, 15])
            .map(|i| format!(r#""k{i}": {i}"#))
            .chain([r#""k5": "five""#.to_string(), r#""k30": null"#.to_string()])
            .collect();
        same(
            format!(
                r#"{{"events": [{{"properties": {{{}}}}}]}}"#,
                names.join(", ")
            )
            .as_bytes(),
        );
        for raw in [
            // Repeated keys: the last wins, in the body, in an event and in properties.
            r#"{"events": 1, "events": [{"name": "a", "name": "b", "properties": {"k": 1, "j": 2, "k": "three"}}]}"#,
            r#"{"events": [{"name": "a"}], "events": null}"#,
            // Exact numbers, never through a float.
            r#"{"events": [{"properties": {"n": 0.1000000000000000000000000001, "e": 1e400, "i": -12345678901234567890123}}]}"#,
            // Escapes in keys and values.
            r#"{"ev\u0065nts": [{"n\u0061me": "\u00e9t\u00e9", "properties": {"\u006b": "\n"}}]}"#,
            r#"{"events": [{"$serde_json::private::Number": "5"}]}"#,
            r#"{"$serde_json::private::Number": "5"}"#,
            // The number token inside properties, well formed or not.
            r#"{"events": [{"properties": {"$serde_json::private::Number": "5"}}]}"#,
            r#"{"events": [{"properties": {"$serde_json::private::Number": "x"}}]}"#,
            r#"{"events": [{"properties": {"$serde_json::private::Number": 5}}]}"#,
            r#"{"events": [{"properties": {"$serde_json::private::Number": "5", "a": 1}}]}"#,
            r#"{"events": [{"properties": {"a": 1, "$serde_json::private::Number": "5"}}]}"#,
            r#"{"events": [{"properties": {"k": {"$serde_json::private::Number": "7"}}}]}"#,
            r#"{"events": [{"properties": {"k": {"$serde_json::private::Number": "y"}}}]}"#,
            r#"{"events": [{"properties": {"k": {"$serde_json::private::Number": "7", "b": 2}}}]}"#,
            r#"{"events": [{"properties": {"k": {}, "j": {"a": {"b": 1}}, "": "empty name"}}]}"#,
            r#"{"events": [{"properties": {"k": 1}, "properties": 5}, {"properties": 5, "properties": {"k": 1}}]}"#,
            "{\"events\": [{}]} x",
            "{\"events\": [",
            "   ",
        ] {
            same(raw.as_bytes());
        }
    }

    /// Nesting past serde_json's recursion limit is refused as invalid JSON wherever
    /// it stands (kept, drained or ignored), never a stack overflow.
    #[test]
    fn deep_nesting_is_refused_not_a_crash() {
        let deep =
            |open: &str, close: &str| format!("{}{}", open.repeat(100_000), close.repeat(100_000));
        for body in [
            format!(r#"{{"events": [{}]}}"#, deep("[", "]")),
            format!(
                r#"{{"events": [{{"properties": {{"k": {}}}}}]}}"#,
                deep("[", "]")
            ),
            format!(
                r#"{{"ignored": {}, "events": [{{}}]}}"#,
                deep(r#"{"a":"#, "}")
            ),
            format!(
                r#"{{"events": [{{"name": "n", "other": {}}}]}}"#,
                deep("[", "]")
            ),
            format!(r#"{{"events": {}}}"#, deep(r#"{"a":"#, "}")),
            deep("[", "]"),
        ] {
            same(body.as_bytes());
            let outcome = decoded(body.as_bytes()).map(|_| ());
            assert!(
                matches!(&outcome, Err(e) if e.starts_with("json")),
                "{:?} for {}",
                outcome,
                &body[..40]
            );
        }
    }

    /// Any JSON value, a few levels deep, with keys that are sometimes event fields.
    fn any_json() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            Just("name".to_string()),
            Just("events".to_string()),
            Just("properties".to_string()),
            Just("event_id".to_string()),
            Just("customer_id".to_string()),
            Just("timestamp".to_string()),
            "[a-z]{1,3}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z0-9 ]{0,6}".prop_map(Value::from),
            "-?[1-9][0-9]{0,29}(\\.[0-9]{1,30})?".prop_map(|n| serde_json::from_str(&n).unwrap()),
        ];
        leaf.prop_recursive(4, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..6)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn any_body_decodes_as_the_value_tree_did(value in any_json()) {
            same(value.to_string().as_bytes());
            same(json!({"events": value}).to_string().as_bytes());
            same(json!({"events": [value.clone(), {"properties": value}]}).to_string().as_bytes());
        }
    }
}
