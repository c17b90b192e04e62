"""The exceptions of the client: every one is a :class:`Error` (docs/protocol.md §4.1)."""

from __future__ import annotations


class Error(Exception):
    """Base class of every latchkey error."""


class Timeout(Error):
    """The acquire was answered ``T`` (the key stayed held for the whole wait), or it waited,
    unsent, on an established session until its deadline. Definitive: nothing is held."""


class Busy(Error):
    """The acquire was answered ``B`` (a queue or a server limit was full, or the server is
    shutting down). Definitive: nothing is held."""


class Rejected(Error):
    """The server refused the request with ``X`` and ``code`` (e.g. 8: the identity may not use
    this key). Definitive: the request had no effect."""

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        super().__init__(message or f"refused by the server: error code {code}")


class Unavailable(Error):
    """No session could take the request before its deadline (or, with a cluster, the members
    only answered "no leader", named a leader that could not be reached, or redirected more
    than 64 times). Nothing was sent that could have executed: nothing is held."""


class Indeterminate(Error):
    """The acquire may have reached the server and no definitive answer was delivered. The
    caller does **not** hold the lock and must not enter the critical section; the client
    never resends it. A grant nobody saw is recovered at the latest when its lease ends."""


class NoAnswer(Error):
    """An extend, release, query or ping may have been sent and no answer came within the
    transport timeout. Its effect on the server is unknown."""
