//! Usage settlement between the domain and `tally.v1`: bindings, charges, the
//! settlement record and a binding's totals (docs/api.md, "Usage prices").

use tally_domain::record::UsageSettlement;
use tally_domain::settlement::{SettlementTotals, UsageBinding, UsageUnits};
use tally_domain::usage::canonical_decimal;

use crate::convert::{mode_from_proto, mode_to_proto, DecodeError};
use crate::product::decimal;
use crate::v1;

pub fn binding_to_proto(b: &UsageBinding) -> v1::UsageBinding {
    v1::UsageBinding {
        source_id: b.source_id.clone(),
        price_id: b.price_id.clone(),
        meter_id: b.meter_id.to_string(),
        unit_price: canonical_decimal(b.unit_price),
        free_allowance: canonical_decimal(b.free_allowance),
        cap: b.cap.map(canonical_decimal),
        account_name: b.account_name.clone(),
        anchor_ms: b.anchor_ms,
        period_months: b.period_months.unwrap_or(0),
        charge_from_ms: b.charge_from_ms,
        charge_until_ms: b.charge_until_ms,
    }
}

pub fn binding_from_proto(b: v1::UsageBinding) -> Result<UsageBinding, DecodeError> {
    Ok(UsageBinding {
        source_id: b.source_id,
        price_id: b.price_id,
        meter_id: b.meter_id.into(),
        unit_price: decimal(&b.unit_price, "unit_price")?,
        free_allowance: decimal(&b.free_allowance, "free_allowance")?,
        cap: b.cap.map(|c| decimal(&c, "cap")).transpose()?,
        account_name: b.account_name,
        anchor_ms: b.anchor_ms,
        period_months: (b.period_months > 0).then_some(b.period_months),
        charge_from_ms: b.charge_from_ms,
        charge_until_ms: b.charge_until_ms,
    })
}

fn units_to_proto(u: &UsageUnits) -> v1::UsageUnits {
    v1::UsageUnits {
        customer_id: u.customer_id.to_string(),
        meter_id: u.meter_id.to_string(),
        timestamp_ms: u.timestamp_ms,
        quantity: canonical_decimal(u.quantity),
        events: u.events,
    }
}

fn units_from_proto(u: v1::UsageUnits) -> Result<UsageUnits, DecodeError> {
    Ok(UsageUnits {
        customer_id: u.customer_id.into(),
        meter_id: u.meter_id.into(),
        timestamp_ms: u.timestamp_ms,
        quantity: decimal(&u.quantity, "quantity")?,
        events: u.events,
    })
}

pub fn settlement_to_proto(s: &UsageSettlement) -> v1::UsageSettled {
    v1::UsageSettled {
        store_id: s.store_id.to_string(),
        mode: mode_to_proto(s.mode),
        source_partition: s.source_partition,
        source_offset: s.source_offset,
        units: s.units.iter().map(units_to_proto).collect(),
    }
}

pub fn settlement_from_proto(s: v1::UsageSettled) -> Result<UsageSettlement, DecodeError> {
    Ok(UsageSettlement {
        store_id: s.store_id.into(),
        mode: mode_from_proto(s.mode)?,
        source_partition: s.source_partition,
        source_offset: s.source_offset,
        units: s
            .units
            .into_iter()
            .map(units_from_proto)
            .collect::<Result<_, _>>()?,
    })
}

pub fn totals_to_proto(t: &SettlementTotals) -> v1::SettlementTotals {
    v1::SettlementTotals {
        meter_id: t.meter_id.clone(),
        account_name: t.account_name.clone(),
        quantity: canonical_decimal(t.quantity),
        billed: canonical_decimal(t.billed),
        debited: canonical_decimal(t.debited),
        shortfall: canonical_decimal(t.shortfall),
    }
}

pub fn totals_from_proto(t: v1::SettlementTotals) -> Result<SettlementTotals, DecodeError> {
    Ok(SettlementTotals {
        meter_id: t.meter_id,
        account_name: t.account_name,
        quantity: decimal(&t.quantity, "quantity")?,
        billed: decimal(&t.billed, "billed")?,
        debited: decimal(&t.debited, "debited")?,
        shortfall: decimal(&t.shortfall, "shortfall")?,
    })
}

pub fn bindings_to_proto(bindings: &[UsageBinding]) -> v1::UsageBindings {
    v1::UsageBindings {
        bindings: bindings.iter().map(binding_to_proto).collect(),
    }
}

pub fn bindings_from_proto(b: v1::UsageBindings) -> Result<Vec<UsageBinding>, DecodeError> {
    b.bindings.into_iter().map(binding_from_proto).collect()
}
