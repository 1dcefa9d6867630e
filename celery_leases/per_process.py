"""What a process keeps for itself: one object per process, one job thread.

A forked child (a prefork pool process) inherits its parent's objects but
not its threads, nor the right to use its sockets or renew its leases. So
what belongs to a process is made on first use and made anew in a child:

- :class:`ProcessLocal` holds one object per process (the heartbeat, the
  notifier, the visibility extender, the owner tokens' prefix);
  :class:`ProcessLocalByKey` one per key and process (an app's runtime, its
  event sender).
- :class:`JobThread` runs jobs in order on a daemon thread of its own,
  started on demand; a job that raises is logged and the thread carries on.

Both forget the parent's state in a child: an at-fork hook gives each a new
lock (another thread may have held the old one at the fork), and a pid check
catches a fork that ran no at-fork hooks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any, Generic, TypeVar

from celery_leases import unpatched

__all__ = ["GREEN_POLL", "JobThread", "ProcessLocal", "ProcessLocalByKey"]

logger = logging.getLogger("celery_leases")

T = TypeVar("T")
K = TypeVar("K")

#: seconds between two looks at its queue by a job thread that is a greenlet
GREEN_POLL = 0.05


class ProcessLocal(Generic[T]):
    """One object per process, made by ``factory()`` on first use.

    A forked child gets an object of its own on its first :meth:`get`. The
    factory runs outside the lock (it may read settings, and under gevent
    or eventlet a greenlet must not switch while holding an OS lock): two
    threads that race in a fresh process may both call it, and both get the
    one object that was stored first.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = unpatched.lock()
        self._made: tuple[int, T] | None = None
        _instances.add(self)

    def get(self) -> T:
        """This process's object, made now if it has none."""
        made = self._made  # the common case, without the lock
        pid = os.getpid()
        if made is not None and made[0] == pid:
            return made[1]
        candidate = self._factory()
        with self._lock:
            if self._made is None or self._made[0] != pid:
                self._made = (pid, candidate)
            return self._made[1]

    def made(self) -> T | None:
        """This process's object if it was made, else None (makes nothing)."""
        made = self._made
        return made[1] if made is not None and made[0] == os.getpid() else None

    def forget(self) -> T | None:
        """Drop this process's object (the next :meth:`get` makes one); returns it."""
        with self._lock:
            made = self.made()
            self._made = None
            return made

    def after_fork(self) -> None:
        """Forget the parent's object and lock (run by the at-fork hook)."""
        self._lock = unpatched.lock()
        self._made = None


@dataclass
class _Keyed(Generic[K, T]):
    lock: Any = field(default_factory=unpatched.lock)
    objects: weakref.WeakKeyDictionary[K, T] = field(default_factory=weakref.WeakKeyDictionary)


class ProcessLocalByKey(Generic[K, T]):
    """One object per key and process, made by ``factory(key)`` on first use.

    Keys are held weakly (a Celery app): an object lives as long as its
    key. As with :class:`ProcessLocal`, the factory runs outside the lock.
    """

    def __init__(self, factory: Callable[[K], T]) -> None:
        self._factory = factory
        self._keyed: ProcessLocal[_Keyed[K, T]] = ProcessLocal(_Keyed)

    def get(self, key: K) -> T:
        """This process's object for ``key``, made now if it has none."""
        keyed = self._keyed.get()
        made = keyed.objects.get(key)  # the common case, without the lock
        if made is not None:
            return made
        candidate = self._factory(key)
        with keyed.lock:
            return keyed.objects.setdefault(key, candidate)

    def made(self) -> list[T]:
        """This process's objects made so far (makes nothing)."""
        keyed = self._keyed.made()
        if keyed is None:
            return []
        with keyed.lock:
            return list(keyed.objects.values())

    def forget(self, key: K) -> T | None:
        """Drop this process's object for ``key``; returns it."""
        keyed = self._keyed.made()
        if keyed is None:
            return None
        with keyed.lock:
            return keyed.objects.pop(key, None)

    def forget_all(self) -> list[T]:
        """Drop every object of this process; returns them."""
        keyed = self._keyed.forget()
        if keyed is None:
            return []
        with keyed.lock:
            return list(keyed.objects.values())


