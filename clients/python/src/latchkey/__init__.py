"""The official Python client of latchkey, a lock server with fencing tokens.

Standard library only. See README.md beside this package and docs/protocol.md §4 for the
rules it follows::

    import latchkey
    client = latchkey.Client("127.0.0.1:7420")
    with client.lock("jobs/nightly", wait=10.0, lease=30.0) as ticket:
        ...  # pass ticket.token to every resource the lock protects
"""

from ._client import DEFAULT_ADDR, REDIRECTS_MAX, TLS, Client, KeyState, Ticket
from ._errors import (
    Busy,
    Error,
    Indeterminate,
    LockLost,
    NoAnswer,
    Rejected,
    Timeout,
    Unavailable,
)

__all__ = [
    "DEFAULT_ADDR",
    "REDIRECTS_MAX",
    "TLS",
    "Busy",
    "Client",
    "Error",
    "Indeterminate",
    "KeyState",
    "LockLost",
    "NoAnswer",
    "Rejected",
    "Ticket",
    "Timeout",
    "Unavailable",
]

__version__ = "0.1.0"
