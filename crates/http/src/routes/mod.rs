//! Route handlers: parse the wire request, call the engine, render the wire answer.

pub mod admin;
pub mod affiliates;
pub mod billing;
pub mod credits;
pub mod customers;
pub mod events;
pub mod health;
pub mod meters;
pub mod moderation;
pub mod products;
pub mod subscriptions;
pub mod webhooks;

/// A list filter naming a customer: 404 naming `param` when the scope has no such
/// customer (docs/api.md, "Lists": the same rule on every list and usage query).
pub fn known_customer(
    state: &crate::AppState,
    scope: &tally_engine::Scope,
    id: Option<&str>,
    param: &str,
) -> Result<(), tally_engine::EngineError> {
    match id {
        Some(id) if !state.engine.directory().customer_exists(scope, id)? => {
            Err(tally_engine::EngineError::not_found("customer", id).for_param(param))
        }
        _ => Ok(()),
    }
}
