//! Peer TLS (`[cluster.tls]`) with real processes on loopback: three members with certificates
//! form a cluster and replicate a hold that outlives a rolling rotation to another CA (one
//! member at a time, with both CAs in `ca_file` meanwhile); a member whose certificate names
//! another member does not start; a member without `[cluster.tls]` among members with it is
//! refused, the log and the metrics saying why.
//!
//! Every wait is bounded; nothing asserts on speed.

use common::cluster::{http_get, metric, serve_to_exit, Cluster, DEFAULT_SECTIONS};
use common::pki::Pki;
use common::server::fresh_id;
use latchkey_client::protocol::{Request, Response};
use std::path::Path;
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(20);

/// `[cluster.tls]` with member `id`'s certificate from `pki` (naming `member-{named}`) and
/// `ca_file`.
fn tls_section(pki: &Pki, id: u64, named: u64, ca_file: &Path) -> String {
    let name = format!("member-{named}");
    let (cert, key) = pki.leaf(&format!("m{id}-as-{named}"), &name, &[&name]);
    format!("[cluster.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\nca_file = {ca_file:?}\n")
}

/// Replaces (or appends) member `index`'s `[cluster.tls]` section.
fn set_tls(cluster: &Cluster, index: usize, section: &str) {
    cluster.edit_config(index, |text| {
        let base = text
            .split("[cluster.tls]")
            .next()
            .unwrap_or_default()
            .to_string();
        format!("{base}{section}")
    });
}

/// Whether `key` is held, as the member that serves it says (waiting for one to serve it).
fn held(cluster: &Cluster, key: &str) -> bool {
    match cluster.serving(key, &[], PATIENCE) {
        Some((_, Response::State { held, .. })) => held,
        other => panic!("no member serves {key}: {other:?}"),
    }
}

