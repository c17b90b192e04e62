//! Peer TLS (`[cluster.tls]`): members with certificates from one CA deliver as plaintext
//! members do; a plaintext dialer, a certificate of another CA, and a certificate naming another
//! member than the hello claims are refused and counted; a member with TLS and one without
//! refuse each other, each saying that the members disagree; a handshake that goes silent is
//! closed at the hello's deadline; a member's own files are checked at start.

use super::*;
use common::pki::{presenting_config, Pki};
use latchkey::cluster::peer::tls::PeerTls;
use latchkey::config::PeerTlsConfig;
use std::path::PathBuf;

/// Member `node_id`'s certificate (naming it as `member-N`) and key, signed by `pki`'s CA.
fn member_files(pki: &Pki, node_id: u64) -> (PathBuf, PathBuf) {
    let name = format!("member-{node_id}");
    pki.leaf(&name, &format!("latchkey {name}"), &[&name])
}

/// Member `node_id`'s peer TLS: its certificate from `pki`, trusting `ca_file`.
fn member_tls(pki: &Pki, node_id: u64, ca_file: PathBuf) -> PeerTls {
    let (cert_file, key_file) = member_files(pki, node_id);
    let files = PeerTlsConfig {
        cert_file,
        key_file,
        ca_file,
    };
    PeerTls::load(&files, node_id).expect("the member's files")
}

/// Member `node_id` of the members at `all` with its certificate from `pki`, trusting `pki`'s
/// CA, read on the peer thread.
fn start_signed(pki: &Pki, node_id: u64, all: &[SocketAddr]) -> Member {
    let tls = member_tls(pki, node_id, pki.ca_file());
    start_tls(node_id, all, Some(tls), Reads::OnThePeerThread)
}

/// Member `node_id` of the members at `all`, with `tls` (or none), read as `reads` says.
fn start_tls(node_id: u64, all: &[SocketAddr], tls: Option<PeerTls>, reads: Reads) -> Member {
    let config = PeerConfig {
        tls,
        ..config_among(node_id, all)
    };
    spawn_member(config, reads)
}

#[test]
fn three_members_with_tls_deliver_every_message_once_read_on_the_thread_or_the_cores() {
    for reads in [Reads::OnThePeerThread, Reads::OnTheCores] {
        let pki = Pki::new("peer-three");
        let all = addresses(3);
        let mut members: Vec<Member> = (1..=3)
            .map(|id| start_tls(id, &all, Some(member_tls(&pki, id, pki.ca_file())), reads))
            .collect();
        const EACH: u64 = 1000;
        for from in 1..=3u64 {
            for to in (1..=3u64).filter(|&to| to != from) {
                let base = from * 1_000_000 + to * 10_000;
                send_numbered(&members[from as usize - 1], from, to, base..base + EACH);
            }
        }
        // Large envelopes too (many TLS records each), among the small ones.
        for (number, padding) in [(900_000u64, 3_000_000), (900_001, 70_000)] {
            let batch = one_to_two(0, number..number + 1, padding);
            assert!(members[0].handle.send_batch(batch));
        }
        for (index, member) in members.iter_mut().enumerate() {
            let to = index as u64 + 1;
            let extra = if to == 2 { 2 } else { 0 };
            let (received, _) = member.receive(2 * EACH as usize + extra);
            let seen: HashSet<(u64, u64)> = (received.iter())
                .map(|(_, _, m)| (m.from, m.commit))
                .collect();
            assert_eq!(seen.len(), received.len(), "{reads:?}: no duplicate");
            assert_eq!(
                received.len(),
                2 * EACH as usize + extra,
                "{reads:?}: member {to}"
            );
            if to == 2 {
                let large = received.iter().find(|(_, _, m)| m.commit == 900_000);
                let large = large.expect("the large envelope").2.get_context().len();
                assert_eq!(large, 3_000_000, "{reads:?}: whole");
            }
        }
        for member in &members {
            let stats = member.stats();
            assert_eq!(
                load(&stats.refusals) + load(&stats.tls_refusals),
                0,
                "{reads:?}"
            );
            assert_eq!(
                load(&stats.connects),
                2,
                "{reads:?}: one connection per peer"
            );
            assert!(member.handle.report().quorum);
        }
    }
}

