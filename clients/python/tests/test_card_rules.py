"""The card reader (``latchkey._card``) and the acceptance rules (``latchkey._check``), sans IO:
a case-by-case mirror of the unit tests of crates/latchkey-client/src/card.rs and check.rs,
plus the strictness Python's ``int`` would not give by itself."""

from __future__ import annotations

import logging
from typing import List, Tuple, Union

import pytest

from latchkey._card import (
    CARD_FIRST_LINE,
    CARD_MEMBERS_MAX,
    Card,
    CardError,
    FetchError,
    Member,
    Standalone,
    TryLater,
    card_of_answer,
    parse,
)
from latchkey._check import ACCEPTED, REFUSED, UNSETTLED, Check, Verdict


def member_card() -> Member:
    return Member(0x5F1C0E2A9D3B7C41, 2, 64, ((1, ("127.0.0.1", 7420)), (2, ("::1", 7421))))


# ---------------------------------------------------------------------------------------------
# card.rs


def test_a_card_reads_back_as_it_was_rendered() -> None:
    """card.rs a_card_reads_back_as_it_was_rendered"""
    standalone = Standalone(7)
    for card in (member_card(), standalone):
        assert parse(card.render()) == card
    text = member_card().render()
    assert text.startswith("latchkey-card 1\ncluster 5f1c0e2a9d3b7c41\nmember 2\n")
    assert text.endswith("client 2 [::1]:7421\n"), text
    assert standalone.render() == "latchkey-card 1\nstandalone 0000000000000007\n"


def test_unknown_lines_are_ignored_and_bad_cards_refused() -> None:
    """card.rs unknown_lines_are_ignored_and_bad_cards_refused"""
    later = member_card().render() + "version 9 and more\n"
    assert parse(later) == member_card()
    refused = [
        "",
        "latchkey-card 2\nstandalone 1\n",
        "latchkey-card 1\n",
        "latchkey-card 1\nstandalone zz\n",
        "latchkey-card 1\nstandalone 1\nstandalone 2\n",
        "latchkey-card 1\nstandalone 1\ncluster 2\nmember 1\nshards 1\nclient 1 1.2.3.4:5\n",
        "latchkey-card 1\ncluster 2\nmember 1\nshards 1\n",
        "latchkey-card 1\ncluster 2\nmember 1\nshards 1\nclient 1 nowhere\n",
    ]
    for text in refused:
        with pytest.raises(CardError):
            parse(text)
    many = "".join(f"client {n} 127.0.0.1:1\n" for n in range(CARD_MEMBERS_MAX + 1))
    many = f"{CARD_FIRST_LINE}\ncluster 1\nmember 1\nshards 1\n{many}"
    with pytest.raises(CardError, match="more than 64 members"):
        parse(many)
    exactly = "".join(f"client {n} 127.0.0.1:1\n" for n in range(CARD_MEMBERS_MAX))
    card = parse(f"{CARD_FIRST_LINE}\ncluster 1\nmember 1\nshards 1\n{exactly}")
    assert isinstance(card, Member) and len(card.clients) == CARD_MEMBERS_MAX


def test_the_messages_say_what_is_wrong_as_the_rust_reader_says_it() -> None:
    def why(text: str) -> str:
        with pytest.raises(CardError) as raised:
            parse(text)
        return str(raised.value)

    assert why("hello\n") == "its first line is not `latchkey-card 1`"
    assert why("latchkey-card 1\nstandalone 1\nstandalone 2\n") == "it has two `standalone` lines"
    assert why("latchkey-card 1\nstandalone zz\n") == 'its `standalone` line is not a hex number: "zz"'
    assert why("latchkey-card 1\nmember x\n") == 'its `member` line is not a number: "x"'
    assert why("latchkey-card 1\ncluster 1\nmember 1\nshards 1\nclient 1\n") == (
        'its `client` line is not `ID ADDRESS`: "1"'
    )
    assert why("latchkey-card 1\n") == "it is neither a standalone server's nor a member's"


