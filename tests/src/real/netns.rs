//! A DHCP server in a network namespace, for the DHCP client tests (root).
//!
//! Two namespaces joined by a veth pair: the server side (`10.77.0.1/24`) runs a real dnsmasq
//! (Debian `dnsmasq-base`) handing out `10.77.0.100`-`10.77.0.150` with 2-minute leases (dnsmasq's
//! minimum) into a lease file in a temp dir; the client side's interface is up with no address
//! (or, after [`DhcpNet::add_client_default_route`], `10.77.0.2/24` with the server as default
//! gateway: a node whose default route goes to the DHCP server's network).
//! Test code runs on the client side through [`DhcpNet::in_client`], or keeps running there
//! through [`DhcpNet::spawn_in_client`] (a cloud provider on that node), reaching the bed's API
//! servers through [`DhcpNet::forward_into_client`]. Names carry the pid and a
//! counter, so tests in parallel threads never meet; everything is removed on drop (dnsmasq
//! killed, both namespaces and with them the veth pair deleted), also when the test fails.

use std::fs::File;
use std::future::Future;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::BedError;
use crate::util::process::{Proc, tail};

/// Address of the server's interface.
pub const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// Address of the client's interface when it has one ([`DhcpNet::add_client_default_route`]).
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
/// The dynamic range dnsmasq leases from.
pub const RANGE: (Ipv4Addr, Ipv4Addr) =
    (Ipv4Addr::new(10, 77, 0, 100), Ipv4Addr::new(10, 77, 0, 150));
/// dnsmasq's lease time (its minimum).
pub const LEASE_SECS: u64 = 120;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// One line of dnsmasq's lease file: `<expiry-epoch> <mac> <ip> <hostname|*> <client-id>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLine {
    pub expiry: u64,
    pub mac: String,
    pub ip: Ipv4Addr,
    pub hostname: String,
    pub client_id: String,
}

pub struct DhcpNet {
    pub server_ns: String,
    pub client_ns: String,
    pub server_if: String,
    pub client_if: String,
    pub dir: tempfile::TempDir,
    pub lease_file: PathBuf,
    /// dnsmasq's own log (`--log-dhcp`): every DISCOVER/OFFER/REQUEST/ACK/NAK/RELEASE.
    pub dhcp_log: PathBuf,
    dnsmasq: Option<Proc>,
    namespaces: Vec<String>,
}

impl DhcpNet {
    /// Creates the namespaces and the veth pair and starts dnsmasq (waits until it serves).
    pub fn start() -> Result<DhcpNet, BedError> {
        Self::start_with(false)
    }

    /// As [`DhcpNet::start`], but the client end of the veth (`client_if`) is in this process's
    /// own network namespace, so code that also talks to the bed's API servers on loopback (the
    /// cloud provider) can lease on it. Deleting the server namespace removes the pair.
    pub fn start_host_client() -> Result<DhcpNet, BedError> {
        Self::start_with(true)
    }

    fn start_with(host_client: bool) -> Result<DhcpNet, BedError> {
        let pid = std::process::id();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = tempfile::Builder::new()
            .prefix("dhcp-netns-")
            .tempdir()
            .map_err(|e| BedError::Setup(format!("temp dir: {e}")))?;
        let mut net = DhcpNet {
            server_ns: format!("hdhcp-{pid}-{n}-srv"),
            client_ns: format!("hdhcp-{pid}-{n}-cli"),
            // IFNAMSIZ: at most 15 characters ("d" + pid in hex (<= 6) + "s" + counter in hex).
            server_if: format!("d{pid:x}s{n:x}"),
            client_if: format!("d{pid:x}c{n:x}"),
            lease_file: dir.path().join("leases"),
            dhcp_log: dir.path().join("dnsmasq-dhcp.log"),
            dir,
            dnsmasq: None,
            namespaces: Vec::new(),
        };
        // From here on, Drop cleans up whatever was made.
        let mut namespaces = vec![net.server_ns.clone()];
        if !host_client {
            namespaces.push(net.client_ns.clone());
        }
        for ns in namespaces {
            run("ip", &["netns", "add", &ns])?;
            net.namespaces.push(ns);
        }
        // The peer goes to the client namespace, or to ours (named by our pid).
        let peer_ns = if host_client {
            std::process::id().to_string()
        } else {
            net.client_ns.clone()
        };
        // Both ends are created inside the namespaces: nothing touches the host's network.
        run(
            "ip",
            &[
                "-n",
                &net.server_ns,
                "link",
                "add",
                &net.server_if,
                "type",
                "veth",
                "peer",
                "name",
                &net.client_if,
                "netns",
                &peer_ns,
            ],
        )?;
        run(
            "ip",
            &[
                "-n",
                &net.server_ns,
                "addr",
                "add",
                &format!("{SERVER_IP}/24"),
                "dev",
                &net.server_if,
            ],
        )?;
        run(
            "ip",
            &["-n", &net.server_ns, "link", "set", &net.server_if, "up"],
        )?;
        if host_client {
            run("ip", &["link", "set", &net.client_if, "up"])?;
        } else {
            run(
                "ip",
                &["-n", &net.client_ns, "link", "set", &net.client_if, "up"],
            )?;
            run("ip", &["-n", &net.client_ns, "link", "set", "lo", "up"])?;
        }
        std::fs::write(&net.lease_file, "")
            .map_err(|e| BedError::Setup(format!("creating the lease file: {e}")))?;
        net.start_server()?;
        Ok(net)
    }

