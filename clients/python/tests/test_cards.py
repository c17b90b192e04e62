"""A client given several addresses takes only members of one cluster: each address is asked
for its card (``GET /cluster``) and only the first cluster's members are sent to — the mirror
of tests/client_redirects.rs "Lists that mix clusters", against fake members, then against the
real server (``$LATCHKEY_BIN``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import List

import pytest

import latchkey
import latchkey.aio
from latchkey._card import FetchError, Standalone, fetch
from support import (
    FAKE_CLUSTER,
    FakeMember,
    FakeServer,
    Server,
    assert_between,
    dead_addr,
    leading,
    member_card,
    redirect_to,
    resp,
    standalone_card,
)

LEASE = 10.0
TRANSPORT = 2.0


def make_client(addrs: List[str], connect: float = 2.0) -> latchkey.Client:
    return latchkey.Client(addrs, sessions=1, connect_timeout=connect, transport_timeout=TRANSPORT)


def other_cluster(member: FakeMember) -> str:
    return member_card(member.addr, cluster=FAKE_CLUSTER + 1)


def test_a_list_that_mixes_clusters_sends_only_to_the_first_clusters_members(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """client_redirects.rs a_list_that_mixes_clusters_sends_only_to_the_first_clusters_members"""
    member = FakeMember(leading(3))
    stranger = FakeMember(leading(9))
    stranger.card = other_cluster(stranger)
    # The first member card to come fixes the cluster: the member's, here.
    stranger.card_delay = 1.0
    standalone = FakeMember(leading(9))
    standalone.card = standalone_card(5)
    old = FakeMember(leading(9))
    old.card = None
    addrs = [standalone.addr, member.addr, stranger.addr, old.addr]
    with caplog.at_level(logging.ERROR, logger="latchkey"):
        client = make_client(addrs)
        tickets = []
        for n in range(8):
            ticket = client.acquire(f"k{n}", wait=2.0, lease=LEASE)
            assert ticket.token == 3, "only the cluster's member grants"
            tickets.append(ticket)
        assert client.query("q").held is False
        client.ping()
        for ticket in tickets[:4]:
            assert ticket.release() is True
        for ticket in tickets[4:]:
            client._release_in_background(ticket._key_bytes, ticket.token, None)
        refused = client.refused_members(5.0)
    named = [addr for addr, _ in refused]
    assert named == [standalone.addr, stranger.addr, old.addr], refused
    assert "a standalone server" in refused[0][1], refused
    assert "not cluster fa4ec1057e200001" in refused[1][1], refused
    assert "HTTP 404" in refused[2][1], refused
    deadline = time.monotonic() + 5
    while sum(1 for f in member.received() if f[0] == "R") < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(1 for f in member.received() if f[0] == "R") == 8, member.received()
    for other in (standalone, stranger, old):
        assert other.received() == [], "never sent to"
        assert other.cards_asked == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "latchkey" and r.levelno == logging.ERROR]
    for addr, why in refused:
        assert f"{addr} is not used: {why}; " in "\n".join(logged), logged
    client.close()


def test_a_list_of_only_foreign_servers_is_unavailable_and_says_why() -> None:
    """client_redirects.rs a_list_of_only_foreign_servers_is_unavailable_and_says_why"""
    standalone = FakeMember(leading(9))
    standalone.card = standalone_card(5)
    another = FakeMember(leading(9))
    another.card = standalone_card(6)
    client = make_client([standalone.addr, another.addr])
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=0.3, lease=LEASE)
    assert_between(time.monotonic() - start, 0.3, 0.3 + 3.0)
    text = str(raised.value)
    assert "another standalone server" in text, text
    assert client.last_unavailable is not None and "another standalone server" in client.last_unavailable
    refused = client.refused_members(5.0)
    assert len(refused) == 1 and "another standalone server" in refused[0][1], refused
    with pytest.raises(latchkey.Unavailable):
        client.query("k")
    assert standalone.received() == []
    assert another.received() == []
    client.close()


def test_one_standalone_server_at_every_address_is_used() -> None:
    """client_redirects.rs one_standalone_server_at_every_address_is_used"""
    standalone = FakeMember(leading(4))
    standalone.card = standalone_card(5)
    alias = FakeMember(leading(4))
    alias.card = standalone_card(5)
    client = make_client([standalone.addr, alias.addr])
    assert client.acquire("k", wait=2.0, lease=LEASE).token == 4
    assert client.refused_members(5.0) == []
    client.close()


def test_one_address_is_never_asked_for_its_card() -> None:
    only = FakeMember(leading(6))
    only.card = standalone_card(5)
    client = make_client([only.addr])
    assert client.acquire("k", wait=0, lease=LEASE).token == 6
    assert client.refused_members(0.0) == []
    assert only.cards_asked == 0
    client.close()


def test_a_redirect_to_a_member_the_card_lists_is_taken_at_once_and_others_are_asked() -> None:
    """A leader learned from ``M`` that the cluster's card lists is sent to without asking it;
    one the card does not list is asked first, and a standalone server named so is refused."""
    leader = FakeMember(leading(21))
    unlisted = FakeMember(leading(22))
    alone = FakeMember(leading(23))
    alone.card = standalone_card(9)
    follower = FakeMember(redirect_to(leader.addr))
    second = FakeMember(redirect_to(leader.addr))
    for fake in (follower, second):
        fake.card = member_card(fake.addr, clients=[follower.addr, second.addr, leader.addr])
    client = make_client([follower.addr, second.addr])
    assert client.acquire("a", wait=2.0, lease=LEASE).token == 21
    assert leader.cards_asked == 0, "listed in the card: not asked"
    for fake in (follower, second, leader):
        fake.set_script(redirect_to(unlisted.addr))
    assert client.acquire("b", wait=2.0, lease=LEASE).token == 22
    assert unlisted.cards_asked == 1, "not listed: asked, and of the cluster"
    for fake in (follower, second, leader, unlisted):
        fake.set_script(redirect_to(alone.addr))
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("c", wait=0.5, lease=LEASE)
    assert "named in a redirect" in str(raised.value), raised.value
    assert alone.received() == []
    assert [addr for addr, _ in client.refused_members(5.0)] == [alone.addr]
    client.close()


def test_a_call_waits_for_the_card_of_its_member_within_its_deadline_and_no_longer() -> None:
    """A member that does not answer its card (a paused process) holds a call only until the
    call's deadline; the member after it serves the next call."""
    paused = FakeMember(leading(1))
    paused.paused = True
    silent = FakeMember(leading(2))
    silent.paused = True
    client = make_client([paused.addr, silent.addr], connect=5.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=0.4, lease=LEASE)
    assert_between(time.monotonic() - start, 0.4, 0.4 + 3.0)
    assert "its card (GET /cluster) was not answered in time" in str(raised.value), raised.value
    assert paused.received() == [] and silent.received() == []
    assert client.refused_members(0.1) == [], "not refused: not answered yet"
    client.close()


