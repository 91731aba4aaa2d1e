//! Server-sent events read from an HTTP body: [`BoundedSse`] bounds what the
//! `eventsource-stream` parser is given and hands it whole lines, so that
//! reading a body costs time and memory in proportion to its size.
//!
//! Used by the model client ([`crate::agent::openai::client`]) and the A2A
//! client's JSON-RPC binding ([`crate::client::a2a::jsonrpc`]).
//!
//! Why whole lines: `eventsource-stream` (0.2) keeps what it has not parsed
//! yet in one string and, at each chunk of the body, parses the line in
//! progress again from its start (a line that comes in n chunks is scanned
//! n times: quadratic in the line's length, and an event's `data` is one
//! line), and after each line it parses it copies what follows into a new
//! string (a chunk of many short lines is copied once per line: quadratic in
//! the chunk's size). Its UTF-8 layer keeps everything after an invalid
//! byte, to the end of the body. Given one complete line of valid UTF-8 at a
//! time, it parses each line once and holds nothing back.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;

/// The most bytes of an `error:` line's value kept (to classify it and for
/// the log); the line itself is bounded as any other.
const MAX_ERROR_LINE_BYTES: usize = 64 * 1024;

/// An SSE body failed, sent an event past the bound or a line that is not
/// UTF-8, reported an error in an `error:` line, or ended inside an event
/// that has no `data` line.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("a server-sent event passed the size bound")]
    TooLarge,
    /// The value of an `error:` line (at most 64 KiB); it can echo the
    /// prompt: for the log only. Only with [`BoundedSse::new`]'s `error:`
    /// lines on.
    #[error("the model server sent an error line")]
    Server(Vec<u8>),
    #[error("a line of the event stream is not UTF-8")]
    Utf8,
    /// The body ended inside an event without a `data` line: these are its
    /// bytes (not whitespace alone; at most the bound). Only with
    /// [`BoundedSse::ending_the_last_event`].
    #[error("the event stream ended inside an event")]
    Unterminated(Vec<u8>),
}

/// An SSE body, checked line by line as the SSE parser will read it, and
/// passed on one whole line at a time (see the module docs):
///
/// - refused once a line grows past `max` bytes, or an event (lines up to
///   a blank one) has by the end of a chunk (an event's lines are held
///   whole by the parser; it may pass `max` by less than a chunk), or at a
///   line that is not UTF-8;
/// - with `error:` lines on ([`Self::new`]; off with
///   [`Self::without_error_lines`]), failed at an `error:` line. Some
///   llama-server builds report a failure met mid-answer (the context
///   filling up) as an event whose field is `error`, then `data: [DONE]`;
///   the SSE parser drops fields other than `data`, `event`, `id` and
///   `retry`, so the answer would end with `[DONE]` alone, as if complete.
///   The lines before it go on first.
///
/// Lines end as the SSE parser ends them: at `\r\n`, `\n` or a lone `\r`,
/// and are passed on ending with `\n` (a `\r` at the end of what the parser
/// has would make it wait for the next byte, to see whether a `\n`
/// follows); line endings are not counted. A line in progress is held
/// (at most `max` bytes) until it ends.
pub struct BoundedSse<S> {
    body: Pin<Box<S>>,
    max: usize,
    error_lines: bool,
    end_last_event: bool,
    /// The chunk being read, and where.
    chunk: Bytes,
    pos: usize,
    /// The line in progress, as far as earlier chunks brought it.
    partial: BytesMut,
    /// Bytes of the line in progress (its end not counted).
    line: usize,
    /// Bytes of the current event's earlier lines.
    event: usize,
    /// The last line ended at a `\r`: a `\n` next is the rest of its end.
    after_cr: bool,
    /// The first bytes of the line in progress, to tell its field.
    head: [u8; 6],
    /// The value of the `error:` line in progress, if the line is one.
    error: Option<Vec<u8>>,
    /// The current event has a `data` line.
    has_data: bool,
    /// The current event's lines, while it has no `data` line (only when
    /// the last event is ended: see [`Self::ending_the_last_event`]).
    kept: Vec<u8>,
    /// Items to return before reading on.
    queue: VecDeque<Result<Bytes, BodyError>>,
    /// The body failed or ended: nothing more is read.
    ended: bool,
}

impl<S> BoundedSse<S> {
    /// `body` with lines and events bounded to `max` bytes, `error:` lines
    /// on; at the end of the body an event that was not ended (by a blank
    /// line) is dropped, as the SSE parser drops it.
    pub fn new(body: S, max: usize) -> Self {
        Self {
            body: Box::pin(body),
            max,
            error_lines: true,
            end_last_event: false,
            chunk: Bytes::new(),
            pos: 0,
            partial: BytesMut::new(),
            line: 0,
            event: 0,
            after_cr: false,
            head: [0; 6],
            error: None,
            has_data: false,
            kept: Vec::new(),
            queue: VecDeque::new(),
            ended: false,
        }
    }

