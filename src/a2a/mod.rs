//! A2A 1.0 (`lf.a2a.v1`), the second face of our agents.
//!
//! The protocol is the official crates': `a2a-lf` types, `a2a-server-lf`'s
//! `DefaultRequestHandler` (task lifecycle, SSE, JSON-RPC over axum),
//! `a2a-grpc`'s tonic binding. What is ours: the executor that runs a task on
//! the turn engine ([`executor`]), the task store on our store
//! (`store::a2a_tasks`: tasks survive restarts and are shared by replicas on
//! PostgreSQL), SubscribeToTask for a task another replica runs and the
//! per-request metrics of both bindings ([`follow`]),
//! the agent card, the version check the gRPC binding lacks ([`version`]),
//! and the assembly below. The gRPC service joins
//! agents.v1 on the same port (see `server`); JSON-RPC, SSE and the card are
//! served on their own HTTP listener.

pub mod auth;
pub mod conformance;
pub mod executor;
pub mod follow;
mod settle;
pub mod version;

use std::sync::Arc;

use a2a::{
    AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TRANSPORT_PROTOCOL_GRPC,
    TRANSPORT_PROTOCOL_JSONRPC,
};
use a2a_pb::proto::a2a_service_server::A2aServiceServer;
use a2a_server::{DefaultRequestHandler, StaticAgentCard};

use crate::agent::AgentRegistry;
use crate::store::a2a_tasks::SharedTasks;
use crate::turn::Turns;

pub use executor::TurnExecutor;

/// The gRPC service name, as health reports it.
pub const A2A_SERVICE_NAME: &str = "lf.a2a.v1.A2AService";
/// Media types an incoming part may declare; others are
/// ContentTypeNotSupported.
pub const INPUT_MODES: &[&str] = &["text/plain"];
/// What our agents produce: text answers, JSON tool calls and results.
pub const OUTPUT_MODES: &[&str] = &["text/plain", "application/json"];

/// The request handler both bindings share, so a task started over one is
/// visible over the other.
pub type Handler = follow::Handler;

/// The A2A face of one server.
#[derive(Clone)]
pub struct A2a {
    handler: Arc<Handler>,
    /// Guards the HTTP face; `None`: authentication is off.
    auth: Option<Arc<crate::auth::Authenticator>>,
}

impl A2a {
    /// `conformance`: serve the conformance agent's scripted tasks, with
    /// this resubscription wait (see [`conformance`]). `auth`: the
    /// credentials both bindings require (tasks then run as their caller).
    pub fn new(
        turns: Arc<Turns>,
        max_input_bytes: usize,
        conformance: Option<std::time::Duration>,
        auth: Option<Arc<crate::auth::Authenticator>>,
    ) -> Self {
        let tasks = turns.store().a2a_tasks();
        settle::settle_expired(&turns);
        let lease = turns.config().lease;
        settle::reconcile(
            &turns,
            (lease * 2).clamp(
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(60),
            ),
            lease,
        );
        let executor = TurnExecutor::new(turns.clone(), max_input_bytes, auth.is_some());
        let store = SharedTasks(tasks.clone());
        let handler = match conformance {
            Some(wait) => DefaultRequestHandler::new(
                conformance::ConformanceExecutor::new(executor, wait),
                store,
            ),
            None => DefaultRequestHandler::new(executor, store),
        };
        // No input modes for the handler to check parts against: it
        // compares media types exactly, and would refuse `text/plain;
        // charset=utf-8` or `TEXT/PLAIN`, which are text/plain. Our own
        // check (`follow::Handler::check_parts`) reads the media type's
        // essence, case aside; the card still declares INPUT_MODES.
        let handler = handler
            .with_capabilities(capabilities())
            .with_authorizer(version::VersionCheck);
        Self {
            handler: Arc::new(follow::Handler::new(
                handler,
                turns,
                tasks,
                max_input_bytes,
                auth.is_some(),
            )),
            auth,
        }
    }

    pub fn handler(&self) -> &Arc<Handler> {
        &self.handler
    }

    /// `lf.a2a.v1.A2AService` for the tonic router.
    pub fn grpc_service(
        &self,
        max_message_bytes: usize,
    ) -> A2aServiceServer<a2a_grpc::GrpcHandler<Handler>> {
        A2aServiceServer::new(a2a_grpc::GrpcHandler::new(self.handler.clone()))
            .max_decoding_message_size(max_message_bytes)
    }

