//! docs/protocol.md §2 and §2.3 against the real server: every error code with its correlation id
//! and its continue/close behaviour, the lowest code of a frame with several faults, refused
//! requests changing nothing, fixed headers full of `0x0A`, frames split at every byte offset,
//! and half-close after pipelined frames.

use common::server::{
    encode_all, fresh_id, keys_on_partition, start, start_with, test_config, Conn, Expect,
    KeyState, Script,
};
use latchkey::partition::partition_of;
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{ErrorCode, Request, Response};
use std::thread;
use std::time::Duration;

const CORES: usize = 2;
/// The key limit of the servers that test code 2 at a small size.
const SMALL_KEY_BYTES: usize = 16;
/// Owner, token and nonce made only of newline bytes.
const NEWLINES: u64 = 0x0A0A_0A0A_0A0A_0A0A;

fn keys(prefix: &str) -> Vec<String> {
    (0..CORES)
        .map(|partition| keys_on_partition(prefix, partition, CORES, 1).remove(0))
        .collect()
}

/// A key of exactly `len` bytes on `partition`.
fn key_of_len(len: usize, partition: usize) -> String {
    (0u32..)
        .map(|i| {
            let mut key = format!("k{i}-");
            key.extend(std::iter::repeat('x').take(len - key.len()));
            key
        })
        .find(|key| partition_of(key.as_bytes(), CORES) == partition)
        .unwrap()
}

fn small_key_server() -> ServerHandle {
    let mut config = test_config(CORES);
    config.limits.max_key_bytes = SMALL_KEY_BYTES;
    start_with(config)
}

fn error(code: ErrorCode, id: u64) -> Response {
    Response::Error { code, id }
}

/// Every keyed request kind naming `key`, each with the correlation id `id` (and a non-zero
/// lease, so only the key can be at fault).
fn keyed_requests(key: &[u8], id: u64) -> [Request<'_>; 5] {
    [
        Request::Acquire {
            wait_s: 5,
            lease_s: 5,
            owner: id,
            key,
        },
        Request::Release { token: id, key },
        Request::Extend {
            lease_s: 5,
            token: id,
            key,
        },
        Request::Cancel { owner: id, key },
        Request::Query { nonce: id, key },
    ]
}

/// Sends `bytes` on a fresh session and returns everything it got before the server closed it.
fn answers_until_closed(server: &ServerHandle, bytes: &[u8]) -> Vec<Response> {
    let mut conn = Conn::connect(server.local_addr());
    conn.send_raw(bytes);
    conn.recv_until_closed()
}

#[test]
fn unknown_op_is_code_1_with_id_0_and_closes_after_answering_what_came_before() {
    let server = start(CORES);
    let keys = keys("unknown-op");
    let mut bytes = encode_all(&[
        Request::Ping { nonce: 1 },
        Request::Query {
            nonce: 2,
            key: keys[0].as_bytes(),
        },
        Request::Query {
            nonce: 3,
            key: keys[1].as_bytes(),
        },
    ]);
    bytes.extend_from_slice(b"Z\x00\x00\x00\x00\x00\x00\x00\x07k\n");
    // Whatever follows is not a frame any more: this Acquire is never executed.
    bytes.extend(encode_all(&[Request::Acquire {
        wait_s: 0,
        lease_s: 5,
        owner: 4,
        key: keys[0].as_bytes(),
    }]));
    let mut answers = answers_until_closed(&server, &bytes);
    // Answers to different keys (and Pings) may come in any order.
    answers.sort_by_key(Response::correlation_id);
    let free = |nonce| Response::State {
        nonce,
        held: false,
        lease_ms: 0,
        waiters: 0,
    };
    assert_eq!(
        answers,
        [
            error(ErrorCode::UnknownOp, 0),
            Response::Pong { nonce: 1 },
            free(2),
            free(3)
        ]
    );
    assert_eq!(
        Conn::connect(server.local_addr()).state(&keys[0]),
        KeyState::FREE
    );
}