/// Waits until member `index`'s log says `what` (its lines arrive as it writes them).
fn wait_for_log(cluster: &Cluster, index: usize, what: &str) {
    let deadline = Instant::now() + PATIENCE;
    while !cluster.members[index].log.lock().unwrap().contains(what) {
        assert!(
            Instant::now() < deadline,
            "member {} never logged {what:?}",
            index + 1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until member `index` reaches every other member both ways (its `/metrics` say so).
fn wait_reachable(cluster: &Cluster, index: usize) {
    let deadline = Instant::now() + PATIENCE;
    let others: Vec<u64> = (1..=3).filter(|&id| id != index as u64 + 1).collect();
    while !others.iter().all(|peer| {
        let series = format!("latchkey_cluster_peer_reachable{{peer=\"{peer}\"}}");
        sample(cluster, index, &series) == 1.0
    }) {
        assert!(
            Instant::now() < deadline,
            "member {} never reached the others",
            index + 1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A member's `/metrics` sample `series`, 0 if absent.
fn sample(cluster: &Cluster, index: usize, series: &str) -> f64 {
    let (_, body) = http_get(cluster.members[index].client, "/metrics").expect("/metrics");
    metric(&body, series).unwrap_or(0.0)
}

#[test]
fn three_members_with_peer_tls_replicate_a_hold_through_a_rolling_rotation_to_another_ca() {
    let old = Pki::new("rotation-old");
    let new = Pki::new("rotation-new");
    let mut cluster = Cluster::configure("cluster-tls", 3, 4, true, false, DEFAULT_SECTIONS);
    for index in 0..3 {
        let id = index as u64 + 1;
        set_tls(&cluster, index, &tls_section(&old, id, id, &old.ca_file()));
        cluster.launch(index);
    }
    for index in 0..3 {
        wait_for_log(&cluster, index, "peer TLS on");
    }
    let key = "jobs/rotated";
    let owner = fresh_id();
    let acquire = || Request::Acquire {
        wait_s: 0,
        lease_s: 120,
        owner,
        key: key.as_bytes(),
    };
    let token = match cluster.call(key, &[], PATIENCE, acquire) {
        (_, Response::Acquired { token, .. }) => token,
        (_, other) => panic!("acquire answered {other:?}"),
    };
    // Both CAs in every ca_file, one member at a time; then the new certificates, likewise.
    let both = std::fs::read_to_string(old.ca_file()).unwrap()
        + &std::fs::read_to_string(new.ca_file()).unwrap();
    let bundle = new.write("both.crt", &both);
    for pki in [&old, &new] {
        for index in 0..3 {
            let id = index as u64 + 1;
            cluster.stop(index);
            set_tls(&cluster, index, &tls_section(pki, id, id, &bundle));
            cluster.launch(index);
            // It reaches both others (TLS both ways) before the next one stops.
            wait_reachable(&cluster, index);
            assert!(held(&cluster, key), "held after member {id} restarted");
        }
    }
    // The hold was replicated all along: its token releases it now.
    let release = || Request::Release {
        token,
        key: key.as_bytes(),
    };
    match cluster.call(key, &[], PATIENCE, release) {
        (_, Response::Released { .. }) => {}
        (_, other) => panic!("release answered {other:?}"),
    }
    let refused = "latchkey_cluster_peer_connections_refused_tls_total";
    for index in 0..3 {
        assert_eq!(
            sample(&cluster, index, refused),
            0.0,
            "member {}",
            index + 1
        );
    }
    // The peer port speaks TLS only: a plaintext hello is refused and counted.
    let mut plain = std::net::TcpStream::connect(cluster.members[0].peer).expect("connect");
    plain.set_read_timeout(Some(PATIENCE)).expect("timeout");
    std::io::Write::write_all(&mut plain, b"LKPR\x05").expect("write");
    let _ = std::io::Read::read_to_end(&mut plain, &mut Vec::new());
    let deadline = Instant::now() + PATIENCE;
    while sample(&cluster, 0, refused) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the plaintext hello was not counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_member_whose_certificate_names_another_member_does_not_start() {
    let pki = Pki::new("misnamed");
    let cluster = Cluster::configure("cluster-tls-name", 3, 4, true, false, DEFAULT_SECTIONS);
    set_tls(&cluster, 1, &tls_section(&pki, 2, 3, &pki.ca_file()));
    let (code, stderr) = serve_to_exit(&cluster.members[1].config, &[]);
    assert!(
        code.is_some_and(|code| code != 0),
        "exit {code:?}: {stderr}"
    );
    assert!(stderr.contains("cluster.tls.cert_file"), "{stderr}");
    assert!(
        stderr.contains("member-2") && stderr.contains("member-3"),
        "{stderr}"
    );
    // Stopped before its data directory was made (a fixed file starts it afresh).
    assert!(!cluster.members[1].data.exists());
}

#[test]
fn a_member_without_peer_tls_among_members_with_it_is_refused_saying_why() {
    let pki = Pki::new("mixed");
    let mut cluster = Cluster::configure("cluster-tls-mixed", 3, 4, true, false, DEFAULT_SECTIONS);
    for index in 0..2 {
        let id = index as u64 + 1;
        set_tls(&cluster, index, &tls_section(&pki, id, id, &pki.ca_file()));
    }
    for index in 0..3 {
        cluster.launch(index);
    }
    let refused = "latchkey_cluster_peer_connections_refused_tls_total";
    let deadline = Instant::now() + PATIENCE;
    let says = |index: usize, what: &str| cluster.members[index].log.lock().unwrap().contains(what);
    loop {
        let counted = (0..3).all(|index| sample(&cluster, index, refused) >= 1.0);
        let logged = says(0, "this member has [cluster.tls], the dialer has not")
            && says(2, "the dialer has [cluster.tls], this member has not");
        if counted && logged {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gave up waiting for the refusals"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Members 1 and 2 (TLS) are a quorum and serve; member 3 reaches neither.
    assert!(!held(&cluster, "jobs/mixed"));
}