    /// JSON-RPC (with SSE streaming) at `/` and the card at
    /// `/.well-known/agent-card.json`; with authentication on, everything
    /// but the card needs credentials (see [`auth`]). A request body over
    /// `max_body_bytes` (`--max-message-bytes`, as on the gRPC port) is
    /// refused with 413 before it is parsed; the JSON-RPC router takes at
    /// most [`a2a_server::jsonrpc::MAX_REQUEST_BODY_BYTES`] (10 MiB)
    /// whatever the flag says, which no layer outside it can raise.
    pub fn http_router(&self, card: AgentCard, max_body_bytes: usize) -> axum::Router {
        let most = a2a_server::jsonrpc::MAX_REQUEST_BODY_BYTES;
        if max_body_bytes > most {
            tracing::warn!(
                max_message_bytes = max_body_bytes,
                a2a_http_limit = most,
                "the A2A HTTP face takes request bodies of at most 10 MiB; larger ones are refused with 413 there (the gRPC port takes --max-message-bytes)"
            );
        }
        // The refusal counter outside the size limit: it counts the 413s.
        let router = a2a_server::jsonrpc::jsonrpc_router(self.handler.clone())
            .layer(tower_http::limit::RequestBodyLimitLayer::new(
                max_body_bytes.min(most),
            ))
            .layer(axum::middleware::from_fn(follow::count_refusals))
            .merge(a2a_server::agent_card::agent_card_router(Arc::new(
                StaticAgentCard::new(card),
            )));
        auth::guard(router, self.auth.clone())
    }

    /// The credentials calls need (the card declares them).
    pub fn credentials(&self) -> auth::Credentials {
        auth::Credentials::of(self.auth.as_deref())
    }
}

fn capabilities() -> AgentCapabilities {
    AgentCapabilities {
        streaming: Some(true),
        push_notifications: Some(false),
        extensions: None,
        extended_agent_card: None,
    }
}

/// Where clients reach the two bindings, as the card advertises them.
#[derive(Debug, Clone)]
pub struct Advertised {
    /// The JSON-RPC endpoint, e.g. `http://agents.internal:8080/`.
    pub jsonrpc_url: String,
    /// The gRPC endpoint: `host:port` in plaintext, `https://host:port`
    /// with TLS.
    pub grpc_url: String,
}

/// The public agent card: both interfaces, streaming, one skill per agent;
/// the schemes of the credentials calls need (`creds`). The JSON-RPC
/// interface is left out where no call to it could be let in (client
/// certificates alone: it is plain HTTP).
pub fn agent_card(agents: &AgentRegistry, at: &Advertised, creds: auth::Credentials) -> AgentCard {
    let skills = agents
        .names()
        .filter_map(|name| agents.get(Some(name)))
        .map(|a| AgentSkill {
            id: a.name().to_owned(),
            name: a.name().to_owned(),
            description: a.description().to_owned(),
            tags: vec![a.name().to_owned()],
            examples: None,
            input_modes: None,
            output_modes: None,
            security_requirements: None,
        })
        .collect();
    let security = auth::card_security(creds);
    let mut interfaces = vec![];
    if creds.jsonrpc_usable() {
        interfaces.push(AgentInterface::new(
            at.jsonrpc_url.clone(),
            TRANSPORT_PROTOCOL_JSONRPC,
        ));
    }
    interfaces.push(AgentInterface::new(
        at.grpc_url.clone(),
        TRANSPORT_PROTOCOL_GRPC,
    ));
    AgentCard {
        name: "agentd".into(),
        description: format!(
            "Serves AI agents. Pick one with the message metadata key \"{}\" (default: {}).",
            executor::AGENT_METADATA_KEY,
            agents.default_name()
        ),
        version: env!("CARGO_PKG_VERSION").into(),
        supported_interfaces: interfaces,
        capabilities: capabilities(),
        default_input_modes: INPUT_MODES.iter().map(|s| s.to_string()).collect(),
        default_output_modes: OUTPUT_MODES.iter().map(|s| s.to_string()).collect(),
        skills,
        provider: None,
        documentation_url: None,
        icon_url: None,
        security_schemes: security.as_ref().map(|s| s.0.clone()),
        security_requirements: security.map(|s| s.1),
        signatures: None,
    }
}

/// How long a client may take to send a request's headers; past it the
/// connection is closed (a client that opens connections and trickles
/// bytes would otherwise hold each for ever).
pub const HEADER_READ_TIMEOUT: std::time::Duration = crate::server::HEADER_READ_TIMEOUT;

/// Serves the HTTP face on `listener` until `stop` resolves, then lets the
/// connections finish what they serve (their streams included) and returns.
/// At most `max_connections` at once, each with a deadline for its first
/// request ([`crate::server::serve_http`]).
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    max_connections: usize,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    crate::server::serve_http("a2a_http", listener, router, max_connections, true, stop).await
}

