"""The server's card: what ``GET /cluster`` on the lock port answers (docs/protocol.md §5, the
HTTP admin requests), so that a client given several addresses can tell whether they are
members of one cluster before it sends a lock request to any of them. The Rust client's
``crates/latchkey-client/src/card.rs``, read the same way.

The card is a few lines of text, one ``name value`` field per line::

    latchkey-card 1
    cluster 5f1c0e2a9d3b7c41
    member 2
    shards 64
    client 1 127.0.0.1:7420
    client 2 127.0.0.1:7421
    client 3 127.0.0.1:7422

or, for a server without ``[cluster]``, ``latchkey-card 1`` then ``standalone 9a0e…`` (a number
drawn when the server started: two addresses answering the same one reach the same server).
A reader ignores lines it does not know (later builds may add some), and refuses a card without
its first line, with a field twice or malformed, or longer than ``CARD_BYTES_MAX``.

Deliberately not here: which addresses a client accepts (see ``_check``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import ssl
import time
from typing import List, NamedTuple, Optional, Tuple, Union

Address = Tuple[str, int]

# The first line of every card, with its format version.
CARD_FIRST_LINE = "latchkey-card 1"
# The longest answer (head and card) a reader takes.
CARD_BYTES_MAX = 16 * 1024
# The most ``client`` lines a card may carry.
CARD_MEMBERS_MAX = 64

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1

# How a failed connect is said, as a session says it (``_session.Session._connect``).
CANNOT_CONNECT = "cannot connect:"

# What Rust's ``str::trim_end`` trims: the Unicode White_Space characters (``str.rstrip()``
# would also take U+001C..U+001F).
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_DECIMAL = re.compile(r"\+?[0-9]+")
_HEX = re.compile(r"\+?[0-9a-fA-F]+")
_PORT = re.compile(r"[0-9]{1,5}")


def addr_text(addr: Address) -> str:
    """``host:port``, an IPv6 host in brackets (as the Rust client writes a socket address)."""
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Owner(NamedTuple):
    """Whom a card speaks for: two addresses with equal owners reach one server, or one
    cluster. ``standalone``: one standalone server (``number`` is its instance number), else
    one cluster (its identity)."""

    standalone: bool
    number: int

    def __str__(self) -> str:
        if self.standalone:
            return f"a standalone server (run {self.number:016x})"
        return f"cluster {self.number:016x}"


class Standalone(NamedTuple):
    """A server without ``[cluster]``, and the number it drew when it started (random per
    server run: the same on every address of one server)."""

    instance: int

    def owner(self) -> Owner:
        return Owner(True, self.instance)

    def lists(self, addr: Address) -> bool:
        return False

    def render(self) -> str:
        return f"{CARD_FIRST_LINE}\nstandalone {self.instance:016x}\n"


class Member(NamedTuple):
    """A member of a cluster: the cluster's identity (the same on every member), this
    member's id, the shard count, and every member's id and client address as this member's
    configuration lists them (hosts as IP addresses in their usual text)."""

    cluster: int
    member: int
    shards: int
    clients: Tuple[Tuple[int, Address], ...]

    def owner(self) -> Owner:
        return Owner(False, self.cluster)

    def lists(self, addr: Address) -> bool:
        """Whether the card lists ``addr`` as a member's client address (an IP address,
        compared as an address: ``::1`` is ``0:0::1``; a name is never listed)."""
        canonical = _canonical(addr)
        return canonical is not None and any(client == canonical for _, client in self.clients)

    def render(self) -> str:
        lines = [
            CARD_FIRST_LINE,
            f"cluster {self.cluster:016x}",
            f"member {self.member}",
            f"shards {self.shards}",
        ]
        lines += [f"client {ident} {addr_text(client)}" for ident, client in self.clients]
        return "\n".join(lines) + "\n"


Card = Union[Standalone, Member]


class CardError(Exception):
    """A card's text is not valid: the message says what is wrong with it."""


def _canonical(addr: Address) -> Optional[Address]:
    """``addr`` with its host as an IP address's usual text; ``None`` for a name."""
    host, port = addr
    try:
        return (str(ipaddress.ip_address(host)), port)
    except ValueError:
        return None