_instances: weakref.WeakSet[ProcessLocal[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for instance in list(_instances):
        instance.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


# --- the job thread ------------------------------------------------------------


class _Marker:
    """A flush (``done`` is set when reached) or the stop of the thread."""

    def __init__(self, stop: bool = False) -> None:
        self.stop = stop
        self.done = threading.Event()


@dataclass
class _ThreadState:
    queue: SimpleQueue[Any] = field(default_factory=unpatched.simple_queue)
    lock: Any = field(default_factory=unpatched.lock)
    thread: threading.Thread | None = None
    #: jobs queued and not yet taken (markers do not count)
    queued: int = 0


class JobThread:
    """Runs submitted jobs in order on one daemon thread, started on demand.

    :meth:`submit` never blocks: slow work (a log handler, a signal
    receiver, a broker that hangs) holds only this thread. A job that
    raises is logged and the thread carries on. :meth:`stop` runs what was
    queued before it, then ends the thread and waits for it; the next job
    starts a new one. In a forked child the queue starts empty (the
    parent's jobs stay the parent's) and the first job starts a thread.

    Under gevent or eventlet monkey-patching the thread is a greenlet of
    the hub, where the worker's sockets and locks live (its jobs use them),
    unlike the lease threads, which are OS threads
    (:mod:`celery_leases.unpatched`). An OS thread hands jobs over through
    an OS-level queue that never blocks a put, and the greenlet picks them
    up every :data:`GREEN_POLL` seconds: a greenlet that holds the hub
    delays the jobs, never a deadline. Only the hub's thread can start the
    greenlet: a job an OS thread submits waits until then.

    Args:
        name: the thread's name.
        maxsize: jobs that may wait at once (0: no bound); :meth:`submit`
            drops a job beyond it.
        on_stop: called on the thread when it stops (to close what its
            jobs opened).
    """

    def __init__(
        self, name: str, *, maxsize: int = 0, on_stop: Callable[[], object] | None = None
    ) -> None:
        self.name = name
        self._maxsize = maxsize
        self._on_stop = on_stop
        self._state: ProcessLocal[_ThreadState] = ProcessLocal(_ThreadState)

    def submit(self, fn: Callable[..., object], /, *args: Any, **kwargs: Any) -> bool:
        """Queue ``fn(*args, **kwargs)``; never blocks, never raises.

        Returns:
            False if the queue was full and the job was dropped.
        """
        state = self._state.get()
        with state.lock:
            if self._maxsize and state.queued >= self._maxsize:
                return False
            state.queued += 1
        state.queue.put((fn, args, kwargs))
        self.start()
        return True

    def start(self) -> None:
        """Start the thread if it is not running (under patching: from the hub only)."""
        if unpatched.green_library() is not None and not unpatched.in_main_os_thread():
            return
        state = self._state.get()
        with state.lock:
            thread = state.thread
            if thread is not None and (thread.is_alive() or thread.ident is None):
                return  # running, or being started by another caller
            thread = threading.Thread(target=self._run, args=(state,), name=self.name, daemon=True)
            state.thread = thread
        # Started outside the lock: under patching, starting a thread switches
        # greenlets, and a greenlet that then waits for this OS lock (the new
        # thread taking its first job, a submit) would hold the hub for good.
        try:
            thread.start()
        except BaseException:
            with state.lock:
                if state.thread is thread:
                    state.thread = None
            raise

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        thread = self._state.get().thread
        return thread is not None and thread.is_alive()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the jobs queued before to run.

        Returns:
            True if they all ran in time.
        """
        marker = _Marker()
        self._state.get().queue.put(marker)
        self.start()
        return marker.done.wait(timeout)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Run what is queued, then end the thread and wait up to ``timeout`` for it."""
        state = self._state.get()
        thread = state.thread
        if thread is None or not thread.is_alive():
            return
        state.queue.put(_Marker(stop=True))
        if thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, state: _ThreadState) -> None:
        green = unpatched.green_library() is not None
        while True:
            if green:
                try:
                    item = state.queue.get_nowait()
                except Empty:
                    time.sleep(GREEN_POLL)  # the patched sleep: lets the hub run
                    continue
            else:
                item = state.queue.get()
            if isinstance(item, _Marker):
                if item.stop:
                    self._stopped(state)
                    return
                item.done.set()
                continue
            with state.lock:
                state.queued -= 1
            fn, args, kwargs = item
            self._call(fn, *args, **kwargs)

    def _stopped(self, state: _ThreadState) -> None:
        if self._on_stop is not None:
            self._call(self._on_stop)
        with state.lock:
            if state.thread is threading.current_thread():
                state.thread = None
        if not state.queue.empty():
            self.start()  # a job came after the stop: a new thread runs it

    @staticmethod
    def _call(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            logger.exception("a job of a celery-leases thread (%r) failed", fn)
