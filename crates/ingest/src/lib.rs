//! The ingest gateway: validates batches, resolves customers, matches meters and
//! deduplicates event ids, then appends the accepted events to the log.
//!
//! Ingest and preview run the same [`Gateway::evaluate_batch`]; preview stops before
//! reserving or writing anything.
//!
//! Dedup is exact: an event id is a duplicate when it is stored (the event index,
//! confirmed by reading the original from the log), in flight (appended, not yet
//! applied: metering's `inflight_events`), or earlier in the same batch. Ingest
//! reserves an id in the in-flight map before it looks the id up, so two concurrent
//! requests carrying the same id cannot both be accepted, and an id the projector
//! stores meanwhile is in the index before its reservation goes. The projector
//! deduplicates once more in log order, so a replay, or two nodes racing on Kafka,
//! still keep exactly the first event.
//!
//! The gateway owns no state of its own: it reads metering (meters, the event index,
//! stored events) and asks the directory for customers and billing whether usage is
//! settled in credits through its own ports, [`Customers`] and [`Settlements`].

pub mod amend;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use dashmap::mapref::entry::Entry;
use tally_core::ids::new_id;
use tally_core::overlay::{inflight_key, FastDashMap};
use tally_core::{EngineError, Journal, Scope};
use tally_domain::ids::MeterId;
use tally_domain::meter::{Aggregation, EventView, Meter, MeterStatus};
use tally_domain::record::Record;
use tally_domain::usage::{validate_event, CustomerRef, RawUsageEvent, UsageEvent, ValidatedEvent};
use tally_domain::FieldError;
use tally_metering::Metering;

/// How long a batch naming a customer this node does not know waits for the node
/// to apply what the log holds before it is refused: on a log shared between nodes,
/// a customer created through another node is durable before its creator answers,
/// yet this node may not have applied it. A few times the usual apply lag, and well
/// within a client's timeout (as the HTTP layer's wait before a 404).
pub const CATCH_UP_BEFORE_UNKNOWN_CUSTOMER_MS: u64 = 5_000;

/// What the gateway asks of the directory: it owns this port, the composition root
/// implements it.
pub trait Customers: Send + Sync {
    /// The id of the customer a reference names (an id or an external id), if the
    /// scope has one.
    fn resolve_customer(
        &self,
        scope: &Scope,
        customer: &CustomerRef,
    ) -> Result<Option<String>, EngineError>;
}

/// What the gateway asks of billing: whether a purchase settles any of these
/// events in credits (binds its customer's usage of a meter it matched). The answer
/// travels in the usage record (`settles`), so apply and every replay settle the
/// same events (docs/api.md, "Usage prices").
pub trait Settlements: Send + Sync {
    fn settles(&self, scope: &Scope, events: &[UsageEvent]) -> Result<bool, EngineError>;

    /// Whether any meter of the scope is priced on a product being sold (asked first,
    /// once per batch: most stores' ingest then asks nothing more).
    fn any_priced(&self, scope: &Scope) -> Result<bool, EngineError>;

    /// Whether the meter is priced on a product being sold.
    fn priced(&self, scope: &Scope, meter_id: &str) -> Result<bool, EngineError>;

    /// Whether a purchase of the customer bills their usage of the (priced) meter;
    /// if not, ingest warns `customer_has_no_active_subscription`.
    fn billed(&self, scope: &Scope, customer_id: &str, meter_id: &str)
        -> Result<bool, EngineError>;
}

pub struct Gateway {
    journal: Arc<Journal>,
    metering: Arc<Metering>,
    customers: Arc<dyn Customers>,
    settlements: Arc<dyn Settlements>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub code: &'static str,
    pub message: String,
}

/// What ingest or preview says about one event.
#[derive(Debug, Clone)]
pub struct EventReport {
    pub valid: bool,
    /// For an invalid event; `param` is the full path (`events[3].timestamp`).
    pub error: Option<FieldError>,
    pub event_id: Option<String>,
    pub customer_id: Option<String>,
    pub duplicate: bool,
    pub matched_meters: Vec<String>,
    pub warnings: Vec<Warning>,
}

