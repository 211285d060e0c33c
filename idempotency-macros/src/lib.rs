//! The `#[idempotent]` attribute and `#[derive(State)]`. Use them through
//! the `idempotency` crate, whose documentation of [`idempotent`] is the reference.
//!
//! Pipeline: `attr` parses the arguments, `key` the key template, `ttl`
//! the durations, `sig` checks the fn against them, `expand` writes code
//! (`async_trait` first takes a method `#[async_trait]` expanded back to an
//! `async fn`, and boxes the result again).
//! `state` parses, checks and writes the derive.

use proc_macro::TokenStream;

mod async_trait;
mod attr;
mod expand;
mod key;
mod sig;
mod state;
mod ttl;

/// Makes an `async fn` run once per business action.
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
/// async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64, amount: i64)
///     -> Result<Receipt, PayError>
/// { ... }
///
/// let receipt = pay(&idem, 42, 1999).await?; // no transaction: the engine supplies it
/// ```
///
/// # Arguments
///
/// Written `name = "value"`, or a bare word for the flags (`steps`, `join`,
/// `record_errors`), in any order, each at most once.
///
/// | argument | required | meaning |
/// |---|---|---|
/// | `key = "order_<order_id>_pay"` | yes | the key template, rendered per call (see [Key templates](#key-templates)) |
/// | `ttl = "24h"` | yes | how long the record protects the key (see [Durations](#durations)); afterwards the next call executes again |
/// | `biz = "pay"` | yes | the business action, `[a-z0-9_]{1,32}`; keys are unique per `(biz, key)` |
/// | `lease = "30s"` | no | how long the Redis claim (or, with `steps`, the phase-one lease) lives while the body runs; default 30 s. Not with `join` |
/// | `biz_no = "<order_id>"` | no | a business number stored with the record, for reconciliation (`idem reconcile`): a template like `key`'s, at most 64 bytes rendered, else `idempotency::Error::BizNoTooLong` and nothing is written |
/// | `engine = self.idem` | no | where the engine comes from when it is not a parameter of type `&Idem<DB>`: any expression that is, or derefs through `AsRef` to, an `Idem<DB>` (`app.idem`, `self.idem`, an `Arc<Idem<DB>>`) |
/// | `crate = "my_idem"` | no | the path to the `idempotency` crate, when it is renamed or re-exported; default `::idempotency` (see [below](#reaching-idempotency-by-another-path)) |
/// | `wait = "5s"` | no | how long a duplicate that meets this fn's call still running waits for its answer (that call's value, or its recorded error) before `idempotency::Error::InProgress` (HTTP 409); `"0s"`: not at all. Default: the engine's, `Builder::wait` (zero unless set) |
/// | `record_errors` | no | the errors the fn's error type declares final (it implements `idempotency::BusinessError`: "declined", "insufficient funds") are recorded like a value, and every duplicate gets the same `Err` (see [Return type](#return-type)). Not with `steps` |
/// | `steps` | no | the two-phase mode for calls to outside services: the body takes the step context `steps: &mut idempotency::Steps<DB>` in place of the transaction (see [below](#calls-to-outside-services-steps)). Not with `join` or `record_errors` |
/// | `join` | no | the body joins the transaction the *caller* passes, in a savepoint; the record commits when the caller commits (see [below](#joining-the-callers-transaction-join)). Not with `steps` or `lease` |
///
/// And on a parameter of the fn:
///
/// | parameter option | meaning |
/// |---|---|
/// | `#[idem(skip)]` | the parameter is left out of the fingerprint (a client, a clock, a trace id): the same key with another value of it replays; it need not implement `Serialize` |
/// | `#[idem(skip_if_default)]` | the parameter is left out of the fingerprint while its JSON is that of its `Default` (`None`, `0`, `false`, `""`, empty), and counts otherwise: for a parameter *added* to a fn that calls were already made with (see [Deploying changes](#deploying-changes)). Its type is `Serialize + Default`; not with `skip` |
///
/// A full call, every optional argument used (`steps` and `join` are modes
/// of their own, below):
///
/// ```ignore
/// #[idempotent(
///     key = "<user>:<idem_key>",  // rendered from the parameters below
///     ttl = "24h",
///     biz = "http_pay",
///     biz_no = "<order_id>",      // stored beside the key, for `idem reconcile`
///     lease = "10s",
///     engine = app.idem,          // the engine is in the handler's state
///     wait = "5s",                // a double click gets the first call's answer, not a 409
///     record_errors,              // a declined payment is an answer: recorded, replayed
///     crate = "idempotency",      // the default, written out
/// )]
/// async fn pay(
///     State(app): State<App>,
///     tx: &mut Transaction<'_, MySql>,          // the engine's: callers never pass it
///     UserId(user): UserId,
///     IdempotencyKey(idem_key): IdempotencyKey,
///     Path(order_id): Path<i64>,
///     Json(req): Json<PayReq>,
///     #[idem(skip)] trace: TraceId,             // not part of the fingerprint
///     #[idem(skip_if_default)] coupon: Option<Coupon>, // added later: `None` hashes as before it existed
/// ) -> Result<PayResponse, PayError> { ... }    // PayError: BusinessError
/// ```
///
/// # Key templates
///
/// Literal text plus placeholders: `<param>` renders a parameter with `Display`,
/// `<param.field.field>` one of its fields (also through patterns such as
/// `Json(req): Json<PayReq>`, where `req` is the name). The literal text may use
/// only `A-Z a-z 0-9 _ . : -`. The rendered key must obey the same rule and be
/// 1..=255 bytes long, or the call fails with `idempotency::Error::InvalidKey` and
/// writes nothing: keys are never escaped, trimmed or hashed, since that could
/// merge two distinct keys.
///
/// # Durations
///
/// A number and a unit, repeated: `ms`, `s`, `m`, `h`, `d`, e.g. `"500ms"`,
/// `"30s"`, `"15m"`, `"24h"`, `"7d"`, `"1h30m"`. Zero is refused, and so is
/// anything longer than 100 years (`"36500d"`).
///
/// # Reaching `idempotency` by another path
///
/// The generated code names the runtime through absolute paths
/// (`::idempotency::__private::run`, `::idempotency::Idem`). When the dependency is renamed
/// in `Cargo.toml` (`my_idem = { package = "idem", .. }`), or a crate of
/// yours re-exports it so its users need no direct dependency, say where it
/// is, as a string holding a path (as with tokio's and serde's `crate`):
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", crate = "my_idem")]
/// // or, through a re-export: `pub use idempotency;` in `my_platform`
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", crate = "my_platform::idempotency")]
/// ```
///
/// Any module path works (`crate::deps::idempotency`, `::my_idem`), resolved where
/// the fn is written; generic arguments are refused at compile time.
///
/// # Parameters
///
/// - The engine: the parameter of type `&Idem<DB>`, or the `engine` expression
///   (anything that is, or derefs through `AsRef` to, an `Idem<DB>`: `Idem`,
///   `&Idem`, `Arc<Idem>`).
/// - The transaction: a parameter of type `&mut sqlx::Transaction<'_, DB>`.
///   It is removed from the signature; the engine opens the transaction, the
///   body runs in it together with the record insert, and it commits once.
///   A fn may have no transaction parameter. With `join` it stays: the
///   caller passes its own (see below).
/// - Every other parameter is part of the fingerprint (SHA-256 of a canonical
///   JSON object keyed by parameter name, keys sorted at every depth) and must
///   implement `serde::Serialize`, unless marked `#[idem(skip)]`. The same key
///   with another fingerprint is `idempotency::Error::KeyReused`. A parameter the
///   `engine` expression starts from (`app` in `app.idem`) is left out
///   automatically.
/// - `#[idem(skip_if_default)]` on a parameter (its type `Serialize + Default`)
///   leaves it out of the fingerprint while its JSON is that of its
///   `Default` (`None`, `0`, `false`, `""`, empty), and counts it otherwise.
///   It is for parameters *added* to a fn that calls were already made with:
///   see below.
///
/// # Deploying changes
///
/// A retry that reaches the fn after a deploy is checked against the record
/// the fn wrote before it. Safe for those calls: reordering parameters (the
/// document is keyed by name), giving one a type with the same JSON, changing
/// `ttl` (it applies to new records only), and adding a parameter marked
/// `#[idem(skip_if_default)]` that the retry passes at its default:
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
/// async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64, amount: i64,
///     #[idem(skip_if_default)] coupon: Option<String>, // added: `None` hashes as before it existed
/// ) -> Result<Receipt, PayError>
/// ```
///
/// Not safe: adding a parameter without the marker (even passed as `None`),
/// renaming or removing one, or marking one that already existed
/// (`KeyReused`); another `key` template or `biz` (another record: the body
/// runs again). The stored result must still deserialize as the new return
/// type (add fields as `Option` or `#[serde(default)]`, keep old names with
/// `#[serde(alias = "...")]`), or a replay is `idempotency::Error::Replay`. The
/// table, with the test of each case: `docs/guarantees.md`, "Deploying changes".
///
/// # Return type
///
/// `Result<T, E>` with `T: Serialize + DeserializeOwned` (stored as JSON and
/// replayed to duplicates) and `E: From<idempotency::Error>` (the engine's
/// answers: `InProgress`, `KeyReused`, `Storage`, ...).
///
/// An `Err` from the body rolls its writes back and records nothing: the
/// next call with the key runs the body again. With `record_errors`, an `Err`
/// that `E`'s `idempotency::BusinessError` impl declares final (its `recorded`
/// answers `Some`) is the call's answer instead: the body's own writes roll
/// back, the record commits holding that error, and every duplicate gets the
/// same `Err` (over HTTP, the same status and body, marked
/// `Idempotent-Replayed: true`) without the body running again. Every other
/// `Err` (a database failure, anything `recorded` answers `None` for) is
/// not recorded, as without `record_errors`.
///
/// ```ignore
/// #[derive(Clone, Serialize, Deserialize)]
/// struct Declined { reason: String }
///
/// enum PayError { Declined(Declined), Idem(idempotency::Error) } // + From<idempotency::Error>
///
/// impl idempotency::BusinessError for PayError {
///     type Record = Declined; // what is stored and replayed
///     fn recorded(&self) -> Option<Declined> {
///         match self { PayError::Declined(d) => Some(d.clone()), PayError::Idem(_) => None }
///     }
///     fn replayed(record: Declined) -> Self { PayError::Declined(record) }
/// }
///
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", record_errors)]
/// async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64, amount: i64)
///     -> Result<Receipt, PayError>
/// {
///     if amount > LIMIT { return Err(PayError::Declined(Declined { reason: "over the limit".into() })); }
///     ...
/// }
/// ```
///
/// Without the impl, `record_errors` is refused at compile time on the
/// return type. A whole HTTP handler that declines (its 402 and the replay):
/// the HTTP guide, "A declined payment".
///
/// The body's future must be `Send`, as `#[async_trait]` asks by default
/// (and tokio's `spawn`, axum and tonic after it): the call flow takes it
/// boxed, so that flow is built once per backend and not once per fn. An
/// `Rc` held across an `.await` is refused at compile time, pointing at it.
///
/// # Calls to outside services (`steps`)
///
/// A body that calls a payment provider, sends an e-mail or calls another
/// service makes each such call a named step, and its local writes in one
/// final transaction:
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_charge", ttl = "24h", biz = "charge", steps)]
/// async fn charge(
///     idem: &Idem<MySql>,
///     steps: &mut Steps<MySql>,
///     #[idem(skip)] provider: &Provider,
///     order_id: u64,
///     amount: i64,
/// ) -> Result<Receipt, ChargeError> {
///     let charge: Charge = steps.step("charge", |step_key| provider.charge(step_key, amount)).await?;
///     let tx = steps.transaction().await?; // opens after the steps
///     sqlx::query("INSERT INTO payment (order_id, charge_id) VALUES (?, ?)")
///         .bind(order_id).bind(&charge.id).execute(&mut **tx).await?;
///     Ok(Receipt { order_id, charge_id: charge.id })
/// }
/// ```
///
/// Phase one commits a `processing` record with a fencing token and a lease
/// (`lease`, default 30 s) before the body runs; each step's result is
/// recorded as soon as the service answers and replayed on a retry; the
/// final transaction commits only while the fencing token is still this
/// call's. `step_key` is the same in every attempt: send it to the service
/// as its idempotency key, since a step whose answer was never recorded (the
/// process died) is called again with it. A transaction parameter is refused
/// in this mode: the transaction opens after the steps
/// (`steps.transaction()`), so none stays open across an outside call. See
/// `idempotency::steps` for phases, fencing, takeover and recovery.
///
/// # Joining the caller's transaction (`join`)
///
/// A service layer that opens one transaction and calls several operations
/// in it passes that transaction on:
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", join)]
/// async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64, amount: i64)
///     -> Result<Receipt, PayError>
/// { ... }
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("SELECT status FROM orders WHERE id = ? FOR UPDATE").bind(42).execute(&mut *tx).await?;
/// let receipt = pay(&idem, &mut tx, 42, 1999).await?; // the caller passes it
/// ship(&mut tx, 42).await?;
/// tx.commit().await?; // the record commits here, or not at all
/// ```
///
/// The record goes into the caller's transaction first, inside a savepoint
/// around the body: a body that fails (or panics, or whose call is dropped)
/// rolls back its own writes only, the caller's stay; the record commits
/// when, and only if, the caller commits. So `Ok` means "done in your
/// transaction", not "committed": a caller that rolls back (or whose commit
/// fails) leaves no record, and the next call executes. The body runs on
/// the caller's connection, so rows the caller locked (`FOR UPDATE`) never
/// block it.
///
/// Nothing goes to Redis or the local cache, since this call never learns
/// whether the caller commits: no claim, no cached result (a committed
/// result already in the local cache does answer). A duplicate in another
/// transaction waits on the record's unique index (bounded by
/// `Builder::lock_wait`) and replays the result once the caller commits, or
/// answers `idempotency::Error::InProgress` past the bound; the bound never stays
/// on the caller's session. The same key called again in the same
/// transaction replays the first result. The transaction must be on the
/// engine's database: the record is written where the transaction is.
///
/// # Methods of `#[async_trait]` impls
///
/// `#[idempotent]` works on the methods of an `#[async_trait]` impl (tonic
/// services are written this way, with `#[tonic::async_trait]`), `&self`
/// and `engine = self.idem` included. `#[async_trait]` stays on the impl
/// and `#[idempotent]` goes on the method: async-trait expands first and
/// `#[idempotent]` rewrites the future inside the boxed one it wrote. The
/// trait declares the method as callers call it, so without the engine's
/// transaction (with `join`, with the caller's):
///
/// ```ignore
/// #[async_trait]
/// trait Payments {
///     async fn pay(&self, order_id: u64) -> Result<Receipt, PayError>;
/// }
///
/// #[async_trait]
/// impl Payments for Service {
///     #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = self.idem)]
///     async fn pay(&self, tx: &mut Transaction<'_, MySql>, order_id: u64) -> Result<Receipt, PayError> { ... }
/// }
/// ```
///
/// `#[idempotent]` on the impl itself is refused with an error that says
/// where it goes. Native `async fn` in traits needs nothing special.
///
/// # The same code without the attribute
///
/// ```ignore
/// async fn pay(idem: &Idem<MySql>, order_id: u64, amount: i64) -> Result<Receipt, PayError> {
///     const SPEC: idempotency::__private::Spec = /* biz, ttl, lease */;
///     let key = format!("order_{}_pay", &order_id);
///     let fingerprint = Fingerprint::new().arg("order_id", &order_id).arg("amount", &amount);
///     let mut body = idempotency::__private::Body::new(move |mut tx| async move {
///         let out: Result<Receipt, PayError> = {
///             let tx: &mut Transaction<'_, MySql> = &mut tx;
///             async move { /* the body */ }.await
///         };
///         (tx, out)
///     });
///     let ended = idempotency::__private::run(idem, &SPEC, key, fingerprint, None, &mut body).await;
///     body.answer(ended)
/// }
/// ```
///
/// `run` takes the body behind `dyn` and is generic over the backend only:
/// the call flow is built once per backend, not once per fn (a debug build
/// links to the copy built in `idempotency-runtime`). What each fn adds is
/// its body, its result's JSON and `Body::answer`: `benches/expansion.rs` measures it.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}

