//! The pump drives a new turn: the agent's event stream goes into the bounded
//! client channel and, through the writer's group commit, into the store.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::stream::End;
use super::{Deadline, Failure, Progress, RunStream, SlowConsumer, Turns};
use crate::domain::{OnDisconnect, RunInput, TurnKey};
use crate::grpc::{convert, status};
use crate::pb;
use crate::store::{EncodedEvent, FinalAnswer, Store, StoreError, TurnOutcome};

/// Queue between the pump and the writer: a full batch can wait while the
/// one before it commits, so a store commit in flight does not stall the
/// pump; bounded so a dead store cannot eat memory.
const WRITER_QUEUE: usize = 2 * WRITER_BATCH;
/// The most events the writer commits in one batch (one row of the SQL
/// stores' event log). Large rows fill SQLite's 64 KiB pages: at 512
/// events (about 45 KB in the benchmark) a row took a page of its own and a
/// quarter of the event log file was empty space, every byte of it written
/// twice (WAL, then checkpoint).
const WRITER_BATCH: usize = 2048;
/// How long the final status waits for the outcome to be stored, at least:
/// up to the run's deadline if that is later (after the shutdown's cut, at
/// most this). A run whose outcome is not stored by then ends UNAVAILABLE
/// without the `recorded` trailer, whatever it ended with: a follow-up
/// could otherwise miss the turn in its history, and the outcome may yet
/// fail to commit.
pub(crate) const OUTCOME_WAIT: Duration = Duration::from_secs(5);
/// After the shutdown's cut, how long the final status waits for the
/// outcome to be stored: less than the shutdown's wait for the cut runs
/// to end (`CUT_FLUSH` in src/server.rs, 5 s), so that the run ends within
/// it either way.
const CUT_OUTCOME_WAIT: Duration = Duration::from_secs(4);
/// A client that goes away this close to its call's deadline (or later) is
/// taken to have reached it: the run ends DEADLINE_EXCEEDED, not CANCELLED.
const DEADLINE_RESET_SLACK: Duration = Duration::from_millis(200);

enum ToWriter {
    /// Encoded by the pump (see [`EncodedEvent`]).
    Event(EncodedEvent),
    /// How the turn ended, and its final answer if it gave one. Boxed: the
    /// channel's slots are allocated up front, for idle runs too.
    Finish(Box<Finish>),
}

/// How a turn ended, and its final answer if it gave one.
type Finish = (TurnOutcome, Option<Answer>);

/// A turn's final answer as it is kept beside the turn, for later turns'
/// history: its text and payload (see [`Answer::of`]).
struct Answer {
    text: String,
    /// Empty for none.
    payload: String,
}

impl Answer {
    /// What is kept of final answer `event`: its text and payload, each in
    /// a text column that on PostgreSQL cannot hold U+0000 (U+FFFD in its
    /// place; the event log keeps them as sent), the payload only within
    /// [`MAX_ANSWER_PAYLOAD_BYTES`](crate::agent::MAX_ANSWER_PAYLOAD_BYTES).
    fn of(event: &crate::agent::Event) -> Self {
        let kept = |s: &str| {
            if s.contains('\0') {
                s.replace('\0', "\u{FFFD}")
            } else {
                s.to_owned()
            }
        };
        // Measured as kept: each NUL is kept as three bytes.
        let payload = kept(&event.payload_json);
        let payload = if payload.len() > crate::agent::MAX_ANSWER_PAYLOAD_BYTES {
            tracing::warn!(
                agent = %event.author,
                bytes = payload.len(),
                limit = crate::agent::MAX_ANSWER_PAYLOAD_BYTES,
                "a final answer's payload is over the limit kept for later turns; not kept"
            );
            String::new()
        } else {
            payload
        };
        Self {
            text: kept(&event.text),
            payload,
        }
    }

    fn as_stored(&self) -> FinalAnswer<'_> {
        FinalAnswer {
            text: &self.text,
            payload: &self.payload,
        }
    }
}

/// An agent's run, made before the pump that drives it: `events` may have
/// been polled already, up to its first event (held), while the turn was
/// being claimed ([`crate::agent::Agent::starts_before_claim`]).
pub(super) struct AgentRun {
    pub agent: String,
    pub events: crate::agent::EventStream,
    /// The token the run's context holds.
    pub cancel: CancellationToken,
    /// The run's span; the pump and the writer run in it.
    pub span: tracing::Span,
}

