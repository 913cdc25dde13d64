//! Products: create, read, list, update, archive and unarchive (docs/api.md,
//! "Products"). The priced meters are checked by the service against metering (a
//! fast, precise 400) and again by apply in log order; writes return once projected.

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest, StatusFilter};
use tally_core::Scope;
use tally_domain::meter::{Aggregation, MeterStatus};
use tally_domain::product::{
    new_product, update_product, IdSource, Product, ProductInput, ProductStatus, SettlementMode,
};
use tally_domain::record::Record;
use tally_domain::FieldError;
use tally_projection::Visit;

use crate::apply::product_key;
use crate::Billing;

/// Fresh random ids for features and usage prices.
struct RandomIds;

impl IdSource for RandomIds {
    fn new_id(&mut self, prefix: &str) -> String {
        new_id(prefix)
    }
}

impl Billing {
    pub fn get_product(&self, scope: &Scope, id: &str) -> Result<Product, EngineError> {
        match self
            .journal
            .store()
            .get(&product_key(&scope.store_id, scope.mode, id))?
        {
            Some(bytes) => codec::decode_product(&bytes),
            None => Err(EngineError::not_found("product", id)),
        }
    }

    pub async fn create_product(
        &self,
        scope: &Scope,
        input: &ProductInput,
    ) -> Result<Product, EngineError> {
        let product = new_product(
            input,
            new_id("prod").into(),
            scope.store_id.clone(),
            scope.mode,
            self.journal.now_ms(),
            &mut RandomIds,
        )?;
        self.check_meters(scope, &product, None)?;
        self.journal
            .append_and_apply(&Record::ProductUpserted(product.clone()))
            .await?;
        Ok(product)
    }

    pub async fn update_product(
        &self,
        scope: &Scope,
        id: &str,
        input: &ProductInput,
    ) -> Result<Product, EngineError> {
        self.write(scope, id, |product| {
            update_product(product, input, &mut RandomIds)?;
            Ok(())
        })
        .await
    }

    /// Archived products are no longer sold; archiving an archived product (or
    /// unarchiving an active one) returns it unchanged.
    pub async fn set_product_status(
        &self,
        scope: &Scope,
        id: &str,
        status: ProductStatus,
    ) -> Result<Product, EngineError> {
        self.write(scope, id, |product| {
            product.status = status;
            Ok(())
        })
        .await
    }

    /// Derives a change from the current version and writes it (again from the new
    /// version if another write came first); an unchanged product is not written.
    async fn write(
        &self,
        scope: &Scope,
        id: &str,
        change: impl Fn(&mut Product) -> Result<(), EngineError>,
    ) -> Result<Product, EngineError> {
        self.journal
            .update(|| {
                let old = self.get_product(scope, id)?;
                let mut product = old.clone();
                change(&mut product)?;
                if product == old {
                    return Ok(Update::Unchanged(old));
                }
                self.check_meters(scope, &product, Some(&old))?;
                let base = self.journal.restamp(&mut product.updated_at_ms);
                Ok(Update::Write {
                    record: Record::ProductUpserted(product.clone()),
                    base_updated_at_ms: base,
                    result: product,
                })
            })
            .await
    }

    /// The meters a write starts pricing exist and are active (the fast answer;
    /// apply decides again).
    fn check_meters(
        &self,
        scope: &Scope,
        product: &Product,
        old: Option<&Product>,
    ) -> Result<(), EngineError> {
        if product.status != ProductStatus::Active {
            return Ok(());
        }
        let already = old.map(Product::priced_meters).unwrap_or_default();
        for (i, price) in product.usage_prices.iter().enumerate() {
            let newly_priced = !already.contains(price.meter_id.as_str());
            let credits = price.settlement_mode == SettlementMode::Credits;
            if !newly_priced && !credits {
                continue;
            }
            let param = format!("usage_prices[{i}].meter_id");
            // An id the body names that does not exist: 404 naming it, as every
            // other reference in a body (docs/api.md, "Errors").
            let meter = match self.meters.meter_info(scope, &price.meter_id)? {
                None => {
                    return Err(EngineError::NotFound {
                        resource: "meter",
                        id: price.meter_id.to_string(),
                        param: Some(param),
                    })
                }
                Some(meter) => meter,
            };
            if newly_priced && meter.status == MeterStatus::Archived {
                return Err(meter_not_active(&price.meter_id, &param).into());
            }
            // Credits are debited per event as usage arrives: only a count or a
            // sum adds up event by event (docs/api.md, "Usage prices").
            if credits && !matches!(meter.aggregation, Aggregation::Count | Aggregation::Sum) {
                return Err(FieldError::invalid(
                    format!("usage_prices[{i}].settlement_mode"),
                    format!(
                        "`credits` settles usage event by event, so it needs a `count` or `sum` meter; meter '{}' aggregates by `{}`: use `invoice`",
                        price.meter_id,
                        meter.aggregation.as_str()
                    ),
                )
                .into());
            }
        }
        Ok(())
    }

    pub fn list_products(
        &self,
        scope: &Scope,
        status: StatusFilter,
        page: &PageRequest,
    ) -> Result<Page<Product>, EngineError> {
        let prefix = ListingKey::prefix(keys::PRODUCT_LIST, &scope.store_id, scope.mode, None);
        let cursor = cursor_from(page, |id| {
            let product = self.get_product(scope, id)?;
            Ok(ListingKey::entry(
                keys::PRODUCT_LIST,
                &scope.store_id,
                scope.mode,
                None,
                product.created_at_ms,
                &product.id,
            ))
        })?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                let product = self.get_product(scope, id)?;
                Ok(status
                    .keeps(product.status == ProductStatus::Active)
                    .then_some(product))
            },
        )
    }

    /// Whether a meter is priced on an active product (metering's `Pricing` port).
    /// Whether any active product of the scope prices a meter (one index read).
    pub fn scope_prices_meters(&self, scope: &Scope) -> Result<bool, EngineError> {
        let prefix =
            keys::Key::scoped(keys::METER_PRICED, &scope.store_id, scope.mode).into_bytes();
        let mut found = false;
        tally_projection::scan_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            &mut |_, _| {
                found = true;
                Visit::Stop
            },
        )?;
        Ok(found)
    }

    pub fn meter_priced_on_active_product(
        &self,
        scope: &Scope,
        meter_id: &str,
    ) -> Result<bool, EngineError> {
        let prefix = keys::meter_priced_prefix(&scope.store_id, scope.mode, meter_id);
        let mut found = false;
        tally_projection::scan_prefix(
            self.journal.store().as_ref(),
            &prefix,
            false,
            &mut |_, _| {
                found = true;
                Visit::Stop
            },
        )?;
        Ok(found)
    }
}

/// A priced meter that does not exist (decided in apply: 409 `resource_missing`).
pub fn meter_missing(meter_id: &str, param: &str) -> Outcome {
    Outcome::rejected(
        "resource_missing",
        format!("no meter '{meter_id}' in this store and environment"),
    )
    .with_param(param)
}

/// 409 `meter_not_active`: an archived meter cannot be priced on an active product.
pub fn meter_not_active(meter_id: &str, param: &str) -> Outcome {
    Outcome::rejected(
        "meter_not_active",
        format!(
            "meter '{meter_id}' is archived; unarchive it before pricing it on an active product"
        ),
    )
    .with_param(param)
}
