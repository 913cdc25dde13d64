//! The webhook dispatcher: POSTs due deliveries, signed, to the endpoints that may be
//! reached, and records every attempt in the log through the notifications context
//! (so restarts resume the schedule and replays never re-deliver). Event bodies come
//! through the [`EventBodies`] port: the HTTP edge renders them with the API's wire
//! types, so the cli feed and every attempt carry the same bytes.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tally_core::{EngineError, Scope};
use tally_domain::ids::EndpointId;
use tally_domain::record::WebhookAttempt;
use tally_domain::webhook::{
    endpoint_target, may_reach, next_attempt_at, signature_header, DeliveryMode, WebhookEndpoint,
};
use tally_domain::Mode;
use tokio::sync::Semaphore;

use crate::webhooks::Delivery;
use crate::Notifications;

/// Only HTTP 200 succeeds; anything slower than this is a failed attempt.
pub const DELIVERY_TIMEOUT_MS: u64 = 10_000;
/// How often the dispatcher looks for due deliveries.
pub const DISPATCH_POLL_MS: u64 = 100;
/// Due deliveries taken per poll (bounds one scan's work and memory); a poll that
/// takes this many is followed by another at once (`run`).
pub const DISPATCH_BATCH: usize = 256;
/// Concurrent deliveries to one endpoint: a slow endpoint holds at most these.
pub const MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT: usize = 4;
/// Deliveries of one endpoint taken from the due index and not yet finished (in
/// flight, or waiting for one of its `MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT` slots,
/// oldest first). A poll takes up to this many of one endpoint, so an endpoint that
/// answers quickly receives up to this many per poll interval (2,560 a second), not
/// only its concurrent slots' worth: with the slots as the only allowance, one
/// endpoint received ~40 deliveries a second however fast it answered, and a store
/// making more events than that fell behind without end (docs/benchmarks.md,
/// "Webhook deliveries per endpoint"). An endpoint at this many is passed over by
/// the next poll, so a black-holed one holds this many waiting tasks (a few hundred
/// bytes each) and never a slot of another endpoint. As large as a poll's batch: a
/// poll that finds one endpoint's backlog fills its batch and stops its scan there.
pub const MAX_TAKEN_DELIVERIES_PER_ENDPOINT: usize = DISPATCH_BATCH;
const _: () = assert!(MAX_TAKEN_DELIVERIES_PER_ENDPOINT >= MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT);
/// Concurrent deliveries in all.
pub const MAX_CONCURRENT_DELIVERIES: usize = 64;
/// An endpoint whose deliveries taken fall to this many wakes the dispatcher for a
/// poll at once, not at the next `DISPATCH_POLL_MS`: with polls only on the timer,
/// an endpoint that answers at once received at most
/// `MAX_TAKEN_DELIVERIES_PER_ENDPOINT` per interval (2,560 a second) and fell
/// behind a faster stream of events (docs/benchmarks.md, "Due deliveries found a
/// window at a time"). Half: one poll then refills half the endpoint's room.
pub const REFILL_TAKEN_AT: usize = MAX_TAKEN_DELIVERIES_PER_ENDPOINT / 2;
/// How often a poll looks at the due index from its oldest entry. The polls
/// between start where the last one met its first entry: a delivered entry stays in
/// the write-back layer as a deletion until its checkpoint, and under a burst every
/// poll from the oldest walked tens of thousands of them (docs/benchmarks.md, "Due
/// deliveries found a window at a time"). New deliveries fall due at their store's
/// time, so only a store's clock behind the others' (or the wall clock stepped
/// back) schedules one before that start, and it waits at most this long.
pub const FULL_DUE_SCAN_EVERY_MS: u64 = 1_000;

/// What the dispatcher asks of the edge that renders the API: it owns this port.
pub trait EventBodies: Send + Sync {
    /// The exact JSON body of a delivery's event (the envelope of docs/api.md, "Webhooks").
    fn body(&self, scope: &Scope, delivery: &Delivery) -> Result<String, EngineError>;
}

