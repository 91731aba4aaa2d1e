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

/// Encodes a batch as a [`StoredBatch`], written straight from the events:
/// no intermediate messages, one allocation of the exact size. (Turns hand
/// the stores events already encoded; this is for tests and old rows.)
#[cfg(test)]
pub(super) fn encode(events: &[SeqEvent]) -> Vec<u8> {
    let lens: Vec<usize> = events.iter().map(|e| event_len(e.seq, &e.event)).collect();
    let total: usize = lens.iter().map(|&n| entry_len(n)).sum();
    let mut buf = Vec::with_capacity(total);
    for (e, &n) in events.iter().zip(&lens) {
        put_entry(&mut buf, n, e.seq, &e.event);
    }
    debug_assert_eq!(buf.len(), total);
    buf
}

/// The bytes [`put_entry`] writes for an event whose message is
/// `event_len` bytes ([`event_len`]): its entry in a [`StoredBatch`] (key,
/// length, message). A batch's blob is its events' entries one after
/// another, so each event is encoded once, alone, and batches are made by
/// concatenation.
pub(super) fn entry_len(event_len: usize) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    key_len(1) + encoded_len_varint(event_len as u64) + event_len
}

/// Writes one event's [`StoredBatch`] entry; `event_len` is its
/// [`event_len`], computed once by the caller, which also sizes the buffer.
pub(super) fn put_entry(buf: &mut impl bytes::BufMut, event_len: usize, seq: u64, e: &Event) {
    use prost::encoding::{WireType, encode_key, encode_varint};
    encode_key(1, WireType::LengthDelimited, buf);
    encode_varint(event_len as u64, buf);
    put_scalar(buf, 1, seq);
    put_str(buf, 2, e.kind.as_str());
    put_str(buf, 3, &e.author);
    put_str(buf, 4, &e.text);
    put_str(buf, 5, &e.tool_name);
    put_str(buf, 6, &e.tool_call_id);
    put_str(buf, 7, &e.payload_json);
    put_scalar(buf, 8, e.created_unix_nanos as u64);

    fn put_scalar(buf: &mut impl bytes::BufMut, tag: u32, v: u64) {
        if v != 0 {
            encode_key(tag, WireType::Varint, buf);
            encode_varint(v, buf);
        }
    }
    fn put_str(buf: &mut impl bytes::BufMut, tag: u32, s: &str) {
        if !s.is_empty() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(s.len() as u64, buf);
            buf.put_slice(s.as_bytes());
        }
    }
}

/// The length of one [`StoredEvent`] message. proto3 rules, as prost
/// applies them: a field at its default value (0, "") is not written; an
/// int64 is written as the varint of its two's complement, like a uint64.
pub(super) fn event_len(seq: u64, e: &Event) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    return scalar_len(1, seq)
        + str_len(2, e.kind.as_str())
        + str_len(3, &e.author)
        + str_len(4, &e.text)
        + str_len(5, &e.tool_name)
        + str_len(6, &e.tool_call_id)
        + str_len(7, &e.payload_json)
        + scalar_len(8, e.created_unix_nanos as u64);

    fn scalar_len(tag: u32, v: u64) -> usize {
        if v == 0 {
            0
        } else {
            key_len(tag) + encoded_len_varint(v)
        }
    }
    fn str_len(tag: u32, s: &str) -> usize {
        if s.is_empty() {
            0
        } else {
            key_len(tag) + encoded_len_varint(s.len() as u64) + s.len()
        }
    }
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
        assert_eq!(decode(&encode(&batch)), Some(batch));
    }

    /// The hand-written encoder produces exactly what prost's derived
    /// encoding of the same [`StoredBatch`] does, defaults and negative
    /// timestamps included, so either can read the other's rows.
    #[test]
    fn the_direct_encoder_writes_the_bytes_prost_writes() {
        let mut batch = vec![
            event(0, EventKind::ToolCall, ""),
            event(1, EventKind::PartialText, "x"),
            event(300, EventKind::FinalAnswer, &"long ".repeat(100)),
        ];
        batch[0].event.author.clear();
        batch[0].event.created_unix_nanos = 0;
        batch[1].event.created_unix_nanos = -5;
        batch[1].event.payload_json.clear();
        let derived = StoredBatch {
            events: batch
                .iter()
                .map(|e| StoredEvent {
                    seq: e.seq,
                    kind: e.event.kind.as_str().to_owned(),
                    author: e.event.author.clone(),
                    text: e.event.text.clone(),
                    tool_name: e.event.tool_name.clone(),
                    tool_call_id: e.event.tool_call_id.clone(),
                    payload_json: e.event.payload_json.clone(),
                    created_unix_nanos: e.event.created_unix_nanos,
                })
                .collect(),
        };
        assert_eq!(encode(&batch), derived.encode_to_vec());
        assert_eq!(encode(&[]), Vec::<u8>::new());
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