#[test]
fn a_key_of_exactly_the_limit_is_valid_and_one_byte_more_is_code_2_and_closes() {
    let server = small_key_server();
    for partition in 0..CORES {
        let key = key_of_len(SMALL_KEY_BYTES, partition);
        let mut conn = Conn::connect(server.local_addr());
        let token = conn.acquire_ok(&key, 5, fresh_id());
        assert!(conn.state(&key).held);
        assert_eq!(conn.release(&key, token), Response::Released { token });
        let long = key_of_len(SMALL_KEY_BYTES + 1, partition);
        for request in keyed_requests(long.as_bytes(), fresh_id()) {
            let answers = answers_until_closed(&server, &encode_all(&[request]));
            let id = request.correlation_id();
            assert_eq!(answers, [error(ErrorCode::KeyTooLong, id)], "{request:?}");
        }
        // The long key was never locked.
        assert_eq!(conn.state(&long[..SMALL_KEY_BYTES]), KeyState::FREE);
    }
}

#[test]
fn code_2_comes_as_soon_as_limit_plus_one_bytes_arrive_without_a_newline() {
    let server = small_key_server();
    let owner = fresh_id();
    let mut frame = encode_all(&[Request::Acquire {
        wait_s: 0,
        lease_s: 5,
        owner,
        key: &[b'x'; SMALL_KEY_BYTES],
    }]);
    frame.pop(); // no `\n`: the frame is merely incomplete so far
    let mut conn = Conn::connect(server.local_addr());
    conn.send_raw(&frame);
    conn.expect_silence(Duration::from_millis(200));
    conn.send_raw(b"x");
    assert_eq!(
        conn.recv_until_closed(),
        [error(ErrorCode::KeyTooLong, owner)]
    );
}

#[test]
fn the_default_limit_is_1024_bytes() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    for partition in 0..CORES {
        let key = key_of_len(1024, partition);
        let token = conn.acquire_ok(&key, 5, fresh_id());
        assert_eq!(conn.release(&key, token), Response::Released { token });
        let owner = fresh_id();
        let long = key_of_len(1025, partition);
        let answers = answers_until_closed(
            &server,
            &encode_all(&[Request::Acquire {
                wait_s: 0,
                lease_s: 5,
                owner,
                key: long.as_bytes(),
            }]),
        );
        assert_eq!(answers, [error(ErrorCode::KeyTooLong, owner)]);
    }
}

#[test]
fn empty_key_is_code_3_and_the_session_continues() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    for request in keyed_requests(b"", fresh_id()) {
        conn.send(request);
        let id = request.correlation_id();
        assert_eq!(conn.recv(), error(ErrorCode::EmptyKey, id), "{request:?}");
        assert_eq!(conn.ping(id), Response::Pong { nonce: id });
    }
}

#[test]
fn invalid_utf8_is_code_4_and_the_session_continues() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    let bad_keys: [&[u8]; 5] = [
        b"\xff",
        b"abc\xc3",         // truncated sequence
        b"\xc0\x80",        // overlong encoding of NUL
        b"\xed\xa0\x80",    // a surrogate
        b"ok-\xf5\x80\x80", // above U+10FFFF
    ];
    for key in bad_keys {
        for request in keyed_requests(key, fresh_id()) {
            conn.send(request);
            let id = request.correlation_id();
            assert_eq!(conn.recv(), error(ErrorCode::KeyNotUtf8, id), "{request:?}");
        }
    }
    // Valid multi-byte UTF-8 is a key like any other, on either partition.
    for key in keys("ключ-🔒") {
        let token = conn.acquire_ok(&key, 5, fresh_id());
        assert_eq!(conn.release(&key, token), Response::Released { token });
    }
}

