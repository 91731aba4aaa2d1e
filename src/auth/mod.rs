//! Who is calling, and for which users they may act.
//!
//! A caller proves who it is with a bearer token (`authorization: Bearer T`,
//! looked up in the `--auth-tokens` file) or, with mTLS, with its client
//! certificate (the certificate's name is the caller). [`AuthLayer`] does
//! this before a request is decoded and puts the [`Caller`] in the request's
//! extensions; the handlers then check the request's `user_id` against it
//! ([`authorize`]), since the user is inside the message.
//!
//! Tokens are kept as SHA-256 digests, compared in constant time (the
//! comparison shows neither where nor whether the lengths differ), and never
//! logged or displayed. The table of tokens and clients is replaced when
//! the tokens file changes ([`reload`]); each call is checked against the
//! table of the moment.

mod layer;
pub mod reload;
pub mod tls;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use serde::Deserialize;
use subtle::ConstantTimeEq;

pub use layer::{AuthLayer, AuthService};

use crate::domain::UserId;

/// The request header (gRPC metadata) in which the authentication layers
/// pass an authenticated caller's name on to the A2A executor. Both layers
/// remove it from every incoming request before they set it.
pub const CALLER_HEADER: &str = "agentd-caller";

/// Services reachable without credentials by default: probes and tooling.
/// They are also the only services `--auth-open-services` may name
/// ([`check_open_services`]).
pub const DEFAULT_OPEN_SERVICES: &[&str] = &[
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
];

/// Checks `--auth-open-services`: only the health and reflection services
/// may be called without credentials. Any other service (agents.v1, the A2A
/// service) would run calls with no caller, which [`authorize`] lets act
/// for every user: authentication would be on in name only.
pub fn check_open_services(services: &[String]) -> Result<(), String> {
    for s in services.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        if !DEFAULT_OPEN_SERVICES.contains(&s) {
            return Err(format!(
                "--auth-open-services: {s:?} cannot be open; only {} may be called without credentials (an open agents.v1 or A2A service would let any client act for any user)",
                DEFAULT_OPEN_SERVICES.join(" and ")
            ));
        }
    }
    Ok(())
}

/// The user ids a caller may act for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// A trusted service: any user.
    AnyUser,
    Users(HashSet<String>),
}

impl Scope {
    fn parse(user_ids: Vec<String>, whose: &str) -> anyhow::Result<Self> {
        if user_ids.iter().any(|u| u == "*") {
            if user_ids.len() > 1 {
                anyhow::bail!("{whose}: \"*\" must be the only entry of user_ids");
            }
            return Ok(Scope::AnyUser);
        }
        if user_ids.is_empty() {
            anyhow::bail!("{whose}: user_ids is empty (list users, or \"*\" for any)");
        }
        for u in &user_ids {
            UserId::parse(u.clone())
                .map_err(|e| anyhow::anyhow!("{whose}: a user id is not valid: {e}"))?;
        }
        Ok(Scope::Users(user_ids.into_iter().collect()))
    }

    pub fn allows(&self, user: &str) -> bool {
        match self {
            Scope::AnyUser => true,
            Scope::Users(users) => users.contains(user),
        }
    }
}

/// An authenticated caller, found in a request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// For logs and metrics: the token's caller name or the certificate's name.
    pub name: Arc<str>,
    pub scope: Scope,
}

/// Checks that `caller` may act for `user`. Without a caller (authentication
/// is off) everything is allowed.
pub fn authorize(caller: Option<&Caller>, user: &UserId) -> Result<(), Denied> {
    match caller {
        Some(c) if !c.scope.allows(user.as_str()) => {
            tracing::info!(caller = %c.name, "call refused: the caller may not act for this user");
            Err(Denied)
        }
        _ => Ok(()),
    }
}

/// Whether `caller` may use the A2A faces, whose tasks run as the user the
/// caller's name is: only if its scope includes that name (`*`, or its own
/// name listed). A token for some users only must not act as another user
/// who happens to share the caller's name.
pub fn may_act_as_itself(caller: &Caller) -> bool {
    let ok = caller.scope.allows(&caller.name);
    if !ok {
        tracing::info!(caller = %caller.name, "A2A call refused: the caller's user_ids do not include its own name, which A2A tasks run as");
    }
    ok
}

/// Why an A2A call of an authenticated caller is refused.
pub const A2A_SCOPE_REFUSAL: &str =
    "A2A tasks run as their caller, and this caller's user_ids do not include its own name";

/// The caller may not act for the request's user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the caller may not act for this user_id")]
pub struct Denied;