    /// An `error:` line is a field like any other (the SSE parser ignores
    /// it).
    pub fn without_error_lines(mut self) -> Self {
        self.error_lines = false;
        self
    }

    /// At the end of the body, an event that was not ended by a blank line
    /// is still read: one with a `data` line is ended (its last line too)
    /// and goes to the parser; of one without, the bytes are returned in
    /// [`BodyError::Unterminated`] unless they are whitespace alone. A body
    /// cut inside an event is thus never a clean end: its `data` does not
    /// parse, or its bytes are returned.
    pub fn ending_the_last_event(mut self) -> Self {
        self.end_last_event = true;
        self
    }

    /// Ends the body with `e`, dropping what it held.
    fn fail(&mut self, e: BodyError) {
        self.queue.push_back(Err(e));
        self.ended = true;
        self.chunk = Bytes::new();
        self.partial = BytesMut::new();
        self.kept = Vec::new();
    }

    /// Whether the line in progress is a `data` field (`data:…`, or `data`
    /// alone).
    fn data_line(&self) -> bool {
        (self.line >= 5 && self.head[..5] == *b"data:")
            || (self.line == 4 && self.head[..4] == *b"data")
    }

    /// Notes `content`, the next bytes of the line in progress: its first
    /// bytes, and the value of an `error:` line.
    fn note(&mut self, content: &[u8]) {
        let mut from = 0;
        if self.line < self.head.len() {
            from = (self.head.len() - self.line).min(content.len());
            self.head[self.line..self.line + from].copy_from_slice(&content[..from]);
            if self.error_lines && self.line + from == self.head.len() && self.head == *b"error:" {
                self.error = Some(Vec::new());
            }
        }
        if let Some(v) = &mut self.error {
            let rest = &content[from..];
            let room = MAX_ERROR_LINE_BYTES.saturating_sub(v.len());
            v.extend_from_slice(&rest[..rest.len().min(room)]);
        }
    }

    /// Reads on in the current chunk, to the end of the line in progress
    /// (queued) or of the chunk (the line held).
    fn read_line(&mut self) {
        let chunk = self.chunk.clone();
        let rest = &chunk[self.pos..];
        if std::mem::take(&mut self.after_cr) && rest[0] == b'\n' {
            self.pos += 1;
            return;
        }
        let end = rest.iter().position(|&b| b == b'\n' || b == b'\r');
        let content = &rest[..end.unwrap_or(rest.len())];
        self.note(content);
        self.line += content.len();
        if self.line > self.max {
            return self.fail(BodyError::TooLarge);
        }
        let Some(end) = end else {
            self.partial.extend_from_slice(content);
            self.pos = chunk.len();
            return self.end_chunk();
        };
        let start = self.pos;
        self.pos += end + 1;
        self.after_cr = rest[end] == b'\r';
        let line = if self.partial.is_empty() && !self.after_cr {
            // The line and its `\n`, as they came.
            chunk.slice(start..self.pos)
        } else {
            let mut line = std::mem::take(&mut self.partial);
            line.reserve(content.len() + 1);
            line.extend_from_slice(content);
            line.put_u8(b'\n');
            line.freeze()
        };
        self.end_line(line);
        if self.pos == chunk.len() {
            self.end_chunk();
        }
    }

    /// The chunk is read: the event so far is checked against the bound.
    fn end_chunk(&mut self) {
        if !self.ended && self.event + self.line > self.max {
            self.fail(BodyError::TooLarge);
        }
    }

    /// The line in progress ended: `line`, ending with `\n`.
    fn end_line(&mut self, line: Bytes) {
        if let Some(v) = self.error.take() {
            return self.fail(BodyError::Server(v));
        }
        if std::str::from_utf8(&line).is_err() {
            return self.fail(BodyError::Utf8);
        }
        if self.line == 0 {
            // A blank line ends the event.
            self.event = 0;
            self.has_data = false;
            self.kept = Vec::new();
        } else {
            self.event += self.line;
            if self.end_last_event && !self.has_data {
                if self.data_line() {
                    self.has_data = true;
                    self.kept = Vec::new();
                } else {
                    self.kept.extend_from_slice(&line);
                }
            }
        }
        self.line = 0;
        self.queue.push_back(Ok(line));
    }

