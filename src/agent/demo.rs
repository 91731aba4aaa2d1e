//! `order_helper`: the built-in deterministic demo agent, served when no model
//! is configured. It answers questions about orders from an embedded table
//! through one tool, `lookup_order`, and remembers the last order mentioned in
//! the session so a follow-up ("and when will it arrive?") needs no number.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{Agent, AgentError, Event, EventStream, RunContext};

pub const NAME: &str = "order_helper";
pub const TOOL: &str = "lookup_order";

/// One row of the embedded order table.
#[derive(Debug, Clone, Copy)]
pub struct Order {
    pub id: &'static str,
    pub status: &'static str,
    pub carrier: &'static str,
    pub eta: &'static str,
    pub items: &'static str,
}

/// The demo's order book. Fixed, so answers are deterministic.
pub const ORDERS: &[Order] = &[
    Order {
        id: "1187",
        status: "shipped",
        carrier: "DHL",
        eta: "2026-12-04",
        items: "2 x espresso cups",
    },
    Order {
        id: "1042",
        status: "delivered",
        carrier: "UPS",
        eta: "2026-11-28",
        items: "1 x french press",
    },
    Order {
        id: "2301",
        status: "processing",
        carrier: "",
        eta: "2026-12-09",
        items: "3 x coffee beans 1kg",
    },
    Order {
        id: "3319",
        status: "cancelled",
        carrier: "",
        eta: "",
        items: "1 x grinder",
    },
];

/// Counts what the `lookup_order` tool did, so tests and operators can see
/// that a cancelled run really stopped its tool.
#[derive(Debug, Default)]
pub struct ToolStats {
    pub started: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
}

impl ToolStats {
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::SeqCst)
    }
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::SeqCst)
    }
}

/// The `lookup_order` tool: a table lookup that takes `delay` (to stand in
/// for a slow backend) and stops as soon as its run is cancelled.
#[derive(Debug, Clone)]
pub struct LookupOrder {
    /// Simulated backend latency of one lookup.
    pub delay: Duration,
    pub stats: Arc<ToolStats>,
}

/// Counts a lookup as cancelled if it is dropped before it finished: the
/// turn cancels a run by dropping its stream, which drops this future.
struct InFlight<'a> {
    stats: &'a ToolStats,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.stats.cancelled.fetch_add(1, Ordering::SeqCst);
            tracing::debug!(tool = TOOL, "tool call cancelled");
        }
    }
}

impl LookupOrder {
    /// Looks `order_id` up; `None` when the run was cancelled first.
    pub async fn call(&self, order_id: &str, cancel: &CancellationToken) -> Option<Option<Order>> {
        self.stats.started.fetch_add(1, Ordering::SeqCst);
        let mut guard = InFlight {
            stats: &self.stats,
            done: false,
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            _ = tokio::time::sleep(self.delay) => {}
        }
        guard.done = true;
        self.stats.completed.fetch_add(1, Ordering::SeqCst);
        Some(ORDERS.iter().find(|o| o.id == order_id).copied())
    }
}

pub struct OrderHelper {
    tool: LookupOrder,
}

impl OrderHelper {
    pub fn new(tool_delay: Duration) -> Self {
        Self {
            tool: LookupOrder {
                delay: tool_delay,
                stats: Arc::default(),
            },
        }
    }

    /// The tool's counters (shared; they outlive the agent).
    pub fn stats(&self) -> Arc<ToolStats> {
        self.tool.stats.clone()
    }
}

/// What the helper decided to do with a message.
#[derive(Debug, PartialEq, Eq)]
enum Intent {
    Lookup(String),
    Greeting,
    Thanks,
    AskForNumber,
    Help,
}

/// The first run of 3-12 digits in `text`: an order number.
fn order_number(text: &str) -> Option<String> {
    let mut best = None;
    for word in text.split(|c: char| !c.is_ascii_digit()) {
        if (3..=12).contains(&word.len()) {
            best = Some(word.to_owned());
            break;
        }
    }
    best
}

fn classify(text: &str, history: &[super::PriorTurn]) -> Intent {
    if let Some(n) = order_number(text) {
        return Intent::Lookup(n);
    }
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let has = |w: &str| words.contains(&w);
    if has("thanks") || has("thank") || has("thx") {
        return Intent::Thanks;
    }
    if has("hello") || has("hi") || has("hey") || lower.contains("good morning") {
        return Intent::Greeting;
    }
    let about_orders = [
        "order", "package", "parcel", "it", "arrive", "delivery", "shipped", "where",
    ]
    .iter()
    .any(|w| has(w));
    if about_orders {
        // A follow-up refers to the last order the session talked about.
        let remembered = history
            .iter()
            .rev()
            .find_map(|t| order_number(&t.user_text));
        return match remembered {
            Some(n) => Intent::Lookup(n),
            None => Intent::AskForNumber,
        };
    }
    Intent::Help
}

