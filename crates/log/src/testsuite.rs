//! The one test suite every [`Log`] implementation must pass. Integration tests of
//! each implementation call [`run_all`] with a factory that can reopen the same log
//! (same directory, same topic) to simulate a restart.
//!
//! Kept in the library (not under `tests/`) so both implementations' test files and
//! any future implementation share exactly the same assertions.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Log, LogEntry, LogError};

/// Opens the log under test. Calling `open` again after dropping the previous
/// handle must give the same log back (a restart).
#[async_trait]
pub trait LogFactory: Send + Sync {
    async fn open(&self) -> Arc<dyn Log>;
}

/// The broker tests of the Kafka path use (`TALLY_TEST_KAFKA_BROKERS`, set by
/// `.ci/run`). Outside CI a missing broker skips those tests with a message; in CI
/// (`CI` set) it fails them, so the Kafka path is never silently untested.
pub fn test_brokers() -> Option<String> {
    match std::env::var("TALLY_TEST_KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => Some(brokers),
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must provide a broker in TALLY_TEST_KAFKA_BROKERS"
            );
            eprintln!("TALLY_TEST_KAFKA_BROKERS not set: Kafka test not run here");
            None
        }
    }
}

/// A topic name no earlier run used (tests share one broker).
pub fn unique_topic(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{prefix}-{nanos}")
}

/// Lowest port [`node_port`] hands out: below it sit well-known services.
const NODE_PORT_FLOOR: u16 = 20_000;

/// A loopback port for a node whose address its peers must know before it starts,
/// and which must get the same port back when it restarts.
///
/// Binding `127.0.0.1:0` and releasing the port is not enough: that port comes from
/// the kernel's ephemeral range, and any outgoing connection (to the broker, to a
/// peer) may take it before the node binds it, or while a killed node is down.
/// So the port is picked below the ephemeral range (`ip_local_port_range`), from a
/// start that differs per call, and checked free now.
pub fn node_port() -> u16 {
    let ephemeral_floor = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let span = ephemeral_floor.saturating_sub(NODE_PORT_FLOOR);
    if span == 0 {
        return any_free_port();
    }
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let seed = std::process::id()
        .wrapping_mul(7_919)
        .wrapping_add(
            CALLS
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                .wrapping_mul(104_729),
        )
        .wrapping_add(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or_default(),
        );
    (0..u32::from(span))
        .map(|step| NODE_PORT_FLOOR + ((seed.wrapping_add(step)) % u32::from(span)) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .unwrap_or_else(any_free_port)
}

/// A port from the ephemeral range, free now.
fn any_free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Generous wait for a reader to see a record; Kafka needs a broker round trip.
const READ_WAIT: Duration = Duration::from_secs(10);

/// Reads `count` records of one partition starting at `from`, failing if they do
/// not arrive in time.
pub async fn read_exactly(log: &dyn Log, partition: u32, from: u64, count: usize) -> Vec<LogEntry> {
    let mut reader = log.reader(partition, from).await.expect("open reader");
    let mut entries = Vec::new();
    let deadline = tokio::time::Instant::now() + READ_WAIT * 3;
    while entries.len() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {count} records arrived",
            entries.len()
        );
        let batch = reader
            .next_batch(count - entries.len(), READ_WAIT)
            .await
            .expect("read batch");
        entries.extend(batch);
    }
    assert_eq!(entries.len(), count, "reader returned more than asked");
    entries
}

fn payload(tag: &str, i: usize) -> Vec<u8> {
    format!("{tag}-{i}").into_bytes()
}

/// Appends land in order with strictly increasing offsets, and each entry's
/// `next_offset` is where the following one starts.
pub async fn append_then_read_in_order(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"customer-a");
    let start = log.end_offset(partition).await.unwrap();
    let mut offsets = Vec::new();
    for i in 0..20 {
        offsets.push(
            log.append(b"customer-a", payload("order", i))
                .await
                .unwrap(),
        );
    }
    assert!(
        offsets.windows(2).all(|w| w[0] < w[1]),
        "offsets increase: {offsets:?}"
    );
    assert!(offsets[0] >= start);
    let entries = read_exactly(log.as_ref(), partition, offsets[0], 20).await;
    for (i, entry) in entries.iter().enumerate() {
        assert_eq!(entry.payload, payload("order", i));
        assert_eq!(entry.offset, offsets[i]);
        if i + 1 < entries.len() {
            assert_eq!(entry.next_offset, entries[i + 1].offset);
        }
    }
    assert_eq!(
        log.end_offset(partition).await.unwrap(),
        entries[19].next_offset
    );
}

