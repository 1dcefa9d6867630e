"""The heartbeat: one daemon thread per process that renews every held lease.

Each tick renews the leases that are due in one ``renew_many`` round trip
per store, and counts each new local deadline from the monotonic time read
before that batch was sent. The thread wakes up for the nearest renewal *or*
deadline, so a lease past its deadline is lost on time even when renewals
cannot get through.

A refusal makes that lease lost. ``StoreUnavailable`` is retried on every
tick until the lease's own deadline passes. Any other error makes every held
lease lost (it is logged with its traceback) and the thread carries on: it
never dies silently.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable

from celery_leases.errors import LeaseLost, StoreUnavailable
from celery_leases.lease import Lease
from celery_leases.stores.base import LeaseStore, RenewRequest

__all__ = ["Heartbeat", "process_heartbeat"]

logger = logging.getLogger("celery_leases")

#: never sleep less than this between ticks (seconds), against busy loops
MIN_WAIT = 0.01
#: longest pause between retries while the store is unavailable (seconds)
MAX_RETRY_WAIT = 1.0


class Heartbeat:
    """Renews the leases of one process from a daemon thread.

    Args:
        clock: the local monotonic clock (the leases' clock too).
        jitter: fraction of a renew interval by which a wake-up comes early,
            at random, so many workers do not renew in lockstep.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, jitter: float = 0.1) -> None:
        self._clock = clock
        self._jitter = jitter
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._wake = threading.Event()
        #: when the sleeping thread wakes up by itself (local clock); +inf
        #: while it is awake, so a lease added then always wakes it again
        self._sleeping_until = float("inf")
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    # -- public --------------------------------------------------------------

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease`` (starts the thread on first use)."""
        with self._lock:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._stopping.clear()
                self._thread = threading.Thread(
                    target=self._run, name="celery-leases-heartbeat", daemon=True
                )
                self._thread.start()
            # Wake the thread only if it would sleep past this lease's first
            # renewal: waking it for every short task costs a thread switch.
            wake = min(lease.next_renew_at, lease.deadline) < self._sleeping_until
        if wake:
            self._wake.set()

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
        with self._lock:
            self._leases.pop(id(lease), None)

    def held(self) -> list[Lease]:
        """The leases being renewed now."""
        with self._lock:
            return list(self._leases.values())

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread and wait for it (leases stay registered)."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                wait = self.tick()
            except Exception as exc:
                self._fail_all(exc)
                wait = MAX_RETRY_WAIT
            wait = max(MIN_WAIT, wait)
            with self._lock:
                self._sleeping_until = self._clock() + wait
            self._wake.wait(wait)
            self._wake.clear()
            with self._lock:
                self._sleeping_until = float("inf")

    def tick(self) -> float:
        """Expire, then renew what is due; returns seconds until the next tick."""
        for lease in self.held():
            if lease.expire_if_due():
                self.remove(lease)
        due_by_store: dict[int, tuple[LeaseStore, list[Lease]]] = {}
        now = self._clock()
        for lease in self.held():
            if lease.next_renew_at <= now:
                due_by_store.setdefault(id(lease.store), (lease.store, []))[1].append(lease)
        for store, leases in due_by_store.values():
            self._renew_batch(store, leases)
        return self._next_wait()

    def _renew_batch(self, store: LeaseStore, leases: list[Lease]) -> None:
        requests = [RenewRequest(x.job_id, x.owner, x.generation, x.timing.ttl) for x in leases]
        started = self._clock()
        try:
            results = store.renew_many(requests)
        except StoreUnavailable as exc:
            logger.warning(
                "could not renew %d lease(s): %s; retrying until their deadlines pass",
                len(leases),
                exc,
            )
            for lease in leases:
                lease.next_renew_at = started + min(lease.timing.renew_interval / 2, MAX_RETRY_WAIT)
            return
        for lease, result in zip(leases, results, strict=True):
            lease.apply_renewal(started, result)
            if lease.lost:
                self.remove(lease)

    def _next_wait(self) -> float:
        leases = self.held()
        if not leases:
            return 3600.0
        now = self._clock()
        waits = []
        for lease in leases:
            early = random.uniform(0, self._jitter * lease.timing.renew_interval)
            waits.append(min(lease.next_renew_at - early, lease.deadline) - now)
        return min(waits)

    def _fail_all(self, exc: Exception) -> None:
        logger.error(
            "the lease heartbeat failed; every lease of this process counts as lost",
            exc_info=exc,
        )
        for lease in self.held():
            self.remove(lease)
            error = LeaseLost(
                f"the heartbeat renewing job {lease.job_id!r} (generation "
                f"{lease.generation}) failed with {exc!r}; stop producing effects",
                job_id=lease.job_id,
                owner=lease.owner,
                generation=lease.generation,
                reason="heartbeat-error",
            )
            error.__cause__ = exc
            lease.mark_lost(error)


_process_lock = threading.Lock()
_process_heartbeat: Heartbeat | None = None


def process_heartbeat() -> Heartbeat:
    """The heartbeat of this process, made anew after a fork.

    A forked pool child inherits the parent's object but not its thread,
    nor the right to renew the parent's leases.
    """
    global _process_heartbeat
    with _process_lock:
        if _process_heartbeat is None or _process_heartbeat.pid != os.getpid():
            _process_heartbeat = Heartbeat()
        return _process_heartbeat


def _forget_after_fork() -> None:
    global _process_heartbeat, _process_lock
    _process_lock = threading.Lock()
    _process_heartbeat = None


os.register_at_fork(after_in_child=_forget_after_fork)
