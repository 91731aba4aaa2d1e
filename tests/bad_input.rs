//! Bad input gets INVALID_ARGUMENT (or NOT_FOUND) with a clear, sanitised
//! message, and changes nothing.

mod common;

use agentd::server::ServerOptions;
use agentd::store::Store;
use common::*;
use tonic::Code;

async fn refused(server: &mut TestServer, req: agentd::pb::RunRequest) -> tonic::Status {
    match server.client.run(req, DEADLINE).await {
        Ok(_) => panic!("accepted"),
        Err(s) => s,
    }
}

async fn nothing_stored(server: &TestServer, session: &str) {
    let sid = agentd::domain::SessionId::parse(session).unwrap();
    assert!(
        server.store.history(sid, 100).await.unwrap().is_empty(),
        "no turn was stored"
    );
    assert_eq!(server.tool.started(), 0, "nothing ran");
}

#[tokio::test]
async fn malformed_fields_are_invalid_argument_and_nothing_is_stored() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let cases = [
        (run_request("", &s, "r", "hi"), "user_id is required"),
        (run_request("al ice", &s, "r", "hi"), "user_id must be"),
        (
            run_request("alice", "", "r", "hi"),
            "session_id is required",
        ),
        (
            run_request("alice", "not-a-uuid", "r", "hi"),
            "session_id must be a UUID",
        ),
        (
            run_request("alice", &s, "bad id!", "hi"),
            "request_id must be",
        ),
        (
            run_request("alice", &s, &"r".repeat(129), "hi"),
            "request_id must be",
        ),
        (run_request("alice", &s, "r", ""), "text is required"),
        (run_request("alice", &s, "r", " \n\t "), "text is required"),
        (
            run_request("alice", &s, "r", &"x".repeat(64 * 1024 + 1)),
            "text is 65537 bytes; the limit is 65536",
        ),
        (
            with_agent(run_request("alice", &s, "r", "hi"), "../etc"),
            "agent must be",
        ),
    ];
    for (req, want) in cases {
        let status = refused(&mut server, req).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{want}: {status:?}");
        assert!(
            status.message().contains(want),
            "{:?} should contain {want:?}",
            status.message()
        );
    }
    nothing_stored(&server, &s).await;

    let status = server.client.create_session("").await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    server.stop().await;
}

#[tokio::test]
async fn the_status_message_never_echoes_the_bad_value() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let status = refused(
        &mut server,
        run_request("alice <script>secret", &s, "r", "hi"),
    )
    .await;
    assert!(!status.message().contains("secret"), "{}", status.message());
    server.stop().await;
}

