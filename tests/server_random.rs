//! The whole server, randomized, over TCP: several client threads on raw connections against a
//! real two-core server, keys on both partitions, random acquires (wait 0 and > 0, sometimes
//! cancelled), releases (own and wrong tokens, sometimes from another session than the one
//! granted), extends, queries, and sessions killed in the middle of a frame.
//!
//! An observer checks from the answers alone, with the client's clock (the server's lease never
//! starts after its `A` was read, nor before the acquire was sent, less the length of one
//! server loop iteration, see [`CLOCK_SLACK`]):
//! * no two grants of a key are both certainly held at the same instant: a grant is certainly
//!   held from the moment its `A` was read until its release was sent (when `R` confirmed it)
//!   or until the earliest its lease could end (acquire sent + lease, or a confirmed extend
//!   sent + its lease);
//! * a grant read before another acquire of its key was sent has the smaller token, and no
//!   token is issued twice;
//! * nothing held is lost early: no `N` for a token whose lease cannot have run out yet;
//! * every acquire of a live session gets exactly one answer, and nothing else arrives;
//! * every `Q` is coherent (a free key has no waiters and no lease);
//! * once every client left and the leases ran out, `Q` of every key says free, no waiters.
//!
//! Small by default (a few seconds); `LATCHKEY_SOAK=1` runs more threads for a minute.

use common::server::{keys_on_partition, start, Conn};
use latchkey::rng::Rng;
use latchkey_client::protocol::{Request, Response};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

/// Every lease the clients ask for is one second; extends ask for one or two.
const LEASE_S: u8 = 1;
/// The server reads its clock once per loop iteration, before it reads the sockets, so the
/// instant it stamps on a grant or an extend may precede the client's send by up to one
/// iteration. Lease ends are counted from the send minus this (generous for a debug build).
const CLOCK_SLACK: Duration = Duration::from_millis(100);
const EXTEND_MAX_S: u8 = 2;

/// One grant as the client saw it.
#[derive(Clone, Debug)]
struct Grant {
    key: usize,
    token: u64,
    /// When the acquire was sent (the grant, hence the lease, is not earlier).
    sent: Instant,
    /// When its `A` was read (the grant is not later).
    read: Instant,
    /// The earliest the lease can end: acquire sent + lease, or after a confirmed extend, that
    /// extend sent + its lease (an extend replaces the lease, so it may also shorten it); both
    /// less [`CLOCK_SLACK`].
    lease_floor: Instant,
    /// When a confirmed release was sent.
    released: Option<Instant>,
    client: usize,
}

impl Grant {
    /// The end of the interval in which this grant is certainly held.
    fn certainly_until(&self) -> Instant {
        self.released.unwrap_or(self.lease_floor)
    }
}

struct Budget {
    clients: usize,
    keys_per_partition: usize,
    run_for: Duration,
}

/// One client thread: its connection, its grants, what it checks as it goes.
struct Client {
    index: usize,
    addr: SocketAddr,
    rng: Rng,
    conn: Conn,
    keys: Vec<String>,
    grants: Vec<Grant>,
    /// Indices into `grants` that may still be held.
    holding: Vec<usize>,
    next_id: u64,
    kills: usize,
}

