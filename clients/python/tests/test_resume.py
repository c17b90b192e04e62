"""Resumable calls (docs/protocol.md §4.1, §5): every session identifies; an acquire whose
identified session fails after it may have been sent is *resolved* on another session (never
sent again), and releases and extends are sent again.

The first half runs the real single node behind the fault proxy, mirroring the cut tests of
tests/client_faults.rs (the Rust test of the same name is named in each docstring); the second
half forces each fate and each refusal by hand with a scripted server. "Never early" is strict,
"not too late" generous (a shared, noisy 2-CPU machine)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Iterator, Optional, Tuple

import pytest

import latchkey
import latchkey.aio
from support import (
    HELLO,
    PATIENCE,
    FakeConn,
    FakeServer,
    Proxy,
    Server,
    assert_between,
    moved,
    one_cluster,
    resp,
)

LATE = 3.0
LEASE = 30.0


def make_client(addr: str, transport: float = 1.0, **options: Any) -> latchkey.Client:
    """One session (so that the proxy's "next connection" is the one the call goes to)."""
    return latchkey.Client(addr, sessions=1, connect_timeout=2.0, transport_timeout=transport, **options)


def freed_within(observer: latchkey.Client, key: str, within: float) -> Optional[float]:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if not observer.query(key).held:
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def acquire_bytes(key: str) -> int:
    return 12 + len(key.encode())


@pytest.fixture
def proxy(server: Server) -> Iterator[Proxy]:
    p = Proxy(server.addr)
    yield p
    p.stop()


class Background:
    """``client.acquire(key, wait)`` on a thread: its ticket or error, and how long it took."""

    def __init__(self, client: latchkey.Client, wait: float, key: str = "k", lease: float = LEASE) -> None:
        self.result: Any = None
        self.elapsed = 0.0

        def run() -> None:
            start = time.monotonic()
            try:
                self.result = client.acquire(key, wait=wait, lease=lease)
            except latchkey.Error as error:
                self.result = error
            self.elapsed = time.monotonic() - start

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Tuple[Any, float]:
        self.thread.join(PATIENCE + 10)
        assert not self.thread.is_alive(), "the call never ended"
        return self.result, self.elapsed


# ---------------------------------------------------------------------------------------------
# The real server behind the fault proxy


def test_a_cut_after_a_partial_frame_is_resolved_never_seen_and_acquired_anew(proxy: Proxy, observer: latchkey.Client) -> None:
    """client_faults.rs a_cut_after_a_partial_frame_is_resolved_never_seen_and_acquired_anew"""
    proxy.cut_next(HELLO + 5)  # the handshake, then 5 bytes of the acquire: nothing executes
    client = make_client(proxy.addr)
    ticket = client.acquire("cut", wait=2.0, lease=LEASE)
    acquires = proxy.acquires()
    # The half-sent acquire was asked about ("never seen", so never to be executed) and never
    # sent again: the one whole acquire that reached the server is a new one, under a new
    # owner. (The proxy counts a frame it read whole even if it forwarded only 5 bytes.)
    assert all(count == 1 for count in acquires.values()), acquires
    assert 1 <= len(acquires) <= 2, acquires
    assert list(proxy.resolves.values()) == [1], proxy.resolves
    assert ticket.token not in proxy.resolves
    assert observer.query("cut").held
    assert ticket.release() is True
    assert freed_within(observer, "cut", LATE) is not None, "no ghost hold"
    client.close()


def test_a_cut_after_the_whole_frame_is_resolved_to_the_grant_it_made(proxy: Proxy, observer: latchkey.Client) -> None:
    """client_faults.rs a_cut_after_the_whole_frame_is_resolved_to_the_grant_it_made"""
    proxy.cut_next(HELLO + acquire_bytes("cut-whole"))
    client = make_client(proxy.addr)
    ticket = client.acquire("cut-whole", wait=2.0, lease=LEASE)
    # Sent once; its grant, made while the answer could not reach the client, is the ticket's.
    acquires = proxy.acquires()
    assert list(acquires.values()) == [1], acquires
    assert proxy.resolves == {owner: 1 for owner in acquires}, "resolved once, by its owner"
    # The bound counts from the Resolve's send instant and the lease left (≤ 30 s), minus 3 s.
    assert time.monotonic() + 20.0 < ticket.valid_until <= time.monotonic() + 27.0
    assert observer.query("cut-whole").held
    assert ticket.release() is True
    assert not observer.query("cut-whole").held, "no ghost hold"
    client.close()


def test_a_waiter_whose_session_is_cut_keeps_its_place_and_is_granted_on_the_next(proxy: Proxy, observer: latchkey.Client) -> None:
    """client_faults.rs a_waiter_whose_session_is_cut_keeps_its_place_and_is_granted_on_the_next"""
    holder = observer.acquire("cut-queued", wait=0.1, lease=LEASE)
    # The whole acquire goes up and queues; the session dies before anything comes back.
    proxy.cut_next(HELLO + acquire_bytes("cut-queued"))
    client = make_client(proxy.addr)
    acquiring = Background(client, 5.0, "cut-queued")
    # Its place is kept: the queue still has it while the client resolves it elsewhere.
    time.sleep(0.6)
    assert observer.query("cut-queued").waiters == 1
    assert len(proxy.resolves) == 1
    holder.release()
    ticket, elapsed = acquiring.join()
    assert isinstance(ticket, latchkey.Ticket), f"granted on the next session, not {ticket!r}"
    assert elapsed < 5.0
    assert list(proxy.acquires().values()) == [1]
    assert proxy.connections == 2
    assert observer.query("cut-queued").held
    assert ticket.release() is True
    assert freed_within(observer, "cut-queued", LATE) is not None
    client.close()


def test_a_waiter_resolved_queued_is_cancelled_on_its_new_session_at_the_deadline(proxy: Proxy, observer: latchkey.Client) -> None:
    """Beyond client_faults.rs: the waiter found queued keeps the call's deadline; at it, the
    Cancel of §4.4 goes to the session that resolved it, and the Timeout is definitive."""
    holder = observer.acquire("cut-cancel", wait=0.1, lease=LEASE)
    proxy.cut_next(HELLO + acquire_bytes("cut-cancel"))
    client = make_client(proxy.addr)
    start = time.monotonic()
    with pytest.raises(latchkey.Timeout):
        client.acquire("cut-cancel", wait=1.2, lease=LEASE)
    assert_between(time.monotonic() - start, 1.2, 1.2 + LATE)
    owners = list(proxy.acquires())
    assert len(owners) == 1 and proxy.cancels == {owners[0]: 1}, "cancelled once, on the new session"
    assert observer.query("cut-cancel").waiters == 0, "nothing left queued"
    assert proxy.connections == 2
    holder.release()
    client.close()


def test_a_timeout_lost_with_its_session_is_still_a_timeout(proxy: Proxy, observer: latchkey.Client) -> None:
    """client_faults.rs a_timeout_lost_with_its_session_is_still_a_timeout"""
    holder = observer.acquire("cut-timeout", wait=0.1, lease=LEASE)
    proxy.cut_next(HELLO + acquire_bytes("cut-timeout"))
    client = make_client(proxy.addr)
    # A wait-0 acquire on a held key: its T is lost with the session, and the Resolve says so.
    # Nothing is sent again (a wait-0 acquire is one attempt).
    with pytest.raises(latchkey.Timeout):
        client.acquire("cut-timeout", wait=0, lease=LEASE)
    assert list(proxy.acquires().values()) == [1]
    assert len(proxy.resolves) == 1
    holder.release()
    client.close()


def test_a_busy_lost_with_its_session_is_still_busy() -> None:
    """Beyond client_faults.rs: a queue of one (limits.max_waiters_per_key = 1) already full, so
    the acquire is answered B; the B is lost with the session, and the Resolve says busy."""
    server = Server(config="[limits]\nmax_waiters_per_key = 1\n")
    proxy = Proxy(server.addr)
    observer = latchkey.Client(server.text, sessions=1, transport_timeout=2.0)
    try:
        holder = observer.acquire("cut-busy", wait=0, lease=LEASE)
        waiter = Background(observer, 3.0, "cut-busy")
        until = time.monotonic() + PATIENCE
        while observer.query("cut-busy").waiters != 1:
            assert time.monotonic() < until, "the first waiter never queued"
            time.sleep(0.01)
        proxy.cut_next(HELLO + acquire_bytes("cut-busy"))
        client = make_client(proxy.addr)
        with pytest.raises(latchkey.Busy):
            client.acquire("cut-busy", wait=2.0, lease=LEASE)
        assert list(proxy.acquires().values()) == [1]
        assert len(proxy.resolves) == 1
        client.close()
        holder.release()
        ticket, _ = waiter.join()
        assert isinstance(ticket, latchkey.Ticket)
        ticket.release()
    finally:
        observer.close()
        proxy.stop()
        server.stop()


def test_a_release_cut_mid_frame_is_sent_again_and_releases(proxy: Proxy, observer: latchkey.Client) -> None:
    """§4.3: a release names a token and is safe to send again; the one whose session was cut
    after 5 of its bytes goes to the next session and is answered there."""
    key = "cut-release"
    proxy.cut_next(HELLO + acquire_bytes(key) + 5)
    client = make_client(proxy.addr)
    ticket = client.acquire(key, wait=1.0, lease=LEASE)
    assert ticket.release() is True, "released on the second session"
    assert proxy.releases == {ticket.token: 2}
    assert not observer.query(key).held, "no ghost hold"
    assert list(proxy.acquires().values()) == [1]
    client.close()


def test_a_release_cut_after_the_whole_frame_leaves_no_hold(proxy: Proxy, observer: latchkey.Client) -> None:
    """The whole release reached the server, its answer did not: sent again, it is answered
    (N, as the first one released it: reported as not held, which the docs say is ambiguous),
    and the key is free at once, not at the end of its lease."""
    key = "cut-release-whole"
    proxy.cut_next(HELLO + acquire_bytes(key) + 10 + len(key))
    client = make_client(proxy.addr)
    ticket = client.acquire(key, wait=1.0, lease=LEASE)
    assert ticket.release() in (True, False)  # answered: no NoAnswer
    assert proxy.releases == {ticket.token: 2}
    assert not observer.query(key).held, "no ghost hold"
    client.close()


def test_an_extend_cut_mid_frame_is_sent_again_and_confirmed(proxy: Proxy, observer: latchkey.Client) -> None:
    """§4.3: an extend executed twice counts its lease from the later; the one whose session
    was cut goes to the next session, and the bound counts from the attempt answered."""
    key = "cut-extend"
    proxy.cut_next(HELLO + acquire_bytes(key) + 5)
    client = make_client(proxy.addr)
    ticket = client.acquire(key, wait=1.0, lease=5.0)
    before = time.monotonic()
    assert ticket.extend(20.0) is True
    after = time.monotonic()
    assert before + 20.0 - 2.0 <= ticket.valid_until <= after + 20.0 - 2.0
    assert proxy.extends == {ticket.token: 2}
    assert observer.query(key).lease_ms > 15_000
    assert ticket.release() is True
    client.close()


def test_lock_keeps_its_lock_across_a_cut_of_a_keep_alive_extend(proxy: Proxy, observer: latchkey.Client) -> None:
    """The keep-alive of ``lock()`` (every lease/3) meets a cut mid-frame: its extend is sent
    again on the next session, and the block ends with the lock kept (no LockLost)."""
    key = "cut-keep"
    proxy.cut_next(HELLO + acquire_bytes(key) + 5)
    client = make_client(proxy.addr)
    with client.lock(key, wait=1.0, lease=3.0) as ticket:
        time.sleep(2.5)  # extends at about 1 s and 2 s; the first is cut
        assert not ticket.lost.is_set()
        assert observer.query(key).held
    assert proxy.extends.get(ticket.token, 0) >= 2
    assert proxy.connections == 2
    assert not observer.query(key).held
    client.close()


def test_without_resuming_the_session_does_not_identify_and_a_cut_is_indeterminate(proxy: Proxy, observer: latchkey.Client) -> None:
    """client_faults.rs without_resuming_a_cut_after_the_whole_frame_is_indeterminate_and_the_lease_recovers_it,
    with the proxy's count of Identify frames: ``resume=None`` keeps to §4 alone."""
    proxy.cut_next(10 + acquire_bytes("cut-off"))
    client = make_client(proxy.addr, resume=None)
    with pytest.raises(latchkey.Indeterminate):
        client.acquire("cut-off", wait=1.0, lease=1.0)
    assert list(proxy.acquires().values()) == [1]
    assert proxy.identifies == 0 and not proxy.resolves
    assert freed_within(observer, "cut-off", 1.0 + LATE) is not None, "the lease recovers it"
    client.close()


# ---------------------------------------------------------------------------------------------
# Scripted servers: each fate, each refusal


def cut_after_acquire(server: FakeServer, client: latchkey.Client, wait: float, key: str = "k") -> Tuple[Background, int]:
    """An identified session takes the acquire and dies unanswered: the call and its owner."""
    conn = server.accept(identify=True)
    call = Background(client, wait, key)
    owner, _, _, got = conn.acquire()
    assert got == key
    conn.close()
    return call, owner


def next_resolve(server: FakeServer, owner: int, key: str = "k") -> FakeConn:
    conn = server.accept(identify=True)
    assert conn.frame() == ("W", owner, key), "a Resolve, not the acquire again"
    return conn


def test_every_session_identifies_with_one_client_id_and_the_grace() -> None:
    fake = FakeServer()
    client = latchkey.Client(fake.addr, sessions=2, resume=3.2)
    first, second = fake.accept(identify=True), fake.accept(identify=True)
    assert first.identify is not None and second.identify is not None
    assert first.identify[2] == second.identify[2] == 4, "the grace, rounded up to whole seconds"
    assert first.identify[3] == second.identify[3] != 0, "one client id per client, never 0"
    assert first.identify[3] < 1 << 128
    other = latchkey.Client(fake.addr, sessions=1)
    third = fake.accept(identify=True)
    assert third.identify is not None and third.identify[2] == 10, "10 s by default"
    assert third.identify[3] != first.identify[3], "a new client, a new id"
    client.close()
    other.close()
    fake.close()


def test_resume_is_checked() -> None:
    for bad in (0, -1.0, 60.5, float("nan")):
        with pytest.raises(ValueError):
            latchkey.Client("127.0.0.1:1", resume=bad)
    with pytest.raises(TypeError):
        latchkey.Client("127.0.0.1:1", resume="10")  # type: ignore[arg-type]
    client = latchkey.Client("127.0.0.1:1", resume=60)
    assert client.resume == 60.0
    client.close()
    client = latchkey.Client("127.0.0.1:1", resume=None)
    assert client.resume is None
    client.close()


def test_a_server_that_does_not_know_identify_closes_and_the_client_stops_identifying() -> None:
    """§4.1: X 1 to the Identify (and the close): no later session of the client identifies,
    and the call goes on, unsent, on the next session."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    conn = fake.accept_raw()
    assert conn is not None
    frame = conn.frame()
    assert frame[0] == "I", f"the handshake starts with the Identify, not {frame}"
    call = Background(client, 2.0)
    conn.send(resp("X", 1, 0))
    conn.close()
    plain = fake.accept_raw()
    assert plain is not None
    ping = plain.frame()
    assert ping[0] == "P", f"the next session does not identify: {ping}"
    plain.send(resp("P", ping[1]))
    owner, wait_s, _, _ = plain.acquire()
    assert wait_s == 2, "the same call, unsent until now"
    plain.send(resp("A", owner, 77))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 77
    plain.close()
    # Off for every later session: pings after that close (the first may still meet the
    # closing session) go on a new one, which does not identify either.
    stop = threading.Event()

    def pinging() -> None:
        while not stop.is_set():
            _ignore(client.ping)
            time.sleep(0.05)

    pinger = threading.Thread(target=pinging, daemon=True)
    pinger.start()
    later = fake.accept_raw()
    assert later is not None
    assert later.frame()[0] == "P"
    stop.set()
    client.close()
    pinger.join(PATIENCE)
    fake.close()


def test_a_session_not_identified_keeps_to_section_4_a_cut_is_indeterminate() -> None:
    """X 9 to the Identify (a server that does not resume calls, such as a cluster member of
    this version): the session goes on, not identified, and an acquire whose session fails
    after it was sent is Indeterminate — nothing is asked, nothing sent again."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=1.0)
    conn = fake.accept()  # refuses the Identify: X 9
    assert conn.identify is not None
    call = Background(client, 2.0)
    conn.acquire()
    conn.close()
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    later = fake.try_accept(0.3)
    if later is not None:
        assert later.read_frame(0.3) == "quiet", "no Resolve, no resend"
    client.close()
    fake.close()


@pytest.mark.parametrize(
    "fate, expected",
    [(3, latchkey.Timeout), (4, latchkey.Busy)],
    ids=["timed-out", "busy"],
)
def test_a_resolved_timeout_or_busy_is_definitive(fate: int, expected: type) -> None:
    fake = FakeServer()
    client = make_client(fake.addr)
    call, owner = cut_after_acquire(fake, client, 2.0)
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, fate, 0, 0))
    result, _ = call.join()
    assert isinstance(result, expected), result
    assert conn.read_frame(0.2) == "quiet", "nothing sent again"
    client.close()
    fake.close()


