//! Background upkeep of one engine: a periodic store health check (whose
//! result gates new Runs and feeds grpc.health and `agentd_store_up`),
//! failing turns whose owner's lease expired (that replica died mid-turn),
//! and, beside them, pruning old turns (a long backlog of which never holds
//! up the health checks).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::Turns;
use crate::store::{Store, StoreError};
use crate::telemetry::metrics;

/// Pruning runs at most this often, and at least once per retention/4.
const PRUNE_EVERY_MAX: Duration = Duration::from_secs(600);
/// Turns deleted per store call when pruning.
const PRUNE_BATCH: usize = 500;

pub(super) async fn run(turns: Arc<Turns>) {
    tokio::join!(
        check(turns.clone()),
        sweep(turns.clone()),
        cancels(turns.clone()),
        prune(turns)
    );
}

/// Stops the runs here of turns that CancelTurn, served by another
/// replica, recorded CANCELLED, as the store announces them; stores only
/// one process uses announce nothing.
async fn cancels(turns: Arc<Turns>) {
    use tokio::sync::broadcast::error::RecvError;
    let Some(mut heard) = turns.store.cancel_announcements() else {
        return;
    };
    loop {
        match heard.recv().await {
            Ok(key) => turns.stop_announced_cancel(&key),
            Err(RecvError::Lagged(missed)) => tracing::warn!(
                missed,
                "cancels announced by other replicas came faster than they were handled; those runs stop at their next lease renewal"
            ),
            Err(RecvError::Closed) => return,
        }
    }
}

/// The health checks.
async fn check(turns: Arc<Turns>) {
    let cfg = turns.cfg.clone();
    let mut tick = tokio::time::interval(cfg.store_check.min(cfg.lease / 2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    metrics::store_up(*turns.store_ok.borrow());
    loop {
        tick.tick().await;
        let bound = cfg.store_check.max(Duration::from_secs(1)) * 2;
        let failure = match tokio::time::timeout(bound, turns.store.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(_) => Some(format!("no answer within {bound:?}")),
        };
        if let Some(why) = &failure {
            tracing::debug!(error = %why, "store health check failed");
        }
        let ok = failure.is_none();
        metrics::store_up(ok);
        let changed = turns
            .store_ok
            .send_if_modified(|was| std::mem::replace(was, ok) != ok);
        if changed {
            if ok {
                tracing::info!("session store reachable again; accepting runs");
            } else {
                tracing::warn!(
                    error = %failure.as_deref().unwrap_or_default(),
                    "session store unreachable; refusing new runs (UNAVAILABLE) until it is back"
                );
            }
        }
    }
}

/// The sweep of expired leases, as often as the health checks, while the
/// store answers them. A loop of its own: a sweep that waits on a store
/// whose writes hang (up to --store-timeout) holds up no health check.
async fn sweep(turns: Arc<Turns>) {
    let cfg = turns.cfg.clone();
    let mut tick = tokio::time::interval(cfg.store_check.min(cfg.lease / 2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = turns.store_health();
    loop {
        tick.tick().await;
        if healthy.wait_for(|ok| *ok).await.is_err() {
            return;
        }
        match turns.fail_expired().await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                turns = n,
                "turns whose replica stopped were marked failed (UNAVAILABLE)"
            ),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "could not sweep expired turn leases")
            }
        }
    }
}

