//! The credits ledger service and its projection (decisions.md "Customer credits").
//!
//! Consistency: every step for an account (balance check, append, apply) runs under
//! that account's lock, held until the record is applied, so 200 concurrent debits of
//! 1 against a balance of 100 succeed exactly 100 times. Multi-node Kafka deployments
//! route a store's writes to one node (deploy/README.md), which makes that node the
//! account's single decider.

use std::ops::Bound;
use std::sync::Arc;

use rust_decimal::Decimal;
use tally_domain::ledger::{
    parse_amount, post, post_reversal, Account, AccountStatus, Rejection, SystemAccount,
    Transaction, TransactionKind, DEFAULT_ACCOUNT_NAME, DEFAULT_UNIT_LABEL, MAX_ACCOUNT_NAME_CHARS,
    MAX_DESCRIPTION_CHARS, MAX_IDEMPOTENCY_KEY_CHARS,
};
use tally_domain::record::{LedgerEvent, Record};
use tally_domain::FieldError;

use crate::codec::{self, StoredEntry};
use crate::customers::cursor_from;
use crate::error::EngineError;
use crate::ids::new_id;
use crate::keys::{self, Key};
use crate::pagination::{paginate, Page, PageRequest};
use crate::projector::Overlay;
use crate::{Engine, Scope};

pub const EVENT_CREDITS_GRANTED: &str = "credits.granted";
pub const EVENT_CREDITS_CONSUMED: &str = "credits.consumed";
pub const EVENT_CREDITS_EXHAUSTED: &str = "customer_credits.exhausted";

