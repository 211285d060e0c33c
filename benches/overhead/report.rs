//! What a run prints and writes: the table, one line per performance
//! target, `target/idem-bench.json`, and the chart (`docs/bench.svg`).

use std::time::Instant;

use super::support::quick;
use super::{CONCURRENCY, Row};

/// The p50 of the row `mode` of one backend, claims and task count.
fn p50(rows: &[Row], backend: &str, redis: &str, tasks: usize, mode: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.backend == backend && r.redis == redis && r.tasks == tasks && r.mode == mode)
        .map(|r| r.p50_ms)
}

/// The row `mode`'s p50 over `bare`'s (same backend, claims and task count).
fn ratio(rows: &[Row], backend: &str, redis: &str, tasks: usize, mode: &str) -> Option<f64> {
    Some(p50(rows, backend, redis, tasks, mode)? / p50(rows, backend, redis, tasks, "bare")?)
}

/// The backends in the order they are shown: the servers at hand, then at
/// a distance (every round trip 1 ms longer).
const BACKENDS: [&str; 6] = ["mariadb", "postgres", "sqlite", "galera", "mariadb+1ms", "postgres+1ms"];

/// One target: the ratio of two rows' p50 (same backend, claims and task
/// count) at most a bound per task count, or (`above`) over it.
struct Target {
    what: &'static str,
    redis: &'static str,
    mode: &'static str,
    over: &'static str,
    bounds: [f64; 2],
    above: bool,
    backends: &'static [&'static str],
}

const SERVERS: &[&str] = &["mariadb", "postgres", "sqlite", "galera"];
const FAR: &[&str] = &["mariadb+1ms", "postgres+1ms"];
const NEAR_AND_FAR: &[&str] = &["mariadb", "postgres", "mariadb+1ms", "postgres+1ms"];
const NEAR: &[&str] = &["mariadb", "postgres", "galera"];

const TARGETS: [Target; 6] = [
    Target {
        what: "replay without Redis / one indexed SELECT of the record",
        redis: "none",
        mode: "replay",
        over: "select",
        bounds: [1.3, 1.3],
        above: false,
        backends: SERVERS,
    },
    Target {
        what: "replay with Redis / one HGET of its field",
        redis: "redis",
        mode: "replay",
        over: "get",
        bounds: [1.15, 1.3],
        above: false,
        backends: SERVERS,
    },
    Target {
        what: "first call with Redis / bare, 1 ms away",
        redis: "redis",
        mode: "first",
        over: "bare",
        bounds: [1.05, 1.05],
        above: false,
        backends: FAR,
    },
    Target {
        what: "first call without Redis / bare, 1 ms away",
        redis: "none",
        mode: "first",
        over: "bare",
        bounds: [1.05, 1.05],
        above: false,
        backends: FAR,
    },
    // Close to the database the record's statements go bound (the round
    // trips they would save cost less than a text's planning): the first
    // call's statements are the floor's, its claim beside `BEGIN`.
    Target {
        what: "first call / the hand-written claim and record",
        redis: "redis",
        mode: "first",
        over: "floor",
        bounds: [1.10, 1.10],
        above: false,
        backends: NEAR,
    },
    Target {
        what: "the hand-written claim, BEGIN, body, INSERT, COMMIT / first call (the floor slower), 1 ms away",
        redis: "redis",
        mode: "floor",
        over: "first",
        bounds: [1.0, 1.0],
        above: true,
        backends: FAR,
    },
];