pub(super) fn spawn(
    turns: &Arc<Turns>,
    run: AgentRun,
    input: &RunInput,
    deadline: Deadline,
    permit: super::RunSlot,
) -> RunStream {
    let (tx, rx) = mpsc::channel(turns.cfg.channel_capacity);
    let end = Arc::new(End::default());
    let (progress_tx, progress_rx) = watch::channel(Progress::default());
    let (writer_tx, writer_rx) = mpsc::channel(WRITER_QUEUE);
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel();
    let key = input.key.clone();

    let span = run.span;
    let renewing = CancellationToken::new();
    let finishing = CancellationToken::new();
    let lease_lost = CancellationToken::new();
    let cancelled = CancellationToken::new();
    // What stops the run from outside: the shutdown's cut, a lost lease or
    // CancelTurn (which also set `lease_lost` or `cancelled`, to tell them
    // apart). One token, so the pump watches one thing per event.
    let stop = turns.cut.child_token();
    let cancel = CancelHandle {
        cancelled: cancelled.clone(),
        stop: stop.clone(),
        run: run.cancel.clone(),
    };
    {
        let mut live = turns.live.lock().unwrap_or_else(|e| e.into_inner());
        // CancelTurn ended the turn between its claim and now: the run
        // stops before its agent is polled (no tool runs).
        if live.cancelled_early.remove(&key).is_some() {
            tracing::info!(parent: &span, turn = %key, "the turn was cancelled (CancelTurn) before its run started; stopping it");
            cancel.fire();
        }
        live.runs.insert(
            key.clone(),
            super::LiveTurn {
                progress: progress_rx.clone(),
                cancel: cancel.clone(),
            },
        );
    }
    turns.tracker.spawn(
        keep_lease(
            turns.clone(),
            key.clone(),
            renewing.clone(),
            finishing.clone(),
            Stops {
                lost: lease_lost.clone(),
                cancelled: cancelled.clone(),
                stop: stop.clone(),
            },
        )
        .instrument(span.clone()),
    );
    let writer = Writer {
        turns: turns.clone(),
        key: key.clone(),
        rx: writer_rx,
        progress: progress_tx,
        renewing,
        finishing,
        finish_late: finish_rx,
    };
    turns.tracker.spawn(writer.run().instrument(span.clone()));

    let pump = Pump {
        agent_name: run.agent,
        events: run.events,
        cancel: run.cancel,
        key,
        client: Some(tx),
        on_disconnect: input.on_disconnect,
        stored: progress_rx,
        writer: Some(writer_tx),
        finish_late: Some(finish_tx),
        encoded: bytes::BytesMut::new(),
        kinds: turns.store.kind_encoding(),
        store: turns.store.clone(),
        answer: None,
        undelivered: None,
        end: end.clone(),
        deadline,
        policy: turns.cfg.slow_consumer,
        stall_timeout: turns.cfg.stall_timeout,
        cut: stop,
        lease_lost,
        cancelled,
        _permit: permit,
    };
    turns.tracker.spawn(pump.run().instrument(span));
    RunStream::new(rx, end)
}

struct Pump {
    agent_name: String,
    events: crate::agent::EventStream,
    /// The run's token; fired when the pump stops, for whatever reason.
    cancel: CancellationToken,
    key: TurnKey,
    /// The client's channel; `None` once the client is gone.
    client: Option<mpsc::Sender<Box<pb::AgentEvent>>>,
    /// Whether a client going away cancels the run or leaves it running.
    on_disconnect: OnDisconnect,
    /// The writer's progress: the final status goes out once the outcome is
    /// stored, so a caller that saw it finds the turn ended on any replica.
    stored: watch::Receiver<Progress>,
    /// The writer's queue; taken (closed) once the outcome is handed over.
    writer: Option<mpsc::Sender<ToWriter>>,
    /// Where the outcome goes when the writer's queue is full (a slow
    /// store): the run ends without waiting for room, and the writer takes
    /// the outcome once it has drained the queue.
    finish_late: Option<tokio::sync::oneshot::Sender<Box<Finish>>>,
    /// Where events are encoded for the store, a block at a time.
    encoded: bytes::BytesMut,
    /// How the store writes an event's kind.
    kinds: crate::store::KindEncoding,
    /// Where the turn's outcome is read back from ([`Pump::as_stored`]).
    store: Arc<dyn Store>,
    /// The final answer, once there is one.
    answer: Option<Answer>,
    /// Why this call could not deliver the final event, which the writer
    /// had already taken: the call ends so, the turn is recorded OK.
    undelivered: Option<Failure>,
    end: Arc<End>,
    deadline: Deadline,
    policy: SlowConsumer,
    stall_timeout: Duration,
    /// The shutdown's cut, or this run's lost lease ([`keep_lease`]).
    cut: CancellationToken,
    /// Set when the turn's lease was lost.
    lease_lost: CancellationToken,
    /// Set when CancelTurn ended the turn.
    cancelled: CancellationToken,
    /// Held for the life of the run: the concurrency caps.
    _permit: super::RunSlot,
}