/// Declares a state column and its allowed transitions (layer 4); see
/// `idempotency::state` for the reference.
///
/// ```ignore
/// #[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
/// #[state(table = "orders", id = "id", column = "status")]
/// #[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
/// enum OrderStatus { Pending, Paid, Refunded, Closed }
/// ```
///
/// | argument | meaning |
/// |---|---|
/// | `table`, `id`, `column` | the table, its id column and its state column: SQL identifiers (`[A-Za-z_][A-Za-z0-9_]{0,63}`), quoted in every statement |
/// | `transitions(A -> B, ...)` | the allowed moves; `idempotency::transition!(T: A -> B)` compiles only for these |
/// | `storage = "text"` (default) or `"int"` | text stores each state as its name in `SCREAMING_SNAKE_CASE` (or `#[state(rename = "...")]` on the variant); int stores the variant's discriminant (`Paid = 1`, a `SMALLINT`) |
/// | `crate = "path"` | the path to the `idempotency` crate, as for `#[idempotent]` |
#[proc_macro_derive(State, attributes(state))]
pub fn derive_state(input: TokenStream) -> TokenStream {
    state::derive(input.into()).into()
}

/// The reference (`idempotent`'s docs, as rustdoc renders them) against the
/// parser: a row for every argument and parameter option it takes, and
/// none for one it refuses.
#[cfg(test)]
mod reference {
    use std::collections::BTreeSet;

