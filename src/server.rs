//! Assembly: the gRPC services, health, reflection, HTTP/2 settings, and the
//! shutdown sequence (NOT_SERVING, drain delay, stop accepting, grace, cut).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_stream::Stream;
use tokio_util::task::AbortOnDropHandle;
use tonic::codegen::http;
use tonic::transport::server::{Connected, TcpIncoming};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::auth::tls::{LiveTls, TLS_HANDSHAKE_TIMEOUT, TlsFiles};
use crate::auth::{AuthLayer, Authenticator};
use crate::grpc::agents::{AgentServiceServer, AgentsService, Limits};
use crate::telemetry::admin::Readiness;
use crate::telemetry::rpc::RpcLayer;
use crate::turn::Turns;

/// Transport and lifecycle settings of one server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// HTTP/2 PING interval; `None` sends none.
    pub keepalive_interval: Option<Duration>,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Connections older than this get GOAWAY so clients rebalance.
    pub max_connection_age: Option<Duration>,
    /// HTTP/2 streams per connection (tonic's default is unlimited).
    pub max_concurrent_streams: u32,
    /// Connections each port holds at once; past it new ones are closed.
    pub max_connections: usize,
    /// Largest request message tonic decodes.
    pub max_message_bytes: usize,
    /// Longest RunRequest.text.
    pub max_input_bytes: usize,
    /// NOT_SERVING while still serving, before we stop accepting.
    pub drain_delay: Duration,
    /// How long in-flight runs may take once we stop accepting.
    pub shutdown_grace: Duration,
    /// TLS and authentication of the port.
    pub security: Security,
    /// How often the TLS and token files are read again (changed ones are
    /// served once they pass the start-up checks); `None`: never.
    pub reload_interval: Option<Duration>,
    /// Also read them again on SIGHUP (the binary; not in-process servers,
    /// which would take the signal from the process they run in).
    pub reload_on_sighup: bool,
    /// Mirrors the health entries for the admin port's `/readyz`.
    pub readiness: Readiness,
    /// Serve A2A's conformance agent, with this resubscription wait.
    pub a2a_conformance: Option<Duration>,
}

/// TLS and authentication of the gRPC port.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// Serve TLS (and mTLS with a client CA); `None` serves plaintext h2c.
    /// Files read by [`TlsFiles::load`] are reloaded while serving (see
    /// [`crate::auth::reload`]).
    pub tls: Option<TlsFiles>,
    /// Check credentials on every call; `None` lets every call in. Its
    /// tokens file, if any, is reloaded while serving.
    pub auth: Option<Arc<Authenticator>>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            keepalive_interval: Some(Duration::from_secs(30)),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: Some(Duration::from_secs(30 * 60)),
            max_concurrent_streams: 1024,
            max_connections: 4096,
            max_message_bytes: 4 * 1024 * 1024,
            max_input_bytes: 64 * 1024,
            drain_delay: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(130),
            security: Security::default(),
            reload_interval: Some(Duration::from_secs(30)),
            reload_on_sighup: false,
            readiness: Readiness::default(),
            a2a_conformance: None,
        }
    }
}

/// After the grace, how long cut runs get to record their outcome.
const CUT_FLUSH: Duration = Duration::from_secs(5);
/// After the runs, how long connections get to deliver what they buffered.
const CONNECTIONS_CLOSE: Duration = Duration::from_secs(5);

/// The name health reports for the agents service.
pub const AGENT_SERVICE_NAME: &str = "agents.v1.AgentService";

/// Serves on a bound TCP listener until `shutdown` resolves, then drains.
pub async fn run(
    listener: tokio::net::TcpListener,
    turns: Arc<Turns>,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    serve(incoming, turns, opts, shutdown).await
}

/// The A2A HTTP face (JSON-RPC, SSE, agent card) of a server.
pub struct A2aHttp {
    pub listener: tokio::net::TcpListener,
    /// Where the card says the two bindings are.
    pub advertised: crate::a2a::Advertised,
}

