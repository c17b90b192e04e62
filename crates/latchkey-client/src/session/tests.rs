//! A real session thread against a bare socket: when an `X` that closes the session reaches a
//! caller, the session is already retired.

use super::super::call::Op;
use super::*;
use crate::protocol::{parse_request, ErrorCode, Response, KEY_BYTES_MAX};
use crossbeam_channel::Receiver;
use std::net::{TcpListener, TcpStream};

const PATIENCE: Duration = Duration::from_secs(10);
const ROUNDS: usize = 50;

fn config() -> SessionConfig {
    SessionConfig {
        connect_timeout: Duration::from_secs(2),
        transport_timeout: Duration::from_secs(5),
        inbox_calls_max: 16,
        tls: None,
        identity: None,
        resumes: Default::default(),
        interrupted: Default::default(),
    }
}

fn spawn(listener: &TcpListener) -> Session {
    let addr = listener.local_addr().unwrap();
    Session::spawn(1, addr, config(), Box::new(|_| {}), FailureLog::default()).unwrap()
}

fn call(op: Op) -> (Call, Receiver<Outcome>) {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let call = Call {
        op,
        deadline: Instant::now() + Duration::from_secs(5),
        reply: Some(tx),
        attempts: 0,
    };
    (call, rx)
}

fn acquire(owner: u64) -> Op {
    Op::Acquire {
        key: Arc::from("123456789"),
        wait_zero: false,
        lease_s: 1,
        owner,
    }
}

/// The server side of one connection: reads whole frames, writes answers.
struct Peer {
    stream: TcpStream,
    input: Vec<u8>,
}

impl Peer {
    /// Accepts the session's connection and answers its handshake ping, its first frame.
    fn accept(listener: &TcpListener) -> Peer {
        let mut peer = Peer::accept_silent(listener);
        let nonce = peer.next_id().expect("the handshake ping");
        peer.send(Response::Pong { nonce });
        peer
    }

    /// Accepts the session's connection and answers nothing.
    fn accept_silent(listener: &TcpListener) -> Peer {
        let (stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        Peer {
            stream,
            input: Vec::new(),
        }
    }

    /// The next request frame (its correlation id), or `None` at end of input.
    fn next_id(&mut self) -> Option<u64> {
        loop {
            if let Some((request, used)) = parse_request(&self.input, KEY_BYTES_MAX).unwrap() {
                let id = request.correlation_id();
                self.input.drain(..used);
                return Some(id);
            }
            let mut chunk = [0u8; 256];
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(read) => self.input.extend_from_slice(&chunk[..read]),
                Err(error) if error.kind() == io::ErrorKind::ConnectionReset => return None,
                Err(error) => panic!("the session neither wrote nor closed: {error}"),
            }
        }
    }

    fn send(&mut self, response: Response) {
        let mut bytes = Vec::new();
        response.encode(&mut bytes);
        self.stream.write_all(&bytes).unwrap();
    }
}

/// The server keeps the connection open after the `X`: only the client's own handling of the
/// code can retire the session, and it must have done so when the caller hears `Rejected`.
#[test]
fn a_correlated_closing_error_retires_the_session_before_the_caller_hears_it() {
    for round in 0..ROUNDS {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let session = spawn(&listener);
        let mut peer = Peer::accept(&listener);
        let owner = 0x1000 + round as u64;
        let (first, rx) = call(acquire(owner));
        session.submit(first).unwrap();
        assert_eq!(peer.next_id(), Some(owner));
        let rejection = Response::Error {
            code: ErrorCode::KeyTooLong,
            id: owner,
        };
        peer.send(rejection);
        match rx.recv_timeout(PATIENCE) {
            Ok(Outcome::Answer { response, .. }) => assert_eq!(response, rejection),
            other => panic!("round {round}: expected the X, got {other:?}"),
        }
        assert!(
            session.is_failed(),
            "round {round}: retired before the reply"
        );
        let (second, _rx) = call(acquire(owner + 1));
        assert!(
            session.submit(second).is_err(),
            "round {round}: a retired session takes no new call"
        );
        assert_eq!(
            peer.next_id(),
            None,
            "round {round}: nothing more was written, and the client closed the session"
        );
    }
}

