//! Members that disagree refuse each other on both sides until fixed; who is reachable, and
//! the quorum.

use super::*;

#[test]
fn members_of_another_cluster_identity_refuse_each_other_on_both_sides_until_fixed() {
    let all = addresses(2);
    let one = start(1, &all, quick_limits());
    let peers = vec![(1, all[0])];
    let mut two = start_with(2, all[1], peers, IDENTITY ^ 1, quick_limits());
    send_numbered(&one, 1, 2, 0..5);
    // Each side refuses the other's hello, and hears the other refuse its own.
    wait_for("both sides to refuse and be refused", || {
        [(&one, 2), (&two, 1)].iter().all(|&(member, other)| {
            let status = view(member, other);
            status.link == LinkState::Refused && status.refused_inbound.is_some()
        })
    });
    for (member, other) in [(&one, 2), (&two, 1)] {
        assert!(load(&member.stats().refusals) >= 1);
        assert!(load(&member.stats().refused_by_peers) >= 1);
        let status = view(member, other);
        assert_eq!(status.link, LinkState::Refused, "{status:?}");
        assert!(
            status.reason.contains("cluster identity differs"),
            "{status:?}"
        );
        let inbound = status.refused_inbound.as_deref().unwrap_or_default();
        assert!(inbound.contains("cluster identity differs"), "{status:?}");
        assert!(!status.reachable);
        let report = member.handle.report();
        assert_eq!((report.reachable, report.quorum), (1, false));
    }
    assert!(
        two.receive_for(Duration::from_millis(300)).is_empty(),
        "nothing delivered"
    );
    // Member 2 comes back with the cluster's identity: member 1 reconnects by itself (it keeps
    // retrying) and what it queued meanwhile arrives.
    two.stop();
    let mut two = start(2, &all, quick_limits());
    let numbers: HashSet<u64> = two.receive(5).0.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (0..5).collect());
    wait_for(
        "member 1 to see member 2 connected, reachable, its refusal history",
        || {
            let status = view(&one, 2);
            status.link == LinkState::Connected
                && status.reachable
                && status.refused_inbound.is_none()
        },
    );
}

#[test]
fn a_peer_address_that_leads_to_another_member_is_refused_as_dialed_but_reached() {
    let all = addresses(3);
    // Member 1 believes member 2 listens on member 3's address; member 2 never runs.
    let peers = vec![(2, all[2]), (3, all[2])];
    let one = start_with(1, all[0], peers, IDENTITY, quick_limits());
    let three = start(3, &all, quick_limits());
    let reason = "node 1 dialed node 2 but reached node 3: member 1's peer address for 2 is wrong";
    wait_for("member 1 to be told", || {
        view(&one, 2).reason.contains(reason)
    });
    assert_eq!(view(&one, 2).link, LinkState::Refused);
    wait_for("member 3 to say why", || {
        view(&three, 1).refused_inbound.is_some()
    });
    let refused = view(&three, 1).refused_inbound.unwrap_or_default();
    assert!(refused.contains(reason), "member 3 says why: {refused}");
    wait_for("member 1 and 3 to reach each other", || {
        view(&one, 3).reachable && view(&three, 1).reachable
    });
    let report = one.handle.report();
    assert_eq!(
        (report.members, report.reachable, report.quorum),
        (3, 2, true)
    );
}

#[test]
fn peers_are_reachable_while_they_talk_and_the_quorum_follows_them() {
    let all = addresses(3);
    let one = start(1, &all, quick_limits());
    let mut others: Vec<Member> = (2..=3).map(|id| start(id, &all, quick_limits())).collect();
    // Nothing is sent between them but keepalives: every peer is reachable all the same.
    wait_for("all three reachable", || one.handle.report().reachable == 3);
    assert!(one.handle.report().quorum);
    for member in &mut others {
        member.stop();
    }
    wait_for("member 1 alone, without a quorum", || {
        let report = one.handle.report();
        report.reachable == 1 && !report.quorum
    });
    let status = view(&one, 2);
    assert_ne!(status.link, LinkState::Connected, "{status:?}");
    assert!(!status.reason.is_empty(), "why: {status:?}");
    let _two = start(2, &all, quick_limits());
    wait_for("member 2 back, and the quorum", || {
        let report = one.handle.report();
        report.reachable == 2 && report.quorum
    });
}

/// Accepts `listener`'s next connection and answers its hello as member `node_id` (accepting
/// it); returns the stream (the dialer's bytes after the hello are left unread).
pub(crate) fn accept_as(listener: &TcpListener, node_id: u64) -> TcpStream {
    use latchkey::cluster::peer::frame::{Reply, Verdict, HELLO_BYTES};
    let (mut stream, _) = listener.accept().expect("member 1 dials");
    let mut hello = [0u8; HELLO_BYTES]; // this build's hello, in its newest version
    stream.read_exact(&mut hello).expect("its hello");
    let reply = Reply {
        version: hello[4], // in the hello's version, as a reader of this build
        verdict: Verdict::Accepted,
        shards: SHARDS,
        node_id,
        identity: IDENTITY,
    };
    stream.write_all(&reply.encode()).expect("reply");
    stream
}

#[test]
fn a_silent_peer_is_unreachable_after_the_window_although_its_connections_are_up() {
    let all = addresses(2);
    // The test plays member 2: it accepts member 1's connection and says hello to member 1,
    // then writes nothing, as a member stopped by SIGSTOP would (its kernel still acks).
    let listener = TcpListener::bind(all[1]).expect("member 2's address");
    let one = start(1, &all, quick_limits());
    let _incoming = accept_as(&listener, 2);
    let mut outgoing = TcpStream::connect(all[0]).expect("connect to member 1");
    outgoing.write_all(&hello_to(1, 2)).expect("hello");
    wait_for("member 2 reachable", || view(&one, 2).reachable);
    let reachable_at = Instant::now();
    wait_for("member 2 unreachable", || !view(&one, 2).reachable);
    let waited = reachable_at.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "not before the window: {waited:?}"
    );
    let status = view(&one, 2);
    assert_eq!(status.link, LinkState::Connected, "TCP is fine: {status:?}");
    // A keepalive makes it reachable again.
    outgoing
        .write_all(&peer::frame::KEEPALIVE)
        .expect("keepalive");
    wait_for("member 2 reachable again", || view(&one, 2).reachable);
}
