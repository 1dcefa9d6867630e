"""The tests' own servers: a redis-server whose first port was taken
between its pick and its bind starts on another (the suite runs many
servers and workers at once, and a picked port is free only when picked)."""

from __future__ import annotations

import socket

import pytest

from tests import servers
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


def test_a_redis_server_whose_port_was_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        pick = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or pick())
        server = RedisServer()
        try:
            assert server.port != busy
            assert server.proc is not None
            assert server.proc.poll() is None
        finally:
            server.stop()