def test_an_unreachable_address_is_asked_again_when_a_call_needs_it() -> None:
    """An address nothing listens on is reported as a session that cannot connect is; once a
    member of the cluster listens there, a call's ask finds it and uses it."""
    leader = FakeMember(leading(11))
    dead = dead_addr()
    client = make_client([dead, leader.addr])
    assert client.acquire("k", wait=2.0, lease=LEASE).token == 11
    leader.set_script(redirect_to(dead))
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("j", wait=0.5, lease=LEASE)
    assert f"{dead}: unreachable: cannot connect" in str(raised.value), raised.value
    server = FakeServer(dead)
    got: List[object] = []
    thread = threading.Thread(target=lambda: got.append(client.acquire("j", wait=3.0, lease=LEASE)))
    thread.start()
    conn = server.accept()
    assert server.cards_asked >= 1, "asked before any session"
    owner, _, _, _ = conn.acquire()
    conn.send(resp("A", owner, 12))
    thread.join(10)
    assert isinstance(got[0], latchkey.Ticket) and got[0].token == 12
    client.close()
    server.close()


def test_fetch_over_a_socket_bounds_the_answer_and_the_time() -> None:
    """``fetch``: an answer longer than 16 KiB is not read on; a silent server is given up at
    the deadline, never before; a refused connect is worded as a session words it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def serve(big: bool) -> None:
        sock, _ = listener.accept()
        sock.recv(4096)
        if big:
            try:
                sock.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (17 * 1024))
            except OSError:
                pass
        else:
            time.sleep(1.5)
        sock.close()

    thread = threading.Thread(target=serve, args=(True,), daemon=True)
    thread.start()
    answer = fetch(("127.0.0.1", port), None, None, time.monotonic() + 5)
    assert answer == FetchError(True, "the answer is longer than 16384 bytes"), answer
    thread.join(5)
    thread = threading.Thread(target=serve, args=(False,), daemon=True)
    thread.start()
    start = time.monotonic()
    answer = fetch(("127.0.0.1", port), None, None, start + 0.5)
    assert_between(time.monotonic() - start, 0.5, 0.5 + 2.0)
    assert answer == FetchError(True, "no answer to GET /cluster in time"), answer
    thread.join(5)
    listener.close()
    host, _, dead_port = dead_addr().rpartition(":")
    answer = fetch((host, int(dead_port)), None, None, time.monotonic() + 2)
    assert isinstance(answer, FetchError) and answer.unreachable
    assert answer.cause.startswith("cannot connect: ") and "onnection refused" in answer.cause, answer


def test_the_asyncio_client_names_the_refused_members() -> None:
    member = FakeMember(leading(3))
    standalone = FakeMember(leading(9))
    standalone.card = standalone_card(5)

    async def main() -> None:
        async with latchkey.aio.Client([member.addr, standalone.addr], sessions=1) as client:
            ticket = await client.acquire("k", wait=1.0, lease=LEASE)
            assert ticket.token == 3
            refused = await client.refused_members(5.0)
            assert [addr for addr, _ in refused] == [standalone.addr], refused
            assert "a standalone server" in refused[0][1]

    asyncio.run(main())
    assert standalone.received() == []


# ---------------------------------------------------------------------------------------------
# The real server


def test_two_real_standalone_servers_in_one_list_are_refused_and_one_alone_works() -> None:
    one, two = Server(), Server()
    try:
        card = fetch(one.addr, None, None, time.monotonic() + 5)
        assert isinstance(card, Standalone), card
        assert fetch(two.addr, None, None, time.monotonic() + 5) != card, "another run's number"
        client = make_client([one.text, two.text])
        refused = client.refused_members(5.0)
        assert len(refused) == 1, refused
        assert refused[0][0] in (one.text, two.text)
        assert "another standalone server" in refused[0][1], refused
        with pytest.raises(latchkey.Unavailable) as raised:
            client.acquire("k", wait=0.3, lease=LEASE)
        assert "another standalone server" in str(raised.value), raised.value
        client.close()
        for server in (one, two):
            alone = make_client([server.text])
            assert alone.query("k").held is False, "nothing taken from either"
            ticket = alone.acquire("k", wait=0, lease=LEASE)
            assert ticket.release() is True
            alone.close()
        # One server at two addresses (its IPv4 address and ``localhost``) is one server.
        both = make_client([one.text, f"localhost:{one.addr[1]}"])
        try:
            assert both.refused_members(5.0) == []
            assert both.acquire("k", wait=1.0, lease=LEASE).release() is True
        except latchkey.Unavailable as error:
            if "localhost" in str(error) and "cannot connect" in str(error):
                pytest.skip("localhost does not reach 127.0.0.1 here")
            raise
        finally:
            both.close()
    finally:
        one.stop()
        two.stop()


def test_a_list_where_nothing_listens_is_unavailable_at_once_unless_refusals_are_retried() -> None:
    """An ask whose connection is refused counts as a session's refused connect: a list where
    nothing listens anywhere ends at once (not at the deadline), saying so; with
    ``retry_refused=True`` the call keeps asking until its deadline."""
    dead = [dead_addr(), dead_addr()]
    client = make_client(dead)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=30.0, lease=LEASE)
    assert time.monotonic() - start < 15.0, "at once, not at the deadline"
    text = str(raised.value)
    assert "nothing listens there" in text, text
    assert f"{dead[0]}: unreachable: cannot connect" in text, text
    client.close()
    client = latchkey.Client(dead, sessions=1, transport_timeout=TRANSPORT, retry_refused=True)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=0.5, lease=LEASE)
    assert_between(time.monotonic() - start, 0.5, 0.5 + 3.0)
    assert "nothing listens there" not in str(raised.value)
    client.close()
