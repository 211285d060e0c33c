// An axum handler whose attribute has a malformed argument: the error says
// what was expected, and nothing else is reported (the fn is still emitted beside
// it as axum sees the handler: without the transaction the engine supplies).
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

#[idempotent(key = "order_<order_id>_pay", biz = "pay", engine = app.idem, ttl = 24h)]
#[axum::debug_handler]
async fn pay(
    State(app): State<App>,
    tx: &mut Transaction<'_, Sqlite>,
    Path(order_id): Path<i64>,
) -> Result<Paid, idempotency::Error> {
    let _ = tx;
    Ok(Paid { order_id })
}

fn main() {
    let _: Router<App> = Router::new().route("/orders/{order_id}/pay", post(pay));
}
