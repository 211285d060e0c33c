//! `cargo run --example http --features axum,mysql,sqlite,redis`
//!
//! An axum server with one idempotent endpoint, `POST /orders/{id}/pay`
//! (JSON body `{"amount": <integer cents>}`), the caller named by an
//! `X-User-Id` header (a stand-in for real authentication) and the retry key
//! either made by the client (`Idempotency-Key`) or issued by the server
//! (`GET /orders/{id}/pay-token`, then `Idempotency-Token`). Orders
//! 1..=10000 exist as `PENDING`.
//!
//! Environment:
//! - `IDEM_HTTP_ADDR`: where to listen (default `127.0.0.1:3000`);
//! - `IDEM_MYSQL_URL`: MySQL / MariaDB, e.g. `mysql://root@127.0.0.1:3306/test`;
//!   unset, SQLite: the file in `IDEM_SQLITE_URL` (e.g. `sqlite:idem-http.db`)
//!   or, unset too, an in-memory database;
//! - `IDEM_REDIS_URL`: the optional Redis claim, e.g. `redis://127.0.0.1:6379`.
//!
//! With `--features metrics` too, `GET /metrics` answers the engine's metrics
//! in the Prometheus text format (`curl localhost:3000/metrics`).
//!
//! Each record keeps its order as `biz_no` (`examples/shop/mod.rs`), so
//! `idem reconcile --biz http_pay --table payments --column order_id
//! --record-field biz_no` lists payments without a record and records
//! without a payment (docs/http.md, "A whole server").
//!
//! ```sh
//! curl -i -X POST localhost:3000/orders/42/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Key: 5d0c2a6e-pay-42' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//! The same command again answers the same body plus `Idempotent-Replayed: true`,
//! and so does `-H 'Idempotency-Key: "5d0c2a6e-pay-42"'` (the quoted form of
//! the IETF draft: the same key); with `{"amount":5}` it answers 422
//! `IDEMPOTENCY_KEY_REUSED`, and with `-H 'X-User-Id: alice:x'` 400
//! `INVALID_PRINCIPAL`. A client that sends a fresh key with its retry
//! defeats the record, not the order's own state (layer 4,
//! `idempotency::state`): the second body finds the order already paid and
//! answers 200 with the caller's own payment, writing nothing; another
//! user's new key on that order answers 409 `ORDER_ALREADY_PAID`, showing
//! nothing of the payment.
//!
//! For clients that must not make up their own keys, the form asks for a
//! token first (it is alice's alone, for 15 minutes) and the submit sends it:
//! ```sh
//! curl -s localhost:3000/orders/43/pay-token -H 'X-User-Id: alice'
//! # {"token":"<32 characters>","expires_in":900}
//! curl -i -X POST localhost:3000/orders/43/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Token: <token>' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//! The same submit again replays the first answer (`Idempotent-Replayed:
//! true`), or answers 409 while the first runs; a submit whose payment fails
//! (say `{"amount":0}`, 422) gives the token back, so the corrected submit
//! runs. A forged, expired or another user's token answers 403
//! `IDEMPOTENCY_TOKEN_INVALID`, and nothing is written. Tokens live in Redis
//! when `IDEM_REDIS_URL` is set (then a Redis outage answers 503, never a
//! pass), in the table `idem_token` otherwise.

#[path = "shop/mod.rs"]
mod shop;

use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, ServiceExt};
use idempotency::Idem;
use idempotency::http::{IdempotencyKey, IdempotencyToken, KeyOrToken, Problem, ReplayHeader, check_principal};
use shop::{ApiError, PAY_TOKEN_TTL, PAY_TOKENS, PayToken, Store};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idem(e) => e.into_response(),
            ApiError::Token(e) => e.into_response(),
            ApiError::Refused(refusal) => {
                let (status, code) = refusal.status_and_code();
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                problem(status, code, refusal.to_string())
            }
        }
    }
}

/// An `application/problem+json` answer in the same shape as the engine's.
fn problem(status: StatusCode, code: &'static str, detail: String) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    Problem { status, code, title, detail, retry_after: None }.into_response()
}

