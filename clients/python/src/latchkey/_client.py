"""The client: argument checks, routing among members, attempts and results (docs/protocol.md §4).

One monotonic deadline per call. A request goes to its key's route (cached leader, else the
last leader an ``M`` named, else the members in turn); while it is definitely unsent it tries
other sessions and members (backoff 10 ms doubling, at most 250 ms) until its deadline; an
``M`` sends the same request (same id, same deadline) to the leader it names, or after a
backoff to the next member; a request that may have been sent without a definite answer is
never sent again, to any member — except a release or an extend, which names a token and is
safe to send again (§4.3). An acquire never is: one whose *identified* session failed after it
may have been sent is *resolved* on another session instead (a Resolve, §4.1 and §5, routed
like any request: to the key's leader now, following ``M``), which is not a resend. (A waiting
acquire's session that finds its server silent fails so: see the probes of ``_session``.)

With several members, a release or an extend (a ticket's, ``lock()``'s keep-alive, a
background release) not answered within the hedge delay — a quarter of ``connect_timeout``,
within 0.1..=0.5 s — is *hedged* (§4.3): the same request also goes to the other members,
never back to the one that has not answered (even when another member names it leader: that
``M`` counts as naming none until a new leader is elected and named), and the first answer
wins. A client of one member never hedges.

A client given several addresses sends only to the members of one cluster: each address is
asked for its card (``GET /cluster``, ``_card``) when the client is built, and ``_check``
accepts or refuses the list whole (a list that mixes clusters, a cluster and a standalone
server, or a server without a card is refused, whichever answered first, and nothing is sent
to any of its addresses; see :meth:`Client.refused_members`). A call that meets an address not
accepted (yet) notes why, as for an unreachable member, and moves on to the next after a
backoff; an ask whose connection was refused counts as a session's refused connect.
"""

from __future__ import annotations

import math
import os
import ssl
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import (
    Callable,
    Deque,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from ._card import FetchError, addr_text, fetch
from ._check import ACCEPTED, REFUSED, Check
from ._codec import (
    FATE_BUSY,
    FATE_GRANTED,
    FATE_NEVER_SEEN,
    FATE_TIMED_OUT,
    GRACE_S_MAX,
    KEY_BYTES_MAX,
    Response,
)
from ._errors import (
    Busy,
    Indeterminate,
    LockLost,
    NoAnswer,
    Rejected,
    Timeout,
    Unavailable,
    refusal_text,
)
from ._session import (
    ANSWER,
    EXPIRED,
    EXPIRED_CONNECTING,
    INDETERMINATE,
    NOT_SENT,
    UNREACHABLE,
    Address,
    Call,
    IdSource,
    Session,
    SessionConfig,
)

DEFAULT_ADDR = "127.0.0.1:7420"
REDIRECTS_MAX = 64
MEMBERS_MAX = 16
LEADER_CACHE_MAX = 65536
BACKOFF_MIN = 0.010
BACKOFF_MAX = 0.250
WAIT_MAX = 255.0
LEASE_S_MAX = 255
MARGIN_MIN = 0.1
RESUME_DEFAULT = 10.0
# How many sessions a fire-and-forget release is handed to at most (as the Rust client).
BACKGROUND_ATTEMPTS_MAX = 3
# Bounds of the hedge delay of a client with several members: a quarter of its connect
# timeout, within these (docs/protocol.md §4.3; the Rust client's ``Client::hedge_after``).
HEDGE_AFTER_MIN = 0.1
HEDGE_AFTER_MAX = 0.5


class KeyState(NamedTuple):
    """What ``query`` saw: whether the key is held, the milliseconds left on its lease
    (0 when free) and how many acquires wait for it."""

    held: bool
    lease_ms: int
    waiters: int


class TLS:
    """TLS settings: ``ca`` (the CA file that signed the server's certificate; ``None``: the
    system's CAs), ``cert`` and ``key`` (a client certificate, when the server asks for one),
    ``server_name`` (the name to check in the server's certificate; default: the host of the
    address connected to)."""

    def __init__(
        self,
        ca: Optional[str] = None,
        cert: Optional[str] = None,
        key: Optional[str] = None,
        server_name: Optional[str] = None,
    ) -> None:
        if (cert is None) != (key is None):
            raise ValueError("TLS: cert and key go together")
        self.ca = ca
        self.cert = cert
        self.key = key
        self.server_name = server_name

    def context(self) -> ssl.SSLContext:
        """The SSL context of these settings; a file that cannot be read or used raises the
        error ``ssl`` raised (``FileNotFoundError``, ``PermissionError``, ``ssl.SSLError``)
        with the setting and the path in its message."""
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        except OSError as error:
            raise _file_error(error, "ca", self.ca) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except OSError as error:
                raise _file_error(error, "cert and key", f"{self.cert}, {self.key}") from None
        return context


def _file_error(error: OSError, setting: str, path: Optional[str]) -> OSError:
    """``error`` of the same type, naming the TLS setting and the path (``ssl`` names neither:
    ``[Errno 2] No such file or directory``)."""
    if isinstance(error, ssl.SSLError):
        return ssl.SSLError(error.errno, f"TLS {setting} {path}: {error.reason or error}")
    if error.errno is not None:
        return type(error)(error.errno, f"TLS {setting}: {error.strerror}", path)
    return type(error)(f"TLS {setting} {path}: {error}")


def _parse_addr(text: str) -> Address:
    text = text.strip()
    if not text:
        raise ValueError("an empty server address")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"{text!r}: expected [IPv6]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{text!r}: expected HOST:PORT")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: the port is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"{text!r}: the port is out of range")
    return (host, number)


def _check_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite")
    return value


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"the key must be a str, not {type(key).__name__}")
    data = key.encode("utf-8")
    if not data:
        raise ValueError("the key is empty")
    if len(data) > KEY_BYTES_MAX:
        raise ValueError(f"the key is longer than {KEY_BYTES_MAX} bytes")
    if b"\n" in data:
        raise ValueError("the key contains a newline")
    return data


def _wait_ms(wait: float) -> int:
    wait = _check_seconds("wait", wait)
    if wait < 0:
        raise ValueError("wait must not be negative")
    ms = math.ceil(wait * 1000 - 1e-9)
    if ms > WAIT_MAX * 1000:
        raise ValueError("wait must be at most 255 s")
    return max(ms, 0)


def _lease_s(lease: float) -> int:
    lease = _check_seconds("lease", lease)
    if lease <= 0:
        raise ValueError("lease must be more than 0")
    seconds = math.ceil(lease - 1e-9)
    if seconds > LEASE_S_MAX:
        raise ValueError("lease must be at most 255 s")
    return max(seconds, 1)


def _margin(lease_s: int) -> float:
    return max(MARGIN_MIN, lease_s / 10)


def _valid_until(start: float, lease_s: int) -> float:
    return start + lease_s - _margin(lease_s)


def _resume_grace_s(resume: Optional[float]) -> Optional[int]:
    """The grace, in whole seconds (rounded up, 1..=60), of ``Client(resume=...)``; ``None``:
    the client does not resume calls."""
    if resume is None:
        return None
    resume = _check_seconds("resume", resume)
    if not 0 < resume <= GRACE_S_MAX:
        raise ValueError(f"resume must be more than 0 and at most {GRACE_S_MAX} s, or None")
    return max(1, math.ceil(resume - 1e-9))


