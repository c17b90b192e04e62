"""The card reader (``latchkey._card``) and the acceptance rules (``latchkey._check``), sans IO:
a case-by-case mirror of the unit tests of crates/latchkey-client/src/card.rs and check.rs,
plus the strictness Python's ``int`` would not give by itself."""

from __future__ import annotations

import logging
from typing import Union

import pytest

from latchkey._card import (
    CARD_FIRST_LINE,
    CARD_MEMBERS_MAX,
    Card,
    CardError,
    FetchError,
    Member,
    Standalone,
    card_of_answer,
    parse,
)
from latchkey._check import ACCEPTED, ASKING, REFUSED, UNKNOWN, WAITING, Check, Verdict


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


def addr(port: int) -> tuple:
    return ("127.0.0.1", port)


def member(cluster: int, ident: int, ports: list) -> Card:
    return Member(cluster, ident, 8, tuple((i + 1, addr(p)) for i, p in enumerate(ports)))


def standalone(instance: int) -> Card:
    return Standalone(instance)


def refused(verdict: Verdict) -> str:
    assert verdict.kind == REFUSED, f"not refused: {verdict}"
    return verdict.why


def test_members_of_one_cluster_are_accepted_and_another_clusters_refused(caplog: pytest.LogCaptureFixture) -> None:
    """check.rs members_of_one_cluster_are_accepted_and_another_clusters_refused"""
    check = Check([addr(1), addr(2), addr(3)])
    assert check.answered(addr(2), member(7, 2, [1, 2])).kind == ACCEPTED
    assert check.answered(addr(1), member(7, 1, [1, 2])).kind == ACCEPTED
    with caplog.at_level(logging.ERROR, logger="latchkey"):
        why = refused(check.answered(addr(3), member(8, 1, [3])))
    assert "cluster 0000000000000008, not cluster 0000000000000007" in why, why
    assert "127.0.0.1:2" in why, why
    assert [address for address, _ in check.refused()] == [addr(3)]
    logged = [r for r in caplog.records if r.name == "latchkey" and r.levelno == logging.ERROR]
    assert len(logged) == 1
    assert logged[0].getMessage().startswith(f"127.0.0.1:3 is not used: {why}; "), logged[0].getMessage()


def test_a_standalone_server_in_a_list_with_members_is_refused_whoever_answers_first() -> None:
    """check.rs a_standalone_server_in_a_list_with_members_is_refused_whoever_answers_first"""
    check = Check([addr(1), addr(2)])
    first = check.answered(addr(1), standalone(5))
    assert first.kind == WAITING, f"waits for the others: {first}"
    assert check.answered(addr(2), member(7, 1, [2])).kind == ACCEPTED
    assert "standalone" in refused(check.verdict(addr(1)))

    check = Check([addr(1), addr(2)])
    assert check.answered(addr(2), member(7, 1, [2])).kind == ACCEPTED
    assert "standalone" in refused(check.answered(addr(1), standalone(5)))


def test_one_standalone_server_at_every_address_is_accepted_two_are_refused() -> None:
    """check.rs one_standalone_server_at_every_address_is_accepted_two_are_refused"""
    check = Check([addr(1), addr(2)])
    assert check.answered(addr(1), standalone(5)).kind == WAITING
    assert check.answered(addr(2), standalone(5)).kind == ACCEPTED
    assert check.verdict(addr(1)).kind == ACCEPTED

    check = Check([addr(1), addr(2)])
    assert check.answered(addr(1), standalone(5)).kind == WAITING
    assert "another standalone" in refused(check.answered(addr(2), standalone(6)))


def test_no_card_is_refused_and_an_unreachable_address_asked_again() -> None:
    """check.rs no_card_is_refused_and_an_unreachable_address_asked_again"""
    check = Check([addr(1), addr(2)])
    old: Union[Card, FetchError] = FetchError(False, "HTTP 404")
    assert "HTTP 404" in refused(check.answered(addr(1), old))
    down = FetchError(True, "refused")
    assert check.answered(addr(2), down) == Verdict(UNKNOWN, "refused")
    check.asking(addr(2))
    assert check.verdict(addr(2)).kind == ASKING
    assert not check.settled()
    assert check.answered(addr(2), member(7, 1, [2])).kind == ACCEPTED
    assert check.settled()


def test_a_redirect_to_a_listed_member_is_accepted_at_once_and_others_are_asked() -> None:
    """check.rs a_redirect_to_a_listed_member_is_accepted_at_once_and_others_are_asked"""
    check = Check([addr(1), addr(2)])
    assert check.verdict(addr(3)).kind == UNKNOWN
    assert check.answered(addr(1), member(7, 1, [1, 3])).kind == ACCEPTED
    assert check.verdict(addr(3)).kind == ACCEPTED
    assert check.verdict(addr(4)).kind == UNKNOWN
    assert check.verdict(addr(2)).kind == UNKNOWN, "listed: asked"
    assert "redirect" in refused(check.answered(addr(4), standalone(1)))


def test_refused_addresses_come_configured_first_in_their_order() -> None:
    check = Check([addr(9), addr(1), addr(5)])
    assert check.answered(addr(9), FetchError(False, "HTTP 404")).kind == REFUSED
    assert check.answered(addr(1), member(7, 1, [1])).kind == ACCEPTED
    assert check.answered(addr(4), standalone(3)).kind == REFUSED  # learned
    assert check.answered(addr(5), member(8, 1, [5])).kind == REFUSED
    assert [a for a, _ in check.refused()] == [addr(9), addr(5), addr(4)]
