//! The record's statements as SQL text, values written in: so they ride in
//! the round trip of a statement the call's transaction sends anyway
//! (`BEGIN`, `COMMIT`), several statements in one text (MySQL's
//! multi-statement query, PostgreSQL's simple query protocol). A bound
//! statement cannot share a round trip with another one in sqlx.
//!
//! No value is ever written as an escaped string. Text and bytes go as hex
//! digits between quotes (MySQL's `x'..'`, PostgreSQL's `decode('..',
//! 'hex')`, read back as UTF-8 where the column is text), integers as Rust
//! writes them: no byte of a key, a `biz_no` or a result can end its
//! literal, whatever the server's `sql_mode` or `standard_conforming_strings`.
//! Everything else in a text is fixed SQL (`&'static str`).

use super::NewRecord;
use super::digest::KeyDigest;

/// Results larger than this go in a bound statement of their own: their
/// hex form doubles them, and MariaDB refuses a text over
/// `max_allowed_packet` (16 MiB by default). A round trip is little beside
/// a megabyte.
pub(crate) const MAX_RIDING: usize = 1 << 20;

/// How a server writes literals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// MySQL and MariaDB.
    MySql,
    /// PostgreSQL.
    Postgres,
}

/// A SQL text being written: fixed SQL and literals only.
#[derive(Debug)]
pub struct Text {
    dialect: Dialect,
    sql: String,
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl Text {
    /// An empty text for `dialect`, with room for about `values` bytes of
    /// values (written twice their size).
    pub fn new(dialect: Dialect, values: usize) -> Self {
        Text { dialect, sql: String::with_capacity(512 + 2 * values) }
    }

    /// Fixed SQL, as written.
    pub fn sql(&mut self, fixed: &'static str) -> &mut Self {
        self.sql.push_str(fixed);
        self
    }

    /// An integer.
    pub fn int(&mut self, value: i64) -> &mut Self {
        use std::fmt::Write;
        let _ = write!(self.sql, "{value}");
        self
    }

    /// A text value: its UTF-8 bytes in hex.
    pub fn text(&mut self, value: &str) -> &mut Self {
        match self.dialect {
            Dialect::MySql => self.sql.push_str("x'"),
            Dialect::Postgres => self.sql.push_str("convert_from(decode('"),
        }
        self.hex(value.as_bytes());
        match self.dialect {
            Dialect::MySql => self.sql.push('\''),
            Dialect::Postgres => self.sql.push_str("', 'hex'), 'UTF8')"),
        }
        self
    }

    /// A text value or `NULL`.
    pub fn text_or_null(&mut self, value: Option<&str>) -> &mut Self {
        match value {
            Some(value) => self.text(value),
            None => self.sql("NULL"),
        }
    }

    /// A key's digest: MySQL's `BINARY(16)`, PostgreSQL's `uuid`.
    pub(crate) fn digest(&mut self, digest: &KeyDigest) -> &mut Self {
        match self.dialect {
            Dialect::MySql => self.sql.push_str("x'"),
            Dialect::Postgres => self.sql.push('\''),
        }
        self.hex(digest.bytes());
        match self.dialect {
            Dialect::MySql => self.sql.push('\''),
            Dialect::Postgres => self.sql.push_str("'::uuid"),
        }
        self
    }

    fn hex(&mut self, bytes: &[u8]) {
        self.sql.reserve(2 * bytes.len());
        for &b in bytes {
            self.sql.push(char::from(HEX[usize::from(b >> 4)]));
            self.sql.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }

    /// `INSERT INTO idem_record (..) VALUES (..)` of `rec`, the columns
    /// in the order of the bound insert (`store::Queries::insert`).
    pub fn insert(&mut self, rec: &NewRecord<'_>) -> &mut Self {
        self.sql("INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (")
            .digest(&rec.key.digest)
            .sql(", ")
            .text(rec.key.biz)
            .sql(", ")
            .text(rec.key.key)
            .sql(", ")
            .text_or_null(rec.biz_no)
            .sql(", ")
            .text(rec.params_hash)
            .sql(", ")
            .int(i64::from(rec.status))
            .sql(", ")
            .text_or_null(rec.response)
            .sql(", ")
            .int(rec.now_ms)
            .sql(", ")
            .int(rec.now_ms)
            .sql(", ")
            .int(rec.expires_ms)
            .sql(")")
    }

    /// The `UPDATE` that finishes the row this transaction inserted, as
    /// the bound `store::Queries::mark_finished` does.
    pub fn mark_finished(&mut self, rec: &NewRecord<'_>) -> &mut Self {
        self.sql("UPDATE idem_record SET status = ")
            .int(i64::from(rec.status))
            .sql(", response = ")
            .text_or_null(rec.response)
            .sql(", updated_at = ")
            .int(rec.now_ms)
            .sql(", expires_at = ")
            .int(rec.expires_ms)
            .sql(" WHERE key_digest = ")
            .digest(&rec.key.digest)
            .sql(" AND biz_type = ")
            .text(rec.key.biz)
            .sql(" AND idem_key = ")
            .text(rec.key.key)
    }

    /// The text, to send in the simple protocol (`sqlx::raw_sql`, `begin_with`).
    pub fn into_sql(self) -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(self.sql)
    }

    /// The text as written (the fuzz targets read it).
    #[cfg(any(fuzzing, test))]
    pub fn as_str(&self) -> &str {
        &self.sql
    }
}

/// The texts each server runs, written once for both (the backends pick
/// theirs, `RecordSql::begin_inserting` and the like). `bound`: the
/// lock-wait bound in the server's own unit (MySQL's whole seconds,
/// PostgreSQL's ms).
impl Dialect {
    /// Opens the call's transaction with `rec` inserted first, the insert
    /// bounded; a failed insert leaves no transaction open.
    ///
    /// - MariaDB: one compound statement (`BEGIN NOT ATOMIC`, MariaDB's
    ///   alone) whose handler rolls the transaction back and raises the
    ///   error again, same number, if the insert fails. The bound is `SET
    ///   STATEMENT`'s, for the insert alone. MySQL has no compound statement
    ///   outside a stored program and refuses the text before running any of it.
    /// - PostgreSQL: the insert runs before `BEGIN`, in the implicit
    ///   transaction a text of several statements runs in: a failure rolls it
    ///   back and ends the text with nothing open, and `BEGIN` makes it the
    ///   call's transaction, the insert in it. The bound is set after saving
    ///   the session's own, and put back before `BEGIN`, so the body's own
    ///   lock waits are left alone.
    pub fn begin_inserting(self, rec: &NewRecord<'_>, bound: i64) -> Text {
        let mut text = Text::new(self, values_len(rec));
        match self {
            Dialect::MySql => text
                .sql("BEGIN NOT ATOMIC DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END; START TRANSACTION; SET STATEMENT innodb_lock_wait_timeout = ")
                .int(bound)
                .sql(" FOR ")
                .insert(rec)
                .sql("; END"),
            Dialect::Postgres => text
                .sql("SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true); SET LOCAL lock_timeout = ")
                .int(bound)
                .sql("; ")
                .insert(rec)
                .sql("; SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true); BEGIN"),
        };
        text
    }

