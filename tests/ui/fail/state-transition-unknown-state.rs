// `transition!` with a state the type does not have.
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid))]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {
    let _ = idempotency::transition!(OrderStatus: Pending -> Shipped);
}
