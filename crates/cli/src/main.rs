//! `tally`: the one binary. Subcommands serve the API, rebuild projections from the
//! log, and administer stores and Kafka topics. `anyhow` lives here and nowhere else.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tally_core::changelog_store::{ChangelogStore, ChangelogWriter};
use tally_domain::clock::Clock;
use tally_engine::Engine;
use tally_http::webhooks::DispatchScope;
use tally_log::changelog::KafkaChangelog;
use tally_log::embedded::EmbeddedLog;
use tally_log::kafka::{create_topic, verify_topic, KafkaConfig, KafkaLog};
use tally_log::membership::Membership;
use tally_log::Log;
use tally_projection::checkpoint::{
    CHECKPOINT_EVERY_MS, CHECKPOINT_MAX_DIRTY_KEYS, LAYER_COPY_EVERY_MS,
};
use tally_projection::{CheckpointStore, ProjectionStore, SledStore};

/// mimalloc instead of the system allocator: the hot paths allocate many small,
/// short-lived buffers (keys, decoded events, batches) across threads, where glibc's
/// malloc took about a quarter of the server's CPU in a profile of the ingest
/// benchmark (`_int_malloc`, `malloc_consolidate`, `unlink_chunk`); with mimalloc
/// ingest and debits ran 30-45% faster (README, "Benchmarks").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process. mimalloc asks the kernel for
/// huge pages on its arenas (`madvise(MADV_HUGEPAGE)`), and a 2 MiB page stays
/// resident while any 4 KiB of it holds a live block: the checkpoints free
/// short-lived buffers by the hundred MB, among long-lived ones, so with huge pages
/// the ingest benchmark's server held 60-100 MiB more at its peak for the same heap and
/// no more throughput (docs/benchmarks.md, "Memory without huge pages"). Best
/// effort, before logging starts: a kernel without the call (older than 3.15) keeps
/// its own setting, which costs memory, never correctness.
fn without_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    let _ = rustix::thread::disable_transparent_huge_pages(true);
}

/// The environment variable through which mimalloc reads its purge delay: how long
/// a page that has emptied stays mapped before it goes back to the kernel.
const PURGE_DELAY_VAR: &str = "MIMALLOC_PURGE_DELAY";

/// `PURGE_DELAY_MS` as a literal, so that `serve --help` can state it (`concat!`
/// takes literals only).
macro_rules! purge_delay_ms {
    () => {
        "100"
    };
}

/// The purge delay `tally` runs with, in ms, unless its environment names one.
/// mimalloc's default (1,000 ms) kept 70-100 MiB more resident at the peak of a
/// ten-million-event ingest (735 against 662 / 663 MiB in turns; 781 against
/// 662-679 earlier), because the checkpoints free a layer's values by the hundred MB
/// every few seconds and the next layer fills them again within the second; 100 ms
/// cost 2-10% more CPU per ingested event and left debits level (docs/benchmarks.md,
/// "mimalloc's purge delay"). 0 cost ~14%.
const PURGE_DELAY_MS: &str = purge_delay_ms!();

/// Runs this same program again, in this same process (`exec`: same PID, same
/// arguments and `argv[0]`), with `PURGE_DELAY_MS` in its environment, when the
/// environment does not already set `PURGE_DELAY_VAR`. mimalloc reads its options
/// once, as the process starts and before `main`, so an environment variable is the
/// one way to set them without `unsafe` (which this workspace forbids). An operator's
/// own value is kept as given. Best effort: if the program cannot be found or run
/// again (e.g. its file was replaced), it goes on at mimalloc's default, which costs
/// memory, never correctness. It cannot loop: the second run finds the variable set.
fn with_allocator_purge_delay() {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(PURGE_DELAY_VAR).is_some() {
            return;
        }
        let Ok(program) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut again = std::process::Command::new(program);
        if let Some(arg0) = args.next() {
            again.arg0(arg0);
        }
        // `exec` returns only when it failed; then this process goes on as it is.
        let _failed = again.args(args).env(PURGE_DELAY_VAR, PURGE_DELAY_MS).exec();
    }
}

mod clock;
mod progress;

#[derive(Parser, Debug)]
#[command(
    name = "tally",
    version,
    about = "Tally: event-sourced usage metering and credits ledger",
    long_about = "Tally deduplicates and aggregates usage events, keeps customer credit ledgers, \
and serves a billing REST API (/v1). Every state change is a record in a durable log; \
projections are rebuilt from it.\n\nStart here: `tally serve` (embedded log under ./tally-data, \
production API on 127.0.0.1:8080, test API on 127.0.0.1:8081). Every flag can also be set \
through the TALLY_* environment variable named in its help."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the API server (both listeners) and the projector.
    #[command(long_about = concat!(
        "Run the API server (both listeners) and the projector.\n\n",
        "Memory: the server gives pages its allocator freed back to the kernel after ",
        purge_delay_ms!(),
        " ms, unless MIMALLOC_PURGE_DELAY in its environment names another delay (in ms): \
a longer one keeps more memory and spends a little less CPU."
    ))]
    Serve(ServeArgs),
    /// Rebuild every projection from the log into a fresh store and print its digest;
    /// then bring the live projection up to date and compare (exit 1 on mismatch,
    /// printing the first keys that differ).
    /// Stop the server first: the data dir is locked while it runs.
    Replay(ReplayArgs),
    /// Store administration against a running server.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
    /// Kafka administration.
    Kafka {
        #[command(subcommand)]
        command: KafkaCommand,
    },
    /// Forward the events of a `cli` webhook endpoint to a local server: polls the
    /// pending feed, POSTs each body with its headers unchanged to --forward-to, and
    /// acknowledges with the local server's status. Ctrl-C stops it.
    Listen(ListenArgs),
    /// Webhook helpers.
    Webhook {
        #[command(subcommand)]
        command: WebhookCommand,
    },
    /// Print the API's OpenAPI 3.1 document (generated from the route handlers; the
    /// server also serves it at GET /v1/openapi.json), or write it to a file:
    /// `tally openapi --write docs/openapi.json` refreshes the committed copy.
    Openapi {
        /// Write the document to this file instead of standard output.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Credits ledger audit and export (stop the server first).
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
    },
}

