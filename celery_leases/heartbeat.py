"""The heartbeat: renews every held lease and enforces every local deadline.

One daemon thread per process, the *deadline thread*, never does I/O. It
sleeps until the nearest renewal or deadline is due, marks the leases past
their deadline lost, and starts the renewals that are due. The reactions to
a lost lease that it runs are quick (a flag, an interrupt, a signal to stop
the pool process); log lines, signals, hooks and events go to the notifier
thread (:mod:`celery_leases.notify`).

A renewal is one ``renew_many`` round trip per store, sent from a
short-lived *renewal thread*; the new deadlines count from the monotonic
time read before the batch was sent. The thread wakes up early by a random
part of ``jitter`` of an interval (so workers do not renew in lockstep), and
a lease due within that much is due. When one lease of a store is due, every
lease of that store due within half its renew interval goes in the same call
(renewed a little early), so leases claimed at scattered times settle on one
call per interval instead of one each. A call that hangs (a black-holed
connection, a lock held by another transaction) is left to its thread: the
leases it was renewing keep their deadlines and are lost on time, and a
reply that comes back after a lease's deadline does not revive it. At most
:data:`MAX_IN_FLIGHT` calls per store hold a *renewal slot* at once, so a
store that hangs cannot pile up threads; a call holds its slot until it
returns or until the earliest deadline of its leases, whichever comes first,
so calls that hang cannot keep the leases claimed later from being renewed.
Each call runs inside :func:`~celery_leases.stores.deadline.bounded` up to
that deadline, so a store that bounds its waits (the SQL store) gives up
then too::

    deadline thread  ──due──▶ start renewal ──▶ sleep ──deadline──▶ lost (flag / interrupt / stop)
    renewal thread            renew_many ......... (hangs) ......... reply: ignored if too late

A lease whose record an ``exactly_once`` block has locked is renewed in
that block's own transaction (``Lease.renewer``, see
:mod:`celery_leases.exactly_once`): a renewal from the store's connection
would only wait for that lock.

A refusal makes that lease lost. ``StoreUnavailable`` is retried until the
lease's own deadline passes. Any other error from a batch makes the leases
of that batch lost (it is logged with its traceback); an error in the
deadline thread itself makes every lease lost, and the thread carries on:
it never dies silently.

Under gevent or eventlet monkey-patching the deadline and renewal threads
are OS threads and their locks OS locks (:mod:`celery_leases.unpatched`),
and the stores that can renew there do so on connections of their own
(``LeaseStore.renews_outside_the_hub``): a task greenlet that holds the hub,
in a tight loop or a blocking C call, delays no deadline and no renewal.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable

from celery_leases import unpatched
from celery_leases.errors import LeaseLost, StoreUnavailable
from celery_leases.lease import Lease, Renewer
from celery_leases.notify import notify, process_notifier
from celery_leases.per_process import ProcessLocal
from celery_leases.stores.base import RenewRequest
from celery_leases.stores.deadline import bounded

__all__ = ["MAX_IN_FLIGHT", "Heartbeat", "process_heartbeat"]

logger = logging.getLogger("celery_leases")

#: never sleep less than this between ticks (seconds), against busy loops
MIN_WAIT = 0.01
#: longest pause between retries while the store is unavailable (seconds)
MAX_RETRY_WAIT = 1.0
#: renewal calls to one store that may hold a slot at once (a call gives its
#: slot up when it returns or at the earliest deadline of its leases)
MAX_IN_FLIGHT = 2


class Heartbeat:
    """Renews the leases of one process and enforces their local deadlines.

    Args:
        clock: the local monotonic clock (the leases' clock too).
        jitter: fraction of a renew interval by which a wake-up comes early,
            at random, so many workers do not renew in lockstep.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, jitter: float = 0.1) -> None:
        self._clock = clock
        self._jitter = jitter
        self._lock = unpatched.lock()
        self._leases: dict[int, Lease] = {}
        self._wake = unpatched.Event()
        #: when the sleeping thread wakes up by itself (local clock); +inf
        #: while it is awake, so a lease added then always wakes it again
        self._sleeping_until = float("inf")
        self._stopping = unpatched.Event()
        self._thread: threading.Thread | unpatched.OsThread | None = None
        #: renewal calls holding a slot, per store (by id): call number ->
        #: the moment its slot ends (the earliest deadline of its leases)
        self._in_flight: dict[int, dict[int, float]] = {}
        self._calls = 0
        #: leases (by id) whose renewal call is running now
        self._renewing: set[int] = set()
        #: how long the thread sleeps with no lease held: the shortest renew
        #: interval of the leases added so far. A lease added then is due no
        #: sooner than that, so adding it need not wake the thread (short
        #: tasks would otherwise wake it once each, for nothing)
        self._idle_wait = 3600.0
        self.pid = os.getpid()

    # -- public --------------------------------------------------------------

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease`` (starts the thread on first use)."""
        with self._lock:
            self._leases[id(lease)] = lease
            self._idle_wait = min(self._idle_wait, lease.timing.renew_interval)
            if self._thread is None or not self._thread.is_alive():
                self._stopping.clear()
                self._thread = unpatched.start_thread(self._run, name="celery-leases-heartbeat")
            # Wake the thread only if it would sleep past this lease's first
            # renewal: waking it for every short task costs a thread switch.
            wake = min(lease.next_renew_at, lease.deadline) < self._sleeping_until
        if wake:
            self._wake.set()
        if unpatched.green_library() is not None:
            # the lease threads' notices need a notifier, which only a
            # greenlet of the hub can start
            process_notifier().start()

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
        """Stop the thread and wait for it (leases stay registered).

        Renewal calls still running are not waited for: they are daemon
        threads, and their replies no longer matter.
        """
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and not unpatched.current_thread_is(thread):
            thread.join(timeout)

    # -- the deadline thread -----------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                wait = self.tick()
            except Exception as exc:
                self._fail(self.held(), exc)
                wait = MAX_RETRY_WAIT
            wait = max(MIN_WAIT, wait)
            with self._lock:
                self._sleeping_until = self._clock() + wait
            self._wake.wait(wait)
            self._wake.clear()
            with self._lock:
                self._sleeping_until = float("inf")

    def tick(self) -> float:
        """Expire, then start the renewals that are due; returns seconds to the next tick.

        Never waits for a store: renewals run on threads of their own.
        """
        for lease in self.held():
            if lease.expire_if_due():
                self.remove(lease)
        held = self.held()
        now = self._clock()
        with self._lock:
            renewing = set(self._renewing)
        # The thread wakes up early by up to `jitter` of an interval (see
        # _next_wait): a lease due within that much is due now. Not one whose
        # renewal is in flight: it waits the full time its call was given.
        jitter = self._jitter
        due = {
            id(x)
            for x in held
            if x.next_renew_at <= now
            or (x.next_renew_at <= now + jitter * x.timing.renew_interval and id(x) not in renewing)
        }
        if not due:
            return self._next_wait(held)
        due_stores = {id(x.renewer) for x in held if id(x) in due}
        due_by_store: dict[int, tuple[Renewer, list[Lease]]] = {}
        for lease in held:
            key = id(lease.renewer)
            if key not in due_stores:
                continue
            # A lease due within half an interval rides along in this call
            # (renewed a little early) rather than costing a round trip of its
            # own: claims spread over time converge on one call per interval.
            # A lease whose renewal is in flight waits for it, as before.
            early = lease.next_renew_at <= now + lease.timing.renew_interval / 2
            if id(lease) in due or (early and id(lease) not in renewing):
                due_by_store.setdefault(key, (lease.renewer, []))[1].append(lease)
        for store, leases in due_by_store.values():
            self._start_renewal(store, leases)
        return self._next_wait(held)

    def _start_renewal(self, store: Renewer, leases: list[Lease]) -> None:
        key = id(store)
        started = self._clock()
        slot_ends = min(lease.deadline for lease in leases)
        with self._lock:
            # a call past its leases' earliest deadline no longer holds a slot
            slots = {
                call: ends for call, ends in self._in_flight.get(key, {}).items() if ends > started
            }
            self._in_flight[key] = slots
            if len(slots) >= MAX_IN_FLIGHT:
                # calls that hang hold every slot: the leases keep their
                # deadlines, and the next tick tries again
                return
            self._calls += 1
            call = self._calls
            slots[call] = slot_ends
        for lease in leases:
            # no second request for these leases until this one had its chance
            lease.next_renew_at = started + min(lease.timing.renew_interval / 2, MAX_RETRY_WAIT)
        with self._lock:
            self._renewing.update(id(lease) for lease in leases)
        try:
            unpatched.start_thread(
                self._renew_batch,
                args=(store, leases, started, call, slot_ends),
                name="celery-leases-renew",
            )
        except BaseException:
            self._end_call(key, call, leases)
            raise

    def _end_call(self, key: int, call: int, leases: list[Lease]) -> None:
        with self._lock:
            self._in_flight.get(key, {}).pop(call, None)
            self._renewing.difference_update(id(lease) for lease in leases)

    # -- renewal threads -------------------------------------------------------

    def _renew_batch(
        self, store: Renewer, leases: list[Lease], started: float, call: int, slot_ends: float
    ) -> None:
        requests = [RenewRequest(x.job_id, x.owner, x.generation, x.timing.ttl) for x in leases]
        try:
            with bounded(slot_ends - self._clock()):
                results = store.renew_many(requests)
        except StoreUnavailable as exc:
            notify(
                logger.warning,
                "could not renew %d lease(s): %s; retrying until their deadlines pass",
                len(leases),
                exc,
            )
            return
        except Exception as exc:
            self._fail(leases, exc)
            return
        finally:
            self._end_call(id(store), call, leases)
        for lease, result in zip(leases, results, strict=True):
            lease.apply_renewal(started, result)
            if lease.lost:
                self.remove(lease)
        self._wake.set()  # the next renewals are due later now

    def _next_wait(self, leases: list[Lease]) -> float:
        if not leases:
            return self._idle_wait
        now = self._clock()
        # one random draw per wake-up, not per lease: the same early wake-up
        # for a fraction of each lease's own interval
        share = random.uniform(0, self._jitter)
        return (
            min(
                min(lease.next_renew_at - share * lease.timing.renew_interval, lease.deadline)
                for lease in leases
            )
            - now
        )

    def _fail(self, leases: list[Lease], exc: Exception) -> None:
        notify(
            logger.error,
            "the lease heartbeat failed; %d lease(s) of this process count as lost",
            len(leases),
            exc_info=exc,
        )
        for lease in leases:
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


_heartbeat: ProcessLocal[Heartbeat] = ProcessLocal(Heartbeat)


def process_heartbeat() -> Heartbeat:
    """The heartbeat of this process, made anew after a fork.

    A forked pool child inherits the parent's object but not its thread,
    nor the right to renew the parent's leases.
    """
    return _heartbeat.get()