    /// The body ended.
    fn finish(&mut self) {
        self.ended = true;
        // An `error:` line the body ended in, without its line end.
        if let Some(v) = self.error.take() {
            return self.fail(BodyError::Server(v));
        }
        let partial = std::mem::take(&mut self.partial);
        if std::str::from_utf8(&partial).is_err() {
            return self.fail(BodyError::Utf8);
        }
        if !self.end_last_event {
            // The parser drops a line without its end.
            if !partial.is_empty() {
                self.queue.push_back(Ok(partial.freeze()));
            }
            return;
        }
        if self.has_data || self.data_line() {
            if !partial.is_empty() {
                let mut line = partial;
                line.put_u8(b'\n');
                self.queue.push_back(Ok(line.freeze()));
            }
            self.queue.push_back(Ok(Bytes::from_static(b"\n")));
            return;
        }
        let mut tail = std::mem::take(&mut self.kept);
        tail.extend_from_slice(&partial);
        // Valid UTF-8: kept lines were checked, and so was the partial one.
        if !String::from_utf8_lossy(&tail).trim().is_empty() {
            self.queue.push_back(Err(BodyError::Unterminated(tail)));
        }
    }
}

impl<S> Stream for BoundedSse<S>
where
    S: Stream<Item = Result<Bytes, reqwest::Error>>,
{
    type Item = Result<Bytes, BodyError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // Every field is Unpin (the body is boxed).
        let this = self.get_mut();
        loop {
            if let Some(item) = this.queue.pop_front() {
                return Poll::Ready(Some(item));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if this.pos < this.chunk.len() {
                this.read_line();
                continue;
            }
            match std::task::ready!(this.body.as_mut().poll_next(cx)) {
                Some(Ok(chunk)) => {
                    this.chunk = chunk;
                    this.pos = 0;
                }
                Some(Err(e)) => this.fail(BodyError::Http(e)),
                None => this.finish(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn body(
        parts: Vec<Vec<u8>>,
    ) -> impl Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static {
        futures::stream::iter(parts.into_iter().map(|p| Ok(Bytes::from(p))))
    }

    fn strs(parts: &[&str]) -> Vec<Vec<u8>> {
        parts.iter().map(|p| p.as_bytes().to_vec()).collect()
    }

    /// What `sse` passes on: the lines, and the error it ended with.
    async fn read<S>(sse: BoundedSse<S>) -> (Vec<String>, Option<BodyError>)
    where
        S: Stream<Item = Result<Bytes, reqwest::Error>>,
    {
        let mut lines = Vec::new();
        let mut error = None;
        let items: Vec<_> = sse.collect().await;
        let n = items.len();
        for (i, item) in items.into_iter().enumerate() {
            match item {
                Ok(b) => lines.push(String::from_utf8(b.to_vec()).unwrap()),
                Err(e) => {
                    assert_eq!(i, n - 1, "nothing follows an error");
                    error = Some(e);
                }
            }
        }
        (lines, error)
    }

    /// The parser is given whole lines, each once, however the body is cut
    /// into chunks: it never scans a line again (see the module docs). Line
    /// ends come as `\n`, whichever the body used.
    #[tokio::test]
    async fn the_parser_is_given_each_line_whole_and_once() {
        let text =
            "data: {\"a\":1}\n\nevent: x\r\ndata: two\r\ndata: lines\r\n\r\ndata: cr\r\r: c\n\n";
        let want = [
            "data: {\"a\":1}\n",
            "\n",
            "event: x\n",
            "data: two\n",
            "data: lines\n",
            "\n",
            "data: cr\n",
            "\n",
            ": c\n",
            "\n",
        ];
        for size in [1, 2, 3, 7, text.len()] {
            let parts: Vec<Vec<u8>> = text.as_bytes().chunks(size).map(<[u8]>::to_vec).collect();
            let (lines, error) = read(BoundedSse::new(body(parts), 1 << 20)).await;
            assert!(error.is_none(), "{size}: {error:?}");
            assert_eq!(lines, want, "chunks of {size}");
        }
        // A long line in small chunks: one item, once.
        let long = format!("data: {}\n\n", "x".repeat(100_000));
        let parts: Vec<Vec<u8>> = long.as_bytes().chunks(8192).map(<[u8]>::to_vec).collect();
        let (lines, _) = read(BoundedSse::new(body(parts), 1 << 20)).await;
        assert_eq!(lines.len(), 2);
        assert_eq!(lines.concat(), long);
    }

    /// Through the parser: the same events as the body has, however it is
    /// cut, with `\n\n`, `\r\r` and `\r\n\r\n` between them.
    #[tokio::test]
    async fn the_parser_reads_the_events_of_the_body() {
        use eventsource_stream::Eventsource;
        let text = "data: 1\n\ndata: 2\r\rdata: 3\r\n\r\ndata: 4a\ndata: 4b\n\n";
        for size in [1, 2, 5, text.len()] {
            let parts: Vec<Vec<u8>> = text.as_bytes().chunks(size).map(<[u8]>::to_vec).collect();
            let events: Vec<String> = BoundedSse::new(body(parts), 1 << 20)
                .eventsource()
                .map(|e| e.unwrap().data)
                .collect()
                .await;
            assert_eq!(events, ["1", "2", "3", "4a\n4b"], "chunks of {size}");
        }
    }

    #[tokio::test]
    async fn a_line_past_the_bound_is_refused_even_within_one_chunk() {
        let (_, error) = read(BoundedSse::new(body(strs(&["data: 123456\n\n"])), 10)).await;
        assert!(matches!(error, Some(BodyError::TooLarge)), "{error:?}");
        let (lines, error) = read(BoundedSse::new(body(strs(&["data: 1234\n\n"])), 10)).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines, ["data: 1234\n", "\n"]);
        // A line that never ends is held up to the bound, no more.
        let endless = (0..100).map(|_| vec![b'x'; 1000]).collect();
        let (lines, error) = read(BoundedSse::new(body(endless), 10_000)).await;
        assert!(lines.is_empty(), "{lines:?}");
        assert!(matches!(error, Some(BodyError::TooLarge)), "{error:?}");
    }

    /// eventsource-stream's UTF-8 layer would keep every byte after an
    /// invalid one, to the end of the body.
    #[tokio::test]
    async fn a_line_that_is_not_utf8_fails_the_body() {
        let parts = vec![
            b"data: 1\n\n".to_vec(),
            b"data: \xff\n\n".to_vec(),
            b"data: 2\n\n".to_vec(),
        ];
        let (lines, error) = read(BoundedSse::new(body(parts), 1 << 20)).await;
        assert_eq!(lines, ["data: 1\n", "\n"]);
        assert!(matches!(error, Some(BodyError::Utf8)), "{error:?}");
        // A character split across chunks is whole in its line.
        let text = "data: é\n\n".as_bytes();
        let parts = vec![text[..7].to_vec(), text[7..].to_vec()];
        let (lines, error) = read(BoundedSse::new(body(parts), 1 << 20)).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines, ["data: é\n", "\n"]);
    }

    /// The end of the body, when the last event is ended: one with a `data`
    /// line is ended; one without returns its bytes; whitespace is a clean
    /// end. Without it, a line without its end goes on as it came.
    #[tokio::test]
    async fn the_end_of_the_body_inside_an_event() {
        let end = |parts: &[&str]| {
            let b = body(strs(parts));
            async move {
                read(
                    BoundedSse::new(b, 1 << 20)
                        .without_error_lines()
                        .ending_the_last_event(),
                )
                .await
            }
        };
        let (lines, error) = end(&["data: 1\n\ndata: {\"cut"]).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines, ["data: 1\n", "\n", "data: {\"cut\n", "\n"]);
        let (lines, error) = end(&["id: 1\ndata: 2\n"]).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines, ["id: 1\n", "data: 2\n", "\n"]);
        let (_, error) = end(&["data: 1\n\n", "{\"jsonrpc\":", "\"2.0\"}\n"]).await;
        let Some(BodyError::Unterminated(tail)) = error else {
            panic!("{error:?}")
        };
        assert_eq!(tail, b"{\"jsonrpc\":\"2.0\"}\n");
        let (_, error) = end(&["data: 1\n\nid: 7\r\n: c"]).await;
        assert!(
            matches!(&error, Some(BodyError::Unterminated(t)) if t == b"id: 7\n: c"),
            "{error:?}"
        );
        for clean in [&["data: 1\n\n", " \r\n\t"][..], &["data: 1\n\n\n"], &[]] {
            let (_, error) = end(clean).await;
            assert!(error.is_none(), "{clean:?}: {error:?}");
        }
        // Not ended: the parser drops it.
        let (lines, error) = read(BoundedSse::new(
            body(strs(&["data: 1\n\ndata: 2"])),
            1 << 20,
        ))
        .await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines, ["data: 1\n", "\n", "data: 2"]);
    }

    /// An `error:` line is a field like any other without error lines.
    #[tokio::test]
    async fn error_lines_can_be_left_to_the_parser() {
        let parts = strs(&["error: {\"code\":500}\n\ndata: 1\n\n"]);
        let (lines, error) =
            read(BoundedSse::new(body(parts), 1 << 20).without_error_lines()).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(lines.len(), 4);
    }
}
