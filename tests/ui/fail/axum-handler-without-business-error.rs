// An axum handler with `record_errors` whose error type lacks its
// `BusinessError` impl: that one error, on the return type, and nothing else.
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Serialize, Deserialize)]
struct Paid {
    order_id: i64,
}

impl IntoResponse for Paid {
    fn into_response(self) -> Response {
        Json(self).into_response()
    }
}

#[derive(Clone)]
struct App {
    idem: Idem<Sqlite>,
}

enum PayError {
    Declined,
    Idem(idempotency::Error),
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl IntoResponse for PayError {
    fn into_response(self) -> Response {
        match self {
            PayError::Declined => axum::http::StatusCode::PAYMENT_REQUIRED.into_response(),
            PayError::Idem(e) => e.into_response(),
        }
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = app.idem, record_errors)]
#[axum::debug_handler]
async fn pay(
    State(app): State<App>,
    tx: &mut Transaction<'_, Sqlite>,
    Path(order_id): Path<i64>,
) -> Result<Paid, PayError> {
    let _ = tx;
    if order_id > 100 {
        return Err(PayError::Declined);
    }
    Ok(Paid { order_id })
}

fn main() {
    let _: Router<App> = Router::new().route("/orders/{order_id}/pay", post(pay));
}
