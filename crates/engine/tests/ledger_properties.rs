//! Property tests of the credits ledger through the engine (real embedded log, real
//! sled, restarts included): for any sequence of credit, debit, reverse, freeze,
//! unfreeze, close, grants (priorities, expiries) and reservations (hold, commit,
//! release, expiry as time passes),
//! - accept/refuse decisions and balances equal an independent reference model,
//!   which draws debits from grants by priority, soonest expiry and age;
//! - the balance is always what the active grants have left;
//! - every transaction's entries sum to zero and no balance ever goes negative
//!   (checked by the audit replay of the log);
//! - the available balance (balance less live holds) never goes negative;
//! - replaying the log into an empty store gives the live projection's digest.

use std::sync::Arc;

use proptest::prelude::*;
use rust_decimal::Decimal;
use tally_core::pagination::PageRequest;
use tally_domain::clock::Clock;
use tally_domain::clock::ManualClock;
use tally_domain::grant::GrantStatus;
use tally_domain::ledger::{AccountStatus, TransactionKind};
use tally_domain::Mode;
use tally_engine::ledger::{AccountInput, GrantInput, MovementInput, ReservationInput};
use tally_engine::{Engine, EngineError, Scope};
use tally_log::embedded::EmbeddedLog;
use tally_projection::{MemoryStore, ProjectionStore, SledStore};

#[derive(Debug, Clone)]
enum Op {
    Credit(usize, i64),
    Debit(usize, i64),
    Reverse(usize),
    Freeze(usize),
    Unfreeze(usize),
    Close(usize),
    /// A grant: amount (tenths), priority, and an expiry this many ms ahead.
    Grant(usize, i64, u32, Option<i64>),
    /// A hold on an account: amount (tenths), and an index into `HOLD_SECONDS`.
    Reserve(usize, i64, usize),
    /// Commit a hold picked by index: all of it, or this many tenths (at most all).
    Commit(usize, Option<i64>),
    Release(usize),
    /// Time passes (ms): holds expire.
    Advance(i64),
    Restart,
}

/// Hold lengths the test picks from (seconds).
const HOLD_SECONDS: [i64; 3] = [1, 60, 300];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3, 1i64..500).prop_map(|(a, n)| Op::Credit(a, n)),
        4 => (0usize..3, 1i64..500).prop_map(|(a, n)| Op::Debit(a, n)),
        2 => (0usize..50).prop_map(Op::Reverse),
        1 => (0usize..3).prop_map(Op::Freeze),
        1 => (0usize..3).prop_map(Op::Unfreeze),
        1 => (0usize..3).prop_map(Op::Close),
        3 => (0usize..3, 1i64..500, prop::sample::select(vec![0u32, 50, 100]), prop::option::of(1i64..90_000))
            .prop_map(|(a, n, p, e)| Op::Grant(a, n, p, e)),
        3 => (0usize..3, 1i64..500, 0usize..3).prop_map(|(a, n, s)| Op::Reserve(a, n, s)),
        2 => (0usize..20, prop::option::of(1i64..500)).prop_map(|(p, n)| Op::Commit(p, n)),
        1 => (0usize..20).prop_map(Op::Release),
        1 => (1i64..120_000).prop_map(Op::Advance),
        1 => Just(Op::Restart),
    ]
}

/// The reference: balances, statuses and transactions, by the rules of docs/api.md.
#[derive(Debug, Default)]
struct Model {
    /// Per account, its active grants (remaining > 0), as docs/api.md "Credit
    /// grants" says they are drawn.
    grants: Vec<Vec<ModelGrant>>,
    next_seq: u64,
    statuses: Vec<AccountStatus>,
    /// (engine transaction id, account, signed delta, reversible, reversed)
    transactions: Vec<(String, usize, Decimal, bool, bool)>,
    holds: Vec<ModelHold>,
}

#[derive(Debug, Clone)]
struct ModelGrant {
    remaining: Decimal,
    priority: u32,
    expires_at_ms: Option<i64>,
    seq: u64,
}

#[derive(Debug, Clone)]
struct ModelHold {
    id: String,
    account: usize,
    amount: Decimal,
    expires_at_ms: i64,
    /// `held`, `committed` or `released` (expiry is read from the time).
    status: &'static str,
    transaction: Option<String>,
}

