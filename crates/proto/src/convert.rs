//! Domain <-> protobuf conversions. Decoding is strict: an unknown enum value or an
//! unparsable decimal is a [`DecodeError`], never a silent default.

use std::collections::BTreeMap;

use rust_decimal::Decimal;
use tally_domain::customer::Customer;
use tally_domain::grant::{Grant, GrantStatus, GrantTerms};
use tally_domain::ledger::{
    Account, AccountStatus, AutoRecharge, Entry, RechargePrice, Transaction, TransactionKind,
};
use tally_domain::meter::{
    Aggregation, Conjunction, FilterClause, FilterValue, Meter, MeterFilter, MeterStatus, Operator,
};
use tally_domain::record::{LedgerEvent, RechargeOutcome, RechargeSettled, WebhookAttempt};
use tally_domain::reservation::{Reservation, ReservationStatus, ReservationStep};
use tally_domain::usage::{canonical_decimal, parse_decimal, PropertyValue, UsageEvent};
use tally_domain::webhook::{DeliveryMode, WebhookEndpoint};
use tally_domain::Mode;

use crate::v1;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("protobuf decode failed: {0}")]
    Protobuf(#[from] prost::DecodeError),
    #[error("record field `{0}` holds an unknown or missing value")]
    BadField(&'static str),
    /// A well-formed record of another format version: not bad data, a log this
    /// build cannot read (fail-stop, never a per-record rejection).
    #[error("the record is in log format version {found}; this build reads version {LOG_FORMAT_VERSION} only (see the README, \"Upgrading\")")]
    Version { found: u32 },
}

/// The log record format this build writes and reads. Bump it when a record's
/// meaning changes in a way older readers would misapply.
pub const LOG_FORMAT_VERSION: u32 = 3;

/// A record of another format version than `LOG_FORMAT_VERSION` is refused.
pub(crate) fn check_format_version(found: u32) -> Result<(), DecodeError> {
    if found == LOG_FORMAT_VERSION {
        Ok(())
    } else {
        Err(DecodeError::Version { found })
    }
}

pub fn mode_to_proto(mode: Mode) -> i32 {
    match mode {
        Mode::Prod => v1::Mode::Prod as i32,
        Mode::Test => v1::Mode::Test as i32,
    }
}

pub fn mode_from_proto(value: i32) -> Result<Mode, DecodeError> {
    match v1::Mode::try_from(value) {
        Ok(v1::Mode::Prod) => Ok(Mode::Prod),
        Ok(v1::Mode::Test) => Ok(Mode::Test),
        _ => Err(DecodeError::BadField("mode")),
    }
}

fn decimal_from_text(text: &str, field: &'static str) -> Result<Decimal, DecodeError> {
    parse_decimal(text).ok_or(DecodeError::BadField(field))
}

pub fn customer_to_proto(c: &Customer) -> v1::Customer {
    v1::Customer {
        id: c.id.to_string(),
        store_id: c.store_id.to_string(),
        mode: mode_to_proto(c.mode),
        email: c.email.clone(),
        name: c.name.clone(),
        country: c.country.clone(),
        metadata: c.metadata.clone(),
        external_id: c.external_id.clone(),
        created_at_ms: c.created_at_ms,
        updated_at_ms: c.updated_at_ms,
    }
}

pub fn customer_from_proto(c: v1::Customer) -> Result<Customer, DecodeError> {
    Ok(Customer {
        mode: mode_from_proto(c.mode)?,
        id: c.id.into(),
        store_id: c.store_id.into(),
        email: c.email,
        name: c.name,
        country: c.country,
        metadata: c.metadata,
        external_id: c.external_id,
        created_at_ms: c.created_at_ms,
        updated_at_ms: c.updated_at_ms,
    })
}

fn aggregation_to_proto(a: Aggregation) -> i32 {
    (match a {
        Aggregation::Count => v1::Aggregation::Count,
        Aggregation::Sum => v1::Aggregation::Sum,
        Aggregation::Average => v1::Aggregation::Average,
        Aggregation::Min => v1::Aggregation::Min,
        Aggregation::Max => v1::Aggregation::Max,
        Aggregation::Unique => v1::Aggregation::Unique,
        Aggregation::Latest => v1::Aggregation::Latest,
        Aggregation::TimeWeightedSum => v1::Aggregation::TimeWeightedSum,
    }) as i32
}

fn aggregation_from_proto(value: i32) -> Result<Aggregation, DecodeError> {
    Ok(match v1::Aggregation::try_from(value) {
        Ok(v1::Aggregation::Count) => Aggregation::Count,
        Ok(v1::Aggregation::Sum) => Aggregation::Sum,
        Ok(v1::Aggregation::Average) => Aggregation::Average,
        Ok(v1::Aggregation::Min) => Aggregation::Min,
        Ok(v1::Aggregation::Max) => Aggregation::Max,
        Ok(v1::Aggregation::Unique) => Aggregation::Unique,
        Ok(v1::Aggregation::Latest) => Aggregation::Latest,
        Ok(v1::Aggregation::TimeWeightedSum) => Aggregation::TimeWeightedSum,
        _ => return Err(DecodeError::BadField("aggregation")),
    })
}

fn filter_value_to_proto(value: &FilterValue) -> v1::FilterValue {
    use v1::filter_value::Value;
    let inner = match value {
        FilterValue::String(s) => Value::StringValue(s.clone()),
        FilterValue::Number(n) => Value::NumberValue(canonical_decimal(*n)),
        FilterValue::Bool(b) => Value::BoolValue(*b),
        FilterValue::List(values) => Value::ListValue(v1::FilterValueList {
            values: values.iter().map(filter_value_to_proto).collect(),
        }),
    };
    v1::FilterValue { value: Some(inner) }
}

fn filter_value_from_proto(value: v1::FilterValue) -> Result<FilterValue, DecodeError> {
    use v1::filter_value::Value;
    Ok(match value.value {
        Some(Value::StringValue(s)) => FilterValue::String(s),
        Some(Value::NumberValue(n)) => FilterValue::Number(decimal_from_text(&n, "filter.value")?),
        Some(Value::BoolValue(b)) => FilterValue::Bool(b),
        Some(Value::ListValue(list)) => FilterValue::List(
            list.values
                .into_iter()
                .map(filter_value_from_proto)
                .collect::<Result<_, _>>()?,
        ),
        Some(Value::NullValue(_)) | None => return Err(DecodeError::BadField("filter.value")),
    })
}

pub fn meter_to_proto(m: &Meter) -> v1::Meter {
    v1::Meter {
        id: m.id.to_string(),
        store_id: m.store_id.to_string(),
        mode: mode_to_proto(m.mode),
        name: m.name.clone(),
        event_name: m.event_name.clone(),
        aggregation: aggregation_to_proto(m.aggregation),
        aggregation_property: m.aggregation_property.clone(),
        filter: Some(v1::MeterFilter {
            conjunction: match m.filter.conjunction {
                Conjunction::And => v1::Conjunction::And as i32,
                Conjunction::Or => v1::Conjunction::Or as i32,
            },
            clauses: m
                .filter
                .clauses
                .iter()
                .map(|c| v1::FilterClause {
                    property: c.property.clone(),
                    operator: c.operator.as_str().to_string(),
                    value: Some(filter_value_to_proto(&c.value)),
                })
                .collect(),
        }),
        unit_label: m.unit_label.clone(),
        status: match m.status {
            MeterStatus::Active => v1::MeterStatus::Active as i32,
            MeterStatus::Archived => v1::MeterStatus::Archived as i32,
        },
        created_at_ms: m.created_at_ms,
        updated_at_ms: m.updated_at_ms,
        counts_from_ms: m.counts_from_ms,
        revision: m.revision,
    }
}

pub fn meter_from_proto(m: v1::Meter) -> Result<Meter, DecodeError> {
    let filter = m.filter.ok_or(DecodeError::BadField("filter"))?;
    let conjunction = match v1::Conjunction::try_from(filter.conjunction) {
        Ok(v1::Conjunction::And) => Conjunction::And,
        Ok(v1::Conjunction::Or) => Conjunction::Or,
        _ => return Err(DecodeError::BadField("filter.conjunction")),
    };
    let clauses = filter
        .clauses
        .into_iter()
        .map(|c| {
            Ok(FilterClause {
                operator: Operator::parse(&c.operator)
                    .ok_or(DecodeError::BadField("filter.operator"))?,
                property: c.property,
                value: filter_value_from_proto(
                    c.value.ok_or(DecodeError::BadField("filter.value"))?,
                )?,
            })
        })
        .collect::<Result<Vec<_>, DecodeError>>()?;
    Ok(Meter {
        mode: mode_from_proto(m.mode)?,
        aggregation: aggregation_from_proto(m.aggregation)?,
        status: match v1::MeterStatus::try_from(m.status) {
            Ok(v1::MeterStatus::Active) => MeterStatus::Active,
            Ok(v1::MeterStatus::Archived) => MeterStatus::Archived,
            _ => return Err(DecodeError::BadField("status")),
        },
        id: m.id.into(),
        store_id: m.store_id.into(),
        name: m.name,
        event_name: m.event_name,
        aggregation_property: m.aggregation_property,
        filter: MeterFilter {
            conjunction,
            clauses,
        },
        unit_label: m.unit_label,
        created_at_ms: m.created_at_ms,
        updated_at_ms: m.updated_at_ms,
        counts_from_ms: m.counts_from_ms,
        revision: m.revision.max(1),
    })
}

fn property_to_proto(value: &PropertyValue) -> v1::PropertyValue {
    use v1::property_value::Value;
    v1::PropertyValue {
        value: Some(match value {
            PropertyValue::String(s) => Value::StringValue(s.clone()),
            PropertyValue::Number(n) => Value::NumberValue(canonical_decimal(*n)),
        }),
    }
}

fn property_from_proto(value: v1::PropertyValue) -> Result<PropertyValue, DecodeError> {
    use v1::property_value::Value;
    match value.value {
        Some(Value::StringValue(s)) => Ok(PropertyValue::String(s)),
        Some(Value::NumberValue(n)) => {
            Ok(PropertyValue::Number(decimal_from_text(&n, "properties")?))
        }
        None => Err(DecodeError::BadField("properties")),
    }
}

pub fn usage_event_to_proto(e: &UsageEvent) -> v1::UsageEvent {
    v1::UsageEvent {
        event_id: e.event_id.clone(),
        name: e.name.clone(),
        customer_id: e.customer_id.as_str().to_owned(),
        timestamp_ms: e.timestamp_ms,
        properties: e
            .properties
            .iter()
            .map(|(k, v)| (k.clone(), property_to_proto(v)))
            .collect(),
        received_at_ms: e.received_at_ms,
        matched_meter_ids: e
            .matched_meter_ids
            .iter()
            .map(|m| m.as_str().to_owned())
            .collect(),
        event_id_assigned: e.event_id_assigned,
        external_customer_id: e.external_customer_id.clone(),
    }
}

pub fn usage_event_from_proto(e: v1::UsageEvent) -> Result<UsageEvent, DecodeError> {
    let properties = e
        .properties
        .into_iter()
        .map(|(k, v)| Ok((k, property_from_proto(v)?)))
        .collect::<Result<BTreeMap<_, _>, DecodeError>>()?;
    Ok(UsageEvent {
        event_id: e.event_id,
        name: e.name,
        customer_id: e.customer_id.into(),
        external_customer_id: e.external_customer_id,
        timestamp_ms: e.timestamp_ms,
        properties,
        received_at_ms: e.received_at_ms,
        matched_meter_ids: e.matched_meter_ids.into_iter().map(Into::into).collect(),
        event_id_assigned: e.event_id_assigned,
    })
}

pub fn account_to_proto(a: &Account) -> v1::CreditAccount {
    v1::CreditAccount {
        id: a.id.to_string(),
        store_id: a.store_id.to_string(),
        mode: mode_to_proto(a.mode),
        customer_id: a.customer_id.to_string(),
        name: a.name.clone(),
        unit_label: a.unit_label.clone(),
        status: a.status.as_str().to_string(),
        created_at_ms: a.created_at_ms,
        updated_at_ms: a.updated_at_ms,
        low_balance_threshold: a.low_balance_threshold.map(canonical_decimal),
        auto_recharge: a.auto_recharge.as_ref().map(|r| v1::AutoRecharge {
            threshold: canonical_decimal(r.threshold),
            amount: canonical_decimal(r.amount),
            price: r.price.as_ref().map_or(0, |p| p.amount),
            currency: r
                .price
                .as_ref()
                .map(|p| p.currency.clone())
                .unwrap_or_default(),
        }),
    }
}

pub fn account_from_proto(a: v1::CreditAccount) -> Result<Account, DecodeError> {
    Ok(Account {
        mode: mode_from_proto(a.mode)?,
        low_balance_threshold: a
            .low_balance_threshold
            .map(|t| decimal_from_text(&t, "account.low_balance_threshold"))
            .transpose()?,
        auto_recharge: a
            .auto_recharge
            .map(|r| {
                Ok::<_, DecodeError>(AutoRecharge {
                    threshold: decimal_from_text(&r.threshold, "account.auto_recharge.threshold")?,
                    amount: decimal_from_text(&r.amount, "account.auto_recharge.amount")?,
                    price: (r.price != 0).then_some(RechargePrice {
                        amount: r.price,
                        currency: r.currency,
                    }),
                })
            })
            .transpose()?,
        status: match a.status.as_str() {
            "active" => AccountStatus::Active,
            "frozen" => AccountStatus::Frozen,
            "closed" => AccountStatus::Closed,
            _ => return Err(DecodeError::BadField("account.status")),
        },
        id: a.id.into(),
        store_id: a.store_id.into(),
        customer_id: a.customer_id.into(),
        name: a.name,
        unit_label: a.unit_label,
        created_at_ms: a.created_at_ms,
        updated_at_ms: a.updated_at_ms,
    })
}

pub fn transaction_to_proto(t: &Transaction) -> v1::CreditTransaction {
    v1::CreditTransaction {
        id: t.id.to_string(),
        store_id: t.store_id.to_string(),
        mode: mode_to_proto(t.mode),
        kind: t.kind.as_str().to_string(),
        account_id: t.account_id.to_string(),
        amount: canonical_decimal(t.amount),
        entries: t
            .entries
            .iter()
            .map(|e| v1::CreditEntry {
                id: e.id.clone(),
                account_id: e.account_id.to_string(),
                amount: canonical_decimal(e.amount),
                grant_id: e.grant_id.as_ref().map(|g| g.to_string()),
            })
            .collect(),
        idempotency_key: t.idempotency_key.clone(),
        description: t.description.clone(),
        metadata: t.metadata.clone(),
        reverses: t.reverses.as_ref().map(|r| r.to_string()),
        created_at_ms: t.created_at_ms,
        grant_terms: t.grant_terms.map(grant_terms_to_proto),
        entry_seqs: Vec::new(),
    }
}

fn grant_terms_to_proto(t: GrantTerms) -> v1::GrantTerms {
    v1::GrantTerms {
        priority: t.priority,
        expires_at_ms: t.expires_at_ms,
    }
}

fn grant_terms_from_proto(t: v1::GrantTerms) -> GrantTerms {
    GrantTerms {
        priority: t.priority,
        expires_at_ms: t.expires_at_ms,
    }
}

pub fn grant_to_proto(g: &Grant) -> v1::CreditGrant {
    v1::CreditGrant {
        id: g.id.to_string(),
        store_id: g.store_id.to_string(),
        mode: mode_to_proto(g.mode),
        account_id: g.account_id.to_string(),
        amount: canonical_decimal(g.amount),
        remaining: canonical_decimal(g.remaining),
        terms: Some(grant_terms_to_proto(g.terms)),
        status: g.status.as_str().to_string(),
        transaction_id: g.transaction_id.to_string(),
        description: g.description.clone(),
        metadata: g.metadata.clone(),
        created_at_ms: g.created_at_ms,
        updated_at_ms: g.updated_at_ms,
        seq: g.seq,
    }
}

pub fn grant_from_proto(g: v1::CreditGrant) -> Result<Grant, DecodeError> {
    Ok(Grant {
        mode: mode_from_proto(g.mode)?,
        amount: decimal_from_text(&g.amount, "grant.amount")?,
        remaining: decimal_from_text(&g.remaining, "grant.remaining")?,
        terms: grant_terms_from_proto(g.terms.ok_or(DecodeError::BadField("grant.terms"))?),
        status: GrantStatus::parse(&g.status).ok_or(DecodeError::BadField("grant.status"))?,
        id: g.id.into(),
        store_id: g.store_id.into(),
        account_id: g.account_id.into(),
        transaction_id: g.transaction_id.into(),
        description: g.description,
        metadata: g.metadata,
        created_at_ms: g.created_at_ms,
        updated_at_ms: g.updated_at_ms,
        seq: g.seq,
    })
}

pub fn reservation_to_proto(r: &Reservation) -> v1::ReservationState {
    v1::ReservationState {
        id: r.id.to_string(),
        store_id: r.store_id.to_string(),
        mode: mode_to_proto(r.mode),
        account_id: r.account_id.to_string(),
        amount: canonical_decimal(r.amount),
        status: r.status.as_str().to_string(),
        idempotency_key: r.idempotency_key.clone(),
        expires_at_ms: r.expires_at_ms,
        created_at_ms: r.created_at_ms,
        updated_at_ms: r.updated_at_ms,
        transaction_id: r.transaction_id.as_ref().map(|t| t.to_string()),
        committed_amount: r.committed_amount.map(canonical_decimal),
    }
}

pub fn reservation_from_proto(r: v1::ReservationState) -> Result<Reservation, DecodeError> {
    Ok(Reservation {
        mode: mode_from_proto(r.mode)?,
        amount: decimal_from_text(&r.amount, "reservation.amount")?,
        status: ReservationStatus::parse(&r.status)
            .ok_or(DecodeError::BadField("reservation.status"))?,
        committed_amount: r
            .committed_amount
            .map(|a| decimal_from_text(&a, "reservation.committed_amount"))
            .transpose()?,
        id: r.id.into(),
        store_id: r.store_id.into(),
        account_id: r.account_id.into(),
        idempotency_key: r.idempotency_key,
        expires_at_ms: r.expires_at_ms,
        created_at_ms: r.created_at_ms,
        updated_at_ms: r.updated_at_ms,
        transaction_id: r.transaction_id.map(Into::into),
    })
}

fn reservation_step_to_proto(step: &ReservationStep) -> v1::CreditReservation {
    use v1::credit_reservation::Step;
    let step = match step {
        ReservationStep::Hold(r) => Step::Hold(reservation_to_proto(r)),
        ReservationStep::Commit {
            store_id,
            mode,
            reservation_id,
            transaction,
        } => Step::Commit(v1::ReservationCommit {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            reservation_id: reservation_id.to_string(),
            transaction: Some(transaction_to_proto(transaction)),
        }),
        ReservationStep::Release {
            store_id,
            mode,
            reservation_id,
        } => Step::Release(v1::ReservationRelease {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            reservation_id: reservation_id.to_string(),
        }),
    };
    v1::CreditReservation { step: Some(step) }
}

fn reservation_step_from_proto(r: v1::CreditReservation) -> Result<ReservationStep, DecodeError> {
    use v1::credit_reservation::Step;
    Ok(
        match r.step.ok_or(DecodeError::BadField("reservation.step"))? {
            Step::Hold(state) => ReservationStep::Hold(reservation_from_proto(state)?),
            Step::Commit(c) => ReservationStep::Commit {
                store_id: c.store_id.into(),
                mode: mode_from_proto(c.mode)?,
                reservation_id: c.reservation_id.into(),
                transaction: transaction_from_proto(
                    c.transaction
                        .ok_or(DecodeError::BadField("reservation.transaction"))?,
                )?,
            },
            Step::Release(r) => ReservationStep::Release {
                store_id: r.store_id.into(),
                mode: mode_from_proto(r.mode)?,
                reservation_id: r.reservation_id.into(),
            },
        },
    )
}

pub fn transaction_from_proto(t: v1::CreditTransaction) -> Result<Transaction, DecodeError> {
    Ok(Transaction {
        mode: mode_from_proto(t.mode)?,
        kind: TransactionKind::parse(&t.kind).ok_or(DecodeError::BadField("transaction.kind"))?,
        amount: decimal_from_text(&t.amount, "transaction.amount")?,
        entries: t
            .entries
            .into_iter()
            .map(|e| {
                Ok(Entry {
                    amount: decimal_from_text(&e.amount, "entry.amount")?,
                    id: e.id,
                    account_id: e.account_id.into(),
                    grant_id: e.grant_id.map(Into::into),
                })
            })
            .collect::<Result<_, DecodeError>>()?,
        id: t.id.into(),
        store_id: t.store_id.into(),
        account_id: t.account_id.into(),
        idempotency_key: t.idempotency_key,
        description: t.description,
        metadata: t.metadata,
        reverses: t.reverses.map(Into::into),
        created_at_ms: t.created_at_ms,
        grant_terms: t.grant_terms.map(grant_terms_from_proto),
    })
}

pub fn ledger_event_to_proto(e: &LedgerEvent) -> v1::LedgerEvent {
    v1::LedgerEvent {
        id: e.id.clone(),
        event_type: e.event_type.clone(),
        created_at_ms: e.created_at_ms,
        transaction_id: e.transaction_id.as_ref().map(|t| t.to_string()),
        account: Some(account_to_proto(&e.account)),
        balance: canonical_decimal(e.balance),
    }
}

pub fn ledger_event_from_proto(e: v1::LedgerEvent) -> Result<LedgerEvent, DecodeError> {
    Ok(LedgerEvent {
        account: account_from_proto(e.account.ok_or(DecodeError::BadField("event.account"))?)?,
        balance: decimal_from_text(&e.balance, "event.balance")?,
        id: e.id,
        event_type: e.event_type,
        created_at_ms: e.created_at_ms,
        transaction_id: e.transaction_id.map(Into::into),
    })
}

pub fn endpoint_to_proto(e: &WebhookEndpoint) -> v1::WebhookEndpoint {
    v1::WebhookEndpoint {
        id: e.id.to_string(),
        store_id: e.store_id.to_string(),
        mode: mode_to_proto(e.mode),
        name: e.name.clone(),
        url: e.url.clone(),
        delivery_mode: e.delivery_mode.as_str().to_string(),
        enabled: e.enabled,
        events: e.events.clone(),
        secret: e.secret.clone(),
        previous_secret: e.previous_secret.clone(),
        previous_secret_expires_at_ms: e.previous_secret_expires_at_ms,
        created_at_ms: e.created_at_ms,
        updated_at_ms: e.updated_at_ms,
    }
}

pub fn endpoint_from_proto(e: v1::WebhookEndpoint) -> Result<WebhookEndpoint, DecodeError> {
    Ok(WebhookEndpoint {
        mode: mode_from_proto(e.mode)?,
        delivery_mode: DeliveryMode::parse(&e.delivery_mode)
            .ok_or(DecodeError::BadField("delivery_mode"))?,
        id: e.id.into(),
        store_id: e.store_id.into(),
        name: e.name,
        url: e.url,
        enabled: e.enabled,
        events: e.events,
        secret: e.secret,
        previous_secret: e.previous_secret,
        previous_secret_expires_at_ms: e.previous_secret_expires_at_ms,
        created_at_ms: e.created_at_ms,
        updated_at_ms: e.updated_at_ms,
    })
}

pub fn attempt_to_proto(a: &WebhookAttempt) -> v1::WebhookAttempt {
    v1::WebhookAttempt {
        store_id: a.store_id.to_string(),
        mode: mode_to_proto(a.mode),
        endpoint_id: a.endpoint_id.to_string(),
        event_id: a.event_id.clone(),
        attempt: a.attempt,
        at_ms: a.at_ms,
        status_code: a.status_code as u32,
        latency_ms: a.latency_ms,
        error: a.error.clone(),
        delivered: a.delivered,
        next_attempt_at_ms: a.next_attempt_at_ms,
        manual: a.manual,
    }
}

pub fn attempt_from_proto(a: v1::WebhookAttempt) -> Result<WebhookAttempt, DecodeError> {
    Ok(WebhookAttempt {
        mode: mode_from_proto(a.mode)?,
        store_id: a.store_id.into(),
        endpoint_id: a.endpoint_id.into(),
        event_id: a.event_id,
        attempt: a.attempt,
        at_ms: a.at_ms,
        status_code: u16::try_from(a.status_code)
            .map_err(|_| DecodeError::BadField("status_code"))?,
        latency_ms: a.latency_ms,
        error: a.error,
        delivered: a.delivered,
        next_attempt_at_ms: a.next_attempt_at_ms,
        manual: a.manual,
    })
}

pub(crate) fn request_key_to_proto(r: &tally_domain::record::RequestKey) -> v1::RequestKey {
    v1::RequestKey {
        api_key_sha256: r.api_key_sha256.clone(),
        key: r.key.clone(),
        fingerprint: r.fingerprint.clone(),
    }
}

fn request_key_from_proto(r: v1::RequestKey) -> tally_domain::record::RequestKey {
    tally_domain::record::RequestKey {
        api_key_sha256: r.api_key_sha256,
        key: r.key,
        fingerprint: r.fingerprint,
    }
}

/// Encodes a record for the log, with nothing beside it but its time.
pub fn encode_record(record: &tally_domain::record::Record, recorded_at_ms: i64) -> Vec<u8> {
    encode_record_with(
        record,
        &tally_domain::record::RecordMeta {
            recorded_at_ms,
            ..Default::default()
        },
    )
}

/// Encodes a record and its envelope for the log.
pub fn encode_record_with(
    record: &tally_domain::record::Record,
    meta: &tally_domain::record::RecordMeta,
) -> Vec<u8> {
    use prost::Message;
    use tally_domain::record::Record;
    use v1::log_record::Kind;
    let kind = match record {
        // The hottest record, written from borrowed fields (usage_encode.rs).
        Record::UsageBatch {
            store_id,
            mode,
            events,
            settles,
            matched_below,
        } => {
            return crate::usage_encode::encode_usage_batch(
                &crate::usage_encode::UsageBatchRef {
                    store_id: store_id.as_str(),
                    mode: *mode,
                    events,
                    settles: *settles,
                    matched_below: *matched_below,
                },
                meta,
            )
        }
        Record::StoreCreated(s) => Kind::StoreCreated(v1::StoreCreated {
            store_id: s.store_id.to_string(),
            name: s.name.clone(),
            prod_key_sha256: s.prod_key_sha256.clone(),
            test_key_sha256: s.test_key_sha256.clone(),
            created_at_ms: s.created_at_ms,
        }),
        Record::CustomerUpserted(c) => Kind::CustomerUpserted(v1::CustomerUpserted {
            customer: Some(customer_to_proto(c)),
        }),
        Record::MeterUpserted(m) => Kind::MeterUpserted(v1::MeterUpserted {
            meter: Some(meter_to_proto(m)),
        }),
        Record::ProductUpserted(p) => Kind::ProductUpserted(v1::ProductUpserted {
            product: Some(crate::product_to_proto(p)),
        }),
        Record::DiscountUpserted(d) => Kind::DiscountUpserted(crate::discount_to_proto(d)),
        Record::CheckoutCreated(c) => Kind::CheckoutCreated(crate::checkout_to_proto(c)),
        Record::CheckoutCompleted(c) => Kind::CheckoutCompleted(crate::completion_to_proto(c)),
        Record::RefundCreated(p) => Kind::RefundCreated(crate::payment_to_proto(p)),
        Record::DisputeOpened(d) => Kind::DisputeOpened(crate::dispute_to_proto(d)),
        Record::TaxRateSet {
            store_id,
            mode,
            country,
            rate_percent,
        } => Kind::TaxRateSet(v1::TaxRateSet {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            country: country.clone(),
            rate_percent: tally_domain::usage::canonical_decimal(*rate_percent),
        }),
        Record::UsageSettled(s) => Kind::UsageSettled(crate::settlement_to_proto(s)),
        Record::SubscriptionChanged {
            subscription,
            payment,
        } => Kind::SubscriptionChanged(v1::SubscriptionChanged {
            subscription: Some(crate::subscription_to_proto(subscription)),
            payment: payment.as_ref().map(crate::payment_to_proto),
        }),
        Record::StoreSettingsSet {
            store_id,
            mode,
            settings,
        } => Kind::StoreSettingsSet(crate::settings_to_proto(store_id, *mode, settings)),
        Record::AffiliateInviteCreated(i) => {
            Kind::AffiliateInviteCreated(crate::invite_to_proto(i))
        }
        Record::AffiliateJoined {
            invite_id,
            affiliate,
        } => Kind::AffiliateJoined(v1::AffiliateJoined {
            invite_id: invite_id.to_string(),
            affiliate: Some(crate::affiliate_to_proto(affiliate)),
        }),
        Record::AffiliateUpserted(a) => Kind::AffiliateUpserted(crate::affiliate_to_proto(a)),
        Record::AffiliateClicked {
            store_id,
            mode,
            referral_code,
        } => Kind::AffiliateClicked(v1::AffiliateClicked {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            referral_code: referral_code.clone(),
        }),
        Record::ModerationPolicySet {
            store_id,
            mode,
            policy,
        } => Kind::ModerationPolicySet(crate::policy_to_proto(store_id, *mode, policy)),
        Record::ApiKeyCreated {
            store_id,
            key_id,
            mode,
            key_sha256,
            permissions,
            created_at_ms,
        } => Kind::ApiKeyCreated(v1::ApiKeyCreated {
            store_id: store_id.to_string(),
            key_id: key_id.clone(),
            mode: mode_to_proto(*mode),
            key_sha256: key_sha256.clone(),
            permissions: permissions.clone(),
            created_at_ms: *created_at_ms,
        }),
        Record::EventsVoided {
            store_id,
            mode,
            event_ids,
            reason,
        } => Kind::EventsVoided(v1::EventsVoided {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            event_ids: event_ids.clone(),
            reason: reason.clone(),
        }),
        Record::MeterRevised { meter, minutes } => Kind::MeterRevised(v1::MeterRevised {
            meter: Some(meter_to_proto(meter)),
            minutes: minutes.clone(),
        }),
        Record::AutoRechargeSettled(s) => Kind::AutoRechargeSettled(v1::AutoRechargeSettled {
            store_id: s.store_id.to_string(),
            mode: mode_to_proto(s.mode),
            account_id: s.account_id.to_string(),
            debit_id: s.debit_id.to_string(),
            amount: canonical_decimal(s.amount),
            payment: match &s.outcome {
                RechargeOutcome::Paid(payment) => Some(crate::payment_to_proto(payment)),
                RechargeOutcome::Declined { .. } => None,
            },
            decline_message: match &s.outcome {
                RechargeOutcome::Paid(_) => None,
                RechargeOutcome::Declined { message } => Some(message.clone()),
            },
        }),
        Record::EventAmended {
            store_id,
            mode,
            event_id,
            reason,
            replacement,
            matched_below,
        } => Kind::EventAmended(v1::EventAmended {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            event_id: event_id.clone(),
            reason: reason.clone(),
            replacement: Some(usage_event_to_proto(replacement)),
            matched_below: *matched_below,
        }),
        Record::ApiKeyRevoked { store_id, key_id } => Kind::ApiKeyRevoked(v1::ApiKeyRevoked {
            store_id: store_id.to_string(),
            key_id: key_id.clone(),
        }),
        Record::TestClockSet { store_id, to_ms } => Kind::TestClockSet(v1::TestClockSet {
            store_id: store_id.to_string(),
            to_ms: *to_ms,
        }),
        Record::MeterBackfill {
            store_id,
            mode,
            meter_id,
            start_ms,
            event_ids,
            finish,
            rescan_from_ms,
        } => Kind::MeterBackfill(v1::MeterBackfill {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            meter_id: meter_id.to_string(),
            start_ms: *start_ms,
            event_ids: event_ids.clone(),
            finish: *finish,
            rescan_from_ms: *rescan_from_ms,
        }),
        Record::WebhookEndpointUpserted(e) => {
            Kind::WebhookEndpointUpserted(v1::WebhookEndpointUpserted {
                endpoint: Some(endpoint_to_proto(e)),
            })
        }
        Record::WebhookEndpointDeleted {
            store_id,
            mode,
            endpoint_id,
        } => Kind::WebhookEndpointDeleted(v1::WebhookEndpointDeleted {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            endpoint_id: endpoint_id.to_string(),
        }),
        Record::WebhookAttempt(a) => Kind::WebhookAttempt(attempt_to_proto(a)),
        Record::IdempotentResponse(r) => Kind::IdempotentResponse(v1::IdempotentResponse {
            request: Some(request_key_to_proto(&r.request)),
            partition_key: r.partition_key.clone(),
            status: r.status.into(),
            body: r.body.clone(),
        }),
        Record::CreditLedger {
            account,
            transaction,
            events,
        } => Kind::CreditLedger(v1::CreditLedger {
            account: account.as_ref().map(account_to_proto),
            transaction: transaction.as_ref().map(transaction_to_proto),
            events: events.iter().map(ledger_event_to_proto).collect(),
        }),
        Record::CreditReservation(step) => Kind::CreditReservation(reservation_step_to_proto(step)),
        Record::CreditExpiriesDue {
            store_id,
            mode,
            account_id,
        } => Kind::CreditExpiriesDue(v1::CreditExpiriesDue {
            store_id: store_id.to_string(),
            mode: mode_to_proto(*mode),
            account_id: account_id.to_string(),
        }),
    };
    v1::LogRecord {
        recorded_at_ms: meta.recorded_at_ms,
        format_version: LOG_FORMAT_VERSION,
        base_updated_at_ms: meta.base_updated_at_ms,
        request: meta.request.as_ref().map(request_key_to_proto),
        kind: Some(kind),
    }
    .encode_to_vec()
}

/// Decodes a log record; returns it with its envelope.
pub fn decode_record(
    bytes: &[u8],
) -> Result<
    (
        tally_domain::record::Record,
        tally_domain::record::RecordMeta,
    ),
    DecodeError,
> {
    use prost::Message;
    use tally_domain::record::{IdempotentResponse, Record, RecordMeta, StoreRecord};
    use v1::log_record::Kind;
    let record = v1::LogRecord::decode(bytes)?;
    check_format_version(record.format_version)?;
    let decoded = match record.kind.ok_or(DecodeError::BadField("kind"))? {
        Kind::StoreCreated(s) => Record::StoreCreated(StoreRecord {
            store_id: s.store_id.into(),
            name: s.name,
            prod_key_sha256: s.prod_key_sha256,
            test_key_sha256: s.test_key_sha256,
            created_at_ms: s.created_at_ms,
        }),
        Kind::CustomerUpserted(c) => Record::CustomerUpserted(customer_from_proto(
            c.customer.ok_or(DecodeError::BadField("customer"))?,
        )?),
        Kind::MeterUpserted(m) => Record::MeterUpserted(meter_from_proto(
            m.meter.ok_or(DecodeError::BadField("meter"))?,
        )?),
        Kind::ProductUpserted(p) => Record::ProductUpserted(crate::product_from_proto(
            p.product.ok_or(DecodeError::BadField("product"))?,
        )?),
        Kind::DiscountUpserted(d) => Record::DiscountUpserted(crate::discount_from_proto(d)?),
        Kind::CheckoutCreated(c) => Record::CheckoutCreated(crate::checkout_from_proto(c)?),
        Kind::CheckoutCompleted(c) => Record::CheckoutCompleted(crate::completion_from_proto(c)?),
        Kind::RefundCreated(p) => Record::RefundCreated(crate::payment_from_proto(p)?),
        Kind::DisputeOpened(d) => Record::DisputeOpened(crate::dispute_from_proto(d)?),
        Kind::TaxRateSet(t) => Record::TaxRateSet {
            store_id: t.store_id.into(),
            mode: mode_from_proto(t.mode)?,
            country: t.country,
            rate_percent: decimal_from_text(&t.rate_percent, "rate_percent")?,
        },
        Kind::UsageSettled(s) => Record::UsageSettled(crate::settlement_from_proto(s)?),
        Kind::SubscriptionChanged(c) => Record::SubscriptionChanged {
            subscription: crate::subscription_from_proto(
                c.subscription
                    .ok_or(DecodeError::BadField("subscription"))?,
            )?,
            payment: c.payment.map(crate::payment_from_proto).transpose()?,
        },
        Kind::StoreSettingsSet(s) => {
            let (store_id, mode, settings) = crate::settings_from_proto(s)?;
            Record::StoreSettingsSet {
                store_id: store_id.into(),
                mode,
                settings,
            }
        }
        Kind::AffiliateInviteCreated(i) => {
            Record::AffiliateInviteCreated(crate::invite_from_proto(i)?)
        }
        Kind::AffiliateJoined(j) => Record::AffiliateJoined {
            invite_id: j.invite_id.into(),
            affiliate: crate::affiliate_from_proto(
                j.affiliate.ok_or(DecodeError::BadField("affiliate"))?,
            )?,
        },
        Kind::AffiliateUpserted(a) => Record::AffiliateUpserted(crate::affiliate_from_proto(a)?),
        Kind::AffiliateClicked(c) => Record::AffiliateClicked {
            store_id: c.store_id.into(),
            mode: mode_from_proto(c.mode)?,
            referral_code: c.referral_code,
        },
        Kind::ModerationPolicySet(p) => {
            let (store_id, mode, policy) = crate::policy_from_proto(p)?;
            Record::ModerationPolicySet {
                store_id: store_id.into(),
                mode,
                policy,
            }
        }
        Kind::ApiKeyCreated(k) => Record::ApiKeyCreated {
            store_id: k.store_id.into(),
            key_id: k.key_id,
            mode: mode_from_proto(k.mode)?,
            key_sha256: k.key_sha256,
            permissions: k.permissions,
            created_at_ms: k.created_at_ms,
        },
        Kind::EventsVoided(v) => Record::EventsVoided {
            store_id: v.store_id.into(),
            mode: mode_from_proto(v.mode)?,
            event_ids: v.event_ids,
            reason: v.reason,
        },
        Kind::MeterRevised(r) => Record::MeterRevised {
            meter: meter_from_proto(r.meter.ok_or(DecodeError::BadField("meter"))?)?,
            minutes: r.minutes,
        },
        Kind::AutoRechargeSettled(s) => Record::AutoRechargeSettled(RechargeSettled {
            store_id: s.store_id.into(),
            mode: mode_from_proto(s.mode)?,
            account_id: s.account_id.into(),
            debit_id: s.debit_id.into(),
            amount: decimal_from_text(&s.amount, "auto_recharge_settled.amount")?,
            outcome: match (s.payment, s.decline_message) {
                (Some(payment), None) => RechargeOutcome::Paid(crate::payment_from_proto(payment)?),
                (None, Some(message)) => RechargeOutcome::Declined { message },
                _ => return Err(DecodeError::BadField("auto_recharge_settled.outcome")),
            },
        }),
        Kind::EventAmended(a) => Record::EventAmended {
            store_id: a.store_id.into(),
            mode: mode_from_proto(a.mode)?,
            event_id: a.event_id,
            reason: a.reason,
            replacement: usage_event_from_proto(
                a.replacement.ok_or(DecodeError::BadField("replacement"))?,
            )?,
            matched_below: a.matched_below,
        },
        Kind::ApiKeyRevoked(k) => Record::ApiKeyRevoked {
            store_id: k.store_id.into(),
            key_id: k.key_id,
        },
        Kind::TestClockSet(t) => Record::TestClockSet {
            store_id: t.store_id.into(),
            to_ms: t.to_ms,
        },
        Kind::UsageBatch(b) => Record::UsageBatch {
            store_id: b.store_id.into(),
            mode: mode_from_proto(b.mode)?,
            settles: b.settles,
            matched_below: b.matched_below,
            events: b
                .events
                .into_iter()
                .map(usage_event_from_proto)
                .collect::<Result<_, _>>()?,
        },
        Kind::MeterBackfill(b) => Record::MeterBackfill {
            store_id: b.store_id.into(),
            mode: mode_from_proto(b.mode)?,
            meter_id: b.meter_id.into(),
            start_ms: b.start_ms,
            event_ids: b.event_ids,
            finish: b.finish,
            rescan_from_ms: b.rescan_from_ms,
        },
        Kind::WebhookEndpointUpserted(e) => Record::WebhookEndpointUpserted(endpoint_from_proto(
            e.endpoint.ok_or(DecodeError::BadField("endpoint"))?,
        )?),
        Kind::WebhookEndpointDeleted(d) => Record::WebhookEndpointDeleted {
            store_id: d.store_id.into(),
            mode: mode_from_proto(d.mode)?,
            endpoint_id: d.endpoint_id.into(),
        },
        Kind::WebhookAttempt(a) => Record::WebhookAttempt(attempt_from_proto(a)?),
        Kind::IdempotentResponse(r) => Record::IdempotentResponse(IdempotentResponse {
            request: request_key_from_proto(r.request.ok_or(DecodeError::BadField("request"))?),
            partition_key: r.partition_key,
            status: u16::try_from(r.status).map_err(|_| DecodeError::BadField("status"))?,
            body: r.body,
        }),
        Kind::CreditLedger(l) => Record::CreditLedger {
            account: l.account.map(account_from_proto).transpose()?,
            transaction: l.transaction.map(transaction_from_proto).transpose()?,
            events: l
                .events
                .into_iter()
                .map(ledger_event_from_proto)
                .collect::<Result<_, _>>()?,
        },
        Kind::CreditReservation(r) => Record::CreditReservation(reservation_step_from_proto(r)?),
        Kind::CreditExpiriesDue(d) => Record::CreditExpiriesDue {
            store_id: d.store_id.into(),
            mode: mode_from_proto(d.mode)?,
            account_id: d.account_id.into(),
        },
    };
    let meta = RecordMeta {
        recorded_at_ms: record.recorded_at_ms,
        base_updated_at_ms: record.base_updated_at_ms,
        request: record.request.map(request_key_from_proto),
    };
    Ok((decoded, meta))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;
    use tally_domain::record::{Record, RecordMeta, RequestKey};

    /// Any short string (empty ones among them), now and then one longer than 127
    /// bytes, whose length takes two bytes on the wire.
    fn text(max: usize) -> impl Strategy<Value = String> {
        prop_oneof![
            8 => proptest::string::string_regex(&format!(".{{0,{max}}}")).expect("a regex"),
            1 => "[a-z]{128,160}",
        ]
    }

    /// A usage event as the gateway builds one: property numbers normalized
    /// (`validate_event`), any strings.
    pub(crate) fn usage_event() -> impl Strategy<Value = UsageEvent> {
        let property = prop_oneof![
            text(8).prop_map(PropertyValue::String),
            (any::<i64>(), 0u32..12)
                .prop_map(|(m, scale)| PropertyValue::Number(Decimal::new(m, scale).normalize())),
        ];
        (
            (text(12), text(12), text(12), proptest::option::of(text(12))),
            (any::<i64>(), any::<i64>(), any::<bool>()),
            proptest::collection::btree_map(text(6), property, 0..4),
            proptest::collection::vec(text(8), 0..3),
        )
            .prop_map(
                |(
                    (event_id, name, customer, external),
                    (timestamp_ms, received_at_ms, assigned),
                    properties,
                    meters,
                )| {
                    UsageEvent {
                        event_id,
                        name,
                        customer_id: customer.into(),
                        external_customer_id: external,
                        timestamp_ms,
                        properties,
                        received_at_ms,
                        matched_meter_ids: meters.into_iter().map(Into::into).collect(),
                        event_id_assigned: assigned,
                    }
                },
            )
    }

    /// A usage batch record of such events, with any envelope.
    pub(crate) fn usage_batch() -> impl Strategy<Value = (Record, RecordMeta)> {
        (
            (
                text(12),
                any::<bool>(),
                proptest::collection::vec(usage_event(), 0..6),
                any::<bool>(),
                proptest::option::of(any::<u64>()),
            ),
            (
                any::<i64>(),
                proptest::option::of(any::<i64>()),
                proptest::option::of((
                    proptest::collection::vec(any::<u8>(), 0..33),
                    text(8),
                    proptest::collection::vec(any::<u8>(), 0..33),
                )),
            ),
        )
            .prop_map(
                |(
                    (store_id, test_mode, events, settles, matched_below),
                    (recorded_at_ms, base_updated_at_ms, request),
                )| {
                    let record = Record::UsageBatch {
                        store_id: store_id.into(),
                        mode: if test_mode { Mode::Test } else { Mode::Prod },
                        events,
                        settles,
                        matched_below,
                    };
                    let meta = RecordMeta {
                        recorded_at_ms,
                        base_updated_at_ms,
                        request: request.map(|(api_key_sha256, key, fingerprint)| RequestKey {
                            api_key_sha256,
                            key,
                            fingerprint,
                        }),
                    };
                    (record, meta)
                },
            )
    }

    proptest! {
        /// The gateway hands its usage records to its own projector as built
        /// (`Journal::append_handing_off`) while every other reader decodes them
        /// from the log: both must be the same record, to the scale of every number
        /// (compared through `Debug`, which shows it; `==` on decimals ignores it).
        #[test]
        fn a_usage_record_decodes_to_the_record_that_was_encoded(
            (record, meta) in usage_batch(),
        ) {
            let decoded = decode_record(&encode_record_with(&record, &meta)).unwrap();
            prop_assert_eq!(format!("{:?}", decoded), format!("{:?}", (record, meta)));
        }

        /// A usage record read as frames holds the record's scope and, one by one,
        /// the events the whole record decodes to (to the scale of every number);
        /// any other record holds no frames.
        #[test]
        fn a_usage_records_frames_decode_to_its_events(
            store_id in ".{0,12}",
            test_mode in any::<bool>(),
            events in proptest::collection::vec(usage_event(), 0..6),
            settles in any::<bool>(),
            matched_below in proptest::option::of(any::<u64>()),
            recorded_at_ms in any::<i64>(),
            amended in any::<bool>(),
        ) {
            let mode = if test_mode { Mode::Test } else { Mode::Prod };
            let record = match (amended, events.first()) {
                (true, Some(replacement)) => Record::EventAmended {
                    store_id: store_id.clone().into(),
                    mode,
                    event_id: replacement.event_id.clone(),
                    reason: "r".into(),
                    replacement: replacement.clone(),
                    matched_below,
                },
                _ => Record::UsageBatch {
                    store_id: store_id.clone().into(),
                    mode,
                    events: events.clone(),
                    settles,
                    matched_below,
                },
            };
            let bytes = encode_record(&record, recorded_at_ms);
            let frames = crate::usage_frames(&bytes).unwrap();
            match decode_record(&bytes).unwrap().0 {
                Record::UsageBatch { store_id, mode, events, .. } => {
                    let frames = frames.expect("a usage record has frames");
                    prop_assert_eq!(&frames.store_id, store_id.as_str());
                    prop_assert_eq!(frames.mode, mode);
                    let one_by_one = frames
                        .events
                        .iter()
                        .map(|bytes| crate::decode_usage_event(bytes).unwrap())
                        .collect::<Vec<_>>();
                    prop_assert_eq!(format!("{one_by_one:?}"), format!("{events:?}"));
                }
                other => prop_assert!(frames.is_none(), "{other:?} has frames"),
            }
        }
    }

    #[test]
    fn frames_of_another_format_version_are_refused() {
        let record = v1::LogRecord {
            format_version: LOG_FORMAT_VERSION + 1,
            ..Default::default()
        };
        let found = LOG_FORMAT_VERSION + 1;
        assert!(matches!(
            crate::usage_frames(&record.encode_to_vec()),
            Err(DecodeError::Version { found: f }) if f == found
        ));
    }

    #[test]
    fn meter_round_trips_through_bytes() {
        let meter = Meter {
            id: "mtr_1".into(),
            store_id: "st_1".into(),
            mode: Mode::Test,
            name: "tokens".into(),
            event_name: "llm".into(),
            aggregation: Aggregation::Sum,
            aggregation_property: Some("tokens".into()),
            filter: MeterFilter {
                conjunction: Conjunction::Or,
                clauses: vec![FilterClause {
                    property: "model".into(),
                    operator: Operator::In,
                    value: FilterValue::List(vec![
                        FilterValue::String("a".into()),
                        FilterValue::Number("1.5".parse().unwrap()),
                        FilterValue::Bool(true),
                    ]),
                }],
            },
            unit_label: "tokens".into(),
            status: MeterStatus::Archived,
            created_at_ms: 1,
            updated_at_ms: 2,
            counts_from_ms: 1,
            revision: 1,
        };
        let bytes = meter_to_proto(&meter).encode_to_vec();
        let back = meter_from_proto(v1::Meter::decode(bytes.as_slice()).unwrap()).unwrap();
        assert_eq!(back, meter);
    }

    #[test]
    fn unknown_enum_values_are_errors() {
        let m = v1::Meter {
            mode: 99,
            ..Default::default()
        };
        assert!(meter_from_proto(m).is_err());
    }
}
