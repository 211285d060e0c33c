//! A claimed call's transaction, opened while its claim is in flight.
//!
//! With a Redis claim a first call made two round trips before its body:
//! the claim, then `BEGIN`. Neither needs the other's answer, so `BEGIN`
//! goes out beside the claim, and the call waits for the slower of the two.
//! A call the claim turns away (a replay, a duplicate of a running call)
//! rolls its transaction back off its path. So that duplicates cost the
//! database little, only fns whose recent calls all ran open early
//! (`read_first`'s counter at rest), and only on a server: SQLite's `BEGIN
//! IMMEDIATE` is no round trip but takes the file's write lock, which a
//! duplicate must not hold.
//!
//! Nothing here decides who runs: the claim does, and the unique index
//! after it. `BEGIN` takes no lock and starts no snapshot on either server
//! (a snapshot starts at the first read), so the body sees what it saw
//! when the transaction opened after the claim.

use crate::engine::Idem;
use crate::gate::Gate;
use crate::spec::Spec;
use crate::store::Backend;
use crate::store::opening::Opening;

/// The transaction a call of `spec` opens beside its claim, if it should:
/// while the claim needs no connection of the pool's (the namespace known),
/// and with a connection the pool lends at once (one idle, or room for one
/// more: behind other calls' turns an early `BEGIN` saves nothing).
pub(crate) fn beside_the_claim<DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    gate: &Gate,
) -> Option<Opening<DB>> {
    let pool = &engine.db().pool;
    let lends_at_once = || pool.num_idle() > 0 || pool.size() < pool.options().get_max_connections();
    // The count first: a fn of replays (the hot path) stops at one atomic load.
    (DB::BEGIN_BESIDE_CLAIM && engine.read_first().at_rest(spec) && gate.claims_in_redis_alone() && lends_at_once())
        .then(|| Opening::begin(pool))
}
