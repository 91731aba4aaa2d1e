//! When a call may be sent again, and how long to wait first.
//!
//! A retry is only safe where it cannot run anything twice:
//! - a Run that failed with UNAVAILABLE before any event arrived, resent with
//!   the same request_id: the server's dedup replays or attaches to the turn
//!   if the first attempt got as far as claiming it;
//! - any call whose connection could not be made (the request never left),
//!   or that the server's HTTP/2 layer refused before the service saw it
//!   (a GOAWAY below its stream, REFUSED_STREAM: gRPC's transparent retry);
//! - a health check (it only reads).
//!
//! A connection that breaks under a call (reset, closed, a broken pipe) is
//! UNAVAILABLE here, as gRPC's status codes have it; tonic reports it as
//! UNKNOWN "transport error". Such a call may have reached the server, so
//! only the calls that are safe to send twice are resent after it. A call
//! refused by a GOAWAY is UNAVAILABLE too (tonic: INTERNAL).

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Code, Status};

/// Bounded exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; 1 disables retries.
    pub max_attempts: u32,
    /// Wait before the first retry.
    pub initial_backoff: Duration,
    /// No wait is longer than this.
    pub max_backoff: Duration,
    /// Growth of the wait per retry.
    pub multiplier: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            multiplier: 2.0,
        }
    }
}

impl RetryPolicy {
    /// The wait after `failed` attempts (1 for the first retry), jittered
    /// into [½, 1] of the exponential value so that clients refused at the
    /// same moment do not come back at the same moment.
    pub fn backoff(&self, failed: u32) -> Duration {
        let exp = self
            .multiplier
            .max(1.0)
            .powi(failed.saturating_sub(1).min(30) as i32);
        // In seconds: a large multiplier overflows a Duration's own product.
        let full = Duration::try_from_secs_f64(self.initial_backoff.as_secs_f64() * exp)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff);
        full.mul_f64(0.5 + fastrand::f64() / 2.0)
    }
}

