//! Brings an `idem_record` of an earlier version (unique on
//! `(biz_type, idem_key)`, no `key_digest`) to today's form, at `migrate`:
//! the digest column filled for every row, unique, and the old unique index
//! dropped. Each step is safe to run again, so a migration cut off halfway
//! finishes at the next start. Engines of the earlier version must be
//! stopped first (docs/operations.md): they neither write nor look up the
//! digest.
//!
//! The servers compute the digest themselves (`SHA2` / `sha256`), the same
//! bytes as [`crate::key::key_digest`]; SQLite has no hash function, so its
//! rows are copied into a new table with digests computed here.

/// Rows the MySQL and SQLite backfills write per statement or transaction
/// (PostgreSQL's backfill is one statement).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
const BATCH: i64 = 10_000;

#[cfg(feature = "mysql")]
pub(super) mod mysql {
    use sqlx::mysql::MySql;
    use sqlx::{AssertSqlSafe, Pool};

    use super::BATCH;
    // MySQL has no transaction pooler here: statements are kept, as sqlx does.
    use crate::store::Pooling;

    /// The digest as MySQL computes it: SHA-256 over `biz`, a zero byte and
    /// `key`, its first 16 bytes.
    const DIGEST: &str = "UNHEX(LEFT(SHA2(CONCAT(biz_type, CHAR(0), idem_key), 256), 32))";

    const HAS_INDEX: &str = "SELECT COUNT(*) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_record' AND INDEX_NAME = ?";
    /// The last id of the next batch after `?`, if any row is left.
    const NEXT_BATCH: &str =
        "SELECT CAST(MAX(id) AS SIGNED) FROM (SELECT id FROM idem_record WHERE id > ? ORDER BY id LIMIT ?) AS batch";
    const HAS_COLUMN: &str = "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_record' AND COLUMN_NAME = 'key_digest'";

    async fn has_index(conn: &mut sqlx::MySqlConnection, name: &str) -> Result<bool, sqlx::Error> {
        let n: i64 = Pooling::Session.query_scalar(HAS_INDEX).bind(name).fetch_one(conn).await?;
        Ok(n > 0)
    }

    /// One statement per step (MySQL commits each DDL by itself), on one
    /// connection holding a named lock, so engines starting together
    /// migrate once. The backfill goes by primary-key ranges: each
    /// statement touches at most [`BATCH`] rows, however large the table.
    pub(in crate::store) async fn to_key_digest(pool: &Pool<MySql>) -> Result<(), sqlx::Error> {
        let mut conn = pool.acquire().await?;
        if has_index(&mut conn, "uk_idem_record_key_digest").await? {
            return Ok(());
        }
        let locked: Option<i64> =
            Pooling::Session.query_scalar("SELECT GET_LOCK('idem_record_upgrade', 3600)").fetch_one(&mut *conn).await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol("idem_record upgrade: another engine held the lock for an hour".into()));
        }
        let done = upgrade(&mut conn).await;
        let released = Pooling::Session.query("SELECT RELEASE_LOCK('idem_record_upgrade')").execute(&mut *conn).await;
        done.and(released.map(drop))
    }

    async fn upgrade(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        if has_index(conn, "uk_idem_record_key_digest").await? {
            return Ok(());
        }
        let columns: i64 = Pooling::Session.query_scalar(HAS_COLUMN).fetch_one(&mut *conn).await?;
        if columns == 0 {
            sqlx::raw_sql("ALTER TABLE idem_record ADD COLUMN key_digest BINARY(16) NULL AFTER id")
                .execute(&mut *conn)
                .await?;
        }
        // Batches by keyset: the next BATCH ids, however sparse, then
        // their rows; rows an engine inserted meanwhile come in later ones.
        let fill =
            format!("UPDATE idem_record SET key_digest = {DIGEST} WHERE id > ? AND id <= ? AND key_digest IS NULL");
        let mut done = 0_i64;
        loop {
            let upto: Option<i64> =
                Pooling::Session.query_scalar(NEXT_BATCH).bind(done).bind(BATCH).fetch_one(&mut *conn).await?;
            let Some(upto) = upto else { break };
            Pooling::Session.query(AssertSqlSafe(fill.clone())).bind(done).bind(upto).execute(&mut *conn).await?;
            done = upto;
        }
        let drop_old =
            if has_index(conn, "uk_idem_record_biz_key").await? { ", DROP INDEX uk_idem_record_biz_key" } else { "" };
        let alter = format!(
            "ALTER TABLE idem_record MODIFY key_digest BINARY(16) NOT NULL, \
             ADD UNIQUE KEY uk_idem_record_key_digest (key_digest){drop_old}"
        );
        sqlx::raw_sql(AssertSqlSafe(alter)).execute(&mut *conn).await.map(drop)
    }
}