def test_numbers_and_addresses_are_read_as_strictly_as_rust_reads_them() -> None:
    """Python's ``int`` takes ``0x``, ``_`` and spaces, and any size; Rust's parsers do not."""
    for value in ["0x1f", "1_0", " 1", "1 2", "-1", "", "+", "1" + "0" * 16]:
        with pytest.raises(CardError):
            parse(f"latchkey-card 1\nstandalone {value}\n")
    assert parse("latchkey-card 1\nstandalone +fF\n") == Standalone(0xFF)
    assert parse("latchkey-card 1\r\nstandalone ffffffffffffffff \r\n") == Standalone((1 << 64) - 1)
    base = "latchkey-card 1\ncluster 1\nmember 1\nclient 1 127.0.0.1:1\n"
    assert isinstance(parse(base + f"shards {(1 << 32) - 1}\n"), Member)
    with pytest.raises(CardError):
        parse(base + f"shards {1 << 32}\n")
    with pytest.raises(CardError):
        parse("latchkey-card 1\ncluster 1\nmember 18446744073709551616\nshards 1\nclient 1 127.0.0.1:1\n")
    head = "latchkey-card 1\ncluster 1\nmember 1\nshards 1\n"
    for addr in ["localhost:1", "127.0.0.1", "127.0.0.1:65536", "::1:5", "[::1]", "01.2.3.4:5", "127.0.0.1:1 x"]:
        with pytest.raises(CardError):
            parse(head + f"client 1 {addr}\n")
    card = parse(head + "client 1 [0:0::1]:5\nclient 2 10.0.0.1:7420\n")
    assert isinstance(card, Member)
    assert card.clients == ((1, ("::1", 5)), (2, ("10.0.0.1", 7420)))
    assert card.lists(("::1", 5)) and card.lists(("0::1", 5)) and card.lists(("10.0.0.1", 7420))
    assert not card.lists(("localhost", 5)) and not card.lists(("10.0.0.1", 7421))


def test_an_answer_is_a_card_only_with_status_200() -> None:
    """card.rs an_answer_is_a_card_only_with_status_200"""
    body = member_card().render()
    ok = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    assert card_of_answer(ok) == member_card()
    with pytest.raises(CardError) as raised:
        card_of_answer(b"HTTP/1.1 404 Not Found\r\n\r\nno such page")
    assert str(raised.value) == "HTTP 404"
    with pytest.raises(CardError):
        card_of_answer(b"X 1 0\n")
    with pytest.raises(CardError, match="not valid"):
        card_of_answer(b"HTTP/1.1 200 OK\r\n\r\nhello")
    with pytest.raises(CardError, match="not text"):
        card_of_answer(b"HTTP/1.1 200 OK\r\n\r\n\xff")
    with pytest.raises(CardError, match="no HTTP answer"):
        card_of_answer(b"SSH-2.0\r\n\r\n")
    # No answer, one cut short, or a server at its limits: ask again later.
    busy = b"HTTP/1.1 503 Service Unavailable\r\n\r\ntoo many admin requests"
    for later in [b"", b"HTTP/1.1 200 OK\r\nContent-", busy]:
        with pytest.raises(TryLater):
            card_of_answer(later)


def test_a_fetch_error_says_what_the_rust_one_says() -> None:
    assert str(FetchError(True, "cannot connect: Connection refused")) == (
        "could not be asked: cannot connect: Connection refused"
    )
    assert str(FetchError(False, "HTTP 404")) == (
        "answered GET /cluster without a card (HTTP 404): not a latchkey server, or one older "
        "than this client"
    )


# ---------------------------------------------------------------------------------------------
# check.rs


Answer = Union[Card, FetchError]


def addr(port: int) -> Tuple[str, int]:
    return ("127.0.0.1", port)


def member(cluster: int, ports: List[int]) -> Answer:
    return Member(cluster, 1, 8, tuple((p, addr(p)) for p in ports))


def standalone(instance: int) -> Answer:
    return Standalone(instance)


def refused_connect() -> Answer:
    return FetchError(True, "cannot connect: connection refused", True)


def timed_out() -> Answer:
    return FetchError(True, "no answer to GET /cluster in time")


def refused(verdict: Verdict) -> str:
    assert verdict.kind == REFUSED, f"not refused: {verdict}"
    return verdict.why


def unsettled(verdict: Verdict) -> bool:
    return verdict.kind == UNSETTLED


def test_the_members_of_one_cluster_are_accepted_once_every_listed_address_is_vouched_for() -> None:
    """check.rs the_members_of_one_cluster_are_accepted_once_every_listed_address_is_vouched_for"""
    check = Check([addr(1), addr(2), addr(3)])
    check.asking(addr(1))
    check.asking(addr(2))
    check.asking(addr(3))
    check.answered(addr(1), member(7, [1, 2]))
    assert unsettled(check.verdict(addr(1))), "3 not vouched for yet"
    check.answered(addr(2), member(7, [1, 2]))
    assert unsettled(check.verdict(addr(1)))
    check.answered(addr(3), member(7, [3]))
    for port in (1, 2, 3):
        assert check.verdict(addr(port)) == Verdict(ACCEPTED)
    assert check.refused() == []


