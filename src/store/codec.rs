//! How the SQL stores keep a turn's event log: one row per group commit,
//! holding the batch's events as one protobuf blob. A row per event would put
//! an index update and a row's worth of binds on every event; a batch row
//! costs one insert per commit, whatever the batch size.
//!
//! The blob is this module's own message, not the wire `AgentEvent`, so the
//! stored form does not change when the API does.
//!
//! An event's kind is stored by name (`kind`) or by number (`kind_code`,
//! [`KindEncoding`]); every reader takes either. A number is 12 bytes less
//! per event (a tenth of a streamed token's row), and on SQLite every stored
//! byte is written about two and a half times (WAL, then checkpoint): the
//! bursty benchmark wrote 11-16% fewer bytes per event, at the same events/s
//! within its spread. Releases before numbers read only names, so
//! PostgreSQL, whose rows replicas of the previous release read during a
//! rolling upgrade, still writes names.

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
    /// Empty when `kind_code` says the kind.
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
    /// The kind as [`kind_code`]'s number, where `kind` is empty.
    #[prost(uint32, tag = "9")]
    kind_code: u32,
}

/// How an event's kind is written into the event log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindEncoding {
    /// By name: what every release reads.
    Name,
    /// By number: 12 bytes less per event; read by this release on.
    Code,
}

/// The stored number of each kind. Fixed: stored rows keep them.
fn kind_code(kind: EventKind) -> u32 {
    match kind {
        EventKind::ToolCall => 1,
        EventKind::ToolResult => 2,
        EventKind::PartialText => 3,
        EventKind::FinalAnswer => 4,
    }
}

fn kind_of_code(code: u32) -> Option<EventKind> {
    Some(match code {
        1 => EventKind::ToolCall,
        2 => EventKind::ToolResult,
        3 => EventKind::PartialText,
        4 => EventKind::FinalAnswer,
        _ => return None,
    })
}

