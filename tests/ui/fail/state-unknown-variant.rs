// A transition naming a state the enum does not have.
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Shipped))]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {}