def _client_id() -> int:
    """A random 128-bit client id (docs/protocol.md §5), never 0: one per client instance."""
    while True:
        value = int.from_bytes(os.urandom(16), "big")
        if value:
            return value


class _Pool:
    """The sessions to one member."""

    def __init__(self, addr: Address, count: int, config: SessionConfig) -> None:
        self.addr = addr
        self._config = config
        self._sessions: List[Optional[Session]] = [None] * count
        self._next = 0
        self._lock = threading.Lock()
        self.last_failure = ""

    def pick(self, avoid: Optional[Session]) -> Optional[Session]:
        """A session that takes calls (a new one in place of a failed one), never ``avoid``
        while another exists; ``None`` when every one is stalled or ``avoid``."""
        with self._lock:
            count = len(self._sessions)
            for step in range(count):
                index = (self._next + step) % count
                session = self._sessions[index]
                if session is not None and session.failed:
                    self.last_failure = session.failure
                    session = None
                if session is None:
                    session = Session(self.addr, self._config)
                    self._sessions[index] = session
                if session is avoid or session.is_stalled():
                    continue
                self._next = index + 1
                return session
            return None

    def start(self) -> None:
        """Starts every session (connecting in the background)."""
        with self._lock:
            for index, session in enumerate(self._sessions):
                if session is None:
                    self._sessions[index] = Session(self.addr, self._config)

    def close(self) -> None:
        with self._lock:
            for session in self._sessions:
                if session is not None:
                    session.close()
            self._sessions = [None] * len(self._sessions)


class _Unusable(NamedTuple):
    """Why a call may not send to an address (:meth:`_Members.usable`): what to report for
    it; ``refused``: its card was just asked for and the connection refused (nothing listens
    there, as a session's refused connect)."""

    why: str
    refused: bool = False