def _socket_addr(text: str) -> Optional[Address]:
    """A socket address as Rust's ``SocketAddr::from_str`` reads one (``IPv4:PORT`` or
    ``[IPv6]:PORT``, an IPv6 scope only as a number), else ``None``."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            return None
        ip, percent, scope = host.partition("%")
        if percent and not scope.isdigit():
            return None
        try:
            parsed: Union[ipaddress.IPv4Address, ipaddress.IPv6Address] = ipaddress.IPv6Address(ip)
        except ValueError:
            return None
    else:
        host, sep, port = text.partition(":")
        if not sep:
            return None
        try:
            parsed = ipaddress.IPv4Address(host)
        except ValueError:
            return None
    if not _PORT.fullmatch(port) or int(port) > 65535:
        return None
    return (str(parsed), int(port))


def _quoted(value: str) -> str:
    """``value`` quoted as Rust's ``{:?}`` quotes a string (near enough: for messages)."""
    return json.dumps(value, ensure_ascii=False)


class _Fields:
    """The fields of a card as they are read."""

    def __init__(self) -> None:
        self.standalone: Optional[int] = None
        self.cluster: Optional[int] = None
        self.member: Optional[int] = None
        self.shards: Optional[int] = None
        self.clients: List[Tuple[int, Address]] = []

    def take(self, name: str, value: str) -> None:
        def bad(what: str) -> CardError:
            return CardError(f"its `{name}` line is not {what}: {_quoted(value)}")

        def number(pattern: "re.Pattern[str]", base: int, most: int, what: str) -> int:
            if not pattern.fullmatch(value):
                raise bad(what)
            parsed = int(value, base)
            if parsed > most:
                raise bad(what)
            return parsed

        if name == "standalone":
            self.standalone = _set(self.standalone, number(_HEX, 16, U64_MAX, "a hex number"), name)
        elif name == "cluster":
            self.cluster = _set(self.cluster, number(_HEX, 16, U64_MAX, "a hex number"), name)
        elif name == "member":
            self.member = _set(self.member, number(_DECIMAL, 10, U64_MAX, "a number"), name)
        elif name == "shards":
            self.shards = _set(self.shards, number(_DECIMAL, 10, U32_MAX, "a number"), name)
        elif name == "client":
            ident_text, sep, addr_part = value.partition(" ")
            if not sep:
                raise bad("`ID ADDRESS`")
            if not _DECIMAL.fullmatch(ident_text) or int(ident_text) > U64_MAX:
                raise bad("`ID ADDRESS`")
            addr = _socket_addr(addr_part)
            if addr is None:
                raise bad("`ID ADDRESS`")
            if len(self.clients) >= CARD_MEMBERS_MAX:
                raise CardError(f"it lists more than {CARD_MEMBERS_MAX} members")
            self.clients.append((int(ident_text), addr))

    def card(self) -> Card:
        standalone, cluster, member, shards = self.standalone, self.cluster, self.member, self.shards
        if standalone is not None and cluster is None and member is None and shards is None:
            if not self.clients:
                return Standalone(standalone)
        if standalone is None and cluster is not None and member is not None and shards is not None:
            if self.clients:
                return Member(cluster, member, shards, tuple(self.clients))
        raise CardError("it is neither a standalone server's nor a member's")


def _set(slot: Optional[int], value: int, name: str) -> int:
    if slot is not None:
        raise CardError(f"it has two `{name}` lines")
    return value


def _lines(text: str) -> List[str]:
    """``text``'s lines as Rust's ``str::lines`` cuts them (at ``\\n``, a ``\\r`` before it
    dropped, no empty last line after a final newline)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def parse(text: str) -> Card:
    """Reads a card's text; raises :class:`CardError` saying what is wrong with it."""
    lines = _lines(text)
    if not lines or lines[0].rstrip(_WHITE_SPACE) != CARD_FIRST_LINE:
        raise CardError(f"its first line is not `{CARD_FIRST_LINE}`")
    fields = _Fields()
    for line in lines[1:]:
        line = line.rstrip(_WHITE_SPACE)
        name, sep, value = line.partition(" ")
        fields.take(name, value)
    return fields.card()


class FetchError(NamedTuple):
    """Why :func:`fetch` has no card. ``unreachable``: the server could not be reached, or did
    not answer before the deadline (try later); else it answered, but not with a card (not
    latchkey, or a build before cards)."""

    unreachable: bool
    cause: str
    # Unreachable because the connection was refused: nothing listens there.
    refused: bool = False

    def __str__(self) -> str:
        if self.unreachable:
            return f"could not be asked: {self.cause}"
        return (
            f"answered GET /cluster without a card ({self.cause}): not a latchkey server, or "
            "one older than this client"
        )


class TryLater(CardError):
    """No card in this answer, but ask again later: no answer at all, one cut short, or a
    ``5xx`` (a server at its limits or shutting down); as ``card.rs`` answers
    ``FetchError::Unreachable``."""


