// `#[axum::debug_handler]` below `#[idempotent]`, as docs/http.md shows:
// the attribute expands first, so axum's check sees the handler (no `tx`)
// and accepts it; the router takes it as a `Handler`.
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct App {
    idem: Idem<Sqlite>,
}

#[derive(Serialize, Deserialize)]
struct Paid {
    order_id: i64,
}

impl IntoResponse for Paid {
    fn into_response(self) -> Response {
        Json(self).into_response()
    }
}

struct ApiError(idempotency::Error);

impl From<idempotency::Error> for ApiError {
    fn from(e: idempotency::Error) -> Self {
        ApiError(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, self.0.to_string()).into_response()
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = app.idem)]
#[axum::debug_handler]
async fn pay(
    State(app): State<App>,
    tx: &mut Transaction<'_, Sqlite>,
    Path(order_id): Path<i64>,
) -> Result<Paid, ApiError> {
    let _ = tx;
    Ok(Paid { order_id })
}

fn main() {
    let _: Router<App> = Router::new().route("/orders/{order_id}/pay", post(pay));
}
