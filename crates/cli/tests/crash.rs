//! The crash tests: `tally serve` is killed with SIGKILL while clients ingest. In the
//! first a torn half-record is left at the end of the log, as a crash mid-write
//! would; in the second the kill lands while a checkpoint is being written to sled;
//! two more kill after a copy of the unwritten layer, one of them a copy made while a
//! checkpoint's stage was being written. After a restart every acknowledged event is
//! present exactly once, and the server starts cleanly. In the last, a client voids and amends acknowledged events while
//! the load runs: every acknowledged correction holds after the restart, and one the
//! kill cut off holds whole or not at all.

mod common;

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// What the crash tests share: a server's address and key, a customer, the meters.
struct Setup {
    http: reqwest::Client,
    base: String,
    key: String,
    customer_id: String,
    meter_ids: Vec<String>,
}

impl Setup {
    /// A customer and `meters` on a fresh server.
    async fn new(served: &Served, meters: &[Value]) -> Setup {
        let key = served.test_key.clone().expect("first start prints keys");
        let base = served.test_url.clone();
        let http = reqwest::Client::new();
        let (status, customer) = post(
            &http,
            &format!("{base}/v1/customers"),
            &key,
            json!({"email": "c@x.io", "external_id": "crash"}),
        )
        .await
        .unwrap();
        assert_eq!(status, 200);
        let mut meter_ids = Vec::new();
        for meter in meters {
            let (status, meter) = post(&http, &format!("{base}/v1/meters"), &key, meter.clone())
                .await
                .unwrap();
            assert_eq!(status, 200, "{meter}");
            meter_ids.push(meter["id"].as_str().unwrap().to_string());
        }
        Setup {
            http,
            base,
            key,
            customer_id: customer["id"].as_str().unwrap().to_string(),
            meter_ids,
        }
    }

    /// An event of the customer; `user` (its own id) feeds a unique meter.
    fn event(&self, id: &str) -> Value {
        json!({"name": "tick", "customer_id": self.customer_id, "event_id": id, "properties": {"user": id}})
    }

    /// Sends the events `ids` to the server at `base`.
    async fn ingest(&self, base: &str, ids: &[String]) -> Result<(u16, Value), reqwest::Error> {
        let events: Vec<_> = ids.iter().map(|id| self.event(id)).collect();
        post(
            &self.http,
            &format!("{base}/v1/events/ingest"),
            &self.key,
            json!({"events": events}),
        )
        .await
    }

    /// `clients` clients sending batches of `batch` new events until the server
    /// dies; `finish` returns the ids acknowledged and how many were sent.
    fn load(self: &Arc<Self>, clients: usize, batch: usize) -> Load {
        let acknowledged: Arc<Mutex<Vec<String>>> = Arc::default();
        let attempted: Arc<Mutex<HashSet<String>>> = Arc::default();
        let clients = (0..clients)
            .map(|client| {
                let (setup, acknowledged, attempted) =
                    (self.clone(), acknowledged.clone(), attempted.clone());
                tokio::spawn(async move {
                    for number in 0..100_000 {
                        let ids: Vec<String> = (0..batch)
                            .map(|i| format!("c{client}-b{number}-e{i}"))
                            .collect();
                        attempted.lock().unwrap().extend(ids.iter().cloned());
                        match setup.ingest(&setup.base, &ids).await {
                            Ok((202, _)) => acknowledged.lock().unwrap().extend(ids),
                            _ => break, // the server died
                        }
                    }
                })
            })
            .collect();
        Load {
            acknowledged,
            attempted,
            clients,
        }
    }

    /// What the meter `meter_id` counts on the server at `base`, over all time.
    async fn counted(&self, base: &str, meter_id: &str) -> usize {
        let (status, usage) = get(
            &self.http,
            &format!("{base}/v1/meters/{meter_id}/usage"),
            &self.key,
        )
        .await;
        assert_eq!(status, 200, "{usage}");
        usage["value"].as_str().unwrap().parse().unwrap()
    }