def test_a_member_the_cards_list_or_where_nothing_listens_does_not_hold_the_list_back() -> None:
    """check.rs a_member_the_cards_list_or_where_nothing_listens_does_not_hold_the_list_back"""
    # 2 is paused (its ask times out) but a card lists it; 3 is down, listed by none.
    check = Check([addr(1), addr(2), addr(3)])
    check.answered(addr(2), timed_out())
    check.answered(addr(3), refused_connect())
    assert unsettled(check.verdict(addr(1)))
    check.answered(addr(1), member(7, [1, 2]))
    assert check.verdict(addr(1)) == Verdict(ACCEPTED)
    assert check.verdict(addr(2)) == Verdict(ACCEPTED), "the card lists it"
    verdict = check.verdict(addr(3))
    assert unsettled(verdict), "3 is asked again before use"
    assert (verdict.ask, verdict.refused) == ((addr(3),), True)
    check.answered(addr(3), member(7, [3]))
    assert check.verdict(addr(3)) == Verdict(ACCEPTED)


def test_two_clusters_in_a_list_refuse_it_whichever_answers_first() -> None:
    """check.rs two_clusters_in_a_list_refuse_it_whichever_answers_first"""
    for first in (1, 2):
        second = 3 - first
        check = Check([addr(1), addr(2)])
        check.answered(addr(first), member(first, [first]))
        check.answered(addr(second), member(second, [second]))
        why = refused(check.verdict(addr(1)))
        assert why.startswith("it is cluster 0000000000000001 (the listed"), why
        everything = check.refused()
        assert len(everything) == 2
        assert everything[1][1].startswith("it is cluster 0000000000000002"), everything


def test_a_standalone_server_beside_members_refuses_the_list_even_after_it_was_accepted() -> None:
    """check.rs a_standalone_server_beside_members_refuses_the_list_even_after_it_was_accepted"""
    check = Check([addr(1), addr(2)])
    check.answered(addr(1), standalone(5))
    check.answered(addr(2), member(7, [2]))
    assert "a standalone server" in refused(check.verdict(addr(1)))
    assert "not the members of one cluster" in refused(check.verdict(addr(2)))

    # Accepted while nothing listened at 1; a standalone server there later refuses it.
    check = Check([addr(1), addr(2)])
    check.answered(addr(1), refused_connect())
    check.answered(addr(2), member(7, [2]))
    assert check.verdict(addr(2)) == Verdict(ACCEPTED)
    check.answered(addr(1), standalone(5))
    assert "a standalone server" in refused(check.verdict(addr(1)))
    assert "not the members of one cluster" in refused(check.verdict(addr(2)))


def test_one_standalone_server_at_every_address_is_accepted_two_are_refused() -> None:
    """check.rs one_standalone_server_at_every_address_is_accepted_two_are_refused"""
    check = Check([addr(1), addr(2), addr(3)])
    check.answered(addr(1), standalone(5))
    check.answered(addr(3), refused_connect())
    assert unsettled(check.verdict(addr(1)))
    check.answered(addr(2), standalone(5))
    assert check.verdict(addr(1)) == Verdict(ACCEPTED)

    check = Check([addr(1), addr(2)])
    check.answered(addr(1), standalone(5))
    check.answered(addr(2), standalone(6))
    assert "a standalone server (run 0000000000000006)" in refused(check.verdict(addr(2)))


