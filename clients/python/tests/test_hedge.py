"""Hedged releases and extends against fake cluster members (docs/protocol.md §4.3; the Rust
client's ``Client::exchange_hedged``): with several members, a release or an extend not
answered within the hedge delay also goes to the other members — never back to the silent one,
even when another member names it leader — and the first answer wins. A client of one member
never hedges. The real-cluster cases (a leader paused with SIGSTOP) are in test_cluster.py.

Every member here is scripted, so each case's order of events is forced: the silent member
never answers, a slow one answers after a fixed sleep far past the hedge delay."""

from __future__ import annotations

import threading
import time
from typing import Callable, List

import pytest

import latchkey
from support import PATIENCE, FakeMember, Frame, Reply, id_of, leader_reply, leading, moved, redirect_to

TOKEN = 7
LEASE = 10.0
CONNECT = 0.4  # a hedge delay of 0.1 s (a quarter, within 0.1..=0.5 s)
HEDGE = 0.1
TRANSPORT = 5.0
# "Not too late": an answered hedge returns long before the silent attempt's deadline.
LATE = TRANSPORT - 1.0


def make_client(addrs: List[str]) -> latchkey.Client:
    return latchkey.Client(addrs, sessions=1, connect_timeout=CONNECT, transport_timeout=TRANSPORT)


def frames(member: FakeMember, op: str) -> List[Frame]:
    return [frame for frame in member.received() if frame[0] == op]


def eventually(member: FakeMember, op: str) -> List[Frame]:
    """The ``op`` frames ``member`` received, once there is one (a member's thread records a
    frame a moment after the client sent it)."""
    until = time.monotonic() + PATIENCE
    while not frames(member, op) and time.monotonic() < until:
        time.sleep(0.01)
    return frames(member, op)


def silent(frame: Frame) -> Reply:
    return None


def slow(seconds: float) -> Callable[[Frame], Reply]:
    """Answers as the key's leader, each request ``seconds`` late (blocking that connection)."""

    def script(frame: Frame) -> Reply:
        time.sleep(seconds)
        return leader_reply(frame, TOKEN)

    return script


def test_the_hedge_delay_is_a_quarter_of_the_connect_timeout_within_bounds() -> None:
    from latchkey._client import _hedge_after

    assert _hedge_after(2.0) == 0.5
    assert _hedge_after(1.0) == 0.25
    assert _hedge_after(0.1) == 0.1
    assert _hedge_after(10.0) == 0.5