impl Pump {
    async fn run(mut self) {
        let started = Instant::now();
        let _cancel_on_exit = self.cancel.clone().drop_guard();
        let _in_flight = crate::telemetry::metrics::RunInFlight::enter();
        let mut sent = 0u64;
        let result = self.forward(&mut sent).await;
        let undelivered = self.undelivered.take();
        // Counted by what stopped the run: a reader that stalled on the
        // final event ended this call, but cancelled no agent (it had
        // finished).
        let counted = match undelivered {
            Some(Failure::SlowConsumer) => &Err(Failure::SlowConsumer),
            _ => &result,
        };
        crate::telemetry::metrics::run_finished(super::Mode::New, counted, sent);
        // Drop the agent's stream first: that cancels the model call and the
        // tools right now, before anything else is awaited.
        self.events = Box::pin(futures::stream::empty());
        self.cancel.cancel();

        let outcome = status::outcome(&result);
        let finish = Box::new((outcome, self.answer.take()));
        // Handed over without waiting: behind the last events in the
        // writer's queue, or beside it when the queue is full.
        let writer = self.writer.take().expect("the outcome is handed over once");
        let handed = match writer.try_send(ToWriter::Finish(finish)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(ToWriter::Finish(finish))) => self
                .finish_late
                .take()
                .is_some_and(|late| late.send(finish).is_ok()),
            Err(_) => false,
        };
        drop(writer);
        let confirmed = if !handed {
            tracing::error!(turn = %self.key, "turn writer stopped before the outcome was recorded");
            false
        } else {
            let until = self.deadline.at.max(Instant::now() + OUTCOME_WAIT);
            let cut = self.cut.clone();
            // After the shutdown's cut (or the lease lost) the wait is no
            // longer the run's deadline but the writer's one write after
            // the cut (which the shutdown waits for too): a cut run whose
            // outcome is stored ends recorded, one whose is not does not.
            let cut_short = async {
                cut.cancelled().await;
                tokio::time::sleep(CUT_OUTCOME_WAIT).await;
            };
            let mut progress = self.stored.clone();
            tokio::select! {
                r = tokio::time::timeout_at(until, progress.wait_for(|p| p.done)) => drop(r),
                _ = cut_short => {}
            }
            let stored = {
                let p = self.stored.borrow();
                p.done && !p.outcome_failed
            };
            if !stored {
                tracing::warn!(turn = %self.key, "the turn's outcome was not stored in time; ending the stream UNAVAILABLE");
            }
            stored
        };
        let superseded = self.stored.borrow().superseded;
        let result = match result {
            // The outcome's write found the turn ended already: the caller
            // gets what the store holds, as a retry would.
            // Bounded as the wait for the outcome is, and cut short by the
            // shutdown's cut: not read, the end is the store's failure.
            r if superseded => {
                let read = as_stored(self.store.clone(), self.key.clone(), r);
                // The shutdown's cut, not a lost lease or a CancelTurn
                // (which fire the same token, and whose outcome is the one
                // to read).
                let shutdown = async {
                    self.cut.cancelled().await;
                    if self.lease_lost.is_cancelled() || self.cancelled.is_cancelled() {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    r = tokio::time::timeout(OUTCOME_WAIT, read) => r.unwrap_or_else(|_| {
                        Err(Failure::Store(StoreError::Unavailable(anyhow::anyhow!(
                            "the turn's outcome could not be read back in time"
                        ))))
                    }),
                    _ = shutdown => Err(Failure::Store(StoreError::Unavailable(
                        anyhow::anyhow!("the turn's outcome could not be read back before the shutdown's cut"),
                    ))),
                }
            }
            Ok(()) if self.stored.borrow().store_failed => Err(Failure::Store(
                StoreError::Unavailable(anyhow::anyhow!("events of the turn could not be stored")),
            )),
            // A lost lease is recorded already: the turn was failed
            // (replica stopped) by whoever took it for dead. So is a
            // CancelTurn, by the replica that served it.
            r @ Err(Failure::LeaseLost | Failure::CancelledByRequest) => r,
            // Its end, whatever it is, is not in the store yet: not the
            // turn's recorded outcome, so no `recorded` trailer. Retrying
            // with the same request id replays it once it is (or its
            // lease ends it).
            r if !confirmed => {
                let ended = match &r {
                    Ok(()) => "OK".to_owned(),
                    Err(f) => format!("{f:#}"),
                };
                Err(Failure::Store(StoreError::Unavailable(anyhow::anyhow!(
                    "the turn's outcome ({ended}) could not be stored in time"
                ))))
            }
            r => r,
        };
        let result = match (result, undelivered) {
            // Recorded OK; this call alone could not deliver its end.
            (Ok(()), Some(f)) => Err(Failure::Undelivered(Box::new(f))),
            (r, _) => r,
        };
        let code = tonic::Code::from(status::outcome(&result).code);
        let level_warn = matches!(
            result,
            Err(Failure::Agent(_) | Failure::NoFinalAnswer | Failure::Store(_))
        );
        let cause = result.as_ref().err().map(|e| format!("{e:#}"));
        self.end.set(result);
        drop(self.client.take());
        let duration_ms = started.elapsed().as_secs_f64() * 1e3;
        if level_warn {
            tracing::warn!(method = "Run", mode = "new", session = %self.key.session_id, request_id = %self.key.request_id,
                agent = %self.agent_name, code = ?code, duration_ms, events_sent = sent, cause = cause.as_deref(), "run finished");
        } else {
            tracing::info!(method = "Run", mode = "new", session = %self.key.session_id, request_id = %self.key.request_id,
                agent = %self.agent_name, code = ?code, duration_ms, events_sent = sent, cause = cause.as_deref(), "run finished");
        }
    }

