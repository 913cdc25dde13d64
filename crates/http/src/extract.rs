//! Request extraction: JSON bodies (size-limited, content type checked, always an
//! object), query strings, path ids, and typed field access that names the exact
//! parameter on every error. Nothing here panics or answers 500 on bad input.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde_json::{Map, Value};
use tally_domain::customer::Patch;
use tally_domain::FieldError;

use crate::error::ApiError;

/// Largest request body (1 MiB, docs/api.md). A full ingest batch of realistic events is
/// ~100 KiB; this leaves room while bounding per-request memory.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

pub fn payload_too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
    )
}

/// What a body past `MAX_BODY_BYTES` reads as once the rest of it was drained
/// (`body_limit`); answered 413 like the limit's other refusals.
#[derive(Debug, thiserror::Error)]
#[error("request bodies are limited to {MAX_BODY_BYTES} bytes")]
pub struct BodyTooLarge;

/// Reads a body up to the limit.
pub async fn read_body_limited(request: Request) -> Result<(Parts, axum::body::Bytes), ApiError> {
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > MAX_BODY_BYTES) {
        return Err(payload_too_large());
    }
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(body_read_error)?;
    Ok((parts, bytes))
}

/// The codes of a refused body whose rest may still be on the connection: the
/// answer closes it (`middleware::request_context`).
pub const BODY_LEFT_UNREAD_CODES: [&str; 3] =
    ["body_too_large", "body_read_timeout", "body_unreadable"];

/// What a body that could not be read is answered: 413 when it passed the limit,
/// 408 `body_read_timeout` when it did not arrive in time (`BODY_READ_TIMEOUT_MS`
/// unless configured otherwise), else 400 `body_unreadable` (the connection broke
/// off, or its chunked framing is invalid). Only the first is about its size.
pub fn body_read_error(error: axum::Error) -> ApiError {
    let inner = error.into_inner();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
    while let Some(error) = cause {
        if error.is::<http_body_util::LengthLimitError>() || error.is::<BodyTooLarge>() {
            return payload_too_large();
        }
        if error.is::<tower_http::timeout::TimeoutError>() {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_read_timeout",
                format!(
                    "the request body did not arrive in time (the server waits {} ms unless configured otherwise); send it again",
                    crate::BODY_READ_TIMEOUT_MS
                ),
            );
        }
        cause = error.source();
    }
    ApiError::bad_request(
        "body_unreadable",
        "the request body could not be read: the connection broke off or its framing is invalid",
    )
}

/// A JSON object body. An empty body reads as `{}` (actions without a body, and
/// updates whose fields are all optional).
#[derive(Debug, Clone)]
pub struct JsonObject(pub Map<String, Value>);

/// Reads a JSON body: `None` for no body at all, else the bytes, once the content
/// type says JSON. Every JSON body extractor starts here, so they share the rules.
pub async fn read_json_body(request: Request) -> Result<Option<axum::body::Bytes>, ApiError> {
    let (parts, bytes) = read_body_limited(request).await?;
    // No body at all reads as `{}`; anything else must be a JSON object (a body of
    // blanks is no JSON).
    if bytes.is_empty() {
        return Ok(None);
    }
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let is_json = content_type
        .split(';')
        .next()
        .map(|t| t.trim().eq_ignore_ascii_case("application/json"))
        .unwrap_or(false);
    if !is_json {
        return Err(ApiError::bad_request(
            "invalid_content_type",
            "request bodies must be JSON with `Content-Type: application/json`",
        ));
    }
    // Bodies are read as sent (docs/api.md, "Servers, environments, keys"): a
    // compressed one would otherwise be refused as not valid JSON, hiding the cause.
    if is_encoded(&parts.headers) {
        return Err(ApiError::bad_request(
            "invalid_content_encoding",
            "request bodies must be sent uncompressed: no `Content-Encoding` but `identity` is accepted",
        ));
    }
    Ok(Some(bytes))
}

/// Whether a request's body is sent with a content coding other than `identity`.
/// Every `Content-Encoding` header counts, and each is a list of codings applied
/// in order (RFC 9110, 8.4), so `identity, gzip` or a second header saying `gzip`
/// is compressed; empty list elements are no coding.
fn is_encoded(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .flat_map(|value| value.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"))
}

/// The answer to a body that is JSON but not an object.
pub fn not_an_object() -> ApiError {
    ApiError::bad_request("invalid_json", "the request body must be a JSON object")
}

/// The answer to a body that is not JSON.
pub fn invalid_json(error: &serde_json::Error) -> ApiError {
    ApiError::bad_request(
        "invalid_json",
        format!("the request body is not valid JSON: {error}"),
    )
}

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(bytes) = read_json_body(request).await? else {
            return Ok(JsonObject(Map::new()));
        };
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(map)) => Ok(JsonObject(map)),
            Ok(_) => Err(not_an_object()),
            Err(e) => Err(invalid_json(&e)),
        }
    }
}

