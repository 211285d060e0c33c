use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "a_<id>", ttl = "1h30m", biz = "a")]
async fn a(idem: &Idem<Sqlite>, id: u64) -> Result<u64, idempotency::Error> {
    Ok(id)
}

#[idempotent(key = "b_<id>", ttl = "1d2h3m4s5ms", biz = "b", lease = "500ms")]
async fn b(idem: &Idem<Sqlite>, id: u64) -> Result<u64, idempotency::Error> {
    Ok(id)
}

#[idempotent(key = "c_<id>", ttl = "7d", biz = "c", lease = "2m")]
async fn c(idem: &Idem<Sqlite>, id: u64) -> Result<u64, idempotency::Error> {
    Ok(id)
}

fn main() {
    let _ = (a, b, c);
}