    /// Why `cut` fired: CancelTurn, a lost lease, or the shutdown's cut.
    fn stopped(&self) -> Failure {
        if self.cancelled.is_cancelled() {
            Failure::CancelledByRequest
        } else if self.lease_lost.is_cancelled() {
            Failure::LeaseLost
        } else {
            Failure::Shutdown
        }
    }

    /// Moves events until the final one, or until something ends the run.
    async fn forward(&mut self, sent: &mut u64) -> Result<(), Failure> {
        let deadline = tokio::time::sleep_until(self.deadline.at);
        tokio::pin!(deadline);
        let cut = self.cut.clone();
        let cut = cut.cancelled();
        tokio::pin!(cut);
        let mut seq = 0u64;
        loop {
            let next = tokio::select! {
                biased;
                _ = &mut cut => return Err(self.stopped()),
                _ = &mut deadline => return Err(Failure::Deadline { by_server: self.deadline.by_server }),
                _ = closed(self.client.as_ref()) => {
                    self.client_gone()?;
                    continue;
                }
                item = next_event(&mut self.events) => item,
            };
            let event = match next {
                None => return Err(Failure::NoFinalAnswer),
                Some(Err(e)) => return Err(Failure::Agent(e)),
                Some(Ok(e)) => e,
            };
            let is_final = event.is_final();
            if event.kind == crate::agent::EventKind::FinalAnswer {
                // Kept beside the turn as the session's history.
                self.answer = Some(Answer::of(&event));
            }
            // Encoded for the store here, while the event is in cache; the
            // client's message then takes the event's strings over.
            let stored = EncodedEvent::encode(seq, &event, self.kinds, &mut self.encoded);
            let wire = Box::new(convert::into_wire(seq, event));
            seq += 1;
            if self.stored.borrow().store_failed {
                return Err(Failure::Store(StoreError::Unavailable(anyhow::anyhow!(
                    "events of the turn could not be stored"
                ))));
            }
            // A slow store fills the writer's queue: waiting for room, the
            // run still ends at its deadline, a shutdown's cut or a lost
            // lease.
            // So does a client that goes away (the model call and the
            // tools stop now, not when the store answers again).
            let writer = self.writer.as_ref().expect("held until the outcome");
            let queued = match writer.try_send(ToWriter::Event(stored)) {
                Ok(()) => {
                    // The writer is behind now: its batch in the store's
                    // hands is not to wait for others (Store::hurry).
                    if WRITER_QUEUE - writer.capacity() == crate::store::WRITER_BEHIND {
                        self.store.hurry();
                    }
                    Ok(())
                }
                Err(mpsc::error::TrySendError::Full(event)) => {
                    let writer = writer.clone();
                    let send = writer.send(event);
                    tokio::pin!(send);
                    loop {
                        tokio::select! {
                            biased;
                            _ = &mut cut => return Err(self.stopped()),
                            _ = &mut deadline => return Err(Failure::Deadline { by_server: self.deadline.by_server }),
                            _ = closed(self.client.as_ref()) => self.client_gone()?,
                            r = &mut send => break r.map_err(drop),
                        }
                    }
                }
                Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
            };
            if queued.is_err() {
                return Err(Failure::Store(
                    anyhow::anyhow!("turn writer stopped").into(),
                ));
            }
            let sink = Sink {
                client: self.client.as_ref(),
                policy: self.policy,
                stall_timeout: self.stall_timeout,
                by_server: self.deadline.by_server,
            };
            let delivered = match sink.deliver(wire, &mut deadline, &mut cut).await {
                Ok(true) => {
                    *sent += 1;
                    Ok(())
                }
                Ok(false) => Ok(()),
                Err(Failure::ClientGone) => self.client_gone(),
                // The final event stays the call's to deliver: the turn
                // completed, and the call ends without it (`undelivered`).
                Err(Failure::SlowConsumer) if !is_final => self.client_stalled(),
                Err(Failure::Shutdown) => Err(self.stopped()),
                Err(e) => Err(e),
            };
            if is_final {
                // The writer has the final event: the turn completed,
                // whatever becomes of this call's delivery of it.
                self.undelivered = delivered.err();
                return Ok(());
            }
            delivered?;
        }
    }

