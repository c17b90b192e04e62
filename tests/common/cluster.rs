//! A cluster of `latchkey serve` processes on loopback for the process tests: ports picked
//! free, one config file and data directory per member, kill -9 / SIGSTOP / restart, and
//! finding which member serves a key (the one that answers `Q` instead of `M`).

#![allow(dead_code)]

use super::server::{Conn, ServerProcess, TempDir};
use latchkey::protocol::{Request, Response};
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
    /// The running process, if any.
    pub process: Option<ServerProcess>,
    /// Its log (stderr), across restarts.
    pub log: Arc<Mutex<String>>,
}

/// A three-member (or `n`-member) cluster.
pub struct Cluster {
    /// The members, `members[i].id == i + 1`.
    pub members: Vec<Member>,
    dir: TempDir,
}

/// Free loopback ports: bound, read and released (the kernel does not hand them out again at
/// once; a clash shows up as a start failure naming the address).
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

impl Cluster {
    /// Writes the configs of `n` members (`shards` shards, `fsync`) and starts them all.
    pub fn start(label: &str, n: usize, shards: u32, fsync: bool) -> Cluster {
        let dir = TempDir::new(label);
        let ports = free_ports(2 * n);
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let list: Vec<String> = (0..n)
            .map(|i| {
                format!(
                    "  {{ id = {}, client = \"{}\", peer = \"{}\" }},",
                    i + 1,
                    addr(ports[2 * i]),
                    addr(ports[2 * i + 1])
                )
            })
            .collect();
        let members = (0..n)
            .map(|i| {
                let id = i as u64 + 1;
                let config = dir.path().join(format!("member-{id}.toml"));
                let data = dir.path().join(format!("data-{id}"));
                let text = format!(
                    "[server]\ncores = 1\n[cluster]\nnode_id = {id}\ndata_dir = {:?}\n\
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
                    process: None,
                    log: Arc::new(Mutex::new(String::new())),
                }
            })
            .collect();
        let mut cluster = Cluster { members, dir };
        for index in 0..n {
            cluster.launch(index);
        }
        cluster
    }

    /// Starts member `index` (again).
    pub fn launch(&mut self, index: usize) {
        let member = &mut self.members[index];
        let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
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
