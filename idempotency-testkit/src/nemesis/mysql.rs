//! MariaDB/MySQL: where the server listens, and a pool that reaches it
//! through a proxy.

use std::str::FromStr;

use sqlx::Pool;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

use super::{ACQUIRE_TIMEOUT, NemesisBackend};
use crate::backend::MySql;
use crate::mysql_url;

impl NemesisBackend for MySql {
    fn server() -> (String, u16) {
        let options = MySqlConnectOptions::from_str(&mysql_url()).expect("mysql url");
        (options.get_host().to_owned(), options.get_port())
    }

    fn pool_via(port: u16, database: &str, size: u32) -> Pool<sqlx::MySql> {
        let options = MySqlConnectOptions::from_str(&mysql_url())
            .expect("mysql url")
            .host("127.0.0.1")
            .port(port)
            .database(database);
        MySqlPoolOptions::new().max_connections(size).acquire_timeout(ACQUIRE_TIMEOUT).connect_lazy_with(options)
    }
}