impl Model {
    fn held(&self, account: usize, now_ms: i64) -> Decimal {
        self.holds
            .iter()
            .filter(|h| h.account == account && h.status == "held" && now_ms < h.expires_at_ms)
            .map(|h| h.amount)
            .sum()
    }

    fn balance(&self, account: usize, now_ms: i64) -> Decimal {
        self.grants[account]
            .iter()
            .filter(|g| g.expires_at_ms.is_none_or(|e| now_ms < e))
            .map(|g| g.remaining)
            .sum()
    }

    /// What a debit or a new hold may take, never below zero: a hold claims the
    /// balance, not grants, so a grant that expires under a hold can leave the
    /// balance below what is held (docs/api.md, "Reservations").
    fn available(&self, account: usize, now_ms: i64) -> Decimal {
        (self.balance(account, now_ms) - self.held(account, now_ms)).max(Decimal::ZERO)
    }

    fn add_grant(
        &mut self,
        account: usize,
        amount: Decimal,
        priority: u32,
        expires_at_ms: Option<i64>,
    ) {
        self.next_seq += 1;
        self.grants[account].push(ModelGrant {
            remaining: amount,
            priority,
            expires_at_ms,
            seq: self.next_seq,
        });
    }

    /// Draws by priority, then soonest expiry (none last), then oldest.
    fn draw(&mut self, account: usize, amount: Decimal, now_ms: i64) {
        let grants = &mut self.grants[account];
        grants.retain(|g| g.expires_at_ms.is_none_or(|e| now_ms < e));
        grants.sort_by_key(|g| (g.priority, g.expires_at_ms.unwrap_or(i64::MAX), g.seq));
        let mut left = amount;
        for grant in grants.iter_mut() {
            let take = left.min(grant.remaining);
            grant.remaining -= take;
            left -= take;
        }
        assert!(left.is_zero(), "the model drew past its grants");
        grants.retain(|g| !g.remaining.is_zero());
    }

    /// What the live grants have left, sorted (to compare with the engine's).
    fn remainders(&self, account: usize, now_ms: i64) -> Vec<Decimal> {
        let mut left: Vec<Decimal> = self.grants[account]
            .iter()
            .filter(|g| g.expires_at_ms.is_none_or(|e| now_ms < e))
            .map(|g| g.remaining.normalize())
            .collect();
        left.sort();
        left
    }
}

/// A running engine: the engine, its projector's shutdown switch and tasks.
type Running = (
    Arc<Engine>,
    tokio::sync::watch::Sender<bool>,
    Vec<tokio::task::JoinHandle<()>>,
);

struct Harness {
    dir: tempfile::TempDir,
    clock: Arc<ManualClock>,
    engine: Option<Running>,
}

impl Harness {
    async fn start(&mut self) {
        let log = Arc::new(EmbeddedLog::open(self.dir.path().join("log")).unwrap());
        // `open` waits for the lock a stop just released (sled frees it late).
        let store = Arc::new(tally_projection::CheckpointStore::new(
            SledStore::open(self.dir.path().join("projections")).unwrap(),
        ));
        let engine = Engine::open(log, store, self.clock.clone()).await.unwrap();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let tasks = engine.start_projector(rx);
        engine.wait_caught_up().await.unwrap();
        self.engine = Some((engine, tx, tasks));
    }

    async fn stop(&mut self) {
        let (engine, tx, tasks) = self.engine.take().unwrap();
        tx.send(true).unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        engine.flush().unwrap();
    }

    fn engine(&self) -> &Arc<Engine> {
        &self.engine.as_ref().unwrap().0
    }
}

