//! Reloading the gRPC port's TLS files and the tokens file while serving.
//!
//! On Kubernetes they are Secrets mounted as volumes, which the kubelet
//! updates in place (cert-manager renewing a certificate, an operator
//! rotating tokens). Every `--reload-interval` and on SIGHUP the files are
//! read again by their paths; when their contents changed they are checked
//! as at start-up and, if they pass, served from then on: new TLS
//! handshakes get the new certificate and client CA (connections already
//! open keep their session), each call is checked against the new tokens.
//! A file that does not pass changes nothing: the previous ones stay
//! served, and a warning names the file and why, once per distinct failure.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::tls::{LiveTls, TlsFile, TlsFiles, TlsPaths};
use super::{Authenticator, FileDigest, file_digest};

/// What one look at a set of files found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The same contents as the last look.
    Unchanged,
    /// New contents, now served.
    Reloaded,
    /// New contents that do not pass (or a file that cannot be read): the
    /// previous ones are still served.
    Refused,
}

/// The files a server reloads, and what it serves of them.
pub struct Reloader {
    tls: Option<TlsState>,
    tokens: Option<TokensState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TlsDigests {
    cert: FileDigest,
    key: FileDigest,
    client_ca: Option<FileDigest>,
}

impl TlsDigests {
    fn of(files: &TlsFiles) -> Self {
        Self {
            cert: file_digest(files.cert_pem()),
            key: file_digest(files.key_pem()),
            client_ca: files.client_ca_pem().map(file_digest),
        }
    }
}

struct TlsState {
    paths: TlsPaths,
    live: Arc<LiveTls>,
    /// The files being served.
    served: TlsDigests,
    /// The files last read, served or refused; `None` after a file could
    /// not be read.
    seen: Option<TlsDigests>,
    /// The last warning, so that a failure is logged once.
    warned: Option<String>,
}

struct TokensState {
    auth: Arc<Authenticator>,
    path: PathBuf,
    served: FileDigest,
    seen: Option<FileDigest>,
    warned: Option<String>,
}

/// Logs `message` about `file` as a warning unless it was the last one
/// logged.
fn warn_once(warned: &mut Option<String>, file: &Path, message: String) {
    if warned.as_deref() != Some(message.as_str()) {
        tracing::warn!(file = %file.display(), "{message}");
        *warned = Some(message);
    }
}

impl Reloader {
    /// The reloader of `tls` (files read by [`TlsFiles::load`], served by
    /// `live`) and of `auth`'s tokens file; `None` when there is no file to
    /// reload (no TLS, or TLS from memory, and no tokens file).
    pub fn new(
        tls: Option<(&TlsFiles, Arc<LiveTls>)>,
        auth: Option<Arc<Authenticator>>,
    ) -> Option<Self> {
        let tls = tls.and_then(|(files, live)| {
            let digests = TlsDigests::of(files);
            files.paths().map(|paths| TlsState {
                paths: paths.clone(),
                live,
                served: digests,
                seen: Some(digests),
                warned: None,
            })
        });
        let tokens = auth.and_then(|auth| {
            let (path, digest) = auth.tokens_file()?;
            let path = path.to_owned();
            Some(TokensState {
                auth,
                path,
                served: digest,
                seen: Some(digest),
                warned: None,
            })
        });
        (tls.is_some() || tokens.is_some()).then_some(Self { tls, tokens })
    }

    /// The warnings of files still refused.
    fn refusals(&self) -> Vec<&str> {
        let tls = self.tls.as_ref().and_then(|t| t.warned.as_deref());
        let tokens = self.tokens.as_ref().and_then(|t| t.warned.as_deref());
        tls.into_iter().chain(tokens).collect()
    }

    /// Reads every file again and serves what changed and passes: the
    /// outcome of the TLS files and of the tokens file (`None`: not
    /// reloaded). Blocks on the file system.
    pub fn check(&mut self) -> (Option<Outcome>, Option<Outcome>) {
        (
            self.tls.as_mut().map(TlsState::check),
            self.tokens.as_mut().map(TokensState::check),
        )
    }
}

impl TlsState {
    fn path(&self, file: TlsFile) -> &Path {
        match file {
            TlsFile::Cert => &self.paths.cert,
            TlsFile::Key => &self.paths.key,
            TlsFile::ClientCa => self.paths.client_ca.as_deref().unwrap_or(Path::new("")),
        }
    }

    fn refused(&mut self, file: TlsFile, why: String) -> Outcome {
        let path = self.path(file).to_owned();
        warn_once(
            &mut self.warned,
            &path,
            format!(
                "cannot reload the TLS files: {} {} {why}; still serving the TLS files loaded before (new contents are picked up at the next reload)",
                file.flag(),
                path.display()
            ),
        );
        Outcome::Refused
    }