    /// Starts dnsmasq (again, after [`DhcpNet::stop_server`]: it reads its lease file back) and
    /// waits until it logs its DHCP range.
    pub fn start_server(&mut self) -> Result<(), BedError> {
        self.stop_server();
        let _ = std::fs::remove_file(&self.dhcp_log);
        let d = self.dir.path();
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.server_ns,
            "dnsmasq",
            "--keep-in-foreground",
        ])
        .arg("--conf-file=/dev/null")
        .arg("--port=0")
        .arg(format!("--interface={}", self.server_if))
        .arg("--bind-interfaces")
        .arg("--except-interface=lo")
        .arg(format!(
            "--dhcp-range={},{},255.255.255.0,{}s",
            RANGE.0, RANGE.1, LEASE_SECS
        ))
        .arg(format!("--dhcp-leasefile={}", self.lease_file.display()))
        .arg("--dhcp-authoritative")
        .arg("--no-ping")
        .arg("--log-dhcp")
        .arg(format!("--log-facility={}", self.dhcp_log.display()))
        .arg(format!("--pid-file={}", d.join("dnsmasq.pid").display()))
        .arg("--user=root");
        let mut proc = Proc::spawn("dnsmasq", cmd, d)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            proc.check_alive()?;
            if self.dhcp_log_text().contains("DHCP, IP range") {
                break;
            }
            if Instant::now() >= deadline {
                return Err(BedError::Timeout {
                    component: "dnsmasq".into(),
                    log: self.dhcp_log.clone(),
                    what: format!("its DHCP range; stderr: {}", tail(&proc.log, 10)),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.dnsmasq = Some(proc);
        Ok(())
    }

    /// Kills dnsmasq (the lease file stays).
    pub fn stop_server(&mut self) {
        if let Some(mut p) = self.dnsmasq.take() {
            p.stop();
        }
    }

    /// The client interface's own MAC.
    pub fn client_if_mac(&self) -> Result<String, BedError> {
        let out = output(
            "ip",
            &["-n", &self.client_ns, "-o", "link", "show", &self.client_if],
        )?;
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .map(str::to_string)
            .ok_or_else(|| BedError::Setup(format!("no link/ether in {out:?}")))
    }

    /// The lease file's entries now.
    pub fn leases(&self) -> Vec<LeaseLine> {
        let text = std::fs::read_to_string(&self.lease_file).unwrap_or_default();
        text.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                Some(LeaseLine {
                    expiry: f.first()?.parse().ok()?,
                    mac: f.get(1)?.to_string(),
                    ip: f.get(2)?.parse().ok()?,
                    hostname: f.get(3)?.to_string(),
                    client_id: f.get(4).map(|s| s.to_string()).unwrap_or_default(),
                })
            })
            .collect()
    }

    /// Polls the lease file every 50 ms until `pred` holds, for at most `limit`; on timeout the
    /// error shows the last entries and the tail of dnsmasq's log.
    pub fn wait_leases(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&[LeaseLine]) -> bool,
    ) -> Result<Vec<LeaseLine>, String> {
        let deadline = Instant::now() + limit;
        loop {
            let leases = self.leases();
            if pred(&leases) {
                return Ok(leases);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "timed out after {limit:?} waiting for {what}; lease file: {leases:?}\n\
                     dnsmasq log:\n{}",
                    tail(&self.dhcp_log, 20)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// dnsmasq's DHCP log so far.
    pub fn dhcp_log_text(&self) -> String {
        std::fs::read_to_string(&self.dhcp_log).unwrap_or_default()
    }

    /// Gives the client interface `CLIENT_IP/24` and makes the server's address the client
    /// namespace's default gateway: the client namespace then looks like a node whose default
    /// route goes out through the interface the DHCP server serves.
    pub fn add_client_default_route(&self) -> Result<(), BedError> {
        let ns = &self.client_ns;
        run(
            "ip",
            &[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{CLIENT_IP}/24"),
                "dev",
                &self.client_if,
            ],
        )?;
        run(
            "ip",
            &[
                "-n",
                ns,
                "route",
                "add",
                "default",
                "via",
                &SERVER_IP.to_string(),
                "dev",
                &self.client_if,
            ],
        )
    }

    /// Makes `127.0.0.1:<port>` of this process's namespace (where the bed's API servers
    /// listen) reachable at the same address inside the client namespace: a listener opened
    /// there, each connection spliced to the host side. Runs on the caller's tokio runtime (a
    /// thread of this namespace, so the outgoing sockets are opened here) until dropped.
    pub fn forward_into_client(&self, port: u16) -> Result<Forward, BedError> {
        let addr = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let listener = self.in_client_blocking(|| std::net::TcpListener::bind(addr))?;
        let listener = listener
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(|e| {
                BedError::Setup(format!("listening on {addr} in {}: {e}", self.client_ns))
            })?;
        Ok(Forward(tokio::spawn(crate::real::podnet::splice(
            listener, addr,
        ))))
    }

    /// Runs `work` in a thread that has entered the client namespace and waits for it.
    fn in_client_blocking<T: Send>(&self, work: impl FnOnce() -> T + Send) -> Result<T, BedError> {
        let path = self.client_ns_path();
        std::thread::scope(|s| {
            let worker = s.spawn(move || -> Result<T, BedError> {
                enter_netns(&path)?;
                Ok(work())
            });
            match worker.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// As [`DhcpNet::in_client`], without waiting: the future runs in its own thread (on a fresh
    /// current-thread runtime inside the client namespace, with every task it spawns) until it
    /// completes; join the handle for its output. A program of the client namespace that keeps
    /// running while the test goes on (a cloud provider on that node).
    pub fn spawn_in_client<T, F, Fut>(
        &self,
        make: F,
    ) -> std::thread::JoinHandle<Result<T, BedError>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T>,
        T: Send + 'static,
    {
        let path = self.client_ns_path();
        std::thread::spawn(move || -> Result<T, BedError> {
            enter_netns(&path)?;
            block_on_fresh(make)
        })
    }

    fn client_ns_path(&self) -> String {
        format!("/run/netns/{}", self.client_ns)
    }

    /// Runs `make()`'s future to completion on a fresh current-thread tokio runtime, in a thread
    /// that has entered the client namespace: every socket it (and any task it spawns) opens is in
    /// that namespace. Each call is like a fresh process of the client ("a restarted CCM"). A
    /// panic inside is re-raised here.
    pub fn in_client<T, F, Fut>(&self, make: F) -> Result<T, BedError>
    where
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = T>,
        T: Send,
    {
        self.in_client_blocking(|| block_on_fresh(make))?
    }
}

/// `make()`'s future run to completion on a fresh current-thread tokio runtime, in the calling
/// thread (and so in its network namespace).
fn block_on_fresh<T, Fut: Future<Output = T>>(make: impl FnOnce() -> Fut) -> Result<T, BedError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| BedError::Setup(format!("tokio runtime: {e}")))?;
    Ok(rt.block_on(make()))
}

impl Drop for DhcpNet {
    fn drop(&mut self) {
        self.stop_server();
        // Deleting a namespace destroys the veth end in it, and so the pair.
        for ns in self.namespaces.drain(..).rev() {
            if let Err(e) = run("ip", &["netns", "del", &ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

/// A splice made by [`DhcpNet::forward_into_client`]; dropping it stops it and its connections.
pub struct Forward(tokio::task::JoinHandle<()>);

impl Drop for Forward {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Moves the calling thread into the network namespace at `path` (sockets it opens from then on
/// are in that namespace, and so are threads it starts).
fn enter_netns(path: &str) -> Result<(), BedError> {
    let ns = File::open(path).map_err(|e| BedError::Setup(format!("opening {path}: {e}")))?;
    rustix::thread::move_into_link_name_space(
        ns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .map_err(|e| BedError::Setup(format!("setns({path}): {e}")))
}

fn output(program: &str, args: &[&str]) -> Result<String, BedError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| BedError::Setup(format!("running {program} {}: {e}", args.join(" "))))?;
    if !out.status.success() {
        return Err(BedError::Setup(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `PROGRAM ARGS`, its stderr in the error.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), BedError> {
    output(program, args).map(|_| ())
}
