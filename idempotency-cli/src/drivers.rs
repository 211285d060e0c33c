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

/// The features, in the order the install line names them.
const FEATURES: [&str; 4] = ["mysql", "postgres", "sqlite", "redis"];

/// Whether this build holds the feature `name`.
// Which arms are true is the build's choice: not a `matches!` in every build.
#[allow(clippy::match_like_matches_macro)]
fn built(name: &str) -> bool {
    match name {
        "mysql" => cfg!(feature = "mysql"),
        "postgres" => cfg!(feature = "postgres"),
        "sqlite" => cfg!(feature = "sqlite"),
        "redis" => cfg!(feature = "redis"),
        _ => false,
    }
}

/// Whether this build holds the driver of `dialect`.
pub fn has(dialect: Dialect) -> bool {
    built(feature(dialect))
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
    if built("redis") { Ok(()) } else { Err(left_out(url.from, "redis")) }
}

/// What the setting `from` needs and this build lacks: the feature, and
/// the install line of a build with it beside the features this one has.
pub fn left_out(from: &str, feature: &str) -> String {
    left_out_of(from, feature, built)
}

fn left_out_of(from: &str, feature: &str, built: impl Fn(&str) -> bool) -> String {
    let wanted: Vec<&str> = FEATURES.into_iter().filter(|&f| f == feature || built(f)).collect();
    let install = if wanted.len() == FEATURES.len() {
        "cargo install --locked --path idempotency-cli".to_owned()
    } else {
        format!("cargo install --locked --path idempotency-cli --no-default-features --features {}", wanted.join(","))
    };
    format!("{from}: this idem was built without the feature `{feature}`; install one with it: {install}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_left_out_is_named_with_its_feature_and_the_line_to_install_it() {
        let only = |names: &'static [&'static str]| move |name: &str| names.contains(&name);
        assert_eq!(
            left_out_of("--database-url", "mysql", only(&["postgres"])),
            "--database-url: this idem was built without the feature `mysql`; install one with it: cargo install \
             --locked --path idempotency-cli --no-default-features --features mysql,postgres"
        );
        assert_eq!(
            left_out_of("IDEM_REDIS_URL", "redis", only(&["mysql", "postgres", "sqlite"])),
            "IDEM_REDIS_URL: this idem was built without the feature `redis`; install one with it: cargo install \
             --locked --path idempotency-cli"
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
