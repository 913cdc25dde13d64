//! Meters: create, read, list, update (name and unit label only), archive and
//! unarchive with the meter states of docs/api.md ("Meters"), and backfill.

use tally_domain::limits::{MAX_METERS_PER_EVENT_NAME, MAX_METERS_PER_SCOPE};
use tally_domain::meter::{validate_meter, validate_meter_name, Meter, MeterInput, MeterStatus};
use tally_domain::record::Record;
use tally_domain::FieldError;

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest, StatusFilter};
use tally_core::Scope;

use crate::Metering;

/// An update as the edge parsed it: only `name` and `unit_label` may change.
#[derive(Debug, Clone, Default)]
pub struct MeterUpdate {
    pub name: Option<String>,
    pub unit_label: Option<String>,
    /// Fields present in the body that meters do not let change.
    pub immutable_fields: Vec<String>,
}

/// Fields of a meter that an update may not touch (docs/api.md).
/// How often a running backfill reports its progress in the server's log.
pub const BACKFILL_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

pub const IMMUTABLE_METER_FIELDS: [&str; 4] = [
    "event_name",
    "aggregation",
    "aggregation_property",
    "filter",
];

/// 409 `meter_name_taken`, naming the archived holder when it is archived. Decided
/// by the service before appending and again by the projector in log order.
pub fn meter_name_taken(name: &str, holder: &Meter) -> Outcome {
    let holder_id = &holder.id;
    let archived = holder.status == MeterStatus::Archived;
    Outcome::Rejected {
        code: "meter_name_taken".into(),
        message: if archived {
            format!(
                "the meter name '{name}' is held by the archived meter {holder_id}; unarchive it (POST /v1/meters/{holder_id}/unarchive) or choose another name"
            )
        } else {
            format!("a meter named '{name}' already exists ({holder_id})")
        },
        param: Some("name".into()),
        archived_holder_id: archived.then(|| holder_id.to_string()),
    }
}

/// Refuses a new meter beyond the per-scope and per-event-name limits, given how
/// many meters the scope has and how many of them are on the new meter's event name.
pub fn check_meter_limits(in_scope: usize, on_event_name: usize) -> Result<(), Outcome> {
    if in_scope >= MAX_METERS_PER_SCOPE {
        return Err(Outcome::rejected(
            "meter_limit_reached",
            format!("a store has at most {MAX_METERS_PER_SCOPE} meters per environment (archived ones included)"),
        ));
    }
    if on_event_name >= MAX_METERS_PER_EVENT_NAME {
        return Err(Outcome::rejected(
            "meter_limit_reached",
            format!("at most {MAX_METERS_PER_EVENT_NAME} meters may aggregate one event name"),
        )
        .with_param("event_name"));
    }
    Ok(())
}

/// Stored events one backfill step names at most: bounds the apply work of a step
/// (and the record's size), however many events the store holds.
pub const BACKFILL_CHUNK_EVENTS: usize = 2_000;
/// Stored events one scan pass looks at before handing back (bounds the blocking
/// work between steps).
pub const BACKFILL_SCAN_EVENTS: usize = 50_000;
/// The finishing step re-sweeps events received since the scan began, minus this
/// margin: covers the time between an event's receipt and its append.
pub const BACKFILL_RESCAN_MARGIN_MS: i64 = 60_000;

impl Metering {
    /// One pass of a backfill scan over the scope's stored events (in receipt order),
    /// after the row `after`: ids of events the meter skipped (matched, timestamp in
    /// `[start_ms, counts_from)`), whole rows until at least `BACKFILL_CHUNK_EVENTS`
    /// ids or `BACKFILL_SCAN_EVENTS` events, and the last row read (`None`: the end
    /// was reached).
    async fn backfill_candidates(
        &self,
        scope: &Scope,
        meter: &Meter,
        start_ms: i64,
        after: Option<Vec<u8>>,
    ) -> Result<(Vec<String>, Option<Vec<u8>>), EngineError> {
        let (mut lower, upper) = crate::events::scope_rows(scope);
        if let Some(after) = after {
            lower = std::ops::Bound::Excluded(after);
        }
        let (mut ids, mut scanned, mut last, mut more) = (Vec::new(), 0usize, None, false);
        self.scan_stored_events(scope, lower, upper, false, |row, events| {
            for (_, event) in events {
                scanned += 1;
                let view = tally_domain::meter::EventView {
                    name: &event.name,
                    timestamp_ms: event.timestamp_ms,
                    properties: &event.properties,
                };
                if event.timestamp_ms >= start_ms
                    && event.timestamp_ms < meter.counts_from_ms
                    && meter.matches(&view)
                {
                    ids.push(event.event_id.clone());
                }
            }
            last = Some(row.encode());
            if ids.len() >= BACKFILL_CHUNK_EVENTS || scanned >= BACKFILL_SCAN_EVENTS {
                more = true;
                tally_projection::Visit::Stop
            } else {
                tally_projection::Visit::Continue
            }
        })
        .await?;
        Ok((ids, if more { last } else { None }))
    }
}

