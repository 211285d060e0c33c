//! The command line, as clap reads it; every command's help ends with examples.

use clap::{Args, Parser, Subcommand, ValueEnum};

const EXAMPLES: &str = "\
Examples:
  export IDEM_DATABASE_URL=mysql://root@127.0.0.1:3306/shop IDEM_REDIS_URL=redis://127.0.0.1:6379
  idem status pay order_42_pay
  idem show pay order_42_pay --json
  idem list --biz pay --state processing --older-than 10m
  idem forget pay order_42_pay
  idem purge --batch 5000
  idem reconcile --biz pay --table payments --column order_no --record-field biz_no
  idem doctor

Exit codes: 0 done (reconcile: nothing found; doctor: no check failed); 1
reconcile found something, a doctor's check failed, or forget was not
confirmed; 2 usage (including a refused table or column name, and a URL of a
driver this build lacks); 3 the database or Redis failed (doctor: never, it
reports them as checks).

Text from requests, the database or Redis is shown with control and bidi
characters escaped (\\n, \\u{1b}, \\u{202e}; a backslash as \\\\); --json escapes
them as JSON does (\\u001b).";

/// Operate the records of `idempotency`: see where a call stands, forget one so it
/// runs again, purge expired records, reconcile records with a business
/// table, and check a deployment.
#[derive(Debug, Parser)]
#[command(name = "idem", version, after_help = EXAMPLES)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// The settings every command takes, from a flag or else from the
/// environment. Clap is not told about the variables (no `env`): it would
/// show a value taken from one in its usage lines as if typed, and the tool
/// must know which of the two a value came from to name it in a message.
#[derive(Debug, Args)]
pub struct Global {
    /// The record store: a mysql://, postgres:// or sqlite: URL [env: IDEM_DATABASE_URL]
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// The Redis of the claims and cached results (optional) [env: IDEM_REDIS_URL]
    #[arg(long, global = true, value_name = "URL")]
    pub redis_url: Option<String>,
    /// The namespace of the Redis keys (`idem:{<namespace>.<shard>}:...`),
    /// if the application sets one; by default the one in table `idem_meta`
    /// [env: IDEM_REDIS_NAMESPACE]
    #[arg(long, global = true)]
    pub namespace: Option<String>,
    /// PostgreSQL only: the database is reached through a pooler in
    /// transaction mode (PgBouncer, RDS Proxy, Supavisor). Statements then
    /// go unnamed, each in a transaction of its own [env: IDEM_TRANSACTION_POOLER]
    #[arg(long, global = true)]
    pub transaction_pooler: bool,
}

/// A setting's value and where it came from (`--database-url` or
/// `IDEM_DATABASE_URL`), which messages about it name.
#[derive(Debug, Clone)]
pub struct Given {
    pub value: String,
    pub from: &'static str,
}

impl Global {
    pub fn database_url(&self) -> Result<Option<Given>, String> {
        given(&self.database_url, "--database-url", "IDEM_DATABASE_URL")
    }

    pub fn redis_url(&self) -> Result<Option<Given>, String> {
        given(&self.redis_url, "--redis-url", "IDEM_REDIS_URL")
    }

    pub fn namespace(&self) -> Result<Option<Given>, String> {
        given(&self.namespace, "--namespace", "IDEM_REDIS_NAMESPACE")
    }

    /// The flag, or `IDEM_TRANSACTION_POOLER` read as clap reads a boolean
    /// (`1`, `true`, `yes`, `on`, ... or `0`, `false`, `no`, `off`, ...).
    pub fn transaction_pooler(&self) -> Result<bool, String> {
        if self.transaction_pooler {
            return Ok(true);
        }
        let Some(set) = given(&None, "--transaction-pooler", "IDEM_TRANSACTION_POOLER")? else { return Ok(false) };
        match set.value.to_ascii_lowercase().as_str() {
            "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
            "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
            _ => Err(format!("IDEM_TRANSACTION_POOLER: {:?} is not a boolean (1 or 0, true or false)", set.value)),
        }
    }
}

