//! Name resolution for `dns:///host:port` targets: a [`Resolve`] turns the
//! name into addresses, and a small task keeps tonic's balancer in step with
//! it, re-resolving every interval so that scale-out and replaced pods are
//! seen (a Kubernetes headless Service answers with one A/AAAA record per
//! ready pod).
//!
//! Each address's grpc.health.v1 is watched too: a replica that reports
//! NOT_SERVING (it is draining for shutdown) or cannot be reached leaves the
//! balancer at once, before DNS catches up, and comes back when it serves.
//!
//! The resolver is pluggable: [`DnsResolver`] asks the system resolver;
//! [`StaticResolver`] is an in-memory list a test (or an embedding program)
//! changes at run time.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::task::AbortOnDropHandle;
use tonic::Code;
use tonic::transport::Endpoint;
use tonic::transport::channel::Change;

/// Turns a host name and port into the addresses to balance over.
#[async_trait]
pub trait Resolve: Send + Sync + 'static {
    async fn resolve(&self, host: &str, port: u16) -> io::Result<Vec<SocketAddr>>;
}

/// The system resolver (`getaddrinfo`): every A and AAAA record of the name.
#[derive(Debug, Clone, Copy, Default)]
pub struct DnsResolver;

#[async_trait]
impl Resolve for DnsResolver {
    async fn resolve(&self, host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        Ok(tokio::net::lookup_host((host, port)).await?.collect())
    }
}

/// A list of addresses held in memory, for every name: whoever holds a clone
/// can change it, and the next resolve sees the change.
#[derive(Debug, Clone, Default)]
pub struct StaticResolver {
    addrs: Arc<RwLock<Vec<SocketAddr>>>,
}

impl StaticResolver {
    pub fn new(addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        let r = Self::default();
        r.set(addrs);
        r
    }

    /// Replaces the list.
    pub fn set(&self, addrs: impl IntoIterator<Item = SocketAddr>) {
        *self.addrs.write().unwrap_or_else(|e| e.into_inner()) = addrs.into_iter().collect();
    }
}