    /// The client stopped reading past the stall timeout (`--slow-consumer
    /// fail`): cancel, or, under CONTINUE, keep running without it. A client
    /// that stays connected but does not read (a laptop asleep, a frozen
    /// process) is then no different from one that went away: the run goes
    /// on to its deadline, its events stored for Attach. The stalled call
    /// ends at once, ahead of the events it has not read, as a follower's
    /// would: RESOURCE_EXHAUSTED, the turn going on.
    fn client_stalled(&mut self) -> Result<(), Failure> {
        match self.on_disconnect {
            OnDisconnect::Cancel => Err(Failure::SlowConsumer),
            OnDisconnect::Continue => {
                self.end.set(Err(Failure::StoppedFollowing(Box::new(
                    Failure::SlowConsumer,
                ))));
                if self.client.take().is_some() {
                    crate::telemetry::metrics::slow_consumer();
                    tracing::info!(turn = %self.key, "client stopped reading; the run continues without it (on_disconnect CONTINUE)");
                }
                Ok(())
            }
        }
    }

    /// The client went away: cancel, or keep running without it.
    fn client_gone(&mut self) -> Result<(), Failure> {
        // gRPC clients reset the stream when their deadline passes, which is
        // a little before ours (counted from the call's arrival): a reset
        // that close to the deadline is the deadline, not a cancel.
        if !self.deadline.by_server
            && tokio::time::Instant::now() + DEADLINE_RESET_SLACK >= self.deadline.at
        {
            return Err(Failure::Deadline { by_server: false });
        }
        match self.on_disconnect {
            OnDisconnect::Cancel => Err(Failure::ClientGone),
            OnDisconnect::Continue => {
                if self.client.take().is_some() {
                    tracing::info!(turn = %self.key, "client went away; the run continues (on_disconnect CONTINUE)");
                }
                Ok(())
            }
        }
    }
}

/// The client side of the pump, borrowed for one delivery.
struct Sink<'a> {
    client: Option<&'a mpsc::Sender<Box<pb::AgentEvent>>>,
    policy: SlowConsumer,
    stall_timeout: Duration,
    by_server: bool,
}

impl Sink<'_> {
    /// Hands one event to the client under the slow-consumer policy; false
    /// when there is no client any more (a run that continues without it).
    async fn deliver(
        &self,
        wire: Box<pb::AgentEvent>,
        deadline: &mut std::pin::Pin<&mut tokio::time::Sleep>,
        cut: &mut std::pin::Pin<&mut tokio_util::sync::WaitForCancellationFuture<'_>>,
    ) -> Result<bool, Failure> {
        let Some(tx) = self.client else {
            return Ok(false);
        };
        let wire = match tx.try_send(wire) {
            Ok(()) => return Ok(true),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(Failure::ClientGone),
            Err(mpsc::error::TrySendError::Full(w)) => w,
        };
        let stall = self.policy.given_up(self.stall_timeout);
        tokio::select! {
            biased;
            _ = cut => Err(Failure::Shutdown),
            _ = deadline => Err(Failure::Deadline { by_server: self.by_server }),
            r = tx.send(wire) => r.map(|()| true).map_err(|_| Failure::ClientGone),
            _ = stall => Err(Failure::SlowConsumer),
        }
    }
}

