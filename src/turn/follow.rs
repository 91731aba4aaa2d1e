//! A follower streams a turn that someone else runs (or ran): the stored
//! events after a cursor, then live ones as the writer stores them, then the
//! stored final status. It never runs the agent.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::stream::End;
use super::{Deadline, Failure, Mode, Progress, RunStream, Turns};
use crate::domain::TurnKey;
use crate::grpc::{convert, status};
use crate::pb;
use crate::store::{Store, TurnRecord};

/// Events read from the store per query.
const PAGE: usize = 512;

pub(super) fn spawn(
    turns: &Arc<Turns>,
    permit: tokio::sync::OwnedSemaphorePermit,
    key: TurnKey,
    agent: &str,
    after: Option<u64>,
    deadline: Deadline,
    mode: Mode,
) -> RunStream {
    let (tx, rx) = mpsc::channel(turns.cfg.channel_capacity);
    let end = Arc::new(End::default());
    let follower = Follower {
        turns: turns.clone(),
        store: turns.store.clone(),
        live: turns.live_progress(&key),
        poll: turns.cfg.follow_poll,
        key,
        cursor: after,
        tx,
        deadline,
        cut: turns.cut.clone(),
        policy: turns.cfg.slow_consumer,
        stall_timeout: turns.cfg.stall_timeout,
        ran: mode == Mode::Replay || after.is_some(),
    };
    let end2 = end.clone();
    let span = crate::telemetry::trace::run_span(
        mode.as_str(),
        agent,
        &follower.key.session_id,
        &follower.key.request_id,
    );
    let agent = agent.to_owned();
    turns.tracker.spawn(tracing::Instrument::instrument(async move {
        let mut follower = follower;
        let started = Instant::now();
        let key = follower.key.clone();
        let mut sent = 0u64;
        let result = follower.run(&mut sent).await.map_err(Failure::of_follower);
        crate::telemetry::metrics::run_finished(mode, &result, sent);
        let code = tonic::Code::from(status::outcome(&result).code);
        tracing::info!(method = "Run", mode = mode.as_str(), session = %key.session_id, request_id = %key.request_id,
            agent = %agent, code = ?code, duration_ms = started.elapsed().as_secs_f64() * 1e3, events_sent = sent, "run finished");
        // How the stream ends must be known before the channel closes: the
        // receiver reads it as soon as it sees the close.
        end2.set(result);
        drop(follower);
        drop(permit);
    }, span));
    RunStream::new(rx, end)
}

struct Follower {
    /// For ending a turn whose replica stopped ([`Turns::fail_expired`]).
    turns: Arc<Turns>,
    store: Arc<dyn Store>,
    /// Progress of the pump in this process, if the turn runs here.
    live: Option<watch::Receiver<Progress>>,
    /// Re-read interval when no pump here publishes progress.
    poll: std::time::Duration,
    key: TurnKey,
    /// The last seq delivered.
    cursor: Option<u64>,
    tx: mpsc::Sender<Box<pb::AgentEvent>>,
    deadline: Deadline,
    cut: tokio_util::sync::CancellationToken,
    /// A reader that stops reading is waited for, or (`Fail`) dropped after
    /// `stall_timeout`, as a run's own client is: a follower holds a
    /// `--max-followers` permit and a page of events while it waits.
    policy: super::SlowConsumer,
    stall_timeout: std::time::Duration,
    /// The turn is known to have run: it had ended when the follower
    /// started, or it has stored events.
    ran: bool,
}

impl Follower {
    async fn run(&mut self, sent: &mut u64) -> Result<(), Failure> {
        loop {
            if let Some(rx) = self.live.as_mut() {
                // Mark the current progress seen before reading, so a write
                // that lands after the read wakes the wait below.
                rx.borrow_and_update();
            }
            *sent += self.drain().await?;
            let record = self.record().await?;
            // Its replica seems to have stopped renewing (by this replica's
            // clock): end it for everyone, then re-read (another follower
            // may have done so first). The store judges by its own clock,
            // which this one's may run ahead of: when it ended nothing, the
            // follower waits as for a live turn instead of asking again.
            if !record.state.is_terminal()
                && self.live.is_none()
                && record.lease_expires_at < std::time::SystemTime::now()
                && self.turns.fail_expired().await? > 0
            {
                continue;
            }
            if let Some(outcome) = record.outcome.filter(|_| record.state.is_terminal()) {
                // The outcome is written after the last event: one more read
                // delivers whatever landed between the drain and the check.
                *sent += self.drain().await?;
                return if outcome.code == tonic::Code::Ok as i32 {
                    Ok(())
                } else {
                    Err(Failure::Stored(outcome))
                };
            }
            self.wait().await?;
        }
    }

    async fn record(&self) -> Result<TurnRecord, Failure> {
        if let Some(r) = self.store.get_turn(&self.key).await? {
            return Ok(r);
        }
        // Gone with its session (deleted), or pruned: nothing more to tell.
        // Gone before it ran, while its session stays, it was a claim
        // withdrawn because its caller left while it was written: the
        // request may be sent again (a retry runs it).
        if self.ran || self.store.get_session(self.key.session_id).await?.is_none() {
            return Err(Failure::Removed);
        }
        Err(Failure::Store(crate::store::StoreError::Unavailable(
            anyhow::anyhow!("the turn was withdrawn before it ran"),
        )))
    }

    /// Sends every stored event after the cursor.
    async fn drain(&mut self) -> Result<u64, Failure> {
        let mut n = 0;
        loop {
            let page = self
                .store
                .events_after(&self.key, self.cursor, PAGE)
                .await?;
            let full = page.len() == PAGE;
            self.ran |= !page.is_empty();
            for e in page {
                self.cursor = Some(e.seq);
                let wire = Box::new(convert::into_wire(e.seq, e.event));
                let wire = match self.tx.try_send(wire) {
                    Ok(()) => {
                        n += 1;
                        continue;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return Err(Failure::ClientGone),
                    Err(mpsc::error::TrySendError::Full(w)) => w,
                };
                let stall = self.policy.given_up(self.stall_timeout);
                tokio::select! {
                    biased;
                    _ = self.cut.cancelled() => return Err(Failure::Shutdown),
                    _ = tokio::time::sleep_until(self.deadline.at) => return Err(Failure::Deadline { by_server: self.deadline.by_server }),
                    r = self.tx.send(wire) => r.map_err(|_| Failure::ClientGone)?,
                    _ = stall => return Err(Failure::SlowConsumer),
                }
                n += 1;
            }
            if !full {
                return Ok(n);
            }
        }
    }

    /// Waits until the turn may have progressed.
    async fn wait(&mut self) -> Result<(), Failure> {
        let live = &mut self.live;
        let poll = self.poll;
        let changed = async move {
            match live.as_mut() {
                Some(rx) => {
                    if rx.changed().await.is_err() {
                        // The writer is gone: the outcome is stored.
                        *live = None;
                    }
                }
                None => tokio::time::sleep(poll).await,
            }
        };
        tokio::select! {
            biased;
            _ = self.cut.cancelled() => Err(Failure::Shutdown),
            _ = tokio::time::sleep_until(self.deadline.at) => Err(Failure::Deadline { by_server: self.deadline.by_server }),
            _ = self.tx.closed() => Err(Failure::ClientGone),
            _ = changed => Ok(()),
        }
    }
}
