//! `/v1/meters`: create, list, get, update, archive, unarchive, backfill, revisions,
//! usage and previews.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use tally_domain::meter::{
    validate_meter, FilterValue, MeterInput, RawFilterClause, RawMeterFilter, RevisionInput,
};
use tally_domain::time::Window;
use tally_domain::usage::parse_decimal;
use tally_domain::FieldError;
use tally_engine::meters::{MeterUpdate, IMMUTABLE_METER_FIELDS};
use tally_engine::usage::UsageQuery;
use tally_engine::Scope;

use crate::error::{ApiError, ApiResult};
use crate::extract::{
    number_text, page_request, parse_instant, status_filter, Fields, JsonObject, PathId,
    QueryParams,
};
use crate::openapi as doc;
use crate::{wire, AppState};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(preview_definition))
        .routes(routes!(get, update))
        .routes(routes!(archive))
        .routes(routes!(unarchive))
        .routes(routes!(backfill))
        .routes(routes!(revise))
        .routes(routes!(preview_existing))
        .routes(routes!(usage))
}

/// Fields of a meter that no update changes and that are not definition fields
/// (those answer `meter_field_immutable`).
const NOT_UPDATABLE_METER_FIELDS: [&str; 9] = [
    "id",
    "object",
    "store_id",
    "mode",
    "status",
    "counts_from",
    "revision",
    "created_at",
    "updated_at",
];

fn filter_value(param: &str, value: &Value, in_list: bool) -> Result<FilterValue, FieldError> {
    match value {
        Value::String(s) => Ok(FilterValue::String(s.clone())),
        Value::Bool(b) => Ok(FilterValue::Bool(*b)),
        Value::Number(n) => parse_decimal(&number_text(n))
            .map(FilterValue::Number)
            .ok_or_else(|| {
                FieldError::invalid(param, "the number does not fit 28 significant digits")
            }),
        Value::Array(items) if !in_list => Ok(FilterValue::List(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| filter_value(&format!("{param}[{i}]"), item, true))
                .collect::<Result<_, _>>()?,
        )),
        _ => Err(FieldError::invalid(
            param,
            "a clause value is a string, number, boolean, or (for `in`) an array of those",
        )),
    }
}

fn raw_filter(value: &Value) -> Result<RawMeterFilter, FieldError> {
    let Value::Object(object) = value else {
        return Err(FieldError::invalid(
            "filter",
            "`filter` must be an object {conjunction, clauses}",
        ));
    };
    let conjunction = match object.get("conjunction") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(FieldError::invalid(
                "filter.conjunction",
                "`conjunction` must be `and` or `or`",
            ))
        }
    };
    let clauses = match object.get("clauses") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let at = |f: &str| format!("filter.clauses[{i}].{f}");
                let Value::Object(clause) = item else {
                    return Err(FieldError::invalid(
                        format!("filter.clauses[{i}]"),
                        "a clause is an object {property, operator, value}",
                    ));
                };
                let text = |name: &str| match clause.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(FieldError::invalid(
                        at(name),
                        format!("`{name}` must be a string"),
                    )),
                };
                Ok(RawFilterClause {
                    property: text("property")?,
                    operator: text("operator")?,
                    value: match clause.get("value") {
                        None | Some(Value::Null) => None,
                        Some(v) => Some(filter_value(&at("value"), v, false)?),
                    },
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(FieldError::invalid(
                "filter.clauses",
                "`clauses` must be an array",
            ))
        }
    };
    Ok(RawMeterFilter {
        conjunction,
        clauses,
    })
}

fn meter_input(body: &Map<String, Value>) -> Result<MeterInput, FieldError> {
    let fields = Fields::new(body);
    Ok(MeterInput {
        name: fields.string("name")?,
        event_name: fields.string("event_name")?,
        aggregation: fields.string("aggregation")?,
        aggregation_property: fields.string("aggregation_property")?,
        filter: match body.get("filter") {
            None | Some(Value::Null) => None,
            Some(v) => Some(raw_filter(v)?),
        },
        unit_label: fields.string("unit_label")?,
    })
}

