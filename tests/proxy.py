"""A TCP proxy for fault tests: it passes, delays, black-holes or cuts traffic.

Put it between a client (a worker's store connection) and a server::

    proxy = Proxy("127.0.0.1", redis_port)   # listens on 127.0.0.1:proxy.port
    proxy.blackhole()       # connections stay open, nothing gets through
    proxy.blackhole_established()   # the same for open connections only; new ones pass
    proxy.heal()            # traffic flows again (new and old connections)
    proxy.drop_next_reply() # the next server reply is swallowed, its connection closed
    proxy.drop_reply_to(b"...")     # the same, for the reply to a request holding these bytes
    proxy.silence_reply_to(b"...")  # that reply is lost, its connection stays open and silent
    proxy.blackhole_after(b"...")   # forward that request, then black-hole everything
    proxy.refuse()          # close new connections at once (a server that is down)
    proxy.delay(0.5)        # every chunk waits 0.5 s in each direction
    proxy.cut()             # close every connection now
    proxy.requests          # how many request chunks clients sent
    proxy.close()

Black-holed bytes are thrown away, as a network that lost them would. It
runs in threads of the test process; every loop polls with a short timeout
and ends when the proxy closes.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

__all__ = ["Proxy"]

_POLL = 0.05


class Proxy:
    """Forwards connections from ``127.0.0.1:port`` to ``host:target_port``."""

    def __init__(self, host: str, target_port: int) -> None:
        self.target = (host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._blackholed = False
        self._delay = 0.0
        self._drop_replies = 0
        self._drop_marker: bytes | None = None
        self._blackhole_marker: bytes | None = None
        self._refusing = False
        self._marked: set[int] = set()
        self._silence_marker: bytes | None = None
        self._silenced: set[int] = set()
        self._blackhole_next = False
        self._holed: set[int] = set()
        self.dropped_replies = 0
        #: chunks read from clients and forwarded or held: a client's request,
        #: sent in one write, is one chunk
        self.requests = 0
        self._connections: list[tuple[socket.socket, socket.socket]] = []
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    # -- faults ------------------------------------------------------------------

    def blackhole(self) -> None:
        """Keep connections open and accept new ones, but let nothing through."""
        with self._lock:
            self._blackholed = True

    def blackhole_established(self) -> None:
        """Black-hole the connections open now (a firewall that forgot them);
        connections made later pass."""
        with self._lock:
            self._holed.update(id(client) for client, _ in self._connections)

    def delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before forwarding it (both directions)."""
        with self._lock:
            self._delay = seconds

    def drop_next_reply(self, count: int = 1) -> None:
        """Swallow the next ``count`` server replies and close their connections.

        The request reaches the server and is applied there; the client
        never hears back, as when a reply is lost on the way.
        """
        with self._lock:
            self._drop_replies += count

    def drop_reply_to(self, marker: bytes) -> None:
        """Swallow the reply to the next request that contains ``marker``.

        The request is forwarded (the server applies it); its connection is
        closed instead of the reply reaching the client.
        """
        with self._lock:
            self._drop_marker = marker

    def silence_reply_to(self, marker: bytes) -> None:
        """Swallow the reply to the next request that contains ``marker``,
        and every later reply on its connection, which stays open.

        The server applies the request; the client hears nothing and waits
        its whole socket timeout, while its other connections still pass.
        """
        with self._lock:
            self._silence_marker = marker

    def blackhole_after(self, marker: bytes) -> None:
        """Forward the next request that contains ``marker``, then black-hole all."""
        with self._lock:
            self._blackhole_marker = marker

    def refuse(self) -> None:
        """Close every new connection at once, and the open ones now."""
        with self._lock:
            self._refusing = True
        self.cut()

    def heal(self) -> None:
        """Pass traffic again: no delay, no dropped replies, no refusals."""
        with self._lock:
            self._blackholed = False
            self._refusing = False
            self._delay = 0.0
            self._drop_replies = 0
            self._drop_marker = None
            self._silence_marker = None
            self._blackhole_marker = None
            self._holed.clear()

    def cut(self) -> None:
        """Close every open connection (new ones are still accepted)."""
        with self._lock:
            connections, self._connections = self._connections, []
        for pair in connections:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        """Stop accepting and close everything."""
        self._closed.set()
        self.cut()
        self._thread.join(5)
        self._listener.close()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections.append((client, upstream))
            for source, sink, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump,
                    args=(source, sink, replies, (client, upstream)),
                    name="proxy-pump",
                    daemon=True,
                ).start()

    def _pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        replies: bool,
        pair: tuple[socket.socket, socket.socket],
    ) -> None:
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([source], [], [], _POLL)
                if not readable:
                    continue
                data = source.recv(65536)
                if not data:
                    break
                with self._lock:
                    blackholed = self._blackholed or id(pair[0]) in self._holed
                    delay = self._delay
                    if not replies:
                        self.requests += 1
                        self._watch_request(data, pair)
                    silenced = replies and id(pair[0]) in self._silenced
                    drop = replies and not blackholed and not silenced and self._take_drop(pair)
                    if drop:
                        self.dropped_replies += 1
                if blackholed or silenced:
                    continue
                if drop:
                    break
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._silenced.discard(id(pair[0]))  # an id is reused once freed
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.close()

    # called with the lock held
    def _watch_request(self, data: bytes, pair: tuple[socket.socket, socket.socket]) -> None:
        if self._drop_marker is not None and self._drop_marker in data:
            self._drop_marker = None
            self._marked.add(id(pair[0]))
        if self._silence_marker is not None and self._silence_marker in data:
            self._silence_marker = None
            self._silenced.add(id(pair[0]))
            self.dropped_replies += 1
        if self._blackhole_marker is not None and self._blackhole_marker in data:
            self._blackhole_marker = None
            self._blackhole_next = True

    def _take_drop(self, pair: tuple[socket.socket, socket.socket]) -> bool:
        if self._blackhole_next:
            self._blackhole_next = False
            self._blackholed = True
            return True
        if id(pair[0]) in self._marked:
            self._marked.discard(id(pair[0]))
            return True
        if self._drop_replies > 0:
            self._drop_replies -= 1
            return True
        return False
