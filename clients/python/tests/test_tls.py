"""TLS and client certificates, made in the test with the ``openssl`` command line (the
recipe of the main README's Security section), and a key outside the identity's prefixes:
``Rejected`` with code 8. Rust counterparts: tests/tls.rs and tests/auth.rs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Dict, Iterator

import pytest

import latchkey
from support import Server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _run(*args: str, cwd: str) -> None:
    subprocess.run(args, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _sign(directory: str, name: str, subject: str, extensions: str) -> None:
    _run("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory)
    with open(os.path.join(directory, f"{name}.ext"), "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n" + extensions + "\n")
    _run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory)


@pytest.fixture(scope="module")
def pki() -> Iterator[Dict[str, str]]:
    directory = tempfile.mkdtemp(prefix="latchkey-py-pki-")
    _run("openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=latchkey test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         cwd=directory)
    _sign(directory, "server", "/CN=latchkey", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    _sign(directory, "billing", "/CN=billing", "extendedKeyUsage=clientAuth")
    _sign(directory, "ops", "/CN=ops", "extendedKeyUsage=clientAuth")
    yield {name: os.path.join(directory, name) for name in ["ca", "server", "billing", "ops"]}
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_server(pki: Dict[str, str]) -> Iterator[Server]:
    config = (
        f'[tls]\ncert_file = "{pki["server"]}.crt"\nkey_file = "{pki["server"]}.key"\n'
        f'client_ca_file = "{pki["ca"]}.crt"\n'
        '[[auth.rule]]\nidentity = "billing"\nprefixes = ["billing/", "shared/"]\n'
        '[[auth.rule]]\nidentity = "ops"\nprefixes = [""]\n'
    )
    server = Server(config=config)
    yield server
    server.stop()


def tls_client(pki: Dict[str, str], server: Server, who: str, **kw: object) -> latchkey.Client:
    tls = latchkey.TLS(ca=pki["ca"] + ".crt", cert=pki[who] + ".crt", key=pki[who] + ".key", **kw)  # type: ignore[arg-type]
    return latchkey.Client(server.text, sessions=2, connect_timeout=2.0, transport_timeout=2.0, tls=tls)


def test_tls_with_a_client_certificate_serves_every_call(pki: Dict[str, str], tls_server: Server) -> None:
    client = tls_client(pki, tls_server, "billing")
    assert client.ping() < 2.0
    ticket = client.acquire("billing/nightly", wait=1.0, lease=10.0)
    state = client.query("billing/nightly")
    assert state.held and 0 < state.lease_ms <= 10_000 and state.waiters == 0
    assert ticket.extend(20.0) is True
    with pytest.raises(latchkey.Timeout):
        client.acquire("billing/nightly", wait=0.3, lease=10.0)
    assert ticket.release() is True
    with client.lock("shared/x", wait=1.0, lease=5.0) as held:
        assert held.is_valid()
    client.close()


def test_a_forbidden_key_is_rejected_with_code_8_and_the_session_goes_on(pki: Dict[str, str], tls_server: Server) -> None:
    client = tls_client(pki, tls_server, "billing")
    for call in (
        lambda: client.acquire("ops/deploy", wait=0, lease=5.0),
        lambda: client.acquire("ops/deploy", wait=1.0, lease=5.0),
        lambda: client.query("ops/deploy"),
    ):
        with pytest.raises(latchkey.Rejected) as raised:
            call()
        assert raised.value.code == 8
        said = str(raised.value)
        assert said.startswith("ops/deploy: the key is forbidden for this identity (X 8)"), said
    # A ticket of another identity's key, extended or released by billing: refused too.
    ops = tls_client(pki, tls_server, "ops")
    ticket = ops.acquire("ops/deploy", wait=1.0, lease=10.0)
    forged = latchkey.Ticket(client, "ops/deploy", b"ops/deploy", ticket.token, 10, 0.0)
    for call in (lambda: forged.extend(5.0), lambda: forged.release()):
        with pytest.raises(latchkey.Rejected) as raised:
            call()
        assert raised.value.code == 8
    assert ops.query("ops/deploy").held, "a refused request has no effect"
    assert ticket.release() is True
    # The refused requests did not end the session: the same client still works.
    client.acquire("billing/after", wait=0, lease=5.0).release()
    client.close()
    ops.close()


def test_no_client_certificate_is_unavailable(pki: Dict[str, str], tls_server: Server) -> None:
    tls = latchkey.TLS(ca=pki["ca"] + ".crt")
    client = latchkey.Client(tls_server.text, sessions=1, connect_timeout=2.0, transport_timeout=1.0, tls=tls)
    with pytest.raises(latchkey.Unavailable):
        client.acquire("billing/x", wait=0.5, lease=5.0)
    with pytest.raises(latchkey.Unavailable):
        client.ping()
    client.close()


def test_a_server_name_that_the_certificate_lacks_is_refused(pki: Dict[str, str], tls_server: Server) -> None:
    wrong = tls_client(pki, tls_server, "ops", server_name="elsewhere.example")
    with pytest.raises(latchkey.Unavailable) as raised:
        wrong.ping()
    assert "TLS" in str(raised.value), raised.value
    wrong.close()
    right = tls_client(pki, tls_server, "ops", server_name="localhost")
    right.ping()
    right.close()


def test_a_plaintext_client_of_a_tls_port_is_unavailable(tls_server: Server) -> None:
    client = latchkey.Client(tls_server.text, sessions=1, connect_timeout=1.0, transport_timeout=1.0)
    for call in (lambda: client.acquire("k", wait=0.5, lease=5.0), client.ping, lambda: client.query("k")):
        with pytest.raises(latchkey.Unavailable) as raised:
            call()
        said = str(raised.value)
        # The words of every client and command (latchkey_client::SPEAKS_TLS), with this one's way.
        assert "the server speaks TLS (it answered with a TLS record): connect with TLS" in said, said
        assert "tls=latchkey.TLS(ca=FILE)" in said, said
    client.close()


def test_a_tls_file_that_cannot_be_read_is_named() -> None:
    missing = "/nonexistent/latchkey/ca.crt"
    with pytest.raises(FileNotFoundError) as raised:
        latchkey.Client("127.0.0.1:7420", tls=latchkey.TLS(ca=missing))
    assert missing in str(raised.value) and "TLS ca" in str(raised.value), raised.value
    assert raised.value.filename == missing
    with pytest.raises(FileNotFoundError) as raised:
        latchkey.Client("127.0.0.1:7420", tls=latchkey.TLS(cert="/nonexistent/c.crt", key="/nonexistent/c.key"))
    assert "/nonexistent/c.crt" in str(raised.value), raised.value


def test_a_client_asks_for_cards_over_tls_and_refuses_two_standalone_servers(
    pki: Dict[str, str], tls_server: Server
) -> None:
    """tls.rs a_client_asks_for_cards_over_tls_and_refuses_two_standalone_servers: each
    address's card (GET /cluster) is asked over TLS with the client's context and server name
    (it needs no identity); two standalone servers are not one cluster, so neither is used."""
    from latchkey._card import Standalone, fetch

    config = f'[tls]\ncert_file = "{pki["server"]}.crt"\nkey_file = "{pki["server"]}.key"\n'
    other = Server(config=config)
    try:
        # (``tls_server`` asks every client for a certificate.)
        tls = latchkey.TLS(ca=pki["ca"] + ".crt", cert=pki["billing"] + ".crt", key=pki["billing"] + ".key")
        card = fetch(tls_server.addr, tls.context(), None, time.monotonic() + 5)
        assert isinstance(card, Standalone), card
        client = latchkey.Client(
            [tls_server.text, other.text], sessions=1, connect_timeout=2.0, transport_timeout=1.0, tls=tls
        )
        refused = client.refused_members(5.0)
        assert [addr for addr, _ in refused] == [tls_server.text, other.text], refused
        assert all("a standalone server" in why for _, why in refused), refused
        with pytest.raises(latchkey.Unavailable):
            client.acquire("k", wait=0.2, lease=5.0)
        client.close()
        # The ask checks the server name as a session does.
        wrong = latchkey.TLS(
            ca=pki["ca"] + ".crt", cert=pki["billing"] + ".crt", key=pki["billing"] + ".key", server_name="elsewhere.example"
        )
        client = latchkey.Client(
            [tls_server.text, other.text], sessions=1, connect_timeout=2.0, transport_timeout=1.0, tls=wrong
        )
        with pytest.raises(latchkey.Unavailable) as raised:
            client.ping()
        said = str(raised.value)
        assert "not confirmed members of one cluster yet" in said and "TLS handshake failed" in said, said
        assert client.refused_members(5.0) == [], "could not be asked: not refused"
        client.close()
    finally:
        other.stop()