/// The performance targets, one line each: the ratio of two rows' p50
/// (same backend, claims and task count), its bound, and met or not met.
pub fn targets(rows: &[Row]) {
    let p50 = |backend: &str, redis: &str, tasks: usize, mode: &str| p50(rows, backend, redis, tasks, mode);
    println!();
    for target in &TARGETS {
        for backend in target.backends {
            for (tasks, bound) in [1, CONCURRENCY].into_iter().zip(target.bounds) {
                let (Some(row), Some(over)) =
                    (p50(backend, target.redis, tasks, target.mode), p50(backend, target.redis, tasks, target.over))
                else {
                    continue;
                };
                let ratio = row / over;
                let (met, sign) = if target.above { (ratio > bound, ">") } else { (ratio <= bound, "<=") };
                let verdict = if met { "met" } else { "NOT met" };
                println!(
                    "target {}, {backend}, {tasks} task(s): {ratio:.3}x ({sign} {bound:.2}x) {verdict}",
                    target.what
                );
            }
        }
    }
    // Not a target: how much of the first call's ratio is its statements.
    for backend in NEAR_AND_FAR {
        for tasks in [1, CONCURRENCY] {
            let (Some(first), Some(gate)) =
                (p50(backend, "redis", tasks, "first"), p50(backend, "redis", tasks, "floor-gate"))
            else {
                continue;
            };
            println!(
                "beside: first call / the engine's own statements hand-written (floor-gate), {backend}, {tasks} task(s): {:.2}x",
                first / gate
            );
        }
    }
}

/// Prints every row as a table, sorting them first: one caller's rows,
/// then many callers' and the storm, per backend and pass.
pub fn table(rows: &mut [Row]) {
    let order = |r: &Row| {
        let backend = BACKENDS.iter().position(|b| *b == r.backend);
        let redis = ["none", "redis", "cluster"].iter().position(|c| *c == r.redis);
        (backend, redis, r.tasks)
    };
    rows.sort_by_key(order);

    println!(
        "\n{:<9} {:<7} {:<12} {:>5} {:>7} {:>10} {:>8} {:>8} {:>6} {:>6} {:>10} {:>10} {:>11} {:>11}",
        "backend",
        "redis",
        "mode",
        "tasks",
        "calls",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "sql",
        "redis",
        "first/bare",
        "floor/bare",
        "bare/replay",
        "bare/local"
    );
    for r in rows.iter() {
        let first = ratio(rows, r.backend, r.redis, r.tasks, "first").filter(|_| r.mode == "bare");
        let floor = ratio(rows, r.backend, r.redis, r.tasks, "floor").filter(|_| r.mode == "bare");
        let replay = ratio(rows, r.backend, r.redis, r.tasks, "replay").filter(|_| r.mode == "bare").map(|x| 1.0 / x);
        let local =
            ratio(rows, r.backend, r.redis, r.tasks, "replay-local").filter(|_| r.mode == "bare").map(|x| 1.0 / x);
        let fmt_ratio = |x: Option<f64>| x.map(|v| format!("{v:.2}x")).unwrap_or_default();
        let fmt_count = |x: f64| if x.is_nan() { "-".to_string() } else { format!("{x:.1}") };
        println!(
            "{:<9} {:<7} {:<12} {:>5} {:>7} {:>10.0} {:>8.3} {:>8.3} {:>6} {:>6} {:>10} {:>10} {:>11} {:>11}{}",
            r.backend,
            r.redis,
            r.mode,
            r.tasks,
            r.calls,
            r.calls_per_sec,
            r.p50_ms,
            r.p99_ms,
            fmt_count(r.sql_per_call),
            fmt_count(r.redis_per_call),
            fmt_ratio(first),
            fmt_ratio(floor),
            fmt_ratio(replay),
            fmt_ratio(local),
            r.executions.map(|e| format!("  executions per storm: {e}")).unwrap_or_default(),
        );
    }
    println!(
        "first/bare: how much a first call costs over the plain transaction; floor/bare: the same for the hand-written \
         round trips a first call cannot avoid (claim, record insert, spawned cache write); bare/replay: how much faster a replay is \
         (p50 latencies, same backend, claims and task count); get: one plain Redis GET through redis-rs, the least a replay's round trip costs; \
         tcp: the same GET hand-written on a plain socket, the machine's own round trip; \
         replay-local: a replay from the engine's local cache (bare/local: how much faster than bare). \
         sql, redis: round trips per call a caller waits for, counted on the wire (SQLite: none, it is embedded); \
         +1ms: every round trip to the database and to Redis 1 ms longer."
    );
}

