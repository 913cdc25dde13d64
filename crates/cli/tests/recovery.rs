//! Start-up refuses to serve from a log that lost acknowledged records: a
//! projection ahead of the log (a truncated or restored log) and corruption in
//! the middle of the log stop `tally serve` with a message, instead of skipping
//! or silently dropping records.

mod common;

use std::fs::OpenOptions;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::json;

/// Runs `tally serve` expecting it to refuse: its exit status and stderr.
fn refused_start(data_dir: &Path) -> (std::process::ExitStatus, String) {
    let mut child = tally()
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0", "--test-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..400 {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            return (status, stderr);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    panic!("tally serve started on a log that lost records");
}

fn segment(data_dir: &Path) -> std::path::PathBuf {
    data_dir.join("log").join(format!("{:020}.seg", 0))
}

async fn write_some(data_dir: &Path) {
    let served = serve(data_dir);
    let key = served.test_key.clone().unwrap();
    let http = reqwest::Client::new();
    for i in 0..5 {
        let (status, _) = post(
            &http,
            &format!("{}/v1/customers", served.test_url),
            &key,
            json!({"email": format!("c{i}@x.io")}),
        )
        .await
        .unwrap();
        assert_eq!(status, 200);
    }
    assert!(served.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projection_ahead_of_the_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_some(dir.path()).await;
    // The log loses its last records (a restored older backup, a truncation).
    let file = OpenOptions::new()
        .write(true)
        .open(segment(dir.path()))
        .unwrap();
    let len = file.metadata().unwrap().len();
    file.set_len(len - 40).unwrap();
    drop(file);
    let (status, stderr) = refused_start(dir.path());
    assert!(!status.success());
    assert!(stderr.contains("ahead of the log"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_in_the_middle_of_the_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_some(dir.path()).await;
    let path = segment(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12] ^= 0x5a; // inside the first record's payload
    std::fs::write(&path, &bytes).unwrap();
    let (status, stderr) = refused_start(dir.path());
    assert!(!status.success());
    assert!(stderr.contains("offset 0"), "{stderr}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing was cut");
}