#[derive(Debug, Clone)]
pub struct IngestOutcome {
    pub accepted: usize,
    pub duplicates: usize,
    pub events: Vec<EventReport>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evaluation {
    Preview,
    Ingest,
}

struct Evaluated<'a> {
    reports: Vec<EventReport>,
    accepted: Vec<UsageEvent>,
    reservations: Reservations<'a>,
    /// The events were matched knowing every record of the store's partition below
    /// this offset (`Record::UsageBatch::matched_below`).
    matched_below: u64,
}

/// An event that passed validation and customer resolution, before dedup.
struct Candidate {
    event: ValidatedEvent,
    customer_id: String,
    event_id: String,
    /// The service assigned the id (such events are never duplicates).
    assigned: bool,
    /// The meters it matched (shared ids: no copy of their text per event).
    matched_meter_ids: Vec<MeterId>,
}

/// The in-flight reservations one ingest request made. Dropping it releases them
/// (an error, a failed append, a client that went away mid-request), so an id is
/// never left reserved with nothing appended; once the batch is appended,
/// `hand_over` leaves them to the projector, which releases them when it applies the
/// record.
struct Reservations<'a> {
    inflight: &'a FastDashMap<String, u64>,
    keys: Vec<String>,
}

impl<'a> Reservations<'a> {
    fn new(inflight: &'a FastDashMap<String, u64>) -> Self {
        Reservations {
            inflight,
            keys: Vec::new(),
        }
    }

    /// Reserves `key` unless it is in flight already; returns the fingerprint of the
    /// reservation holding it, if another does.
    fn reserve(&mut self, key: &str, print: u64) -> Option<u64> {
        match self.inflight.entry(key.to_string()) {
            Entry::Occupied(inflight) => Some(*inflight.get()),
            Entry::Vacant(slot) => {
                slot.insert(print);
                self.keys.push(key.to_string());
                None
            }
        }
    }

    fn release(&mut self, key: &str) {
        self.inflight.remove(key);
        self.keys.retain(|k| k != key);
    }

    fn hand_over(mut self) {
        self.keys.clear();
    }
}

impl Drop for Reservations<'_> {
    fn drop(&mut self) {
        for key in &self.keys {
            self.inflight.remove(key);
        }
    }
}

/// The seed of `fingerprint` (any constant: prints live only in this process).
const FINGERPRINT_SEED: u64 = 0x7a11_7a11_7a11_7a11;

/// A hash of what the sender sent (for "payload differs" between requests in
/// flight): the timestamp counts only when given (see `UsageEvent::same_payload`).
fn fingerprint(event: &ValidatedEvent, customer_id: &str) -> u64 {
    // A fixed seed: prints made by different requests are compared. Not SipHash: it
    // ran for every ingested event (~2% of intake's CPU under the ingest benchmark),
    // and a crafted collision could only hide a warning on its sender's own retry.
    let mut hasher = foldhash::fast::FixedState::with_seed(FINGERPRINT_SEED).build_hasher();
    event.name.hash(&mut hasher);
    customer_id.hash(&mut hasher);
    event
        .timestamp_given
        .then_some(event.timestamp_ms)
        .hash(&mut hasher);
    event.properties.hash(&mut hasher);
    hasher.finish()
}

fn duplicate_warnings(report: &mut EventReport, payload_differs: bool) {
    report.duplicate = true;
    report.warnings.push(Warning {
        code: "duplicate_event_id",
        message: "an event with this event_id was already ingested; this one is ignored".into(),
    });
    if payload_differs {
        report.warnings.push(Warning {
            code: "duplicate_payload_differs",
            message: "the ignored duplicate's payload differs from the event that was kept".into(),
        });
    }
}

impl Gateway {
    pub fn new(
        journal: Arc<Journal>,
        metering: Arc<Metering>,
        customers: Arc<dyn Customers>,
        settlements: Arc<dyn Settlements>,
    ) -> Gateway {
        Gateway {
            journal,
            metering,
            customers,
            settlements,
        }
    }

