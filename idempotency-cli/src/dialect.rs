//! Which SQL the database speaks, from the scheme of its URL. Its own file,
//! needing nothing else of the tool: the fuzz targets in `fuzz/` compile it
//! with `ident.rs`.

/// Which SQL the database speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    MySql,
    Postgres,
    Sqlite,
}

impl Dialect {
    /// The dialect of a database URL; the refusal names the scheme (its
    /// caller names where the URL came from).
    pub fn of(url: &str) -> Result<Dialect, String> {
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme {
            "mysql" | "mariadb" => Ok(Dialect::MySql),
            "postgres" | "postgresql" => Ok(Dialect::Postgres),
            "sqlite" => Ok(Dialect::Sqlite),
            _ => Err(format!("unknown scheme `{scheme}`; expected mysql:, postgres: or sqlite:")),
        }
    }

    /// The `n`th bind placeholder (from 1).
    pub fn arg(self, n: usize) -> String {
        match self {
            Dialect::Postgres => format!("${n}"),
            Dialect::MySql | Dialect::Sqlite => "?".into(),
        }
    }

    /// The `n`th placeholder as a `key_digest` value, bound as 32 hex digits.
    pub fn digest_arg(self, n: usize) -> String {
        match self {
            Dialect::MySql => "UNHEX(?)".into(),
            Dialect::Postgres => format!("CAST(${n} AS uuid)"),
            Dialect::Sqlite => "unhex(?)".into(),
        }
    }

    /// `expr` as text, whatever the column's type.
    pub fn as_text(self, expr: &str) -> String {
        match self {
            Dialect::MySql => format!("CAST({expr} AS CHAR)"),
            Dialect::Postgres | Dialect::Sqlite => format!("CAST({expr} AS TEXT)"),
        }
    }
}
