// `transition!` with a state the type does not have.
#[derive(Clone, Copy, Debug, PartialEq, idem::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid))]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {
    let _ = idem::transition!(OrderStatus: Pending -> Shipped);
}
