//! What the bucket layout costs a checkpoint as the store grows: the same
//! checkpoints written to three sled stores (`SledStore`, the service's settings,
//! none packing its keys), one keyed as bucket keys are (table, scope, meter,
//! customer, minute: a minute's buckets land beside each series' older minutes, all
//! over the table), one with the minute before the customer (a minute's buckets are
//! contiguous, at the end of each meter's range), and one row per customer and
//! minute holding all its meters (the bucket keys' order, a twentieth of the keys,
//! each value 20 buckets long). The measurement that chose the third, which the
//! service's store now keeps (docs/benchmarks.md, "Ten million events on this build, and what
//! bends the rate late", and "Bucket rows").
//!
//! Each simulated minute writes `--checkpoints-per-minute` checkpoints, each a
//! random half of the minute's buckets (customers x meters), sorted as the
//! write-back layer sorts them; the layouts take turns checkpoint by checkpoint,
//! so a noisy neighbour slows them all.

use std::time::Instant;

use clap::Parser;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tally_core::keys::{self, BucketKey, Key};
use tally_domain::Mode;
use tally_projection::sled_store::SledStore;
use tally_projection::{Change, ProjectionStore};

#[derive(Parser, Debug)]
#[command(about = "Checkpoint cost by bucket layout as a sled store grows")]
struct Args {
    /// Customers (each with a bucket per meter and minute).
    #[arg(long, default_value_t = 10_000)]
    customers: usize,
    /// Meters.
    #[arg(long, default_value_t = 20)]
    meters: usize,
    /// Minutes of history to write (at least 1: the summary compares the first and
    /// last quarter of them).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    minutes: i64,
    /// Checkpoints per minute, each writing a random half of the minute's buckets.
    #[arg(long, default_value_t = 2)]
    checkpoints_per_minute: usize,
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Today's: ... meter, customer, minute.
    SeriesFirst,
    /// ... meter, minute, customer.
    MinuteFirst,
    /// ... customer, minute: one row of every meter's bucket.
    CustomerRow,
}

fn key(layout: Layout, meter: &str, customer: &str, minute: i64) -> Vec<u8> {
    const STORE: &str = "st_Q7JNDeAmp76ESdre0rStXezC";
    match layout {
        Layout::SeriesFirst => {
            BucketKey::from_minute(keys::AGGREGATE, STORE, Mode::Prod, meter, customer, minute)
        }
        Layout::MinuteFirst => Key::scoped(keys::AGGREGATE, STORE, Mode::Prod)
            .text(meter)
            .int(minute)
            .text(customer)
            .into_bytes(),
        Layout::CustomerRow => Key::scoped(keys::AGGREGATE, STORE, Mode::Prod)
            .text(customer)
            .int(minute)
            .into_bytes(),
    }
}

fn id(prefix: &str, n: usize) -> String {
    format!("{prefix}_{n:024}")
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let meters: Vec<String> = (0..args.meters).map(|m| id("mtr", m)).collect();
    let customers: Vec<String> = (0..args.customers).map(|c| id("cus", c)).collect();
    let layouts = [
        Layout::SeriesFirst,
        Layout::MinuteFirst,
        Layout::CustomerRow,
    ];
    let dirs = [
        tempfile::tempdir()?,
        tempfile::tempdir()?,
        tempfile::tempdir()?,
    ];
    let stores = [
        SledStore::open(dirs[0].path())?,
        SledStore::open(dirs[1].path())?,
        SledStore::open(dirs[2].path())?,
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let value: Vec<u8> = (0..40).map(|_| rng.random()).collect();
    let row: Vec<u8> = value.repeat(args.meters);
    let pairs: Vec<(usize, usize)> = (0..args.meters)
        .flat_map(|m| (0..args.customers).map(move |c| (m, c)))
        .collect();
    // Seconds spent writing, per layout and minute.
    let mut seconds = vec![[0f64; 3]; args.minutes as usize];
    let mut position = 0u64;
    println!("minute  buckets written  series-first ms  minute-first ms  customer-row ms");
    for minute in 0..args.minutes {
        let minute_ms = minute * 60_000;
        for _ in 0..args.checkpoints_per_minute {
            let mut half = pairs.clone();
            half.shuffle(&mut rng);
            half.truncate(pairs.len() / 2);
            position += 1;
            for (at, layout) in layouts.iter().enumerate() {
                let mut changes: Vec<Change> = match layout {
                    Layout::CustomerRow => half
                        .iter()
                        .map(|(_, c)| *c)
                        .collect::<std::collections::BTreeSet<usize>>()
                        .into_iter()
                        .map(|c| {
                            (
                                key(*layout, "", &customers[c], minute_ms),
                                Some(row.clone()),
                            )
                        })
                        .collect(),
                    _ => half
                        .iter()
                        .map(|(m, c)| {
                            let k = key(*layout, &meters[*m], &customers[*c], minute_ms);
                            (k, Some(value.clone()))
                        })
                        .collect(),
                };
                changes.sort();
                let started = Instant::now();
                stores[at].apply(changes, &[(0, position)])?;
                seconds[minute as usize][at] += started.elapsed().as_secs_f64();
            }
        }
        let [a, b, c] = seconds[minute as usize];
        println!(
            "{minute:>6}  {:>15}  {:>15.0}  {:>15.0}  {:>15.0}",
            pairs.len() / 2 * args.checkpoints_per_minute,
            a * 1000.0,
            b * 1000.0,
            c * 1000.0,
        );
    }
    let quarter = (args.minutes as usize / 4).max(1);
    let sum = |rows: &[[f64; 3]], at: usize| rows.iter().map(|r| r[at]).sum::<f64>();
    let first = &seconds[..quarter];
    let last = &seconds[seconds.len() - quarter..];
    for (at, layout) in layouts.iter().enumerate() {
        println!(
            "{layout:?}: last quarter / first quarter of the minutes, time per checkpoint: {:.2}",
            sum(last, at) / sum(first, at).max(f64::MIN_POSITIVE)
        );
    }
    for (at, layout) in layouts.iter().enumerate().skip(1) {
        println!(
            "series-first / {layout:?} over the last quarter: {:.2}",
            sum(last, 0) / sum(last, at).max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}
