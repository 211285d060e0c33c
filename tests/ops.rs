//! What ships for operators, held to the crate: the Grafana dashboard
//! (`ops/grafana/idem.json`) and the Prometheus alert rules
//! (`ops/prometheus/idem-rules.yml`) query only metrics the crate emits
//! (`idempotency-runtime/src/metrics.rs`, whose table lists the same names
//! as its constants), the dashboard leaves out exactly the metrics named
//! here, every dashboard query is valid PromQL, and the rules pass
//! `promtool check rules` and their unit tests (`promtool test rules
//! ops/prometheus/idem-rules.test.yml`). `promtool` comes with Debian's
//! `prometheus`; without it the promtool tests skip, or fail under
//! `IDEM_REQUIRE_SERVICES=1`. The picture of the dashboard in the
//! operations guide (`docs/dashboard.svg`) is the one
//! `ops/grafana/render.py` draws from it. `tests/prometheus.rs` runs the
//! dashboard's queries and the rules in a real Prometheus.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Metrics the dashboard does not chart, and why: none today. A metric
/// added to the crate fails `the_dashboard_charts_what_the_crate_emits`
/// until the dashboard charts it or it is named here.
const LEFT_OUT: &[&str] = &[];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every `idem_...` name in `text` (a name: `[a-z0-9_]`, not preceded by
/// one).
fn metric_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let word = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("idem_") {
        if at > 0 && (word(bytes[at - 1]) || bytes[at - 1].is_ascii_uppercase()) {
            continue;
        }
        let end = bytes[at..].iter().position(|&b| !word(b)).map_or(text.len(), |n| at + n);
        names.insert(text[at..end].to_owned());
    }
    names
}

/// The names the crate emits: the string constants of `metrics.rs`. Its
/// table (the module docs) must list the same.
fn emitted() -> BTreeSet<String> {
    let source = read("idempotency-runtime/src/metrics.rs");
    let constants: BTreeSet<String> = source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const ")?.split_once("&str = \"")?.1.strip_suffix("\";"))
        .map(str::to_owned)
        .collect();
    let table: BTreeSet<String> = source
        .lines()
        .filter_map(|l| l.strip_prefix("//! | `")?.split_once('`'))
        .map(|(name, _)| name.to_owned())
        .collect();
    assert_eq!(table, constants, "metrics.rs: its table and its constants name different metrics");
    assert!(constants.len() >= 13, "{constants:?}");
    constants
}

/// A histogram's series (`_bucket`, `_sum`, `_count`) as its metric's name.
fn family(name: &str, emitted: &BTreeSet<String>) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && emitted.contains(base)
        {
            return base.to_owned();
        }
    }
    name.to_owned()
}

/// Every target's query in the dashboard, with the panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: Value = serde_json::from_str(&read("ops/grafana/idem.json")).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().expect("panels").iter().collect();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or_default();
            queries.push((title.to_owned(), target["expr"].as_str().expect("every target has an expr").to_owned()));
        }
    }
    queries
}

/// A dashboard query as Prometheus gets it from Grafana: its variables
/// given values ("All" for `$job` and `$biz`).
fn as_sent(expr: &str) -> String {
    let sent = expr
        .replace("$__rate_interval", "1m")
        .replace("$__range", "1h")
        .replace("$__interval", "1m")
        .replace("$job", ".*")
        .replace("$biz", ".*");
    assert!(!sent.contains('$'), "a variable left in {expr}");
    sent
}

#[test]
fn the_dashboard_charts_what_the_crate_emits() {
    let emitted = emitted();
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let mut charted = BTreeSet::new();
    for (title, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{title}: {expr} queries no metric of the crate");
        for name in names {
            let metric = family(&name, &emitted);
            assert!(emitted.contains(&metric), "panel {title:?} queries {name}, which the crate does not emit");
            charted.insert(metric);
        }
    }
    let left_out: BTreeSet<String> = emitted.difference(&charted).cloned().collect();
    let named: BTreeSet<String> = LEFT_OUT.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(left_out, named, "the metrics the dashboard leaves out are not the ones LEFT_OUT names");
    println!("the dashboard charts {} of the {} metrics; leaves out: {:?}", charted.len(), emitted.len(), LEFT_OUT);
}

#[test]
fn the_alert_rules_query_what_the_crate_emits() {
    let emitted = emitted();
    let rules = read("ops/prometheus/idem-rules.yml");
    let names = metric_names(&rules);
    assert!(names.len() >= 6, "{names:?}");
    for name in names {
        assert!(emitted.contains(&family(&name, &emitted)), "the rules query {name}, which the crate does not emit");
    }
}

/// `promtool`, or `None` after saying why (a failure under
/// `IDEM_REQUIRE_SERVICES=1`).
fn promtool() -> Option<&'static str> {
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some("promtool");
    }
    assert!(
        std::env::var("IDEM_REQUIRE_SERVICES").map_or(true, |v| v != "1"),
        "promtool not installed (Debian's prometheus) and IDEM_REQUIRE_SERVICES=1"
    );
    println!("skipped: promtool not installed (Debian's prometheus)");
    None
}

fn run(promtool: &str, args: &[&str], dir: &Path) -> String {
    let out = Command::new(promtool).args(args).current_dir(dir).output().expect("promtool runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    let Some(promtool) = promtool() else { return };
    // Each query as a recording rule: `promtool check rules` parses its
    // expression as Prometheus would.
    let queries = dashboard_queries();
    let mut file = String::from("groups:\n  - name: idem_dashboard\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let sent = serde_json::to_string(&as_sent(expr)).unwrap();
        file += &format!("      - record: idem_dashboard:query_{i}\n        expr: {sent}\n");
    }
    let dir = std::env::temp_dir().join(format!("idem-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("dashboard-queries.yml"), file).unwrap();
    let said = run(promtool, &["check", "rules", "dashboard-queries.yml"], &dir);
    assert!(said.contains(&format!("SUCCESS: {} rules found", queries.len())), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_alert_rules_check_and_pass_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let dir = root().join("ops/prometheus");
    let checked = run(promtool, &["check", "rules", "idem-rules.yml"], &dir);
    assert!(checked.contains("SUCCESS: 7 rules found"), "{checked}");
    let tested = run(promtool, &["test", "rules", "idem-rules.test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// The picture in docs/operations.md is the dashboard as it is:
/// `ops/grafana/render.py --check` draws it again and compares.
#[test]
fn the_dashboard_picture_is_drawn_from_the_dashboard() {
    let Ok(out) = Command::new("python3").arg("ops/grafana/render.py").arg("--check").current_dir(root()).output()
    else {
        assert!(
            std::env::var("IDEM_REQUIRE_SERVICES").map_or(true, |v| v != "1"),
            "python3 not installed and IDEM_REQUIRE_SERVICES=1"
        );
        println!("skipped: python3 not installed");
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn names_are_found_where_they_stand() {
    let names = metric_names("sum(rate(idem_calls_total{x=\"y\"}[1m])) / idem_x_bucket + my_idem_z + Idem_q");
    assert_eq!(names.into_iter().collect::<Vec<_>>(), ["idem_calls_total", "idem_x_bucket"]);
}
