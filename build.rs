//! Generates the agents.v1 gRPC code with protox (no system `protoc`) and
//! writes the encoded descriptor sets that server reflection serves
//! (agents.v1, and lf.a2a.v1 of the A2A face).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The migrations are embedded by `sqlx::migrate!`, which cannot tell
    // cargo to rebuild when one is added.
    println!("cargo:rerun-if-changed=migrations");
    let protos = ["proto/agents/v1/agent.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out.join("agents_descriptor.bin");
    std::fs::write(&descriptor_path, prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .codec_path("crate::grpc::codec::SmallBufferCodec")
        .compile_fds(fds)?;

    // lf.a2a.v1 (the A2A 1.0 gRPC binding, whose code a2a-pb generates): only
    // its descriptor set, for reflection and the per-method metrics. The
    // proto is a2a-pb's, vendored under proto/a2a.
    let a2a = ["a2a.proto"];
    println!("cargo:rerun-if-changed=proto/a2a");
    let a2a_fds = protox::compile(a2a, ["proto/a2a"])?;
    std::fs::write(
        out.join("a2a_descriptor.bin"),
        prost::Message::encode_to_vec(&a2a_fds),
    )?;
    Ok(())
}
