//! Usage settled in credits (docs/api.md, "Usage prices"; ARCHITECTURE.md, "Usage
//! settlement"): a purchase binds a customer's usage of a meter to one of their
//! credit accounts; each usage record's new events are charged to the bindings
//! they fall under; the charges are settled against the accounts in the store's
//! log order.
//!
//! Three steps, each deterministic, so a replay reproduces them:
//! 1. [`bind_purchase`] (in the completion's apply) writes the bindings;
//! 2. [`charge_usage`] (in the usage record's apply) adds up what the record's new
//!    events charge and leaves it as a pending settlement (table `3`), committed
//!    atomically with the usage it charges for;
//! 3. the [`Settler`](crate::Billing::settle_pending) appends each pending
//!    settlement as a `UsageSettled` record on the store's partition, and
//!    [`apply_usage_settled`] decides it there, once per usage record: the billable
//!    units of the period (above `free_allowance`, up to `cap`), then the debit,
//!    never below zero, through the caller's `debit` (the ledger).
//!
//! Logs of earlier builds partitioned usage by customer and the ledger by store, so
//! the settlement is a record of its own: its debits are decided in the ledger's
//! log order, never in the interleaving of two partitions. Whatever order a replay applies the two
//! records in, the result is the same: a usage record whose settlement was applied
//! first leaves nothing pending.

use std::collections::{BTreeMap, HashMap};

use rust_decimal::Decimal;
use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::keys::{self, Key};
use tally_core::outcome::Outcome;
use tally_core::overlay::{ApplyError, Overlay};
use tally_core::pagination::collect_prefix;
use tally_domain::ledger::MAX_AMOUNT;
use tally_domain::product::Product;
use tally_domain::record::UsageSettlement;
use tally_domain::settlement::{
    billable, credits_for, take_back, PeriodSettlement, SettlementTotals, UsageBinding,
    UsageCharge, UsageUnits,
};
use tally_domain::Mode;

/// Outcome code of a settlement record whose usage record is settled already (a
/// settler on another node, or a retry after a crash, appended it again).
pub const ALREADY_SETTLED: &str = "usage_already_settled";

fn binding_key(store_id: &str, mode: Mode, customer_id: &str, meter_id: &str) -> Vec<u8> {
    Key::scoped(keys::USAGE_BINDING, store_id, mode)
        .text(customer_id)
        .text(meter_id)
        .into_bytes()
}

fn scope_key(store_id: &str, mode: Mode) -> Vec<u8> {
    Key::scoped(keys::USAGE_BINDING_SCOPE, store_id, mode).into_bytes()
}

/// The pending settlement of the usage record at a position.
pub fn pending_key(partition: u32, offset: u64) -> Vec<u8> {
    Key::table(keys::SETTLEMENT_PENDING)
        .uint(u64::from(partition))
        .uint(offset)
        .into_bytes()
}

fn done_key(partition: u32, offset: u64) -> Vec<u8> {
    keys::settlement_done_key(partition, offset)
}

fn period_usage_key(store_id: &str, mode: Mode, charge: &UsageCharge) -> Vec<u8> {
    Key::scoped(keys::SETTLEMENT_PERIOD_USAGE, store_id, mode)
        .text(&charge.source_id)
        .text(&charge.price_id)
        .int(charge.period_start_ms)
        .into_bytes()
}

fn totals_prefix(store_id: &str, mode: Mode, source_id: &str) -> Key {
    Key::scoped(keys::SETTLEMENT_TOTALS, store_id, mode).text(source_id)
}

/// Binds a purchase's `credits` usage prices to the customer's usage: a checkout's
/// completion, a subscription becoming live again or changing product.
/// `source_id`: the subscription, or the checkout of a one-time product; events
/// from `from_ms` are charged, in periods counted from `anchor_ms`.
pub fn bind_purchase(
    overlay: &mut Overlay<'_>,
    customer_id: &str,
    source_id: &str,
    product: &Product,
    (anchor_ms, from_ms): (i64, i64),
    trial_end_ms: Option<i64>,
) -> Result<(), EngineError> {
    let (store_id, mode) = (&product.store_id, product.mode);
    let bindings = UsageBinding::for_purchase(source_id, product, anchor_ms, from_ms, trial_end_ms);
    if bindings.is_empty() {
        return Ok(());
    }
    for binding in bindings {
        let key = binding_key(store_id, mode, customer_id, &binding.meter_id);
        let mut all = match overlay.get(&key)? {
            Some(bytes) => codec::decode_bindings(&bytes)?,
            None => Vec::new(),
        };
        all.push(binding);
        overlay.put(key, codec::encode_bindings(&all));
    }
    overlay.put(scope_key(store_id, mode), Vec::new());
    Ok(())
}