def test_never_seen_with_time_left_is_a_new_acquire_under_a_new_owner() -> None:
    fake = FakeServer()
    client = make_client(fake.addr)
    call, owner = cut_after_acquire(fake, client, 3.0)
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, 0, 0, 0))
    again, wait_s, _, key = conn.acquire()
    assert again != owner, "a new acquire, under a new owner"
    assert key == "k" and 1 <= wait_s <= 3, "within the same deadline"
    conn.send(resp("A", again, 55))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 55
    client.close()
    fake.close()


def test_never_seen_at_the_deadline_is_a_timeout_and_nothing_is_sent() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 0.5)
    conn = next_resolve(fake, owner)
    time.sleep(0.7)  # past the call's deadline: the Resolve still has its transport allowance
    conn.send(resp("W", owner, 0, 0, 0))
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Timeout), result
    assert elapsed >= 0.5
    assert conn.read_frame(0.3) == "quiet", "no new acquire after the deadline"
    client.close()
    fake.close()


def test_a_grant_resolved_in_time_has_its_bound_from_the_resolve_and_the_lease_left() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 2.0)
    before = time.monotonic()
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, 1, 91, 5000))
    ticket, _ = call.join()
    after = time.monotonic()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 91
    # Sent between before and after; 5 s of lease left, minus the margin of a 30 s lease (3 s).
    assert before + 2.0 <= ticket.valid_until <= after + 2.0
    client.close()
    fake.close()


