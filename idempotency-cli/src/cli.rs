//! The command line, as clap reads it; every command's help ends with examples.

use clap::{Args, Parser, Subcommand, ValueEnum};

const EXAMPLES: &str = "\
Examples:
  export IDEM_DATABASE_URL=mysql://root@127.0.0.1:3306/shop IDEM_REDIS_URL=redis://127.0.0.1:6379
  idem status pay order_42_pay
  idem show pay order_42_pay --json
  idem list --biz pay --state processing --older-than 10m
  idem forget pay order_42_pay
  idem purge --expired --batch 5000
  idem reconcile --biz pay --table payments --column order_no --record-field biz_no

Exit codes: 0 done (reconcile: nothing found); 1 reconcile found something, or
forget was not confirmed; 2 usage (including a refused table or column name);
3 the database or Redis failed.";

/// Operate the records of `idempotency`: see where a call stands, forget one so it
/// runs again, purge expired records, and reconcile records with a business
/// table.
#[derive(Debug, Parser)]
#[command(name = "idem", version, after_help = EXAMPLES)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// The record store: mysql://, postgres:// or sqlite: URL.
    #[arg(long, env = "IDEM_DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// The Redis of the claims and cached results (optional).
    #[arg(long, env = "IDEM_REDIS_URL", global = true, hide_env_values = true)]
    pub redis_url: Option<String>,
    /// The namespace of the Redis keys (`idem:{<namespace>.<shard>}:...`),
    /// if the application sets one; by default the one in table `idem_meta`.
    #[arg(long, env = "IDEM_REDIS_NAMESPACE", global = true, hide_env_values = true)]
    pub namespace: Option<String>,
    /// PostgreSQL only: the database is reached through a pooler in
    /// transaction mode (PgBouncer, RDS Proxy, Supavisor). Statements then
    /// go unnamed, each in a transaction of its own.
    #[arg(
        long,
        env = "IDEM_TRANSACTION_POOLER",
        global = true,
        hide_env_values = true,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub transaction_pooler: bool,
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
    /// Deletes expired records, a batch at a time, until none is left.
    #[command(after_help = "Example:\n  idem purge --expired --batch 5000")]
    Purge {
        /// Required: what is purged.
        #[arg(long, required = true)]
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