/// A reader started at the end sees records appended afterwards (tailing).
pub async fn tailing_reader_sees_later_appends(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"tail");
    let end = log.read_end(partition).await.unwrap();
    let mut reader = log.reader(partition, end).await.unwrap();
    let empty = reader
        .next_batch(10, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(empty.is_empty(), "nothing past the end yet");
    let writer = log.clone();
    let appender = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for i in 0..5 {
            writer.append(b"tail", payload("tail", i)).await.unwrap();
        }
    });
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let batch = reader.next_batch(10, READ_WAIT).await.unwrap();
        assert!(
            !batch.is_empty(),
            "tailing reader timed out with {} records",
            seen.len()
        );
        seen.extend(batch.into_iter().map(|e| e.payload));
    }
    appender.await.unwrap();
    assert_eq!(seen, (0..5).map(|i| payload("tail", i)).collect::<Vec<_>>());
}

/// Concurrent appenders: every acknowledged append is readable exactly once.
pub async fn concurrent_appends_land_exactly_once(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"concurrent");
    let start = log.read_end(partition).await.unwrap();
    let mut tasks = Vec::new();
    for task in 0..16 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                log.append(b"concurrent", payload(&format!("t{task}"), i))
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let entries = read_exactly(log.as_ref(), partition, start, 400).await;
    // A replay that ends at `read_end` misses none of them.
    let end = entries.last().unwrap().next_offset;
    assert_eq!(log.read_end(partition).await.unwrap(), end);
    assert!(log.end_offset(partition).await.unwrap() <= end);
    let distinct: BTreeSet<_> = entries.iter().map(|e| e.payload.clone()).collect();
    assert_eq!(distinct.len(), 400, "no record lost or doubled");
    for task in 0..16 {
        let tag = format!("t{task}-");
        let order: Vec<usize> = entries
            .iter()
            .filter_map(|e| String::from_utf8(e.payload.clone()).ok())
            .filter_map(|p| p.strip_prefix(&tag).map(|n| n.parse().unwrap()))
            .collect();
        assert_eq!(
            order,
            (0..25).collect::<Vec<_>>(),
            "one appender's records keep their order"
        );
    }
}

/// Everything appended survives closing and reopening the log.
pub async fn restart_keeps_every_record(factory: &dyn LogFactory) {
    let (partition, start) = {
        let log = factory.open().await;
        let partition = log.partition_for(b"restart");
        let start = log.read_end(partition).await.unwrap();
        for i in 0..10 {
            log.append(b"restart", payload("restart", i)).await.unwrap();
        }
        (partition, start)
    };
    let log = factory.open().await;
    let entries = read_exactly(log.as_ref(), partition, start, 10).await;
    let payloads: Vec<_> = entries.into_iter().map(|e| e.payload).collect();
    assert_eq!(
        payloads,
        (0..10).map(|i| payload("restart", i)).collect::<Vec<_>>()
    );
    let next = log
        .append(b"restart", payload("restart", 10))
        .await
        .unwrap();
    assert!(next >= start, "offsets continue after a restart");
}

/// A consumer that commits after processing resumes, after a restart, exactly at
/// the first record it had not processed: nothing replayed, nothing skipped.
pub async fn consumer_resumes_without_replay_or_loss(factory: &dyn LogFactory) {
    let group = "suite-consumer";
    let (partition, start) = {
        let log = factory.open().await;
        let partition = log.partition_for(b"resume");
        let start = log.read_end(partition).await.unwrap();
        for i in 0..10 {
            log.append(b"resume", payload("resume", i)).await.unwrap();
        }
        let first_half = read_exactly(log.as_ref(), partition, start, 4).await;
        log.commit(group, partition, first_half[3].next_offset)
            .await
            .unwrap();
        (partition, start)
    };
    let log = factory.open().await;
    let resume_at = log
        .committed(group, partition)
        .await
        .unwrap()
        .expect("a committed offset survives the restart");
    assert!(resume_at > start);
    let rest = read_exactly(log.as_ref(), partition, resume_at, 6).await;
    let payloads: Vec<_> = rest.into_iter().map(|e| e.payload).collect();
    assert_eq!(
        payloads,
        (4..10).map(|i| payload("resume", i)).collect::<Vec<_>>()
    );
}

