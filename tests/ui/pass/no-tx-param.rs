use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "notify_<user_id>", ttl = "1h", biz = "notify")]
async fn notify(idem: &Idem<Sqlite>, user_id: u64) -> Result<u64, idempotency::Error> {
    Ok(user_id)
}

fn main() {
    let _ = notify;
}