    /// The doc comment on `idempotent`, without its `///`.
    fn reference() -> Vec<&'static str> {
        let source = include_str!("lib.rs");
        let item = source.find("#[proc_macro_attribute]\npub fn idempotent").expect("the attribute's item");
        let mut lines: Vec<&str> = source[..item]
            .lines()
            .rev()
            .take_while(|line| line.starts_with("///"))
            .map(|line| line.trim_start_matches("///").strip_prefix(' ').unwrap_or_default())
            .collect();
        lines.reverse();
        lines
    }

    /// What the first cell of each table row under `# heading` names: `key`
    /// for `` `key = "..."` ``, `skip` for `` `#[idem(skip)]` ``.
    fn rows(heading: &str) -> Vec<String> {
        let doc = reference();
        let start = doc.iter().position(|line| *line == heading).unwrap_or_else(|| panic!("no `{heading}`"));
        doc[start + 1..]
            .iter()
            .take_while(|line| !line.starts_with("# "))
            .filter_map(|line| line.strip_prefix("| `"))
            .map(|cell| {
                let cell = cell.strip_prefix("#[idem(").unwrap_or(cell);
                cell.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
            })
            .collect()
    }

    fn set<'a>(names: impl IntoIterator<Item = &'a str>) -> BTreeSet<&'a str> {
        names.into_iter().collect()
    }

    #[test]
    fn every_argument_and_parameter_option_has_its_row() {
        let rows = rows("# Arguments");
        let (options, arguments): (Vec<&String>, Vec<&String>) =
            rows.iter().partition(|name| crate::sig::PARAMETER_OPTIONS.contains(&name.as_str()));
        assert_eq!(
            set(arguments.iter().map(|name| name.as_str())),
            set(crate::attr::ARGUMENT_NAMES),
            "the rows of `# Arguments` and the arguments `attr.rs` parses"
        );
        assert_eq!(
            set(options.iter().map(|name| name.as_str())),
            set(crate::sig::PARAMETER_OPTIONS),
            "the parameter options' rows and the options `sig.rs` parses"
        );
        assert_eq!(rows.len(), crate::attr::ARGUMENT_NAMES.len() + crate::sig::PARAMETER_OPTIONS.len(), "{rows:?}");
    }
}