#[test]
fn lease_0_in_acquire_or_extend_is_code_5_continues_and_changes_nothing() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    let mut other = Conn::connect(server.local_addr());
    for key in keys("lease-zero") {
        // On a free key: nothing is granted.
        for wait_s in [0, 5] {
            let owner = fresh_id();
            conn.send(Request::Acquire {
                wait_s,
                lease_s: 0,
                owner,
                key: key.as_bytes(),
            });
            assert_eq!(conn.recv(), error(ErrorCode::LeaseZero, owner));
        }
        assert_eq!(conn.state(&key), KeyState::FREE);
        // On a held key: nothing is queued, and the lease is not touched.
        let token = other.acquire_ok(&key, 5, fresh_id());
        let owner = fresh_id();
        conn.send(Request::Acquire {
            wait_s: 5,
            lease_s: 0,
            owner,
            key: key.as_bytes(),
        });
        assert_eq!(conn.recv(), error(ErrorCode::LeaseZero, owner));
        conn.send(Request::Extend {
            lease_s: 0,
            token,
            key: key.as_bytes(),
        });
        assert_eq!(conn.recv(), error(ErrorCode::LeaseZero, token));
        let seen = conn.state(&key);
        assert!(
            seen.held && seen.waiters == 0 && seen.lease_ms <= 5000,
            "{seen:?}"
        );
        // The holder still holds: its token still works.
        assert_eq!(other.release(&key, token), Response::Released { token });
    }
}

#[test]
fn ping_without_newline_is_code_6_and_closes_without_executing_what_follows() {
    let server = start(CORES);
    let key = &keys("ping-no-newline")[1];
    let nonce = fresh_id();
    let mut bytes = vec![b'P'];
    bytes.extend_from_slice(&nonce.to_be_bytes());
    bytes.push(b'x');
    bytes.extend(encode_all(&[Request::Acquire {
        wait_s: 0,
        lease_s: 5,
        owner: fresh_id(),
        key: key.as_bytes(),
    }]));
    assert_eq!(
        answers_until_closed(&server, &bytes),
        [error(ErrorCode::MissingNewline, nonce)]
    );
    assert_eq!(
        Conn::connect(server.local_addr()).state(key),
        KeyState::FREE
    );
}

#[test]
fn a_frame_with_several_faults_reports_the_lowest_code() {
    let server = small_key_server();
    let mut conn = Conn::connect(server.local_addr());
    let acquire = |owner, key| Request::Acquire {
        wait_s: 5,
        lease_s: 0,
        owner,
        key,
    };
    let extend = |token, key| Request::Extend {
        lease_s: 0,
        token,
        key,
    };
    // Empty key and lease 0: 3.
    let owner = fresh_id();
    conn.send(acquire(owner, b""));
    assert_eq!(conn.recv(), error(ErrorCode::EmptyKey, owner));
    conn.send(extend(owner, b""));
    assert_eq!(conn.recv(), error(ErrorCode::EmptyKey, owner));
    // Invalid UTF-8 and lease 0: 4.
    conn.send(acquire(owner, b"\xff\xfe"));
    assert_eq!(conn.recv(), error(ErrorCode::KeyNotUtf8, owner));
    conn.send(extend(owner, b"\xff\xfe"));
    assert_eq!(conn.recv(), error(ErrorCode::KeyNotUtf8, owner));
    assert_eq!(conn.ping(owner), Response::Pong { nonce: owner });
    // Too long, invalid UTF-8 and lease 0: 2, and the session closes.
    let long = [0xffu8; SMALL_KEY_BYTES + 1];
    let answers = answers_until_closed(&server, &encode_all(&[acquire(owner, &long)]));
    assert_eq!(answers, [error(ErrorCode::KeyTooLong, owner)]);
}

#[test]
fn fixed_headers_full_of_newline_bytes_are_parsed_by_length() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    let mut queue = Conn::connect(server.local_addr());
    for key in keys("newlines") {
        let key = key.as_bytes();
        // wait = lease = 10 = 0x0A too.
        let acquire = Request::Acquire {
            wait_s: 0x0A,
            lease_s: 0x0A,
            owner: NEWLINES,
            key,
        };
        conn.send(acquire);
        let token = match conn.recv() {
            Response::Acquired { owner, token } if owner == NEWLINES => token,
            other => panic!("expected A for 0x0A…, got {other:?}"),
        };
        queue.send(acquire);
        queue.send(Request::Query {
            nonce: NEWLINES,
            key,
        });
        assert!(matches!(
            queue.recv(),
            Response::State {
                nonce: NEWLINES,
                held: true,
                waiters: 1,
                ..
            }
        ));
        queue.send(Request::Cancel {
            owner: NEWLINES,
            key,
        });
        assert_eq!(queue.recv(), Response::Timeout { owner: NEWLINES });
        conn.send_raw(&encode_all(&[
            Request::Extend {
                lease_s: 0x0A,
                token,
                key,
            },
            Request::Release {
                token: NEWLINES,
                key,
            },
            Request::Ping { nonce: NEWLINES },
            Request::Release { token, key },
        ]));
        let mut answers = conn.recv_n(4);
        let pong = answers
            .iter()
            .position(|a| *a == Response::Pong { nonce: NEWLINES });
        answers.remove(pong.expect("the Pong"));
        assert_eq!(
            answers,
            [
                Response::Extended { token },
                Response::NotHeld { token: NEWLINES },
                Response::Released { token },
            ]
        );
    }
}