/// Why a request carried no acceptable credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error("this call needs credentials: a bearer token or a client certificate")]
    Missing,
    #[error("the authorization header must be \"Bearer <token>\"")]
    Malformed,
    #[error("the bearer token is not valid")]
    BadToken,
    #[error("the client certificate has no name this server knows")]
    UnknownCertificate,
}

/// A token's entry: the token's SHA-256 digest, never the token. Debug
/// shows the caller only.
struct TokenEntry {
    digest: TokenDigest,
    caller: Caller,
}

/// The SHA-256 digest of a token: what presented tokens are compared by.
/// Every digest has the same length, so a comparison in constant time
/// reveals nothing of the stored token's length.
type TokenDigest = [u8; 32];

fn token_digest(token: &[u8]) -> TokenDigest {
    use sha2::Digest as _;
    sha2::Sha256::digest(token).into()
}

impl std::fmt::Debug for TokenEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEntry")
            .field("caller", &self.caller)
            .finish_non_exhaustive()
    }
}

/// The credentials a server accepts. Shared by the gRPC and A2A faces;
/// its table follows the tokens file ([`Authenticator::replace_tokens`]).
/// Debug shows the callers, never a token or a digest.
pub struct Authenticator {
    /// The tokens file's table of the moment.
    table: RwLock<Arc<Table>>,
    /// The tokens file and the digest of its contents as loaded at
    /// start-up; `None` without one.
    tokens_file: Option<(PathBuf, FileDigest)>,
    /// With mTLS and no tokens file, every certificate the CA signed is a
    /// trusted caller.
    trust_any_certificate: bool,
    /// Client certificates are verified (`--tls-client-ca`).
    mtls: bool,
    /// Full service names reachable without credentials.
    open_services: HashSet<String>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("table", &self.table())
            .field("tokens_file", &self.tokens_file.as_ref().map(|(p, _)| p))
            .field("trust_any_certificate", &self.trust_any_certificate)
            .field("open_services", &self.open_services)
            .finish()
    }
}

/// What one version of the tokens file says.
#[derive(Debug, Default)]
struct Table {
    tokens: Vec<TokenEntry>,
    /// Certificate name → scope, from the tokens file's `clients`.
    clients: Vec<Caller>,
}

/// The SHA-256 digest of a file's contents: how a reload tells that it
/// changed, without keeping the contents.
pub type FileDigest = [u8; 32];

/// The [`FileDigest`] of `contents`.
pub fn file_digest(contents: &[u8]) -> FileDigest {
    use sha2::Digest as _;
    sha2::Sha256::digest(contents).into()
}