/// Input of `POST /v1/customer-credits/accounts`, as the edge parsed it.
#[derive(Debug, Clone, Default)]
pub struct AccountInput {
    pub customer_id: Option<String>,
    pub name: Option<String>,
    pub unit_label: Option<String>,
    pub initial_balance: Option<String>,
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

/// Folds one ledger step into the projection (called by the projector).
pub fn apply_ledger_step(
    overlay: &mut Overlay<'_>,
    account: Option<&Account>,
    transaction: Option<&Transaction>,
    events: &[LedgerEvent],
) -> Result<(), EngineError> {
    if let Some(account) = account {
        let (store, mode) = (&account.store_id, account.mode);
        let key = Key::scoped(keys::CREDIT_ACCOUNT, store, mode)
            .text(&account.id)
            .into_bytes();
        if overlay.get(&key)?.is_none() {
            overlay.put(
                Key::scoped(keys::CREDIT_ACCOUNT_LIST, store, mode)
                    .int(account.created_at_ms)
                    .text(&account.id)
                    .into_bytes(),
                Vec::new(),
            );
            overlay.put(
                Key::scoped(keys::CREDIT_ACCOUNT_BY_CUSTOMER, store, mode)
                    .text(&account.customer_id)
                    .int(account.created_at_ms)
                    .text(&account.id)
                    .into_bytes(),
                Vec::new(),
            );
            overlay.put(
                Key::scoped(keys::CREDIT_ACCOUNT_NAME, store, mode)
                    .text(&account.customer_id)
                    .text(&account.name)
                    .into_bytes(),
                account.id.as_bytes().to_vec(),
            );
            overlay.put(
                Key::scoped(keys::CREDIT_BALANCE, store, mode)
                    .text(&account.id)
                    .into_bytes(),
                codec::encode_decimal(Decimal::ZERO),
            );
        }
        overlay.put(key, codec::encode_account(account));
    }
    if let Some(tx) = transaction {
        let (store, mode) = (&tx.store_id, tx.mode);
        overlay.put(
            Key::scoped(keys::CREDIT_TRANSACTION, store, mode)
                .text(&tx.id)
                .into_bytes(),
            codec::encode_transaction(tx),
        );
        if let Some(idempotency_key) = &tx.idempotency_key {
            overlay.put(
                Key::scoped(keys::CREDIT_IDEMPOTENCY, store, mode)
                    .tail(idempotency_key.as_bytes())
                    .into_bytes(),
                tx.id.as_bytes().to_vec(),
            );
        }
        if let Some(original) = &tx.reverses {
            overlay.put(
                Key::scoped(keys::CREDIT_REVERSED, store, mode)
                    .text(original)
                    .into_bytes(),
                tx.id.as_bytes().to_vec(),
            );
        }
        for entry in &tx.entries {
            let balance_key = Key::scoped(keys::CREDIT_BALANCE, store, mode)
                .text(&entry.account_id)
                .into_bytes();
            let balance = match overlay.get(&balance_key)? {
                Some(bytes) => codec::decode_decimal(&bytes)?,
                None => Decimal::ZERO,
            } + entry.amount;
            overlay.put(balance_key, codec::encode_decimal(balance));
            if SystemAccount::from_account_id(&entry.account_id).is_some() {
                continue;
            }
            let seq_key = Key::scoped(keys::CREDIT_ENTRY_SEQ, store, mode)
                .text(&entry.account_id)
                .into_bytes();
            let seq = match overlay.get(&seq_key)? {
                Some(bytes) => u64::from_be_bytes(
                    bytes
                        .as_slice()
                        .try_into()
                        .map_err(|_| EngineError::Corrupt("entry seq".into()))?,
                ),
                None => 0,
            };
            overlay.put(seq_key, (seq + 1).to_be_bytes().to_vec());
            let stored = StoredEntry {
                id: entry.id.clone(),
                transaction_id: tx.id.clone(),
                account_id: entry.account_id.clone(),
                amount: entry.amount,
                created_at_ms: tx.created_at_ms,
                balance_after: balance,
            };
            overlay.put(
                Key::scoped(keys::CREDIT_ENTRY, store, mode)
                    .text(&entry.account_id)
                    .uint(seq)
                    .into_bytes(),
                codec::encode_entry(&stored),
            );
            let mut pointer = entry.account_id.as_bytes().to_vec();
            pointer.push(0);
            pointer.extend_from_slice(&seq.to_be_bytes());
            overlay.put(
                Key::scoped(keys::CREDIT_ENTRY_ID, store, mode)
                    .text(&entry.id)
                    .into_bytes(),
                pointer,
            );
            overlay.put(
                Key::scoped(keys::CREDIT_BALANCE_HISTORY, store, mode)
                    .text(&entry.account_id)
                    .int(tx.created_at_ms)
                    .uint(seq)
                    .into_bytes(),
                codec::encode_decimal(balance),
            );
        }
    }
    for event in events {
        let (store, mode) = (&event.account.store_id, event.account.mode);
        overlay.put(
            Key::scoped(keys::WEBHOOK_EVENT, store, mode)
                .int(event.created_at_ms)
                .text(&event.id)
                .into_bytes(),
            tally_proto::Message::encode_to_vec(&tally_proto::ledger_event_to_proto(event)),
        );
    }
    Ok(())
}

impl Engine {
    fn account_lock(&self, account_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.account_locks
            .entry(account_id.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(())))
            .clone()
    }