/// Encodes a batch as a [`StoredBatch`], written straight from the events:
/// no intermediate messages, one allocation of the exact size. (Turns hand
/// the stores events already encoded; this is for tests and old rows.)
#[cfg(test)]
pub(super) fn encode(events: &[SeqEvent], kinds: KindEncoding) -> Vec<u8> {
    let lens: Vec<usize> = events
        .iter()
        .map(|e| event_len(e.seq, &e.event, kinds))
        .collect();
    let total: usize = lens.iter().map(|&n| entry_len(n)).sum();
    let mut buf = Vec::with_capacity(total);
    for (e, &n) in events.iter().zip(&lens) {
        put_entry(&mut buf, n, e.seq, &e.event, kinds);
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
pub(super) fn put_entry(
    buf: &mut impl bytes::BufMut,
    event_len: usize,
    seq: u64,
    e: &Event,
    kinds: KindEncoding,
) {
    use prost::encoding::{WireType, encode_key, encode_varint};
    encode_key(1, WireType::LengthDelimited, buf);
    encode_varint(event_len as u64, buf);
    put_scalar(buf, 1, seq);
    if kinds == KindEncoding::Name {
        put_str(buf, 2, e.kind.as_str());
    }
    put_str(buf, 3, &e.author);
    put_str(buf, 4, &e.text);
    put_str(buf, 5, &e.tool_name);
    put_str(buf, 6, &e.tool_call_id);
    put_str(buf, 7, &e.payload_json);
    put_scalar(buf, 8, e.created_unix_nanos as u64);
    if kinds == KindEncoding::Code {
        put_scalar(buf, 9, kind_code(e.kind).into());
    }

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
pub(super) fn event_len(seq: u64, e: &Event, kinds: KindEncoding) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let kind = match kinds {
        KindEncoding::Name => str_len(2, e.kind.as_str()),
        KindEncoding::Code => scalar_len(9, kind_code(e.kind).into()),
    };
    return scalar_len(1, seq)
        + kind
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
                    kind: match e.kind.as_str() {
                        "" => kind_of_code(e.kind_code)?,
                        name => EventKind::parse(name)?,
                    },
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
    fn a_batch_round_trips_every_field_in_order_with_kinds_by_name_or_number() {
        let batch = vec![
            event(7, EventKind::ToolCall, ""),
            event(8, EventKind::ToolResult, "é ✓"),
            event(9, EventKind::PartialText, "partial"),
            event(10, EventKind::FinalAnswer, "done"),
        ];
        for kinds in [KindEncoding::Name, KindEncoding::Code] {
            assert_eq!(decode(&encode(&batch, kinds)), Some(batch.clone()));
        }
        // One blob may hold both (rows written before and after a change of
        // encoding are read alike): entries are concatenated.
        let mut mixed = encode(&batch[..2], KindEncoding::Name);
        mixed.extend(encode(&batch[2..], KindEncoding::Code));
        assert_eq!(decode(&mixed), Some(batch));
    }

    /// A number costs two bytes where `partial_text` costs fourteen.
    #[test]
    fn kinds_by_number_take_fewer_bytes() {
        let batch = vec![event(9, EventKind::PartialText, "partial")];
        let (name, code) = (
            encode(&batch, KindEncoding::Name),
            encode(&batch, KindEncoding::Code),
        );
        assert_eq!(name.len() - code.len(), 12);
        assert!(!code.windows(12).any(|w| w == b"partial_text"));
    }

    /// The hand-written encoder produces exactly what prost's derived
    /// encoding of the same [`StoredBatch`] does, defaults and negative
    /// timestamps included, so either can read the other's rows.
    #[test]
    fn the_direct_encoder_writes_the_bytes_prost_writes_either_way() {
        let mut batch = vec![
            event(0, EventKind::ToolCall, ""),
            event(1, EventKind::PartialText, "x"),
            event(300, EventKind::FinalAnswer, &"long ".repeat(100)),
        ];
        batch[0].event.author.clear();
        batch[0].event.created_unix_nanos = 0;
        batch[1].event.created_unix_nanos = -5;
        batch[1].event.payload_json.clear();
        for kinds in [KindEncoding::Name, KindEncoding::Code] {
            let derived = StoredBatch {
                events: batch
                    .iter()
                    .map(|e| StoredEvent {
                        seq: e.seq,
                        kind: match kinds {
                            KindEncoding::Name => e.event.kind.as_str().to_owned(),
                            KindEncoding::Code => String::new(),
                        },
                        kind_code: match kinds {
                            KindEncoding::Name => 0,
                            KindEncoding::Code => kind_code(e.event.kind),
                        },
                        author: e.event.author.clone(),
                        text: e.event.text.clone(),
                        tool_name: e.event.tool_name.clone(),
                        tool_call_id: e.event.tool_call_id.clone(),
                        payload_json: e.event.payload_json.clone(),
                        created_unix_nanos: e.event.created_unix_nanos,
                    })
                    .collect(),
            };
            assert_eq!(encode(&batch, kinds), derived.encode_to_vec());
            assert_eq!(encode(&[], kinds), Vec::<u8>::new());
        }
    }

    /// The numbers are part of the stored form: rows written with them must
    /// read back the same kinds in every later release.
    #[test]
    fn the_kind_numbers_are_fixed() {
        let numbered: Vec<(u32, EventKind)> = (0..=5)
            .filter_map(|c| kind_of_code(c).map(|k| (c, k)))
            .collect();
        assert_eq!(
            numbered,
            vec![
                (1, EventKind::ToolCall),
                (2, EventKind::ToolResult),
                (3, EventKind::PartialText),
                (4, EventKind::FinalAnswer),
            ]
        );
        for (c, k) in numbered {
            assert_eq!(kind_code(k), c);
        }
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
        for kind_code in [0, 5, 99] {
            let unknown = StoredBatch {
                events: vec![StoredEvent {
                    kind_code,
                    ..Default::default()
                }],
            };
            assert_eq!(
                decode(&unknown.encode_to_vec()),
                None,
                "kind_code {kind_code}"
            );
        }
    }
}