/// The authenticated principal; here simply the `X-User-Id` header. None
/// is 401; one that cannot scope a key (`:` in it, the separator in the key
/// template, or anything outside `[A-Za-z0-9_.-]{1,64}`) is refused by
/// `check_principal` with 400 `INVALID_PRINCIPAL`, so that two users' keys
/// can never render the same.
struct UserId(String);

/// Made once: a header looked up by a `&str` name is parsed on every request.
const X_USER_ID: HeaderName = HeaderName::from_static("x-user-id");

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let Some(value) = parts.headers.get(X_USER_ID) else {
            let detail = "send X-User-Id: 1 to 64 characters from A-Z a-z 0-9 _ . -".to_owned();
            return Err(problem(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", detail));
        };
        let user = String::from_utf8_lossy(value.as_bytes());
        check_principal(&user).map_err(IntoResponse::into_response)?;
        Ok(UserId(user.into_owned()))
    }
}

/// The handlers and their router for one database.
macro_rules! pay_service {
    ($module:ident, $db:ty, $payment_id:path) => {
        mod $module {
            use super::*;

            #[derive(Clone)]
            pub struct App {
                pub idem: Idem<$db>,
            }

            shop::payments!($db, $payment_id);

            /// A token for paying an order, for this user alone.
            async fn pay_token(
                State(app): State<App>,
                UserId(user): UserId,
                Path(_order_id): Path<i64>,
            ) -> Result<Json<PayToken>, ApiError> {
                let issued = app.idem.tokens().issue(PAY_TOKENS, &user, PAY_TOKEN_TTL).await?;
                Ok(Json(PayToken { token: issued.token, expires_in: issued.ttl.as_secs() }))
            }

            /// Pays an order once per retry key: the client's
            /// `Idempotency-Key`, or the `Idempotency-Token` the server
            /// issued (consumed here, given back if the payment fails).
            async fn pay(
                State(app): State<App>,
                UserId(user): UserId,
                proof: KeyOrToken,
                Path(order_id): Path<i64>,
                Json(req): Json<PayReq>,
            ) -> Result<StoredJson<PayResponse>, ApiError> {
                match proof {
                    KeyOrToken::Key(IdempotencyKey(idem_key)) => pay_by_key(&app, user, idem_key, order_id, req).await,
                    KeyOrToken::Token(IdempotencyToken(token)) => {
                        let call = || pay_by_token(&app, user.clone(), token.clone(), order_id, req);
                        app.idem.tokens().redeem(PAY_TOKENS, &user, &token, call).await
                    }
                }
            }

            pub fn router(idem: Idem<$db>) -> Router {
                Router::new()
                    .route("/orders/{id}/pay", post(pay))
                    .route("/orders/{id}/pay-token", get(pay_token))
                    .with_state(App { idem })
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql, shop::mysql_payment_id);
pay_service!(on_sqlite, sqlx::Sqlite, shop::sqlite_payment_id);

/// `GET /metrics`: what the engine recorded, in the Prometheus text format.
/// The exporter only renders; axum serves it (no listener of its own).
#[cfg(feature = "metrics")]
fn metrics_route() -> Result<Router, Box<dyn std::error::Error>> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    idempotency::metrics::describe();
    // Histograms are summarised on upkeep, which nothing else runs here.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(Router::new().route("/metrics", axum::routing::get(move || std::future::ready(handle.render()))))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("IDEM_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let redis = std::env::var("IDEM_REDIS_URL").ok().map(redis::Client::open).transpose()?;
    let claims = if redis.is_some() { "with the Redis claim" } else { "without Redis" };
    let (router, store) = match shop::open(redis).await? {
        Store::MySql(idem) => (on_mysql::router(idem), "MySQL"),
        Store::Sqlite(idem) => (on_sqlite::router(idem), "SQLite"),
    };

    #[cfg(feature = "metrics")]
    let router = router.merge(metrics_route()?);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{} ({store}, {claims})", listener.local_addr()?);
    // `Idempotent-Replayed: true` on replays, around the whole router: as a
    // `Router::layer`, axum would clone and box it for every request.
    let app = ReplayHeader::new(router);
    axum::serve(listener, ServiceExt::<Request>::into_make_service(app)).await?;
    Ok(())
}
