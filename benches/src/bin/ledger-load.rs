//! Credits ledger benchmark (README, "Credits ledger"): debit transactions per second over HTTP
//! against a running `tally serve` it starts itself, (a) spread over many accounts and
//! (b) all on one hot account, with latency percentiles; then (c) reserve + commit
//! pairs spread over the same accounts, and (d) debits spread over accounts holding
//! 20 active grants each, both against (a) in the same run. The four scenarios take
//! turns (`--turns`), so each ratio compares steps measured on a ledger of about the
//! same size and in the same stretch of a shared machine's time, not (c) and (d) on
//! a ledger (a) has already grown. Each scenario also reports the server's CPU time
//! per step. `--growth-rounds N` then repeats (a) N times on the grown ledger, to
//! show whether a debit's cost stays flat.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rand::Rng;
use serde_json::json;
use tally_benches::{cpu_seconds, percentile, start_server};

/// Accounts of scenario (d), each holding 20 active grants.
const GRANTED_ACCOUNTS: usize = 1_000;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "target/release/tally")]
    tally_bin: String,
    #[arg(long, default_value_t = 10_000)]
    accounts: usize,
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Seconds per scenario in each turn.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Times the four scenarios run, one after another in each turn; each line
    /// sums a scenario's turns.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Seconds of (a) before the first turn, not counted: a debit on a store this
    /// new is cheaper than on one that has taken a few thousand (docs/benchmarks.md, "A
    /// debit's cost as the ledger grows"), which would flatter the first (a).
    #[arg(long, default_value_t = 5.0)]
    warmup_seconds: f64,
    /// After the four scenarios, run (a) (or (b), see `--growth-on`) this many more
    /// times and print each round: how a debit's cost moves as the ledger grows
    /// (docs/benchmarks.md, "A debit's cost as the ledger grows").
    #[arg(long, default_value_t = 0)]
    growth_rounds: usize,
    /// The accounts the growth rounds debit.
    #[arg(long, value_enum, default_value_t = GrowthOn::Spread)]
    growth_on: GrowthOn,
}

/// Which scenario `--growth-rounds` repeats.
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum GrowthOn {
    /// (a): a random one of all the accounts each time.
    Spread,
    /// (b): the one hot account.
    Hot,
}

/// What one step of a scenario sends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Work {
    /// One debit of 1.
    Debit,
    /// A hold of 1, then its commit: one debit through a reservation.
    ReserveCommit,
}

/// POSTs `body` and insists on a 200; answers the body.
async fn post_ok(
    http: &reqwest::Client,
    url: String,
    key: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let r = http
        .post(url)
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap_or_default()
}

/// What every scenario runs against.
struct Load<'a> {
    http: &'a reqwest::Client,
    base: &'a str,
    key: &'a str,
    connections: usize,
    seconds: f64,
    /// The server's process, whose CPU time is measured.
    pid: u32,
}

async fn scenario(
    load: &Load<'_>,
    accounts: Arc<Vec<String>>,
    tag: &str,
    work: Work,
) -> anyhow::Result<Measured> {
    let Load {
        http,
        base,
        key,
        connections,
        seconds,
        pid,
    } = *load;
    let cpu_before = cpu_seconds(pid)?;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..connections {
        let (http, base, key, accounts, stop, done) = (
            http.clone(),
            base.to_string(),
            key.to_string(),
            accounts.clone(),
            stop.clone(),
            done.clone(),
        );
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let account = accounts[rand::rng().random_range(0..accounts.len())].clone();
                n += 1;
                let t = Instant::now();
                let idempotency_key = format!("{tag}-{c}-{n}");
                let accounts = format!("{base}/v1/customer-credits/accounts/{account}");
                match work {
                    Work::Debit => {
                        post_ok(
                            &http,
                            format!("{accounts}/debit"),
                            &key,
                            json!({"amount": "1", "idempotency_key": idempotency_key}),
                        )
                        .await;
                    }
                    Work::ReserveCommit => {
                        let held = post_ok(
                            &http,
                            format!("{accounts}/reservations"),
                            &key,
                            json!({"amount": "1", "idempotency_key": idempotency_key}),
                        )
                        .await;
                        let id = held["id"].as_str().unwrap_or_default();
                        post_ok(
                            &http,
                            format!("{base}/v1/customer-credits/reservations/{id}/commit"),
                            &key,
                            json!({}),
                        )
                        .await;
                    }
                }
                latencies.push(t.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
            }
            latencies
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    latencies.sort();
    let done = done.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Measured {
        rate: done as f64 / elapsed,
        latencies,
        cpu_per_step: (cpu_seconds(pid)? - cpu_before) / done.max(1) as f64,
        steps: done,
        seconds: elapsed,
    })
}

