//! The texts as written, and (against the servers) as read back.
use super::*;
use crate::store::RowKey;

fn record<'a>(key: RowKey<'a>, response: Option<&'a str>) -> NewRecord<'a> {
    NewRecord { key, biz_no: Some("n'o\\"), params_hash: "ab", status: 1, response, now_ms: -5, expires_ms: i64::MAX }
}

#[test]
fn values_are_hex_between_quotes_and_integers_as_written() {
    let key = RowKey::new("pay", "k'1");
    let rec = record(key, Some("{\"a\":\"'; DROP\"}"));
    let mut mysql = Text::new(Dialect::MySql, 64);
    mysql.insert(&rec);
    let digest: String = key.digest.bytes().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        mysql.as_str(),
        format!(
            "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
             VALUES (x'{digest}', x'706179', x'6b2731', x'6e276f5c', x'6162', 1, x'{}', -5, -5, 9223372036854775807)",
            "{\"a\":\"'; DROP\"}".bytes().map(|b| format!("{b:02x}")).collect::<String>()
        )
    );
    let mut pg = Text::new(Dialect::Postgres, 64);
    pg.mark_finished(&record(key, None));
    assert_eq!(
        pg.as_str(),
        format!(
            "UPDATE idem_record SET status = 1, response = NULL, updated_at = -5, expires_at = 9223372036854775807 \
             WHERE key_digest = '{digest}'::uuid AND biz_type = convert_from(decode('706179', 'hex'), 'UTF8') \
             AND idem_key = convert_from(decode('6b2731', 'hex'), 'UTF8')"
        )
    );
}

/// Arbitrary keys, `biz_no`s and results through the texts the backends
/// send, against the servers: each row reads back (through bound
/// statements) exactly as it was given. Skipped when a server does not
/// answer, unless `IDEM_REQUIRE_SERVICES=1`.
#[cfg(any(feature = "mysql", feature = "postgres"))]
mod against_the_servers {
    use std::time::Duration;

    use sqlx::Pool;

    use crate::store::{Backend, Db, NewRecord, PROCESSING, Pooling, RowKey, SUCCEEDED, StoredRecord};

    const CASES: usize = 250;
    const BIZ: &str = "t_text";

    /// xorshift64: a fixed seed, printed, gives the same cases again.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }

        /// Text of up to `max` bytes, from characters that end or escape a
        /// literal somewhere (quotes, backslashes, `$$`, comments,
        /// semicolons), controls, and several-byte UTF-8; now and then long.
        fn text(&mut self, max: usize) -> String {
            let len = if self.below(20) == 0 { max } else { self.below(40) as usize };
            self.filled(len.min(max))
        }

        /// Text of about `len` bytes (never more).
        fn filled(&mut self, len: usize) -> String {
            const CHARS: [&str; 24] = [
                "'", "\"", "\\", ";", "--", "/*", "*/", "$$", "$1", "?", "`", "x'", "E'", "U&'", "\n", "\r\t",
                "\u{7f}", "\u{1}", "é", "€", "😀", "\u{202e}", "a", "Z",
            ];
            let mut text = String::with_capacity(len);
            while text.len() < len {
                let next = CHARS[self.below(CHARS.len() as u64) as usize];
                if text.len() + next.len() > len {
                    break;
                }
                text.push_str(next);
            }
            text
        }

        /// A key of the key rule's alphabet, `prefix` first so that runs
        /// never meet each other's rows.
        fn key(&mut self, prefix: &str) -> String {
            const ALPHABET: &[u8] = b"ABCXYZabcxyz0189_.:-";
            let len = self.below(120) as usize;
            let tail: String =
                (0..len).map(|_| char::from(ALPHABET[self.below(ALPHABET.len() as u64) as usize])).collect();
            format!("{prefix}{tail}")
        }

