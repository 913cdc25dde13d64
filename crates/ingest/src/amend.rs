//! Amending a stored usage event (docs/api.md, "Amending an event"): the gateway
//! builds the replacement as ingest builds an event (validated, meters matched now,
//! received now), reserves its id in flight as ingest does, and appends one
//! `EventAmended` record holding the void and the replacement; apply decides it
//! whole, in log order (`tally_metering::voids::apply_amend`).

use tally_core::ids::new_id;
use tally_core::overlay::inflight_key;
use tally_core::{EngineError, Scope};
use tally_domain::record::Record;
use tally_domain::usage::{amended_event, EventChanges, UsageEvent};
use tally_domain::FieldError;
use tally_metering::voids::{amended_not_found, check_reason, event_id_taken, event_voided};

use crate::{fingerprint, Gateway, Reservations};

impl Gateway {
    /// `POST /v1/events/{event_id}/amend`: voids the stored event and stores its
    /// replacement, both or neither; returns the replacement as stored.
    pub async fn amend_event(
        &self,
        scope: &Scope,
        event_id: &str,
        changes: &EventChanges,
        reason: &str,
    ) -> Result<UsageEvent, EngineError> {
        check_reason(reason)?;
        self.journal.wait_for_projector_headroom().await?;
        let Some((_, _, original)) = self
            .metering
            .find_stored_event_applied(scope, event_id)
            .await?
        else {
            return Err(amended_not_found(event_id).into());
        };
        if self.metering.event_void(scope, event_id)?.is_some() {
            return Err(event_voided(event_id).into());
        }
        let validated = amended_event(&original, changes, self.journal.now_in(scope))?;
        let assigned = validated.event_id.is_none();
        let replacement_id = validated.event_id.clone().unwrap_or_else(|| new_id("evt"));
        let mut reservations = Reservations::new(&self.metering.caches().inflight_events);
        if !assigned {
            let key = inflight_key(&scope.store_id, scope.mode, &replacement_id);
            let print = fingerprint(&validated, &original.customer_id);
            if reservations.reserve(&key, print).is_some()
                || self
                    .metering
                    .find_stored_event(scope, &replacement_id)
                    .await?
                    .is_some()
            {
                return Err(event_id_taken(&replacement_id).into());
            }
        }
        // Read before the meters, as ingest does (ARCHITECTURE.md, "Meters the
        // gateway did not know").
        let matched_below = self.journal.applied_for_store(&scope.store_id);
        let meters = self
            .metering
            .caches()
            .meters
            .get(scope)
            .map(|m| m.clone())
            .unwrap_or_default();
        let matched_meter_ids = Self::matching_meters(&meters, &validated)
            .into_iter()
            .map(|meter| meter.id.clone())
            .collect();
        let replacement = UsageEvent {
            event_id: replacement_id,
            name: validated.name,
            customer_id: original.customer_id.clone(),
            external_customer_id: original.external_customer_id.clone(),
            timestamp_ms: validated.timestamp_ms,
            properties: validated.properties,
            received_at_ms: self.journal.now_ms(),
            matched_meter_ids,
            event_id_assigned: assigned,
        };
        let record = Record::EventAmended {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            event_id: event_id.to_string(),
            reason: reason.to_string(),
            replacement: replacement.clone(),
            matched_below: Some(matched_below),
        };
        let position = self.journal.append(&record).await?;
        // Durable: the projector releases the reservation when it applies the record.
        reservations.hand_over();
        self.journal.decision(&record, position).await?;
        Ok(replacement)
    }
}

/// The customer fields an amendment refuses: the replacement keeps the customer.
pub fn refuse_customer_change(field: &str) -> FieldError {
    FieldError::invalid(
        format!("event.{field}"),
        "an amendment keeps the event's customer; to move usage to another customer, void the event and ingest a new one",
    )
}
