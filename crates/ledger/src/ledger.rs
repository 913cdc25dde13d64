//! The credits ledger service: accounts, credits, debits, reversals, balances and
//! entries (docs/api.md, "Customer credits"); its apply lives in `crate::apply`.
//!
//! Consistency: the service checks a request against the projection (fast 409s) and
//! appends it; the projector decides it in log order (balance, status, idempotency
//! key, reversal at most once, limits) and records the outcome the caller waits for.
//! So 200 concurrent debits of 1 against a balance of 100 succeed exactly 100 times on
//! any number of nodes, without a per-account lock; webhook events are decided in
//! apply too, from the balance the transaction leaves. Freeze, unfreeze, close and
//! threshold updates are updates of the account (`Journal::update`, re-derived when
//! the account moved).

use rust_decimal::Decimal;
use tally_domain::ledger::{
    parse_amount, post, post_reversal, Account, AccountStatus, Rejection, Transaction,
    TransactionKind, DEFAULT_ACCOUNT_NAME, DEFAULT_UNIT_LABEL, MAX_ACCOUNT_NAME_CHARS,
    MAX_DESCRIPTION_CHARS, MAX_IDEMPOTENCY_KEY_CHARS,
};
use tally_domain::record::Record;
use tally_domain::FieldError;

use tally_core::codec::{self, StoredEntry};
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::pagination::{collect_prefix, cursor_from, paginate, Page, PageRequest};
use tally_core::{Decision, Scope};

use crate::apply::{account_name_taken, idempotency_key_reused};
use crate::Ledger;

/// Input of `POST /v1/customer-credits/accounts`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct AccountInput {
    pub customer_id: Option<String>,
    pub name: Option<String>,
    pub unit_label: Option<String>,
    pub initial_balance: Option<String>,
    /// Parsed by the edge (`parse_amount`, zero allowed).
    pub low_balance_threshold: Option<Decimal>,
    pub auto_recharge: Option<tally_domain::ledger::AutoRecharge>,
}

/// Input of credit and debit.
#[derive(Debug, Clone, Default)]
pub struct MovementInput {
    pub amount: Option<String>,
    pub idempotency_key: Option<String>,
    pub description: Option<String>,
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// A transaction with what the projection knows about it.
#[derive(Debug, Clone)]
pub struct TransactionView {
    pub transaction: Transaction,
    pub reversed_by: Option<String>,
}

fn rejected(rejection: Rejection) -> EngineError {
    EngineError::conflict(rejection.code(), rejection.message())
}

/// The body's `idempotency_key` of a credits step: required, trimmed, at most
/// `MAX_IDEMPOTENCY_KEY_CHARS`.
pub(crate) fn idempotency_key_field(value: Option<&str>) -> Result<String, FieldError> {
    let key = value
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| FieldError::missing("idempotency_key"))?;
    if key.chars().count() > MAX_IDEMPOTENCY_KEY_CHARS {
        return Err(FieldError::invalid(
            "idempotency_key",
            format!("`idempotency_key` is at most {MAX_IDEMPOTENCY_KEY_CHARS} characters"),
        ));
    }
    Ok(key.to_string())
}

fn text_field(param: &str, value: Option<&String>, default: &str) -> Result<String, FieldError> {
    match value {
        None => Ok(default.to_string()),
        Some(text) => {
            let trimmed = text.trim();
            if trimmed.is_empty() || trimmed.chars().count() > MAX_ACCOUNT_NAME_CHARS {
                return Err(FieldError::invalid(
                    param,
                    format!("`{param}` must be 1 to {MAX_ACCOUNT_NAME_CHARS} characters"),
                ));
            }
            Ok(trimmed.to_string())
        }
    }
}

/// A priced auto-recharge waiting for its charge (docs/api.md, "Thresholds and
/// auto-recharge").
#[derive(Debug, Clone, PartialEq)]
pub struct PendingRecharge {
    pub scope: Scope,
    /// The account as it is now (its `auto_recharge` holds the price).
    pub account: Account,
    /// The debit that left its balance below the threshold.
    pub debit_id: String,
}