def card_of_answer(answer: bytes) -> Card:
    """The card in an HTTP answer; raises :class:`TryLater` (ask again) or :class:`CardError`
    (not a card) saying why there is none."""
    if not answer:
        raise TryLater("it closed the connection without answering GET /cluster")
    end = answer.find(b"\r\n\r\n")
    if end < 0:
        if answer.startswith(b"HTTP/1."):
            raise TryLater("its answer to GET /cluster ended early")
        raise CardError("no HTTP answer")
    head = answer[:end].decode("utf-8", "replace")
    status = _lines(head)[0] if head else ""
    if not status.startswith("HTTP/1."):
        raise CardError("no HTTP answer")
    words = status.split(" ")
    code = words[1] if len(words) > 1 else ""
    if code.startswith("5"):
        raise TryLater(f"GET /cluster: HTTP {code}")
    if code != "200":
        raise CardError(f"HTTP {code}")
    try:
        body = answer[end + 4 :].decode("utf-8")
    except UnicodeDecodeError:
        raise CardError("not text") from None
    try:
        return parse(body)
    except CardError as error:
        raise CardError(f"a card that is not valid: {error}") from None


class _Late(Exception):
    """The deadline passed (or a socket timeout) before the answer was read."""


class _Failed(Exception):
    """The answer could not be had: the message says why; ``refused``: the connection was
    refused (nothing listens there)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def fetch(
    addr: Address,
    ssl_context: Optional[ssl.SSLContext],
    server_name: Optional[str],
    deadline: float,
) -> Union[Card, FetchError]:
    """Asks the server at ``addr`` for its card (over TLS with ``ssl_context`` when it is set,
    checking ``server_name``, default the address's host, as a session does), all by
    ``deadline`` (a ``time.monotonic()`` value): one ``GET /cluster`` on a new connection,
    read to the server's close."""
    try:
        answer = _get(addr, ssl_context, server_name, deadline)
    except _Late:
        return FetchError(True, "no answer to GET /cluster in time")
    except _Failed as error:
        return FetchError(True, str(error), error.refused)
    try:
        return card_of_answer(answer)
    except TryLater as error:
        return FetchError(True, str(error))
    except CardError as error:
        return FetchError(False, str(error))


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Late()
    return left


def _get(
    addr: Address, ssl_context: Optional[ssl.SSLContext], server_name: Optional[str], deadline: float
) -> bytes:
    """One ``GET /cluster``, read to the server's close (at most ``CARD_BYTES_MAX`` bytes)."""
    left = _left(deadline)
    # Worded as a session words a failed connect (``Session._connect``).
    try:
        sock = socket.create_connection(addr, timeout=left)
    except socket.timeout:
        raise _Failed(f"{CANNOT_CONNECT} timed out") from None
    except ConnectionRefusedError as error:
        raise _Failed(f"{CANNOT_CONNECT} {error.strerror or error}", refused=True) from None
    except OSError as error:
        raise _Failed(f"{CANNOT_CONNECT} {error.strerror or error}") from None
    stream: socket.socket = sock
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            stream = ssl_context.wrap_socket(
                sock, server_hostname=server_name or addr[0], do_handshake_on_connect=False
            )
            stream.settimeout(_left(deadline))
            try:
                stream.do_handshake()
            except socket.timeout:
                raise _Late() from None
            except ssl.SSLError as error:
                raise _Failed(f"TLS handshake failed: {error.reason or error}") from None
            except OSError as error:
                raise _Failed(f"TLS handshake failed: {error.strerror or error}") from None
        return _exchange(stream, deadline)
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _exchange(stream: socket.socket, deadline: float) -> bytes:
    """Writes the request and reads the answer to its end, each step by ``deadline``."""
    request = b"GET /cluster HTTP/1.1\r\nHost: latchkey\r\nConnection: close\r\n\r\n"
    answer = bytearray()
    try:
        stream.settimeout(_left(deadline))
        stream.sendall(request)
        while True:
            stream.settimeout(_left(deadline))
            try:
                data = stream.recv(4096)
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                # A TLS server may close without close_notify: the answer is what came.
                data = b""
            if not data:
                return bytes(answer)
            if len(answer) + len(data) > CARD_BYTES_MAX:
                raise _Failed(f"the answer is longer than {CARD_BYTES_MAX} bytes")
            answer += data
    except socket.timeout:
        raise _Late() from None
    except ssl.SSLError as error:
        raise _Failed(f"TLS: {error.reason or error}") from None
    except OSError as error:
        raise _Failed(str(error.strerror or error)) from None