    pub fn get_account(&self, scope: &Scope, id: &str) -> Result<Account, EngineError> {
        let key = Key::scoped(keys::CREDIT_ACCOUNT, &scope.store_id, scope.mode).text(id);
        match self.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_account(&bytes),
            None => Err(EngineError::not_found("customer credits account", id)),
        }
    }

    /// The balance of an account (customer or `system:*`) now.
    pub fn balance(&self, scope: &Scope, account_id: &str) -> Result<Decimal, EngineError> {
        let key = Key::scoped(keys::CREDIT_BALANCE, &scope.store_id, scope.mode).text(account_id);
        match self.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_decimal(&bytes),
            None => Ok(Decimal::ZERO),
        }
    }

    /// The balance as of `at_ms` (inclusive): the balance after the last entry at or
    /// before that instant.
    pub fn balance_at(
        &self,
        scope: &Scope,
        account_id: &str,
        at_ms: i64,
    ) -> Result<Decimal, EngineError> {
        let base =
            Key::scoped(keys::CREDIT_BALANCE_HISTORY, &scope.store_id, scope.mode).text(account_id);
        let start = base.clone().into_bytes();
        let end = base.int(at_ms.saturating_add(1)).into_bytes();
        let mut found = None;
        self.store().scan(
            Bound::Included(&start),
            Bound::Excluded(&end),
            true,
            &mut |_, v| {
                found = Some(v.to_vec());
                tally_projection::Visit::Stop
            },
        )?;
        match found {
            Some(bytes) => codec::decode_decimal(&bytes),
            None => Ok(Decimal::ZERO),
        }
    }

    fn ledger_event(
        &self,
        event_type: &str,
        transaction_id: Option<&str>,
        account: &Account,
        balance: Decimal,
    ) -> LedgerEvent {
        LedgerEvent {
            id: new_id("whevt"),
            event_type: event_type.to_string(),
            created_at_ms: self.now_ms(),
            transaction_id: transaction_id.map(str::to_string),
            account: account.clone(),
            balance,
        }
    }

    /// Events of a transaction that moved the account by `delta` to `balance_after`.
    fn movement_events(
        &self,
        tx: &Transaction,
        account: &Account,
        delta: Decimal,
        balance_after: Decimal,
    ) -> Vec<LedgerEvent> {
        let mut events = Vec::new();
        if delta > Decimal::ZERO {
            events.push(self.ledger_event(
                EVENT_CREDITS_GRANTED,
                Some(&tx.id),
                account,
                balance_after,
            ));
        } else if delta < Decimal::ZERO {
            events.push(self.ledger_event(
                EVENT_CREDITS_CONSUMED,
                Some(&tx.id),
                account,
                balance_after,
            ));
            if balance_after.is_zero() {
                events.push(self.ledger_event(
                    EVENT_CREDITS_EXHAUSTED,
                    Some(&tx.id),
                    account,
                    balance_after,
                ));
            }
        }
        events
    }

    /// A transaction of `kind` on `account_id` with the given entries, created now.
    fn new_transaction(
        &self,
        scope: &Scope,
        kind: TransactionKind,
        account_id: &str,
        amount: Decimal,
        entries: Vec<tally_domain::ledger::Entry>,
    ) -> Transaction {
        Transaction {
            id: new_id("ctx"),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            kind,
            account_id: account_id.to_string(),
            amount,
            entries,
            idempotency_key: None,
            description: None,
            metadata: Default::default(),
            reverses: None,
            created_at_ms: self.now_ms(),
        }
    }

    /// Appends a transaction on an account whose balance was `balance`, with the
    /// webhook events it causes, and waits until it is applied.
    async fn commit_movement(
        &self,
        account: &Account,
        balance: Decimal,
        tx: Transaction,
    ) -> Result<TransactionView, EngineError> {
        let delta = tx.delta_for(&account.id);
        let events = self.movement_events(&tx, account, delta, balance + delta);
        self.append_and_apply(&Record::CreditLedger {
            account: None,
            transaction: Some(tx.clone()),
            events,
        })
        .await?;
        Ok(TransactionView {
            transaction: tx,
            reversed_by: None,
        })
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
        if !self.customer_exists(scope, customer_id)? {
            return Err(EngineError::NotFound {
                resource: "customer",
                id: customer_id.to_string(),
                param: Some("customer_id".into()),
            });
        }
        let lock = self.control_lock(scope);
        let _guard = lock.lock().await;
        let name_key = Key::scoped(keys::CREDIT_ACCOUNT_NAME, &scope.store_id, scope.mode)
            .text(customer_id)
            .text(&name);
        if self.store().get(name_key.as_bytes())?.is_some() {
            return Err(EngineError::Conflict {
                code: "account_name_taken",
                message: format!("customer {customer_id} already has an account named '{name}'"),
                param: Some("name".into()),
                archived_holder_id: None,
            });
        }
        let now = self.now_ms();
        let account = Account {
            id: new_id("ca"),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            customer_id: customer_id.to_string(),
            name,
            unit_label,
            status: AccountStatus::Active,
            created_at_ms: now,
            updated_at_ms: now,
        };
        let mut events = Vec::new();
        let transaction = if initial > Decimal::ZERO {
            let entries = post(
                TransactionKind::InitialBalance,
                &account.id,
                account.status,
                Decimal::ZERO,
                initial,
                &mut || new_id("ce"),
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
            events = self.movement_events(&tx, &account, initial, initial);
            Some(tx)
        } else {
            None
        };
        // One record: the account and its seed exist together or not at all.
        self.append_and_apply(&Record::CreditLedger {
            account: Some(account.clone()),
            transaction,
            events,
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
        let prefix = match customer_id {
            Some(c) => Key::scoped(
                keys::CREDIT_ACCOUNT_BY_CUSTOMER,
                &scope.store_id,
                scope.mode,
            )
            .text(c)
            .into_bytes(),
            None => {
                Key::scoped(keys::CREDIT_ACCOUNT_LIST, &scope.store_id, scope.mode).into_bytes()
            }
        };
        let cursor = cursor_from(page, |id| {
            let account = self.get_account(scope, id)?;
            if customer_id.is_some_and(|c| c != account.customer_id) {
                return Err(EngineError::not_found("customer credits account", id));
            }
            let mut key = prefix.clone();
            key.extend_from_slice(
                Key::table(0)
                    .int(account.created_at_ms)
                    .text(&account.id)
                    .as_bytes()[1..]
                    .as_ref(),
            );
            Ok(key)
        })?;
        paginate(
            self.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let (id, _) = keys::read_text(key, prefix.len() + 8)
                    .ok_or_else(|| EngineError::Corrupt("account index".into()))?;
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
        let lock = self.account_lock(id);
        let _guard = lock.lock().await;
        let mut account = self.get_account(scope, id)?;
        let target = if frozen {
            AccountStatus::Frozen
        } else {
            AccountStatus::Active
        };
        if account.status == AccountStatus::Closed {
            return Err(rejected(Rejection::AccountClosed));
        }
        if account.status != target {
            account.status = target;
            account.updated_at_ms = self.now_ms();
            self.append_and_apply(&Record::CreditLedger {
                account: Some(account.clone()),
                transaction: None,
                events: Vec::new(),
            })
            .await?;
        }
        let balance = self.balance(scope, id)?;
        Ok((account, balance))
    }

    /// close: final. The remaining balance moves to `forfeit` in the same record.
    pub async fn close_account(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<(Account, Decimal), EngineError> {
        let lock = self.account_lock(id);
        let _guard = lock.lock().await;
        let mut account = self.get_account(scope, id)?;
        if account.status == AccountStatus::Closed {
            return Ok((account, Decimal::ZERO));
        }
        let balance = self.balance(scope, id)?;
        let now = self.now_ms();
        let transaction = if balance > Decimal::ZERO {
            // The close posts against the account as it is (frozen accounts close too).
            let entries = post(
                TransactionKind::Close,
                id,
                AccountStatus::Active,
                balance,
                balance,
                &mut || new_id("ce"),
            )
            .map_err(rejected)?;
            let mut tx = self.new_transaction(scope, TransactionKind::Close, id, balance, entries);
            tx.description = Some("account closed: remaining balance forfeited".into());
            Some(tx)
        } else {
            None
        };
        account.status = AccountStatus::Closed;
        account.updated_at_ms = now;
        self.append_and_apply(&Record::CreditLedger {
            account: Some(account.clone()),
            transaction,
            events: Vec::new(),
        })
        .await?;
        Ok((account, Decimal::ZERO))
    }

    pub fn get_transaction(&self, scope: &Scope, id: &str) -> Result<TransactionView, EngineError> {
        let key = Key::scoped(keys::CREDIT_TRANSACTION, &scope.store_id, scope.mode).text(id);
        let transaction = match self.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_transaction(&bytes)?,
            None => return Err(EngineError::not_found("customer credits transaction", id)),
        };
        let reversed_key = Key::scoped(keys::CREDIT_REVERSED, &scope.store_id, scope.mode).text(id);
        let reversed_by = self
            .store()
            .get(reversed_key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        Ok(TransactionView {
            transaction,
            reversed_by,
        })
    }

    /// credit or debit, idempotent by the caller's key.
    pub async fn move_credits(
        &self,
        scope: &Scope,
        account_id: &str,
        kind: TransactionKind,
        input: &MovementInput,
    ) -> Result<TransactionView, EngineError> {
        let amount_text = input
            .amount
            .as_deref()
            .ok_or_else(|| FieldError::missing("amount"))?;
        let amount = parse_amount("amount", amount_text, false)?;
        let idempotency_key = input
            .idempotency_key
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| FieldError::missing("idempotency_key"))?
            .to_string();
        if idempotency_key.chars().count() > MAX_IDEMPOTENCY_KEY_CHARS {
            return Err(FieldError::invalid(
                "idempotency_key",
                "`idempotency_key` is at most 255 characters",
            )
            .into());
        }
        if input
            .description
            .as_ref()
            .is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_CHARS)
        {
            return Err(FieldError::invalid(
                "description",
                "`description` is at most 1000 characters",
            )
            .into());
        }
        tally_domain::customer::validate_metadata(&input.metadata)?;
        let lock = self.account_lock(account_id);
        let _guard = lock.lock().await;
        let account = self.get_account(scope, account_id)?;
        let idempotency = Key::scoped(keys::CREDIT_IDEMPOTENCY, &scope.store_id, scope.mode)
            .tail(idempotency_key.as_bytes());
        if let Some(existing) = self.store().get(idempotency.as_bytes())? {
            let view = self.get_transaction(scope, &String::from_utf8_lossy(&existing))?;
            let same = view.transaction.account_id == account_id
                && view.transaction.amount == amount
                && view.transaction.kind == kind;
            if !same {
                return Err(EngineError::Conflict {
                    code: "idempotency_key_reused",
                    message:
                        "this idempotency_key was used for a different amount, account or operation"
                            .into(),
                    param: Some("idempotency_key".into()),
                    archived_holder_id: None,
                });
            }
            return Ok(view);
        }
        let balance = self.balance(scope, account_id)?;
        let entries = post(
            kind,
            account_id,
            account.status,
            balance,
            amount,
            &mut || new_id("ce"),
        )
        .map_err(rejected)?;
        let mut tx = self.new_transaction(scope, kind, account_id, amount, entries);
        tx.idempotency_key = Some(idempotency_key);
        tx.description = input.description.clone();
        tx.metadata = input.metadata.clone();
        self.commit_movement(&account, balance, tx).await
    }

    /// A new transaction mirroring the original's entries; at most once.
    pub async fn reverse_transaction(
        &self,
        scope: &Scope,
        id: &str,
    ) -> Result<TransactionView, EngineError> {
        let original = self.get_transaction(scope, id)?;
        let account_id = original.transaction.account_id.clone();
        let lock = self.account_lock(&account_id);
        let _guard = lock.lock().await;
        let original = self.get_transaction(scope, id)?;
        let account = self.get_account(scope, &account_id)?;
        let balance = self.balance(scope, &account_id)?;
        let entries = post_reversal(
            &original.transaction,
            account.status,
            balance,
            original.reversed_by.is_some(),
            &mut || new_id("ce"),
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
        tx.reverses = Some(id.to_string());
        self.commit_movement(&account, balance, tx).await
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
            let pointer_key =
                Key::scoped(keys::CREDIT_ENTRY_ID, &scope.store_id, scope.mode).text(entry_id);
            let pointer = self
                .store()
                .get(pointer_key.as_bytes())?
                .ok_or_else(|| EngineError::not_found("customer credits entry", entry_id))?;
            let (owner, next) = keys::read_text(&pointer, 0)
                .ok_or_else(|| EngineError::Corrupt("entry pointer".into()))?;
            if owner != account_id {
                return Err(EngineError::not_found("customer credits entry", entry_id));
            }
            let mut key = prefix.clone();
            key.extend_from_slice(&pointer[next..]);
            Ok(key)
        })?;
        paginate(
            self.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |_, value| codec::decode_entry(value).map(Some),
        )
    }
}
