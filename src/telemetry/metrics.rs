//! Prometheus metrics: the names, and the few calls the turn engine makes.
//!
//! The recorder is the process-wide one of the `metrics` crate, installed on
//! first use; [`render`] is what the admin port serves at `/metrics`.
//!
//! | metric | labels | what |
//! | --- | --- | --- |
//! | `grpc_server_started_total` | `grpc_service`, `grpc_method` | calls received |
//! | `grpc_server_handled_total` | `grpc_service`, `grpc_method`, `grpc_code` | calls ended, by final status (a stream's status is its trailer) |
//! | `grpc_server_handling_seconds` | `grpc_service`, `grpc_method`, `grpc_code` | histogram: call start to the end of its response stream |
//! | `agentd_runs_in_flight` | | agent runs executing now |
//! | `agentd_run_events` | `mode` | histogram: events sent per Run (`new`, `replay`, `attach`) |
//! | `agentd_run_cancellations_total` | `cause` | agent runs cancelled: `client`, `deadline`, `shutdown`, `cancel_turn` |
//! | `agentd_slow_consumer_terminations_total` | | Runs ended with RESOURCE_EXHAUSTED because the client stopped reading |
//! | `agentd_dedup_total` | `mode` | repeated request ids served without running: `replay`, `attach` |
//! | `agentd_a2a_requests_total` | `method`, `outcome` | A2A requests over either binding, by method (`SendStreamingMessage`, `GetTask`, …) and outcome: `OK`, the A2A error's reason (`TASK_NOT_FOUND`, …), `CANCELLED` for a stream the client dropped, or `UNAUTHENTICATED` (method `unknown`) for a JSON-RPC request refused for its credentials; a JSON-RPC request refused before it reaches a method also counts as `unknown`, with its error's reason (`PARSE_ERROR`, `METHOD_NOT_FOUND`, …) |
//! | `agentd_a2a_request_seconds` | `method`, `outcome` | histogram: request to its answer, or to the end of its stream |
//! | `agentd_store_call_seconds` | `op` | histogram: a store call as its caller waited for it, queueing included (`op`: `session_for_run`, `claim_turn`, `append`, `append_and_finish`, … one per store method) |
//! | `agentd_store_errors_total` | `op`, `error` | store calls that failed: `unavailable` (the database could not be reached) or `unexpected` |
//! | `agentd_store_up` | | 1 while the store answers the upkeep's health checks, 0 while it does not (set on every check, even when no call reaches the store) |
//! | `agentd_store_group_seconds` | `queue` | histogram, SQL stores: writing one group, `commit` (events and outcomes of many turns) or `claim` (claims made together); PostgreSQL also `read` (the sessions of Runs starting together) |
//! | `agentd_store_group_size` | `queue` | histogram, SQL stores: batches, claims or session reads per group |
//! | `agentd_connections_refused_total` | `port` | connections closed as soon as they were accepted, the port (`grpc`, `a2a_http`) at `--max-connections` |
//! | `agentd_accept_errors_total` | `port` | accepts that failed (out of file descriptors, say), each followed by a 50 ms pause |

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::turn::{Failure, Mode};

pub const STARTED: &str = "grpc_server_started_total";
pub const HANDLED: &str = "grpc_server_handled_total";
pub const HANDLING_SECONDS: &str = "grpc_server_handling_seconds";
pub const RUNS_IN_FLIGHT: &str = "agentd_runs_in_flight";
pub const RUN_EVENTS: &str = "agentd_run_events";
pub const CANCELLATIONS: &str = "agentd_run_cancellations_total";
pub const SLOW_CONSUMER: &str = "agentd_slow_consumer_terminations_total";
pub const DEDUP: &str = "agentd_dedup_total";
pub const A2A_REQUESTS: &str = "agentd_a2a_requests_total";
pub const A2A_REQUEST_SECONDS: &str = "agentd_a2a_request_seconds";
pub const A2A_STREAM_RESUMES: &str = "agentd_a2a_stream_resumes_total";
pub const STORE_CALL_SECONDS: &str = "agentd_store_call_seconds";
pub const STORE_ERRORS: &str = "agentd_store_errors_total";
pub const STORE_UP: &str = "agentd_store_up";
pub const STORE_GROUP_SECONDS: &str = "agentd_store_group_seconds";
pub const STORE_GROUP_SIZE: &str = "agentd_store_group_size";
pub const CONNECTIONS_REFUSED: &str = "agentd_connections_refused_total";
pub const ACCEPT_ERRORS: &str = "agentd_accept_errors_total";

/// Call durations from 1 ms to the longest run a server allows by default.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Store calls and group writes: from a cached read to a stalled database.
const STORE_SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];
/// Batches or claims per group: one alone up to a group's limit.
const GROUP_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
/// Events per run: a tool-using turn is a handful, a streamed answer hundreds.
const EVENTS_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0, 10000.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// How often histogram samples are folded into their buckets. The recorder
/// keeps every sample until a render or an upkeep folds it, so without
/// this memory would grow with every call wherever nobody scrapes
/// `/metrics` (the admin port off, a library user that never renders).
const UPKEEP: Duration = Duration::from_secs(5);
/// Upkeeps run so far.
static UPKEEPS: AtomicU64 = AtomicU64::new(0);