/// Which stores' webhooks this node delivers. The dispatcher owns this port; the
/// composition root answers: every store on a lone node, and on a cluster the stores
/// whose records go to the partitions this node owns, so each delivery has one
/// dispatching node, and another takes over when that one leaves.
pub trait DispatchScope: Send + Sync + std::fmt::Debug {
    fn dispatches(&self, store_id: &str) -> bool;
}

/// A lone node delivers for every store.
#[derive(Debug, Clone, Copy, Default)]
pub struct EveryStore;

impl DispatchScope for EveryStore {
    fn dispatches(&self, _store_id: &str) -> bool {
        true
    }
}

/// The headers of a delivery made at `now_ms`, the wall clock (never a test clock:
/// receivers reject signatures whose time is far from their own clock).
pub fn delivery_headers(
    endpoint: &WebhookEndpoint,
    delivery: &Delivery,
    body: &str,
    now_ms: i64,
) -> Vec<(String, String)> {
    vec![
        ("Content-Type".into(), "application/json".into()),
        (
            "tally-signature".into(),
            signature_header(
                &endpoint.signing_secrets(now_ms),
                now_ms.div_euclid(1000),
                body.as_bytes(),
            ),
        ),
        ("tally-event-id".into(), delivery.event_id.clone()),
        ("tally-event-type".into(), delivery.event_type.clone()),
    ]
}

/// Resolves endpoint host names and keeps only the addresses a webhook of `mode` may
/// reach (`may_reach`); a name with none left fails to resolve. The connector dials
/// only what this returns.
#[derive(Debug)]
struct FilteringResolver {
    mode: Mode,
    allow_private: bool,
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (mode, allow_private) = (self.mode, self.allow_private);
        Box::pin(async move {
            let host = name.as_str().to_string();
            let resolved: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|address| may_reach(address.ip(), mode, allow_private))
                .collect();
            if resolved.is_empty() {
                let refused: Box<dyn std::error::Error + Send + Sync> =
                    format!("{host} resolves to no address a webhook may reach").into();
                return Err(refused);
            }
            let addresses: reqwest::dns::Addrs = Box::new(resolved.into_iter());
            Ok(addresses)
        })
    }
}

pub struct Dispatcher {
    notifications: Arc<Notifications>,
    bodies: Arc<dyn EventBodies>,
    scope: Arc<dyn DispatchScope>,
    allow_private: bool,
    /// One client per environment: their resolvers allow different addresses.
    prod_client: reqwest::Client,
    test_client: reqwest::Client,
    in_flight: DashMap<String, ()>,
    /// Deliveries taken and not finished per endpoint (entries removed at zero).
    taken: DashMap<String, usize>,
    /// Each endpoint's concurrent slots (`MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT`);
    /// an entry goes when nothing holds it.
    slots: DashMap<String, Arc<Semaphore>>,
    /// Each endpoint's deliveries taken and waiting for a slot, oldest due first.
    /// An entry exists while its endpoint's one lane task (`run_lane`) runs: the
    /// lane hands out the slots in this order, so an endpoint receives its events
    /// in the order they fell due as far as its concurrent slots allow. With a task
    /// per delivery waiting on the semaphore, the order was the runtime's: a
    /// checkout's `subscription.canceled` reached a receiver before the
    /// `checkout.completed` of a second earlier.
    lanes: DashMap<String, VecDeque<(Scope, String)>>,
    overall: Arc<Semaphore>,
    /// Where polls start (`FULL_DUE_SCAN_EVERY_MS`): the due time of the first
    /// entry the last poll met, and when a poll last started from the oldest.
    scan_from: std::sync::Mutex<ScanFrom>,
    /// Notified when an endpoint's deliveries taken fall to `REFILL_TAKEN_AT`.
    room: tokio::sync::Notify,
}

/// Where the next poll's look at the due index starts.
#[derive(Debug, Default)]
struct ScanFrom {
    due_ms: Option<i64>,
    last_full: Option<Instant>,
}

impl ScanFrom {
    /// Where a poll at `now` starts: at the due time the last poll met first, or
    /// at the oldest entry (`None`) when a full look is due or none was met yet.
    fn start(&self, now: Instant) -> Option<i64> {
        let full_due = self.last_full.is_none_or(|at| {
            now.saturating_duration_since(at) >= Duration::from_millis(FULL_DUE_SCAN_EVERY_MS)
        });
        if full_due {
            None
        } else {
            self.due_ms
        }
    }

