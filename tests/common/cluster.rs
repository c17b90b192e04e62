//! A cluster of `latchkey serve` processes on loopback for the process tests: ports picked
//! free, one config file and data directory per member, kill -9 / SIGSTOP / restart, and
//! finding which member serves a key (the one that answers `Q` instead of `M`).

use super::server::{Conn, ServerProcess, TempDir};
use latchkey_client::protocol::{Request, Response};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One member: its addresses, files, and process while it runs.
pub struct Member {
    /// Its node id (1-based).
    pub id: u64,
    /// Where clients reach it.
    pub client: SocketAddr,
    /// Where peers reach it.
    pub peer: SocketAddr,
    /// Its config file.
    pub config: PathBuf,
    /// Its data directory.
    pub data: PathBuf,
    /// The running process, if any.
    pub process: Option<ServerProcess>,
    /// Its log (stderr), across restarts.
    pub log: Arc<Mutex<String>>,
}

/// A three-member (or `n`-member) cluster.
pub struct Cluster {
    /// The members, `members[i].id == i + 1`.
    pub members: Vec<Member>,
    /// With [`Cluster::start_with`] `linked`: the link each member reaches each other through.
    links: Vec<((usize, usize), Link)>,
    dir: TempDir,
}

/// What [`Cluster::start`] writes before `[cluster]`: one core per member.
pub const DEFAULT_SECTIONS: &str = "[server]\ncores = 1\n";

/// Runs `latchkey serve --config CONFIG ARGS...` that is expected to stop by itself (a refused
/// start) within 10 s; its exit code and stderr.
pub fn serve_to_exit(config: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = Command::new(crate::latchkey_bin())
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn latchkey");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("latchkey serve --config {} kept running", config.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    let pipe = child.stderr.as_mut().expect("stderr piped");
    pipe.read_to_string(&mut stderr).expect("read stderr");
    (status.code(), stderr)
}

/// Free loopback ports, kept bound by the listeners returned until the caller drops them:
/// anything else the caller binds to port 0 meanwhile (a [`Link`]) cannot be given one of
/// them. Once released, the kernel may hand one out again (a clash shows up as a start
/// failure naming the address).
fn reserve_ports(count: usize) -> (Vec<TcpListener>, Vec<u16>) {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let ports = (listeners.iter())
        .map(|l| l.local_addr().expect("addr").port())
        .collect();
    (listeners, ports)
}

/// Free loopback ports: bound, read and released (see [`reserve_ports`]).
fn free_ports(count: usize) -> Vec<u16> {
    reserve_ports(count).1
}

impl Cluster {
    /// Every member's client address, as a `--server` list (`a,b,c`).
    pub fn servers(&self) -> String {
        let list: Vec<String> = (self.members.iter())
            .map(|member| member.client.to_string())
            .collect();
        list.join(",")
    }

    /// Writes the configs of `n` members (`shards` shards, `fsync`) and starts them all.
    pub fn start(label: &str, n: usize, shards: u32, fsync: bool) -> Cluster {
        Cluster::start_with(label, n, shards, fsync, false)
    }

    /// As [`start`](Self::start), and with `linked` every member reaches every other one's
    /// peer address through a [`Link`] of its own (`links[(from, to)]`), so that a test can cut
    /// one member off its peers while clients still reach it.
    pub fn start_with(label: &str, n: usize, shards: u32, fsync: bool, linked: bool) -> Cluster {
        let mut cluster = Cluster::configure(label, n, shards, fsync, linked, DEFAULT_SECTIONS);
        cluster.launch_all();
        cluster
    }

    /// As [`start`](Self::start), with `sections` (TOML, `[server]` included: a member needs
    /// its cores) before each member's `[cluster]`.
    pub fn start_sections(label: &str, n: usize, shards: u32, sections: &str) -> Cluster {
        let mut cluster = Cluster::configure(label, n, shards, true, false, sections);
        cluster.launch_all();
        cluster
    }

    /// Starts every member.
    fn launch_all(&mut self) {
        for index in 0..self.members.len() {
            self.launch(index);
        }
    }

