//! The one table: every dimension users configure, the combinations that
//! cannot apply (with why), and the known defects. Every cell of the
//! matrix is a combination of one value per dimension, named by them
//! (`mysql::redis::join::record_errors::axum`).

use std::fmt;

/// Where the records live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// A file of its own per cell, WAL.
    Sqlite,
    /// MariaDB (`IDEM_MYSQL_URL`).
    Mysql,
    /// PostgreSQL (`IDEM_PG_URL`).
    Postgres,
    /// PostgreSQL behind a PgBouncer in transaction mode, the engine told
    /// so (`Builder::transaction_pooler(true)`).
    PgBouncer,
}

/// What keeps duplicates out before the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gate {
    /// No Redis: duplicates meet in memory and at the unique index.
    NoRedis,
    /// One Redis (`Builder::redis`).
    Redis,
    /// A three-master Redis Cluster (`Builder::redis_cluster`).
    Cluster,
    /// The local replay cache over one Redis (`Builder::local_cache`).
    LocalCache,
}

/// How the annotated fn runs its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The engine's own transaction.
    Plain,
    /// The caller's transaction (`join`): the caller opens it, calls, commits.
    Join,
    /// Two phases around an outside call (`steps`).
    Steps,
}

/// The attribute's options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Options {
    /// Neither.
    Defaults,
    /// `record_errors`: declared business errors are recorded and replayed.
    RecordErrors,
    /// `wait = "30s"`: a duplicate of a running call waits for its answer.
    Wait,
    /// Both.
    RecordErrorsWait,
}

/// How the call reaches the fn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry {
    /// The fn called from the test.
    Direct,
    /// An axum handler behind the `Idempotency-Key` extractor and the
    /// replay header, called in process (`tower::ServiceExt::oneshot`).
    Axum,
    /// A Redis Streams consumer runner: the transport that needs no server
    /// beyond the Redis every gate but one uses already, whose redelivery
    /// delay a runner sets (so one entry is one delivery in a cell), on
    /// the same consumer core as RabbitMQ, NATS and Kafka.
    Consumer,
    /// The cron runner on a manual clock, a job keyed by its slot.
    Cron,
}

impl Backend {
    pub const ALL: [Backend; 4] = [Backend::Sqlite, Backend::Mysql, Backend::Postgres, Backend::PgBouncer];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Mysql => "mysql",
            Backend::Postgres => "postgres",
            Backend::PgBouncer => "pgbouncer",
        }
    }
}

impl Gate {
    pub const ALL: [Gate; 4] = [Gate::NoRedis, Gate::Redis, Gate::Cluster, Gate::LocalCache];

    pub fn name(self) -> &'static str {
        match self {
            Gate::NoRedis => "no_redis",
            Gate::Redis => "redis",
            Gate::Cluster => "cluster",
            Gate::LocalCache => "local_cache",
        }
    }

    /// Whether the engine talks to Redis (and so whether Redis can fail it).
    pub fn has_redis(self) -> bool {
        self != Gate::NoRedis
    }
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Plain, Mode::Join, Mode::Steps];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Join => "join",
            Mode::Steps => "steps",
        }
    }
}

impl Options {
    pub const ALL: [Options; 4] = [Options::Defaults, Options::RecordErrors, Options::Wait, Options::RecordErrorsWait];

    pub fn name(self) -> &'static str {
        match self {
            Options::Defaults => "defaults",
            Options::RecordErrors => "record_errors",
            Options::Wait => "wait",
            Options::RecordErrorsWait => "record_errors_wait",
        }
    }

    pub fn record_errors(self) -> bool {
        matches!(self, Options::RecordErrors | Options::RecordErrorsWait)
    }

    pub fn wait(self) -> bool {
        matches!(self, Options::Wait | Options::RecordErrorsWait)
    }
}

impl Entry {
    pub const ALL: [Entry; 4] = [Entry::Direct, Entry::Axum, Entry::Consumer, Entry::Cron];

    pub fn name(self) -> &'static str {
        match self {
            Entry::Direct => "direct",
            Entry::Axum => "axum",
            Entry::Consumer => "consumer",
            Entry::Cron => "cron",
        }
    }
}

/// One cell: a value of each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Combo {
    pub backend: Backend,
    pub gate: Gate,
    pub mode: Mode,
    pub options: Options,
    pub entry: Entry,
}

impl Combo {
    /// Each dimension's value as its index in that dimension: what the
    /// slice covers.
    pub fn values(self) -> [usize; 5] {
        fn at<T: PartialEq>(all: &[T], value: T) -> usize {
            all.iter().position(|v| *v == value).expect("a value of its dimension")
        }
        [
            at(&Backend::ALL, self.backend),
            at(&Gate::ALL, self.gate),
            at(&Mode::ALL, self.mode),
            at(&Options::ALL, self.options),
            at(&Entry::ALL, self.entry),
        ]
    }
}

/// The test's name: the values, outermost first.
impl fmt::Display for Combo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}::{}::{}::{}::{}",
            self.backend.name(),
            self.gate.name(),
            self.mode.name(),
            self.options.name(),
            self.entry.name()
        )
    }
}

/// Combinations that cannot apply, with why: not generated.
pub fn excluded(combo: Combo) -> Option<&'static str> {
    match (combo.mode, combo.options.record_errors()) {
        (Mode::Steps, true) => Some(
            "`steps` with `record_errors` is refused at compile time: a steps body declares a final failure \
             with `Steps::permanent` (clause 6 in steps mode), which needs no option",
        ),
        _ => None,
    }
}

/// Cells that fail today for a defect of the crate, with a one-line reason:
/// run in the whole matrix, left out of CI's slice until fixed. None today.
pub fn known_defect(combo: Combo) -> Option<&'static str> {
    let _ = combo;
    None
}

/// Every cell of the matrix, in table order.
pub fn cells() -> Vec<Combo> {
    let mut cells = Vec::new();
    for backend in Backend::ALL {
        for gate in Gate::ALL {
            for mode in Mode::ALL {
                for options in Options::ALL {
                    for entry in Entry::ALL {
                        let combo = Combo { backend, gate, mode, options, entry };
                        if excluded(combo).is_none() {
                            cells.push(combo);
                        }
                    }
                }
            }
        }
    }
    cells
}

/// The number of combinations before exclusions.
pub fn combinations() -> usize {
    Backend::ALL.len() * Gate::ALL.len() * Mode::ALL.len() * Options::ALL.len() * Entry::ALL.len()
}