/// Ends the bindings `source_id` holds for `product`'s `credits` prices: events from
/// `at_ms` on are not charged (a subscription canceled, paused, unpaid or moved to
/// another product).
pub fn end_bindings(
    overlay: &mut Overlay<'_>,
    customer_id: &str,
    source_id: &str,
    product: &Product,
    at_ms: i64,
) -> Result<(), EngineError> {
    let (store_id, mode) = (&product.store_id, product.mode);
    for price in product
        .usage_prices
        .iter()
        .filter(|p| p.settlement_mode == tally_domain::product::SettlementMode::Credits)
    {
        let key = binding_key(store_id, mode, customer_id, &price.meter_id);
        let Some(bytes) = overlay.get(&key)? else {
            continue;
        };
        let mut all = codec::decode_bindings(&bytes)?;
        // Only this product's prices: an add-on item of the same subscription may
        // price the same meter.
        for binding in all.iter_mut().filter(|b| {
            b.source_id == source_id && b.charge_until_ms.is_none() && b.price_id == price.id
        }) {
            binding.charge_until_ms = Some(at_ms.max(binding.charge_from_ms));
        }
        overlay.put(key, codec::encode_bindings(&all));
    }
    Ok(())
}

/// Whether any purchase of the scope ever bound usage to credits (one read): a
/// scope without such a purchase has no settlement to correct.
pub fn scope_settles(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
) -> Result<bool, EngineError> {
    overlay.contains(&scope_key(store_id, mode))
}

/// Whether the usage record at a position left its units for settlement: it is
/// settled (its claim) or pending. A void takes units back only from such records:
/// the others charged nothing.
pub fn was_left(overlay: &Overlay<'_>, partition: u32, offset: u64) -> Result<bool, EngineError> {
    Ok(overlay.contains(&done_key(partition, offset))?
        || overlay.contains(&pending_key(partition, offset))?)
}

/// Marks the usage record at a position as settled with nothing to charge (its
/// events added no units under the definitions of the time), unless it is marked
/// already: a correction of its events later (a meter revision) then knows that
/// its usage is settled, as `was_left` asks.
pub fn settled_nothing(
    overlay: &mut Overlay<'_>,
    partition: u32,
    offset: u64,
) -> Result<(), EngineError> {
    if !was_left(overlay, partition, offset)? {
        overlay.put(done_key(partition, offset), Vec::new());
    }
    Ok(())
}

/// Meter units one new event added to one meter (negative: a voided event's, taken
/// back).
#[derive(Debug, Clone, Copy)]
pub struct NewUnits<'a> {
    pub customer_id: &'a str,
    pub meter_id: &'a str,
    pub timestamp_ms: i64,
    pub quantity: Decimal,
}

/// Leaves the meter units a usage record's new events added pending for the
/// settler (the record's apply, for a record the gateway marked as settling); true
/// when it did. Reads no binding: which purchases the units charge is decided when
/// the settlement is applied, in the store's log order. A record settled already
/// (its settlement applied first, in a replay over partitions) leaves nothing.
pub fn leave_units<'a>(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    new_units: impl IntoIterator<Item = NewUnits<'a>>,
    partition: u32,
    offset: u64,
) -> Result<bool, EngineError> {
    let mut units: BTreeMap<(&str, &str, i64), UsageUnits> = BTreeMap::new();
    for unit in new_units {
        let entry = units
            .entry((unit.customer_id, unit.meter_id, unit.timestamp_ms))
            .or_insert_with(|| UsageUnits {
                customer_id: unit.customer_id.into(),
                meter_id: unit.meter_id.into(),
                timestamp_ms: unit.timestamp_ms,
                quantity: Decimal::ZERO,
                events: 0,
            });
        // Inputs are bounded (limits::MAX_PROPERTY_NUMBER_ABS); past the exact range
        // the units stop growing rather than rounding.
        if let Some(sum) = tally_domain::exact::exact_add(entry.quantity, unit.quantity) {
            entry.quantity = sum;
            entry.events = entry.events.saturating_add(1);
        }
    }
    if units.is_empty() || overlay.contains(&done_key(partition, offset))? {
        return Ok(false);
    }
    let settlement = UsageSettlement {
        store_id: store_id.into(),
        mode,
        source_partition: partition,
        source_offset: offset,
        units: units.into_values().collect(),
    };
    overlay.put(
        pending_key(partition, offset),
        codec::encode_settlement(&settlement),
    );
    Ok(true)
}

