"""Frames of the latchkey protocol (docs/protocol.md §2, §5): pure encode and decode, no I/O.

Every multi-byte integer is big-endian. Requests are encoded into ``bytes``; responses are
decoded from a growing buffer by :class:`Decoder`, which returns whole frames only.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import List, NamedTuple, Optional, Tuple

KEY_BYTES_MAX = 1024
U64_MAX = (1 << 64) - 1
CLIENT_ID_MAX = (1 << 128) - 1
GRACE_S_MAX = 60

_HEAD_A = struct.Struct(">cBBQ")
_HEAD_8 = struct.Struct(">cQ")
_HEAD_E = struct.Struct(">cBQ")
_U64 = struct.Struct(">Q")


def encode_acquire(key: bytes, wait_s: int, lease_s: int, owner: int) -> bytes:
    """``A`` wait:u8 lease:u8 owner:u64 key ``\\n`` (12 + N bytes)."""
    return _HEAD_A.pack(b"A", wait_s, lease_s, owner) + key + b"\n"


def encode_release(key: bytes, token: int) -> bytes:
    """``R`` token:u64 key ``\\n`` (10 + N bytes)."""
    return _HEAD_8.pack(b"R", token) + key + b"\n"


def encode_extend(key: bytes, lease_s: int, token: int) -> bytes:
    """``E`` lease:u8 token:u64 key ``\\n`` (11 + N bytes)."""
    return _HEAD_E.pack(b"E", lease_s, token) + key + b"\n"


def encode_cancel(key: bytes, owner: int) -> bytes:
    """``C`` owner:u64 key ``\\n`` (10 + N bytes)."""
    return _HEAD_8.pack(b"C", owner) + key + b"\n"


def encode_query(key: bytes, nonce: int) -> bytes:
    """``Q`` nonce:u64 key ``\\n`` (10 + N bytes)."""
    return _HEAD_8.pack(b"Q", nonce) + key + b"\n"


def encode_ping(nonce: int) -> bytes:
    """``P`` nonce:u64 ``\\n`` (10 bytes)."""
    return _HEAD_8.pack(b"P", nonce) + b"\n"


def encode_identify(grace_s: int, client: int, nonce: int) -> bytes:
    """``I`` grace:u8 client:16 bytes nonce:u64 ``\\n`` (27 bytes; docs/protocol.md §5). The
    client id is big-endian and never 0; the grace is 1..=60 s."""
    return b"I" + bytes((grace_s,)) + client.to_bytes(16, "big") + _U64.pack(nonce) + b"\n"


def encode_resolve(key: bytes, owner: int) -> bytes:
    """``W`` owner:u64 key ``\\n`` (10 + N bytes; docs/protocol.md §5)."""
    return _HEAD_8.pack(b"W", owner) + key + b"\n"


# The fates a Resolve reports (docs/protocol.md §5).
FATE_NEVER_SEEN = 0
FATE_GRANTED = 1
FATE_QUEUED = 2
FATE_TIMED_OUT = 3
FATE_BUSY = 4


class Response(NamedTuple):
    """One decoded server frame.

    ``op`` is the frame's letter; ``id`` its correlation id (owner, token or nonce; for ``X``
    the request's id, 0 for codes 1 and 7). The other fields are those of the op and 0 where
    the op has none: ``W`` (Resolved) has ``fate``, ``token`` and ``lease_ms``; ``I``
    (Identified) has ``grace`` (seconds).
    """

    op: str
    id: int
    token: int = 0
    held: bool = False
    lease_ms: int = 0
    waiters: int = 0
    code: int = 0
    leader: Optional[Tuple[str, int]] = None
    fate: int = 0
    grace: int = 0


# Total frame length per response op, the `\n` included.
RESPONSE_LEN = {
    "A": 18,
    "T": 10,
    "B": 10,
    "R": 10,
    "E": 10,
    "N": 10,
    "P": 10,
    "Q": 19,
    "X": 11,
    "M": 28,
    "I": 11,
    "W": 23,
}


class ProtocolError(Exception):
    """The peer sent bytes that are not a latchkey response."""


def _leader(ip: bytes, port: int) -> Optional[Tuple[str, int]]:
    if port == 0 and ip == bytes(16):
        return None
    address = ipaddress.IPv6Address(ip)
    mapped = address.ipv4_mapped
    host = str(mapped) if mapped is not None else str(address)
    return (host, port)


def decode_one(frame: bytes) -> Response:
    """Decodes one whole frame (its length already checked against ``RESPONSE_LEN``)."""
    op = chr(frame[0])
    if frame[-1] != 0x0A:
        raise ProtocolError(f"frame {op!r} does not end with a newline")
    if op == "A":
        owner, token = struct.unpack_from(">QQ", frame, 1)
        return Response("A", owner, token=token)
    if op in "TBRENP":
        (ident,) = struct.unpack_from(">Q", frame, 1)
        return Response(op, ident)
    if op == "Q":
        nonce, held, lease_ms, waiters = struct.unpack_from(">QBII", frame, 1)
        return Response("Q", nonce, held=held != 0, lease_ms=lease_ms, waiters=waiters)
    if op == "X":
        code, ident = struct.unpack_from(">BQ", frame, 1)
        return Response("X", ident, code=code)
    if op == "M":
        (ident,) = struct.unpack_from(">Q", frame, 1)
        ip = bytes(frame[9:25])
        (port,) = struct.unpack_from(">H", frame, 25)
        return Response("M", ident, leader=_leader(ip, port))
    if op == "W":
        owner, fate, token, lease_ms = struct.unpack_from(">QBQI", frame, 1)
        return Response("W", owner, token=token, lease_ms=lease_ms, fate=fate)
    if op == "I":
        nonce, grace = struct.unpack_from(">QB", frame, 1)
        return Response("I", nonce, grace=grace)
    raise ProtocolError(f"unknown response op {op!r}")


class Decoder:
    """Splits a byte stream into responses; frames may arrive split at any byte."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> List[Response]:
        """Appends ``data`` and returns every whole response now available, in order.

        Raises :class:`ProtocolError` on an unknown op or a frame not ending in ``\\n``.
        """
        buffer = self._buffer
        buffer += data
        out: List[Response] = []
        start = 0
        end = len(buffer)
        while start < end:
            length = RESPONSE_LEN.get(chr(buffer[start]))
            if length is None:
                raise ProtocolError(f"unknown response op {chr(buffer[start])!r}")
            if end - start < length:
                break
            out.append(decode_one(bytes(buffer[start : start + length])))
            start += length
        if start:
            del buffer[:start]
        return out

    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)