def test_an_older_member_without_a_card_is_vouched_for_by_the_clusters_cards(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """check.rs an_older_member_without_a_card_is_vouched_for_by_the_clusters_cards"""
    # A rolling upgrade: 1 and 3 are of builds before cards; 2's card lists them all.
    check = Check([addr(1), addr(2), addr(3)])

    def old() -> Answer:
        return FetchError(False, "HTTP 404")

    check.answered(addr(1), old())
    assert unsettled(check.verdict(addr(1))), "pending: 2 and 3 not answered"
    check.answered(addr(2), member(7, [1, 2, 3]))
    check.answered(addr(3), old())
    for port in (1, 2, 3):
        assert check.verdict(addr(port)) == Verdict(ACCEPTED)
    assert check.refused() == []
    # Every listed server without a card: older builds, used as given (warned once).
    with caplog.at_level(logging.WARNING, logger="latchkey"):
        check = Check([addr(1), addr(2), addr(3)])
        check.answered(addr(1), old())
        check.answered(addr(2), refused_connect())
        assert unsettled(check.verdict(addr(1)))
        check.answered(addr(3), old())
        assert check.verdict(addr(1)) == Verdict(ACCEPTED)
        verdict = check.verdict(addr(2))
        assert unsettled(verdict), "where nothing listened is asked first"
        assert (verdict.ask, verdict.refused) == ((addr(2),), True)
        check.answered(addr(2), refused_connect())
        assert check.verdict(addr(3)) == Verdict(ACCEPTED)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "no listed server gives a card (GET /cluster): they are older builds, and the list "
        "cannot be checked to name one cluster; it is used as given"
    ], warned
    # A server of this build there, whose cards do not list the older ones: refused.
    check.answered(addr(2), member(7, [2]))
    assert "HTTP 404" in refused(check.verdict(addr(1)))
    # One whose card lists them: accepted.
    check = Check([addr(1), addr(2), addr(3)])
    check.answered(addr(1), old())
    check.answered(addr(2), refused_connect())
    check.answered(addr(3), old())
    check.asking(addr(2))
    verdict = check.verdict(addr(2))
    assert (verdict.kind, verdict.waiting, verdict.ask) == (UNSETTLED, True, ())
    check.answered(addr(2), member(7, [1, 2, 3]))
    for port in (1, 2, 3):
        assert check.verdict(addr(port)) == Verdict(ACCEPTED)
    # A leader an ``M`` names that answers without a card: used where the cards list it,
    # refused alone where they do not (not in the Rust test: check.rs ``stranger``).
    check = Check([addr(1), addr(2)])
    check.answered(addr(1), member(7, [1, 2, 4]))
    check.answered(addr(2), old())
    assert check.verdict(addr(2)) == Verdict(ACCEPTED)
    check.answered(addr(4), old())
    check.answered(addr(5), old())
    assert check.verdict(addr(4)) == Verdict(ACCEPTED)
    assert "HTTP 404" in refused(check.verdict(addr(5)))
    assert [a for a, _ in check.refused()] == [addr(5)]
    # A standalone server beside servers without a card is refused (it lists nothing).
    check = Check([addr(1), addr(2)])
    check.answered(addr(1), old())
    check.answered(addr(2), standalone(5))
    assert "HTTP 404" in refused(check.verdict(addr(1)))


def test_a_server_without_a_card_refuses_the_list() -> None:
    """check.rs a_server_without_a_card_refuses_the_list"""
    check = Check([addr(1), addr(2)])
    check.answered(addr(2), member(7, [2]))
    check.answered(addr(1), FetchError(False, "HTTP 404"))
    assert "HTTP 404" in refused(check.verdict(addr(1)))
    assert refused(check.verdict(addr(2))).startswith("it is cluster")


def test_a_pending_list_asks_what_it_lacks_and_says_nothing_listens_anywhere() -> None:
    """check.rs a_pending_list_asks_what_it_lacks_and_says_nothing_listens_anywhere"""
    check = Check([addr(1), addr(2)])
    verdict = check.verdict(addr(1))
    assert unsettled(verdict), "pending"
    assert (verdict.ask, verdict.waiting) == ((addr(1), addr(2)), False)
    check.asking(addr(1))
    check.asking(addr(2))
    assert not check.settled()
    verdict = check.verdict(addr(1))
    assert unsettled(verdict) and verdict.waiting
    check.answered(addr(1), refused_connect())
    check.answered(addr(2), refused_connect())
    assert check.settled()
    verdict = check.verdict(addr(2))
    assert unsettled(verdict), "pending"
    assert not verdict.waiting and verdict.refused, f"nothing listens: {verdict.why}"


def test_a_redirect_to_a_listed_member_is_accepted_at_once_and_a_foreign_one_refused_alone() -> None:
    """check.rs a_redirect_to_a_listed_member_is_accepted_at_once_and_a_foreign_one_refused_alone"""
    check = Check([addr(1), addr(2)])
    check.answered(addr(1), member(7, [1, 2, 3]))
    check.answered(addr(2), member(7, [1, 2, 3]))
    assert check.verdict(addr(3)) == Verdict(ACCEPTED)
    assert unsettled(check.verdict(addr(4))), "asked first"
    check.answered(addr(4), standalone(1))
    assert "redirect" in refused(check.verdict(addr(4)))
    assert check.verdict(addr(1)) == Verdict(ACCEPTED), "the list stands"
    assert len(check.refused()) == 1


