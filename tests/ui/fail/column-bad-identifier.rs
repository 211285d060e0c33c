// A column name outside [A-Za-z_][A-Za-z0-9_]* does not compile.
fn main() {
    let _ = idempotency::col!(paid_été);
}
