"""The deadline rules of docs/protocol.md §4.2–§4.4 against a scripted server, each interleaving
forced by hand: a case-by-case mirror of tests/client_deadlines.rs. "Never early" is strict,
"not too late" generous (shared, noisy 2-CPU machine)."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Tuple

import pytest

import latchkey
from support import PATIENCE, FakeServer, assert_between, dead_addr, one_cluster, resp

LATE = 3.0
LEASE = 30.0


def make_client(
    addrs: List[str], sessions: int, transport: float, connect: float = 2.0, retry_refused: bool = False
) -> latchkey.Client:
    return latchkey.Client(
        addrs, sessions=sessions, connect_timeout=connect, transport_timeout=transport, retry_refused=retry_refused
    )


class Background:
    """``client.acquire("k", wait)`` on a thread: its ticket or error, and how long it took."""

    def __init__(self, client: latchkey.Client, wait: float, key: str = "k") -> None:
        self.result: Any = None
        self.elapsed = 0.0

        def run() -> None:
            start = time.monotonic()
            try:
                self.result = client.acquire(key, wait=wait, lease=LEASE)
            except latchkey.Error as error:
                self.result = error
            self.elapsed = time.monotonic() - start

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Tuple[Any, float]:
        self.thread.join(PATIENCE + 10)
        assert not self.thread.is_alive(), "the call never ended"
        return self.result, self.elapsed


def test_x7_counts_as_unsent_and_the_retry_keeps_owner_and_deadline() -> None:
    """client_deadlines.rs x7_counts_as_unsent_and_the_retry_keeps_owner_and_deadline"""
    refusing, answering = FakeServer(), FakeServer()
    one_cluster([refusing, answering])
    client = make_client([refusing.addr, answering.addr], 1, 2.0)
    start = time.monotonic()
    call = Background(client, 2.5)
    first = refusing.accept()
    owner, wait_s, _, _ = first.acquire()
    assert wait_s == 3, "2.5 s rounds up to 3"
    time.sleep(1.2)
    first.refuse()
    second = answering.accept()
    retry_owner, retry_wait_s, _, key = second.acquire()
    assert retry_owner == owner, "the retry keeps the owner"
    assert retry_wait_s == 2, "the retry keeps the deadline: at most 1.3 s were left"
    assert second.frame() == ("C", owner, key)
    assert_between(time.monotonic() - start, 2.5, 2.5 + LATE)
    second.send(resp("T", owner))
    result, _ = call.join()
    assert isinstance(result, latchkey.Timeout), result
    client.close()


def test_a_failed_connect_is_retried_on_another_session_within_the_same_deadline() -> None:
    """client_deadlines.rs a_failed_connect_is_retried_on_another_session_within_the_same_deadline"""
    server = FakeServer()
    client = make_client([dead_addr(), server.addr], 1, 2.0)
    call = Background(client, 1.5)
    conn = server.accept()
    owner, wait_s, lease_s, key = conn.acquire()
    assert (wait_s, lease_s, key) == (2, 30, "k")
    conn.send(resp("A", owner, 7))
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Ticket) and result.token == 7, result
    assert elapsed < 1.5
    client.close()


def test_an_unsent_request_keeps_trying_new_sessions_until_a_server_appears() -> None:
    """client_deadlines.rs an_unsent_request_keeps_trying_new_sessions_until_a_server_appears"""
    addr = dead_addr()
    client = make_client([addr], 1, 2.0, retry_refused=True)
    start = time.monotonic()
    call = Background(client, 3.0)
    time.sleep(1.0)
    server = FakeServer(addr)
    appeared = time.monotonic()
    conn = server.accept()
    owner, wait_s, _, _ = conn.acquire()
    assert time.monotonic() - appeared < 0.25 + LATE, "backoff is at most 250 ms"
    left = max(0.0, 3.0 - (time.monotonic() - start))
    assert wait_s <= int(left) + 1, "the deadline was kept"
    assert wait_s <= 2
    conn.send(resp("A", owner, 3))
    result, _ = call.join()
    assert isinstance(result, latchkey.Ticket) and result.token == 3
    client.close()


def test_a_request_still_unsent_on_a_live_session_at_its_deadline_is_a_timeout_and_never_sent() -> None:
    """client_deadlines.rs a_request_still_unsent_on_a_live_session_at_its_deadline_is_a_timeout_and_never_sent

    The Rust test fills the socket with releases of granted tickets; here big releases of
    fake tokens fill it (releases are never waited for past their transport timeout: they are
    sent in the background the way a compensating release is)."""
    server = FakeServer(small_buffer=True)
    # A silence limit (the connect timeout) longer than the test: the session is up and merely
    # full, never stalled.
    client = make_client([server.addr], 1, 30.0, connect=30.0)
    conn = server.accept()
    # As in the Rust test: more bytes of releases than the client's send buffer can ever
    # grow to (tcp_wmem's maximum), so the acquire behind them is never handed to the socket.
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            wmem_max = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        wmem_max = 4 << 20
    count = (wmem_max // 1000) * 5 // 4 + 500
    key = ("x" * 990).encode()
    session = client._members.pool(client._members.listed[0]).pick(None)  # type: ignore[union-attr]
    assert session is not None
    from latchkey._session import Call

    for token in range(1, count + 1):
        assert session.submit_background(Call("R", key, token, time.monotonic() + 60, waitable=False))
    start = time.monotonic()
    with pytest.raises(latchkey.Timeout):
        client.acquire("behind", wait=1.0, lease=LEASE)
    assert_between(time.monotonic() - start, 1.0, 1.0 + LATE)
    releases = 0
    while True:
        frame = conn.read_frame(1.0)
        if not isinstance(frame, tuple):
            break
        assert frame[0] == "R", f"only the releases were ever sent, not {frame}"
        releases += 1
    assert releases == count
    client.close()


def test_a_deadline_while_queued_cancels_and_the_session_stays_open() -> None:
    """client_deadlines.rs a_deadline_while_queued_cancels_and_the_session_stays_open"""
    server = FakeServer()
    client = make_client([server.addr], 1, 2.0)
    conn = server.accept()
    start = time.monotonic()
    call = Background(client, 1.2)
    owner, wait_s, _, key = conn.acquire()
    assert wait_s == 2, "the wire wait is rounded up"
    assert conn.frame() == ("C", owner, key), "same session, key and owner"
    assert_between(time.monotonic() - start, 1.2, 1.2 + LATE)
    conn.send(resp("T", owner))
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Timeout), result
    assert_between(elapsed, 1.2, 1.2 + LATE)
    pinged: List[float] = []
    pinger = threading.Thread(target=lambda: pinged.append(client.ping()))
    pinger.start()
    frame = conn.frame()
    assert frame[0] == "P", frame
    conn.send(resp("P", frame[1]))
    pinger.join(10)
    assert pinged, "the ping was answered on the same session"
    assert server.try_accept(0.1) is None, "no new connection"
    client.close()


def test_a_timeout_found_after_the_deadline_is_still_a_timeout() -> None:
    """client_deadlines.rs a_timeout_found_after_the_deadline_is_still_a_timeout"""
    server = FakeServer()
    client = make_client([server.addr], 1, 3.0)
    conn = server.accept()
    call = Background(client, 0.5)
    owner, _, _, _ = conn.acquire()
    assert conn.frame()[0] == "C"
    time.sleep(0.8)
    conn.send(resp("T", owner))
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Timeout), result
    assert elapsed >= 1.3
    client.close()


def test_busy_found_after_the_deadline_is_still_busy() -> None:
    """client_deadlines.rs busy_found_after_the_deadline_is_still_busy"""
    server = FakeServer()
    client = make_client([server.addr], 1, 3.0)
    conn = server.accept()
    call = Background(client, 0.3)
    owner, _, _, _ = conn.acquire()
    assert conn.frame()[0] == "C"
    conn.send(resp("B", owner))
    result, _ = call.join()
    assert isinstance(result, latchkey.Busy), result
    client.close()


def test_a_grant_after_the_cancel_is_released_at_once_and_indeterminate() -> None:
    """client_deadlines.rs a_grant_after_the_cancel_is_released_at_once_and_indeterminate"""
    server = FakeServer()
    client = make_client([server.addr], 1, 3.0)
    conn = server.accept()
    call = Background(client, 0.3)
    owner, _, _, key = conn.acquire()
    assert conn.frame() == ("C", owner, key)
    conn.send(resp("A", owner, 91))
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert conn.frame() == ("R", 91, key), "that exact token"
    client.close()


def test_no_answer_to_the_cancel_closes_that_session_and_is_indeterminate() -> None:
    """client_deadlines.rs no_answer_to_the_cancel_closes_that_session_and_is_indeterminate"""
    server = FakeServer()
    transport = 1.0
    client = make_client([server.addr], 1, transport)
    conn = server.accept()
    call = Background(client, 0.3)
    conn.acquire()
    assert conn.frame()[0] == "C"
    assert conn.expect_eof(PATIENCE) == [], "closed, nothing resent"
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert_between(elapsed, 0.3 + transport, 0.3 + transport + LATE)
    client.close()


def test_wait_zero_is_one_attempt_with_its_own_transport_deadline_and_no_cancel() -> None:
    """client_deadlines.rs wait_zero_is_one_attempt_with_its_own_transport_deadline_and_no_cancel"""
    server = FakeServer()
    transport = 1.0
    client = make_client([server.addr], 1, transport)
    conn = server.accept()
    call = Background(client, 0)
    _, wait_s, _, _ = conn.acquire()
    assert wait_s == 0, "a single immediate attempt on the wire"
    assert conn.expect_eof(PATIENCE) == [], "no Cancel, no resend"
    result, elapsed = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    assert_between(elapsed, transport, transport + LATE)
    following = server.try_accept(0.3)
    if following is not None:
        assert following.read_frame(0.3) == "quiet", "never resent after a possible send"
    client.close()


def test_wait_zero_answered_in_time_is_acquired() -> None:
    """client_deadlines.rs wait_zero_answered_in_time_is_acquired"""
    server = FakeServer()
    client = make_client([server.addr], 1, 1.0)
    conn = server.accept()
    call = Background(client, 0)
    owner, _, _, _ = conn.acquire()
    time.sleep(0.4)
    conn.send(resp("A", owner, 5))
    result, _ = call.join()
    assert isinstance(result, latchkey.Ticket) and result.token == 5, result
    client.close()


def test_wait_zero_unsent_moves_to_another_session_with_the_same_owner() -> None:
    """client_deadlines.rs wait_zero_unsent_moves_to_another_session_with_the_same_owner"""
    refusing, answering = FakeServer(), FakeServer()
    one_cluster([refusing, answering])
    client = make_client([refusing.addr, answering.addr], 1, 2.0)
    call = Background(client, 0)
    first = refusing.accept()
    owner, _, _, _ = first.acquire()
    first.refuse()
    second = answering.accept()
    retry_owner, wait_s, _, _ = second.acquire()
    assert (retry_owner, wait_s) == (owner, 0)
    second.send(resp("T", owner))
    result, _ = call.join()
    assert isinstance(result, latchkey.Timeout), result
    client.close()


def test_a_session_failing_after_the_send_is_indeterminate_and_never_resent() -> None:
    """client_deadlines.rs a_session_failing_after_the_send_is_indeterminate_and_never_resent"""
    server = FakeServer()
    client = make_client([server.addr], 2, 2.0)
    # Both sessions of the first member's pool start with the client.
    conns = [server.accept(), server.accept()]
    call = Background(client, 2.0)
    index = None
    deadline = time.monotonic() + PATIENCE
    while index is None and time.monotonic() < deadline:
        for i, conn in enumerate(conns):
            frame = conn.read_frame(0.02)
            if isinstance(frame, tuple) and frame[0] == "A":
                index = i
                break
    assert index is not None
    conns[index].close()
    result, _ = call.join()
    assert isinstance(result, latchkey.Indeterminate), result
    other = conns[1 - index]
    frame = other.read_frame(0.3)
    assert frame == "quiet", f"not resent on the other session: {frame}"
    client.close()


def test_the_server_down_is_unavailable_at_the_deadline() -> None:
    """client_deadlines.rs the_server_down_is_unavailable_at_the_deadline"""
    client = make_client([dead_addr()], 2, 1.0, retry_refused=True)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable):
        client.acquire("k", wait=0.6, lease=LEASE)
    assert_between(time.monotonic() - start, 0.6, 0.6 + LATE)
    with pytest.raises(latchkey.Unavailable):
        client.ping()
    client.close()


def test_a_refused_connection_everywhere_is_unavailable_at_once() -> None:
    """client_api.rs a_refused_connection_ends_the_call_at_once_unless_it_is_retried"""
    dead = dead_addr()
    client = make_client([dead], 1, 60.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=60.0, lease=LEASE)
    for call in (lambda: client.acquire("k", wait=0, lease=LEASE), lambda: client.query("k"), client.ping):
        with pytest.raises(latchkey.Unavailable):
            call()
    assert time.monotonic() - start < 30.0, "at once, not at the deadline"
    said = str(raised.value)
    assert "onnection refused" in said and "(tried for " in said, said
    assert "retry_refused=True keeps trying" in said, said
    client.close()
    # One member refusing among several is not the end: the next one serves.
    server = FakeServer()
    client = make_client([dead, server.addr], 1, 5.0)
    call = Background(client, 5.0)
    conn = server.accept()
    owner, _, _, _ = conn.acquire()
    conn.send(resp("A", owner, 9))
    result, _ = call.join()
    assert isinstance(result, latchkey.Ticket) and result.token == 9, result
    client.close()
