//! Products: what a store sells, with its price, billing period, features and usage
//! prices, and the validation of create and update input (docs/api.md, "Products").
//!
//! Money is an integer in minor units with an ISO 4217 currency; usage quantities
//! and credit amounts are decimals. A usage price binds a meter: in `invoice` mode
//! its `unit_price` is minor units per meter unit, billed on the period's renewal;
//! in `credits` mode it is credits per meter unit, consumed from the customer's
//! account named `target_account_name` as usage arrives.

use std::collections::BTreeSet;

use rust_decimal::Decimal;

use crate::customer::Patch;
use crate::error::FieldError;
use crate::ids::{MeterId, ProductId, StoreId};
use crate::ledger::parse_amount;
use crate::limits::{
    MAX_CUSTOM_FIELDS, MAX_CUSTOM_FIELD_KEY_CHARS, MAX_DESCRIPTION_CHARS, MAX_NAME_CHARS,
    MAX_PRICE_MINOR, MAX_PRODUCT_FEATURES, MAX_PRODUCT_IMAGES, MAX_TRIAL_DAYS, MAX_URL_CHARS,
    MAX_USAGE_PRICES,
};
use crate::mode::Mode;

wire_enum!(
    /// Whether a product renews.
    BillingType { Recurring => "recurring", Onetime => "onetime" }
);
wire_enum!(
    /// How often a recurring product renews (`once` for a one-time product).
    BillingPeriod {
        EveryMonth => "every-month",
        EveryThreeMonths => "every-three-months",
        EverySixMonths => "every-six-months",
        EveryYear => "every-year",
        Once => "once",
    }
);
wire_enum!(
    /// `archived` products are no longer sold (no new checkouts); they stay readable.
    ProductStatus { Active => "active", Archived => "archived" }
);
wire_enum!(
    /// `exclusive` adds tax to the price; `inclusive` carves it out of the price.
    TaxMode { Inclusive => "inclusive", Exclusive => "exclusive" }
);
wire_enum!(
    TaxCategory { Saas => "saas", DigitalGoodsService => "digital-goods-service", Ebooks => "ebooks" }
);
wire_enum!(
    /// `invoice`: billed on the renewal transaction; `credits`: consumed from a
    /// credits account as usage arrives.
    SettlementMode { Invoice => "invoice", Credits => "credits" }
);
wire_enum!(
    /// Whose account a `credits` usage price consumes from (only the customer's).
    TargetAccount { Customer => "customer" }
);
wire_enum!(
    /// Whether usage during a trial is charged.
    TrialUsageMode { Free => "free", Charge => "charge" }
);
wire_enum!(
    FeatureType { CustomerCredits => "customer_credits", Custom => "custom" }
);
wire_enum!(
    CustomFieldType { Text => "text", Checkbox => "checkbox" }
);

impl BillingPeriod {
    /// The `recurring_interval` and `recurring_interval_count` of the wire.
    pub fn interval(self) -> Option<(&'static str, u32)> {
        match self {
            BillingPeriod::EveryMonth => Some(("month", 1)),
            BillingPeriod::EveryThreeMonths => Some(("month", 3)),
            BillingPeriod::EverySixMonths => Some(("month", 6)),
            BillingPeriod::EveryYear => Some(("year", 1)),
            BillingPeriod::Once => None,
        }
    }
}