def test_a_grant_resolved_after_the_deadline_is_released_and_indeterminate() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 0.5)
    conn = next_resolve(fake, owner)
    time.sleep(0.7)
    conn.send(resp("W", owner, 1, 91, 29000))
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert conn.frame() == ("R", 91, "k"), "that exact token, released at once"
    client.close()
    fake.close()


def test_a_resolve_answered_with_an_error_is_indeterminate() -> None:
    fake = FakeServer()
    client = make_client(fake.addr)
    call, owner = cut_after_acquire(fake, client, 2.0)
    conn = next_resolve(fake, owner)
    conn.send(resp("X", 10, owner))  # the server's records for this client are full
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert conn.read_frame(0.2) == "quiet"
    client.close()
    fake.close()


def test_a_resolve_whose_session_fails_is_asked_again_on_the_next() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 3.0)
    next_resolve(fake, owner).close()
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, 1, 91, 29000))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 91
    client.close()
    fake.close()


def test_no_session_answering_the_resolve_in_time_is_indeterminate() -> None:
    """The Resolve is tried until the call's deadline (or one transport timeout after the
    failure, if later), never past it; then Indeterminate."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=1.0)
    call, owner = cut_after_acquire(fake, client, 1.5)
    failed = time.monotonic()
    conn = next_resolve(fake, owner)  # and never answered
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert_between(time.monotonic() - failed, 1.0, 1.5 + LATE)
    assert conn.expect_eof(PATIENCE) == [], "its session is closed: nothing else is sent"
    client.close()
    fake.close()


def frame_after_probes(conn: FakeConn) -> Any:
    """The next frame that is not a probe, answering the probes before it: a waiter on an
    identified session pings its server after a quiet quarter of the connect timeout."""
    while True:
        frame = conn.frame()
        if frame[0] != "P":
            return frame
        conn.send(resp("P", frame[1]))


def test_a_waiter_resolved_queued_waits_there_and_is_cancelled_there_at_the_deadline() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    start = time.monotonic()
    call, owner = cut_after_acquire(fake, client, 1.0)
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, 2, 0, 0))
    frame = frame_after_probes(conn)
    assert frame == ("C", owner, "k"), "its Cancel goes to the session that resolved it"
    assert time.monotonic() - start >= 1.0, "never before the deadline"
    conn.send(resp("T", owner))
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Timeout), result
    assert_between(elapsed, 1.0, 1.0 + LATE)
    client.close()
    fake.close()


def test_a_waiter_resolved_queued_after_the_deadline_is_cancelled_there_at_once() -> None:
    """The Resolve of an acquire whose deadline passed (it has a transport timeout more) finds
    it still queued: the Cancel goes out on that session at once, and its T is definitive."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 0.5)
    conn = next_resolve(fake, owner)
    time.sleep(0.7)
    conn.send(resp("W", owner, 2, 0, 0))
    assert conn.frame() == ("C", owner, "k")
    conn.send(resp("T", owner))
    result, _ = call.join()
    assert isinstance(result, latchkey.Timeout), result
    client.close()
    fake.close()