#[utoipa::path(
    post,
    path = "/v1/meters",
    operation_id = "meters_create",
    tag = "meters",
    summary = "Create a meter",
    request_body(content = doc::MeterCreate, content_type = "application/json", example = json!({"name": "LLM tokens", "event_name": "llm.completion", "aggregation": "sum", "aggregation_property": "tokens", "filter": {"conjunction": "and", "clauses": [{"property": "model", "operator": "in", "value": ["gpt-x", "gpt-y"]}]}, "unit_label": "tokens"})),
    responses((status = 200, description = "Create a meter", body = doc::Meter), (status = 409, description = "meter_name_taken, meter_limit_reached", body = doc::ErrorBody))
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let meter = state
        .engine
        .metering()
        .create_meter(&scope, &meter_input(&body)?)
        .await?;
    Ok(Json(wire::meter(&meter)))
}

#[utoipa::path(
    get,
    path = "/v1/meters/{id}",
    operation_id = "meters_get",
    tag = "meters",
    summary = "Get a meter",
    params(doc::IdParam),
    responses((status = 200, description = "Get a meter", body = doc::Meter))
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::meter(
        &state.engine.metering().get_meter(&scope, &id)?,
    )))
}

#[utoipa::path(
    get,
    path = "/v1/meters",
    operation_id = "meters_list",
    tag = "meters",
    summary = "List meters",
    params(doc::CursorParams, ("status" = Option<String>, Query, description = "`active` (default), `archived` or `all`")),
    responses((status = 200, description = "List meters", body = doc::List<doc::Meter>))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = state.engine.metering().list_meters(
        &scope,
        status_filter(&query)?,
        &page_request(&query)?,
    )?;
    Ok(Json(wire::list(&page, wire::meter)))
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}",
    operation_id = "meters_update",
    tag = "meters",
    summary = "Rename a meter or change its unit label",
    params(doc::IdParam),
    request_body(content = doc::MeterUpdate, content_type = "application/json"),
    responses((status = 200, description = "Rename a meter or change its unit label", body = doc::Meter), (status = 400, description = "meter_field_immutable, parameter_unknown, parameter_invalid", body = doc::ErrorBody), (status = 409, description = "meter_name_taken", body = doc::ErrorBody))
)]
pub async fn update(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    // A meter field an update cannot take is named, never silently ignored; a field
    // that is no meter field at all is ignored like in every request body
    // (docs/api.md, "Errors, request ids, limits").
    if let Some(field) = body
        .keys()
        .find(|k| NOT_UPDATABLE_METER_FIELDS.contains(&k.as_str()))
    {
        let message = if field == "status" {
            "`status` changes through POST /v1/meters/{id}/archive and /unarchive".to_string()
        } else {
            format!("a meter update takes `name` and `unit_label`; `{field}` is not one of them")
        };
        return Err(
            tally_domain::FieldError::new("parameter_unknown", field.clone(), message).into(),
        );
    }
    let fields = Fields::new(&body);
    let update = MeterUpdate {
        name: fields.string("name")?,
        unit_label: fields.string("unit_label")?,
        immutable_fields: IMMUTABLE_METER_FIELDS
            .iter()
            .filter(|f| body.contains_key(**f))
            .map(|f| f.to_string())
            .collect(),
    };
    Ok(Json(wire::meter(
        &state
            .engine
            .metering()
            .update_meter(&scope, &id, &update)
            .await?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}/archive",
    operation_id = "meters_archive",
    tag = "meters",
    summary = "Archive a meter",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Archive a meter", body = doc::Meter), (status = 409, description = "meter_in_use", body = doc::ErrorBody))
)]
pub async fn archive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::meter(
        &state.engine.metering().archive_meter(&scope, &id).await?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}/unarchive",
    operation_id = "meters_unarchive",
    tag = "meters",
    summary = "Unarchive a meter",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Unarchive a meter", body = doc::Meter), (status = 409, description = "meter_name_taken, meter_limit_reached", body = doc::ErrorBody))
)]
pub async fn unarchive(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    Ok(Json(wire::meter(
        &state.engine.metering().unarchive_meter(&scope, &id).await?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}/backfill",
    operation_id = "meters_backfill",
    tag = "meters",
    summary = "Count stored events from `start` on",
    params(doc::IdParam),
    request_body(content = doc::Backfill, content_type = "application/json"),
    responses((status = 200, description = "Count stored events from `start` on", body = doc::Meter))
)]
pub async fn backfill(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let start = Fields::new(&body).required_string("start")?;
    let start_ms = parse_instant("start", &start)?;
    Ok(Json(wire::meter(
        &state
            .engine
            .metering()
            .backfill_meter(&scope, &id, start_ms)
            .await?,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}/revisions",
    operation_id = "meters_revise",
    tag = "meters",
    summary = "Revise a meter's filter or aggregation property, re-deriving its usage from the stored events",
    params(doc::IdParam),
    request_body(content = doc::MeterRevisionRequest, content_type = "application/json", example = json!({"filter": {"conjunction": "and", "clauses": [{"property": "model", "operator": "eq", "value": "gpt-x"}]}, "dry_run": true})),
    responses((status = 200, description = "The customers whose usage changes (dry run) or changed", body = doc::MeterRevision), (status = 400, description = "parameter_missing / parameter_invalid (`dry_run`, `filter`, `aggregation_property`)", body = doc::ErrorBody), (status = 409, description = "meter_not_active, resource_changed (revised meanwhile)", body = doc::ErrorBody))
)]
pub async fn revise(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let dry_run = fields
        .boolean("dry_run")?
        .ok_or_else(|| FieldError::missing("dry_run"))?;
    let input = RevisionInput {
        filter: match body.get("filter") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(value) => Some(Some(raw_filter(value)?)),
        },
        aggregation_property: match body.get("aggregation_property") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(_) => Some(fields.string("aggregation_property")?),
        },
    };
    let result = state
        .engine
        .metering()
        .revise_meter(&scope, &id, &input, dry_run)
        .await?;
    let changes: Vec<Value> = result
        .changes
        .iter()
        .map(|c| {
            json!({
                "customer_id": c.customer_id,
                "before": c.before.map(|d| d.normalize().to_string()),
                "after": c.after.map(|d| d.normalize().to_string()),
            })
        })
        .collect();
    let mut answer = json!({
        "object": "meter_revision",
        "dry_run": result.dry_run,
        "revision": result.meter.revision + u32::from(result.dry_run),
        "changes": changes,
    });
    if !result.dry_run {
        answer["meter"] = wire::meter(&result.meter);
    }
    Ok(Json(answer))
}