/// Credits a checkout of the product grants (the `customer_credits` feature).
#[derive(Debug, Clone, PartialEq)]
pub struct CreditGrant {
    pub amount: Decimal,
    pub unit_label: String,
    pub bucket_name: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Feature {
    pub id: String,
    pub feature_type: FeatureType,
    pub description: Option<String>,
    /// Present exactly for `customer_credits`.
    pub customer_credits: Option<CreditGrant>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UsagePrice {
    pub id: String,
    pub meter_id: MeterId,
    pub unit_price: Decimal,
    pub free_allowance: Decimal,
    pub cap: Option<Decimal>,
    pub settlement_mode: SettlementMode,
    pub target_account: TargetAccount,
    pub target_account_name: String,
    pub trial_usage_mode: TrialUsageMode,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CustomField {
    pub field_type: CustomFieldType,
    pub key: String,
    pub label: String,
    pub optional: bool,
    /// For `text`: the bounds on the answer's length.
    pub min_length: Option<u32>,
    pub max_length: Option<u32>,
    /// For `checkbox`: the text beside the box.
    pub checkbox_label: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Product {
    pub id: ProductId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub name: String,
    pub description: Option<String>,
    /// Minor units of `currency`.
    pub price: i64,
    pub currency: String,
    pub billing_type: BillingType,
    pub billing_period: BillingPeriod,
    pub status: ProductStatus,
    pub tax_mode: TaxMode,
    pub tax_category: TaxCategory,
    pub image_urls: Vec<String>,
    pub features: Vec<Feature>,
    pub usage_prices: Vec<UsagePrice>,
    pub trial_period_days: Option<u32>,
    /// Minor units charged for the trial (none: free).
    pub trial_price: Option<i64>,
    pub business_net_pricing: bool,
    pub product_url: Option<String>,
    pub default_success_url: Option<String>,
    pub custom_fields: Vec<CustomField>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Product {
    /// The meters this product prices, while it is sold (an archived product prices
    /// none: its meters may be archived).
    pub fn priced_meters(&self) -> BTreeSet<&str> {
        match self.status {
            ProductStatus::Active => self
                .usage_prices
                .iter()
                .map(|p| p.meter_id.as_str())
                .collect(),
            ProductStatus::Archived => BTreeSet::new(),
        }
    }
}

/// A feature as the edge parsed it (not validated).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FeatureInput {
    pub feature_type: Option<String>,
    pub description: Option<String>,
    pub credits_amount: Option<String>,
    pub credits_unit_label: Option<String>,
    pub credits_bucket_name: Option<String>,
    /// `customer_credits` was given (an object).
    pub has_credits: bool,
}

/// A usage price as the edge parsed it. Numbers arrive as their exact text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsagePriceInput {
    pub meter_id: Option<String>,
    pub unit_price: Option<String>,
    pub free_allowance: Option<String>,
    pub cap: Option<String>,
    pub settlement_mode: Option<String>,
    pub target_account: Option<String>,
    pub target_account_name: Option<String>,
    pub trial_usage_mode: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct CustomFieldInput {
    pub field_type: Option<String>,
    pub key: Option<String>,
    pub label: Option<String>,
    pub optional: Option<bool>,
    pub min_length: Option<u32>,
    pub max_length: Option<u32>,
    pub checkbox_label: Option<String>,
}

/// Create or update input as the edge parsed it. On create, `Keep` means "not
/// given" (and `Clear` is the same); numbers are their exact text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProductInput {
    pub name: Patch<String>,
    pub description: Patch<String>,
    pub price: Patch<String>,
    pub currency: Patch<String>,
    pub billing_type: Patch<String>,
    pub billing_period: Patch<String>,
    pub status: Patch<String>,
    pub tax_mode: Patch<String>,
    pub tax_category: Patch<String>,
    /// `image_url` (one) and `image_urls` (all); `image_url` is the first.
    pub image_url: Patch<String>,
    pub image_urls: Patch<Vec<String>>,
    pub features: Patch<Vec<FeatureInput>>,
    pub usage_prices: Patch<Vec<UsagePriceInput>>,
    pub trial_period_days: Patch<String>,
    pub trial_price: Patch<String>,
    pub business_net_pricing: Patch<bool>,
    pub product_url: Patch<String>,
    pub default_success_url: Patch<String>,
    pub custom_fields: Patch<Vec<CustomFieldInput>>,
}

/// The fields an update may not change (docs/api.md): a subscription's renewals are
/// priced in its product's currency and period.
pub const IMMUTABLE_PRODUCT_FIELDS: [&str; 3] = ["currency", "billing_type", "billing_period"];

/// New ids for the features and usage prices a create or update adds.
pub trait IdSource {
    fn new_id(&mut self, prefix: &str) -> String;
}

/// Builds a product from create input: every rule of docs/api.md except that the
/// priced meters exist and are active (the service and apply check those).
pub fn new_product(
    input: &ProductInput,
    id: ProductId,
    store_id: StoreId,
    mode: Mode,
    now_ms: i64,
    ids: &mut dyn IdSource,
) -> Result<Product, FieldError> {
    let name = required(&input.name, "name")?;
    let price = required(&input.price, "price")?;
    let currency = required(&input.currency, "currency")?;
    let billing_type = match set(&input.billing_type) {
        Some(text) => BillingType::parse_field("billing_type", text)?,
        None => BillingType::Onetime,
    };
    let billing_period = match set(&input.billing_period) {
        Some(text) => BillingPeriod::parse_field("billing_period", text)?,
        None if billing_type == BillingType::Onetime => BillingPeriod::Once,
        None => return Err(FieldError::missing("billing_period")),
    };
    let mut product = Product {
        id,
        store_id,
        mode,
        name: String::new(),
        description: None,
        price: parse_minor("price", price)?,
        currency: parse_currency(currency)?,
        billing_type,
        billing_period,
        status: ProductStatus::Active,
        tax_mode: TaxMode::Exclusive,
        tax_category: TaxCategory::Saas,
        image_urls: Vec::new(),
        features: Vec::new(),
        usage_prices: Vec::new(),
        trial_period_days: None,
        trial_price: None,
        business_net_pricing: false,
        product_url: None,
        default_success_url: None,
        custom_fields: Vec::new(),
        created_at_ms: now_ms,
        updated_at_ms: now_ms,
    };
    let mut rest = input.clone();
    rest.name = Patch::Set(name.clone());
    for patch in [
        &mut rest.price,
        &mut rest.currency,
        &mut rest.billing_type,
        &mut rest.billing_period,
    ] {
        *patch = Patch::Keep;
    }
    apply_changes(&mut product, &rest, ids)?;
    Ok(product)
}

/// Applies update input to a product (the immutable fields refused), validating
/// the result as a whole.
pub fn update_product(
    product: &mut Product,
    input: &ProductInput,
    ids: &mut dyn IdSource,
) -> Result<(), FieldError> {
    for (field, patch) in IMMUTABLE_PRODUCT_FIELDS.iter().zip([
        &input.currency,
        &input.billing_type,
        &input.billing_period,
    ]) {
        if *patch != Patch::Keep {
            return Err(FieldError::new(
                "product_field_immutable",
                *field,
                format!("`{field}` cannot change after the product is created; create a new product instead"),
            ));
        }
    }
    if input.name == Patch::Clear {
        return Err(FieldError::invalid("name", "`name` cannot be null"));
    }
    if input.price == Patch::Clear {
        return Err(FieldError::invalid("price", "`price` cannot be null"));
    }
    if let Some(price) = set(&input.price) {
        product.price = parse_minor("price", price)?;
    }
    apply_changes(product, input, ids)
}

fn set<T>(patch: &Patch<T>) -> Option<&T> {
    match patch {
        Patch::Set(value) => Some(value),
        _ => None,
    }
}

fn required<'a>(patch: &'a Patch<String>, param: &str) -> Result<&'a String, FieldError> {
    set(patch).ok_or_else(|| FieldError::missing(param))
}

/// The fields create and update share; validates the whole product after.
fn apply_changes(
    product: &mut Product,
    input: &ProductInput,
    ids: &mut dyn IdSource,
) -> Result<(), FieldError> {
    if let Some(name) = set(&input.name) {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > MAX_NAME_CHARS {
            return Err(FieldError::invalid(
                "name",
                format!("`name` must be 1 to {MAX_NAME_CHARS} characters"),
            ));
        }
        product.name = name.to_string();
    }
    match &input.description {
        Patch::Keep => {}
        Patch::Clear => product.description = None,
        Patch::Set(text) => {
            if text.chars().count() > MAX_DESCRIPTION_CHARS {
                return Err(FieldError::invalid(
                    "description",
                    format!("`description` is at most {MAX_DESCRIPTION_CHARS} characters"),
                ));
            }
            product.description = Some(text.clone());
        }
    }
    if input.status == Patch::Clear {
        return Err(FieldError::invalid("status", "`status` cannot be null"));
    }
    if let Some(text) = set(&input.status) {
        product.status = ProductStatus::parse_field("status", text)?;
    }
    if let Some(text) = set(&input.tax_mode) {
        product.tax_mode = TaxMode::parse_field("tax_mode", text)?;
    }
    if let Some(text) = set(&input.tax_category) {
        product.tax_category = TaxCategory::parse_field("tax_category", text)?;
    }
    match (&input.image_urls, &input.image_url) {
        (Patch::Set(urls), _) => {
            if urls.len() > MAX_PRODUCT_IMAGES {
                return Err(FieldError::invalid(
                    "image_urls",
                    format!("at most {MAX_PRODUCT_IMAGES} images"),
                ));
            }
            for (i, url) in urls.iter().enumerate() {
                check_url(&format!("image_urls[{i}]"), url)?;
            }
            product.image_urls = urls.clone();
        }
        (Patch::Clear, _) | (Patch::Keep, Patch::Clear) => product.image_urls.clear(),
        (Patch::Keep, Patch::Set(url)) => {
            check_url("image_url", url)?;
            product.image_urls.retain(|u| u != url);
            product.image_urls.insert(0, url.clone());
            product.image_urls.truncate(MAX_PRODUCT_IMAGES);
        }
        (Patch::Keep, Patch::Keep) => {}
    }
    for (param, patch, slot) in [
        ("product_url", &input.product_url, &mut product.product_url),
        (
            "default_success_url",
            &input.default_success_url,
            &mut product.default_success_url,
        ),
    ] {
        match patch {
            Patch::Keep => {}
            Patch::Clear => *slot = None,
            Patch::Set(url) => {
                check_url(param, url)?;
                *slot = Some(url.clone());
            }
        }
    }
    match &input.trial_period_days {
        Patch::Keep => {}
        Patch::Clear => product.trial_period_days = None,
        Patch::Set(text) => {
            let days = parse_integer("trial_period_days", text, 0, i64::from(MAX_TRIAL_DAYS))?;
            product.trial_period_days = (days > 0).then_some(days as u32);
        }
    }
    match &input.trial_price {
        Patch::Keep => {}
        Patch::Clear => product.trial_price = None,
        Patch::Set(text) => product.trial_price = Some(parse_minor("trial_price", text)?),
    }
    match &input.business_net_pricing {
        Patch::Set(flag) => product.business_net_pricing = *flag,
        Patch::Clear => product.business_net_pricing = false,
        Patch::Keep => {}
    }
    match &input.features {
        Patch::Keep => {}
        Patch::Clear => product.features.clear(),
        Patch::Set(features) => product.features = features_from(features, ids)?,
    }
    match &input.usage_prices {
        Patch::Keep => {}
        Patch::Clear => product.usage_prices.clear(),
        Patch::Set(prices) => {
            product.usage_prices = usage_prices_from(prices, &product.usage_prices, ids)?
        }
    }
    match &input.custom_fields {
        Patch::Keep => {}
        Patch::Clear => product.custom_fields.clear(),
        Patch::Set(fields) => product.custom_fields = custom_fields_from(fields)?,
    }
    check_whole(product)
}

/// Rules that tie fields together, checked on the product an input produces.
fn check_whole(product: &Product) -> Result<(), FieldError> {
    let recurring = product.billing_type == BillingType::Recurring;
    if recurring == (product.billing_period == BillingPeriod::Once) {
        return Err(FieldError::invalid(
            "billing_period",
            if recurring {
                "a recurring product needs a `billing_period` other than `once`"
            } else {
                "a one-time product's `billing_period` is `once`"
            },
        ));
    }
    if !recurring && (product.trial_period_days.is_some() || product.trial_price.is_some()) {
        return Err(FieldError::invalid(
            if product.trial_period_days.is_some() {
                "trial_period_days"
            } else {
                "trial_price"
            },
            "only a recurring product can have a trial",
        ));
    }
    if product.trial_price.is_some() && product.trial_period_days.is_none() {
        return Err(FieldError::invalid(
            "trial_price",
            "`trial_price` needs `trial_period_days`",
        ));
    }
    for (i, price) in product.usage_prices.iter().enumerate() {
        if price.settlement_mode == SettlementMode::Invoice && !recurring {
            return Err(FieldError::invalid(
                format!("usage_prices[{i}].settlement_mode"),
                "`invoice` usage is billed on renewals, which a one-time product has none of; use `credits`",
            ));
        }
    }
    Ok(())
}

/// An integer amount of minor units, 0..=`MAX_PRICE_MINOR`.
pub fn parse_minor(param: &str, text: &str) -> Result<i64, FieldError> {
    parse_integer(param, text, 0, MAX_PRICE_MINOR)
}

/// A positive amount in minor units (a refund's: 1 up to the price limit), with the
/// range its message names.
pub fn parse_positive_minor(param: &str, text: &str) -> Result<i64, FieldError> {
    parse_integer(param, text, 1, MAX_PRICE_MINOR)
}

pub(crate) fn parse_integer(
    param: &str,
    text: &str,
    min: i64,
    max: i64,
) -> Result<i64, FieldError> {
    text.trim()
        .parse::<i64>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| {
            FieldError::invalid(
                param,
                format!("`{param}` must be an integer from {min} to {max}"),
            )
        })
}

