"""The frames of docs/protocol.md §2.4 and §5, byte for byte (pure: no server)."""

from __future__ import annotations

import pytest

from latchkey import _codec


def test_requests_match_the_worked_examples() -> None:
    assert _codec.encode_acquire(b"orders/42", 5, 30, 7).hex(" ") == (
        "41 05 1e 00 00 00 00 00 00 00 07 6f 72 64 65 72 73 2f 34 32 0a"
    )
    token = 0x1986E1AF9E58B802
    assert _codec.encode_extend(b"orders/42", 60, token).hex() == "453c1986e1af9e58b8026f72646572732f34320a"
    assert _codec.encode_release(b"orders/42", token).hex() == "521986e1af9e58b8026f72646572732f34320a"
    assert _codec.encode_query(b"orders/42", 8).hex() == "5100000000000000086f72646572732f34320a"
    assert _codec.encode_ping(9).hex() == "5000000000000000090a"
    assert _codec.encode_cancel(b"k", 1).hex() == "4300000000000000016b0a"


def test_responses_split_at_every_byte_decode_the_same() -> None:
    stream = bytes.fromhex(
        "41 0000000000000007 1986e1af9e58b802 0a"
        "51 0000000000000008 01 0000e9fb 00000000 0a"
        "58 05 000000000000000a 0a"
        "4d 0000000000000003 00000000000000000000ffff7f000001 1ca4 0a"
        "4d 0000000000000004 00000000000000000000000000000000 0000 0a"
        "50 0000000000000009 0a"
    )
    expected = [
        _codec.Response("A", 7, token=0x1986E1AF9E58B802),
        _codec.Response("Q", 8, held=True, lease_ms=59899, waiters=0),
        _codec.Response("X", 10, code=5),
        _codec.Response("M", 3, leader=("127.0.0.1", 7332)),
        _codec.Response("M", 4, leader=None),
        _codec.Response("P", 9),
    ]
    assert _codec.Decoder().feed(stream) == expected
    decoder = _codec.Decoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == expected and decoder.pending() == 0


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(_codec.ProtocolError):
        _codec.Decoder().feed(b"HTTP/1.1 400")
    with pytest.raises(_codec.ProtocolError):
        _codec.Decoder().feed(bytes.fromhex("50 0000000000000009 21"))


def test_bad_arguments_raise_value_error_before_anything_is_sent() -> None:
    import latchkey

    client = latchkey.Client("127.0.0.1:1", sessions=1, connect_timeout=0.2)
    for args in [("", 1, 1), ("a\nb", 1, 1), ("x" * 1025, 1, 1), ("k", -1, 1), ("k", 255.001, 1),
                 ("k", 1, 0), ("k", 1, 256), ("k", float("nan"), 1)]:
        with pytest.raises(ValueError):
            client.acquire(*args)  # type: ignore[arg-type]
    # The wrong type is a TypeError, as Python code expects.
    for args in [(b"k", 1, 1), (7, 1, 1), (None, 1, 1), ("k", True, 1), ("k", "1", 1), ("k", 1, "30")]:
        with pytest.raises(TypeError):
            client.acquire(*args)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as raised:
        client.query(b"k")  # type: ignore[arg-type]
    assert "must be a str, not bytes" in str(raised.value), raised.value
    with pytest.raises(ValueError):
        latchkey.Client("no-port")
    with pytest.raises(ValueError):
        latchkey.Client("127.0.0.1:7420", sessions=0)
    client.close()


def test_the_default_server_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import latchkey

    monkeypatch.setenv("LATCHKEY_SERVER", "127.0.0.1:1,127.0.0.1:2")
    client = latchkey.Client(connect_timeout=0.2)
    assert client._members.listed == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    client.close()
    monkeypatch.delenv("LATCHKEY_SERVER")
    client = latchkey.Client(connect_timeout=0.2)
    assert client._members.listed == [("127.0.0.1", 7420)]
    client.close()


def test_the_frames_of_resumable_calls() -> None:
    """docs/protocol.md §5: Identify (27 bytes), Resolve (10 + N); Identified (11), Resolved
    (23). Identified's grace of 10 s is the byte 0x0A before its own newline."""
    client = 0x5EED0000000000000000000000000001
    assert _codec.encode_identify(10, client, 4).hex(" ") == (
        "49 0a 5e ed 00 00 00 00 00 00 00 00 00 00 00 00 00 01 00 00 00 00 00 00 00 04 0a"
    )
    assert len(_codec.encode_identify(60, (1 << 128) - 1, (1 << 64) - 1)) == 27
    assert _codec.encode_resolve(b"orders/42", 3).hex() == "5700000000000000036f72646572732f34320a"
    stream = bytes.fromhex(
        "49 0000000000000004 0a 0a"
        "57 0000000000000003 01 1986e1af9e58b802 00007530 0a"
        "57 0000000000000005 02 0000000000000000 00000000 0a"
        "58 09 0000000000000004 0a"
    )
    expected = [
        _codec.Response("I", 4, grace=10),
        _codec.Response("W", 3, token=0x1986E1AF9E58B802, lease_ms=30000, fate=_codec.FATE_GRANTED),
        _codec.Response("W", 5, fate=_codec.FATE_QUEUED),
        _codec.Response("X", 4, code=9),
    ]
    assert _codec.Decoder().feed(stream) == expected
    decoder = _codec.Decoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == expected and decoder.pending() == 0
