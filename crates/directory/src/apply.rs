//! The directory's apply: stores and customers folded into the projection, in log
//! order. Uniqueness of external ids is decided here (the service's check is only a
//! fast path; ARCHITECTURE.md, "Decisions in apply").

use tally_core::codec;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::check_base;
use tally_core::overlay::{customer_cache_key, ApplyError, Overlay};
use tally_domain::customer::Customer;
use tally_domain::record::StoreRecord;
use tally_domain::Mode;

use crate::customers::external_id_taken;
use crate::DirectoryApplied;

/// A store and its two API keys' digests.
/// A store and its first two keys. A store id that exists already is kept as it is
/// (the first record wins): a retried idempotent creation derives the same id, and
/// must neither change the store nor bring back a key revoked since.
pub fn apply_store(
    overlay: &mut Overlay<'_>,
    store: &StoreRecord,
    applied: &mut DirectoryApplied,
) -> Result<(), ApplyError> {
    let key = Key::table(keys::STORE).text(&store.store_id).into_bytes();
    if overlay.contains(&key)? {
        return Ok(());
    }
    overlay.put(key, codec::encode_store(store));
    for (hash, mode) in [
        (&store.prod_key_sha256, Mode::Prod),
        (&store.test_key_sha256, Mode::Test),
    ] {
        let mut value = store.store_id.as_bytes().to_vec();
        value.push(mode.key_byte());
        overlay.put(Key::table(keys::API_KEY).tail(hash).into_bytes(), value);
        // The admin API's handle on the key, for revocation.
        crate::access::put_index(
            overlay,
            &store.store_id,
            &crate::access::key_id_of(hash),
            hash,
            mode,
        );
    }
    applied.stores.push(store.clone());
    Ok(())
}

/// A customer as the projection holds it at this point of the log (what other
/// contexts' apply may read, through a port of theirs).
pub fn stored_customer(
    overlay: &Overlay<'_>,
    store_id: &str,
    mode: Mode,
    id: &str,
) -> Result<Option<Customer>, tally_core::error::EngineError> {
    let key = Key::scoped(keys::CUSTOMER, store_id, mode)
        .text(id)
        .into_bytes();
    overlay
        .get(&key)?
        .map(|b| codec::decode_customer(&b))
        .transpose()
}

/// A customer, created or updated. Re-checks in log order that its external id is
/// not held by another customer (the service checked before appending, but another
/// node, or a retry of a write whose outcome was unknown, may have taken it since).
pub fn apply_customer(
    overlay: &mut Overlay<'_>,
    customer: &Customer,
    base_updated_at_ms: Option<i64>,
    applied: &mut DirectoryApplied,
) -> Result<(), ApplyError> {
    let (store_id, mode) = (&customer.store_id, customer.mode);
    let key = Key::scoped(keys::CUSTOMER, store_id, mode)
        .text(&customer.id)
        .into_bytes();
    let previous = overlay
        .get(&key)?
        .map(|b| codec::decode_customer(&b))
        .transpose()?;
    check_base(
        base_updated_at_ms,
        previous.as_ref().map(|c| c.updated_at_ms),
    )?;
    let external_key = |external: &str| {
        Key::scoped(keys::CUSTOMER_EXTERNAL, store_id, mode)
            .text(external)
            .into_bytes()
    };
    if let Some(external) = &customer.external_id {
        if let Some(holder) = overlay.get(&external_key(external))? {
            if holder != customer.id.as_bytes() {
                return Err(external_id_taken(external).into());
            }
        }
    }
    match &previous {
        None => overlay.put(
            ListingKey::entry(
                keys::CUSTOMER_LIST,
                store_id,
                mode,
                None,
                customer.created_at_ms,
                &customer.id,
            ),
            Vec::new(),
        ),
        Some(old) => {
            if let Some(old_external) = &old.external_id {
                if customer.external_id.as_ref() != Some(old_external) {
                    overlay.delete(external_key(old_external));
                    applied.stale_external_ids.push(customer_cache_key(
                        store_id,
                        mode,
                        old_external,
                    ));
                }
            }
        }
    }
    applied.customers_changed = true;
    if let Some(external) = &customer.external_id {
        overlay.put(external_key(external), customer.id.as_bytes().to_vec());
    }
    overlay.put(key, codec::encode_customer(customer));
    Ok(())
}