class _Asker:
    """The check of a client's addresses (``_check``), and the threads that ask for their cards
    (``_card.fetch``), each within the connect timeout, over TLS when the client uses it."""

    def __init__(self, listed: List[Address], config: SessionConfig) -> None:
        self.check = Check(listed)
        # Guards ``check``; notified when an ask ends.
        self.answered = threading.Condition()
        self._config = config

    def ask(self, addr: Address) -> None:
        """Starts asking ``addr`` for its card, on a daemon thread (the caller holds
        ``answered``)."""
        self.check.asking(addr)
        thread = threading.Thread(
            target=self._run, args=(addr,), name="latchkey-card", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as error:
            cause = f"cannot start a thread to ask it: {error}"
            self.check.answered(addr, FetchError(True, cause))

    def _run(self, addr: Address) -> None:
        config = self._config
        deadline = time.monotonic() + config.connect_timeout
        answer = fetch(addr, config.ssl_context, config.server_name, deadline)
        with self.answered:
            self.check.answered(addr, answer)
            self.answered.notify_all()


class _Members:
    """The listed members, the pools, and the leader cache.

    Several listed addresses: each is asked for its card (``GET /cluster``, ``_card``) when
    the client is built, one thread per address, and a call uses an address only once
    ``_check`` accepted the list and it (a call that finds answers still due waits for them,
    within its deadline). One address is never asked."""

    def __init__(self, addrs: List[Address], sessions: int, config: SessionConfig) -> None:
        self.listed = addrs
        self._sessions = sessions
        self._config = config
        self._pools: Dict[Address, _Pool] = {}
        self._leaders: Dict[bytes, Address] = {}
        self._last_leader: Optional[Address] = None
        self._current = 0
        self._lock = threading.Lock()
        self.closed = False
        self._asker: Optional[_Asker] = None
        if len(addrs) > 1:
            asker = _Asker(addrs, config)
            with asker.answered:
                for addr in addrs:
                    asker.ask(addr)
            self._asker = asker

    def usable(self, addr: Address, deadline: float) -> Optional[_Unusable]:
        """Whether a call may send to ``addr``: always with one listed address; else once
        ``_check`` accepts it, asking what it needs (again, once per call) and waiting for the
        answers until ``deadline``. ``None``: usable; else what to report for it (why not)."""
        asker = self._asker
        if asker is None:
            return None
        asked = False
        with asker.answered:
            while True:
                verdict = asker.check.verdict(addr)
                if verdict.kind == ACCEPTED:
                    return None
                if verdict.kind == REFUSED:
                    return _Unusable(f"not used: {verdict.why}")
                if verdict.ask and not asked:
                    asked = True
                    for each in verdict.ask:
                        asker.ask(each)
                    continue
                if verdict.waiting:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _Unusable(verdict.why)
                    asker.answered.wait(left)
                    continue
                if verdict.cause:
                    # Worded as a session that cannot connect is (``unreachable: ...``).
                    return _Unusable(f"unreachable: {verdict.why}", verdict.refused)
                return _Unusable(verdict.why, verdict.refused)

    def accepted(self, addr: Address) -> bool:
        """Whether ``addr`` may be sent to now, without asking or waiting (see
        :meth:`usable`)."""
        asker = self._asker
        if asker is None:
            return True
        with asker.answered:
            return asker.check.verdict(addr).kind == ACCEPTED

    def refused(self, wait: float) -> List[Tuple[str, str]]:
        """The addresses never sent to, and why (``Check.refused``: every listed one when the
        list is refused, then foreign leaders an ``M`` named), once every listed address being
        asked has answered or ``wait`` has passed; empty for one address."""
        asker = self._asker
        if asker is None:
            return []
        deadline = time.monotonic() + wait
        with asker.answered:
            while not asker.check.settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                asker.answered.wait(left)
            return [(addr_text(addr), why) for addr, why in asker.check.refused()]

    def pool(self, addr: Address) -> Optional[_Pool]:
        with self._lock:
            pool = self._pools.get(addr)
            if pool is None:
                if self.closed or len(self._pools) >= MEMBERS_MAX:
                    return None
                pool = self._pools[addr] = _Pool(addr, self._sessions, self._config)
            return pool

    def route(self, key: Optional[bytes]) -> Address:
        with self._lock:
            if key is not None:
                leader = self._leaders.get(key)
                if leader is not None:
                    return leader
            if self._last_leader is not None:
                return self._last_leader
            return self.listed[self._current % len(self.listed)]

    def next_member_except(self, addr: Address) -> Address:
        with self._lock:
            listed = self.listed
            if addr in listed:
                index = listed.index(addr)
            else:
                index = self._current
            if len(listed) > 1 and self._last_leader == addr:
                self._last_leader = None
            self._current = (index + 1) % len(listed)
            return listed[self._current]

    def learn(self, key: Optional[bytes], leader: Address) -> None:
        with self._lock:
            if key is not None:
                if len(self._leaders) >= LEADER_CACHE_MAX:
                    self._leaders.clear()
                self._leaders[key] = leader
            self._last_leader = leader

    def forget(self, key: Optional[bytes], addr: Address) -> None:
        with self._lock:
            if key is not None and self._leaders.get(key) == addr:
                del self._leaders[key]
            if self._last_leader == addr:
                self._last_leader = None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()


class _Result(NamedTuple):
    """How one request ended: an answer (with the instants its first byte was handed and its
    answer read), unsent (``serving``: it waited on an established session), indeterminate,
    or (an acquire that a Resolve found never executed, and never to be) ``never_seen``.
    ``retried``: an earlier attempt of this release or extend may have been sent."""

    kind: str  # "answer", "unsent", "indeterminate", "never_seen"
    response: Optional[Response] = None
    sent_at: float = 0.0
    read_at: float = 0.0
    serving: bool = False
    why: str = ""
    session: Optional[Session] = None
    retried: bool = False


class _Report:
    """What each member did, for the message of ``Unavailable``."""

    def __init__(self) -> None:
        self.states: Dict[Address, str] = {}
        self.redirects_exhausted = False

    def note(self, addr: Address, state: str) -> None:
        self.states[addr] = state

    def text(self, listed: Sequence[Address]) -> str:
        def name(addr: Address) -> str:
            return f"{addr[0]}:{addr[1]}"

        parts = [f"{name(addr)}: {state}" for addr, state in self.states.items()]
        detail = " (" + "; ".join(parts) + ")" if parts else ""
        answered = [addr for addr, state in self.states.items() if state == "no leader"]
        named = {
            addr: state[len("named the leader ") :]
            for addr, state in self.states.items()
            if state.startswith("named the leader ")
        }
        if self.redirects_exhausted:
            return f"{REDIRECTS_MAX} redirects followed without an answer{detail}"
        for by, leader in named.items():
            for addr, state in self.states.items():
                if name(addr) == leader and state != "no leader" and addr not in named:
                    return (
                        f"the key's leader {leader} (named by {name(by)}) cannot be reached: "
                        f"{state}{detail}"
                    )
        if answered and not named:
            reachable = len(answered)
            quorum = ", no quorum" if reachable <= len(listed) // 2 else ""
            return (
                f"no leader for this key: {reachable} of {len(listed)} members "
                f"reachable{quorum}{detail}"
            )
        if not self.states:
            return "no session was established before the deadline"
        return f"nothing served the request{detail}"


class Ticket:
    """A held lock: its key, fencing token and local validity bound (§4.5).

    A dropped ``Ticket`` is **not** released (Python finalizers are unreliable): call
    :meth:`release`, or use :meth:`Client.lock`. The lease recovers a forgotten hold.
    """

    def __init__(
        self,
        client: "Client",
        key: str,
        key_bytes: bytes,
        token: int,
        lease_s: int,
        read_at: float,
        valid_until: Optional[float] = None,
    ) -> None:
        self._client = client
        self._key = key
        self._key_bytes = key_bytes
        self._token = token
        # A grant a Resolve found has its bound from the Resolve (``valid_until``, §4.1).
        self._valid_until = _valid_until(read_at, lease_s) if valid_until is None else valid_until
        self._unknown_lease_s: Optional[int] = None
        self._bound_lock = threading.Lock()
        self._extending = threading.Lock()
        self._lost: Optional[threading.Event] = None
        self._lost_why = ""  # why ``lost`` was set, for LockLost
        # The last release's ``N`` answered a release sent again after its session failed, or
        # hedged (another attempt may have released it): for the message of LockLost.
        self._release_retried = False

    @property
    def lost(self) -> threading.Event:
        """Set by ``lock()``'s keep-alive when the lock is lost (or cannot be kept): stop
        using the protected resource."""
        lost = self._lost
        if lost is None:
            with self._bound_lock:
                if self._lost is None:
                    self._lost = threading.Event()
                lost = self._lost
        return lost

    @property
    def key(self) -> str:
        return self._key

    @property
    def token(self) -> int:
        """The fencing token: pass it to every resource the lock protects."""
        return self._token

    @property
    def valid_until(self) -> float:
        """A ``time.monotonic()`` value until which the hold is believed valid."""
        return self._valid_until

    def is_valid(self) -> bool:
        """Whether the validity bound has not passed (advice; the token is the safety)."""
        return time.monotonic() < self._valid_until

    def extend(self, lease: float) -> bool:
        """Sets the lease to ``lease`` seconds (rounded up) from now, which may shorten it.

        ``True``: extended; ``False``: the token no longer holds the key (the lock is lost).
        Raises ``Unavailable`` (not sent: the bound is as before), ``NoAnswer`` (unknown: the
        bound stays the earlier of the old one and what this extend would give) or
        ``Rejected``. An extend whose session failed after it may have been sent is sent
        again on another session within its deadline (an extend executed twice counts its
        lease from the later, §4.3); the bound then counts from the attempt answered.
        ``NoAnswer`` only when no attempt was answered. With several members, an extend not
        answered within the hedge delay (a quarter of ``connect_timeout``, 0.1..=0.5 s) also
        goes to the other members, never back to the silent one; the first answer wins, and
        the bound counts from the attempt it answered.
        """
        lease_s = _lease_s(lease)
        with self._extending:
            with self._bound_lock:
                before = self._valid_until
                self._valid_until = min(before, _valid_until(time.monotonic(), lease_s))
            try:
                response, sent_at, _ = self._client._small(
                    "E", self._key_bytes, self._token, lease_s
                )
            except NoAnswer:
                with self._bound_lock:
                    shortest = self._unknown_lease_s
                    self._unknown_lease_s = lease_s if shortest is None else min(shortest, lease_s)
                raise
            except (Unavailable, Rejected):
                with self._bound_lock:
                    self._valid_until = before
                raise
            with self._bound_lock:
                if response.op == "E":
                    shortest = self._unknown_lease_s
                    lease = lease_s if shortest is None else min(shortest, lease_s)
                    self._valid_until = _valid_until(sent_at, int(lease))
                    return True
                self._valid_until = min(self._valid_until, sent_at)
                return False

    def release(self) -> bool:
        """Releases the lock. ``True``: released; ``False``: it was no longer held (the lease
        ran out, another holder may have it). Raises ``Unavailable``, ``NoAnswer`` or
        ``Rejected``.

        A release whose session failed after it may have been sent is sent again on another
        session within its deadline (§4.3: a release executed twice answers ``N`` the second
        time), so a cut connection leaves no hold behind; ``NoAnswer`` only when no attempt
        was answered. Then ``False`` is ambiguous — the first attempt may have released it —
        and is reported all the same: the lock may have been lost. With several members, a
        release not answered within the hedge delay also goes to the other members (never
        back to the silent one), and the first answer wins; a ``False`` after a hedge is as
        ambiguous."""
        with self._bound_lock:
            self._valid_until = min(self._valid_until, time.monotonic())
        response, _, retried = self._client._small("R", self._key_bytes, self._token)
        released = response.op == "R"
        self._release_retried = retried and not released
        return released

    def __repr__(self) -> str:
        return f"Ticket(key={self._key!r}, token={self._token}, valid_until={self._valid_until:.3f})"


class _KeepAlive:
    """Extends a ticket every lease/3 until stopped; sets ``ticket.lost`` when the lock is lost
    or its validity bound passes without a confirmed extend. Its extends are
    :meth:`Ticket.extend`'s: hedged when the client lists several members."""

    def __init__(self, ticket: Ticket, lease_s: int) -> None:
        self._ticket = ticket
        self._lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latchkey-keep-alive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ticket = self._ticket
        period = self._lease_s / 3
        pause = period
        while not self._stop.wait(pause):
            try:
                if not ticket.extend(self._lease_s):
                    return self._lost("the server no longer holds it for this token")
                pause = period
            except (NoAnswer, Unavailable):
                # Tried again soon (a leader change, a cut connection) until the bound passes.
                pause = min(period, 0.25)
            except Rejected as error:
                return self._lost(f"an extend was refused: {error}")
            if not ticket.is_valid():
                return self._lost("no extend was confirmed before its validity bound passed")

    def _lost(self, why: str) -> None:
        self._ticket._lost_why = why
        self._ticket.lost.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _end_lock(ticket: Ticket, keeper: Optional[_KeepAlive]) -> Optional[str]:
    """Ends a ``lock()`` block: stops the keep-alive and releases. Why the lock was lost while
    the block ran, if it was; ``None`` when it was held to the end (or the release could not
    tell: unsent, unanswered or refused, the lease recovers it)."""
    if keeper is not None:
        keeper.stop()
    try:
        released = ticket.release()
    except (Unavailable, NoAnswer, Rejected):
        released = True  # unknown; the lease recovers it
    if ticket.lost.is_set():
        return ticket._lost_why or "the lock was lost"
    if not released:
        if ticket._release_retried:
            return (
                "the release, sent more than once (its session failed, or its member did not "
                "answer in time), found it no longer held (another attempt may have released "
                "it, or its lease had run out)"
            )
        return "the release found it no longer held (its lease had run out)"
    return None


def _resolved(result: _Result) -> _Result:
    """What a Resolve's answer (or, after ``queued``, the acquire's own ``A``, ``T`` or ``B``)
    means for the acquire; an answer already read so is kept as it is."""
    response = result.response
    assert response is not None
    op = response.op
    if op == "W":
        fate = response.fate
        if fate == FATE_NEVER_SEEN:
            return _Result("never_seen")
        if fate == FATE_TIMED_OUT:
            response = Response("T", response.id)
        elif fate == FATE_BUSY:
            response = Response("B", response.id)
        elif fate != FATE_GRANTED:
            return _Result("indeterminate")
    elif op not in ("A", "T", "B"):
        # An X (not identified after all, or the server's records are full): settles nothing.
        return _Result("indeterminate")
    return result._replace(response=response)


def _elapsed_text(seconds: float) -> str:
    """``seconds`` for a person: whole milliseconds under a second (at least 1), else seconds
    with a decimal (as the ``latchkey`` commands write it)."""
    if seconds < 1.0:
        return f"{max(1, math.ceil(seconds * 1000))} ms"
    return f"{seconds:.1f} s"


class _Abort:
    """A way for another thread (an asyncio task being cancelled) to give a call up: its
    current attempt is ended as if its deadline had passed (``Session.abort``: an unsent
    request is never sent, a queued acquire gets its Cancel at once), and a grant that still
    comes is given back at the delivery gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self._current: Optional[Tuple[Session, Call]] = None

    def attach(self, session: Session, call: Call) -> None:
        """``call`` was handed to ``session``: what to abort; at once if already cancelled."""
        with self._lock:
            self._current = (session, call)
            cancelled = self.cancelled
        if cancelled:
            session.abort(call)

    def detach(self) -> None:
        with self._lock:
            self._current = None

    def current(self) -> Optional[Tuple[Session, Call]]:
        """The call's current attempt and its session, if it is under way."""
        with self._lock:
            return self._current

    def member(self) -> Optional[Address]:
        """The member the call's current attempt was handed to, if it is under way."""
        with self._lock:
            current = self._current
        return None if current is None else current[0].addr

    def cancel(self) -> None:
        """Gives the call up (from any thread; returns at once)."""
        with self._lock:
            self.cancelled = True
            current = self._current
        if current is not None:
            current[0].abort(current[1])


def _hedge_after(connect_timeout: float) -> float:
    """How long a release or an extend of a client with several members waits for its first
    attempt before it also goes to the other members: a quarter of the connect timeout,
    within 0.1..=0.5 s (well under a lease's validity: a 2 s lease is valid for 1.8 s)."""
    return min(max(connect_timeout / 4, HEDGE_AFTER_MIN), HEDGE_AFTER_MAX)


class _Hedgeable:
    """What a :class:`_Hedger` holds: a request that may be hedged at its instant."""

    __slots__ = ()

    def pending(self) -> bool:
        """Whether the request may still need its hedge (read without a lock: a stale
        ``True`` only makes the hedger call :meth:`fire`, which looks again)."""
        raise NotImplementedError

    def fire(self) -> None:
        """At the hedge instant, on the hedger's thread: starts the hedge if still needed."""
        raise NotImplementedError


class _Hedger:
    """Starts the hedges of one client's releases and extends (docs/protocol.md §4.3).

    Each release or extend of a client with several members registers here as it starts;
    this class's one daemon thread (started on first use) fires, at the request's hedge
    instant, each that is still pending, which starts its hedge. So a request answered in
    time costs no thread of its own, and the thread drops answered requests without waiting
    for their instants: it wakes about once per hedge delay under a steady stream, not once
    per request. The instants come in order (one delay per client): a queue, not a heap."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._cond = threading.Condition()
        self._due: Deque[Tuple[float, _Hedgeable]] = deque()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def schedule(self, request: _Hedgeable) -> None:
        """Fires ``request`` (on this hedger's thread) ``delay`` from now if it is still
        pending then (never after ``close``)."""
        with self._cond:
            if self._closed:
                return
            self._due.append((time.monotonic() + self.delay, request))
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="latchkey-hedge", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    # No thread to be had (the interpreter is exiting): not hedged.
                    self._due.clear()
                    return
                self._thread = thread
            elif len(self._due) == 1:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()

    def _run(self) -> None:
        due = self._due
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    while due and not due[0][1].pending():
                        due.popleft()
                    if not due:
                        self._cond.wait()
                        continue
                    left = due[0][0] - time.monotonic()
                    if left <= 0:
                        _, request = due.popleft()
                        break
                    self._cond.wait(left)
            try:
                request.fire()
            except Exception:  # noqa: BLE001 - a hedge that cannot start leaves its request as is
                pass


class _Hedge(_Hedgeable):
    """One hedged release or extend (:meth:`Client._exchange_hedged`).

    Its first sequence of attempts runs on the caller's thread. The hedge — the same request
    (same token, key and deadline) to the other members, never to the one the first sequence
    waits at — runs on a thread of its own, started by the client's :class:`_Hedger` only if
    the first is still unanswered at the hedge instant. The first answer wins, and the other
    sequence is given up (an :class:`_Abort`: an unsent attempt is never sent, a sent one's
    answer is ignored)."""

    __slots__ = (
        "_client",
        "_call",
        "_first_addr",
        "_lock",
        "_cond",
        "abort_first",
        "_abort_second",
        "_started",
        "_first",
        "_second",
    )

    def __init__(self, client: "Client", call: Call, first: Address) -> None:
        self._client = client
        self._call = call
        self._first_addr = first
        self._lock = threading.Lock()
        self._cond: Optional[threading.Condition] = None  # once the hedge started
        self.abort_first = _Abort()
        self._abort_second: Optional[_Abort] = None
        self._started = False
        self._first: Optional[_Result] = None
        self._second: Optional[_Result] = None

    def pending(self) -> bool:
        return self._first is None

    def fire(self) -> None:
        """At the hedge instant (on the hedger's thread): the hedge, unless the first sequence
        ended or the deadline passed."""
        call = self._call
        with self._lock:
            if self._first is not None or time.monotonic() >= call.deadline:
                return
            self._started = True
            self._cond = threading.Condition(self._lock)
            self._abort_second = _Abort()
            # The same request, for the hedge: nothing changed ``call`` yet (only the hedge's
            # answer makes the first sequence give up).
            copy = call.fresh()
        # Never back to the member the first sequence waits at now (an M may have sent it
        # there), else the one it started at.
        skip = self.abort_first.member() or self._first_addr
        thread = threading.Thread(
            target=self._hedge,
            args=(copy, self._abort_second, skip),
            name="latchkey-hedge-request",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:
            with self._cond:
                self._second = _Result("unsent", why="no thread for the hedge")
                self._cond.notify_all()

    def _hedge(self, copy: Call, abort: _Abort, skip: Address) -> None:
        result = self._client._exchange(copy, abort, skip)
        cond = self._cond
        assert cond is not None
        with cond:
            self._second = result
            first_running = self._first is None
            cond.notify_all()
        if result.kind == "answer" and first_running:
            # It won: the caller's sequence gives up and returns this answer.
            self.abort_first.cancel()

    def settle(self, first: _Result) -> _Result:
        """The request's result, once its first sequence ended with ``first``: that, when no
        hedge started; else the first answer of either, and only when neither is answered,
        ``indeterminate`` if either may have been sent."""
        with self._lock:
            self._first = first
            if not self._started:
                return first
            cond = self._cond
            assert cond is not None
            second = self._second
            if second is None and first.kind != "answer":
                # Bounded: the hedge ends by the request's deadline (its session applies it).
                backstop = self._call.deadline + 2 * self._client.transport_timeout
                while self._second is None:
                    left = backstop - time.monotonic()
                    if left <= 0:
                        break
                    cond.wait(left)
                second = self._second
        # Both were handed on: the other may have been sent too, so a "not held" may answer a
        # second execution (``retried``).
        if second is not None and second.kind == "answer":
            return second._replace(retried=True)
        if first.kind == "answer":
            if self._abort_second is not None:
                self._abort_second.cancel()
            return first._replace(retried=True)
        if second is None or first.kind == "indeterminate" or second.kind == "indeterminate":
            return _Result("indeterminate", retried=True)
        # Neither may have been sent: nothing served it (the first's report is the caller's).
        return first


class _BackgroundHedge(_Hedgeable):
    """The hedge of a background release handed to a session to ``first``: unless answered
    by its instant (an ``M`` is no answer here), the same release also goes to the other
    members, never to ``first``, on a thread of its own; its outcome is not waited for (the
    lease recovers a release that is lost)."""

    __slots__ = ("_client", "_call", "_first")

    def __init__(self, client: "Client", call: Call, first: Address) -> None:
        self._client = client
        self._call = call
        self._first = first

    def pending(self) -> bool:
        response = self._call.response
        return response is None or response.op == "M"

    def fire(self) -> None:
        call = self._call
        if not self.pending() or time.monotonic() >= call.deadline:
            return
        again = Call("R", call.key, call.ident, call.deadline)
        thread = threading.Thread(
            target=self._client._exchange,
            args=(again, None, self._first),
            name="latchkey-hedge-request",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:
            pass  # the interpreter is exiting; the lease recovers it


def _default_addrs() -> List[str]:
    env = os.environ.get("LATCHKEY_SERVER", "").strip()
    if env:
        return [part for part in env.split(",") if part.strip()]
    return [DEFAULT_ADDR]


class Client:
    """A latchkey client shared by any number of threads.

    ``servers``: ``"host:port"`` or a list of cluster members; default ``$LATCHKEY_SERVER``
    (comma-separated), else ``127.0.0.1:7420``. ``sessions`` per member; ``connect_timeout``
    bounds a session's connect, TLS handshake and handshake ping; ``transport_timeout`` is
    the deadline of extend, release, query and ping, of a ``wait=0`` acquire, and how long an
    acquire's Cancel waits for its answer. A call ends ``Unavailable`` at once when every
    member refused the connection (nothing listens there); ``retry_refused=True`` keeps trying
    until the call's deadline instead (a server restarting).

    A list of several addresses must name one cluster, or it is refused: each address is asked
    for its card (``GET /cluster`` on the lock port, within ``connect_timeout``) when the
    client is built. The list is accepted once some address answered a card and every listed
    address is vouched for (it answered a card of that same cluster, or of that same standalone
    server; or a card of the cluster lists it; or nothing listens there); until then calls wait
    (within their own deadline) and send nothing. It is refused for the client's life as soon
    as two addresses answer cards of different owners (two clusters, a member and a standalone
    server, two standalone servers) or one answers without a card, whichever answered first:
    nothing is sent to any listed address, the refusal is logged (``logging``, ``latchkey``
    logger, error level), :meth:`refused_members` names every address and what it is, and
    calls end ``Unavailable`` saying why. One address (a ``host:port``, whatever its name
    resolves to) is never asked.

    ``resume`` (seconds, default 10; ``None``: off) makes every session identify as this
    client (a random 128-bit id, docs/protocol.md §5) with that grace (rounded up to whole
    seconds, at most 60): an acquire whose session fails or stalls after it may have been sent
    is then *resolved* on another session (the server says what became of it) instead of
    ending ``Indeterminate``. A server that does not resume calls (a cluster member of this
    version) refuses the Identify, and one that does not know it closes the session (``X`` 1;
    no later session identifies then): the client then keeps to §4 alone.

    With several members, releases and extends (explicit, ``lock()``'s keep-alive, background)
    are *hedged* (docs/protocol.md §4.3): one not answered within a quarter of
    ``connect_timeout`` (within 0.1..=0.5 s) also goes to the other members — never back to
    the one that has not answered, even when another member names it leader — which redirect
    it to the new leader once one is elected, and the first answer wins. So a paused leader
    (a VM stall, a slow disk) does not cost a holder whose lease is shorter than
    ``transport_timeout`` its lock.
    """

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
    ) -> None:
        if servers is None:
            texts = _default_addrs()
        elif isinstance(servers, str):
            texts = [part for part in servers.split(",") if part.strip()]
        else:
            texts = list(servers)
        if not texts:
            raise ValueError("no server address")
        addrs: List[Address] = []
        for text in texts:
            addr = _parse_addr(text)
            if addr not in addrs:
                addrs.append(addr)
        if len(addrs) > MEMBERS_MAX:
            raise ValueError(f"at most {MEMBERS_MAX} members")
        if isinstance(sessions, bool) or not isinstance(sessions, int) or not 1 <= sessions <= 64:
            raise ValueError("sessions must be 1..=64")
        connect_timeout = _check_seconds("connect_timeout", connect_timeout)
        transport_timeout = _check_seconds("transport_timeout", transport_timeout)
        if connect_timeout <= 0 or transport_timeout <= 0:
            raise ValueError("timeouts must be more than 0")
        grace_s = _resume_grace_s(resume)
        context = tls.context() if tls is not None else None
        self._ids = IdSource()
        self._config = SessionConfig(
            connect_timeout,
            transport_timeout,
            context,
            tls.server_name if tls is not None else None,
            self._ids,
            identity=None if grace_s is None else (_client_id(), grace_s),
            resubmit=self._resubmit_background,
        )
        self.resume: Optional[float] = None if grace_s is None else float(grace_s)
        """The grace (whole seconds) this client's sessions identify with; ``None``: off."""
        self.transport_timeout = transport_timeout
        self.connect_timeout = connect_timeout
        self.retry_refused = bool(retry_refused)
        """Whether a refused connection is tried again until the call's deadline."""
        self._members = _Members(addrs, sessions, self._config)
        self._hedger = _Hedger(_hedge_after(connect_timeout))
        self.last_unavailable: Optional[str] = None
        """What each member did in the last call that ended ``Unavailable``."""
        first = self._members.pool(addrs[0])
        if first is not None:
            first.start()

    # ------------------------------------------------------------------------------------
    # Public calls

    def acquire(self, key: str, wait: float = 0.0, lease: float = 30.0) -> Ticket:
        """Takes the lock on ``key``, waiting at most ``wait`` seconds, holding it at most
        ``lease`` seconds (rounded up to whole seconds, 1..=255). ``wait=0`` is one immediate
        attempt. Raises ``Timeout``, ``Busy``, ``Rejected``, ``Unavailable`` or
        ``Indeterminate`` (§4.1); ``TypeError`` or ``ValueError`` for bad arguments, before
        anything is sent.

        Interrupted while it waits (``KeyboardInterrupt``, or any exception a signal handler
        raises), the acquire is withdrawn before the exception goes on: a waiter queued on the
        server gets its Cancel and its answer is waited for (at most the transport timeout), and
        a grant that came first is released — rather than left queued, and granted later to
        nobody (held until its lease ran out)."""
        abort = _Abort()
        try:
            return self._acquire(key, wait, lease, abort)
        except Exception:
            raise
        except BaseException:
            self._withdraw(abort)
            raise

    def _withdraw(self, abort: "_Abort") -> None:
        """Gives up the acquire ``abort`` names, whose caller was interrupted, and waits for it
        to settle (bounded: a Cancel's answer is due within the transport timeout, else its
        session closes); a grant that came first is released."""
        current = abort.current()
        abort.cancel()
        if current is None:
            return
        session, call = current
        if call.kind not in ("A", "W"):
            return
        session.wait(call)
        response = call.response
        if call.outcome != ANSWER or response is None:
            return
        # A grant: the acquire's own ``A``, or a Resolve that found it granted.
        if response.op == "A" or (response.op == "W" and response.fate == FATE_GRANTED):
            self._release_in_background(call.key, response.token, session)

    def _acquire(self, key: str, wait: float, lease: float, abort: Optional["_Abort"]) -> Ticket:
        """``acquire``, given up at once when ``abort`` is cancelled (see :class:`_Abort`)."""
        key_bytes = _key_bytes(key)
        wait_ms = _wait_ms(wait)
        lease_s = _lease_s(lease)
        wait_zero = wait_ms == 0
        allowance = self.transport_timeout if wait_zero else wait_ms / 1000
        deadline = time.monotonic() + allowance
        while True:
            owner = self._ids()
            call = Call("A", key_bytes, owner, deadline, lease_s, wait_zero)
            result = self._exchange(call, abort)
            if result.kind != "never_seen":
                break
            # A Resolve found it never executed, and recorded that it never will: as if never
            # sent (§5). A new acquire, under a new owner, while the deadline leaves time.
            if time.monotonic() >= deadline or (abort is not None and abort.cancelled):
                raise Timeout(f"{key}: the wait ran out (the acquire was never executed)")
        if result.kind == "unsent":
            if result.serving:
                raise Timeout(f"{key}: the wait ran out before the request could be sent")
            raise Unavailable(f"{key}: {result.why}")
        if result.kind == "indeterminate":
            raise Indeterminate(f"{key}: the acquire may have reached the server; no answer")
        response = result.response
        assert response is not None
        op = response.op
        if op == "W":
            # A grant a Resolve found (§4.1): its lease had ``lease_ms`` left when the server
            # answered, so at most that from the instant the Resolve was sent.
            if time.monotonic() >= deadline or (abort is not None and abort.cancelled):
                self._release_in_background(key_bytes, response.token, result.session)
                raise Indeterminate(f"{key}: a grant found after the deadline; released again")
            left = response.lease_ms / 1000
            valid_until = result.sent_at + max(0.0, left - _margin(lease_s))
            return Ticket(
                self, key, key_bytes, response.token, lease_s, result.read_at, valid_until
            )
        if op == "A":
            if time.monotonic() >= deadline or (abort is not None and abort.cancelled):
                # Found at the delivery gate after the deadline (or the caller gave up): give
                # it back (§4.2).
                self._release_in_background(key_bytes, response.token, result.session)
                raise Indeterminate(f"{key}: granted after the deadline; released again")
            return Ticket(self, key, key_bytes, response.token, lease_s, result.read_at)
        if op == "T":
            raise Timeout(f"{key}: held by someone else for the whole wait")
        if op == "B":
            raise Busy(f"{key}: the server is busy (queue or limits full, or shutting down)")
        if op == "X":
            raise Rejected(response.code, f"{key}: {refusal_text(response.code)}")
        raise Indeterminate(f"{key}: unexpected answer {op!r}")

    @contextmanager
    def lock(
        self, key: str, wait: float = 0.0, lease: float = 30.0, keep_alive: bool = True
    ) -> Iterator[Ticket]:
        """``acquire`` as a context manager that releases on exit. The lease is extended every
        lease/3 while the block runs (``keep_alive=False``: not, so a block longer than the
        lease loses the lock). If the lock is lost, ``ticket.lost`` is set at once (check it,
        and ``is_valid()``, before every write; pass ``ticket.token`` to the resource), and
        leaving the block raises :class:`LockLost` naming the key and the token — also when
        the release finds the lock no longer held. An exception of the block itself is never
        replaced by it."""
        lease_s = _lease_s(lease)
        ticket = self.acquire(key, wait, lease_s)
        keeper = _KeepAlive(ticket, lease_s) if keep_alive else None
        try:
            yield ticket
        except BaseException:
            _end_lock(ticket, keeper)
            raise
        why = _end_lock(ticket, keeper)
        if why is not None:
            raise LockLost(key, ticket.token, why)

    def query(self, key: str) -> KeyState:
        """Whether ``key`` is held, the lease left and its waiters."""
        key_bytes = _key_bytes(key)
        response, _, _ = self._small("Q", key_bytes, self._ids())
        return KeyState(response.held, response.lease_ms, response.waiters)

    def ping(self) -> float:
        """Round-trip time in seconds of a ping."""
        start = time.monotonic()
        self._small("P", b"", self._ids())
        return time.monotonic() - start

    def refused_members(self, wait: float) -> List[Tuple[str, str]]:
        """For a client given several addresses: the addresses it will never send to, and why,
        as ``("host:port", why)``, once every listed address has answered its card ask or
        ``wait`` seconds have passed. For a refused list (not the members of one cluster: two
        clusters, a member and a standalone server, two standalone servers, or a server that
        gives no card), every listed address in the order listed, with what it is (``it is
        cluster …``, ``it is a standalone server (run …)``, ``it answered GET /cluster without a
        card (HTTP 404): …``, or ``not known (…)``); then any leader a redirect named that is
        not of the list's cluster. Empty for one address, and while the list is accepted or not
        decided yet. A program that was given a list should refuse to go on when this is not
        empty: the list is wrong."""
        wait = _check_seconds("wait", wait)
        if wait < 0:
            raise ValueError("wait must not be negative")
        return self._members.refused(wait)

    def close(self) -> None:
        """Closes every session; calls in flight end ``Indeterminate``/``NoAnswer`` or
        ``Unavailable``."""
        self._hedger.close()
        self._members.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------
    # Internals

    def _small(
        self, kind: str, key: bytes, ident: int, lease_s: int = 0
    ) -> Tuple[Response, float, bool]:
        """Sends a release, extend, query or ping within the transport timeout: its answer,
        when the answered attempt was sent, and whether an earlier attempt (of a release or an
        extend) may have been sent too."""
        deadline = time.monotonic() + self.transport_timeout
        call = Call(kind, key, ident, deadline, lease_s)
        result = self._exchange_hedged(call)
        what = key.decode("utf-8", "replace") if key else "ping"
        if result.kind == "unsent":
            raise Unavailable(f"{what}: {result.why}")
        if result.kind == "indeterminate":
            raise NoAnswer(f"{what}: no answer within the transport timeout")
        response = result.response
        assert response is not None
        if response.op == "X":
            raise Rejected(response.code, f"{what}: {refusal_text(response.code)}")
        expected = {"R": "RN", "E": "EN", "Q": "Q", "P": "P"}[kind]
        if response.op not in expected:
            raise NoAnswer(f"{what}: unexpected answer {response.op!r}")
        return response, result.sent_at, result.retried

    def _release_in_background(
        self, key: bytes, token: int, session: Optional[Session]
    ) -> None:
        """A compensating release of that exact token, not waited for (the lease recovers it
        if this fails). A session that fails with it, sent or not, hands it back to
        :meth:`_resubmit_background`: a release is safe to send again (§4.3)."""
        deadline = time.monotonic() + self.transport_timeout
        call = Call("R", key, token, deadline, waitable=False)
        taken: Optional[Address] = None
        if session is not None and session.submit_background(call):
            taken = session.addr
        else:
            addr = self._members.route(key)
            # Never to an address not accepted (yet): the lease recovers the hold.
            pool = self._members.pool(addr) if self._members.accepted(addr) else None
            if pool is not None:
                other = pool.pick(None)
                if other is not None and other.submit_background(call):
                    taken = addr
        if taken is not None and len(self._members.listed) > 1:
            # Hedged as any release of a client with several members (§4.3).
            self._hedger.schedule(_BackgroundHedge(self, call, taken))

    def _resubmit_background(self, call: Call) -> None:
        """A fire-and-forget release whose session failed: to another session of the key's
        route while its deadline leaves time, at most ``BACKGROUND_ATTEMPTS_MAX`` sessions in
        all (called on the failed session's I/O thread)."""
        attempts = call.attempts + 1
        if attempts >= BACKGROUND_ATTEMPTS_MAX or time.monotonic() >= call.deadline:
            return
        again = call.fresh()
        again.attempts = attempts
        addr = self._members.route(call.key)
        # Never to an address not accepted (yet): the lease recovers the hold.
        pool = self._members.pool(addr) if self._members.accepted(addr) else None
        if pool is None:
            return
        session = pool.pick(None)
        if session is not None:
            session.submit_background(again)

    def _exchange_hedged(self, call: Call) -> _Result:
        """:meth:`_exchange` of a release or an extend, *hedged* when the client lists
        several members (docs/protocol.md §4.3): when its first attempt is not answered
        within the hedge delay (a quarter of ``connect_timeout``, within 0.1..=0.5 s; its
        member may be paused: a VM stall, a slow disk, a cut link), the same request also goes
        to the other members — never back to the one that has not answered, even when another
        member names it leader — which redirect it to the new leader once one is elected; the
        first answer wins. Both are safe to execute twice: a second release answers ``N``,
        and an extend executed twice counts its lease from the later execution, so the
        ticket's bound, taken from the answer that came, is never late. Anything else, and
        any request of a client of one member: :meth:`_exchange` unchanged."""
        members = self._members
        if (call.kind != "R" and call.kind != "E") or len(members.listed) < 2:
            return self._exchange(call, None)
        hedge = _Hedge(self, call, members.route(call.key))
        self._hedger.schedule(hedge)
        return hedge.settle(self._exchange(call, hedge.abort_first))

    def _exchange(
        self,
        call: Call,
        abort: Optional["_Abort"],
        skip: Optional[Address] = None,
        away: Optional[Address] = None,
    ) -> _Result:
        """Hands ``call`` to sessions until one answers (other than ``M``) or may have sent
        it, or its deadline passes while it is definitely unsent, or (unless
        ``retry_refused``) every member refused the connection (see the module docs). A
        cancelled ``abort`` ends it as its deadline would. A release or an extend that may
        have been sent on a session that failed is sent again (it ends ``indeterminate`` only
        if no later attempt is answered); an acquire that may have been sent on an identified
        session that failed is resolved (:meth:`_resolve`).

        ``skip``: the hedge of a release or an extend already waiting at that member
        (:meth:`_exchange_hedged`): its first attempt goes to the member after it in turn
        instead of the key's route, and it never goes there, even when another member names
        it leader (such an ``M`` counts as naming none: back off, then the next member). A
        hedge leaves ``last_unavailable`` to its caller.

        ``away``: a Resolve after a session to that member failed: its first attempt goes to
        the key's route unless that is this member, else to the member after it in turn; an
        ``M`` naming it is followed (if it still leads the key, the others send the Resolve
        back; if it is paused, no new session waits out its handshake there first)."""
        members = self._members
        key = call.key if call.kind != "P" else None
        deadline = call.deadline
        started = time.monotonic()
        report: Optional[_Report] = None
        backoff = 0.0
        redirects = 0
        avoid: Optional[Session] = None
        refused: List[Address] = []  # members that refused a connection, each once
        # An earlier attempt of this release or extend may have been sent.
        possibly_sent = False
        # How many refusals end the call: every member this sequence may try.
        refusals_all = max(1, len(members.listed) - (1 if skip in members.listed else 0))

        def turn(at: Address) -> Address:
            # The member after ``at`` in turn, never ``skip`` (unless it is the only one).
            following = members.next_member_except(at)
            for _ in range(len(members.listed)):
                if following != skip:
                    break
                following = members.next_member_except(following)
            return following

        addr = members.route(key) if skip is None else turn(skip)
        if away is not None and addr == away:
            addr = members.next_member_except(away)

        def sleep() -> None:
            nonlocal backoff
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(min(backoff, left))
            backoff = min(max(backoff * 2, BACKOFF_MIN), BACKOFF_MAX)

        def note(at: Address, state: str) -> None:
            nonlocal report
            if report is None:
                report = _Report()
            report.note(at, state)

        def leave(at: Address) -> Address:
            # No longer the key's leader as far as this call knows: back off, then the next.
            members.forget(key, at)
            sleep()
            return turn(at)

        def unavailable(all_refused: bool = False) -> _Result:
            if possibly_sent:
                # An earlier attempt may have executed: whatever the later ones did, unknown.
                return _Result("indeterminate", retried=True)
            text = (report or _Report()).text(members.listed)
            tried = _elapsed_text(time.monotonic() - started)
            if all_refused:
                text += (
                    f" (tried for {tried}: nothing listens there; retry_refused=True keeps "
                    "trying until the deadline)"
                )
            else:
                text += f" (tried for {tried})"
            if skip is None and call.kind != "W" and (abort is None or not abort.cancelled):
                self.last_unavailable = text
            return _Result("unsent", why=text)

        def every_member_refused(session: Optional[Session], at: Address) -> bool:
            if self.retry_refused or session is None or not session.connect_refused:
                return False
            if at not in refused:
                refused.append(at)
            return len(refused) >= refusals_all

        while True:
            if abort is not None and abort.cancelled and call.kind != "W":
                # (A Resolve goes on: it settles what the acquire did; ``Session.abort`` only
                # moves the acquire's deadline.)
                return _Result("unsent", serving=True)
            if time.monotonic() >= deadline:
                return unavailable()
            unusable = members.usable(addr, deadline)
            if unusable is not None:
                # Not accepted (yet) as a member of this client's cluster (``_check``): noted
                # as an unreachable member is, and the next one after a backoff. An ask whose
                # connection was refused counts as a session's refused connect.
                note(addr, unusable.why)
                if unusable.refused and not self.retry_refused:
                    if addr not in refused:
                        refused.append(addr)
                    if len(refused) >= refusals_all:
                        return unavailable(all_refused=True)
                addr = leave(addr)
                continue
            pool = members.pool(addr)
            if pool is None:
                if members.closed:
                    note(addr, "the client was closed")
                    return unavailable()
                note(addr, f"more than {MEMBERS_MAX} members: no session to it")
                sleep()
                addr = turn(addr)
                continue
            session = pool.pick(avoid)
            if session is None or not session.submit(call):
                if session is not None and session.failed:
                    note(addr, f"unreachable: {session.failure}")
                elif pool.last_failure and session is None:
                    note(addr, f"unreachable: {pool.last_failure}")
                else:
                    note(addr, "silent (its sessions stopped answering)")
                if every_member_refused(session, addr):
                    return unavailable(all_refused=True)
                if session is not None:
                    avoid = session
                addr = leave(addr)
                call = call.fresh()
                continue
            if abort is not None:
                abort.attach(session, call)
            session.wait(call)
            if abort is not None:
                abort.detach()
            outcome = call.outcome
            if outcome == ANSWER:
                response = call.response
                assert response is not None
                if response.op != "M":
                    return _Result(
                        "answer",
                        response,
                        call.sent_at,
                        call.read_at,
                        session=session,
                        retried=possibly_sent,
                    )
                leader = response.leader
                if call.resolved:
                    # An acquire a Resolve found queued, answered M (its leader stepped down):
                    # never sent again; ``_resolve`` asks the leader named, or the next.
                    if leader is not None and leader != addr:
                        members.learn(key, leader)
                    else:
                        members.forget(key, addr)
                    return _Result("indeterminate")
                redirects += 1
                named = leader if leader is not None and leader != addr else None
                if named is not None and named == skip:
                    # The member this hedge leaves alone: as if no leader were known, until
                    # another one is elected and named.
                    named = None
                note(addr, f"named the leader {named[0]}:{named[1]}" if named else "no leader")
                if redirects > REDIRECTS_MAX:
                    if report is not None:
                        report.redirects_exhausted = True
                    return unavailable()
                avoid = None
                call = call.fresh()
                if named is not None:
                    members.learn(key, named)
                    addr = named
                else:
                    backoff = max(backoff, BACKOFF_MIN)
                    addr = leave(addr)
                continue
            if outcome == EXPIRED:
                if possibly_sent:
                    return _Result("indeterminate", retried=True)
                return _Result("unsent", serving=True)
            if outcome == EXPIRED_CONNECTING:
                note(addr, "connecting")
                return unavailable()
            if outcome == UNREACHABLE:
                note(addr, f"unreachable: {session.failure}")
                return unavailable()
            if outcome == NOT_SENT:
                if call.resolved:
                    # (An X 7 with an acquire a Resolve found queued on this session: not sent
                    # again; ``_resolve`` asks again.)
                    return _Result("indeterminate")
                failure = session.failure if session.failed else "silent (answers overdue)"
                note(addr, f"unreachable: {failure}" if session.failed else failure)
                if every_member_refused(session, addr):
                    return unavailable(all_refused=True)
                avoid = session
                addr = leave(addr)
                call = call.fresh()
                continue
            assert outcome == INDETERMINATE
            if call.kind == "A" and session.identified:
                # Not sent again: asked about, on another session (§4.1, §5).
                members.forget(key, addr)
                return self._resolve(call, session, addr, abort)
            if call.kind == "R" or call.kind == "E":
                # Names a token: safe to send again (§4.3), within the same deadline.
                possibly_sent = True
                if session.failed:
                    note(addr, f"unreachable: {session.failure}")
                avoid = session
                addr = leave(addr)
                call = call.fresh()
                continue
            members.forget(key, addr)
            return _Result("indeterminate")

    def _resolve(
        self, acquire: Call, failed: Session, addr: Address, abort: Optional["_Abort"]
    ) -> _Result:
        """An acquire that may have been sent on ``failed``, an identified session to
        ``addr``, got no answer there: asks another session what became of it (Resolve,
        docs/protocol.md §5) — at the member that leads the key now, following ``M`` and
        moving on from a member that does not answer, as any request (:meth:`_exchange`) —
        until its deadline, or, when that passed, for one transport timeout from now, so that
        a grant made meanwhile is found and released rather than left to its lease. A Resolve
        is safe to repeat: one whose session fails, or that reaches no member, is asked again
        while time is left. ``indeterminate`` when none could answer in time."""
        deadline = acquire.deadline
        until = max(deadline, time.monotonic() + self.transport_timeout)
        backoff = 0.0
        # The first ask goes to another member first (``away``), later ones by route.
        away: Optional[Address] = addr
        while time.monotonic() < until:
            resolve = Call("W", acquire.key, acquire.ident, until, acquire.lease_s, acquire.wait_zero)
            resolve.wait_deadline = deadline
            result = self._exchange(resolve, abort, away=away)
            away = None
            if result.kind == "answer":
                return _resolved(result)
            if result.kind == "never_seen":
                # Resolved "queued", then its session failed: resolved again there (by
                # ``_exchange``), which found it never executed.
                return result
            left = until - time.monotonic()
            if left > 0:
                time.sleep(min(backoff, left))
            backoff = min(max(backoff * 2, BACKOFF_MIN), BACKOFF_MAX)
        return _Result("indeterminate")
