//! Domain events to and from their `agents.v1` wire form.

use crate::agent::{Event, EventKind};
use crate::pb;

pub fn kind_to_wire(kind: EventKind) -> pb::EventKind {
    match kind {
        EventKind::ToolCall => pb::EventKind::ToolCall,
        EventKind::ToolResult => pb::EventKind::ToolResult,
        EventKind::PartialText => pb::EventKind::PartialText,
        EventKind::FinalAnswer => pb::EventKind::FinalAnswer,
    }
}

/// The wire form of event `seq`, taking its strings over.
pub fn into_wire(seq: u64, e: Event) -> pb::AgentEvent {
    pb::AgentEvent {
        seq,
        is_final: e.is_final(),
        kind: kind_to_wire(e.kind) as i32,
        text: e.text,
        author: e.author,
        tool_name: e.tool_name,
        tool_call_id: e.tool_call_id,
        payload_json: e.payload_json,
        created_unix_nanos: e.created_unix_nanos,
    }
}