# Beyond check.rs's own tests: the words, the log, the order, and Python's addresses.


def test_a_refused_list_is_logged_once_naming_every_address_and_what_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = Check([addr(9), addr(1), addr(5)])
    check.answered(addr(5), refused_connect())
    check.answered(addr(1), member(7, [1]))
    with caplog.at_level(logging.ERROR, logger="latchkey"):
        check.answered(addr(9), FetchError(False, "HTTP 404"))
        check.answered(addr(5), member(8, [5]))  # already refused: not logged again
    logged = [r.getMessage() for r in caplog.records if r.name == "latchkey" and r.levelno == logging.ERROR]
    assert logged == [
        "the listed servers are not the members of one cluster (127.0.0.1:9: it answered GET "
        "/cluster without a card (HTTP 404): not a latchkey server, or one older than this "
        "client; 127.0.0.1:1: it is cluster 0000000000000007): none of them is used; a client "
        'given several addresses takes only the members of one cluster (docs/cluster.md, "What '
        'clients see")'
    ], logged
    assert check.refused() == [
        (addr(9), "it answered GET /cluster without a card (HTTP 404): not a latchkey server, or one older than this client"),
        (addr(1), "it is cluster 0000000000000007"),
        (addr(5), "it is cluster 0000000000000008"),
    ]
    assert refused(check.verdict(addr(4))) == (
        "not known (not answered yet) (the listed servers are not the members of one cluster)"
    )


def test_a_pending_list_says_what_each_address_lacks() -> None:
    check = Check([addr(1), addr(2), addr(3), addr(4)])
    check.asking(addr(2))
    check.answered(addr(3), timed_out())
    check.answered(addr(4), member(7, [4]))
    verdict = check.verdict(addr(1))
    assert verdict == Verdict(
        UNSETTLED,
        "the listed servers are not confirmed members of one cluster yet (127.0.0.1:1: not asked "
        "yet; 127.0.0.1:2: its card is being asked for; 127.0.0.1:3: no answer to GET /cluster "
        "in time)",
        (addr(1), addr(3)),
        waiting=True,
    ), verdict
    check.answered(addr(1), refused_connect())
    verdict = check.verdict(addr(1))
    assert (verdict.why, verdict.refused, verdict.cause) == ("cannot connect: connection refused", True, True)


def test_an_accepted_lists_unanswered_address_is_waited_for_and_a_failed_one_asked_again() -> None:
    check = Check([addr(1), addr(2), addr(3)])
    check.answered(addr(2), refused_connect())
    check.answered(addr(3), refused_connect())
    check.answered(addr(1), member(7, [1]))
    assert check.verdict(addr(1)) == Verdict(ACCEPTED)
    check.asking(addr(2))
    assert check.verdict(addr(2)) == Verdict(
        UNSETTLED, "its card (GET /cluster) was not answered in time", (), waiting=True
    )
    check.answered(addr(2), timed_out())
    assert check.verdict(addr(2)) == Verdict(
        UNSETTLED, "no answer to GET /cluster in time", (addr(2),), cause=True
    )
    assert check.verdict(addr(6)) == Verdict(
        UNSETTLED, "its card (GET /cluster) was not asked for yet", (addr(6),)
    )
    check.answered(addr(6), FetchError(False, "HTTP 404"))
    assert refused(check.verdict(addr(6))).startswith("it answered GET /cluster without a card")
    assert check.verdict(addr(1)) == Verdict(ACCEPTED), "a redirect's stranger refuses itself alone"


def test_a_card_lists_an_ip_address_in_any_spelling_and_never_a_name() -> None:
    v6 = ("::1", 4)
    check = Check([addr(1), ("0:0::1", 4), ("localhost", 1)])
    check.answered(("localhost", 1), refused_connect())
    check.answered(addr(1), Member(7, 1, 8, ((1, addr(1)), (4, v6))))
    assert check.verdict(("0:0::1", 4)) == Verdict(ACCEPTED), "listed as ::1"
    assert check.verdict(("localhost", 1)).kind == UNSETTLED, "a name is asked"