    /// A poll at `now` that started at `started` met its first entry due at
    /// `first_due`; one that met none leaves the start where it was.
    fn polled(&mut self, started: Option<i64>, first_due: Option<i64>, now: Instant) {
        if started.is_none() {
            self.last_full = Some(now);
        }
        if first_due.is_some() {
            self.due_ms = first_due;
        }
    }
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dispatcher")
    }
}

impl Dispatcher {
    pub fn new(
        notifications: Arc<Notifications>,
        bodies: Arc<dyn EventBodies>,
        scope: Arc<dyn DispatchScope>,
        allow_private: bool,
    ) -> Arc<Dispatcher> {
        let client = |mode: Mode| {
            reqwest::Client::builder()
                .timeout(Duration::from_millis(DELIVERY_TIMEOUT_MS))
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .dns_resolver(Arc::new(FilteringResolver {
                    mode,
                    allow_private,
                }))
                .build()
                .expect("build the webhook HTTP client")
        };
        Arc::new(Dispatcher {
            notifications,
            bodies,
            scope,
            allow_private,
            prod_client: client(Mode::Prod),
            test_client: client(Mode::Test),
            in_flight: DashMap::new(),
            taken: DashMap::new(),
            slots: DashMap::new(),
            lanes: DashMap::new(),
            overall: Arc::new(Semaphore::new(MAX_CONCURRENT_DELIVERIES)),
            scan_from: std::sync::Mutex::default(),
            room: tokio::sync::Notify::new(),
        })
    }