    /// Against a restarted server on `base`: every acknowledged id sent again is a
    /// duplicate (stored, and only once), and each meter counted between the
    /// acknowledged and the attempted events; returns what each meter counted.
    async fn check_exactly_once(
        &self,
        base: &str,
        acknowledged: &[String],
        attempted: usize,
    ) -> Vec<usize> {
        for chunk in acknowledged.chunks(100) {
            let (status, answer) = self.ingest(base, chunk).await.unwrap();
            assert_eq!(status, 202);
            assert_eq!(
                answer["accepted"], 0,
                "an acknowledged event was missing: {answer}"
            );
        }
        let mut counts = Vec::new();
        for meter_id in &self.meter_ids {
            let counted = self.counted(base, meter_id).await;
            assert!(
                (acknowledged.len()..=attempted).contains(&counted),
                "counted {counted} outside acknowledged {} ..= attempted {attempted}",
                acknowledged.len()
            );
            counts.push(counted);
        }
        counts
    }
}

struct Load {
    acknowledged: Arc<Mutex<Vec<String>>>,
    attempted: Arc<Mutex<HashSet<String>>>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Waits for the clients (the server is dead): acknowledged ids, ids sent.
    async fn finish(self) -> (Vec<String>, usize) {
        for client in self.clients {
            client.await.unwrap();
        }
        let acknowledged = self.acknowledged.lock().unwrap().clone();
        let attempted = self.attempted.lock().unwrap().len();
        (acknowledged, attempted)
    }
}

fn count_meter() -> Value {
    json!({"name": "all", "event_name": "tick", "aggregation": "count"})
}

/// Every event has its own `user`: the unique meter keeps a key per value, so each
/// event adds keys and checkpoints (and layer copies) have much to write.
fn unique_users_meter() -> Value {
    json!({"name": "users", "event_name": "tick", "aggregation": "unique", "aggregation_property": "user"})
}

/// Waits (at most 60 s) until the file `name` of the projection store exists.
async fn projection_file_appears(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let path = dir.join("projections").join(name);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no {name} was written within 60 s of load"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    path
}

/// The restarted server is ready and holds each stored event once, in both meters.
async fn restarted_exactly_once(
    setup: &Setup,
    served: &Served,
    acknowledged: &[String],
    attempted: usize,
) {
    let base = served.test_url.clone();
    let (ready, _) = get(&setup.http, &format!("{base}/readyz"), &setup.key).await;
    assert_eq!(ready, 200);
    let counts = setup
        .check_exactly_once(&base, acknowledged, attempted)
        .await;
    assert_eq!(
        counts[0], counts[1],
        "count and unique both count each stored event once (one user per event)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_events_survive_sigkill_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let setup = Arc::new(Setup::new(&served, &[count_meter()]).await);
    let load = setup.load(16, 10);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    served.kill();
    let (acknowledged, attempted) = load.finish().await;
    assert!(
        acknowledged.len() >= 100,
        "load ran before the kill ({} acknowledged)",
        acknowledged.len()
    );

    // A crash mid-write leaves half a frame at the end of the active segment.
    let log_dir = dir.path().join("log");
    let mut segments: Vec<_> = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segments.sort();
    let mut tail = std::fs::OpenOptions::new()
        .append(true)
        .open(segments.last().unwrap())
        .unwrap();
    tail.write_all(&[200, 0, 0, 0, 9, 9, 9, 9, 1, 2, 3])
        .unwrap();
    drop(tail);

    let served = serve(dir.path());
    assert!(served.test_key.is_none(), "no new default store on restart");
    let base = served.test_url.clone();
    let (ready, _) = get(&setup.http, &format!("{base}/readyz"), &setup.key).await;
    assert_eq!(ready, 200);

    // Every acknowledged event is stored...
    for id in acknowledged.iter().step_by(7) {
        let (status, event) = get(&setup.http, &format!("{base}/v1/events/{id}"), &setup.key).await;
        assert_eq!(status, 200, "acknowledged event {id} lost");
        assert_eq!(event["event_id"], id.as_str());
    }
    // ...exactly once: re-sending all of them yields only duplicates, and the usage
    // count equals the number of distinct events stored.
    setup
        .check_exactly_once(&base, &acknowledged, attempted)
        .await;
    let exit = served.terminate();
    assert!(exit.success());
}

/// Checkpoints of `CHECKPOINT_KEYS` changed keys, every one of them staged (more than
/// sled's atomic batch), many per second under this load: the test waits for a stage
/// file to appear and kills the server then, while its keys are being written. The
/// restarted server takes the interrupted checkpoint into memory and writes it with
/// its next checkpoint (here: at its stop).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sigkill_mid_checkpoint_loses_nothing_and_matches_a_replay() {
    const CHECKPOINT_KEYS: &str = "3000";
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(dir.path(), &["--checkpoint-keys", CHECKPOINT_KEYS]);
    let setup = Arc::new(Setup::new(&served, &[count_meter(), unique_users_meter()]).await);
    let load = setup.load(8, 50);
    let stage = projection_file_appears(dir.path(), tally_projection::sled_store::STAGE_FILE).await;
    served.kill();
    eprintln!(
        "killed with a stage file {}",
        if stage.exists() {
            "left behind"
        } else {
            "already removed"
        }
    );
    let (acknowledged, attempted) = load.finish().await;
    assert!(!acknowledged.is_empty(), "load ran before the kill");

    let served = serve(dir.path());
    restarted_exactly_once(&setup, &served, &acknowledged, attempted).await;
    assert!(served.terminate().success());
    // The interrupted checkpoint went into the restarted server's write-back layer;
    // the checkpoint of its stop wrote it and removed its stage.
    assert!(!stage.exists(), "the interrupted checkpoint was written");
    let (matched, replayed, live) = replay(dir.path());
    assert!(matched, "replay {replayed} differs from live {live}");
}

