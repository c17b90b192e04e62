//! A fake cluster member: a listener on 127.0.0.1 whose connections parse requests with
//! [`parse_request`] and answer what a script says (an answer, silence, or a close), recording
//! every request it received. The client's handshake ping (the first frame of every session)
//! is not given to the script: the member answers it with its pong, or, when it plays a
//! paused process ([`FakeMember::pause_handshakes`]), ignores it; either way it is counted
//! ([`FakeMember::handshakes`]) and not recorded with the requests.
//!
//! A connection that opens with `GET ` is an admin request: `GET /cluster` is answered with
//! the member's card (by default a member of [`FAKE_CLUSTER`]; see [`FakeMember::set_card`]),
//! unless the member plays a paused process; anything else is answered 404.
//!
//! Bounds: each connection's buffer holds at most 64 KiB; every blocking read and accept
//! polls a stop flag every 20 ms, so dropping a member stops its threads promptly.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use latchkey_client::card::Card;
use latchkey_client::protocol::{parse_request, ErrorCode, Leader, Response, KEY_BYTES_MAX};

use super::Frame;

/// What a fake member does with one request.
#[derive(Clone, Copy, Debug)]
pub enum Reply {
    /// Writes this answer.
    Answer(Response),
    /// Writes nothing.
    Silent,
    /// Closes the connection without answering.
    Close,
}

/// A script: the reply to each request a member receives.
pub type Script = Arc<dyn Fn(&Frame) -> Reply + Send + Sync>;

/// A fake member; dropping it stops its threads.
pub struct FakeMember {
    addr: SocketAddr,
    received: Arc<Mutex<Vec<Frame>>>,
    script: Arc<Mutex<Script>>,
    stop: Arc<AtomicBool>,
    greeting: Arc<Greeting>,
}

/// The handshake pings of a member's sessions.
#[derive(Default)]
struct Greeting {
    /// Ignore them (a paused member).
    paused: AtomicBool,
    /// Handshake pings received.
    count: AtomicUsize,
    /// Answer a session's Identify (docs/protocol.md §5) instead of refusing it with `X` 9.
    identifies: AtomicBool,
    /// What `GET /cluster` answers: a card, or `None` for 404 (a server without cards).
    card: Mutex<Option<Card>>,
    /// `GET /cluster` requests received.
    cards_asked: AtomicUsize,
}

/// The cluster fake members say they belong to unless told otherwise.
pub const FAKE_CLUSTER: u64 = 0xfa4e_c105_7e20_0001;

/// The card of member `id` of [`FAKE_CLUSTER`], listing `clients` (their ports as ids).
pub fn card_listing(id: u16, clients: &[SocketAddr]) -> Card {
    Card::Member {
        cluster: FAKE_CLUSTER,
        member: u64::from(id),
        shards: 1,
        clients: clients
            .iter()
            .map(|addr| (u64::from(addr.port()), *addr))
            .collect(),
    }
}

const POLL: Duration = Duration::from_millis(20);
const BUFFER_MAX: usize = 64 * 1024;

impl FakeMember {
    /// A member answering every request with `script`.
    pub fn start(script: Script) -> FakeMember {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let member = FakeMember {
            addr,
            received: Arc::default(),
            script: Arc::new(Mutex::new(script)),
            stop: Arc::default(),
            greeting: Arc::default(),
        };
        member.set_card(Some(card_listing(addr.port(), &[addr])));
        let shared = Shared {
            received: Arc::clone(&member.received),
            script: Arc::clone(&member.script),
            stop: Arc::clone(&member.stop),
            greeting: Arc::clone(&member.greeting),
        };
        thread::spawn(move || accept_loop(listener, shared));
        member
    }

    /// From now on, handshake pings get no answer, as from a paused (SIGSTOP) process whose
    /// kernel still accepts connections.
    pub fn pause_handshakes(&self) {
        self.greeting.paused.store(true, Ordering::Relaxed);
    }

    /// From now on, a session's Identify is answered (with the grace asked for), as by a
    /// member that resumes calls; its Resolves go to the script like any request.
    pub fn identify_sessions(&self) {
        self.greeting.identifies.store(true, Ordering::Relaxed);
    }

    /// From now on, `GET /cluster` answers `card`, or 404 for `None`.
    pub fn set_card(&self, card: Option<Card>) {
        *self.greeting.card.lock().unwrap() = card;
    }

    /// `GET /cluster` requests received so far (answered or not).
    pub fn cards_asked(&self) -> usize {
        self.greeting.cards_asked.load(Ordering::Relaxed)
    }

    /// Handshake pings received so far (answered or not).
    pub fn handshakes(&self) -> usize {
        self.greeting.count.load(Ordering::Relaxed)
    }

    /// This member's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request received so far, in order.
    pub fn received(&self) -> Vec<Frame> {
        self.received.lock().unwrap().clone()
    }

    /// Replaces the script for the requests to come.
    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }
}

impl Drop for FakeMember {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Makes `members` one cluster's as their cards say: each card lists every one of them (so a
/// member whose card is never answered, a paused one, is vouched for by the others').
pub fn one_cluster(members: &[&FakeMember]) {
    let addrs: Vec<SocketAddr> = members.iter().map(|member| member.addr).collect();
    for member in members {
        member.set_card(Some(card_listing(member.addr.port(), &addrs)));
    }
}

/// What every connection of a member shares.
#[derive(Clone)]
struct Shared {
    received: Arc<Mutex<Vec<Frame>>>,
    script: Arc<Mutex<Script>>,
    stop: Arc<AtomicBool>,
    greeting: Arc<Greeting>,
}

fn accept_loop(listener: TcpListener, shared: Shared) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let shared = shared.clone();
                thread::spawn(move || serve(stream, shared));
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => thread::sleep(POLL),
            Err(_) => return,
        }
    }
}

