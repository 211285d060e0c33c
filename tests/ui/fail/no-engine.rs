use idempotency::idempotent;

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {}
