//! Cluster membership on Kafka: the nodes of one cluster (`tally serve --cluster
//! NAME`) join one consumer group on the log's topic and the group protocol splits
//! the topic's partitions between them, so each partition has one owner at a time.
//! When a node leaves (a clean stop) or stops answering the group (a crash: after
//! `MEMBERSHIP_SESSION_TIMEOUT_MS`), its partitions move to the others.
//!
//! The group is used for the assignment only: its consumer reads nothing (assigned
//! partitions are paused at once) and commits nothing. What a node does with the
//! partitions it owns is its callers' business (today: it delivers the webhooks of
//! the stores whose records go to them).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};

use crate::kafka::KafkaConfig;
use crate::LogError;

/// How long the group waits for a silent member before moving its partitions: the
/// failover time after a crash. librdkafka's heartbeats run on their own thread, so
/// a busy node is not mistaken for a dead one; 6 s is the smallest session Kafka
/// brokers accept by default (`group.min.session.timeout.ms`).
pub const MEMBERSHIP_SESSION_TIMEOUT_MS: u64 = 6_000;
/// Heartbeats per session, as Kafka recommends (a third of the session).
const MEMBERSHIP_HEARTBEAT_MS: u64 = MEMBERSHIP_SESSION_TIMEOUT_MS / 3;
/// How long a rebalance waits for members to rejoin (librdkafka sends its
/// `max.poll.interval.ms`; the thread below polls every `MEMBERSHIP_POLL_MS`).
const MEMBERSHIP_REBALANCE_TIMEOUT_MS: u64 = MEMBERSHIP_SESSION_TIMEOUT_MS + 1_000;
/// Least time between two rejoins of this node. A rebalance that hands a node back
/// exactly what it revoked is how tansu 0.6 answers a member's crash: it drops the
/// dead member, yet the survivors keep their old shares and the dead one's
/// partitions stay unowned. Leaving and joining again makes the group assign them
/// (as a clean leave does). A rebalance that truly changes nothing for this node
/// costs one more rebalance, at most once per cooldown, so members cannot keep
/// each other rebalancing.
pub const MEMBERSHIP_REJOIN_COOLDOWN_MS: u64 = 10_000;
/// How often the membership thread serves the group's callbacks (rebalances).
const MEMBERSHIP_POLL_MS: u64 = 100;

/// The partitions this node owns, shared with the rebalance callback.
type Owned = Arc<RwLock<BTreeSet<u32>>>;

struct MembershipContext {
    owned: Owned,
    /// The last assignment (kept through a revocation until the next one).
    assigned: Arc<RwLock<Option<BTreeSet<u32>>>>,
    cluster: String,
    /// What this node owned before the last revocation.
    before_revoke: std::sync::Mutex<Option<BTreeSet<u32>>>,
    /// Set when a rebalance handed back exactly what was revoked (see
    /// `MEMBERSHIP_REJOIN_COOLDOWN_MS`).
    suspect: AtomicBool,
}

impl ClientContext for MembershipContext {}

impl ConsumerContext for MembershipContext {
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let owned: BTreeSet<u32> = match rebalance {
            Rebalance::Assign(assigned) => {
                // Assignment only: never fetch the topic's records.
                if let Err(error) = consumer.pause(assigned) {
                    tracing::warn!(%error, "pausing the membership consumer failed");
                }
                assigned
                    .elements()
                    .iter()
                    .filter_map(|e| u32::try_from(e.partition()).ok())
                    .collect()
            }
            // The eager protocol revokes everything before assigning anew: in
            // between, this node owns nothing (and so acts for no partition).
            Rebalance::Revoke(_) => {
                let before = self.owned.read().unwrap_or_else(|p| p.into_inner()).clone();
                *self.before_revoke.lock().unwrap_or_else(|p| p.into_inner()) = Some(before);
                BTreeSet::new()
            }
            Rebalance::Error(error) => {
                tracing::warn!(%error, cluster = %self.cluster, "cluster rebalance failed");
                BTreeSet::new()
            }
        };
        if let Rebalance::Assign(_) = rebalance {
            *self.assigned.write().unwrap_or_else(|p| p.into_inner()) = Some(owned.clone());
            let before = self
                .before_revoke
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if before.as_ref() == Some(&owned) {
                self.suspect.store(true, Ordering::Relaxed);
            }
        }
        tracing::info!(cluster = %self.cluster, partitions = ?owned, "cluster partitions owned");
        *self.owned.write().unwrap_or_else(|p| p.into_inner()) = owned;
    }
}