    fn check(&mut self) -> Outcome {
        let read = |file: TlsFile| {
            std::fs::read(self.path(file)).map_err(|e| (file, format!("cannot be read: {e}")))
        };
        let read_all = || -> Result<TlsFiles, (TlsFile, String)> {
            Ok(TlsFiles::from_pem(
                read(TlsFile::Cert)?,
                read(TlsFile::Key)?,
                self.paths
                    .client_ca
                    .is_some()
                    .then(|| read(TlsFile::ClientCa))
                    .transpose()?,
            ))
        };
        let files = match read_all() {
            Ok(files) => files,
            Err((file, why)) => {
                self.seen = None;
                return self.refused(file, why);
            }
        };
        let now = TlsDigests::of(&files);
        if self.seen == Some(now) {
            return Outcome::Unchanged;
        }
        self.seen = Some(now);
        if now == self.served {
            // Back to what is served, after a refused version.
            if self.warned.take().is_some() {
                tracing::info!("the TLS files are back to those being served; nothing to reload");
            }
            return Outcome::Unchanged;
        }
        let config = match files.check() {
            Ok(config) => config,
            Err(e) => return self.refused(e.file, e.reason),
        };
        self.live.replace(config);
        let mut changed = Vec::new();
        for (file, differs) in [
            (TlsFile::Cert, now.cert != self.served.cert),
            (TlsFile::Key, now.key != self.served.key),
            (TlsFile::ClientCa, now.client_ca != self.served.client_ca),
        ] {
            if differs {
                changed.push(format!("{} {}", file.flag(), self.path(file).display()));
            }
        }
        let leaf = super::tls::describe_pem(files.cert_pem())
            .into_iter()
            .next();
        let (subject, not_after) = leaf.unwrap_or_default();
        let client_ca = files
            .client_ca_pem()
            .filter(|_| now.client_ca != self.served.client_ca)
            .map(|pem| {
                super::tls::describe_pem(pem)
                    .into_iter()
                    .map(|(subject, not_after)| format!("{subject} (until {not_after})"))
                    .collect::<Vec<_>>()
                    .join("; ")
            });
        tracing::info!(
            changed = %changed.join(", "),
            subject = %subject,
            not_after = %not_after,
            client_ca = client_ca.as_deref(),
            "reloaded the TLS files: new handshakes get them; connections already open keep theirs"
        );
        self.served = now;
        self.warned = None;
        Outcome::Reloaded
    }
}

impl TokensState {
    fn refused(&mut self, why: String) -> Outcome {
        warn_once(
            &mut self.warned,
            &self.path,
            format!(
                "cannot reload --auth-tokens {}: {why}; still checking calls against the tokens loaded before (new contents are picked up at the next reload)",
                self.path.display()
            ),
        );
        Outcome::Refused
    }

    fn check(&mut self) -> Outcome {
        let text = match std::fs::read(&self.path) {
            Ok(text) => text,
            Err(e) => {
                self.seen = None;
                return self.refused(format!("it cannot be read: {e}"));
            }
        };
        let now = file_digest(&text);
        if self.seen == Some(now) {
            return Outcome::Unchanged;
        }
        self.seen = Some(now);
        if now == self.served {
            if self.warned.take().is_some() {
                tracing::info!(
                    "the --auth-tokens file is back to the one being served; nothing to reload"
                );
            }
            return Outcome::Unchanged;
        }
        let replaced = std::str::from_utf8(&text)
            .map_err(|_| anyhow::anyhow!("not UTF-8 text"))
            .and_then(|text| self.auth.replace_tokens(text));
        match replaced {
            Ok((tokens, clients)) => {
                tracing::info!(
                    file = %self.path.display(),
                    tokens,
                    clients,
                    "reloaded --auth-tokens: calls from now on are checked against it"
                );
                self.served = now;
                self.warned = None;
                Outcome::Reloaded
            }
            // The parser's messages quote no token.
            Err(e) => self.refused(format!("{e:#}")),
        }
    }
}

/// Reloads every `interval` (`None`: never) and, with `sighup`, on SIGHUP,
/// for ever: spawn it, and abort it to stop. With nothing to reload, a
/// SIGHUP is logged and otherwise ignored (it no longer stops the server).
pub async fn watch(mut reloader: Option<Reloader>, interval: Option<Duration>, sighup: bool) {
    #[cfg(unix)]
    let mut hangups = if sighup {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; the TLS and token files are reloaded every --reload-interval only");
                None
            }
        }
    } else {
        None
    };
    #[cfg(not(unix))]
    let _ = sighup;
    let mut ticks = interval.filter(|_| reloader.is_some()).map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let signalled = tokio::select! {
            _ = async {
                match ticks.as_mut() {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            } => false,
            Some(()) = async {
                #[cfg(unix)]
                if let Some(h) = hangups.as_mut() {
                    return h.recv().await;
                }
                std::future::pending::<Option<()>>().await
            } => true,
            else => return,
        };
        let Some(mut r) = reloader.take() else {
            tracing::info!(
                "SIGHUP received: there is nothing to reload (no --tls-cert or --auth-tokens file)"
            );
            continue;
        };
        if signalled {
            tracing::info!("SIGHUP received: reading the TLS and token files again");
        }
        let checked = tokio::task::spawn_blocking(move || {
            let outcomes = r.check();
            (r, outcomes)
        })
        .await;
        let (r, outcomes) = match checked {
            Ok(done) => done,
            Err(e) if e.is_panic() => {
                tracing::error!(
                    error = %e,
                    "reading the TLS and token files failed unexpectedly; they are not reloaded again until the server restarts (the ones in use are kept)"
                );
                return;
            }
            // Cancelled: the server is stopping.
            Err(_) => return,
        };
        if signalled
            && matches!(
                outcomes,
                (
                    None | Some(Outcome::Unchanged),
                    None | Some(Outcome::Unchanged)
                )
            )
        {
            // Asked by an operator: what is still refused, if anything.
            let refused = r.refusals().join(" | ");
            tracing::info!(
                still_refused = (!refused.is_empty()).then_some(refused.as_str()),
                "the TLS and token files are unchanged since they were last read"
            );
        }
        reloader = Some(r);
    }
}