/// [`run`], plus A2A's JSON-RPC face on its own listener; both stop
/// accepting at the same moment of the shutdown sequence.
pub async fn run_with_a2a(
    listener: tokio::net::TcpListener,
    a2a_http: Option<A2aHttp>,
    turns: Arc<Turns>,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    serve_with_a2a(incoming, a2a_http, turns, opts, shutdown).await
}

/// Connections a port's kernel queue holds before they are accepted (the
/// kernel caps it at `net.core.somaxconn`): room for a fleet of clients
/// reconnecting at once, after a deploy or a replica's restart.
const LISTEN_BACKLOG: i32 = 1024;

/// Binds a listening TCP socket for `flag` (named in errors and warnings).
///
/// `[::]` listens on IPv6 and IPv4 alike (dual stack), whatever the
/// system's `net.ipv6.bindv6only`, so one address serves single-stack and
/// dual-stack clusters. On a kernel without IPv6 (booted with
/// `ipv6.disable=1`) it listens on `0.0.0.0` instead, with a warning.
pub fn bind(addr: std::net::SocketAddr, flag: &str) -> anyhow::Result<tokio::net::TcpListener> {
    let (listener, fell_back) = bind_with(addr, bind_socket)
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr} ({flag}): {e}"))?;
    if let Some(why) = fell_back {
        tracing::warn!(
            listen = %addr,
            error = %why,
            "{flag}: this kernel has no IPv6; listening on IPv4 only (0.0.0.0)"
        );
    }
    Ok(listener)
}

/// [`bind`] over `socket`, which binds one address; the error of the `[::]`
/// attempt when it fell back to `0.0.0.0`.
fn bind_with(
    addr: std::net::SocketAddr,
    socket: impl Fn(std::net::SocketAddr) -> std::io::Result<std::net::TcpListener>,
) -> std::io::Result<(tokio::net::TcpListener, Option<std::io::Error>)> {
    let any_v6 = addr.is_ipv6() && addr.ip().is_unspecified();
    let (std_listener, fell_back) = match socket(addr) {
        Ok(l) => (l, None),
        Err(e) if any_v6 && no_ipv6(&e) => {
            let v4 = std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            (socket(v4)?, Some(e))
        }
        Err(e) => return Err(e),
    };
    std_listener.set_nonblocking(true)?;
    Ok((tokio::net::TcpListener::from_std(std_listener)?, fell_back))
}

/// The error of a socket the kernel cannot make because it has no IPv6.
fn no_ipv6(e: &std::io::Error) -> bool {
    // EAFNOSUPPORT (97 on Linux): the address family is not supported (no
    // IPv6 at all); EADDRNOTAVAIL: IPv6 switched off on every interface.
    e.raw_os_error() == Some(97) || e.kind() == std::io::ErrorKind::AddrNotAvailable
}

