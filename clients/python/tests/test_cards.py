"""A client given several addresses takes only the members of one cluster: each address is
asked for its card (``GET /cluster``), and the list is accepted or refused whole — the mirror
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
    one_cluster,
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


def test_a_list_that_mixes_clusters_is_refused_whole_and_nothing_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """client_redirects.rs a_list_that_mixes_clusters_is_refused_whole_and_nothing_is_sent"""
    member = FakeMember(leading(3))
    stranger = FakeMember(leading(9))
    stranger.card = other_cluster(stranger)
    standalone = FakeMember(leading(9))
    standalone.card = standalone_card(5)
    old = FakeMember(leading(9))
    old.card = None
    everyone = [member, stranger, standalone, old]
    # Whichever answers first (the second's card is held back), the list is refused once they
    # differ.
    for first, second in [(member, stranger), (stranger, member), (member, standalone), (member, old)]:
        second.card_delay = 0.3
        addrs = [first.addr, second.addr]
        client = make_client(addrs)
        with pytest.raises(latchkey.Unavailable) as raised:
            client.acquire("k", wait=0.5, lease=LEASE)
        text = str(raised.value)
        assert "not the members of one cluster" in text, text
        assert client.last_unavailable is not None and "not the members of one cluster" in client.last_unavailable
        refused = client.refused_members(5.0)
        assert [addr for addr, _ in refused] == addrs, refused
        client.close()
        second.card_delay = 0.0
    with caplog.at_level(logging.ERROR, logger="latchkey"):
        client = make_client([fake.addr for fake in everyone])
        refused = client.refused_members(5.0)
    said = dict(refused)
    assert said[member.addr] == "it is cluster fa4ec1057e200001", refused
    assert said[stranger.addr] == "it is cluster fa4ec1057e200002", refused
    assert said[standalone.addr].startswith("it is a standalone server (run "), refused
    assert said[old.addr].startswith("it answered GET /cluster without a card (HTTP 404): "), refused
    with pytest.raises(latchkey.Unavailable) as raised:
        client.query("k")
    assert f"{old.addr}: not used: it answered GET /cluster without a card" in str(raised.value), raised.value
    with pytest.raises(latchkey.Unavailable):
        client.ping()
    logged = [r.getMessage() for r in caplog.records if r.name == "latchkey" and r.levelno == logging.ERROR]
    assert logged and all(m.startswith("the listed servers are not the members of one cluster (") for m in logged)
    client.close()
    for other in everyone:
        assert other.received() == [], "never sent to"


def test_a_member_of_a_build_before_cards_is_vouched_for_by_the_upgraded_members_cards(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """client_redirects.rs
    a_member_of_a_build_before_cards_is_vouched_for_by_the_upgraded_members_cards"""
    upgraded = FakeMember(redirect_to(None))
    old = FakeMember(leading(6))
    one_cluster([upgraded, old])
    old.card = None
    listed = make_client([upgraded.addr, old.addr])
    ticket = listed.acquire("k", wait=3.0, lease=LEASE)
    assert ticket.token == 6, "granted by the member that gives no card"
    assert listed.refused_members(0.0) == []
    listed.close()
    # None upgraded yet: the list is used as given, as before cards (with a warning).
    first = FakeMember(leading(2))
    first.card = None
    second = FakeMember(leading(2))
    second.card = None
    with caplog.at_level(logging.WARNING, logger="latchkey"):
        listed = make_client([first.addr, second.addr])
        assert listed.acquire("k", wait=3.0, lease=LEASE).token == 2
        assert listed.refused_members(0.0) == []
    listed.close()
    warned = [
        r.getMessage() for r in caplog.records if r.name == "latchkey" and r.levelno == logging.WARNING
    ]
    assert warned == [
        "no listed server gives a card (GET /cluster): they are older builds, and the list "
        "cannot be checked to name one cluster; it is used as given"
    ], warned


def test_a_list_of_two_standalone_servers_is_unavailable_and_says_why() -> None:
    """client_redirects.rs a_list_of_two_standalone_servers_is_unavailable_and_says_why"""
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
    assert "standalone server (run 0000000000000006)" in text, text
    refused = client.refused_members(5.0)
    assert [addr for addr, _ in refused] == [standalone.addr, another.addr], refused
    assert all("a standalone server" in why for _, why in refused), refused
    with pytest.raises(latchkey.Unavailable):
        client.query("k")
    assert standalone.received() == []
    assert another.received() == []
    client.close()


def test_a_member_where_nothing_listens_or_that_never_answers_its_card_holds_nothing_back() -> None:
    """client_redirects.rs
    a_member_where_nothing_listens_or_that_never_answers_its_card_holds_nothing_back"""
    leader = FakeMember(leading(8))
    silent = FakeMember(leading(9))
    silent.paused = True
    one_cluster([leader, silent])
    listed = make_client([silent.addr, dead_addr(), leader.addr], connect=1.0)
    ticket = listed.acquire("k", wait=5.0, lease=LEASE)
    assert ticket.token == 8
    assert listed.refused_members(0.0) == []
    assert silent.received() == []
    listed.close()


def test_an_accepted_list_is_refused_when_an_address_where_nothing_listened_answers_another_owner() -> None:
    """check.rs a_standalone_server_beside_members_refuses_the_list_even_after_it_was_accepted,
    through the client: the documented window closes when a call next needs that address."""
    leader = FakeMember(leading(11))
    dead = dead_addr()
    client = make_client([dead, leader.addr])
    assert client.acquire("k", wait=2.0, lease=LEASE).token == 11
    server = FakeServer(dead)
    server.card = standalone_card(5)
    # (Cards are answered while a test accepts.)
    threading.Thread(target=server.accept_raw, args=(3.0,), daemon=True).start()
    leader.set_script(redirect_to(dead))
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("j", wait=0.5, lease=LEASE)
    assert "not the members of one cluster" in str(raised.value), raised.value
    refused = client.refused_members(5.0)
    assert [addr for addr, _ in refused] == [dead, leader.addr], refused
    assert refused[0][1].startswith("it is a standalone server"), refused
    with pytest.raises(latchkey.Unavailable):
        client.query("k")
    client.close()
    server.close()


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
    """Members that do not answer their cards (paused processes) hold a call, which sends
    nothing, only until the call's deadline."""
    paused = FakeMember(leading(1))
    paused.paused = True
    silent = FakeMember(leading(2))
    silent.paused = True
    client = make_client([paused.addr, silent.addr], connect=5.0)
    start = time.monotonic()
    with pytest.raises(latchkey.Unavailable) as raised:
        client.acquire("k", wait=0.4, lease=LEASE)
    assert_between(time.monotonic() - start, 0.4, 0.4 + 3.0)
    said = str(raised.value)
    assert "not confirmed members of one cluster yet" in said, said
    assert f"{paused.addr}: its card is being asked for" in said, said
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
            with pytest.raises(latchkey.Unavailable):
                await client.acquire("k", wait=0.5, lease=LEASE)
            refused = await client.refused_members(5.0)
            assert [addr for addr, _ in refused] == [member.addr, standalone.addr], refused
            assert "a standalone server" in refused[1][1]

    asyncio.run(main())
    assert standalone.received() == [] and member.received() == []


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
        assert [addr for addr, _ in refused] == [one.text, two.text], refused
        assert all(why.startswith("it is a standalone server (run ") for _, why in refused), refused
        with pytest.raises(latchkey.Unavailable) as raised:
            client.acquire("k", wait=0.3, lease=LEASE)
        assert "not the members of one cluster" in str(raised.value), raised.value
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
