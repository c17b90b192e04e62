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


# What each error code of an ``X`` answer means (docs/protocol.md §2.3).
ERROR_CODES = {
    1: "unknown op",
    2: "key longer than the limit",
    3: "empty key",
    4: "key is not valid UTF-8",
    5: "lease 0",
    6: "byte after a fixed-size frame is not a newline",
    7: "session refused: too many connections",
    8: "the key is forbidden for this identity (X 8): the server's rules do not let this client use it",
    9: "not identified (resumable calls refused here)",
    10: "the server's records of identified clients are full",
}


def refusal_text(code: int) -> str:
    """What code ``code`` means, as the ``latchkey`` commands say it."""
    meaning = ERROR_CODES.get(code)
    if meaning is None:
        return f"refused by the server: error code {code}"
    if code == 8:
        return meaning
    return f"refused by the server: {meaning} (code {code})"


class Rejected(Error):
    """The server refused the request with ``X`` and ``code`` (e.g. 8: the identity may not use
    this key). Definitive: the request had no effect."""

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        super().__init__(message or refusal_text(code))


class LockLost(Error):
    """Raised when a ``with client.lock(...)`` block ends and the lock was lost while it ran:
    ``keep_alive`` found it gone (or could not keep it before its validity bound passed), or
    the release at the end found it no longer held (the lease had run out). Someone else may
    have held the key meanwhile: what the block wrote must be fenced with ``token``. Names the
    ``key`` and the ``token``."""

    def __init__(self, key: str, token: int, why: str) -> None:
        self.key = key
        self.token = token
        super().__init__(f"{key}: the lock (token {token}) was lost while the block ran: {why}")


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