/// Query parameters; a malformed query string is a 400 with the error body.
#[derive(Debug, Clone, Default)]
pub struct QueryParams(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| QueryParams(q))
            .map_err(|e| {
                ApiError::bad_request("invalid_query", format!("malformed query string: {e}"))
            })
    }
}

impl QueryParams {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }
}

/// One path parameter.
#[derive(Debug, Clone)]
pub struct PathId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| PathId(id))
            .map_err(|e| ApiError::bad_request("invalid_path", e.to_string()).with_param("id"))
    }
}

/// Two path parameters.
#[derive(Debug, Clone)]
pub struct PathIds(pub String, pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathIds {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map(|Path((a, b))| PathIds(a, b))
            .map_err(|e| ApiError::bad_request("invalid_path", e.to_string()))
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(param: &str, wanted: &str, value: &Value) -> FieldError {
    FieldError::invalid(
        param,
        format!("`{param}` must be {wanted}, not {}", type_name(value)),
    )
}

/// Typed access to the fields of a JSON object, naming `prefix.field` on errors.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    pub map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn new(map: &'a Map<String, Value>) -> Self {
        Fields { map }
    }

    pub fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// A string; absent or null reads as `None`.
    pub fn string(&self, name: &str) -> Result<Option<String>, FieldError> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(wrong_type(name, "a string", other)),
        }
    }

    pub fn required_string(&self, name: &str) -> Result<String, FieldError> {
        self.string(name)?.ok_or_else(|| FieldError::missing(name))
    }

    /// For updates: absent keeps, null clears, a string sets.
    pub fn patch_string(&self, name: &str) -> Result<Patch<String>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::String(s)) => Ok(Patch::Set(s.clone())),
            Some(other) => Err(wrong_type(name, "a string", other)),
        }
    }

    /// A boolean; absent or null reads as `None`.
    pub fn boolean(&self, name: &str) -> Result<Option<bool>, FieldError> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(name, "a boolean", other)),
        }
    }

    /// For updates: a boolean, null clears, absent keeps.
    pub fn patch_boolean(&self, name: &str) -> Result<Patch<bool>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::Bool(b)) => Ok(Patch::Set(*b)),
            Some(other) => Err(wrong_type(name, "a boolean", other)),
        }
    }

    /// For updates: a number as its exact text (money and quantities never pass
    /// through a float); `strings` also takes decimal strings, as credits are sent.
    pub fn patch_number(&self, name: &str, strings: bool) -> Result<Patch<String>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::Number(n)) => Ok(Patch::Set(number_text(n))),
            Some(Value::String(s)) if strings => Ok(Patch::Set(s.clone())),
            Some(other) => Err(wrong_type(name, "a number", other)),
        }
    }

    /// A decimal quantity (a number or a decimal string) as its exact text.
    pub fn quantity(&self, name: &str) -> Result<Option<String>, FieldError> {
        self.number(name, true)
    }

    /// A number as its exact text (`strings`: a numeric string too); absent or
    /// null reads as `None`.
    pub fn number(&self, name: &str, strings: bool) -> Result<Option<String>, FieldError> {
        Ok(match self.patch_number(name, strings)? {
            Patch::Set(text) => Some(text),
            Patch::Keep | Patch::Clear => None,
        })
    }

    /// An array of strings; absent or null reads as `None`.
    pub fn strings(&self, name: &str) -> Result<Option<Vec<String>>, FieldError> {
        Ok(match self.patch_strings(name)? {
            Patch::Set(list) => Some(list),
            Patch::Keep | Patch::Clear => None,
        })
    }

    /// Metadata; absent or null reads as empty.
    pub fn metadata(&self, name: &str) -> Result<BTreeMap<String, String>, FieldError> {
        Ok(match self.patch_metadata(name)? {
            Patch::Set(map) => map,
            Patch::Keep | Patch::Clear => BTreeMap::new(),
        })
    }

    /// A non-negative integer that fits `u32`.
    pub fn small_uint(&self, name: &str) -> Result<Option<u32>, FieldError> {
        match self.patch_number(name, false)? {
            Patch::Set(text) => text.parse::<u32>().map(Some).map_err(|_| {
                FieldError::invalid(name, format!("`{name}` must be a non-negative integer"))
            }),
            Patch::Keep | Patch::Clear => Ok(None),
        }
    }

    /// An object field, for reading nested fields; absent or null reads as `None`.
    pub fn object(&self, name: &str) -> Result<Option<Fields<'a>>, FieldError> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields::new(map))),
            Some(other) => Err(wrong_type(name, "an object", other)),
        }
    }

    /// For updates: an array of objects, each read by `read` (whose errors are
    /// named under `name[i]`).
    pub fn patch_objects<T>(
        &self,
        name: &str,
        read: impl Fn(Fields<'a>) -> Result<T, FieldError>,
    ) -> Result<Patch<Vec<T>>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let path = format!("{name}[{i}]");
                    match item {
                        Value::Object(map) => read(Fields::new(map)).map_err(|e| e.under(&path)),
                        other => Err(wrong_type(&path, "an object", other)),
                    }
                })
                .collect::<Result<Vec<T>, _>>()
                .map(Patch::Set),
            Some(other) => Err(wrong_type(name, "an array", other)),
        }
    }

    /// For updates: an array of strings.
    pub fn patch_strings(&self, name: &str) -> Result<Patch<Vec<String>>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type(&format!("{name}[{i}]"), "a string", other)),
                })
                .collect::<Result<_, _>>()
                .map(Patch::Set),
            Some(other) => Err(wrong_type(name, "an array", other)),
        }
    }

    /// Metadata: an object whose values are strings, numbers or booleans (kept as
    /// their text, as a Stripe-class API does).
    pub fn patch_metadata(
        &self,
        name: &str,
    ) -> Result<Patch<BTreeMap<String, String>>, FieldError> {
        match self.map.get(name) {
            None => Ok(Patch::Keep),
            Some(Value::Null) => Ok(Patch::Clear),
            Some(Value::Object(object)) => {
                let mut metadata = BTreeMap::new();
                for (key, value) in object {
                    let text = match value {
                        Value::String(s) => s.clone(),
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        other => {
                            return Err(wrong_type(&format!("{name}.{key}"), "a string", other))
                        }
                    };
                    metadata.insert(key.clone(), text);
                }
                Ok(Patch::Set(metadata))
            }
            Some(other) => Err(wrong_type(name, "an object", other)),
        }
    }
}

