//! JSON wire shapes of API objects, built explicitly from domain types. Decimal
//! values are strings in usage and credits (docs/api.md); event properties keep
//! their JSON type (numbers stay numbers, exact).

use rust_decimal::Decimal;
use serde_json::{json, Map, Value};
use tally_domain::customer::Customer;
use tally_domain::meter::{FilterValue, Meter};
use tally_domain::product::{CustomFieldType, Product};
use tally_domain::time::format_iso8601_ms;
use tally_domain::usage::{canonical_decimal, PropertyValue, UsageEvent};
use tally_engine::ingest::{EventReport, Warning};
use tally_engine::pagination::Page;
use tally_engine::usage::{UsageResult, UsageSeries};
use tally_engine::Scope;

fn decimal_number(value: Decimal) -> Value {
    canonical_decimal(value)
        .parse::<serde_json::Number>()
        .map(Value::Number)
        .unwrap_or_else(|_| Value::String(canonical_decimal(value)))
}

fn decimal_string(value: Option<Decimal>) -> Value {
    value.map_or(Value::Null, |v| Value::String(canonical_decimal(v)))
}

pub fn customer(c: &Customer) -> Value {
    json!({
        "id": c.id,
        "object": "customer",
        "mode": c.mode.as_str(),
        "email": c.email,
        "name": c.name,
        "country": c.country,
        "metadata": c.metadata,
        "external_id": c.external_id,
        "created_at": format_iso8601_ms(c.created_at_ms),
        "updated_at": format_iso8601_ms(c.updated_at_ms),
    })
}

fn filter_value(value: &FilterValue) -> Value {
    match value {
        FilterValue::String(s) => Value::String(s.clone()),
        FilterValue::Number(n) => decimal_number(*n),
        FilterValue::Bool(b) => Value::Bool(*b),
        FilterValue::List(values) => Value::Array(values.iter().map(filter_value).collect()),
    }
}

pub fn meter(m: &Meter) -> Value {
    json!({
        "id": m.id,
        "object": "meter",
        "store_id": m.store_id,
        "mode": m.mode.as_str(),
        "name": m.name,
        "event_name": m.event_name,
        "aggregation": m.aggregation.as_str(),
        "aggregation_property": m.aggregation_property,
        "filter": {
            "conjunction": m.filter.conjunction.as_str(),
            "clauses": m.filter.clauses.iter().map(|c| json!({
                "property": c.property,
                "operator": c.operator.as_str(),
                "value": filter_value(&c.value),
            })).collect::<Vec<_>>(),
        },
        "unit_label": m.unit_label,
        "status": m.status.as_str(),
        "counts_from": format_iso8601_ms(m.counts_from_ms),
        "created_at": format_iso8601_ms(m.created_at_ms),
        "updated_at": format_iso8601_ms(m.updated_at_ms),
    })
}

fn properties(properties: &std::collections::BTreeMap<String, PropertyValue>) -> Value {
    let mut map = Map::new();
    for (key, value) in properties {
        let value = match value {
            PropertyValue::String(s) => Value::String(s.clone()),
            PropertyValue::Number(n) => decimal_number(*n),
        };
        map.insert(key.clone(), value);
    }
    Value::Object(map)
}

pub fn usage_event(e: &UsageEvent, scope: &Scope) -> Value {
    json!({
        "id": e.event_id,
        "object": "usage_event",
        "mode": scope.mode.as_str(),
        "event_id": e.event_id,
        "name": e.name,
        "customer_id": e.customer_id,
        "external_customer_id": e.external_customer_id,
        "timestamp": format_iso8601_ms(e.timestamp_ms),
        "properties": properties(&e.properties),
        "received_at": format_iso8601_ms(e.received_at_ms),
        "matched_meters": e.matched_meter_ids,
    })
}

fn warnings(list: &[Warning]) -> Value {
    Value::Array(
        list.iter()
            .map(|w| json!({"code": w.code, "message": w.message}))
            .collect(),
    )
}

/// One entry of an ingest answer.
pub fn ingest_report(r: &EventReport) -> Value {
    json!({
        "event_id": r.event_id,
        "customer_id": r.customer_id,
        "duplicate": r.duplicate,
        "matched_meters": r.matched_meters,
        "warnings": warnings(&r.warnings),
    })
}

/// One entry of a preview answer (docs/api.md).
pub fn preview_report(r: &EventReport) -> Value {
    let mut value = json!({
        "valid": r.valid,
        "event_id": r.event_id,
        "customer_id": r.customer_id,
        "duplicate": r.duplicate,
        "matched_meters": r.matched_meters,
        "warnings": warnings(&r.warnings),
    });
    if let Some(error) = &r.error {
        value["error"] =
            json!({"code": error.code, "message": error.message, "param": error.param});
    }
    value
}

