//! The smallest end-to-end check: a two-core server grants, queues, hands off and answers.

use common::server::{keys_on_partition, start, Conn};
use latchkey_client::protocol::Response;

#[test]
fn grant_queue_handoff_across_partitions() {
    let server = start(2);
    let mut first = Conn::connect(server.local_addr());
    let mut second = Conn::connect(server.local_addr());
    for partition in 0..2 {
        let key = &keys_on_partition("smoke", partition, 2, 1)[0];
        let token = first.acquire_ok(key, 30, 1);
        assert_eq!(
            second.acquire(key, 0, 30, 2),
            Response::Timeout { owner: 2 }
        );
        second.send(latchkey_client::protocol::Request::Acquire {
            wait_s: 30,
            lease_s: 30,
            owner: 3,
            key: key.as_bytes(),
        });
        assert_eq!(first.release(key, token), Response::Released { token });
        match second.recv() {
            Response::Acquired {
                owner: 3,
                token: next,
            } => assert!(next > token),
            other => panic!("expected handoff, got {other:?}"),
        }
    }
    drop(first);
    drop(second);
    server.shutdown();
    server.join().unwrap();
}
