//! Guards the call's tracing span: one `idem` span per call, with `biz`,
//! `key` and `outcome` (`executed`, `replayed`, `key_reused`, `failed`), and
//! never the raw arguments or a rejected key.

use idempotency::{Idem, idempotent};
use idempotency_testkit::logs::Logs;
use sqlx::Sqlite;

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
struct Failure(idempotency::Error);

impl From<idempotency::Error> for Failure {
    fn from(e: idempotency::Error) -> Self {
        Failure(e)
    }
}

#[idempotent(key = "acct_<account>", ttl = "1h", biz = "t_span")]
async fn transfer(idem: &Idem<Sqlite>, account: String, secret_note: String) -> Result<u32, Failure> {
    Ok(secret_note.len() as u32)
}

#[tokio::test]
async fn each_call_has_one_span_with_its_outcome_and_no_arguments() {
    let idem = Idem::sqlite_memory().await.unwrap();
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.clone());

    transfer(&idem, "a1".into(), "s3cr3t-31337".into()).await.unwrap();
    transfer(&idem, "a1".into(), "s3cr3t-31337".into()).await.unwrap();
    transfer(&idem, "a1".into(), "other-s3cr3t".into()).await.unwrap_err();
    transfer(&idem, "bad key\r\n".into(), "s3cr3t-31337".into()).await.unwrap_err();

    let spans = logs.spans();
    let idem_spans: Vec<_> = spans.iter().filter(|(name, _)| name == "idem").map(|(_, f)| f).collect();
    let seen: Vec<(&str, &str, &str)> = idem_spans
        .iter()
        .map(|f| (f["biz"].as_str(), f["key"].as_str(), f.get("outcome").map_or("", String::as_str)))
        .collect();
    assert_eq!(
        seen,
        [
            ("t_span", "acct_a1", "executed"),
            ("t_span", "acct_a1", "replayed"),
            ("t_span", "acct_a1", "key_reused"),
            ("t_span", "<invalid>", "rejected"),
        ]
    );
    for (_, fields) in &spans {
        for value in fields.values() {
            assert!(!value.contains("s3cr3t") && !value.contains("bad key"), "logged: {value}");
        }
    }
}
