//! `idempotency-key`s, decided in apply (ARCHITECTURE.md "Idempotency keys").
//!
//! A request sent with a key runs with a [`RequestSlot`]; the first record it
//! appends carries the key in its envelope. Apply claims the key for that record,
//! in log order: a later record carrying the same key (a retry through another
//! node, or one whose first attempt's outcome was unknown) is refused as a repeat,
//! and a key used with another request as `idempotency_key_reused`. When the request
//! has its final response, the node appends it as an `IdempotentResponse` record, and
//! apply stores it with the claim: every node replays the same status and body.
//!
//! Claims live for `IDEMPOTENCY_TTL_MS` of record time; apply prunes expired ones a
//! few at a time (`PRUNE_PER_RECORD`), oldest first, from a time-ordered index.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tally_domain::record::{IdempotentResponse, RequestKey};
use tally_projection::ProjectionStore;

use crate::error::EngineError;
use crate::keys::{self, Key};
use crate::outcome::Outcome;
use crate::overlay::{ApplyError, Overlay};

/// How long a key is remembered: a retry within 24 hours gets the first response
/// (docs/api.md, "Idempotency"). Measured in record time.
pub const IDEMPOTENCY_TTL_MS: i64 = 24 * 60 * 60 * 1000;
/// Expired claims apply removes per keyed record: more than the at most one claim
/// each keyed request adds, so the table shrinks back after a burst, while a record
/// never pays for a long sweep.
pub const PRUNE_PER_RECORD: usize = 4;

tokio::task_local! {
    /// The key of the request this task serves (see `RequestSlot`).
    pub static REQUEST: RequestSlot;
}

/// The key a request was sent with, handed to the first record it appends.
#[derive(Debug)]
pub struct RequestSlot(Mutex<SlotState>);

#[derive(Debug)]
struct SlotState {
    key: Option<RequestKey>,
    /// The key once given to a record (see `give_back`).
    given: Option<RequestKey>,
    partition_key: Option<Vec<u8>>,
}

impl RequestSlot {
    pub fn new(key: RequestKey) -> RequestSlot {
        RequestSlot(Mutex::new(SlotState {
            key: Some(key),
            given: None,
            partition_key: None,
        }))
    }

    /// The key for a record about to be appended under `partition_key`: given to the
    /// first record only (a request's later records are its own consequences).
    pub fn take_for(&self, partition_key: &[u8]) -> Option<RequestKey> {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let key = state.key.take();
        if key.is_some() {
            state.partition_key = Some(partition_key.to_vec());
            state.given.clone_from(&key);
        }
        key
    }

    /// The record that carried the key was refused without claiming it: the
    /// request's next record carries it instead.
    fn give_back(&self) {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(key) = state.given.take() {
            state.key = Some(key);
            state.partition_key = None;
        }
    }

    /// The partition key of the record that carried the key, if one was appended.
    pub fn partition_key(&self) -> Option<Vec<u8>> {
        let state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        state.partition_key.clone()
    }
}

/// The key of the current task's request for a record under `partition_key`.
pub fn request_key_for(partition_key: &[u8]) -> Option<RequestKey> {
    REQUEST
        .try_with(|slot| slot.take_for(partition_key))
        .ok()
        .flatten()
}

/// See `RequestSlot::give_back` (nothing outside a keyed request).
pub fn give_back() {
    let _ = REQUEST.try_with(RequestSlot::give_back);
}

/// A claimed key (table `I`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub fingerprint: Vec<u8>,
    /// Record time of the claim.
    pub at_ms: i64,
    /// The final response, once its record is applied.
    pub response: Option<SavedResponse>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedResponse {
    pub status: u16,
    pub body: String,
}

impl Claim {
    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    fn decode(bytes: &[u8]) -> Result<Claim, EngineError> {
        serde_json::from_slice(bytes)
            .map_err(|e| EngineError::Corrupt(format!("idempotency claim: {e}")))
    }

    fn live_at(&self, at_ms: i64) -> bool {
        at_ms.saturating_sub(self.at_ms) < IDEMPOTENCY_TTL_MS
    }
}

fn claim_key(request: &RequestKey) -> Vec<u8> {
    Key::table(keys::IDEMPOTENCY)
        .text(&hex::encode(&request.api_key_sha256))
        .tail(request.key.as_bytes())
        .into_bytes()
}

fn expiry_key(at_ms: i64, claim_key: &[u8]) -> Vec<u8> {
    Key::table(keys::IDEMPOTENCY_EXPIRY)
        .int(at_ms)
        .tail(claim_key)
        .into_bytes()
}

/// The live claim of `request`'s key at `at_ms`, as stored.
fn live_claim(overlay: &Overlay<'_>, key: &[u8], at_ms: i64) -> Result<Option<Claim>, EngineError> {
    match overlay.get(key)? {
        Some(bytes) => Ok(Some(Claim::decode(&bytes)?).filter(|c| c.live_at(at_ms))),
        None => Ok(None),
    }
}

