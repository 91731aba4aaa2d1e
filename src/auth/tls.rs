//! TLS for the gRPC port: the server's certificate, and with a client CA,
//! mutual TLS where the client certificate's name is the caller.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// How long a client gets to complete the TLS handshake after connecting.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The PEM files of the gRPC port's TLS, read at start-up.
#[derive(Clone)]
pub struct TlsFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("mtls", &self.client_ca.is_some())
            .finish_non_exhaustive()
    }
}

/// Makes ring the process's rustls crypto provider, once. The HTTP clients
/// (model servers, HTTP tools, remote A2A agents) use the process default;
/// tonic's TLS names ring itself. Call before building any of them.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err only when another provider was installed first: that one stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn read(path: &Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
}

impl TlsFiles {
    /// Reads and checks the files, so a bad one fails at start-up.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&PathBuf>) -> anyhow::Result<Self> {
        let files = Self::from_pem(
            read(cert, "--tls-cert")?,
            read(key, "--tls-key")?,
            client_ca.map(|p| read(p, "--tls-client-ca")).transpose()?,
        );
        files.server_config()?;
        Ok(files)
    }

    pub fn from_pem(cert: Vec<u8>, key: Vec<u8>, client_ca: Option<Vec<u8>>) -> Self {
        Self {
            cert,
            key,
            client_ca,
        }
    }

    pub fn mtls(&self) -> bool {
        self.client_ca.is_some()
    }

    /// tonic's rustls configuration: client certificates are required when a
    /// client CA is given.
    pub fn server_config(&self) -> anyhow::Result<ServerTlsConfig> {
        // A peer that opens a connection and never completes the handshake
        // holds a socket and a task: it is dropped after this long.
        let mut cfg = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        if let Some(ca) = &self.client_ca {
            cfg = cfg
                .client_ca_root(Certificate::from_pem(ca))
                .client_auth_optional(false);
        }
        // Building the acceptor checks that the key matches and parses.
        tonic::transport::Server::builder()
            .tls_config(cfg.clone())
            .map_err(|e| {
                anyhow::anyhow!(
                    "the TLS certificate or key is not usable: {}",
                    crate::error_chain(&e)
                )
            })?;
        Ok(cfg)
    }
}

/// A verified client certificate's name: its first DNS or URI subject
/// alternative name (e.g. a SPIFFE id), else its subject common name.
pub fn certificate_name(der: &[u8]) -> Option<String> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) | GeneralName::URI(n) => return Some((*n).to_owned()),
                _ => {}
            }
        }
    }
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DnType, KeyPair, SanType};

    fn der(sans: Vec<SanType>, cn: &str) -> Vec<u8> {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = sans;
        params.distinguished_name.push(DnType::CommonName, cn);
        params
            .self_signed(&KeyPair::generate().unwrap())
            .unwrap()
            .der()
            .to_vec()
    }

    #[test]
    fn the_name_is_the_first_dns_or_uri_san_else_the_common_name() {
        let spiffe = "spiffe://cluster.local/ns/billing/sa/worker";
        let uri = der(vec![SanType::URI(spiffe.try_into().unwrap())], "ignored");
        assert_eq!(certificate_name(&uri).as_deref(), Some(spiffe));
        let dns = der(
            vec![
                SanType::IpAddress("10.0.0.1".parse().unwrap()),
                SanType::DnsName("web.internal".try_into().unwrap()),
            ],
            "x",
        );
        assert_eq!(certificate_name(&dns).as_deref(), Some("web.internal"));
        assert_eq!(
            certificate_name(&der(vec![], "batch-job")).as_deref(),
            Some("batch-job")
        );
        assert_eq!(certificate_name(b"not a certificate"), None);
    }
}
