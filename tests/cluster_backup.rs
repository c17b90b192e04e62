//! `latchkey cluster backup FILE` and a new cluster started from it (`cluster.restore_from`),
//! with real processes on loopback: the leader of a shard gives its copy and a follower refuses
//! naming the leader; the backup of a 3-member cluster starts a new 3-member cluster on empty
//! data directories that holds the same locks and grants tokens above every token of the
//! backup; a backup of another shard count, or a damaged one, is refused at start naming the
//! key (no data directory created); and the command writes no file unless every shard was
//! captured.
//!
//! Every wait is bounded and polled; no timing is asserted beyond "eventually, within 10 s".

use common::cluster::{serve_to_exit, Cluster, DEFAULT_SECTIONS};
use common::server::fresh_id;
use latchkey::cluster::backup::{BackupFile, ShardBackup};
use latchkey::cluster::machine::ShardMachine;
use latchkey::cluster::partition::shard_of;
use latchkey_client::protocol::{Request, Response};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

const SETTLE_LIMIT: Duration = Duration::from_secs(10);
const SHARDS: u32 = 4;
const HELD: [&str; 6] = ["jobs/a", "jobs/b", "jobs/c", "db/1", "db/2", "cache"];

/// `latchkey ARGS --server SERVERS`: exit code, stdout, stderr.
fn latchkey(servers: &str, args: &[&str]) -> (Option<i32>, String, String) {
    common::run_cli(env!("CARGO_BIN_EXE_latchkey"), servers, args)
}

/// `GET path` on `addr`: the status and the body as bytes.
fn get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n");
    stream.write_all(request.as_bytes()).expect("send");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("read the answer");
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let status = String::from_utf8_lossy(&answer[9..12])
        .parse()
        .expect("status");
    (status, answer[end + 4..].to_vec())
}

/// Sends `make()` to the member that serves `key` until it is not `M`.
fn call(cluster: &Cluster, key: &'static str, make: impl Fn() -> Request<'static>) -> Response {
    cluster.call(key, &[], SETTLE_LIMIT, make).1
}

fn acquire(cluster: &Cluster, key: &'static str, lease_s: u8) -> u64 {
    let owner = fresh_id();
    let request = move || Request::Acquire {
        wait_s: 0,
        lease_s,
        owner,
        key: key.as_bytes(),
    };
    match call(cluster, key, request) {
        Response::Acquired { token, .. } => token,
        other => panic!("acquire of {key}: {other:?}"),
    }
}

/// The leader of `key`'s shard gives the shard's copy (holding `key`); a member that does not
/// serve it answers 421 naming the leader.
fn check_the_route(cluster: &Cluster, key: &'static str) {
    let shard = shard_of(key.as_bytes(), SHARDS);
    let path = format!("/cluster/backup?shard={shard}");
    let (mut copied, mut refused) = (false, false);
    let started = Instant::now();
    while !(copied && refused) {
        assert!(
            started.elapsed() < SETTLE_LIMIT,
            "copied {copied}, refused {refused}"
        );
        let (leader, _) = cluster.serving(key, &[], SETTLE_LIMIT).expect("a leader");
        for (index, member) in cluster.members.iter().enumerate() {
            let (status, body) = get(member.client, &path);
            match status {
                200 if index == leader => {
                    let copy = ShardBackup::decode(&body).expect("a copy");
                    assert_eq!((copy.shard, copy.shards), (shard, SHARDS));
                    assert!(copy.image.holds.iter().any(|h| h.key == key.as_bytes()));
                    copied = true;
                }
                421 if index != leader => {
                    let text = String::from_utf8_lossy(&body);
                    assert!(text.contains("does not serve shard"), "{text}");
                    refused = true;
                }
                _ => {} // leadership moved meanwhile: look again
            }
        }
    }
    let (status, body) = get(cluster.members[0].client, "/cluster/backup?shard=99");
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
}

