//! The delivery gate and the mapping of §4.1, on a client whose only server is a bare socket.

use super::exchange::Backoff;
use super::*;
use crate::protocol::{parse_request, ErrorCode, Request, KEY_BYTES_MAX};
use std::io::Read;
use std::net::TcpListener;

fn client_and_server() -> (Client, TcpListener) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let config = ClientConfig {
        addrs: vec![listener.local_addr().unwrap()],
        sessions: 1,
        // A bare socket: the handshake is the ping alone.
        resume: None,
        ..ClientConfig::default()
    };
    (Client::with_config(config).unwrap(), listener)
}

fn answer(response: Response, read_at: Instant) -> Exchange {
    Exchange::Answer {
        response,
        sent_at: read_at,
        read_at,
    }
}

#[test]
fn a_grant_delivered_at_the_deadline_is_released_and_indeterminate() {
    let (client, listener) = client_and_server();
    let deadline = Instant::now();
    let read_at = deadline - Duration::from_millis(1);
    let exchange = answer(
        Response::Acquired {
            owner: 1,
            token: 42,
        },
        read_at,
    );
    let result = client.settle_acquire(exchange, Arc::from("gate"), 30, deadline, deadline);
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    let (mut socket, _) = listener.accept().unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The handshake ping first; nothing else goes out before its pong.
    let mut ping = [0u8; 10];
    socket.read_exact(&mut ping).unwrap();
    let Some((Request::Ping { nonce }, 10)) = parse_request(&ping, KEY_BYTES_MAX).unwrap() else {
        panic!("the session's first frame is its handshake ping: {ping:?}");
    };
    let mut pong = Vec::new();
    Response::Pong { nonce }.encode(&mut pong);
    std::io::Write::write_all(&mut socket, &pong).unwrap();
    let mut frame = [0u8; 14];
    socket.read_exact(&mut frame).unwrap();
    let (request, _) = parse_request(&frame, KEY_BYTES_MAX).unwrap().unwrap();
    assert_eq!(
        request,
        Request::Release {
            token: 42,
            key: b"gate"
        }
    );
}

#[test]
fn a_grant_delivered_before_the_deadline_is_a_ticket_bounded_from_its_read() {
    let (client, _listener) = client_and_server();
    let deadline = Instant::now() + Duration::from_secs(1);
    let read_at = deadline - Duration::from_millis(500);
    let exchange = answer(
        Response::Acquired {
            owner: 1,
            token: 43,
        },
        read_at,
    );
    let now = deadline - Duration::from_millis(1);
    let ticket = client
        .settle_acquire(exchange, Arc::from("gate"), 10, deadline, now)
        .unwrap();
    assert_eq!(ticket.token(), 43);
    assert_eq!(ticket.key(), "gate");
    assert_eq!(ticket.valid_until(), read_at + Duration::from_secs(9));
}

#[test]
fn the_other_results_map_as_protocol_section_4_1_says() {
    let (client, _listener) = client_and_server();
    let now = Instant::now();
    let deadline = now + Duration::from_secs(1);
    let cases = [
        (
            answer(Response::Timeout { owner: 1 }, now),
            AcquireError::Timeout,
        ),
        (answer(Response::Busy { owner: 1 }, now), AcquireError::Busy),
        (
            answer(
                Response::Error {
                    code: ErrorCode::KeyTooLong,
                    id: 1,
                },
                now,
            ),
            AcquireError::Rejected(ErrorCode::KeyTooLong),
        ),
        (Exchange::Unsent { serving: true }, AcquireError::Timeout),
        (
            Exchange::Unsent { serving: false },
            AcquireError::Unavailable,
        ),
        (Exchange::Indeterminate, AcquireError::Indeterminate),
    ];
    for (exchange, expected) in cases {
        let late = deadline + Duration::from_secs(1);
        let result = client.settle_acquire(exchange, Arc::from("k"), 1, deadline, late);
        assert_eq!(result.unwrap_err(), expected, "late T/B/X stay definitive");
    }
}

#[test]
fn arguments_are_refused_before_anything_is_sent() {
    let (client, _listener) = client_and_server();
    let second = Duration::from_secs(1);
    let cases = [
        ("", second, second, ArgumentError::KeyEmpty),
        ("a\nb", second, second, ArgumentError::KeyContainsNewline),
        (
            "k",
            Duration::from_millis(255_001),
            second,
            ArgumentError::WaitTooLong,
        ),
        ("k", second, Duration::ZERO, ArgumentError::LeaseZero),
        (
            "k",
            second,
            Duration::from_secs(256),
            ArgumentError::LeaseTooLong,
        ),
    ];
    for (key, wait, lease, expected) in cases {
        let error = client.acquire(key, wait, lease).unwrap_err();
        assert_eq!(error, AcquireError::InvalidArgument(expected));
    }
    let long = "k".repeat(KEY_BYTES_MAX + 1);
    assert_eq!(
        client.query(&long),
        Err(RequestError::InvalidArgument(ArgumentError::KeyTooLong))
    );
}

#[test]
fn client_and_ticket_are_shareable() {
    fn shareable<T: Send + Sync + Clone>() {}
    fn sendable<T: Send + Sync>() {}
    shareable::<Client>();
    sendable::<Ticket>();
}

#[test]
fn backoff_grows_to_250_ms_at_most_and_never_sleeps_past_the_deadline() {
    let mut backoff = Backoff::default();
    assert_eq!(backoff.next, Duration::ZERO, "the first retry is immediate");
    let deadline = Instant::now();
    for _ in 0..12 {
        let before = Instant::now();
        backoff.sleep(deadline);
        assert!(
            before.elapsed() < Duration::from_millis(100),
            "slept past the deadline"
        );
        assert!(backoff.next <= BACKOFF_MAX);
    }
    assert_eq!(backoff.next, BACKOFF_MAX);
}
