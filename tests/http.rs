//! End to end over HTTP with axum: the contract of `http_contract` (every
//! case there, against an axum app with an `#[idempotent]` handler bound to
//! an ephemeral port, driven by a real client). `tests/actix.rs` holds
//! actix-web to the same cases.

mod http_answers;
mod http_contract;
// The HTTP examples' business part, as users copy it, and its tests.
#[allow(dead_code)]
mod example_shop;
#[path = "../examples/shop/mod.rs"]
#[allow(dead_code)]
mod shop;

use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router, ServiceExt};
use http_contract::{ApiError, Framework, Gate, NOT_PAYABLE_BODY, PayReq, PayResponse, UserId};
use idempotency::http::{IdempotencyKey, ReplayHeader, ReplayHeaderLayer, check_principal};
use idempotency::{Idem, idempotent};
use sqlx::Transaction;

impl IntoResponse for PayResponse {
    fn into_response(self) -> Response {
        (StatusCode::OK, Json(self)).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idem(e) => e.into_response(),
            ApiError::NotPayable => {
                let mut r = (StatusCode::CONFLICT, NOT_PAYABLE_BODY).into_response();
                r.headers_mut().insert("content-type", HeaderValue::from_static("application/problem+json"));
                r
            }
        }
    }
}

/// The caller, from `X-User-Id`: none is 401; one that cannot scope a key
/// (`:` in it, say) is refused by `check_principal` with 400.
impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let Some(value) = parts.headers.get("x-user-id") else {
            return Err(StatusCode::UNAUTHORIZED.into_response());
        };
        let user = String::from_utf8_lossy(value.as_bytes());
        check_principal(&user).map_err(IntoResponse::into_response)?;
        Ok(UserId(user.into_owned()))
    }
}

macro_rules! pay_service {
    ($module:ident, $db:ty) => {
        mod $module {
            use super::*;

            #[derive(Clone)]
            pub struct App {
                pub idem: Idem<$db>,
                pub gate: Arc<Gate>,
            }

            #[idempotent(key = "<user>:<idem_key>", ttl = "1h", biz = "http_test_pay", engine = app.idem)]
            async fn pay(
                State(app): State<App>,
                tx: &mut Transaction<'_, $db>,
                UserId(user): UserId,
                IdempotencyKey(idem_key): IdempotencyKey,
                Path(order_id): Path<i64>,
                Json(req): Json<PayReq>,
            ) -> Result<PayResponse, ApiError> {
                crate::charge!(tx, app.gate, user, order_id, req)
            }

            pub fn router(idem: Idem<$db>, gate: Arc<Gate>) -> Router {
                Router::new().route("/orders/{id}/pay", post(pay)).with_state(App { idem, gate })
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql);
pay_service!(on_sqlite, sqlx::Sqlite);

/// Books a reference taken from the path: the `biz_no` is the request's.
#[idempotent(key = "<idem_key>", ttl = "1h", biz = "http_test_book", biz_no = "<reference>", engine = idem)]
async fn book(
    State(idem): State<Idem<sqlx::Sqlite>>,
    IdempotencyKey(idem_key): IdempotencyKey,
    Path(reference): Path<String>,
) -> Result<PayResponse, ApiError> {
    Ok(PayResponse { order_id: 0, user: reference, amount: 0, payment_id: 0 })
}

/// A listener on an ephemeral port, and its base URL.
async fn ephemeral() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().unwrap());
    (listener, base)
}

/// Serves `router` on an ephemeral port; returns its base URL.
async fn serve(router: Router) -> String {
    let (listener, base) = ephemeral().await;
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    base
}

/// [`serve`], the replays marked around the whole router rather than by
/// `Router::layer`: the contract's replay cases hold for both.
async fn serve_wrapped(router: Router) -> String {
    let (listener, base) = ephemeral().await;
    let app = ServiceExt::<Request>::into_make_service(ReplayHeader::new(router));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    base
}

struct Axum;

impl Framework for Axum {
    async fn serve_mysql(idem: Idem<sqlx::MySql>, gate: Arc<Gate>) -> String {
        serve(on_mysql::router(idem, gate).layer(ReplayHeaderLayer)).await
    }

    async fn serve_sqlite(idem: Idem<sqlx::Sqlite>, gate: Arc<Gate>) -> String {
        serve_wrapped(on_sqlite::router(idem, gate)).await
    }

    async fn serve_booking(idem: Idem<sqlx::Sqlite>) -> String {
        serve(Router::new().route("/refs/{reference}", post(book)).with_state(idem)).await
    }
}

contract_tests!(Axum);
