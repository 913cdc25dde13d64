//! JSON wire shapes of API objects, built explicitly from domain types. Decimal
//! values are strings in usage and credits (docs/api.md); event properties keep
//! their JSON type (numbers stay numbers, exact).

use rust_decimal::Decimal;
use serde::Serialize;
use serde_json::{json, Map, Value};
use tally_domain::billing::{Checkout, Discount, DiscountType, Dispute, Payment, Subscription};
use tally_domain::customer::Customer;
use tally_domain::meter::{FilterValue, Meter};
use tally_domain::product::{CustomFieldType, Product};
use tally_domain::time::format_iso8601_ms;
use tally_domain::usage::{canonical_decimal, PropertyValue, UsageEvent};
use tally_engine::ingest::{EventReport, IngestOutcome, Warning};
use tally_engine::pagination::Page;
use tally_engine::usage::{UsageResult, UsageSeries, WindowValue};
use tally_engine::voids::EventVoid;
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
        "revision": m.revision,
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

pub fn usage_event(e: &UsageEvent, scope: &Scope, void: Option<&EventVoid>) -> Value {
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
        "voided": void.is_some(),
        "void_reason": void.map(|v| v.reason.as_str()),
        "voided_at": void.map(|v| format_iso8601_ms(v.voided_at_ms)),
    })
}

fn warnings(list: &[Warning]) -> Value {
    Value::Array(
        list.iter()
            .map(|w| json!({"code": w.code, "message": w.message}))
            .collect(),
    )
}

/// An ingest answer (docs/api.md, "Events"), serialized straight from the outcome
/// rather than through a `Value` tree: it is the hottest response. Field order is the
/// wire order.
#[derive(Debug, Serialize)]
pub struct IngestAnswer {
    object: &'static str,
    accepted: usize,
    duplicates: usize,
    events: Vec<IngestReport>,
}

#[derive(Debug, Serialize)]
struct IngestReport {
    event_id: Option<String>,
    customer_id: Option<String>,
    duplicate: bool,
    matched_meters: Vec<String>,
    warnings: Vec<WarningBody>,
}

#[derive(Debug, Serialize)]
struct WarningBody {
    code: &'static str,
    message: String,
}

pub fn ingest_answer(outcome: IngestOutcome) -> IngestAnswer {
    IngestAnswer {
        object: "ingest_result",
        accepted: outcome.accepted,
        duplicates: outcome.duplicates,
        events: outcome
            .events
            .into_iter()
            .map(|r| IngestReport {
                event_id: r.event_id,
                customer_id: r.customer_id,
                duplicate: r.duplicate,
                matched_meters: r.matched_meters,
                warnings: r
                    .warnings
                    .into_iter()
                    .map(|w| WarningBody {
                        code: w.code,
                        message: w.message,
                    })
                    .collect(),
            })
            .collect(),
    }
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

/// A product (docs/api.md, "Products"): money as integer minor units, quantities as JSON numbers.
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

/// `list` for items whose rendering reads more (and may fail): the first error
/// answers.
pub fn try_list<T, E>(page: &Page<T>, render: impl Fn(&T) -> Result<Value, E>) -> Result<Value, E> {
    Ok(json!({
        "object": "list",
        "data": page.data.iter().map(render).collect::<Result<Vec<_>, E>>()?,
        "has_more": page.has_more,
    }))
}

fn windows(series: &UsageSeries) -> Vec<WindowBody> {
    series.windows.iter().map(WindowBody::of).collect()
}

/// A usage answer (docs/api.md, "Usage"), serialized straight from the result
/// rather than through a `Value` tree: a query of the default range by hour has
/// 840 windows, and building them as maps (twice, before) was most of the query's
/// own time. Field order is the wire order.
#[derive(Debug, Serialize)]
pub struct UsageAnswer<'a> {
    object: &'static str,
    meter_id: &'a str,
    customer_id: Option<&'a str>,
    aggregation: &'static str,
    unit_label: &'a str,
    start: String,
    end: String,
    window: &'a str,
    value: Option<String>,
    windows: Vec<WindowBody>,
    #[serde(skip_serializing_if = "Option::is_none")]
    groups: Option<Vec<SeriesBody<'a>>>,
}