/// The flag's value if typed, else the variable's; an empty variable is
/// unset.
fn given(typed: &Option<String>, flag: &'static str, var: &'static str) -> Result<Option<Given>, String> {
    if let Some(value) = typed {
        return Ok(Some(Given { value: value.clone(), from: flag }));
    }
    match std::env::var(var) {
        Ok(value) if value.is_empty() => Ok(None),
        Ok(value) => Ok(Some(Given { value, from: var })),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{var} is not valid UTF-8")),
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Where a call stands: completed, in_progress, expired or absent.
    #[command(after_help = "Example:\n  idem status pay order_42_pay\n  idem status pay order_42_pay --json")]
    Status {
        #[command(flatten)]
        id: CallId,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// A call's record (stored response, expiry) and its Redis entry.
    #[command(after_help = "Example:\n  idem show pay order_42_pay\n  idem show pay order_42_pay --json")]
    Show {
        #[command(flatten)]
        id: CallId,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The records of one biz, oldest first.
    #[command(after_help = "Example:\n  idem list --biz pay --state processing --older-than 10m --limit 20")]
    List {
        /// The biz (as in `#[idempotent(biz = ...)]`).
        #[arg(long)]
        biz: String,
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<State>,
        /// Only records created at least this long ago (`30s`, `10m`, `2h`, `1d`).
        #[arg(long, value_name = "DURATION")]
        older_than: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Deletes a call's record and its Redis entry, so the next call runs
    /// again. Asks first unless --yes; prints what it removed.
    #[command(after_help = "Example:\n  idem forget pay order_42_pay\n  idem forget pay order_42_pay --yes")]
    Forget {
        #[command(flatten)]
        id: CallId,
        /// Do not ask.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Creates the tables if absent and brings a record table of an earlier
    /// version to this one's form (what an engine does when it starts).
    #[command(after_help = "Example:\n  idem migrate")]
    Migrate,
    /// Deletes expired records (of every biz, as an engine's own purge
    /// does: an expired record counts as absent), a batch at a time, until
    /// none is left; says first how many of each biz are expired.
    #[command(after_help = "Example:\n  idem purge\n  idem purge --batch 5000")]
    Purge {
        /// What `idem purge` deletes anyway: accepted for the scripts of
        /// earlier versions, which required it.
        #[arg(long, hide = true)]
        expired: bool,
        /// Rows per statement.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
    /// Compares the records of a biz with a business table: records without
    /// a business row, business rows without a record, records stuck in
    /// processing. Exits 1 when anything is found.
    #[command(
        after_help = "Example:\n  idem reconcile --biz pay --table payments --column order_no --record-field biz_no\n  \
                            idem reconcile --biz pay --table billing.payments --column order_no --json\n\n\
                            Table and column are SQL identifiers ([A-Za-z_][A-Za-z0-9_]{0,63}; the table\n\
                            optionally schema.table), quoted in the query and matched exactly as given."
    )]
    Reconcile {
        /// The biz whose records are compared.
        #[arg(long)]
        biz: String,
        /// The business table.
        #[arg(long)]
        table: String,
        /// Its column holding what the records hold in --record-field.
        #[arg(long)]
        column: String,
        /// The record's column compared with it.
        #[arg(long, value_enum, default_value_t = RecordField::IdemKey)]
        record_field: RecordField,
        /// A record in processing longer than this is stuck.
        #[arg(long, value_name = "DURATION", default_value = "10m")]
        stuck_after: String,
        /// At most this many of each kind are listed (all are counted).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Checks a deployment against what the engines need, a line per check
    /// (ok, warning or failure, what it found and the fix): the tables, a
    /// transaction pooler, the clocks, the database's and Redis's settings,
    /// expired records not purged, outbox events dead or stuck. Exits 1 when
    /// a check fails (with --strict, also when one warns).
    #[command(after_help = DOCTOR_EXAMPLES)]
    Doctor(DoctorArgs),
}

const DOCTOR_EXAMPLES: &str = "\
Examples:
  idem doctor
  idem doctor --json
  idem doctor --max-result-bytes 4194304 --lock-wait 2s --lease 1m --purge-every 1h
  idem --transaction-pooler doctor

Redis is checked when --redis-url / IDEM_REDIS_URL is given; for a Redis Cluster,
any node's URL (the doctor finds the others). The engines' own settings, which
the servers' are compared with, are the flags above: give yours where they are
not the defaults.";

/// What `idem doctor` cannot read from the servers: the engines' own
/// settings, which its checks compare the servers' with, and how old a
/// backlog may grow.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Warnings fail too (exit 1).
    #[arg(long)]
    pub strict: bool,
    /// The engines' `Builder::max_result_bytes` (MySQL/MariaDB: checked
    /// against `max_allowed_packet`).
    #[arg(long, value_name = "BYTES", default_value_t = idempotency_runtime::DEFAULT_MAX_RESULT_BYTES)]
    pub max_result_bytes: usize,
    /// The engines' `Builder::lock_wait` (MySQL: checked against
    /// `innodb_lock_wait_timeout`; PostgreSQL: against `lock_timeout`).
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    pub lock_wait: String,
    /// The longest `lease` of your fns (PostgreSQL: checked against
    /// `idle_in_transaction_session_timeout`).
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    pub lease: String,
    /// How often your purge runs (`Idem::purge_expired`, `idem purge`):
    /// records expired longer ago than this are a backlog.
    #[arg(long, value_name = "DURATION", default_value = "1d")]
    pub purge_every: String,
    /// An outbox event pending longer than this is stuck.
    #[arg(long, value_name = "DURATION", default_value = "10m")]
    pub outbox_stuck_after: String,
}

/// One call: its biz and key.
#[derive(Debug, Args)]
pub struct CallId {
    /// The biz (as in `#[idempotent(biz = ...)]`).
    pub biz: String,
    /// The rendered key.
    pub key: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum State {
    Processing,
    Succeeded,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecordField {
    /// The rendered key.
    #[value(name = "idem_key")]
    IdemKey,
    /// The business number (`biz_no = "..."` in the attribute).
    #[value(name = "biz_no")]
    BizNo,
}

impl RecordField {
    pub fn name(self) -> &'static str {
        match self {
            RecordField::IdemKey => "idem_key",
            RecordField::BizNo => "biz_no",
        }
    }
}