/// The rows and their ratios as JSON, and the chart, beside the build.
pub fn write(rows: &[Row], started: Instant) {
    let json = serde_json::json!({
        "quick": quick(),
        "seconds": started.elapsed().as_secs_f64(),
        "rows": rows.iter().map(|r| {
            let mut v = serde_json::to_value(r).expect("row");
            v["first_over_bare"] = serde_json::json!(ratio(rows, r.backend, r.redis, r.tasks, "first"));
            v["floor_over_bare"] = serde_json::json!(ratio(rows, r.backend, r.redis, r.tasks, "floor"));
            v["bare_over_replay"] = serde_json::json!(ratio(rows, r.backend, r.redis, r.tasks, "replay").map(|x| 1.0 / x));
            v["bare_over_replay_local"] =
                serde_json::json!(ratio(rows, r.backend, r.redis, r.tasks, "replay-local").map(|x| 1.0 / x));
            if r.sql_per_call.is_nan() { v["sql_per_call"] = serde_json::Value::Null; v["redis_per_call"] = serde_json::Value::Null; }
            v
        }).collect::<Vec<_>>(),
    });
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let path = std::path::Path::new(&dir).join("idem-bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
    println!("wrote {} in {:.1} s", path.display(), started.elapsed().as_secs_f64());

    // The chart of this run, beside the JSON and in docs/ (the performance
    // guide shows that copy).
    let svg = chart(rows, quick(), started.elapsed().as_secs_f64());
    let chart_path = std::path::Path::new(&dir).join("idem-bench.svg");
    std::fs::write(&chart_path, &svg).expect("write svg");
    println!("wrote {}", chart_path.display());
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    if docs.is_dir() {
        std::fs::write(docs.join("bench.svg"), &svg).expect("write docs/bench.svg");
        println!("wrote {}", docs.join("bench.svg").display());
    }
}

/// An SVG bar chart of every row: a light bar to p99 with a dark bar to p50
/// over it, on a log scale (rows span 0.01 to 10 ms). Written by hand: no
/// plotting crate, no system libraries.
fn chart(rows: &[Row], quick: bool, seconds: f64) -> String {
    use std::fmt::Write;
    const LABEL_W: f64 = 250.0;
    const PLOT_W: f64 = 560.0;
    const VALUE_W: f64 = 130.0;
    const ROW_H: f64 = 18.0;
    const TOP: f64 = 62.0;
    let rows: Vec<&Row> = rows.iter().filter(|r| r.p50_ms > 0.0 && r.p99_ms.is_finite()).collect();
    let lo = rows.iter().map(|r| r.p50_ms).fold(f64::INFINITY, f64::min).log10().floor().min(-2.0);
    let hi = rows.iter().map(|r| r.p99_ms).fold(0.0, f64::max).log10().ceil().max(lo + 1.0);
    let x = |ms: f64| LABEL_W + (ms.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * PLOT_W;
    // Rows grouped by (backend, claims), a heading line above each group.
    let mut lines: Vec<Option<&Row>> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if i == 0 || (rows[i - 1].backend, rows[i - 1].redis) != (r.backend, r.redis) {
            lines.push(None);
        }
        lines.push(Some(r));
    }
    let width = LABEL_W + PLOT_W + VALUE_W;
    let height = TOP + lines.len() as f64 * ROW_H + 20.0;
    let (dark, light) = ("#1f5fa8", "#a9c6ea");
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">idem bench: p50 and p99 per row, ms, log scale</text>\n\
         <text x=\"10\" y=\"38\" fill=\"#555\">{} run of {}, {seconds:.0} s (cargo bench --bench overhead --features mysql,postgres,redis)</text>\n\
         <rect x=\"{}\" y=\"11\" width=\"10\" height=\"10\" fill=\"{dark}\"/>\
         <text x=\"{}\" y=\"20\">p50</text>\
         <rect x=\"{}\" y=\"11\" width=\"10\" height=\"10\" fill=\"{light}\"/>\
         <text x=\"{}\" y=\"20\">p99</text>\n",
        if quick { "quick" } else { "full" },
        utc_date(),
        width - 110.0,
        width - 96.0,
        width - 60.0,
        width - 46.0,
    );
    // Grid: a labelled line per power of ten, faint ones at 2 and 5.
    let bottom = TOP + lines.len() as f64 * ROW_H;
    for decade in lo as i32..=hi as i32 {
        let base = 10f64.powi(decade);
        for (m, faint) in [(1.0, false), (2.0, true), (5.0, true)] {
            let v = base * m;
            if v > 10f64.powf(hi) * 1.0001 {
                break;
            }
            let gx = x(v);
            let stroke = if faint { "#eee" } else { "#ccc" };
            let _ = writeln!(
                svg,
                "<line x1=\"{gx:.1}\" y1=\"{}\" x2=\"{gx:.1}\" y2=\"{bottom}\" stroke=\"{stroke}\"/>",
                TOP - 6.0
            );
            if !faint {
                let text = if decade < 0 { format!("{:.*}", (-decade) as usize, v) } else { format!("{v:.0}") };
                let _ = writeln!(
                    svg,
                    "<text x=\"{gx:.1}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">{text}</text>",
                    TOP - 9.0
                );
            }
        }
    }
    for (i, line) in lines.iter().enumerate() {
        let y = TOP + i as f64 * ROW_H;
        match line {
            None => {
                let r = lines[i + 1].expect("a heading comes before a row");
                let backend = match r.backend {
                    "mariadb" => "MariaDB",
                    "postgres" => "PostgreSQL",
                    "sqlite" => "SQLite",
                    "galera" => "MariaDB Galera",
                    "mariadb+1ms" => "MariaDB 1 ms away",
                    "postgres+1ms" => "PostgreSQL 1 ms away",
                    other => other,
                };
                let claims = match r.redis {
                    "none" => "no Redis".to_string(),
                    "redis" => "claims in Redis".to_string(),
                    "cluster" => "claims in a Redis Cluster".to_string(),
                    other => format!("claims in {other}"),
                };
                let _ = writeln!(
                    svg,
                    "<text x=\"10\" y=\"{:.1}\" font-weight=\"bold\">{}, {}</text>",
                    y + 13.0,
                    escape(backend),
                    escape(&claims)
                );
            }
            Some(r) => {
                let tasks = if r.tasks == 1 { "1 task".to_string() } else { format!("{} tasks", r.tasks) };
                let _ = writeln!(
                    svg,
                    "<text x=\"24\" y=\"{:.1}\">{} ({tasks})</text>\n\
                     <rect x=\"{LABEL_W}\" y=\"{:.1}\" width=\"{:.1}\" height=\"12\" fill=\"{light}\"/>\n\
                     <rect x=\"{LABEL_W}\" y=\"{:.1}\" width=\"{:.1}\" height=\"12\" fill=\"{dark}\"/>\n\
                     <text x=\"{:.1}\" y=\"{:.1}\">{:.3} / {:.3}</text>",
                    y + 13.0,
                    escape(r.mode),
                    y + 3.0,
                    x(r.p99_ms) - LABEL_W,
                    y + 3.0,
                    x(r.p50_ms) - LABEL_W,
                    LABEL_W + PLOT_W + 8.0,
                    y + 13.0,
                    r.p50_ms,
                    r.p99_ms,
                );
            }
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Today's date in UTC, `YYYY-MM-DD` (days to civil date, Howard Hinnant's
/// algorithm), so the chart says when it ran without a date crate.
fn utc_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