    /// The active meters of the scope that consume this event now.
    fn matching_meters<'m>(meters: &'m [Meter], event: &ValidatedEvent) -> Vec<&'m Meter> {
        let view = EventView {
            name: &event.name,
            timestamp_ms: event.timestamp_ms,
            properties: &event.properties,
        };
        meters
            .iter()
            .filter(|m| {
                m.status == MeterStatus::Active
                    && event.timestamp_ms >= m.counts_from_ms
                    && m.matches(&view)
            })
            .collect()
    }

    /// Why an event matched no meter: when an active meter would consume it but
    /// for its counting start (`counts_from`, docs/api.md), the message says so,
    /// since the event's timestamp, not its properties, is what a producer must fix.
    fn no_match_message(meters: &[Meter], event: &ValidatedEvent) -> String {
        let view = EventView {
            name: &event.name,
            timestamp_ms: event.timestamp_ms,
            properties: &event.properties,
        };
        let too_early = meters.iter().find(|m| {
            m.status == MeterStatus::Active
                && event.timestamp_ms < m.counts_from_ms
                && m.matches(&view)
        });
        match too_early {
            Some(meter) => format!(
                "the event's timestamp is before meter '{}' counts events (its counts_from, {}); \
                 a backfill opts in to earlier events",
                meter.id,
                tally_domain::time::format_iso8601_ms(meter.counts_from_ms)
            ),
            None => format!(
                "no active meter consumes events named '{}' with these properties",
                event.name
            ),
        }
    }

    async fn evaluate_batch(
        &self,
        scope: &Scope,
        raws: Vec<Result<RawUsageEvent, FieldError>>,
        evaluation: Evaluation,
    ) -> Result<Evaluated<'_>, EngineError> {
        let now = self.journal.now_ms();
        // Event time (the default timestamp, the accepted window) is the scope's
        // business time: a test store's test clock (docs/api.md, "Test clock").
        // Receipt time stays the node's clock.
        let business_now = self.journal.now_in(scope);
        // Read before the meters: every meter of a record below this watermark is in
        // the cache (caches are updated before the watermark moves), so apply need
        // decide only the meters changed from here on (ARCHITECTURE.md, "Meters the
        // gateway did not know").
        let matched_below = self.journal.applied_for_store(&scope.store_id);
        let meters = self
            .metering
            .caches()
            .meters
            .get(scope)
            .map(|m| m.clone())
            .unwrap_or_default();
        let invalid = |index: usize, e: FieldError| {
            let param = if e.param.is_empty() {
                format!("events[{index}]")
            } else {
                format!("events[{index}].{}", e.param)
            };
            FieldError::new("invalid_usage_event", param, e.message)
        };
        // Phase 1: validate, resolve and match every event; nothing is reserved yet.
        // Whether a meter is priced, and a (customer, meter) billed: asked once per
        // batch (the warning `customer_has_no_active_subscription`).
        let mut any_priced: Option<bool> = None;
        let mut priced_cache: HashMap<String, bool> = HashMap::new();
        let mut billed_cache: HashMap<(String, String), bool> = HashMap::new();
        let mut reports = Vec::with_capacity(raws.len());
        let mut candidates: Vec<Option<Candidate>> = Vec::with_capacity(raws.len());
        let mut caught_up = false;
        for (index, raw) in raws.into_iter().enumerate() {
            let mut report = EventReport {
                valid: false,
                error: None,
                event_id: None,
                customer_id: None,
                duplicate: false,
                matched_meters: Vec::new(),
                warnings: Vec::new(),
            };
            let validated = raw.and_then(|raw| validate_event(raw, business_now));
            let mut validated = match validated {
                Ok(v) => v,
                Err(e) => {
                    report.error = Some(invalid(index, e));
                    reports.push(report);
                    candidates.push(None);
                    continue;
                }
            };
            let mut resolved = self
                .customers
                .resolve_customer(scope, &validated.customer)?;
            if resolved.is_none() && !caught_up && self.journal.log().shared_between_nodes() {
                // Once per batch: the node catches up with the log and looks again.
                caught_up = true;
                let limit = std::time::Duration::from_millis(CATCH_UP_BEFORE_UNKNOWN_CUSTOMER_MS);
                self.journal.caught_up_within(limit).await;
                resolved = self
                    .customers
                    .resolve_customer(scope, &validated.customer)?;
            }
            let Some(customer_id) = resolved else {
                let (param, what) = match &validated.customer {
                    CustomerRef::Id(id) => ("customer_id", format!("no customer with id '{id}'")),
                    CustomerRef::External(e) => (
                        "external_customer_id",
                        format!("no customer with external_id '{e}'"),
                    ),
                };
                report.error = Some(invalid(
                    index,
                    FieldError::new("invalid_usage_event", param, what),
                ));
                reports.push(report);
                candidates.push(None);
                continue;
            };
            // The candidate carries the id from here on (the validated event's copy
            // is not read again).
            let assigned = validated.event_id.is_none();
            let event_id = validated.event_id.take().unwrap_or_else(|| new_id("evt"));
            let matched = Self::matching_meters(&meters, &validated);
            if matched.is_empty() {
                report.warnings.push(Warning {
                    code: "no_matching_meter",
                    message: Self::no_match_message(&meters, &validated),
                });
            }
            let mut unbilled = false;
            let any_priced = match any_priced {
                Some(any) => any,
                None => {
                    let any = self.settlements.any_priced(scope)?;
                    any_priced = Some(any);
                    any
                }
            };
            for meter in matched.iter().filter(|_| any_priced) {
                // Whether a meter is priced is asked once per batch; only for a priced
                // one, whether this customer's usage of it is billed.
                let priced = match priced_cache.get(meter.id.as_str()) {
                    Some(priced) => *priced,
                    None => {
                        let priced = self.settlements.priced(scope, &meter.id)?;
                        priced_cache.insert(meter.id.to_string(), priced);
                        priced
                    }
                };
                if !priced {
                    continue;
                }
                let key = (customer_id.clone(), meter.id.to_string());
                let billed = match billed_cache.get(&key) {
                    Some(billed) => *billed,
                    None => {
                        let billed = self.settlements.billed(scope, &customer_id, &meter.id)?;
                        billed_cache.insert(key, billed);
                        billed
                    }
                };
                unbilled |= !billed;
            }
            if unbilled {
                report.warnings.push(Warning {
                    code: "customer_has_no_active_subscription",
                    message: format!(
                        "customer {customer_id} has no active subscription or purchase billing a priced meter this event matched; the usage is recorded, not billed"
                    ),
                });
            }
            for meter in &matched {
                let Some(property) = &meter.aggregation_property else {
                    continue;
                };
                // A unique meter counts any value; the numeric ones need a number.
                let why = match validated.properties.get(property) {
                    None => Some("this event lacks it"),
                    Some(v)
                        if meter.aggregation != Aggregation::Unique && v.as_number().is_none() =>
                    {
                        Some("this event's value of it is not a number")
                    }
                    Some(_) => None,
                };
                if let Some(why) = why {
                    report.warnings.push(Warning {
                        code: "aggregation_property_missing",
                        message: format!(
                            "meter {} aggregates property '{property}' and {why}; the meter skips this event",
                            meter.id
                        ),
                    });
                }
            }
            report.valid = true;
            report.event_id = Some(event_id.clone());
            report.customer_id = Some(customer_id.clone());
            report.matched_meters = matched.iter().map(|m| m.id.as_str().to_owned()).collect();
            reports.push(report);
            candidates.push(Some(Candidate {
                event: validated,
                customer_id,
                event_id,
                assigned,
                matched_meter_ids: matched.iter().map(|m| m.id.clone()).collect(),
            }));
        }
        if evaluation == Evaluation::Ingest {
            if let Some(error) = reports.iter().find_map(|r| r.error.clone()) {
                return Err(error.into());
            }
        }
        // Phase 2: dedup (and, for ingest, reserve) in batch order: the first wins.
        // On an error the reservations are dropped, which releases them.
        let mut reservations = Reservations::new(&self.metering.caches().inflight_events);
        let accepted = self
            .dedup_batch(
                scope,
                &mut reports,
                candidates,
                evaluation,
                now,
                &mut reservations,
            )
            .await?;
        Ok(Evaluated {
            reports,
            accepted,
            reservations,
            matched_below,
        })
    }

    async fn dedup_batch(
        &self,
        scope: &Scope,
        reports: &mut [EventReport],
        candidates: Vec<Option<Candidate>>,
        evaluation: Evaluation,
        now: i64,
        reservations: &mut Reservations<'_>,
    ) -> Result<Vec<UsageEvent>, EngineError> {
        let mut accepted = Vec::new();
        let mut in_batch: HashMap<String, u64> = HashMap::new();
        for (report, candidate) in reports.iter_mut().zip(candidates) {
            let Some(Candidate {
                event: validated,
                customer_id,
                event_id,
                assigned,
                matched_meter_ids,
            }) = candidate
            else {
                continue;
            };
            let print = fingerprint(&validated, &customer_id);
            if !assigned {
                if let Some(earlier) = in_batch.get(&event_id) {
                    duplicate_warnings(report, *earlier != print);
                    continue;
                }
                in_batch.insert(event_id.clone(), print);
                let key = inflight_key(&scope.store_id, scope.mode, &event_id);
                // In flight elsewhere? For ingest, reserve first (no lock is held across
                // the log read below): an id the projector stores meanwhile is in the
                // index before its reservation is released, so the lookup sees it.
                let inflight = match evaluation {
                    Evaluation::Preview => {
                        self.metering.caches().inflight_events.get(&key).map(|p| *p)
                    }
                    Evaluation::Ingest => reservations.reserve(&key, print),
                };
                let duplicate_of = match inflight {
                    Some(inflight) => Some(inflight != print),
                    None => self
                        .metering
                        .find_stored_event(scope, &event_id)
                        .await?
                        .map(|(_, _, stored)| !stored.same_payload(&validated, &customer_id)),
                };
                if let Some(differs) = duplicate_of {
                    if inflight.is_none() && evaluation == Evaluation::Ingest {
                        reservations.release(&key);
                    }
                    duplicate_warnings(report, differs);
                    continue;
                }
            }
            accepted.push(UsageEvent {
                event_id,
                name: validated.name,
                customer_id: customer_id.into(),
                external_customer_id: match validated.customer {
                    CustomerRef::External(e) => Some(e),
                    CustomerRef::Id(_) => None,
                },
                timestamp_ms: validated.timestamp_ms,
                properties: validated.properties,
                received_at_ms: now,
                matched_meter_ids,
                event_id_assigned: assigned,
            });
        }
        Ok(accepted)
    }

    /// `POST /v1/events/preview`: the ingest evaluation, writing nothing.
    pub async fn preview_events(
        &self,
        scope: &Scope,
        raws: Vec<Result<RawUsageEvent, FieldError>>,
    ) -> Result<Vec<EventReport>, EngineError> {
        Ok(self
            .evaluate_batch(scope, raws, Evaluation::Preview)
            .await?
            .reports)
    }

    /// `POST /v1/events/ingest`: all or nothing; returns once the batch is durable.
    pub async fn ingest_events(
        &self,
        scope: &Scope,
        raws: Vec<Result<RawUsageEvent, FieldError>>,
    ) -> Result<IngestOutcome, EngineError> {
        self.journal.wait_for_projector_headroom().await?;
        let evaluated = self.evaluate_batch(scope, raws, Evaluation::Ingest).await?;
        let accepted = evaluated.accepted.len();
        let duplicates = evaluated.reports.iter().filter(|r| r.duplicate).count();
        if accepted > 0 {
            // One record for the whole batch: a store's records share one partition
            // (`Record::partition_key`), so splitting the batch would only append
            // several records one after another, and a failure between them would
            // leave part of the batch durable behind an error answer.
            let events = evaluated.accepted;
            let settles = self.settlements.settles(scope, &events)?;
            let record = Record::UsageBatch {
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                events,
                settles,
                matched_below: Some(evaluated.matched_below),
            };
            // On an error, returning drops the reservations: nothing durable holds
            // the ids, so a retry is accepted (and if the outcome was in fact written,
            // apply keeps the first in log order).
            self.journal.append_handing_off(record).await?;
        }
        evaluated.reservations.hand_over();
        self.journal
            .metrics
            .events(accepted as u64, duplicates as u64);
        Ok(IngestOutcome {
            accepted,
            duplicates,
            events: evaluated.reports,
        })
    }
}
