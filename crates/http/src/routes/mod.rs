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