fn bind_socket(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    // As std's and tokio's listeners: a restarted server binds its port
    // while the old one's connections are still in TIME_WAIT. (Unix only:
    // on Windows it would let another socket take the port.)
    #[cfg(unix)]
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// Serves connections from `incoming` (TCP, or in-memory in tests).
pub async fn serve<I, IO, IE>(
    incoming: I,
    turns: Arc<Turns>,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()>
where
    I: Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    serve_with_a2a(incoming, None, turns, opts, shutdown).await
}

/// [`serve`], plus the A2A HTTP face when `a2a_http` is given. The A2A gRPC
/// service is always on the gRPC port.
pub async fn serve_with_a2a<I, IO, IE>(
    incoming: I,
    a2a_http: Option<A2aHttp>,
    turns: Arc<Turns>,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()>
where
    I: Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let a2a = crate::a2a::A2a::new(
        turns.clone(),
        opts.max_input_bytes,
        opts.a2a_conformance,
        opts.security.auth.clone(),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, &opts.readiness, ServingStatus::Serving).await;
    // Store upkeep (health checks, expired leases, retention, cancels
    // announced by other replicas), mirrored into grpc.health until
    // shutdown takes health over. The upkeep itself runs on until the runs
    // are done: a run draining here is still stopped by a CancelTurn served
    // elsewhere, and CancelTurn and DeleteSession here see the store come
    // back. Every task started here is aborted when this function
    // returns, by an error too (a server that stopped by itself, a
    // configuration refused below): nothing of the server outlives it.
    let upkeep = AbortOnDropHandle::new(tokio::spawn(turns.upkeep()));
    let mirror = AbortOnDropHandle::new(tokio::spawn(store_health_mirror(
        turns.clone(),
        health.clone(),
        opts.readiness.clone(),
    )));
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(crate::pb::A2A_FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let agents = AgentServiceServer::new(AgentsService::new(
        turns.clone(),
        Limits {
            max_input_bytes: opts.max_input_bytes,
        },
    ))
    .max_decoding_message_size(opts.max_message_bytes);

    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(opts.keepalive_interval)
        .http2_keepalive_timeout(Some(opts.keepalive_timeout))
        .max_concurrent_streams(Some(opts.max_concurrent_streams))
        .tcp_nodelay(true);
    // TLS is ours (see `tls_handshakes`), not tonic's, whose configuration
    // cannot change once serving.
    let live_tls = match &opts.security.tls {
        Some(tls) => Some(Arc::new(LiveTls::new(tls.server_config()?))),
        None => None,
    };
    let reloader = crate::auth::reload::Reloader::new(
        opts.security.tls.as_ref().zip(live_tls.clone()),
        opts.security.auth.clone(),
    );
    let _reloading = (reloader.is_some() || opts.reload_on_sighup).then(|| {
        AbortOnDropHandle::new(tokio::spawn(crate::auth::reload::watch(
            reloader,
            opts.reload_interval,
            opts.reload_on_sighup,
        )))
    });
    let max_connection_age = opts.max_connection_age.map(jittered_age);
    if let Some(age) = max_connection_age {
        // Without max_connection_age_grace: with it, tonic closes the
        // connection at age + grace without a GOAWAY. Alone, it sends GOAWAY
        // at `age` and lets in-flight calls finish.
        builder = builder.max_connection_age(age);
    }
    let rpc = RpcLayer::new(&[
        crate::pb::FILE_DESCRIPTOR_SET,
        crate::pb::A2A_FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
    ])?;
    let router = builder
        // Outermost: the call's span and metrics see every call, refusals of
        // the layers below included, with the status the client gets, and
        // end when the response stream ends.
        .layer(rpc)
        // Rewrites tonic's status for an oversized request, the one refusal
        // produced before our handlers see the request.
        .layer(tower::util::MapResponseLayer::new(
            client_errors_are_invalid_argument,
        ))
        // Innermost: credentials are checked before anything is decoded, and
        // the caller rides in the request's extensions to the handlers.
        .layer(AuthLayer::new(opts.security.auth.clone()))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(agents)
        .add_service(a2a.grpc_service(opts.max_message_bytes));

    let incoming = capped(incoming, opts.max_connections);
    let (stop_accepting, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopped = async {
        let _ = stop_rx.await;
    };
    let mut serving = AbortOnDropHandle::new(match live_tls {
        Some(tls) => tokio::spawn(
            router.serve_with_incoming_shutdown(tls_handshakes(incoming, tls), stopped),
        ),
        None => tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped)),
    });
    let (stop_a2a, stop_a2a_rx) = tokio::sync::oneshot::channel::<()>();
    let mut a2a_serving = a2a_http.map(|h| {
        let card = crate::a2a::agent_card(turns.agents(), &h.advertised, a2a.credentials());
        AbortOnDropHandle::new(tokio::spawn(crate::a2a::serve_http(
            h.listener,
            a2a.http_router(card, opts.max_message_bytes),
            opts.max_connections,
            async {
                let _ = stop_a2a_rx.await;
            },
        )))
    });
    tracing::info!(
        agents = ?turns.agents().names().collect::<Vec<_>>(),
        default = turns.agents().default_name(),
        max_connection_age = %max_connection_age.map_or_else(
            || "off".to_owned(),
            |age| humantime::format_duration(Duration::from_millis(age.as_millis() as u64)).to_string(),
        ),
        "serving"
    );

    tokio::select! {
        _ = shutdown => {}
        r = &mut serving => {
            r??;
            anyhow::bail!("the gRPC server stopped by itself");
        }
        r = async {
            match a2a_serving.as_mut() {
                Some(h) => h.await,
                None => std::future::pending().await,
            }
        } => {
            r??;
            anyhow::bail!("the A2A HTTP server stopped by itself");
        }
    }
    mirror.abort();
    let _ = mirror.await;
    tracing::info!(drain_delay = ?opts.drain_delay, "shutdown: health NOT_SERVING; still accepting during the drain delay");
    set_health(&health, &opts.readiness, ServingStatus::NotServing).await;
    // Cut short when the runs are cut (a second signal).
    tokio::select! {
        _ = tokio::time::sleep(opts.drain_delay) => {}
        _ = turns.cut_requested() => {}
    }

    turns.begin_drain();
    let _ = stop_accepting.send(());
    let _ = stop_a2a.send(());
    tracing::info!(runs = turns.runs_in_flight(), followers = turns.followers_in_flight(), grace = ?opts.shutdown_grace, "shutdown: stopped accepting; waiting for in-flight runs");
    if tokio::time::timeout(opts.shutdown_grace, turns.wait_idle())
        .await
        .is_err()
    {
        tracing::warn!(
            runs = turns.runs_in_flight(),
            followers = turns.followers_in_flight(),
            "shutdown: grace passed; cutting the runs still in flight (they end with UNAVAILABLE)"
        );
        turns.cut_all();
        if tokio::time::timeout(CUT_FLUSH, turns.wait_idle())
            .await
            .is_err()
        {
            tracing::error!(
                runs = turns.runs_in_flight(),
                followers = turns.followers_in_flight(),
                "shutdown: runs did not stop after being cut"
            );
        }
    }
    upkeep.abort();
    let _ = upkeep.await;
    match tokio::time::timeout(CONNECTIONS_CLOSE, &mut serving).await {
        Ok(r) => r??,
        Err(_) => {
            tracing::warn!("shutdown: connections still open; closing them");
            serving.abort();
        }
    }
    if let Some(a2a_serving) = a2a_serving.as_mut() {
        match tokio::time::timeout(CONNECTIONS_CLOSE, &mut *a2a_serving).await {
            Ok(r) => r??,
            Err(_) => {
                tracing::warn!("shutdown: A2A HTTP connections still open; closing them");
                a2a_serving.abort();
            }
        }
    }
    tracing::info!("shutdown complete");
    Ok(())
}

/// Reports NOT_SERVING while the turn engine's store is unreachable (as
/// its upkeep finds it), SERVING again once it answers.
async fn store_health_mirror(turns: Arc<Turns>, health: HealthReporter, readiness: Readiness) {
    let mut store_ok = turns.store_health();
    while store_ok.changed().await.is_ok() {
        let ok = *store_ok.borrow_and_update();
        set_health(
            &health,
            &readiness,
            if ok {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            },
        )
        .await;
    }
}

async fn set_health(health: &HealthReporter, readiness: &Readiness, status: ServingStatus) {
    readiness.set(status == ServingStatus::Serving);
    health.set_service_status("", status).await;
    health.set_service_status(AGENT_SERVICE_NAME, status).await;
    health
        .set_service_status(crate::a2a::A2A_SERVICE_NAME, status)
        .await;
}

/// tonic refuses a request larger than the decoding limit with OUT_OF_RANGE,
/// one that is not valid protobuf with INTERNAL (naming the message type
/// and field that failed), and one whose gRPC framing is broken with
/// INTERNAL too (a unary call with no message, a message cut short by the
/// end of the stream, a compressed flag with no `grpc-encoding` or a flag
/// that is neither 0 nor 1), before any handler runs; our contract says
/// INVALID_ARGUMENT, with a message of our own. Such a refusal is a
/// trailers-only response, so only the headers change.
fn client_errors_are_invalid_argument<B>(mut resp: http::Response<B>) -> http::Response<B> {
    /// tonic's messages for a request whose framing is broken, as they
    /// start (tonic percent-encodes the spaces).
    const BROKEN_FRAMING: [&str; 3] = [
        "Missing%20request%20message.",
        "Unexpected%20EOF%20decoding%20stream.",
        "protocol%20error:",
    ];
    let h = resp.headers();
    let status = h.get("grpc-status").and_then(|v| v.to_str().ok());
    let message = h
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default();
    let ours = match status {
        Some("11")
            if message.contains("message%20length%20too%20large")
                || message.contains("message length too large") =>
        {
            "the%20request%20message%20is%20larger%20than%20the%20server%20accepts"
        }
        Some("13")
            if message.starts_with("failed%20to%20decode")
                || message.starts_with("failed to decode") =>
        {
            "the%20request%20message%20is%20malformed%20(not%20valid%20protobuf%20for%20this%20method)"
        }
        Some("13")
            if BROKEN_FRAMING
                .iter()
                .any(|m| message.starts_with(m) || message.starts_with(&m.replace("%20", " "))) =>
        {
            "the%20request%20is%20malformed%20(its%20gRPC%20framing%20is%20not%20valid:%20no%20message,%20a%20message%20cut%20short,%20or%20a%20bad%20compressed%20flag)"
        }
        _ => return resp,
    };
    let h = resp.headers_mut();
    h.insert("grpc-status", http::HeaderValue::from_static("3"));
    h.insert("grpc-message", http::HeaderValue::from_static(ours));
    resp
}

/// `age` times a factor drawn at random in [0.9, 1.1], as gRPC's A9
/// (server-side connection management) asks. tonic gives every connection
/// of a server the same age, so without it the connections a fleet of
/// clients opened together (a deploy, a replica that restarted) would get
/// GOAWAY together, reconnect together, and do so again at every age. Drawn
/// once per server: its connections still share one age, but each replica's
/// differs, which spreads the reconnections across them.
fn jittered_age(age: Duration) -> Duration {
    age.mul_f64(0.9 + 0.2 * fastrand::f64())
}

/// How long a port waits after a failed accept before it accepts again. Out
/// of file descriptors (EMFILE), the connection stays in the listen queue
/// and the listener stays readable: accepting again at once fails again at
/// once, a loop that takes a whole core and starves the connections served.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// While accepts keep failing, how often a port warns again.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(60);

/// The failed accepts of one port: each is counted
/// (`agentd_accept_errors_total`) and followed by an [`ACCEPT_RETRY`] pause;
/// a warning is logged at the first and then at most once per
/// [`ACCEPT_WARN_EVERY`] (one per retry would be 20 lines a second for as
/// long as the descriptors stay short), and the next accept after a warning
/// says that accepting works again.
struct AcceptErrors {
    port: &'static str,
    /// When the last warning was logged.
    warned: Option<tokio::time::Instant>,
    /// Failures since then.
    unlogged: u64,
    /// A warning was logged since the last accepted connection.
    failing: bool,
}

impl AcceptErrors {
    fn new(port: &'static str) -> Self {
        Self {
            port,
            warned: None,
            unlogged: 0,
            failing: false,
        }
    }

    /// An accept failed with `error`: counted, maybe logged, then a pause.
    async fn failed(&mut self, error: &(dyn std::fmt::Display + Sync)) {
        crate::telemetry::metrics::accept_failed(self.port);
        self.unlogged += 1;
        let now = tokio::time::Instant::now();
        if self
            .warned
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_WARN_EVERY)
        {
            tracing::warn!(
                port = self.port,
                error = %error,
                failed = self.unlogged,
                "could not accept connections (out of file descriptors? see --max-connections and the process's open-file limit); trying again every 50 ms, counted in agentd_accept_errors_total, warned again at most once a minute"
            );
            self.warned = Some(now);
            self.unlogged = 0;
            self.failing = true;
        }
        tokio::time::sleep(ACCEPT_RETRY).await;
    }

    /// A connection was accepted.
    fn accepted(&mut self) {
        if std::mem::take(&mut self.failing) {
            tracing::info!(port = self.port, "accepting connections again");
        }
    }
}

