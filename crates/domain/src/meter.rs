//! Meters: definition, validation, and the filter that decides which events a meter
//! consumes. Operators and comparison rules are those of docs/api.md, "Meters".

use std::cmp::Ordering;
use std::collections::BTreeMap;

use rust_decimal::Decimal;

use crate::error::FieldError;
use crate::ids::{MeterId, StoreId};
use crate::limits::{
    more_chars_than, MAX_FILTER_CLAUSES, MAX_FILTER_IN_VALUES, MAX_METER_NAME_CHARS,
    MAX_PROPERTY_KEY_CHARS, MAX_PROPERTY_STRING_CHARS,
};
use crate::mode::Mode;
use crate::time::format_iso8601_ms;
use crate::usage::PropertyValue;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Aggregation {
    Count,
    Sum,
    Average,
    Min,
    Max,
    Unique,
    /// The value of the event with the greatest timestamp (ties: the greater
    /// event id); see `gauge`.
    Latest,
    /// Each customer's latest value held until their next event, integrated over
    /// time in value x hours; see `gauge`.
    TimeWeightedSum,
}

impl Aggregation {
    pub const ALL: [Aggregation; 8] = [
        Aggregation::Count,
        Aggregation::Sum,
        Aggregation::Average,
        Aggregation::Min,
        Aggregation::Max,
        Aggregation::Unique,
        Aggregation::Latest,
        Aggregation::TimeWeightedSum,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Aggregation::Count => "count",
            Aggregation::Sum => "sum",
            Aggregation::Average => "average",
            Aggregation::Min => "min",
            Aggregation::Max => "max",
            Aggregation::Unique => "unique",
            Aggregation::Latest => "latest",
            Aggregation::TimeWeightedSum => "time_weighted_sum",
        }
    }

    /// Every aggregation's name, comma-separated (for messages).
    pub fn names() -> String {
        Aggregation::ALL.map(Aggregation::as_str).join(", ")
    }

    pub fn parse(text: &str) -> Option<Aggregation> {
        Aggregation::ALL.into_iter().find(|a| a.as_str() == text)
    }

    /// Whether the aggregation reads a numeric property.
    pub fn is_numeric(self) -> bool {
        matches!(
            self,
            Aggregation::Sum
                | Aggregation::Average
                | Aggregation::Min
                | Aggregation::Max
                | Aggregation::Latest
                | Aggregation::TimeWeightedSum
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeterStatus {
    Active,
    Archived,
}

impl MeterStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            MeterStatus::Active => "active",
            MeterStatus::Archived => "archived",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conjunction {
    And,
    Or,
}

impl Conjunction {
    pub fn as_str(self) -> &'static str {
        match self {
            Conjunction::And => "and",
            Conjunction::Or => "or",
        }
    }
    pub fn parse(text: &str) -> Option<Conjunction> {
        match text {
            "and" => Some(Conjunction::And),
            "or" => Some(Conjunction::Or),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    Eq,
    Ne,
    Gt,
    Gte,
    Lt,
    Lte,
    Like,
    NotLike,
    In,
    Exists,
}

impl Operator {
    pub const ALL: [Operator; 10] = [
        Operator::Eq,
        Operator::Ne,
        Operator::Gt,
        Operator::Gte,
        Operator::Lt,
        Operator::Lte,
        Operator::Like,
        Operator::NotLike,
        Operator::In,
        Operator::Exists,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operator::Eq => "eq",
            Operator::Ne => "ne",
            Operator::Gt => "gt",
            Operator::Gte => "gte",
            Operator::Lt => "lt",
            Operator::Lte => "lte",
            Operator::Like => "like",
            Operator::NotLike => "not_like",
            Operator::In => "in",
            Operator::Exists => "exists",
        }
    }

    pub fn parse(text: &str) -> Option<Operator> {
        Operator::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

/// A clause value "as stored after parsing" (docs/api.md).
#[derive(Debug, Clone, PartialEq)]
pub enum FilterValue {
    String(String),
    Number(Decimal),
    Bool(bool),
    List(Vec<FilterValue>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct FilterClause {
    pub property: String,
    pub operator: Operator,
    pub value: FilterValue,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MeterFilter {
    pub conjunction: Conjunction,
    pub clauses: Vec<FilterClause>,
}

impl Default for MeterFilter {
    fn default() -> Self {
        MeterFilter {
            conjunction: Conjunction::And,
            clauses: Vec::new(),
        }
    }
}

/// The event fields a filter can look at.
#[derive(Debug, Clone, Copy)]
pub struct EventView<'a> {
    pub name: &'a str,
    pub timestamp_ms: i64,
    pub properties: &'a BTreeMap<String, PropertyValue>,
}

impl MeterFilter {
    /// An empty filter matches every event (docs/api.md).
    pub fn matches(&self, event: &EventView<'_>) -> bool {
        if self.clauses.is_empty() {
            return true;
        }
        match self.conjunction {
            Conjunction::And => self.clauses.iter().all(|c| c.matches(event)),
            Conjunction::Or => self.clauses.iter().any(|c| c.matches(event)),
        }
    }
}

impl FilterClause {
    fn matches(&self, event: &EventView<'_>) -> bool {
        let looked_up = lookup(event, &self.property);
        match self.operator {
            Operator::Exists => {
                let wanted = !matches!(self.value, FilterValue::Bool(false));
                looked_up.is_some() == wanted
            }
            // A missing property satisfies no comparison (a type mismatch is false).
            _ => match looked_up {
                None => false,
                Some(actual) => compare_clause(self.operator, &actual, &self.value),
            },
        }
    }
}

/// `name` and `timestamp` are the event's own fields; any other name is a property.
/// A property literally called `name` is shadowed by the event name, by design: the
/// decisions page reserves both words.
fn lookup(event: &EventView<'_>, property: &str) -> Option<PropertyValue> {
    match property {
        "name" => Some(PropertyValue::String(event.name.to_string())),
        "timestamp" => Some(PropertyValue::String(format_iso8601_ms(event.timestamp_ms))),
        other => event.properties.get(other).cloned(),
    }
}

fn compare_clause(operator: Operator, actual: &PropertyValue, expected: &FilterValue) -> bool {
    match operator {
        Operator::Eq => ordering(actual, expected) == Some(Ordering::Equal),
        Operator::Ne => matches!(ordering(actual, expected), Some(o) if o != Ordering::Equal),
        Operator::Gt => ordering(actual, expected) == Some(Ordering::Greater),
        Operator::Gte => matches!(
            ordering(actual, expected),
            Some(Ordering::Greater | Ordering::Equal)
        ),
        Operator::Lt => ordering(actual, expected) == Some(Ordering::Less),
        Operator::Lte => matches!(
            ordering(actual, expected),
            Some(Ordering::Less | Ordering::Equal)
        ),
        Operator::Like | Operator::NotLike => {
            let (PropertyValue::String(text), FilterValue::String(needle)) = (actual, expected)
            else {
                return false;
            };
            text.contains(needle.as_str()) == (operator == Operator::Like)
        }
        Operator::In => match expected {
            FilterValue::List(values) => values
                .iter()
                .any(|v| ordering(actual, v) == Some(Ordering::Equal)),
            _ => false,
        },
        // Decided in FilterClause::matches before any comparison.
        Operator::Exists => false,
    }
}

/// How an event value orders against a clause value; `None` is a type mismatch.
/// Numbers compare numerically, and a string property that reads as a number compares
/// as that number against a numeric clause ("12" vs 12). A boolean clause matches the
/// string property `"true"` or `"false"`.
fn ordering(actual: &PropertyValue, expected: &FilterValue) -> Option<Ordering> {
    match expected {
        FilterValue::Number(wanted) => actual.as_number().map(|n| n.cmp(wanted)),
        FilterValue::String(wanted) => match actual {
            PropertyValue::String(s) => Some(s.as_str().cmp(wanted.as_str())),
            PropertyValue::Number(_) => None,
        },
        FilterValue::Bool(wanted) => match actual {
            PropertyValue::String(s) if s == "true" || s == "false" => {
                Some((s == "true").cmp(wanted))
            }
            _ => None,
        },
        FilterValue::List(_) => None,
    }
}

/// A clause as the edge parsed it (types checked, meaning not).
#[derive(Debug, Clone, Default)]
pub struct RawFilterClause {
    pub property: Option<String>,
    pub operator: Option<String>,
    pub value: Option<FilterValue>,
}

#[derive(Debug, Clone, Default)]
pub struct RawMeterFilter {
    pub conjunction: Option<String>,
    pub clauses: Vec<RawFilterClause>,
}

/// Validates a filter; errors name `filter.clauses[N].field`.
pub fn validate_filter(raw: &RawMeterFilter) -> Result<MeterFilter, FieldError> {
    let conjunction = match raw.conjunction.as_deref() {
        None => Conjunction::And,
        Some(text) => Conjunction::parse(text).ok_or_else(|| {
            FieldError::invalid("filter.conjunction", "`conjunction` must be `and` or `or`")
        })?,
    };
    if raw.clauses.len() > MAX_FILTER_CLAUSES {
        return Err(FieldError::invalid(
            "filter.clauses",
            format!("at most {MAX_FILTER_CLAUSES} clauses"),
        ));
    }
    let mut clauses = Vec::with_capacity(raw.clauses.len());
    for (index, clause) in raw.clauses.iter().enumerate() {
        let at = |field: &str| format!("filter.clauses[{index}].{field}");
        let property = clause
            .property
            .clone()
            .filter(|p| !p.is_empty() && p.chars().count() <= MAX_PROPERTY_KEY_CHARS)
            .ok_or_else(|| {
                FieldError::invalid(
                    at("property"),
                    format!("`property` must be 1 to {MAX_PROPERTY_KEY_CHARS} characters"),
                )
            })?;
        let operator_text = clause
            .operator
            .as_deref()
            .ok_or_else(|| FieldError::missing(at("operator")))?;
        let operator = Operator::parse(operator_text).ok_or_else(|| {
            FieldError::invalid(
                at("operator"),
                format!(
                    "unknown operator `{operator_text}`; use one of eq, ne, gt, gte, lt, lte, like, not_like, in, exists"
                ),
            )
        })?;
        let value = match (&clause.value, operator) {
            (None, Operator::Exists) => FilterValue::Bool(true),
            (None, _) => return Err(FieldError::missing(at("value"))),
            (Some(value), _) => value.clone(),
        };
        let shape_ok = match (operator, &value) {
            (Operator::In, FilterValue::List(values)) => {
                !values.is_empty()
                    && values.len() <= MAX_FILTER_IN_VALUES
                    && values.iter().all(|v| !matches!(v, FilterValue::List(_)))
            }
            (Operator::In, _) => false,
            (_, FilterValue::List(_)) => false,
            (Operator::Exists, FilterValue::Bool(_)) => true,
            (Operator::Exists, _) => false,
            (Operator::Like | Operator::NotLike, FilterValue::String(s)) => !s.is_empty(),
            (Operator::Like | Operator::NotLike, _) => false,
            (Operator::Gt | Operator::Gte | Operator::Lt | Operator::Lte, FilterValue::Bool(_)) => {
                false
            }
            _ => true,
        };
        if !shape_ok {
            let wanted = match operator {
                Operator::In => format!(
                    "a non-empty array of at most {MAX_FILTER_IN_VALUES} strings, numbers or booleans"
                ),
                Operator::Exists => "a boolean".into(),
                Operator::Like | Operator::NotLike => "a non-empty string".into(),
                Operator::Gt | Operator::Gte | Operator::Lt | Operator::Lte => {
                    "a number or a string".into()
                }
                _ => "a string, number or boolean".into(),
            };
            return Err(FieldError::invalid(
                at("value"),
                format!("operator `{}` takes {wanted}", operator.as_str()),
            ));
        }
        // An event's string property is at most `MAX_PROPERTY_STRING_CHARS`: a longer
        // value could never equal or be found in one, and every event would still
        // pay for comparing it.
        if !strings_within_limit(&value) {
            return Err(FieldError::invalid(
                at("value"),
                format!(
                    "a string value is at most {MAX_PROPERTY_STRING_CHARS} characters, as an event's string property is"
                ),
            ));
        }
        clauses.push(FilterClause {
            property,
            operator,
            value,
        });
    }
    Ok(MeterFilter {
        conjunction,
        clauses,
    })
}

/// Whether every string in a filter value (an `in` list's included) is at most
/// `MAX_PROPERTY_STRING_CHARS` characters.
fn strings_within_limit(value: &FilterValue) -> bool {
    match value {
        FilterValue::String(text) => !more_chars_than(text, MAX_PROPERTY_STRING_CHARS),
        FilterValue::List(values) => values.iter().all(strings_within_limit),
        FilterValue::Number(_) | FilterValue::Bool(_) => true,
    }
}

/// A meter as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Meter {
    pub id: MeterId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub name: String,
    pub event_name: String,
    pub aggregation: Aggregation,
    pub aggregation_property: Option<String>,
    pub filter: MeterFilter,
    pub unit_label: String,
    pub status: MeterStatus,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Events at or after this instant count: `created_at` unless backfilled.
    pub counts_from_ms: i64,
    /// 1 when created; each revision of the definition (filter, aggregation
    /// property) adds one (docs/api.md, "Meter revisions").
    pub revision: u32,
}

impl Meter {
    /// Whether this meter consumes the event (name and filter; not status or time).
    pub fn matches(&self, event: &EventView<'_>) -> bool {
        self.event_name == event.name && self.filter.matches(event)
    }

    /// Whether a stored event counts in this meter as revised (revision > 1): a
    /// revised meter is re-derived from its definition, so an event counts when the
    /// definition matches it and the meter counts from its timestamp (or a backfill
    /// folded it), unless it was applied while the meter was archived (`skipped`).
    pub fn counts_revised(&self, event: &EventView<'_>, backfilled: bool, skipped: bool) -> bool {
        (backfilled || event.timestamp_ms >= self.counts_from_ms) && self.matches(event) && !skipped
    }

    /// Whether an event at `timestamp_ms` accrues usage on this meter now.
    pub fn accrues(&self, timestamp_ms: i64) -> bool {
        self.status == MeterStatus::Active && timestamp_ms >= self.counts_from_ms
    }
}

/// Fields accepted when creating a meter, as the edge parsed them.
#[derive(Debug, Clone, Default)]
pub struct MeterInput {
    pub name: Option<String>,
    pub event_name: Option<String>,
    pub aggregation: Option<String>,
    pub aggregation_property: Option<String>,
    pub filter: Option<RawMeterFilter>,
    pub unit_label: Option<String>,
}

/// What a revision changes (docs/api.md, "Meter revisions"): each field given
/// (`Some`) replaces the meter's; `Some(None)` removes it.
#[derive(Debug, Clone, Default)]
pub struct RevisionInput {
    pub filter: Option<Option<RawMeterFilter>>,
    pub aggregation_property: Option<Option<String>>,
}

/// The meter as `input` revises it, validated as a meter is at creation; its
/// revision is the next one.
pub fn revise_meter(meter: &Meter, input: &RevisionInput) -> Result<Meter, FieldError> {
    if input.filter.is_none() && input.aggregation_property.is_none() {
        return Err(FieldError::new(
            "parameter_missing",
            "filter",
            "give `filter`, `aggregation_property` or both: what the revision changes",
        ));
    }
    let definition = validate_meter(&MeterInput {
        name: Some(meter.name.clone()),
        event_name: Some(meter.event_name.clone()),
        aggregation: Some(meter.aggregation.as_str().to_string()),
        aggregation_property: match &input.aggregation_property {
            Some(given) => given.clone(),
            None => meter.aggregation_property.clone(),
        },
        filter: input.filter.clone().flatten(),
        unit_label: Some(meter.unit_label.clone()),
    })?;
    let mut revised = meter.clone();
    revised.aggregation_property = definition.aggregation_property;
    if input.filter.is_some() {
        revised.filter = definition.filter;
    }
    revised.revision = meter.revision.checked_add(1).ok_or_else(|| {
        FieldError::invalid(
            "filter",
            "this meter has been revised as often as it can be",
        )
    })?;
    Ok(revised)
}

/// A validated meter definition (everything but identity and timestamps).
#[derive(Debug, Clone, PartialEq)]
pub struct MeterDefinition {
    pub name: String,
    pub event_name: String,
    pub aggregation: Aggregation,
    pub aggregation_property: Option<String>,
    pub filter: MeterFilter,
    pub unit_label: String,
}

pub const DEFAULT_UNIT_LABEL: &str = "units";

pub fn validate_meter_name(name: Option<&str>, param: &str) -> Result<String, FieldError> {
    let name = name.ok_or_else(|| FieldError::missing(param))?.trim();
    if name.is_empty() || name.chars().count() > MAX_METER_NAME_CHARS {
        return Err(FieldError::invalid(
            param,
            format!("`{param}` must be 1 to {MAX_METER_NAME_CHARS} characters"),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(FieldError::invalid(
            param,
            format!("`{param}` may not contain control characters"),
        ));
    }
    Ok(name.to_string())
}

pub fn validate_meter(input: &MeterInput) -> Result<MeterDefinition, FieldError> {
    let name = validate_meter_name(input.name.as_deref(), "name")?;
    let event_name = validate_meter_name(input.event_name.as_deref(), "event_name")?;
    if event_name.chars().count() > crate::limits::MAX_EVENT_NAME_CHARS {
        return Err(FieldError::invalid(
            "event_name",
            format!(
                "`event_name` must be at most {} characters",
                crate::limits::MAX_EVENT_NAME_CHARS
            ),
        ));
    }
    let aggregation_text = input
        .aggregation
        .as_deref()
        .ok_or_else(|| FieldError::missing("aggregation"))?;
    let aggregation = Aggregation::parse(aggregation_text).ok_or_else(|| {
        FieldError::invalid(
            "aggregation",
            format!("`aggregation` must be one of {}", Aggregation::names()),
        )
    })?;
    let aggregation_property = match (aggregation, &input.aggregation_property) {
        (Aggregation::Count, None) => None,
        (Aggregation::Count, Some(_)) => {
            return Err(FieldError::invalid(
                "aggregation_property",
                "`aggregation_property` must be null for `count`",
            ))
        }
        (_, None) => return Err(FieldError::missing("aggregation_property")),
        (_, Some(p)) if p.is_empty() || p.chars().count() > MAX_PROPERTY_KEY_CHARS => {
            return Err(FieldError::invalid(
                "aggregation_property",
                format!("`aggregation_property` must be 1 to {MAX_PROPERTY_KEY_CHARS} characters"),
            ))
        }
        (_, Some(p)) => Some(p.clone()),
    };
    let filter = match &input.filter {
        None => MeterFilter::default(),
        Some(raw) => validate_filter(raw)?,
    };
    let unit_label = match &input.unit_label {
        None => DEFAULT_UNIT_LABEL.to_string(),
        Some(_) => validate_meter_name(input.unit_label.as_deref(), "unit_label")?,
    };
    Ok(MeterDefinition {
        name,
        event_name,
        aggregation,
        aggregation_property,
        filter,
        unit_label,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(pairs: &[(&str, PropertyValue)]) -> BTreeMap<String, PropertyValue> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    fn clause(property: &str, operator: Operator, value: FilterValue) -> FilterClause {
        FilterClause {
            property: property.into(),
            operator,
            value,
        }
    }

    fn eval(c: FilterClause, properties: &BTreeMap<String, PropertyValue>) -> bool {
        let filter = MeterFilter {
            conjunction: Conjunction::And,
            clauses: vec![c],
        };
        filter.matches(&EventView {
            name: "api_call",
            timestamp_ms: 0,
            properties,
        })
    }

    #[test]
    fn numbers_compare_numerically_and_strings_coerce() {
        let p = props(&[("n", PropertyValue::String("12".into()))]);
        assert!(eval(
            clause("n", Operator::Eq, FilterValue::Number(12.into())),
            &p
        ));
        assert!(eval(
            clause("n", Operator::Gt, FilterValue::Number(9.into())),
            &p
        ));
        assert!(!eval(
            clause("n", Operator::Lt, FilterValue::Number(9.into())),
            &p
        ));
        let q = props(&[("n", PropertyValue::Number(12.into()))]);
        assert!(!eval(
            clause("n", Operator::Eq, FilterValue::String("12".into())),
            &q
        ));
        assert!(
            !eval(
                clause("n", Operator::Ne, FilterValue::String("12".into())),
                &q
            ),
            "mismatch is false"
        );
    }

    #[test]
    fn like_in_exists() {
        let p = props(&[("model", PropertyValue::String("gpt-large".into()))]);
        assert!(eval(
            clause("model", Operator::Like, FilterValue::String("large".into())),
            &p
        ));
        assert!(eval(
            clause(
                "model",
                Operator::NotLike,
                FilterValue::String("small".into())
            ),
            &p
        ));
        let list = FilterValue::List(vec![
            FilterValue::String("a".into()),
            FilterValue::String("gpt-large".into()),
        ]);
        assert!(eval(clause("model", Operator::In, list), &p));
        assert!(eval(
            clause("model", Operator::Exists, FilterValue::Bool(true)),
            &p
        ));
        assert!(eval(
            clause("other", Operator::Exists, FilterValue::Bool(false)),
            &p
        ));
        assert!(!eval(
            clause("other", Operator::Ne, FilterValue::String("x".into())),
            &p
        ));
        assert!(eval(
            clause("name", Operator::Eq, FilterValue::String("api_call".into())),
            &p
        ));
    }

    #[test]
    fn or_conjunction_and_empty_filter() {
        let p = props(&[("a", PropertyValue::Number(1.into()))]);
        let filter = MeterFilter {
            conjunction: Conjunction::Or,
            clauses: vec![
                clause("a", Operator::Eq, FilterValue::Number(2.into())),
                clause("a", Operator::Eq, FilterValue::Number(1.into())),
            ],
        };
        let view = EventView {
            name: "x",
            timestamp_ms: 0,
            properties: &p,
        };
        assert!(filter.matches(&view));
        assert!(MeterFilter::default().matches(&view));
    }

    #[test]
    fn filter_validation_names_the_clause_field() {
        let raw = RawMeterFilter {
            conjunction: None,
            clauses: vec![RawFilterClause {
                property: Some("a".into()),
                operator: Some("in".into()),
                value: Some(FilterValue::String("x".into())),
            }],
        };
        assert_eq!(
            validate_filter(&raw).unwrap_err().param,
            "filter.clauses[0].value"
        );
        let raw = RawMeterFilter {
            conjunction: Some("xor".into()),
            clauses: vec![],
        };
        assert_eq!(
            validate_filter(&raw).unwrap_err().param,
            "filter.conjunction"
        );
    }

    /// A string value longer than an event's string property can be is refused
    /// (the limit counts characters, not bytes), alone or inside an `in` list; one
    /// of exactly the limit is taken.
    #[test]
    fn filter_string_values_are_bounded_by_the_property_limit() {
        let one = |operator: &str, value: FilterValue| RawMeterFilter {
            conjunction: None,
            clauses: vec![RawFilterClause {
                property: Some("a".into()),
                operator: Some(operator.into()),
                value: Some(value),
            }],
        };
        let text = |chars: usize, c: char| FilterValue::String(c.to_string().repeat(chars));
        let at_limit = MAX_PROPERTY_STRING_CHARS;
        for operator in ["eq", "ne", "like", "not_like", "gt"] {
            assert!(validate_filter(&one(operator, text(at_limit, 'é'))).is_ok());
            let err = validate_filter(&one(operator, text(at_limit + 1, 'x'))).unwrap_err();
            assert_eq!(err.param, "filter.clauses[0].value", "{operator}");
            assert!(
                err.message.contains(&at_limit.to_string()),
                "{}",
                err.message
            );
        }
        let list = |last: FilterValue| {
            FilterValue::List(vec![FilterValue::Number(1.into()), text(3, 'a'), last])
        };
        assert!(validate_filter(&one("in", list(text(at_limit, 'x')))).is_ok());
        assert_eq!(
            validate_filter(&one("in", list(text(at_limit + 1, 'x'))))
                .unwrap_err()
                .param,
            "filter.clauses[0].value"
        );
    }

    #[test]
    fn count_takes_no_property_and_others_need_one() {
        let mut input = MeterInput {
            name: Some("m".into()),
            event_name: Some("e".into()),
            aggregation: Some("count".into()),
            ..Default::default()
        };
        assert_eq!(validate_meter(&input).unwrap().unit_label, "units");
        input.aggregation_property = Some("x".into());
        assert_eq!(
            validate_meter(&input).unwrap_err().param,
            "aggregation_property"
        );
        input.aggregation = Some("sum".into());
        assert!(validate_meter(&input).is_ok());
        input.aggregation_property = None;
        assert_eq!(
            validate_meter(&input).unwrap_err().param,
            "aggregation_property"
        );
        input.aggregation = Some("median".into());
        assert_eq!(validate_meter(&input).unwrap_err().param, "aggregation");
    }

    #[test]
    fn names_with_control_characters_are_refused_naming_the_field() {
        let valid = MeterInput {
            name: Some("API calls".into()),
            event_name: Some("api.call".into()),
            aggregation: Some("count".into()),
            unit_label: Some("calls".into()),
            ..Default::default()
        };
        assert!(validate_meter(&valid).is_ok());
        for field in ["name", "event_name", "unit_label"] {
            let mut input = valid.clone();
            let bad = Some("a\u{0}b".to_string());
            match field {
                "name" => input.name = bad,
                "event_name" => input.event_name = bad,
                _ => input.unit_label = bad,
            }
            assert_eq!(validate_meter(&input).unwrap_err().param, field);
        }
    }
}