fn describe(order: &Order) -> String {
    match order.status {
        "shipped" => format!(
            "Order {} ({}) has shipped with {} and should arrive on {}.",
            order.id, order.items, order.carrier, order.eta
        ),
        "delivered" => format!(
            "Order {} ({}) was delivered on {} by {}.",
            order.id, order.items, order.eta, order.carrier
        ),
        "processing" => format!(
            "Order {} ({}) is being prepared; it is expected to ship in time for {}.",
            order.id, order.items, order.eta
        ),
        "cancelled" => format!(
            "Order {} ({}) was cancelled; no charge was made.",
            order.id, order.items
        ),
        other => format!("Order {} is {}.", order.id, other),
    }
}

impl Agent for OrderHelper {
    fn name(&self) -> &str {
        NAME
    }

    fn description(&self) -> &str {
        "Answers questions about customer orders (demo: embedded order table, no model)."
    }

    fn run(&self, ctx: RunContext, input: String) -> EventStream {
        let tool = self.tool.clone();
        Box::pin(async_stream::stream! {
            match classify(&input, &ctx.history) {
                Intent::Lookup(id) => {
                    let call_id = format!("call_{}_0", ctx.request_id);
                    yield Ok::<_, AgentError>(Event::tool_call(NAME, TOOL, &call_id, &json!({ "order_id": id })));
                    let span = crate::telemetry::trace::tool_span(TOOL, &call_id);
                    let Some(found) = tracing::Instrument::instrument(tool.call(&id, &ctx.cancel), span).await else {
                        return;
                    };
                    let (summary, result, answer) = match found {
                        Some(o) => (
                            format!("order {} is {}", o.id, o.status),
                            json!({ "found": true, "order_id": o.id, "status": o.status, "carrier": o.carrier, "eta": o.eta, "items": o.items }),
                            describe(&o),
                        ),
                        None => (
                            format!("no order {id}"),
                            json!({ "found": false, "order_id": id }),
                            format!("I could not find order {id}. Please check the number; it is on your confirmation email."),
                        ),
                    };
                    yield Ok(Event::tool_result(TOOL, &call_id, summary, &result));
                    yield Ok(Event::final_answer(NAME, answer));
                }
                Intent::Greeting => yield Ok(Event::final_answer(
                    NAME,
                    "Hello! I can look up your orders. Which order number would you like me to check?".into(),
                )),
                Intent::Thanks => yield Ok(Event::final_answer(NAME, "You're welcome! Anything else about your orders?".into())),
                Intent::AskForNumber => yield Ok(Event::final_answer(
                    NAME,
                    "Which order do you mean? Please give me the order number, for example \"Where is order 1187?\"".into(),
                )),
                Intent::Help => yield Ok(Event::final_answer(
                    NAME,
                    "I am the order helper: I can tell you where an order is and when it will arrive. Ask me, for example, \"Where is order 1187?\"".into(),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::PriorTurn;

    #[test]
    fn finds_the_order_number_in_a_question() {
        assert_eq!(order_number("Where is order 1187?"), Some("1187".into()));
        assert_eq!(
            order_number("order #42"),
            None,
            "two digits is not an order number"
        );
        assert_eq!(
            classify("Where is order 1187?", &[]),
            Intent::Lookup("1187".into())
        );
    }

    #[test]
    fn tells_chit_chat_from_questions() {
        assert_eq!(classify("hi there", &[]), Intent::Greeting);
        assert_eq!(classify("thanks!", &[]), Intent::Thanks);
        assert_eq!(classify("where is my order?", &[]), Intent::AskForNumber);
        assert_eq!(classify("what's the weather", &[]), Intent::Help);
    }

    #[test]
    fn a_follow_up_uses_the_order_from_the_session_history() {
        let history = vec![PriorTurn {
            request_id: "r1".into(),
            user_text: "Where is order 2301?".into(),
            answer: "...".into(),
            ..PriorTurn::default()
        }];
        assert_eq!(
            classify("when will it arrive?", &history),
            Intent::Lookup("2301".into())
        );
    }
}
