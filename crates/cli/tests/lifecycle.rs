//! Process lifecycle: graceful SIGTERM exits 0 and keeps everything; a restart keeps
//! data and keys; `tally replay` reproduces the projection digest, twice the same.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_graceful_and_replay_reproduces_the_digest() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    assert!(
        served
            .stdout
            .iter()
            .any(|l| l.contains("test key: tally_test_")),
        "{:?}",
        served.stdout
    );
    let key = served.test_key.clone().unwrap();
    let base = served.test_url.clone();
    let http = reqwest::Client::new();
    let (_, customer) = post(
        &http,
        &format!("{base}/v1/customers"),
        &key,
        json!({"email": "l@x.io"}),
    )
    .await
    .unwrap();
    let (_, meter) = post(&http, &format!("{base}/v1/meters"), &key, json!({"name": "sum", "event_name": "e", "aggregation": "sum", "aggregation_property": "n"})).await.unwrap();
    let events: Vec<_> = (0..50).map(|i| json!({"name": "e", "customer_id": customer["id"], "event_id": format!("l{i}"), "properties": {"n": format!("{i}.5")}})).collect();
    let (status, _) = post(
        &http,
        &format!("{base}/v1/events/ingest"),
        &key,
        json!({"events": events}),
    )
    .await
    .unwrap();
    assert_eq!(status, 202);
    let meter_id = meter["id"].as_str().unwrap().to_string();
    // Let the projector apply, then stop gracefully.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let exit = served.terminate();
    assert_eq!(exit.code(), Some(0), "SIGTERM is a clean exit");

    let (matched, replayed, live) = replay(dir.path());
    assert!(matched, "live projection equals a replay");
    assert_eq!(replayed, live);
    let (_, replayed_again, _) = replay(dir.path());
    assert_eq!(
        replayed_again, replayed,
        "two replays of one log give one digest"
    );

    let served = serve(dir.path());
    assert!(served.test_key.is_none());
    let base = served.test_url.clone();
    let (status, usage) = get(&http, &format!("{base}/v1/meters/{meter_id}/usage"), &key).await;
    assert_eq!(status, 200, "the key still works after a restart");
    // 0.5 + 1.5 + ... + 49.5 = 1250
    assert_eq!(usage["value"], "1250");
    served.terminate();
}

/// A stop asked for while the server still starts (here right after it opened its
/// store, before it caught up with the log and said it serves) is a clean stop:
/// the handlers are installed first, so the signal neither kills it nor is lost.
#[test]
fn sigterm_while_starting_is_a_clean_exit() {
    use std::io::{BufRead, BufReader};
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tally()
        .args(["serve", "--data-dir"])
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = |wait: Duration| lines.recv_timeout(wait).ok();
    loop {
        let line = next(Duration::from_secs(30)).expect("the server logs its start-up");
        if line.contains("opened the log and the projection store") {
            break;
        }
    }
    let signalled = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let mut rest = Vec::new();
    while let Some(line) = next(Duration::from_secs(15)) {
        rest.push(line);
    }
    let exit = child.wait().unwrap();
    assert_eq!(exit.code(), Some(0), "a clean exit, not a kill: {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("stopped cleanly")),
        "{rest:?}"
    );
}

/// The server runs without transparent huge pages (`without_transparent_huge_pages`
/// in main.rs: with them its peak memory under ingest was 60-100 MiB higher), whatever
/// the machine's default.
#[cfg(target_os = "linux")]
#[test]
fn the_server_runs_without_transparent_huge_pages() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let status = std::fs::read_to_string(format!("/proc/{}/status", served.child.id())).unwrap();
    let line = status.lines().find(|l| l.starts_with("THP_enabled:"));
    served.terminate();
    // Kernels before 5.0 do not report it; there is nothing to check on them.
    if let Some(line) = line {
        assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    }
}