def test_a_waiter_resolved_queued_is_granted_there() -> None:
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 3.0)
    conn = next_resolve(fake, owner)
    conn.send(resp("W", owner, 2, 0, 0))
    time.sleep(0.2)
    before = time.monotonic()
    conn.send(resp("A", owner, 93))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 93
    assert ticket.valid_until >= before + LEASE - 3.0, "from the instant its A was read"
    client.close()
    fake.close()


def test_a_background_release_whose_session_fails_goes_to_another() -> None:
    """A grant found after the deadline is released in the background; the session that
    takes that release fails: the release goes to the next session (§4.3)."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    call, owner = cut_after_acquire(fake, client, 0.5)
    conn = next_resolve(fake, owner)
    time.sleep(0.7)
    conn.send(resp("W", owner, 1, 91, 29000))
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert conn.frame() == ("R", 91, "k")
    conn.close()  # unanswered
    again = fake.accept(identify=True)
    assert again.frame() == ("R", 91, "k"), "the same release, on the next session"
    again.send(resp("R", 91))
    client.close()
    fake.close()


def test_a_resolve_answered_m_follows_it_to_the_leader_named() -> None:
    """With a cluster, the Resolve goes to the member that leads the key now (docs/protocol.md
    §4.1), asked first of a member other than the one whose session failed: that member answers
    it ``M`` naming the first (which still leads the key: only the connection was cut), and the
    Resolve — not the acquire — goes back to it, which finds the grant."""
    first, second = FakeServer(), FakeServer()
    one_cluster([first, second])
    client = latchkey.Client([first.addr, second.addr], sessions=1, connect_timeout=2.0, transport_timeout=2.0)
    call, owner = cut_after_acquire(first, client, 5.0)
    asked = next_resolve(second, owner)
    asked.send(moved(owner, first.addr))
    leader = next_resolve(first, owner)
    leader.send(resp("W", owner, 1, 66, 29000))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 66
    assert asked.read_frame(0.3) == "quiet" and leader.read_frame(0.3) == "quiet", "no acquire again"
    client.close()
    first.close()
    second.close()


# ---------------------------------------------------------------------------------------------
# Probes: a waiter on a server gone silent (paused) moves on (the Rust client's
# pipeline/link.rs "Probes"; make_client's connect timeout of 2 s: a probe after 0.5 s without
# a read, the session closed 1 s after an unanswered probe).

CONNECT = 2.0
QUIET = CONNECT / 4
ANSWER = CONNECT / 2


def test_a_waiter_on_a_server_gone_silent_probes_it_and_is_resolved_on_a_new_session() -> None:
    """An identified session whose server stops answering once the acquire is queued: a ``P``
    of the session's own after a quarter of the connect timeout without a read (never before);
    unanswered, the session closes at the probe + half the connect timeout (never before), and the
    acquire is resolved on a new session — never sent again. The new session, carrying the
    waiter the Resolve found queued, probes in turn."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    conn = fake.accept_raw()
    assert conn is not None
    hello = conn.handshake(identify=True)
    start = time.monotonic()
    call = Background(client, 20.0)
    owner, wait_s, _, _ = conn.acquire()
    assert wait_s == 20
    probe = conn.frame()
    probed = time.monotonic()
    assert probe[0] == "P" and probe[1] != hello, f"a probe of its own, not {probe}"
    assert_between(probed - start, QUIET, QUIET + LATE)
    assert conn.expect_eof(ANSWER + LATE + QUIET) == [], "nothing after the probe"
    assert_between(time.monotonic() - start, QUIET + ANSWER, QUIET + ANSWER + LATE)
    resolved = next_resolve(fake, owner)
    queued = time.monotonic()
    resolved.send(resp("W", owner, 2, 0, 0))  # queued: it now waits on this session
    again = resolved.frame()
    assert again[0] == "P" and again[1] != probe[1], f"the new session probes too, not {again}"
    assert_between(time.monotonic() - queued, QUIET, QUIET + LATE)
    resolved.send(resp("P", again[1]))
    resolved.send(resp("A", owner, 61))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 61
    assert resolved.read_frame(QUIET + 0.5) == "quiet", "no acquire again, no probe without a waiter"
    client.close()
    fake.close()


