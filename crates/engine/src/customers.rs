//! Customers: create, read, list, update (spec 4.6, decisions.md "Customers").
//! `external_id` uniqueness per store and environment is checked under the scope's
//! control lock, and the write returns once projected.

use tally_domain::customer::{validate_customer_input, Customer, CustomerInput, Patch};
use tally_domain::record::Record;

use crate::codec;
use crate::error::EngineError;
use crate::ids::new_id;
use crate::keys::{self, Key, ListingKey};
use crate::outcome::Outcome;
use crate::pagination::{paginate, Cursor, Page, PageRequest};
use crate::{Engine, Scope};

impl Engine {
    pub fn get_customer(&self, scope: &Scope, id: &str) -> Result<Customer, EngineError> {
        let key = Key::scoped(keys::CUSTOMER, &scope.store_id, scope.mode).text(id);
        match self.store().get(key.as_bytes())? {
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
            .store()
            .get(key.as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    pub fn customer_exists(&self, scope: &Scope, id: &str) -> Result<bool, EngineError> {
        let key = Key::scoped(keys::CUSTOMER, &scope.store_id, scope.mode).text(id);
        Ok(self.store().get(key.as_bytes())?.is_some())
    }

    pub async fn create_customer(
        &self,
        scope: &Scope,
        input: &CustomerInput,
    ) -> Result<Customer, EngineError> {
        let changes = validate_customer_input(input, true)?;
        let lock = self.control_lock(scope);
        let _guard = self.acquire(lock).await?;
        if let Patch::Set(external) = &changes.external_id {
            if self.customer_id_by_external(scope, external)?.is_some() {
                return Err(external_id_taken(external).into());
            }
        }
        let now = self.now_ms();
        let mut customer = Customer {
            id: new_id("cus"),
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
        self.append_and_apply(&Record::CustomerUpserted(customer.clone()))
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
        let lock = self.control_lock(scope);
        let _guard = self.acquire(lock).await?;
        let mut customer = self.get_customer(scope, id)?;
        if let Patch::Set(external) = &changes.external_id {
            match self.customer_id_by_external(scope, external)? {
                Some(holder) if holder != customer.id => {
                    return Err(external_id_taken(external).into())
                }
                _ => {}
            }
        }
        customer.apply(changes, self.now_ms());
        self.append_and_apply(&Record::CustomerUpserted(customer.clone()))
            .await?;
        Ok(customer)
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
            Ok(ListingKey {
                table: keys::CUSTOMER_LIST,
                store_id: scope.store_id.clone(),
                mode: scope.mode,
                owner: None,
                created_at_ms: customer.created_at_ms,
                id: customer.id.clone(),
            }
            .encode())
        };
        let cursor = cursor_from(page, cursor_key)?;
        paginate(
            self.store().as_ref(),
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

/// Resolves the cursor ids of a page request to index keys (404 for an unknown id).
pub fn cursor_from(
    page: &PageRequest,
    key_of: impl Fn(&str) -> Result<Vec<u8>, EngineError>,
) -> Result<Cursor, EngineError> {
    let with_param = |param: &str, e: EngineError| match e {
        EngineError::NotFound { resource, id, .. } => EngineError::NotFound {
            resource,
            id,
            param: Some(param.to_string()),
        },
        other => other,
    };
    Ok(match (&page.starting_after, &page.ending_before) {
        (Some(_), Some(_)) => {
            return Err(tally_domain::FieldError::invalid(
                "ending_before",
                "give at most one of `starting_after` and `ending_before`",
            )
            .into())
        }
        (Some(id), None) => Cursor::After(key_of(id).map_err(|e| with_param("starting_after", e))?),
        (None, Some(id)) => Cursor::Before(key_of(id).map_err(|e| with_param("ending_before", e))?),
        (None, None) => Cursor::None,
    })
}

/// 409 `external_id_taken`: decided by the service before appending and again by
/// the projector in log order.
pub(crate) fn external_id_taken(external: &str) -> Outcome {
    Outcome::rejected(
        "external_id_taken",
        format!("a customer with external_id '{external}' already exists"),
    )
    .with_param("external_id")
}
