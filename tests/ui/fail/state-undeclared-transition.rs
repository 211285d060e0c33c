// A transition the type does not declare does not compile where it is written.
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Refunded))]
enum OrderStatus {
    Pending,
    Paid,
    Refunded,
}

fn main() {
    let _ = idempotency::transition!(OrderStatus: Pending -> Refunded);
}