/// The agent's next event. A stream that answers Pending is polled once more
/// at once, as hyper polls a response body again after taking a frame from
/// it: an agent that only yields to the scheduler (`tokio::task::yield_now`)
/// then hands over its next event in the same wake-up, so events reach the
/// client in batches instead of costing one scheduler round trip and one
/// socket write each. An agent really waiting (model, tool, timer) stays
/// Pending at the cost of one extra poll.
fn next_event(
    events: &mut crate::agent::EventStream,
) -> impl std::future::Future<Output = Option<Result<crate::agent::Event, crate::agent::AgentError>>> + '_
{
    std::future::poll_fn(move |cx| match events.as_mut().poll_next(cx) {
        std::task::Poll::Pending => events.as_mut().poll_next(cx),
        ready => ready,
    })
}

/// How a run whose outcome's write found its turn ended already ends:
/// as the store has it. Either the turn was failed under this run (its
/// lease ran out: replica stopped), or an earlier write of this run's
/// own outcome, reported failed (it outlasted `--store-timeout`),
/// landed after all; a client told "replica stopped" then would run
/// again a turn that completed.
async fn as_stored(
    store: Arc<dyn Store>,
    key: TurnKey,
    result: Result<(), Failure>,
) -> Result<(), Failure> {
    let stored = match store.get_turn(&key).await {
        Ok(t) => t.and_then(|t| t.outcome),
        Err(e) => {
            tracing::warn!(turn = %key, error = %format!("{e:#}"), "could not read the turn's stored outcome");
            None
        }
    };
    match stored {
        Some(o) if o.code == tonic::Code::Ok as i32 => {
            tracing::info!(turn = %key, "the turn's outcome was stored by an earlier write of this run, which had been reported failed");
            result
        }
        // CancelTurn ended it, here or on another replica.
        Some(o) if o.state == crate::store::TurnState::Cancelled => {
            tracing::info!(turn = %key, status_message = %o.message, "the turn was cancelled before this write of its outcome; it ends as recorded");
            Err(Failure::Stored(o))
        }
        Some(o) => {
            tracing::warn!(turn = %key, code = ?tonic::Code::from(o.code), status_message = %o.message, "the turn had ended before this write of its outcome (its lease ran out, or an earlier write landed late); it ends as recorded");
            Err(Failure::Stored(o))
        }
        None => Err(Failure::Store(StoreError::Unavailable(anyhow::anyhow!(
            "the turn's outcome could not be read back"
        )))),
    }
}

