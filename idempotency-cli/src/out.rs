//! Everything the tool writes to the terminal goes through here. Commands
//! escape each value they show ([`escape::text`], [`escape::response`]);
//! each line is then written with any unsafe character still in it escaped
//! ([`escape::line`]), so a value a command forgot cannot reach the
//! terminal raw either. The crate's `clippy.toml` refuses `println!` and
//! its kin anywhere else.
#![allow(clippy::disallowed_macros)]

use std::io::Write;

use serde_json::Value;

use crate::escape;

/// One line on standard output.
pub fn say(line: &str) {
    println!("{}", escape::line(line));
}

/// One line on standard error.
pub fn tell(line: &str) {
    eprintln!("{}", escape::line(line));
}

/// A question on standard error, the answer to come on the same line.
pub fn ask(question: &str) {
    eprint!("{} ", escape::line(question));
    let _ = std::io::stderr().flush();
}

/// `--json` output: pretty JSON, each line with any unsafe character as a
/// JSON escape (serde_json escapes only C0 controls, not DEL, C1 or bidi
/// controls): still the same JSON value.
pub fn json(value: &Value) {
    let pretty = serde_json::to_string_pretty(value).unwrap_or_default();
    for line in pretty.lines() {
        println!("{}", escape::json(line));
    }
}
