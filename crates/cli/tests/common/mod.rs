//! Runs the real `tally` binary as a child process for persistence and crash tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

pub struct Served {
    pub child: Child,
    pub prod_url: String,
    pub test_url: String,
    /// Keys printed on the first start only.
    pub test_key: Option<String>,
    pub stdout: Vec<String>,
    /// The server's log so far (it is also echoed to the test's stderr).
    pub stderr: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

pub fn tally() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tally"))
}

/// Starts `tally serve` on free loopback ports and waits for its banner.
pub fn serve(data_dir: &Path) -> Served {
    serve_with(data_dir, &[])
}

/// `serve` with extra flags (e.g. the Kafka log).
pub fn serve_with(data_dir: &Path, extra: &[&str]) -> Served {
    serve_on(data_dir, "127.0.0.1:0", "127.0.0.1:0", extra)
}

/// `serve_with` on the given listener addresses.
pub fn serve_on(data_dir: &Path, listen: &str, test_listen: &str, extra: &[&str]) -> Served {
    started(serve_command(data_dir, listen, test_listen, extra), listen)
}

/// `serve` with its command adjusted first (e.g. its environment).
pub fn serve_adjusted(data_dir: &Path, adjust: impl FnOnce(&mut Command)) -> Served {
    let listen = "127.0.0.1:0";
    let mut command = serve_command(data_dir, listen, listen, &[]);
    adjust(&mut command);
    started(command, listen)
}

fn serve_command(data_dir: &Path, listen: &str, test_listen: &str, extra: &[&str]) -> Command {
    let mut command = tally();
    command
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args([
            "--listen",
            listen,
            "--test-listen",
            test_listen,
            "--rate-limit-per-second",
            "1000000",
            "--rate-limit-burst",
            "1000000",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Spawns `command` and waits for its banner; `listen` names the node in its log lines.
fn started(mut command: Command, listen: &str) -> Served {
    let mut child = command.spawn().expect("spawn tally serve");
    let stderr = child.stderr.take().unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = log.clone();
    // Several nodes of one test print here: each line names its node's listener.
    let node = listen.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[tally {node}] {line}");
            kept.lock().unwrap().push(line);
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stdout = Vec::new();
    let (mut prod_url, mut test_url, mut test_key) = (None, None, None);
    for line in lines.by_ref() {
        let line = line.expect("read banner");
        let field = |prefix: &str| {
            line.trim()
                .strip_prefix(prefix)
                .map(|rest| rest.split_whitespace().next().unwrap().to_string())
        };
        if let Some(url) = field("production API:") {
            prod_url = Some(url);
        }
        if let Some(url) = field("test API:") {
            test_url = Some(url);
        }
        if let Some(key) = field("test key:") {
            test_key = Some(key);
        }
        let done = line.starts_with("Try:") || line.trim().starts_with("stores:");
        stdout.push(line);
        if done {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Served {
        child,
        prod_url: prod_url.expect("banner names the production listener"),
        test_url: test_url.expect("banner names the test listener"),
        test_key,
        stdout,
        stderr: log,
    }
}

/// A test that fails mid-way must not leave its server running.
impl Drop for Served {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Served {
    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        for _ in 0..300 {
            if let Some(exit) = self.child.try_wait().unwrap() {
                return exit;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child.kill().unwrap();
        panic!("tally did not stop within 15 s of SIGTERM");
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

pub async fn post(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: Value,
) -> Result<(u16, Value), reqwest::Error> {
    let response = http
        .post(url)
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await.unwrap_or(Value::Null)))
}

pub async fn get(http: &reqwest::Client, url: &str, key: &str) -> (u16, Value) {
    let response = http.get(url).header("x-api-key", key).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `tally replay` of a stopped node's data dir: whether it matched, the replayed
/// digest, the live digest.
pub fn replay(dir: &std::path::Path) -> (bool, String, String) {
    replay_with(dir, &[])
}

/// `replay` with the node's log flags (e.g. its Kafka topic).
pub fn replay_with(dir: &std::path::Path, flags: &[&str]) -> (bool, String, String) {
    let output = tally()
        .args(["replay", "--data-dir"])
        .arg(dir)
        .args(flags)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let digest = |label: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(label).map(|d| d.trim().to_string()))
            .unwrap_or_else(|| panic!("no `{label}` in {stdout}"))
    };
    (
        output.status.success(),
        digest("replayed projection digest:"),
        digest("live projection digest:"),
    )
}

/// The report of `tally ledger verify` on a stopped data dir, which must pass.
pub struct VerifyReport(pub String);

impl VerifyReport {
    /// The value of its `label` line (e.g. `accounts:`).
    pub fn value(&self, label: &str) -> String {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(label))
            .unwrap_or_else(|| panic!("{label} in {}", self.0))
            .trim()
            .to_string()
    }
}

/// Runs `tally ledger verify` on `dir` and asserts it passed.
pub fn verify_passing(dir: &Path) -> VerifyReport {
    let output = tally()
        .args(["ledger", "verify", "--data-dir"])
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    VerifyReport(stdout)
}