/// An auto-recharge's price (docs/api.md, "Thresholds and auto-recharge"):
/// `auto_recharge.price` minor units (at least 1) in `auto_recharge.currency`.
pub fn parse_recharge_price(
    price: &str,
    currency: Option<&str>,
) -> Result<crate::ledger::RechargePrice, FieldError> {
    const PRICE: &str = "auto_recharge.price";
    const CURRENCY: &str = "auto_recharge.currency";
    let amount = parse_integer(PRICE, price, 1, MAX_PRICE_MINOR)?;
    let currency = currency.ok_or_else(|| FieldError::missing(CURRENCY))?;
    let currency = parse_currency_as(CURRENCY, currency)?;
    Ok(crate::ledger::RechargePrice { amount, currency })
}

/// An ISO 4217 code of a currency money is priced in, kept upper case.
pub fn parse_currency(text: &str) -> Result<String, FieldError> {
    parse_currency_as("currency", text)
}

/// `parse_currency` of the field `param`. The code must name a currency of the
/// standard's list (the `iso_currency` crate's), not one of its special codes
/// (gold, drawing rights, `XTS` for tests, `XXX` for none), which price nothing.
pub fn parse_currency_as(param: &str, text: &str) -> Result<String, FieldError> {
    let code = text.trim().to_ascii_uppercase();
    match iso_currency::Currency::from_code(&code) {
        Some(currency) if !currency.is_special() => Ok(code),
        _ => Err(FieldError::invalid(
            param,
            format!("`{param}` must be an ISO 4217 currency code, e.g. USD"),
        )),
    }
}