def test_a_hedged_extend_never_goes_back_to_the_silent_member_even_when_named_leader() -> None:
    """The key's leader falls silent; the other members go on naming it leader for a while
    (their view before the election), then one of them leads. The hedge never sends the extend
    back to the silent member: an M naming it counts as naming none (back off, next member),
    until the new leader answers; the extend returns that answer, long before the silent
    attempt's deadline, and the bound counts from the attempt answered."""
    old = FakeMember(leading(TOKEN))
    follower = FakeMember(redirect_to(old.addr))
    extends = [0]
    lock = threading.Lock()

    def elected_later(frame: Frame) -> Reply:
        # Names the silent member for its first three extends, then leads.
        with lock:
            if frame[0] == "E":
                extends[0] += 1
            seen = extends[0]
        if frame[0] == "E" and seen > 3:
            return leader_reply(frame, TOKEN)
        return moved(id_of(frame), old.addr)

    new = FakeMember(elected_later)
    client = make_client([old.addr, follower.addr, new.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    assert ticket.token == TOKEN
    old.set_script(silent)
    start = time.monotonic()
    assert ticket.extend(LEASE) is True
    returned = time.monotonic()
    assert returned - start < LATE, f"waited for the silent member: {returned - start:.3f} s"
    extend = ("E", int(LEASE), TOKEN, "k")
    assert eventually(old, "E") == [extend], "the silent member got the first attempt only"
    assert frames(new, "E") == [extend] * 4, "three M naming the silent member, then the answer"
    assert frames(follower, "E") and set(frames(follower, "E")) == {extend}
    # The bound counts from the answered attempt, sent after the hedge delay; never late.
    margin = max(0.1, LEASE / 10)
    assert ticket.valid_until >= start + HEDGE + LEASE - margin
    assert ticket.valid_until <= returned + LEASE - margin
    time.sleep(0.3)
    assert frames(old, "E") == [extend], "nothing more reached the silent member"
    client.close()
    for member in (old, follower, new):
        member.stop()


def test_the_hedge_skips_the_member_an_m_sent_the_first_attempt_to() -> None:
    """The first attempt follows an M to a member that is silent: the hedge leaves that
    member alone (not the one the attempt started at) and goes on to the others. (The
    first attempt meets the M and reaches the silent member within milliseconds; the hedge
    delay here is 0.5 s.)"""
    first = FakeMember(leading(TOKEN))
    named = FakeMember(silent)
    other = FakeMember(leading(TOKEN))
    client = latchkey.Client(
        [first.addr, named.addr, other.addr],
        sessions=1,
        connect_timeout=2.0,
        transport_timeout=TRANSPORT,
    )
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    assert frames(first, "A") and not frames(named, "A") and not frames(other, "A")
    first.set_script(redirect_to(named.addr))
    start = time.monotonic()
    assert ticket.extend(LEASE) is True
    assert time.monotonic() - start < LATE
    extend = ("E", int(LEASE), TOKEN, "k")
    assert frames(first, "E") == [extend], "the first attempt started here, and met an M"
    assert eventually(named, "E") == [extend], "the silent member got the first attempt only"
    assert frames(other, "E") == [extend], "the hedge answered"
    time.sleep(0.3)
    assert frames(named, "E") == [extend]
    client.close()
    for member in (first, named, other):
        member.stop()


def test_a_hedged_release_takes_the_first_answer_not_the_slow_members() -> None:
    """The leader answers a release 3 s late; the other member answers at once: the release
    returns that answer (released) without waiting for the slow one, and the slow member's
    late answer, when it comes, changes nothing."""
    leader = FakeMember(leading(TOKEN))
    other = FakeMember(leading(TOKEN))
    client = make_client([leader.addr, other.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    assert frames(leader, "A") and not frames(other, "A")
    leader.set_script(slow(3.0))
    start = time.monotonic()
    assert ticket.release() is True
    assert time.monotonic() - start < 2.5, "it waited for the slow member"
    release = ("R", TOKEN, "k")
    assert eventually(leader, "R") == [release]
    assert frames(other, "R") == [release]
    # The slow answer comes (and is dropped) while another call uses the same session.
    leader.set_script(leading(TOKEN))
    other.set_script(leading(TOKEN))
    time.sleep(max(0.0, start + 3.5 - time.monotonic()))
    assert not client.query("k").held
    client.close()
    leader.stop()
    other.stop()


def test_when_the_first_attempt_answers_first_the_hedge_is_given_up() -> None:
    """The leader answers an extend 1 s late (long after the hedge delay); the other member
    only says "no leader". The extend returns the leader's answer, its bound counts from that
    attempt, and the hedge stops: at most the attempt it had under way still reaches the other
    member, none after it."""
    leader = FakeMember(leading(TOKEN))
    electing = FakeMember(redirect_to(None))
    client = make_client([leader.addr, electing.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    leader.set_script(slow(1.0))
    start = time.monotonic()
    assert ticket.extend(LEASE) is True
    returned = time.monotonic()
    assert returned - start >= 1.0, "answered before the leader answered"
    assert returned - start < LATE
    margin = max(0.1, LEASE / 10)
    # The answered attempt was sent at least 1 s before its answer came.
    assert ticket.valid_until <= returned - 1.0 + LEASE - margin
    hedged = len(frames(electing, "E"))
    # Without giving up, the hedge would try every 250 ms until the 5 s deadline.
    time.sleep(1.5)
    final = frames(electing, "E")
    assert len(final) >= 1, "the extend was hedged"
    assert len(final) <= hedged + 1, final
    assert frames(leader, "E") == [("E", int(LEASE), TOKEN, "k")]
    client.close()
    leader.stop()
    electing.stop()


def test_a_background_release_of_a_late_grant_is_hedged() -> None:
    """A grant that comes after the acquire's deadline is released in the background on its
    own session (§4.2); that member then falls silent, and the release also goes to the other
    member, never back to it."""
    other = FakeMember(leading(TOKEN))

    def late_grant(frame: Frame) -> Reply:
        if frame[0] == "A":
            time.sleep(0.6)  # past the acquire's 0.2 s deadline
            return leader_reply(frame, TOKEN)
        if frame[0] == "R":
            return None  # silent from now on
        return leader_reply(frame, TOKEN)

    leader = FakeMember(late_grant)
    client = make_client([leader.addr, other.addr])
    with pytest.raises(latchkey.Indeterminate):
        client.acquire("k", wait=0.2, lease=LEASE)
    release = ("R", TOKEN, "k")
    until = time.monotonic() + PATIENCE
    while not frames(other, "R") and time.monotonic() < until:
        time.sleep(0.02)
    assert frames(other, "R") == [release], "the background release was hedged"
    assert frames(leader, "R") == [release], "the silent member got it once"
    client.close()
    leader.stop()
    other.stop()


def test_a_client_of_one_member_never_hedges() -> None:
    """One member: the extend waits for that member's (slow) answer, and no hedge starts."""
    only = FakeMember(leading(TOKEN))
    client = make_client([only.addr])
    ticket = client.acquire("k", wait=1.0, lease=LEASE)
    only.set_script(slow(0.5))
    start = time.monotonic()
    assert ticket.extend(LEASE) is True
    assert time.monotonic() - start >= 0.5
    assert ticket.release() is True
    assert frames(only, "E") == [("E", int(LEASE), TOKEN, "k")]
    assert frames(only, "R") == [("R", TOKEN, "k")]
    assert client._hedger._thread is None, "no hedge was scheduled"
    client.close()
    only.stop()
