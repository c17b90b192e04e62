"""A real three-member cluster (three ``latchkey serve`` processes on loopback): redirects to the
key's leader, a leader killed mid-run, no quorum (``Unavailable``, never a fake ``Timeout``),
a holder keeping its lock through a paused leader (hedged extends), and a waiter moving to the
new leader during a leader's pause (probes, then a Resolve). The Rust counterparts
are tests/cluster_clients.rs and tests/client_redirects.rs (which use fake members); this runs
the real thing."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from typing import Iterator, List, Optional

import pytest

import latchkey
import latchkey.aio
from support import Server, free_ports


class Cluster:
    def __init__(self, n: int = 3, shards: int = 6) -> None:
        self.dir = tempfile.mkdtemp(prefix="latchkey-py-cluster-")
        ports = free_ports(2 * n)
        self.clients = [f"127.0.0.1:{ports[2 * i]}" for i in range(n)]
        members = "\n".join(
            f'  {{ id = {i + 1}, client = "{self.clients[i]}", peer = "127.0.0.1:{ports[2 * i + 1]}" }},'
            for i in range(n)
        )
        self.configs = []
        for i in range(n):
            self.configs.append(
                "[server]\ncores = 1\n[cluster]\n"
                f"node_id = {i + 1}\ndata_dir = \"{os.path.join(self.dir, f'data-{i + 1}')}\"\n"
                f"shards = {shards}\nfsync = false\nmembers = [\n{members}\n]\n"
            )
        self.members: List[Optional[Server]] = [Server(config=c, listen=False) for c in self.configs]

    def kill(self, index: int) -> None:
        member = self.members[index]
        if member is not None:
            member.signal(signal.SIGKILL)
            member.kill()
            self.members[index] = None

    def stop(self) -> None:
        for member in self.members:
            if member is not None:
                member.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def leads(self, index: int, key: str) -> bool:
        """Whether member ``index`` answers a query of ``key`` itself (not ``M``)."""
        host, _, port = self.clients[index].rpartition(":")
        with socket.create_connection((host, int(port)), timeout=2) as sock:
            sock.sendall(b"Q" + struct.pack(">Q", 1) + key.encode() + b"\n")
            data = b""
            while not data or len(data) < {"Q": 19, "M": 28}.get(chr(data[0]), 11):
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
            return data[:1] == b"Q"

    def leader_of(self, key: str) -> Optional[int]:
        for index, member in enumerate(self.members):
            if member is not None:
                try:
                    if self.leads(index, key):
                        return index
                except OSError:
                    pass
        return None


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        # Ready once every shard has a leader: a key of each answers somewhere.
        until = time.monotonic() + 30
        client = latchkey.Client(c.clients, sessions=1, transport_timeout=2.0)
        while True:
            try:
                for k in range(24):
                    client.query(f"ready/{k}")
                break
            except latchkey.Error:
                assert time.monotonic() < until, "the cluster did not elect leaders"
                time.sleep(0.1)
        client.close()
        yield c
    finally:
        c.stop()


def test_a_client_of_one_member_follows_redirects_to_every_leader(cluster: Cluster) -> None:
    keys = [f"jobs/{i}" for i in range(30)]
    first_leader = cluster.leader_of(keys[0])
    assert first_leader is not None
    # The client lists one member only, one that does not lead the first key.
    entry = (first_leader + 1) % 3
    elsewhere = [k for k in keys if not cluster.leads(entry, k)]
    client = latchkey.Client(cluster.clients[entry], sessions=1, transport_timeout=2.0)
    tickets = [client.acquire(k, wait=5.0, lease=20.0) for k in keys]
    for ticket in tickets:
        assert ticket.is_valid()
        assert client.query(ticket.key).held
        assert ticket.extend(20.0) is True
    for ticket in tickets:
        assert ticket.release() is True
    print(f"{len(elsewhere)} of {len(keys)} keys led by another member than the one listed")
    assert keys[0] in elsewhere, "no redirect was exercised"
    client.close()


def test_a_leader_killed_mid_run_keeps_the_lock_and_the_client_moves_on(cluster: Cluster) -> None:
    client = latchkey.Client(cluster.clients, sessions=1, connect_timeout=1.0, transport_timeout=2.0)
    key = "failover/k"
    ticket = client.acquire(key, wait=5.0, lease=30.0)
    leader = cluster.leader_of(key)
    assert leader is not None
    # Traffic on other keys while the leader dies.
    stop = threading.Event()
    outcomes: List[str] = []
    failures: List[BaseException] = []

    def traffic(index: int) -> None:
        while not stop.is_set():
            try:
                client.acquire(f"failover/other/{index}", wait=0.5, lease=5.0).release()
                outcomes.append("ok")
            except (latchkey.Timeout, latchkey.Unavailable, latchkey.Indeterminate, latchkey.NoAnswer, latchkey.Busy) as error:
                outcomes.append(type(error).__name__)
            except BaseException as error:  # noqa: BLE001
                failures.append(error)
                return

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    cluster.kill(leader)
    killed_at = time.monotonic()
    # The lock survives: nobody else gets the key while its lease lasts.
    recovered = False
    while time.monotonic() - killed_at < 15:
        try:
            other = client.acquire(key, wait=0.5, lease=5.0)
        except latchkey.Timeout:
            recovered = True  # a new leader answers, and the key is still held
            break
        except (latchkey.Unavailable, latchkey.Indeterminate):
            continue
        pytest.fail(f"granted twice: {other}")
    assert recovered, "no new leader answered within 15 s"
    assert ticket.extend(30.0) is True, "the holder keeps its lock through the failover"
    assert ticket.release() is True
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not failures, failures
    assert outcomes.count("ok") > 0
    print(f"traffic outcomes: { {o: outcomes.count(o) for o in set(outcomes)} }")
    client.close()


def test_no_quorum_is_unavailable_never_a_timeout(cluster: Cluster) -> None:
    client = latchkey.Client(cluster.clients, sessions=1, connect_timeout=1.0, transport_timeout=1.0)
    client.acquire("quorum/k", wait=5.0, lease=5.0).release()
    cluster.kill(1)
    cluster.kill(2)
    time.sleep(0.5)
    for key in ["quorum/k", "quorum/other"]:
        start = time.monotonic()
        with pytest.raises(latchkey.Unavailable) as raised:
            client.acquire(key, wait=1.0, lease=5.0)
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 1.0 + 4.0, elapsed
        print(raised.value)
    with pytest.raises(latchkey.Unavailable):
        client.query("quorum/k")
    client.close()


# A holder's lease (whole seconds) and how long its key's leader is paused (longer than the
# lease), as in tests/cluster_clients.rs a_holder_keeps_its_lock_while_its_leader_is_paused
# (`latchkey lock --lease 4s`, a 6 s SIGSTOP: a 4 s lease leaves this shared CI machine room
# for an election; benches/failover.py shows 3 s leases through the same pause).
STALL_LEASE = 4
STALL_S = 6.0


def _nobody_else_gets(cluster: Cluster, key: str, leader: int) -> None:
    """While the leader is paused: a client of the other members only is refused the key
    (``Timeout``) by the new leader once one is elected — the holder's lease lives on there."""
    others = [addr for index, addr in enumerate(cluster.clients) if index != leader]
    client = latchkey.Client(others, sessions=1, connect_timeout=1.0, transport_timeout=2.0)
    try:
        until = time.monotonic() + STALL_S / 2
        while True:
            try:
                other = client.acquire(key, wait=0, lease=5.0)
            except latchkey.Timeout:
                return
            except (latchkey.Unavailable, latchkey.Indeterminate):
                assert time.monotonic() < until, "no new leader answered"
                time.sleep(0.1)
                continue
            pytest.fail(f"granted twice while the leader was paused: {other}")
    finally:
        client.close()