/// `incoming` holding at most `limit` connections at once: past it a new
/// connection is closed as soon as it is accepted (tonic's incoming has no
/// bound of its own, so idle connections, or health `Watch` streams that
/// last for ever, could take every file descriptor). A connection holds its
/// slot until tonic drops it. A failed accept is not passed on: tonic would
/// log it at trace and accept again at once, a busy loop while the process
/// is out of file descriptors; [`AcceptErrors`] logs it and pauses.
fn capped<I, IO, IE>(
    incoming: I,
    limit: usize,
) -> impl Stream<Item = Result<Capped<IO>, IE>> + Send + 'static
where
    I: Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    use tokio_stream::StreamExt as _;
    let slots = crate::telemetry::metrics::ConnectionSlots::new("grpc", limit);
    let mut errors = AcceptErrors::new("grpc");
    async_stream::stream! {
        let mut incoming = std::pin::pin!(incoming);
        while let Some(accepted) = incoming.next().await {
            match accepted {
                Ok(io) => {
                    errors.accepted();
                    if let Some(slot) = slots.admit() {
                        yield Ok::<_, IE>(Capped { io, _slot: slot });
                    }
                }
                Err(e) => {
                    let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                    errors.failed(&e).await;
                }
            }
        }
    }
}

/// What [`tls_handshakes`] waits for: a connection, or a handshake's end
/// (the stream, `None` when it failed).
enum Handshaking<IO, IE> {
    Accepted(Option<Result<IO, IE>>),
    Done(Result<Option<Box<tokio_rustls::server::TlsStream<IO>>>, tokio::task::JoinError>),
}

