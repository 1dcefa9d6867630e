"""OS threads, locks and sockets that gevent or eventlet monkey-patching leaves alone.

Under ``celery worker -P gevent`` or ``-P eventlet`` the ``threading``,
``time`` and ``socket`` modules are patched: a "thread" is a greenlet, a
lock or a sleep switches to the hub, and a socket waits in the hub. A task
greenlet that never yields (a tight loop, a C call that blocks) holds the
hub, and with it every other greenlet. The lease threads must not be among
them, so they are made from what the patching left behind:

- :func:`start_thread` starts a real OS thread (``_thread.start_new_thread``
  as it was before patching);
- :func:`lock` and :class:`Event` block that OS thread, never a hub; a
  greenlet only ever holds :func:`lock` for a few bytecodes, never across a
  switch;
- :func:`socket_module` is the socket module as it was, for a store client
  that lives in those threads.

Without monkey-patching each of them is the ordinary ``threading`` one.
``time.monotonic`` is patched by neither library, so leases read it as is.
"""

from __future__ import annotations

import _thread
import queue
import socket
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "Event",
    "OsThread",
    "current_thread_is",
    "get_ident",
    "green_library",
    "in_main_os_thread",
    "lock",
    "rlock",
    "simple_queue",
    "socket_module",
    "start_thread",
]


def green_library() -> str | None:
    """``"gevent"`` or ``"eventlet"`` if that library patched ``threading``, else None."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


def _original(module: str, name: str) -> Any:
    library = green_library()
    if library == "gevent":
        from gevent import monkey  # type: ignore[import-untyped]

        return monkey.get_original(module, name)
    if library == "eventlet":
        from eventlet import patcher  # type: ignore[import-untyped]

        return getattr(patcher.original(module), name)
    return getattr(sys.modules[module], name)


def lock() -> _thread.LockType:
    """A lock of the OS: blocking on it blocks the OS thread, not a hub."""
    allocate: Callable[[], _thread.LockType] = _original("_thread", "allocate_lock")
    return allocate()


def rlock() -> Any:
    """A reentrant lock of the OS (the C one of ``_thread``)."""
    make: Callable[[], Any] = _original("_thread", "RLock")
    return make()


def get_ident() -> int:
    """The OS thread's identity (a greenlet's, too, is its hub thread's)."""
    ident: Callable[[], int] = _original("_thread", "get_ident")
    return ident()


_main_ident = get_ident()  # the package is imported in the main thread


def in_main_os_thread() -> bool:
    """Whether the caller runs in the process's main OS thread (the hub's)."""
    return get_ident() == _main_ident


def simple_queue() -> queue.SimpleQueue[Any]:
    """The C ``queue.SimpleQueue`` as it was before monkey-patching (gevent
    replaces it with its own, eventlet with the pure-Python one): its ``get``
    blocks the OS thread, and its ``put`` never switches greenlets."""
    make: Callable[[], queue.SimpleQueue[Any]] = _original("queue", "SimpleQueue")
    return make()


def socket_module() -> ModuleType:
    """The ``socket`` module as it was before monkey-patching.

    Under gevent its ``socket`` class and ``getaddrinfo`` are the original
    ones, and the functions written in Python (``create_connection``) still
    make patched sockets: build connections from ``socket`` itself.
    """
    library = green_library()
    if library == "eventlet":
        from eventlet import patcher

        module: ModuleType = patcher.original("socket")
        return module
    if library == "gevent":
        from gevent import monkey

        # only the module's functions and classes are patched, in place
        names = ("socket", "getaddrinfo")
        originals = dict(zip(names, monkey.get_original("socket", list(names)), strict=True))
        unpatched = ModuleType("socket")
        unpatched.__dict__.update(vars(socket))
        unpatched.__dict__.update(originals)
        return unpatched
    return socket


class Event:
    """``threading.Event`` made of :func:`lock`; ``wait`` blocks its OS thread."""

    def __init__(self) -> None:
        self._mutex = lock()
        self._flag = False
        self._waiters: list[_thread.LockType] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._mutex:
            self._flag = True
            for waiter in self._waiters:
                waiter.release()
            self._waiters.clear()

    def clear(self) -> None:
        with self._mutex:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set or ``timeout`` seconds pass; returns whether it is set."""
        with self._mutex:
            if self._flag:
                return True
            waiter = lock()
            waiter.acquire()
            self._waiters.append(waiter)
        waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        with self._mutex:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            return self._flag


class OsThread:
    """A daemon OS thread started with the unpatched ``_thread`` module.

    Under monkey-patching ``threading.Thread`` would start a greenlet; this
    one has a stack of its own, and runs while a greenlet holds the hub.
    """

    def __init__(self, target: Callable[..., object], args: tuple[Any, ...], name: str) -> None:
        self.name = name
        self._target = target
        self._args = args
        self._running = lock()
        self.ident: int | None = None

    def start(self) -> None:
        self._running.acquire()
        start: Callable[..., int] = _original("_thread", "start_new_thread")
        try:
            start(self._run, ())
        except BaseException:
            self._running.release()
            raise

    def _run(self) -> None:
        self.ident = get_ident()
        try:
            self._target(*self._args)
        finally:
            self._running.release()

    def is_alive(self) -> bool:
        return self._running.locked()

    def join(self, timeout: float | None = None) -> None:
        if self._running.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._running.release()


def start_thread(
    target: Callable[..., object], *, name: str, args: tuple[Any, ...] = ()
) -> threading.Thread | OsThread:
    """Start ``target(*args)`` on a daemon OS thread named ``name``.

    Without monkey-patching it is an ordinary ``threading.Thread``.
    """
    thread: threading.Thread | OsThread
    if green_library() is None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    else:
        thread = OsThread(target, args, name)
    thread.start()
    return thread


def current_thread_is(thread: threading.Thread | OsThread | None) -> bool:
    """Whether the caller runs on ``thread``."""
    if thread is None:
        return False
    if isinstance(thread, OsThread):
        return thread.ident == get_ident()
    return thread is threading.current_thread()