/// Copies of the layer not yet checkpointed, five a second here: the test waits for
/// one to be written under load and kills the server a little later. The restarted
/// server takes the copy in (it says so) and re-applies only the log after it; what
/// it then holds is exact and matches a replay of the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sigkill_after_a_layer_copy_restarts_from_it_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(dir.path(), &["--layer-copy-ms", "200"]);
    let setup = Arc::new(Setup::new(&served, &[count_meter(), unique_users_meter()]).await);
    let load = setup.load(8, 50);
    projection_file_appears(dir.path(), tally_projection::sled_store::LAYER_COPY_FILE).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    served.kill();
    let (acknowledged, attempted) = load.finish().await;
    assert!(!acknowledged.is_empty(), "load ran before the kill");

    let served = serve(dir.path());
    // The log line is read on its own thread: it may trail the banner a little.
    let took_in_copy = || {
        served
            .stderr
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains("took in the copy of the layer"))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !took_in_copy() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(took_in_copy(), "the restart took the layer copy in");
    restarted_exactly_once(&setup, &served, &acknowledged, attempted).await;
    assert!(served.terminate().success());
    let (matched, replayed, live) = replay(dir.path());
    assert!(matched, "replay {replayed} differs from live {live}");
}

/// Copies go on while a checkpoint writes, once its stage file is durable: staged
/// checkpoints of `CHECKPOINT_KEYS` keys and a copy every 20 ms. The test kills the
/// server once two copies were written after the stage file it still sees: one copy
/// at a time is in flight, so the second began after the stage was written, and was
/// made over what sled holds once that stage is written. If that stage is still there
/// after the kill, the restart takes it in, then the copy (it says so); either way
/// what it holds is exact and matches a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sigkill_after_a_copy_made_while_a_stage_is_written_restarts_exactly() {
    const CHECKPOINT_KEYS: &str = "20000";
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(
        dir.path(),
        &[
            "--checkpoint-keys",
            CHECKPOINT_KEYS,
            "--layer-copy-ms",
            "20",
        ],
    );
    let setup = Arc::new(Setup::new(&served, &[count_meter(), unique_users_meter()]).await);
    let load = setup.load(8, 50);
    let projections = dir.path().join("projections");
    let stage = projections.join(tally_projection::sled_store::STAGE_FILE);
    let copy = projections.join(tally_projection::sled_store::LAYER_COPY_FILE);
    let modified = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    // The stage file's time, and the times of the copies written after it.
    let mut seen: Option<(std::time::SystemTime, HashSet<std::time::SystemTime>)> = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let staged_at = loop {
        match (modified(&stage), modified(&copy)) {
            (Some(staged), Some(copied)) if copied > staged => {
                let copies = match &mut seen {
                    Some((at, copies)) if *at == staged => copies,
                    _ => &mut seen.insert((staged, HashSet::new())).1,
                };
                copies.insert(copied);
                if copies.len() >= 2 {
                    break staged;
                }
            }
            _ => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no two layer copies after one stage file within 120 s of load"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    served.kill();
    let interrupted = modified(&stage) == Some(staged_at)
        && modified(&copy).is_some_and(|copied| copied > staged_at);
    eprintln!("killed with that stage interrupted: {interrupted}");
    let (acknowledged, attempted) = load.finish().await;
    assert!(!acknowledged.is_empty(), "load ran before the kill");

    let served = serve(dir.path());
    if interrupted {
        let logged = |needle: &str| {
            served
                .stderr
                .lock()
                .unwrap()
                .iter()
                .find(|line| line.contains(needle))
                .cloned()
        };
        // The log lines are read on their own thread: they may trail the banner.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while logged("took in the copy of the layer").is_none()
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let stage = logged("found the stage of a checkpoint").expect("the restart found the stage");
        let copy = logged("took in the copy of the layer").expect("the restart took in the copy");
        // A stage sled had written before the kill (its file not yet removed) is
        // done, so the copy was made over what sled holds; otherwise over the stage.
        let passed = stage.contains("passed=true");
        assert!(
            copy.contains(&format!("over_stage={}", !passed)),
            "the copy is taken over the stage exactly when sled had not written it: {stage} / {copy}"
        );
    }
    restarted_exactly_once(&setup, &served, &acknowledged, attempted).await;
    assert!(served.terminate().success());
    let (matched, replayed, live) = replay(dir.path());
    assert!(matched, "replay {replayed} differs from live {live}");
}

/// A correction sent while the load runs.
#[derive(Debug, Clone)]
enum Correction {
    /// A void of these ids.
    Void(Vec<String>),
    /// An amendment of `original`, whose replacement takes the id `replacement`.
    Amend {
        original: String,
        replacement: String,
    },
}

/// The corrections sent, each with whether it was answered 200 (`None` once the
/// server died).
type Corrections = Arc<Mutex<Vec<(Correction, Option<u16>)>>>;

/// One client correcting acknowledged events until the server dies, each event
/// once: voids of ten, and every fourth request an amendment of one.
fn correct_while_loading(
    setup: &Arc<Setup>,
    load: &Load,
) -> (Corrections, tokio::task::JoinHandle<()>) {
    let requests: Corrections = Arc::default();
    let (setup, acknowledged, sent) = (setup.clone(), load.acknowledged.clone(), requests.clone());
    let client = tokio::spawn(async move {
        let mut next = 0;
        for number in 0.. {
            let ids: Vec<String> = loop {
                let ids: Vec<String> = {
                    let acknowledged = acknowledged.lock().unwrap();
                    // Every third acknowledged event, so corrected and counted
                    // events share their batches and minutes.
                    acknowledged
                        .iter()
                        .skip(next)
                        .step_by(3)
                        .take(10)
                        .cloned()
                        .collect()
                };
                if ids.len() == 10 {
                    next += 30;
                    break ids;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let (correction, answer) = if number % 4 == 3 {
                let (original, replacement) = (ids[0].clone(), format!("amended-{number}"));
                let answer = post(
                    &setup.http,
                    &format!("{}/v1/events/{original}/amend", setup.base),
                    &setup.key,
                    json!({"event": {"event_id": replacement, "properties": {"user": replacement}}, "reason": "crash test"}),
                )
                .await;
                (
                    Correction::Amend {
                        original,
                        replacement,
                    },
                    answer,
                )
            } else {
                let answer = post(
                    &setup.http,
                    &format!("{}/v1/events/void", setup.base),
                    &setup.key,
                    json!({"event_ids": ids, "reason": "crash test"}),
                )
                .await;
                (Correction::Void(ids), answer)
            };
            let status = answer.as_ref().ok().map(|(status, _)| *status);
            if let Ok((status, body)) = &answer {
                assert!(
                    *status == 200 || *status == 503,
                    "{correction:?} answered {status}: {body}"
                );
            }
            sent.lock().unwrap().push((correction, status));
            if status.is_none() {
                break; // the server died
            }
        }
    });
    (requests, client)
}

/// Every event the server at `base` holds, voided ones too, by id: whether voided.
async fn listed_events(setup: &Setup, base: &str) -> std::collections::HashMap<String, bool> {
    let mut events = std::collections::HashMap::new();
    let mut after: Option<String> = None;
    loop {
        let cursor = after
            .map(|id| format!("&starting_after={id}"))
            .unwrap_or_default();
        let (status, page) = get(
            &setup.http,
            &format!("{base}/v1/events?limit=100&include_voided=true{cursor}"),
            &setup.key,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let data = page["data"].as_array().unwrap();
        for event in data {
            let id = event["event_id"].as_str().unwrap().to_string();
            let voided = event["voided"].as_bool().unwrap();
            assert!(events.insert(id, voided).is_none(), "an event listed twice");
        }
        if page["has_more"] != true {
            return events;
        }
        after = data
            .last()
            .map(|e| e["event_id"].as_str().unwrap().to_string());
    }
}

/// Voids and amendments go through the log like everything else: a SIGKILL while
/// events are ingested and corrected, with checkpoints in flight, loses no
/// acknowledged correction; one whose answer the kill cut off holds whole or not
/// at all (a void for all its ids or none, an amendment's void with its
/// replacement); and both meters (count, and unique, which a void must rebuild
/// exactly) count exactly the stored events not voided, as a replay of the log
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_corrections_survive_sigkill_mid_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(dir.path(), &["--checkpoint-keys", "3000"]);
    let setup = Arc::new(Setup::new(&served, &[count_meter(), unique_users_meter()]).await);
    let load = setup.load(4, 20);
    let (corrections, correcting) = correct_while_loading(&setup, &load);
    let answered = |corrections: &Corrections| {
        corrections
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, status)| *status == Some(200))
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while answered(&corrections) < 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "no corrections within 60 s: {:?}",
            corrections.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    projection_file_appears(dir.path(), tally_projection::sled_store::STAGE_FILE).await;
    served.kill();
    let (acknowledged, _) = load.finish().await;
    correcting.await.unwrap();
    let corrections = corrections.lock().unwrap().clone();

    let served = serve(dir.path());
    let base = served.test_url.clone();
    let (ready, _) = get(&setup.http, &format!("{base}/readyz"), &setup.key).await;
    assert_eq!(ready, 200);
    let events = listed_events(&setup, &base).await;
    for id in &acknowledged {
        assert!(events.contains_key(id), "acknowledged event {id} lost");
    }
    let mut asked_to_void = HashSet::new();
    for (correction, status) in &corrections {
        let acknowledged = *status == Some(200);
        match correction {
            Correction::Void(ids) => {
                let voided = ids.iter().filter(|id| events[id.as_str()]).count();
                if acknowledged {
                    assert_eq!(voided, ids.len(), "an acknowledged void was lost: {ids:?}");
                } else {
                    assert!(
                        voided == 0 || voided == ids.len(),
                        "a void held for {voided} of its {} ids",
                        ids.len()
                    );
                }
                asked_to_void.extend(ids.iter().cloned());
            }
            Correction::Amend {
                original,
                replacement,
            } => {
                let voided = events[original.as_str()];
                let stored = events.get(replacement.as_str()) == Some(&false);
                assert_eq!(
                    voided, stored,
                    "{original} voided: {voided}, its replacement stored: {stored}"
                );
                assert!(
                    stored || !acknowledged,
                    "an acknowledged amendment was lost: {original}"
                );
                asked_to_void.insert(original.clone());
            }
        }
    }
    let voided: Vec<&String> = events
        .iter()
        .filter(|(_, voided)| **voided)
        .map(|(id, _)| id)
        .collect();
    assert!(
        voided.iter().all(|id| asked_to_void.contains(*id)),
        "an event voided unasked"
    );
    let counted = events.len() - voided.len();
    for meter_id in &setup.meter_ids {
        assert_eq!(
            setup.counted(&base, meter_id).await,
            counted,
            "meter {meter_id}: {} stored, {} voided",
            events.len(),
            voided.len()
        );
    }
    eprintln!(
        "{} events stored, {} voided, {} corrections",
        events.len(),
        voided.len(),
        corrections.len()
    );
    assert!(served.terminate().success());
    let (matched, replayed, live) = replay(dir.path());
    assert!(matched, "replay {replayed} differs from live {live}");
}