fn code(result: &Result<impl std::fmt::Debug, EngineError>) -> Option<&'static str> {
    match result {
        Ok(_) => None,
        Err(EngineError::Conflict { code, .. }) => Some(code),
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

/// A started harness with one store (test mode) and one customer in it.
async fn started_with_customer(
    store_name: &str,
) -> (Harness, Scope, tally_domain::customer::Customer) {
    let mut h = Harness {
        dir: tempfile::tempdir().unwrap(),
        clock: Arc::new(ManualClock::new(1_800_000_000_000)),
        engine: None,
    };
    h.start().await;
    let store = h
        .engine()
        .directory()
        .create_store(store_name)
        .await
        .unwrap();
    let scope = Scope {
        store_id: store.store_id.into(),
        mode: Mode::Test,
    };
    let customer = h
        .engine()
        .directory()
        .create_customer(
            &scope,
            &tally_domain::customer::CustomerInput {
                email: tally_domain::customer::Patch::Set("p@x.io".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    (h, scope, customer)
}

async fn run(ops: Vec<Op>, seeds: [i64; 3]) -> Result<(), TestCaseError> {
    let (mut h, scope, customer) = started_with_customer("prop").await;
    let mut model = Model::default();
    let mut accounts = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        let (account, _) = h
            .engine()
            .ledger()
            .create_account(
                &scope,
                &AccountInput {
                    customer_id: Some(customer.id.to_string()),
                    name: Some(format!("a{i}")),
                    unit_label: None,
                    initial_balance: Some(seed.to_string()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        accounts.push(account.id);
        model.grants.push(Vec::new());
        if *seed > 0 {
            model.add_grant(i, Decimal::from(*seed), 50, None);
        }
        model.statuses.push(AccountStatus::Active);
    }
    let mut key = 0;
    for op in ops {
        h.clock.advance_ms(1);
        match op {
            Op::Credit(a, n) | Op::Debit(a, n) => {
                let debit = matches!(op, Op::Debit(..));
                key += 1;
                let amount = Decimal::new(n, 1);
                let result = h
                    .engine()
                    .ledger()
                    .move_credits(
                        &scope,
                        &accounts[a],
                        if debit {
                            TransactionKind::Debit
                        } else {
                            TransactionKind::Credit
                        },
                        &MovementInput {
                            amount: Some(amount.to_string()),
                            idempotency_key: Some(format!("k{key}")),
                            ..Default::default()
                        },
                    )
                    .await;
                let expected = match model.statuses[a] {
                    AccountStatus::Frozen => Some("account_frozen"),
                    AccountStatus::Closed => Some("account_closed"),
                    AccountStatus::Active
                        if debit && model.available(a, h.clock.now_ms()) < amount =>
                    {
                        Some("insufficient_balance")
                    }
                    AccountStatus::Active => None,
                };
                prop_assert_eq!(code(&result), expected, "{:?}", op);
                if let Ok(view) = result {
                    let delta = if debit { -amount } else { amount };
                    if debit {
                        model.draw(a, amount, h.clock.now_ms());
                    } else {
                        model.add_grant(a, amount, 50, None);
                    }
                    model.transactions.push((
                        view.transaction.id.to_string(),
                        a,
                        delta,
                        true,
                        false,
                    ));
                }
            }
            Op::Reverse(pick) => {
                if model.transactions.is_empty() {
                    continue;
                }
                let index = pick % model.transactions.len();
                let (id, a, delta, reversible, reversed) = model.transactions[index].clone();
                let result = h.engine().ledger().reverse_transaction(&scope, &id).await;
                let expected = if reversed {
                    Some("transaction_already_reversed")
                } else if !reversible {
                    Some("transaction_not_reversible")
                } else {
                    match model.statuses[a] {
                        AccountStatus::Frozen => Some("account_frozen"),
                        AccountStatus::Closed => Some("account_closed"),
                        AccountStatus::Active
                            if delta > Decimal::ZERO
                                && model.available(a, h.clock.now_ms()) - delta < Decimal::ZERO =>
                        {
                            Some("insufficient_balance")
                        }
                        AccountStatus::Active => None,
                    }
                };
                prop_assert_eq!(code(&result), expected, "reverse {}", id);
                if let Ok(view) = result {
                    // Reversing a credit takes (drawn like a debit); reversing a
                    // debit gives back as a new grant.
                    if delta > Decimal::ZERO {
                        model.draw(a, delta, h.clock.now_ms());
                    } else {
                        model.add_grant(a, -delta, 50, None);
                    }
                    model.transactions[index].4 = true;
                    model.transactions.push((
                        view.transaction.id.to_string(),
                        a,
                        -delta,
                        false,
                        false,
                    ));
                }
            }
            Op::Freeze(a) | Op::Unfreeze(a) => {
                let freeze = matches!(op, Op::Freeze(_));
                let result = h
                    .engine()
                    .ledger()
                    .set_account_frozen(&scope, &accounts[a], freeze)
                    .await;
                if model.statuses[a] == AccountStatus::Closed {
                    prop_assert_eq!(code(&result), Some("account_closed"));
                } else {
                    prop_assert!(result.is_ok());
                    model.statuses[a] = if freeze {
                        AccountStatus::Frozen
                    } else {
                        AccountStatus::Active
                    };
                }
            }
            Op::Close(a) => {
                h.engine()
                    .ledger()
                    .close_account(&scope, &accounts[a])
                    .await
                    .unwrap();
                model.statuses[a] = AccountStatus::Closed;
                model.grants[a].clear();
                let now = h.clock.now_ms();
                for hold in model.holds.iter_mut() {
                    if hold.account == a && hold.status == "held" && now < hold.expires_at_ms {
                        hold.status = "released";
                    }
                }
            }
            Op::Reserve(a, n, s) => {
                key += 1;
                let amount = Decimal::new(n, 1);
                let result = h
                    .engine()
                    .ledger()
                    .reserve(
                        &scope,
                        &accounts[a],
                        &ReservationInput {
                            amount: Some(amount.to_string()),
                            idempotency_key: Some(format!("r{key}")),
                            expires_in_seconds: Some(HOLD_SECONDS[s]),
                        },
                    )
                    .await;
                let now = h.clock.now_ms();
                let expected = match model.statuses[a] {
                    AccountStatus::Frozen => Some("account_frozen"),
                    AccountStatus::Closed => Some("account_closed"),
                    AccountStatus::Active if model.available(a, now) < amount => {
                        Some("insufficient_balance")
                    }
                    AccountStatus::Active => None,
                };
                prop_assert_eq!(code(&result), expected, "{:?}", op);
                if let Ok(reservation) = result {
                    prop_assert_eq!(reservation.expires_at_ms, now + HOLD_SECONDS[s] * 1000);
                    model.holds.push(ModelHold {
                        id: reservation.id.to_string(),
                        account: a,
                        amount,
                        expires_at_ms: reservation.expires_at_ms,
                        status: "held",
                        transaction: None,
                    });
                }
            }
            Op::Commit(pick, part) => {
                if model.holds.is_empty() {
                    continue;
                }
                let index = pick % model.holds.len();
                let hold = model.holds[index].clone();
                let amount = part
                    .map(|n| Decimal::new(n, 1).min(hold.amount))
                    .unwrap_or(hold.amount);
                let result = h
                    .engine()
                    .ledger()
                    .commit_reservation(&scope, &hold.id, Some(&amount.to_string()))
                    .await;
                let now = h.clock.now_ms();
                let expected = match hold.status {
                    "committed" => None,
                    "released" => Some("reservation_released"),
                    _ if now >= hold.expires_at_ms => Some("reservation_expired"),
                    _ => match model.statuses[hold.account] {
                        AccountStatus::Frozen => Some("account_frozen"),
                        AccountStatus::Closed => Some("account_closed"),
                        // A hold is a claim on the balance, not on grants: credits
                        // that expired while it was held can leave the balance
                        // short of it (docs/api.md, "Reservations").
                        AccountStatus::Active
                            if amount
                                > model.balance(hold.account, now)
                                    - (model.held(hold.account, now) - hold.amount) =>
                        {
                            Some("insufficient_balance")
                        }
                        AccountStatus::Active => None,
                    },
                };
                prop_assert_eq!(code(&result), expected, "{:?} of {:?}", op, hold);
                if let Ok(reservation) = result {
                    let tx = reservation.transaction_id.map(|t| t.to_string());
                    if hold.status == "committed" {
                        prop_assert_eq!(tx, hold.transaction, "committing again: the same");
                    } else {
                        model.draw(hold.account, amount, now);
                        model.holds[index].status = "committed";
                        model.holds[index].transaction = tx.clone();
                        model.transactions.push((
                            tx.expect("a committed reservation names its debit"),
                            hold.account,
                            -amount,
                            true,
                            false,
                        ));
                    }
                }
            }
            Op::Release(pick) => {
                if model.holds.is_empty() {
                    continue;
                }
                let index = pick % model.holds.len();
                let hold = model.holds[index].clone();
                let result = h
                    .engine()
                    .ledger()
                    .release_reservation(&scope, &hold.id)
                    .await;
                let expected = (hold.status == "committed").then_some("reservation_committed");
                prop_assert_eq!(code(&result), expected, "{:?} of {:?}", op, hold);
                if result.is_ok() && hold.status == "held" && h.clock.now_ms() < hold.expires_at_ms
                {
                    model.holds[index].status = "released";
                }
            }
            Op::Advance(ms) => h.clock.advance_ms(ms),
            Op::Grant(a, n, priority, expires_in) => {
                key += 1;
                let amount = Decimal::new(n, 1);
                let now = h.clock.now_ms();
                let expires_at_ms = expires_in.map(|ms| now + ms);
                let result = h
                    .engine()
                    .ledger()
                    .create_grant(
                        &scope,
                        &accounts[a],
                        &GrantInput {
                            movement: MovementInput {
                                amount: Some(amount.to_string()),
                                idempotency_key: Some(format!("g{key}")),
                                ..Default::default()
                            },
                            priority: Some(i64::from(priority)),
                            expires_at_ms,
                        },
                    )
                    .await;
                let expected = match model.statuses[a] {
                    AccountStatus::Frozen => Some("account_frozen"),
                    AccountStatus::Closed => Some("account_closed"),
                    AccountStatus::Active => None,
                };
                prop_assert_eq!(code(&result), expected, "{:?}", op);
                if let Ok(grant) = result {
                    prop_assert_eq!(grant.remaining, amount);
                    model.add_grant(a, amount, priority, expires_at_ms);
                    model.transactions.push((
                        grant.transaction_id.to_string(),
                        a,
                        amount,
                        true,
                        false,
                    ));
                }
            }
            Op::Restart => {
                h.stop().await;
                h.start().await;
            }
        }
    }
    for (i, id) in accounts.iter().enumerate() {
        let now = h.clock.now_ms();
        let balance = h.engine().ledger().balance(&scope, id).unwrap();
        prop_assert_eq!(balance, model.balance(i, now), "balance of account {}", i);
        // Every credit unit belongs to one grant: the balance is what the active
        // grants have left, and they are the model's.
        let active = h
            .engine()
            .ledger()
            .list_grants(
                &scope,
                id,
                Some(GrantStatus::Active),
                &PageRequest {
                    limit: 100,
                    starting_after: None,
                    ending_before: None,
                },
            )
            .unwrap();
        let mut left: Vec<Decimal> = active
            .data
            .iter()
            .map(|g| g.remaining.normalize())
            .collect();
        left.retain(|r| !r.is_zero());
        left.sort();
        prop_assert_eq!(left.iter().copied().sum::<Decimal>(), balance);
        prop_assert_eq!(left, model.remainders(i, now), "grants of account {}", i);
        prop_assert_eq!(
            h.engine().ledger().get_account(&scope, id).unwrap().status,
            model.statuses[i]
        );
        let held = h.engine().ledger().held(&scope, id).unwrap();
        prop_assert_eq!(
            held,
            model.held(i, h.clock.now_ms()),
            "held on account {}",
            i
        );
        // The available balance the API shows, from the engine's balance and holds
        // (never negative: the domain's `available` floors it, tested there).
        let available = tally_domain::reservation::available(balance, held);
        prop_assert_eq!(
            available,
            model.available(i, h.clock.now_ms()),
            "available balance of account {}",
            i
        );
    }
    let log = h.engine().log().clone();
    let mut audit = tally_engine::audit::replay_ledger(
        log.as_ref(),
        h.engine().store().as_ref(),
        |_, _| {},
        |_, _, _, _| {},
    )
    .await
    .unwrap();
    h.engine()
        .ledger()
        .check_projected_balances(&mut audit)
        .unwrap();
    prop_assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    let issued_minus_out = audit.total_issued() - audit.total_consumed() - audit.total_forfeited();
    let mut booked = Decimal::ZERO;
    for id in &accounts {
        booked += h.engine().ledger().booked_balance(&scope, id).unwrap();
    }
    prop_assert_eq!(issued_minus_out, booked, "money is conserved");

    let replayed: Arc<dyn ProjectionStore> = Arc::new(MemoryStore::new());
    tally_engine::projector::replay_partition(log.as_ref(), replayed.clone(), 0, |_, _| {})
        .await
        .unwrap();
    prop_assert_eq!(
        replayed.digest().unwrap(),
        h.engine().store().digest().unwrap()
    );
    h.stop().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn ledger_matches_the_reference_and_stays_balanced(
        ops in proptest::collection::vec(op(), 1..40),
        seeds in [0i64..300, 0i64..300, 0i64..300],
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(run(ops, seeds))?;
    }
}

/// The customer's account "main", seeded with `initial_balance`.
async fn main_account(
    h: &Harness,
    scope: &Scope,
    customer: &tally_domain::customer::Customer,
    initial_balance: &str,
) -> tally_domain::ledger::Account {
    let (account, _) = h
        .engine()
        .ledger()
        .create_account(
            scope,
            &AccountInput {
                customer_id: Some(customer.id.to_string()),
                name: Some("main".into()),
                unit_label: None,
                initial_balance: Some(initial_balance.into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    account
}

/// Concurrent debits decided on a stale balance are appended and refused in apply;
/// a repeated idempotency key is appended and answered with the original. The audit
/// replay (`tally ledger verify`, `tally ledger export`) must count only what apply
/// applied: balances equal the projection and no violation is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_skips_what_apply_refused() {
    let (mut h, scope, customer) = started_with_customer("audit").await;
    let account = main_account(&h, &scope, &customer, "10").await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let engine = h.engine().clone();
        let scope = scope.clone();
        let account = account.id.clone();
        tasks.push(tokio::spawn(async move {
            engine
                .ledger()
                .move_credits(
                    &scope,
                    &account,
                    TransactionKind::Debit,
                    &MovementInput {
                        amount: Some("1".into()),
                        // Pairs share a key: the second is the same request again.
                        idempotency_key: Some(format!("k{}", i / 2)),
                        ..Default::default()
                    },
                )
                .await
                .is_ok()
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    h.engine().wait_caught_up().await.unwrap();
    assert_eq!(
        h.engine().ledger().balance(&scope, &account.id).unwrap(),
        Decimal::ZERO,
        "ten distinct debits of 1 succeed"
    );
    let (exported, transactions) = audit_without_violations(&h).await;
    assert_eq!(exported, 11, "the seed and ten debits");
    assert_eq!(transactions, 11);
    h.stop().await;
}

/// Replays the ledger from the log as `tally ledger verify` does and checks it
/// against the projection: no violation. Returns the transactions exported and
/// audited.
async fn audit_without_violations(h: &Harness) -> (usize, u64) {
    let log = h.engine().log().clone();
    let mut exported = 0;
    let mut audit = tally_engine::audit::replay_ledger(
        log.as_ref(),
        h.engine().store().as_ref(),
        |_, _| exported += 1,
        |_, _, _, _| {},
    )
    .await
    .unwrap();
    h.engine()
        .ledger()
        .check_projected_balances(&mut audit)
        .unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    (exported, audit.transactions)
}

/// A close recorded after a grant's instant, before anything booked its expiry (no
/// sweep runs here), books the expiry first and closes: what the close checks is the
/// live balance. It was refused with `account_balance_changed` until a sweep ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_after_an_unbooked_expiry_books_it_and_closes() {
    let (mut h, scope, customer) = started_with_customer("close-expiry").await;
    let account = main_account(&h, &scope, &customer, "0").await;
    let now = h.clock.now_ms();
    h.engine()
        .ledger()
        .create_grant(
            &scope,
            &account.id,
            &GrantInput {
                movement: MovementInput {
                    amount: Some("5".into()),
                    idempotency_key: Some("g1".into()),
                    ..Default::default()
                },
                priority: None,
                expires_at_ms: Some(now + 10),
            },
        )
        .await
        .unwrap();
    h.clock.advance_ms(1_000);
    let ledger = h.engine().ledger();
    assert_eq!(ledger.balance(&scope, &account.id).unwrap(), Decimal::ZERO);
    ledger.close_account(&scope, &account.id).await.unwrap();
    assert_eq!(
        ledger.get_account(&scope, &account.id).unwrap().status,
        AccountStatus::Closed
    );
    let grants = ledger
        .list_grants(
            &scope,
            &account.id,
            Some(GrantStatus::Expired),
            &PageRequest {
                limit: 10,
                starting_after: None,
                ending_before: None,
            },
        )
        .unwrap();
    assert_eq!(grants.data.len(), 1, "the close booked the expiry");
    // The audit replays the expiry the close booked: the grant, its expiry.
    let (_, transactions) = audit_without_violations(&h).await;
    assert_eq!(transactions, 2);
    h.stop().await;
}
