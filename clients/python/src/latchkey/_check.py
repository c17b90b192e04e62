"""Whether a client's list of addresses names the members of one cluster, from their cards
(``_card``), and which addresses a call may send to: no list that mixes clusters, or a cluster
and a standalone server, can make two holders of one key. The rules of the Rust client's
``crates/latchkey-client/src/check.rs``, exactly, with its words.

The rules, for a client given more than one address (one address is never asked):

* The list is *accepted* once some address answered a card and every listed address is
  vouched for: it answered a card of that same owner (cluster, or standalone server run), or a
  card of that cluster lists it as a member's client address (a member that is down or
  paused, or of a build before cards, which answers ``GET /cluster`` 404: a rolling upgrade),
  or nothing listens there (the connection was refused: a member down).
* The list is *refused* for the client's life as soon as two listed addresses answer cards of
  different owners (two clusters, a cluster and a standalone server, two standalone servers),
  or one answers without a card where the cluster's cards do not list it (not latchkey, or an
  older standalone server): nothing is sent to any of them, whatever answered first. Each
  refusal is logged at error level on the ``latchkey`` logger, naming every address that
  answered and what it is.
* When every listed server answered without a card (or nothing listens there), they are all of
  builds before cards: the list is used as given, unchecked (logged once at warning level on
  the ``latchkey`` logger), as a client before cards did; a card answered later decides as
  above.
* Until then the list is *pending*: a call waits for the asks in flight (within its own
  deadline) and sends nothing. An address that could not be asked (no answer in time) is asked
  again when a call needs it.
* Once accepted, a call sends to an address that answered the list's card or that a card of
  the cluster lists (a leader named in an ``M`` among them); any other address (one where
  nothing listened, or a leader named in an ``M`` that no card lists) is asked first. A listed
  address that then answers another owner's card refuses the whole list; an ``M``-named one,
  only itself.

A window is left, and documented: an address where nothing listened when the list was accepted
may later start a server of another owner; the client finds it out when a call next needs that
address (and refuses the list from then on), not before.

Sans-IO: :class:`Check` takes answers and says verdicts; ``_client._Asker`` asks (one thread per
ask). Not thread-safe: its owner locks. Invariants: an accepted address answered the list's
owner or a card of it lists it (or the list is unchecked); a refused list stays refused.
"""

from __future__ import annotations

import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from ._card import Address, Card, FetchError, Member, Owner, _canonical, addr_text

LOG = logging.getLogger("latchkey")

# The kinds of verdict.
ACCEPTED = "accepted"  # send to it
REFUSED = "refused"  # never send to it: ``why``
UNSETTLED = "unsettled"  # not yet: ask ``ask``, wait while ``waiting``, else go elsewhere (``why``)


class Verdict(NamedTuple):
    """What may be done with an address now (check.rs ``Verdict``).

    ``UNSETTLED``: ask the addresses in ``ask`` (none is being asked), and wait while
    ``waiting`` (asks are in flight); otherwise the call goes elsewhere, because of ``why``.
    ``refused``: nothing listens at this address (a refused connection, for a call that fails at
    once when every listed member refuses). ``cause`` (not in the Rust client): ``why`` is what
    the ask of this address met (a failed connect, a timeout), which the client reports as it
    reports a session's (``unreachable: ...``)."""

    kind: str
    why: str = ""
    ask: Tuple[Address, ...] = ()
    waiting: bool = False
    refused: bool = False
    cause: bool = False


_ACCEPTED = Verdict(ACCEPTED)

# What one address answered (check.rs ``Answer``).
_ASKING = "asking"  # its card is being asked for
_CARD = "card"  # a card of ``owner``
_ABSENT = "absent"  # nothing listens there (the connection was refused): ``why``
_FAILED = "failed"  # it could not be asked (timeout, reset, TLS): ``why``
_NO_CARD = "no card"  # it answered without a card: ``why``


class _Answer(NamedTuple):
    kind: str
    owner: Optional[Owner] = None
    why: str = ""


_ASKING_ANSWER = _Answer(_ASKING)

# The list's states.
_PENDING = "pending"
_LIST_ACCEPTED = "accepted"
_LIST_UNCHECKED = "unchecked"  # every listed server is of a build before cards: used as given
_LIST_REFUSED = "refused"

# What a refused list's addresses are told, after what each is.
NOT_ONE_CLUSTER = "the listed servers are not the members of one cluster"