/// An http(s) URL with a host, as the WHATWG URL parser (the `url` crate) reads
/// it, of at most `MAX_URL_CHARS` characters and without whitespace.
pub fn check_url(param: &str, text: &str) -> Result<(), FieldError> {
    let ok = text.chars().count() <= MAX_URL_CHARS
        && !text.chars().any(|c| c.is_whitespace() || c.is_control())
        && url::Url::parse(text)
            .is_ok_and(|url| matches!(url.scheme(), "http" | "https") && url.host().is_some());
    if ok {
        Ok(())
    } else {
        Err(FieldError::invalid(
            param,
            format!("`{param}` must be an http(s) URL of at most {MAX_URL_CHARS} characters"),
        ))
    }
}

/// A non-negative decimal quantity of meter units or credits (a number's text).
fn parse_quantity(param: &str, text: &str) -> Result<Decimal, FieldError> {
    parse_amount(param, text, true)
}

fn features_from(
    inputs: &[FeatureInput],
    ids: &mut dyn IdSource,
) -> Result<Vec<Feature>, FieldError> {
    if inputs.len() > MAX_PRODUCT_FEATURES {
        return Err(FieldError::invalid(
            "features",
            format!("at most {MAX_PRODUCT_FEATURES} features"),
        ));
    }
    let mut features = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.iter().enumerate() {
        let param = |field: &str| format!("features[{i}].{field}");
        let feature_type = match &input.feature_type {
            Some(text) => FeatureType::parse_field(&param("type"), text)?,
            None => return Err(FieldError::missing(param("type"))),
        };
        if let Some(text) = &input.description {
            if text.chars().count() > MAX_DESCRIPTION_CHARS {
                return Err(FieldError::invalid(
                    param("description"),
                    format!("a description is at most {MAX_DESCRIPTION_CHARS} characters"),
                ));
            }
        }
        let customer_credits = match feature_type {
            FeatureType::CustomerCredits => {
                if !input.has_credits {
                    return Err(FieldError::missing(param("customer_credits")));
                }
                let amount = match &input.credits_amount {
                    Some(text) => parse_amount(&param("customer_credits.amount"), text, false)?,
                    None => return Err(FieldError::missing(param("customer_credits.amount"))),
                };
                let label = |value: &Option<String>, field: &str, default: &str| {
                    let text = value.as_deref().unwrap_or(default).trim().to_string();
                    if text.is_empty() || text.chars().count() > MAX_NAME_CHARS {
                        Err(FieldError::invalid(
                            param(&format!("customer_credits.{field}")),
                            format!("must be 1 to {MAX_NAME_CHARS} characters"),
                        ))
                    } else {
                        Ok(text)
                    }
                };
                Some(CreditGrant {
                    amount,
                    unit_label: label(&input.credits_unit_label, "unit_label", "credits")?,
                    bucket_name: label(&input.credits_bucket_name, "bucket_name", "default")?,
                })
            }
            FeatureType::Custom => {
                if input
                    .description
                    .as_deref()
                    .is_none_or(|d| d.trim().is_empty())
                {
                    return Err(FieldError::missing(param("description")));
                }
                if input.has_credits {
                    return Err(FieldError::invalid(
                        param("customer_credits"),
                        "only a `customer_credits` feature carries `customer_credits`",
                    ));
                }
                None
            }
        };
        features.push(Feature {
            id: ids.new_id("feat"),
            feature_type,
            description: input.description.clone(),
            customer_credits,
        });
    }
    Ok(features)
}