/// `covers` answers yes for every position up to the end of what was appended, even
/// when the appends were batched (concurrent appenders), and no for positions past
/// the end: a consumer that applied records a log no longer holds is caught.
pub async fn covers_exactly_what_was_appended(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"covers");
    let mut tasks = Vec::new();
    for task in 0..8 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut last = 0;
            for i in 0..10 {
                last = log
                    .append(b"covers", payload(&format!("c{task}"), i))
                    .await
                    .unwrap();
            }
            last
        }));
    }
    let mut last = 0;
    for task in tasks {
        last = last.max(task.await.unwrap());
    }
    for position in [0, last, last + 1] {
        assert!(
            log.covers(partition, position).await.unwrap(),
            "the log holds every record below {position}"
        );
    }
    // Offsets are record numbers in Kafka and byte positions in the embedded log:
    // positions a whole record past the last one are past the end in both.
    for position in [last + 1_000, last + 100_000] {
        assert!(
            !log.covers(partition, position).await.unwrap(),
            "the last record starts at {last}, so the log does not cover {position}"
        );
    }
}

/// `read_range` hands over exactly the records in `[from, until)`, in order, and says
/// where it stopped; an empty range reads nothing.
pub async fn read_range_is_exact(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"range");
    let mut offsets = Vec::new();
    for i in 0..5 {
        offsets.push(log.append(b"range", payload("range", i)).await.unwrap());
    }
    let mut seen = Vec::new();
    let reached = crate::read_range(
        log.as_ref(),
        partition,
        offsets[1],
        offsets[4],
        2,
        |chunk| {
            assert!(chunk.len() <= 2, "chunks are bounded");
            seen.extend(chunk.iter().map(|e| e.payload.clone()));
            Ok::<(), LogError>(())
        },
    )
    .await
    .unwrap();
    assert_eq!(
        seen,
        (1..4).map(|i| payload("range", i)).collect::<Vec<_>>()
    );
    assert_eq!(reached, offsets[4]);
    let none = crate::read_range(log.as_ref(), partition, offsets[2], offsets[2], 2, |_| {
        panic!("nothing to read")
    })
    .await
    .map_err(|e: LogError| e)
    .unwrap();
    assert_eq!(none, offsets[2]);
}

/// `read_at` returns the record at each offset an append returned, also for records
/// appended concurrently (batched together by a Kafka producer), and nothing past
/// the end.
pub async fn read_at_finds_every_appended_record(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"at");
    let appends = (0..24).map(|i| {
        let log = log.clone();
        async move { (i, log.append(b"at", payload("at", i)).await.unwrap()) }
    });
    let appended = futures::future::join_all(appends).await;
    for (i, offset) in &appended {
        let entry = log.read_at(partition, *offset).await.unwrap();
        let entry = entry.unwrap_or_else(|| panic!("record {i} at offset {offset} is readable"));
        assert_eq!(entry.offset, *offset);
        assert_eq!(entry.payload, payload("at", *i));
    }
    let end = appended.iter().map(|(_, o)| *o).max().unwrap() + 1;
    let past = log.read_at(partition, end + 1_000_000).await.unwrap();
    assert!(past.is_none(), "nothing is stored past the end");
    // Several at once, in the order asked (newest first, as a listing asks), with one
    // offset past the end.
    let mut asked: Vec<(usize, u64)> = appended.iter().step_by(3).copied().collect();
    asked.reverse();
    let mut offsets: Vec<u64> = asked.iter().map(|(_, o)| *o).collect();
    offsets.push(end + 1_000_000);
    let many = log.read_many(partition, &offsets).await.unwrap();
    assert_eq!(many.len(), offsets.len());
    for ((i, offset), entry) in asked.iter().zip(&many) {
        let entry = entry
            .as_ref()
            .unwrap_or_else(|| panic!("record {i} read with the others"));
        assert_eq!(
            (entry.offset, &entry.payload),
            (*offset, &payload("at", *i))
        );
    }
    assert!(many.last().unwrap().is_none());
    // A few at once (a log may read those one by one) answer the same.
    let few = log.read_many(partition, &offsets[..2]).await.unwrap();
    assert_eq!(few, many[..2]);
}

/// A reader opened at any record's offset hands over exactly that record first, also
/// when it sits in the middle of a batch a Kafka producer formed (tansu serves whole
/// batches from their first record, so a reader asking for a later one got the next
/// batch and silently skipped the rest of this one). A node restarting from its
/// checkpoint starts at such an offset.
pub async fn reader_starts_exactly_at_its_offset(factory: &dyn LogFactory) {
    let log = factory.open().await;
    let partition = log.partition_for(b"start");
    let appends = (0..40).map(|i| {
        let log = log.clone();
        async move { (i, log.append(b"start", payload("start", i)).await.unwrap()) }
    });
    let appended = futures::future::join_all(appends).await;
    for (i, offset) in appended.iter().step_by(3) {
        let first = read_exactly(log.as_ref(), partition, *offset, 1).await;
        assert_eq!(
            (first[0].offset, &first[0].payload),
            (*offset, &payload("start", *i)),
            "a reader opened at {offset} starts there"
        );
    }
}