        fn hex(&mut self, len: usize) -> String {
            (0..len).map(|_| char::from(b"0123456789abcdef"[self.below(16) as usize])).collect()
        }
    }

    /// What a case wrote, read back with bound statements: the row the
    /// read of a key finds, and its `biz_no`.
    async fn read_back<DB: Backend>(db: &Db<DB>, key: RowKey<'_>) -> (Option<StoredRecord>, Option<String>)
    where
        for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
        for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
        String: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB> + for<'q> sqlx::Encode<'q, DB>,
        (Option<String>,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        let row = DB::read_plain(db, key).await.expect("read the row");
        let sql = format!(
            "SELECT biz_no FROM idem_record WHERE biz_type = {} AND idem_key = {}",
            DB::placeholder(1),
            DB::placeholder(2)
        );
        let biz_no: Option<Option<String>> = db
            .pooling
            .query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(key.biz.to_owned())
            .bind(key.key.to_owned())
            .fetch_optional(&db.pool)
            .await
            .expect("read biz_no");
        (row, biz_no.flatten())
    }

    async fn reads_back<DB: Backend>(pool: Pool<DB>, server: &str)
    where
        for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
        for<'a> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
        String: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB> + for<'q> sqlx::Encode<'q, DB>,
        (Option<String>,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        let db = Db::new(pool, Pooling::Session);
        DB::migrate(&db, "idem-text-cases").await.expect("migrate");
        let seed = crate::clock::now_nanos() as u64 | 1;
        println!("{server}: {CASES} cases from seed {seed:#x}");
        let mut rng = Rng(seed);
        let run = format!("t{seed:x}-");
        let wait = Duration::from_secs(5);
        for case in 0..CASES {
            let (key, committed_key) = (rng.key(&format!("{run}{case}b")), rng.key(&format!("{run}{case}c")));
            let biz_no = (rng.below(4) != 0).then(|| rng.text(64));
            // The first case's result is large: 300 kB, 600 kB as hex.
            let response = if case == 0 { rng.filled(300_000) } else { rng.text(4_000) };
            let params_hash = rng.hex(64);
            let now = rng.below(1 << 50) as i64 - (1 << 49);
            let base = NewRecord {
                key: RowKey::new(BIZ, &key),
                biz_no: biz_no.as_deref(),
                params_hash: &params_hash,
                status: PROCESSING,
                response: None,
                now_ms: now,
                expires_ms: now.saturating_add(rng.below(1 << 40) as i64),
            };
            let seen = |rec: &NewRecord<'_>| StoredRecord {
                params_hash: params_hash.clone(),
                status: SUCCEEDED,
                response: rec.response.map(str::to_owned),
                expires_ms: rec.expires_ms,
            };

            // Without a claim: `BEGIN` carries the insert, `COMMIT` the update.
            let begin = DB::begin_inserting(&db, &base, wait).expect("a text to begin with");
            let mut tx =
                db.pool.begin_with(begin.into_sql()).await.unwrap_or_else(|e| panic!("{server} case {case}: {e}"));
            let finished = NewRecord { status: SUCCEEDED, response: Some(&response), ..base };
            let commit = DB::finish_committing(&finished).expect("a text to commit with");
            DB::execute_text(&mut tx, commit).await.unwrap_or_else(|e| panic!("{server} case {case}: {e}"));
            drop(tx);
            assert_eq!(read_back(&db, base.key).await, (Some(seen(&finished)), biz_no.clone()), "{server} case {case}");

            // With a claim: the insert after the body, with `COMMIT`.
            let inserted = NewRecord { key: RowKey::new(BIZ, &committed_key), ..finished };
            let mut tx = db.pool.begin().await.expect("begin");
            let commit = DB::insert_committing(&inserted, wait).expect("a text to commit with");
            DB::execute_text(&mut tx, commit).await.unwrap_or_else(|e| panic!("{server} case {case}: {e}"));
            drop(tx);
            assert_eq!(read_back(&db, inserted.key).await, (Some(seen(&inserted)), biz_no), "{server} case {case}");
        }
        let sql = format!(
            "DELETE FROM idem_record WHERE biz_type = {} AND idem_key LIKE {}",
            DB::placeholder(1),
            DB::placeholder(2)
        );
        db.pooling
            .query(sqlx::AssertSqlSafe(sql))
            .bind(BIZ.to_owned())
            .bind(format!("{run}%"))
            .execute(&db.pool)
            .await
            .expect("clean up");
    }

    fn unreachable(service: &str, e: impl std::fmt::Display) {
        assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
        eprintln!("skipped: {service} unreachable ({e})");
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn mysql_reads_back_every_value_a_text_wrote() {
        let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        match sqlx::mysql::MySqlPoolOptions::new().max_connections(2).connect(&url).await {
            Ok(pool) => reads_back(pool, "mysql").await,
            Err(e) => unreachable("mysql", e),
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn postgres_reads_back_every_value_a_text_wrote() {
        let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        match sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&url).await {
            Ok(pool) => reads_back(pool, "postgres").await,
            Err(e) => unreachable("postgres", e),
        }
    }
}
