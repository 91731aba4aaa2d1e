//! The gRPC faces of agentd: tonic services over the turn engine.

pub mod agents;
pub mod codec;
pub mod convert;
pub mod deadline;
pub mod status;
