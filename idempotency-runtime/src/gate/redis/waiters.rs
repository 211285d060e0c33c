//! Duplicates waiting for a running call's answer (`wait`): told when it
//! ends, not polling. The call that ends (its result cached in place of its
//! claim, or its claim released) publishes on a channel named as its claim
//! key (the scripts, `scripts.rs`); a duplicate waiting here subscribes to
//! that channel and, once Redis confirmed the subscription, asks the claim
//! again: a result, the key free (the first call failed: it goes ahead as a
//! first call), or someone else's claim (it waits on).
//!
//! One pub/sub connection per engine, made on the first wait and shared by
//! every key waited on; one subscription per key, shared by its waiters
//! here, dropped with the last. One task owns the connection and sends its
//! orders in the order they were given, so an unsubscribe never lands after
//! a newer subscribe of the same channel; every waiter of a channel, not
//! only the first, waits for its confirmation before it asks again, so a
//! publish cannot slip between its question and its wait.
//!
//! A dead connection (a NAT or a load balancer that dropped it, a host
//! gone: it goes silent rather than closed) is noticed: connecting, each
//! confirmation, and a ping every [`PING_EVERY`] while waiters listen must
//! be answered within the engine's `redis_timeout`. Then its waiters ask the
//! claim at doubling intervals until their bound, as on a Redis Cluster,
//! and for [`BACKOFF`] new waiters do too; the next one connects anew.
//! Whatever happens to the connection, a waiter waits at most until its
//! deadline. A Redis Cluster has no one connection every publish reaches
//! (sharded channels live on their slot's node): there every waiter asks
//! the claim at intervals.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::connection::BACKOFF;

/// How often a pub/sub connection with subscriptions is asked to answer a
/// ping (within the engine's `redis_timeout`).
const PING_EVERY: Duration = Duration::from_secs(1);

/// The waits of one engine on one Redis node.
pub(crate) struct Waiters {
    client: redis::Client,
    /// How long connecting, a confirmation or a ping may take.
    timeout: Duration,
    shared: Arc<Mutex<Shared>>,
}

#[derive(Default)]
struct Shared {
    /// The connection new subscriptions go to (being made, or up); `None`
    /// before the first wait and after a connection was lost.
    connection: Option<Connection>,
    /// Connections made so far (the last one's number).
    made: u64,
    /// Orders given so far (the last one's number).
    ordered: u64,
    /// After a lost connection, new waiters ask at intervals until then.
    down_until: Option<Instant>,
    channels: HashMap<String, Channel>,
}

/// A pub/sub connection, by its number, and the queue of its task.
struct Connection {
    number: u64,
    orders: mpsc::UnboundedSender<Order>,
}

enum Order {
    Subscribe(String, Ticket),
    Unsubscribe(String),
}

/// One subscribe order: on which connection, and which order it was (a
/// confirmation counts only for the order that is the channel's last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticket {
    connection: u64,
    order: u64,
}

struct Channel {
    waiters: usize,
    news: watch::Sender<News>,
}

/// What a channel's waiters watch: how many ends were published on it, and
/// where its subscription stands.
#[derive(Debug, Clone, Copy)]
struct News {
    told: u64,
    subscription: Standing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Not subscribed: never asked, refused, or its connection was lost.
    None,
    /// Asked, not confirmed yet.
    Asked(Ticket),
    Confirmed(Ticket),
}

impl Standing {
    fn ticket(self) -> Option<Ticket> {
        match self {
            Standing::None => None,
            Standing::Asked(ticket) | Standing::Confirmed(ticket) => Some(ticket),
        }
    }
}

/// How a wait on a confirmed subscription ended.
pub(crate) enum Heard {
    /// A publish: the call ended (ask the claim again).
    Ended,
    /// The connection was lost: ask at intervals from here.
    Lost,
    Deadline,
}

/// A waiter's subscription. Dropped, it unsubscribes with the channel's
/// last waiter.
pub(crate) struct Subscription<'w> {
    waiters: &'w Waiters,
    channel: String,
    news: watch::Receiver<News>,
    /// The connection it was confirmed on, and the publishes counted then.
    listening: Option<(u64, u64)>,
}