    /// As [`start_with`](Self::start_with) with `sections` before each `[cluster]`, but starts
    /// nothing: a test may edit a member's config file ([`Cluster::edit_config`]) before it
    /// [`launch`](Self::launch)es it.
    pub fn configure(
        label: &str,
        n: usize,
        shards: u32,
        fsync: bool,
        linked: bool,
        sections: &str,
    ) -> Cluster {
        let dir = TempDir::new(label);
        // Held while the links bind theirs (seen: a link given a member's port, and a config
        // refused for an address that appears twice).
        let (reserved, ports) = reserve_ports(2 * n);
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let mut links = Vec::new();
        if linked {
            for from in 0..n {
                for to in (0..n).filter(|&to| to != from) {
                    links.push(((from, to), Link::start(addr(ports[2 * to + 1]))));
                }
            }
        }
        drop(reserved);
        let peer_seen_by = |from: usize, to: usize| {
            links
                .iter()
                .find(|((f, t), _)| (*f, *t) == (from, to))
                .map_or(addr(ports[2 * to + 1]), |(_, link)| link.addr())
        };
        let members = (0..n)
            .map(|i| {
                let id = i as u64 + 1;
                let list: Vec<String> = (0..n)
                    .map(|j| {
                        let client = addr(ports[2 * j]);
                        let peer = peer_seen_by(i, j);
                        format!(
                            "  {{ id = {}, client = \"{client}\", peer = \"{peer}\" }},",
                            j + 1
                        )
                    })
                    .collect();
                let config = dir.path().join(format!("member-{id}.toml"));
                let data = dir.path().join(format!("data-{id}"));
                let text = format!(
                    "{sections}[cluster]\nnode_id = {id}\ndata_dir = {:?}\n\
                     shards = {shards}\nfsync = {fsync}\nmembers = [\n{}\n]\n",
                    data,
                    list.join("\n")
                );
                std::fs::write(&config, text).expect("write config");
                Member {
                    id,
                    client: addr(ports[2 * i]),
                    peer: addr(ports[2 * i + 1]),
                    config,
                    data,
                    process: None,
                    log: Arc::new(Mutex::new(String::new())),
                }
            })
            .collect();
        Cluster {
            members,
            links,
            dir,
        }
    }

    /// Rewrites member `index`'s config file with `edit` (takes effect at its next launch).
    pub fn edit_config(&self, index: usize, edit: impl FnOnce(String) -> String) {
        let path = &self.members[index].config;
        let text = std::fs::read_to_string(path).expect("read config");
        std::fs::write(path, edit(text)).expect("write config");
    }

    /// Cuts (or heals) every link between member `index` and the others, both ways.
    pub fn isolate(&self, index: usize, cut: bool) {
        for ((from, to), link) in &self.links {
            if *from == index || *to == index {
                if cut {
                    link.cut();
                } else {
                    link.heal();
                }
            }
        }
    }

    /// Starts member `index` (again).
    pub fn launch(&mut self, index: usize) {
        let member = &mut self.members[index];
        let mut command = Command::new(crate::latchkey_bin());
        command
            .arg("serve")
            .arg("--config")
            .arg(&member.config)
            .env("RUST_LOG", "info");
        let (process, log) = ServerProcess::spawn_collecting(command);
        assert_eq!(process.addr, member.client);
        let text = log.lock().unwrap().clone();
        member.log.lock().unwrap().push_str(&text);
        // Later lines go to the new log; keep both readable through `member.log`.
        member.log = log;
        member.process = Some(process);
    }

    /// Stops member `index` with SIGTERM and waits for its exit 0.
    pub fn stop(&mut self, index: usize) {
        if let Some(mut process) = self.members[index].process.take() {
            process.signal(libc::SIGTERM);
            let status = process.wait_timeout(Duration::from_secs(10));
            let status = status.expect("a member exits within 10 s of SIGTERM");
            assert!(status.success(), "member {} exited {status}", index + 1);
        }
    }

    /// Member `index`'s config file as text.
    pub fn config_text(&self, index: usize) -> String {
        std::fs::read_to_string(&self.members[index].config).expect("read config")
    }

