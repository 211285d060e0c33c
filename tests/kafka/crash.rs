//! A consumer process SIGKILLed mid-handling (the test binary runs
//! `kafka_child_consumer` as the child).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use idempotency::Idem;
use idempotency::kafka::Consumer;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

use crate::support::*;

/// The child process of the crash test: a consumer of the broker and
/// database named in its environment; it prints what it does, and with
/// `IDEM_KAFKA_CHILD_HANG` it hangs after its call returned (never acks).
#[test]
#[ignore = "the crash test's consumer process: run by that test, as a child"]
fn kafka_child_consumer() {
    let Ok(bootstrap) = std::env::var("IDEM_KAFKA_CHILD_BOOTSTRAP") else { return };
    let db = std::env::var("IDEM_KAFKA_CHILD_DB").unwrap();
    let hang = std::env::var("IDEM_KAFKA_CHILD_HANG").is_ok();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let options: MySqlConnectOptions = idempotency_testkit::mysql_url().parse().unwrap();
        let pool = MySqlPoolOptions::new().max_connections(4).connect_with(options.database(&db)).await.unwrap();
        let idem = Idem::new(pool);
        let handler = move |e: OrderPaid| {
            let idem = idem.clone();
            async move {
                let result = deduct_stock(&idem, e).await;
                println!("called");
                if hang {
                    println!("hanging");
                    std::future::pending::<()>().await;
                }
                result
            }
        };
        let mut config = client_config(&bootstrap);
        // A killed member leaves the group once its session times out.
        config.set("session.timeout.ms", "6000");
        Consumer::new(config, "orders", "stock")
            .on_settle(|s| println!("settled {:?} {:?} {}", s.action, s.outcome, s.delivery.offset))
            .run(std::future::pending::<()>(), handler)
            .await
            .unwrap();
    });
}

/// A consumer process spawned from this test binary, its stdout lines sent
/// to a channel.
fn spawn_child(w: &World, hang: bool) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["crash::kafka_child_consumer", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("IDEM_KAFKA_CHILD_BOOTSTRAP", w.broker.bootstrap())
        .env("IDEM_KAFKA_CHILD_DB", &w.db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if hang {
        command.env("IDEM_KAFKA_CHILD_HANG", "1");
    }
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn await_line(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    let start = Instant::now();
    loop {
        let left = BOUND.saturating_sub(start.elapsed());
        let line = lines.recv_timeout(left).unwrap_or_else(|_| panic!("no line starting {prefix:?} in time"));
        if line.starts_with(prefix) {
            return line;
        }
    }
}

/// A consumer process SIGKILLed after its call committed and before its
/// message settled: restarted, it gets the message again from the
/// committed offset, and the call replays: one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_handling_gets_the_message_again_and_it_executes_once() {
    let Some(w) = world(1, false).await else { return };
    w.produce_event(0, &event(7, "sku-1", 5)).await;
    let (mut first, lines) = spawn_child(&w, true);
    await_line(&lines, "hanging");
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert_eq!(w.moves().await, BTreeMap::from([(7, 1)]), "the call committed before the kill");
    assert_eq!(w.committed("orders", 1), [None], "nothing was settled, nothing committed");

    let (mut second, lines) = spawn_child(&w, false);
    let settled = await_line(&lines, "settled");
    assert_eq!(settled, "settled Ack Some(Replayed) 0");
    w.await_committed("orders", &[Some(1)]);
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(w.moves().await, BTreeMap::from([(7, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 1);
    let stock: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'sku-1'").fetch_one(w.idem.pool()).await.unwrap();
    assert_eq!(stock, 995);
    w.remove().await;
}