impl Waiters {
    pub(crate) fn new(client: redis::Client, timeout: Duration) -> Self {
        Waiters { client, timeout, shared: Arc::default() }
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Joins the waiters of `channel` (the running call's claim key),
    /// asking Redis to subscribe unless it is (or is being) already on the
    /// current connection. Wait for the confirmation with
    /// [`Subscription::confirmed`].
    pub(crate) fn subscribe(&self, channel: &str) -> Subscription<'_> {
        let mut guard = self.shared();
        let shared = &mut *guard;
        let connection = shared.connection(self).map(|c| (c.number, c.orders.clone()));
        let entry = shared.channels.entry(channel.to_owned()).or_insert_with(|| Channel {
            waiters: 0,
            news: watch::Sender::new(News { told: 0, subscription: Standing::None }),
        });
        entry.waiters += 1;
        let news = entry.news.subscribe();
        if let Some((number, orders)) = connection {
            let current = entry.news.borrow().subscription.ticket().is_some_and(|t| t.connection == number);
            if !current {
                shared.ordered += 1;
                let ticket = Ticket { connection: number, order: shared.ordered };
                if orders.send(Order::Subscribe(channel.to_owned(), ticket)).is_ok() {
                    entry.news.send_modify(|news| news.subscription = Standing::Asked(ticket));
                }
            }
        }
        Subscription { waiters: self, channel: channel.to_owned(), news, listening: None }
    }
}

impl Shared {
    /// The connection to subscribe on: the current one, or a new one (its
    /// task connects in the background) unless one was lost just now.
    fn connection(&mut self, waiters: &Waiters) -> Option<&Connection> {
        if self.connection.as_ref().is_some_and(|c| c.orders.is_closed()) {
            self.connection = None;
        }
        if self.connection.is_none() {
            if self.down_until.is_some_and(|until| Instant::now() < until) {
                return None;
            }
            self.made += 1;
            let (orders, queue) = mpsc::unbounded_channel();
            let task = Driver {
                client: waiters.client.clone(),
                timeout: waiters.timeout,
                shared: Arc::downgrade(&waiters.shared),
                number: self.made,
            };
            tokio::spawn(task.run(queue));
            self.connection = Some(Connection { number: self.made, orders });
        }
        self.connection.as_ref()
    }

    /// Connection `number` is gone: its channels are no longer subscribed
    /// (their waiters ask at intervals), and new waiters ask at intervals
    /// for a [`BACKOFF`].
    fn lose(&mut self, number: u64) {
        if self.connection.as_ref().is_some_and(|c| c.number == number) {
            self.connection = None;
            self.down_until = Some(Instant::now() + BACKOFF);
        }
        for channel in self.channels.values() {
            channel.news.send_if_modified(|news| {
                let on_it = news.subscription.ticket().is_some_and(|t| t.connection == number);
                if on_it {
                    news.subscription = Standing::None;
                }
                on_it
            });
        }
    }
}

impl Subscription<'_> {
    /// Waits (until `deadline` at most) for Redis to confirm the channel's
    /// subscription: `false` when it will not come (no connection, or it
    /// was lost) or the deadline passed. Then, and only then, the waiter
    /// listens: an end published after this is heard.
    pub(crate) async fn confirmed(&mut self, deadline: Instant) -> bool {
        let settled = self.news.wait_for(|news| !matches!(news.subscription, Standing::Asked(_)));
        let news = match tokio::time::timeout_at(deadline, settled).await {
            Ok(Ok(news)) => *news,
            _ => return false,
        };
        match news.subscription {
            Standing::Confirmed(ticket) => {
                self.listening = Some((ticket.connection, news.told));
                true
            }
            _ => false,
        }
    }