/// A product (spec 2.5): money as integer minor units, quantities as JSON numbers.
pub fn product(p: &Product) -> Value {
    let (interval, interval_count) = match p.billing_period.interval() {
        Some((interval, count)) => (Value::from(interval), Value::from(count)),
        None => (Value::Null, Value::Null),
    };
    json!({
        "id": p.id,
        "object": "product",
        "mode": p.mode.as_str(),
        "name": p.name,
        "description": p.description,
        "price": p.price,
        "currency": p.currency,
        "billing_type": p.billing_type.as_str(),
        "billing_period": p.billing_period.as_str(),
        "status": p.status.as_str(),
        "tax_mode": p.tax_mode.as_str(),
        "tax_category": p.tax_category.as_str(),
        "created_at": format_iso8601_ms(p.created_at_ms),
        "updated_at": format_iso8601_ms(p.updated_at_ms),
        "image_url": p.image_urls.first(),
        "image_urls": p.image_urls,
        "features": p.features.iter().map(|f| json!({
            "id": f.id,
            "type": f.feature_type.as_str(),
            "description": f.description,
            "customer_credits": f.customer_credits.as_ref().map(|c| json!({
                "amount": canonical_decimal(c.amount),
                "unit_label": c.unit_label,
                "bucket_name": c.bucket_name,
            })),
        })).collect::<Vec<_>>(),
        "usage_prices": p.usage_prices.iter().map(|u| json!({
            "id": u.id,
            "meter_id": u.meter_id,
            "unit_price": decimal_number(u.unit_price),
            "free_allowance": decimal_number(u.free_allowance),
            "cap": u.cap.map(decimal_number),
            "settlement_mode": u.settlement_mode.as_str(),
            "target_account": u.target_account.as_str(),
            "target_account_name": u.target_account_name,
            "trial_usage_mode": u.trial_usage_mode.as_str(),
        })).collect::<Vec<_>>(),
        "recurring_interval": interval,
        "recurring_interval_count": interval_count,
        "trial_period_days": p.trial_period_days,
        "trial_price": p.trial_price,
        "business_net_pricing": p.business_net_pricing,
        "product_url": p.product_url,
        "default_success_url": p.default_success_url,
        "custom_fields": p.custom_fields.iter().map(|c| json!({
            "type": c.field_type.as_str(),
            "key": c.key,
            "label": c.label,
            "optional": c.optional,
            "text": (c.field_type == CustomFieldType::Text).then(|| json!({
                "minimum_length": c.min_length,
                "max_length": c.max_length,
                "value": null,
            })),
            "checkbox": (c.field_type == CustomFieldType::Checkbox).then(|| json!({
                "label": c.checkbox_label,
                "value": null,
            })),
        })).collect::<Vec<_>>(),
    })
}

pub fn list<T>(page: &Page<T>, render: impl Fn(&T) -> Value) -> Value {
    json!({
        "object": "list",
        "data": page.data.iter().map(render).collect::<Vec<_>>(),
        "has_more": page.has_more,
    })
}

pub fn usage_series(series: &UsageSeries) -> Value {
    json!({
        "customer_id": series.customer_id,
        "value": decimal_string(series.value),
        "windows": series.windows.iter().map(|w| json!({
            "start": format_iso8601_ms(w.start_ms),
            "end": format_iso8601_ms(w.end_ms),
            "value": decimal_string(w.value),
        })).collect::<Vec<_>>(),
    })
}

pub fn usage(result: &UsageResult, window: &str) -> Value {
    let mut value = json!({
        "object": "meter_usage",
        "meter_id": *result.meter.id,
        "customer_id": result.total.customer_id,
        "aggregation": result.meter.aggregation.as_str(),
        "unit_label": result.meter.unit_label,
        "start": format_iso8601_ms(result.start_ms),
        "end": format_iso8601_ms(result.end_ms),
        "window": window,
        "value": decimal_string(result.total.value),
        "windows": usage_series(&result.total)["windows"].clone(),
    });
    if let Some(groups) = &result.groups {
        value["groups"] = Value::Array(groups.iter().map(usage_series).collect());
    }
    value
}

pub fn meter_preview(
    series: &UsageSeries,
    aggregation: &str,
    scanned: usize,
    matched: usize,
    truncated: bool,
) -> Value {
    json!({
        "object": "meter_preview",
        "aggregation": aggregation,
        "customer_id": series.customer_id,
        "value": decimal_string(series.value),
        "windows": usage_series(series)["windows"].clone(),
        "events_scanned": scanned,
        "events_matched": matched,
        "truncated": truncated,
    })
}