/// What one scenario measured.
struct Measured {
    /// Steps per second.
    rate: f64,
    latencies: Vec<Duration>,
    /// The server's CPU time (user + system) per step, from the scenario's start to
    /// its end, background work included: steadier than a rate on a shared
    /// machine, as in `ingest-load`.
    cpu_per_step: f64,
    /// Steps done, and the seconds they took.
    steps: u64,
    seconds: f64,
}

impl Measured {
    /// Several turns of one scenario as one: steps over the time they took, CPU
    /// per step over all of them.
    fn sum(turns: Vec<Measured>) -> Measured {
        let steps: u64 = turns.iter().map(|m| m.steps).sum();
        let seconds: f64 = turns.iter().map(|m| m.seconds).sum();
        let cpu: f64 = turns.iter().map(|m| m.cpu_per_step * m.steps as f64).sum();
        let mut latencies: Vec<Duration> = turns.into_iter().flat_map(|m| m.latencies).collect();
        latencies.sort();
        Measured {
            rate: steps as f64 / seconds.max(f64::EPSILON),
            latencies,
            cpu_per_step: cpu / steps.max(1) as f64,
            steps,
            seconds,
        }
    }

    /// The scenario's line: rate (against `baseline`'s, if given), latency
    /// percentiles per `step`, and the server's CPU per step.
    fn summary(&self, step: &str, baseline: Option<(&str, &Measured)>) -> String {
        let ratio = baseline
            .map(|(name, b)| format!(" ({:.2} of {name})", self.rate / b.rate))
            .unwrap_or_default();
        format!(
            "{:.0} debits/s{ratio}, p50 {:.2?}, p99 {:.2?} per {step}, server CPU {:.0} µs per {step}",
            self.rate,
            percentile(&self.latencies, 50.0),
            percentile(&self.latencies, 99.0),
            self.cpu_per_step * 1e6
        )
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let temp = tempfile::tempdir()?;
    let (child, base, key) = start_server(&args.tally_bin, &temp.path().display().to_string())?;
    let mut child = tally_benches::ServerChild(child);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.connections + 8)
        .build()?;
    // Setup goes through the typed client; the debit loop sends prebuilt bodies
    // and reads only the status (the load generator shares the machine).
    let tally = tally_client::Client::new(&base, &key);
    let customer_id = tally
        .create_customer(&tally_client::CustomerCreate {
            email: "bench@x.io".into(),
            ..Default::default()
        })
        .await?
        .id;
    eprintln!("creating {} accounts...", args.accounts);
    let mut tasks = Vec::new();
    for w in 0..32 {
        let (tally, customer_id, total) = (tally.clone(), customer_id.clone(), args.accounts);
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in (w..total).step_by(32) {
                let account = tally
                    .create_account(&tally_client::AccountCreate {
                        customer_id: customer_id.clone(),
                        name: Some(format!("acct-{i}")),
                        initial_balance: Some("1000000000".into()),
                        ..Default::default()
                    })
                    .await?;
                ids.push(account.id);
            }
            Ok::<_, tally_client::Error>(ids)
        }));
    }
    let mut accounts = Vec::new();
    for t in tasks {
        accounts.extend(t.await??);
    }
    // (d)'s accounts: 19 grants each besides the initial balance's, of mixed
    // priorities and expiries far ahead, so a debit reads and draws from 20.
    let granted: Vec<String> = accounts.iter().take(GRANTED_ACCOUNTS).cloned().collect();
    eprintln!(
        "granting 19 more grants to each of {} accounts...",
        granted.len()
    );
    let mut tasks = Vec::new();
    for (w, chunk) in granted
        .chunks(granted.len().div_ceil(32).max(1))
        .enumerate()
    {
        let (http, base, key, chunk) = (http.clone(), base.clone(), key.clone(), chunk.to_vec());
        tasks.push(tokio::spawn(async move {
            for account in chunk {
                for g in 0..19 {
                    let mut body = json!({"amount": "1000000", "idempotency_key": format!("grant-{w}-{account}-{g}"), "priority": (g * 5) % 101});
                    if g % 2 == 0 {
                        body["expires_at"] = json!("2099-01-01T00:00:00Z");
                    }
                    post_ok(
                        &http,
                        format!("{base}/v1/customer-credits/accounts/{account}/grants"),
                        &key,
                        body,
                    )
                    .await;
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let granted_accounts = granted.len();
    let granted = Arc::new(granted);
    let load = Load {
        http: &http,
        base: &base,
        key: &key,
        connections: args.connections,
        seconds: args.seconds,
        pid: child.id(),
    };
    let hot_account = Arc::new(vec![accounts[0].clone()]);
    let spread_accounts = Arc::new(accounts);
    if args.warmup_seconds > 0.0 {
        let warmup = Load {
            seconds: args.warmup_seconds,
            ..load
        };
        let measured = scenario(&warmup, spread_accounts.clone(), "warmup", Work::Debit).await?;
        eprintln!("warm-up (not counted): {:.0} debits/s", measured.rate);
    }
    let mut turns: [Vec<Measured>; 4] = Default::default();
    for turn in 0..args.turns.max(1) {
        // Each turn's idempotency keys are its own (a key sent again would be
        // answered from the first outcome, not debited).
        let runs = [
            (spread_accounts.clone(), "spread", Work::Debit),
            (hot_account.clone(), "hot", Work::Debit),
            (spread_accounts.clone(), "reserve", Work::ReserveCommit),
            (granted.clone(), "granted", Work::Debit),
        ];
        for (i, (accounts, tag, work)) in runs.into_iter().enumerate() {
            let measured = scenario(&load, accounts, &format!("{tag}{turn}"), work).await?;
            eprintln!(
                "turn {} {tag}: {:.0} steps/s, server CPU {:.0} µs per step",
                turn + 1,
                measured.rate,
                measured.cpu_per_step * 1e6
            );
            turns[i].push(measured);
        }
    }
    let [spread, hot, reserved, granted] = turns.map(Measured::sum);
    let (grown, growth_baseline, growth_name) = match args.growth_on {
        GrowthOn::Spread => (spread_accounts.clone(), &spread, "(a)"),
        GrowthOn::Hot => (hot_account, &hot, "(b)"),
    };
    let mut rounds = Vec::new();
    for round in 0..args.growth_rounds {
        let tag = format!("growth{round}");
        rounds.push(scenario(&load, grown.clone(), &tag, Work::Debit).await?);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    println!(
        "(a) spread over {} accounts: {}",
        args.accounts,
        spread.summary("debit", None)
    );
    println!(
        "(b) one hot account:          {}",
        hot.summary("debit", None)
    );
    println!(
        "(c) reserve + commit, spread: {}",
        reserved.summary("pair", Some(("(a)", &spread)))
    );
    println!(
        "(d) spread over {} accounts of 20 grants: {}",
        granted_accounts,
        granted.summary("debit", Some(("(a)", &spread)))
    );
    // Debits booked before each round: the four scenarios', then the rounds'.
    let mut booked = [&spread, &hot, &reserved, &granted]
        .iter()
        .map(|m| m.steps as f64)
        .sum::<f64>();
    for (round, measured) in rounds.iter().enumerate() {
        println!(
            "(e) round {} of {growth_name}, after ~{:.0} debits: {}",
            round + 1,
            booked,
            measured.summary("debit", Some((growth_name, growth_baseline)))
        );
        booked += measured.steps as f64;
    }
    println!(
        "({} connections, {} turns of {} s per scenario)",
        args.connections,
        args.turns.max(1),
        args.seconds
    );
    Ok(())
}
