"""A TCP proxy for fault tests: it sits between a client and a real server.

Usage::

    with Proxy("127.0.0.1", redis_server.port) as proxy:
        store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0")
        proxy.drop_next_reply()   # the next request reaches the server,
        ...                       # its reply never reaches the client
        proxy.heal()

Modes (each call replaces the one before, for every connection):

- pass (the default, and after :meth:`Proxy.heal`): bytes flow both ways.
- :meth:`Proxy.delay`: every reply is held back ``seconds`` before it is sent.
- :meth:`Proxy.blackhole`: connections are accepted and requests forwarded to
  the server, but nothing comes back: the client waits until its own timeout.
- :meth:`Proxy.drop_next_reply`: the next request is forwarded; the server's
  reply to it is thrown away and that connection is closed, as when a reply is
  lost with the connection. Later connections pass again.
- :meth:`Proxy.cut`: closes every open connection now (new ones are accepted).

Every socket operation has a timeout and every thread is a daemon that
checks a stop flag, so a test that forgets :meth:`Proxy.close` cannot hang.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

__all__ = ["Proxy"]

#: how often a blocked thread looks at the stop flags (seconds)
_POLL = 0.05
_CHUNK = 65536


class _Pair:
    """One client connection and its connection to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.closed = threading.Event()
        #: the next reply on this connection is to be dropped
        self.drop_reply = False

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class Proxy:
    """Forward TCP connections from ``127.0.0.1:<port>`` to the target.

    Args:
        target_host: the server's host.
        target_port: the server's port.

    Attributes:
        port: the port the proxy listens on (on 127.0.0.1).
        dropped: how many replies :meth:`drop_next_reply` threw away.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._stop = threading.Event()
        self._delay = 0.0
        self._blackhole = False
        self._drop_next = False
        self.dropped = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(_POLL)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop)

    # -- modes ----------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Hold every reply back ``seconds`` before sending it on."""
        with self._lock:
            self._delay = float(seconds)
            self._blackhole = False

    def blackhole(self) -> None:
        """Forward requests, send no reply back."""
        with self._lock:
            self._blackhole = True

    def drop_next_reply(self) -> None:
        """Forward the next request, then drop its reply and close its connection."""
        with self._lock:
            self._drop_next = True

    def heal(self) -> None:
        """Back to passing everything through, at once."""
        with self._lock:
            self._delay = 0.0
            self._blackhole = False
            self._drop_next = False

    def cut(self) -> None:
        """Close every open connection (both sides); new ones are accepted."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def close(self) -> None:
        """Stop listening, close every connection and join the threads."""
        self._stop.set()
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- the pumps --------------------------------------------------------------

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the server is down: so is the proxy, for this client
                continue
            for sock in (client, server):
                sock.settimeout(_POLL)
            pair = _Pair(client, server)
            with self._lock:
                self._pairs.append(pair)
            self._start(self._requests, pair)
            self._start(self._replies, pair)

    def _requests(self, pair: _Pair) -> None:
        """Client to server: always forwarded; arms a dropped reply if asked."""
        while not (pair.closed.is_set() or self._stop.is_set()):
            data = self._receive(pair, pair.client)
            if data is None:
                continue
            if not data:
                break
            with self._lock:
                if self._drop_next:
                    self._drop_next = False
                    pair.drop_reply = True
            if not self._send(pair, pair.server, data):
                break
        pair.close()

    def _replies(self, pair: _Pair) -> None:
        """Server to client: delayed, held back or dropped as the mode says."""
        while not (pair.closed.is_set() or self._stop.is_set()):
            data = self._receive(pair, pair.server)
            if data is None:
                continue
            if not data:
                break
            with self._lock:
                delay, blackhole, drop = self._delay, self._blackhole, pair.drop_reply
            if drop:
                self.dropped += 1
                break  # the reply is lost, and the connection with it
            if blackhole:
                continue
            if delay and pair.closed.wait(delay):
                break
            if not self._send(pair, pair.client, data):
                break
        pair.close()

    @staticmethod
    def _receive(pair: _Pair, sock: socket.socket) -> bytes | None:
        """Bytes read, ``b""`` at the end, ``None`` when nothing came yet."""
        try:
            return sock.recv(_CHUNK)
        except TimeoutError:
            return None
        except OSError:
            return b""

    @staticmethod
    def _send(pair: _Pair, sock: socket.socket, data: bytes) -> bool:
        deadline = time.monotonic() + 10
        view = memoryview(data)
        while view and not pair.closed.is_set():
            try:
                sent = sock.send(view)
            except TimeoutError:
                if time.monotonic() > deadline:
                    return False
                continue
            except OSError:
                return False
            view = view[sent:]
        return not view