def test_a_waiter_whose_server_answers_the_probes_keeps_waiting_and_is_granted() -> None:
    """A live server answers each probe: every read restarts the quiet time (the next probe
    comes a quarter of the connect timeout after the pong, never before), a pong later than
    that but within half the connect timeout closes nothing, and the waiter keeps its place on the
    same session until its grant."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    conn = fake.accept(identify=True)
    call = Background(client, 20.0)
    owner = conn.acquire()[0]
    nonces = set()
    answered: Optional[float] = None
    for index in range(4):
        probe = conn.frame()
        assert probe[0] == "P", f"a probe, not {probe}"
        if answered is not None:
            assert_between(time.monotonic() - answered, QUIET, QUIET + LATE)
        nonces.add(probe[1])
        if index == 1:
            time.sleep(ANSWER * 0.5)  # a slow pong, within half the connect timeout
        answered = time.monotonic()
        conn.send(resp("P", probe[1]))
    assert len(nonces) == 4, "a nonce per probe"
    conn.send(resp("A", owner, 62))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 62
    assert conn.read_frame(QUIET + 0.5) == "quiet", "no probe once no waiter is on the wire"
    client.close()
    fake.close()


@pytest.mark.parametrize("refusal", [9, 1], ids=["X9", "X1"])
def test_a_session_not_identified_never_probes_and_never_closes_for_silence(refusal: int) -> None:
    """A server that answers the Identify X 9 (it does not resume calls) or X 1 (it does not
    know Identify, and closes): no Resolve is possible, so the waiter's session neither probes
    nor closes while the server is silent, and the waiter is granted there."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=2.0)
    if refusal == 9:
        conn = fake.accept()
        call = Background(client, 20.0)
    else:
        first = fake.accept_raw()
        assert first is not None
        assert first.frame()[0] == "I"
        call = Background(client, 20.0)
        first.send(resp("X", 1, 0))
        first.close()
        plain = fake.accept_raw()
        assert plain is not None
        ping = plain.frame()
        assert ping[0] == "P", f"the next session does not identify: {ping}"
        plain.send(resp("P", ping[1]))
        conn = plain
    owner = conn.acquire()[0]
    assert conn.read_frame(QUIET + CONNECT + 1.0) == "quiet", "no probe, and not closed"
    conn.send(resp("A", owner, 63))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 63
    client.close()
    fake.close()


