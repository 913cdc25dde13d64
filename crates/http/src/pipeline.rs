//! The `/v1` middleware chain, run inside one axum layer.
//!
//! Every `/v1` request meets, in this order: [`middleware::authenticate`],
//! [`cluster::forward`], [`middleware::rate_limit`], [`middleware::idempotency`],
//! [`middleware::write_gate`], [`middleware::found_after_catching_up`], then its
//! handler. Six axum `from_fn` layers did this before; axum wraps each route in
//! every layer, and each layer copies all the layers inside it on every request:
//! with those copies gone a cheap GET costs about a quarter less server CPU
//! (docs/benchmarks.md, "Layers around the router, not each route"). Here the
//! chain is one layer ([`v1_chain`]) and each step hands the request to the next
//! through [`Chain`], which is what axum's `Next` is to a `from_fn` middleware.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use futures::future::BoxFuture;

use crate::cluster;
use crate::middleware::{self, Proceed};
use crate::AppState;

/// The steps of the chain, in the order a request meets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Authenticate,
    Forward,
    RateLimit,
    Idempotency,
    WriteGate,
    FoundAfterCatchingUp,
    Handler,
}

impl Step {
    fn after(self) -> Step {
        match self {
            Step::Authenticate => Step::Forward,
            Step::Forward => Step::RateLimit,
            Step::RateLimit => Step::Idempotency,
            Step::Idempotency => Step::WriteGate,
            Step::WriteGate => Step::FoundAfterCatchingUp,
            Step::FoundAfterCatchingUp | Step::Handler => Step::Handler,
        }
    }
}

/// The rest of the chain from one step: the step's middleware, the ones after
/// it, then the route's handler (axum's `Next`).
#[derive(Clone)]
pub struct Chain {
    state: AppState,
    handler: Next,
    step: Step,
}

impl Chain {
    fn then(&self) -> Chain {
        Chain {
            state: self.state.clone(),
            handler: self.handler.clone(),
            step: self.step.after(),
        }
    }
}

impl Proceed for Chain {
    fn run(self, request: Request) -> BoxFuture<'static, Response> {
        let state = State(self.state.clone());
        match self.step {
            Step::Authenticate => Box::pin(middleware::authenticate(state, request, self.then())),
            Step::Forward => Box::pin(cluster::forward(state, request, self.then())),
            Step::RateLimit => Box::pin(middleware::rate_limit(state, request, self.then())),
            Step::Idempotency => Box::pin(middleware::idempotency(state, request, self.then())),
            Step::WriteGate => Box::pin(middleware::write_gate(state, request, self.then())),
            Step::FoundAfterCatchingUp => Box::pin(middleware::found_after_catching_up(
                state,
                request,
                self.then(),
            )),
            Step::Handler => Box::pin(self.handler.run(request)),
        }
    }
}

/// The one layer of every `/v1` route: the whole chain, then the handler.
pub async fn v1_chain(State(state): State<AppState>, request: Request, handler: Next) -> Response {
    Chain {
        state,
        handler,
        step: Step::Authenticate,
    }
    .run(request)
    .await
}

#[cfg(test)]
mod tests {
    use super::Step;

    #[test]
    fn every_step_leads_to_the_handler_once_in_order() {
        let mut seen = vec![Step::Authenticate];
        while *seen.last().unwrap() != Step::Handler {
            let next = seen.last().unwrap().after();
            assert!(!seen.contains(&next), "{next:?} twice");
            seen.push(next);
        }
        assert_eq!(
            seen,
            [
                Step::Authenticate,
                Step::Forward,
                Step::RateLimit,
                Step::Idempotency,
                Step::WriteGate,
                Step::FoundAfterCatchingUp,
                Step::Handler,
            ]
        );
    }
}