    /// Waits (until `deadline` at most) for an end published after the
    /// confirmation, or after the last one heard.
    pub(crate) async fn heard(&mut self, deadline: Instant) -> Heard {
        let Some((connection, mut seen)) = self.listening else { return Heard::Lost };
        loop {
            let news = *self.news.borrow_and_update();
            if news.told != seen {
                seen = news.told;
                self.listening = Some((connection, seen));
                return Heard::Ended;
            }
            if !matches!(news.subscription, Standing::Confirmed(t) if t.connection == connection) {
                self.listening = None;
                return Heard::Lost;
            }
            match tokio::time::timeout_at(deadline, self.news.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_closed)) => return Heard::Lost,
                Err(_elapsed) => return Heard::Deadline,
            }
        }
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut shared = self.waiters.shared();
        let Some(channel) = shared.channels.get_mut(&self.channel) else { return };
        channel.waiters -= 1;
        if channel.waiters > 0 {
            return;
        }
        let standing = channel.news.borrow().subscription;
        shared.channels.remove(&self.channel);
        // Queued behind the channel's subscribe: it lands after it, and
        // before any later subscribe of the same channel.
        if let (Some(connection), Some(ticket)) = (&shared.connection, standing.ticket())
            && ticket.connection == connection.number
        {
            let _ = connection.orders.send(Order::Unsubscribe(std::mem::take(&mut self.channel)));
        }
    }
}

/// The task that owns one pub/sub connection: connects, sends its orders
/// one by one, hands publishes to their channels, pings it while anyone
/// listens, and gives it up at the first question left unanswered.
struct Driver {
    client: redis::Client,
    timeout: Duration,
    shared: Weak<Mutex<Shared>>,
    number: u64,
}

/// What the driver does next.
enum Event {
    Order(Option<Order>),
    Published(Option<redis::Msg>),
    Ping,
}

