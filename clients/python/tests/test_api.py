"""The public API against the real server: tickets, validity bounds (§4.5), ``lock()`` and
``keep_alive`` (mirroring client_redirects.rs latchkey_lock_keeps_its_lock_through_a_leader_change
with fake members)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import latchkey
from support import FakeMember, Frame, Reply, Server, leader_reply, moved, redirect_to


def test_validity_bounds_follow_the_grant_and_every_extend(server: Server) -> None:
    with latchkey.Client(server.text) as client:
        before = time.monotonic()
        ticket = client.acquire("bound", wait=1.0, lease=10.0)
        after = time.monotonic()
        # read + lease - max(100 ms, lease/10)
        assert before + 9.0 <= ticket.valid_until <= after + 9.0
        assert ticket.is_valid()
        # An extend may shorten: the bound follows it down (1 s - 100 ms).
        start = time.monotonic()
        assert ticket.extend(1.0) is True
        assert ticket.valid_until <= time.monotonic() + 0.9
        assert ticket.valid_until >= start + 0.9 - 0.001
        assert ticket.extend(20.0) is True
        assert ticket.valid_until >= time.monotonic() + 17.0
        assert ticket.release() is True
        assert not ticket.is_valid(), "released: the bound has ended"
        assert ticket.release() is False
        assert ticket.extend(5.0) is False, "the token no longer holds the key"
        state = client.query("bound")
        assert state == latchkey.KeyState(False, 0, 0)


def test_lock_releases_on_exit_even_on_an_exception(server: Server) -> None:
    client = latchkey.Client(server.text)
    with pytest.raises(RuntimeError):
        with client.lock("ctx", wait=1.0, lease=10.0) as ticket:
            assert client.query("ctx").held and ticket.is_valid()
            raise RuntimeError("boom")
    assert not client.query("ctx").held
    client.close()


def test_keep_alive_extends_past_the_lease(server: Server) -> None:
    client = latchkey.Client(server.text)
    with client.lock("kept", wait=1.0, lease=1.0, keep_alive=True) as ticket:
        time.sleep(2.5)
        assert client.query("kept").held
        assert not ticket.lost.is_set() and ticket.is_valid()
    assert not client.query("kept").held
    client.close()


def test_keep_alive_sets_lost_when_the_lock_is_lost(server: Server, observer: latchkey.Client) -> None:
    client = latchkey.Client(server.text)
    with pytest.raises(latchkey.LockLost) as raised:
        with client.lock("stolen", wait=1.0, lease=3.0, keep_alive=True) as ticket:
            # Someone releases it with the token (as after an expiry): the next extend says so.
            forged = latchkey.Ticket(observer, "stolen", b"stolen", ticket.token, 3, 0.0)
            assert forged.release() is True
            assert ticket.lost.wait(3.0), "lost was not set"
            assert not ticket.is_valid()
    lost = raised.value
    assert (lost.key, lost.token) == ("stolen", ticket.token)
    assert f"stolen: the lock (token {ticket.token}) was lost" in str(lost), lost
    assert "no longer holds it" in str(lost), lost
    client.close()


def test_lock_keeps_the_lock_by_default(server: Server) -> None:
    client = latchkey.Client(server.text)
    with client.lock("default-kept", wait=1.0, lease=1.0) as ticket:
        time.sleep(2.5)
        assert client.query("default-kept").held, "extended past the lease without keep_alive=True"
        assert not ticket.lost.is_set() and ticket.is_valid()
    assert not client.query("default-kept").held
    client.close()


def test_a_lease_that_ran_out_in_the_block_raises_lock_lost_at_its_end(server: Server) -> None:
    client = latchkey.Client(server.text)
    with pytest.raises(latchkey.LockLost) as raised:
        with client.lock("ran-out", wait=1.0, lease=1.0, keep_alive=False) as ticket:
            time.sleep(1.5)
    assert (raised.value.key, raised.value.token) == ("ran-out", ticket.token)
    assert "no longer held" in str(raised.value), raised.value
    # An exception of the block itself is never replaced by it.
    with pytest.raises(RuntimeError):
        with client.lock("ran-out", wait=1.0, lease=1.0, keep_alive=False):
            time.sleep(1.5)
            raise RuntimeError("the block's own")
    client.close()


def test_keep_alive_keeps_its_lock_through_a_leader_change() -> None:
    """client_redirects.rs latchkey_lock_keeps_its_lock_through_a_leader_change"""
    start = time.monotonic()
    b = FakeMember(redirect_to(None))

    def script_a(frame: Frame) -> Reply:
        elapsed = time.monotonic() - start
        if elapsed < 1.0:
            return leader_reply(frame, 21)
        if elapsed < 1.4:
            return "close"
        return moved(frame[2] if frame[0] == "E" else frame[1], b.addr)

    a = FakeMember(script_a)

    def script_b(frame: Frame) -> Reply:
        if time.monotonic() - start < 1.4:
            return moved(frame[2] if frame[0] == "E" else frame[1], a.addr)
        return leader_reply(frame, 21)

    b.set_script(script_b)
    client = latchkey.Client([a.addr, b.addr], sessions=1, transport_timeout=2.0)
    with client.lock("k", wait=1.0, lease=2.0, keep_alive=True) as ticket:
        time.sleep(3.0)
        assert not ticket.lost.is_set(), "the lock was kept"
        assert ticket.is_valid()
    assert any(frame[0] == "E" for frame in b.received()), "B extended the lease"
    assert ("R", 21, "k") in b.received(), "B released it"
    client.close()


def test_threads_share_a_client_and_tickets(server: Server) -> None:
    client = latchkey.Client(server.text, sessions=2)
    ticket = client.acquire("shared", wait=1.0, lease=10.0)
    results = []

    def extend() -> None:
        results.append(ticket.extend(10.0))

    threads = [threading.Thread(target=extend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [True] * 8, "extends of one ticket are serialized and all confirmed"
    assert ticket.release() is True
    client.close()


def test_a_peer_that_is_not_a_latchkey_server_is_unavailable_at_once() -> None:
    """§4.3: bytes that are not latchkey frames in answer to the handshake ping end the call
    Unavailable at once (not retried within the call)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    addr = "127.0.0.1:%d" % listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            try:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            except OSError:
                pass
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = latchkey.Client(addr, sessions=1, connect_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=5.0, lease=5.0)
    assert time.monotonic() - start < 2.0, "not retried until the deadline"
    assert "not a latchkey server" in str(raised.value), raised.value
    client.close()
    stop.set()
    thread.join(5)
    listener.close()


def test_an_interrupted_acquire_withdraws_its_waiter(server: Server, observer: latchkey.Client) -> None:
    """``KeyboardInterrupt`` while ``acquire`` waits (Ctrl-C at a REPL, in a script): the waiter
    is withdrawn (Cancel, its answer waited for) before the exception goes on — not left queued,
    to be granted later to nobody and held until its lease ran out. Before, it stayed queued
    for its whole wait, and its grant was never released."""
    assert threading.current_thread() is threading.main_thread(), "SIGINT reaches the main thread"
    key = "jobs/interrupted"
    holder = observer.acquire(key, wait=0, lease=30)
    client = latchkey.Client(server.text, sessions=1, transport_timeout=2.0)
    main = threading.main_thread().ident
    assert main is not None

    def interrupt() -> None:
        deadline = time.monotonic() + 5
        while observer.query(key).waiters == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        client.acquire(key, wait=30, lease=30)
    interrupter.join()
    assert observer.query(key).waiters == 0, "withdrawn before the exception went on"
    holder.release()
    time.sleep(0.2)
    assert not observer.query(key).held, "nobody was granted it"
    client.close()