#[derive(Args, Debug)]
struct ListenArgs {
    /// Local URL each event is POSTed to.
    #[arg(long, env = "TALLY_FORWARD_TO")]
    forward_to: String,
    /// The `cli` webhook endpoint whose feed is read.
    #[arg(long, env = "TALLY_WEBHOOK_ID")]
    webhook_id: String,
    /// API key of the endpoint's store and environment.
    #[arg(long, env = "TALLY_API_KEY", hide_env_values = true)]
    api_key: String,
    /// The tally listener of that environment.
    #[arg(long, env = "TALLY_BASE_URL", default_value = "http://127.0.0.1:8081")]
    base_url: String,
}

#[derive(Subcommand, Debug)]
enum WebhookCommand {
    /// Check a `tally-signature` header against a secret and the raw body. Exit code
    /// 0 when valid, 1 otherwise.
    Verify {
        /// The endpoint's signing secret (`whsec_...`).
        #[arg(long, env = "TALLY_WEBHOOK_SECRET", hide_env_values = true)]
        secret: String,
        /// The `tally-signature` header value.
        #[arg(long)]
        header: String,
        /// File holding the exact request body.
        #[arg(long)]
        body_file: PathBuf,
        /// Skip the 5-minute freshness check (for old captures).
        #[arg(long)]
        ignore_timestamp: bool,
    },
}

#[derive(Subcommand, Debug)]
enum LedgerCommand {
    /// Replay the ledger from the log and check it: every transaction sums to zero, no
    /// customer balance is ever negative, projected balances equal replayed ones.
    /// Prints account and transaction counts, totals and a digest; exit code 1 on any
    /// violation, naming it.
    Verify(ReplayArgs),
    /// Write every ledger entry (customer and system accounts) for finance: one row
    /// per entry as posted (a debit drawn from several grants has one customer
    /// entry per grant, each naming its `grant_id`).
    Export(ExportArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum ExportFormat {
    Csv,
    Jsonl,
}

#[derive(Args, Debug)]
struct ExportArgs {
    #[command(flatten)]
    storage: StorageArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ExportFormat::Csv)]
    format: ExportFormat,
    /// Output file (default: standard output).
    #[arg(long)]
    output: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum StoreCommand {
    /// Create a store and print its API keys (shown once). Needs TALLY_ADMIN_TOKEN.
    Create {
        /// Name of the new store.
        #[arg(long)]
        name: String,
        /// The server's production listener.
        #[arg(long, env = "TALLY_BASE_URL", default_value = "http://127.0.0.1:8080")]
        base_url: String,
        /// Admin token the server was started with.
        #[arg(long, env = "TALLY_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
    },
    /// Create a restricted API key of a store and print it (shown once).
    CreateKey {
        /// The store's id (st_...).
        #[arg(long)]
        store: String,
        /// `test` or `prod`.
        #[arg(long)]
        mode: String,
        /// A permission: `all` or `<resource>:read|write` (repeat for several).
        #[arg(long = "permission", required = true)]
        permissions: Vec<String>,
        /// The server's production listener.
        #[arg(long, env = "TALLY_BASE_URL", default_value = "http://127.0.0.1:8080")]
        base_url: String,
        /// Admin token the server was started with.
        #[arg(long, env = "TALLY_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
    },
    /// Revoke an API key of a store (refused at once by every node).
    RevokeKey {
        /// The store's id (st_...).
        #[arg(long)]
        store: String,
        /// The key's id (key_...).
        #[arg(long)]
        key: String,
        /// The server's production listener.
        #[arg(long, env = "TALLY_BASE_URL", default_value = "http://127.0.0.1:8080")]
        base_url: String,
        /// Admin token the server was started with.
        #[arg(long, env = "TALLY_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: String,
    },
}

#[derive(Subcommand, Debug)]
enum KafkaCommand {
    /// Create the log topic (idempotent: an existing topic is left alone).
    CreateTopics(KafkaArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum LogKind {
    /// Durable local files under --data-dir; no other process needed.
    Embedded,
    /// Kafka via rdkafka (--kafka-brokers).
    Kafka,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug, Clone)]
struct KafkaArgs {
    /// Kafka bootstrap brokers, comma separated (H:P[,H:P]).
    #[arg(long, env = "TALLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// Topic holding the log.
    #[arg(long, env = "TALLY_KAFKA_TOPIC", default_value = "tally.log")]
    kafka_topic: String,
    /// Partitions of the topic. Every record of a store goes to one partition.
    /// Must match the topic's real partition count.
    #[arg(long, env = "TALLY_KAFKA_PARTITIONS", default_value_t = 12)]
    kafka_partitions: u32,
    /// Replication factor when creating the topic (3 in production, 1 for a test broker).
    #[arg(long, env = "TALLY_KAFKA_REPLICATION_FACTOR", default_value_t = 1)]
    kafka_replication_factor: i32,
    /// `min.insync.replicas` when creating the topic: an acknowledged write is on at
    /// least this many replicas. 2 with a replication factor of 3; 1 only for a
    /// one-broker development cluster. Defaults to 2, or 1 when the replication
    /// factor is 1.
    #[arg(long, env = "TALLY_KAFKA_MIN_INSYNC_REPLICAS")]
    kafka_min_insync_replicas: Option<i32>,
    /// How long (ms) a log reader's fetch waits at the broker for new records before
    /// an empty answer. On Apache Kafka a waiting fetch is answered as soon as a record
    /// arrives, so this only sets how often idle readers ask. A broker that answers
    /// only when the wait ends (tansu) adds about this much to every command decided
    /// in the log (debits, creates): lower it there for faster commands, at the cost
    /// of more idle fetches (one per partition per wait).
    #[arg(
        long,
        env = "TALLY_KAFKA_FETCH_WAIT_MS",
        default_value_t = tally_log::kafka::DEFAULT_FETCH_WAIT_MS,
        value_parser = clap::value_parser!(u64).range(1..=tally_log::kafka::MAX_FETCH_WAIT_MS)
    )]
    kafka_fetch_wait_ms: u64,
}

