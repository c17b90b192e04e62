"""The client against fake cluster members: following ``M`` to the named leader, the leader
cache, backing off when no leader is known, a redirect loop that ends, and never resending
what may have been sent — a case-by-case mirror of tests/client_redirects.rs (its client
parts; the command-line cases are the Rust CLI's own)."""

from __future__ import annotations

import threading
import time
from typing import List

import pytest

import latchkey
from support import (
    FakeMember,
    Frame,
    assert_between,
    dead_addr,
    leader_reply,
    leading,
    one_cluster,
    redirect_to,
    resp,
)

LEASE = 10.0
TRANSPORT = 2.0


def make_client(addrs: List[str], connect: float = 2.0) -> latchkey.Client:
    return latchkey.Client(addrs, sessions=1, connect_timeout=connect, transport_timeout=TRANSPORT)


def acquires(member: FakeMember) -> List[int]:
    return [frame[1] for frame in member.received() if frame[0] == "A"]


def test_an_acquire_follows_one_moved_to_the_named_leader_and_remembers_it() -> None:
    """client_redirects.rs an_acquire_follows_one_moved_to_the_named_leader_and_remembers_it"""
    leader = FakeMember(leading(77))
    follower = FakeMember(redirect_to(leader.addr))
    client = make_client([follower.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    assert ticket.token == 77
    asked, granted = acquires(follower), acquires(leader)
    assert len(asked) == 1
    assert granted == asked, "the same owner goes to the leader"
    seen = len(follower.received())
    again = client.acquire("k", wait=0, lease=LEASE)
    assert again.token == 77
    assert len(acquires(leader)) == 2
    assert len(follower.received()) == seen, "the follower saw nothing new"
    client.close()


def test_moved_without_a_leader_backs_off_and_another_member_grants() -> None:
    """client_redirects.rs moved_without_a_leader_backs_off_and_another_member_grants"""
    electing = FakeMember(redirect_to(None))
    leader = FakeMember(leading(5))
    client = make_client([electing.addr, leader.addr])
    start = time.monotonic()
    ticket = client.acquire("k", wait=2.0, lease=LEASE)
    assert_between(time.monotonic() - start, 0.010, 2.0)
    assert ticket.token == 5
    asked = acquires(electing)
    assert len(asked) == 1
    assert acquires(leader) == asked, "the same owner, sent again after the M"
    client.close()


def test_a_redirect_loop_ends_with_bounded_redirects() -> None:
    """client_redirects.rs a_redirect_loop_ends_with_bounded_redirects"""
    a = FakeMember(redirect_to(None))
    b = FakeMember(redirect_to(a.addr))
    a.set_script(redirect_to(b.addr))
    client = make_client([a.addr])
    wait = 3.0
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=wait, lease=LEASE)
    assert time.monotonic() - start <= wait + TRANSPORT, "ends by the deadline"
    assert f"{latchkey.REDIRECTS_MAX} redirects followed" in str(raised.value)
    to_a, to_b = acquires(a), acquires(b)
    assert len(to_a) + len(to_b) == latchkey.REDIRECTS_MAX + 1
    assert all(owner == to_a[0] for owner in to_a + to_b)
    with pytest.raises(latchkey.Unavailable):
        client.query("k")
    client.close()


def test_a_query_follows_moved() -> None:
    """client_redirects.rs a_query_follows_moved"""
    leader = FakeMember(leading(1))
    follower = FakeMember(redirect_to(leader.addr))
    client = make_client([follower.addr])
    state = client.query("q")
    assert not state.held
    asked, answered = follower.received(), leader.received()
    assert (len(asked), len(answered)) == (1, 1)
    assert asked == answered, "the same nonce"
    assert answered[0][0] == "Q"
    client.close()


def test_extend_and_release_follow_moved_after_a_leader_change() -> None:
    """client_redirects.rs extend_and_release_follow_moved_after_a_leader_change"""
    first = FakeMember(leading(9))
    second = FakeMember(redirect_to(first.addr))
    client = make_client([second.addr, first.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    assert (len(acquires(second)), len(acquires(first))) == (1, 1)
    second.set_script(leading(9))
    first.set_script(redirect_to(second.addr))
    assert ticket.extend(LEASE) is True
    extend = ("E", 10, 9, "k")
    assert first.received()[-1] == extend
    assert second.received()[-1] == extend
    first.set_script(leading(9))
    second.set_script(redirect_to(first.addr))
    assert ticket.release() is True
    release = ("R", 9, "k")
    assert second.received()[-1] == release
    assert first.received()[-1] == release
    client.close()


def test_an_acquire_that_may_have_been_sent_is_never_sent_to_another_member() -> None:
    """client_redirects.rs an_acquire_that_may_have_been_sent_is_never_sent_to_another_member"""
    closer = FakeMember(lambda frame: "close")
    leader = FakeMember(leading(3))
    client = make_client([closer.addr, leader.addr])
    with pytest.raises(latchkey.Indeterminate):
        client.acquire("k", wait=1.0, lease=LEASE)
    owner = acquires(closer)
    assert len(owner) == 1
    time.sleep(0.3)
    received = leader.received()
    assert all(
        frame[1] != owner[0] for frame in received if frame[0] in ("A", "C")
    ), f"the owner reached another member: {received}"
    client.close()


def test_an_unreachable_member_is_skipped_for_the_next() -> None:
    """client_redirects.rs an_unreachable_member_is_skipped_for_the_next"""
    leader = FakeMember(leading(11))
    client = make_client([dead_addr(), leader.addr])
    assert client.acquire("k", wait=2.0, lease=LEASE).token == 11
    client.close()


def test_a_single_address_sees_one_request_per_call() -> None:
    """client_redirects.rs a_single_address_sees_one_request_per_call"""
    only = FakeMember(lambda frame: leader_reply(frame, 2))
    client = make_client([only.addr])
    for key in ["a", "b", "c"]:
        client.query(key)
    assert len(only.received()) == 3
    client.close()


def test_a_paused_member_gets_only_the_handshake_ping_and_the_next_one_serves() -> None:
    """client_redirects.rs a_paused_member_gets_only_the_handshake_ping_and_the_next_one_serves"""
    paused = FakeMember(leading(1))
    paused.paused = True

    def script(frame: Frame) -> bytes:
        if frame[0] == "A":
            return resp("T", frame[1])
        reply = leader_reply(frame, 2)
        assert isinstance(reply, bytes)
        return reply

    leader = FakeMember(script)
    # (The paused member never answers its card: the leader's card vouches for it.)
    one_cluster([paused, leader])
    connect = 0.4
    start = time.monotonic()
    client = make_client([paused.addr, leader.addr], connect=connect)
    with pytest.raises(latchkey.Timeout):
        client.acquire("k", wait=0, lease=LEASE)
    assert_between(time.monotonic() - start, connect, connect + 3.0)
    assert paused.handshakes == 1
    assert paused.received() == [], "nothing but the handshake ping reached it"
    assert len(acquires(leader)) == 1
    assert not client.query("q").held
    client.ping()
    assert paused.received() == []
    client.close()


def test_a_member_that_stops_answering_stops_taking_calls() -> None:
    """client_redirects.rs a_member_that_stops_answering_stops_taking_calls"""
    silent = FakeMember(lambda frame: None)
    leader = FakeMember(leading(8))
    client = make_client([silent.addr, leader.addr], connect=0.3)
    with pytest.raises(latchkey.NoAnswer):
        client.query("first")
    assert len(silent.received()) == 1, "the query went to the silent member"
    for key in ["a", "b", "c", "d"]:
        assert client.acquire(key, wait=0, lease=LEASE).token == 8
    assert len(silent.received()) == 1, f"nothing more reached it: {silent.received()}"
    assert len(acquires(leader)) == 4
    client.close()


def test_an_acquire_that_met_only_no_leader_is_unavailable_and_says_so() -> None:
    """client_redirects.rs an_acquire_that_met_only_no_leader_is_unavailable_and_says_so"""
    electing = FakeMember(redirect_to(None))
    dead1, dead2 = dead_addr(), dead_addr()
    client = make_client([electing.addr, dead1, dead2])
    wait = 0.8
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=wait, lease=LEASE)
    assert_between(time.monotonic() - start, wait, wait + TRANSPORT)
    text = str(raised.value)
    assert text.startswith("k: no leader for this key: 1 of 3 members reachable, no quorum ("), text
    assert f"{dead1}: unreachable: cannot connect" in text, text
    with pytest.raises(latchkey.Unavailable):
        client.query("k")
    client.close()


def test_an_acquire_that_met_a_leaders_timeout_is_a_timeout() -> None:
    """client_redirects.rs an_acquire_that_met_a_leaders_timeout_is_a_timeout"""
    electing = FakeMember(redirect_to(None))
    leader = FakeMember(lambda frame: resp("T", frame[1]) if frame[0] == "A" else None)
    client = make_client([electing.addr, leader.addr])
    with pytest.raises(latchkey.Timeout):
        client.acquire("k", wait=0.8, lease=LEASE)
    assert len(acquires(leader)) == 1
    client.close()


def test_a_named_leader_that_cannot_be_reached_is_unavailable_and_named() -> None:
    """client_redirects.rs a_named_leader_that_cannot_be_reached_is_unavailable_and_named"""
    gone = dead_addr()
    follower = FakeMember(redirect_to(gone))
    client = make_client([follower.addr])
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=0.6, lease=LEASE)
    text = str(raised.value)
    assert text.startswith(
        f"k: the key's leader {gone} (named by {follower.addr}) cannot be reached: "
        "unreachable: cannot connect"
    ), text
    client.close()


def test_a_waiter_whose_leader_goes_silent_asks_another_member_first() -> None:
    """client_redirects.rs a_waiter_whose_leader_goes_silent_asks_another_member_first: the
    session of a waiter at a paused leader closes once its probe goes unanswered, and the
    Resolve goes first to a member other than the silent one — not to a new session there that
    would wait out its handshake (the connect timeout) — even when the route names it (A is
    listed first: once the key's leader is forgotten, the route is the first member). Before,
    the Resolve went there first."""
    a = FakeMember(lambda frame: None)
    c = FakeMember(redirect_to(a.addr))
    b = FakeMember(redirect_to(a.addr))
    for member in (c, a, b):
        member.identifies = True
    client = make_client([a.addr, c.addr, b.addr])
    result: List[object] = []
    waiter = threading.Thread(target=lambda: result.append(client.acquire("k", wait=20.0, lease=LEASE)))
    waiter.start()
    deadline = time.monotonic() + 5
    while not acquires(a) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(acquires(a)) == 1, f"queued at A: {a.received()}"
    # A is paused from now on; B leads the key and never saw the acquire.
    a.paused = True

    def new_leader(frame: Frame) -> bytes:
        if frame[0] == "W":
            return resp("W", frame[1], 0, 0, 0)  # never seen
        reply = leader_reply(frame, 91)
        assert isinstance(reply, bytes)
        return reply

    b.set_script(new_leader)
    c.set_script(redirect_to(b.addr))
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    ticket = result[0]
    assert isinstance(ticket, latchkey.Ticket), ticket
    assert ticket.token == 91
    assert a.handshakes == 1, "no new session to the silent member"
    ticket.release()
    client.close()
