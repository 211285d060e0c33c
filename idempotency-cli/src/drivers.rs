//! The drivers this build of `idem` holds: one cargo feature each (`mysql`,
//! `postgres`, `sqlite`, `redis`), all on by default, so that an operator of
//! one database builds one driver. A URL for a driver left out is refused
//! before anything is opened, with the feature that builds it.

use crate::cli::Given;
use crate::dialect::Dialect;

/// The feature that builds the driver of `dialect`.
pub fn feature(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::MySql => "mysql",
        Dialect::Postgres => "postgres",
        Dialect::Sqlite => "sqlite",
    }
}

/// Whether this build holds the driver of `dialect`.
pub fn has(dialect: Dialect) -> bool {
    match dialect {
        Dialect::MySql => cfg!(feature = "mysql"),
        Dialect::Postgres => cfg!(feature = "postgres"),
        Dialect::Sqlite => cfg!(feature = "sqlite"),
    }
}

/// Whether this build holds the Redis client.
pub fn has_redis() -> bool {
    cfg!(feature = "redis")
}

/// The database URL's dialect, if this build holds its driver.
pub fn database(url: &Given) -> Result<Dialect, String> {
    let dialect = Dialect::of(&url.value).map_err(|e| format!("{}: {e}", url.from))?;
    if !has(dialect) {
        return Err(left_out(url.from, feature(dialect)));
    }
    Ok(dialect)
}

/// A Redis URL is usable: this build holds the client.
pub fn redis(url: &Given) -> Result<(), String> {
    if has_redis() { Ok(()) } else { Err(left_out(url.from, "redis")) }
}

/// What a driver this build lacks is told.
pub fn left_out(from: &str, feature: &str) -> String {
    format!(
        "{from}: this idem was built without the feature `{feature}`; build it in: cargo install --locked --path \
         idempotency-cli --features {feature} (beside the features it has)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_left_out_is_named_with_its_feature() {
        assert_eq!(
            left_out("--database-url", "mysql"),
            "--database-url: this idem was built without the feature `mysql`; build it in: cargo install --locked \
             --path idempotency-cli --features mysql (beside the features it has)"
        );
        let url = |value: &str| Given { value: value.into(), from: "IDEM_DATABASE_URL" };
        for (value, dialect) in
            [("mysql://h/d", Dialect::MySql), ("postgres://h/d", Dialect::Postgres), ("sqlite:x.db", Dialect::Sqlite)]
        {
            let expected =
                if has(dialect) { Ok(dialect) } else { Err(left_out("IDEM_DATABASE_URL", feature(dialect))) };
            assert_eq!(database(&url(value)), expected);
        }
        assert_eq!(
            database(&url("oracle://h")),
            Err("IDEM_DATABASE_URL: unknown scheme `oracle`; expected mysql:, postgres: or sqlite:".into())
        );
    }
}
