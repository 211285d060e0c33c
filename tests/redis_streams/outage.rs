//! Redis that cannot serve, and Redis down and back: waited out with a
//! back-off (never a busy loop), and consumption goes on once it answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::Outcome;
use idempotency::redis_streams::{Action, Consumer};
use redis::Value;

use crate::support::*;

/// Counts the runner's "Redis failed; waiting" warnings per stream: each
/// is one failed read (installed once, for the whole test binary).
fn failed_reads(stream: &str) -> usize {
    FAILED_READS.lock().unwrap().as_ref().and_then(|reads| reads.get(stream).copied()).unwrap_or(0)
}

static FAILED_READS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

struct FailedReads;

#[derive(Default)]
struct WarningFields {
    stream: Option<String>,
    message: String,
}

impl tracing::field::Visit for WarningFields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "stream" {
            self.stream = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "stream" => self.stream = Some(format!("{value:?}")),
            _ => {}
        }
    }
}

impl tracing::Subscriber for FailedReads {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.is_event() && *metadata.level() == tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = WarningFields::default();
        event.record(&mut fields);
        if let (Some(stream), true) = (fields.stream, fields.message.contains("Redis failed; waiting")) {
            *FAILED_READS.lock().unwrap().get_or_insert_with(HashMap::new).entry(stream).or_default() += 1;
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A fake Redis on loopback that answers every command with `-LOADING`
/// (as a Redis does while it loads its data set): the commands it got.
async fn loading_redis() -> (u16, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let commands = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&commands);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    // A command is an array: one `*` line each (the test's names hold none).
                    let got = buf[..n].split(|b| *b == b'\n').filter(|line| line.first() == Some(&b'*')).count();
                    counter.fetch_add(got, SeqCst);
                    let reply = "-LOADING Redis is loading the dataset in memory\r\n".repeat(got);
                    if socket.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, commands)
}

/// A Redis that answers but cannot serve (`LOADING`) is waited out with a
/// back-off, not hammered: a handful of commands in 3 s, not thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_cannot_serve_is_not_hammered() {
    let (port, commands) = loading_redis().await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let running = spawn_consumer(Consumer::new(client, "idem-test-rs-loading", GROUP), |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, |_: OrderPaid| async { Ok::<(), StockError>(()) }))
    });
    let window = Duration::from_secs(3);
    tokio::time::sleep(window).await;
    let sent = commands.load(SeqCst);
    let rest = running.stop().await;
    println!("commands to a loading Redis in {window:?}: {sent}");
    assert!(rest.is_empty(), "{rest:#?}");
    // 50 ms, doubling up to 2 s: about 6 tries in 3 s (and the connection's own set-up).
    assert!((2..=20).contains(&sent), "{sent} commands in {window:?}");
}

/// Redis killed under a running consumer: it waits (a few failed reads,
/// not a busy loop) and, once a Redis answers again on that port (empty:
/// the stream and the group are gone), creates the group again and goes on
/// consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_waited_out_without_a_busy_loop_then_consumption_resumes() {
    let Some(server) = idempotency_testkit::servers::RedisServer::start() else { return };
    let server = Arc::new(server);
    let Some(idem) = mysql_engine(None).await else { return };
    let sku = idempotency_testkit::unique("rs-sku");
    sqlx::query("INSERT INTO idem_rs_stock (sku, qty) VALUES (?, 100)").bind(&sku).execute(idem.pool()).await.unwrap();
    let _ = tracing::subscriber::set_global_default(FailedReads);
    let stream = idempotency_testkit::unique("idem-test-rs-down");
    let mut direct = server.client().get_multiplexed_async_connection().await.unwrap();

    let consumer = Consumer::new(server.client(), stream.clone(), GROUP)
        .consumer_name("c")
        .claim_interval(Duration::from_millis(100));
    let handler_idem = idem.clone();
    let mut running = spawn_consumer(consumer, move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let idem = handler_idem.clone();
            async move { deduct_stock(&idem, event).await }
        }))
    });
    add_to(&mut direct, &stream, &[("payload", &event(order_id(), &sku, 1))]).await;
    let before = running.next().await;
    assert_eq!((before.action, before.outcome), (Action::Ack, Some(Outcome::Executed)));

    let killer = Arc::clone(&server);
    tokio::task::spawn_blocking(move || killer.kill()).await.unwrap();
    let outage = Duration::from_secs(4);
    let at_kill = failed_reads(&stream);
    tokio::time::sleep(outage).await;
    let tries = failed_reads(&stream) - at_kill;
    let restarter = Arc::clone(&server);
    tokio::task::spawn_blocking(move || restarter.restart()).await.unwrap();
    let mut direct = server.client().get_multiplexed_async_connection().await.unwrap();
    let entry = add_to(&mut direct, &stream, &[("payload", &event(order_id(), &sku, 2))]).await;
    let resumed_at = Instant::now();
    let after = running.next().await;
    let resumed_in = resumed_at.elapsed();
    let rest = running.stop().await;

    println!("failed reads during a {outage:?} outage: {tries}; consuming again {resumed_in:?} after Redis came back");
    // Its reads fail and are tried again, held up by the back-off and by
    // the connection's own reconnecting: at most the back-off's 7 in 5 s.
    assert!(tries <= 8, "{tries} failed reads in {outage:?}");
    assert_eq!(
        (after.action, after.outcome, after.delivery.entry_id.as_str()),
        (Action::Ack, Some(Outcome::Executed), entry.as_str())
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(resumed_in < Duration::from_secs(30), "{resumed_in:?}");
    let pending: Vec<Value> = redis::cmd("XPENDING")
        .arg(&stream)
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(10)
        .query_async(&mut direct)
        .await
        .unwrap();
    assert!(pending.is_empty(), "{pending:?}");
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
        .bind(&sku)
        .fetch_one(idem.pool())
        .await
        .unwrap();
    assert_eq!(moves, 2);
}
