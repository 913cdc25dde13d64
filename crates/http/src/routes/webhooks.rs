//! `/v1/webhooks`: endpoints, secrets, deliveries, resend, and the cli pending feed.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use tally_domain::record::WebhookAttempt;
use tally_domain::time::format_iso8601_ms;
use tally_domain::webhook::{DeliveryMode, WebhookEndpoint};
use tally_engine::webhooks::EndpointInput;
use tally_engine::Scope;

use crate::error::{ApiError, ApiResult};
use crate::extract::{page_request, Fields, JsonObject, PathId, PathIds, QueryParams};
use crate::openapi as doc;
use crate::webhooks::{delivery_headers, event_body};
use crate::wire;
use crate::AppState;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(get, update, delete))
        .routes(routes!(secret))
        .routes(routes!(rotate))
        .routes(routes!(deliveries))
        .routes(routes!(pending))
        .routes(routes!(resend))
        .routes(routes!(ack))
}

/// Pending events returned at once (docs/api.md: 1..100, default 10).
pub const MAX_PENDING_LIMIT: usize = 100;
pub const DEFAULT_PENDING_LIMIT: usize = 10;

fn endpoint_json(e: &WebhookEndpoint, with_secret: bool) -> Value {
    let mut value = json!({
        "id": e.id,
        "object": "webhook",
        "mode": e.mode.as_str(),
        "store_id": e.store_id,
        "name": e.name,
        "url": e.url,
        "delivery_mode": e.delivery_mode.as_str(),
        "status": if e.enabled { "enabled" } else { "disabled" },
        "events": e.events,
        "created_at": format_iso8601_ms(e.created_at_ms),
        "updated_at": format_iso8601_ms(e.updated_at_ms),
    });
    if with_secret {
        value["secret"] = Value::String(e.secret.clone());
    }
    value
}

fn attempt_json(a: &WebhookAttempt) -> Value {
    json!({
        "id": tally_engine::webhooks::attempt_id(a),
        "object": "webhook_attempt",
        "endpoint_id": *a.endpoint_id,
        "event_id": a.event_id,
        "attempt": a.attempt,
        "status_code": if a.status_code == 0 { Value::Null } else { json!(a.status_code) },
        "latency_ms": a.latency_ms,
        // Not `error`: a 200 answer with a top-level `error` key reads as an error
        // envelope to clients that look for one (docs/api.md, "Errors").
        "failure_reason": if a.error.is_empty() { Value::Null } else { json!(a.error) },
        "delivered": a.delivered,
        "manual": a.manual,
        "next_attempt_at": a.next_attempt_at_ms.map(format_iso8601_ms),
        "created_at": format_iso8601_ms(a.at_ms),
    })
}

fn endpoint_input(body: &Map<String, Value>) -> Result<EndpointInput, ApiError> {
    let fields = Fields::new(body);
    let events = match body.get("events") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid_param(&format!("events[{i}]"), "event types are strings")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "events",
                "`events` must be an array of event types",
            ))
        }
    };
    Ok(EndpointInput {
        name: fields.string("name")?,
        url: fields.string("url")?,
        delivery_mode: fields.string("delivery_mode")?,
        events,
        status: fields.string("status")?,
    })
}

#[utoipa::path(
    post,
    path = "/v1/webhooks",
    operation_id = "webhooks_create",
    tag = "webhooks",
    summary = "Create a webhook endpoint (answers its secret)",
    request_body(content = doc::WebhookCreate, content_type = "application/json", example = json!({"name": "billing", "url": "https://hooks.example.com/tally", "events": ["checkout.completed", "subscription.paid", "credits.consumed"]})),
    responses((status = 200, description = "Create a webhook endpoint (answers its secret)", body = doc::Webhook), (status = 409, description = "webhook_limit_reached", body = doc::ErrorBody))
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let endpoint = state
        .engine
        .notifications()
        .create_endpoint(
            &scope,
            &endpoint_input(&body)?,
            state.config.allow_private_webhooks,
        )
        .await?;
    Ok(Json(endpoint_json(&endpoint, true)))
}

/// `GET /v1/webhooks`: newest first, a cursor list (at most
/// `MAX_ENDPOINTS_PER_SCOPE` endpoints exist, so it pages in memory).
#[utoipa::path(
    get,
    path = "/v1/webhooks",
    operation_id = "webhooks_list",
    tag = "webhooks",
    summary = "List webhook endpoints",
    params(doc::CursorParams),
    responses((status = 200, description = "List webhook endpoints", body = doc::List<doc::Webhook>))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let endpoints = state.engine.notifications().list_endpoints(&scope)?;
    let page = tally_engine::pagination::paginate_slice(endpoints, &page_request(&query)?, |e| {
        e.id.to_string()
    })?;
    Ok(Json(wire::list(&page, |e| endpoint_json(e, false))))
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{id}",
    operation_id = "webhooks_get",
    tag = "webhooks",
    summary = "Get a webhook endpoint",
    params(doc::IdParam),
    responses((status = 200, description = "Get a webhook endpoint", body = doc::Webhook))
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    Ok(Json(endpoint_json(
        &state.engine.notifications().get_endpoint(&scope, &id)?,
        false,
    )))
}

