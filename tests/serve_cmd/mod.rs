//! `agentd serve` as the tests start it, in a child process.
#![allow(dead_code)]

/// `agentd serve` (the binary) with JSON logs, the gRPC port on
/// 127.0.0.1:0, the admin and A2A ports on `admin` and `a2a` (an address,
/// or `off`), and the memory store (not the default SQLite file, which
/// parallel tests would share; an `AGENTD_STORE` or `--store` set later
/// wins); then `args`. The caller sets the rest (stdio, environment).
pub fn agentd_serve(admin: &str, a2a: &str, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_agentd"));
    cmd.env("AGENTD_STORE", "memory:")
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", admin, "--a2a-listen", a2a])
        .args(args);
    cmd
}