def test_a_holder_keeps_its_lock_while_its_leader_is_paused(cluster: Cluster) -> None:
    """``lock(lease=4)`` with its keep-alive (an extend every 1.3 s) through a 6 s SIGSTOP of
    its key's leader: an extend the paused leader does not answer within the hedge delay
    (0.5 s: a quarter of the default connect timeout) also goes to the other members, which
    redirect it to the new leader once one is elected (docs/protocol.md §4.3). Without that,
    an extend sent to the paused member waits out its 5 s transport timeout there, and the
    lease is lost.

    Both sessions to the leader (two: the default) answer a query before the pause, so the
    keep-alive's extend is sent to the paused leader. (An extend waiting on a session still
    connecting is another case: it is given back unsent after the 2 s connect timeout and goes
    to another member, hedged or not.)"""
    client = latchkey.Client(cluster.clients, sessions=2)
    key = "stall/k"
    try:
        with client.lock(key, wait=5.0, lease=STALL_LEASE) as ticket:
            leader = cluster.leader_of(key)
            assert leader is not None
            member = cluster.members[leader]
            assert member is not None
            for _ in range(2):
                client.query(key)  # every session to the leader is up
            member.signal(signal.SIGSTOP)
            try:
                paused = time.monotonic()
                time.sleep(STALL_LEASE + 0.5)
                _nobody_else_gets(cluster, key, leader)
                time.sleep(max(0.0, paused + STALL_S - time.monotonic()))
            finally:
                member.signal(signal.SIGCONT)
            assert not ticket.lost.is_set(), ticket._lost_why
            assert ticket.is_valid()
        # Leaving the block released it: its release found it held (else LockLost).
        assert not client.query(key).held
    finally:
        client.close()