/// Pruning past the retentions, at most every [`PRUNE_EVERY_MAX`] and at
/// least once per retention/4 (the shorter one's), while the store answers
/// its health checks.
async fn prune(turns: Arc<Turns>) {
    let cfg = turns.cfg.clone();
    let Some(shortest) = [cfg.retain_turns, cfg.retain_sessions]
        .into_iter()
        .flatten()
        .min()
    else {
        return;
    };
    let mut tick = tokio::time::interval((shortest / 4).clamp(cfg.store_check, PRUNE_EVERY_MAX));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = turns.store_health();
    let ago = |retain: Duration| {
        SystemTime::now()
            .checked_sub(retain)
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    loop {
        tick.tick().await;
        if healthy.wait_for(|ok| *ok).await.is_err() {
            return;
        }
        if let Some(retain) = cfg.retain_turns {
            let before = ago(retain);
            let (n, failed) = prune_all(&*turns.store, before, PRUNE_BATCH).await;
            if n > 0 {
                tracing::info!(turns = n, "pruned turns past the retention");
            }
            if let Some(e) = failed {
                tracing::warn!(error = %format!("{e:#}"), pruned = n, "could not prune old turns");
            }
            let (n, failed) = prune_tasks(&*turns.store.a2a_tasks(), before, PRUNE_BATCH).await;
            if n > 0 {
                tracing::info!(tasks = n, "pruned A2A tasks past the retention");
            }
            if let Some(e) = failed {
                tracing::warn!(error = %format!("{e:#}"), pruned = n, "could not prune old A2A tasks");
            }
        }
        // Last: a session whose turns were all pruned above goes in the same
        // pass, once its own retention has passed too.
        if let Some(retain) = cfg.retain_sessions {
            let (n, failed) = prune_sessions(&*turns.store, ago(retain), PRUNE_BATCH).await;
            if n > 0 {
                tracing::info!(
                    sessions = n,
                    "pruned sessions with no turns past the retention"
                );
            }
            if let Some(e) = failed {
                tracing::warn!(error = %format!("{e:#}"), pruned = n, "could not prune old sessions");
            }
        }
    }
}

/// Deletes every session with no turns last updated before `before`,
/// `batch` per store call (as [`prune_all`] does turns).
async fn prune_sessions(
    store: &dyn Store,
    before: SystemTime,
    batch: usize,
) -> (u64, Option<StoreError>) {
    in_batches(batch, || store.prune_sessions(before, batch)).await
}

/// Deletes every ended A2A task last updated before `before`, `batch` per
/// store call (as [`prune_all`] does turns).
async fn prune_tasks(
    tasks: &dyn crate::store::a2a_tasks::A2aTasks,
    before: SystemTime,
    batch: usize,
) -> (u64, Option<StoreError>) {
    in_batches(batch, || tasks.prune_ended(before, batch)).await
}

/// Deletes every ended turn last updated before `before`, `batch` turns
/// (and their events) per store call, so no one transaction holds the
/// database long (SQLite's writer, most of all) and commits of running
/// turns go on between them. Returns how many went, and the error that
/// stopped it early, if one did.
async fn prune_all(
    store: &dyn Store,
    before: SystemTime,
    batch: usize,
) -> (u64, Option<StoreError>) {
    in_batches(batch, || store.prune(before, batch)).await
}

/// Calls `prune` (which deletes at most `batch` rows) until a call deletes
/// fewer, yielding between calls; how many went, and the error that stopped
/// it early, if one did.
async fn in_batches<F, Fut>(batch: usize, mut prune: F) -> (u64, Option<StoreError>)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    let mut pruned = 0;
    loop {
        match prune().await {
            Ok(n) => {
                pruned += n;
                if n < batch as u64 {
                    return (pruned, None);
                }
            }
            Err(e) => return (pruned, Some(e)),
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{RequestId, TurnKey, UserId};
    use crate::store::{NewTurn, TurnOutcome, TurnState, memory::MemoryStore};

    #[tokio::test]
    async fn pruning_goes_on_batch_after_batch_until_every_old_turn_is_gone() {
        let store = MemoryStore::new();
        let session = store
            .create_session(&UserId::parse("alice").unwrap())
            .await
            .unwrap();
        let key = |r: &str| TurnKey {
            session_id: session.id,
            request_id: RequestId::parse(r).unwrap(),
        };
        let done = TurnOutcome {
            state: TurnState::Completed,
            code: 0,
            message: String::new(),
        };
        for r in ["r1", "r2", "r3", "r4", "r5", "running"] {
            let turn = NewTurn {
                key: key(r),
                user_text: "q".into(),
                agent: "a".into(),
                owner: "here".into(),
                lease: Duration::from_secs(60),
            };
            store.claim_turn(&turn).await.unwrap();
            if r != "running" {
                store
                    .finish_turn(&key(r), &done, Some("a".into()))
                    .await
                    .unwrap();
            }
        }
        let later = SystemTime::now() + Duration::from_secs(1);
        assert_eq!(prune_all(&store, later, 2).await.0, 5);
        let left = store.list_turns(session.id, None, 100).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].key, key("running"));
        assert_eq!(prune_all(&store, later, 2).await.0, 0);
    }
}