fn window_param(text: Option<&str>) -> Result<(Window, String), FieldError> {
    let text = text.unwrap_or("none");
    Window::parse(text)
        .map(|w| (w, text.to_string()))
        .ok_or_else(|| {
            FieldError::invalid(
                "window",
                "`window` must be minute, hour, day, month or none",
            )
        })
}

/// The customer of a usage or preview request: `customer_id` or `external_customer_id`.
fn customer_param(
    state: &AppState,
    scope: &Scope,
    customer_id: Option<&str>,
    external_customer_id: Option<&str>,
) -> ApiResult<Option<String>> {
    match (customer_id, external_customer_id) {
        (Some(_), Some(_)) => Err(ApiError::invalid_param(
            "customer_id",
            "give at most one of `customer_id` and `external_customer_id`",
        )),
        (Some(id), None) => {
            state
                .engine
                .directory()
                .get_customer(scope, id)
                .map_err(|e| ApiError::from(e).with_param("customer_id"))?;
            Ok(Some(id.to_string()))
        }
        (None, Some(external)) => match state
            .engine
            .directory()
            .customer_id_by_external(scope, external)?
        {
            Some(id) => Ok(Some(id)),
            None => Err(
                ApiError::from(tally_engine::EngineError::not_found("customer", external))
                    .with_param("external_customer_id"),
            ),
        },
        (None, None) => Ok(None),
    }
}

/// `start` and `end` of a range. `end` defaults to now plus the future skew ingest
/// accepts (so every ingested event is inside), `start` to 35 days (the ingest
/// horizon) before now. "Now" is the scope's time, as ingest's default timestamp is:
/// a test store's test clock once advanced (docs/api.md, "Test clock").
fn range(
    state: &AppState,
    scope: &Scope,
    start: Option<&str>,
    end: Option<&str>,
) -> Result<(i64, i64), FieldError> {
    let now = state.engine.journal().now_in(scope);
    let end_ms = match end {
        Some(text) => parse_instant("end", text)?,
        None => now + tally_domain::limits::MAX_EVENT_FUTURE_SKEW_MS,
    };
    let start_ms = match start {
        Some(text) => parse_instant("start", text)?,
        None => now - tally_domain::limits::MAX_EVENT_AGE_MS,
    };
    if end_ms <= start_ms {
        return Err(FieldError::invalid("end", "`end` must be after `start`"));
    }
    Ok((start_ms, end_ms))
}

