//! Products between the domain and `tally.v1.Product`. Enum fields travel as their
//! wire names; an unknown name or an unparsable decimal is a [`DecodeError`].

use rust_decimal::Decimal;
use tally_domain::product::{
    BillingPeriod, BillingType, CreditGrant, CustomField, CustomFieldType, Feature, FeatureType,
    Product, ProductStatus, SettlementMode, TargetAccount, TaxCategory, TaxMode, TrialUsageMode,
    UsagePrice,
};
use tally_domain::usage::{canonical_decimal, parse_decimal};

use crate::convert::{mode_from_proto, mode_to_proto, DecodeError};
use crate::v1;

pub(crate) fn decimal(text: &str, field: &'static str) -> Result<Decimal, DecodeError> {
    parse_decimal(text).ok_or(DecodeError::BadField(field))
}

pub(crate) fn named<T>(
    parse: fn(&str) -> Option<T>,
    text: &str,
    field: &'static str,
) -> Result<T, DecodeError> {
    parse(text).ok_or(DecodeError::BadField(field))
}

pub fn product_to_proto(p: &Product) -> v1::Product {
    v1::Product {
        id: p.id.to_string(),
        store_id: p.store_id.to_string(),
        mode: mode_to_proto(p.mode),
        name: p.name.clone(),
        description: p.description.clone(),
        price: p.price,
        currency: p.currency.clone(),
        billing_type: p.billing_type.as_str().into(),
        billing_period: p.billing_period.as_str().into(),
        status: p.status.as_str().into(),
        tax_mode: p.tax_mode.as_str().into(),
        tax_category: p.tax_category.as_str().into(),
        image_urls: p.image_urls.clone(),
        features: p
            .features
            .iter()
            .map(|f| v1::ProductFeature {
                id: f.id.clone(),
                r#type: f.feature_type.as_str().into(),
                description: f.description.clone(),
                credits_amount: f
                    .customer_credits
                    .as_ref()
                    .map(|c| canonical_decimal(c.amount)),
                credits_unit_label: f.customer_credits.as_ref().map(|c| c.unit_label.clone()),
                credits_bucket_name: f.customer_credits.as_ref().map(|c| c.bucket_name.clone()),
            })
            .collect(),
        usage_prices: p.usage_prices.iter().map(usage_price_to_proto).collect(),
        trial_period_days: p.trial_period_days,
        trial_price: p.trial_price,
        business_net_pricing: p.business_net_pricing,
        product_url: p.product_url.clone(),
        default_success_url: p.default_success_url.clone(),
        custom_fields: p
            .custom_fields
            .iter()
            .map(|c| v1::CustomField {
                r#type: c.field_type.as_str().into(),
                key: c.key.clone(),
                label: c.label.clone(),
                optional: c.optional,
                min_length: c.min_length,
                max_length: c.max_length,
                checkbox_label: c.checkbox_label.clone(),
            })
            .collect(),
        created_at_ms: p.created_at_ms,
        updated_at_ms: p.updated_at_ms,
    }
}

pub fn product_from_proto(p: v1::Product) -> Result<Product, DecodeError> {
    let features = p
        .features
        .into_iter()
        .map(|f| {
            let feature_type = named(FeatureType::parse, &f.r#type, "feature type")?;
            let customer_credits = match (feature_type, f.credits_amount) {
                (FeatureType::CustomerCredits, Some(amount)) => Some(CreditGrant {
                    amount: decimal(&amount, "credits_amount")?,
                    unit_label: f.credits_unit_label.unwrap_or_default(),
                    bucket_name: f.credits_bucket_name.unwrap_or_default(),
                }),
                (FeatureType::CustomerCredits, None) => {
                    return Err(DecodeError::BadField("credits_amount"))
                }
                (FeatureType::Custom, _) => None,
            };
            Ok(Feature {
                id: f.id,
                feature_type,
                description: f.description,
                customer_credits,
            })
        })
        .collect::<Result<_, DecodeError>>()?;
    let usage_prices = p
        .usage_prices
        .into_iter()
        .map(usage_price_from_proto)
        .collect::<Result<_, DecodeError>>()?;
    let custom_fields = p
        .custom_fields
        .into_iter()
        .map(|c| {
            Ok(CustomField {
                field_type: named(CustomFieldType::parse, &c.r#type, "custom field type")?,
                key: c.key,
                label: c.label,
                optional: c.optional,
                min_length: c.min_length,
                max_length: c.max_length,
                checkbox_label: c.checkbox_label,
            })
        })
        .collect::<Result<_, DecodeError>>()?;
    Ok(Product {
        id: p.id.into(),
        store_id: p.store_id.into(),
        mode: mode_from_proto(p.mode)?,
        name: p.name,
        description: p.description,
        price: p.price,
        currency: p.currency,
        billing_type: named(BillingType::parse, &p.billing_type, "billing_type")?,
        billing_period: named(BillingPeriod::parse, &p.billing_period, "billing_period")?,
        status: named(ProductStatus::parse, &p.status, "status")?,
        tax_mode: named(TaxMode::parse, &p.tax_mode, "tax_mode")?,
        tax_category: named(TaxCategory::parse, &p.tax_category, "tax_category")?,
        image_urls: p.image_urls,
        features,
        usage_prices,
        trial_period_days: p.trial_period_days,
        trial_price: p.trial_price,
        business_net_pricing: p.business_net_pricing,
        product_url: p.product_url,
        default_success_url: p.default_success_url,
        custom_fields,
        created_at_ms: p.created_at_ms,
        updated_at_ms: p.updated_at_ms,
    })
}

pub fn usage_price_to_proto(u: &UsagePrice) -> v1::UsagePrice {
    v1::UsagePrice {
        id: u.id.clone(),
        meter_id: u.meter_id.to_string(),
        unit_price: canonical_decimal(u.unit_price),
        free_allowance: canonical_decimal(u.free_allowance),
        cap: u.cap.map(canonical_decimal),
        settlement_mode: u.settlement_mode.as_str().into(),
        target_account: u.target_account.as_str().into(),
        target_account_name: u.target_account_name.clone(),
        trial_usage_mode: u.trial_usage_mode.as_str().into(),
    }
}

pub fn usage_price_from_proto(u: v1::UsagePrice) -> Result<UsagePrice, DecodeError> {
    Ok(UsagePrice {
        id: u.id,
        meter_id: u.meter_id.into(),
        unit_price: decimal(&u.unit_price, "unit_price")?,
        free_allowance: decimal(&u.free_allowance, "free_allowance")?,
        cap: u.cap.map(|c| decimal(&c, "cap")).transpose()?,
        settlement_mode: named(SettlementMode::parse, &u.settlement_mode, "settlement_mode")?,
        target_account: named(TargetAccount::parse, &u.target_account, "target_account")?,
        target_account_name: u.target_account_name,
        trial_usage_mode: named(
            TrialUsageMode::parse,
            &u.trial_usage_mode,
            "trial_usage_mode",
        )?,
    })
}