impl KafkaArgs {
    fn config(&self) -> KafkaConfig {
        KafkaConfig {
            brokers: self.kafka_brokers.clone(),
            topic: self.kafka_topic.clone(),
            partitions: self.kafka_partitions,
            replication_factor: self.kafka_replication_factor,
            fetch_wait_ms: self.kafka_fetch_wait_ms,
            min_insync_replicas: self.kafka_min_insync_replicas.unwrap_or(
                if self.kafka_replication_factor > 1 {
                    2
                } else {
                    1
                },
            ),
        }
    }
}

#[derive(Args, Debug, Clone)]
struct StorageArgs {
    /// Where the embedded log and the projections live.
    #[arg(long, env = "TALLY_DATA_DIR", default_value = "./tally-data")]
    data_dir: PathBuf,
    /// Which log implementation holds the records.
    #[arg(long = "log", env = "TALLY_LOG", value_enum, default_value_t = LogKind::Embedded)]
    log_kind: LogKind,
    #[command(flatten)]
    kafka: KafkaArgs,
}

#[derive(Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    storage: StorageArgs,
    /// Production listener (production keys only).
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Test listener (test keys only).
    #[arg(long, env = "TALLY_TEST_LISTEN", default_value = "127.0.0.1:8081")]
    test_listen: SocketAddr,
    /// Log output format on stderr.
    #[arg(long, env = "TALLY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Requests per second allowed per API key (token bucket refill rate). The
    /// default is above what one node serves one key (a few thousand debits or
    /// ingest batches a second on two cores), so a single producer is never refused
    /// below the node's capacity; lower it to share a node between tenants.
    #[arg(long, env = "TALLY_RATE_LIMIT_PER_SECOND", default_value_t = 10_000)]
    rate_limit_per_second: u32,
    /// Burst allowed per API key (token bucket size).
    #[arg(long, env = "TALLY_RATE_LIMIT_BURST", default_value_t = 20_000)]
    rate_limit_burst: u32,
    /// Admin API token; enables POST /admin/v1/stores on the production listener.
    /// At least 32 characters (a random secret): a guessable token on a public
    /// listener hands out stores.
    #[arg(long, env = "TALLY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Let production webhook endpoints target loopback, private and link-local
    /// addresses (refused by default, also after DNS resolution: SSRF protection).
    #[arg(long, env = "TALLY_ALLOW_PRIVATE_WEBHOOKS")]
    allow_private_webhooks: bool,
    /// Do not deliver webhooks from this node. In a Kafka deployment without
    /// `--cluster` every node holds every delivery; exactly one node should dispatch
    /// them.
    #[arg(long, env = "TALLY_NO_WEBHOOK_DISPATCH")]
    no_webhook_dispatch: bool,
    /// In a split cluster (`--peers`), write no checkpoints to the changelog topic
    /// and restore a partition this node gains from the log alone (slower: the
    /// partition's history instead of its state). For a broker without room for
    /// the changelog, and as the baseline of the failover benchmark.
    #[arg(long, env = "TALLY_NO_CHANGELOG")]
    no_changelog: bool,
    /// Join the cluster NAME of nodes on the same Kafka topic (`--log kafka` only):
    /// the nodes split the topic's partitions through a Kafka consumer group, and
    /// each delivers the webhooks of the stores on the partitions it owns; when a
    /// node stops or dies (after a few seconds of silence), the others take its
    /// partitions over. Give every node of the cluster the same name.
    #[arg(long, env = "TALLY_CLUSTER", value_parser = parse_cluster_name)]
    cluster: Option<String>,
    /// Split the projection with the cluster's other nodes (needs `--cluster` and
    /// `--cluster-secret`): this node projects in full only the partitions the
    /// cluster gives it (of the others, only stores and API keys), and forwards a
    /// request about a store it does not serve to the node that does. List every
    /// node's production URL, comma separated, as the nodes reach one another
    /// (this node's own may be included). Every node of the cluster needs the same
    /// list.
    #[arg(
        long,
        env = "TALLY_PEERS",
        value_delimiter = ',',
        requires = "cluster",
        requires = "cluster_secret"
    )]
    peers: Vec<url::Url>,
    /// The secret the nodes of a split cluster present to one another (at least
    /// 32 characters of printable ASCII, no surrounding whitespace, the same on
    /// every node).
    #[arg(long, env = "TALLY_CLUSTER_SECRET", hide_env_values = true)]
    cluster_secret: Option<String>,
    /// Do not create the `default` store on a first start (for additional nodes of a
    /// Kafka deployment; create stores with `tally store create`).
    #[arg(long, env = "TALLY_NO_DEFAULT_STORE")]
    no_default_store: bool,
    /// Changed projection keys held in memory before they are written to sled as a
    /// checkpoint. Fewer: less memory and less of the log to re-apply after a crash;
    /// more: fewer sled writes per event (a usage bucket rewritten in memory is
    /// written once). The default suits a few hundred MiB of memory.
    #[arg(long, env = "TALLY_CHECKPOINT_KEYS", default_value_t = CHECKPOINT_MAX_DIRTY_KEYS as u64,
          value_parser = clap::value_parser!(u64).range(1..=MAX_CHECKPOINT_KEYS as u64))]
    checkpoint_keys: u64,
    /// Milliseconds between copies of the changes not yet checkpointed to disk (0:
    /// none). A restart after a crash takes the latest copy in instead of
    /// re-applying that part of the log, so it is ready sooner; each copy writes
    /// those changes (tens of MB at most) in the background.
    #[arg(long, env = "TALLY_LAYER_COPY_MS", default_value_t = LAYER_COPY_EVERY_MS,
          value_parser = clap::value_parser!(u64).range(0..=CHECKPOINT_EVERY_MS))]
    layer_copy_ms: u64,
}

/// The most `--checkpoint-keys` accepts: a key costs ~200 B in memory, and the layer
/// being written plus the one filling may hold three times the limit (~6 GiB here).
const MAX_CHECKPOINT_KEYS: usize = 10_000_000;