/// The server runs with mimalloc's purge delay at `PURGE_DELAY_MS` (main.rs: 100 ms,
/// ~100 MiB less at a ten-million-event peak) unless its environment names one, and
/// the operator's value is then kept; `tally` sets it by running itself again in the
/// same process, so the PID a supervisor holds is still the server's.
#[cfg(target_os = "linux")]
#[test]
fn the_server_runs_with_a_short_purge_delay_unless_told_otherwise() {
    let environ = |served: &Served| {
        let raw = std::fs::read(format!("/proc/{}/environ", served.child.id())).unwrap();
        raw.split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .filter(|v| v.starts_with("MIMALLOC_PURGE_DELAY="))
            .collect::<Vec<_>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let served = serve_adjusted(dir.path(), |c| {
        c.env_remove("MIMALLOC_PURGE_DELAY");
    });
    // Only the image `tally` ran again has the variable, under the PID it was given.
    assert_eq!(environ(&served), ["MIMALLOC_PURGE_DELAY=100"]);
    // SIGTERM to that PID still reaches the server, which stops gracefully.
    assert!(served.terminate().success());

    let served = serve_adjusted(dir.path(), |c| {
        c.env("MIMALLOC_PURGE_DELAY", "250");
    });
    assert_eq!(environ(&served), ["MIMALLOC_PURGE_DELAY=250"]);
    assert!(served.terminate().success());
}

#[test]
fn help_explains_every_flag() {
    let output = tally().args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--data-dir",
        "--listen",
        "--test-listen",
        "--log",
        "--kafka-brokers",
        "--kafka-fetch-wait-ms",
        "--log-format",
        "--rate-limit-per-second",
        "TALLY_DATA_DIR",
        "TALLY_ADMIN_TOKEN",
        "--cluster",
        "--checkpoint-keys",
        "MIMALLOC_PURGE_DELAY",
    ] {
        assert!(
            help.contains(flag),
            "`serve --help` mentions {flag}:\n{help}"
        );
    }
    let replay_running = tally().args(["replay", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&replay_running.stdout).contains("Stop the server first"));
}

/// A cluster shares a Kafka topic: `--cluster` on the embedded log, or a name that
/// cannot be part of a consumer group id, is refused before anything starts.
#[test]
fn a_cluster_needs_kafka_and_a_plain_name() {
    let dir = tempfile::tempdir().unwrap();
    let output = tally()
        .args(["serve", "--cluster", "c1", "--data-dir"])
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--cluster needs --log kafka"), "{stderr}");
    let output = tally()
        .args(["serve", "--cluster", "a b", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("a cluster name is 1 to"), "{stderr}");
}

/// A fetch wait outside 1..=`MAX_FETCH_WAIT_MS` is refused, naming the flag and the
/// range, before anything starts: 0 would make idle readers spin against the broker,
/// and a longer wait than the limit would outlast `read_end`'s wait for an answer.
#[test]
fn a_fetch_wait_out_of_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let max = tally_log::kafka::MAX_FETCH_WAIT_MS;
    for bad in ["0".to_string(), (max + 1).to_string(), "soon".to_string()] {
        let mut child = tally()
            .args(["serve", "--log", "kafka", "--kafka-fetch-wait-ms", &bad])
            .args(["--kafka-brokers", "127.0.0.1:1", "--data-dir"])
            .arg(dir.path().join("d"))
            .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A value let through would start a server that waits for the (absent)
        // broker: fail at a deadline rather than hang.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("--kafka-fetch-wait-ms {bad} was accepted");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{bad}: {stderr}");
        assert!(stderr.contains("--kafka-fetch-wait-ms"), "{bad}: {stderr}");
        assert!(
            !dir.path().join("d").exists(),
            "{bad}: the data dir was created"
        );
    }
    let output = tally()
        .args(["serve", "--kafka-fetch-wait-ms", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&format!("1..={max}")), "{stderr}");
}

/// A weak `TALLY_ADMIN_TOKEN` is refused before the data dir is opened: the error
/// comes at once (not after a restart's catch-up), and nothing is written.
#[test]
fn a_weak_admin_token_is_refused_before_the_data_dir_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let output = tally()
        .args(["serve", "--data-dir"])
        .arg(&data_dir)
        .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
        .env("TALLY_ADMIN_TOKEN", "short")
        // Set on many machines: the refusal must still be its own line, not one
        // line under forty of a stack backtrace.
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("Error: TALLY_ADMIN_TOKEN must be a random secret"),
        "{stderr}"
    );
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
    assert!(!data_dir.exists(), "the data dir was created: {stderr}");
}

/// A failure with causes prints each on its own line after the error (what was
/// being done, then why), and no backtrace.
#[test]
fn a_failure_prints_its_causes_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    // A data dir that is a file: opening the log under it fails with the OS's reason.
    let data_dir = dir.path().join("not-a-dir");
    std::fs::write(&data_dir, b"x").unwrap();
    let output = tally()
        .args(["serve", "--data-dir"])
        .arg(&data_dir)
        .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.contains(" INFO ")).collect();
    assert!(lines.len() >= 2, "the OS's reason is missing: {stderr}");
    assert!(lines[0].starts_with("Error: "), "{stderr}");
    assert!(
        lines[1..].iter().all(|l| l.starts_with("  caused by: ")),
        "{stderr}"
    );
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
}

#[test]
fn replay_refuses_a_data_dir_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path());
    let output = tally()
        .args(["replay", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    served.terminate();
}