#[cfg(feature = "postgres")]
pub(super) mod postgres {
    use sqlx::{PgConnection, Row};

    /// One transaction (the migration's, holding its lock): the table is
    /// either as before or migrated, never in between, also behind a
    /// pooler. The `UPDATE` writes a new version of every row; the old ones
    /// are left for vacuum.
    const STEPS: &str = "ALTER TABLE idem_record ADD COLUMN IF NOT EXISTS key_digest uuid;
        UPDATE idem_record SET key_digest = encode(substring(sha256(convert_to(biz_type, 'UTF8') || decode('00', 'hex') || convert_to(idem_key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid WHERE key_digest IS NULL;
        ALTER TABLE idem_record ALTER COLUMN key_digest SET NOT NULL,
            ADD CONSTRAINT uk_idem_record_key_digest UNIQUE (key_digest),
            DROP CONSTRAINT IF EXISTS uk_idem_record_biz_key";

    pub(in crate::store) async fn to_key_digest(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let row =
            sqlx::raw_sql("SELECT to_regclass('uk_idem_record_key_digest') IS NOT NULL").fetch_one(&mut *tx).await?;
        if row.try_get::<bool, _>(0)? {
            return Ok(());
        }
        sqlx::raw_sql(STEPS).execute(&mut *tx).await.map(drop)
    }
}

#[cfg(feature = "sqlite")]
pub(super) mod sqlite {
    use sqlx::{Sqlite, SqliteConnection};

    use super::BATCH;
    // SQLite has no pooler: statements are kept, as sqlx does.
    use crate::store::{Pooling, RowKey};

    const HAS_OLD_TABLE: &str = "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'idem_record' \
         AND NOT EXISTS (SELECT 1 FROM pragma_table_info('idem_record') WHERE name = 'key_digest')";
    /// The table's indexes go with it on a rename; dropped first, so the
    /// new table gets its own under the same names.
    const SET_ASIDE: &str = "DROP INDEX IF EXISTS idx_idem_record_biz_no;
        DROP INDEX IF EXISTS idx_idem_record_expires_at;
        ALTER TABLE idem_record RENAME TO idem_record_before_digest";
    const COPY: &str = "INSERT INTO idem_record (id, key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
         SELECT id, ?, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at \
         FROM idem_record_before_digest WHERE id = ?";

    /// A table-level `UNIQUE` cannot be dropped in SQLite: the rows move to
    /// a new table (created by `ddl`), in one transaction.
    pub(in crate::store) async fn to_key_digest(tx: &mut SqliteConnection, ddl: &str) -> Result<(), sqlx::Error> {
        let old: i64 = Pooling::Session.query_scalar(HAS_OLD_TABLE).fetch_one(&mut *tx).await?;
        if old == 0 {
            return Ok(());
        }
        sqlx::raw_sql(SET_ASIDE).execute(&mut *tx).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.to_owned())).execute(&mut *tx).await?;
        let mut after = i64::MIN;
        loop {
            let rows: Vec<(i64, String, String)> = Pooling::Session
                .query_as::<Sqlite, _>(
                    "SELECT id, biz_type, idem_key FROM idem_record_before_digest WHERE id > ? ORDER BY id LIMIT ?",
                )
                .bind(after)
                .bind(BATCH)
                .fetch_all(&mut *tx)
                .await?;
            let Some(&(last, ..)) = rows.last() else { break };
            for (id, biz, key) in &rows {
                Pooling::Session.query(COPY).bind(RowKey::new(biz, key).digest).bind(id).execute(&mut *tx).await?;
            }
            after = last;
        }
        sqlx::raw_sql("DROP TABLE idem_record_before_digest").execute(&mut *tx).await.map(drop)
    }
}
