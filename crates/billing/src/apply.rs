//! Billing's apply: products folded into the projection in log order. Whether a
//! priced meter exists and is active is decided here (the service's check is a fast
//! path; ARCHITECTURE.md, "Decisions in apply"), and so is the `Z` index metering's
//! apply reads to refuse archiving a priced meter.

use tally_core::codec;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::check_base;
use tally_core::overlay::{ApplyError, Overlay};
use tally_domain::meter::MeterStatus;
use tally_domain::product::Product;

use crate::products::{meter_missing, meter_not_active};

/// A product, created or updated.
pub fn apply_product(
    overlay: &mut Overlay<'_>,
    product: &Product,
    base_updated_at_ms: Option<i64>,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&product.store_id, product.mode);
    let key = product_key(store_id, mode, &product.id);
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_product(&b))
        .transpose()?;
    check_base(
        base_updated_at_ms,
        previous.as_ref().map(|p| p.updated_at_ms),
    )?;
    let newly_priced: Vec<&str> = match &previous {
        Some(old) => {
            let old_priced = old.priced_meters();
            product
                .priced_meters()
                .into_iter()
                .filter(|m| !old_priced.contains(m))
                .collect()
        }
        None => product.priced_meters().into_iter().collect(),
    };
    for (i, price) in product.usage_prices.iter().enumerate() {
        if !newly_priced.contains(&price.meter_id.as_str()) {
            continue;
        }
        let meter_key = Key::scoped(keys::METER, store_id, mode)
            .text(&price.meter_id)
            .into_bytes();
        let param = format!("usage_prices[{i}].meter_id");
        match overlay.get(&meter_key)? {
            None => return Err(meter_missing(&price.meter_id, &param).into()),
            Some(bytes) => {
                if codec::decode_meter(&bytes)?.status != MeterStatus::Active {
                    return Err(meter_not_active(&price.meter_id, &param).into());
                }
            }
        }
    }
    if let Some(old) = &previous {
        for meter_id in old.priced_meters() {
            overlay.delete(priced_key(store_id, mode, meter_id, &product.id));
        }
    } else {
        overlay.put(
            ListingKey::entry(
                keys::PRODUCT_LIST,
                store_id,
                mode,
                None,
                product.created_at_ms,
                &product.id,
            ),
            Vec::new(),
        );
    }
    for meter_id in product.priced_meters() {
        overlay.put(
            priced_key(store_id, mode, meter_id, &product.id),
            Vec::new(),
        );
    }
    overlay.put(key, codec::encode_product(product));
    Ok(())
}

pub fn product_key(store_id: &str, mode: tally_domain::Mode, id: &str) -> Vec<u8> {
    Key::scoped(keys::PRODUCT, store_id, mode)
        .text(id)
        .into_bytes()
}

/// The `Z` row saying `meter_id` is priced on the active product `product_id`.
pub fn priced_key(
    store_id: &str,
    mode: tally_domain::Mode,
    meter_id: &str,
    product_id: &str,
) -> Vec<u8> {
    let mut key = keys::meter_priced_prefix(store_id, mode, meter_id);
    key.extend_from_slice(product_id.as_bytes());
    key.push(0);
    key
}