/// This node's membership of a cluster; leaving the group when dropped.
pub struct Membership {
    owned: Owned,
    assigned: Arc<RwLock<Option<BTreeSet<u32>>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("owned", &self.owned())
            .finish()
    }
}

/// The consumer group of cluster `cluster` on the log's topic (one topic may hold
/// several clusters' groups, e.g. staging and production readers).
pub fn group_id(topic: &str, cluster: &str) -> String {
    format!("{topic}.cluster.{cluster}")
}

impl Membership {
    /// Joins the cluster's group; partitions arrive with the first rebalance (a
    /// second or so), until then this node owns none.
    pub fn join(config: &KafkaConfig, cluster: &str) -> Result<Membership, LogError> {
        let owned: Owned = Arc::default();
        let assigned: Arc<RwLock<Option<BTreeSet<u32>>>> = Arc::default();
        let context = MembershipContext {
            owned: owned.clone(),
            assigned: assigned.clone(),
            cluster: cluster.to_string(),
            before_revoke: Default::default(),
            suspect: AtomicBool::new(false),
        };
        let consumer: BaseConsumer<MembershipContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &config.brokers)
            .set("broker.address.family", "v4")
            .set("group.id", group_id(&config.topic, cluster))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Nothing is read; if a fetch starts before the pause, start at the end.
            .set("auto.offset.reset", "latest")
            .set(
                "session.timeout.ms",
                MEMBERSHIP_SESSION_TIMEOUT_MS.to_string(),
            )
            .set("heartbeat.interval.ms", MEMBERSHIP_HEARTBEAT_MS.to_string())
            .set(
                "max.poll.interval.ms",
                MEMBERSHIP_REBALANCE_TIMEOUT_MS.to_string(),
            )
            .create_with_context(context)
            .map_err(|e| LogError::Kafka(e.to_string()))?;
        consumer
            .subscribe(&[&config.topic])
            .map_err(|e| LogError::Kafka(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let topic = config.topic.clone();
            std::thread::Builder::new()
                .name("tally-membership".into())
                .spawn(move || {
                    let cooldown = Duration::from_millis(MEMBERSHIP_REJOIN_COOLDOWN_MS);
                    let mut last_rejoin: Option<std::time::Instant> = None;
                    while !stop.load(Ordering::Relaxed) {
                        // Serves rebalances; a message would only come from a fetch
                        // begun before the pause, and is dropped.
                        let _ = consumer.poll(Duration::from_millis(MEMBERSHIP_POLL_MS));
                        let context = consumer.context();
                        // A suspect rebalance during the cooldown is acted on when
                        // the cooldown ends (the flag stays set until then).
                        if last_rejoin.is_none_or(|at| at.elapsed() > cooldown)
                            && context.suspect.swap(false, Ordering::Relaxed)
                        {
                            tracing::info!(cluster = %context.cluster, "a rebalance handed back the same partitions; joining the group again");
                            last_rejoin = Some(std::time::Instant::now());
                            consumer.unsubscribe();
                            let _ = consumer.poll(Duration::from_millis(MEMBERSHIP_POLL_MS));
                            if let Err(error) = consumer.subscribe(&[&topic]) {
                                tracing::error!(%error, "rejoining the cluster failed");
                            }
                        }
                    }
                    // Leave the group now rather than after a session timeout.
                    consumer.unsubscribe();
                    let _ = consumer.poll(Duration::from_millis(MEMBERSHIP_POLL_MS));
                })
                .map_err(LogError::Io)?
        };
        Ok(Membership {
            owned,
            assigned,
            stop,
            thread: Some(thread),
        })
    }

    /// The partitions this node owns now.
    pub fn owned(&self) -> BTreeSet<u32> {
        self.owned.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The partitions of the last assignment, kept while a rebalance runs (the
    /// eager protocol revokes everything first): what a node projects stays put
    /// until the group has decided (`None`: no assignment yet).
    pub fn last_assignment(&self) -> Option<BTreeSet<u32>> {
        self.assigned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn owns(&self, partition: u32) -> bool {
        self.owned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&partition)
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
