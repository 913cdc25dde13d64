//! Customers: create, read, list, update (docs/api.md, "Customers").
//! `external_id` uniqueness per store and environment is decided in apply (the
//! service only answers early from the projection); writes return once projected.

use tally_domain::customer::{validate_customer_input, Customer, CustomerInput, Patch};
use tally_domain::record::Record;

use tally_core::codec;
use tally_core::error::EngineError;
use tally_core::ids::new_id;
use tally_core::journal::Update;
use tally_core::keys::{self, Key, ListingKey};
use tally_core::outcome::Outcome;
use tally_core::pagination::{cursor_from, paginate, Page, PageRequest};
use tally_core::Scope;

use crate::Directory;

impl Directory {
    pub fn get_customer(&self, scope: &Scope, id: &str) -> Result<Customer, EngineError> {
        let key = Key::scoped(keys::CUSTOMER, &scope.store_id, scope.mode).text(id);
        match self.journal.store().get(key.as_bytes())? {
            Some(bytes) => codec::decode_customer(&bytes),
            None => Err(EngineError::not_found("customer", id)),
        }
    }

    /// The customer id holding `external_id`, if any.
    pub fn customer_id_by_external(
        &self,
        scope: &Scope,
        external_id: &str,
    ) -> Result<Option<String>, EngineError> {
        let key =
            Key::scoped(keys::CUSTOMER_EXTERNAL, &scope.store_id, scope.mode).text(external_id);
        Ok(self
            .journal
            .store()
            .get(key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    pub fn customer_exists(&self, scope: &Scope, id: &str) -> Result<bool, EngineError> {
        let key = Key::scoped(keys::CUSTOMER, &scope.store_id, scope.mode).text(id);
        Ok(self.journal.store().get(key.as_bytes())?.is_some())
    }

    pub async fn create_customer(
        &self,
        scope: &Scope,
        input: &CustomerInput,
    ) -> Result<Customer, EngineError> {
        let changes = validate_customer_input(input, true)?;
        // A fast answer from the projection; apply decides again in log order.
        if let Patch::Set(external) = &changes.external_id {
            if self.customer_id_by_external(scope, external)?.is_some() {
                return Err(external_id_taken(external).into());
            }
        }
        let now = self.journal.now_ms();
        let mut customer = Customer {
            id: new_id("cus").into(),
            store_id: scope.store_id.clone(),
            mode: scope.mode,
            email: String::new(),
            name: None,
            country: None,
            metadata: Default::default(),
            external_id: None,
            created_at_ms: now,
            updated_at_ms: now,
        };
        customer.apply(changes, now);
        self.journal
            .append_and_apply(&Record::CustomerUpserted(customer.clone()))
            .await?;
        Ok(customer)
    }

    pub async fn update_customer(
        &self,
        scope: &Scope,
        id: &str,
        input: &CustomerInput,
    ) -> Result<Customer, EngineError> {
        let changes = validate_customer_input(input, false)?;
        self.journal
            .update(|| {
                let mut customer = self.get_customer(scope, id)?;
                if let Patch::Set(external) = &changes.external_id {
                    match self.customer_id_by_external(scope, external)? {
                        Some(holder) if customer.id != *holder => {
                            return Err(external_id_taken(external).into())
                        }
                        _ => {}
                    }
                }
                let base = customer.updated_at_ms;
                customer.apply(changes.clone(), self.journal.update_time(base));
                Ok(Update::Write {
                    record: Record::CustomerUpserted(customer.clone()),
                    base_updated_at_ms: base,
                    result: customer,
                })
            })
            .await
    }

    pub fn list_customers(
        &self,
        scope: &Scope,
        page: &PageRequest,
    ) -> Result<Page<Customer>, EngineError> {
        let prefix = ListingKey::prefix(keys::CUSTOMER_LIST, &scope.store_id, scope.mode, None);
        let cursor_key = |id: &str| -> Result<Vec<u8>, EngineError> {
            let customer = self
                .get_customer(scope, id)
                .map_err(|_| EngineError::NotFound {
                    resource: "customer",
                    id: id.to_string(),
                    param: None,
                })?;
            Ok(ListingKey::entry(
                keys::CUSTOMER_LIST,
                &scope.store_id,
                scope.mode,
                None,
                customer.created_at_ms,
                &customer.id,
            ))
        };
        let cursor = cursor_from(page, cursor_key)?;
        paginate(
            self.journal.store().as_ref(),
            &prefix,
            cursor,
            page.limit,
            |key, _| {
                let id = ListingKey::id_in(&prefix, key)?;
                self.get_customer(scope, id).map(Some)
            },
        )
    }
}

/// 409 `external_id_taken`: decided by the service before appending and again by
/// the projector in log order.
pub fn external_id_taken(external: &str) -> Outcome {
    Outcome::rejected(
        "external_id_taken",
        format!("a customer with external_id '{external}' already exists"),
    )
    .with_param("external_id")
}