async fn closed(tx: Option<&mpsc::Sender<Box<pb::AgentEvent>>>) {
    match tx {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

/// Commits a turn's events in batches (whatever queued while the previous
/// batch was being written), then its outcome, and publishes progress.
struct Writer {
    turns: Arc<Turns>,
    key: TurnKey,
    rx: mpsc::Receiver<ToWriter>,
    progress: watch::Sender<Progress>,
    /// Cancelled when the writer ends: [`keep_lease`] stops.
    renewing: CancellationToken,
    /// Cancelled as the writer starts writing the outcome: from then on a
    /// renewal that finds the turn ended is that write landing, not a
    /// lost lease (the write's own answer says which).
    finishing: CancellationToken,
    /// The outcome, when the pump found the queue full.
    finish_late: tokio::sync::oneshot::Receiver<Box<Finish>>,
}

/// Stops a run from outside its pump, for CancelTurn served here.
#[derive(Clone)]
pub(super) struct CancelHandle {
    /// Tells the pump why it stopped ([`Pump::stopped`]).
    cancelled: CancellationToken,
    /// The pump's stop token ([`Pump::cut`]).
    stop: CancellationToken,
    /// The run context's token: tools running on tasks of their own see
    /// it at once, before the pump drops the agent's stream.
    run: CancellationToken,
}

impl CancelHandle {
    /// Whether [`CancelHandle::fire`] was called.
    pub(super) fn fired(&self) -> bool {
        self.cancelled.is_cancelled()
    }

    /// Stops the run: the pump drops the agent's stream the next time it
    /// looks (before it polls the agent again), and its outcome's write
    /// finds the turn ended CANCELLED.
    pub(super) fn fire(&self) {
        self.cancelled.cancel();
        self.stop.cancel();
        self.run.cancel();
    }
}

/// What [`keep_lease`] fires when its renewal finds the turn ended under
/// the run: `stop`, with `cancelled` (CancelTurn recorded it) or `lost`
/// (it was failed as its lease ran out) to say why.
struct Stops {
    lost: CancellationToken,
    cancelled: CancellationToken,
    stop: CancellationToken,
}

/// Renews the turn's lease every third of it until `renewing` is
/// cancelled, so no replica takes the turn for dead. If the turn ended
/// under the run, the renewal fails, and the run is stopped: the turn was
/// cancelled by a CancelTurn another replica served (which recorded it
/// CANCELLED in the store), or the lease was lost anyway (the turn was
/// marked failed: a store stall or a jump of the store's clock longer than two thirds of
/// the lease). Not once the outcome is being written (`finishing`): a
/// renewal then finds the turn ended by that write, which tells itself
/// whether the turn had been ended under it.
async fn keep_lease(
    turns: Arc<Turns>,
    key: TurnKey,
    renewing: CancellationToken,
    finishing: CancellationToken,
    stops: Stops,
) {
    let lease = turns.cfg.lease;
    let mut tick = tokio::time::interval_at(Instant::now() + lease / 3, lease / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = renewing.cancelled() => return,
            _ = tick.tick() => {}
        }
        let renewed = tokio::select! {
            _ = renewing.cancelled() => return,
            r = turns.store.renew_lease(&key, &turns.cfg.replica_id, lease) => r,
        };
        match renewed {
            Ok(true) => {}
            // The turn ended meanwhile: its outcome is stored, or being so.
            Ok(false) if renewing.is_cancelled() || finishing.is_cancelled() => return,
            // A CancelTurn served here stopped the run already.
            Ok(false) if stops.cancelled.is_cancelled() => return,
            Ok(false) => {
                let cancelled = matches!(
                    turns.store.get_turn(&key).await,
                    Ok(Some(t)) if t.state == crate::store::TurnState::Cancelled
                );
                // Stopped meanwhile by the cancel's announcement (which
                // said so in the log).
                if stops.cancelled.is_cancelled() {
                    return;
                }
                if cancelled {
                    tracing::info!(turn = %key, "the turn was cancelled elsewhere (CancelTurn); stopping its run");
                    stops.cancelled.cancel();
                } else {
                    tracing::warn!(turn = %key, "the turn's lease was lost (it was marked failed); stopping its run");
                    stops.lost.cancel();
                }
                stops.stop.cancel();
                return;
            }
            Err(e) => {
                tracing::warn!(turn = %key, error = %format!("{e:#}"), "could not renew the turn's lease")
            }
        }
    }
}

impl Writer {
    async fn run(mut self) {
        let store: Arc<dyn Store> = self.turns.store.clone();
        // The lease is kept beside the writer, not between its commits: a
        // commit that waits long (a slow or stalled store) must not let it
        // lapse. It stops when the writer does.
        let _stop_renewing = self.renewing.clone().drop_guard();
        // Both grow with what arrives: an idle run holds no batch-sized buffer.
        let mut batch = Vec::new();
        let mut events = Vec::new();
        let outcome = loop {
            let received = self.rx.recv_many(&mut batch, WRITER_BATCH).await;
            if received == 0 {
                if let Ok(finish) = self.finish_late.try_recv() {
                    break *finish;
                }
                // The pump ended without an outcome: it panicked.
                let failed = status::outcome(&Err(Failure::Agent(
                    anyhow::anyhow!("the run task stopped unexpectedly").into(),
                )));
                break (failed, None);
            }
            let mut finish = None;
            // Sized once: the batch's events move in without regrowing.
            events.reserve(batch.len());
            for msg in batch.drain(..) {
                match msg {
                    ToWriter::Event(e) => events.push(e),
                    ToWriter::Finish(f) => finish = Some(*f),
                }
            }
            // The queue's last events, with the outcome handed over beside it.
            if finish.is_none() && self.rx.is_closed() && self.rx.is_empty() {
                finish = self.finish_late.try_recv().ok().map(|f| *f);
            }
            match finish {
                // The last events and the outcome go to the store together.
                Some((outcome, answer))
                    if !events.is_empty() && !self.progress.borrow().store_failed =>
                {
                    let last = events.last().map(|e| e.seq);
                    self.finishing.cancel();
                    match store
                        .append_and_finish(
                            &self.key,
                            std::mem::take(&mut events),
                            &outcome,
                            answer.as_ref().map(Answer::as_stored),
                        )
                        .await
                    {
                        Ok(recorded) => {
                            self.progress.send_modify(|p| {
                                p.stored_through = last;
                                p.superseded = !recorded;
                                p.done = true;
                            });
                            self.forget();
                            return;
                        }
                        Err(e) => {
                            tracing::error!(turn = %self.key, error = %format!("{e:#}"), "could not store turn events; ending the run");
                            self.progress.send_modify(|p| p.store_failed = true);
                            break (outcome, answer);
                        }
                    }
                }
                Some(o) => {
                    self.flush(&*store, &mut events).await;
                    break o;
                }
                None => self.flush(&*store, &mut events).await,
            }
        };
        let (outcome, answer) = outcome;
        let outcome =
            if self.progress.borrow().store_failed && outcome.code == tonic::Code::Ok as i32 {
                // The client may have seen every event, but the log did not get
                // them all: a replay could not reproduce the turn.
                status::outcome(&Err(Failure::Store(StoreError::Unavailable(
                    anyhow::anyhow!("events lost"),
                ))))
            } else {
                outcome
            };
        self.finishing.cancel();
        let written = self
            .write_outcome(&*store, &outcome, answer.as_ref().map(Answer::as_stored))
            .await;
        if let Err(e) = &written {
            tracing::error!(turn = %self.key, error = %format!("{e:#}"), "could not record the outcome of a turn; it ends when its lease does (replica stopped)");
        }
        self.progress.send_modify(|p| {
            p.superseded = matches!(written, Ok(false));
            p.outcome_failed = written.is_err();
            p.done = true;
        });
        self.forget();
    }

    /// Records the outcome, again after the store was unavailable (a
    /// connection reset, a failover), for as long as a lease lasts, or
    /// until the shutdown's cut: given up, the turn stays
    /// running until its lease ends it as "replica stopped", and a retry
    /// of its client would be told to run it again under a new request id.
    /// A write that failed but landed shows as `Ok(false)` on the next one
    /// ([`as_stored`] reads what it stored).
    async fn write_outcome(
        &self,
        store: &dyn Store,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> crate::store::StoreResult<bool> {
        let give_up = Instant::now() + self.turns.cfg.lease;
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.finish_turn(&self.key, outcome, answer).await {
                Err(e @ StoreError::Unavailable(_))
                    if Instant::now() + backoff < give_up && !self.turns.cut.is_cancelled() =>
                {
                    tracing::warn!(turn = %self.key, error = %format!("{e:#}"), "could not record the outcome of a turn; trying again");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = self.turns.cut.cancelled() => return Err(e),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                r => return r,
            }
        }
    }

    /// The turn is over here: a repeated request id no longer attaches live.
    fn forget(&self) {
        self.turns
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .runs
            .remove(&self.key);
    }

    async fn flush(&self, store: &dyn Store, events: &mut Vec<EncodedEvent>) {
        let Some(last) = events.last().map(|e| e.seq) else {
            return;
        };
        if self.progress.borrow().store_failed {
            // The log already has a hole; the pump is ending the run.
            events.clear();
            return;
        }
        match store
            .append_encoded(&self.key, std::mem::take(events))
            .await
        {
            Ok(()) => self.progress.send_modify(|p| p.stored_through = Some(last)),
            Err(e) => {
                tracing::error!(turn = %self.key, error = %format!("{e:#}"), "could not store turn events; ending the run");
                self.progress.send_modify(|p| p.store_failed = true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload is held to its limit as it is kept: a NUL, kept as
    /// U+FFFD, weighs three bytes there.
    #[test]
    fn a_final_answers_payload_is_measured_as_kept() {
        let limit = crate::agent::MAX_ANSWER_PAYLOAD_BYTES;
        let answer = |payload: String| {
            let event = crate::agent::Event {
                payload_json: payload,
                ..crate::agent::Event::final_answer("a", "done".into())
            };
            Answer::of(&event).payload
        };
        let fits = "\0".repeat(limit / 3);
        assert_eq!(answer(fits.clone()), "\u{FFFD}".repeat(limit / 3));
        assert_eq!(
            answer(format!("{fits}\0\0")),
            "",
            "kept as {} bytes",
            limit / 3 * 3 + 6
        );
        assert_eq!(answer("x".repeat(limit)).len(), limit);
        assert_eq!(answer("x".repeat(limit + 1)), "");
    }
}