#[tokio::test]
async fn a_message_over_the_size_limit_is_invalid_argument() {
    let mut opts = Options::default();
    opts.server = ServerOptions {
        max_message_bytes: 32 * 1024,
        max_input_bytes: 16 * 1024,
        ..opts.server
    };
    let mut server = TestServer::tcp(opts).await;
    let s = server.session("alice").await;
    let status = refused(
        &mut server,
        run_request("alice", &s, "r", &"x".repeat(100 * 1024)),
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("larger than the server accepts"),
        "{}",
        status.message()
    );
    nothing_stored(&server, &s).await;
    // The connection is still good.
    let (_, end) = server
        .client
        .run_to_end(run_request("alice", &s, "r", "hi"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn an_unknown_session_is_not_found() {
    let mut server = TestServer::in_process(Options::default()).await;
    let missing = agentd::domain::SessionId::generate().to_string();
    let status = refused(&mut server, run_request("alice", &missing, "r", "hi")).await;
    assert_eq!(status.code(), Code::NotFound);
    server.stop().await;
}

#[tokio::test]
async fn another_users_session_is_not_found_exactly_like_a_missing_one() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let foreign = refused(
        &mut server,
        run_request("mallory", &s, "r", "Where is order 1187?"),
    )
    .await;
    let missing = refused(
        &mut server,
        run_request(
            "mallory",
            &agentd::domain::SessionId::generate().to_string(),
            "r",
            "hi",
        ),
    )
    .await;
    assert_eq!(foreign.code(), Code::NotFound);
    assert_eq!(
        (foreign.code(), foreign.message()),
        (missing.code(), missing.message()),
        "does not reveal the session exists"
    );
    nothing_stored(&server, &s).await;
    server.stop().await;
}

#[tokio::test]
async fn a_malformed_grpc_timeout_is_invalid_argument() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let mut req = tonic::Request::new(run_request("alice", &s, "r", "hi"));
    req.metadata_mut()
        .insert("grpc-timeout", "soon".parse().unwrap());
    let status = server.client.raw().run(req).await.err().unwrap();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    nothing_stored(&server, &s).await;
    server.stop().await;
}

/// A request whose gRPC framing is broken (a unary call with no message, a
/// message cut short by the end of the stream, a compressed flag with no
/// `grpc-encoding`, a flag that is neither 0 nor 1) is INVALID_ARGUMENT
/// with a message of ours, not tonic's INTERNAL, and creates nothing.
#[tokio::test]
async fn a_request_whose_grpc_framing_is_broken_is_invalid_argument() {
    use tonic::codegen::http;
    use tower::ServiceExt as _;
    const PATH: &str = "/agents.v1.AgentService/CreateSession";
    let server = TestServer::tcp(Options::default()).await;
    let channel = server.channel().await;
    let assert_ours = |what: &str, code: Code, message: &str| {
        assert_eq!(code, Code::InvalidArgument, "{what}: {message}");
        assert!(
            message.contains("framing is not valid")
                && !message.contains("EOF")
                && !message.contains("protocol error"),
            "{what}: {message}"
        );
    };

    // A client stream with no message, to a unary method.
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let status = grpc
        .client_streaming(
            tonic::Request::new(futures::stream::empty::<Vec<u8>>()),
            tonic::codegen::http::uri::PathAndQuery::from_static(PATH),
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_ours("no message", status.code(), status.message());

    // Frames as they are: the 5-byte gRPC prefix (flag, length) and what
    // follows it.
    let frames: [(&str, &[u8]); 4] = [
        ("no message", &[]),
        ("a message cut short", &[0, 0, 0, 0, 10, 0x0a, 0x02]),
        ("a compressed flag with no grpc-encoding", &[1, 0, 0, 0, 0]),
        ("a flag neither 0 nor 1", &[2, 0, 0, 0, 0]),
    ];
    for (what, body) in frames {
        let req = http::Request::post(PATH)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(tonic::body::Body::new(http_body_util::Full::new(
                bytes::Bytes::from_static(body),
            )))
            .unwrap();
        let resp = channel.clone().oneshot(req).await.unwrap();
        // Refused before any handler runs: a trailers-only response.
        let status = tonic::Status::from_header_map(resp.headers())
            .unwrap_or_else(|| panic!("{what}: no status in the headers: {resp:?}"));
        assert_ours(what, status.code(), status.message());
    }
    assert_eq!(
        server
            .store
            .list_sessions(&agentd::domain::UserId::parse("alice").unwrap(), 10, None)
            .await
            .unwrap()
            .sessions
            .len(),
        0
    );
    server.stop().await;
}

/// Bytes sent as they are: what a client that does not speak protobuf
/// (or a broken one) puts in a gRPC message.
#[derive(Clone, Copy, Default)]
struct RawCodec;

struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = agentd::pb::SessionRef;
    type Encoder = RawEncoder;
    type Decoder = tonic_prost::ProstDecoder<agentd::pb::SessionRef>;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<(), agentd::pb::SessionRef>::raw_decoder(
            tonic::codec::BufferSettings::default(),
        )
    }
}

/// A request that is not valid protobuf (a string that is not UTF-8, a
/// message cut short) is INVALID_ARGUMENT with a message of ours, not
/// tonic's INTERNAL naming the message type and field, and creates nothing.
#[tokio::test]
async fn a_request_that_is_not_valid_protobuf_is_invalid_argument() {
    let server = TestServer::tcp(Options::default()).await;
    let channel = server.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    for body in [vec![0x0a, 0x02, 0xff, 0xfe], vec![0x0a, 0x05, 0xab]] {
        grpc.ready().await.unwrap();
        let status = grpc
            .unary(
                tonic::Request::new(body.clone()),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/agents.v1.AgentService/CreateSession",
                ),
                RawCodec,
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{body:?}: {status:?}");
        assert!(
            status.message().contains("not valid protobuf")
                && !status.message().contains("CreateSessionRequest"),
            "{}",
            status.message()
        );
    }
    assert_eq!(
        server
            .store
            .list_sessions(&agentd::domain::UserId::parse("alice").unwrap(), 10, None)
            .await
            .unwrap()
            .sessions
            .len(),
        0
    );
    server.stop().await;
}