#[derive(Args, Debug)]
struct ReplayArgs {
    #[command(flatten)]
    storage: StorageArgs,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TALLY_LOG_LEVEL")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Shortest admin token `serve` accepts.
const MIN_ADMIN_TOKEN_CHARS: usize = 32;

async fn open_log(storage: &StorageArgs, create_kafka_topic: bool) -> Result<Arc<dyn Log>> {
    Ok(match storage.log_kind {
        LogKind::Embedded => {
            let dir = storage.data_dir.join("log");
            match EmbeddedLog::open(&dir) {
                Ok(log) => Arc::new(log),
                Err(tally_log::LogError::Locked(dir)) => bail!(
                    "the data dir log {dir} is in use by another tally process (stop it first, or use another --data-dir)"
                ),
                Err(e) => return Err(e).with_context(|| format!("opening the embedded log in {}", dir.display())),
            }
        }
        LogKind::Kafka => {
            let config = storage.kafka.config();
            if create_kafka_topic
                && create_topic(&config)
                    .await
                    .context("creating the Kafka topic")?
            {
                tracing::info!(topic = %config.topic, partitions = config.partitions, "created Kafka topic");
            }
            verify_topic(&config)
                .await
                .context("checking the Kafka topic's settings")?;
            Arc::new(KafkaLog::connect(config).context("connecting to Kafka")?)
        }
    })
}

/// Longest cluster name: it becomes part of a Kafka consumer group id.
const MAX_CLUSTER_NAME_CHARS: usize = 64;

fn parse_cluster_name(name: &str) -> Result<String, String> {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.chars().count() > MAX_CLUSTER_NAME_CHARS || !name.chars().all(valid)
    {
        return Err(format!(
            "a cluster name is 1 to {MAX_CLUSTER_NAME_CHARS} letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(name.to_string())
}

/// The stores of the partitions this node owns in its cluster.
#[derive(Debug)]
struct OwnedStores {
    membership: Arc<Membership>,
    partitions: u32,
}

impl DispatchScope for OwnedStores {
    fn dispatches(&self, store_id: &str) -> bool {
        // A store's webhook records are keyed by its id (`Record::partition_key`).
        self.membership.owns(tally_log::partition_of(
            store_id.as_bytes(),
            self.partitions,
        ))
    }
}

/// How often the ownership gauges are refreshed from the membership.
const OWNERSHIP_GAUGE_EVERY_MS: u64 = 500;

/// Keeps `/metrics` showing which partitions this node owns in its cluster, and
/// (in a split cluster) which it serves.
async fn publish_ownership(
    membership: Arc<Membership>,
    partitions: u32,
    serving: Option<Arc<tally_engine::Ownership>>,
) {
    loop {
        let owned = membership.owned();
        metrics::gauge!("tally_cluster_partitions_owned").set(owned.len() as f64);
        for partition in 0..partitions {
            let value = if owned.contains(&partition) { 1.0 } else { 0.0 };
            metrics::gauge!("tally_cluster_partition_owned", "partition" => partition.to_string())
                .set(value);
            if let Some(ownership) = &serving {
                let value = if ownership.serves(partition) {
                    1.0
                } else {
                    0.0
                };
                metrics::gauge!("tally_cluster_partition_serving", "partition" => partition.to_string())
                    .set(value);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(OWNERSHIP_GAUGE_EVERY_MS)).await;
    }
}

/// How often what the node projects in full follows the cluster's assignment.
const PROJECT_ASSIGNED_EVERY_MS: u64 = 100;
/// How long a node of a split cluster waits for the cluster's first assignment
/// before it starts its projector (then owning nothing until one arrives): a
/// group's first rebalance takes a second or two, a rebalance waiting for a dead
/// member up to its session timeout (`MEMBERSHIP_SESSION_TIMEOUT_MS`).
const FIRST_ASSIGNMENT_WAIT_MS: u64 = 10_000;

/// Projects in full what the cluster last assigned to this node (a split cluster,
/// `--peers`): a partition gained is restored first, one lost is skipped from then
/// on (ARCHITECTURE.md, "Partitions and ownership").
async fn project_assigned(membership: Arc<Membership>, ownership: Arc<tally_engine::Ownership>) {
    loop {
        if let Some(assigned) = membership.last_assignment() {
            if ownership.projecting().as_ref() != Some(&assigned) {
                tracing::info!(partitions = ?assigned, "projecting the partitions the cluster assigned");
                ownership.set_projecting(Some(assigned));
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(PROJECT_ASSIGNED_EVERY_MS)).await;
    }
}

/// Which stores this node delivers webhooks for, and its cluster membership.
struct Dispatching {
    scope: Arc<dyn DispatchScope>,
    membership: Option<Arc<Membership>>,
}

/// Which stores this node delivers webhooks for, and its cluster membership when
/// it has joined one (kept alive for as long as the node serves).
fn cluster_membership(args: &ServeArgs) -> Result<Dispatching> {
    let Some(cluster) = &args.cluster else {
        return Ok(Dispatching {
            scope: Arc::new(tally_http::webhooks::EveryStore),
            membership: None,
        });
    };
    if args.storage.log_kind != LogKind::Kafka {
        bail!("--cluster needs --log kafka: the nodes of a cluster share a Kafka topic");
    }
    let config = args.storage.kafka.config();
    let membership = Arc::new(
        Membership::join(&config, cluster).context("joining the cluster's consumer group")?,
    );
    tracing::info!(%cluster, group = %tally_log::membership::group_id(&config.topic, cluster), "joined the cluster");
    let scope = OwnedStores {
        membership: membership.clone(),
        partitions: config.partitions,
    };
    Ok(Dispatching {
        scope: Arc::new(scope),
        membership: Some(membership),
    })
}

/// sled under the in-memory write-back layer (ARCHITECTURE.md, "Checkpoints"),
/// checkpointed every `checkpoint_keys` changed keys.
fn open_projections(dir: &Path, checkpoint_keys: usize) -> Result<Arc<dyn ProjectionStore>> {
    open_projections_with(dir, checkpoint_keys, None, None)
}

/// `open_projections`; in a split cluster each checkpoint also goes to the
/// changelog (`changelog`) before it reaches sled. With `layer_copies`, the layer
/// not yet checkpointed is also copied to disk that often (`sled_store`, "Layer
/// copies"; never in a split cluster, whose changelog restores a partition).
fn open_projections_with(
    dir: &Path,
    checkpoint_keys: usize,
    changelog: Option<Arc<ChangelogWriter>>,
    layer_copies: Option<std::time::Duration>,
) -> Result<Arc<dyn ProjectionStore>> {
    let (sled, interrupted) =
        SledStore::open_deferring_stage_with(dir, tally_core::keys::bucket_rows())
            .with_context(|| format!("opening the projection store in {}", dir.display()))?;
    let every = std::time::Duration::from_millis(CHECKPOINT_EVERY_MS);
    let store: Arc<dyn ProjectionStore> = match changelog {
        Some(writer) => Arc::new(
            CheckpointStore::with_limits(ChangelogStore::new(sled, writer), checkpoint_keys, every)
                .with_read_cache(tally_core::keys::READ_CACHED_TABLES),
        ),
        None => {
            let store = CheckpointStore::with_limits(sled, checkpoint_keys, every)
                .with_read_cache(tally_core::keys::READ_CACHED_TABLES);
            Arc::new(match layer_copies {
                Some(every) => store.with_layer_copies(every),
                None => store,
            })
        }
    };
    // A checkpoint a stop interrupted, and the layer copy made after it, go into the
    // write-back layer, which the next checkpoint writes in the background, rather
    // than into sled before anything can start (~2-3 s of sled inserts for a full
    // layer).
    if let Some((changes, positions)) = interrupted {
        let count = changes.len();
        store
            .apply(changes, &positions)
            .context("loading what a stop left unwritten")?;
        tracing::info!(
            changes = count,
            "loaded what a stop left unwritten (an interrupted checkpoint, a layer copy); the next checkpoint writes it"
        );
    }
    Ok(store)
}

/// A split cluster's changelog (`--peers` with `--cluster` on Kafka): where its
/// checkpoints go, and where a partition it gains is restored from.
async fn split_changelog(
    args: &ServeArgs,
) -> Result<Option<(Arc<KafkaChangelog>, Arc<ChangelogWriter>)>> {
    let (false, false, Some(_), LogKind::Kafka) = (
        args.peers.is_empty(),
        args.no_changelog,
        &args.cluster,
        args.storage.log_kind,
    ) else {
        return Ok(None);
    };
    let config = args.storage.kafka.config();
    tally_log::changelog::create_changelog_topic(&config)
        .await
        .context("creating the changelog topic")?;
    let changelog =
        Arc::new(KafkaChangelog::connect(&config).context("connecting to the changelog")?);
    let writer = ChangelogWriter::new(changelog.clone(), config.partitions);
    Ok(Some((changelog, writer)))
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called,
/// not when the future is first polled: a signal that arrives while a server still
/// catches up with the log stops it cleanly instead of killing it, or of being
/// lost (a shell starts its background jobs with SIGINT ignored).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        let mut terminate = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Says the server is up (once caught up with the log): where it listens, and the
/// keys of the default store if this start created it.
async fn announce(
    args: &ServeArgs,
    engine: &Engine,
    prod_addr: std::net::SocketAddr,
    test_addr: std::net::SocketAddr,
    started: std::time::Instant,
) -> Result<()> {
    tracing::info!(
        elapsed_ms = started.elapsed().as_millis() as u64,
        "projections caught up with the log"
    );
    let log_description = match args.storage.log_kind {
        LogKind::Embedded => format!(
            "embedded log in {}",
            args.storage.data_dir.join("log").display()
        ),
        LogKind::Kafka => format!(
            "Kafka topic {} at {}",
            args.storage.kafka.kafka_topic, args.storage.kafka.kafka_brokers
        ),
    };
    println!("tally {} is serving", env!("CARGO_PKG_VERSION"));
    println!("  production API: http://{prod_addr}  (prod keys)");
    println!("  test API:       http://{test_addr}  (test keys)");
    println!("  data:           {log_description}");
    let bootstrapped = if args.no_default_store {
        None
    } else {
        engine.directory().bootstrap_default_store().await?
    };
    match bootstrapped {
        Some(created) => {
            println!();
            println!(
                "Created store \"{}\" ({}). Its API keys are shown only this once:",
                created.name, created.store_id
            );
            println!("  test key: {}", created.test_key);
            println!("  prod key: {}", created.prod_key);
            println!();
            println!(
                "Try: curl -H 'x-api-key: {}' http://{test_addr}/v1/meters",
                created.test_key
            );
        }
        None => println!(
            "  stores:         {} (keys were printed when each was created)",
            engine.directory().store_count()?
        ),
    }
    let _ = std::io::stdout().flush();

    Ok(())
}

async fn serve(args: ServeArgs) -> Result<()> {
    init_tracing(args.log_format);
    let stop = shutdown_signal();
    tokio::pin!(stop);
    // Checked before the data dir is opened: a bad setting is reported at once,
    // not after a restart's catch-up, and leaves nothing written.
    let admin_token = args.admin_token.clone().filter(|t| !t.is_empty());
    if let Some(token) = &admin_token {
        if token.chars().count() < MIN_ADMIN_TOKEN_CHARS || token == "change-me" {
            bail!("TALLY_ADMIN_TOKEN must be a random secret of at least {MIN_ADMIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)");
        }
    }
    std::fs::create_dir_all(&args.storage.data_dir)
        .with_context(|| format!("creating data dir {}", args.storage.data_dir.display()))?;
    let opening = std::time::Instant::now();
    let log = open_log(&args.storage, true).await?;
    let changelog = split_changelog(&args).await?;
    let store = open_projections_with(
        &args.storage.data_dir.join("projections"),
        args.checkpoint_keys as usize,
        changelog.as_ref().map(|(_, writer)| writer.clone()),
        (args.layer_copy_ms > 0).then(|| std::time::Duration::from_millis(args.layer_copy_ms)),
    )?;
    let clock: Arc<dyn Clock> = Arc::new(clock::SystemClock);
    tracing::info!(
        ms = opening.elapsed().as_millis() as u64,
        "opened the log and the projection store"
    );
    let engine = Engine::open(log.clone(), store, clock).await?;
    tracing::info!(
        ms = opening.elapsed().as_millis() as u64,
        "loaded the projections"
    );
    if let Some((changelog, writer)) = changelog {
        writer.bind(engine.journal().runtime().ownership().clone());
        engine.set_changelog(changelog, args.storage.kafka.config().partitions);
    }
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    // The projector stops only after HTTP has drained: in-flight writes wait for
    // their records to be applied, and would otherwise answer 503 while durable.
    let (projector_stop_tx, projector_stop_rx) = tokio::sync::watch::channel(false);
    let Dispatching {
        scope: dispatch_scope,
        membership,
    } = cluster_membership(&args)?;
    let split = !args.peers.is_empty();
    if let (true, Some(membership)) = (split, &membership) {
        // Project in full only what the cluster assigns: the first assignment is
        // awaited (briefly) so that a restarted node catches up with its own
        // partitions in full rather than skipping them and restoring them after.
        let ownership = engine.journal().runtime().ownership().clone();
        ownership.set_projecting(Some(Default::default()));
        let waited = std::time::Instant::now();
        while membership.last_assignment().is_none()
            && waited.elapsed() < std::time::Duration::from_millis(FIRST_ASSIGNMENT_WAIT_MS)
        {
            tokio::time::sleep(std::time::Duration::from_millis(PROJECT_ASSIGNED_EVERY_MS)).await;
        }
        if let Some(assigned) = membership.last_assignment() {
            tracing::info!(partitions = ?assigned, "projecting the partitions the cluster assigned");
            ownership.set_projecting(Some(assigned));
        }
        tokio::spawn(project_assigned(membership.clone(), ownership));
    }
    let projector = engine.start_projector(projector_stop_rx);
    if let Some(membership) = &membership {
        tokio::spawn(publish_ownership(
            membership.clone(),
            args.storage.kafka.config().partitions,
            split.then(|| engine.journal().runtime().ownership().clone()),
        ));
    }
    let prod_listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the production listener {}", args.listen))?;
    let test_listener = tokio::net::TcpListener::bind(args.test_listen)
        .await
        .with_context(|| format!("binding the test listener {}", args.test_listen))?;
    let prod_addr = prod_listener.local_addr()?;
    let test_addr = test_listener.local_addr()?;
    let cluster = match (split, &args.cluster_secret) {
        (true, Some(secret)) => {
            let routing =
                tally_http::cluster::ClusterRouting::new(tally_http::cluster::ClusterConfig {
                    secret: secret.clone(),
                    peers: args.peers.clone(),
                    partitions: args.storage.kafka.config().partitions,
                    test_port: test_addr.port(),
                })
                .map_err(|why| anyhow::anyhow!("--cluster-secret / --peers: {why}"))?;
            tokio::spawn(routing.clone().run());
            Some(routing)
        }
        _ => None,
    };
    let (prod_state, test_state) = tally_http::states(
        engine.clone(),
        tally_http::HttpConfig {
            admin_token,
            rate_limit_per_second: args.rate_limit_per_second,
            rate_limit_burst: args.rate_limit_burst,
            allow_private_webhooks: args.allow_private_webhooks,
            dispatch_webhooks: !args.no_webhook_dispatch,
            dispatch_scope,
            cluster,
            request_timeout_ms: tally_http::REQUEST_TIMEOUT_MS,
            body_read_timeout_ms: tally_http::BODY_READ_TIMEOUT_MS,
        },
    );
    let server = tokio::spawn(tally_http::serve(
        (prod_listener, prod_state),
        (test_listener, test_state),
        shutdown_rx.clone(),
    ));

    // Catch up with the log before deciding whether this is a first start.
    let started = std::time::Instant::now();
    let mut stopped = false;
    while !engine.is_ready() {
        tokio::select! {
            () = &mut stop => {
                stopped = true;
                break;
            }
            () = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
        }
        if started.elapsed().as_secs() > 0 && started.elapsed().as_millis() % 5000 < 100 {
            let positions = engine.positions().await;
            tracing::info!(?positions, "catching up with the log (applied, end)");
        }
    }
    if !stopped {
        // Caught up: from here the store is read at random (tally_projection
        // `read_advice`); start-up's scans kept the kernel's read-ahead.
        let projections = args.storage.data_dir.join("projections");
        match tally_projection::read_advice::advise_random_reads(&projections) {
            Ok(advised) => tracing::debug!(advised, "advised random reads of the store's file"),
            Err(error) => {
                tracing::info!(%error, "could not advise random reads of the store's file; reading as before")
            }
        }
        announce(&args, &engine, prod_addr, test_addr, started).await?;
        stop.await;
    }
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    let _ = shutdown_tx.send(true);
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "server error during shutdown"),
        Err(e) => tracing::error!(error = %e, "server task failed"),
    }
    // Leave the cluster now (no more deliveries from here): the others take this
    // node's partitions without waiting for its session to time out.
    drop(membership);
    let _ = projector_stop_tx.send(true);
    for task in projector {
        let _ = task.await;
    }
    engine.flush()?;
    drop(engine);
    drop(log);
    tracing::info!("stopped cleanly");
    Ok(())
}

async fn replay(args: ReplayArgs) -> Result<()> {
    init_tracing(LogFormat::Text);
    let log = open_log(&args.storage, false).await?;
    let scratch = args
        .storage
        .data_dir
        .join(format!("replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let replayed = open_projections(&scratch, CHECKPOINT_MAX_DIRTY_KEYS)?;
    let mut progress = progress::Progress::new("replaying");
    let records = tally_engine::projector::replay_log(
        log.as_ref(),
        replayed.clone(),
        |partition, at, end| progress.update(partition, at, end, None),
    )
    .await?;
    progress.finish();
    let replayed_digest = replayed.digest()?;
    println!("replayed {records} records from the {} log", log.kind());
    println!("replayed projection digest: {replayed_digest}");

    let live = open_projections(
        &args.storage.data_dir.join("projections"),
        CHECKPOINT_MAX_DIRTY_KEYS,
    )?;
    tally_engine::projector::replay_log(log.as_ref(), live.clone(), |_, _, _| {}).await?;
    live.flush()?;
    let live_digest = live.digest()?;
    println!("live projection digest:     {live_digest}");
    let differences = if live_digest == replayed_digest {
        Vec::new()
    } else {
        tally_projection::differences(live.as_ref(), replayed.as_ref(), REPLAY_DIFFERENCES_SHOWN)?
    };
    drop(replayed);
    let _ = std::fs::remove_dir_all(&scratch);
    if live_digest != replayed_digest {
        println!("MISMATCH: the live projection differs from a replay of the log");
        println!("first differing keys (at most {REPLAY_DIFFERENCES_SHOWN}; live / replayed):");
        for difference in differences {
            println!("  key {}", printable(&difference.key));
            println!(
                "    live:     {}",
                difference
                    .left
                    .as_deref()
                    .map_or("(absent)".into(), printable)
            );
            println!(
                "    replayed: {}",
                difference
                    .right
                    .as_deref()
                    .map_or("(absent)".into(), printable)
            );
        }
        std::process::exit(1);
    }
    println!("match: the live projection equals a replay of the log");
    Ok(())
}

/// How many differing keys `tally replay` prints on a mismatch: enough to see which
/// tables differ, few enough to read.
const REPLAY_DIFFERENCES_SHOWN: usize = 20;

/// Bytes as text an operator can read: printable ASCII as is, the rest as `\xNN`.
fn printable(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

/// Reports an audit's progress (records, partition, position, end).
fn progress_printer(progress: &mut progress::Progress) -> impl FnMut(u64, u32, u64, u64) + '_ {
    move |records, partition, at, end| progress.update(partition, at, end, Some(records))
}

/// The projection brought up to the end of the log, as a restart would: the ledger
/// audit reads from it which records apply refused.
async fn caught_up_projections(
    storage: &StorageArgs,
    log: &Arc<dyn Log>,
) -> Result<Arc<dyn ProjectionStore>> {
    let store = open_projections(
        &storage.data_dir.join("projections"),
        CHECKPOINT_MAX_DIRTY_KEYS,
    )?;
    tally_engine::projector::replay_log(log.as_ref(), store.clone(), |_, _, _| {}).await?;
    store.flush()?;
    Ok(store)
}

async fn ledger_verify(args: ReplayArgs) -> Result<()> {
    init_tracing(LogFormat::Text);
    let log = open_log(&args.storage, false).await?;
    let store = caught_up_projections(&args.storage, &log).await?;
    let engine = Engine::open(log.clone(), store, Arc::new(clock::SystemClock)).await?;
    let mut progress = progress::Progress::new("verifying");
    let mut replay = tally_engine::audit::replay_ledger(
        log.as_ref(),
        engine.store().as_ref(),
        |_, _| {},
        progress_printer(&mut progress),
    )
    .await?;
    progress.finish();
    engine.ledger().check_projected_balances(&mut replay)?;
    println!("accounts:        {}", replay.customer_account_count());
    println!("transactions:    {}", replay.transactions);
    println!("total issued:    {}", replay.total_issued().normalize());
    println!("total consumed:  {}", replay.total_consumed().normalize());
    println!("total forfeited: {}", replay.total_forfeited().normalize());
    println!("digest:          {}", replay.digest());
    if replay.violations.is_empty() {
        println!("ok: every transaction sums to zero, no balance went negative, projection matches the log");
        Ok(())
    } else {
        for violation in &replay.violations {
            println!("VIOLATION: {violation}");
        }
        std::process::exit(1);
    }
}

fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

async fn ledger_export(args: ExportArgs) -> Result<()> {
    init_tracing(LogFormat::Text);
    let log = open_log(&args.storage, false).await?;
    let projection = caught_up_projections(&args.storage, &log).await?;
    let mut out: Box<dyn std::io::Write> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
    };
    if args.format == ExportFormat::Csv {
        writeln!(
            out,
            "transaction_id,type,created_at,store_id,mode,entry_id,account_id,customer_id,amount,grant_id"
        )?;
    }
    let mut failure: Option<std::io::Error> = None;
    let mut entries = 0u64;
    let mut progress = progress::Progress::new("exporting");
    let replay = tally_engine::audit::replay_ledger(
        log.as_ref(),
        projection.as_ref(),
        |tx, account| {
            let created_at = tally_domain::time::format_iso8601_ms(tx.created_at_ms);
            for entry in &tx.entries {
                let customer = if entry.account_id == tx.account_id {
                    account.map(|a| a.customer_id.as_str()).unwrap_or("")
                } else {
                    ""
                };
                let amount = tally_domain::usage::canonical_decimal(entry.amount);
                let grant = entry.grant_id.as_deref().unwrap_or("");
                let line = match args.format {
                    ExportFormat::Csv => [
                        tx.id.as_str(),
                        tx.kind.as_str(),
                        &created_at,
                        &tx.store_id,
                        tx.mode.as_str(),
                        &entry.id,
                        &entry.account_id,
                        customer,
                        &amount,
                        grant,
                    ]
                    .iter()
                    .map(|f| csv_field(f))
                    .collect::<Vec<_>>()
                    .join(","),
                    ExportFormat::Jsonl => serde_json::json!({
                        "transaction_id": tx.id, "type": tx.kind.as_str(), "created_at": created_at,
                        "store_id": tx.store_id, "mode": tx.mode.as_str(), "entry_id": entry.id,
                        "account_id": entry.account_id, "customer_id": customer, "amount": amount,
                        "grant_id": entry.grant_id,
                    })
                    .to_string(),
                };
                if failure.is_none() {
                    if let Err(e) = writeln!(out, "{line}") {
                        failure = Some(e);
                    }
                }
                entries += 1;
            }
        },
        progress_printer(&mut progress),
    )
    .await?;
    progress.finish();
    if let Some(e) = failure {
        return Err(e).context("writing the export");
    }
    out.flush()?;
    eprintln!(
        "exported {entries} entries of {} transactions",
        replay.transactions
    );
    Ok(())
}

/// Idle polling starts here and doubles up to `LISTEN_MAX_IDLE_MS`.
const LISTEN_MIN_IDLE_MS: u64 = 200;
const LISTEN_MAX_IDLE_MS: u64 = 5_000;

async fn listen(args: ListenArgs) -> Result<()> {
    let base = args.base_url.trim_end_matches('/').to_string();
    let tally = tally_client::Client::new(&base, &args.api_key)
        .with_timeout(std::time::Duration::from_secs(30));
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?;
    eprintln!(
        "forwarding events of {} to {} (Ctrl-C to stop)",
        args.webhook_id, args.forward_to
    );
    let stop = shutdown_signal();
    tokio::pin!(stop);
    let mut idle_ms = LISTEN_MIN_IDLE_MS;
    loop {
        let items = match tally.pending_events(&args.webhook_id, 100).await {
            Ok(feed) => feed.items,
            Err(tally_client::Error::Api { status, error })
                if (400..500).contains(&status) && status != 429 =>
            {
                bail!("the server refused the feed ({status}): {}", error.message);
            }
            Err(e @ tally_client::Error::Api { .. }) => {
                eprintln!("feed answered {e}; retrying");
                Vec::new()
            }
            Err(e) => {
                eprintln!("cannot reach {base}: {e}; retrying");
                Vec::new()
            }
        };
        for item in &items {
            let mut request = client.post(&args.forward_to).body(item.body.clone());
            for (name, value) in &item.headers {
                request = request.header(name, value);
            }
            let started = std::time::Instant::now();
            // A local server that cannot be reached counts as 502 (not acknowledged).
            let status = match request.send().await {
                Ok(response) => response.status().as_u16(),
                Err(_) => 502,
            };
            let latency_ms = started.elapsed().as_millis();
            let acked = tally
                .ack_event(&args.webhook_id, &item.id, status)
                .await
                .is_ok();
            println!(
                "{}  {:<28} {}  {status}  {latency_ms} ms{}",
                tally_domain::time::format_iso8601_ms(clock::SystemClock.now_ms()),
                item.event_type,
                item.id,
                if acked {
                    ""
                } else {
                    "  (ack failed; will retry)"
                }
            );
            let _ = std::io::stdout().flush();
        }
        idle_ms = if items.is_empty() {
            (idle_ms * 2).min(LISTEN_MAX_IDLE_MS)
        } else {
            LISTEN_MIN_IDLE_MS
        };
        let wait = if items.is_empty() { idle_ms } else { 0 };
        tokio::select! {
            _ = &mut stop => {
                eprintln!("stopped");
                return Ok(());
            }
            _ = tokio::time::sleep(std::time::Duration::from_millis(wait)) => {}
        }
    }
}

async fn store_create(name: String, base_url: String, admin_token: String) -> Result<()> {
    let store = tally_client::Client::admin(&base_url, &admin_token)
        .create_store(&name)
        .await?;
    println!(
        "Created store \"{}\" ({}). Its API keys are shown only this once:",
        store.name, store.id
    );
    println!("  test key: {}", store.api_keys.test);
    println!("  prod key: {}", store.api_keys.prod);
    println!(
        "Key ids (for `tally store revoke-key`): test {}, prod {}",
        store.api_key_ids.test, store.api_key_ids.prod
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    with_allocator_purge_delay();
    without_transparent_huge_pages();
    let ran = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
        .and_then(|runtime| runtime.block_on(run()));
    match ran {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{}", error_report(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// What `tally` prints when a command fails: the error and its causes, one line
/// each, for the operator to act on. Not anyhow's own report, which appends a stack
/// backtrace whenever `RUST_BACKTRACE` is set (as it is on many machines): forty
/// lines of frames that bury the one line saying what to do (a weak admin token, a
/// data dir in use, an address taken). A panic still prints its backtrace.
fn error_report(err: &anyhow::Error) -> String {
    std::iter::once(format!("Error: {err}"))
        .chain(
            err.chain()
                .skip(1)
                .map(|cause| format!("  caused by: {cause}")),
        )
        .collect::<Vec<_>>()
        .join("\n")
}

async fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve(args).await,
        Command::Replay(args) => replay(args).await,
        Command::Store {
            command:
                StoreCommand::Create {
                    name,
                    base_url,
                    admin_token,
                },
        } => store_create(name, base_url, admin_token).await,
        Command::Store {
            command:
                StoreCommand::CreateKey {
                    store,
                    mode,
                    permissions,
                    base_url,
                    admin_token,
                },
        } => {
            let key = tally_client::Client::admin(&base_url, &admin_token)
                .create_key(&store, &tally_client::KeyCreate { mode, permissions })
                .await?;
            println!(
                "Created key {} ({}) with {}. It is shown only this once:\n  {}",
                key.id,
                key.mode,
                key.permissions.join(", "),
                key.key
            );
            Ok(())
        }
        Command::Store {
            command:
                StoreCommand::RevokeKey {
                    store,
                    key,
                    base_url,
                    admin_token,
                },
        } => {
            tally_client::Client::admin(&base_url, &admin_token)
                .revoke_key(&store, &key)
                .await?;
            println!("Revoked key {key}.");
            Ok(())
        }
        Command::Listen(args) => listen(args).await,
        Command::Openapi { write } => {
            let document = tally_http::openapi::document_json();
            match write {
                Some(path) => {
                    std::fs::write(&path, document)
                        .with_context(|| format!("writing {}", path.display()))?;
                    eprintln!("Wrote {}.", path.display());
                }
                None => print!("{document}"),
            }
            Ok(())
        }
        Command::Webhook {
            command:
                WebhookCommand::Verify {
                    secret,
                    header,
                    body_file,
                    ignore_timestamp,
                },
        } => {
            let body = std::fs::read(&body_file)
                .with_context(|| format!("reading {}", body_file.display()))?;
            let now_s = if ignore_timestamp {
                header
                    .split(',')
                    .next()
                    .and_then(|t| t.trim().strip_prefix("t="))
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0)
            } else {
                clock::SystemClock.now_ms() / 1000
            };
            match tally_domain::webhook::verify_signature(&header, &secret, &body, now_s) {
                Ok(()) => {
                    println!("valid");
                    Ok(())
                }
                Err(e) => {
                    println!("invalid: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::Ledger {
            command: LedgerCommand::Verify(args),
        } => ledger_verify(args).await,
        Command::Ledger {
            command: LedgerCommand::Export(args),
        } => ledger_export(args).await,
        Command::Kafka {
            command: KafkaCommand::CreateTopics(args),
        } => {
            let config = args.config();
            if create_topic(&config).await? {
                println!(
                    "created topic {} with {} partitions",
                    config.topic, config.partitions
                );
            } else {
                println!("topic {} already exists", config.topic);
            }
            let changelog = tally_log::changelog::changelog_topic(&config.topic);
            if tally_log::changelog::create_changelog_topic(&config).await? {
                println!("created topic {changelog} (split clusters' checkpoints)");
            } else {
                println!("topic {changelog} already exists");
            }
            Ok(())
        }
    }
}
