//! `/v1/events`: ingest, preview, list, get, void, amend.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::{Extension, Json};
use serde_json::{json, Value};
use tally_engine::events::EventFilter;
use tally_engine::Scope;

use crate::error::{ApiError, ApiResult};
use crate::extract::{page_request, parse_instant, Fields, JsonObject, PathId, QueryParams};
use crate::ingest_body::UsageEvents;
use crate::openapi as doc;
use crate::{answer_encoding, wire, AppState};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list))
        .routes(routes!(ingest))
        .routes(routes!(preview))
        .routes(routes!(get))
        .routes(routes!(void))
        .routes(routes!(amend))
}

#[utoipa::path(
    post,
    path = "/v1/events/ingest",
    operation_id = "events_ingest",
    tag = "events",
    summary = "Ingest usage events (all or nothing)",
    request_body(content = doc::IngestRequest, content_type = "application/json", example = json!({"events": [{"event_id": "req_8f2c", "name": "llm.completion", "external_customer_id": "user-42", "timestamp": "2026-11-24T10:00:00Z", "properties": {"tokens": 1250, "model": "gpt-x"}}]})),
    responses((status = 202, description = "Ingest usage events (all or nothing)", body = doc::IngestResult), (status = 400, description = "invalid_usage_event (param `events[N].<field>`)", body = doc::ErrorBody))
)]
pub async fn ingest(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    headers: HeaderMap,
    UsageEvents(raws): UsageEvents,
) -> ApiResult<(StatusCode, HeaderMap, Bytes)> {
    // The answer (a report per event) is serialized on the intake runtime too, as
    // `Json` would write it: on a request worker it was ~15% of the workers' time
    // under the ingest benchmark, at request priority, in front of the queries
    // those workers serve. For the same reason it is compressed there
    // (`crate::answer_encoding`).
    let (answer_headers, body) = crate::intake::run(async move {
        let outcome = state.engine.gateway().ingest_events(&scope, raws).await?;
        let json = serde_json::to_vec(&wire::ingest_answer(outcome))
            .map_err(|e| ApiError::internal(format!("serializing the ingest answer: {e}")))?;
        answer_encoding::encode(headers, "application/json", json).await
    })
    .await?;
    Ok((StatusCode::ACCEPTED, answer_headers, body))
}

#[utoipa::path(
    post,
    path = "/v1/events/preview",
    operation_id = "events_preview",
    tag = "events",
    summary = "Validate usage events without writing them",
    request_body(content = doc::PreviewRequest, content_type = "application/json"),
    responses((status = 200, description = "Validate usage events without writing them", body = doc::IngestPreview))
)]
pub async fn preview(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    UsageEvents(raws): UsageEvents,
) -> ApiResult<Json<Value>> {
    let reports = state.engine.gateway().preview_events(&scope, raws).await?;
    Ok(Json(json!({
        "object": "ingest_preview",
        "valid": reports.iter().all(|r| r.valid),
        "events": reports.iter().map(wire::preview_report).collect::<Vec<_>>(),
    })))
}

#[utoipa::path(
    get,
    path = "/v1/events/{event_id}",
    operation_id = "events_get",
    tag = "events",
    summary = "Get a stored usage event",
    params(("event_id" = String, Path, description = "the event id")),
    responses((status = 200, description = "Get a stored usage event", body = doc::UsageEvent))
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(event_id): PathId,
) -> ApiResult<Json<Value>> {
    let metering = state.engine.metering();
    let event = metering.get_event(&scope, &event_id).await?;
    let void = metering.event_void(&scope, &event_id)?;
    Ok(Json(wire::usage_event(&event, &scope, void.as_ref())))
}

#[utoipa::path(
    post,
    path = "/v1/events/void",
    operation_id = "events_void",
    tag = "events",
    summary = "Void stored usage events (all or nothing)",
    request_body(content = doc::VoidRequest, content_type = "application/json", example = json!({"event_ids": ["req_8f2c"], "reason": "sent twice by a retry bug"})),
    responses((status = 200, description = "Void stored usage events (all or nothing)", body = doc::EventVoid), (status = 400, description = "parameter_missing / parameter_invalid (param `event_ids`, `event_ids[N]` or `reason`)", body = doc::ErrorBody), (status = 404, description = "event_not_found (param `event_ids[N]`): nothing was voided", body = doc::ErrorBody))
)]
pub async fn void(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let event_ids = fields
        .strings("event_ids")?
        .ok_or_else(|| tally_domain::FieldError::missing("event_ids"))?;
    let reason = fields.required_string("reason")?;
    let result = state
        .engine
        .metering()
        .void_events(&scope, &event_ids, &reason)
        .await?;
    Ok(Json(json!({
        "object": "event_void",
        "voided": result.voided,
        "already_voided": result.already_voided,
    })))
}