impl Client {
    fn new(index: usize, addr: SocketAddr, keys: Vec<String>, seed: u64) -> Client {
        Client {
            index,
            addr,
            rng: Rng::new(seed),
            conn: Conn::connect(addr),
            keys,
            grants: Vec::new(),
            holding: Vec::new(),
            next_id: (index as u64 + 1) << 40,
            kills: 0,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn run(mut self, until: Instant) -> Client {
        while Instant::now() < until {
            // Holders mostly give their locks back soon, so that others get a turn; the rest
            // of the holds run out on their own.
            if !self.holding.is_empty() && self.rng.percent(40) {
                self.release();
                continue;
            }
            match self.rng.below(100) {
                0..=39 => self.acquire(),
                40..=59 => self.release(),
                60..=69 => self.extend(),
                70..=84 => self.query(),
                85..=89 => self.wrong_token(),
                _ if self.rng.percent(50) => self.kill_mid_frame(),
                _ => thread::sleep(Duration::from_millis(self.rng.below(20))),
            }
        }
        // Nothing stray is left on the session: the next answer is the Pong.
        self.conn.send(Request::Ping { nonce: 7 });
        assert_eq!(
            self.conn.recv(),
            Response::Pong { nonce: 7 },
            "a stray answer"
        );
        self
    }

    /// Reads the next answer, which must satisfy `fits` (nothing else is outstanding).
    fn answer(&mut self, what: &str, fits: impl Fn(&Response) -> bool) -> (Response, Instant) {
        let response = self.conn.recv();
        let read = Instant::now();
        assert!(
            fits(&response),
            "client {}: {what} answered {response:?}",
            self.index
        );
        (response, read)
    }

    fn acquire(&mut self) {
        let key = self.rng.below(self.keys.len() as u64) as usize;
        let wait_s = self.rng.pick(&[0, 0, 1, 2]);
        let owner = self.id();
        let sent = Instant::now();
        self.conn.send(Request::Acquire {
            wait_s,
            lease_s: LEASE_S,
            owner,
            key: self.keys[key].as_bytes(),
        });
        if wait_s > 0 && self.rng.percent(30) {
            // Give up early: exactly one answer still comes (the A/T/B, or the Cancel's T).
            thread::sleep(Duration::from_millis(self.rng.below(300)));
            self.conn.send(Request::Cancel {
                owner,
                key: self.keys[key].as_bytes(),
            });
        }
        let (response, read) = self.answer("acquire", |r| {
            matches!(*r, Response::Acquired { owner: o, .. } | Response::Timeout { owner: o }
                | Response::Busy { owner: o } if o == owner)
        });
        if let Response::Acquired { token, .. } = response {
            self.holding.push(self.grants.len());
            self.grants.push(Grant {
                key,
                token,
                sent,
                read,
                lease_floor: sent + Duration::from_secs(LEASE_S.into()) - CLOCK_SLACK,
                released: None,
                client: self.index,
            });
        }
    }

    fn pick_held(&mut self) -> Option<usize> {
        match self.holding.is_empty() {
            true => None,
            false => Some(self.rng.below(self.holding.len() as u64) as usize),
        }
    }

    fn release(&mut self) {
        let Some(slot) = self.pick_held() else {
            return;
        };
        let index = self.holding.swap_remove(slot);
        let (key, token) = (self.grants[index].key, self.grants[index].token);
        let sent = Instant::now();
        self.conn.send(Request::Release {
            token,
            key: self.keys[key].as_bytes(),
        });
        let (response, read) = self.answer("release", |r| {
            matches!(*r, Response::Released { token: t } | Response::NotHeld { token: t } if t == token)
        });
        match response {
            Response::Released { .. } => self.grants[index].released = Some(sent),
            _ => self.check_not_lost(index, read, "release"),
        }
    }

    fn extend(&mut self) {
        let Some(slot) = self.pick_held() else {
            return;
        };
        let index = self.holding[slot];
        let (key, token) = (self.grants[index].key, self.grants[index].token);
        let lease_s = self.rng.between(1, EXTEND_MAX_S.into()) as u8;
        let sent = Instant::now();
        self.conn.send(Request::Extend {
            lease_s,
            token,
            key: self.keys[key].as_bytes(),
        });
        let (response, read) = self.answer("extend", |r| {
            matches!(*r, Response::Extended { token: t } | Response::NotHeld { token: t } if t == token)
        });
        match response {
            Response::Extended { .. } => {
                // The server's new lease is (the instant it read the Extend) + lease_s.
                let lease = Duration::from_secs(lease_s.into());
                self.grants[index].lease_floor = sent + lease - CLOCK_SLACK;
            }
            _ => {
                self.holding.swap_remove(slot);
                self.check_not_lost(index, read, "extend");
            }
        }
    }

    /// An `N` read at `read` is wrong if the lease cannot have run out by then.
    fn check_not_lost(&self, index: usize, read: Instant, what: &str) {
        let grant = &self.grants[index];
        assert!(
            read >= grant.lease_floor,
            "client {}: {what} of token {} answered N {:?} before its lease could end",
            self.index,
            grant.token,
            grant.lease_floor - read
        );
    }

    fn query(&mut self) {
        let key = self.rng.below(self.keys.len() as u64) as usize;
        let nonce = self.id();
        self.conn.send(Request::Query {
            nonce,
            key: self.keys[key].as_bytes(),
        });
        let (response, _) = self.answer("query", |r| r.correlation_id() == nonce);
        let Response::State {
            held,
            lease_ms,
            waiters,
            ..
        } = response
        else {
            panic!("query answered {response:?}");
        };
        assert!(
            held || (waiters == 0 && lease_ms == 0),
            "incoherent {response:?}"
        );
        assert!(
            lease_ms <= u32::from(EXTEND_MAX_S) * 1000,
            "lease too long {response:?}"
        );
    }

    fn wrong_token(&mut self) {
        let key = self.rng.below(self.keys.len() as u64) as usize;
        // Real tokens start from the wall clock in microseconds × 1024: far above these.
        let token = self.rng.between(1, 1 << 40);
        self.conn.send(Request::Release {
            token,
            key: self.keys[key].as_bytes(),
        });
        self.answer("wrong release", |r| *r == Response::NotHeld { token });
    }

    /// Sometimes queues an acquire first, then writes part of a frame and drops the socket;
    /// the client goes on with a new session (and may release its grants from there).
    fn kill_mid_frame(&mut self) {
        if self.rng.percent(50) {
            let owner = self.id();
            let key = self.rng.below(self.keys.len() as u64) as usize;
            self.conn.send(Request::Acquire {
                wait_s: 2,
                lease_s: LEASE_S,
                owner,
                key: self.keys[key].as_bytes(),
            });
        }
        let mut frame = Vec::new();
        let key = self.keys[0].as_bytes();
        Request::Extend {
            lease_s: 1,
            token: 1,
            key,
        }
        .encode(&mut frame);
        let cut = self.rng.between(1, frame.len() as u64 - 1) as usize;
        self.conn.send_raw(&frame[..cut]);
        self.conn = Conn::connect(self.addr);
        self.kills += 1;
    }
}

/// Checks every pair of grants of a key, and that no token repeats.
fn observe(grants: &[Grant]) {
    let mut by_token = HashMap::new();
    for grant in grants {
        if let Some(other) = by_token.insert(grant.token, grant) {
            panic!("token issued twice: {other:?} and {grant:?}");
        }
    }
    let mut by_key: HashMap<usize, Vec<&Grant>> = HashMap::new();
    for grant in grants {
        by_key.entry(grant.key).or_default().push(grant);
    }
    for list in by_key.values_mut() {
        list.sort_by_key(|grant| grant.read);
        for (i, first) in list.iter().enumerate() {
            for second in &list[i + 1..] {
                // Sorted by `read`: `second` is certainly held from `second.read` on.
                assert!(
                    second.read >= first.certainly_until(),
                    "two holders at once: {first:?} and {second:?}"
                );
                if first.read <= second.sent {
                    assert!(
                        first.token < second.token,
                        "tokens out of order: {first:?} {second:?}"
                    );
                }
            }
        }
    }
}

fn run(budget: Budget) {
    let server = start(2);
    let addr = server.local_addr();
    let per = budget.keys_per_partition;
    let mut keys = keys_on_partition("random", 0, 2, per);
    keys.extend(keys_on_partition("random", 1, 2, per));
    let until = Instant::now() + budget.run_for;
    let handles: Vec<_> = (0..budget.clients)
        .map(|index| {
            let keys = keys.clone();
            thread::spawn(move || Client::new(index, addr, keys, 0x5eed + index as u64).run(until))
        })
        .collect();
    let clients: Vec<Client> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let grants: Vec<Grant> = clients
        .iter()
        .flat_map(|c| c.grants.iter().cloned())
        .collect();
    observe(&grants);
    let kills: usize = clients.iter().map(|c| c.kills).sum();
    let released = grants.iter().filter(|g| g.released.is_some()).count();
    let by_client = |index| grants.iter().filter(|g| g.client == index).count();
    assert!(
        (0..budget.clients).all(|index| by_client(index) > 0),
        "a client got nothing"
    );
    drop(clients);
    // Every lease runs out (the longest is an extend of EXTEND_MAX_S); then nothing is left.
    thread::sleep(Duration::from_secs(EXTEND_MAX_S.into()) + Duration::from_millis(300));
    let mut observer = Conn::connect(addr);
    for (nonce, key) in keys.iter().enumerate() {
        let state = observer.query(key, nonce as u64);
        let free = Response::State {
            nonce: nonce as u64,
            held: false,
            lease_ms: 0,
            waiters: 0,
        };
        assert_eq!(state, free, "key {key} not free after every client left");
    }
    assert!(!server.failed());
    eprintln!(
        "server_random: {} clients, {} keys, {:?}: {} grants ({released} released), \
         {kills} sessions killed mid-frame",
        budget.clients,
        keys.len(),
        budget.run_for,
        grants.len()
    );
}

#[test]
fn random_clients_never_share_a_lock() {
    let soak = std::env::var("LATCHKEY_SOAK").is_ok_and(|v| v == "1");
    run(match soak {
        true => Budget {
            clients: 8,
            keys_per_partition: 6,
            run_for: Duration::from_secs(60),
        },
        false => Budget {
            clients: 4,
            keys_per_partition: 3,
            run_for: Duration::from_secs(3),
        },
    });
}
