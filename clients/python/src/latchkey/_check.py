"""Which of a client's addresses it may send lock requests to, from their cards (``_card``): a
client given several addresses takes only members of one cluster, so that no list that mixes
clusters, or a cluster and a standalone server, can make two holders of one key. The rules of
the Rust client's ``crates/latchkey-client/src/check.rs``, exactly.

The rules, for a client given more than one address (one address is never asked):

* The first member card any address answers fixes the cluster; an address is accepted once it
  answers a card of that cluster (two addresses of one member are fine).
* An address that answers another cluster's card, a standalone server's card, or no card at
  all (not latchkey, or a build before cards) is refused for the client's life, with a message
  naming it and what it is (logged at error level on the ``latchkey`` logger).
* A standalone server is accepted only when every listed address answered that same server
  (one server reached by several addresses): until then it is not used.
* An address a member named in a redirect (``M``) is accepted at once when the cluster's card
  lists it, else asked like a listed one.
* An address that could not be asked is asked again when a call next needs it.

Sans-IO: :class:`Check` takes answers and says verdicts; ``_client._Asker`` asks (one thread
per ask). Not thread-safe: its owner locks. Invariant: every accepted address answered the
fixed owner's card, or that card lists it.
"""

from __future__ import annotations

import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from ._card import Address, Card, FetchError, Owner, addr_text

LOG = logging.getLogger("latchkey")

# The kinds of verdict.
ASKING = "asking"  # its card is being asked for
UNKNOWN = "unknown"  # never asked, or the last ask failed: asked when a call needs it
WAITING = "waiting"  # a standalone server waiting for the other addresses to answer as it
ACCEPTED = "accepted"  # a member of the client's cluster (or its one standalone server)
REFUSED = "refused"  # never used


class Verdict(NamedTuple):
    """What a client may do with an address; ``why``: why not usable (yet), or refused."""

    kind: str
    why: str = ""
    # ``UNKNOWN`` because the last ask's connection was refused (nothing listens there).
    refused: bool = False


_ACCEPTED = Verdict(ACCEPTED)
_ASKING = Verdict(ASKING)


class Check:
    """The addresses' verdicts, and the owner they must share."""

    def __init__(self, configured: Sequence[Address]) -> None:
        """A check of ``configured`` (distinct; more than one), none of them asked yet."""
        self.configured: List[Address] = list(configured)
        # The owner the accepted addresses answered, the card that fixed it and who answered it.
        self._fixed: Optional[Tuple[Owner, Card, Address]] = None
        self._verdicts: Dict[Address, Verdict] = {}
        # Whom each address that answered a card said it speaks for.
        self._owners: Dict[Address, Owner] = {}

    def verdict(self, addr: Address) -> Verdict:
        """The verdict on ``addr``: a learned address its cluster's card lists is accepted."""
        verdict = self._verdicts.get(addr)
        if verdict is not None:
            return verdict
        fixed = self._fixed
        if fixed is not None and fixed[1].lists(addr) and addr not in self.configured:
            self._verdicts[addr] = _ACCEPTED
            return _ACCEPTED
        return Verdict(UNKNOWN, "not asked yet")

    def asking(self, addr: Address) -> None:
        """``addr`` is being asked."""
        self._verdicts[addr] = _ASKING

    def settled(self) -> bool:
        """Whether no address is being asked."""
        return all(verdict.kind != ASKING for verdict in self._verdicts.values())

    def refused(self) -> List[Tuple[Address, str]]:
        """The refused addresses and why, configured first, each once."""
        refused = [(a, v.why) for a, v in self._verdicts.items() if v.kind == REFUSED]

        def rank(item: Tuple[Address, str]) -> Tuple[int, Address]:
            addr = item[0]
            listed = self.configured.index(addr) if addr in self.configured else len(self.configured)
            return (listed, addr)

        refused.sort(key=rank)
        return refused

    def answered(self, addr: Address, answer: Union[Card, FetchError]) -> Verdict:
        """What the ask of ``addr`` found; returns the new verdict."""
        if isinstance(answer, FetchError):
            if answer.unreachable:
                verdict = Verdict(UNKNOWN, answer.cause, answer.refused)
            else:
                verdict = self._refuse(addr, str(answer))
        else:
            verdict = self._card(addr, answer)
        self._verdicts[addr] = verdict
        self._check_invariants()
        return verdict

    def _card(self, addr: Address, card: Card) -> Verdict:
        owner = card.owner()
        learned = addr not in self.configured
        if learned and owner.standalone:
            return self._refuse(addr, f"it is {owner}, named in a redirect")
        self._owners[addr] = owner
        fixed = self._fixed
        if fixed is not None:
            if fixed[0] == owner:
                return _ACCEPTED
            return self._refuse(addr, f"it is {owner}, not {fixed[0]} like {addr_text(fixed[2])}")
        if owner.standalone:
            other = next((a for a, o in self._owners.items() if o != owner), None)
            if other is not None:
                why = f"it is {owner}, and {addr_text(other)} is another standalone server"
                return self._refuse(addr, why)
            if len(self._owners) < len(self.configured):
                return Verdict(
                    WAITING,
                    "a standalone server: used only once every listed address answered as that "
                    "same server",
                )
            for each in self.configured:
                self._verdicts[each] = _ACCEPTED
            self._fixed = (owner, card, addr)
            return _ACCEPTED
        # The first member card fixes the cluster; standalone servers seen so far are refused.
        self._fixed = (owner, card, addr)
        standalone = [(a, o) for a, o in self._owners.items() if o != owner]
        for other, other_owner in standalone:
            why = f"it is {other_owner}, not {owner} like {addr_text(addr)}"
            self._verdicts[other] = self._refuse(other, why)
        return _ACCEPTED

    def _refuse(self, addr: Address, why: str) -> Verdict:
        LOG.error(
            '%s is not used: %s; a client given several addresses takes only the members of one '
            'cluster (docs/cluster.md, "Clients")',
            addr_text(addr),
            why,
        )
        return Verdict(REFUSED, why)

    def _check_invariants(self) -> None:
        if not __debug__:
            return
        for addr, verdict in self._verdicts.items():
            if verdict.kind != ACCEPTED:
                continue
            assert self._fixed is not None, "an accepted address has an owner"
            owner, card, _ = self._fixed
            assert self._owners.get(addr) == owner or card.lists(addr), (
                f"{addr_text(addr)} accepted without its owner's card"
            )