impl Ledger {
    /// Up to `limit` pending recharges of the stores this node serves.
    pub fn pending_recharges(&self, limit: usize) -> Result<Vec<PendingRecharge>, EngineError> {
        let found = collect_prefix(
            self.journal.store().as_ref(),
            &[keys::RECHARGE_PENDING],
            false,
            limit,
            |key, value| {
                let (store, mode, account) = keys::recharge_pending_of(key)?;
                let scope = Scope {
                    store_id: store.into(),
                    mode,
                };
                Ok(self.journal.serves_store(&scope.store_id).then(|| {
                    let debit = String::from_utf8_lossy(value).into_owned();
                    (scope, account.to_string(), debit)
                }))
            },
        )?;
        found
            .into_iter()
            .map(|(scope, account_id, debit_id)| {
                let account = self.get_account(&scope, &account_id)?;
                Ok(PendingRecharge {
                    scope,
                    account,
                    debit_id,
                })
            })
            .collect()
    }

    pub fn held(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = crate::holds::holds_key(&scope.store_id, scope.mode, account_id);
        let holds = match self.journal.store().get(&key)? {
            Some(bytes) => codec::decode_holds(&bytes)?,
            None => Vec::new(),
        };
        tally_domain::reservation::held_at(&holds, self.journal.now_ms())
            .ok_or_else(|| EngineError::Corrupt("an account's holds pass the decimal range".into()))
    }

