//! Keeping a lease: renew from T1, rebind from T2, re-acquire after the lease is lost.

use std::convert::Infallible;
use std::future::Future;
use std::net::Ipv4Addr;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::client::{self, Lease};
use super::timers::{Next, Rng, next_step, random_seed};
use super::{DhcpError, DhcpOptions};

/// What happened to a kept lease. Count these for metrics (acquired / renewed / failed).
#[derive(Debug)]
pub enum LeaseEvent {
    /// The lease was extended: a renewal after T1, or a rebinding after T2 (`rebinding`).
    Renewed { lease: Lease, rebinding: bool },
    /// A renewal attempt got no answer. The lease stays valid until it expires; the next attempt
    /// follows the RFC 2131 schedule.
    RenewFailed {
        ip: Ipv4Addr,
        rebinding: bool,
        error: DhcpError,
    },
    /// The address is lost: the lease expired (`error` = `None`) or the server NAKed the renewal.
    /// Stop announcing it; a re-acquisition follows.
    Lost {
        ip: Ipv4Addr,
        error: Option<DhcpError>,
    },
    /// A lease after a loss. The old address was requested, but the server may give another one:
    /// compare `lease.ip` and update the Service.
    Reacquired(Lease),
    /// A re-acquisition failed; retried after [`DhcpOptions::reacquire`] backoff.
    AcquireFailed { error: DhcpError },
}

/// Keeps `lease` alive for as long as the future runs (it never completes: spawn it and abort the
/// task, or use [`Maintainer`]). Every change is reported to `on_event`; the lease to release at
/// the end is the one from the last `Renewed` / `Reacquired` event.
pub async fn maintain(
    lease: Lease,
    opts: DhcpOptions,
    on_event: impl FnMut(LeaseEvent) + Send,
) -> Infallible {
    maintain_with(&Network, lease, &opts, on_event).await
}

/// The network calls `maintain` makes, replaceable in tests.
pub(crate) trait Transport {
    fn renew(
        &self,
        lease: &Lease,
        opts: &DhcpOptions,
    ) -> impl Future<Output = Result<Lease, DhcpError>> + Send;
    fn acquire(
        &self,
        iface: &str,
        mac: [u8; 6],
        requested: Option<Ipv4Addr>,
        opts: &DhcpOptions,
    ) -> impl Future<Output = Result<Lease, DhcpError>> + Send;
}

struct Network;

impl Transport for Network {
    fn renew(
        &self,
        lease: &Lease,
        opts: &DhcpOptions,
    ) -> impl Future<Output = Result<Lease, DhcpError>> + Send {
        client::renew(lease, opts)
    }

    fn acquire(
        &self,
        iface: &str,
        mac: [u8; 6],
        requested: Option<Ipv4Addr>,
        opts: &DhcpOptions,
    ) -> impl Future<Output = Result<Lease, DhcpError>> + Send {
        client::acquire(iface, mac, requested, opts)
    }
}

pub(crate) async fn maintain_with<T: Transport>(
    net: &T,
    mut lease: Lease,
    opts: &DhcpOptions,
    mut on_event: impl FnMut(LeaseEvent),
) -> Infallible {
    let mut rng = Rng::new(random_seed());
    let mut last_failure: Option<Duration> = None;
    loop {
        let elapsed = lease.obtained_at.elapsed();
        match next_step(
            &lease.timers(),
            elapsed,
            last_failure,
            opts.min_renew_interval,
        ) {
            Next::Sleep(d) => tokio::time::sleep(d).await,
            step @ (Next::Renew | Next::Rebind) => {
                let rebinding = step == Next::Rebind;
                let ip = lease.ip;
                // An answer that comes after the lease ended is no use: stop waiting there.
                match tokio::time::timeout_at(lease.expires_at(), net.renew(&lease, opts)).await {
                    Ok(Ok(renewed)) => {
                        last_failure = None;
                        lease = renewed;
                        on_event(LeaseEvent::Renewed {
                            lease: lease.clone(),
                            rebinding,
                        });
                    }
                    Ok(Err(error @ DhcpError::Nak { .. })) => {
                        tracing::warn!(%ip, %error, "DHCP renewal refused; the address is lost");
                        on_event(LeaseEvent::Lost {
                            ip,
                            error: Some(error),
                        });
                        lease = reacquire(net, &lease, opts, &mut rng, &mut on_event).await;
                        last_failure = None;
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(%ip, rebinding, %error, "DHCP renewal failed; will retry");
                        last_failure = Some(lease.obtained_at.elapsed());
                        on_event(LeaseEvent::RenewFailed {
                            ip,
                            rebinding,
                            error,
                        });
                    }
                    Err(_expired) => last_failure = Some(lease.obtained_at.elapsed()),
                }
            }
            Next::Expired => {
                tracing::warn!(ip = %lease.ip, "DHCP lease expired without renewal");
                on_event(LeaseEvent::Lost {
                    ip: lease.ip,
                    error: None,
                });
                lease = reacquire(net, &lease, opts, &mut rng, &mut on_event).await;
                last_failure = None;
            }
        }
    }
}

