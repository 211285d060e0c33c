//! `cargo run --example actix --features actix,mysql,sqlite,redis`
//!
//! The server of `examples/http.rs`, on actix-web instead of axum: one
//! idempotent endpoint, `POST /orders/{id}/pay` (JSON body `{"amount":
//! <integer cents>}`), the caller named by an `X-User-Id` header (a stand-in
//! for real authentication) and the retry key either made by the client
//! (`Idempotency-Key`) or issued by the server (`GET /orders/{id}/pay-token`,
//! then `Idempotency-Token`). Orders 1..=10000 exist as `PENDING`. It answers
//! exactly as the axum one does: the same statuses, `application/problem+json`
//! bodies and `Idempotent-Replayed: true` header.
//!
//! Environment:
//! - `IDEM_HTTP_ADDR`: where to listen (default `127.0.0.1:3000`);
//! - `IDEM_MYSQL_URL`: MySQL / MariaDB, e.g. `mysql://root@127.0.0.1:3306/test`;
//!   unset, SQLite: the file in `IDEM_SQLITE_URL` (e.g. `sqlite:idem-actix.db`)
//!   or, unset too, an in-memory database;
//! - `IDEM_REDIS_URL`: the optional Redis claim, e.g. `redis://127.0.0.1:6379`.
//!
//! ```sh
//! curl -i -X POST localhost:3000/orders/42/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Key: 5d0c2a6e-pay-42' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//! The same command again answers the same body plus `Idempotent-Replayed: true`,
//! and so does `-H 'Idempotency-Key: "5d0c2a6e-pay-42"'` (the quoted form of
//! the IETF draft: the same key); with `{"amount":5}` it answers 422
//! `IDEMPOTENCY_KEY_REUSED`, and with `-H 'X-User-Id: alice:x'` 400
//! `INVALID_PRINCIPAL`. Records keep their order as `biz_no`, for `idem
//! reconcile` (see `examples/http.rs`). Tokens work as in `examples/http.rs`:
//! ```sh
//! curl -s localhost:3000/orders/43/pay-token -H 'X-User-Id: alice'
//! curl -i -X POST localhost:3000/orders/43/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Token: <token>' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```

#[path = "shop/mod.rs"]
mod shop;

use std::future::{Ready, ready};

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::middleware::from_fn;
use actix_web::{App, FromRequest, HttpRequest, HttpResponse, HttpServer, ResponseError, web};
use idempotency::Idem;
use idempotency::http::actix::{Path, Problem, check_principal, replay_header};
use idempotency::http::{IdempotencyKey, IdempotencyToken, KeyOrToken};
use shop::{ApiError, PAY_TOKEN_TTL, PAY_TOKENS, PayToken, Refusal, Store};

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Idem(e) => ResponseError::status_code(e),
            ApiError::Token(e) => ResponseError::status_code(e),
            ApiError::Refused(refusal) => refusal_problem(refusal).status,
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            ApiError::Idem(e) => e.error_response(),
            ApiError::Token(e) => e.error_response(),
            ApiError::Refused(refusal) => refusal_problem(refusal).error_response(),
        }
    }
}

/// A business refusal in the same `application/problem+json` shape as the
/// engine's answers.
fn refusal_problem(refusal: &Refusal) -> Problem {
    let (status, code) = refusal.status_and_code();
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let title = status.canonical_reason().unwrap_or("Error");
    Problem { status, code, title, detail: refusal.to_string(), retry_after: None }
}

/// The authenticated principal; here simply the `X-User-Id` header. None
/// is 401; one that cannot scope a key (`:` in it, the separator in the key
/// template, or anything outside `[A-Za-z0-9_.-]{1,64}`) is refused by
/// `check_principal` with 400 `INVALID_PRINCIPAL`, so that two users' keys
/// can never render the same.
struct UserId(String);

impl FromRequest for UserId {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        let Some(value) = request.headers().get("x-user-id") else {
            let detail = "send X-User-Id: 1 to 64 characters from A-Z a-z 0-9 _ . -".to_owned();
            let title = "Unauthorized";
            return ready(Err(Problem {
                status: StatusCode::UNAUTHORIZED,
                code: "UNAUTHENTICATED",
                title,
                detail,
                retry_after: None,
            }));
        };
        let user = String::from_utf8_lossy(value.as_bytes());
        ready(check_principal(&user).map(|()| UserId(user.into_owned())))
    }
}

/// The handlers and their routes for one database.
macro_rules! pay_service {
    ($module:ident, $db:ty, $payment_id:path) => {
        mod $module {
            use super::*;

            pub struct App {
                pub idem: Idem<$db>,
            }

            shop::payments!($db, $payment_id);

            /// A token for paying an order, for this user alone.
            async fn pay_token(
                app: web::Data<App>,
                UserId(user): UserId,
                Path(_order_id): Path<i64>,
            ) -> Result<web::Json<PayToken>, ApiError> {
                let issued = app.idem.tokens().issue(PAY_TOKENS, &user, PAY_TOKEN_TTL).await?;
                Ok(web::Json(PayToken { token: issued.token, expires_in: issued.ttl.as_secs() }))
            }

            /// Pays an order once per retry key: the client's
            /// `Idempotency-Key`, or the `Idempotency-Token` the server
            /// issued (consumed here, given back if the payment fails).
            async fn pay(
                app: web::Data<App>,
                UserId(user): UserId,
                proof: KeyOrToken,
                Path(order_id): Path<i64>,
                web::Json(req): web::Json<PayReq>,
            ) -> Result<StoredJson<PayResponse>, ApiError> {
                match proof {
                    KeyOrToken::Key(IdempotencyKey(idem_key)) => pay_by_key(&app, user, idem_key, order_id, req).await,
                    KeyOrToken::Token(IdempotencyToken(token)) => {
                        let call = || pay_by_token(&app, user.clone(), token.clone(), order_id, req);
                        app.idem.tokens().redeem(PAY_TOKENS, &user, &token, call).await
                    }
                }
            }

            /// The routes, for `App::configure` in each worker.
            pub fn routes(app: web::Data<App>) -> impl Fn(&mut web::ServiceConfig) + Clone + Send + 'static {
                move |config| {
                    config
                        .app_data(app.clone())
                        .route("/orders/{id}/pay", web::post().to(pay))
                        .route("/orders/{id}/pay-token", web::get().to(pay_token));
                }
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql, shop::mysql_payment_id);
pay_service!(on_sqlite, sqlx::Sqlite, shop::sqlite_payment_id);

/// Serves `routes` behind the replay marker, on every core.
async fn serve(addr: &str, routes: impl Fn(&mut web::ServiceConfig) + Clone + Send + 'static) -> std::io::Result<()> {
    let server =
        HttpServer::new(move || App::new().wrap(from_fn(replay_header)).configure(routes.clone())).bind(addr)?;
    for local in server.addrs() {
        println!("listening on http://{local}");
    }
    server.run().await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("IDEM_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let redis = std::env::var("IDEM_REDIS_URL").ok().map(redis::Client::open).transpose()?;
    println!("{}", if redis.is_some() { "with the Redis claim" } else { "without Redis" });
    match shop::open(redis).await? {
        Store::MySql(idem) => {
            println!("on MySQL");
            serve(&addr, on_mysql::routes(web::Data::new(on_mysql::App { idem }))).await?;
        }
        Store::Sqlite(idem) => {
            println!("on SQLite");
            serve(&addr, on_sqlite::routes(web::Data::new(on_sqlite::App { idem }))).await?;
        }
    }
    Ok(())
}