class Check:
    """The answers of a client's addresses, and what they make of its list."""

    def __init__(self, configured: Sequence[Address]) -> None:
        """A check of ``configured`` (distinct; more than one), none of them asked yet."""
        self.configured: List[Address] = list(configured)
        self._answers: Dict[Address, _Answer] = {}
        # Every client address the cards of each cluster listed (canonical; at most 64 per card).
        self._listed: Dict[Owner, List[Address]] = {}
        self._list = _PENDING
        # The owner of an accepted list.
        self._owner: Optional[Owner] = None
        # Addresses named in an ``M`` that answered another owner, or no card: why.
        self._strangers: Dict[Address, str] = {}

    def asking(self, addr: Address) -> None:
        """``addr`` is being asked."""
        self._answers[addr] = _ASKING_ANSWER

    def answered(self, addr: Address, answer: Union[Card, FetchError]) -> None:
        """What the ask of ``addr`` found."""
        if isinstance(answer, FetchError):
            if answer.unreachable and answer.refused:
                recorded = _Answer(_ABSENT, why=answer.cause)
            elif answer.unreachable:
                recorded = _Answer(_FAILED, why=answer.cause)
            else:
                recorded = _Answer(_NO_CARD, why=str(answer))
        else:
            owner = answer.owner()
            if isinstance(answer, Member):
                listed = self._listed.setdefault(owner, [])
                for _, client in answer.clients:
                    if client not in listed:
                        listed.append(client)
            recorded = _Answer(_CARD, owner)
        self._answers[addr] = recorded
        if addr in self.configured:
            self._decide()
        else:
            self._stranger(addr)
        self._check_invariants()

    def verdict(self, addr: Address) -> Verdict:
        """The verdict on ``addr``."""
        if self._list == _LIST_REFUSED:
            return Verdict(REFUSED, f"{self._what_it_is(addr)} ({NOT_ONE_CLUSTER})")
        if self._list == _LIST_UNCHECKED:
            return self._unchecked(addr)
        owner = self._owner
        if self._list == _PENDING or owner is None:
            return self._pending(addr)
        why = self._strangers.get(addr)
        if why is not None:
            return Verdict(REFUSED, why)
        answer = self._answers.get(addr)
        if answer == _Answer(_CARD, owner) or self._lists(owner, addr):
            return _ACCEPTED
        if answer is not None and answer.kind == _ASKING:
            why = "its card (GET /cluster) was not answered in time"
            return Verdict(UNSETTLED, why, (), waiting=True)
        if answer is not None and answer.kind == _ABSENT:
            return Verdict(UNSETTLED, answer.why, (addr,), refused=True, cause=True)
        if answer is not None and answer.kind == _FAILED:
            return Verdict(UNSETTLED, answer.why, (addr,), cause=True)
        return Verdict(UNSETTLED, "its card (GET /cluster) was not asked for yet", (addr,))

    def _unchecked(self, addr: Address) -> Verdict:
        """The verdict on ``addr`` in a list of older builds: what answered is used, as before
        cards; an address where nothing listened is asked first (a server of this build there,
        with its card, then refuses the list: it cannot be known to be the others' cluster)."""
        answer = self._answers.get(addr)
        if answer is not None and answer.kind == _ABSENT and addr in self.configured:
            return Verdict(UNSETTLED, answer.why, (addr,), refused=True, cause=True)
        if answer is not None and answer.kind == _ASKING:
            why = "its card (GET /cluster) was not answered in time"
            return Verdict(UNSETTLED, why, (), waiting=True)
        return _ACCEPTED

    def _pending(self, addr: Address) -> Verdict:
        """The verdict on ``addr`` while the list is pending: ask every listed address that has
        not answered a card yet, wait while asks are in flight."""
        kinds = [self._kind(a) for a in self.configured]
        waiting = _ASKING in kinds
        ask = tuple(a for a, kind in zip(self.configured, kinds) if kind not in (_ASKING, _CARD))
        answer = self._answers.get(addr)
        if answer is not None and answer.kind == _ABSENT:
            return Verdict(UNSETTLED, answer.why, ask, waiting, refused=True, cause=True)
        return Verdict(UNSETTLED, self._pending_why(), ask, waiting)

    def _pending_why(self) -> str:
        """Why a pending list is not accepted yet, in words."""
        unknown = []
        for addr in self.configured:
            answer = self._answers.get(addr)
            if answer is None:
                unknown.append(f"{addr_text(addr)}: not asked yet")
            elif answer.kind in (_FAILED, _ABSENT):
                unknown.append(f"{addr_text(addr)}: {answer.why}")
            elif answer.kind == _ASKING:
                unknown.append(f"{addr_text(addr)}: its card is being asked for")
            elif answer.kind != _CARD:
                unknown.append(f"{addr_text(addr)}: not asked yet")
        return (
            "the listed servers are not confirmed members of one cluster yet "
            f"({'; '.join(unknown)})"
        )

    def settled(self) -> bool:
        """Whether every configured address has an answer other than being asked."""
        return all(self._kind(addr) != _ASKING for addr in self.configured)

    def refused(self) -> List[Tuple[Address, str]]:
        """The addresses never sent to, and why: with the list refused, every listed one (what
        it answered), in the order listed; then every ``M``-named address that answered another
        owner or no card."""
        refused: List[Tuple[Address, str]] = []
        if self._list == _LIST_REFUSED:
            refused += [(addr, self._what_it_is(addr)) for addr in self.configured]
        refused += sorted(self._strangers.items())
        return refused

    def _kind(self, addr: Address) -> Optional[str]:
        answer = self._answers.get(addr)
        return None if answer is None else answer.kind

    def _what_it_is(self, addr: Address) -> str:
        """What ``addr`` answered, in words."""
        answer = self._answers.get(addr)
        if answer is None or answer.kind == _ASKING:
            return "not known (not answered yet)"
        if answer.kind == _CARD:
            return f"it is {answer.owner}"
        if answer.kind == _NO_CARD:
            return f"it {answer.why}"
        return f"not known ({answer.why})"

    def _lists(self, owner: Owner, addr: Address) -> bool:
        """Whether a card of ``owner`` listed ``addr`` (an IP address, compared as an address;
        a name is never listed)."""
        listed = self._listed.get(owner)
        if not listed:
            return False
        canonical = _canonical(addr)
        return canonical is not None and canonical in listed

    def _decide(self) -> None:
        """The list's state from the configured addresses' answers (a refused list stays so)."""
        if self._list == _LIST_REFUSED:
            return
        owners: List[Owner] = []
        for addr in self.configured:
            answer = self._answers.get(addr)
            if answer is None:
                continue
            if answer.kind == _CARD and answer.owner is not None and answer.owner not in owners:
                owners.append(answer.owner)
        no_card = [addr for addr in self.configured if self._kind(addr) == _NO_CARD]
        # A server without a card is an older build: it may be in the list only where the
        # cluster's cards list it (a member not upgraded yet).
        foreign = len(owners) == 1 and any(not self._lists(owners[0], a) for a in no_card)
        if foreign or len(owners) > 1:
            what = [
                f"{addr_text(addr)}: {self._what_it_is(addr)}"
                for addr in self.configured
                if self._kind(addr) in (_CARD, _NO_CARD)
            ]
            LOG.error(
                "%s (%s): none of them is used; a client given several addresses takes only the "
                'members of one cluster (docs/cluster.md, "What clients see")',
                NOT_ONE_CLUSTER,
                "; ".join(what),
            )
            self._list = _LIST_REFUSED
            self._owner = None
            return
        if not owners:
            # No card anywhere: when every listed server answered without one (or nothing
            # listens there), they are all of builds before cards, and cannot be checked.
            old = all(self._kind(addr) in (_NO_CARD, _ABSENT) for addr in self.configured)
            if old and no_card and self._list != _LIST_UNCHECKED:
                LOG.warning(
                    "no listed server gives a card (GET /cluster): they are older builds, and "
                    "the list cannot be checked to name one cluster; it is used as given"
                )
                self._list = _LIST_UNCHECKED
            return
        owner = owners[0]

        def vouched(addr: Address) -> bool:
            answer = self._answers.get(addr)
            if answer is not None and answer.kind == _CARD:
                return answer.owner == owner
            if answer is not None and answer.kind == _ABSENT:
                return True
            return self._lists(owner, addr)

        if all(vouched(addr) for addr in self.configured):
            self._list = _LIST_ACCEPTED
            self._owner = owner

    def _stranger(self, addr: Address) -> None:
        """An ``M``-named address answered: refused alone if not the accepted list's owner's."""
        owner = self._owner
        if self._list != _LIST_ACCEPTED or owner is None:
            return
        answer = self._answers.get(addr)
        if answer is None:
            return
        foreign = (answer.kind == _CARD and answer.owner != owner) or (
            answer.kind == _NO_CARD and not self._lists(owner, addr)
        )
        if foreign:
            why = f"{self._what_it_is(addr)}, not {owner}: named in a redirect"
            LOG.error("%s is not used: %s", addr_text(addr), why)
            self._strangers[addr] = why

    def _check_invariants(self) -> None:
        if not __debug__:
            return
        owner = self._owner
        if self._list == _LIST_ACCEPTED:
            assert owner is not None, "an accepted list has an owner"
            for addr in self.configured:
                answer = self._answers.get(addr)
                vouched = (
                    answer == _Answer(_CARD, owner)
                    or (answer is not None and answer.kind in (_ABSENT, _ASKING, _FAILED))
                    or self._lists(owner, addr)
                )
                assert vouched, f"{addr_text(addr)} in an accepted list answered {answer}"
