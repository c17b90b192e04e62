"""One session (one TCP or TLS connection) and the calls pipelined on it (docs/protocol.md §4.3).

A session has one I/O thread that connects, proves the session with a handshake ping (§4.3
"Established sessions"), reads every answer and matches it by owner, token or nonce. A caller
hands the queued frames to the (non-blocking) socket itself, in one ``send`` made without the
lock, so frames other threads queue meanwhile go out together in the next batch; the I/O
thread sends what the socket would not take at once. A call's own thread applies its
deadline (see ``Session.on_timer``): an unsent call is never sent after it, a fully sent
acquire gets a Cancel on the same session, a partly sent frame or an unanswered Cancel closes
the session.

A call counts as *definitely not sent* only while none of its bytes was handed to the socket
(over TLS: to the TLS layer), or when the session was refused with ``X`` 7.

Resumable calls (docs/protocol.md §5): when the client resumes calls, the handshake starts with
an Identify before the ping. ``I`` makes the session *identified*; ``X`` 9, 8 or 10 leave it
not identified and the handshake goes on; ``X`` 1 (a server that does not know Identify, and
closes the session) turns identification off for every later session of the client and ends
this one as a failed connect (its calls were not sent). A Resolve (``W``) is correlated by
the owner of the acquire it asks about; a ``queued`` answer turns it back into that acquire,
waiting on this session until the acquire's own deadline (then the Cancel of §4.4 goes here).
A fire-and-forget release whose session fails, sent or not, is handed to the client's
``resubmit`` for another session (a release is safe to send again).

Silence (§4.3): a session *stalls* when an answer is overdue — a request the server answers at
once (anything but an acquire with wait > 0) was handed ``connect_timeout`` ago or more, and
nothing was read since. A stalled session takes no new call, and its unsent calls go back
(``NOT_SENT``); a stall never closes it by itself: a slow server is not a dead one.

Probes: a waiting acquire is not answered at once, so a session carrying only waiters would
never notice a paused server (SIGSTOP, a VM stall: its kernel still accepts bytes), and its
waiters would wait the pause out although another member may lead their keys within a second.
So an *identified* session with a waiting acquire possibly on the wire that reads nothing for
a quarter of ``connect_timeout`` sends a ``P`` of its own (a nonce no caller uses; its pong is
delivered to nobody), again after each quiet quarter; every read restarts the quiet time, and
once no waiting acquire is on the wire probing stops (an idle session never wakes). An
identified session that stalls — the probe counts as a request answered at once, and its
answer is overdue after half of ``connect_timeout`` — while a waiting acquire is on the wire
*closes*: its acquires end ``INDETERMINATE`` and the client
resolves them on another session (never sends them again). The I/O thread keeps that time
(its poll wakes at the probe's instant and the stall's). An unidentified session never probes
and never closes for silence: without a Resolve, closing would only end its waiters
``INDETERMINATE`` early.
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from . import _codec
from ._codec import Response

# Call states.
QUEUED = 0  # nothing handed to the socket
PARTIAL = 1  # part of the frame handed
SENT = 2  # the whole frame handed
CANCELLING = 3  # an acquire whose Cancel was queued at its deadline
DONE = 4  # the outcome is set
HANDING = 5  # in a send() under way outside the lock: counts as possibly sent

# Outcomes.
ANSWER = "answer"
NOT_SENT = "not_sent"  # definitely not sent: may go to another session or member
UNREACHABLE = "unreachable"  # not a latchkey server, or TLS refused: do not retry
INDETERMINATE = "indeterminate"  # may have been sent, no definite answer
EXPIRED = "expired"  # the deadline passed while it was unsent on an established session
EXPIRED_CONNECTING = "expired_connecting"  # ... while its session was not established

Address = Tuple[str, int]

# What every client says when a TLS server answers a plaintext client (the Rust client's
# latchkey_client::SPEAKS_TLS), and how this one is given the CA.
SPEAKS_TLS = "the server speaks TLS (it answered with a TLS record)"
TLS_HINT = "connect with TLS, trusting its CA (tls=latchkey.TLS(ca=FILE))"

_READ_BYTES = 65536

# An identified session with a waiting acquire on the wire probes after this fraction of
# ``connect_timeout`` without a read (the module docs): 0.5 s with the default 2 s, and a paused
# server found 2.5 s after its last answer.
PROBE_QUIET = 4
# An unanswered probe stalls the session after this fraction of ``connect_timeout`` (1 s with
# the default 2 s): a paused server found 1.5 s after its last answer (the Rust client's
# PROBE_ANSWER).
PROBE_ANSWER = 2
# The reason an identified session with a waiter closes for silence (the Rust client's
# CloseReason::Silent).
SILENT = "the server stopped answering (a ping went unanswered) while an acquire waited"


class Call:
    """One request and, once it ends, its outcome."""

    __slots__ = (
        "kind",
        "key",
        "ident",
        "lease_s",
        "wait_zero",
        "deadline",
        "timer",
        "state",
        "sent_at",
        "read_at",
        "outcome",
        "response",
        "done",
        "answered",
        "abandoned",
        "parent",
        "wait_deadline",
        "attempts",
        "resolved",
    )

    def __init__(
        self,
        kind: str,
        key: bytes,
        ident: int,
        deadline: float,
        lease_s: int = 0,
        wait_zero: bool = False,
        waitable: bool = True,
    ) -> None:
        self.kind = kind
        self.key = key
        self.ident = ident
        self.lease_s = lease_s
        self.wait_zero = wait_zero
        self.deadline = deadline
        self.timer = deadline
        self.state = QUEUED
        self.sent_at = 0.0
        self.read_at = 0.0
        self.outcome = ""
        self.response: Optional[Response] = None
        self.done: Optional[threading.Lock] = None
        if waitable:
            self.done = threading.Lock()
            self.done.acquire()
        self.answered = False
        self.abandoned = False
        self.parent: Optional[Call] = None
        # A Resolve: the deadline of the acquire it asks about (``deadline`` is the Resolve's).
        self.wait_deadline = deadline
        # A fire-and-forget release: how many sessions it was handed to after the first.
        self.attempts = 0
        # A Resolve that a "queued" answer turned back into its acquire: never sent again as
        # an acquire (its retries are Resolves, see ``Client._exchange``).
        self.resolved = False

    def fresh(self) -> "Call":
        """The same request (same id, key and deadline) for another attempt."""
        call = Call(
            self.kind,
            self.key,
            self.ident,
            self.deadline,
            self.lease_s,
            self.wait_zero,
            self.done is not None,
        )
        call.wait_deadline = self.wait_deadline
        call.attempts = self.attempts
        return call

    def immediate(self) -> bool:
        """Whether the server answers it at once (anything but an acquire with wait > 0)."""
        return self.kind != "A" or self.wait_zero

    def encode(self, now: float) -> Optional[bytes]:
        """The frame, with the wire wait computed now; ``None`` when the deadline has passed
        (the request must not be sent)."""
        kind = self.kind
        if kind == "A":
            if self.wait_zero:
                wait_s = 0
            else:
                left = self.deadline - now
                if left <= 0:
                    return None
                wait_s = min(255, math.ceil(left))
            return _codec.encode_acquire(self.key, wait_s, self.lease_s, self.ident)
        if now >= self.deadline and kind != "C":
            return None
        if kind == "R":
            return _codec.encode_release(self.key, self.ident)
        if kind == "E":
            return _codec.encode_extend(self.key, self.lease_s, self.ident)
        if kind == "Q":
            return _codec.encode_query(self.key, self.ident)
        if kind == "P":
            return _codec.encode_ping(self.ident)
        if kind == "W":
            return _codec.encode_resolve(self.key, self.ident)
        return _codec.encode_cancel(self.key, self.ident)


class _Entry:
    """A call in the output queue: its frame once encoded, and how much of it was handed."""

    __slots__ = ("call", "frame", "offset")

    def __init__(self, call: Call) -> None:
        self.call = call
        self.frame: Optional[bytes] = None
        self.offset = 0


class SessionConfig:
    """What every session of a client shares.

    ``identity``: the client id and the grace (whole seconds) its sessions identify with
    (docs/protocol.md §5), or ``None`` (they do not). ``resumes`` turns ``False``, for every
    later session, once a server answered an Identify ``X`` 1. ``resubmit`` takes the
    fire-and-forget releases of a failed session (called on its I/O thread, without its
    lock)."""

    __slots__ = (
        "connect_timeout",
        "transport_timeout",
        "ssl_context",
        "server_name",
        "next_id",
        "identity",
        "resumes",
        "resubmit",
    )

    def __init__(
        self,
        connect_timeout: float,
        transport_timeout: float,
        ssl_context: Optional[ssl.SSLContext],
        server_name: Optional[str],
        next_id: "IdSource",
        identity: Optional[Tuple[int, int]] = None,
        resubmit: Optional[Callable[[Call], None]] = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.transport_timeout = transport_timeout
        self.ssl_context = ssl_context
        self.server_name = server_name
        self.next_id = next_id
        self.identity = identity
        self.resumes = identity is not None
        self.resubmit = resubmit


class IdSource:
    """Owner ids and nonces: distinct, never 0, unpredictable across processes."""

    def __init__(self) -> None:
        self._base = int.from_bytes(os.urandom(8), "big")
        self._lock = threading.Lock()
        self._count = 0

    def __call__(self) -> int:
        with self._lock:
            self._count += 1
            count = self._count
        # splitmix64 of base + count: a bijection, so ids of one client never repeat.
        z = (self._base + count * 0x9E3779B97F4A7C15) & _codec.U64_MAX
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _codec.U64_MAX
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _codec.U64_MAX
        z ^= z >> 31
        return z or 1


def _finish(call: Call, outcome: str, response: Optional[Response] = None, now: float = 0.0) -> None:
    if call.state == DONE:
        return
    call.state = DONE
    call.outcome = outcome
    call.response = response
    call.read_at = now
    if call.done is not None:
        call.done.release()


class Session:
    """One connection to one member; see the module docs."""

    def __init__(self, addr: Address, config: SessionConfig) -> None:
        self.addr = addr
        self.config = config
        self.lock = threading.Lock()
        self.established = False
        self.failed = False
        self.failure = ""
        self.unreachable = False
        self.connect_refused = False  # the TCP connection was refused: nothing listens there
        self.identified = False  # the server identified it (docs/protocol.md §5)
        self._lost: List[Call] = []  # fire-and-forget releases it ended: for another session
        self._sock: Optional[socket.socket] = None
        self._tls: Optional[ssl.SSLObject] = None
        self._tls_in: Optional[ssl.MemoryBIO] = None
        self._tls_out: Optional[ssl.MemoryBIO] = None
        self._raw_backlog = bytearray()
        self._decoder = _codec.Decoder()
        self._waiting: List[Call] = []  # submitted before the handshake pong
        self._out: Deque[_Entry] = deque()
        self._entries: Dict[int, _Entry] = {}  # id(call) -> its unsent entry
        self._owners: Dict[int, Call] = {}
        self._nonces: Dict[int, Call] = {}
        self._tokens: Dict[int, Deque[Call]] = {}
        self._stall: Deque[Tuple[float, Call]] = deque()
        self._last_read = 0.0
        # While a waiting acquire may be on the wire of this identified session: the instant
        # its quiet time counts from (its hand-off, or the last probe; reads count through
        # ``_last_read``); ``None`` while no probe is armed (see the module docs).
        self._probe_from: Optional[float] = None
        # The last probe handed and when: awaited for ``connect_timeout / PROBE_ANSWER``.
        self._probe_out: Optional[Tuple[float, Call]] = None
        self._probe_nonce = -1  # the last probe's
        self._want_write = False
        self._sending = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self._thread = threading.Thread(
            target=self._run, name=f"latchkey-session-{addr[0]}:{addr[1]}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------
    # Callers

    def submit(self, call: Call) -> bool:
        """Queues ``call``; ``False`` when this session takes no new call (failed or stalled)."""
        with self.lock:
            if self.failed or self._stalled_locked(time.monotonic()):
                return False
            self._submit_locked(call)
            return True

    def submit_background(self, call: Call) -> bool:
        """Queues a fire-and-forget call (a compensating release) even on a stalled session."""
        with self.lock:
            if self.failed:
                return False
            self._submit_locked(call)
            return True

    def _submit_locked(self, call: Call, flush: bool = True) -> None:
        kind = call.kind
        if kind == "A" or kind == "W":
            self._owners[call.ident] = call
        elif kind == "R" or kind == "E":
            queue = self._tokens.get(call.ident)
            if queue is None:
                queue = self._tokens[call.ident] = deque()
            queue.append(call)
        elif kind == "Q" or kind == "P":
            self._nonces[call.ident] = call
        if not self.established:
            self._waiting.append(call)
            return
        entry = _Entry(call)
        self._entries[id(call)] = entry
        self._out.append(entry)
        if not self._sending and not self._want_write:
            # Otherwise the thread sending now, or the I/O thread once the socket takes more,
            # sends it.
            if flush:
                self._flush_locked()
            else:
                self._request_write_locked()

    def is_stalled(self) -> bool:
        with self.lock:
            return self._stalled_locked(time.monotonic())

    def _stalled_locked(self, now: float) -> bool:
        at = self._stall_at_locked()
        return at is not None and at <= now

    def _stall_at_locked(self) -> Optional[float]:
        """When the session stalls unless it reads before: ``None`` when no answer is awaited
        (every request answered at once was answered, or handed before the last read)."""
        stall = self._stall
        last_read = self._last_read
        while stall and (stall[0][1].answered or stall[0][0] <= last_read):
            stall.popleft()
        at = stall[0][0] + self.config.connect_timeout if stall else None
        probe = self._probe_out
        if probe is not None:
            if probe[1].answered or probe[0] <= last_read:
                self._probe_out = None
            else:
                probe_at = probe[0] + self.config.connect_timeout / PROBE_ANSWER
                at = probe_at if at is None else min(at, probe_at)
        return at

    def wait(self, call: Call) -> None:
        """Blocks until ``call`` has its outcome, applying its deadline (§4.2–§4.4)."""
        done = call.done
        assert done is not None
        while True:
            now = time.monotonic()
            state = call.state
            if state == QUEUED:
                # Unsent: look again now and then, in case the session stalls.
                timeout = min(call.timer - now, 0.05)
            elif state == HANDING:
                timeout = max(call.timer - now, 0.001)
            else:
                # At least every second: ``abort`` may have moved the timer earlier.
                timeout = min(call.timer - now, 1.0)
                if call.kind == "W" and call.wait_deadline > now:
                    # A "queued" answer may turn it into the acquire, due at this deadline.
                    timeout = min(timeout, call.wait_deadline - now)
            if done.acquire(True, max(timeout, 0.0)):
                return
            self.on_timer(call)

    def abort(self, call: Call) -> None:
        """Gives ``call`` up now, as if its deadline had passed (a caller that no longer wants
        it: an asyncio task cancelled): unsent, it is never sent; a fully sent acquire that
        may be queued gets its Cancel on this session at once (§4.4), and the answer that
        follows decides. A ``wait=0`` acquire is left alone: it never queues, its answer
        comes at once, and the caller's delivery gate gives a late grant back."""
        if call.kind == "A" and call.wait_zero:
            return
        with self.lock:
            if call.state == DONE or call.state == CANCELLING:
                return
            now = time.monotonic()
            if call.kind == "W":
                # The Resolve goes on (it settles what the acquire did): only the acquire's
                # deadline passes, so a "queued" answer cancels it at once, and a grant is
                # given back at the caller's delivery gate.
                call.wait_deadline = min(call.wait_deadline, now)
                return
            call.deadline = min(call.deadline, now)
            call.timer = min(call.timer, now)
        self.on_timer(call)

    def on_timer(self, call: Call) -> None:
        """What a call's deadline (or a stall) does to it; see the module docs."""
        with self.lock:
            self._on_timer_locked(call, time.monotonic())

    def _on_timer_locked(self, call: Call, now: float, flush: bool = True) -> None:
        """``on_timer`` under the lock; ``flush=False`` from the I/O thread's dispatch (a
        Cancel is then left to the I/O thread to send: handing frames releases the lock)."""
        state = call.state
        if state == DONE or state == HANDING:
            # HANDING: the send under way decides in a moment whether it left.
            return
        if state == QUEUED:
            if now >= call.deadline:
                self._unqueue_locked(call)
                _finish(call, EXPIRED if self.established else EXPIRED_CONNECTING)
            elif self.established and self._stalled_locked(now):
                self._unqueue_locked(call)
                _finish(call, NOT_SENT)
            return
        if now < call.timer:
            return
        if state == PARTIAL:
            self._fail_locked("the deadline passed with part of a frame sent")
        elif state == SENT and call.kind == "A" and not call.wait_zero:
            call.state = CANCELLING
            call.timer = now + self.config.transport_timeout
            cancel = Call("C", call.key, call.ident, call.timer, waitable=False)
            cancel.parent = call
            self._submit_locked(cancel, flush)
        elif call.kind == "A":
            self._fail_locked("no answer to an acquire within its deadline")
        elif call.kind == "W":
            # Closed rather than given up: a waiter it might still hand to this session is
            # then detached, and withdrawn when the client's grace ends (docs/protocol.md §5).
            self._fail_locked("no answer to a Resolve within its deadline")
        elif call.kind == "R" or call.kind == "E":
            # Its answer, if it comes, must still be matched in token order.
            call.abandoned = True
            _finish(call, INDETERMINATE)
        else:
            self._nonces.pop(call.ident, None)
            _finish(call, INDETERMINATE)

    def _unqueue_locked(self, call: Call) -> None:
        entry = self._entries.pop(id(call), None)
        if entry is not None:
            try:
                self._out.remove(entry)
            except ValueError:
                pass
        else:
            try:
                self._waiting.remove(call)
            except ValueError:
                pass
        self._forget_locked(call)

    def _forget_locked(self, call: Call) -> None:
        kind = call.kind
        if kind == "A" or kind == "W":
            if self._owners.get(call.ident) is call:
                del self._owners[call.ident]
        elif kind == "Q" or kind == "P":
            if self._nonces.get(call.ident) is call:
                del self._nonces[call.ident]
        elif kind == "R" or kind == "E":
            queue = self._tokens.get(call.ident)
            if queue is not None:
                try:
                    queue.remove(call)
                except ValueError:
                    pass
                if not queue:
                    del self._tokens[call.ident]

    def close(self) -> None:
        with self.lock:
            self._fail_locked("the client was closed")

    # ------------------------------------------------------------------------------------
    # Writing

    def _request_write_locked(self) -> None:
        self._want_write = True
        self._wake_locked()

    def _wake_locked(self) -> None:
        if not self._woken:
            self._woken = True
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass

    def _flush_locked(self) -> None:
        """Hands queued frames to the socket until it would block."""
        sock = self._sock
        if sock is None or self.failed:
            return
        out = self._out
        now = time.monotonic()
        if self._tls is not None:
            tls = self._tls
            while out:
                entry = out.popleft()
                call = entry.call
                self._entries.pop(id(call), None)
                frame = call.encode(now)
                if frame is None:
                    self._forget_locked(call)
                    _finish(call, EXPIRED)
                    continue
                tls.write(frame)
                self._handed_locked(call, now)
                if call.state == PARTIAL:
                    call.state = SENT
            assert self._tls_out is not None
            self._raw_backlog += self._tls_out.read()
            self._send_raw_locked()
            return
        if self._sending:
            return
        self._sending = True
        try:
            self._send_batches_locked(sock)
        finally:
            self._sending = False

    def _send_batches_locked(self, sock: socket.socket) -> None:
        """Sends the queued frames in batches, each ``send`` made without the lock (other
        threads queue meanwhile, and their frames go in the next batch). The frames of a batch
        are ``HANDING`` while it is under way: possibly sent, should the session fail then;
        afterwards, what the socket did not take is ``QUEUED`` again (definitely not sent)."""
        out = self._out
        rounds = 0
        while out and not self.failed:
            rounds += 1
            if rounds > 4:
                # Frames keep coming: the I/O thread sends the rest, this caller goes back.
                if not self._want_write:
                    self._request_write_locked()
                return
            now = time.monotonic()
            batch: List[_Entry] = []
            pieces: List[bytes] = []
            size = 0
            for entry in out:
                frame = entry.frame
                if frame is None:
                    frame = entry.call.encode(now)
                    if frame is None:
                        break
                    entry.frame = frame
                piece = frame[entry.offset :] if entry.offset else frame
                pieces.append(piece)
                batch.append(entry)
                size += len(piece)
                if size >= 65536:
                    break
            if not batch:
                # The head's deadline passed before any of it was handed.
                entry = out.popleft()
                self._entries.pop(id(entry.call), None)
                self._forget_locked(entry.call)
                _finish(entry.call, EXPIRED)
                continue
            for entry in batch:
                call = entry.call
                if call.state == QUEUED and call.kind != "C":
                    call.state = HANDING
                    call.sent_at = now
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            failure: Optional[OSError] = None
            self.lock.release()
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                sent = 0
                failure = error
            finally:
                self.lock.acquire()
            if self.failed:
                # Every call of the batch was ended as possibly sent (or refused): done.
                return
            left = sent
            for entry in batch:
                frame = entry.frame
                assert frame is not None
                call = entry.call
                take = min(left, len(frame) - entry.offset)
                left -= take
                if take and entry.offset == 0:
                    self._handed_locked(call, now)
                elif not take and call.state == HANDING:
                    call.state = QUEUED  # the socket took none of it
                entry.offset += take
                if entry.offset == len(frame):
                    # The batch is the head of the queue: nothing removes a frame that is
                    # HANDING, PARTIAL or a Cancel.
                    if out and out[0] is entry:
                        out.popleft()
                    else:
                        out.remove(entry)
                    self._entries.pop(id(call), None)
                    if call.state == PARTIAL:
                        call.state = SENT
            if failure is not None:
                self._fail_locked(f"cannot send: {failure}")
                return
            if sent < len(data):
                if not self._want_write:
                    self._request_write_locked()
                return
        self._want_write = False

    def _handed_locked(self, call: Call, now: float) -> None:
        """The first bytes of ``call``'s frame were handed to the socket (or TLS) at ``now``;
        its state becomes PARTIAL (SENT once the whole frame is)."""
        if call.kind == "C":
            parent = call.parent
            if parent is not None:
                self._stall.append((now, parent))
            return
        call.sent_at = now
        if call.state == QUEUED or call.state == HANDING:
            call.state = PARTIAL
        if call.immediate():
            self._stall.append((now, call))
            if call.kind == "P" and call.ident == self._probe_nonce:
                self._probe_out = (now, call)
        else:
            self._arm_probe_locked(now)

    # ------------------------------------------------------------------------------------
    # Probes (see the module docs)

    def _arm_probe_locked(self, now: float) -> None:
        """A waiting acquire may be on the wire from ``now``: an identified session starts
        counting its quiet time, and the I/O thread learns when to wake."""
        if self.identified and self._probe_from is None:
            self._probe_from = now
            self._wake_locked()

    def _waiter_on_the_wire_locked(self) -> bool:
        """Whether an acquire with wait > 0 may be on the wire (some byte of it handed, no
        answer yet). O(acquires of the session): at most once per quiet time and at a stall."""
        for call in self._owners.values():
            if (
                call.kind == "A"
                and not call.wait_zero
                and call.state in (PARTIAL, SENT, CANCELLING, HANDING)
            ):
                return True
        return False

    def _silence_locked(self, now: float) -> Optional[float]:
        """The I/O thread, at ``now``: probes when the quiet time is up, and closes the session
        when an answer is overdue with a waiter on the wire (never before either instant).
        Returns when to look again; ``None`` while no probe is armed."""
        if self._probe_from is None or self.failed:
            return None
        stall_at = self._stall_at_locked()
        if stall_at is not None:
            # An answer is awaited: the stall covers it, no probe meanwhile.
            if now < stall_at:
                return stall_at
            if self._waiter_on_the_wire_locked():
                self._fail_locked(SILENT)
                return None
            # Stalled with no waiter left: nothing to probe for (the next waiter re-arms).
            self._probe_from = None
            return None
        probe_at = max(self._probe_from, self._last_read) + self.config.connect_timeout / PROBE_QUIET
        if now < probe_at:
            return probe_at
        if not self._waiter_on_the_wire_locked():
            self._probe_from = None
            return None
        self._probe_from = now
        probe = Call("P", b"", self.config.next_id(), now + self.config.transport_timeout, waitable=False)
        self._probe_nonce = probe.ident
        self._submit_locked(probe)
        if self.failed:
            return None
        # Handed (it is then awaited: the stall's instant), or still queued behind a frame
        # the socket would not take yet: look again after another quiet time.
        stall_at = self._stall_at_locked()
        return stall_at if stall_at is not None else now + self.config.connect_timeout / PROBE_QUIET

    def _send_raw_locked(self) -> None:
        sock = self._sock
        if sock is None or not self._raw_backlog:
            self._want_write = False
            return
        try:
            sent = sock.send(self._raw_backlog)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._fail_locked(f"cannot send: {error}")
            return
        del self._raw_backlog[:sent]
        if self._raw_backlog:
            if not self._want_write:
                self._request_write_locked()
        else:
            self._want_write = False

    # ------------------------------------------------------------------------------------
    # Failing

    def _fail_locked(
        self,
        reason: str,
        refused: bool = False,
        unreachable: bool = False,
        connect_refused: bool = False,
    ) -> None:
        """Ends the session: unsent calls go back (``NOT_SENT``), the others end
        ``INDETERMINATE`` — all of them ``NOT_SENT`` after an ``X`` 7."""
        if self.failed:
            return
        self.failed = True
        self.failure = reason
        self.unreachable = unreachable
        self.connect_refused = connect_refused
        unsent = UNREACHABLE if unreachable else NOT_SENT
        lost = self._lost
        for queue in self._tokens.values():
            for call in queue:
                if call.done is None and call.kind == "R" and call.state != DONE:
                    # A background release, sent or not: safe to send again elsewhere.
                    lost.append(call)
        for call in self._waiting:
            _finish(call, unsent)
        self._waiting.clear()
        for entry in self._out:
            call = entry.call
            if call.state == QUEUED or refused:
                _finish(call, unsent)
            else:
                _finish(call, INDETERMINATE)
        self._out.clear()
        self._entries.clear()
        sent_outcome = NOT_SENT if refused else INDETERMINATE
        for call in self._owners.values():
            _finish(call, sent_outcome)
        for call in self._nonces.values():
            _finish(call, sent_outcome)
        for queue in self._tokens.values():
            for call in queue:
                _finish(call, sent_outcome)
        self._owners.clear()
        self._nonces.clear()
        self._tokens.clear()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake_locked()

    # ------------------------------------------------------------------------------------
    # The I/O thread

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as error:  # noqa: BLE001 - every failure ends the session
            with self.lock:
                unreachable = isinstance(error, _Unreachable)
                refused = isinstance(error, _Refused)
                connect_refused = isinstance(error, _ConnectRefused)
                self._fail_locked(
                    _describe(error),
                    refused=refused,
                    unreachable=unreachable,
                    connect_refused=connect_refused,
                )
            self._close_socket()
            self._hand_lost()
            return
        try:
            self._loop()
        except Exception as error:  # noqa: BLE001
            with self.lock:
                self._fail_locked(_describe(error))
        self._close_socket()
        self._hand_lost()

    def _hand_lost(self) -> None:
        """Gives the fire-and-forget releases the failed session ended to the client, for
        another session (outside the lock: the client takes pool and session locks)."""
        with self.lock:
            lost = self._lost
            self._lost = []
        resubmit = self.config.resubmit
        if resubmit is None:
            return
        for call in lost:
            try:
                resubmit(call)
            except Exception:  # noqa: BLE001 - the lease recovers a release that is lost
                pass

    def _close_socket(self) -> None:
        for sock in (self._sock, self._wake_r, self._wake_w):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _connect(self) -> None:
        """TCP connect, TLS handshake and the handshake ping, all within the connect timeout."""
        config = self.config
        until = time.monotonic() + config.connect_timeout
        try:
            sock = socket.create_connection(self.addr, timeout=config.connect_timeout)
        except socket.timeout:
            raise _ConnectError("cannot connect: timed out") from None
        except ConnectionRefusedError as error:
            raise _ConnectRefused(f"cannot connect: {error.strerror or error}") from None
        except OSError as error:
            raise _ConnectError(f"cannot connect: {error.strerror or error}") from None
        self._sock = sock
        with self.lock:
            if self.failed:
                raise _ConnectError(self.failure)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if config.ssl_context is not None:
            self._tls_in = ssl.MemoryBIO()
            self._tls_out = ssl.MemoryBIO()
            self._tls = config.ssl_context.wrap_bio(
                self._tls_in,
                self._tls_out,
                server_hostname=config.server_name or self.addr[0],
            )
            self._tls_handshake(until)
        # An Identify first when the client resumes calls (docs/protocol.md §5): the server
        # answers it before the ping.
        identify: Optional[int] = None
        hello = b""
        if config.identity is not None and config.resumes:
            identify = config.next_id()
            client, grace_s = config.identity
            hello = _codec.encode_identify(grace_s, client, identify)
        identified = False
        nonce = config.next_id()
        ping = hello + _codec.encode_ping(nonce)
        if self._tls is not None:
            assert self._tls_out is not None
            self._tls.write(ping)
            ping = self._tls_out.read()
        self._send_blocking(ping, until)
        decoder = self._decoder
        leftover: Optional[List[Response]] = None
        while leftover is None:
            data = self._recv_blocking(until)
            try:
                answers = decoder.feed(data)
            except _codec.ProtocolError:
                if data[:1] in (b"\x15", b"\x16"):  # a TLS alert or handshake record
                    raise _Unreachable(f"{SPEAKS_TLS}: {TLS_HINT}") from None
                raise _Unreachable(
                    f"not a latchkey server: it answered a ping with {data[:1]!r}"
                ) from None
            for index, answer in enumerate(answers):
                op = answer.op
                if identify is not None:
                    if op == "I" and answer.id == identify:
                        identified = True
                        identify = None
                        continue
                    if op == "X" and answer.id == identify and answer.code in (8, 9, 10):
                        # Not identified (a server or member that does not resume calls, a
                        # client id of another identity, or its limit): §1-§4 alone here.
                        identify = None
                        continue
                    if op == "X" and answer.code == 1:
                        # It does not know Identify, and closes the session: no later
                        # session of this client identifies.
                        config.resumes = False
                        raise _ConnectError(
                            "the server does not know Identify (X 1): resumable calls are off"
                        )
                if op == "P" and answer.id == nonce and identify is None:
                    leftover = answers[index + 1 :]
                    break
                if op == "X" and answer.code == 7:
                    raise _Refused("the server refused the session: it has too many (X 7)")
                raise _Unreachable(f"not a latchkey server: it answered a ping with {op!r}")
        sock.setblocking(False)
        with self.lock:
            if self.failed:
                raise _ConnectError(self.failure)
            self.identified = identified
            self.established = True
            self._last_read = time.monotonic()
            waiting = self._waiting
            self._waiting = []
            for call in waiting:
                entry = _Entry(call)
                self._entries[id(call)] = entry
                self._out.append(entry)
            self._flush_locked()
            now = time.monotonic()
            for answer in leftover:
                self._dispatch_locked(answer, now)

    def _tls_handshake(self, until: float) -> None:
        tls = self._tls
        assert tls is not None and self._tls_in is not None and self._tls_out is not None
        while True:
            try:
                tls.do_handshake()
                self._send_blocking(self._tls_out.read(), until)
                return
            except ssl.SSLWantReadError:
                self._send_blocking(self._tls_out.read(), until)
                data = self._recv_raw(until)
                if not data:
                    raise _Unreachable("TLS handshake failed: the server closed the connection")
                self._tls_in.write(data)
            except ssl.SSLError as error:
                raise _Unreachable(f"TLS handshake failed: {error.reason or error}") from None

    def _send_blocking(self, data: bytes, until: float) -> None:
        """Handshake writes of raw bytes (already encrypted when over TLS)."""
        sock = self._sock
        assert sock is not None
        view = memoryview(data)
        while view:
            left = until - time.monotonic()
            if left <= 0:
                raise _ConnectError(
                    "connected, but no answer to a ping within the connect timeout"
                )
            sock.settimeout(left)
            try:
                sent = sock.send(view)
            except socket.timeout:
                continue
            view = view[sent:]

    def _recv_raw(self, until: float) -> bytes:
        sock = self._sock
        assert sock is not None
        left = until - time.monotonic()
        if left <= 0:
            raise _ConnectError("connected, but no answer to a ping within the connect timeout")
        sock.settimeout(left)
        try:
            return sock.recv(_READ_BYTES)
        except socket.timeout:
            raise _ConnectError(
                "connected, but no answer to a ping within the connect timeout "
                "(the server may be paused or overloaded)"
            ) from None
        except OSError as error:
            raise _ConnectError(f"cannot connect: {error.strerror or error}") from None

    def _recv_blocking(self, until: float) -> bytes:
        """Handshake reads: plaintext bytes, decrypted when over TLS."""
        while True:
            raw = self._recv_raw(until)
            if not raw:
                raise _ConnectError("cannot connect: the server closed the connection")
            if self._tls is None:
                return raw
            assert self._tls_in is not None
            self._tls_in.write(raw)
            plain = self._tls_read()
            if plain:
                return plain

    def _tls_read(self) -> bytes:
        tls = self._tls
        assert tls is not None
        chunks = []
        while True:
            try:
                chunk = tls.read(_READ_BYTES)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                raise EOFError("the server closed the TLS session") from None
            if not chunk:
                raise EOFError("the server closed the TLS session")
            chunks.append(chunk)
        return b"".join(chunks)

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        sock_fd = sock.fileno()
        wake = self._wake_r
        wake_fd = wake.fileno()
        poller.register(sock_fd, select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        watching_write = False
        decoder = self._decoder
        wake_at: Optional[float] = None  # a probe's or a stall's instant (module docs)
        while True:
            timeout: Optional[int] = None
            if wake_at is not None:
                # Rounded up: a poll that returns early only looks again.
                timeout = max(1, math.ceil((wake_at - time.monotonic()) * 1000))
            for fd, mask in poller.poll(timeout):
                if fd == wake_fd:
                    try:
                        while wake.recv(4096):
                            pass
                    except OSError:
                        pass
                    with self.lock:
                        self._woken = False
                    continue
                if mask & select.POLLOUT:
                    with self.lock:
                        if self._raw_backlog:
                            self._send_raw_locked()
                        else:
                            self._flush_locked()
                if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    if not self._read(sock, decoder):
                        return
            # Set by callers under the lock, each followed by a wake-up: read without it.
            if self.failed:
                return
            if self._probe_from is not None:
                with self.lock:
                    wake_at = self._silence_locked(time.monotonic())
                if self.failed:
                    return
            else:
                wake_at = None
            want = self._want_write
            if want != watching_write:
                poller.modify(sock_fd, select.POLLIN | (select.POLLOUT if want else 0))
                watching_write = want

    def _read(self, sock: socket.socket, decoder: _codec.Decoder) -> bool:
        try:
            data = sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as error:
            with self.lock:
                self._fail_locked(f"the connection failed: {error.strerror or error}")
            return False
        if not data:
            with self.lock:
                self._fail_locked("the server closed the connection")
            return False
        if self._tls is not None:
            assert self._tls_in is not None and self._tls_out is not None
            with self.lock:
                self._tls_in.write(data)
                try:
                    data = self._tls_read()
                except (EOFError, ssl.SSLError) as error:
                    self._fail_locked(f"the TLS session ended: {error}")
                    return False
                pending = self._tls_out.read()
                if pending:
                    self._raw_backlog += pending
                    self._send_raw_locked()
            if not data:
                return True
        try:
            answers = decoder.feed(data)
        except _codec.ProtocolError as error:
            with self.lock:
                self._fail_locked(f"not a latchkey answer: {error}")
            return False
        now = time.monotonic()
        with self.lock:
            self._last_read = now
            for answer in answers:
                self._dispatch_locked(answer, now)
                if self.failed:
                    return False
        return True

    def _dispatch_locked(self, answer: Response, now: float) -> None:
        op = answer.op
        call: Optional[Call]
        if op == "A" or op == "T" or op == "B":
            call = self._owners.pop(answer.id, None)
            if call is None:
                return
            call.answered = True
            _finish(call, ANSWER, answer, now)
        elif op == "R" or op == "E" or op == "N":
            queue = self._tokens.get(answer.id)
            if not queue:
                return
            call = queue.popleft()
            if not queue:
                del self._tokens[answer.id]
            call.answered = True
            if not call.abandoned:
                _finish(call, ANSWER, answer, now)
        elif op == "Q" or op == "P":
            call = self._nonces.pop(answer.id, None)
            if call is not None:
                call.answered = True
                _finish(call, ANSWER, answer, now)
        elif op == "W":
            call = self._owners.get(answer.id)
            if call is None or call.kind != "W":
                return
            if answer.fate == _codec.FATE_QUEUED:
                # Still queued, now on this session: the call is that acquire again, waiting
                # here for its A, T or B until its own deadline (then its Cancel goes here).
                call.kind = "A"
                call.resolved = True
                call.deadline = call.wait_deadline
                call.timer = call.wait_deadline
                if not call.wait_zero:
                    self._arm_probe_locked(now)
                if now >= call.deadline:
                    self._on_timer_locked(call, now, flush=False)
                return
            del self._owners[answer.id]
            call.answered = True
            _finish(call, ANSWER, answer, now)
        elif op == "X" and answer.code in (1, 2, 6, 7):
            if answer.code == 7:
                self._fail_locked("the server refused the session: it has too many (X 7)", True)
                return
            target = self._take_by_id_locked(answer.id, moved=False)
            if target is not None:
                target.answered = True
                _finish(target, ANSWER, answer, now)
            self._fail_locked(f"the server closed the session after error {answer.code}")
        elif op == "X" or op == "M":
            target = self._take_by_id_locked(answer.id, moved=op == "M")
            if target is not None:
                target.answered = True
                if not target.abandoned:
                    _finish(target, ANSWER, answer, now)

    def _take_by_id_locked(self, ident: int, moved: bool) -> Optional[Call]:
        call = self._owners.get(ident)
        if call is not None:
            if moved and call.state == CANCELLING:
                # The M answers the Cancel (leadership moved): the acquire's own answer is
                # unknown, and it runs out at its transport allowance.
                return None
            del self._owners[ident]
            return call
        call = self._nonces.pop(ident, None)
        if call is not None:
            return call
        queue = self._tokens.get(ident)
        if queue:
            call = queue.popleft()
            if not queue:
                del self._tokens[ident]
            return call
        return None


class _ConnectError(Exception):
    """The session could not be established: its calls were not sent."""


class _Refused(_ConnectError):
    """``X`` 7 before the handshake pong."""


class _Unreachable(_ConnectError):
    """Not a latchkey server, or TLS refused: retrying would meet the same."""


class _ConnectRefused(_ConnectError):
    """The TCP connection was refused: nothing listens at the address."""


def _describe(error: BaseException) -> str:
    if isinstance(error, _ConnectError):
        return str(error)
    return f"{type(error).__name__}: {error}"
