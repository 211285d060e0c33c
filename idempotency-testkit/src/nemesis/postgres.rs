//! PostgreSQL: where the server listens, and a pool that reaches it
//! through a proxy.

use std::str::FromStr;

use sqlx::Pool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::{ACQUIRE_TIMEOUT, NemesisBackend};
use crate::backend::Postgres;
use crate::pg_url;

impl NemesisBackend for Postgres {
    fn server() -> (String, u16) {
        let options = PgConnectOptions::from_str(&pg_url()).expect("postgres url");
        (options.get_host().to_owned(), options.get_port())
    }

    fn pool_via(port: u16, database: &str, size: u32) -> Pool<sqlx::Postgres> {
        let options = PgConnectOptions::from_str(&pg_url())
            .expect("postgres url")
            .host("127.0.0.1")
            .port(port)
            .database(database);
        PgPoolOptions::new().max_connections(size).acquire_timeout(ACQUIRE_TIMEOUT).connect_lazy_with(options)
    }
}
