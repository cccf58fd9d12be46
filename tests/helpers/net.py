"""Loopback ports for the servers tests start. Imported as `helpers.net`: a module of its own, since
`from conftest import ...` resolves to whichever conftest.py was imported last under that name
(tests/sandbox_security has one too)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
