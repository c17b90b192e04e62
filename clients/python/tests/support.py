"""Test support: the real server, a fault proxy, a scripted fake server and fake cluster members.

Python ports of tests/common/{server.rs, proxy.rs, fake_member.rs} and the FakeServer of
tests/common/mod.rs. Everything listens on 127.0.0.1 ephemeral ports; every blocking read,
accept and wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from latchkey._card import Member, Standalone

REPO = Path(__file__).resolve().parents[3]
PATIENCE = 10.0

# ---------------------------------------------------------------------------------------------
# The binary and the real server


def binary() -> Path:
    """``$LATCHKEY_BIN``, else the newest of target/{debug,release}/latchkey, else ``cargo
    build`` (debug) from the repository root."""
    env = os.environ.get("LATCHKEY_BIN")
    if env:
        return Path(env)
    found = [REPO / "target" / p / "latchkey" for p in ("debug", "release")]
    found = [p for p in found if p.exists()]
    if not found:
        subprocess.run(["cargo", "build", "--bin", "latchkey"], cwd=REPO, check=True)
        found = [REPO / "target" / "debug" / "latchkey"]
    return max(found, key=lambda p: p.stat().st_mtime)


class Server:
    """``latchkey serve --listen 127.0.0.1:0 --cores 1`` (or ``--config FILE``), its address
    read from its first line (``listening on ADDR``)."""

    def __init__(self, config: Optional[str] = None, cores: int = 1, listen: bool = True) -> None:
        args = [str(binary()), "serve"]
        self.dir = tempfile.mkdtemp(prefix="latchkey-py-")
        if config is not None:
            path = os.path.join(self.dir, "config.toml")
            with open(path, "w") as f:
                f.write(config)
            args += ["--config", path]
        if listen:
            args += ["--listen", "127.0.0.1:0", "--cores", str(cores)]
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"unexpected first line {line!r}")
        host, _, port = line.split()[-1].rpartition(":")
        self.addr = (host, int(port))
        self.text = f"{host}:{port}"

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def dead_addr() -> str:
    """An address on which nothing listens (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def free_ports(count: int) -> List[int]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def assert_between(elapsed: float, at_least: float, at_most: float) -> None:
    """Never early (strict), not absurdly late (generous)."""
    assert elapsed >= at_least, f"early: {elapsed:.3f} s < {at_least:.3f} s"
    assert elapsed <= at_most, f"late: {elapsed:.3f} s > {at_most:.3f} s"


# ---------------------------------------------------------------------------------------------
# Frames the client sends

Frame = Tuple  # ("A", owner, wait_s, lease_s, key) | ("R", token, key) | ("E", lease_s, token, key)
# | ("C", owner, key) | ("Q", nonce, key) | ("P", nonce) | ("W", owner, key)
# | ("I", nonce, grace_s, client)

# Bytes of a resuming client's handshake: an Identify (27), then the ping (10).
HELLO = 27 + 10


def parse_requests(buffer: bytearray) -> List[Frame]:
    """Whole request frames at the start of ``buffer`` (consumed); raises on garbage."""
    out: List[Frame] = []
    while buffer:
        op = chr(buffer[0])
        head = {"A": 11, "R": 9, "E": 10, "C": 9, "Q": 9, "P": 9, "W": 9, "I": 26}.get(op)
        if head is None:
            raise ValueError(f"unknown op {op!r}")
        if len(buffer) < head + 1:
            break
        if op == "P":
            if buffer[9] != 0x0A:
                raise ValueError("bad ping")
            out.append(("P", struct.unpack_from(">Q", buffer, 1)[0]))
            del buffer[:10]
            continue
        if op == "I":
            if buffer[26] != 0x0A:
                raise ValueError("bad identify")
            grace_s = buffer[1]
            client = int.from_bytes(bytes(buffer[2:18]), "big")
            (nonce,) = struct.unpack_from(">Q", buffer, 18)
            out.append(("I", nonce, grace_s, client))
            del buffer[:27]
            continue
        end = buffer.find(b"\n", head)
        if end < 0:
            break
        key = bytes(buffer[head:end]).decode()
        if op == "A":
            wait_s, lease_s, owner = struct.unpack_from(">BBQ", buffer, 1)
            out.append(("A", owner, wait_s, lease_s, key))
        elif op == "E":
            lease_s, token = struct.unpack_from(">BQ", buffer, 1)
            out.append(("E", lease_s, token, key))
        else:
            (ident,) = struct.unpack_from(">Q", buffer, 1)
            out.append((op, ident, key))
        del buffer[: end + 1]
    return out


def resp(op: str, ident: int, *rest: int) -> bytes:
    """A response frame: ``resp("A", owner, token)``, ``resp("T", owner)``, ``resp("X", code,
    id)``, ``resp("Q", nonce, held, lease_ms, waiters)``, ``resp("W", owner, fate, token,
    lease_ms)``, ``resp("I", nonce, grace_s)``."""
    if op == "W":
        return struct.pack(">cQBQI", b"W", ident, *rest) + b"\n"
    if op == "I":
        return struct.pack(">cQB", b"I", ident, rest[0]) + b"\n"
    if op == "A":
        return struct.pack(">cQQ", b"A", ident, rest[0]) + b"\n"
    if op == "X":
        return struct.pack(">cBQ", b"X", ident, rest[0]) + b"\n"
    if op == "Q":
        return struct.pack(">cQBII", b"Q", ident, *rest) + b"\n"
    return struct.pack(">cQ", op.encode(), ident) + b"\n"


def moved(ident: int, leader: Optional[str]) -> bytes:
    if leader is None:
        ip, port = bytes(16), 0
    else:
        host, _, p = leader.rpartition(":")
        ip = bytes(10) + b"\xff\xff" + socket.inet_aton(host)
        port = int(p)
    return b"M" + struct.pack(">Q", ident) + ip + struct.pack(">H", port) + b"\n"


# ---------------------------------------------------------------------------------------------
# The fault proxy


class Proxy:
    """A TCP fault proxy (tests/common/proxy.rs): delays, holding the server's bytes, cutting
    a connection (every one, or the next only) after N client bytes, refusing connections with
    ``X`` 7; counts the Acquire, Cancel, Resolve, Identify and Ping frames the client sent.

    Byte counts include the session's handshake: an Identify (27 bytes) when the client
    resumes calls, then the ping (10): ``HELLO``. A refused session that answers its handshake
    answers an Identify ``X`` 9 (it identifies nobody)."""

    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.settimeout(0.1)
        self.addr = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.cond = threading.Condition()
        self.hold_down = False
        self.delay_up_s = 0.0
        self.delay_down_s = 0.0
        self.cut: Optional[int] = None
        self.cut_next_count: Optional[int] = None
        self.refuse_count = 0
        self.refuse_after = 0.0
        self.refuse_pong = False
        self.pings = 0
        self.connections = 0
        self.acquire_frames: List[Tuple[int, int]] = []
        self.cancels: Dict[int, int] = {}
        self.resolves: Dict[int, int] = {}
        self.identifies = 0
        self.releases: Dict[int, int] = {}
        self.extends: Dict[int, int] = {}
        self.stopped = False
        self._sockets: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        with self.cond:
            self.hold_down = True

    def release(self) -> None:
        with self.cond:
            self.hold_down = False
            self.cond.notify_all()

    def delay_up(self, seconds: float) -> None:
        self.delay_up_s = seconds

    def delay_down(self, seconds: float) -> None:
        self.delay_down_s = seconds

    def cut_after(self, count: int) -> None:
        self.cut = count

    def cut_next(self, count: int) -> None:
        """Cuts the next connection accepted (both sides) once ``count`` client bytes were
        forwarded on it; later ones are left alone."""
        with self.cond:
            self.cut_next_count = count

    def refuse_next(self, count: int, after: float, pong: bool = False) -> None:
        with self.cond:
            self.refuse_count = count
            self.refuse_after = after
            self.refuse_pong = pong

    def acquires(self) -> Dict[int, int]:
        with self.cond:
            counts: Dict[int, int] = {}
            for owner, _ in self.acquire_frames:
                counts[owner] = counts.get(owner, 0) + 1
            return counts

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.hold_down = False
            self.cond.notify_all()
        self.listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            self._sockets.append(client)
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _count(self, buffer: bytearray, data: bytes) -> List[bytes]:
        """Counts the frames ``data`` completes; returns what a refusing server that answers
        the handshake would answer: a pong to each ping, ``X`` 9 to each Identify."""
        buffer += data
        replies: List[bytes] = []
        try:
            frames = parse_requests(buffer)
        except ValueError:
            buffer.clear()
            return replies
        with self.cond:
            for frame in frames:
                if frame[0] == "A":
                    self.acquire_frames.append((frame[1], frame[2]))
                elif frame[0] == "C":
                    self.cancels[frame[1]] = self.cancels.get(frame[1], 0) + 1
                elif frame[0] == "W":
                    self.resolves[frame[1]] = self.resolves.get(frame[1], 0) + 1
                elif frame[0] == "R":
                    self.releases[frame[1]] = self.releases.get(frame[1], 0) + 1
                elif frame[0] == "E":
                    self.extends[frame[2]] = self.extends.get(frame[2], 0) + 1
                elif frame[0] == "I":
                    self.identifies += 1
                    replies.append(resp("X", 9, frame[1]))
                elif frame[0] == "P":
                    self.pings += 1
                    replies.append(resp("P", frame[1]))
        return replies

    def _connection(self, client: socket.socket) -> None:
        with self.cond:
            self.connections += 1
            refuse = self.refuse_count > 0
            if refuse:
                self.refuse_count -= 1
            after, pong = self.refuse_after, self.refuse_pong
            cut = self.cut_next_count
            self.cut_next_count = None
        if refuse:
            self._refuse(client, after, pong)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sockets.append(server)
        threading.Thread(target=self._down, args=(server, client), daemon=True).start()
        self._up(client, server, cut)

    def _refuse(self, client: socket.socket, after: float, pong: bool) -> None:
        buffer = bytearray()
        until = time.monotonic() + after
        while True:
            left = until - time.monotonic()
            if left <= 0:
                break
            client.settimeout(left)
            try:
                data = client.recv(4096)
            except socket.timeout:
                break
            except OSError:
                return
            if not data:
                return
            for reply in self._count(buffer, data):
                if pong:
                    client.sendall(reply)
        try:
            client.sendall(resp("X", 7, 0))
            client.shutdown(socket.SHUT_WR)
            client.settimeout(PATIENCE)
            while True:
                data = client.recv(4096)
                if not data:
                    break
                self._count(buffer, data)
        except OSError:
            pass
        client.close()

    def _up(self, client: socket.socket, server: socket.socket, cut_next: Optional[int]) -> None:
        buffer = bytearray()
        forwarded = 0
        while True:
            data = _read(client, server)
            if not data:
                return
            self._count(buffer, data)
            if self.delay_up_s:
                time.sleep(self.delay_up_s)
            cut = self.cut if self.cut is not None else cut_next
            allowed = len(data) if cut is None else max(0, min(len(data), cut - forwarded))
            cut_now = allowed < len(data) or (cut is not None and cut == forwarded + allowed)
            if cut_now:
                _shut(client)
            try:
                server.sendall(data[:allowed])
            except OSError:
                _shut(client)
                return
            forwarded += allowed
            if cut_now:
                _shut(server)
                return

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        while True:
            data = _read(server, client)
            if not data:
                return
            with self.cond:
                while self.hold_down and not self.stopped:
                    self.cond.wait()
            if self.delay_down_s:
                time.sleep(self.delay_down_s)
            try:
                client.sendall(data)
            except OSError:
                _shut(server)
                return


def _read(source: socket.socket, sink: socket.socket) -> bytes:
    """The next bytes from ``source``; at its end (or on an error) shuts ``sink``'s sending
    side, as the end goes on through the proxy, and returns ``b""``."""
    try:
        data = source.recv(16384)
    except OSError:
        data = b""
    if not data:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    return data


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# A scripted fake server


class FakeConn:
    """One accepted connection of a :class:`FakeServer`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.frames: List[Frame] = []
        self.identify: Optional[Frame] = None  # the Identify of its handshake, if any

    def read_frame(self, within: float) -> Union[Frame, str]:
        """The next frame, ``"quiet"`` after ``within`` s, or ``"eof"``."""
        until = time.monotonic() + within
        while not self.frames:
            left = until - time.monotonic()
            if left <= 0:
                return "quiet"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return "quiet"
            except OSError:
                return "eof"
            if not data:
                return "eof"
            self.buffer += data
            self.frames += parse_requests(self.buffer)
        return self.frames.pop(0)

    def frame(self) -> Frame:
        got = self.read_frame(PATIENCE)
        assert isinstance(got, tuple), f"expected a frame, got {got}"
        return got

    def handshake(self, identify: bool = False) -> int:
        """Answers the session's handshake; returns the ping's nonce. A fake server does not
        resume calls unless ``identify``: the client's Identify is refused ``X`` 9 (as by a
        cluster member of this version), and its handshake ping follows."""
        frame = self.frame()
        self.identify = None
        if frame[0] == "I":
            self.identify = frame
            self.send(resp("I", frame[1], frame[2]) if identify else resp("X", 9, frame[1]))
            frame = self.frame()
        assert frame[0] == "P", f"a session starts with its handshake ping, not {frame}"
        self.send(resp("P", frame[1]))
        return int(frame[1])

    def acquire(self) -> Tuple[int, int, int, str]:
        frame = self.frame()
        assert frame[0] == "A", f"expected an acquire, got {frame}"
        return frame[1], frame[2], frame[3], frame[4]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def expect_eof(self, within: float) -> List[Frame]:
        """Frames read until the client closes (asserting it does within ``within``)."""
        until = time.monotonic() + within
        got: List[Frame] = []
        while True:
            frame = self.read_frame(max(0.0, until - time.monotonic()))
            if frame == "eof":
                return got
            assert frame != "quiet", f"not closed within {within} s; got {got}"
            assert isinstance(frame, tuple)
            got.append(frame)

    def refuse(self) -> None:
        """``X`` 7 and close, as a full server."""
        try:
            self.send(resp("X", 7, 0))
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        _shut(self.sock)
        self.sock.close()


class FakeServer:
    """A listener whose connections a test drives by hand (tests/common/mod.rs FakeServer)."""

    def __init__(self, addr: Optional[str] = None, small_buffer: bool = False) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if small_buffer:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if addr is None:
            self.listener.bind(("127.0.0.1", 0))
        else:
            host, _, port = addr.rpartition(":")
            self.listener.bind((host, int(port)))
        self.listener.listen(64)
        self.addr = "127.0.0.1:%d" % self.listener.getsockname()[1]
        # What ``GET /cluster`` answers (a client given several addresses asks each): a member
        # of FAKE_CLUSTER by default; ``None``: 404.
        self.card: Optional[str] = member_card(self.addr)
        self.cards_asked = 0

    def accept_raw(self, within: float = PATIENCE) -> Optional[FakeConn]:
        """The next connection within ``within`` that is not an admin request (``GET``: those
        are answered, on a thread of their own, as they come)."""
        until = time.monotonic() + within
        while True:
            self.listener.settimeout(max(0.001, until - time.monotonic()))
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                return None
            if not _is_admin(sock, until):
                return FakeConn(sock)
            self.cards_asked += 1
            threading.Thread(target=_answer_admin, args=(sock, lambda: self.card), daemon=True).start()

    def accept(self, identify: bool = False) -> FakeConn:
        conn = self.accept_raw()
        assert conn is not None, "no connection"
        conn.handshake(identify)
        return conn

    def try_accept(self, within: float) -> Optional[FakeConn]:
        conn = self.accept_raw(within)
        if conn is not None:
            conn.handshake()
        return conn

    def close(self) -> None:
        self.listener.close()


# ---------------------------------------------------------------------------------------------
# Cards (GET /cluster on the lock port: crates/latchkey-client/src/card.rs)

# The cluster fake members say they belong to unless told otherwise (as fake_member.rs).
FAKE_CLUSTER = 0xFA4EC1057E200001


def _host_port(addr: str) -> Tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return (host.strip("[]"), int(port))


def member_card(addr: str, cluster: int = FAKE_CLUSTER, clients: Optional[List[str]] = None) -> str:
    """The card of a member of ``cluster`` at ``addr`` whose configuration lists ``clients``
    (default: only ``addr``)."""
    listed = clients if clients is not None else [addr]
    port = _host_port(addr)[1]
    return Member(cluster, port, 1, tuple((i + 1, _host_port(a)) for i, a in enumerate(listed))).render()


def one_cluster(members: "Sequence[Union[FakeMember, FakeServer]]") -> None:
    """Makes ``members`` one cluster's as their cards say: each card lists every one of them (so
    a member whose card is never answered, a paused one, is vouched for by the others'), as
    fake_member.rs ``one_cluster``. (A ``FakeServer`` answers its card only while a test accepts
    its connections: one card answered then vouches for the others.)"""
    addrs = [member.addr for member in members]
    for member in members:
        member.card = member_card(member.addr, clients=addrs)


def standalone_card(instance: int) -> str:
    return Standalone(instance).render()


def _is_admin(sock: socket.socket, until: float) -> bool:
    """Whether the connection opens with ``GET `` (peeked: nothing is consumed)."""
    while True:
        sock.settimeout(max(0.001, until - time.monotonic()))
        try:
            head = sock.recv(4, socket.MSG_PEEK)
        except (socket.timeout, OSError):
            return False
        if len(head) >= 4 or not head or not b"GET ".startswith(head):
            return head.startswith(b"GET ")
        time.sleep(0.001)


def _answer_admin(sock: socket.socket, card: Callable[[], Optional[str]], head: bytes = b"") -> None:
    """Reads an admin request's head, answers ``GET /cluster`` with the card (``None``: 404;
    any other page: 404), then closes."""
    buffer = bytearray(head)
    try:
        sock.settimeout(PATIENCE)
        while b"\r\n\r\n" not in buffer:
            data = sock.recv(4096)
            if not data:
                return
            buffer += data
        text = card() if buffer.startswith(b"GET /cluster ") else None
        if text is None:
            answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        else:
            body = text.encode()
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        sock.sendall(answer)
        _shut(sock)
    except OSError:
        pass
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------
# Fake cluster members

Reply = Union[bytes, str, None]  # bytes to write, "close", or None (silent)
Script = Callable[[Frame], Reply]


def id_of(frame: Frame) -> int:
    if frame[0] == "E":
        return int(frame[2])
    return int(frame[1])


def leader_reply(frame: Frame, token: int) -> Reply:
    op = frame[0]
    if op == "A":
        return resp("A", frame[1], token)
    if op == "R":
        return resp("R", frame[1])
    if op == "E":
        return resp("E", frame[2])
    if op == "Q":
        return resp("Q", frame[1], 0, 0, 0)
    if op == "P":
        return resp("P", frame[1])
    return resp("T", frame[1])


def leading(token: int) -> Script:
    return lambda frame: leader_reply(frame, token)


def redirect_to(leader: Optional[str]) -> Script:
    return lambda frame: moved(id_of(frame), leader)


class FakeMember:
    """A fake cluster member (tests/common/fake_member.rs): answers each request with its
    script; the handshake ping is answered (or ignored while paused) and counted apart."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.addr = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self._received: List[Frame] = []
        self.handshakes = 0
        self.paused = False
        # Answer a session's Identify (docs/protocol.md §5) instead of refusing it with X 9.
        self.identifies = False
        # What ``GET /cluster`` answers (unless paused: then nothing); ``None``: 404.
        self.card: Optional[str] = member_card(self.addr)
        self.cards_asked = 0
        # How long a card's answer is held back (seconds).
        self.card_delay = 0.0
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def received(self) -> List[Frame]:
        with self.lock:
            return list(self._received)

    def set_script(self, script: Script) -> None:
        with self.lock:
            self.script = script

    def stop(self) -> None:
        self.stopped = True
        self.listener.close()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        buffer = bytearray()
        greeted = False
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                buffer += data
                if not greeted and b"GET ".startswith(bytes(buffer[:4])):
                    if len(buffer) < 4:
                        continue
                    # An admin request (a client asking for the card): answered, then closed.
                    with self.lock:
                        self.cards_asked += 1
                        paused = self.paused
                    while paused and not self.stopped:
                        time.sleep(0.02)
                    if paused:
                        return
                    time.sleep(self.card_delay)
                    _answer_admin(sock, lambda: self.card, bytes(buffer))
                    return
                for frame in parse_requests(buffer):
                    if not greeted and frame[0] == "I":
                        if self.identifies:
                            sock.sendall(resp("I", frame[1], frame[2]))
                        else:
                            # By default, a member that does not resume calls (§5).
                            sock.sendall(resp("X", 9, frame[1]))
                        continue
                    if not greeted and frame[0] == "P":
                        greeted = True
                        with self.lock:
                            self.handshakes += 1
                            paused = self.paused
                        if not paused:
                            sock.sendall(resp("P", frame[1]))
                        continue
                    with self.lock:
                        self._received.append(frame)
                        script = self.script
                    reply = script(frame)
                    if reply == "close":
                        _shut(sock)
                        return
                    if isinstance(reply, bytes):
                        sock.sendall(reply)
        except OSError:
            return
        finally:
            sock.close()
