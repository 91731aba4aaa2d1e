//! agentd serves AI agents to other services over gRPC.
//!
//! The path of one turn: [`grpc::agents`] validates a `Run` into
//! [`domain`] types, [`turn`] claims its request id in the [`store`], runs the
//! [`agent`] and pumps its events through a bounded channel into the response
//! stream. [`server`] assembles the services, health, reflection and shutdown.

pub mod a2a;
pub mod agent;
pub mod auth;
pub mod bench;
pub mod client;
pub mod config;
pub mod domain;
pub mod grpc;
pub mod server;
pub mod sse;
pub mod store;
pub mod telemetry;
pub mod turn;

/// An error and its causes, one after another (`a: b: c`): some errors'
/// own text is only their kind (tonic's "transport error").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Generated code for the `agents.v1` contract.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("agents.v1");

    /// The encoded descriptor set of `agents.v1`, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("agents_descriptor");

    /// The encoded descriptor set of `lf.a2a.v1` (A2A 1.0's gRPC binding),
    /// served by reflection beside agents.v1.
    pub const A2A_FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("a2a_descriptor");
}