def test_an_identified_session_without_a_waiter_stalls_and_stays_open() -> None:
    """An unanswered ping on an identified session with no waiter: the call ends ``NoAnswer``
    at its transport timeout, the session stalls (past the connect timeout) but neither probes
    nor closes, and takes calls again once it reads."""
    fake = FakeServer()
    client = make_client(fake.addr, transport=1.0)
    conn = fake.accept(identify=True)
    with pytest.raises(latchkey.NoAnswer):
        client.ping()
    ping = conn.frame()
    assert ping[0] == "P"
    assert conn.read_frame(CONNECT + 1.0) == "quiet", "no probe, and not closed"
    conn.send(resp("P", ping[1]))  # late: read, and the stall ends
    time.sleep(0.1)
    call = Background(client, 2.0)
    owner = conn.acquire()[0]
    conn.send(resp("A", owner, 64))
    ticket, _ = call.join()
    assert isinstance(ticket, latchkey.Ticket) and ticket.token == 64
    client.close()
    fake.close()


def _ignore(function: Any) -> None:
    try:
        function()
    except latchkey.Error:
        pass


# ---------------------------------------------------------------------------------------------
# The same through latchkey.aio


def aclient(addr: str, transport: float = 1.0, **options: Any) -> "latchkey.aio.Client":
    return latchkey.aio.Client(addr, sessions=1, connect_timeout=2.0, transport_timeout=transport, **options)