#[utoipa::path(
    post,
    path = "/v1/webhooks/{id}",
    operation_id = "webhooks_update",
    tag = "webhooks",
    summary = "Update a webhook endpoint",
    params(doc::IdParam),
    request_body(content = doc::WebhookInput, content_type = "application/json", example = json!({"name": "billing", "url": "https://hooks.example.com/tally", "events": ["checkout.completed", "subscription.paid", "credits.consumed"]})),
    responses((status = 200, description = "Update a webhook endpoint", body = doc::Webhook), (status = 400, description = "webhook_field_immutable, parameter_invalid", body = doc::ErrorBody))
)]
pub async fn update(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let endpoint = state
        .engine
        .notifications()
        .update_endpoint(
            &scope,
            &id,
            &endpoint_input(&body)?,
            state.config.allow_private_webhooks,
        )
        .await?;
    Ok(Json(endpoint_json(&endpoint, false)))
}

#[utoipa::path(
    delete,
    path = "/v1/webhooks/{id}",
    operation_id = "webhooks_delete",
    tag = "webhooks",
    summary = "Delete a webhook endpoint",
    params(doc::IdParam),
    responses((status = 200, description = "Delete a webhook endpoint", body = doc::Deleted))
)]
pub async fn delete(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let endpoint = state
        .engine
        .notifications()
        .delete_endpoint(&scope, &id)
        .await?;
    Ok(Json(
        json!({"id": endpoint.id, "object": "webhook", "deleted": true}),
    ))
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{id}/secret",
    operation_id = "webhooks_secret",
    tag = "webhooks",
    summary = "Get an endpoint's signing secret",
    params(doc::IdParam),
    responses((status = 200, description = "Get an endpoint's signing secret", body = doc::WebhookSecret))
)]
pub async fn secret(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
) -> ApiResult<Json<Value>> {
    let endpoint = state.engine.notifications().get_endpoint(&scope, &id)?;
    Ok(Json(
        json!({"object": "webhook_secret", "secret": endpoint.secret}),
    ))
}

#[utoipa::path(
    post,
    path = "/v1/webhooks/{id}/secret/rotate",
    operation_id = "webhooks_rotate",
    tag = "webhooks",
    summary = "Rotate the signing secret (the old one signs for 24 h more)",
    params(doc::IdParam),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Rotate the signing secret (the old one signs for 24 h more)", body = doc::Webhook))
)]
pub async fn rotate(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let endpoint = state
        .engine
        .notifications()
        .rotate_secret(&scope, &id)
        .await?;
    Ok(Json(endpoint_json(&endpoint, true)))
}

fn limit(query: &QueryParams) -> Result<usize, ApiError> {
    match query.get("limit") {
        None => Ok(DEFAULT_PENDING_LIMIT),
        Some(text) => match text.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_PENDING_LIMIT).contains(&n) => Ok(n),
            _ => Err(ApiError::invalid_param(
                "limit",
                "`limit` must be an integer from 1 to 100",
            )),
        },
    }
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{id}/deliveries",
    operation_id = "webhooks_deliveries",
    tag = "webhooks",
    summary = "List delivery attempts, newest first",
    params(doc::IdParam, doc::CursorParams),
    responses((status = 200, description = "List delivery attempts, newest first", body = doc::List<doc::WebhookAttempt>))
)]
pub async fn deliveries(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    state.engine.notifications().get_endpoint(&scope, &id)?;
    let page = state
        .engine
        .notifications()
        .list_attempts(&scope, &id, &page_request(&query)?)?;
    Ok(Json(wire::list(&page, attempt_json)))
}

