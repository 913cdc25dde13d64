//! Discounts: create, read (by id or by code), list, update and delete (docs/api.md,
//! "Discounts"). The code's uniqueness and every redemption are decided in apply.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, ListingKey};
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest};
use tally_core::Scope;
use tally_domain::billing::{
    new_discount, normalize_discount_code, update_discount, Discount, DiscountInput,
    DiscountStatus, DiscountUpdate,
};
use tally_domain::record::Record;
use tally_domain::FieldError;

use crate::apply::{
    code_row, discount_code_key, discount_code_taken, discount_key, max_below_redeemed,
};
use crate::Billing;

impl Billing {
    pub fn get_discount(&self, scope: &Scope, id: &str) -> Result<Discount, EngineError> {
        match self
            .journal
            .store()
            .get(&discount_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_discount(&bytes),
            None => Err(EngineError::NotFound {
                resource: "discount",
                id: id.to_string(),
                param: Some("discount_id".into()),
            }),
        }
    }

    /// The discount a code names (deleted ones included: the caller decides).
    pub fn discount_by_code(
        &self,
        scope: &Scope,
        code: &str,
        param: &str,
    ) -> Result<Discount, EngineError> {
        let not_found = || EngineError::NotFound {
            resource: "discount code",
            id: code.to_string(),
            param: Some(param.to_string()),
        };
        let code = normalize_discount_code(code).map_err(|_| not_found())?;
        let store = self.journal.store();
        let get = |key: &[u8]| Ok(store.get(key)?);
        match code_row(get, keys::DISCOUNT_CODE, &scope.store_id, scope.mode, &code)? {
            Some(id) => self.get_discount(scope, &id),
            None => Err(not_found()),
        }
    }

    pub async fn create_discount(
        &self,
        scope: &Scope,
        input: &DiscountInput,
    ) -> Result<Discount, EngineError> {
        let discount = new_discount(
            input,
            new_id("dis").into(),
            scope.store_id.clone(),
            scope.mode,
            self.journal.now_ms(),
        )?;
        for (i, product) in discount.applies_to_products.iter().enumerate() {
            if let Err(EngineError::NotFound { .. }) = self.get_product(scope, product) {
                return Err(EngineError::NotFound {
                    resource: "product",
                    id: product.to_string(),
                    param: Some(format!("applies_to_products[{i}]")),
                });
            }
        }
        let code_key = discount_code_key(&scope.store_id, scope.mode, &discount.code);
        if self.journal.store().get(&code_key)?.is_some() {
            return Err(discount_code_taken(&discount.code).into());
        }
        self.journal
            .append_and_apply(&Record::DiscountUpserted(discount.clone()))
            .await?;
        Ok(discount)
    }

    pub async fn update_discount(
        &self,
        scope: &Scope,
        id: &str,
        update: &DiscountUpdate,
    ) -> Result<Discount, EngineError> {
        self.write_discount(scope, id, |discount| {
            update_discount(discount, update)?;
            match discount.max_redemptions {
                Some(max) if max < discount.redeem_count => {
                    Err(max_below_redeemed(discount.redeem_count))
                }
                _ => Ok(()),
            }
        })
        .await
    }

    /// Deletes a discount: status `deleted`, no longer redeemable; deleting a
    /// deleted discount returns it unchanged.
    pub async fn delete_discount(&self, scope: &Scope, id: &str) -> Result<Discount, EngineError> {
        self.write_discount(scope, id, |discount| {
            discount.stored_status = DiscountStatus::Deleted;
            Ok(())
        })
        .await
    }

    async fn write_discount(
        &self,
        scope: &Scope,
        id: &str,
        change: impl Fn(&mut Discount) -> Result<(), FieldError>,
    ) -> Result<Discount, EngineError> {
        self.journal
            .update(|| {
                let old = self.get_discount(scope, id)?;
                let mut discount = old.clone();
                change(&mut discount)?;
                if discount == old {
                    return Ok(Update::Unchanged(old));
                }
                let base = self.journal.restamp(&mut discount.updated_at_ms);
                Ok(Update::Write {
                    record: Record::DiscountUpserted(discount.clone()),
                    base_updated_at_ms: base,
                    result: discount,
                })
            })
            .await
    }

    pub fn list_discounts(
        &self,
        scope: &Scope,
        page: &PageRequest,
    ) -> Result<Page<Discount>, EngineError> {
        let prefix = ListingKey::prefix(keys::DISCOUNT_LIST, &scope.store_id, scope.mode, None);
        let cursor = cursor_from(page, |id| {
            let discount = self.get_discount(scope, id)?;
            Ok(ListingKey::entry(
                keys::DISCOUNT_LIST,
                &scope.store_id,
                scope.mode,
                None,
                discount.created_at_ms,
                &discount.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                self.get_discount(scope, id).map(Some)
            },
        )
    }
}