/// A pipelined batch of every request kind (and refused frames that continue) on `keys`.
fn mixed_batch(keys: &[String]) -> Script {
    let mut script = Script::default();
    for (stream, key) in keys.iter().enumerate() {
        let k = key.as_bytes();
        let ids: [u64; 8] = std::array::from_fn(|_| fresh_id());
        // The granted owner is mostly newline bytes, like a hostile fixed header.
        let granted = NEWLINES ^ ids[0];
        let requests = [
            Request::Ping { nonce: ids[1] },
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: granted,
                key: k,
            },
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: ids[2],
                key: k,
            },
            Request::Extend {
                lease_s: 1,
                token: ids[3],
                key: k,
            },
            Request::Release {
                token: ids[4],
                key: k,
            },
            Request::Acquire {
                wait_s: 5,
                lease_s: 1,
                owner: ids[5],
                key: k,
            },
            Request::Cancel {
                owner: ids[5],
                key: k,
            },
            Request::Query {
                nonce: ids[6],
                key: k,
            },
            Request::Query {
                nonce: ids[7],
                key: b"",
            },
        ];
        for request in requests {
            script.request(request);
        }
        script.expect(stream, Expect::Granted(granted));
        script.expect(stream, Expect::Exact(Response::Timeout { owner: ids[2] }));
        script.expect(stream, Expect::Exact(Response::NotHeld { token: ids[3] }));
        script.expect(stream, Expect::Exact(Response::NotHeld { token: ids[4] }));
        script.expect(stream, Expect::Exact(Response::Timeout { owner: ids[5] }));
        let held = Expect::State {
            nonce: ids[6],
            held: true,
            waiters: 0,
        };
        script.expect(stream, held);
        script.expect_any_order(Response::Pong { nonce: ids[1] });
        script.expect_any_order(error(ErrorCode::EmptyKey, ids[7]));
    }
    script
}

#[test]
fn a_pipelined_batch_sent_one_byte_at_a_time_is_parsed_and_answered() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    let keys: Vec<String> = (0..CORES)
        .flat_map(|partition| keys_on_partition("bytewise", partition, CORES, 2))
        .collect();
    let batch = mixed_batch(&keys);
    for byte in &batch.bytes {
        conn.send_raw(std::slice::from_ref(byte));
        thread::sleep(Duration::from_micros(300));
    }
    batch.check(&mut conn);
    conn.expect_silence(Duration::from_millis(50));
}

#[test]
fn a_pipelined_batch_split_in_two_at_every_byte_offset_is_parsed_and_answered() {
    let server = start(CORES);
    let mut conn = Conn::connect(server.local_addr());
    // Bounded: every pass moves the split one byte further into a batch of similar length.
    for offset in 1.. {
        let batch = mixed_batch(&keys(&format!("split{offset}")));
        if offset >= batch.bytes.len() {
            break;
        }
        conn.send_raw(&batch.bytes[..offset]);
        thread::sleep(Duration::from_millis(2));
        conn.send_raw(&batch.bytes[offset..]);
        batch.check(&mut conn);
    }
    conn.expect_silence(Duration::from_millis(50));
}

