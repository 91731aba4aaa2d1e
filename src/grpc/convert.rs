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

pub fn to_wire(seq: u64, e: &Event) -> pb::AgentEvent {
    pb::AgentEvent {
        seq,
        text: e.text.clone(),
        is_final: e.is_final(),
        kind: kind_to_wire(e.kind) as i32,
        author: e.author.clone(),
        tool_name: e.tool_name.clone(),
        tool_call_id: e.tool_call_id.clone(),
        payload_json: e.payload_json.clone(),
        created_unix_nanos: e.created_unix_nanos,
    }
}
