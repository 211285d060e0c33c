//! How the record table finds a key: by a fixed-width digest of `(biz, key)`
//! (`key_digest`, the unique column), the full key kept beside it and
//! checked by every statement that finds a row.
//!
//! Why a digest: the unique index is the one every first call writes to at
//! a random place. Keyed by `(biz_type, idem_key)` it spent 86-89 bytes per
//! live record, and once it outgrew the buffer pool each insert read a page
//! from disk. Sixteen bytes per entry (MariaDB `BINARY(16)`, PostgreSQL
//! `uuid`, SQLite `BLOB`) make it about half that (47 and 40 bytes measured),
//! and its size is known from the count of live records alone.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;

/// `key_digest`: [`crate::key::key_digest`] of a record's `(biz, key)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyDigest([u8; 16]);

impl KeyDigest {
    /// The 16 bytes, as a text writes them (`store::text`).
    pub(crate) fn bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

/// A record's key as the table finds it: the digest for the index, the
/// full key for the check.
#[derive(Debug, Clone, Copy)]
pub struct RowKey<'a> {
    pub biz: &'a str,
    pub key: &'a str,
    pub(crate) digest: KeyDigest,
}

impl<'a> RowKey<'a> {
    pub(crate) fn new(biz: &'a str, key: &'a str) -> Self {
        RowKey { biz, key, digest: KeyDigest(crate::key::key_digest(biz, key)) }
    }

    /// The digest's bytes (also the call's field in Redis: `gate::redis::layout`,
    /// the only reader, hence the feature).
    #[cfg(feature = "redis")]
    pub(crate) fn digest_bytes(&self) -> [u8; 16] {
        self.digest.0
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use sqlx::mysql::{MySql, MySqlTypeInfo};
    use sqlx::{Encode, Type};

    use super::{BoxDynError, IsNull, KeyDigest};

    /// `BINARY(16)`, sent as bytes.
    impl Type<MySql> for KeyDigest {
        fn type_info() -> MySqlTypeInfo {
            <[u8] as Type<MySql>>::type_info()
        }
    }

    impl Encode<'_, MySql> for KeyDigest {
        fn encode_by_ref(&self, buf: &mut Vec<u8>) -> Result<IsNull, BoxDynError> {
            <&[u8] as Encode<MySql>>::encode(&self.0[..], buf)
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use sqlx::postgres::types::Oid;
    use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo, Postgres};
    use sqlx::{Encode, Type};

    use super::{BoxDynError, IsNull, KeyDigest};

    /// PostgreSQL's `uuid`, whose binary form is the 16 bytes themselves: a
    /// fixed-width index entry (a `bytea` would add a length byte and
    /// round the entry up to the next 8 bytes).
    const UUID: Oid = Oid(2950);

    impl Type<Postgres> for KeyDigest {
        fn type_info() -> PgTypeInfo {
            PgTypeInfo::with_oid(UUID)
        }
    }

    impl Encode<'_, Postgres> for KeyDigest {
        fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
            buf.extend_from_slice(&self.0);
            Ok(IsNull::No)
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use sqlx::sqlite::{Sqlite, SqliteArgumentsBuffer, SqliteTypeInfo};
    use sqlx::{Encode, Type};

    use super::{BoxDynError, IsNull, KeyDigest};

    /// A 16-byte `BLOB`.
    impl Type<Sqlite> for KeyDigest {
        fn type_info() -> SqliteTypeInfo {
            <[u8] as Type<Sqlite>>::type_info()
        }
    }

    impl Encode<'_, Sqlite> for KeyDigest {
        fn encode_by_ref(&self, buf: &mut SqliteArgumentsBuffer) -> Result<IsNull, BoxDynError> {
            <Vec<u8> as Encode<Sqlite>>::encode(self.0.to_vec(), buf)
        }
    }
}
