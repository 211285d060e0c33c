//! What a call's fingerprint costs (its arguments written as canonical
//! JSON, then SHA-256) beside its floor, serde_json writing the same
//! arguments once (`serde_json::to_vec`, no sorting, no hash): for the
//! arguments of `examples/http.rs`'s payment, and for a larger order (20
//! lines, a map of tags). Figures per call, medians of 5 rounds, side by
//! side in one run.
//!
//! `cargo bench --bench fingerprint`

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use idempotency::__private::Fingerprint;
use serde::Serialize;

#[derive(Serialize)]
struct PayReq {
    amount: i64,
}

#[derive(Serialize)]
struct Line {
    sku: String,
    qty: u32,
    price: f64,
    note: Option<String>,
}

#[derive(Serialize)]
struct Order {
    lines: Vec<Line>,
    customer: String,
    currency: String,
    tags: HashMap<String, String>,
}

/// Nanoseconds per run of `f`: the median of 5 rounds of `n` runs.
fn per_call<T>(n: u32, f: impl Fn() -> T) -> f64 {
    let mut rounds: Vec<f64> = (0..5)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..n {
                black_box(f());
            }
            started.elapsed().as_nanos() as f64 / f64::from(n)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[2]
}

fn main() {
    let (user, key, order_id, req) =
        ("alice".to_owned(), "bench-replay-1764971234567890".to_owned(), 42i64, PayReq { amount: 1999 });
    let order = Order {
        lines: (0..20)
            .map(|i| Line {
                sku: format!("SKU-{i}"),
                qty: i,
                price: 1.5 * f64::from(i),
                note: Some("gift wrap".into()),
            })
            .collect(),
        customer: "alice".into(),
        currency: "EUR".into(),
        tags: (0..5).map(|i| (format!("t{i}"), format!("v{i}"))).collect(),
    };

    let small = per_call(200_000, || {
        let fingerprint = Fingerprint::new().arg("user", &user).arg("idem_key", &key).arg("order_id", &order_id);
        fingerprint.arg("req", &req).finish()
    });
    let small_floor = per_call(200_000, || serde_json::to_vec(&(&user, &key, order_id, &req)));
    let large = per_call(20_000, || Fingerprint::new().arg("order", &order).arg("order_id", &order_id).finish());
    let large_floor = per_call(20_000, || serde_json::to_vec(&(&order, order_id)));

    println!("{:<34} {:>14} {:>16} {:>7}", "arguments", "fingerprint ns", "serde_json ns", "ratio");
    println!(
        "{:<34} {small:>14.0} {small_floor:>16.0} {:>7.2}",
        "the HTTP payment's (4, ~60 bytes)",
        small / small_floor
    );
    println!("{:<34} {large:>14.0} {large_floor:>16.0} {:>7.2}", "an order of 20 lines (~1.5 KB)", large / large_floor);
}