    /// A file in the cluster's directory (for configs a test writes).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// kill -9 member `index`.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut process) = self.members[index].process.take() {
            process.signal(libc::SIGKILL);
            let _ = process.wait_timeout(Duration::from_secs(5));
        }
    }

    /// Sends `signal` to member `index` (SIGSTOP, SIGCONT).
    pub fn signal(&self, index: usize, signal: i32) {
        self.members[index]
            .process
            .as_ref()
            .expect("running")
            .signal(signal);
    }

    /// Whether member `index` runs.
    pub fn running(&self, index: usize) -> bool {
        self.members[index].process.is_some()
    }

    /// The member that serves `key` now: the first running one (not in `skip`) that answers
    /// a `Q` with a state, polled until `within`; with that state.
    pub fn serving(
        &self,
        key: &str,
        skip: &[usize],
        within: Duration,
    ) -> Option<(usize, Response)> {
        let until = Instant::now() + within;
        let mut nonce = 1;
        while Instant::now() < until {
            for (index, member) in self.members.iter().enumerate() {
                if skip.contains(&index) || member.process.is_none() {
                    continue;
                }
                nonce += 1;
                if let Some(state) = query(member.client, key, nonce) {
                    return Some((index, state));
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Sends the request `make` builds to the member that serves `key` and returns its answer
    /// (and the member's index), trying again while the answer is `M` (which means the request
    /// had no effect: leadership moved, by a failover or the balancer) for at most `within`.
    pub fn call(
        &self,
        key: &str,
        skip: &[usize],
        within: Duration,
        make: impl Fn() -> Request<'static>,
    ) -> (usize, Response) {
        let until = Instant::now() + within;
        loop {
            let (index, _) = self
                .serving(key, skip, until.saturating_duration_since(Instant::now()))
                .expect("a member serves the key");
            let mut conn = self.conn(index);
            conn.send(make());
            match conn.recv_within(Duration::from_secs(5)) {
                Some(Response::Moved { .. }) | None if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Some(answer) => return (index, answer),
                None => panic!("no answer from member {}", index + 1),
            }
        }
    }

    /// A connection to member `index`.
    pub fn conn(&self, index: usize) -> Conn {
        Conn::connect(self.members[index].client)
    }
}

/// `Q` on `addr`: the state if it serves the key, `None` on `M`, an error or no answer.
pub fn query(addr: SocketAddr, key: &str, nonce: u64) -> Option<Response> {
    let stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    let mut conn = Conn::over(stream);
    conn.send(Request::Query {
        nonce,
        key: key.as_bytes(),
    });
    match conn.recv_within(Duration::from_millis(500))? {
        state @ Response::State { .. } => Some(state),
        _ => None,
    }
}

/// A TCP forwarder on a link between two members that can be cut: `cut` closes its
/// connections and closes new ones at once until `heal`.
pub struct Link {
    addr: SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
    streams: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl Link {
    /// Listens on an ephemeral loopback port and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> Link {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (cut_flag, all) = (Arc::clone(&cut), Arc::clone(&streams));
        std::thread::spawn(move || {
            for incoming in listener.incoming() {
                let Ok(down) = incoming else { continue };
                if cut_flag.load(Ordering::Acquire) {
                    continue; // dropped: closed at once
                }
                let Ok(up) = std::net::TcpStream::connect(upstream) else {
                    continue;
                };
                let pairs = [
                    (down.try_clone(), up.try_clone()),
                    (up.try_clone(), down.try_clone()),
                ];
                for (from, to) in pairs {
                    if let (Ok(mut from), Ok(mut to)) = (from, to) {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                }
                let mut all = all.lock().unwrap();
                all.push(down);
                all.push(up);
            }
        });
        Link { addr, cut, streams }
    }

    /// Where the member connects.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection on the link and every new one, until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Release);
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Forwards new connections again.
    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// `GET path` on `addr`: the status and the body, `None` if it does not answer within 5 s.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let timeout = Duration::from_secs(5);
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.get(9..12)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// The value of the sample `series` (name and labels) in a `/metrics` text.
pub fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// A free loopback address (bound, read and released).
pub fn free_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_ports(1)[0]))
}
