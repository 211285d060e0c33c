//! An axum handler behind the `Idempotency-Key` extractor and the replay
//! header, called in process (a real `Router`, `tower`'s `oneshot`): the
//! answer is the status, the `Idempotent-Replayed` header and the body.
//! The handler answers a value 200 with its JSON, a declined payment 402
//! with the decline's, the engine's errors as `idempotency::http` words
//! them (problem details), and its body's own failure 500.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router, middleware};
use idempotency::http::header::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, REPLAYED};
use idempotency::http::{IdempotencyKey, replay_header};
use serde::{Deserialize, Serialize};
use tower::ServiceExt;

use super::{Answer, EntryPoint, Shape};
use crate::backends::Store;
use crate::fns::{BoxFuture, CallError};
use crate::script::Script;

/// The scripts of the requests in flight, by the id a request carries.
type Scripts = Arc<Mutex<HashMap<u64, Arc<Script>>>>;

pub struct Axum<F: Store> {
    router: Router,
    scripts: Scripts,
    next: AtomicU64,
    _shape: std::marker::PhantomData<F>,
}

struct App<F: Store> {
    shape: Shape<F>,
    scripts: Scripts,
}

#[derive(Serialize, Deserialize)]
struct PayRequest {
    amount: i64,
    /// Which script the body follows (not an argument of the fn).
    script: u64,
}

/// A problem of the handler's own, as `idempotency::http` words its.
fn problem(status: StatusCode, code: &str) -> Response {
    let body = serde_json::json!({ "status": status.as_u16(), "code": code });
    (status, [(header::CONTENT_TYPE, idempotency::http::PROBLEM_JSON)], body.to_string()).into_response()
}

async fn pay<F: Store>(
    State(app): State<Arc<App<F>>>,
    IdempotencyKey(key): IdempotencyKey,
    Json(request): Json<PayRequest>,
) -> Response {
    let script = app.scripts.lock().unwrap()[&request.script].clone();
    match app.shape.call(key, request.amount, &script).await {
        Ok(paid) => Json(paid).into_response(),
        Err(CallError::Declined(declined)) => (StatusCode::PAYMENT_REQUIRED, Json(declined)).into_response(),
        Err(CallError::Idem(idempotency::Error::Permanent { failure, .. })) => {
            let json = [(header::CONTENT_TYPE, "application/json")];
            (StatusCode::PAYMENT_REQUIRED, json, failure.as_json().to_owned()).into_response()
        }
        Err(CallError::Idem(e)) => e.into_response(),
        Err(CallError::Body) => problem(StatusCode::INTERNAL_SERVER_ERROR, "BODY_FAILED"),
        Err(CallError::Db(_)) => problem(StatusCode::INTERNAL_SERVER_ERROR, "DATABASE_FAILED"),
    }
}

impl<F: Store> Axum<F> {
    pub fn new(shape: Shape<F>) -> Self {
        let scripts = Scripts::default();
        let app = Arc::new(App { shape, scripts: Arc::clone(&scripts) });
        let router =
            Router::new().route("/pay", post(pay::<F>)).layer(middleware::from_fn(replay_header)).with_state(app);
        Axum { router, scripts, next: AtomicU64::new(0), _shape: std::marker::PhantomData }
    }
}

impl<F: Store> EntryPoint for Axum<F> {
    fn call(&self, key: &str, amount: i64, script: Arc<Script>) -> BoxFuture<'static, Answer> {
        let id = self.next.fetch_add(1, SeqCst);
        self.scripts.lock().unwrap().insert(id, script);
        let body = serde_json::to_string(&PayRequest { amount, script: id }).expect("a request's JSON");
        let request = Request::post("/pay")
            .header(IDEMPOTENCY_KEY, key)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("a request");
        let (router, scripts) = (self.router.clone(), Arc::clone(&self.scripts));
        Box::pin(async move {
            let response = router.oneshot(request).await.expect("axum answers");
            scripts.lock().unwrap().remove(&id);
            let status = response.status();
            let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == REPLAYED);
            let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("the body");
            let bytes = String::from_utf8(body.to_vec()).expect("a UTF-8 body");
            let code = serde_json::from_str::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
            match (status, code.as_deref()) {
                (StatusCode::OK, _) => Answer::Value { bytes, replayed },
                (StatusCode::PAYMENT_REQUIRED, _) => Answer::Declined { bytes, replayed },
                (StatusCode::CONFLICT, Some("IDEMPOTENCY_KEY_IN_PROGRESS")) => Answer::InProgress,
                (StatusCode::UNPROCESSABLE_ENTITY, Some("IDEMPOTENCY_KEY_REUSED")) => Answer::KeyReused,
                (StatusCode::INTERNAL_SERVER_ERROR, Some("BODY_FAILED")) => Answer::BodyFailed,
                _ => Answer::Other(format!("{status} {bytes}")),
            }
        })
    }
}
