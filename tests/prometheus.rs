//! End to end with a real Prometheus (Debian's `prometheus`): a Prometheus
//! of the test's own (its port, its data folder, a scrape and an evaluation
//! every second) scrapes `examples/http.rs` as users build it, with the
//! feature `metrics` (SQLite in memory, a private Redis behind a proxy the
//! test can cut), with a copy of
//! `ops/prometheus/idem-rules.yml` whose every `for:` is `1s`. Known calls
//! (three first calls, two replays, one key reused with another amount),
//! then the counts read back through Prometheus's HTTP API with the
//! dashboard's own queries (`ops/grafana/idem.json`), every one of which
//! Prometheus evaluates; then Redis cut, and `IdemRedisDegraded`, not
//! firing before, fires. Without `prometheus` the test skips, or fails
//! under `IDEM_REQUIRE_SERVICES=1`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_testkit::example::Example;
use idempotency_testkit::forwarder::Forwarder;
use idempotency_testkit::servers::RedisServer;
use serde_json::Value;

/// How long any one awaited event may take: generous, for a loaded machine.
const BOUND: Duration = Duration::from_secs(90);

/// A child process killed (SIGKILL) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `examples/http.rs` as users build it (with this test's features,
/// `metrics` among them), its Redis at `redis_port`: the example, and its
/// address.
async fn start_example(redis_port: u16) -> (Example, String) {
    let redis = format!("redis://127.0.0.1:{redis_port}");
    let env = [("IDEM_HTTP_ADDR", "127.0.0.1:0"), ("IDEM_REDIS_URL", redis.as_str())];
    let features = idempotency_testkit::facade_features!();
    let sources = ["examples/http.rs", "examples/shop"];
    let (example, listening) = Example::start("http", &sources, &features, &env, "listening on http://").await;
    let addr = listening.split_whitespace().next().expect("an address").to_owned();
    (example, addr)
}

/// The alert rules with every `for:` shortened to a second.
fn rules_for_the_test() -> String {
    let rules =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ops/prometheus/idem-rules.yml"))
            .expect("the rules");
    let mut shortened = 0;
    let lines: Vec<String> = rules
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => {
                shortened += 1;
                format!("{}for: 1s", &line[..line.len() - line.trim_start().len()])
            }
            None => line.to_owned(),
        })
        .collect();
    assert!(shortened >= 5, "the rules' `for:` lines: {shortened}");
    lines.join("\n") + "\n"
}

/// A private Prometheus: its folder, its port, its process.
struct Prometheus {
    dir: PathBuf,
    base: String,
    _child: Killed,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Starts one scraping `target` as job `shop`, with `rules`; waits
    /// until it is ready. `None` (after saying why) without `prometheus`.
    async fn start(target: &str, rules: &str) -> Option<Prometheus> {
        if !Command::new("prometheus").arg("--version").output().is_ok_and(|o| o.status.success()) {
            assert!(
                !idempotency_testkit::services_required(),
                "prometheus not installed (Debian's prometheus) and IDEM_REQUIRE_SERVICES=1"
            );
            println!("skipped: prometheus not installed");
            return None;
        }
        let dir = std::env::temp_dir().join(idempotency_testkit::unique("idem-prometheus"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rules.yml"), rules).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\n\
             scrape_configs:\n  - job_name: shop\n    static_configs:\n      - targets: ['{target}']\n"
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        // A port found free may be taken before Prometheus binds it: then
        // it exits, and another is tried.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("prometheus");
            let mut child = Killed(child);
            let base = format!("http://127.0.0.1:{port}");
            let client = reqwest::Client::new();
            let started = Instant::now();
            loop {
                if let Ok(Some(_)) = child.0.try_wait() {
                    break;
                }
                let ready = client.get(format!("{base}/-/ready")).send().await;
                if ready.is_ok_and(|r| r.status().is_success()) {
                    return Some(Prometheus { dir, base, _child: child });
                }
                assert!(started.elapsed() < BOUND, "prometheus not ready");
                tokio::task::yield_now().await;
            }
        }
        panic!("prometheus found no free port in 5 tries");
    }

    /// `GET /api/v1/<path>`, its `data`; a query Prometheus refuses fails.
    async fn api(&self, path: &str) -> Value {
        let body = reqwest::get(format!("{}/api/v1/{path}", self.base)).await.unwrap().text().await.unwrap();
        let answer: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(answer["status"], "success", "{path}: {body}");
        answer["data"].clone()
    }

    /// An instant query's vector, each series by the values of `labels`.
    async fn vector(&self, query: &str, labels: &[&str]) -> BTreeMap<String, f64> {
        let data = self.api(&format!("query?query={}", encode(query))).await;
        let mut out = BTreeMap::new();
        for series in data["result"].as_array().into_iter().flatten() {
            let key = labels.iter().map(|l| series["metric"][*l].as_str().unwrap_or("")).collect::<Vec<_>>().join(" ");
            out.insert(key, series["value"][1].as_str().unwrap().parse().unwrap());
        }
        out
    }

    /// The alerts in state `state` now, by name.
    async fn alerts(&self, state: &str) -> Vec<Value> {
        let data = self.api("alerts").await;
        data["alerts"].as_array().unwrap().iter().filter(|a| a["state"] == state).cloned().collect()
    }
}

/// `text` percent-encoded for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The dashboard's queries by panel title, as Grafana sends them with
/// every `$job` and `$biz` (All).
fn dashboard() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ops/grafana/idem.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let sent = expr
                .replace("$__rate_interval", "1m")
                .replace("$__range", "5m")
                .replace("$job", ".*")
                .replace("$biz", ".*");
            queries.push((panel["title"].as_str().unwrap().to_owned(), sent));
        }
    }
    queries
}