    /// Inserts `rec` after the body, bounded, and commits. A refused insert
    /// fails the text before its `COMMIT` and leaves the body's writes
    /// standing:
    ///
    /// - MySQL stops a text at its first failing statement, and a failed
    ///   statement leaves the transaction as it was.
    /// - PostgreSQL aborts the whole transaction on an error: the insert
    ///   goes in a savepoint of its own (`recover_refused` rolls back to it).
    ///   The `BEGIN` after `COMMIT` is for the `ROLLBACK` sqlx sends when it
    ///   drops the transaction: it ends an empty one (without it, the server
    ///   would warn of no transaction in progress).
    pub fn insert_committing(self, rec: &NewRecord<'_>, bound: i64) -> Text {
        let mut text = Text::new(self, values_len(rec));
        match self {
            Dialect::MySql => text
                .sql("/*M! SET STATEMENT innodb_lock_wait_timeout = ")
                .int(bound)
                .sql(" FOR */ ")
                .insert(rec)
                .sql("; COMMIT"),
            Dialect::Postgres => text
                .sql("SET LOCAL lock_timeout = ")
                .int(bound)
                .sql("; SAVEPOINT idem_record; ")
                .insert(rec)
                .sql("; RELEASE SAVEPOINT idem_record; COMMIT; BEGIN"),
        };
        text
    }

    /// Finishes the row this transaction inserted and commits.
    pub fn finish_committing(self, rec: &NewRecord<'_>) -> Text {
        let mut text = Text::new(self, values_len(rec));
        match self {
            Dialect::MySql => text.mark_finished(rec).sql("; COMMIT"),
            Dialect::Postgres => text.mark_finished(rec).sql("; COMMIT; BEGIN"),
        };
        text
    }
}

/// Room for the values of `rec` in a text.
fn values_len(rec: &NewRecord<'_>) -> usize {
    rec.key.key.len() + rec.biz_no.map_or(0, str::len) + rec.response.map_or(0, str::len)
}

#[cfg(test)]
mod tests;
