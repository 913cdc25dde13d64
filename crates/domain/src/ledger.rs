//! The credits ledger's pure rules: accounts, double-entry transactions, posting
//! rules and rejections (docs/api.md, "Customer credits").
//!
//! Every transaction moves value between a customer account and one of the store's
//! system accounts (`issuance`, `consumption`, `forfeit`); its entries sum to exactly
//! zero. Rejections are values with reason codes, never panics.

use std::collections::BTreeMap;

use rust_decimal::Decimal;

use crate::error::FieldError;
use crate::exact::{exact_add, exact_sum};
use crate::ids::{AccountId, CustomerId, StoreId, TransactionId};
use crate::mode::Mode;
use crate::usage::parse_decimal;

/// Most fractional digits an amount may carry (docs/api.md "Amounts").
pub const MAX_AMOUNT_SCALE: u32 = 18;
/// Largest amount of one credit, debit or initial balance: a quadrillion credits,
/// far beyond any real grant, small enough that no sum below can overflow.
pub const MAX_AMOUNT: Decimal = Decimal::from_parts(0xA4C6_8000, 0x0003_8D7E, 0, false, 0); // 1e15
/// Largest magnitude any balance may reach: customer accounts and the store's
/// system accounts (which carry the running totals of every grant and consumption).
///
/// Why nothing can overflow: every entry is at most `MAX_BALANCE` in magnitude (an
/// amount is at most `MAX_AMOUNT`, a close forfeits at most a whole balance), so a
/// balance plus an entry is at most 2e18 in magnitude, far inside rust_decimal's
/// ~7.9e28. The projector adds with `exact_add` and refuses (a recorded rejection,
/// `amount_out_of_range`) any step that would take a balance past this limit or need
/// more than 28 significant digits; so every stored balance stays in range, and a
/// store's total over all its accounts is exactly zero by double entry.
pub const MAX_BALANCE: Decimal = Decimal::from_parts(0xA764_0000, 0x0DE0_B6B3, 0, false, 0); // 1e18
/// Account name and unit label length.
pub const MAX_ACCOUNT_NAME_CHARS: usize = 255;
pub const DEFAULT_ACCOUNT_NAME: &str = "default";
pub const DEFAULT_UNIT_LABEL: &str = "credits";
/// Description length of a transaction.
pub const MAX_DESCRIPTION_CHARS: usize = 1000;
/// Caller idempotency key length.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccountStatus {
    Active,
    Frozen,
    Closed,
}

impl AccountStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AccountStatus::Active => "active",
            AccountStatus::Frozen => "frozen",
            AccountStatus::Closed => "closed",
        }
    }
}

/// The store's own accounts that take the other side of every transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SystemAccount {
    Issuance,
    Consumption,
    Forfeit,
}

impl SystemAccount {
    pub const ALL: [SystemAccount; 3] = [
        SystemAccount::Issuance,
        SystemAccount::Consumption,
        SystemAccount::Forfeit,
    ];