impl Metering {
    pub fn get_meter(&self, scope: &Scope, id: &str) -> Result<Meter, EngineError> {
        let key = keys::meter_key(&scope.store_id, scope.mode, id);
        match self.journal.store().get(&key)? {
            Some(bytes) => codec::decode_meter(&bytes),
            None => Err(EngineError::not_found("meter", id)),
        }
    }

    fn meter_id_by_name(&self, scope: &Scope, name: &str) -> Result<Option<String>, EngineError> {
        let key = Key::scoped(keys::METER_NAME, &scope.store_id, scope.mode).text(name);
        Ok(self
            .journal
            .store()
            .get(key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// 409 `meter_name_taken`, with the archived holder when it is archived.
    fn check_name_free(
        &self,
        scope: &Scope,
        name: &str,
        except_id: Option<&str>,
    ) -> Result<(), EngineError> {
        let Some(holder_id) = self.meter_id_by_name(scope, name)? else {
            return Ok(());
        };
        if Some(holder_id.as_str()) == except_id {
            return Ok(());
        }
        let holder = self.get_meter(scope, &holder_id)?;
        Err(meter_name_taken(name, &holder).into())
    }

    pub async fn create_meter(
        &self,
        scope: &Scope,
        input: &MeterInput,
    ) -> Result<Meter, EngineError> {
        let definition = validate_meter(input)?;
        // Fast answers from the projection; apply decides again in log order.
        self.check_name_free(scope, &definition.name, None)?;
        if let Some(meters) = self.caches.meters.get(scope) {
            let on_event_name = meters
                .iter()
                .filter(|m| m.event_name == definition.event_name)
                .count();
            check_meter_limits(meters.len(), on_event_name)?;
        }
        let now = self.journal.now_ms();
        let meter = Meter {
            id: new_id("mtr").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            name: definition.name,
            event_name: definition.event_name,
            aggregation: definition.aggregation,
            aggregation_property: definition.aggregation_property,
            filter: definition.filter,
            unit_label: definition.unit_label,
            status: MeterStatus::Active,
            created_at_ms: now,
            updated_at_ms: now,
            counts_from_ms: now,
            revision: 1,
        };
        self.journal
            .append_and_apply(&Record::MeterUpserted(meter.clone()))
            .await?;
        Ok(meter)
    }

    pub async fn update_meter(
        &self,
        scope: &Scope,
        id: &str,
        update: &MeterUpdate,
    ) -> Result<Meter, EngineError> {
        if let Some(field) = update.immutable_fields.first() {
            return Err(FieldError::new(
                "meter_field_immutable",
                field.clone(),
                format!("`{field}` cannot change by an update; only `name` and `unit_label` can (a filter or aggregation property changes by POST /v1/meters/{{id}}/revisions)"),
            )
            .into());
        }
        let name = update
            .name
            .as_deref()
            .map(|n| validate_meter_name(Some(n), "name"))
            .transpose()?;
        let unit_label = update
            .unit_label
            .as_deref()
            .map(|u| validate_meter_name(Some(u), "unit_label"))
            .transpose()?;
        self.journal
            .update(|| {
                let mut meter = self.get_meter(scope, id)?;
                if let Some(name) = &name {
                    if *name != meter.name {
                        self.check_name_free(scope, name, Some(id))?;
                    }
                    meter.name.clone_from(name);
                }
                if let Some(unit_label) = &unit_label {
                    meter.unit_label.clone_from(unit_label);
                }
                let base = self.journal.restamp(&mut meter.updated_at_ms);
                Ok(Update::Write {
                    record: Record::MeterUpserted(meter.clone()),
                    base_updated_at_ms: base,
                    result: meter,
                })
            })
            .await
    }

    pub async fn archive_meter(&self, scope: &Scope, id: &str) -> Result<Meter, EngineError> {
        self.set_meter_status(scope, id, MeterStatus::Archived)
            .await
    }

    pub async fn unarchive_meter(&self, scope: &Scope, id: &str) -> Result<Meter, EngineError> {
        self.set_meter_status(scope, id, MeterStatus::Active).await
    }

    async fn set_meter_status(
        &self,
        scope: &Scope,
        id: &str,
        status: MeterStatus,
    ) -> Result<Meter, EngineError> {
        self.journal
            .update(|| {
                let mut meter = self.get_meter(scope, id)?;
                if meter.status == status {
                    // Archive of an archived meter and unarchive of an active one are
                    // idempotent.
                    return Ok(Update::Unchanged(meter));
                }
                if status == MeterStatus::Archived
                    && self.pricing.meter_priced_on_active_product(scope, id)?
                {
                    return Err(meter_in_use().into());
                }
                meter.status = status;
                let base = self.journal.restamp(&mut meter.updated_at_ms);
                Ok(Update::Write {
                    record: Record::MeterUpserted(meter.clone()),
                    base_updated_at_ms: base,
                    result: meter,
                })
            })
            .await
    }

    /// Opts the meter in to stored events from `start_ms` (docs/api.md). A start at
    /// or after the current counting start changes nothing.
    pub async fn backfill_meter(
        &self,
        scope: &Scope,
        id: &str,
        start_ms: i64,
    ) -> Result<Meter, EngineError> {
        let oldest = self.journal.now_ms() - tally_domain::limits::MAX_EVENT_AGE_MS;
        if start_ms < oldest {
            return Err(FieldError::invalid(
                "start",
                format!(
                    "`start` may be at most {} days in the past (older events cannot exist)",
                    tally_domain::limits::MAX_EVENT_AGE_MS / tally_domain::time::DAY_MS
                ),
            )
            .into());
        }
        let meter = self.get_meter(scope, id)?;
        if start_ms >= meter.counts_from_ms {
            return Ok(meter);
        }
        // The scan runs off the apply path, in chunks of bounded records; the
        // projector only folds the ids each step names.
        let rescan_from_ms = self.journal.now_ms() - BACKFILL_RESCAN_MARGIN_MS;
        self.journal.wait_caught_up().await?;
        let step = |event_ids: Vec<String>, finish: bool| Record::MeterBackfill {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            meter_id: id.into(),
            start_ms,
            event_ids,
            finish,
            rescan_from_ms,
        };
        let mut after: Option<Vec<u8>> = None;
        // Progress in the server's log: a line per step is too many for a long
        // backfill, one every `BACKFILL_PROGRESS_EVERY` shows it moves.
        let (mut counted, mut steps, mut reported) = (0usize, 0usize, std::time::Instant::now());
        tracing::info!(meter_id = id, start_ms, "backfill started");
        loop {
            let (ids, next) = self
                .backfill_candidates(scope, &meter, start_ms, after.take())
                .await?;
            if !ids.is_empty() {
                counted += ids.len();
                steps += 1;
                self.journal.append_and_apply(&step(ids, false)).await?;
            }
            if reported.elapsed() >= BACKFILL_PROGRESS_EVERY {
                reported = std::time::Instant::now();
                tracing::info!(
                    meter_id = id,
                    steps,
                    events = counted,
                    "backfill in progress"
                );
            }
            match next {
                Some(key) => after = Some(key),
                None => break,
            }
        }
        self.journal
            .append_and_apply(&step(Vec::new(), true))
            .await?;
        tracing::info!(meter_id = id, steps, events = counted, "backfill finished");
        self.get_meter(scope, id)
    }

    pub fn list_meters(
        &self,
        scope: &Scope,
        status: StatusFilter,
        page: &PageRequest,
    ) -> Result<Page<Meter>, EngineError> {
        let prefix = ListingKey::prefix(keys::METER_LIST, &scope.store_id, scope.mode, None);
        let cursor = cursor_from(page, |id| {
            let meter = self.get_meter(scope, id)?;
            Ok(ListingKey::entry(
                keys::METER_LIST,
                &scope.store_id,
                scope.mode,
                None,
                meter.created_at_ms,
                &meter.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let meter = self.get_meter(scope, id)?;
                Ok(status
                    .keeps(meter.status == MeterStatus::Active)
                    .then_some(meter))
            },
        )
    }
}

/// 409 `meter_in_use` (docs/api.md, "Meters"): decided by the service through the `Pricing`
/// port and again by apply in log order.
pub fn meter_in_use() -> tally_core::outcome::Outcome {
    tally_core::outcome::Outcome::rejected(
        "meter_in_use",
        "the meter is priced on a product that is still being sold; remove the usage charge or archive the product first",
    )
}
