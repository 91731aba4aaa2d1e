//! TLS for the gRPC port: the server's certificate, and with a client CA,
//! mutual TLS where the client certificate's name is the caller.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use rustls::pki_types::pem::{self, PemObject as _};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// How long a client gets to complete the TLS handshake after connecting.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The protocol the gRPC port negotiates (ALPN): HTTP/2 only.
const ALPN_H2: &[u8] = b"h2";

/// The PEM files of the gRPC port's TLS, as read at start-up (and, from
/// [`TlsFiles::paths`], again while serving: see [`super::reload`]).
#[derive(Clone)]
pub struct TlsFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
    paths: Option<TlsPaths>,
}

/// Where [`TlsFiles::load`] read the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("mtls", &self.client_ca.is_some())
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

/// Makes ring the process's rustls crypto provider, once. The HTTP clients
/// (model servers, HTTP tools, remote A2A agents) use the process default;
/// tonic's client TLS and the gRPC port's TLS name ring themselves. Call
/// before building any of them.
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

/// One of the TLS files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    Cert,
    Key,
    ClientCa,
}

impl TlsFile {
    /// The flag that names the file.
    pub fn flag(self) -> &'static str {
        match self {
            TlsFile::Cert => "--tls-cert",
            TlsFile::Key => "--tls-key",
            TlsFile::ClientCa => "--tls-client-ca",
        }
    }
}

/// Why the TLS files cannot be served: which file, and a reason that
/// quotes none of its contents.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {reason}", file.flag())]
pub struct Unusable {
    pub file: TlsFile,
    pub reason: String,
}

fn unusable(file: TlsFile, reason: impl Into<String>) -> Unusable {
    Unusable {
        file,
        reason: reason.into(),
    }
}

/// What is wrong with a PEM file, without quoting any of it (pki-types'
/// messages quote the offending line, which could be key material).
fn pem_problem(e: &pem::Error) -> &'static str {
    match e {
        pem::Error::MissingSectionEnd { .. } => "is not valid PEM: a section has no END line",
        pem::Error::IllegalSectionStart { .. } => "is not valid PEM: a BEGIN line is malformed",
        pem::Error::Base64Decode(_) => "is not valid PEM: a section is not valid base64",
        pem::Error::SectionTooLarge => "is not valid PEM: a section is too large",
        _ => "is not valid PEM",
    }
}

fn certificates(pem: &[u8], file: TlsFile) -> Result<Vec<CertificateDer<'static>>, Unusable> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unusable(file, pem_problem(&e)))?;
    if certs.is_empty() {
        return Err(unusable(file, "holds no PEM certificate"));
    }
    Ok(certs)
}

impl TlsFiles {
    /// Reads and checks the files, so a bad one fails at start-up.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&PathBuf>) -> anyhow::Result<Self> {
        let mut files = Self::from_pem(
            read(cert, "--tls-cert")?,
            read(key, "--tls-key")?,
            client_ca.map(|p| read(p, "--tls-client-ca")).transpose()?,
        );
        files.paths = Some(TlsPaths {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.cloned(),
        });
        files.server_config()?;
        Ok(files)
    }

    pub fn from_pem(cert: Vec<u8>, key: Vec<u8>, client_ca: Option<Vec<u8>>) -> Self {
        Self {
            cert,
            key,
            client_ca,
            paths: None,
        }
    }

    pub fn mtls(&self) -> bool {
        self.client_ca.is_some()
    }

    /// Where the files were read from ([`TlsFiles::load`]); `None` for
    /// [`TlsFiles::from_pem`], which is never reloaded.
    pub fn paths(&self) -> Option<&TlsPaths> {
        self.paths.as_ref()
    }

    pub(crate) fn cert_pem(&self) -> &[u8] {
        &self.cert
    }

    pub(crate) fn key_pem(&self) -> &[u8] {
        &self.key
    }

    pub(crate) fn client_ca_pem(&self) -> Option<&[u8]> {
        self.client_ca.as_deref()
    }

    /// The gRPC port's rustls configuration (ring; ALPN `h2`): client
    /// certificates are required when a client CA is given. An error names
    /// the flag (and, for files that were loaded, the path) at fault.
    pub fn server_config(&self) -> anyhow::Result<Arc<ServerConfig>> {
        self.check().map_err(|e| {
            let path = self.paths.as_ref().and_then(|p| match e.file {
                TlsFile::Cert => Some(&p.cert),
                TlsFile::Key => Some(&p.key),
                TlsFile::ClientCa => p.client_ca.as_ref(),
            });
            match path {
                Some(path) => {
                    anyhow::anyhow!("TLS: {} {} {}", e.file.flag(), path.display(), e.reason)
                }
                None => anyhow::anyhow!("TLS: {e}"),
            }
        })
    }

    /// [`TlsFiles::server_config`], with the file at fault and why: the
    /// checks of start-up and of every reload. The key must parse and
    /// match the certificate; the client CA must hold a usable certificate.
    pub fn check(&self) -> Result<Arc<ServerConfig>, Unusable> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certificates(&self.cert, TlsFile::Cert)?;
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| match e {
            pem::Error::NoItemsFound => unusable(
                TlsFile::Key,
                "holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
            ),
            e => unusable(TlsFile::Key, pem_problem(&e)),
        })?;
        let certified =
            rustls::sign::CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
                match e {
                    rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                        unusable(TlsFile::Key, "does not match the certificate of --tls-cert")
                    }
                    rustls::Error::InvalidCertificate(e) => {
                        unusable(TlsFile::Cert, format!("is not a usable certificate: {e}"))
                    }
                    // rustls's reasons quote no key material.
                    e => unusable(TlsFile::Key, format!("is not a usable private key: {e}")),
                }
            })?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| unusable(TlsFile::Cert, e.to_string()))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = RootCertStore::empty();
                // As tonic did: certificates that do not parse are skipped,
                // and the file is refused only if none is left.
                roots.add_parsable_certificates(certificates(pem, TlsFile::ClientCa)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| {
                        unusable(
                            TlsFile::ClientCa,
                            format!("holds no usable CA certificate: {e}"),
                        )
                    })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config =
            builder.with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(certified)));
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Arc::new(config))
    }
}