    /// The id of the customer's account named `name`, if there is one.
    pub fn account_id_by_name(
        &self,
        scope: &Scope,
        customer_id: &str,
        name: &str,
    ) -> Result<Option<String>, EngineError> {
        let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, &scope.store_id, scope.mode)
            .text(customer_id)
            .text(name);
        Ok(self
            .journal
            .store()
            .get(name_key.as_bytes())?
            .map(|id| String::from_utf8_lossy(&id).into_owned()))
    }

    pub fn get_account(&self, scope: &Scope, id: &str) -> Result<Account, EngineError> {
        let key = Key::scoped(keys::CREDIT_ACCOUNT, &scope.store_id, scope.mode).text(id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_account(&bytes),
            None => Err(EngineError::not_found("customer credits account", id)),
        }
    }

    /// The balance of an account (customer or `system:*`) now: a grant whose expiry
    /// has passed holds nothing, whether or not a record has booked its expiry yet.
    pub fn balance(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = Key::scoped(keys::CREDIT_BALANCE, &scope.store_id, scope.mode).text(account_id);
        let booked = match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_account_totals(&bytes)?.balance,
            None => Decimal::ZERO,
        };
        self.less_unbooked_expiries(scope, account_id, booked, self.journal.now_ms())
    }

    /// The balance as the posted entries leave it (expiries not yet booked still
    /// count): what the audit replays.
    pub fn booked_balance(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = Key::scoped(keys::CREDIT_BALANCE, &scope.store_id, scope.mode).text(account_id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => Ok(codec::decode_account_totals(&bytes)?.balance),
            None => Ok(Decimal::ZERO),
        }
    }

    /// `booked` less what grants expired by `at_ms` but not yet booked have left. No
    /// step of the account happened since such a grant expired (a step books it
    /// first), so what it has left now is what it had at any instant since.
    fn less_unbooked_expiries(
        &self,
        scope: &Scope,
        account_id: &str,
        booked: Decimal,
        at_ms: i64,
    ) -> Result<Decimal, EngineError> {
        let key = crate::grants::active_key(&scope.store_id, scope.mode, account_id);
        let Some(bytes) = self.journal.store().get(&key)? else {
            return Ok(booked);
        };
        let mut balance = booked;
        for grant in codec::decode_active_grants(&bytes)? {
            if !grant.live_at(at_ms) {
                balance = balance.checked_sub(grant.remaining).ok_or_else(|| {
                    EngineError::Corrupt("a grant's remainder passes the decimal range".into())
                })?;
            }
        }
        Ok(balance)
    }

    /// The balance as of `at_ms` (inclusive): the balance after the last entry
    /// posted at or before that instant. Entries are posted in list order and an
    /// entry's `posted_at_ms` never falls below the one before it, so the list is
    /// bisected: a few point reads, however long the account's history.
    pub fn balance_at(
        &self,
        scope: &Scope,
        account_id: &str,
        at_ms: i64,
    ) -> Result<Decimal, EngineError> {
        let store = self.journal.store();
        let read = |key: &[u8]| store.get(key).map_err(EngineError::from);
        let (store_id, mode) = (&scope.store_id, scope.mode);
        let end = crate::posting::account_totals(read, store_id, mode, account_id)?.entries;
        let entry_at = |seq: u64| -> Result<codec::StoredEntry, EngineError> {
            let key = crate::posting::entry_key(store_id, mode, account_id, seq);
            match store.get(&key)? {
                Some(bytes) => codec::decode_entry(&bytes),
                None => Err(EngineError::Corrupt(format!(
                    "account {account_id} lists {} entries but has none at {seq}",
                    end.count
                ))),
            }
        };
        // The first place whose entry was posted after `at_ms` (or the end).
        let (mut low, mut high) = (0u64, end.count);
        while low < high {
            let middle = low + (high - low) / 2;
            if entry_at(middle)?.posted_at_ms <= at_ms {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        let booked = match low.checked_sub(1) {
            Some(last) => entry_at(last)?.balance_after,
            None => Decimal::ZERO,
        };
        self.less_unbooked_expiries(scope, account_id, booked, at_ms)
    }

    /// A transaction of `kind` on `account_id` with the given entries, created now;
    /// the entries are named after it (`tally_domain::ledger::entry_id`), whatever
    /// ids they came with.
    pub(crate) fn new_transaction(
        &self,
        scope: &Scope,
        kind: TransactionKind,
        account_id: &str,
        amount: Decimal,
        entries: Vec<tally_domain::ledger::Entry>,
    ) -> Transaction {
        let id = new_id("ctx");
        let mut entries = entries;
        tally_domain::ledger::name_entries(&id, &mut entries);
        Transaction {
            id: id.into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            kind,
            account_id: account_id.into(),
            amount,
            entries,
            idempotency_key: None,
            description: None,
            metadata: Default::default(),
            reverses: None,
            created_at_ms: self.journal.now_ms(),
            grant_terms: None,
        }
    }

    /// Appends a transaction on an account whose balance was `balance`, with the
    /// and waits for the projector's decision: applied, refused (409), or a repeat of
    /// an earlier transaction with the same idempotency key (that transaction is
    /// returned). The balance it leaves, and so its webhook events, are decided in
    /// apply.
    pub(crate) async fn commit_movement(
        &self,
        scope: &Scope,
        tx: Transaction,
    ) -> Result<TransactionView, EngineError> {
        let decision = self
            .journal
            .append_and_decide(&Record::CreditLedger {
                account: None,
                transaction: Some(tx.clone()),
                events: Vec::new(),
            })
            .await?;
        match decision {
            // Apply decided the grants (the entries as posted): read it back. It
            // is answered as it was created, not reversed (no read of the reversal
            // marker: a miss in sled for every new transaction; docs/benchmarks.md,
            // "Fresh keys known absent").
            Decision::Applied => Ok(TransactionView {
                transaction: self.stored_transaction(scope, &tx.id)?,
                reversed_by: None,
            }),
            Decision::SameAs(id) => self.get_transaction(scope, &id),
        }
    }

    pub async fn create_account(
        &self,
        scope: &Scope,
        input: &AccountInput,
    ) -> Result<(Account, Decimal), EngineError> {
        let customer_id = input
            .customer_id
            .as_deref()
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| FieldError::missing("customer_id"))?;
        let name = text_field("name", input.name.as_ref(), DEFAULT_ACCOUNT_NAME)?;
        let unit_label = text_field("unit_label", input.unit_label.as_ref(), DEFAULT_UNIT_LABEL)?;
        let initial = match &input.initial_balance {
            None => Decimal::ZERO,
            Some(text) => parse_amount("initial_balance", text, true)?,
        };
        if !self.holders.customer_exists(scope, customer_id)? {
            return Err(EngineError::NotFound {
                resource: "customer",
                id: customer_id.to_string(),
                param: Some("customer_id".into()),
            });
        }
        // A fast answer from the projection; apply decides again in log order.
        let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, &scope.store_id, scope.mode)
            .text(customer_id)
            .text(&name);
        if self.journal.store().get(name_key.as_bytes())?.is_some() {
            return Err(account_name_taken(customer_id, &name).into());
        }
        let now = self.journal.now_ms();
        let account = Account {
            id: new_id("ca").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            customer_id: customer_id.into(),
            name,
            unit_label,
            status: AccountStatus::Active,
            created_at_ms: now,
            updated_at_ms: now,
            low_balance_threshold: input.low_balance_threshold,
            auto_recharge: input.auto_recharge.clone(),
        };
        let transaction = if initial > Decimal::ZERO {
            let entries = post(
                TransactionKind::InitialBalance,
                &account.id,
                account.status,
                Decimal::ZERO,
                initial,
                &mut String::new,
            )
            .map_err(rejected)?;
            let mut tx = self.new_transaction(
                scope,
                TransactionKind::InitialBalance,
                &account.id,
                initial,
                entries,
            );
            tx.description = Some("initial balance".into());
            Some(tx)
        } else {
            None
        };
        // One record: the account and its seed exist together or not at all.
        self.journal
            .append_and_apply(&Record::CreditLedger {
                account: Some(account.clone()),
                transaction,
                events: Vec::new(),
            })
            .await?;
        Ok((account, initial))
    }

    pub fn list_accounts(
        &self,
        scope: &Scope,
        customer_id: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<(Account, Decimal)>, EngineError> {
        let table = match customer_id {
            Some(_) => keys::CREDIT_ACCOUNT_BY_CUSTOMER,
            None => keys::CREDIT_ACCOUNT_LIST,
        };
        let prefix = ListingKey::prefix(table, &scope.store_id, scope.mode, customer_id);
        let cursor = cursor_from(page, |id| {
            let account = self.get_account(scope, id)?;
            if customer_id.is_some_and(|c| account.customer_id != *c) {
                return Err(EngineError::not_found("customer credits account", id));
            }
            Ok(ListingKey::entry(
                table,
                &scope.store_id,
                scope.mode,
                customer_id,
                account.created_at_ms,
                &account.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let account = self.get_account(scope, id)?;
                let balance = self.balance(scope, id)?;
                Ok(Some((account, balance)))
            },
        )
    }

    /// freeze / unfreeze: active <-> frozen; repeating a transition returns the
    /// account unchanged; a closed account refuses both.
    pub async fn set_account_frozen(
        &self,
        scope: &Scope,
        id: &str,
        frozen: bool,
    ) -> Result<(Account, Decimal), EngineError> {
        let target = if frozen {
            AccountStatus::Frozen
        } else {
            AccountStatus::Active
        };
        self.change_account(scope, id, |account| {
            let changed = account.status != target;
            account.status = target;
            changed
        })
        .await
    }

    /// Sets or clears the account's low-balance threshold and auto-recharge
    /// (docs/api.md, "Thresholds and auto-recharge"); a closed account refuses.
    pub async fn update_thresholds(
        &self,
        scope: &Scope,
        id: &str,
        threshold: tally_domain::customer::Patch<Decimal>,
        recharge: tally_domain::customer::Patch<tally_domain::ledger::AutoRecharge>,
    ) -> Result<(Account, Decimal), EngineError> {
        self.change_account(scope, id, |account| {
            let next_threshold = threshold.clone().apply_to(account.low_balance_threshold);
            let next_recharge = recharge.clone().apply_to(account.auto_recharge.clone());
            let changed = next_threshold != account.low_balance_threshold
                || next_recharge != account.auto_recharge;
            account.low_balance_threshold = next_threshold;
            account.auto_recharge = next_recharge;
            changed
        })
        .await
    }

    /// One change to an account's own fields, as a `CreditLedger` record without a
    /// transaction: `change` edits the account and says whether anything changed
    /// (nothing changed: the account is returned as it is, nothing is written). A
    /// closed account refuses every change.
    async fn change_account(
        &self,
        scope: &Scope,
        id: &str,
        change: impl Fn(&mut Account) -> bool,
    ) -> Result<(Account, Decimal), EngineError> {
        let account = self
            .journal
            .update(|| {
                let mut account = self.get_account(scope, id)?;
                if account.status == AccountStatus::Closed {
                    return Err(rejected(Rejection::AccountClosed));
                }
                if !change(&mut account) {
                    return Ok(Update::Unchanged(account));
                }
                let base = self.journal.restamp(&mut account.updated_at_ms);
                Ok(Update::Write {
                    record: Record::CreditLedger {
                        account: Some(account.clone()),
                        transaction: None,
                        events: Vec::new(),
                    },
                    base_updated_at_ms: base,
                    result: account,
                })
            })
            .await?;
        let balance = self.balance(scope, id)?;
        Ok((account, balance))
    }

    /// close: final. The remaining balance moves to `forfeit` in the same record.
    pub async fn close_account(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<(Account, Decimal), EngineError> {
        let account = self
            .journal
            .update(|| {
                let mut account = self.get_account(scope, id)?;
                if account.status == AccountStatus::Closed {
                    return Ok(Update::Unchanged(account));
                }
                let balance = self.balance(scope, id)?;
                let transaction = if balance > Decimal::ZERO {
                    // The close posts against the account as it is (frozen accounts
                    // close too).
                    let entries = post(
                        TransactionKind::Close,
                        &account.id,
                        AccountStatus::Active,
                        balance,
                        balance,
                        &mut String::new,
                    )
                    .map_err(rejected)?;
                    let mut tx =
                        self.new_transaction(scope, TransactionKind::Close, id, balance, entries);
                    tx.description = Some("account closed: remaining balance forfeited".into());
                    Some(tx)
                } else {
                    None
                };
                account.status = AccountStatus::Closed;
                let base = self.journal.restamp(&mut account.updated_at_ms);
                Ok(Update::Write {
                    record: Record::CreditLedger {
                        account: Some(account.clone()),
                        transaction,
                        events: Vec::new(),
                    },
                    base_updated_at_ms: base,
                    result: account,
                })
            })
            .await?;
        Ok((account, Decimal::ZERO))
    }

    pub fn get_transaction(&self, scope: &Scope, id: &str) -> Result<TransactionView, EngineError> {
        let transaction = self.stored_transaction(scope, id)?;
        let reversed_key = Key::scoped(keys::CREDIT_REVERSED, &scope.store_id, scope.mode).text(id);
        let reversed_by = self
            .journal
            .store()
            .get(reversed_key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        Ok(TransactionView {
            transaction,
            reversed_by,
        })
    }

    /// A transaction as posted, without whether it was reversed.
    fn stored_transaction(&self, scope: &Scope, id: &str) -> Result<Transaction, EngineError> {
        let key = Key::scoped(keys::CREDIT_TRANSACTION, &scope.store_id, scope.mode).text(id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => Ok(codec::decode_transaction(&bytes)?),
            None => Err(EngineError::not_found("customer credits transaction", id)),
        }
    }

    /// credit or debit, idempotent by the caller's key.
    pub async fn move_credits(
        &self,
        scope: &Scope,
        account_id: &str,
        kind: TransactionKind,
        input: &MovementInput,
    ) -> Result<TransactionView, EngineError> {
        self.move_credits_with_terms(scope, account_id, kind, input, None)
            .await
    }

    /// `move_credits`; a credit's grant gets `terms` (docs/api.md, "Credit grants").
    pub(crate) async fn move_credits_with_terms(
        &self,
        scope: &Scope,
        account_id: &str,
        kind: TransactionKind,
        input: &MovementInput,
        terms: Option<tally_domain::grant::GrantTerms>,
    ) -> Result<TransactionView, EngineError> {
        let amount_text = input
            .amount
            .as_deref()
            .ok_or_else(|| FieldError::missing("amount"))?;
        let amount = parse_amount("amount", amount_text, false)?;
        let idempotency_key = idempotency_key_field(input.idempotency_key.as_deref())?;
        if input
            .description
            .as_ref()
            .is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_CHARS)
        {
            return Err(FieldError::invalid(
                "description",
                format!("`description` is at most {MAX_DESCRIPTION_CHARS} characters"),
            )
            .into());
        }
        tally_domain::customer::validate_metadata(&input.metadata)?;
        // No lock: the projector decides in log order (balance, status, idempotency
        // key), so concurrent debits share group commits and none overdraws.
        let account = self.get_account(scope, account_id)?;
        let idempotency = Key::scoped(keys::CREDIT_IDEMPOTENCY, &scope.store_id, scope.mode)
            .tail(idempotency_key.as_bytes());
        if let Some(existing) = self.journal.store().get(idempotency.as_bytes())? {
            let view = self.get_transaction(scope, &String::from_utf8_lossy(&existing))?;
            let same = view.transaction.account_id == account_id
                && view.transaction.amount == amount
                && view.transaction.kind == kind;
            if !same {
                return Err(idempotency_key_reused().into());
            }
            return Ok(view);
        }
        let mut balance = self.balance(scope, account_id)?;
        if kind == TransactionKind::Debit {
            // What reservations hold is not there to take (apply decides again).
            balance = tally_domain::reservation::available(balance, self.held(scope, account_id)?);
        }
        let entries = post(
            kind,
            &account.id,
            account.status,
            balance,
            amount,
            &mut String::new,
        )
        .map_err(rejected)?;
        let mut tx = self.new_transaction(scope, kind, account_id, amount, entries);
        tx.idempotency_key = Some(idempotency_key);
        tx.description = input.description.clone();
        tx.metadata = input.metadata.clone();
        tx.grant_terms = terms;
        self.commit_movement(scope, tx).await
    }

    /// A new transaction mirroring the original's entries; at most once.
    pub async fn reverse_transaction(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<TransactionView, EngineError> {
        let original = self.get_transaction(scope, id)?;
        let account_id = original.transaction.account_id.clone();
        let account = self.get_account(scope, &account_id)?;
        let balance = self.balance(scope, &account_id)?;
        let entries = post_reversal(
            &original.transaction,
            account.status,
            balance,
            original.reversed_by.is_some(),
            &mut String::new,
        )
        .map_err(rejected)?;
        let mut tx = self.new_transaction(
            scope,
            TransactionKind::Reversal,
            &account_id,
            original.transaction.amount,
            entries,
        );
        tx.description = Some(format!("reversal of {id}"));
        tx.reverses = Some(id.into());
        self.commit_movement(scope, tx).await
    }

    pub fn list_entries(
        &self,
        scope: &Scope,
        account_id: &str,
        page: &PageRequest,
    ) -> Result<Page<StoredEntry>, EngineError> {
        self.get_account(scope, account_id)?;
        let prefix = Key::scoped(keys::CREDIT_ENTRY, &scope.store_id, scope.mode)
            .text(account_id)
            .into_bytes();
        let cursor = cursor_from(page, |entry_id| {
            let missing = || EngineError::not_found("customer credits entry", entry_id);
            // An entry id names its transaction, whose row says where the entry is.
            let transaction_id =
                tally_domain::ledger::transaction_of_entry(entry_id).ok_or_else(missing)?;
            let transaction_key =
                Key::scoped(keys::CREDIT_TRANSACTION, &scope.store_id, scope.mode)
                    .text(&transaction_id);
            let row = self
                .journal
                .store()
                .get(transaction_key.as_bytes())?
                .ok_or_else(missing)?;
            match codec::posted_entry_place(&row, entry_id)? {
                Some((owner, seq)) if owner == account_id => Ok(crate::posting::entry_key(
                    &scope.store_id,
                    scope.mode,
                    account_id,
                    seq,
                )),
                _ => Err(missing()),
            }
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |_, value| codec::decode_entry(value).map(Some),
        )
    }
}
