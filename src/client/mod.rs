//! The Rust client of `agents.v1`, used by the CLI and the tests, and
//! ([`a2a`]) the A2A streaming client.
//!
//! - Targets: `http://host:port` (one server) or `dns:///host:port` (every
//!   A/AAAA record of the name, balanced by tonic's balancer, re-resolved
//!   every [`ClientConfig::resolve_interval`]; see [`resolve`]).
//! - Every call carries a deadline (default [`DEFAULT_DEADLINE`]), sent as
//!   `grpc-timeout` and also enforced here.
//! - Retries only where the server's dedup makes them safe (see [`retry`]):
//!   a Run without a request_id gets one here, so that its retries are the
//!   same turn; a retry never changes the request_id.

pub mod a2a;

pub mod resolve;
pub mod retry;
pub mod target;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};
use tonic::{Request, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::pb;
use crate::pb::agent_service_client::AgentServiceClient;
pub use resolve::{DnsResolver, Resolve, StaticResolver};
pub use retry::RetryPolicy;
pub use target::Target;

/// Default deadline of a call when the caller gives none.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);
/// Default interval between two resolutions of a `dns:///` target.
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(10);
/// Metadata key of a status returned by this client: the attempts the call
/// took (more than 1 when it was retried), for the caller's logs.
pub const ATTEMPTS_METADATA: &str = "agentd-client-attempts";
/// How long past the deadline the client waits for the server's own
/// DEADLINE_EXCEEDED before giving up on a silent stream itself. The server
/// enforces the deadline and records the turn as such; cutting at the same
/// instant would record it as cancelled by the client instead.
const LOCAL_DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// How a client connects and calls. Transport security and credentials
/// belong here too (they apply to every endpoint the client builds).
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Deadline of every call that names none.
    pub deadline: Duration,
    /// How often a `dns:///` target is resolved again, so that new and
    /// replaced replicas are seen.
    pub resolve_interval: Duration,
    /// Longest wait for one TCP connection.
    pub connect_timeout: Duration,
    /// Retries of calls that are safe to resend.
    pub retry: RetryPolicy,
    /// For a `dns:///` target, watch each replica's grpc.health.v1 and send
    /// no calls to one that is not serving (draining) or unreachable.
    pub health_check: bool,
    /// TLS (and mTLS) of every endpoint, and the bearer token of every call.
    pub security: ClientSecurity,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            deadline: DEFAULT_DEADLINE,
            resolve_interval: DEFAULT_RESOLVE_INTERVAL,
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            health_check: true,
            security: ClientSecurity::default(),
        }
    }
}

impl ClientConfig {
    /// The one place a call's request is built: its deadline (sent as
    /// grpc-timeout) and, with credentials, their metadata.
    fn request<T>(&self, msg: T, timeout: Duration) -> Request<T> {
        let mut req = Request::new(msg);
        req.set_timeout(timeout);
        // The token was checked when the client was made.
        if let Some(v) = self.security.token.as_deref().and_then(|t| bearer(t).ok()) {
            req.metadata_mut().insert("authorization", v);
        }
        crate::telemetry::trace::inject_metadata(req.metadata_mut());
        req
    }

    /// The one place an endpoint's transport settings (and TLS) are chosen.
    /// `server_name`, when given, is the name the server's certificate must
    /// carry (a `dns:///` target's host, dialled by address); otherwise it is
    /// the host of `uri`.
    fn endpoint(&self, uri: Uri, server_name: Option<&str>) -> anyhow::Result<Endpoint> {
        let endpoint = Endpoint::from(uri)
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        match &self.security.tls {
            None => Ok(endpoint),
            Some(tls) => {
                let tls = match server_name {
                    Some(name) => tls.clone().domain_name(name),
                    None => tls.clone(),
                };
                endpoint
                    .tls_config(tls)
                    .map_err(|e| anyhow::anyhow!("bad TLS settings: {e}"))
            }
        }
    }