#[test]
fn a_member_with_tls_and_one_without_refuse_each_other_saying_so() {
    let pki = Pki::new("peer-mixed");
    let all = addresses(2);
    let one = start_signed(&pki, 1, &all);
    let mut two = start_tls(2, &all, None, Reads::OnThePeerThread);
    send_numbered(&one, 1, 2, 0..5);
    send_numbered(&two, 2, 1, 0..5);
    wait_for("both sides to refuse and be refused", || {
        [(&one, 2), (&two, 1)].iter().all(|&(member, other)| {
            let status = view(member, other);
            status.link == LinkState::Refused && load(&member.stats().tls_refusals) >= 1
        })
    });
    for (member, other) in [(&one, 2), (&two, 1)] {
        let status = view(member, other);
        assert!(status.reason.contains("[cluster.tls]"), "{status:?}");
        assert!(!status.reachable, "{status:?}");
    }
    // (Each side's refusal of the other's connection comes before a hello names the dialer:
    // the log says it, and the TLS refusals count it.)
    assert!(
        two.receive_for(Duration::from_millis(300)).is_empty(),
        "nothing delivered"
    );
    // Fixed (member 2 restarted with TLS), the two connect and what was queued arrives.
    two.stop();
    let tls = member_tls(&pki, 2, pki.ca_file());
    let mut two = start_tls(2, &all, Some(tls), Reads::OnThePeerThread);
    let numbers: HashSet<u64> = two.receive(5).0.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (0..5).collect());
}

#[test]
fn a_plaintext_dialer_is_refused_and_counted() {
    let pki = Pki::new("peer-plain");
    let all = addresses(2);
    let one = start_signed(&pki, 1, &all);
    let mut stream = TcpStream::connect(all[0]).expect("connect");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    stream.write_all(&hello_to(1, 2)).expect("write the hello");
    // No reply: rustls's alert (a TLS record, not the peer magic), then the close.
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    assert!(!answer.starts_with(b"LKPR"), "{answer:02x?}");
    wait_for("the refusal to be counted", || {
        load(&one.stats().tls_refusals) == 1 && load(&one.stats().refusals) == 1
    });
    assert_eq!(load(&one.stats().accepts), 0);
}

#[test]
fn a_certificate_signed_by_another_ca_is_refused_both_ways() {
    let pki = Pki::new("peer-ca");
    let rogue = Pki::new("peer-rogue");
    let all = addresses(2);
    let one = start_signed(&pki, 1, &all);
    // Member 2's certificate is the other CA's (which its own ca_file trusts, so it starts).
    let both = std::fs::read_to_string(pki.ca_file()).unwrap()
        + &std::fs::read_to_string(rogue.ca_file()).unwrap();
    let bundle = rogue.write("both.crt", &both);
    let mut two = start_tls(
        2,
        &all,
        Some(member_tls(&rogue, 2, bundle)),
        Reads::OnThePeerThread,
    );
    send_numbered(&two, 2, 1, 0..5);
    wait_for(
        "member 1 to refuse member 2's certificate, both ways",
        || {
            let status = view(&one, 2);
            load(&one.stats().tls_refusals) >= 1 && status.link == LinkState::Refused
        },
    );
    let status = view(&one, 2);
    assert!(status.reason.contains("TLS"), "{status:?}");
    assert!(!status.reachable);
    wait_for("member 2 to see its connection refused", || {
        view(&two, 1).link == LinkState::Refused
    });
    let mut one = one;
    assert!(
        one.receive_for(Duration::from_millis(300)).is_empty(),
        "nothing delivered"
    );
    two.stop();
}

#[test]
fn a_certificate_naming_another_member_than_the_hello_claims_is_refused() {
    let pki = Pki::new("peer-name");
    let all = addresses(2);
    let mut one = start_signed(&pki, 1, &all);
    // A dialer with a good certificate of member 3's, saying hello as member 2.
    let three = member_files(&pki, 3);
    let config = presenting_config(&pki.ca_file(), &three);
    let tcp = TcpStream::connect(all[0]).expect("connect");
    tcp.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let name = "member-1".try_into().expect("a name");
    let connection = rustls::ClientConnection::new(config, name).expect("a session");
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    // In another data-directory incarnation than the real member 2's.
    let mut impostor = hello_to(1, 2);
    impostor[33..].copy_from_slice(&0xbadu64.to_be_bytes());
    stream
        .write_all(&impostor)
        .expect("the handshake and the hello");
    let mut reply = [0u8; REPLY_BYTES];
    let read = stream.read(&mut reply);
    assert!(
        !matches!(read, Ok(n) if n > 0),
        "no reply: {read:?} {reply:02x?}"
    );
    wait_for("member 1 to refuse it", || {
        view(&one, 2).refused_inbound.is_some() && load(&one.stats().tls_refusals) == 1
    });
    let said = view(&one, 2).refused_inbound.unwrap_or_default();
    assert!(said.contains("does not name member 2"), "{said}");
    assert!(said.contains("member-3"), "{said}");
    assert_eq!(load(&one.stats().accepts), 0);
    assert!(one.receive_for(Duration::from_millis(100)).is_empty());
    // Its incarnation was not remembered (the certificate is checked first): the real member
    // 2 is accepted.
    let two = start_signed(&pki, 2, &all);
    send_numbered(&two, 2, 1, 0..3);
    assert_eq!(one.receive(3).0.len(), 3, "the real member 2 is accepted");
}

