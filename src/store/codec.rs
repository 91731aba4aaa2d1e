//! How the SQL stores keep a turn's event log: one row per group commit,
//! holding the batch's events as one protobuf blob. A row per event would put
//! an index update and a row's worth of binds on every event; a batch row
//! costs one insert per commit, whatever the batch size.
//!
//! The blob is this module's own message, not the wire `AgentEvent`, so the
//! stored form does not change when the API does.

use prost::Message as _;

use super::SeqEvent;
use crate::agent::{Event, EventKind};

#[derive(Clone, PartialEq, prost::Message)]
struct StoredBatch {
    #[prost(message, repeated, tag = "1")]
    events: Vec<StoredEvent>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StoredEvent {
    #[prost(uint64, tag = "1")]
    seq: u64,
    /// [`EventKind::as_str`]: a name, so the kind enum can be reordered.
    #[prost(string, tag = "2")]
    kind: String,
    #[prost(string, tag = "3")]
    author: String,
    #[prost(string, tag = "4")]
    text: String,
    #[prost(string, tag = "5")]
    tool_name: String,
    #[prost(string, tag = "6")]
    tool_call_id: String,
    #[prost(string, tag = "7")]
    payload_json: String,
    #[prost(int64, tag = "8")]
    created_unix_nanos: i64,
}

/// Encodes a batch (moved, not copied).
pub(super) fn encode(events: Vec<SeqEvent>) -> Vec<u8> {
    let batch = StoredBatch {
        events: events
            .into_iter()
            .map(|e| StoredEvent {
                seq: e.seq,
                kind: e.event.kind.as_str().to_owned(),
                author: e.event.author,
                text: e.event.text,
                tool_name: e.event.tool_name,
                tool_call_id: e.event.tool_call_id,
                payload_json: e.event.payload_json,
                created_unix_nanos: e.event.created_unix_nanos,
            })
            .collect(),
    };
    batch.encode_to_vec()
}

/// Decodes a stored batch; `None` if the blob is not one.
pub(super) fn decode(blob: &[u8]) -> Option<Vec<SeqEvent>> {
    let batch = StoredBatch::decode(blob).ok()?;
    batch
        .events
        .into_iter()
        .map(|e| {
            Some(SeqEvent {
                seq: e.seq,
                event: Event {
                    kind: EventKind::parse(&e.kind)?,
                    author: e.author,
                    text: e.text,
                    tool_name: e.tool_name,
                    tool_call_id: e.tool_call_id,
                    payload_json: e.payload_json,
                    created_unix_nanos: e.created_unix_nanos,
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, kind: EventKind, text: &str) -> SeqEvent {
        SeqEvent {
            seq,
            event: Event {
                kind,
                author: "order_helper".into(),
                text: text.into(),
                tool_name: "lookup_order".into(),
                tool_call_id: format!("call-{seq}"),
                payload_json: r#"{"order":"A-1"}"#.into(),
                created_unix_nanos: 1_733_000_000_000_000_000 + seq as i64,
            },
        }
    }

    #[test]
    fn a_batch_round_trips_every_field_in_order() {
        let batch = vec![
            event(7, EventKind::ToolCall, ""),
            event(8, EventKind::ToolResult, "é ✓"),
            event(9, EventKind::PartialText, "partial"),
            event(10, EventKind::FinalAnswer, "done"),
        ];
        assert_eq!(decode(&encode(batch.clone())), Some(batch));
    }

    #[test]
    fn garbage_and_unknown_kinds_are_refused() {
        assert_eq!(decode(b"\xff\xff\xff"), None);
        let unknown = StoredBatch {
            events: vec![StoredEvent {
                kind: "telepathy".into(),
                ..Default::default()
            }],
        };
        assert_eq!(decode(&unknown.encode_to_vec()), None);
    }
}