#[test]
fn a_new_cluster_starts_from_a_backup_with_its_locks_and_tokens_above_it() {
    let mut old = Cluster::start("backup-old", 3, SHARDS, false);
    let mut tokens: Vec<u64> = HELD.iter().map(|key| acquire(&old, key, 200)).collect();
    let freed = acquire(&old, "freed", 200);
    tokens.push(freed);
    let release = move || Request::Release {
        token: freed,
        key: b"freed",
    };
    assert_eq!(
        call(&old, "freed", release),
        Response::Released { token: freed }
    );
    check_the_route(&old, HELD[0]);

    let file = old.file("locks.lkb");
    let path = file.to_str().expect("a path");
    let (code, stdout, stderr) = latchkey(&Cluster::servers(&old), &["cluster", "backup", path]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("4 shards, 6 locks"), "{stdout}");
    let backup = BackupFile::decode(&std::fs::read(&file).expect("the file")).expect("decodes");
    assert_eq!(backup.locks(), HELD.len());
    for index in 0..3 {
        old.stop(index);
    }

    let mut new = Cluster::configure("backup-new", 3, SHARDS, false, false, DEFAULT_SECTIONS);
    for index in 0..3 {
        new.edit_config(index, |text| format!("{text}restore_from = {path:?}\n"));
        assert!(!new.members[index].data.exists());
        new.launch(index);
    }
    for (key, token) in HELD.iter().zip(&tokens) {
        let (_, state) = new.serving(key, &[], SETTLE_LIMIT).expect("served");
        let Response::State { held, lease_ms, .. } = state else {
            panic!("{key}: {state:?}");
        };
        assert!(held, "{key} (token {token}) is held in the new cluster");
        assert!(lease_ms > 100_000, "{key}: {lease_ms} ms left of 200 s");
    }
    let highest = *tokens.iter().max().expect("tokens");
    for key in ["freed", "fresh"] {
        let token = acquire(&new, key, 5);
        assert!(token > highest, "{key}: {token} <= {highest}");
    }
    let refused = move || Request::Acquire {
        wait_s: 0,
        lease_s: 5,
        owner: fresh_id(),
        key: HELD[1].as_bytes(),
    };
    assert!(matches!(
        call(&new, HELD[1], refused),
        Response::Timeout { .. }
    ));

    // Once the data directory holds the member's data, the key is ignored (and said so).
    new.stop(0);
    new.launch(0);
    let (_, state) = new.serving(HELD[2], &[], SETTLE_LIMIT).expect("served");
    assert!(matches!(state, Response::State { held: true, .. }));
    let log = new.members[0].log.lock().unwrap().clone();
    assert!(
        log.contains("cluster.restore_from") && log.contains("ignored"),
        "{log}"
    );
}

/// A backup of `shards` empty shards, as bytes.
fn empty_backup(shards: u32) -> Vec<u8> {
    let copies = (0..shards)
        .map(|shard| {
            let machine = ShardMachine::new(shard, shards);
            let bytes = ShardBackup::encode_of(&machine, shards, 1, 0).expect("a copy");
            ShardBackup::decode(&bytes).expect("decodes")
        })
        .collect();
    BackupFile { shards: copies }.encode().expect("encodes")
}

fn refused_start(cluster: &Cluster, file: &Path, words: &str) {
    let member = &cluster.members[0];
    let path = file.to_str().expect("a path").to_owned();
    cluster.edit_config(0, |text| format!("{text}restore_from = {path:?}\n"));
    let (code, stderr) = serve_to_exit(&member.config, &[]);
    assert_eq!(code, Some(70), "{stderr}");
    assert!(stderr.contains("cluster.restore_from"), "{stderr}");
    assert!(stderr.contains(words), "{stderr}");
    assert!(!member.data.exists(), "no data directory is created");
}

#[test]
fn a_backup_of_another_shard_count_or_damaged_is_refused_at_start() {
    let cluster = Cluster::configure("backup-refused", 3, 2, false, false, DEFAULT_SECTIONS);
    let four = cluster.file("four.lkb");
    std::fs::write(&four, empty_backup(4)).expect("write");
    refused_start(&cluster, &four, "cluster.shards is 2");
    let cut = cluster.file("cut.lkb");
    let bytes = empty_backup(2);
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).expect("write");
    let cluster = Cluster::configure("backup-cut", 3, 2, false, false, DEFAULT_SECTIONS);
    refused_start(&cluster, &cut, "truncated or corrupt");
    let cluster = Cluster::configure("backup-none", 3, 2, false, false, DEFAULT_SECTIONS);
    refused_start(&cluster, &cluster.file("missing.lkb"), "No such file");
}

#[test]
fn no_file_is_written_unless_every_shard_is_captured() {
    let dead = common::dead_addr().to_string();
    let dir = Cluster::configure("backup-dead", 3, SHARDS, false, false, DEFAULT_SECTIONS);
    let file = dir.file("never.lkb");
    let path = file.to_str().expect("a path");
    let (code, _, stderr) = latchkey(&dead, &["cluster", "backup", path]);
    assert_eq!(code, Some(83), "{stderr}");
    assert!(stderr.contains("no file written"), "{stderr}");
    assert!(!file.exists());

    // One member of three: it answers, but no shard has a leader (no quorum).
    let mut alone = dir;
    alone.launch(0);
    let (code, _, stderr) = latchkey(&Cluster::servers(&alone), &["cluster", "backup", path]);
    assert_eq!(code, Some(83), "{stderr}");
    assert!(stderr.contains("4 of 4 shards not captured"), "{stderr}");
    assert!(stderr.contains("latchkey cluster status"), "{stderr}");
    assert!(!file.exists());
    alone.stop(0);
}