/// A reader tailing the log while several writers (as several nodes) append at once
/// sees every record exactly once, each entry's `next_offset` being the next one's
/// offset. A broker that assigns offsets before the records are readable (tansu
/// writes a batch after numbering it) serves a later batch before an earlier one:
/// a reader that took the jump lost the earlier records for good.
pub async fn tailing_reader_misses_nothing_under_concurrent_writers(factory: &dyn LogFactory) {
    const WRITERS: usize = 3;
    const TASKS_PER_WRITER: usize = 6;
    const APPENDS_PER_TASK: usize = 30;
    const TOTAL: usize = WRITERS * TASKS_PER_WRITER * APPENDS_PER_TASK;
    let reader_log = factory.open().await;
    let partition = reader_log.partition_for(b"tailing");
    let start = reader_log.read_end(partition).await.unwrap();
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        // Separate handles where several nodes may write; one log only one process
        // opens (embedded) takes all writers on its single handle.
        let log = match reader_log.shared_between_nodes() {
            true => factory.open().await,
            false => reader_log.clone(),
        };
        for task in 0..TASKS_PER_WRITER {
            let log = log.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..APPENDS_PER_TASK {
                    let tag = format!("w{writer}t{task}");
                    log.append(b"tailing", payload(&tag, i)).await.unwrap();
                }
            }));
        }
    }
    let entries = read_exactly(reader_log.as_ref(), partition, start, TOTAL).await;
    for task in tasks {
        task.await.unwrap();
    }
    for pair in entries.windows(2) {
        assert_eq!(
            pair[0].next_offset, pair[1].offset,
            "the reader skipped records between two it handed over"
        );
    }
    let distinct: BTreeSet<_> = entries.iter().map(|e| e.payload.clone()).collect();
    assert_eq!(distinct.len(), TOTAL, "no record lost or doubled");
}

/// Records of every size read back whole by position, alone and several at once:
/// smaller than a page, around the size an implementation may read with a record's
/// header in one go, and far larger.
pub async fn read_at_returns_records_of_every_size(factory: &dyn LogFactory) {
    const SIZES: [usize; 9] = [
        1, 100, 4_095, 32_760, 32_768, 32_769, 40_000, 100_000, 300_000,
    ];
    let log = factory.open().await;
    let partition = log.partition_for(b"sizes");
    let mut appended = Vec::new();
    for (i, size) in SIZES.iter().enumerate() {
        // Each byte says where it is, so a read that mixes up pieces is caught.
        let payload: Vec<u8> = (0..*size).map(|at| (at * 7 + i) as u8).collect();
        let offset = log.append(b"sizes", payload.clone()).await.unwrap();
        appended.push((offset, payload));
    }
    for (offset, payload) in &appended {
        let entry = log.read_at(partition, *offset).await.unwrap().unwrap();
        assert_eq!(entry.offset, *offset);
        assert_eq!(entry.payload.len(), payload.len());
        assert!(
            entry.payload == *payload,
            "record of {} bytes",
            payload.len()
        );
    }
    let offsets: Vec<u64> = appended.iter().rev().map(|(o, _)| *o).collect();
    let many = log.read_many(partition, &offsets).await.unwrap();
    for ((_, payload), entry) in appended.iter().rev().zip(&many) {
        assert!(
            entry.as_ref().is_some_and(|e| e.payload == *payload),
            "record of {} bytes read with others",
            payload.len()
        );
    }
}

/// Runs every case of the suite against one implementation.
pub async fn run_all(factory: &dyn LogFactory) {
    append_then_read_in_order(factory).await;
    tailing_reader_sees_later_appends(factory).await;
    concurrent_appends_land_exactly_once(factory).await;
    restart_keeps_every_record(factory).await;
    consumer_resumes_without_replay_or_loss(factory).await;
    covers_exactly_what_was_appended(factory).await;
    read_range_is_exact(factory).await;
    read_at_finds_every_appended_record(factory).await;
    read_at_returns_records_of_every_size(factory).await;
    reader_starts_exactly_at_its_offset(factory).await;
    tailing_reader_misses_nothing_under_concurrent_writers(factory).await;
}