    /// The scheme of the endpoints this configuration dials.
    fn scheme(&self) -> &'static str {
        if self.security.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

/// The `authorization` value of a bearer token.
fn bearer(token: &str) -> anyhow::Result<AsciiMetadataValue> {
    AsciiMetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| anyhow::anyhow!("the token must be printable ASCII"))
}

#[derive(Clone)]
pub struct AgentClient {
    agents: AgentServiceClient<Channel>,
    health: HealthClient<Channel>,
    cfg: Arc<ClientConfig>,
    /// Asks the resolver task (of a `dns:///` target) to resolve now.
    refresh: Option<mpsc::Sender<resolve::Refresh>>,
    /// The addresses the balancer has (of a `dns:///` target).
    endpoints: Option<watch::Receiver<BTreeSet<SocketAddr>>>,
}

/// How the client reaches a secured server: TLS (the server's CA, and a
/// client certificate for mTLS) and a bearer token.
#[derive(Clone, Debug, Default)]
pub struct ClientSecurity {
    /// Required for an `https://` target.
    pub tls: Option<ClientTlsConfig>,
    pub token: Option<String>,
}

impl ClientSecurity {
    /// From PEM bytes: the CA that signed the server's certificate, and
    /// optionally the client's certificate and key (mTLS).
    pub fn tls_from_pem(ca: &[u8], identity: Option<(&[u8], &[u8])>) -> ClientTlsConfig {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        tls
    }
}

/// A started Run: the server's response headers and its event stream.
pub struct RunCall {
    /// The turn's request id: the caller's, or the one this client generated
    /// for a request without one. Every attempt of the call carries it.
    pub request_id: String,
    /// `new`, `replay` or `attach`, as the server answered the first
    /// successful attempt.
    pub mode: String,
    pub events: RunEvents,
}

impl RunCall {
    /// Attempts made so far (1 when nothing was retried).
    pub fn attempts(&self) -> u32 {
        self.events.attempts()
    }
}

impl AgentClient {
    /// Connects to `target` (`http://host:port` or `dns:///host:port`) with
    /// the default configuration.
    pub async fn connect(target: &str) -> anyhow::Result<Self> {
        Self::connect_config(target, ClientConfig::default()).await
    }

    /// Connects to `target` with TLS and/or a bearer token, and otherwise
    /// the default configuration.
    pub async fn connect_with(target: &str, security: &ClientSecurity) -> anyhow::Result<Self> {
        Self::connect_config(
            target,
            ClientConfig {
                security: security.clone(),
                ..Default::default()
            },
        )
        .await
    }

