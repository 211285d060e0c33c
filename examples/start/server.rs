use axum::extract::{FromRequestParts, Path, State};
use axum::http::{StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::post};
use idempotency::http::{IdempotencyKey, Problem, ReplayHeaderLayer, check_principal};
use idempotency::{BusinessError, Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlPool, Transaction};

/// The handlers' state: the engine (clones share its pool and Redis).
#[derive(Clone)]
struct App {
    idem: Idem<MySql>,
}

/// Your authenticated principal; here the `X-User-Id` header. `check_principal`
/// refuses one that could render another user's key (400 `INVALID_PRINCIPAL`).
struct UserId(String);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let user = parts.headers.get("x-user-id").and_then(|v| v.to_str().ok());
        let user = user.ok_or_else(|| {
            problem(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", "unauthenticated", "send X-User-Id".into())
        })?;
        check_principal(user).map_err(Problem::into_response)?;
        Ok(UserId(user.to_owned()))
    }
}

#[derive(Serialize, Deserialize)]
struct PayReq {
    amount: i64,
}

/// What the handler answers, and what a retry replays byte for byte.
#[derive(Serialize, Deserialize)]
struct PayResponse {
    order_id: i64,
    amount: i64,
}

impl IntoResponse for PayResponse {
    fn into_response(self) -> Response {
        Json(self).into_response()
    }
}

/// Payments over this many cents are declined.
const LIMIT: i64 = 100_000;

/// A declined payment: a final answer, recorded and replayed (`record_errors`).
#[derive(Clone, Serialize, Deserialize)]
struct Declined {
    amount: i64,
    limit: i64,
}

/// The handler's error: the engine's answers (`idempotency::Error`, which a
/// `sqlx::Error` converts into, classified by its code), and your own refusals.
/// Without refusals of your own, `idempotency::Error` alone is enough.
enum ApiError {
    Idem(idempotency::Error),
    NotPayable(i64),
    Declined(Declined),
}

/// Which errors are answers (`record_errors` records them; every retry gets
/// the same one), and which are failures (rolled back; a retry runs again).
impl BusinessError for ApiError {
    type Record = Declined;

    fn recorded(&self) -> Option<Declined> {
        match self {
            ApiError::Declined(declined) => Some(declined.clone()),
            ApiError::Idem(_) | ApiError::NotPayable(_) => None,
        }
    }

    fn replayed(record: Declined) -> Self {
        ApiError::Declined(record)
    }
}

impl From<idempotency::Error> for ApiError {
    fn from(e: idempotency::Error) -> Self {
        ApiError::Idem(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Idem(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idem(e) => e.into_response(), // application/problem+json
            ApiError::NotPayable(id) => problem(
                StatusCode::CONFLICT,
                "ORDER_NOT_PAYABLE",
                "order-not-payable",
                format!("order {id} is not pending"),
            ),
            ApiError::Declined(Declined { amount, limit }) => problem(
                StatusCode::PAYMENT_REQUIRED,
                "PAYMENT_DECLINED",
                "payment-declined",
                format!("{amount} is over the limit of {limit}"),
            ),
        }
    }
}

/// Your own refusals in the engine's shape (`application/problem+json` with a
/// `code`), typed in your own namespace (`with_type`; the engine's are
/// `urn:idem:problem:...`).
fn problem(status: StatusCode, code: &'static str, kind: &str, detail: String) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let problem = Problem { status, code, title, detail, retry_after: None };
    problem.with_type(format!("https://shop.example/problems/{kind}")).into_response()
}

/// `wait`: a duplicate sent while the first request runs gets its answer, not a 409.
/// `record_errors`: a declined payment is recorded; every retry gets the same 402.
#[idempotent(
    key = "<user>:<idem_key>",
    ttl = "24h",
    biz = "http_pay",
    biz_no = "<order_id>",
    engine = app.idem,
    wait = "5s",
    record_errors
)]
#[axum::debug_handler]
async fn pay(
    State(app): State<App>,
    tx: &mut Transaction<'_, MySql>,
    UserId(user): UserId,
    IdempotencyKey(idem_key): IdempotencyKey,
    Path(order_id): Path<i64>,
    Json(req): Json<PayReq>,
) -> Result<PayResponse, ApiError> {
    if req.amount > LIMIT {
        return Err(ApiError::Declined(Declined { amount: req.amount, limit: LIMIT }));
    }
    let paid = sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    if paid.rows_affected() == 0 {
        return Err(ApiError::NotPayable(order_id)); // rolled back, nothing recorded
    }
    sqlx::query("INSERT INTO payments (order_id, user_id, amount) VALUES (?, ?, ?)")
        .bind(order_id)
        .bind(&user)
        .bind(req.amount)
        .execute(&mut **tx)
        .await?;
    Ok(PayResponse { order_id, amount: req.amount })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Logs to stdout. A call that fails on the database logs its cause here
    // (its code, the database's message, `biz`), which clients never see.
    tracing_subscriber::fmt::init();
    let pool = MySqlPool::connect("mysql://root@127.0.0.1:3306/test").await?;
    let idem = Idem::builder(pool).redis(redis::Client::open("redis://127.0.0.1:6379")?).build();
    idem.migrate().await?;

    // This example's business tables: orders to pay, and the payments.
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL);
         CREATE TABLE IF NOT EXISTS payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL,
             user_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL);
         INSERT IGNORE INTO orders VALUES (42, 'PENDING'), (43, 'PENDING'), (44, 'PENDING');",
    )
    .execute(idem.pool())
    .await?;

    let app = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .layer(ReplayHeaderLayer) // `Idempotent-Replayed: true` on replays
        .with_state(App { idem });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