impl Driver {
    async fn run(self, mut queue: mpsc::UnboundedReceiver<Order>) {
        let connected = tokio::time::timeout(self.timeout, self.client.get_async_pubsub()).await;
        let Ok(Ok(pubsub)) = connected else {
            return self.lost("could not connect in time");
        };
        let (mut sink, mut stream) = pubsub.split();
        let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = std::future::poll_fn(|cx| {
                use futures_core::Stream;
                if let Poll::Ready(order) = queue.poll_recv(cx) {
                    return Poll::Ready(Event::Order(order));
                }
                if let Poll::Ready(message) = Pin::new(&mut stream).poll_next(cx) {
                    return Poll::Ready(Event::Published(message));
                }
                ping.poll_tick(cx).map(|_| Event::Ping)
            })
            .await;
            let answered = match event {
                // The engine is gone.
                Event::Order(None) => return,
                Event::Order(Some(Order::Subscribe(channel, ticket))) => {
                    let answered = self.within(sink.subscribe(&channel)).await;
                    if answered {
                        self.confirm(&channel, ticket);
                    }
                    answered
                }
                Event::Order(Some(Order::Unsubscribe(channel))) => self.within(sink.unsubscribe(&channel)).await,
                Event::Published(Some(message)) => {
                    self.tell(message.get_channel_name());
                    true
                }
                Event::Published(None) => false,
                Event::Ping => !self.listened() || self.within(sink.ping::<redis::Value>()).await,
            };
            if !answered {
                return self.lost("a question went unanswered");
            }
        }
    }

    /// Whether `question` was answered within the timeout.
    async fn within<T>(&self, question: impl Future<Output = redis::RedisResult<T>>) -> bool {
        matches!(tokio::time::timeout(self.timeout, question).await, Ok(Ok(_)))
    }

    fn with_shared(&self, f: impl FnOnce(&mut Shared)) {
        if let Some(shared) = self.shared.upgrade() {
            f(&mut shared.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }

    /// Whether anyone listens (or waits to) on this connection.
    fn listened(&self) -> bool {
        let mut any = false;
        self.with_shared(|shared| any = !shared.channels.is_empty());
        any
    }

    fn confirm(&self, channel: &str, ticket: Ticket) {
        self.with_shared(|shared| {
            if let Some(channel) = shared.channels.get(channel) {
                channel.news.send_if_modified(|news| {
                    let ours = news.subscription == Standing::Asked(ticket);
                    if ours {
                        news.subscription = Standing::Confirmed(ticket);
                    }
                    ours
                });
            }
        });
    }

    fn tell(&self, channel: &str) {
        self.with_shared(|shared| {
            if let Some(channel) = shared.channels.get(channel) {
                channel.news.send_modify(|news| news.told = news.told.wrapping_add(1));
            }
        });
    }

    fn lost(&self, why: &str) {
        tracing::debug!(connection = self.number, why, "redis pub/sub connection given up; waiters ask at intervals");
        self.with_shared(|shared| shared.lose(self.number));
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{black_hole, test_client};
    use super::*;

    async fn ask<T: redis::FromRedisValue>(client: &redis::Client, cmd: &redis::Cmd) -> T {
        let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
        cmd.query_async(&mut conn).await.expect("redis")
    }

    /// Subscribers Redis counts on `channel`.
    async fn subscribers(client: &redis::Client, channel: &str) -> i64 {
        let counts: Vec<(String, i64)> = ask(client, redis::cmd("PUBSUB").arg("NUMSUB").arg(channel)).await;
        counts.first().map_or(0, |(_, n)| *n)
    }

    /// Every waiter of a channel, a later one as the first, is confirmed
    /// before it listens and hears an end published after that. The last
    /// waiter's unsubscribe and a newer subscribe of the same channel land
    /// in the order they were given, round after round: Redis counts the
    /// newer subscriber, and it hears the next end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_waiter_is_confirmed_and_an_unsubscribe_never_lands_after_a_newer_subscribe() {
        let Some(client) = test_client().await else { return };
        let waiters = Waiters::new(client.clone(), Duration::from_secs(5));
        let channel = format!("idem:t_waiters:{}", crate::random::token());
        let deadline = Instant::now() + Duration::from_secs(30);
        let publish = redis::cmd("PUBLISH").arg(&channel).arg("1").clone();

        let mut first = waiters.subscribe(&channel);
        // Joins while the first's subscribe is on its way.
        let mut later = waiters.subscribe(&channel);
        assert!(later.confirmed(deadline).await, "the later waiter waits for the confirmation");
        assert!(first.confirmed(deadline).await);
        assert_eq!(subscribers(&client, &channel).await, 1, "one subscription, shared");
        let _: i64 = ask(&client, &publish).await;
        assert!(matches!(first.heard(deadline).await, Heard::Ended));
        assert!(matches!(later.heard(deadline).await, Heard::Ended));
        drop((first, later));

        for round in 0..50 {
            let mut newer = waiters.subscribe(&channel);
            assert!(newer.confirmed(deadline).await, "round {round}");
            assert_eq!(subscribers(&client, &channel).await, 1, "round {round}: subscribed after the unsubscribe");
            let _: i64 = ask(&client, &publish).await;
            assert!(matches!(newer.heard(deadline).await, Heard::Ended), "round {round}");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while subscribers(&client, &channel).await != 0 {
            assert!(Instant::now() < deadline, "the last waiter's unsubscribe never landed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Nothing answers: connecting times out within the Redis timeout, the
    /// waiter is told at once (it asks at intervals), and the next waiters
    /// for a back-off do not try again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_that_is_never_answered_is_given_up_within_the_timeout() {
        let (client, hole) = black_hole().await;
        let waiters = Waiters::new(client, Duration::from_millis(200));
        let started = Instant::now();
        let mut waiter = waiters.subscribe("idem:t_hole");
        assert!(!waiter.confirmed(started + Duration::from_secs(60)).await);
        assert!(started.elapsed() < Duration::from_secs(30), "given up after {:?}", started.elapsed());
        assert!(matches!(waiter.heard(started + Duration::from_secs(60)).await, Heard::Lost));
        let made = waiters.shared().made;
        let mut next = waiters.subscribe("idem:t_hole");
        assert!(!next.confirmed(Instant::now() + Duration::from_secs(60)).await, "told at once");
        assert_eq!(waiters.shared().made, made, "no new connection during the back-off");
        hole.abort();
    }
}
