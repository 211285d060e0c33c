//! A floor under the life of the records made inside a scope, whatever
//! their calls' ttl. The cron runner runs each slot's job in one as long as
//! its catch-up window (and a margin): a catch-up within the window then
//! finds the slot's record instead of an expired one, and never runs the
//! slot again. No table, no round trip: the call flow reads the floor
//! when it builds the record's key.
//!
//! The scope is a task-local, so it covers what the scoped future awaits,
//! not tasks it spawns. Outside any scope a call pays one task-local
//! lookup (without the feature `cron`, nothing).

use std::time::Duration;

#[cfg(feature = "cron")]
tokio::task_local! {
    static AT_LEAST: Duration;
}

/// Runs `future` with every record its calls write living at least `life`.
#[cfg(feature = "cron")]
pub(crate) async fn keep_records_for<F: std::future::Future>(life: Duration, future: F) -> F::Output {
    AT_LEAST.scope(life, future).await
}

/// The ttl a call's record gets: its own `ttl`, or the scope's floor when
/// that is longer.
pub(crate) fn record_ttl(ttl: Duration) -> Duration {
    #[cfg(feature = "cron")]
    if let Ok(life) = AT_LEAST.try_with(|life| *life)
        && life > ttl
    {
        // In the call's span: biz and key are there.
        tracing::debug!(
            ttl_ms = ttl.as_millis(),
            kept_ms = life.as_millis(),
            "idem record kept past its ttl: the cron runner's catch-up window needs it"
        );
        return life;
    }
    ttl
}

#[cfg(all(test, feature = "cron"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_floor_holds_inside_the_scope_only() {
        let (short, long) = (Duration::from_secs(2), Duration::from_secs(68));
        assert_eq!(record_ttl(short), short, "outside a scope the ttl is the call's own");
        let inside = keep_records_for(long, async {
            tokio::task::yield_now().await;
            (record_ttl(short), record_ttl(Duration::from_secs(3600)))
        })
        .await;
        assert_eq!(inside, (long, Duration::from_secs(3600)), "a floor, never a cap");
        assert_eq!(record_ttl(short), short, "the scope ends with its future");
        // A task spawned inside is not covered (documented).
        let spawned = keep_records_for(long, async { tokio::spawn(async move { record_ttl(short) }).await.unwrap() });
        assert_eq!(spawned.await, short);
    }
}