#[derive(Debug, Serialize)]
struct SeriesBody<'a> {
    customer_id: Option<&'a str>,
    value: Option<String>,
    windows: Vec<WindowBody>,
}

#[derive(Debug, Serialize)]
struct WindowBody {
    start: String,
    end: String,
    value: Option<String>,
}

impl<'a> SeriesBody<'a> {
    fn of(series: &'a UsageSeries) -> SeriesBody<'a> {
        SeriesBody {
            customer_id: series.customer_id.as_deref(),
            value: series.value.map(canonical_decimal),
            windows: windows(series),
        }
    }
}

impl WindowBody {
    fn of(window: &WindowValue) -> WindowBody {
        WindowBody {
            start: format_iso8601_ms(window.start_ms),
            end: format_iso8601_ms(window.end_ms),
            value: window.value.map(canonical_decimal),
        }
    }
}

pub fn usage<'a>(result: &'a UsageResult, window: &'a str) -> UsageAnswer<'a> {
    UsageAnswer {
        object: "meter_usage",
        meter_id: &result.meter.id,
        customer_id: result.total.customer_id.as_deref(),
        aggregation: result.meter.aggregation.as_str(),
        unit_label: &result.meter.unit_label,
        start: format_iso8601_ms(result.start_ms),
        end: format_iso8601_ms(result.end_ms),
        window,
        value: result.total.value.map(canonical_decimal),
        windows: windows(&result.total),
        groups: result
            .groups
            .as_ref()
            .map(|groups| groups.iter().map(SeriesBody::of).collect()),
    }
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
        "windows": windows(series),
        "events_scanned": scanned,
        "events_matched": matched,
        "truncated": truncated,
    })
}

fn iso(ms: Option<i64>) -> Value {
    ms.map_or(Value::Null, |ms| Value::from(format_iso8601_ms(ms)))
}

/// A discount: `amount` is the percent or the minor units; `percentage` repeats the
/// percent for a `percentage` discount (docs/api.md, "Discounts").
pub fn discount(d: &Discount, now_ms: i64) -> Value {
    let percentage =
        (d.discount_type == DiscountType::Percentage).then(|| decimal_number(d.amount));
    json!({
        "id": d.id,
        "object": "discount",
        "mode": d.mode.as_str(),
        "status": d.status_at(now_ms).as_str(),
        "name": d.name,
        "code": d.code,
        "type": d.discount_type.as_str(),
        "amount": decimal_number(d.amount),
        "currency": d.currency,
        "percentage": percentage,
        "starts_at": iso(d.starts_at_ms),
        "expiry_date": iso(d.expires_at_ms),
        "max_redemptions": d.max_redemptions,
        "duration": d.duration.as_str(),
        "duration_in_months": d.duration_in_months,
        "applies_to_products": d.applies_to_products,
        "redeem_count": d.redeem_count,
        "created_at": format_iso8601_ms(d.created_at_ms),
        "updated_at": format_iso8601_ms(d.updated_at_ms),
    })
}

pub fn checkout(c: &Checkout) -> Value {
    json!({
        "id": c.id,
        "object": "checkout",
        "mode": c.mode.as_str(),
        "status": c.status.as_str(),
        "product_id": c.product_id,
        "customer_id": c.customer_id,
        "units": c.units,
        "amount": c.amount,
        "currency": c.currency,
        "discount_id": c.discount_id,
        "discount_code": c.discount_code,
        "affiliate_code": c.affiliate_code,
        "success_url": c.success_url,
        "metadata": c.metadata,
        "transaction_id": c.transaction_id,
        "subscription_id": c.subscription_id,
        "completed_at": iso(c.completed_at_ms),
        "created_at": format_iso8601_ms(c.created_at_ms),
        "updated_at": format_iso8601_ms(c.updated_at_ms),
    })
}