/// Pays `order` with `key`; the status and whether it was a replay.
async fn pay(client: &reqwest::Client, base: &str, order: i64, key: &str, amount: i64) -> (u16, bool) {
    let answer = client
        .post(format!("http://{base}/orders/{order}/pay"))
        .header("X-User-Id", "alice")
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(format!("{{\"amount\":{amount}}}"))
        .send()
        .await
        .expect("the example answers");
    let replayed = answer.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    (answer.status().as_u16(), replayed)
}

/// Waits until `check` holds, for at most [`BOUND`]: `what` names it.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < BOUND, "{what}: not within {BOUND:?}");
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_sees_the_calls_and_the_cut() {
    let Some(redis) = tokio::task::spawn_blocking(RedisServer::start).await.unwrap() else { return };
    let proxy = Forwarder::start(redis.port()).await;
    let (_example, base) = start_example(proxy.port()).await;
    let Some(prometheus) = Prometheus::start(&base, &rules_for_the_test()).await else { return };
    let client = reqwest::Client::new();

    // Three first calls; once each has its result cached in Redis (its
    // claim gone), two replays; then a key reused with another amount.
    for order in 1..=3 {
        assert_eq!(pay(&client, &base, order, &format!("prom-key-{order}"), 100).await, (200, false));
    }
    let conn = redis.client().get_multiplexed_async_connection().await.unwrap();
    until("the three claims replaced by their results", || {
        let mut conn = conn.clone();
        async move {
            let claims: Vec<String> = redis::cmd("KEYS").arg("idem:*:http_pay:*").query_async(&mut conn).await.unwrap();
            claims.is_empty()
        }
    })
    .await;
    for order in 1..=2 {
        assert_eq!(pay(&client, &base, order, &format!("prom-key-{order}"), 100).await, (200, true));
    }
    assert_eq!(pay(&client, &base, 1, "prom-key-1", 5).await, (422, false));

    // What the dashboard's table shows, once scraped: exact counts.
    let calls = dashboard()
        .into_iter()
        .find(|(title, _)| title == "Calls since the instances started")
        .expect("the dashboard's table of calls")
        .1;
    let expected = BTreeMap::from([
        ("http_pay executed".to_owned(), 3.0),
        ("http_pay key_reused".to_owned(), 1.0),
        ("http_pay replayed".to_owned(), 2.0),
    ]);
    let (p, calls_query, want) = (&prometheus, calls.as_str(), &expected);
    until(
        "Prometheus scraped the six calls",
        || async move { p.vector(calls_query, &["biz", "outcome"]).await == *want },
    )
    .await;
    assert_eq!(prometheus.vector(&calls, &["biz", "outcome"]).await, expected);
    let sources = prometheus.vector("sum by (source) (idem_replays_total)", &["source"]).await;
    assert_eq!(sources, BTreeMap::from([("redis".to_owned(), 2.0)]));
    // Every query of the dashboard evaluates in Prometheus.
    for (title, query) in dashboard() {
        prometheus.api(&format!("query?query={}", encode(&query))).await;
        println!("evaluated: {title}");
    }
    let rules = prometheus.api("rules").await;
    let loaded: usize = rules["groups"].as_array().unwrap().iter().map(|g| g["rules"].as_array().unwrap().len()).sum();
    assert_eq!(loaded, 7, "every alert rule loaded");
    assert!(prometheus.alerts("firing").await.is_empty(), "nothing fires before the cut");

    // Redis cut: the next call runs on the database alone, the engine is
    // degraded, and the alert fires.
    proxy.cut();
    assert_eq!(pay(&client, &base, 4, "prom-key-4", 100).await, (200, false));
    until("IdemRedisDegraded firing", || async move {
        p.alerts("firing").await.iter().any(|a| a["labels"]["alertname"] == "IdemRedisDegraded")
    })
    .await;
    let firing = prometheus.alerts("firing").await;
    assert_eq!(firing.len(), 1, "{firing:?}");
    let labels = &firing[0]["labels"];
    assert_eq!(
        (&labels["job"], &labels["instance"], &labels["severity"]),
        (&"shop".into(), &base.as_str().into(), &"warning".into())
    );
    assert_eq!(prometheus.vector("idem_redis_degraded", &["job"]).await, BTreeMap::from([("shop".to_owned(), 1.0)]));
    until("the call made during the cut counted", || async move {
        p.vector(calls_query, &["outcome"]).await.get("executed") == Some(&4.0)
    })
    .await;
}