#[utoipa::path(
    get,
    path = "/v1/meters/{id}/usage",
    operation_id = "meters_usage",
    tag = "usage",
    summary = "Query a meter's usage",
    params(doc::IdParam, ("customer_id" = Option<String>, Query, description = "one customer"), ("external_customer_id" = Option<String>, Query, description = "one customer, by external id"), ("start" = Option<String>, Query, description = "ISO 8601, rounded down to the minute (default now - 35 days)"), ("end" = Option<String>, Query, description = "ISO 8601, rounded up to the minute (default now + 5 minutes)"), ("window" = Option<String>, Query, description = "`none` (default), `minute`, `hour`, `day`"), ("group_by" = Option<String>, Query, description = "`customer_id`")),
    responses((status = 200, description = "Query a meter's usage", body = doc::MeterUsage), (status = 404, description = "resource_missing: the meter, or the customer named by `customer_id` or `external_customer_id`", body = doc::ErrorBody))
)]
pub async fn usage(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Response> {
    let (window, window_text) = window_param(query.get("window"))?;
    let (start_ms, end_ms) = range(&state, &scope, query.get("start"), query.get("end"))?;
    let group_by_customer = match query.get("group_by") {
        None => false,
        Some("customer_id") => true,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "group_by",
                "`group_by` supports only customer_id",
            ))
        }
    };
    // Resolve the meter first, so an unknown meter is a 404 whatever else is wrong.
    state.engine.metering().get_meter(&scope, &id)?;
    let customer_id = customer_param(
        &state,
        &scope,
        query.get("customer_id"),
        query.get("external_customer_id"),
    )?;
    let engine = state.engine.clone();
    let result = crate::bounded_read(move || {
        engine.metering().query_usage(
            &scope,
            &UsageQuery {
                meter_id: id,
                customer_id,
                start_ms,
                end_ms,
                window,
                group_by_customer,
            },
        )
    })
    .await?;
    Ok(Json(wire::usage(&result, &window_text)).into_response())
}

/// Shared by both preview endpoints: the range, customer and window of the body.
async fn run_preview(
    state: &AppState,
    scope: &Scope,
    definition: &tally_domain::meter::MeterDefinition,
    body: &Map<String, Value>,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(body);
    let (start_ms, end_ms) = range(
        state,
        scope,
        fields.string("start")?.as_deref(),
        fields.string("end")?.as_deref(),
    )?;
    let (window, _) = window_param(fields.string("window")?.as_deref())?;
    let customer = customer_param(
        state,
        scope,
        fields.string("customer_id")?.as_deref(),
        fields.string("external_customer_id")?.as_deref(),
    )?;
    let (series, scanned, matched, truncated) = state
        .engine
        .metering()
        .preview_meter(
            scope,
            definition,
            customer.as_deref(),
            start_ms,
            end_ms,
            window,
        )
        .await?;
    Ok(Json(wire::meter_preview(
        &series,
        definition.aggregation.as_str(),
        scanned,
        matched,
        truncated,
    )))
}

/// `POST /v1/meters/preview`: a definition in the body (same fields as create; the
/// name may be left out).
#[utoipa::path(
    post,
    path = "/v1/meters/preview",
    operation_id = "meters_preview_definition",
    tag = "meters",
    summary = "Preview a meter definition over stored events",
    request_body(content = doc::DefinitionPreview, content_type = "application/json"),
    responses((status = 200, description = "Preview a meter definition over stored events", body = doc::MeterPreview), (status = 404, description = "resource_missing: the customer named by `customer_id` or `external_customer_id`", body = doc::ErrorBody))
)]
pub async fn preview_definition(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let mut input = meter_input(&body)?;
    input.name.get_or_insert_with(|| "preview".to_string());
    let definition = validate_meter(&input)?;
    run_preview(&state, &scope, &definition, &body).await
}

#[utoipa::path(
    post,
    path = "/v1/meters/{id}/preview",
    operation_id = "meters_preview_existing",
    tag = "meters",
    summary = "Preview a meter over stored events",
    params(doc::IdParam),
    request_body(content = doc::MeterPreviewRequest, content_type = "application/json"),
    responses((status = 200, description = "Preview a meter over stored events", body = doc::MeterPreview))
)]
pub async fn preview_existing(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let meter = state.engine.metering().get_meter(&scope, &id)?;
    let definition = tally_domain::meter::MeterDefinition {
        name: meter.name.clone(),
        event_name: meter.event_name.clone(),
        aggregation: meter.aggregation,
        aggregation_property: meter.aggregation_property.clone(),
        filter: meter.filter.clone(),
        unit_label: meter.unit_label.clone(),
    };
    run_preview(&state, &scope, &definition, &body).await
}