/// Whether a purchase binds the usage of any of these events (its customer's, of a
/// meter it matched): the gateway's question, read from the projection; one read
/// when the scope has no binding at all.
pub fn is_bound(
    store: &dyn tally_projection::ProjectionStore,
    store_id: &str,
    mode: Mode,
    events: &[tally_domain::usage::UsageEvent],
) -> Result<bool, EngineError> {
    is_bound_by(|key| Ok(store.get(key)?), store_id, mode, events)
}

/// `is_bound`, reading through `get`: apply asks it of its overlay when the
/// gateway that answered it had not applied everything before the record
/// (ARCHITECTURE.md, "Meters the gateway did not know").
pub fn is_bound_by(
    get: impl Fn(&[u8]) -> Result<Option<Vec<u8>>, EngineError>,
    store_id: &str,
    mode: Mode,
    events: &[tally_domain::usage::UsageEvent],
) -> Result<bool, EngineError> {
    if get(&scope_key(store_id, mode))?.is_none() {
        return Ok(false);
    }
    for event in events {
        for meter_id in &event.matched_meter_ids {
            let key = binding_key(store_id, mode, &event.customer_id, meter_id);
            if get(&key)?.is_some() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Whether a purchase settles the customer's usage of the meter in credits now
/// (a binding that has not ended).
pub fn is_bound_to(
    store: &dyn tally_projection::ProjectionStore,
    store_id: &str,
    mode: Mode,
    customer_id: &str,
    meter_id: &str,
) -> Result<bool, EngineError> {
    match store.get(&binding_key(store_id, mode, customer_id, meter_id))? {
        Some(bytes) => Ok(codec::decode_bindings(&bytes)?
            .iter()
            .any(|b| b.charge_until_ms.is_none())),
        None => Ok(false),
    }
}

/// A debit settlement asks of the ledger, or, taking a voided event's usage back, a
/// credit (`amount` is then what to give back).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageDebit<'a> {
    pub store_id: &'a str,
    pub mode: Mode,
    pub customer_id: &'a str,
    pub account_name: &'a str,
    /// Positive.
    pub amount: Decimal,
    /// The ledger transaction's id (derived from the settlement, so a replay posts
    /// the same one).
    pub transaction_id: String,
    pub meter_id: &'a str,
    pub source_id: &'a str,
    pub created_at_ms: i64,
}

/// Settles a usage record's charges once: the billable units of each charge's
/// period, their credits, and the debit `debit` takes (never more than the account
/// holds: it answers what it took). The rest is the shortfall, kept with the
/// binding's totals. A void's charges are negative: the period's usage shrinks, and
/// the credits its billable units came to are taken back (`take_back`: shortfall
/// forgiven first, the rest credited through `refund`, which answers what it gave).
pub fn apply_usage_settled(
    overlay: &mut Overlay<'_>,
    settlement: &UsageSettlement,
    recorded_at_ms: i64,
    debit: &mut dyn FnMut(&mut Overlay<'_>, &UsageDebit<'_>) -> Result<Decimal, ApplyError>,
    refund: &mut dyn FnMut(&mut Overlay<'_>, &UsageDebit<'_>) -> Result<Decimal, ApplyError>,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&settlement.store_id, settlement.mode);
    let (partition, offset) = (settlement.source_partition, settlement.source_offset);
    let done = done_key(partition, offset);
    if overlay.contains(&done)? {
        return Err(Outcome::rejected(
            ALREADY_SETTLED,
            "the usage of this record is settled already",
        )
        .into());
    }
    overlay.delete(pending_key(partition, offset));
    let mut bindings: HashMap<(&str, &str), Vec<UsageBinding>> = HashMap::new();
    for unit in &settlement.units {
        let key = (unit.customer_id.as_str(), unit.meter_id.as_str());
        if let std::collections::hash_map::Entry::Vacant(slot) = bindings.entry(key) {
            let stored = binding_key(store_id, mode, key.0, key.1);
            slot.insert(match overlay.get(&stored)? {
                Some(bytes) => codec::decode_bindings(&bytes)?,
                None => Vec::new(),
            });
        }
    }
    let units: Vec<(&UsageUnits, &[UsageBinding])> = settlement
        .units
        .iter()
        .map(|unit| {
            let key = (unit.customer_id.as_str(), unit.meter_id.as_str());
            (unit, bindings.get(&key).map_or(&[][..], Vec::as_slice))
        })
        .collect();
    let mut posted = String::new();
    for (index, charge) in UsageCharge::of(&units).iter().enumerate() {
        let usage_key = period_usage_key(store_id, mode, charge);
        let period = match overlay.get(&usage_key)? {
            Some(bytes) => codec::decode_period_settlement(&bytes)?,
            None => PeriodSettlement::new(),
        };
        let used_before = period.used;
        let (Some(units), Some(used_after)) = (
            billable(
                used_before,
                charge.quantity,
                charge.free_allowance,
                charge.cap,
            ),
            tally_domain::exact::exact_add(used_before, charge.quantity),
        ) else {
            continue;
        };
        let credits = credits_for(units.abs(), charge.unit_price)
            .unwrap_or(MAX_AMOUNT)
            .min(MAX_AMOUNT);
        let transaction_id =
            tally_core::ids::derived_id("ctx", &format!("usage:{partition}:{offset}:{index}"));
        let request = |amount| UsageDebit {
            store_id,
            mode,
            customer_id: &charge.customer_id,
            account_name: &charge.account_name,
            amount,
            transaction_id: transaction_id.clone(),
            meter_id: &charge.meter_id,
            source_id: &charge.source_id,
            created_at_ms: recorded_at_ms,
        };
        let (billed, debited) = if charge.quantity < Decimal::ZERO {
            // The period's own shortfall is forgiven first; a period an earlier
            // build settled keeps no amounts, so the binding's stand in.
            let totals = match period.totals() {
                Some(totals) => totals,
                None => stored_totals(overlay, store_id, mode, charge)?,
            };
            let (forgiven, back) = take_back(&totals, credits);
            let given = match back > Decimal::ZERO {
                true => refund(overlay, &request(back))?.clamp(Decimal::ZERO, back),
                false => Decimal::ZERO,
            };
            if given > Decimal::ZERO {
                posted.push_str(&transaction_id);
                posted.push('\n');
            }
            // What is not given back (an account closed since) stays billed.
            (-(forgiven + given), -given)
        } else if credits > Decimal::ZERO {
            let taken = debit(overlay, &request(credits))?.clamp(Decimal::ZERO, credits);
            if taken > Decimal::ZERO {
                posted.push_str(&transaction_id);
                posted.push('\n');
            }
            (credits, taken)
        } else {
            (Decimal::ZERO, Decimal::ZERO)
        };
        // Bounded by the ledger's limits; saturating like the totals, a report.
        let add = |a: Decimal, b: Decimal| a.checked_add(b).unwrap_or(Decimal::MAX);
        let period = PeriodSettlement {
            // A void takes back at most what the period used.
            used: used_after.max(Decimal::ZERO),
            paid: period.paid.map(|(was_billed, was_debited)| {
                (add(was_billed, billed), add(was_debited, debited))
            }),
        };
        overlay.put(usage_key, codec::encode_period_settlement(&period));
        add_to_totals(overlay, store_id, mode, charge, billed, debited)?;
    }
    // The claim, naming what it posted (the ledger audit replays those).
    overlay.put(done, posted.into_bytes());
    Ok(())
}

fn totals_key(store_id: &str, mode: Mode, charge: &UsageCharge) -> Vec<u8> {
    totals_prefix(store_id, mode, &charge.source_id)
        .text(&charge.price_id)
        .into_bytes()
}

/// The totals of the binding `charge` falls under (zero before its first charge).
fn stored_totals(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    charge: &UsageCharge,
) -> Result<SettlementTotals, EngineError> {
    Ok(match overlay.get(&totals_key(store_id, mode, charge))? {
        Some(bytes) => codec::decode_settlement_totals(&bytes)?,
        None => SettlementTotals {
            meter_id: charge.meter_id.to_string(),
            account_name: charge.account_name.clone(),
            ..SettlementTotals::default()
        },
    })
}

/// Adds a charge to its binding's totals: positive for usage, negative for a
/// void's take-back.
fn add_to_totals(
    overlay: &mut Overlay<'_>,
    store_id: &str,
    mode: Mode,
    charge: &UsageCharge,
    billed: Decimal,
    debited: Decimal,
) -> Result<(), EngineError> {
    let mut totals = stored_totals(overlay, store_id, mode, charge)?;
    // Saturating: the totals are a report; the ledger holds the exact balances.
    let add = |a: Decimal, b: Decimal| a.checked_add(b).unwrap_or(Decimal::MAX);
    totals.quantity = add(totals.quantity, charge.quantity).max(Decimal::ZERO);
    totals.billed = add(totals.billed, billed);
    totals.debited = add(totals.debited, debited);
    totals.shortfall = add(totals.shortfall, billed - debited);
    overlay.put(
        totals_key(store_id, mode, charge),
        codec::encode_settlement_totals(&totals),
    );
    Ok(())
}

/// The settlement totals of a subscription's (or one-time checkout's) usage prices,
/// by price.
pub fn settlement_totals(
    store: &dyn tally_projection::ProjectionStore,
    store_id: &str,
    mode: Mode,
    source_id: &str,
) -> Result<Vec<SettlementTotals>, EngineError> {
    let prefix = totals_prefix(store_id, mode, source_id).into_bytes();
    collect_prefix(store, &prefix, false, usize::MAX, |_, value| {
        codec::decode_settlement_totals(value).map(Some)
    })
}

/// The pending settlements, oldest position first, up to `limit`.
pub fn pending_settlements(
    store: &dyn tally_projection::ProjectionStore,
    limit: usize,
    serves: impl Fn(&str) -> bool,
) -> Result<Vec<UsageSettlement>, EngineError> {
    collect_prefix(
        store,
        &[keys::SETTLEMENT_PENDING],
        false,
        limit,
        |_, value| {
            codec::decode_settlement(value)
                .map(|settlement| Some(settlement).filter(|s| serves(&s.store_id)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_projection::{MemoryStore, ProjectionStore};

    fn pending(store_id: &str, offset: u64) -> UsageSettlement {
        UsageSettlement {
            store_id: store_id.into(),
            mode: Mode::Test,
            source_partition: 0,
            source_offset: offset,
            units: Vec::new(),
        }
    }

    /// A split cluster's node settles only the stores it serves, and the others'
    /// pending settlements do not use up its batch.
    #[test]
    fn pending_settlements_of_stores_served_elsewhere_are_left_out() {
        let store = MemoryStore::new();
        let rows = (0..6)
            .map(|offset| {
                let owner = if offset < 4 {
                    "st_elsewhere"
                } else {
                    "st_here"
                };
                (
                    pending_key(0, offset),
                    Some(codec::encode_settlement(&pending(owner, offset))),
                )
            })
            .collect();
        store.apply(rows, &[]).unwrap();
        let here = pending_settlements(&store, 2, |s| s == "st_here").unwrap();
        assert_eq!(
            here.iter().map(|s| s.source_offset).collect::<Vec<_>>(),
            [4, 5]
        );
        assert_eq!(pending_settlements(&store, 10, |_| true).unwrap().len(), 6);
    }

    /// A binding of one meter in monthly periods from `anchor`, at 1 credit a unit.
    fn monthly_binding(anchor: i64) -> UsageBinding {
        UsageBinding {
            source_id: "sub_1".into(),
            price_id: "price_1".into(),
            meter_id: "mtr_1".into(),
            unit_price: Decimal::ONE,
            free_allowance: Decimal::ZERO,
            cap: None,
            account_name: "api".into(),
            anchor_ms: anchor,
            period_months: Some(1),
            charge_from_ms: anchor,
            charge_until_ms: None,
        }
    }

    fn units_at(offset: u64, timestamp_ms: i64, quantity: i64) -> UsageSettlement {
        UsageSettlement {
            store_id: "st_1".into(),
            mode: Mode::Test,
            source_partition: 0,
            source_offset: offset,
            units: vec![UsageUnits {
                customer_id: "cus_1".into(),
                meter_id: "mtr_1".into(),
                timestamp_ms,
                quantity: Decimal::from(quantity),
                events: 1,
            }],
        }
    }

    /// A void forgives what its own period lacked, not another period's shortfall:
    /// a first month that ran short does not keep a second month's void from
    /// giving back what the second month paid.
    #[test]
    fn a_void_gives_back_what_its_period_paid_whatever_another_period_lacked() {
        let store = MemoryStore::new();
        let index = tally_core::event_index::EventIndex::default();
        let fetched = tally_core::overlay::Fetched::new();
        let mut overlay = Overlay::new(&store, &index, &fetched);
        let anchor = 1_700_000_000_000; // 2023-11-14
        let day = 86_400_000;
        overlay.put(
            binding_key("st_1", Mode::Test, "cus_1", "mtr_1"),
            codec::encode_bindings(&[monthly_binding(anchor)]),
        );
        // A ledger stand-in: debits take what the balance holds, refunds add.
        let balance = std::cell::Cell::new(Decimal::from(6));
        let given = std::cell::Cell::new(Decimal::ZERO);
        let settle = |overlay: &mut Overlay<'_>, settlement: &UsageSettlement| {
            apply_usage_settled(
                overlay,
                settlement,
                anchor + 60 * day,
                &mut |_, debit| {
                    let taken = debit.amount.min(balance.get());
                    balance.set(balance.get() - taken);
                    Ok(taken)
                },
                &mut |_, refund| {
                    given.set(given.get() + refund.amount);
                    balance.set(balance.get() + refund.amount);
                    Ok(refund.amount)
                },
            )
            .unwrap()
        };
        // First month: 10 billed, 6 debited, 4 short.
        settle(&mut overlay, &units_at(1, anchor + day, 10));
        balance.set(Decimal::from(100));
        // Second month: 5 billed and paid; then 3 of them voided.
        settle(&mut overlay, &units_at(2, anchor + 40 * day, 5));
        settle(&mut overlay, &units_at(3, anchor + 40 * day, -3));
        assert_eq!(given.get(), Decimal::from(3), "the second month paid them");
        // A void in the first month forgives its shortfall first.
        settle(&mut overlay, &units_at(4, anchor + day, -5));
        assert_eq!(given.get(), Decimal::from(4), "4 forgiven, 1 given back");
        let totals = {
            let key = totals_prefix("st_1", Mode::Test, "sub_1")
                .text("price_1")
                .into_bytes();
            codec::decode_settlement_totals(&overlay.get(&key).unwrap().unwrap()).unwrap()
        };
        assert_eq!(
            (
                totals.quantity,
                totals.billed,
                totals.debited,
                totals.shortfall
            ),
            (
                Decimal::from(7),
                Decimal::from(7),
                Decimal::from(7),
                Decimal::ZERO
            )
        );
    }

    /// A period an earlier build settled keeps only its used units; its row still
    /// reads, and a take-back there falls back to the binding's totals.
    #[test]
    fn a_period_row_reads_with_or_without_its_amounts() {
        let full = PeriodSettlement {
            used: Decimal::from(12),
            paid: Some((Decimal::new(65, 1), Decimal::from(4))),
        };
        let bytes = codec::encode_period_settlement(&full);
        assert_eq!(codec::decode_period_settlement(&bytes).unwrap(), full);
        let old = codec::encode_decimal(Decimal::from(12));
        assert_eq!(
            codec::decode_period_settlement(&old).unwrap(),
            PeriodSettlement {
                used: Decimal::from(12),
                paid: None
            }
        );
        assert!(codec::decode_period_settlement(&bytes[..20]).is_err());
    }
}