/// The server's `grpc-retry-pushback-ms`: wait at least that long.
pub fn pushback(status: &Status) -> Option<Duration> {
    let ms: u64 = status
        .metadata()
        .get("grpc-retry-pushback-ms")?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// The call never reached a server: connecting failed.
pub fn is_connect_error(status: &Status) -> bool {
    let mut source = status.source();
    while let Some(e) = source {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// The server's HTTP/2 layer refused the call before its service saw it:
/// a GOAWAY whose last stream id is below the call's stream, or that came
/// before the stream was opened (h2 fails such a stream with the GOAWAY
/// itself, NO_ERROR, from the remote; a GOAWAY for an error fails every
/// stream with that error's reason), or a RST_STREAM with REFUSED_STREAM.
pub fn refused_unprocessed(status: &Status) -> bool {
    let mut source = status.source();
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let reason = h2.reason();
            return h2.is_remote()
                && ((h2.is_go_away() && reason == Some(h2::Reason::NO_ERROR))
                    || (h2.is_reset() && reason == Some(h2::Reason::REFUSED_STREAM)));
        }
        source = e.source();
    }
    false
}

/// The call never reached the service: no connection could be made, or
/// the server refused it unprocessed. Safe to send again, whatever it is.
pub fn never_processed(status: &Status) -> bool {
    is_connect_error(status) || refused_unprocessed(status)
}

/// tonic reports its own header timeout as CANCELLED; to the caller it is
/// the call's deadline passing.
fn deadline_passed(status: Status) -> Status {
    let mut source = status.source();
    while let Some(e) = source {
        if e.is::<tonic::TimeoutExpired>() {
            return deadline_exceeded();
        }
        source = e.source();
    }
    status
}

/// What a call's status says once it comes off the wire: the client's own
/// header timeout is DEADLINE_EXCEEDED, a broken connection and a call
/// refused unprocessed UNAVAILABLE.
pub fn from_wire(status: Status) -> Status {
    let status = deadline_passed(status);
    if refused_unprocessed(&status) && status.code() != Code::Unavailable {
        let mut refused = Status::unavailable(REFUSED);
        refused.set_source(Arc::new(status));
        return refused;
    }
    connection_broke(status)
}

/// The message of a call whose connection broke under it.
pub const CONNECTION_BROKE: &str = "the connection to the server broke during the call";

/// The message of a call the server refused before processing it.
pub const REFUSED: &str = "the server refused the call before processing it (it is shutting down)";

/// A call that failed because its connection broke is UNAVAILABLE (gRPC's
/// status codes: "some data transmitted before connection breaks"), with
/// tonic's own status kept as the source. Anything else is unchanged, an
/// UNKNOWN sent by a server above all.
pub fn connection_broke(status: Status) -> Status {
    if status.code() != Code::Unknown || !from_transport(&status) {
        return status;
    }
    tracing::debug!(error = ?status, "the call's connection broke");
    let mut broke = Status::unavailable(CONNECTION_BROKE);
    broke.set_source(Arc::new(status));
    broke
}

/// The status was made by the client's transport (hyper, h2, the socket),
/// not received from a server.
fn from_transport(status: &Status) -> bool {
    let mut source = status.source();
    while let Some(e) = source {
        if e.is::<tonic::transport::Error>() || e.is::<hyper::Error>() || e.is::<std::io::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

pub fn deadline_exceeded() -> Status {
    Status::deadline_exceeded("the call's deadline passed (client side)")
}

/// The server (or the way to it) is unavailable.
pub fn is_unavailable(status: &Status) -> bool {
    status.code() == Code::Unavailable
}

/// A Run failure before any event that a resend with the same request_id
/// may cure.
pub fn run_is_retryable(status: &Status) -> bool {
    is_unavailable(status)
        && status
            .metadata()
            .get(crate::grpc::status::TURN_OUTCOME_HEADER)
            .is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_bounded() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            multiplier: 2.0,
        };
        for _ in 0..100 {
            let first = p.backoff(1);
            assert!(
                first >= Duration::from_millis(50) && first <= Duration::from_millis(100),
                "{first:?}"
            );
            let third = p.backoff(3);
            assert!(
                third >= Duration::from_millis(200) && third <= Duration::from_millis(400),
                "{third:?}"
            );
            assert!(p.backoff(40) <= Duration::from_millis(1000));
        }
        // A multiplier whose product overflows a Duration is capped, not a panic.
        let steep = RetryPolicy {
            multiplier: 1000.0,
            ..p
        };
        assert!(steep.backoff(9) <= Duration::from_millis(1000));
    }

    #[test]
    fn pushback_is_read_from_the_status() {
        let mut s = Status::unavailable("busy");
        assert_eq!(pushback(&s), None);
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", "250".parse().unwrap());
        assert_eq!(pushback(&s), Some(Duration::from_millis(250)));
    }

    #[test]
    fn a_broken_connection_is_unavailable_and_a_servers_unknown_is_not() {
        let broken = Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "stream closed because of a broken pipe",
        )));
        assert_eq!(broken.code(), Code::Unknown, "tonic's own mapping");
        let mapped = from_wire(broken);
        assert_eq!(mapped.code(), Code::Unavailable);
        assert_eq!(mapped.message(), CONNECTION_BROKE);
        assert!(run_is_retryable(&mapped));
        assert!(!is_connect_error(&mapped), "it may have reached the server");
        let kept = mapped.source().and_then(|e| e.downcast_ref::<Status>());
        assert_eq!(
            kept.map(Status::code),
            Some(Code::Unknown),
            "the original is the source"
        );

        // An UNKNOWN a server sent, and other codes, are left alone.
        let sent = Status::unknown("the agent failed");
        assert_eq!(from_wire(sent).code(), Code::Unknown);
        let internal = Status::internal("x");
        assert_eq!(from_wire(internal).message(), "x");
    }

    #[test]
    fn only_unavailable_runs_are_retried() {
        assert!(run_is_retryable(&Status::unavailable("x")));
        for code in [
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Internal,
            Code::Cancelled,
            Code::NotFound,
        ] {
            assert!(!run_is_retryable(&Status::new(code, "x")), "{code:?}");
        }
    }
}
