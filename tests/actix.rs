//! End to end over HTTP with actix-web: the same contract as axum's
//! (`http_contract`, every case), against an actix-web server with an
//! `#[idempotent]` handler bound to an ephemeral port, driven by a real
//! client. The server runs its own worker threads, as in production; the
//! engine and its pools come from the test's runtime, as they come from
//! `main` there.

mod http_contract;

use std::fmt;
use std::future::{Ready, ready};
use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::middleware::from_fn;
use actix_web::{App, FromRequest, HttpRequest, HttpResponse, HttpServer, Responder, ResponseError, web};
use http_contract::{ApiError, Framework, Gate, NOT_PAYABLE_BODY, PayReq, PayResponse, UserId};
use idempotency::http::IdempotencyKey;
use idempotency::http::actix::{Path, check_principal, replay_header};
use idempotency::{Idem, idempotent};
use sqlx::Transaction;

impl Responder for PayResponse {
    type Body = actix_web::body::BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        HttpResponse::Ok().json(self)
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Idem(e) => e.fmt(f),
            ApiError::NotPayable => f.write_str("order not payable"),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Idem(e) => ResponseError::status_code(e),
            ApiError::NotPayable => StatusCode::CONFLICT,
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            ApiError::Idem(e) => e.error_response(),
            ApiError::NotPayable => HttpResponse::Conflict()
                .insert_header(("content-type", "application/problem+json"))
                .body(NOT_PAYABLE_BODY),
        }
    }
}

/// The caller, from `X-User-Id`: none is 401; one that cannot scope a key
/// (`:` in it, say) is refused by `check_principal` with 400.
impl FromRequest for UserId {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, actix_web::Error>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        let Some(value) = request.headers().get("x-user-id") else {
            return ready(Err(actix_web::error::ErrorUnauthorized("")));
        };
        let user = String::from_utf8_lossy(value.as_bytes());
        ready(check_principal(&user).map(|()| UserId(user.into_owned())).map_err(Into::into))
    }
}

macro_rules! pay_service {
    ($module:ident, $db:ty) => {
        mod $module {
            use super::*;

            #[derive(Clone)]
            pub struct Shop {
                pub idem: Idem<$db>,
                pub gate: Arc<Gate>,
            }

            #[idempotent(key = "<user>:<idem_key>", ttl = "1h", biz = "http_test_pay", engine = app.idem)]
            async fn pay(
                app: web::Data<Shop>,
                tx: &mut Transaction<'_, $db>,
                UserId(user): UserId,
                IdempotencyKey(idem_key): IdempotencyKey,
                Path(order_id): Path<i64>,
                web::Json(req): web::Json<PayReq>,
            ) -> Result<PayResponse, ApiError> {
                crate::charge!(tx, app.gate, user, order_id, req)
            }

            pub async fn serve(idem: Idem<$db>, gate: Arc<Gate>) -> String {
                let shop = web::Data::new(Shop { idem, gate });
                super::serve(move |config| {
                    config.app_data(shop.clone()).route("/orders/{id}/pay", web::post().to(pay));
                })
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql);
pay_service!(on_sqlite, sqlx::Sqlite);

/// Books a reference taken from the path: the `biz_no` is the request's.
#[idempotent(key = "<idem_key>", ttl = "1h", biz = "http_test_book", biz_no = "<reference>", engine = idem)]
async fn book(
    idem: web::Data<Idem<sqlx::Sqlite>>,
    IdempotencyKey(idem_key): IdempotencyKey,
    Path(reference): Path<String>,
) -> Result<PayResponse, ApiError> {
    Ok(PayResponse { order_id: 0, user: reference, amount: 0, payment_id: 0 })
}

/// Serves the routes `configure` adds, behind `replay_header`, on an
/// ephemeral port with two workers; returns its base URL.
fn serve(configure: impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().unwrap();
    let server = HttpServer::new(move || App::new().wrap(from_fn(replay_header)).configure(configure.clone()))
        .workers(2)
        .disable_signals()
        .listen(listener)
        .expect("listen")
        .run();
    tokio::spawn(server);
    format!("http://{addr}")
}

struct Actix;

impl Framework for Actix {
    async fn serve_mysql(idem: Idem<sqlx::MySql>, gate: Arc<Gate>) -> String {
        on_mysql::serve(idem, gate).await
    }

    async fn serve_sqlite(idem: Idem<sqlx::Sqlite>, gate: Arc<Gate>) -> String {
        on_sqlite::serve(idem, gate).await
    }

    async fn serve_booking(idem: Idem<sqlx::Sqlite>) -> String {
        let idem = web::Data::new(idem);
        serve(move |config| {
            config.app_data(idem.clone()).route("/refs/{reference}", web::post().to(book));
        })
    }
}

contract_tests!(Actix);