def test_aio_a_cut_after_a_partial_frame_is_acquired_anew(proxy: Proxy, observer: latchkey.Client) -> None:
    """test_a_cut_after_a_partial_frame_is_resolved_never_seen_and_acquired_anew, as a task"""
    proxy.cut_next(HELLO + 5)

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            ticket = await client.acquire("cut", wait=2.0, lease=LEASE)
            assert observer.query("cut").held
            assert await ticket.release() is True

    asyncio.run(main())
    acquires = proxy.acquires()
    assert all(count == 1 for count in acquires.values()) and 1 <= len(acquires) <= 2, acquires
    assert list(proxy.resolves.values()) == [1]
    assert not observer.query("cut").held


def test_aio_a_cut_after_the_whole_frame_is_resolved_to_its_grant(proxy: Proxy, observer: latchkey.Client) -> None:
    """test_a_cut_after_the_whole_frame_is_resolved_to_the_grant_it_made, as a task"""
    proxy.cut_next(HELLO + acquire_bytes("cut-whole"))

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            ticket = await client.acquire("cut-whole", wait=2.0, lease=LEASE)
            assert ticket.valid_until > time.monotonic() + 20.0
            assert observer.query("cut-whole").held
            assert await ticket.release() is True

    asyncio.run(main())
    assert list(proxy.acquires().values()) == [1]
    assert not observer.query("cut-whole").held


def test_aio_a_waiter_whose_session_is_cut_is_granted_on_the_next(proxy: Proxy, observer: latchkey.Client) -> None:
    """test_a_waiter_whose_session_is_cut_keeps_its_place_and_is_granted_on_the_next, as a task"""
    holder = observer.acquire("cut-queued", wait=0.1, lease=LEASE)
    proxy.cut_next(HELLO + acquire_bytes("cut-queued"))

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            task = asyncio.ensure_future(client.acquire("cut-queued", wait=5.0, lease=LEASE))
            await asyncio.sleep(0.6)
            assert observer.query("cut-queued").waiters == 1
            holder.release()
            ticket = await task
            assert observer.query("cut-queued").held
            assert await ticket.release() is True

    asyncio.run(main())
    assert list(proxy.acquires().values()) == [1]
    assert proxy.connections == 2


