"""The client for asyncio: the methods of :class:`latchkey.Client` as coroutines.

Each call runs the thread-safe blocking client on a worker thread of this client's own pool (so
a call that waits for a lock never blocks the event loop, and many tasks share the sessions and
their pipelining exactly like many threads do): the rules of docs/protocol.md §4 are the
blocking client's, unchanged, and so are resumable calls (§4.1, §5: ``resume``, on by default;
an acquire whose session fails after it may have been sent is resolved on another session, and
releases and extends are sent again; a waiter's session probes a silent server, and closes,
exactly as a thread's), and so is hedging (§4.3: with several members, a release
or an extend — ``AsyncTicket``'s, ``lock()``'s keep-alive — not answered within a quarter of
``connect_timeout``, 0.1..=0.5 s, also goes to the other members, never back to the silent one,
and the first answer wins). A task cancelled while its ``acquire`` runs gives the acquire up at
once: a waiter queued on the server is withdrawn (Cancel, docs/protocol.md §4.4), and a grant
that still arrives is released, so the cancelled task leaves no lock and no waiter behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from types import TracebackType
from typing import AsyncIterator, Callable, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from contextlib import asynccontextmanager

from ._client import (
    RESUME_DEFAULT,
    TLS,
    KeyState,
    Ticket,
    _Abort,
    _end_lock,
    _KeepAlive,
    _key_bytes,
    _lease_s,
    _wait_ms,
)
from ._client import Client as _SyncClient
from ._errors import LockLost, NoAnswer, Rejected, Unavailable

__all__ = ["Client", "Ticket", "AsyncTicket"]

T = TypeVar("T")


class AsyncTicket:
    """A held lock, as :class:`latchkey.Ticket` with coroutine ``extend`` and ``release``."""

    def __init__(self, client: "Client", ticket: Ticket) -> None:
        self._client = client
        self.ticket = ticket

    @property
    def key(self) -> str:
        return self.ticket.key

    @property
    def token(self) -> int:
        return self.ticket.token

    @property
    def valid_until(self) -> float:
        return self.ticket.valid_until

    @property
    def lost(self) -> threading.Event:
        """Set by ``lock()``'s keep-alive when the lock is lost."""
        return self.ticket.lost

    def is_valid(self) -> bool:
        return self.ticket.is_valid()

    async def extend(self, lease: float) -> bool:
        """As :meth:`latchkey.Ticket.extend`."""
        _lease_s(lease)
        return await self._client._run(self.ticket.extend, lease)

    async def release(self) -> bool:
        """As :meth:`latchkey.Ticket.release`."""
        return await self._client._run(self.ticket.release)

    def __repr__(self) -> str:
        return f"Async{self.ticket!r}"


class Client:
    """``latchkey.Client`` for asyncio; the same arguments (``resume`` among them), plus
    ``max_calls``: how many calls may be in flight at once (worker threads, started on
    demand)."""

    def __init__(
        self,
        servers: Union[str, Sequence[str], None] = None,
        *,
        sessions: int = 2,
        connect_timeout: float = 2.0,
        transport_timeout: float = 5.0,
        tls: Optional[TLS] = None,
        retry_refused: bool = False,
        resume: Optional[float] = RESUME_DEFAULT,
        max_calls: int = 256,
    ) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError("max_calls must be at least 1")
        self.sync = _SyncClient(
            servers,
            sessions=sessions,
            connect_timeout=connect_timeout,
            transport_timeout=transport_timeout,
            tls=tls,
            retry_refused=retry_refused,
            resume=resume,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_calls, thread_name_prefix="latchkey-aio"
        )

    async def _run(self, function: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(function, *args))
        return await future

    async def acquire(self, key: str, wait: float = 0.0, lease: float = 30.0) -> AsyncTicket:
        """As :meth:`latchkey.Client.acquire`. Cancelling the task gives the acquire up at
        once: its waiter is withdrawn from the server's queue (Cancel), and a grant that still
        comes is released."""
        _key_bytes(key)
        _wait_ms(wait)
        _lease_s(lease)
        loop = asyncio.get_running_loop()
        abort = _Abort()
        inner = self._pool.submit(self.sync._acquire, key, wait, lease, abort)
        try:
            ticket = await asyncio.wrap_future(inner, loop=loop)
        except asyncio.CancelledError:
            abort.cancel()
            inner.add_done_callback(_release_if_granted)
            raise
        return AsyncTicket(self, ticket)

    @asynccontextmanager
    async def lock(
        self, key: str, wait: float = 0.0, lease: float = 30.0, keep_alive: bool = True
    ) -> AsyncIterator[AsyncTicket]:
        """As :meth:`latchkey.Client.lock`: ``async with client.lock(...) as ticket``; the
        lease is kept by default, and a lock lost while the block ran raises
        :class:`latchkey.LockLost` when it ends."""
        lease_s = _lease_s(lease)
        ticket = await self.acquire(key, wait, lease_s)
        keeper = _KeepAlive(ticket.ticket, lease_s) if keep_alive else None
        try:
            yield ticket
        except BaseException:
            await self._run(_end_lock, ticket.ticket, keeper)
            raise
        why = await self._run(_end_lock, ticket.ticket, keeper)
        if why is not None:
            raise LockLost(key, ticket.token, why)

    async def query(self, key: str) -> KeyState:
        return await self._run(self.sync.query, key)

    async def ping(self) -> float:
        return await self._run(self.sync.ping)

    async def refused_members(self, wait: float) -> List[Tuple[str, str]]:
        """As :meth:`latchkey.Client.refused_members`."""
        return await self._run(self.sync.refused_members, wait)

    async def close(self) -> None:
        self.sync.close()
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(
        self,
        kind: Optional[Type[BaseException]],
        value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        await self.close()


def _release_if_granted(future: "concurrent.futures.Future[Ticket]") -> None:
    if future.cancelled() or future.exception() is not None:
        return
    try:
        future.result().release()
    except (Unavailable, NoAnswer, Rejected):
        pass