#[utoipa::path(
    post,
    path = "/v1/webhooks/{id}/events/{event_id}/resend",
    operation_id = "webhooks_resend",
    tag = "webhooks",
    summary = "Make one extra delivery attempt now",
    params(("id" = String, Path, description = "the endpoint id"), ("event_id" = String, Path, description = "the event id")),
    request_body(content = doc::NoBody, content_type = "application/json"),
    responses((status = 200, description = "Make one extra delivery attempt now", body = doc::WebhookAttempt), (status = 400, description = "webhook_is_cli", body = doc::ErrorBody), (status = 503, description = "endpoint_busy", body = doc::ErrorBody))
)]
pub async fn resend(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathIds(id, event_id): PathIds,
    JsonObject(_): JsonObject,
) -> ApiResult<Json<Value>> {
    let endpoint = state.engine.notifications().get_endpoint(&scope, &id)?;
    if endpoint.delivery_mode == DeliveryMode::Cli {
        return Err(ApiError::bad_request(
            "webhook_is_cli",
            "cli endpoints keep events in their pending feed until acknowledged; nothing to resend",
        ));
    }
    let delivery =
        state
            .engine
            .notifications()
            .get_delivery(&scope, &id.as_str().into(), &event_id)?;
    let attempt = state.dispatcher.resend(&scope, &delivery).await?;
    Ok(Json(attempt_json(&attempt)))
}

fn require_cli(endpoint: &WebhookEndpoint) -> Result<(), ApiError> {
    if endpoint.delivery_mode == DeliveryMode::Cli {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "webhook_not_cli",
            "the pending feed exists only for endpoints with delivery_mode `cli`",
        ))
    }
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{id}/events/pending",
    operation_id = "webhooks_pending",
    tag = "webhooks",
    summary = "The cli feed: events not yet acknowledged",
    params(doc::IdParam, ("limit" = Option<u32>, Query, description = "1..100, default 10")),
    responses((status = 200, description = "The cli feed: events not yet acknowledged", body = doc::PendingEvents), (status = 400, description = "webhook_not_cli, parameter_invalid", body = doc::ErrorBody))
)]
pub async fn pending(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathId(id): PathId,
    query: QueryParams,
) -> ApiResult<Json<Value>> {
    let limit = limit(&query)?;
    let endpoint = state.engine.notifications().get_endpoint(&scope, &id)?;
    require_cli(&endpoint)?;
    let now = state.engine.now_ms();
    let mut items = Vec::new();
    for delivery in state
        .engine
        .notifications()
        .pending_deliveries(&scope, &id, limit)?
    {
        let body = event_body(&state.engine, &scope, &delivery)?;
        let headers: Map<String, Value> = delivery_headers(&endpoint, &delivery, &body, now)
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        items.push(json!({
            "id": delivery.event_id,
            "object": "webhook_event",
            "event_type": delivery.event_type,
            "created_at": format_iso8601_ms(delivery.created_at_ms),
            "body": body,
            "headers": headers,
        }));
    }
    Ok(Json(json!({"object": "list", "items": items})))
}

#[utoipa::path(
    post,
    path = "/v1/webhooks/{id}/events/{event_id}/ack",
    operation_id = "webhooks_ack",
    tag = "webhooks",
    summary = "Acknowledge a cli event",
    params(("id" = String, Path, description = "the endpoint id"), ("event_id" = String, Path, description = "the event id")),
    request_body(content = doc::Ack, content_type = "application/json"),
    responses((status = 200, description = "Acknowledge a cli event", body = doc::WebhookAttempt), (status = 400, description = "webhook_not_cli, parameter_invalid", body = doc::ErrorBody), (status = 409, description = "webhook_event_acknowledged", body = doc::ErrorBody))
)]
pub async fn ack(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    PathIds(id, event_id): PathIds,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let status = match body.get("status") {
        Some(Value::Number(n)) => {
            n.as_u64()
                .filter(|s| (100..=599).contains(s))
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "status",
                        "`status` must be an HTTP status code (100-599)",
                    )
                })?
        }
        None => {
            return Err(
                ApiError::bad_request("parameter_missing", "`status` is required")
                    .with_param("status"),
            )
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "status",
                "`status` must be an integer",
            ))
        }
    } as u16;
    let endpoint = state.engine.notifications().get_endpoint(&scope, &id)?;
    require_cli(&endpoint)?;
    let delivery =
        state
            .engine
            .notifications()
            .get_delivery(&scope, &id.as_str().into(), &event_id)?;
    if delivery.delivered {
        return Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "webhook_event_acknowledged",
            "this event was already acknowledged with 200",
        ));
    }
    let delivered = status == 200;
    let attempt = WebhookAttempt {
        store_id: scope.store_id.clone(),
        mode: scope.mode,
        endpoint_id: id.clone().into(),
        event_id: event_id.clone(),
        attempt: delivery.attempts + 1,
        at_ms: state.engine.now_ms(),
        status_code: status,
        latency_ms: 0,
        error: if delivered {
            String::new()
        } else {
            format!("the local server answered {status}")
        },
        delivered,
        next_attempt_at_ms: None,
        manual: false,
    };
    state
        .engine
        .notifications()
        .record_attempt(attempt.clone())
        .await?;
    Ok(Json(attempt_json(&attempt)))
}
