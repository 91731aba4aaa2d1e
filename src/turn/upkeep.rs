//! Background upkeep of one engine: a periodic store health check (whose
//! result gates new Runs and feeds grpc.health), failing turns whose owner's
//! lease expired (that replica died mid-turn), and pruning old turns.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::Turns;
use crate::grpc::status;

/// Pruning runs at most this often, and at least once per retention/4.
const PRUNE_EVERY_MAX: Duration = Duration::from_secs(600);

pub(super) async fn run(turns: Arc<Turns>) {
    let cfg = turns.cfg.clone();
    let mut tick = tokio::time::interval(cfg.store_check.min(cfg.lease / 2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let prune_every = cfg
        .retain_turns
        .map(|r| (r / 4).clamp(cfg.store_check, PRUNE_EVERY_MAX));
    let mut last_prune: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let ok = match tokio::time::timeout(
            cfg.store_check.max(Duration::from_secs(1)) * 2,
            turns.store.ping(),
        )
        .await
        {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::debug!(error = %format!("{e:#}"), "store health check failed");
                false
            }
            Err(_) => false,
        };
        let changed = turns
            .store_ok
            .send_if_modified(|was| std::mem::replace(was, ok) != ok);
        if changed {
            if ok {
                tracing::info!("session store reachable again; accepting runs");
            } else {
                tracing::warn!(
                    "session store unreachable; refusing new runs (UNAVAILABLE) until it is back"
                );
            }
        }
        if !ok {
            continue;
        }
        match turns
            .store
            .fail_expired(SystemTime::now(), &status::replica_stopped())
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                turns = n,
                "turns whose replica stopped were marked failed (UNAVAILABLE)"
            ),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "could not sweep expired turn leases")
            }
        }
        if let (Some(retain), Some(every)) = (cfg.retain_turns, prune_every)
            && last_prune.is_none_or(|t| t.elapsed() >= every)
        {
            last_prune = Some(tokio::time::Instant::now());
            match turns
                .store
                .prune(
                    SystemTime::now()
                        .checked_sub(retain)
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                )
                .await
            {
                Ok(0) => {}
                Ok(n) => tracing::info!(turns = n, "pruned turns past the retention"),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "could not prune old turns"),
            }
        }
    }
}