/// A transaction: amounts in minor units, times in epoch milliseconds (as the
/// webhook envelope's `created_at`).
pub fn transaction(p: &Payment) -> Value {
    json!({
        "id": p.id,
        "object": "transaction",
        "mode": p.mode.as_str(),
        "type": p.payment_type.as_str(),
        "status": p.status.as_str(),
        "amount": p.amount,
        "currency": p.currency,
        "amount_paid": p.amount_paid,
        "discount_amount": p.discount_amount,
        "tax_amount": p.tax_amount,
        "refunded_amount": p.refunded_amount,
        "tax_country": p.tax_country,
        "order": p.checkout_id,
        "subscription": p.subscription_id,
        "customer": p.customer_id,
        "description": p.description,
        "period_start": p.period_start_ms,
        "period_end": p.period_end_ms,
        "refunded_transaction": p.refund_of,
        "reason": p.reason,
        "disputed": p.disputed,
        "card_last4": p.card_last4,
        "lines": lines(&p.lines),
        "created_at": p.created_at_ms,
    })
}

/// A transaction's lines (`lines[]`: what it charges and why).
pub fn lines(lines: &[tally_domain::subscription::PaymentLine]) -> Value {
    Value::Array(
        lines
            .iter()
            .map(|l| {
                json!({
                    "description": l.description,
                    "meter_id": l.meter_id,
                    "quantity": canonical_decimal(l.quantity),
                    "unit_price": canonical_decimal(l.unit_price),
                    "amount": l.amount,
                })
            })
            .collect(),
    )
}

pub fn dispute(d: &Dispute) -> Value {
    json!({
        "id": d.id,
        "object": "dispute",
        "mode": d.mode.as_str(),
        "status": "needs_response",
        "transaction_id": d.transaction_id,
        "customer_id": d.customer_id,
        "amount": d.amount,
        "currency": d.currency,
        "reason": d.reason,
        "created_at": format_iso8601_ms(d.created_at_ms),
    })
}

/// A subscription with its product (as bought), its customer (as now, when known)
/// and its last paid transaction.
/// The settlement of a purchase's `credits` usage prices, one entry per price
/// (docs/api.md, "Usage prices"), added to the subscription (or one-time checkout)
/// it belongs to.
pub fn with_usage_settlement(
    mut object: Value,
    totals: &[tally_domain::settlement::SettlementTotals],
) -> Value {
    if let Value::Object(map) = &mut object {
        let entries = totals
            .iter()
            .map(|t| {
                json!({
                    "meter_id": t.meter_id,
                    "account_name": t.account_name,
                    "quantity": canonical_decimal(t.quantity),
                    "billed": canonical_decimal(t.billed),
                    "debited": canonical_decimal(t.debited),
                    "shortfall": canonical_decimal(t.shortfall),
                })
            })
            .collect();
        map.insert("usage_settlement".into(), Value::Array(entries));
    }
    object
}

