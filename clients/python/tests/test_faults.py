"""Every §4 rule through the fault proxy, in front of the real server: a case-by-case mirror of
tests/client_faults.rs (the Rust test of the same name is named in each docstring)."""

from __future__ import annotations

import threading
import time
from typing import List, Optional, Tuple

import pytest

import latchkey
from support import Proxy, Server, assert_between

LATE = 1.5
LEASE = 30.0


def make_client(addr: str, sessions: int, transport: float) -> latchkey.Client:
    return latchkey.Client(addr, sessions=sessions, connect_timeout=2.0, transport_timeout=transport)


def freed_within(observer: latchkey.Client, key: str, within: float) -> Optional[float]:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if not observer.query(key).held:
            return time.monotonic() - start
        time.sleep(0.01)
    return None


@pytest.fixture
def proxy(server: Server):  # type: ignore[no-untyped-def]
    p = Proxy(server.addr)
    yield p
    p.stop()


def test_a_session_refused_before_its_handshake_pong_gets_only_the_ping(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs a_session_refused_before_its_handshake_pong_gets_only_the_ping"""
    proxy.refuse_next(1, 0.8)
    client = make_client(proxy.addr, 1, 2.0)
    ticket = client.acquire("retry", wait=2.5, lease=LEASE)
    frames = proxy.acquire_frames
    assert len(frames) == 1, f"never sent to the refused session: {frames}"
    assert frames[0][1] == 2, "same deadline: at most 1.7 s were left"
    assert proxy.connections == 2
    assert proxy.pings == 2, "one handshake per session"
    assert observer.query("retry").held
    ticket.release()
    client.close()


def test_unsent_retry_on_another_session_keeps_owner_and_deadline(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs unsent_retry_on_another_session_keeps_owner_and_deadline"""
    proxy.refuse_next(1, 0.8, pong=True)
    client = make_client(proxy.addr, 1, 2.0)
    ticket = client.acquire("retry", wait=2.5, lease=LEASE)
    frames = proxy.acquire_frames
    assert len(frames) == 2, f"sent to the refused session, then once more: {frames}"
    assert frames[0][0] == frames[1][0], "same owner"
    assert frames[0][1] == 3, "2.5 s rounds up to 3"
    assert frames[1][1] == 2, "same deadline: at most 1.7 s were left"
    assert proxy.connections == 2
    assert observer.query("retry").held
    ticket.release()
    client.close()


def test_without_resuming_a_cut_after_a_partial_frame_is_indeterminate_and_never_resent(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs without_resuming_a_cut_after_a_partial_frame_is_indeterminate_and_never_resent:
    a client that does not resume calls (``resume=None``) keeps to §4 alone."""
    proxy.cut_after(10 + 5)  # the handshake ping, then 5 bytes of the acquire
    client = latchkey.Client(proxy.addr, sessions=2, connect_timeout=2.0, transport_timeout=1.0, resume=None)
    with pytest.raises(latchkey.Indeterminate):
        client.acquire("cut", wait=1.0, lease=LEASE)
    time.sleep(0.3)
    acquires = proxy.acquires()
    assert list(acquires.values()) == [1], f"zero resends: {acquires}"
    assert not observer.query("cut").held, "half a frame grants nothing"
    client.close()


def test_without_resuming_a_cut_after_the_whole_frame_is_indeterminate_and_the_lease_recovers_it(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs without_resuming_a_cut_after_the_whole_frame_is_indeterminate_and_the_lease_recovers_it"""
    proxy.cut_after(10 + 12 + len("cut-whole"))
    client = latchkey.Client(proxy.addr, sessions=1, connect_timeout=2.0, transport_timeout=1.0, resume=None)
    with pytest.raises(latchkey.Indeterminate):
        client.acquire("cut-whole", wait=1.0, lease=1.0)
    assert list(proxy.acquires().values()) == [1]
    assert freed_within(observer, "cut-whole", 1.0 + LATE) is not None
    client.close()


def test_a_grant_held_past_the_deadline_is_indeterminate_and_released_promptly(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs a_grant_held_past_the_deadline_is_indeterminate_and_released_promptly"""
    client = make_client(proxy.addr, 1, 3.0)
    client.ping()  # the session is up before the server's bytes are held
    proxy.hold()
    results: List[BaseException] = []

    def acquiring() -> None:
        try:
            client.acquire("held", wait=0.6, lease=LEASE)
        except latchkey.Error as error:
            results.append(error)

    thread = threading.Thread(target=acquiring)
    thread.start()
    time.sleep(1.2)
    assert observer.query("held").held, "the server granted at once"
    proxy.release()
    thread.join(10)
    assert len(results) == 1 and isinstance(results[0], latchkey.Indeterminate), results
    freed = freed_within(observer, "held", LATE)
    assert freed is not None and freed < LATE, "released well before the lease"
    assert len(proxy.acquires()) == 1
    client.close()


def test_a_deadline_while_queued_cancels_to_timeout_and_the_session_stays_open(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs a_deadline_while_queued_cancels_to_timeout_and_the_session_stays_open"""
    holder = observer.acquire("queued", wait=0.1, lease=LEASE)
    client = make_client(proxy.addr, 1, 2.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Timeout):
        client.acquire("queued", wait=1.1, lease=LEASE)
    # The wire wait was 2 s: a Timeout at 1.1 s is the Cancel's doing.
    assert_between(time.monotonic() - start, 1.1, 1.1 + LATE)
    assert len(proxy.cancels) == 1
    assert list(proxy.cancels) == list(proxy.acquires())
    assert observer.query("queued").waiters == 0, "nothing left queued"
    client.ping()
    assert proxy.connections == 1, "the session stayed open"
    holder.release()
    client.close()


def test_a_late_timeout_is_a_timeout(proxy, observer):  # type: ignore[no-untyped-def]
    """client_faults.rs a_late_timeout_is_a_timeout"""
    holder = observer.acquire("late", wait=0.1, lease=LEASE)
    client = make_client(proxy.addr, 1, 3.0)
    client.ping()
    proxy.hold()
    out: List[Tuple[BaseException, float]] = []

    def acquiring() -> None:
        start = time.monotonic()
        try:
            client.acquire("late", wait=0.5, lease=LEASE)
        except latchkey.Error as error:
            out.append((error, time.monotonic() - start))

    thread = threading.Thread(target=acquiring)
    thread.start()
    time.sleep(1.5)
    proxy.release()
    thread.join(10)
    assert len(out) == 1
    error, elapsed = out[0]
    assert isinstance(error, latchkey.Timeout), error
    assert elapsed >= 1.4, f"the T came late: {elapsed}"
    holder.release()
    client.close()


def test_a_server_refusing_every_session_is_unavailable_and_nothing_was_executed(proxy):  # type: ignore[no-untyped-def]
    """client_faults.rs a_server_refusing_every_session_is_unavailable_and_nothing_was_executed"""
    proxy.refuse_next(1 << 30, 0.05)
    client = make_client(proxy.addr, 2, 1.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable):
        client.acquire("refused", wait=0.8, lease=LEASE)
    assert_between(time.monotonic() - start, 0.8, 0.8 + LATE)
    assert not proxy.acquires(), "never sent"
    client.close()


def test_many_threads_through_a_slow_proxy_each_send_once_and_get_one_result(proxy):  # type: ignore[no-untyped-def]
    """client_faults.rs many_threads_through_a_slow_proxy_each_send_once_and_get_one_result"""
    threads, calls = 6, 25
    proxy.delay_up(0.001)
    proxy.delay_down(0.001)
    client = make_client(proxy.addr, 2, 2.0)
    results = [0] * threads
    errors: List[BaseException] = []

    def worker(index: int) -> None:
        for call in range(calls):
            key = "m%d" % ((index * 7 + call) % 5)
            try:
                client.acquire(key, wait=0.2, lease=LEASE).release()
            except latchkey.Timeout:
                pass
            except BaseException as error:  # noqa: BLE001
                errors.append(error)
            results[index] += 1

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    assert sum(results) == threads * calls
    acquires = proxy.acquires()
    assert len(acquires) == threads * calls
    assert all(count == 1 for count in acquires.values())
    client.close()


def test_a_black_hole_makes_extend_release_query_and_ping_no_answer(proxy, observer):  # type: ignore[no-untyped-def]
    """Beyond client_faults.rs: the server's bytes held back (a black hole) for the small
    requests. Each ends NoAnswer at its transport deadline; an extend whose outcome is unknown
    keeps the earlier bound (§4.5). The connect timeout (the silence limit) is longer than the
    test, so the session does not stall: a stalled one would take no new call (Unavailable)."""
    client = latchkey.Client(proxy.addr, sessions=1, connect_timeout=10.0, transport_timeout=1.0)
    ticket = client.acquire("hole", wait=1.0, lease=20.0)
    bound = ticket.valid_until
    proxy.hold()
    start = time.monotonic()
    with pytest.raises(latchkey.NoAnswer):
        ticket.extend(5.0)
    assert_between(time.monotonic() - start, 1.0, 1.0 + LATE)
    assert ticket.valid_until <= min(bound, start + 5.0), "the earlier bound is kept"
    with pytest.raises(latchkey.NoAnswer):
        client.query("hole")
    with pytest.raises(latchkey.NoAnswer):
        client.ping()
    with pytest.raises(latchkey.NoAnswer):
        ticket.release()
    proxy.release()
    # The held answers arrive late and are matched (or dropped) without confusing later calls.
    assert client.ping() < 2.0
    assert observer.query("hole").held is False, "the release did reach the server"
    client.close()