/// Before a keyed record is applied: refuses it when its key is claimed already,
/// as a repeat (same request) or as reused (another request).
pub fn check(overlay: &Overlay<'_>, request: &RequestKey, at_ms: i64) -> Result<(), ApplyError> {
    match live_claim(overlay, &claim_key(request), at_ms)? {
        None => Ok(()),
        Some(claim) if claim.fingerprint == request.fingerprint => Err(Outcome::rejected(
            "idempotency_key_in_use",
            "a request with this idempotency-key was already taken; its response is replayed once it is ready",
        )
        .into()),
        Some(_) => Err(reused().into()),
    }
}

fn reused() -> Outcome {
    Outcome::rejected(
        "idempotency_key_reused",
        "this idempotency-key was used with a different request; use a new key",
    )
    .with_param("idempotency-key")
}

/// After a keyed record was applied: the key is claimed for it.
pub fn claim(
    overlay: &mut Overlay<'_>,
    request: &RequestKey,
    at_ms: i64,
) -> Result<(), EngineError> {
    let key = claim_key(request);
    put_claim(
        overlay,
        key,
        Claim {
            fingerprint: request.fingerprint.clone(),
            at_ms,
            response: None,
        },
    );
    prune(overlay, at_ms)
}

fn put_claim(overlay: &mut Overlay<'_>, key: Vec<u8>, claim: Claim) {
    overlay.put(expiry_key(claim.at_ms, &key), Vec::new());
    overlay.put(key, claim.encode());
}

/// Stores a keyed request's final response with its claim (claiming the key when
/// the request appended nothing else). The first response stays: a repeat, or a
/// response for another request under the key, changes nothing.
pub fn apply_response(
    overlay: &mut Overlay<'_>,
    response: &IdempotentResponse,
    at_ms: i64,
) -> Result<(), EngineError> {
    let key = claim_key(&response.request);
    let saved = SavedResponse {
        status: response.status,
        body: response.body.clone(),
    };
    match live_claim(overlay, &key, at_ms)? {
        Some(mut claim)
            if claim.fingerprint == response.request.fingerprint && claim.response.is_none() =>
        {
            claim.response = Some(saved);
            overlay.put(key, claim.encode());
        }
        Some(_) => {}
        None => put_claim(
            overlay,
            key,
            Claim {
                fingerprint: response.request.fingerprint.clone(),
                at_ms,
                response: Some(saved),
            },
        ),
    }
    prune(overlay, at_ms)
}

/// Removes up to `PRUNE_PER_RECORD` claims that expired before `at_ms`.
fn prune(overlay: &mut Overlay<'_>, at_ms: i64) -> Result<(), EngineError> {
    let prefix = [keys::IDEMPOTENCY_EXPIRY];
    let oldest = overlay.first_entries(&prefix, PRUNE_PER_RECORD)?;
    for (expiry, _) in oldest {
        let Some(stamp) = expiry.get(1..9) else {
            return Err(EngineError::Corrupt("idempotency expiry key".into()));
        };
        let claimed_at = keys::read_int(stamp);
        if at_ms.saturating_sub(claimed_at) < IDEMPOTENCY_TTL_MS {
            break;
        }
        let claim_key = expiry[9..].to_vec();
        // The claim may have been renewed since (a new claim after expiry): only
        // the claim this index entry stands for goes.
        if let Some(bytes) = overlay.get(&claim_key)? {
            if Claim::decode(&bytes)?.at_ms == claimed_at {
                overlay.delete(claim_key);
            }
        }
        overlay.delete(expiry);
    }
    Ok(())
}