fn usage_prices_from(
    inputs: &[UsagePriceInput],
    old: &[UsagePrice],
    ids: &mut dyn IdSource,
) -> Result<Vec<UsagePrice>, FieldError> {
    if inputs.len() > MAX_USAGE_PRICES {
        return Err(FieldError::invalid(
            "usage_prices",
            format!("at most {MAX_USAGE_PRICES} usage prices"),
        ));
    }
    let mut seen = BTreeSet::new();
    let mut prices = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.iter().enumerate() {
        let param = |field: &str| format!("usage_prices[{i}].{field}");
        let meter_id = match &input.meter_id {
            Some(id) if !id.trim().is_empty() => id.trim().to_string(),
            _ => return Err(FieldError::missing(param("meter_id"))),
        };
        if !seen.insert(meter_id.clone()) {
            return Err(FieldError::invalid(
                param("meter_id"),
                "a meter is priced at most once per product",
            ));
        }
        let unit_price = match &input.unit_price {
            Some(text) => parse_quantity(&param("unit_price"), text)?,
            None => return Err(FieldError::missing(param("unit_price"))),
        };
        let free_allowance = match &input.free_allowance {
            Some(text) => parse_quantity(&param("free_allowance"), text)?,
            None => Decimal::ZERO,
        };
        let cap = match &input.cap {
            Some(text) => {
                let cap = parse_amount(&param("cap"), text, false)?;
                if cap < free_allowance {
                    return Err(FieldError::invalid(
                        param("cap"),
                        "`cap` may not be below `free_allowance`",
                    ));
                }
                Some(cap)
            }
            None => None,
        };
        let settlement_mode = match &input.settlement_mode {
            Some(text) => SettlementMode::parse_field(&param("settlement_mode"), text)?,
            None => SettlementMode::Invoice,
        };
        let target_account = match &input.target_account {
            Some(text) => TargetAccount::parse_field(&param("target_account"), text)?,
            None => TargetAccount::Customer,
        };
        let target_account_name = input
            .target_account_name
            .as_deref()
            .unwrap_or("default")
            .trim()
            .to_string();
        if target_account_name.is_empty() || target_account_name.chars().count() > MAX_NAME_CHARS {
            return Err(FieldError::invalid(
                param("target_account_name"),
                format!("must be 1 to {MAX_NAME_CHARS} characters"),
            ));
        }
        let trial_usage_mode = match &input.trial_usage_mode {
            Some(text) => TrialUsageMode::parse_field(&param("trial_usage_mode"), text)?,
            None => TrialUsageMode::Free,
        };
        // A price for a meter already priced keeps its id, so invoices and
        // settlement stay linked to it across updates.
        let id = old
            .iter()
            .find(|p| p.meter_id.as_str() == meter_id)
            .map(|p| p.id.clone())
            .unwrap_or_else(|| ids.new_id("uprc"));
        prices.push(UsagePrice {
            id,
            meter_id: MeterId::new(meter_id),
            unit_price,
            free_allowance,
            cap,
            settlement_mode,
            target_account,
            target_account_name,
            trial_usage_mode,
        });
    }
    Ok(prices)
}

