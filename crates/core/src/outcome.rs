//! Outcomes the projector records for records it did not apply.
//!
//! Decisions are re-checked in apply, in log order (ARCHITECTURE.md "Decisions in
//! apply"): a record that breaks an invariant (a second debit with an idempotency key
//! already used, an external id taken meanwhile, a balance past its limit, a record
//! that does not decode) is not applied. Instead its outcome is written under its log
//! position, in the same atomic batch, so the caller that appended it learns what
//! happened, and a replay decides the same way.

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::keys::{self, Key};

/// Every code an outcome can carry: the registry the HTTP layer also answers with.
/// Outcomes are stored as text; decoding maps back onto these so the error type can
/// keep `&'static str` codes.
pub const OUTCOME_CODES: &[&str] = &[
    "account_closed",
    "affiliate_invite_exists",
    "api_key_revoked",
    "account_frozen",
    "account_name_taken",
    "account_balance_changed",
    "amount_out_of_range",
    "apply_failed",
    "discount_code_taken",
    "discount_currency_mismatch",
    "discount_exhausted",
    "discount_expired",
    "discount_not_active",
    "discount_not_applicable",
    "dispute_exists",
    "event_id_taken",
    "event_not_found",
    "event_voided",
    "external_id_taken",
    "grant_not_active",
    "idempotency_key_in_use",
    "idempotency_key_reused",
    "insufficient_balance",
    "invalid_state_transition",
    "meter_in_use",
    "meter_limit_reached",
    "meter_name_taken",
    "meter_not_active",
    "parameter_invalid",
    "product_not_active",
    "recharge_not_pending",
    "record_format_unsupported",
    "record_undecodable",
    "refund_exceeds_remaining",
    "reservation_committed",
    "reservation_expired",
    "reservation_released",
    "resource_changed",
    "resource_missing",
    "transaction_already_reversed",
    "transaction_not_disputable",
    "transaction_not_refundable",
    "transaction_not_reversible",
    "transaction_unbalanced",
    "test_clock_backwards",
    "too_many_grants",
    "too_many_reservations",
    "too_many_webhooks",
    "usage_already_settled",
];

/// Outcome codes that are the caller's input no longer fitting (a discount redeemed
/// to its limit meanwhile, a refund larger than what is left): answered 400, as the
/// service's fast check would have; every other rejection is a 409 conflict.
pub const INVALID_REQUEST_OUTCOMES: &[&str] = &[
    "discount_currency_mismatch",
    "discount_exhausted",
    "discount_expired",
    "discount_not_active",
    "discount_not_applicable",
    "parameter_invalid",
    "product_not_active",
    "refund_exceeds_remaining",
    "test_clock_backwards",
    "transaction_not_disputable",
    "transaction_not_refundable",
];

/// Outcome codes that name something the request points at that does not exist
/// (a voided event id no longer stored): answered 404.
pub const NOT_FOUND_OUTCOMES: &[&str] = &["event_not_found"];

/// What became of a record the projector did not apply as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Refused: nothing of the record was applied.
    Rejected {
        code: String,
        message: String,
        param: Option<String>,
        /// `meter_name_taken` by an archived meter: its id.
        archived_holder_id: Option<String>,
    },
    /// The record repeats one already applied (same idempotency key, same request):
    /// nothing new was applied; the caller gets the original, `id`.
    SameAs { id: String },
}

impl Outcome {
    pub fn rejected(code: &'static str, message: impl Into<String>) -> Outcome {
        Outcome::Rejected {
            code: code.to_string(),
            message: message.into(),
            param: None,
            archived_holder_id: None,
        }
    }

    pub fn with_param(self, param: &str) -> Outcome {
        match self {
            Outcome::Rejected {
                code,
                message,
                archived_holder_id,
                ..
            } => Outcome::Rejected {
                code,
                message,
                param: Some(param.to_string()),
                archived_holder_id,
            },
            same => same,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Outcome, EngineError> {
        serde_json::from_slice(bytes)
            .map_err(|e| EngineError::Corrupt(format!("recorded outcome: {e}")))
    }

    /// The error a caller answers with for a rejection (`None` for `SameAs`).
    pub fn into_error(self) -> Option<EngineError> {
        match self {
            Outcome::Rejected {
                code,
                message,
                param,
                archived_holder_id,
            } => {
                let code = OUTCOME_CODES
                    .iter()
                    .find(|known| **known == code)
                    .copied()
                    .unwrap_or("apply_failed");
                Some(EngineError::Conflict {
                    code,
                    message,
                    param,
                    archived_holder_id,
                })
            }
            Outcome::SameAs { .. } => None,
        }
    }
}

impl From<Outcome> for EngineError {
    /// A rejection decided before appending (the service's fast path).
    fn from(outcome: Outcome) -> Self {
        match outcome.into_error() {
            Some(error) => error,
            None => EngineError::Corrupt("a duplicate outcome is not an error".into()),
        }
    }
}

/// Where the outcome of the record at (`partition`, `offset`) is kept.
pub fn outcome_key(partition: u32, offset: u64) -> Vec<u8> {
    Key::table(keys::OUTCOME)
        .tail(&partition.to_be_bytes())
        .uint(offset)
        .into_bytes()
}

/// The precondition of an update (`RecordMeta::base_updated_at_ms`): it applies only
/// on top of the version it was derived from, so two concurrent updates of one
/// resource never lose one another's changes; the service re-reads and retries.
pub fn check_base(
    base_updated_at_ms: Option<i64>,
    stored_updated_at_ms: Option<i64>,
) -> Result<(), Outcome> {
    match (base_updated_at_ms, stored_updated_at_ms) {
        (None, _) => Ok(()),
        (Some(base), Some(stored)) if base == stored => Ok(()),
        (Some(_), None) => Err(Outcome::rejected(
            "resource_missing",
            "the resource this update was derived from does not exist",
        )),
        (Some(_), Some(_)) => Err(Outcome::rejected(
            "resource_changed",
            "the resource changed while this update was being made; retry it",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_and_map_to_registered_codes() {
        let outcome = Outcome::rejected("external_id_taken", "taken").with_param("external_id");
        assert_eq!(Outcome::decode(&outcome.encode()).unwrap(), outcome);
        match outcome.into_error() {
            Some(EngineError::Conflict { code, param, .. }) => {
                assert_eq!(code, "external_id_taken");
                assert_eq!(param.as_deref(), Some("external_id"));
            }
            other => panic!("{other:?}"),
        }
        let unknown = Outcome::Rejected {
            code: "from_a_newer_version".into(),
            message: "m".into(),
            param: None,
            archived_holder_id: None,
        };
        assert!(matches!(
            unknown.into_error(),
            Some(EngineError::Conflict {
                code: "apply_failed",
                ..
            })
        ));
        assert!(Outcome::SameAs { id: "x".into() }.into_error().is_none());
    }
}
