// A table name that is not a SQL identifier never reaches SQL.
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders; DROP TABLE orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid))]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {}