/// Installs the process-wide recorder (once) and returns its handle.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(RUN_EVENTS.into()), EVENTS_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Prefix("agentd_store_".into()),
                    STORE_SECONDS_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(STORE_GROUP_SIZE.into()), GROUP_SIZE_BUCKETS)
            })
            .expect("bucket lists are non-empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("another metrics recorder is installed; /metrics will be empty");
        }
        describe();
        start_upkeep(handle.clone());
        handle
    })
}

/// Runs the recorder's upkeep every [`UPKEEP`] for the rest of the process,
/// on a thread of its own: the recorder is process-wide and outlives any
/// runtime.
fn start_upkeep(handle: PrometheusHandle) {
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP);
                handle.run_upkeep();
                UPKEEPS.fetch_add(1, Ordering::Relaxed);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the metrics upkeep thread; histogram samples are folded only when /metrics is scraped");
    }
}

/// The Prometheus text exposition of every metric.
pub fn render() -> String {
    handle().render()
}

fn describe() {
    metrics::describe_counter!(STARTED, "gRPC calls received");
    metrics::describe_counter!(
        HANDLED,
        "gRPC calls ended, by final status (trailer status for streams)"
    );
    metrics::describe_histogram!(
        HANDLING_SECONDS,
        metrics::Unit::Seconds,
        "gRPC call duration to the end of the response stream"
    );
    metrics::describe_gauge!(RUNS_IN_FLIGHT, "agent runs executing now");
    metrics::describe_histogram!(RUN_EVENTS, "events sent per Run");
    metrics::describe_counter!(CANCELLATIONS, "agent runs cancelled, by cause");
    metrics::describe_counter!(
        SLOW_CONSUMER,
        "Runs ended because the client stopped reading"
    );
    metrics::describe_counter!(
        DEDUP,
        "repeated request ids answered without running the agent"
    );
    metrics::describe_counter!(
        A2A_REQUESTS,
        "A2A requests (JSON-RPC or gRPC binding), by method and outcome"
    );
    metrics::describe_histogram!(
        A2A_REQUEST_SECONDS,
        metrics::Unit::Seconds,
        "A2A request duration to its answer, or to the end of its stream"
    );
    metrics::describe_counter!(
        A2A_STREAM_RESUMES,
        "A2A streams that fell behind their run and went on from the task as it stood"
    );
    metrics::describe_histogram!(
        STORE_CALL_SECONDS,
        metrics::Unit::Seconds,
        "store calls, as their callers waited for them (queueing included)"
    );
    metrics::describe_counter!(STORE_ERRORS, "store calls that failed, by cause");
    metrics::describe_gauge!(
        STORE_UP,
        "1 while the session store answers its health checks, 0 while it does not"
    );
    metrics::describe_histogram!(
        STORE_GROUP_SECONDS,
        metrics::Unit::Seconds,
        "SQL stores: writing one group of commits or claims"
    );
    metrics::describe_histogram!(STORE_GROUP_SIZE, "SQL stores: batches or claims per group");
    metrics::describe_counter!(
        CONNECTIONS_REFUSED,
        "connections closed on accept, the port at its connection limit"
    );
    metrics::describe_counter!(
        ACCEPT_ERRORS,
        "accepts that failed (out of file descriptors, say), each followed by a 50 ms pause"
    );
}

/// Counts an agent run in flight for as long as it lives.
pub struct RunInFlight(());

impl RunInFlight {
    pub fn enter() -> Self {
        handle();
        metrics::gauge!(RUNS_IN_FLIGHT).increment(1.0);
        RunInFlight(())
    }
}

impl Drop for RunInFlight {
    fn drop(&mut self) {
        metrics::gauge!(RUNS_IN_FLIGHT).decrement(1.0);
    }
}

/// A repeated request id was joined instead of run.
pub fn dedup(mode: Mode) {
    handle();
    metrics::counter!(DEDUP, "mode" => mode.as_str()).increment(1);
}

/// A call was ended because its client stopped reading.
pub fn slow_consumer() {
    handle();
    metrics::counter!(SLOW_CONSUMER).increment(1);
}

/// A Run's stream ended: how many events it sent and why it stopped.
pub fn run_finished(mode: Mode, result: &Result<(), Failure>, events_sent: u64) {
    handle();
    metrics::histogram!(RUN_EVENTS, "mode" => mode.as_str()).record(events_sent as f64);
    // A follower's end is wrapped (it stopped following; the turn goes on).
    let failure = match result {
        Err(Failure::StoppedFollowing(f)) => &**f,
        Err(f) => f,
        Ok(()) => return,
    };
    let cause = match failure {
        Failure::ClientGone => "client",
        Failure::Deadline { .. } => "deadline",
        Failure::Shutdown => "shutdown",
        Failure::CancelledByRequest => "cancel_turn",
        Failure::SlowConsumer => {
            slow_consumer();
            return;
        }
        _ => return,
    };
    // Only a run of the agent is cancelled; a follower just stops reading.
    if mode == Mode::New {
        metrics::counter!(CANCELLATIONS, "cause" => cause).increment(1);
    }
}