async fn reacquire<T: Transport>(
    net: &T,
    old: &Lease,
    opts: &DhcpOptions,
    rng: &mut Rng,
    on_event: &mut impl FnMut(LeaseEvent),
) -> Lease {
    let mut attempt = 0u32;
    loop {
        match net.acquire(&old.iface, old.mac, Some(old.ip), opts).await {
            Ok(lease) => {
                on_event(LeaseEvent::Reacquired(lease.clone()));
                return lease;
            }
            Err(error) => {
                on_event(LeaseEvent::AcquireFailed { error });
                tokio::time::sleep(opts.reacquire.delay(attempt, rng.next_u64())).await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}

/// A spawned [`maintain`] task with the lease it holds now. Dropping it stops the renewals
/// without releasing; [`Maintainer::release`] stops and releases.
#[derive(Debug)]
pub struct Maintainer {
    task: JoinHandle<Infallible>,
    current: watch::Receiver<Option<Lease>>,
}

impl Maintainer {
    /// Spawns the keeper on the current tokio runtime (its sockets are opened in that runtime's
    /// threads' network namespace). Events go to `events`; a closed receiver is ignored.
    pub fn spawn(
        lease: Lease,
        opts: DhcpOptions,
        events: mpsc::UnboundedSender<LeaseEvent>,
    ) -> Maintainer {
        let (tx, current) = watch::channel(Some(lease.clone()));
        let task = tokio::spawn(maintain(lease, opts, move |event| {
            match &event {
                LeaseEvent::Renewed { lease, .. } | LeaseEvent::Reacquired(lease) => {
                    tx.send_replace(Some(lease.clone()));
                }
                LeaseEvent::Lost { .. } => {
                    tx.send_replace(None);
                }
                _ => {}
            }
            let _ = events.send(event);
        }));
        Maintainer { task, current }
    }

    /// The lease held now; `None` between a loss and the next acquisition.
    pub fn lease(&self) -> Option<Lease> {
        self.current.borrow().clone()
    }

    /// Stops renewing and returns the lease held at that moment (still leased on the server).
    pub async fn stop(mut self) -> Option<Lease> {
        self.task.abort();
        let _ = (&mut self.task).await;
        self.lease()
    }

    /// Stops renewing and releases the lease held, returning its address.
    pub async fn release(self) -> Result<Option<Ipv4Addr>, DhcpError> {
        match self.stop().await {
            Some(lease) => {
                client::release(&lease).await?;
                Ok(Some(lease.ip))
            }
            None => Ok(None),
        }
    }
}

impl Drop for Maintainer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Step;
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use tokio::time::Instant;

    const IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 120);

    fn lease(ip: Ipv4Addr, secs: u32) -> Lease {
        let t = crate::timers::Timers::from_options(Some(secs), None, None, Duration::ZERO);
        Lease {
            iface: "eth1".into(),
            mac: [2, 0xaa, 0, 0, 0, 1],
            ip,
            server_id: Ipv4Addr::new(10, 77, 0, 1),
            lease_time: t.lease,
            t1: t.t1,
            t2: t.t2,
            obtained_at: Instant::now(),
            subnet_mask: None,
            router: None,
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Answer {
        Ack,
        Silent,
        Nak,
    }

    /// Answers scripted per call; records (call, seconds since start, requested address).
    struct Fake {
        start: Instant,
        renewals: Mutex<VecDeque<Answer>>,
        acquisitions: Mutex<VecDeque<Answer>>,
        calls: Mutex<Vec<(&'static str, u64, Option<Ipv4Addr>)>>,
    }

    impl Fake {
        fn new(renewals: &[Answer], acquisitions: &[Answer]) -> Fake {
            Fake {
                start: Instant::now(),
                renewals: Mutex::new(renewals.iter().copied().collect()),
                acquisitions: Mutex::new(acquisitions.iter().copied().collect()),
                calls: Mutex::new(Vec::new()),
            }
        }

        fn calls(&self) -> Vec<(&'static str, u64, Option<Ipv4Addr>)> {
            self.calls.lock().unwrap().clone()
        }

        fn answer(
            &self,
            call: &'static str,
            requested: Option<Ipv4Addr>,
            queue: &Mutex<VecDeque<Answer>>,
            new_ip: Ipv4Addr,
        ) -> impl Future<Output = Result<Lease, DhcpError>> + Send + use<> {
            let now = Instant::now();
            self.calls
                .lock()
                .unwrap()
                .push((call, (now - self.start).as_secs(), requested));
            let answer = queue.lock().unwrap().pop_front().unwrap_or(Answer::Silent);
            async move {
                match answer {
                    Answer::Ack => Ok(lease(new_ip, 100)),
                    Answer::Nak => Err(DhcpError::Nak {
                        iface: "eth1".into(),
                        mac: "02:aa:00:00:00:01".into(),
                        ip: new_ip,
                        server: Ipv4Addr::new(10, 77, 0, 1),
                        message: None,
                    }),
                    Answer::Silent => {
                        // a renewal's own retransmissions take a while
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        Err(DhcpError::NoAck {
                            iface: "eth1".into(),
                            mac: "02:aa:00:00:00:01".into(),
                            ip: new_ip,
                            step: Step::InitReboot,
                            attempts: 4,
                        })
                    }
                }
            }
        }
    }

    impl Transport for Fake {
        fn renew(
            &self,
            lease: &Lease,
            _opts: &DhcpOptions,
        ) -> impl Future<Output = Result<Lease, DhcpError>> + Send {
            self.answer("renew", Some(lease.ip), &self.renewals, lease.ip)
        }

        fn acquire(
            &self,
            _iface: &str,
            _mac: [u8; 6],
            requested: Option<Ipv4Addr>,
            _opts: &DhcpOptions,
        ) -> impl Future<Output = Result<Lease, DhcpError>> + Send {
            let ip = requested.unwrap_or(Ipv4Addr::new(10, 77, 0, 130));
            self.answer("acquire", requested, &self.acquisitions, ip)
        }
    }

    fn opts() -> DhcpOptions {
        DhcpOptions {
            min_renew_interval: Duration::from_secs(5),
            reacquire: crate::Backoff::new(Duration::from_secs(10), Duration::from_secs(60), 0),
            ..DhcpOptions::default()
        }
    }

    /// Runs the keeper for `secs` of (paused) time and returns the events with their times.
    async fn run(fake: &Fake, secs: u64) -> Vec<(u64, String)> {
        let start = fake.start;
        let mut events = Vec::new();
        let opts = opts();
        let keeper = maintain_with(fake, lease(IP, 100), &opts, |e| {
            let name = match &e {
                LeaseEvent::Renewed { rebinding, .. } => format!("renewed(rebinding={rebinding})"),
                LeaseEvent::RenewFailed { rebinding, .. } => {
                    format!("renew-failed(rebinding={rebinding})")
                }
                LeaseEvent::Lost { error, .. } => format!("lost(nak={})", error.is_some()),
                LeaseEvent::Reacquired(l) => format!("reacquired({})", l.ip),
                LeaseEvent::AcquireFailed { .. } => "acquire-failed".to_string(),
            };
            events.push(((Instant::now() - start).as_secs(), name));
        });
        let _ = tokio::time::timeout(Duration::from_secs(secs), keeper).await;
        events
    }

    #[tokio::test(start_paused = true)]
    async fn renews_at_t1_each_time() {
        let fake = Fake::new(&[Answer::Ack, Answer::Ack], &[]);
        let events = run(&fake, 120).await;
        assert_eq!(
            events,
            [
                (50, "renewed(rebinding=false)".to_string()),
                (100, "renewed(rebinding=false)".into())
            ]
        );
        assert_eq!(
            fake.calls(),
            [("renew", 50, Some(IP)), ("renew", 100, Some(IP))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failed_renewals_retry_then_rebind_after_t2() {
        // T1 50, T2 87.5, lease 100; a silent renewal takes 2 s.
        let s = Answer::Silent;
        let fake = Fake::new(&[s, s, s, s, Answer::Ack], &[]);
        let events = run(&fake, 95).await;
        let calls: Vec<u64> = fake.calls().iter().map(|c| c.1).collect();
        // 50 fails at 52 -> retry at 52 + (87.5 - 52) / 2 = 69.75, fails at 71.75 -> 79.6, fails
        // at 81.6 -> the 5 s floor: 86.6, fails after T2 at 88.6 -> rebinding: 88.6 + 5.7 = 94.3.
        assert_eq!(calls, [50, 69, 79, 86, 94]);
        let last = events.last().unwrap();
        assert_eq!(last.1, "renewed(rebinding=true)");
        assert!(
            events
                .iter()
                .filter(|e| e.1 == "renew-failed(rebinding=false)")
                .count()
                >= 3
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_is_reported_lost_and_reacquired_with_the_old_address() {
        let fake = Fake::new(&[], &[Answer::Silent, Answer::Ack]);
        let events = run(&fake, 150).await;
        let names: Vec<&str> = events.iter().map(|e| e.1.as_str()).collect();
        let lost = names
            .iter()
            .position(|n| *n == "lost(nak=false)")
            .expect("lost");
        assert_eq!(events[lost].0, 100, "lost exactly at the lease end");
        assert_eq!(names[lost + 1], "acquire-failed");
        assert_eq!(names[lost + 2], format!("reacquired({IP})"));
        // Failed acquisition at 102, backoff 10 s -> second try at 112.
        assert_eq!(events[lost + 2].0, 112);
        let acquires: Vec<_> = fake
            .calls()
            .into_iter()
            .filter(|c| c.0 == "acquire")
            .collect();
        assert_eq!(
            acquires,
            [("acquire", 100, Some(IP)), ("acquire", 112, Some(IP))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_nak_on_renewal_loses_the_address_at_once() {
        let fake = Fake::new(&[Answer::Nak], &[Answer::Ack]);
        let events = run(&fake, 60).await;
        assert_eq!(
            events,
            [
                (50, "lost(nak=true)".to_string()),
                (50, format!("reacquired({IP})"))
            ]
        );
    }
}
