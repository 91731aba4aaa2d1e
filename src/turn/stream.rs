//! The receiving end of a turn: a bounded channel of events plus a slot for
//! how the turn ended. This is what tonic polls as the response body.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::Stream;
use tokio::sync::mpsc;

use super::Failure;
use crate::pb;

/// How the producer ended the stream; read after the channel closes, or at
/// once when `urgent` is set.
#[derive(Default)]
pub(super) struct End {
    failure: Mutex<Option<Failure>>,
    /// The status must overtake buffered events (slow consumer, deadline).
    urgent: AtomicBool,
    /// `set` was called: a channel that closes without it lost its producer
    /// (a panic), which is a failure, not the end of a turn.
    set: AtomicBool,
}

impl End {
    /// Records how the stream ends. Call before dropping the sender. The
    /// first call counts: a CONTINUE run's stalled client was told its end
    /// when it was detached, and the run's own end is not its stream's.
    pub(super) fn set(&self, result: Result<(), Failure>) {
        if self.set.load(Ordering::Acquire) {
            return;
        }
        if let Err(f) = result {
            let urgent = f.discards_buffer();
            *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
            self.urgent.store(urgent, Ordering::Release);
        }
        self.set.store(true, Ordering::Release);
    }

    fn take(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// How a stream whose channel closed ends.
    fn at_close(&self) -> Option<Failure> {
        if !self.set.load(Ordering::Acquire) {
            return Some(Failure::Agent(crate::agent::AgentError::Unexpected(
                anyhow::anyhow!("the run task stopped unexpectedly"),
            )));
        }
        self.take()
    }
}

/// The events of one Run as the client sees them: `Ok` events in seq order,
/// then at most one `Err` with how the turn failed. Dropping it is how a
/// client cancels: the producer sees the channel close.
pub struct RunStream {
    /// Boxed: a channel allocates its slots in blocks of 32 up front, and a
    /// pointer-sized slot keeps that small for each of thousands of idle runs.
    rx: mpsc::Receiver<Box<pb::AgentEvent>>,
    end: Arc<End>,
    finished: bool,
}

impl RunStream {
    pub(super) fn new(rx: mpsc::Receiver<Box<pb::AgentEvent>>, end: Arc<End>) -> Self {
        Self {
            rx,
            end,
            finished: false,
        }
    }
}

impl Stream for RunStream {
    type Item = Result<pb::AgentEvent, Failure>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if self.end.urgent.load(Ordering::Acquire) {
            self.finished = true;
            return Poll::Ready(self.end.take().map(Err));
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(ev)) => Poll::Ready(Some(Ok(*ev))),
            Poll::Ready(None) => {
                self.finished = true;
                Poll::Ready(self.end.at_close().map(Err))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