#[test]
fn a_members_own_files_are_checked_at_start_each_error_naming_its_key() {
    let pki = Pki::new("peer-own");
    let rogue = Pki::new("peer-own-rogue");
    let (cert_file, key_file) = member_files(&pki, 2);
    let files = PeerTlsConfig {
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        ca_file: pki.ca_file(),
    };
    assert!(PeerTls::load(&files, 2).is_ok());
    let refused = |files: &PeerTlsConfig, node_id: u64| {
        PeerTls::load(files, node_id)
            .expect_err("refused")
            .to_string()
    };
    let error = refused(&files, 3);
    assert!(error.starts_with("cluster.tls.cert_file "), "{error}");
    assert!(
        error.contains("member-3") && error.contains("member-2"),
        "{error}"
    );
    let other_ca = PeerTlsConfig {
        ca_file: rogue.ca_file(),
        ..files.clone()
    };
    let error = refused(&other_ca, 2);
    assert!(error.starts_with("cluster.tls.cert_file "), "{error}");
    assert!(error.contains("cluster.tls.ca_file"), "{error}");
    let (_, other_key) = member_files(&pki, 4);
    let wrong_key = PeerTlsConfig {
        key_file: other_key,
        ..files.clone()
    };
    let error = refused(&wrong_key, 2);
    assert!(error.starts_with("cluster.tls.key_file "), "{error}");
    let missing = PeerTlsConfig {
        ca_file: pki.dir.join("nowhere.crt"),
        ..files
    };
    let error = refused(&missing, 2);
    assert!(error.starts_with("cluster.tls.ca_file "), "{error}");
}

/// A dialer that starts a handshake and goes silent is closed at the hello's deadline, which
/// bounds the handshake too: it cannot hold one of the member's connection slots.
#[test]
fn a_silent_handshake_is_closed_at_the_hello_deadline() {
    let pki = Pki::new("peer-silent");
    let all = addresses(2);
    let tls = Some(member_tls(&pki, 1, pki.ca_file()));
    let config = PeerConfig {
        seed: 0x5eed,
        limits: PeerLimits {
            hello_timeout: Duration::from_millis(300),
            ..PeerLimits::default()
        },
        tls,
        ..config_among(1, &all)
    };
    let one = spawn_member(config, Reads::OnThePeerThread);
    let mut stream = TcpStream::connect(all[0]).expect("connect");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    // The first bytes of a ClientHello record, and nothing more.
    stream
        .write_all(&[0x16, 0x03, 0x01, 0x00, 0xf4, 0x01])
        .expect("write");
    let started = Instant::now();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(started.elapsed() < PATIENCE, "closed, not left open");
    wait_for("the late handshake to be refused", || {
        load(&one.stats().refusals) == 1
    });
    assert_eq!(load(&one.stats().accepts), 0);
}

/// A dialer checks that the member it reached is the one it dialed: a peer address of member 2
/// that leads to member 3 is refused by the certificate's name, before any hello.
#[test]
fn a_peer_address_that_leads_to_another_member_is_refused_by_its_certificate() {
    let pki = Pki::new("peer-dialed");
    let all = addresses(3);
    let config = |node_id: u64, peers: Vec<(u64, SocketAddr)>| PeerConfig {
        peers,
        limits: PeerLimits::default(),
        tls: Some(member_tls(&pki, node_id, pki.ca_file())),
        ..config_among(node_id, &all)
    };
    // Member 1 believes member 2 listens on member 3's address; member 2 never runs.
    let one = spawn_member(
        config(1, vec![(2, all[2]), (3, all[2])]),
        Reads::OnThePeerThread,
    );
    let three = spawn_member(
        config(3, vec![(1, all[0]), (2, all[1])]),
        Reads::OnThePeerThread,
    );
    wait_for("member 1 to refuse what answers as member 2", || {
        view(&one, 2).link == LinkState::Refused && view(&one, 3).link == LinkState::Connected
    });
    let status = view(&one, 2);
    assert!(
        status.reason.contains("refused its TLS certificate"),
        "{status:?}"
    );
    assert!(
        status.reason.contains("not valid for name \"member-2\""),
        "{status:?}"
    );
    assert!(load(&one.stats().tls_refusals) >= 1);
    drop(three);
}