/// The card's addresses for servers bound to `grpc` and `http`: `host` when
/// given, else the bound IP, or the machine's name for an unspecified IP.
/// With `grpc_tls` the gRPC interface is an `https://` URL: A2A clients
/// (the official crate's among them) take a bare `host:port` for plaintext.
/// `jsonrpc_url`, when given, is the JSON-RPC interface's URL as is (a
/// proxy in front of it). An IPv6 `host` is bracketed (`[fd00::1]:8080`):
/// bare, its colons would read as a port.
pub fn advertised(
    grpc: std::net::SocketAddr,
    http: std::net::SocketAddr,
    host: Option<&str>,
    grpc_tls: bool,
    jsonrpc_url: Option<&str>,
) -> Advertised {
    let at = |addr: std::net::SocketAddr| match host {
        Some(h) if h.parse::<std::net::Ipv6Addr>().is_ok() => format!("[{h}]:{}", addr.port()),
        Some(h) => format!("{h}:{}", addr.port()),
        None if addr.ip().is_unspecified() => format!("{}:{}", machine_name(), addr.port()),
        None => addr.to_string(),
    };
    Advertised {
        jsonrpc_url: jsonrpc_url
            .map(str::to_owned)
            .unwrap_or_else(|| format!("http://{}/", at(http))),
        grpc_url: match grpc_tls {
            true => format!("https://{}", at(grpc)),
            false => at(grpc),
        },
    }
}

fn machine_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The card declares the credentials calls take, and only interfaces
    /// a caller can use: with client certificates alone, a mutual TLS
    /// scheme and the gRPC interface (the JSON-RPC face is plain HTTP,
    /// where no certificate is presented, and refuses every call).
    #[test]
    fn the_card_declares_the_credentials_taken_and_only_usable_interfaces() {
        let agents = AgentRegistry::new(
            vec![Arc::new(crate::agent::demo::OrderHelper::new(
                std::time::Duration::ZERO,
            ))],
            crate::agent::demo::NAME,
        )
        .unwrap();
        let at = advertised(
            "127.0.0.1:50051".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
            None,
            true,
            None,
        );
        let card = |bearer, mtls| {
            serde_json::to_value(agent_card(&agents, &at, auth::Credentials { bearer, mtls }))
                .unwrap()
        };
        let bindings = |card: &serde_json::Value| -> Vec<String> {
            card["supportedInterfaces"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["protocolBinding"].as_str().unwrap().to_owned())
                .collect()
        };
        let requirements = |card: &serde_json::Value| -> Vec<String> {
            card["securityRequirements"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r["schemes"].as_object().unwrap().keys().cloned())
                .collect()
        };

        let mtls = card(false, true);
        assert_eq!(bindings(&mtls), ["GRPC"], "{mtls}");
        assert!(
            mtls["securitySchemes"]["mtls"]["mtlsSecurityScheme"].is_object(),
            "{mtls}"
        );
        assert!(mtls["securitySchemes"].get("bearer").is_none(), "{mtls}");
        assert_eq!(requirements(&mtls), ["mtls"], "{mtls}");

        let bearer = card(true, false);
        assert_eq!(bindings(&bearer), ["JSONRPC", "GRPC"], "{bearer}");
        assert_eq!(requirements(&bearer), ["bearer"], "{bearer}");

        // Either credential lets a call in: one requirement each.
        let both = card(true, true);
        assert_eq!(bindings(&both), ["JSONRPC", "GRPC"], "{both}");
        assert_eq!(requirements(&both), ["bearer", "mtls"], "{both}");

        let open = card(false, false);
        assert_eq!(bindings(&open), ["JSONRPC", "GRPC"], "{open}");
        assert!(open.get("securitySchemes").is_none(), "{open}");
    }

    #[test]
    fn the_grpc_interface_is_an_https_url_with_tls_and_host_port_without() {
        let grpc: std::net::SocketAddr = "10.0.0.7:50051".parse().unwrap();
        let http: std::net::SocketAddr = "10.0.0.7:8080".parse().unwrap();
        let plain = advertised(grpc, http, Some("agentd.agents"), false, None);
        assert_eq!(plain.grpc_url, "agentd.agents:50051");
        assert_eq!(plain.jsonrpc_url, "http://agentd.agents:8080/");
        let tls = advertised(grpc, http, Some("agentd.agents"), true, None);
        assert_eq!(tls.grpc_url, "https://agentd.agents:50051");
        let proxied = advertised(grpc, http, None, false, Some("https://agents.example.com/"));
        assert_eq!(proxied.jsonrpc_url, "https://agents.example.com/");
        assert_eq!(
            advertised(grpc, http, None, true, None).grpc_url,
            "https://10.0.0.7:50051"
        );
    }
}