/// The histogram of one store method's calls (`op` from a fixed set).
pub fn store_call_histogram(op: &'static str) -> metrics::Histogram {
    handle();
    metrics::histogram!(STORE_CALL_SECONDS, "op" => op)
}

/// A store call failed.
pub fn store_error(op: &'static str, error: &crate::store::StoreError) {
    store_error_kind(
        op,
        matches!(error, crate::store::StoreError::Unavailable(_)),
    );
}

/// A failed store call: `unavailable` when the database could not be
/// reached, `unexpected` for anything else.
pub fn store_error_kind(op: &'static str, unavailable: bool) {
    let cause = if unavailable {
        "unavailable"
    } else {
        "unexpected"
    };
    metrics::counter!(STORE_ERRORS, "op" => op, "error" => cause).increment(1);
}

/// The outcome of a store health check: `agentd_store_up` 1 or 0. Set on
/// every check, so it reads 0 through an outage in which no call reaches
/// the store (Runs are refused before they call it, and a check that times
/// out counts no store error).
pub fn store_up(ok: bool) {
    handle();
    metrics::gauge!(STORE_UP).set(if ok { 1.0 } else { 0.0 });
}

/// Admits connections to one port up to `--max-connections`, counting
/// (`agentd_connections_refused_total`) and logging the ones it refuses: one
/// warning each time the port reaches its limit, not one per connection of
/// a flood.
pub struct ConnectionSlots {
    port: &'static str,
    limit: usize,
    slots: std::sync::Arc<tokio::sync::Semaphore>,
    at_limit: std::sync::atomic::AtomicBool,
}

impl ConnectionSlots {
    pub fn new(port: &'static str, limit: usize) -> Self {
        handle();
        Self {
            port,
            limit,
            slots: std::sync::Arc::new(tokio::sync::Semaphore::new(limit)),
            at_limit: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A slot the new connection holds until it closes; `None`: close it.
    pub fn admit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        use std::sync::atomic::Ordering;
        match self.slots.clone().try_acquire_owned() {
            Ok(slot) => {
                self.at_limit.store(false, Ordering::Relaxed);
                Some(slot)
            }
            Err(_) => {
                metrics::counter!(CONNECTIONS_REFUSED, "port" => self.port).increment(1);
                if !self.at_limit.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        port = self.port,
                        limit = self.limit,
                        "at the connection limit (--max-connections): new connections are closed until one ends (agentd_connections_refused_total counts them)"
                    );
                }
                None
            }
        }
    }
}

/// An accept on `port` failed (the connection waits in the listen queue
/// for the next try).
pub fn accept_failed(port: &'static str) {
    handle();
    metrics::counter!(ACCEPT_ERRORS, "port" => port).increment(1);
}

/// A SQL store wrote one group of `size` batches (`queue` `commit`) or
/// claims (`claim`), or read `size` sessions (`read`, PostgreSQL).
pub fn store_group(queue: &'static str, size: usize, elapsed: std::time::Duration) {
    handle();
    metrics::histogram!(STORE_GROUP_SECONDS, "queue" => queue).record(elapsed);
    metrics::histogram!(STORE_GROUP_SIZE, "queue" => queue).record(size as f64);
}

/// An A2A request ended. `method` is the A2A method name (or `unknown`),
/// `outcome` `OK`, an A2A error reason, `CANCELLED` or `UNAUTHENTICATED`;
/// both come from fixed sets, so a caller cannot grow the label space.
pub fn a2a_request(method: &'static str, outcome: &'static str, elapsed: std::time::Duration) {
    handle();
    metrics::counter!(A2A_REQUESTS, "method" => method, "outcome" => outcome).increment(1);
    metrics::histogram!(A2A_REQUEST_SECONDS, "method" => method, "outcome" => outcome)
        .record(elapsed.as_secs_f64());
}

/// An A2A stream fell behind its run and went on from the task's state.
pub fn a2a_stream_resumed() {
    handle();
    metrics::counter!(A2A_STREAM_RESUMES).increment(1);
}

/// The name of a gRPC status code as the gRPC specification spells it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recorder folds its samples on its own, with or without an
    /// admin port scraping it: otherwise each call's samples would be
    /// kept for the life of the process.
    #[test]
    fn the_recorder_runs_its_upkeep_without_an_admin_port() {
        handle();
        metrics::histogram!(HANDLING_SECONDS).record(0.01);
        let before = UPKEEPS.load(Ordering::Relaxed);
        let give_up = std::time::Instant::now() + UPKEEP * 4;
        while UPKEEPS.load(Ordering::Relaxed) == before {
            assert!(
                std::time::Instant::now() < give_up,
                "no upkeep ran in {:?}",
                UPKEEP * 4
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