#[test]
fn an_uncorrelated_closing_error_retires_the_session_before_any_call_hears_back() {
    for round in 0..ROUNDS {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let session = spawn(&listener);
        let mut peer = Peer::accept(&listener);
        let nonce = 0x2000 + round as u64;
        let (ping, rx) = call(Op::Ping { nonce });
        session.submit(ping).unwrap();
        assert_eq!(peer.next_id(), Some(nonce));
        peer.send(Response::Error {
            code: ErrorCode::UnknownOp,
            id: 0,
        });
        assert_eq!(
            rx.recv_timeout(PATIENCE),
            Ok(Outcome::Indeterminate),
            "round {round}: the ping was sent and never answered"
        );
        assert!(
            session.is_failed(),
            "round {round}: retired before the reply"
        );
        let (again, _rx) = call(Op::Ping { nonce: nonce + 1 });
        assert!(session.submit(again).is_err(), "round {round}");
        assert_eq!(peer.next_id(), None, "round {round}");
    }
}

fn spawn_with(listener: &TcpListener, config: SessionConfig, failures: FailureLog) -> Session {
    let addr = listener.local_addr().unwrap();
    Session::spawn(1, addr, config, Box::new(|_| {}), failures).unwrap()
}

/// Waits (bounded) until `condition` holds.
fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + PATIENCE;
    while Instant::now() < until {
        if condition() {
            return true;
        }
        thread::sleep(Duration::from_millis(5));
    }
    false
}

/// A server that accepts (the kernel does, from the backlog) but never answers: only the
/// handshake ping reaches it, and at the connect timeout every call is definitely unsent.
#[test]
fn a_server_that_never_answers_the_handshake_ping_gets_nothing_else() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let connect_timeout = Duration::from_millis(300);
    let failures = FailureLog::default();
    let config = SessionConfig {
        connect_timeout,
        ..config()
    };
    let start = Instant::now();
    let session = spawn_with(&listener, config, Arc::clone(&failures));
    let (first, rx) = call(acquire(0x3000));
    session.submit(first).unwrap();
    let mut peer = Peer::accept_silent(&listener);
    assert!(peer.next_id().is_some(), "the handshake ping");
    assert_eq!(
        rx.recv_timeout(PATIENCE),
        Ok(Outcome::NotSent),
        "nothing was sent: another session may take it"
    );
    assert!(
        start.elapsed() >= connect_timeout,
        "never before the connect timeout"
    );
    assert!(session.is_failed());
    assert_eq!(
        peer.next_id(),
        None,
        "the ping was all it got, then the close"
    );
    let failure = failures.lock().latest().cloned().expect("recorded");
    assert_eq!(failure.cause(), CloseReason::HandshakeTimeout.to_string());
    assert!(!failure.connected());
}

/// An established session whose answer is overdue stops taking calls, and takes them again
/// once it reads.
#[test]
fn an_overdue_answer_stalls_the_session_until_it_reads() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let silence = Duration::from_millis(300);
    let config = SessionConfig {
        connect_timeout: silence,
        ..config()
    };
    let session = spawn_with(&listener, config, FailureLog::default());
    let mut peer = Peer::accept(&listener);
    let nonce = 0x4000;
    let (query, rx) = call(Op::Query {
        key: Arc::from("k"),
        nonce,
    });
    let sent_at = Instant::now();
    session.submit(query).unwrap();
    assert_eq!(peer.next_id(), Some(nonce));
    assert!(eventually(|| session.is_stalled()), "stalls");
    assert!(sent_at.elapsed() >= silence, "never early");
    let (refused, _rx) = call(Op::Ping { nonce: nonce + 1 });
    assert!(
        session.submit(refused).is_err(),
        "a stalled session takes no call"
    );
    peer.send(Response::State {
        nonce,
        held: false,
        lease_ms: 0,
        waiters: 0,
    });
    assert!(matches!(
        rx.recv_timeout(PATIENCE),
        Ok(Outcome::Answer { .. })
    ));
    assert!(
        eventually(|| !session.is_stalled()),
        "reading ends the stall"
    );
    let (ping, rx_ping) = call(Op::Ping { nonce: nonce + 2 });
    session.submit(ping).unwrap();
    assert_eq!(peer.next_id(), Some(nonce + 2));
    peer.send(Response::Pong { nonce: nonce + 2 });
    assert!(matches!(
        rx_ping.recv_timeout(PATIENCE),
        Ok(Outcome::Answer { .. })
    ));
    assert!(!session.is_failed());
}
