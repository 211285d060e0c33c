// A state column declared with its transitions; declared transitions and
// checked column names are constants.
use idempotency::state::{State, Stored, Transition};
use idempotency::{col, transition};

#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
enum OrderStatus {
    Pending,
    #[state(rename = "PAID_IN_FULL")]
    Paid,
    Refunded,
    PartlyClosed,
    Closed,
}

#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "tickets", id = "ticket_id", column = "state", storage = "int")]
#[state(transitions(Open -> Done))]
enum Ticket {
    Open = 0,
    Done = -3,
}

const PAY: Transition<OrderStatus> = transition!(OrderStatus: Pending -> Paid);

fn main() {
    assert_eq!(PAY.to(), OrderStatus::Paid);
    assert_eq!(OrderStatus::Paid.stored(), Stored::Text("PAID_IN_FULL"));
    assert_eq!(OrderStatus::PartlyClosed.stored(), Stored::Text("PARTLY_CLOSED"));
    assert_eq!(OrderStatus::from_text("REFUNDED"), Some(OrderStatus::Refunded));
    assert_eq!(OrderStatus::from_text("PAID"), None);
    assert_eq!(Ticket::from_int(-3), Some(Ticket::Done));
    assert_eq!(<OrderStatus as State>::TABLE.as_str(), "orders");
    assert_eq!(col!(paid_at).as_str(), "paid_at");
    let _ = transition!(Ticket: Open -> Done);
}