/// The `--auth-tokens` file (JSON).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    tokens: Vec<TokenSpec>,
    #[serde(default)]
    clients: Vec<ClientSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenSpec {
    token: String,
    caller: String,
    user_ids: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientSpec {
    name: String,
    user_ids: Vec<String>,
}

/// Shortest token accepted: guessing must be hopeless.
const MIN_TOKEN_BYTES: usize = 16;

impl Authenticator {
    /// `tokens_file`: the `--auth-tokens` JSON; `mtls`: whether client
    /// certificates are verified; `open_services`: reachable without
    /// credentials.
    pub fn new(
        tokens_file: Option<&Path>,
        mtls: bool,
        open_services: &[String],
    ) -> anyhow::Result<Self> {
        check_open_services(open_services).map_err(anyhow::Error::msg)?;
        let (table, loaded) = match tokens_file {
            None => (Table::default(), None),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --auth-tokens {}", path.display()))?;
                let table = Self::parse_table(&text)
                    .with_context(|| format!("--auth-tokens {}", path.display()))?;
                (table, Some((path.to_owned(), file_digest(text.as_bytes()))))
            }
        };
        Ok(Self {
            table: RwLock::new(Arc::new(table)),
            tokens_file: loaded,
            // Every certificate the CA signed acts for any user only when
            // no tokens file says who may: with one, only its `clients` are
            // trusted (none if it lists none), as README promises.
            trust_any_certificate: mtls && tokens_file.is_none(),
            mtls,
            open_services: open_services
                .iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
        })
    }

    /// Whether callers may present bearer tokens (a tokens file is read).
    pub fn takes_tokens(&self) -> bool {
        self.tokens_file.is_some()
    }

    /// Whether callers may present client certificates (mTLS).
    pub fn takes_certificates(&self) -> bool {
        self.mtls
    }

    /// The tokens file, with the digest of what start-up read of it.
    pub fn tokens_file(&self) -> Option<(&Path, FileDigest)> {
        self.tokens_file.as_ref().map(|(p, d)| (p.as_path(), *d))
    }

    /// Checks `text` as start-up checks the tokens file and, if it passes,
    /// makes it the table every call from now on is checked against; the
    /// number of tokens and of clients it lists. On error the table stays.
    pub fn replace_tokens(&self, text: &str) -> anyhow::Result<(usize, usize)> {
        let table = Self::parse_table(text)?;
        let counts = (table.tokens.len(), table.clients.len());
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        Ok(counts)
    }

    /// The table of the moment.
    fn table(&self) -> Arc<Table> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn parse_table(text: &str) -> anyhow::Result<Table> {
        let (tokens, clients, _listed) = Self::parse(text)?;
        Ok(Table { tokens, clients })
    }

    #[allow(clippy::type_complexity)]
    fn parse(text: &str) -> anyhow::Result<(Vec<TokenEntry>, Vec<Caller>, bool)> {
        // Only the position and kind of error: serde_json messages can quote values.
        let file: TokensFile = serde_json::from_str(text).map_err(|e| {
            anyhow::anyhow!(
                "not a valid tokens file (line {}, column {}): {}",
                e.line(),
                e.column(),
                match e.classify() {
                    serde_json::error::Category::Syntax => "syntax error",
                    serde_json::error::Category::Eof => "unexpected end",
                    serde_json::error::Category::Data =>
                        "a field is missing, unknown or of the wrong type",
                    serde_json::error::Category::Io => "read error",
                }
            )
        })?;
        let mut tokens = Vec::new();
        for (i, t) in file.tokens.into_iter().enumerate() {
            let whose = format!("tokens[{i}] (caller {:?})", t.caller);
            if t.token.len() < MIN_TOKEN_BYTES || !t.token.bytes().all(|b| b.is_ascii_graphic()) {
                anyhow::bail!(
                    "{whose}: a token must be at least {MIN_TOKEN_BYTES} printable ASCII characters"
                );
            }
            // deploy/examples/secrets.yaml's placeholder, applied unchanged,
            // would be a working token that anyone who read the example knows.
            if t.token.starts_with("REPLACE") {
                anyhow::bail!(
                    "{whose}: the token is the example's placeholder; put a random one in its place (e.g. from `openssl rand -hex 32`)"
                );
            }
            if t.caller.is_empty() {
                anyhow::bail!("tokens[{i}]: caller is empty");
            }
            let digest = token_digest(t.token.as_bytes());
            if tokens.iter().any(|e: &TokenEntry| e.digest == digest) {
                anyhow::bail!("{whose}: the same token is listed twice");
            }
            let scope = Scope::parse(t.user_ids, &whose)?;
            tokens.push(TokenEntry {
                digest,
                caller: Caller {
                    name: t.caller.into(),
                    scope,
                },
            });
        }
        let listed = !file.clients.is_empty();
        let mut clients = Vec::new();
        for (i, c) in file.clients.into_iter().enumerate() {
            let whose = format!("clients[{i}] ({:?})", c.name);
            let scope = Scope::parse(c.user_ids, &whose)?;
            clients.push(Caller {
                name: c.name.into(),
                scope,
            });
        }
        Ok((tokens, clients, listed))
    }

    /// Whether `service` (e.g. `grpc.health.v1.Health`) needs no credentials.
    pub fn is_open(&self, service: &str) -> bool {
        self.open_services.contains(service)
    }

    /// The caller presenting `token`. The presented token's digest is
    /// compared with every entry's, each in constant time (digests all have
    /// one length, so neither the position of a difference nor a stored
    /// token's length shows), whichever matches.
    pub fn by_token(&self, token: &[u8]) -> Option<Caller> {
        let presented = token_digest(token);
        let table = self.table();
        let mut found = None;
        for e in &table.tokens {
            if bool::from(e.digest.as_slice().ct_eq(presented.as_slice())) {
                found = Some(&e.caller);
            }
        }
        found.cloned()
    }

    /// The caller a verified client certificate named `name` is.
    pub fn by_certificate(&self, name: &str) -> Option<Caller> {
        if self.trust_any_certificate {
            return Some(Caller {
                name: name.into(),
                scope: Scope::AnyUser,
            });
        }
        self.table()
            .clients
            .iter()
            .find(|c| &*c.name == name)
            .cloned()
    }

    /// Who sent a request: its bearer token if it has one, else its client
    /// certificate's name.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        certificate_name: Option<&str>,
    ) -> Result<Caller, Unauthenticated> {
        if let Some(value) = authorization {
            // The scheme's name is case-insensitive (RFC 9110 11.1).
            let token = match value.split_at_checked(7) {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"Bearer ") => token,
                _ => return Err(Unauthenticated::Malformed),
            };
            return self.by_token(token).ok_or(Unauthenticated::BadToken);
        }
        match certificate_name {
            Some(name) => self
                .by_certificate(name)
                .ok_or(Unauthenticated::UnknownCertificate),
            None => Err(Unauthenticated::Missing),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{
        "tokens": [
            {"token": "tok-billing-0123456789", "caller": "billing", "user_ids": ["*"]},
            {"token": "tok-web-0123456789abc", "caller": "web", "user_ids": ["alice", "bob"]}
        ]
    }"#;

    fn authenticator(text: &str, trust_any_certificate: bool) -> Authenticator {
        Authenticator {
            table: RwLock::new(Arc::new(Authenticator::parse_table(text).unwrap())),
            tokens_file: None,
            trust_any_certificate,
            mtls: trust_any_certificate,
            open_services: HashSet::new(),
        }
    }

    fn auth() -> Authenticator {
        authenticator(FILE, true)
    }

    #[test]
    fn a_token_names_its_caller_and_scope() {
        let a = auth();
        let c = a
            .authenticate(Some(b"Bearer tok-web-0123456789abc"), None)
            .unwrap();
        assert_eq!(&*c.name, "web");
        assert!(c.scope.allows("alice") && !c.scope.allows("mallory"));
        let c = a
            .authenticate(Some(b"Bearer tok-billing-0123456789"), None)
            .unwrap();
        assert!(c.scope.allows("anyone"));
        // The scheme's name in any case.
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            let header = format!("{scheme} tok-web-0123456789abc");
            let c = a.authenticate(Some(header.as_bytes()), None).unwrap();
            assert_eq!(&*c.name, "web", "{scheme}");
        }
    }

    #[test]
    fn missing_malformed_and_unknown_tokens_are_refused() {
        let a = auth();
        assert_eq!(a.authenticate(None, None), Err(Unauthenticated::Missing));
        assert_eq!(
            a.authenticate(Some(b"Basic abc"), None),
            Err(Unauthenticated::Malformed)
        );
        for short in [&b""[..], b"Bearer", b"Bearer\ttok-web-0123456789abc"] {
            assert_eq!(
                a.authenticate(Some(short), None),
                Err(Unauthenticated::Malformed)
            );
        }
        assert_eq!(
            a.authenticate(Some(b"Bearer tok-web-0123456789abX"), None),
            Err(Unauthenticated::BadToken)
        );
        assert_eq!(
            a.authenticate(Some(b"Bearer tok-web"), None),
            Err(Unauthenticated::BadToken)
        );
    }

    #[test]
    fn a_bad_file_is_refused_without_quoting_its_tokens() {
        let short = r#"{"tokens": [{"token": "short-secret", "caller": "x", "user_ids": ["*"]}]}"#;
        let err = format!("{:#}", Authenticator::parse(short).unwrap_err());
        assert!(
            err.contains("at least 16") && !err.contains("short-secret"),
            "{err}"
        );
        let broken = r#"{"tokens": [{"token": "a-very-secret-token-value", "caller": "x", "user_ids": ["*"]"#;
        let err = format!("{:#}", Authenticator::parse(broken).unwrap_err());
        assert!(!err.contains("a-very-secret"), "{err}");
        let mixed = r#"{"tokens": [{"token": "a-very-secret-token-value", "caller": "x", "user_ids": ["*", "bob"]}]}"#;
        assert!(Authenticator::parse(mixed).is_err());
        let example = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/examples/secrets.yaml"
        ))
        .unwrap();
        let placeholder = example
            .lines()
            .find_map(|l| l.trim().strip_prefix(r#"{"token": ""#))
            .and_then(|rest| rest.split('"').next())
            .expect("the example lists a token");
        let copied = format!(
            r#"{{"tokens": [{{"token": "{placeholder}", "caller": "web", "user_ids": ["*"]}}]}}"#
        );
        let err = format!("{:#}", Authenticator::parse(&copied).unwrap_err());
        assert!(err.contains("placeholder"), "{err}");
    }

    #[test]
    fn tokens_match_only_in_full_and_are_kept_as_fixed_size_digests() {
        let a = auth();
        assert_eq!(
            a.by_token(b"tok-web-0123456789abc").map(|c| c.name),
            Some("web".into())
        );
        for other in [
            &b"tok-web-0123456789abX"[..], // same length, last byte differs
            b"Xok-web-0123456789abc",      // same length, first byte differs
            b"tok-web-0123456789ab",       // a prefix
            b"tok-web-0123456789abcd",     // one byte longer
            b"",
        ] {
            assert!(a.by_token(other).is_none(), "{other:?}");
        }
        // What is compared is a digest of one length whatever the token's,
        // so the comparison cannot end early on a length difference.
        for e in &a.table().tokens {
            let digest: &TokenDigest = &e.digest;
            assert_eq!(digest.len(), 32);
            assert_ne!(digest.as_slice(), b"tok-web-0123456789abc".as_slice());
        }
        assert_ne!(token_digest(b"tok-web"), token_digest(b"tok-web-"));
    }

    #[test]
    fn only_health_and_reflection_may_be_open() {
        let defaults: Vec<String> = DEFAULT_OPEN_SERVICES
            .iter()
            .map(|s| s.to_string())
            .collect();
        check_open_services(&defaults).unwrap();
        check_open_services(&[String::new(), " grpc.health.v1.Health ".into()]).unwrap();
        for open in [
            "agents.v1.AgentService",
            crate::a2a::A2A_SERVICE_NAME,
            "grpc.health.v1.Health2",
        ] {
            let listed = vec!["grpc.health.v1.Health".to_owned(), open.to_owned()];
            let err = check_open_services(&listed).unwrap_err();
            assert!(
                err.starts_with("--auth-open-services") && err.contains(open),
                "{err}"
            );
            // Whoever builds the authenticator gets the same refusal.
            let err = Authenticator::new(None, true, &listed).unwrap_err();
            assert!(format!("{err:#}").contains(open), "{err:#}");
        }
    }

    #[test]
    fn debug_output_never_shows_a_token() {
        let a = auth();
        let shown = format!("{a:?}");
        assert!(
            shown.contains("billing") && !shown.contains("tok-billing"),
            "{shown}"
        );
    }

    #[test]
    fn with_a_tokens_file_only_its_clients_are_trusted_by_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.json");
        std::fs::write(
            &path,
            r#"{"tokens": [{"token": "a-long-enough-token-123", "caller": "web", "user_ids": ["alice"]}]}"#,
        )
        .unwrap();
        let a = Authenticator::new(Some(&path), true, &[]).unwrap();
        assert_eq!(
            a.authenticate(None, Some("any.signed.client")),
            Err(Unauthenticated::UnknownCertificate),
            "a tokens file without clients trusts no certificate"
        );
        assert_eq!(
            &*a.authenticate(
                Some(b"Bearer a-long-enough-token-123"),
                Some("any.signed.client")
            )
            .unwrap()
            .name,
            "web"
        );
        let open = Authenticator::new(None, true, &[]).unwrap();
        assert!(matches!(
            open.authenticate(None, Some("any.signed.client")),
            Ok(Caller {
                scope: Scope::AnyUser,
                ..
            })
        ));
    }

    #[test]
    fn a_replaced_table_serves_the_next_calls_and_a_bad_one_changes_nothing() {
        let a = auth();
        let next = r#"{"tokens": [{"token": "tok-new-0123456789abc", "caller": "new", "user_ids": ["*"]}],
                       "clients": [{"name": "batch.internal", "user_ids": ["*"]}]}"#;
        assert_eq!(a.replace_tokens(next).unwrap(), (1, 1));
        assert_eq!(
            &*a.authenticate(Some(b"Bearer tok-new-0123456789abc"), None)
                .unwrap()
                .name,
            "new"
        );
        assert_eq!(
            a.authenticate(Some(b"Bearer tok-web-0123456789abc"), None),
            Err(Unauthenticated::BadToken)
        );
        // A file that start-up would refuse leaves the table as it was,
        // and its error quotes no token.
        let short = r#"{"tokens": [{"token": "short-secret", "caller": "x", "user_ids": ["*"]}]}"#;
        let err = format!("{:#}", a.replace_tokens(short).unwrap_err());
        assert!(!err.contains("short-secret"), "{err}");
        assert!(
            a.authenticate(Some(b"Bearer tok-new-0123456789abc"), None)
                .is_ok()
        );
    }

    #[test]
    fn listed_clients_restrict_certificates() {
        let text = r#"{"clients": [{"name": "web.internal", "user_ids": ["alice"]}]}"#;
        let a = authenticator(text, false);
        assert_eq!(
            &*a.authenticate(None, Some("web.internal")).unwrap().name,
            "web.internal"
        );
        assert_eq!(
            a.authenticate(None, Some("other")),
            Err(Unauthenticated::UnknownCertificate)
        );
    }
}
