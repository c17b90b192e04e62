"""Fixtures: the real ``latchkey`` binary (see support.binary) and clients of it."""

from __future__ import annotations

from typing import Iterator

import pytest

import latchkey
from support import Server, binary


def pytest_report_header(config: pytest.Config) -> str:
    return f"latchkey binary: {binary()}"


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def observer(server: Server) -> Iterator[latchkey.Client]:
    """A client that talks to the server directly, to observe it."""
    c = latchkey.Client(server.text, sessions=1, transport_timeout=2.0)
    c.ping()  # the session is up before the tests' short waits start
    try:
        yield c
    finally:
        c.close()