#[async_trait]
impl Resolve for StaticResolver {
    async fn resolve(&self, _host: &str, _port: u16) -> io::Result<Vec<SocketAddr>> {
        Ok(self.addrs.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// What the balancer must do to go from `current` to `wanted`.
///
/// An empty `wanted` changes nothing: a name that briefly has no records
/// (every pod restarting, a DNS hiccup) keeps the last known addresses, whose
/// calls fail fast with UNAVAILABLE, instead of leaving calls waiting for an
/// endpoint until their deadline.
pub fn diff(
    current: &BTreeSet<SocketAddr>,
    wanted: &BTreeSet<SocketAddr>,
) -> (Vec<SocketAddr>, Vec<SocketAddr>) {
    if wanted.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let insert = wanted.difference(current).copied().collect();
    let remove = current.difference(wanted).copied().collect();
    (insert, remove)
}

/// A request to resolve now; answered once the balancer has been told.
pub(crate) type Refresh = oneshot::Sender<()>;

/// What a health watcher reports about one address.
type HealthReport = (SocketAddr, bool);

/// Everything the resolver task needs.
pub(crate) struct Task {
    pub resolver: Arc<dyn Resolve>,
    pub host: String,
    pub port: u16,
    pub interval: Duration,
    /// Builds the endpoint of one address (transport settings, origin).
    pub endpoint: Arc<dyn Fn(SocketAddr) -> Endpoint + Send + Sync>,
    /// Watch each address's grpc.health.v1 and leave out those not serving.
    pub health_check: bool,
    /// The balancer's change feed; closed when every channel clone is gone.
    pub changes: mpsc::Sender<Change<SocketAddr, Endpoint>>,
    pub refresh: mpsc::Receiver<Refresh>,
    /// The addresses the balancer has, for whoever wants to know.
    pub published: watch::Sender<BTreeSet<SocketAddr>>,
    pub state: State,
}

/// What the task knows.
#[derive(Default)]
pub(crate) struct State {
    /// The name's addresses at the last successful resolve.
    listed: BTreeSet<SocketAddr>,
    /// Listed addresses whose health says not serving, or that cannot be
    /// reached. Unknown health counts as serving, so that a new client
    /// does not wait for health before its first call.
    down: BTreeSet<SocketAddr>,
    /// The addresses the balancer has now.
    current: BTreeSet<SocketAddr>,
    /// One health watcher per listed address; dropping one stops it.
    watchers: HashMap<SocketAddr, AbortOnDropHandle<()>>,
}

impl State {
    /// Listed and serving; every listed address when none is serving (a
    /// call then fails fast or succeeds, rather than waiting for an
    /// endpoint until its deadline).
    fn wanted(&self) -> BTreeSet<SocketAddr> {
        let up: BTreeSet<SocketAddr> = self.listed.difference(&self.down).copied().collect();
        if up.is_empty() {
            self.listed.clone()
        } else {
            up
        }
    }
}

impl Task {
    /// Resolves once and tells the balancer; returns how many addresses it
    /// has. An error or an empty answer keeps the current set.
    pub async fn resolve_once(&mut self, health: &mpsc::Sender<HealthReport>) -> io::Result<usize> {
        let listed: BTreeSet<SocketAddr> = self
            .resolver
            .resolve(&self.host, self.port)
            .await?
            .into_iter()
            .collect();
        if listed.is_empty() {
            tracing::warn!(host = %self.host, kept = self.state.current.len(), "the name resolved to no addresses; keeping the last known ones");
            return Ok(self.state.current.len());
        }
        let st = &mut self.state;
        st.watchers.retain(|addr, _| listed.contains(addr));
        st.down.retain(|addr| listed.contains(addr));
        if self.health_check {
            for addr in listed.difference(&st.listed) {
                let watcher = tokio::spawn(watch_health(
                    *addr,
                    (self.endpoint)(*addr),
                    health.clone(),
                    self.interval,
                ));
                st.watchers.insert(*addr, AbortOnDropHandle::new(watcher));
            }
        }
        st.listed = listed;
        self.apply().await;
        Ok(self.state.current.len())
    }

    /// Brings the balancer to [`State::wanted`], as far as its queue takes:
    /// the balancer reads its changes only when a call comes, so an idle
    /// client's queue can be full. What does not fit is left for the next
    /// round (the difference is worked out again), never waited for: a
    /// wait would hold resolution, and a first connect, until a call.
    async fn apply(&mut self) {
        let (insert, remove) = diff(&self.state.current, &self.state.wanted());
        let changes = insert
            .into_iter()
            .map(|addr| (addr, true))
            .chain(remove.into_iter().map(|addr| (addr, false)));
        for (addr, add) in changes {
            let change = if add {
                Change::Insert(addr, (self.endpoint)(addr))
            } else {
                Change::Remove(addr)
            };
            match self.changes.try_send(change) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    tracing::debug!(host = %self.host, "the balancer's queue is full; the other changes wait for the next round");
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
            if add {
                tracing::debug!(%addr, host = %self.host, "balancing over an address");
                self.state.current.insert(addr);
            } else {
                tracing::debug!(%addr, host = %self.host, "no longer balancing over an address");
                self.state.current.remove(&addr);
            }
        }
        self.published.send_replace(self.state.current.clone());
    }

    fn health(&mut self, addr: SocketAddr, serving: bool) -> bool {
        if !self.state.listed.contains(&addr) {
            return false;
        }
        if serving {
            self.state.down.remove(&addr)
        } else {
            self.state.down.insert(addr)
        }
    }

    /// Re-resolves every interval, or when asked, and follows health, until
    /// the channel is gone.
    pub async fn run(
        mut self,
        health_tx: mpsc::Sender<HealthReport>,
        mut health_rx: mpsc::Receiver<HealthReport>,
    ) {
        let mut tick =
            tokio::time::interval_at(tokio::time::Instant::now() + self.interval, self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let ack = tokio::select! {
                _ = self.changes.closed() => return,
                Some((addr, serving)) = health_rx.recv() => {
                    if self.health(addr, serving) {
                        tracing::info!(%addr, host = %self.host, serving, "replica health changed");
                        self.apply().await;
                    }
                    continue;
                }
                _ = tick.tick() => None,
                r = self.refresh.recv() => match r {
                    Some(ack) => Some(ack),
                    // Every client handle is gone; the channel soon follows.
                    None => return,
                },
            };
            if let Err(e) = self.resolve_once(&health_tx).await {
                tracing::warn!(host = %self.host, error = %e, kept = self.state.current.len(), "re-resolving failed; keeping the last known addresses");
            }
            if let Some(ack) = ack {
                let _ = ack.send(());
            }
        }
    }
}

/// Follows one address's grpc.health.v1 `Watch` and reports what it sees:
/// SERVING is up; NOT_SERVING (a replica draining for shutdown), a broken
/// stream or a failed connection is down. A server that does not offer
/// health (or refuses this client its use) counts as up. Tries again every
/// `retry` after a failure, until aborted.
async fn watch_health(
    addr: SocketAddr,
    endpoint: Endpoint,
    report: mpsc::Sender<HealthReport>,
    retry: Duration,
) {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let retry = retry.min(Duration::from_secs(1));
    loop {
        let serving = match endpoint.connect().await {
            Err(e) => {
                tracing::debug!(%addr, error = %e, "health: cannot connect");
                false
            }
            Ok(channel) => match HealthClient::new(channel)
                .watch(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                Ok(resp) => {
                    let mut statuses = resp.into_inner();
                    // Watch while serving. At NOT_SERVING the replica is
                    // draining: let go of the stream and its connection at
                    // once (an open stream would hold up its shutdown) and
                    // ask again after `retry`.
                    loop {
                        match statuses.message().await {
                            Ok(Some(r)) if r.status() == ServingStatus::Serving => {
                                if report.send((addr, true)).await.is_err() {
                                    return;
                                }
                            }
                            _ => break false,
                        }
                    }
                }
                Err(s)
                    if matches!(
                        s.code(),
                        Code::Unimplemented | Code::Unauthenticated | Code::PermissionDenied
                    ) =>
                {
                    let _ = report.send((addr, true)).await;
                    tokio::time::sleep(retry * 10).await;
                    continue;
                }
                Err(_) => false,
            },
        };
        if report.send((addr, serving)).await.is_err() {
            return;
        }
        tokio::time::sleep(retry).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ports: &[u16]) -> BTreeSet<SocketAddr> {
        ports
            .iter()
            .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
            .collect()
    }

    #[test]
    fn the_difference_inserts_new_addresses_and_removes_gone_ones() {
        let (insert, remove) = diff(&set(&[1, 2, 3]), &set(&[2, 3, 4]));
        assert_eq!(insert, set(&[4]).into_iter().collect::<Vec<_>>());
        assert_eq!(remove, set(&[1]).into_iter().collect::<Vec<_>>());
        assert_eq!(diff(&set(&[1]), &set(&[1])), (vec![], vec![]));
    }

    #[test]
    fn an_empty_answer_keeps_the_last_known_addresses() {
        assert_eq!(diff(&set(&[1, 2]), &set(&[])), (vec![], vec![]));
    }

    #[tokio::test]
    async fn the_system_resolver_finds_loopback() {
        let addrs = DnsResolver.resolve("127.0.0.1", 50051).await.unwrap();
        assert_eq!(addrs, vec![SocketAddr::from(([127, 0, 0, 1], 50051))]);
    }
}