/// The gRPC port's TLS configuration: every handshake takes the current
/// one, which a reload replaces. A connection keeps the configuration its
/// handshake took. Each configuration has its own session cache, so a
/// session resumed after a reload was verified against what is served now
/// (a client CA removed by a reload cannot be resumed into).
#[derive(Debug)]
pub struct LiveTls {
    current: RwLock<Arc<ServerConfig>>,
}

impl LiveTls {
    pub fn new(config: Arc<ServerConfig>) -> Self {
        Self {
            current: RwLock::new(config),
        }
    }

    /// The configuration of a handshake starting now.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Serves `config` to the handshakes from now on.
    pub fn replace(&self, config: Arc<ServerConfig>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
    }
}

/// A certificate's subject and end of validity, for logs.
pub fn describe(der: &[u8]) -> Option<(String, String)> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let not_after = cert.validity().not_after;
    Some((
        cert.subject().to_string(),
        not_after
            .to_rfc2822()
            .unwrap_or_else(|_| not_after.to_string()),
    ))
}

/// [`describe`] of each certificate of a PEM file that parses.
pub fn describe_pem(pem: &[u8]) -> Vec<(String, String)> {
    CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .filter_map(|c| describe(&c))
        .collect()
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

    fn server_pem() -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, "server");
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[test]
    fn each_unusable_file_is_named_and_no_key_is_quoted() {
        let (cert, key) = server_pem();
        let (_, other_key) = server_pem();
        let files = |cert: &str, key: &str, ca: Option<&str>| {
            TlsFiles::from_pem(
                cert.as_bytes().to_vec(),
                key.as_bytes().to_vec(),
                ca.map(|c| c.as_bytes().to_vec()),
            )
        };
        let config = files(&cert, &key, Some(&cert)).check().unwrap();
        assert_eq!(config.alpn_protocols, vec![b"h2".to_vec()]);

        let err = files("garbage", &key, None).check().unwrap_err();
        assert_eq!(err.file, TlsFile::Cert, "{err}");
        let err = files(&cert, &other_key, None).check().unwrap_err();
        assert_eq!(err.file, TlsFile::Key, "{err}");
        assert!(err.reason.contains("does not match"), "{err}");
        // A key whose base64 is broken: the reason quotes none of it.
        let broken: String = key
            .lines()
            .enumerate()
            .map(|(i, l)| {
                if i == 1 {
                    format!("!{}\n", &l[1..])
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        let err = files(&cert, &broken, None).check().unwrap_err();
        assert_eq!(err.file, TlsFile::Key, "{err}");
        for line in key.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!err.to_string().contains(line), "{err}");
        }
        let err = files(&cert, &key, Some("not a CA")).check().unwrap_err();
        assert_eq!(err.file, TlsFile::ClientCa, "{err}");

        // At start-up, the flag and the path.
        let dir = tempfile::tempdir().unwrap();
        let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&c, &cert).unwrap();
        std::fs::write(&k, &other_key).unwrap();
        let err = TlsFiles::load(&c, &k, None).unwrap_err().to_string();
        assert!(
            err.contains(&format!("--tls-key {}", k.display())) && err.contains("does not match"),
            "{err}"
        );
        std::fs::write(&k, &key).unwrap();
        let loaded = TlsFiles::load(&c, &k, None).unwrap();
        assert_eq!(loaded.paths().unwrap().key, k);
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
