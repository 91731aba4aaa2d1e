//! Where a client connects: one address (`http://host:port`), or every
//! address of a name (`dns:///host:port`), as gRPC spells targets.

use std::fmt;
use std::str::FromStr;

use tonic::transport::Uri;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server; tonic connects to it (and reconnects when it drops).
    Direct(Uri),
    /// Every A/AAAA record of `host`, balanced, re-resolved periodically.
    Dns { host: String, port: u16 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadTarget(&'static str);

impl fmt::Display for BadTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for BadTarget {}

const DNS_FORM: &str = "expected http://host:port, https://host:port or dns:///host:port";

impl FromStr for Target {
    type Err = BadTarget;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = s.strip_prefix("dns:") {
            // dns:///host:port, or dns:host:port; dns://server/host:port names
            // a DNS server, which the system resolver cannot be told to use.
            let name = match rest.strip_prefix("//") {
                Some(r) => r.strip_prefix('/').ok_or(BadTarget(
                    "dns://SERVER/host:port (a chosen DNS server) is not supported; use dns:///host:port",
                ))?,
                None => rest,
            };
            let (host, port) = split_host_port(name)?;
            return Ok(Target::Dns { host, port });
        }
        if s.starts_with("http://") || s.starts_with("https://") {
            let uri: Uri = s.parse().map_err(|_| BadTarget(DNS_FORM))?;
            if uri.host().is_none() {
                return Err(BadTarget(DNS_FORM));
            }
            return Ok(Target::Direct(uri));
        }
        Err(BadTarget(DNS_FORM))
    }
}

fn split_host_port(s: &str) -> Result<(String, u16), BadTarget> {
    const NEED_PORT: &str = "dns:///host:port needs a host and a port, e.g. dns:///agentd.default.svc.cluster.local:50051";
    let (host, port) = s.rsplit_once(':').ok_or(BadTarget(NEED_PORT))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| BadTarget(NEED_PORT))?;
    if host.is_empty() || host.contains('/') || port == 0 {
        return Err(BadTarget(NEED_PORT));
    }
    Ok((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns(host: &str, port: u16) -> Target {
        Target::Dns {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn dns_targets_name_a_host_and_a_port() {
        assert_eq!(
            "dns:///agents.svc.cluster.local:50051".parse(),
            Ok(dns("agents.svc.cluster.local", 50051))
        );
        assert_eq!("dns:localhost:1".parse(), Ok(dns("localhost", 1)));
        assert_eq!("dns:///[::1]:50051".parse(), Ok(dns("::1", 50051)));
    }

    #[test]
    fn http_targets_are_one_server() {
        let t: Target = "http://127.0.0.1:50051".parse().unwrap();
        assert!(matches!(t, Target::Direct(u) if u.port_u16() == Some(50051)));
    }

    #[test]
    fn malformed_targets_are_refused() {
        for bad in [
            "dns:///agents",
            "dns:///agents:",
            "dns:///agents:http",
            "dns:///:50051",
            "dns://8.8.8.8/agents:50051",
            "agents:50051",
            "http://",
            "",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
    }
}
