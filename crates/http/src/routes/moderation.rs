//! Prompt moderation (experimental; docs/api.md, "Moderation"): screening a prompt
//! and the store's policy.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use tally_domain::moderation::{Pii, PiiAction, PiiActionOr, Policy};
use tally_domain::FieldError;
use tally_engine::Scope;

use crate::error::ApiResult;
use crate::extract::{Fields, JsonObject};
use crate::openapi as doc;
use crate::AppState;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this resource and their documentation (merged into the API by
/// `crate::api_router`).
pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(screen_prompt))
        .routes(routes!(get_policy, set_policy))
}

/// `POST /v1/moderation/prompt {prompt, external_id?}` -> a moderation result.
#[utoipa::path(
    post,
    path = "/v1/moderation/prompt",
    operation_id = "screen_prompt",
    tag = "moderation",
    summary = "Screen a prompt against the store's policy",
    request_body(content = doc::PromptInput, content_type = "application/json"),
    responses((status = 200, description = "Screen a prompt against the store's policy", body = doc::ModerationResult))
)]
pub async fn screen_prompt(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let prompt = fields.string("prompt")?;
    let external_id = fields.string("external_id")?;
    let result = state
        .engine
        .moderate(&scope, prompt.as_deref(), external_id.as_deref())
        .await?;
    Ok(Json(json!({
        "id": result.id,
        "object": "moderation_result",
        "prompt": prompt,
        "decision": result.decision.as_str(),
        "reasons": result.reasons,
        "usage": {"units": result.units},
        "external_id": external_id,
        "metered": result.metered,
    })))
}

fn policy_body(p: &Policy) -> Value {
    json!({
        "object": "moderation_policy",
        "deny_terms": p.deny_terms,
        "flag_terms": p.flag_terms,
        "deny_patterns": p.deny_patterns,
        "flag_patterns": p.flag_patterns,
        "pii": {
            "email": p.pii.email.0.as_str(),
            "phone": p.pii.phone.0.as_str(),
            "card": p.pii.card.0.as_str(),
            "iban": p.pii.iban.0.as_str(),
        },
    })
}

#[utoipa::path(
    get,
    path = "/v1/moderation/policy",
    operation_id = "get_policy",
    tag = "moderation",
    summary = "Get the moderation policy",
    responses((status = 200, description = "Get the moderation policy", body = doc::ModerationPolicy))
)]
pub async fn get_policy(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
) -> ApiResult<Json<Value>> {
    Ok(Json(policy_body(
        &state.engine.directory().moderation_policy(&scope)?,
    )))
}

fn pii_action(pii: &Map<String, Value>, name: &str) -> Result<PiiActionOr, FieldError> {
    let param = format!("pii.{name}");
    match pii.get(name) {
        None | Some(Value::Null) => Ok(PiiActionOr(PiiAction::Off)),
        Some(Value::String(text)) => PiiAction::parse_field(&param, text).map(PiiActionOr),
        Some(_) => Err(FieldError::invalid(param, "must be off, flag or deny")),
    }
}

/// `POST /v1/moderation/policy`: replaces the policy (absent lists are empty).
#[utoipa::path(
    post,
    path = "/v1/moderation/policy",
    operation_id = "set_policy",
    tag = "moderation",
    summary = "Replace the moderation policy",
    request_body(content = doc::PolicyInput, content_type = "application/json"),
    responses((status = 200, description = "Replace the moderation policy", body = doc::ModerationPolicy))
)]
pub async fn set_policy(
    State(state): State<AppState>,
    Extension(scope): Extension<Scope>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let fields = Fields::new(&body);
    let list = |name: &str| fields.strings(name).map(Option::unwrap_or_default);
    let pii = match body.get("pii") {
        None | Some(Value::Null) => Pii::default(),
        Some(Value::Object(map)) => Pii {
            email: pii_action(map, "email")?,
            phone: pii_action(map, "phone")?,
            card: pii_action(map, "card")?,
            iban: pii_action(map, "iban")?,
        },
        Some(_) => return Err(FieldError::invalid("pii", "`pii` must be an object").into()),
    };
    let policy = Policy {
        deny_terms: list("deny_terms")?,
        flag_terms: list("flag_terms")?,
        deny_patterns: list("deny_patterns")?,
        flag_patterns: list("flag_patterns")?,
        pii,
    };
    let saved = state
        .engine
        .directory()
        .set_moderation_policy(&scope, policy)
        .await?;
    Ok(Json(policy_body(&saved)))
}
