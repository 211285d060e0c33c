//! Table and column names given on the command line: checked as SQL
//! identifiers and quoted for the database, never pasted into SQL as typed.
//! The rule is layer 4's (`idempotency_rules::is_sql_identifier`): `[A-Za-z_][A-Za-z0-9_]{0,63}`, and
//! a table may be qualified by its schema (`billing.payments`). Needs only
//! `dialect.rs`: the fuzz targets in `fuzz/` compile the two (and `time.rs`).

use std::fmt;

use crate::dialect::Dialect;

/// A checked identifier, or `schema.name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident {
    parts: Vec<String>,
}

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadIdent {
    what: &'static str,
    shown: String,
}

impl fmt::Display for BadIdent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} is not a SQL identifier: expected [A-Za-z_][A-Za-z0-9_]{{0,63}}{}",
            self.what,
            self.shown,
            if self.what == "table" { ", optionally as schema.table" } else { "" }
        )
    }
}

impl std::error::Error for BadIdent {}

impl Ident {
    /// Checks `name` (`what` says which argument it is, for the message).
    pub fn parse(what: &'static str, name: &str, qualified: bool) -> Result<Ident, BadIdent> {
        let parts: Vec<&str> = if qualified { name.split('.').collect() } else { vec![name] };
        if parts.len() > 2 || !parts.iter().all(|p| is_ident(p)) {
            // Shown escaped: a hostile name may hold control characters.
            return Err(BadIdent { what, shown: format!("{name:?}") });
        }
        Ok(Ident { parts: parts.into_iter().map(str::to_owned).collect() })
    }

    /// The name quoted for `dialect` (each part on its own).
    pub fn quoted(&self, dialect: Dialect) -> String {
        let (open, close) = match dialect {
            Dialect::MySql => ('`', '`'),
            Dialect::Postgres | Dialect::Sqlite => ('"', '"'),
        };
        // A checked part holds no quote character, so wrapping it suffices.
        self.parts.iter().map(|p| format!("{open}{p}{close}")).collect::<Vec<_>>().join(".")
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.parts.join("."))
    }
}

fn is_ident(part: &str) -> bool {
    idempotency_rules::is_sql_identifier(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_then_quoted() {
        let t = Ident::parse("table", "billing.Payments_2", true).unwrap();
        assert_eq!(t.quoted(Dialect::MySql), "`billing`.`Payments_2`");
        assert_eq!(t.quoted(Dialect::Postgres), "\"billing\".\"Payments_2\"");
        assert_eq!(Ident::parse("column", "order", false).unwrap().quoted(Dialect::Sqlite), "\"order\"");
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "payments; DROP TABLE payments",
            "a\"b",
            "a`b",
            "a]b",
            "caf\u{e9}",
            "a.b.c",
            ".a",
            "a.",
            "x\u{0}",
            &"a".repeat(65),
        ] {
            assert!(Ident::parse("table", bad, true).is_err(), "{bad:?}");
        }
        assert!(Ident::parse("column", "a.b", false).is_err(), "a column is never qualified");
        assert!(Ident::parse("table", &"a".repeat(64), true).is_ok());
    }
}