/// The live claim of `api_key_sha256`'s `key` at `now_ms`, for the HTTP layer.
pub fn lookup(
    store: &dyn ProjectionStore,
    api_key_sha256: &[u8],
    key: &str,
    now_ms: i64,
) -> Result<Option<Claim>, EngineError> {
    let stored_key = claim_key(&RequestKey {
        api_key_sha256: api_key_sha256.to_vec(),
        key: key.to_string(),
        fingerprint: Vec::new(),
    });
    match store.get(&stored_key)? {
        Some(bytes) => Ok(Some(Claim::decode(&bytes)?).filter(|c| c.live_at(now_ms))),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_index::EventIndex;
    use crate::overlay::Fetched;
    use tally_projection::{scan_prefix, MemoryStore, Visit};

    /// How many claims are stored.
    fn stored_claims(store: &dyn ProjectionStore) -> Result<usize, EngineError> {
        let mut count = 0;
        scan_prefix(store, &[keys::IDEMPOTENCY], false, &mut |_, _| {
            count += 1;
            Visit::Continue
        })?;
        Ok(count)
    }

    fn request(key: &str, body: &str) -> RequestKey {
        RequestKey {
            api_key_sha256: vec![7; 32],
            key: key.to_string(),
            fingerprint: body.as_bytes().to_vec(),
        }
    }

    /// Runs `step` in an overlay over `store` and commits what it wrote (as the
    /// projector does for one chunk).
    fn in_chunk<T>(store: &MemoryStore, step: impl FnOnce(&mut Overlay<'_>) -> T) -> T {
        let index = EventIndex::default();
        let fetched = Fetched::new();
        let mut overlay = Overlay::new(store, &index, &fetched);
        let result = step(&mut overlay);
        overlay.keep();
        let committed = overlay.into_changes().unwrap();
        store.apply_shared(committed.changes, &[]).unwrap();
        result
    }

    fn refusal(result: Result<(), ApplyError>) -> Option<String> {
        match result {
            Ok(()) => None,
            Err(ApplyError::Refused(Outcome::Rejected { code, .. })) => Some(code),
            Err(other) => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn the_first_record_claims_a_key_and_repeats_are_refused() {
        let store = MemoryStore::new();
        let first = request("k", "body");
        assert_eq!(in_chunk(&store, |o| refusal(check(o, &first, 1_000))), None);
        in_chunk(&store, |o| claim(o, &first, 1_000).unwrap());
        assert_eq!(
            in_chunk(&store, |o| refusal(check(o, &first, 2_000))).as_deref(),
            Some("idempotency_key_in_use")
        );
        assert_eq!(
            in_chunk(&store, |o| refusal(check(o, &request("k", "other"), 2_000))).as_deref(),
            Some("idempotency_key_reused")
        );
        // Another key, or the same key under another API key, is free.
        assert_eq!(
            in_chunk(&store, |o| refusal(check(o, &request("k2", "body"), 2_000))),
            None
        );
        let mut elsewhere = first.clone();
        elsewhere.api_key_sha256 = vec![8; 32];
        assert_eq!(
            in_chunk(&store, |o| refusal(check(o, &elsewhere, 2_000))),
            None
        );
        // Expired in record time: free again.
        let later = 1_000 + IDEMPOTENCY_TTL_MS;
        assert_eq!(in_chunk(&store, |o| refusal(check(o, &first, later))), None);
        assert!(lookup(&store, &first.api_key_sha256, "k", 2_000)
            .unwrap()
            .is_some());
        assert!(lookup(&store, &first.api_key_sha256, "k", later)
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_first_response_is_kept() {
        let store = MemoryStore::new();
        let first = request("k", "body");
        in_chunk(&store, |o| claim(o, &first, 1_000).unwrap());
        let response = |request: &RequestKey, status: u16, body: &str| IdempotentResponse {
            request: request.clone(),
            partition_key: Vec::new(),
            status,
            body: body.to_string(),
        };
        in_chunk(&store, |o| {
            apply_response(o, &response(&first, 200, "one"), 1_500).unwrap()
        });
        in_chunk(&store, |o| {
            apply_response(o, &response(&first, 200, "two"), 1_600).unwrap()
        });
        let other = request("k", "other");
        in_chunk(&store, |o| {
            apply_response(o, &response(&other, 400, "three"), 1_700).unwrap()
        });
        let claim = lookup(&store, &first.api_key_sha256, "k", 2_000)
            .unwrap()
            .unwrap();
        assert_eq!(claim.at_ms, 1_000);
        assert_eq!(claim.fingerprint, first.fingerprint);
        assert_eq!(
            claim.response,
            Some(SavedResponse {
                status: 200,
                body: "one".into()
            })
        );
        // A request that appended nothing is claimed by its response.
        let lone = request("lone", "body");
        in_chunk(&store, |o| {
            apply_response(o, &response(&lone, 400, "bad"), 3_000).unwrap()
        });
        assert_eq!(
            in_chunk(&store, |o| refusal(check(o, &lone, 3_100))).as_deref(),
            Some("idempotency_key_in_use")
        );
    }

    #[test]
    fn expired_claims_are_pruned_a_few_per_record_and_renewed_ones_stay() {
        let store = MemoryStore::new();
        for i in 0..10 {
            in_chunk(&store, |o| {
                claim(o, &request(&format!("k{i}"), "b"), 100 + i).unwrap()
            });
        }
        // k0 is claimed again once expired; its old index entry is pruned with it, and
        // must not take the new claim.
        let renewed_at = IDEMPOTENCY_TTL_MS + 100;
        in_chunk(&store, |o| {
            claim(o, &request("k0", "b"), renewed_at).unwrap()
        });
        assert_eq!(stored_claims(&store).unwrap(), 10);
        let now = IDEMPOTENCY_TTL_MS + 109;
        in_chunk(&store, |o| claim(o, &request("new", "b"), now).unwrap());
        // k1..k4: `PRUNE_PER_RECORD` of the nine expired.
        assert_eq!(stored_claims(&store).unwrap(), 7);
        assert!(lookup(&store, &[7; 32], "k0", now).unwrap().is_some());
        assert!(lookup(&store, &[7; 32], "k5", now - 6).unwrap().is_some());
        for i in 0..3 {
            in_chunk(&store, |o| {
                claim(o, &request(&format!("n{i}"), "b"), now + 1).unwrap()
            });
        }
        // k5..k9 pruned; k0 (renewed), `new` and n0..n2 stay.
        assert_eq!(stored_claims(&store).unwrap(), 5);
        assert!(lookup(&store, &[7; 32], "k0", now + 1).unwrap().is_some());
    }
}