    /// The account id used in entries. Never a customer account id (those start `ca_`).
    pub fn account_id(self) -> &'static str {
        match self {
            SystemAccount::Issuance => "system:issuance",
            SystemAccount::Consumption => "system:consumption",
            SystemAccount::Forfeit => "system:forfeit",
        }
    }

    pub fn from_account_id(id: &str) -> Option<SystemAccount> {
        SystemAccount::ALL
            .into_iter()
            .find(|s| s.account_id() == id)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub id: AccountId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub customer_id: CustomerId,
    pub name: String,
    pub unit_label: String,
    pub status: AccountStatus,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// `credits.balance_low` fires each time the available balance crosses below it
    /// (docs/api.md, "Thresholds and auto-recharge").
    pub low_balance_threshold: Option<Decimal>,
    /// After a debit that leaves the balance below `threshold`, a grant of `amount`
    /// is booked right after it.
    pub auto_recharge: Option<AutoRecharge>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoRecharge {
    pub threshold: Decimal,
    pub amount: Decimal,
    /// What one recharge costs, charged on the customer's last successful payment
    /// method before its grant is booked; `None`: the grant is free and booked
    /// right after the debit (docs/api.md, "Thresholds and auto-recharge").
    pub price: Option<RechargePrice>,
}

/// The money one auto-recharge costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RechargePrice {
    /// Minor units, 1..=`MAX_PRICE_MINOR`.
    pub amount: i64,
    /// ISO 4217, upper case.
    pub currency: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionKind {
    /// `initial_balance` at account creation.
    InitialBalance,
    Credit,
    Debit,
    /// Mirrors another transaction's entries.
    Reversal,
    /// Moves the remaining balance to `forfeit` when an account closes.
    Close,
    /// Moves what a grant has left to `forfeit` at its expiry instant.
    Expiry,
    /// Moves what a voided grant has left to `forfeit`.
    GrantVoid,
}

impl TransactionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransactionKind::InitialBalance => "initial_balance",
            TransactionKind::Credit => "credit",
            TransactionKind::Debit => "debit",
            TransactionKind::Reversal => "reversal",
            TransactionKind::Close => "close",
            TransactionKind::Expiry => "expiry",
            TransactionKind::GrantVoid => "grant_void",
        }
    }

    pub fn parse(text: &str) -> Option<TransactionKind> {
        [
            TransactionKind::InitialBalance,
            TransactionKind::Credit,
            TransactionKind::Debit,
            TransactionKind::Reversal,
            TransactionKind::Close,
            TransactionKind::Expiry,
            TransactionKind::GrantVoid,
        ]
        .into_iter()
        .find(|k| k.as_str() == text)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub id: String,
    pub account_id: AccountId,
    /// Signed: + credits the account, - debits it.
    pub amount: Decimal,
    /// A customer account's entry: the grant it gave to or drew from (decided in
    /// apply; docs/api.md, "Credit grants"). `None` on system accounts' entries.
    pub grant_id: Option<crate::ids::GrantId>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Transaction {
    pub id: TransactionId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub kind: TransactionKind,
    /// The customer account the transaction is about.
    pub account_id: AccountId,
    /// Positive size of the movement.
    pub amount: Decimal,
    pub entries: Vec<Entry>,
    pub idempotency_key: Option<String>,
    pub description: Option<String>,
    pub metadata: std::collections::BTreeMap<String, String>,
    /// For a reversal: the transaction it reverses.
    pub reverses: Option<TransactionId>,
    pub created_at_ms: i64,
    /// A credit made through the grants endpoint: its grant's priority and expiry
    /// (other credits make a grant with the default terms).
    pub grant_terms: Option<crate::grant::GrantTerms>,
}

impl Transaction {
    /// The double-entry invariant.
    pub fn entries_sum_to_zero(&self) -> bool {
        exact_sum(self.entries.iter().map(|e| e.amount)).is_some_and(|sum| sum.is_zero())
            && self.entries.len() >= 2
    }

    /// The signed change this transaction makes to `account_id` (zero when the
    /// entries cannot be summed exactly; `balances_after` refuses such a transaction).
    pub fn delta_for(&self, account_id: &str) -> Decimal {
        exact_sum(
            self.entries
                .iter()
                .filter(|e| e.account_id == account_id)
                .map(|e| e.amount),
        )
        .unwrap_or_default()
    }
}

/// Why the ledger refuses a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    InsufficientBalance,
    AccountFrozen,
    AccountClosed,
    AlreadyReversed,
    NotReversible,
    /// A balance would pass `MAX_BALANCE` or need rounding.
    AmountOutOfRange,
    /// The entries do not form a valid double-entry transaction (a forged record).
    Unbalanced,
}