#[test]
fn half_close_answers_every_complete_frame_then_withdraws_waiters_and_closes() {
    let server = start(CORES);
    let keys = keys("half-close");
    let (free, held) = (&keys[0], &keys[1]);
    let mut holder = Conn::connect(server.local_addr());
    let held_token = holder.acquire_ok(held, 30, fresh_id());
    let mut conn = Conn::connect(server.local_addr());
    let (granted, queued) = (fresh_id(), fresh_id());
    let mut bytes = encode_all(&[
        Request::Ping { nonce: 1 },
        Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: granted,
            key: free.as_bytes(),
        },
        Request::Acquire {
            wait_s: 30,
            lease_s: 30,
            owner: queued,
            key: held.as_bytes(),
        },
        Request::Query {
            nonce: 2,
            key: held.as_bytes(),
        },
    ]);
    // An incomplete frame at the end: dropped with the session.
    bytes.extend_from_slice(b"Q\x00\x00");
    // The end of input travels with the data, as from `printf … | nc -N`.
    conn.send_raw_then_half_close(&bytes);
    let mut answers = conn.recv_until_closed();
    answers.sort_by_key(Response::correlation_id);
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers[0], Response::Pong { nonce: 1 });
    assert!(matches!(
        answers[1],
        Response::State {
            nonce: 2,
            held: true,
            waiters: 1,
            ..
        }
    ));
    let token = match answers[2] {
        Response::Acquired { owner, token } if owner == granted => token,
        other => panic!("expected A for {granted}, got {other:?}"),
    };
    // The session has ended: its waiter is gone, its hold stays.
    let seen = holder.state(held);
    assert!(seen.held && seen.waiters == 0, "{seen:?}");
    assert!(holder.state(free).held);
    assert_eq!(holder.release(free, token), Response::Released { token });
    assert_eq!(
        holder.release(held, held_token),
        Response::Released { token: held_token }
    );
    assert_eq!(holder.state(held), KeyState::FREE);
}

#[test]
fn half_close_answers_every_frame_even_when_the_last_ones_arrive_over_the_output_bound() {
    // One Cancel answers `T` for each acquire it withdraws: 140 keys with 100 waiters each
    // make the last read (Cancels, Pings and the end of input together) produce more than
    // the session's output bound (64 KiB) at once, so the session pauses with frames left.
    let mut config = test_config(CORES);
    config.limits.max_pending_per_session = 20_000;
    let server = start_with(config);
    let keys: Vec<String> = (0..CORES)
        .flat_map(|partition| keys_on_partition("over-bound", partition, CORES, 70))
        .collect();
    let mut holder = Conn::connect(server.local_addr());
    let grants: Vec<Request> = keys
        .iter()
        .map(|key| Request::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: fresh_id(),
            key: key.as_bytes(),
        })
        .collect();
    holder.send_raw(&encode_all(&grants));
    for answer in holder.recv_n(keys.len()) {
        assert!(matches!(answer, Response::Acquired { .. }), "{answer:?}");
    }
    let mut conn = Conn::connect(server.local_addr());
    let owner = fresh_id();
    let per_key = 100;
    let mut queued = Vec::new();
    for key in &keys {
        queued.extend((0..per_key).map(|_| Request::Acquire {
            wait_s: 60,
            lease_s: 60,
            owner,
            key: key.as_bytes(),
        }));
    }
    conn.send_raw(&encode_all(&queued));
    for key in &keys {
        assert_eq!(conn.state(key).waiters, per_key);
    }
    let mut tail: Vec<Request> = keys
        .iter()
        .map(|key| Request::Cancel {
            owner,
            key: key.as_bytes(),
        })
        .collect();
    tail.extend((1..=100).map(|nonce| Request::Ping { nonce }));
    conn.send_raw_then_half_close(&encode_all(&tail));
    let answers = conn.recv_until_closed();
    let timeouts = answers
        .iter()
        .filter(|answer| **answer == Response::Timeout { owner })
        .count();
    let mut pongs: Vec<u64> = answers
        .iter()
        .filter(|answer| matches!(answer, Response::Pong { .. }))
        .map(Response::correlation_id)
        .collect();
    pongs.sort_unstable();
    assert_eq!(timeouts, keys.len() * per_key as usize);
    assert_eq!(pongs, (1..=100).collect::<Vec<_>>());
    assert_eq!(answers.len(), timeouts + pongs.len());
}