def test_an_aio_holder_keeps_its_lock_while_its_leader_is_paused(cluster: Cluster) -> None:
    """The same through ``latchkey.aio``: ``async with client.lock(lease=4)``."""
    key = "stall/aio"

    async def main() -> None:
        async with latchkey.aio.Client(cluster.clients, sessions=2) as client:
            async with client.lock(key, wait=5.0, lease=STALL_LEASE) as ticket:
                leader = cluster.leader_of(key)
                assert leader is not None
                member = cluster.members[leader]
                assert member is not None
                for _ in range(2):
                    await client.query(key)  # every session to the leader is up
                member.signal(signal.SIGSTOP)
                try:
                    paused = time.monotonic()
                    await asyncio.sleep(STALL_LEASE + 0.5)
                    await asyncio.get_running_loop().run_in_executor(
                        None, _nobody_else_gets, cluster, key, leader
                    )
                    await asyncio.sleep(max(0.0, paused + STALL_S - time.monotonic()))
                finally:
                    member.signal(signal.SIGCONT)
                assert not ticket.lost.is_set(), ticket.ticket._lost_why
                assert ticket.is_valid()
            assert not (await client.query(key)).held

    asyncio.run(main())


def _ask(cluster: Cluster, index: int, frame: bytes, size: int) -> bytes:
    """One raw request to member ``index`` (no handshake); its answer, or ``b""`` when the
    member does not answer within 2 s (a paused one)."""
    host, _, port = cluster.clients[index].rpartition(":")
    data = b""
    try:
        with socket.create_connection((host, int(port)), timeout=2) as sock:
            sock.sendall(frame)
            while not data or len(data) < {"M": 28}.get(chr(data[0]), size):
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return b""
    return data


def _waiters_at(cluster: Cluster, index: int, key: str) -> Optional[int]:
    """The waiters on ``key`` as member ``index`` answers a query itself; ``None`` for an
    ``M`` or no answer."""
    data = _ask(cluster, index, b"Q" + struct.pack(">Q", 1) + key.encode() + b"\n", 19)
    if data[:1] != b"Q" or len(data) < 19:
        return None
    return int(struct.unpack_from(">I", data, 14)[0])


def test_a_waiter_whose_leader_is_paused_moves_to_the_new_leader_during_the_pause(cluster: Cluster) -> None:
    """tests/cluster_clients.rs a_waiter_whose_leader_is_paused_moves_to_the_new_leader_during_the_pause:
    a waiter (``acquire(wait=20)``) queued on its key's leader, which is then paused (SIGSTOP).
    Its identified session, which reads nothing while the acquire waits, probes the leader with
    a ping a quarter of the connect timeout after its last read; unanswered, the session closes
    at the probe + half the connect timeout, and the acquire is resolved (never sent again) at the
    member that leads the key now: "never seen" there, it queues again. Released there, the
    holder's lock goes to the waiter while the old leader is still stopped. Before, the waiter
    waited the pause out."""
    key = "paused/waiter"
    holders = latchkey.Client(cluster.clients, sessions=1)
    waiters = latchkey.Client(cluster.clients, sessions=1)
    done = threading.Event()
    outcome: List[object] = []

    def wait() -> None:
        try:
            outcome.append(waiters.acquire(key, wait=20.0, lease=30.0))
        except latchkey.Error as error:
            outcome.append(error)
        done.set()

    thread = threading.Thread(target=wait, daemon=True)
    try:
        holder = holders.acquire(key, wait=5.0, lease=30.0)
        leader = cluster.leader_of(key)
        assert leader is not None
        member = cluster.members[leader]
        assert member is not None
        thread.start()
        until = time.monotonic() + 10
        while _waiters_at(cluster, leader, key) != 1:
            assert time.monotonic() < until, "never queued on the leader"
            time.sleep(0.05)
        member.signal(signal.SIGSTOP)
        try:
            paused = time.monotonic()
            others = [i for i in range(3) if i != leader]
            moved_to: Optional[int] = None
            while moved_to is None:
                assert time.monotonic() - paused < 12, "not queued again on a new leader"
                assert not done.is_set(), f"the waiter ended: {outcome}"
                for index in others:
                    if _waiters_at(cluster, index, key) == 1:
                        moved_to = index
                time.sleep(0.05)
            print(f"queued again on member {moved_to + 1} {time.monotonic() - paused:.2f} s into the pause")
            release = b"R" + struct.pack(">Q", holder.token) + key.encode() + b"\n"
            assert _ask(cluster, moved_to, release, 10)[:1] == b"R", "the holder released there"
            assert done.wait(3.0), "the waiter is granted while the old leader is stopped"
            assert time.monotonic() - paused < 15
        finally:
            member.signal(signal.SIGCONT)
        assert len(outcome) == 1 and isinstance(outcome[0], latchkey.Ticket), outcome
        assert outcome[0].is_valid()
        assert outcome[0].release() is True
    finally:
        holders.close()
        waiters.close()
        thread.join(30)