impl Rejection {
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::InsufficientBalance => "insufficient_balance",
            Rejection::AccountFrozen => "account_frozen",
            Rejection::AccountClosed => "account_closed",
            Rejection::AlreadyReversed => "transaction_already_reversed",
            Rejection::NotReversible => "transaction_not_reversible",
            Rejection::AmountOutOfRange => "amount_out_of_range",
            Rejection::Unbalanced => "transaction_unbalanced",
        }
    }

    pub fn message(&self) -> &'static str {
        match self {
            Rejection::InsufficientBalance => {
                "the account's balance is lower than the amount; nothing was written"
            }
            Rejection::AccountFrozen => {
                "the account is frozen and takes no transactions; unfreeze it first"
            }
            Rejection::AccountClosed => "the account is closed for good and takes no transactions",
            Rejection::AlreadyReversed => "the transaction was already reversed",
            Rejection::NotReversible => {
                "only credit, debit and initial-balance transactions can be reversed"
            }
            Rejection::AmountOutOfRange => {
                "the transaction would take a balance (the account's or the store's running total) past 1e18 credits or beyond 28 significant digits; nothing was written"
            }
            Rejection::Unbalanced => {
                "a transaction needs at least two entries that sum to exactly zero"
            }
        }
    }
}

/// Parses an amount: a positive decimal string, at most `MAX_AMOUNT_SCALE` fractional
/// digits, at most `MAX_AMOUNT`, exactly representable (never rounded).
/// `allow_zero` for `initial_balance`.
/// The id of a transaction's `n`-th entry (from 1): `ce_` and the transaction id's
/// tail, then `_n`. An entry id names its transaction, so a list cursor finds the
/// entry through the transaction (docs/api.md, "Customer credits").
pub fn entry_id(transaction_id: &str, n: usize) -> String {
    let tail = transaction_id
        .strip_prefix("ctx_")
        .unwrap_or(transaction_id);
    format!("ce_{tail}_{n}")
}

/// The transaction an entry id names (the inverse of [`entry_id`]); `None` for a
/// string that is no entry id.
pub fn transaction_of_entry(entry_id: &str) -> Option<String> {
    let (tail, n) = entry_id.strip_prefix("ce_")?.rsplit_once('_')?;
    if tail.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!("ctx_{tail}"))
}