/// Answers the admin request in `head` (whole), then closes; silent while paused.
fn answer_admin(mut stream: TcpStream, head: &[u8], shared: &Shared) {
    let greeting = &shared.greeting;
    let card = head.starts_with(b"GET /cluster ");
    if card {
        greeting.cards_asked.fetch_add(1, Ordering::Relaxed);
    }
    if greeting.paused.load(Ordering::Relaxed) {
        while !shared.stop.load(Ordering::Relaxed) {
            thread::sleep(POLL);
        }
        return;
    }
    let answer = match greeting.card.lock().unwrap().as_ref().filter(|_| card) {
        Some(card) => {
            let body = card.render();
            let length = body.len();
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n{body}"
            )
        }
        None => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into(),
    };
    let _ = stream.write_all(answer.as_bytes());
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve(mut stream: TcpStream, shared: Shared) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(POLL));
    let _ = stream.set_nodelay(true);
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut greeted = false;
    while !shared.stop.load(Ordering::Relaxed) && buffer.len() < BUFFER_MAX {
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => return,
        }
        if !greeted && buffer.starts_with(b"GET ") {
            if buffer.windows(4).any(|w| w == b"\r\n\r\n") {
                return answer_admin(stream, &buffer, &shared);
            }
            continue;
        }
        loop {
            let (frame, used) = match parse_request(&buffer, KEY_BYTES_MAX) {
                Ok(Some((request, used))) => (Frame::from_request(&request), used),
                Ok(None) => break,
                Err(_) => return,
            };
            buffer.drain(..used);
            let reply = match (greeted, &frame) {
                (false, &Frame::Identify { nonce, grace_s, .. })
                    if shared.greeting.identifies.load(Ordering::Relaxed) =>
                {
                    Reply::Answer(Response::Identified { nonce, grace_s })
                }
                // By default, a member that does not resume calls (docs/protocol.md §5).
                (false, &Frame::Identify { nonce, .. }) => Reply::Answer(Response::Error {
                    code: ErrorCode::NotIdentified,
                    id: nonce,
                }),
                (false, &Frame::Ping { nonce }) => {
                    greeted = true;
                    shared.greeting.count.fetch_add(1, Ordering::Relaxed);
                    match shared.greeting.paused.load(Ordering::Relaxed) {
                        true => Reply::Silent,
                        false => Reply::Answer(Response::Pong { nonce }),
                    }
                }
                _ => {
                    greeted = true;
                    shared.received.lock().unwrap().push(frame.clone());
                    (shared.script.lock().unwrap())(&frame)
                }
            };
            match reply {
                Reply::Answer(response) => {
                    let mut out = Vec::new();
                    response.encode(&mut out);
                    if stream.write_all(&out).is_err() {
                        return;
                    }
                }
                Reply::Silent => {}
                Reply::Close => {
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    }
}

/// The correlation id of a request (owner, token or nonce).
fn id_of(frame: &Frame) -> u64 {
    match *frame {
        Frame::Acquire { owner, .. }
        | Frame::Cancel { owner, .. }
        | Frame::Resolve { owner, .. } => owner,
        Frame::Release { token, .. } | Frame::Extend { token, .. } => token,
        Frame::Query { nonce, .. } | Frame::Ping { nonce } | Frame::Identify { nonce, .. } => nonce,
    }
}

/// `M` naming `leader` (or no leader) for `frame`.
pub fn moved(frame: &Frame, leader: Option<SocketAddr>) -> Reply {
    let leader = leader.map_or(Leader::UNKNOWN, Leader::at);
    Reply::Answer(Response::Moved {
        id: id_of(frame),
        leader,
    })
}

/// What a leader answers: a grant with `token`, releases, extends, a free key's state, pongs.
pub fn leader_reply(frame: &Frame, token: u64) -> Reply {
    let response = match *frame {
        Frame::Acquire { owner, .. } => Response::Acquired { owner, token },
        Frame::Release { token, .. } => Response::Released { token },
        Frame::Extend { token, .. } => Response::Extended { token },
        Frame::Query { nonce, .. } => Response::State {
            nonce,
            held: false,
            lease_ms: 0,
            waiters: 0,
        },
        Frame::Ping { nonce } => Response::Pong { nonce },
        Frame::Cancel { owner, .. } => Response::Timeout { owner },
        // A member of a cluster does not resume calls (docs/protocol.md §5).
        Frame::Identify { nonce: id, .. } | Frame::Resolve { owner: id, .. } => Response::Error {
            code: ErrorCode::NotIdentified,
            id,
        },
    };
    Reply::Answer(response)
}

/// A script that redirects every request to `leader` (or names none).
pub fn redirect_to(leader: Option<SocketAddr>) -> Script {
    Arc::new(move |frame| moved(frame, leader))
}

/// A script that leads: grants with `token` and answers everything else.
pub fn leading(token: u64) -> Script {
    Arc::new(move |frame| leader_reply(frame, token))
}