pub fn subscription(
    s: &Subscription,
    customer_now: Option<&Customer>,
    last: Option<&Payment>,
) -> Value {
    let customer_json = match customer_now {
        Some(c) => customer(c),
        None => json!({ "id": s.customer_id, "object": "customer" }),
    };
    json!({
        "id": s.id,
        "object": "subscription",
        "mode": s.mode.as_str(),
        "status": s.status.as_str(),
        "product": product(&s.product),
        "customer": customer_json,
        "collection_method": "charge_automatically",
        "items": std::iter::once((&s.item_id, &s.product.id, s.units))
            .chain(s.extra_items.iter().map(|i| (&i.id, &i.product.id, i.units)))
            .map(|(id, product_id, units)| json!({
                "id": id,
                "object": "subscription_item",
                "mode": s.mode.as_str(),
                "product_id": product_id,
                "price_id": product_id,
                "units": units,
            }))
            .collect::<Vec<_>>(),
        "pending_lines": lines(&s.pending_lines),
        "last_transaction_id": s.last_transaction_id,
        "last_transaction": last.map(transaction),
        "last_transaction_date": iso(s.last_transaction_at_ms),
        // A period's end and the late usage billed after it charge no new period.
        "next_transaction_date": iso(s.due().and_then(|(at, kind)| {
            use tally_domain::subscription::DueKind;
            (!matches!(kind, DueKind::PeriodEnd | DueKind::LateUsage)).then_some(at)
        })),
        "current_period_start_date": iso(Some(s.current_period_start_ms)),
        "current_period_end_date": iso(Some(s.current_period_end_ms)),
        "trial_end_date": iso(s.trial_end_ms),
        "canceled_at": iso(s.canceled_at_ms),
        "cancel_at_period_end": s.on_period_end.is_some(),
        "on_period_end": s.on_period_end.map(|o| o.as_str()),
        "paused_at": iso(s.paused_at_ms),
        "payment_retries": s.retries,
        "next_retry_date": iso(s.next_retry_ms),
        "discount": s.discount.as_ref().map(|d| json!({
            "id": d.id,
            "discountCode": d.code,
            "name": d.name,
            "type": d.discount_type.as_str(),
            "amount": decimal_number(d.amount),
            "duration": d.duration.as_str(),
            "durationInMonths": d.duration_in_months,
        })),
        "metadata": s.metadata,
        "created_at": format_iso8601_ms(s.created_at_ms),
        "updated_at": format_iso8601_ms(s.updated_at_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_domain::meter::{Aggregation, MeterFilter, MeterStatus};
    use tally_domain::Mode;

    fn series(customer: Option<&str>, values: &[Option<i64>]) -> UsageSeries {
        UsageSeries {
            customer_id: customer.map(str::to_string),
            value: Some(Decimal::new(values.iter().flatten().sum(), 0)),
            windows: values
                .iter()
                .enumerate()
                .map(|(at, value)| WindowValue {
                    start_ms: at as i64 * 3_600_000,
                    end_ms: (at as i64 + 1) * 3_600_000,
                    value: value.map(|v| Decimal::new(v, 0)),
                })
                .collect(),
        }
    }

    /// The typed answer writes what the `Value` tree it replaced wrote: the same
    /// fields, in the same order, nulls included, groups only when asked for.
    #[test]
    fn a_usage_answer_has_the_documented_shape_in_wire_order() {
        let meter = Meter {
            id: "mtr_1".into(),
            store_id: "st_1".into(),
            mode: Mode::Test,
            name: "API calls".into(),
            event_name: "api_call".into(),
            aggregation: Aggregation::Sum,
            aggregation_property: Some("n".into()),
            filter: MeterFilter::default(),
            unit_label: "calls".into(),
            status: MeterStatus::Active,
            created_at_ms: 0,
            updated_at_ms: 0,
            counts_from_ms: 0,
            revision: 1,
        };
        let mut result = UsageResult {
            meter,
            start_ms: 0,
            end_ms: 7_200_000,
            total: series(None, &[Some(3), None]),
            groups: None,
        };
        let window = |start: &str, end: &str, value: Value| json!({"start": start, "end": end, "value": value});
        let first = window(
            "1970-01-01T00:00:00.000Z",
            "1970-01-01T01:00:00.000Z",
            json!("3"),
        );
        let second = window(
            "1970-01-01T01:00:00.000Z",
            "1970-01-01T02:00:00.000Z",
            Value::Null,
        );
        let expected = json!({
            "object": "meter_usage",
            "meter_id": "mtr_1",
            "customer_id": null,
            "aggregation": "sum",
            "unit_label": "calls",
            "start": "1970-01-01T00:00:00.000Z",
            "end": "1970-01-01T02:00:00.000Z",
            "window": "hour",
            "value": "3",
            "windows": [first.clone(), second.clone()],
        });
        let text = serde_json::to_string(&usage(&result, "hour")).unwrap();
        assert_eq!(text, serde_json::to_string(&expected).unwrap());

        result.groups = Some(vec![series(Some("cus_1"), &[Some(3), None])]);
        let mut expected = expected;
        expected["groups"] = json!([{
            "customer_id": "cus_1",
            "value": "3",
            "windows": [first, second],
        }]);
        let text = serde_json::to_string(&usage(&result, "hour")).unwrap();
        assert_eq!(text, serde_json::to_string(&expected).unwrap());
    }
}