/// Whether `entry_id` is an entry id of `transaction_id` (see [`entry_id`]).
pub fn names_transaction(entry_id: &str, transaction_id: &str) -> bool {
    let tail = transaction_id
        .strip_prefix("ctx_")
        .unwrap_or(transaction_id);
    entry_id
        .strip_prefix("ce_")
        .and_then(|rest| rest.strip_prefix(tail))
        .and_then(|rest| rest.strip_prefix('_'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Names a transaction's entries after it, in order: see [`entry_id`].
pub fn name_entries(transaction_id: &str, entries: &mut [Entry]) {
    let mut next = entry_ids(transaction_id);
    for entry in entries {
        entry.id = next();
    }
}

/// Entry ids for a transaction's entries, in order: see [`entry_id`].
pub fn entry_ids(transaction_id: &str) -> impl FnMut() -> String + '_ {
    let mut n = 0;
    move || {
        n += 1;
        entry_id(transaction_id, n)
    }
}

pub fn parse_amount(param: &str, text: &str, allow_zero: bool) -> Result<Decimal, FieldError> {
    let trimmed = text.trim();
    let invalid = || {
        FieldError::invalid(
            param,
            format!("`{param}` must be a {} decimal string of at most {MAX_AMOUNT} with at most {MAX_AMOUNT_SCALE} fractional digits and 28 significant digits, e.g. \"12.5\"",
                if allow_zero { "non-negative" } else { "positive" }),
        )
    };
    let plain = !trimmed.is_empty()
        && trimmed.chars().all(|c| c.is_ascii_digit() || c == '.')
        && trimmed.chars().filter(|c| *c == '.').count() <= 1
        && !trimmed.starts_with('.')
        && !trimmed.ends_with('.');
    if !plain {
        return Err(invalid());
    }
    let fraction_digits = trimmed.split_once('.').map_or(0, |(_, f)| f.len());
    if fraction_digits > MAX_AMOUNT_SCALE as usize {
        return Err(invalid());
    }
    let value = parse_decimal(trimmed).ok_or_else(invalid)?;
    if value.is_sign_negative() || (value.is_zero() && !allow_zero) || value > MAX_AMOUNT {
        return Err(invalid());
    }
    Ok(value.normalize())
}

/// The balances a transaction leaves, account by account, given the balances before
/// (`balance_before`, zero for an account never touched). This is the projector's
/// re-check, in log order, of what the service decided: entries must form a valid
/// double-entry transaction, no balance may pass `MAX_BALANCE` or need rounding,
/// and no customer account may go below zero (system accounts are signed by nature).
pub fn balances_after(
    transaction: &Transaction,
    balance_before: &dyn Fn(&str) -> Decimal,
) -> Result<BTreeMap<AccountId, Decimal>, Rejection> {
    if !transaction.entries_sum_to_zero() {
        return Err(Rejection::Unbalanced);
    }
    let mut after: BTreeMap<AccountId, Decimal> = BTreeMap::new();
    for entry in &transaction.entries {
        if entry.amount.abs() > MAX_BALANCE {
            return Err(Rejection::AmountOutOfRange);
        }
        let before = match after.get(&entry.account_id) {
            Some(balance) => *balance,
            None => balance_before(&entry.account_id),
        };
        let balance = exact_add(before, entry.amount)
            .filter(|b| b.abs() <= MAX_BALANCE)
            .ok_or(Rejection::AmountOutOfRange)?;
        after.insert(entry.account_id.clone(), balance);
    }
    let overdrawn = after.iter().any(|(id, balance)| {
        SystemAccount::from_account_id(id).is_none() && *balance < Decimal::ZERO
    });
    if overdrawn {
        return Err(Rejection::InsufficientBalance);
    }
    Ok(after)
}

/// Checks that an account can take a transaction at all.
pub fn check_open(status: AccountStatus) -> Result<(), Rejection> {
    match status {
        AccountStatus::Active => Ok(()),
        AccountStatus::Frozen => Err(Rejection::AccountFrozen),
        AccountStatus::Closed => Err(Rejection::AccountClosed),
    }
}

/// The entries of a movement of `amount` into (`+`) or out of (`-`) the account.
fn pair(
    account_id: &AccountId,
    signed: Decimal,
    other: SystemAccount,
    new_entry_id: &mut dyn FnMut() -> String,
) -> Vec<Entry> {
    vec![
        Entry {
            id: new_entry_id(),
            account_id: account_id.clone(),
            amount: signed,
            grant_id: None,
        },
        Entry {
            id: new_entry_id(),
            account_id: other.account_id().into(),
            amount: -signed,
            grant_id: None,
        },
    ]
}

/// Posting rule for a transaction kind, given the account's status and balance.
/// Returns the entries or why not.
pub fn post(
    kind: TransactionKind,
    account_id: &AccountId,
    status: AccountStatus,
    balance: Decimal,
    amount: Decimal,
    new_entry_id: &mut dyn FnMut() -> String,
) -> Result<Vec<Entry>, Rejection> {
    check_open(status)?;
    match kind {
        TransactionKind::InitialBalance | TransactionKind::Credit => Ok(pair(
            account_id,
            amount,
            SystemAccount::Issuance,
            new_entry_id,
        )),
        TransactionKind::Debit => {
            if balance < amount {
                return Err(Rejection::InsufficientBalance);
            }
            Ok(pair(
                account_id,
                -amount,
                SystemAccount::Consumption,
                new_entry_id,
            ))
        }
        TransactionKind::Close => Ok(pair(
            account_id,
            -balance,
            SystemAccount::Forfeit,
            new_entry_id,
        )),
        // Built by the ledger's apply (expiry) or for one grant (void), never here.
        TransactionKind::Reversal | TransactionKind::Expiry | TransactionKind::GrantVoid => {
            Err(Rejection::NotReversible)
        }
    }
}

/// Posting rule of a reversal: the original's entries mirrored. Refused when the
/// account would go negative, is not active, or the original is not reversible.
pub fn post_reversal(
    original: &Transaction,
    status: AccountStatus,
    balance: Decimal,
    already_reversed: bool,
    new_entry_id: &mut dyn FnMut() -> String,
) -> Result<Vec<Entry>, Rejection> {
    if already_reversed {
        return Err(Rejection::AlreadyReversed);
    }
    if !matches!(
        original.kind,
        TransactionKind::Credit | TransactionKind::Debit | TransactionKind::InitialBalance
    ) {
        return Err(Rejection::NotReversible);
    }
    check_open(status)?;
    let delta = -original.delta_for(&original.account_id);
    match exact_add(balance, delta) {
        None => return Err(Rejection::AmountOutOfRange),
        Some(after) if after < Decimal::ZERO => return Err(Rejection::InsufficientBalance),
        Some(_) => {}
    }
    Ok(original
        .entries
        .iter()
        .map(|e| Entry {
            id: new_entry_id(),
            account_id: e.account_id.clone(),
            amount: -e.amount,
            grant_id: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("ce_{n}")
        }
    }

    #[test]
    fn an_entry_id_names_its_transaction() {
        let mut next = entry_ids("ctx_AbC123");
        assert_eq!(next(), "ce_AbC123_1");
        assert_eq!(next(), "ce_AbC123_2");
        assert_eq!(
            transaction_of_entry("ce_AbC123_2").as_deref(),
            Some("ctx_AbC123")
        );
        // A derived transaction id keeps its own underscores.
        let id = entry_id("ctx_AbC_e3", 10);
        assert_eq!(transaction_of_entry(&id).as_deref(), Some("ctx_AbC_e3"));
        for not_an_entry in ["", "ce_", "ce__1", "ce_x_", "ce_x_1a", "ctx_x_1", "ce_x"] {
            assert_eq!(transaction_of_entry(not_an_entry), None, "{not_an_entry}");
        }
        assert!(names_transaction("ce_AbC_e3_10", "ctx_AbC_e3"));
        assert!(!names_transaction("ce_AbC_e3_10", "ctx_AbC"));
        assert!(!names_transaction("ce_AbC_1", "ctx_AbC_e3"));
        assert!(!names_transaction("ce_random", "ctx_random"));
    }

    #[test]
    fn amounts_are_positive_exact_decimal_strings() {
        assert_eq!(
            parse_amount("amount", "12.50", false).unwrap().to_string(),
            "12.5"
        );
        assert_eq!(
            parse_amount("amount", "0.000000000000000001", false)
                .unwrap()
                .to_string(),
            "0.000000000000000001"
        );
        for bad in [
            "",
            "0",
            "-1",
            "1e3",
            "0.0000000000000000001",
            "abc",
            "1.",
            ".5",
            " ",
            "1,5",
            "99999999999999999999999999999999",
        ] {
            assert!(parse_amount("amount", bad, false).is_err(), "{bad}");
        }
        assert!(parse_amount("initial_balance", "0", true)
            .unwrap()
            .is_zero());
    }

    #[test]
    fn limits_are_what_their_names_say_and_cannot_overflow() {
        assert_eq!(MAX_AMOUNT.to_string(), "1000000000000000");
        assert_eq!(MAX_BALANCE.to_string(), "1000000000000000000");
        // The worst case the proof in MAX_BALANCE's comment relies on.
        assert!(MAX_BALANCE.checked_add(MAX_BALANCE).is_some());
        assert!(parse_amount("amount", "1000000000000000", false).is_ok());
        for bad in [
            "1000000000000000.000000000000000001",
            "1000000000000001",
            "79228162514264337593543950335",
        ] {
            assert!(parse_amount("amount", bad, false).is_err(), "{bad}");
        }
    }

    fn tx(entries: &[(&str, &str)]) -> Transaction {
        Transaction {
            id: "ctx_1".into(),
            store_id: "st".into(),
            mode: Mode::Test,
            kind: TransactionKind::Credit,
            account_id: "ca_1".into(),
            amount: Decimal::ONE,
            entries: entries
                .iter()
                .enumerate()
                .map(|(i, (account, amount))| Entry {
                    id: format!("ce_{i}"),
                    account_id: (*account).into(),
                    amount: amount.parse().unwrap(),
                    grant_id: None,
                })
                .collect(),
            idempotency_key: None,
            description: None,
            metadata: Default::default(),
            reverses: None,
            created_at_ms: 0,
            grant_terms: None,
        }
    }

    #[test]
    fn balances_after_refuses_what_breaks_an_invariant() {
        let zero = |_: &str| Decimal::ZERO;
        let after =
            balances_after(&tx(&[("ca_1", "5"), ("system:issuance", "-5")]), &zero).unwrap();
        assert_eq!(after["ca_1"], Decimal::from(5));
        assert_eq!(after["system:issuance"], Decimal::from(-5));
        assert_eq!(
            balances_after(&tx(&[("ca_1", "-5"), ("system:consumption", "5")]), &zero),
            Err(Rejection::InsufficientBalance)
        );
        assert_eq!(
            balances_after(&tx(&[("ca_1", "5"), ("system:issuance", "-4")]), &zero),
            Err(Rejection::Unbalanced)
        );
        assert_eq!(balances_after(&tx(&[]), &zero), Err(Rejection::Unbalanced));
        // The store's issuance total at its limit refuses one more credit.
        let at_limit = |id: &str| {
            if id == "system:issuance" {
                -MAX_BALANCE
            } else {
                Decimal::ZERO
            }
        };
        assert_eq!(
            balances_after(&tx(&[("ca_1", "1"), ("system:issuance", "-1")]), &at_limit),
            Err(Rejection::AmountOutOfRange)
        );
        // A credit that would need rounding is refused, not rounded.
        let big = |_: &str| Decimal::from(100_000_000_000i64);
        assert_eq!(
            balances_after(
                &tx(&[
                    ("ca_1", "0.000000000000000001"),
                    ("system:issuance", "-0.000000000000000001")
                ]),
                &big
            ),
            Err(Rejection::AmountOutOfRange)
        );
    }

    #[test]
    fn posting_rules_balance_and_refuse() {
        let mut new_id = ids();
        let credit = post(
            TransactionKind::Credit,
            &"ca_1".into(),
            AccountStatus::Active,
            Decimal::ZERO,
            Decimal::TEN,
            &mut new_id,
        )
        .unwrap();
        assert_eq!(
            credit.iter().map(|e| e.amount).sum::<Decimal>(),
            Decimal::ZERO
        );
        assert_eq!(credit[1].account_id, "system:issuance");
        assert_eq!(
            post(
                TransactionKind::Debit,
                &"ca_1".into(),
                AccountStatus::Active,
                Decimal::ONE,
                Decimal::TEN,
                &mut new_id
            ),
            Err(Rejection::InsufficientBalance)
        );
        assert_eq!(
            post(
                TransactionKind::Credit,
                &"ca_1".into(),
                AccountStatus::Frozen,
                Decimal::ONE,
                Decimal::TEN,
                &mut new_id
            ),
            Err(Rejection::AccountFrozen)
        );
        assert_eq!(
            post(
                TransactionKind::Debit,
                &"ca_1".into(),
                AccountStatus::Closed,
                Decimal::TEN,
                Decimal::ONE,
                &mut new_id
            ),
            Err(Rejection::AccountClosed)
        );
    }
}