#[utoipa::path(
    post,
    path = "/v1/events/{event_id}/amend",
    operation_id = "events_amend",
    tag = "events",
    summary = "Amend a stored usage event: void it and store its replacement, in one record",
    params(("event_id" = String, Path, description = "the event to amend")),
    request_body(content = doc::AmendRequest, content_type = "application/json", example = json!({"event": {"properties": {"tokens": 125}}, "reason": "tokens were counted ten times"})),
    responses((status = 200, description = "The amended event's id (now voided) and its replacement", body = doc::EventAmendment), (status = 400, description = "parameter_missing / parameter_invalid / invalid_usage_event (param `reason`, `event`, `event.<field>`)", body = doc::ErrorBody), (status = 404, description = "event_not_found: nothing was amended", body = doc::ErrorBody), (status = 409, description = "event_voided (the event is voided) / event_id_taken (param `event.event_id`)", body = doc::ErrorBody))
)]
pub async fn amend(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(event_id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let event = fields
        .object("event")?
        .ok_or_else(|| tally_domain::FieldError::missing("event"))?;
    for customer in ["customer_id", "external_customer_id"] {
        if event.has(customer) {
            return Err(tally_engine::ingest::amend::refuse_customer_change(customer).into());
        }
    }
    let under = |e: tally_domain::FieldError| {
        tally_domain::FieldError::new(e.code, format!("event.{}", e.param), e.message)
    };
    let changes = tally_domain::usage::EventChanges {
        event_id: event.string("event_id").map_err(under)?,
        name: event.string("name").map_err(under)?,
        timestamp: event.string("timestamp").map_err(under)?,
        properties: crate::ingest_body::raw_properties(event.map.get("properties").cloned())
            .map_err(under)?,
    };
    let reason = fields.required_string("reason")?;
    let replacement = state
        .engine
        .gateway()
        .amend_event(&scope, &event_id, &changes, &reason)
        .await?;
    Ok(Json(json!({
        "object": "event_amendment",
        "voided": event_id,
        "replacement": wire::usage_event(&replacement, &scope, None),
    })))
}

#[utoipa::path(
    get,
    path = "/v1/events",
    operation_id = "events_list",
    tag = "events",
    summary = "List stored usage events, newest received first",
    params(doc::CursorParams, ("customer_id" = Option<String>, Query, description = "one customer"), ("external_customer_id" = Option<String>, Query, description = "one customer, by external id"), ("name" = Option<String>, Query, description = "the event name"), ("meter_id" = Option<String>, Query, description = "events a meter matched"), ("start" = Option<String>, Query, description = "ISO 8601, on the event timestamp"), ("end" = Option<String>, Query, description = "ISO 8601, on the event timestamp"), ("include_voided" = Option<bool>, Query, description = "`true`: voided events too (left out by default)")),
    responses((status = 200, description = "List stored usage events, newest received first", body = doc::List<doc::UsageEvent>), (status = 404, description = "resource_missing: the customer named by `customer_id` or `external_customer_id`", body = doc::ErrorBody))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let page = page_request(&query)?;
    let customer_id = match (query.get("customer_id"), query.get("external_customer_id")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "customer_id",
                "give at most one of `customer_id` and `external_customer_id`",
            ))
        }
        (Some(id), None) => Some(id.to_string()),
        (None, Some(external)) => state
            .engine
            .directory()
            .customer_id_by_external(&scope, external)?,
        (None, None) => None,
    };
    // A filter naming a customer that does not exist is a 404 naming the parameter,
    // as on usage queries and transaction lists (docs/api.md, "Lists").
    match (&customer_id, query.get("external_customer_id")) {
        (None, Some(external)) => {
            return Err(tally_engine::EngineError::not_found("customer", external)
                .for_param("external_customer_id")
                .into())
        }
        (Some(id), _) if !state.engine.directory().customer_exists(&scope, id)? => {
            return Err(tally_engine::EngineError::not_found("customer", id)
                .for_param("customer_id")
                .into())
        }
        _ => {}
    }
    let filter = EventFilter {
        customer_id,
        name: query.get("name").map(str::to_string),
        meter_id: query.get("meter_id").map(str::to_string),
        start_ms: query
            .get("start")
            .map(|s| parse_instant("start", s))
            .transpose()?,
        end_ms: query
            .get("end")
            .map(|s| parse_instant("end", s))
            .transpose()?,
        include_voided: match query.get("include_voided") {
            None | Some("false") => false,
            Some("true") => true,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "include_voided",
                    "`include_voided` is `true` or `false`",
                ))
            }
        },
    };
    let page = state
        .engine
        .metering()
        .list_events(&scope, &filter, &page)
        .await?;
    let metering = state.engine.metering();
    let mut voids = std::collections::HashMap::new();
    if filter.include_voided {
        for event in &page.data {
            if let Some(void) = metering.event_void(&scope, &event.event_id)? {
                voids.insert(event.event_id.clone(), void);
            }
        }
    }
    Ok(Json(wire::list(&page, |e| {
        wire::usage_event(e, &scope, voids.get(&e.event_id))
    })))
}