    /// Connects to `target`. A direct target is connected to now (so a
    /// wrong address fails here); a `dns:///` target must resolve to at
    /// least one address, connected to on first use.
    pub async fn connect_config(target: &str, cfg: ClientConfig) -> anyhow::Result<Self> {
        if let Some(token) = &cfg.security.token {
            bearer(token)?;
        }
        match target
            .parse::<Target>()
            .map_err(|e| anyhow::anyhow!("bad server address {target:?}: {e}"))?
        {
            Target::Direct(uri) => {
                // TLS is applied to https:// only: with TLS settings, an
                // http:// address would send the token in clear.
                if cfg.security.tls.is_some() && uri.scheme_str() != Some("https") {
                    anyhow::bail!(
                        "{target}: TLS settings (a CA, a client certificate) need an https:// server address"
                    );
                }
                if cfg.security.tls.is_none() && uri.scheme_str() == Some("https") {
                    anyhow::bail!(
                        "{target}: an https:// server address needs --tls-ca (the CA that signed the server's certificate)"
                    );
                }
                // The whole connection, TLS and HTTP/2 handshakes included:
                // `connect_timeout` bounds only the TCP connect, and a server
                // that accepts and then never answers would hold us for ever.
                let channel = tokio::time::timeout(cfg.connect_timeout, cfg.endpoint(uri, None)?.connect())
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "cannot connect to {target}: no answer within {:?} (a TLS or HTTP/2 handshake that never completes)",
                            cfg.connect_timeout
                        )
                    })?
                    .map_err(|e| anyhow::anyhow!("cannot connect to {target}: {}", crate::error_chain(&e)))?;
                Ok(Self::new(channel, cfg, None))
            }
            Target::Dns { host, port } => {
                Self::balanced(&host, port, Arc::new(DnsResolver), cfg).await
            }
        }
    }

    /// Balances over every address `resolver` gives for `host:port`,
    /// re-resolving every `cfg.resolve_interval`.
    pub async fn balanced(
        host: &str,
        port: u16,
        resolver: Arc<dyn Resolve>,
        cfg: ClientConfig,
    ) -> anyhow::Result<Self> {
        /// Address changes the balancer takes before it reads them, which
        /// it does only when a call comes: the first answer (a headless
        /// service of that many pods) fits at once; past it, the resolver
        /// leaves the rest for its next round rather than wait.
        const BALANCER_CHANGES: usize = 1024;
        if cfg.resolve_interval.is_zero() {
            anyhow::bail!("the resolve interval must be more than 0s");
        }
        if let Some(token) = &cfg.security.token {
            bearer(token)?;
        }
        let (channel, changes) = Channel::balance_channel::<SocketAddr>(BALANCER_CHANGES);
        let (refresh, refresh_rx) = mpsc::channel(8);
        let (health_tx, health_rx) = mpsc::channel(64);
        let (published, endpoints) = watch::channel(BTreeSet::new());
        let endpoint_cfg = cfg.clone();
        let server_name = host.to_owned();
        // The :authority (and, with TLS, the server name) is the service's
        // name, not a pod's address.
        let scheme = cfg.scheme();
        let origin: Uri = format!("{scheme}://{}:{port}", bracket_v6(host))
            .parse()
            .map_err(|e| anyhow::anyhow!("bad host name {host:?}: {e}"))?;
        let addr_uri = move |addr: SocketAddr| {
            Uri::try_from(format!("{scheme}://{addr}"))
                .expect("a socket address is a valid authority")
        };
        // Every address gets the same settings: check them once here.
        cfg.endpoint(
            addr_uri(SocketAddr::from(([127, 0, 0, 1], port))),
            Some(host),
        )?;
        let mut task = resolve::Task {
            resolver,
            host: host.to_owned(),
            port,
            interval: cfg.resolve_interval,
            endpoint: Arc::new(move |addr| {
                endpoint_cfg
                    .endpoint(addr_uri(addr), Some(&server_name))
                    .expect("checked when the client was made")
                    .origin(origin.clone())
            }),
            health_check: cfg.health_check,
            changes,
            refresh: refresh_rx,
            published,
            state: Default::default(),
        };
        match task.resolve_once(&health_tx).await {
            Ok(0) => anyhow::bail!("{host} resolved to no addresses"),
            Ok(n) => tracing::debug!(host, addresses = n, "balancing"),
            Err(e) => anyhow::bail!("cannot resolve {host}: {e}"),
        }
        tokio::spawn(task.run(health_tx, health_rx));
        let mut client = Self::new(channel, cfg, Some(refresh));
        client.endpoints = Some(endpoints);
        Ok(client)
    }

    /// A client over an existing channel (e.g. in-memory in tests).
    pub fn from_channel(channel: Channel) -> Self {
        Self::new(channel, ClientConfig::default(), None)
    }

    fn new(
        channel: Channel,
        cfg: ClientConfig,
        refresh: Option<mpsc::Sender<resolve::Refresh>>,
    ) -> Self {
        Self {
            agents: AgentServiceClient::new(channel.clone()),
            health: HealthClient::new(channel),
            cfg: Arc::new(cfg),
            refresh,
            endpoints: None,
        }
    }

    /// Resolves a `dns:///` target now rather than at the next interval, and
    /// returns once the balancer has been told the result. Does nothing for
    /// a direct target.
    pub async fn refresh(&self) {
        let Some(tx) = &self.refresh else { return };
        let (ack, done) = oneshot::channel();
        if tx.send(ack).await.is_ok() {
            let _ = done.await;
        }
    }

    /// The addresses calls are balanced over now, updated as resolution and
    /// health change (`None` for a direct target).
    pub fn endpoints(&self) -> Option<watch::Receiver<BTreeSet<SocketAddr>>> {
        self.endpoints.clone()
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// Sends `authorization: Bearer <token>` on every call.
    pub fn with_token(mut self, token: &str) -> anyhow::Result<Self> {
        bearer(token)?;
        Arc::make_mut(&mut self.cfg).security.token = Some(token.to_owned());
        Ok(self)
    }

    /// A request with `timeout`, the token and the current trace context;
    /// use it with [`AgentClient::raw`] for calls this wrapper does not cover.
    pub fn request<T>(&self, msg: T, timeout: Duration) -> Request<T> {
        self.cfg.request(msg, timeout)
    }

    /// The generated client, for calls this wrapper does not cover.
    pub fn raw(&self) -> AgentServiceClient<Channel> {
        self.agents.clone()
    }

    /// Creates a session, under a request id of its own (see
    /// [`AgentClient::create_session_keyed`]): resent after UNAVAILABLE, a
    /// call whose connection broke under it among others, and answered the
    /// one session however many attempts reached a server.
    pub async fn create_session(&mut self, user_id: &str) -> Result<pb::SessionRef, Status> {
        let key = uuid::Uuid::new_v4().to_string();
        self.create_session_keyed(user_id, &key).await
    }

    /// Creates a session keyed `request_id` (CreateSessionRequest's
    /// idempotency key): a server that made a session under this key for
    /// this user answers that session again, while it exists. A caller that
    /// keeps the key can so resend a creation whose answer it lost even
    /// across its own restarts. UNAVAILABLE is resent here, within the
    /// deadline and the retry policy. (A server of a release before the key
    /// ignores it: there a resend that reached it makes a second, empty
    /// session.)
    pub async fn create_session_keyed(
        &mut self,
        user_id: &str,
        request_id: &str,
    ) -> Result<pb::SessionRef, Status> {
        let (agents, cfg) = (self.agents.clone(), self.cfg.clone());
        let msg = pb::CreateSessionRequest {
            user_id: user_id.to_owned(),
            request_id: request_id.to_owned(),
        };
        self.unary(retry::is_unavailable, move |req_timeout| {
            let mut agents = agents.clone();
            let req = cfg.request(msg.clone(), req_timeout);
            async move { agents.create_session(req).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// Asks grpc.health.v1 about `service` ("" for the whole server).
    pub async fn health(&mut self, service: &str) -> Result<ServingStatus, Status> {
        let (health, cfg) = (self.health.clone(), self.cfg.clone());
        let msg = tonic_health::pb::HealthCheckRequest {
            service: service.to_owned(),
        };
        let status = self
            .unary(retry::is_unavailable, move |req_timeout| {
                let mut health = health.clone();
                let req = cfg.request(msg.clone(), req_timeout);
                async move { health.check(req).await.map(|r| r.into_inner()) }
            })
            .await?;
        Ok(status.status())
    }

    /// Stops a running turn (CancelTurn); a turn that had ended is
    /// answered as it ended, unchanged. Resent on UNAVAILABLE, within the
    /// configured deadline and the retry policy: a cancel is idempotent.
    pub async fn cancel_turn(
        &mut self,
        user_id: &str,
        session_id: &str,
        request_id: &str,
    ) -> Result<pb::CancelTurnResponse, Status> {
        let (agents, cfg) = (self.agents.clone(), self.cfg.clone());
        let msg = pb::CancelTurnRequest {
            user_id: user_id.to_owned(),
            session_id: session_id.to_owned(),
            request_id: request_id.to_owned(),
        };
        self.unary(retry::is_unavailable, move |req_timeout| {
            let mut agents = agents.clone();
            let req = cfg.request(msg.clone(), req_timeout);
            async move { agents.cancel_turn(req).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// One unary call under the configured deadline, resent while
    /// `retryable` says so and the policy allows.
    async fn unary<T, F, Fut>(
        &self,
        retryable: fn(&Status) -> bool,
        mut call: F,
    ) -> Result<T, Status>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let mut attempts = Attempts::new(self.cfg.retry, Instant::now() + self.cfg.deadline);
        loop {
            let result = match attempts.begin() {
                Ok(remaining) => match tokio::time::timeout(remaining, call(remaining)).await {
                    Ok(r) => r.map_err(retry::from_wire),
                    Err(_) => Err(retry::deadline_exceeded()),
                },
                Err(s) => Err(s),
            };
            match result {
                Err(s) if retryable(&s) => attempts.backoff_or_give_up(s).await?,
                Err(s) => return Err(attempts.final_status(s)),
                ok => return ok,
            }
        }
    }

    /// Starts a Run under `deadline` (sent as grpc-timeout; the server ends
    /// the stream with DEADLINE_EXCEEDED and cancels the agent when it
    /// passes). An empty request_id is filled in here so that a retry is
    /// the same turn. UNAVAILABLE before any event is retried with the same
    /// request_id, within the deadline and the retry policy.
    pub async fn run(
        &mut self,
        mut req: pb::RunRequest,
        deadline: Duration,
    ) -> Result<RunCall, Status> {
        if req.request_id.is_empty() {
            req.request_id = uuid::Uuid::new_v4().to_string();
        }
        let mut run = RunAttempts {
            client: self.agents.clone(),
            cfg: self.cfg.clone(),
            req,
            attempts: Attempts::new(self.cfg.retry, Instant::now() + deadline),
        };
        let started = run.start().await?;
        let request_id = if started.request_id.is_empty() {
            run.req.request_id.clone()
        } else {
            started.request_id
        };
        let attempts = run.attempts.count.clone();
        let mode = started.mode.clone();
        let events = follow(run, started.stream, started.mode);
        Ok(RunCall {
            request_id,
            mode,
            events: RunEvents {
                inner: Box::pin(events),
                attempts,
            },
        })
    }

    /// A Run under the configured deadline.
    pub async fn run_default(&mut self, req: pb::RunRequest) -> Result<RunCall, Status> {
        let deadline = self.cfg.deadline;
        self.run(req, deadline).await
    }

    /// A Run collected to its end: every event, then the final status.
    pub async fn run_to_end(
        &mut self,
        req: pb::RunRequest,
        deadline: Duration,
    ) -> Result<(Vec<pb::AgentEvent>, Result<(), Status>), Status> {
        let mut call = self.run(req, deadline).await?;
        let mut events = Vec::new();
        loop {
            match call.events.message().await {
                Ok(Some(e)) => events.push(e),
                Ok(None) => return Ok((events, Ok(()))),
                Err(s) => return Ok((events, Err(s))),
            }
        }
    }
}

fn bracket_v6(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// The events of a Run, in seq order, ending with the call's status.
pub struct RunEvents {
    inner: Pin<Box<dyn Stream<Item = Result<pb::AgentEvent, Status>> + Send>>,
    attempts: Arc<AtomicU32>,
}

impl RunEvents {
    /// The next event; `Ok(None)` once the call ended with OK.
    pub async fn message(&mut self) -> Result<Option<pb::AgentEvent>, Status> {
        self.inner.next().await.transpose()
    }

    /// Attempts made so far (1 when nothing was retried).
    pub fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Relaxed)
    }
}

impl Stream for RunEvents {
    type Item = Result<pb::AgentEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// The deadline and retry budget of one call, across its attempts.
struct Attempts {
    policy: RetryPolicy,
    until: Instant,
    /// Shared with [`RunEvents`], which reports it.
    count: Arc<AtomicU32>,
}

impl Attempts {
    fn new(policy: RetryPolicy, until: Instant) -> Self {
        Self {
            policy,
            until,
            count: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The status the caller gets, stamped with the attempts it took.
    fn final_status(&self, mut status: Status) -> Status {
        let made = self.count.load(Ordering::Relaxed);
        status.metadata_mut().insert(ATTEMPTS_METADATA, made.into());
        status
    }

    /// Counts an attempt; its time budget, or DEADLINE_EXCEEDED if none is
    /// left.
    fn begin(&mut self) -> Result<Duration, Status> {
        self.count.fetch_add(1, Ordering::Relaxed);
        let remaining = self.until.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            Err(retry::deadline_exceeded())
        } else {
            Ok(remaining)
        }
    }

    /// Waits before the next attempt, or gives `status` back when the policy
    /// or the deadline leaves no room for one.
    async fn backoff_or_give_up(&mut self, status: Status) -> Result<(), Status> {
        let made = self.count.load(Ordering::Relaxed);
        if made >= self.policy.max_attempts.max(1) {
            return Err(self.final_status(status));
        }
        let wait = self
            .policy
            .backoff(made)
            .max(retry::pushback(&status).unwrap_or_default());
        if Instant::now() + wait >= self.until {
            return Err(self.final_status(status));
        }
        tracing::debug!(code = ?status.code(), reason = status.message(), attempt = made, ?wait, "retrying");
        tokio::time::sleep(wait).await;
        Ok(())
    }
}

/// A Run's request and its attempts.
struct RunAttempts {
    client: AgentServiceClient<Channel>,
    cfg: Arc<ClientConfig>,
    /// Sent unchanged by every attempt (its request_id above all).
    req: pb::RunRequest,
    attempts: Attempts,
}

/// One attempt that got the server's response headers.
struct Started {
    request_id: String,
    mode: String,
    stream: Streaming<pb::AgentEvent>,
}

impl RunAttempts {
    /// Attempts until one is answered with headers, retrying refusals that
    /// are safe to resend.
    async fn start(&mut self) -> Result<Started, Status> {
        loop {
            match self.once().await {
                Ok(s) => return Ok(s),
                Err(s) if retry::run_is_retryable(&s) => {
                    self.attempts.backoff_or_give_up(s).await?
                }
                Err(s) => return Err(self.attempts.final_status(s)),
            }
        }
    }

    async fn once(&mut self) -> Result<Started, Status> {
        let remaining = self.attempts.begin()?;
        let req = self.cfg.request(self.req.clone(), remaining);
        let resp = match tokio::time::timeout_at(self.attempts.until, self.client.run(req)).await {
            Err(_) => return Err(retry::deadline_exceeded()),
            Ok(r) => r.map_err(retry::from_wire)?,
        };
        let header = |name: &str| {
            resp.metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let request_id = header(crate::grpc::agents::REQUEST_ID_HEADER);
        let mode = header(crate::grpc::agents::TURN_MODE_HEADER);
        Ok(Started {
            request_id,
            mode,
            stream: resp.into_inner(),
        })
    }
}

/// Relays a Run's events; an UNAVAILABLE ending before the first event is
/// retried (same request_id), unless the attempt was a replay (its stored
/// status is final).
fn follow(
    mut run: RunAttempts,
    first: Streaming<pb::AgentEvent>,
    first_mode: String,
) -> impl Stream<Item = Result<pb::AgentEvent, Status>> + Send {
    async_stream::stream! {
        let local_deadline = run.attempts.until + LOCAL_DEADLINE_SLACK;
        let (mut stream, mut mode) = (first, first_mode);
        let mut received = false;
        loop {
            let status = match tokio::time::timeout_at(local_deadline, stream.message()).await {
                Err(_) => {
                    yield Err(run.attempts.final_status(retry::deadline_exceeded()));
                    return;
                }
                Ok(Ok(Some(event))) => {
                    received = true;
                    yield Ok(event);
                    continue;
                }
                Ok(Ok(None)) => return,
                Ok(Err(status)) => retry::from_wire(status),
            };
            if received || mode == crate::turn::Mode::Replay.as_str() || !retry::run_is_retryable(&status) {
                yield Err(run.attempts.final_status(status));
                return;
            }
            if let Err(status) = run.attempts.backoff_or_give_up(status).await {
                yield Err(status);
                return;
            }
            match run.start().await {
                Ok(s) => (stream, mode) = (s.stream, s.mode),
                Err(status) => {
                    yield Err(status);
                    return;
                }
            }
        }
    }
}