fn custom_fields_from(inputs: &[CustomFieldInput]) -> Result<Vec<CustomField>, FieldError> {
    if inputs.len() > MAX_CUSTOM_FIELDS {
        return Err(FieldError::invalid(
            "custom_fields",
            format!("at most {MAX_CUSTOM_FIELDS} custom fields"),
        ));
    }
    let mut keys = BTreeSet::new();
    let mut fields = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.iter().enumerate() {
        let param = |field: &str| format!("custom_fields[{i}].{field}");
        let field_type = match &input.field_type {
            Some(text) => CustomFieldType::parse_field(&param("type"), text)?,
            None => return Err(FieldError::missing(param("type"))),
        };
        let key = input
            .key
            .clone()
            .ok_or_else(|| FieldError::missing(param("key")))?;
        let key_ok = !key.is_empty()
            && key.chars().count() <= MAX_CUSTOM_FIELD_KEY_CHARS
            && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !key_ok {
            return Err(FieldError::invalid(
                param("key"),
                format!("a key is 1 to {MAX_CUSTOM_FIELD_KEY_CHARS} letters, digits or `_`"),
            ));
        }
        if !keys.insert(key.clone()) {
            return Err(FieldError::invalid(param("key"), "keys must be unique"));
        }
        let label = input
            .label
            .clone()
            .ok_or_else(|| FieldError::missing(param("label")))?;
        if label.trim().is_empty() || label.chars().count() > MAX_NAME_CHARS {
            return Err(FieldError::invalid(
                param("label"),
                format!("a label is 1 to {MAX_NAME_CHARS} characters"),
            ));
        }
        let (min_length, max_length, checkbox_label) = match field_type {
            CustomFieldType::Text => {
                if let (Some(min), Some(max)) = (input.min_length, input.max_length) {
                    if min > max {
                        return Err(FieldError::invalid(
                            param("text.minimum_length"),
                            "`minimum_length` may not exceed `max_length`",
                        ));
                    }
                }
                (input.min_length, input.max_length, None)
            }
            CustomFieldType::Checkbox => (None, None, input.checkbox_label.clone()),
        };
        fields.push(CustomField {
            field_type,
            key,
            label,
            optional: input.optional.unwrap_or(false),
            min_length,
            max_length,
            checkbox_label,
        });
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {

    #[test]
    fn urls_are_read_by_the_url_parser() {
        for good in [
            "https://example.com/x?y=1",
            "http://shop.example.com",
            "HTTPS://Example.COM/A",
        ] {
            assert!(check_url("u", good).is_ok(), "{good}");
        }
        for bad in [
            "https://",
            "http:// x.com",
            "ftp://example.com",
            "javascript:alert(1)",
            "example.com",
            "https://exa\tmple.com",
            "https://a\u{7}b.com",
        ] {
            assert!(check_url("u", bad).is_err(), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_CHARS));
        assert!(check_url("u", &long).is_err());
    }

    use super::*;

    #[test]
    fn a_currency_is_a_code_of_the_standard_in_upper_case() {
        for (text, code) in [
            ("usd", "USD"),
            (" EUR ", "EUR"),
            ("jpy", "JPY"),
            ("Chf", "CHF"),
        ] {
            assert_eq!(parse_currency(text).unwrap(), code);
        }
        for bad in ["", "us", "dollars", "ZZZ", "XTS", "XXX", "XAU", "U$D"] {
            let error = parse_currency(bad).unwrap_err();
            assert_eq!(error.param, "currency", "{bad}");
        }
    }

    struct Counter(u32);
    impl IdSource for Counter {
        fn new_id(&mut self, prefix: &str) -> String {
            self.0 += 1;
            format!("{prefix}_{}", self.0)
        }
    }

    fn create(input: &ProductInput) -> Result<Product, FieldError> {
        new_product(
            input,
            ProductId::new("prod_1"),
            StoreId::new("st_1"),
            Mode::Test,
            1_000,
            &mut Counter(0),
        )
    }

    fn base() -> ProductInput {
        ProductInput {
            name: Patch::Set("Pro".into()),
            price: Patch::Set("1900".into()),
            currency: Patch::Set("usd".into()),
            billing_type: Patch::Set("recurring".into()),
            billing_period: Patch::Set("every-month".into()),
            ..ProductInput::default()
        }
    }

    #[test]
    fn defaults_and_normalization() {
        let product = create(&base()).unwrap();
        assert_eq!(product.currency, "USD");
        assert_eq!(
            (product.tax_mode, product.tax_category),
            (TaxMode::Exclusive, TaxCategory::Saas)
        );
        assert_eq!(product.status, ProductStatus::Active);
        let onetime = create(&ProductInput {
            billing_type: Patch::Keep,
            billing_period: Patch::Keep,
            ..base()
        })
        .unwrap();
        assert_eq!(
            (onetime.billing_type, onetime.billing_period),
            (BillingType::Onetime, BillingPeriod::Once)
        );
    }

    #[test]
    fn bad_input_names_the_field() {
        let cases: Vec<(ProductInput, &str)> = vec![
            (
                ProductInput {
                    name: Patch::Keep,
                    ..base()
                },
                "name",
            ),
            (
                ProductInput {
                    price: Patch::Set("-1".into()),
                    ..base()
                },
                "price",
            ),
            (
                ProductInput {
                    price: Patch::Set("1.5".into()),
                    ..base()
                },
                "price",
            ),
            (
                ProductInput {
                    currency: Patch::Set("dollars".into()),
                    ..base()
                },
                "currency",
            ),
            (
                ProductInput {
                    billing_period: Patch::Set("once".into()),
                    ..base()
                },
                "billing_period",
            ),
            (
                ProductInput {
                    billing_period: Patch::Set("weekly".into()),
                    ..base()
                },
                "billing_period",
            ),
            (
                ProductInput {
                    tax_mode: Patch::Set("none".into()),
                    ..base()
                },
                "tax_mode",
            ),
            (
                ProductInput {
                    usage_prices: Patch::Set(vec![UsagePriceInput {
                        meter_id: Some("mtr_1".into()),
                        ..Default::default()
                    }]),
                    ..base()
                },
                "usage_prices[0].unit_price",
            ),
            (
                ProductInput {
                    usage_prices: Patch::Set(vec![
                        UsagePriceInput {
                            meter_id: Some("mtr_1".into()),
                            unit_price: Some("1".into()),
                            ..Default::default()
                        },
                        UsagePriceInput {
                            meter_id: Some("mtr_1".into()),
                            unit_price: Some("2".into()),
                            ..Default::default()
                        },
                    ]),
                    ..base()
                },
                "usage_prices[1].meter_id",
            ),
            (
                ProductInput {
                    features: Patch::Set(vec![FeatureInput {
                        feature_type: Some("customer_credits".into()),
                        ..Default::default()
                    }]),
                    ..base()
                },
                "features[0].customer_credits",
            ),
            (
                ProductInput {
                    billing_type: Patch::Keep,
                    billing_period: Patch::Keep,
                    trial_period_days: Patch::Set("7".into()),
                    ..base()
                },
                "trial_period_days",
            ),
        ];
        for (input, param) in cases {
            let error = create(&input).expect_err(param);
            assert_eq!(error.param, param, "{error:?}");
        }
    }

    #[test]
    fn updates_keep_usage_price_ids_and_refuse_immutable_fields() {
        let priced = |unit: &str| ProductInput {
            usage_prices: Patch::Set(vec![UsagePriceInput {
                meter_id: Some("mtr_1".into()),
                unit_price: Some(unit.into()),
                ..Default::default()
            }]),
            ..ProductInput::default()
        };
        let mut product = create(&ProductInput {
            usage_prices: priced("2").usage_prices,
            ..base()
        })
        .unwrap();
        let id = product.usage_prices[0].id.clone();
        update_product(&mut product, &priced("3.5"), &mut Counter(10)).unwrap();
        assert_eq!(product.usage_prices[0].id, id);
        assert_eq!(product.usage_prices[0].unit_price, Decimal::new(35, 1));
        let error = update_product(
            &mut product,
            &ProductInput {
                currency: Patch::Set("EUR".into()),
                ..ProductInput::default()
            },
            &mut Counter(20),
        )
        .unwrap_err();
        assert_eq!(
            (error.code, error.param.as_str()),
            ("product_field_immutable", "currency")
        );
    }
}