/// `incoming` (TCP connections under [`capped`]'s limit) after their TLS
/// handshake, with the configuration `tls` serves when each starts (a
/// reload replaces it for the handshakes after). Each handshake is a task
/// of its own, so a slow or silent client holds up no other's; it has
/// [`TLS_HANDSHAKE_TIMEOUT`] to finish, and holds its connection's slot
/// meanwhile, so half-open handshakes are bounded by `--max-connections`.
/// A failed handshake is the client's doing: logged at debug, not as an
/// accept error. The streams yielded are tokio-rustls's, whose connect info
/// (tonic's `TlsConnectInfo`) carries the client certificate to the
/// authentication layer.
fn tls_handshakes<IO, IE>(
    incoming: impl Stream<Item = Result<IO, IE>> + Send + 'static,
    tls: Arc<LiveTls>,
) -> impl Stream<Item = Result<tokio_rustls::server::TlsStream<IO>, IE>> + Send + 'static
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    IE: Send + 'static,
{
    use tokio_stream::StreamExt as _;
    async_stream::stream! {
        let mut incoming = std::pin::pin!(incoming);
        let mut handshakes = tokio::task::JoinSet::new();
        let mut accepting = true;
        loop {
            let next = tokio::select! {
                accepted = incoming.next(), if accepting => Handshaking::Accepted(accepted),
                Some(done) = handshakes.join_next() => Handshaking::Done(done),
                else => break,
            };
            match next {
                Handshaking::Accepted(Some(Ok(io))) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
                    handshakes.spawn(async move {
                        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                            Ok(Ok(stream)) => Some(Box::new(stream)),
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, "TLS handshake failed");
                                None
                            }
                            Err(_) => {
                                tracing::debug!(timeout = ?TLS_HANDSHAKE_TIMEOUT, "TLS handshake not completed in time; connection closed");
                                None
                            }
                        }
                    });
                }
                Handshaking::Accepted(Some(Err(e))) => yield Err(e),
                Handshaking::Accepted(None) => accepting = false,
                Handshaking::Done(Ok(Some(stream))) => yield Ok(*stream),
                Handshaking::Done(Ok(None)) => {}
                Handshaking::Done(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake task failed");
                }
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection and its slot under [`capped`]'s limit.
    struct Capped<IO> {
        #[pin]
        io: IO,
        _slot: tokio::sync::OwnedSemaphorePermit,
    }
}