    /// Delivers what is due until `shutdown` turns true.
    pub async fn run(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tokio::time::sleep(Duration::from_millis(DISPATCH_POLL_MS)) => {}
                _ = self.room.notified() => {}
            }
            // A poll that filled its batch may have left due deliveries of other
            // endpoints behind it: look again at once, until a poll finds less
            // than a batch (every endpoint with a backlog then has its most taken).
            while self.poll() >= DISPATCH_BATCH {
                tokio::task::yield_now().await;
            }
        }
    }

    /// One look at the due index: takes what is due, up to `DISPATCH_BATCH` and up
    /// to each endpoint's room under `MAX_TAKEN_DELIVERIES_PER_ENDPOINT`, and starts
    /// a task for each, which waits for one of its endpoint's slots and then for
    /// one of the `MAX_CONCURRENT_DELIVERIES` overall. Answers how many it took.
    pub fn poll(self: &Arc<Self>) -> usize {
        // What this scan already picked per endpoint: the room it leaves is counted
        // as the scan goes, so the scan passes over an endpoint it filled and goes
        // on to the deliveries of others (a busy endpoint never hides them).
        let picked: RefCell<HashMap<String, usize>> = RefCell::default();
        let skip = |store: &str, endpoint: &str, event: &str| {
            let mut picked = picked.borrow_mut();
            let before = picked.get(endpoint).copied().unwrap_or(0);
            // Room first: it needs no allocation, and a backlog's entries are
            // mostly of endpoints without room.
            if !self.scope.dispatches(store)
                || self.taken_by(endpoint) + before >= MAX_TAKEN_DELIVERIES_PER_ENDPOINT
                || self.in_flight.contains_key(&format!("{endpoint}/{event}"))
            {
                return true;
            }
            picked.insert(endpoint.to_string(), before + 1);
            false
        };
        let from_ms = self
            .scan_from
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .start(Instant::now());
        let due = match self.notifications.due_deliveries(
            // The latest any store's clock shows; each delivery is checked
            // against its own store's.
            self.notifications.journal.latest_test_time(),
            from_ms,
            DISPATCH_BATCH,
            &skip,
        ) {
            Ok(look) => {
                self.scan_from
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .polled(from_ms, look.first_due_ms, Instant::now());
                look.due
            }
            Err(error) => {
                tracing::error!(%error, "reading due webhook deliveries failed");
                return 0;
            }
        };
        let mut started = 0;
        for (scope, endpoint_id, event_id) in due {
            let key = format!("{endpoint_id}/{event_id}");
            {
                let mut taken = self.taken.entry(endpoint_id.to_string()).or_insert(0);
                if *taken >= MAX_TAKEN_DELIVERIES_PER_ENDPOINT
                    || self.in_flight.insert(key, ()).is_some()
                {
                    continue;
                }
                *taken += 1;
            }
            started += 1;
            // Queued behind the endpoint's earlier deliveries; the first one queued
            // starts the lane (an entry exists exactly while its lane runs).
            let mut lane_is_new = false;
            self.lanes
                .entry(endpoint_id.to_string())
                .or_insert_with(|| {
                    lane_is_new = true;
                    VecDeque::new()
                })
                .push_back((scope, event_id));
            if lane_is_new {
                tokio::spawn(self.clone().run_lane(endpoint_id));
            }
        }
        started
    }

    /// Hands `endpoint_id`'s queued deliveries their slots one at a time, in the
    /// order queued: the endpoint's slot first, then the overall one (a lane
    /// waiting on a slow endpoint holds nothing another endpoint needs), and then
    /// a task that makes the attempt. Ends when the queue is empty; the queue's
    /// entry goes in the same step, under the map's lock, so a delivery queued
    /// meanwhile finds either this lane still running or no lane and starts one.
    /// Neither semaphore is ever closed.
    async fn run_lane(self: Arc<Self>, endpoint_id: EndpointId) {
        let slots = self.slots_of(&endpoint_id);
        loop {
            let next = self
                .lanes
                .get_mut(endpoint_id.as_str())
                .and_then(|mut queue| queue.pop_front());
            let Some((scope, event_id)) = next else {
                // Removed only while empty; a delivery queued since the pop keeps it
                // (and this lane) going. An absent entry has nothing for this lane
                // either, so it ends then too rather than spin.
                let emptied = self
                    .lanes
                    .remove_if(endpoint_id.as_str(), |_, queue| queue.is_empty())
                    .is_some();
                if emptied || !self.lanes.contains_key(endpoint_id.as_str()) {
                    break;
                }
                continue;
            };
            let slot = slots.clone().acquire_owned().await;
            let overall = self.overall.clone().acquire_owned().await;
            let dispatcher = self.clone();
            let endpoint_id = endpoint_id.clone();
            tokio::spawn(async move {
                if let Err(error) = dispatcher
                    .deliver_if_due(&scope, &endpoint_id, &event_id, (overall, slot))
                    .await
                {
                    tracing::warn!(%error, event = %event_id, "webhook attempt could not be recorded");
                }
                // Held until the attempt is recorded: the event is not taken again
                // while its slots have gone to the next delivery.
                dispatcher
                    .in_flight
                    .remove(&format!("{endpoint_id}/{event_id}"));
                dispatcher.release_taken(&endpoint_id);
            });
        }
        drop(slots);
        self.drop_idle_slots(&endpoint_id);
    }

    /// A scheduled attempt of a delivery taken by a poll, read once its slot came:
    /// while it waited a manual resend may have delivered it, or made an attempt
    /// whose number the next one follows; and on a cluster the store may have
    /// moved to another node, which delivers it from then on.
    async fn deliver_if_due<Slots: Send>(
        &self,
        scope: &Scope,
        endpoint_id: &EndpointId,
        event_id: &str,
        slots: Slots,
    ) -> Result<(), EngineError> {
        if !self.scope.dispatches(&scope.store_id) {
            return Ok(());
        }
        let delivery = self
            .notifications
            .get_delivery(scope, endpoint_id, event_id)?;
        if delivery.delivered || delivery.next_attempt_at_ms.is_none() {
            return Ok(());
        }
        self.deliver(scope, &delivery, false, slots).await.map(drop)
    }

    /// Deliveries taken and not finished of `endpoint_id`.
    fn taken_by(&self, endpoint_id: &str) -> usize {
        self.taken.get(endpoint_id).map_or(0, |taken| *taken)
    }

    /// The endpoint's concurrent slots (created when missing).
    fn slots_of(&self, endpoint_id: &str) -> Arc<Semaphore> {
        self.slots
            .entry(endpoint_id.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(MAX_CONCURRENT_DELIVERIES_PER_ENDPOINT)))
            .clone()
    }

    /// One delivery of `endpoint_id` finished: at zero its count goes, and its
    /// slots when nothing holds them; at `REFILL_TAKEN_AT` the dispatcher polls.
    fn release_taken(&self, endpoint_id: &str) {
        let mut refill = false;
        let idle = self
            .taken
            .remove_if_mut(endpoint_id, |_, taken| {
                *taken = taken.saturating_sub(1);
                refill = *taken == REFILL_TAKEN_AT;
                *taken == 0
            })
            .is_some();
        if refill {
            self.room.notify_one();
        }
        if idle {
            self.drop_idle_slots(endpoint_id);
        }
    }

    /// Drops an endpoint's slots when no task or resend holds them: every holder
    /// took its `Arc` under the map's shard lock, which `remove_if` holds too, and a
    /// task keeps it until its delivery ends, so a count of one is the map's alone.
    fn drop_idle_slots(&self, endpoint_id: &str) {
        self.slots
            .remove_if(endpoint_id, |_, slots| Arc::strong_count(slots) == 1);
    }

    /// A manual resend: the same slots per endpoint and overall as scheduled
    /// delivery, so resends cannot be used to flood an endpoint or scan for open
    /// ports; one finding every slot of its endpoint busy is refused at once.
    pub async fn resend(
        &self,
        scope: &Scope,
        delivery: &Delivery,
    ) -> Result<WebhookAttempt, EngineError> {
        let slots = self.slots_of(&delivery.endpoint_id);
        let result = match slots.try_acquire() {
            Ok(slot) => {
                let overall = self.overall.acquire().await;
                self.deliver(scope, delivery, true, (overall, slot)).await
            }
            Err(_) => Err(EngineError::Unavailable {
                code: "endpoint_busy",
                message: "this endpoint already has the most deliveries in flight; retry the resend shortly",
            }),
        };
        drop(slots);
        self.drop_idle_slots(&delivery.endpoint_id);
        result
    }

    /// Makes one attempt and records it; returns the recorded attempt. `slots` (the
    /// endpoint's and the overall permits) are let go once the receiver has
    /// answered, before the attempt is recorded: they bound requests at receivers,
    /// and recording is a log append and its fsync (~1-2 ms), which while it held
    /// them kept a fast endpoint to ~2,200 deliveries a second (docs/benchmarks.md,
    /// "Due deliveries found a window at a time").
    pub async fn deliver<Slots: Send>(
        &self,
        scope: &Scope,
        delivery: &Delivery,
        manual: bool,
        slots: Slots,
    ) -> Result<WebhookAttempt, EngineError> {
        let now = self.notifications.journal.now_in(scope);
        let number = delivery.attempts + 1;
        let first = if delivery.first_attempt_at_ms == 0 {
            now
        } else {
            delivery.first_attempt_at_ms
        };
        let endpoint = match self
            .notifications
            .get_endpoint(scope, &delivery.endpoint_id)
        {
            Ok(e) if e.enabled && e.delivery_mode == DeliveryMode::Http => Some(e),
            Ok(_) | Err(EngineError::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        let started = Instant::now();
        let (status_code, error) = match &endpoint {
            None => (0, "endpoint disabled or deleted: not delivered".to_string()),
            Some(endpoint) => {
                let body = self.bodies.body(scope, delivery)?;
                match self.refuse_target(endpoint) {
                    Some(reason) => (0, reason),
                    // Signed at the wall clock even on an advanced test clock:
                    // a receiver checks the signature's time against its own clock.
                    None => {
                        let signed_at = self.notifications.journal.now_ms();
                        self.post(endpoint, delivery, &body, signed_at).await
                    }
                }
            }
        };
        drop(slots);
        let delivered = status_code == 200;
        let next_attempt_at_ms = match (&endpoint, delivered, manual) {
            (None, _, _) | (_, true, _) => None,
            // A manual resend leaves the schedule where it was.
            (_, false, true) => delivery.next_attempt_at_ms,
            (_, false, false) => next_attempt_at(first, number),
        };
        let attempt = WebhookAttempt {
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            endpoint_id: delivery.endpoint_id.clone().into(),
            event_id: delivery.event_id.clone(),
            attempt: number,
            at_ms: now,
            status_code,
            latency_ms: started.elapsed().as_millis() as u64,
            error,
            delivered,
            next_attempt_at_ms,
            manual,
        };
        self.notifications.record_attempt(attempt.clone()).await?;
        Ok(attempt)
    }

    /// Why an endpoint may not be reached now, if it may not: its URL is checked
    /// again (the rules may have changed since it was saved); names are checked
    /// after resolution by the client's resolver (`FilteringResolver`), which hands
    /// the connector only the addresses it checked, so DNS rebinding cannot slip an
    /// internal address in between.
    fn refuse_target(&self, endpoint: &WebhookEndpoint) -> Option<String> {
        endpoint_target(&endpoint.url, endpoint.mode, self.allow_private)
            .err()
            .map(|error| format!("refused: {}", error.message))
    }

    async fn post(
        &self,
        endpoint: &WebhookEndpoint,
        delivery: &Delivery,
        body: &str,
        now_ms: i64,
    ) -> (u16, String) {
        let client = match endpoint.mode {
            Mode::Prod => &self.prod_client,
            Mode::Test => &self.test_client,
        };
        let mut request = client.post(&endpoint.url).body(body.to_string());
        for (name, value) in delivery_headers(endpoint, delivery, body, now_ms) {
            request = request.header(name, value);
        }
        match request.send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let error = if status == 200 {
                    String::new()
                } else {
                    format!("the endpoint answered {status}")
                };
                (status, error)
            }
            Err(e) if e.is_timeout() => (0, "timed out after 10 s".into()),
            // No transport detail: the attempt log must not work as a port scanner.
            Err(e) if e.is_connect() => (0, "could not connect to the endpoint".into()),
            Err(_) => (0, "the request failed".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::Resolve;
    use std::str::FromStr;

    async fn resolves(mode: Mode, allow_private: bool, name: &str) -> bool {
        let resolver = FilteringResolver {
            mode,
            allow_private,
        };
        resolver
            .resolve(reqwest::dns::Name::from_str(name).unwrap())
            .await
            .is_ok()
    }

    /// Polls start where the last one met its first due entry, and from the oldest
    /// once `FULL_DUE_SCAN_EVERY_MS` passed since the last full look; a poll that
    /// met nothing moves no start.
    #[test]
    fn polls_start_where_the_last_met_its_first_entry_between_full_looks() {
        let t0 = Instant::now();
        let every = Duration::from_millis(FULL_DUE_SCAN_EVERY_MS);
        let mut from = ScanFrom::default();
        assert_eq!(from.start(t0), None, "the first poll looks at everything");
        from.polled(None, None, t0);
        assert_eq!(from.start(t0), None, "nothing met yet");
        from.polled(None, Some(500), t0);
        assert_eq!(from.start(t0 + every / 2), Some(500));
        from.polled(Some(500), Some(700), t0 + every / 2);
        assert_eq!(from.start(t0 + every / 2), Some(700));
        from.polled(Some(700), None, t0 + every / 2);
        assert_eq!(from.start(t0 + every / 2), Some(700), "met nothing: kept");
        assert_eq!(from.start(t0 + every), None, "a full look is due");
        from.polled(None, Some(300), t0 + every);
        assert_eq!(
            from.start(t0 + every + every / 2),
            Some(300),
            "a full look moves the start back to what it met"
        );
        assert_eq!(from.start(t0 + 2 * every), None);
    }

    /// What the connector may dial is decided after resolution: a name that resolves
    /// to loopback is refused for production endpoints, allowed for test ones.
    #[tokio::test]
    async fn the_resolver_hands_out_only_reachable_addresses() {
        assert!(!resolves(Mode::Prod, false, "localhost").await);
        assert!(resolves(Mode::Test, false, "localhost").await);
        assert!(resolves(Mode::Prod, true, "localhost").await);
    }
}