def test_aio_a_timeout_lost_with_its_session_is_still_a_timeout(proxy: Proxy, observer: latchkey.Client) -> None:
    """test_a_timeout_lost_with_its_session_is_still_a_timeout, as a task"""
    holder = observer.acquire("cut-timeout", wait=0.1, lease=LEASE)
    proxy.cut_next(HELLO + acquire_bytes("cut-timeout"))

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            with pytest.raises(latchkey.Timeout):
                await client.acquire("cut-timeout", wait=0, lease=LEASE)

    asyncio.run(main())
    assert list(proxy.acquires().values()) == [1]
    holder.release()


def test_aio_a_release_cut_mid_frame_is_sent_again_and_releases(proxy: Proxy, observer: latchkey.Client) -> None:
    """test_a_release_cut_mid_frame_is_sent_again_and_releases, as a task"""
    key = "cut-release"
    proxy.cut_next(HELLO + acquire_bytes(key) + 5)

    async def main() -> None:
        async with aclient(proxy.addr) as client:
            ticket = await client.acquire(key, wait=1.0, lease=LEASE)
            assert await ticket.release() is True
            assert proxy.releases == {ticket.token: 2}

    asyncio.run(main())
    assert not observer.query(key).held


def test_aio_a_cancelled_task_whose_waiter_was_resolved_leaves_no_waiter(proxy: Proxy, observer: latchkey.Client) -> None:
    """A task cancelled while its acquire, resolved "queued", waits on its new session: the
    waiter is withdrawn there (Cancel) at once, not left to get the key later."""
    holder = observer.acquire("cut-ghost", wait=0, lease=LEASE)
    proxy.cut_next(HELLO + acquire_bytes("cut-ghost"))

    async def main() -> None:
        async with aclient(proxy.addr, transport=2.0) as client:
            task = asyncio.ensure_future(client.acquire("cut-ghost", wait=60.0, lease=LEASE))
            until = time.monotonic() + PATIENCE
            while not proxy.resolves or observer.query("cut-ghost").waiters != 1:
                assert time.monotonic() < until, "never resolved"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # the Resolve's answer (queued) is read meanwhile
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled = time.monotonic()
            while observer.query("cut-ghost").waiters != 0:
                assert time.monotonic() - cancelled < 5.0, "the cancelled task's waiter stays queued"
                await asyncio.sleep(0.02)

    asyncio.run(main())
    holder.release()
    assert not observer.query("cut-ghost").held, "nobody was left to take it"
    assert list(proxy.acquires().values()) == [1]


def test_aio_a_server_that_does_not_know_identify_is_used_without_it() -> None:
    """test_a_server_that_does_not_know_identify_closes_and_the_client_stops_identifying, as a task"""
    fake = FakeServer()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with aclient(fake.addr, transport=2.0) as client:
            conn = await loop.run_in_executor(None, fake.accept_raw)
            assert conn is not None
            assert (await loop.run_in_executor(None, conn.frame))[0] == "I"
            task = asyncio.ensure_future(client.acquire("k", wait=2.0, lease=LEASE))
            conn.send(resp("X", 1, 0))
            conn.close()
            plain = await loop.run_in_executor(None, fake.accept_raw)
            assert plain is not None
            ping = await loop.run_in_executor(None, plain.frame)
            assert ping[0] == "P", "no Identify any more"
            plain.send(resp("P", ping[1]))
            owner = (await loop.run_in_executor(None, plain.acquire))[0]
            plain.send(resp("A", owner, 77))
            assert (await task).token == 77

    asyncio.run(main())
    fake.close()


def test_aio_a_waiter_on_a_server_gone_silent_is_resolved_on_a_new_session() -> None:
    """test_a_waiter_on_a_server_gone_silent_probes_it_and_is_resolved_on_a_new_session, as a
    task (``latchkey.aio`` runs on the same sessions): probed, closed, resolved to its grant."""
    fake = FakeServer()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with aclient(fake.addr, transport=2.0) as client:
            conn = await loop.run_in_executor(None, fake.accept, True)
            start = time.monotonic()
            task = asyncio.ensure_future(client.acquire("k", wait=20.0, lease=LEASE))
            owner = (await loop.run_in_executor(None, conn.acquire))[0]
            probe = await loop.run_in_executor(None, conn.frame)
            assert probe[0] == "P", f"a probe, not {probe}"
            assert_between(time.monotonic() - start, QUIET, QUIET + LATE)
            frames = await loop.run_in_executor(None, conn.expect_eof, ANSWER + LATE + QUIET)
            assert frames == [], "nothing after the probe"
            assert_between(time.monotonic() - start, QUIET + ANSWER, QUIET + ANSWER + LATE)
            resolved = await loop.run_in_executor(None, next_resolve, fake, owner)
            resolved.send(resp("W", owner, 1, 65, 29000))
            ticket = await task
            assert ticket.token == 65

    asyncio.run(main())
    fake.close()