/// The one parse of a timestamp parameter (body or query).
pub fn parse_instant(param: &str, text: &str) -> Result<i64, FieldError> {
    tally_domain::time::parse_iso8601_ms(text).ok_or_else(|| {
        FieldError::invalid(
            param,
            format!(
                "`{param}` must be an ISO 8601 instant with an offset, e.g. 2026-01-31T00:00:00Z"
            ),
        )
    })
}

/// Cursor page parameters: `limit` 1..100 (default 10), `starting_after`, `ending_before`.
pub fn page_request(
    query: &QueryParams,
) -> Result<tally_engine::pagination::PageRequest, FieldError> {
    use tally_domain::limits::{DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT};
    let limit = match query.get("limit") {
        None => DEFAULT_PAGE_LIMIT,
        Some(text) => match text.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE_LIMIT).contains(&n) => n,
            _ => {
                return Err(FieldError::invalid(
                    "limit",
                    format!("`limit` must be an integer from 1 to {MAX_PAGE_LIMIT}"),
                ))
            }
        },
    };
    let cursor = |name: &str| -> Result<Option<String>, FieldError> {
        match query.get(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => {
                Err(FieldError::invalid(name, format!("`{name}` is empty")))
            }
            Some(v) => Ok(Some(v.to_string())),
        }
    };
    Ok(tally_engine::pagination::PageRequest {
        limit,
        starting_after: cursor("starting_after")?,
        ending_before: cursor("ending_before")?,
    })
}

/// The `status` filter of lists of archivable resources (default `active`).
pub fn status_filter(
    query: &QueryParams,
) -> Result<tally_engine::pagination::StatusFilter, FieldError> {
    match query.get("status") {
        None => Ok(Default::default()),
        Some(text) => tally_engine::pagination::StatusFilter::parse(text).ok_or_else(|| {
            FieldError::invalid("status", "`status` must be active, archived or all")
        }),
    }
}

/// Converts a JSON number to its exact text (serde_json keeps it with
/// `arbitrary_precision`), so decimals never pass through a float.
pub fn number_text(number: &serde_json::Number) -> String {
    number.to_string()
}
