"""The lease a running task holds, as task code sees it (``self.lease``).

A :class:`Lease` keeps two clocks apart. ``lease_until`` is when the
store will let another worker claim the job, on the **store's** clock. The
local safe deadline is on this process's ``time.monotonic()``, counted from
*before* the claim or renewal was sent, minus the drift margin; past it the
lease counts as lost even if the store has not noticed yet::

    t0 = monotonic()   claim sent ........ reply      deadline = t0 + ttl - margin
    store: ................ now_s  ...................... now_s + ttl (lease_until)

The heartbeat moves the deadline forward after each renewal; a refused
renewal or a passed deadline makes the lease lost for good. ``lost``,
``check()`` and ``remaining()`` read the clock themselves, so the deadline
holds even while every thread that could notice it is stuck in I/O.

Once the run is over (its completion accepted, or its lease released)
:meth:`Lease.finish` is called: a renewal refused after that, for example
one that was on the wire while the completion went through, is not a loss.
A lease given up for the run that ``retry()`` or ``replace()`` sent
(:meth:`Lease.hand_over`) reads as lost to the run that gave it up.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol

from celery_leases import unpatched
from celery_leases.errors import LeaseConfigurationError, LeaseLost, StoreUnavailable
from celery_leases.owners import make_owner
from celery_leases.settings import LeaseTiming
from celery_leases.stores.base import (
    LeaseStore,
    Refusal,
    RefusalReason,
    Renewed,
    RenewRequest,
    RenewResult,
    ms_to_datetime,
)

__all__ = ["Lease", "Renewer", "make_owner"]

logger = logging.getLogger("celery_leases")

Clock = Callable[[], float]


class Renewer(Protocol):
    """Where the heartbeat renews a lease: its store, or (while an
    ``exactly_once`` block holds the record's lock) that block's transaction."""

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]: ...


class Lease:
    """A claimed lease on one job, with its fencing token.

    Args:
        job_id: the job key in the store.
        owner: the owner token used for the claim.
        generation: the fencing token the claim returned.
        lease_until_ms: the store's ``lease_until`` (store milliseconds).
        started_at: ``clock()`` read before the claim was sent.
        store: the store the lease lives in (for renewals).
        timing: TTL, renew interval and drift margin of the task.
        task_name: the task's name, for messages.
        on_lost: called once (in the thread that noticed) when the lease is lost.
        on_renewed: called after each accepted renewal (often in a renewal thread).
        clock: the local monotonic clock.
        task_id: the Celery task id of the run (for messages and events).
        hostname: the worker's node name (for messages and events).
    """

    # a running task holds one: slots keep it without an attribute dictionary
    __slots__ = (
        "__weakref__", "_clock", "_deadline", "_finished", "_in_body", "_interrupted",
        "_lease_until_ms", "_lock", "_lost", "_on_lost", "_on_renewed", "_thread_id",
        "_void_before", "completed_in_transaction", "generation", "hostname", "in_transaction",
        "job_id", "next_renew_at", "owner", "renewals", "renewer", "store", "task_id",
        "task_name", "timing",
    )  # fmt: skip

    def __init__(
        self,
        *,
        job_id: str,
        owner: str,
        generation: int,
        lease_until_ms: int,
        started_at: float,
        store: LeaseStore,
        timing: LeaseTiming,
        task_name: str = "",
        on_lost: Callable[[Lease], None] | None = None,
        on_renewed: Callable[[Lease], None] | None = None,
        clock: Clock = time.monotonic,
        task_id: str | None = None,
        hostname: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.task_id = task_id
        self.hostname = hostname
        self.owner = owner
        self.generation = generation
        self.store = store
        #: where the heartbeat renews the lease (the store, unless a block
        #: of celery_leases.exactly_once holds the record)
        self.renewer: Renewer = store
        self.timing = timing
        self.task_name = task_name
        self._clock = clock
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._lock = unpatched.lock()
        self._lease_until_ms = lease_until_ms
        self._deadline = started_at + timing.safe_duration
        #: renewals sent at or before this moment are not applied (void_renewals)
        self._void_before = float("-inf")
        self._lost: LeaseLost | None = None
        #: when the heartbeat should renew next (local monotonic clock)
        self.next_renew_at = started_at + timing.renew_interval
        self._thread_id = threading.get_ident()
        self._in_body = False
        self._interrupted = False
        self._finished = False
        #: renewals the store accepted so far
        self.renewals = 0
        #: the run's completion committed with its writes, in the task's own
        #: transaction (celery_leases.exactly_once): the run is not completed again
        self.completed_in_transaction = False
        #: the run's exactly_once block is open: its transaction holds the
        #: lease record's lock, so the lease cannot be handed over from inside
        self.in_transaction = False

    def __repr__(self) -> str:
        state = "lost" if self.lost else f"{self.remaining():.1f}s left"
        return f"<Lease {self.job_id!r} generation={self.generation} {state}>"

    # -- what task code reads ----------------------------------------------

    @property
    def lease_until(self) -> datetime:
        """When the store lets another worker claim the job (aware UTC, store clock)."""
        return ms_to_datetime(self._lease_until_ms)

    @property
    def lease_until_ms(self) -> int:
        """``lease_until`` in the store's milliseconds."""
        return self._lease_until_ms

    @property
    def deadline(self) -> float:
        """The local safe deadline, on the monotonic clock."""
        return self._deadline

    @property
    def idempotency_key(self) -> str:
        """``"{job_id}:{generation}"``: names this run to fenced targets."""
        return f"{self.job_id}:{self.generation}"

    @property
    def lost(self) -> bool:
        """Whether the lease is lost (refused renewal or passed deadline).

        Reads the clock itself: past the local deadline it is True even if
        no other thread has noticed yet.
        """
        return self.expire_if_due()

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (a ``RefusalReason`` value, ``"deadline"``,
        ``"handed-over"``, ...)."""
        return None if self._lost is None else self._lost.reason

    def remaining(self) -> float:
        """Seconds left before the local safe deadline (0 once lost)."""
        if self._lost is not None:
            return 0.0
        return max(0.0, self._deadline - self._clock())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease is lost or past its deadline."""
        self.expire_if_due()
        if self._lost is not None:
            raise self._error_copy(self._lost)

    def ensure(self, min_remaining: float) -> None:
        """Renew now if less than ``min_remaining`` seconds are left.

        Use it before a step that must not be cut off (for example one
        external call that takes up to ``min_remaining`` seconds).

        Raises:
            LeaseLost: the lease is lost, the renewal was refused, or the
                store could not be reached (then ``reason`` is
                ``"unavailable"`` and the lease itself may still be held).
            LeaseConfigurationError: ``min_remaining`` is more than a
                renewal can ever give (the ttl minus the drift margin).
        """
        if min_remaining >= self.timing.safe_duration:
            raise LeaseConfigurationError(
                f"ensure({min_remaining:g}) asks for more than a renewal gives "
                f"({self.timing.safe_duration:g} s = ttl - drift margin): raise the "
                "task's lease_ttl or ask for less",
                job_id=self.job_id,
                owner=self.owner,
                generation=self.generation,
            )
        self.check()
        if self.remaining() >= min_remaining:
            return
        started = self._clock()
        try:
            result = self.store.renew(self.job_id, self.owner, self.generation, self.timing.ttl)
        except StoreUnavailable as exc:
            raise self._lost_error(
                f"could not renew the lease on job {self.job_id!r} (generation "
                f"{self.generation}) to secure {min_remaining:g} s: the lease store is "
                "unavailable; stop before the next external effect",
                "unavailable",
            ) from exc
        self.apply_renewal(started, result)
        self.check()

    # -- what the heartbeat and the task runner use -------------------------

    def apply_renewal(self, started_at: float, result: Renewed | Refusal) -> None:
        """Record a renewal sent at ``started_at``; a refusal makes the lease lost.

        A renewal that comes back after the local deadline passed does not
        revive the lease: it was lost at the deadline, whatever the store
        says now. A refusal that names this run as the job's completer is
        this run's own completion, not a loss.
        """
        if isinstance(result, Refusal):
            if not self.is_own_completion(result):
                self.mark_lost(result.error("renew"))
            return
        with self._lock:
            if self._lost is not None or self._finished or started_at <= self._void_before:
                return
            expired = self._clock() >= self._deadline
            if not expired:
                self._deadline = max(self._deadline, started_at + self.timing.safe_duration)
                self._lease_until_ms = max(self._lease_until_ms, result.lease_until_ms)
                self.next_renew_at = started_at + self.timing.renew_interval
                self.renewals += 1
        if expired:
            self.mark_lost(self._deadline_error())
            return
        if self._on_renewed is not None:
            try:
                self._on_renewed(self)
            except Exception:
                logger.exception("renewed-lease handler for job %r failed", self.job_id)

    def void_renewals(self, deadline: float, lease_until_ms: int) -> None:
        """Undo the renewals made in a transaction that rolled back.

        The lease keeps at most ``deadline`` and ``lease_until_ms`` (what
        the committed record supports), is due for a renewal now, and a
        renewal sent before this call is not applied when its reply comes::

            block:     BEGIN, lock ... renew (in the transaction) ... ROLLBACK
            heartbeat:                 renew sent ......................... reply: void
        """
        with self._lock:
            now = self._clock()
            self._void_before = now
            self._deadline = min(self._deadline, deadline)
            self._lease_until_ms = min(self._lease_until_ms, lease_until_ms)
            self.next_renew_at = min(self.next_renew_at, now)

    def is_own_completion(self, refusal: Refusal) -> bool:
        """Whether ``refusal`` says the job was completed by this very run
        (this owner and generation): a completion whose reply was lost."""
        return (
            refusal.reason is RefusalReason.COMPLETED
            and refusal.current_owner == self.owner
            and refusal.current_generation == self.generation
        )

    def expire_if_due(self) -> bool:
        """Mark the lease lost if its deadline has passed; returns whether it is lost."""
        if self._lost is None and not self._finished and self._clock() >= self._deadline:
            self.mark_lost(self._deadline_error())
        return self._lost is not None

    def finish(self) -> None:
        """Note that the run no longer needs the lease (completed or released).

        Later refusals and the deadline no longer count as a loss, so no
        lost notice goes out for a run that ended normally.
        """
        with self._lock:
            self._finished = True

    def hand_over(self, how: str) -> None:
        """Note that the run gave the lease up for the run it sent (``how``:
        ``"retry"``, ``"replaced"``).

        From then on the lease reads as lost to this run (``lost_reason``
        ``"handed-over"``): ``check()`` raises, fenced writes refuse, and
        ``remaining()`` is 0. No lost notice goes out: nothing went wrong.
        """
        with self._lock:
            self._finished = True
            if self._lost is None:
                self._lost = self._lost_error(
                    f"the lease on job {self.job_id!r} (generation {self.generation}) was "
                    f"handed over ({how}) to the run this one sent; this run must not "
                    "produce effects any more",
                    "handed-over",
                )

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called."""
        return self._finished

    def mark_lost(self, error: LeaseLost) -> bool:
        """Make the lease lost with ``error``; only the first call notifies.

        Returns:
            True if this call made the lease lost.
        """
        with self._lock:
            if self._lost is not None or self._finished:
                return False
            self._lost = error
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                logger.exception("lost-lease handler for job %r failed", self.job_id)
        return True

    @property
    def loss(self) -> LeaseLost | None:
        """The error that made the lease lost, if it is."""
        return self._lost

    @property
    def in_body(self) -> bool:
        """Whether the task body is running now."""
        return self._in_body

    def enter_body(self) -> None:
        """Note that the task body starts running in this thread.

        The lease is looked at again first, under the lock a loss is noted
        under, so a loss noticed between the claim and the body (a claim
        reply that came back late, a slow ``lease_claimed`` receiver) is
        never missed: either it is seen here and the body does not start, or
        it comes later and finds the body running (and interrupts or stops
        it, as configured)::

            claim ... reply late ... lease_claimed ... enter_body: lost -> no body

        Raises:
            LeaseLost: the lease is lost or past its deadline; the body must
                not start (protocol duty 1).
        """
        with self._lock:
            if self._lost is None and self._clock() < self._deadline:
                self._thread_id = threading.get_ident()
                self._in_body = True
                return
        self.check()
        raise self._deadline_error()  # finished before its body: never a body either

    def leave_body(self) -> None:
        """Note that the body ended; cancels an interrupt not yet delivered.

        An interrupt lands at most once, possibly inside this very call, so
        callers call it again if it raised :class:`LeaseLost`.
        """
        with self._lock:
            self._in_body = False
            if self._interrupted:
                # a NULL exception clears one that is still pending
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)

    def interrupt(self) -> bool:
        """Raise :class:`LeaseLost` asynchronously in the body's thread.

        It lands at the next bytecode boundary of that thread, not inside a
        blocking C call (a socket read, ``time.sleep``): it waits until that
        call returns. Never sent twice, never outside the body, never to the
        calling thread.

        Returns:
            True if the interrupt was scheduled.
        """
        error = self._lost
        if error is None:
            return False
        with self._lock:
            if not self._in_body or self._interrupted or self._thread_id == threading.get_ident():
                return False
            self._interrupted = True
            interrupt_type = _interrupt_type(error)
            count = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread_id), ctypes.py_object(interrupt_type)
            )
            return bool(count == 1)

    # -- helpers -------------------------------------------------------------

    def _lost_error(self, message: str, reason: str) -> LeaseLost:
        """A :class:`LeaseLost` naming this lease's job, owner and generation."""
        return LeaseLost(
            message,
            job_id=self.job_id,
            owner=self.owner,
            generation=self.generation,
            reason=reason,
        )

    def _deadline_error(self) -> LeaseLost:
        return self._lost_error(
            f"the lease on job {self.job_id!r} (generation {self.generation}) passed its "
            "local safe deadline without a renewal; another worker may hold the job now, "
            "so stop producing effects",
            "deadline",
        )

    @staticmethod
    def _error_copy(error: LeaseLost) -> LeaseLost:
        copy = LeaseLost(
            str(error),
            job_id=error.job_id or "",
            owner=error.owner,
            generation=error.generation,
            reason=error.reason,
        )
        copy.__cause__ = error.__cause__
        return copy


def _interrupt_type(error: LeaseLost) -> type[LeaseLost]:
    """A LeaseLost subclass that builds ``error``'s twin with no arguments.

    CPython instantiates an asynchronous exception class without arguments,
    and LeaseLost needs its job fields.
    """

    class LeaseLostInterrupt(LeaseLost):
        def __init__(self) -> None:
            super().__init__(
                str(error),
                job_id=error.job_id or "",
                owner=error.owner,
                generation=error.generation,
                reason=error.reason,
            )

    return LeaseLostInterrupt
