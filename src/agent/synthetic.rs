//! Synthetic agents for tests and benchmarks.
//!
//! - `echo` answers with the message itself.
//! - `stream` emits N partial-text events of S bytes, paced or as fast as it
//!   can, then a final answer. Its parameters come from the message, as
//!   `key=value` words: `n=10000 size=64 rate=0 yield=1 wait=0s`, where
//!   `rate` is events per second (0: no pacing), `yield=1` yields to the
//!   scheduler between events (one event at a time), and `wait` sleeps before
//!   the first event (an idle stream). Unknown words are an error.

use std::time::Duration;

use super::{Agent, AgentError, Event, EventStream, RunContext};

pub struct Echo;

impl Agent for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn description(&self) -> &str {
        "Answers with the message it was sent."
    }
    fn run(&self, _ctx: RunContext, input: String) -> EventStream {
        Box::pin(futures::stream::once(async move {
            Ok(Event::final_answer("echo", input))
        }))
    }
}

/// What one `stream` run does.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    pub count: u64,
    pub size: usize,
    /// Events per second; 0 means as fast as the consumer takes them.
    pub rate: f64,
    pub yield_each: bool,
    pub wait: Duration,
}

impl Default for StreamSpec {
    fn default() -> Self {
        Self {
            count: 10,
            size: 16,
            rate: 0.0,
            yield_each: false,
            wait: Duration::ZERO,
        }
    }
}

/// The most events one `stream` run may emit, so a typo cannot run forever.
pub const MAX_STREAM_EVENTS: u64 = 10_000_000;
/// The slowest and fastest pace the `stream` agent keeps, in events per
/// second (besides 0, no pacing).
pub const MIN_STREAM_RATE: f64 = 1e-6;
pub const MAX_STREAM_RATE: f64 = 1e9;
/// The largest event the `stream` agent makes.
pub const MAX_STREAM_EVENT_SIZE: usize = 1 << 20;

impl StreamSpec {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut spec = StreamSpec::default();
        for word in text.split_whitespace() {
            let (k, v) = word
                .split_once('=')
                .ok_or_else(|| "expected key=value, got a bare word".to_string())?;
            let bad = |what: &str| format!("{k} must be {what}");
            match k {
                "n" => spec.count = v.parse().map_err(|_| bad("a whole number"))?,
                "size" => spec.size = v.parse().map_err(|_| bad("a whole number of bytes"))?,
                "rate" => spec.rate = v.parse().map_err(|_| bad("events per second"))?,
                "yield" => spec.yield_each = matches!(v, "1" | "true" | "yes"),
                "wait" => {
                    spec.wait =
                        humantime::parse_duration(v).map_err(|_| bad("a duration like 5s"))?
                }
                _ => return Err("unknown parameter; use n, size, rate, yield, wait".to_string()),
            }
        }
        if spec.count > MAX_STREAM_EVENTS {
            return Err(format!("n must be at most {MAX_STREAM_EVENTS}"));
        }
        if spec.size > MAX_STREAM_EVENT_SIZE {
            return Err(format!("size must be at most {MAX_STREAM_EVENT_SIZE}"));
        }
        // The pace is one event every 1/rate seconds: a period of at least
        // a nanosecond (tokio's timer refuses zero) that fits a Duration.
        if !(spec.rate == 0.0 || (MIN_STREAM_RATE..=MAX_STREAM_RATE).contains(&spec.rate)) {
            return Err(format!(
                "rate must be 0 (no pacing) or between {MIN_STREAM_RATE} and {MAX_STREAM_RATE} events per second"
            ));
        }
        Ok(spec)
    }
}

pub struct Streamer;

impl Agent for Streamer {
    fn name(&self) -> &str {
        "stream"
    }
    fn description(&self) -> &str {
        "Emits n events of size bytes at rate events/s (for tests and benchmarks)."
    }
    fn run(&self, _ctx: RunContext, input: String) -> EventStream {
        Box::pin(async_stream::stream! {
            let spec = match StreamSpec::parse(&input) {
                Ok(s) => s,
                Err(e) => {
                    yield Err(AgentError::InvalidInput(e));
                    return;
                }
            };
            if !spec.wait.is_zero() {
                tokio::time::sleep(spec.wait).await;
            }
            let body = "x".repeat(spec.size);
            let mut ticker = (spec.rate > 0.0).then(|| {
                let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / spec.rate));
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                t
            });
            for _ in 0..spec.count {
                if let Some(t) = ticker.as_mut() {
                    t.tick().await;
                } else if spec.yield_each {
                    tokio::task::yield_now().await;
                }
                yield Ok(Event::partial("stream", body.clone()));
            }
            yield Ok(Event::final_answer("stream", format!("sent {} events", spec.count)));
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_parameters_and_rejects_unknown_ones() {
        let s = StreamSpec::parse("n=5 size=3 rate=100 yield=1 wait=2s").unwrap();
        assert_eq!(
            s,
            StreamSpec {
                count: 5,
                size: 3,
                rate: 100.0,
                yield_each: true,
                wait: Duration::from_secs(2)
            }
        );
        assert_eq!(StreamSpec::parse("").unwrap(), StreamSpec::default());
        assert!(StreamSpec::parse("frobnicate=1").is_err());
        assert!(StreamSpec::parse("n=many").is_err());
        assert!(StreamSpec::parse("rate=-1").is_err());
        // Paces no timer can keep (a zero or overflowing period) are
        // refused here, not a panic in the run.
        for rate in ["1e10", "1e-20", "NaN", "inf"] {
            assert!(
                StreamSpec::parse(&format!("rate={rate}")).is_err(),
                "{rate}"
            );
        }
        assert!(StreamSpec::parse("rate=1e9").is_ok());
        assert!(StreamSpec::parse("n=99999999999").is_err());
    }
}