impl<IO: Connected> Connected for Capped<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead> AsyncRead for Capped<IO> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite> AsyncWrite for Capped<IO> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// How long an HTTP client may take to send a request's headers (its first
/// bytes included); past it the connection is closed. A client that opens
/// connections and sends nothing, or trickles bytes, would otherwise hold
/// each for ever, and with them every connection slot.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an HTTP/2 connection may leave a ping unanswered before it is
/// closed, and how often one is sent: a peer that vanished frees its slot.
const H2_KEEPALIVE: Duration = Duration::from_secs(30);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` (HTTP/1, and HTTP/2 with `http2`) until `stop` resolves,
/// then lets the connections finish what they serve (their streams
/// included) and returns. At most `max_connections` at once (counted under
/// `port` in `agentd_connections_refused_total` past it). axum's own
/// `serve` sets no timer, so hyper reads headers without a deadline, and
/// hyper's choice between HTTP/1 and HTTP/2 waits for a client's first
/// bytes for ever: each connection is served here, as axum does, with a
/// deadline for both.
pub async fn serve_http(
    port: &'static str,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    max_connections: usize,
    http2: bool,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;
    let (closing, closing_rx) = tokio::sync::watch::channel(false);
    let slots = crate::telemetry::metrics::ConnectionSlots::new(port, max_connections);
    let mut accept_errors = AcceptErrors::new(port);
    let connections = tokio_util::task::TaskTracker::new();
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    accept_errors.accepted();
                    stream
                }
                Err(e) => {
                    // Out of file descriptors, say: wait, then go on.
                    accept_errors.failed(&e).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let Some(slot) = slots.admit() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut closing = closing_rx.clone();
        connections.spawn(async move {
            let _slot = slot;
            tokio::select! {
                first = tokio::time::timeout(HEADER_READ_TIMEOUT, first_bytes(&stream)) => match first {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(_) => {
                        tracing::debug!(port, "a connection sent no request in time; closed");
                        return;
                    }
                },
                // Shutting down: a connection that has sent nothing is closed.
                _ = closing.changed() => return,
            }
            let mut builder = Builder::new(TokioExecutor::new());
            if !http2 {
                builder = builder.http1_only();
            }
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            builder
                .http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(H2_KEEPALIVE)
                .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    served = conn.as_mut() => {
                        if let Err(e) = served {
                            tracing::debug!(port, error = %e, "a connection ended with an error");
                        }
                        break;
                    }
                    Ok(()) = closing.changed() => conn.as_mut().graceful_shutdown(),
                }
            }
        });
    }
    drop(listener);
    let _ = closing.send(true);
    connections.close();
    connections.wait().await;
    Ok(())
}

/// Waits until `stream` has sent what tells HTTP/1 from HTTP/2 (hyper reads
/// up to the 24 bytes of HTTP/2's preface, for as long as what came is a
/// prefix of it); false when it closed first.
async fn first_bytes(stream: &tokio::net::TcpStream) -> bool {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut buf = [0u8; PREFACE.len()];
    loop {
        match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) if n == PREFACE.len() || buf[..n] != PREFACE[..n] => return true,
            // Part of the preface: a peek answers at once while those bytes
            // wait to be read, so look again shortly.
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[::]` is one socket that IPv4 and IPv6 clients both reach, not an
    /// IPv6-only one, whatever the system's default.
    #[tokio::test]
    async fn any_ipv6_address_listens_for_ipv4_and_ipv6_alike() {
        // A machine without an IPv6 loopback cannot tell.
        if std::net::TcpListener::bind("[::1]:0").is_err() {
            eprintln!("no IPv6 loopback here: not checked");
            return;
        }
        let l = bind("[::]:0".parse().unwrap(), "--listen").unwrap();
        assert!(!socket2::SockRef::from(&l).only_v6().unwrap());
        let port = l.local_addr().unwrap().port();
        for client in ["127.0.0.1", "[::1]"] {
            let to: std::net::SocketAddr = format!("{client}:{port}").parse().unwrap();
            let _c = tokio::net::TcpStream::connect(to).await.unwrap();
            let (_, from) = tokio::time::timeout(Duration::from_secs(5), l.accept())
                .await
                .expect("accepted")
                .unwrap();
            assert_eq!(
                from.ip().to_canonical().is_ipv4(),
                client == "127.0.0.1",
                "{from}"
            );
        }
    }

    /// On a kernel without IPv6, `[::]` listens on `0.0.0.0`, same port;
    /// any other failure, or one of another address, is the error it was.
    #[tokio::test]
    async fn any_ipv6_address_falls_back_to_ipv4_without_ipv6() {
        let no_v6 = |a: std::net::SocketAddr| {
            if a.is_ipv6() {
                Err(std::io::Error::from_raw_os_error(97))
            } else {
                bind_socket(a)
            }
        };
        // A free port (another process may take it between the probe and
        // the bind: then another one).
        let (port, (l, why)) = (0..10)
            .find_map(|_| {
                let port = {
                    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                    probe.local_addr().unwrap().port()
                };
                match bind_with(format!("[::]:{port}").parse().unwrap(), no_v6) {
                    Ok(bound) => Some((port, bound)),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => None,
                    Err(e) => panic!("{e}"),
                }
            })
            .expect("a free port in ten tries");
        assert_eq!(
            l.local_addr().unwrap(),
            format!("0.0.0.0:{port}").parse().unwrap()
        );
        assert_eq!(why.unwrap().raw_os_error(), Some(97));
        drop(l);

        // A specific IPv6 address is not replaced by another one.
        let e = bind_with("[::1]:0".parse().unwrap(), no_v6).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(97));
        // A port in use is reported, not retried on IPv4.
        let held = bind("[::]:0".parse().unwrap(), "--listen").unwrap();
        let taken = held.local_addr().unwrap();
        let e = bind_with(taken, bind_socket).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    }

    #[test]
    fn the_connection_age_is_jittered_within_ten_percent() {
        let age = Duration::from_secs(30 * 60);
        let ages: Vec<Duration> = (0..1000).map(|_| jittered_age(age)).collect();
        for a in &ages {
            assert!(
                age.mul_f64(0.9) <= *a && *a <= age.mul_f64(1.1),
                "{a:?} is not within 10% of {age:?}"
            );
        }
        let distinct: std::collections::BTreeSet<_> = ages.iter().collect();
        assert!(
            distinct.len() > 900,
            "{} distinct ages of 1000: not random",
            distinct.len()
        );
        // Spread over the whole range, not bunched at one end.
        assert!(ages.iter().any(|a| *a < age.mul_f64(0.95)));
        assert!(ages.iter().any(|a| *a > age.mul_f64(1.05)));
    }
}
