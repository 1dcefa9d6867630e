"""``LeasedTask``: a Celery task whose body runs only while it holds a lease.

Everything happens inside ``__call__``, because Celery stores the result
right after it returns::

    claim ──Acquired──▶ body ──returns──▶ complete ──Completed──▶ result stored
      │                   │                   └─Refusal─▶ fenced out: Ignore
      │                   ├─raises──▶ release, re-raise (FAILURE / RETRY)
      │                   └─raises, lease lost──▶ fenced out: Ignore
      ├─HeldElsewhere──▶ publish again with a countdown, Ignore
      ├─AlreadyCompleted──▶ Ignore (the stored result stays)
      └─StoreUnavailable──▶ publish again with backoff, Ignore

A fenced-out run also publishes its message again (the copy finds the job
completed, held or free), so a job is never dropped (invariant I6).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from celery import Task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry

from celery_leases import events, signals
from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    StoreUnavailable,
    TakeoverLimitExceeded,
)
from celery_leases.heartbeat import process_heartbeat
from celery_leases.lease import Lease, make_owner
from celery_leases.settings import (
    LeaseSettings,
    LeaseTiming,
    OnLost,
    check_max_takeovers,
    check_on_lost,
)
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.base import (
    Acquired,
    AlreadyCompleted,
    Completed,
    CompleteResult,
    HeldElsewhere,
    Refusal,
)
from celery_leases.worker import in_prefork_child, install

__all__ = ["DEFERRALS_HEADER", "LeasedTask", "settings_for", "store_for"]

logger = logging.getLogger("celery_leases")

#: message header counting how often a message was deferred
DEFERRALS_HEADER = "leases_deferrals"


# --- per-app, per-process runtime ---------------------------------------------


@dataclass(frozen=True)
class _TaskOptions:
    """A task's lease options with the app's settings applied, validated."""

    timing: LeaseTiming
    on_lost: OnLost
    takeover_limit: int | None


@dataclass
class _Runtime:
    settings: LeaseSettings
    pid: int
    store: LeaseStore | None = None
    #: resolved once per task name, so a run does not validate them again
    options: dict[str, _TaskOptions] = field(default_factory=dict)


_runtimes: weakref.WeakKeyDictionary[Any, _Runtime] = weakref.WeakKeyDictionary()
_runtimes_lock = threading.Lock()


def _runtime(app: Any) -> _Runtime:
    with _runtimes_lock:
        runtime = _runtimes.get(app)
        if runtime is None or runtime.pid != os.getpid():
            # a forked child must not share the parent's sockets
            runtime = _Runtime(LeaseSettings.from_conf(app.conf), os.getpid())
            _runtimes[app] = runtime
        return runtime


def settings_for(app: Any) -> LeaseSettings:
    """The validated lease settings of ``app`` (read once per process).

    Raises:
        LeaseConfigurationError: a ``leases_*`` setting is missing or invalid.
    """
    return _runtime(app).settings


def store_for(app: Any) -> LeaseStore:
    """The lease store of ``app`` in this process, opened on first use."""
    runtime = _runtime(app)
    with _runtimes_lock:
        if runtime.store is None:
            runtime.store = open_store(
                runtime.settings.store_url, **dict(runtime.settings.store_options)
            )
        return runtime.store


def forget_runtime(app: Any) -> None:
    """Drop the cached settings and store of ``app`` (after a config change)."""
    with _runtimes_lock:
        runtime = _runtimes.pop(app, None)
    if runtime is not None and runtime.store is not None and runtime.pid == os.getpid():
        runtime.store.close()


# --- the lease stack of the running thread ------------------------------------


class _Local(threading.local):
    def __init__(self) -> None:
        self.leases: list[Lease] = []


_local = _Local()


# --- the task -------------------------------------------------------------------


class LeasedTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """Base class of tasks that run only while they hold a lease.

    Use it as ``@app.task(base=LeasedTask, bind=True)``. Each ``lease_*``
    attribute can be set on a subclass or as a keyword of ``@app.task``;
    ``None`` means "use the app's ``leases_*`` setting".
    """

    acks_late = True
    #: a killed worker's message goes back to the queue; the lease decides
    #: whether the copy runs, and ``lease_max_takeovers`` stops poison jobs
    reject_on_worker_lost = True

    lease_ttl: float | None = None
    lease_renew_interval: float | None = None
    lease_drift_margin: float | None = None
    lease_on_lost: OnLost | None = None
    #: None: the task id; a format string over the arguments; or a callable
    #: taking the task's (*args, **kwargs) and returning the key
    lease_key: str | Callable[..., str] | None = None
    lease_max_takeovers: int | None = None
    lease_defer_max: float | None = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install(app)

    # -- what task code uses -------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease of the running body.

        Raises:
            LeaseError: no leased run of this task is running in this thread.
        """
        for lease in reversed(_local.leases):
            if lease.task_name == self.name:
                return lease
        raise LeaseError(
            f"task {self.name!r} holds no lease here: self.lease is only available inside "
            "the body of a running LeasedTask (not from other threads or callbacks)"
        )

    def on_lease_lost(self, lease: Lease) -> None:
        """Called once when the lease of a running body is lost; override it.

        It may run in the heartbeat thread: keep it quick, and do not use
        ``self.request`` there.
        """

    # -- resolved options ----------------------------------------------------

    def lease_timing(self) -> LeaseTiming:
        """This task's TTL, renew interval and drift margin, validated."""
        return settings_for(self._get_app()).timing(
            self.lease_ttl, self.lease_renew_interval, self.lease_drift_margin
        )

    def lease_on_lost_mode(self) -> OnLost:
        """This task's ``on_lost`` mode, validated."""
        if self.lease_on_lost is None:
            return settings_for(self._get_app()).on_lost
        return check_on_lost(self.lease_on_lost, f"{self.name}.lease_on_lost")

    def lease_takeover_limit(self) -> int | None:
        """This task's takeover limit (None: no limit), validated."""
        if self.lease_max_takeovers is None:
            return settings_for(self._get_app()).max_takeovers
        return check_max_takeovers(self.lease_max_takeovers, f"{self.name}.lease_max_takeovers")

    def lease_job_id(
        self, task_id: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """The job key for a run with these arguments (see ``lease_key``)."""
        key = type(self).lease_key  # from the class: a function must not bind
        if key is None:
            return task_id or uuid.uuid4().hex
        try:
            job_id = key.format(*args, **kwargs) if isinstance(key, str) else key(*args, **kwargs)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LeaseConfigurationError(
                f"lease_key of task {self.name!r} could not be built from args={args!r} "
                f"kwargs={kwargs!r}: {exc!r}; make it match the task's arguments"
            ) from exc
        if not isinstance(job_id, str) or not job_id:
            raise LeaseConfigurationError(
                f"lease_key of task {self.name!r} returned {job_id!r}; it must return a "
                "non-empty string"
            )
        return job_id

    # -- the run ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is not None:
            return self._run_leased(args, kwargs)
        # called directly: push a request like Task.__call__ does
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return self._run_leased(args, kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _lease_options(self) -> _TaskOptions:
        runtime = _runtime(self._get_app())
        options = runtime.options.get(self.name)
        if options is None:
            options = _TaskOptions(
                self.lease_timing(), self.lease_on_lost_mode(), self.lease_takeover_limit()
            )
            runtime.options[self.name] = options
        return options

    def _run_leased(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        settings = settings_for(self._get_app())
        options = self._lease_options()
        timing = options.timing
        job_id = self.lease_job_id(request.id, args, kwargs)
        store = store_for(self._get_app())
        owner = make_owner()
        started = time.monotonic()  # before the claim is sent
        try:
            claim = store.claim(job_id, owner, timing.ttl, task_name=self.name)
        except StoreUnavailable as exc:
            self._defer_unavailable(request, args, kwargs, job_id, settings, exc)
        if isinstance(claim, AlreadyCompleted):
            logger.info(
                "task %s[%s]: job %r was already completed by generation %d; skipping",
                self.name, request.id, job_id, claim.generation,
            )  # fmt: skip
            raise Ignore()
        if isinstance(claim, HeldElsewhere):
            self._defer_held(request, args, kwargs, claim, settings)
        lease = self._make_lease(claim, started, store, timing, options.on_lost, request)
        limit = options.takeover_limit
        if limit is not None and claim.takeovers > limit:
            self._reject_poison(lease, claim, limit)
        _local.leases.append(lease)
        heartbeat = process_heartbeat()
        heartbeat.add(lease)
        signals.lease_claimed.send(
            sender=self, lease=lease, job_id=job_id, takeovers=claim.takeovers
        )
        try:
            return self._run_body(lease, request, args, kwargs)
        finally:
            heartbeat.remove(lease)
            _local.leases.remove(lease)

    def _make_lease(
        self,
        claim: Acquired,
        started: float,
        store: LeaseStore,
        timing: LeaseTiming,
        mode: OnLost,
        request: Any,
    ) -> Lease:
        task_id, hostname = request.id, request.hostname

        def on_lost(lease: Lease) -> None:
            self._lease_lost(lease, mode, task_id, hostname)

        return Lease(
            job_id=claim.job_id,
            owner=claim.owner,
            generation=claim.generation,
            lease_until_ms=claim.lease_until_ms,
            started_at=started,
            store=store,
            timing=timing,
            task_name=self.name,
            on_lost=on_lost,
            on_renewed=self._lease_renewed,
        )

    def _run_body(
        self, lease: Lease, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            try:
                lease.enter_body()
                value = self.run(*args, **kwargs)
            finally:
                _leave_body(lease)
        except Retry:
            # the retry message is out already: it claims the next generation
            if lease.lost:
                self._fenced_out(lease, request, args, kwargs, "lost", republish=False)
            self._release(lease, "retry")
            raise
        except (Ignore, Reject):
            self._release(lease, "ignored")
            raise
        except Exception as exc:
            # a stale run's FAILURE would overwrite the real holder's result
            if lease.lost or not self._release(lease, "failure"):
                self._fenced_out(lease, request, args, kwargs, lease.lost_reason or "lost", exc)
            raise
        except BaseException:
            if not lease.lost:
                self._release(lease, "interrupted")
            raise
        if lease.lost:
            self._fenced_out(lease, request, args, kwargs, lease.lost_reason or "lost")
        result = self._complete(lease)
        if result is None:
            self._fenced_out(lease, request, args, kwargs, "completion-unknown")
        if isinstance(result, Refusal):
            lease.mark_lost(result.error("complete"))
            self._fenced_out(lease, request, args, kwargs, result.reason.value)
        signals.lease_completed.send(sender=self, lease=lease, job_id=lease.job_id)
        return value

    # -- store steps -------------------------------------------------------------

    def _complete(self, lease: Lease) -> CompleteResult | None:
        """Complete, retrying an unavailable store until the local deadline.

        Returns None when the outcome is unknown.
        """
        delay = 0.05
        while True:
            try:
                return lease.store.complete(lease.job_id, lease.owner, lease.generation)
            except StoreUnavailable as exc:
                if lease.remaining() <= delay:
                    logger.error(
                        "could not complete job %r (generation %d): %s; the body ran but "
                        "the completion is unknown, so the message is published again",
                        lease.job_id, lease.generation, exc,
                    )  # fmt: skip
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _release(self, lease: Lease, reason: str) -> bool:
        """Release after a failure or retry; False if the store refused (stale)."""
        try:
            result = lease.store.release(lease.job_id, lease.owner, lease.generation)
        except StoreUnavailable as exc:
            logger.warning(
                "could not release job %r (generation %d) after %s: %s; it runs out in %g s",
                lease.job_id, lease.generation, reason, exc, lease.timing.ttl,
            )  # fmt: skip
            return True
        if isinstance(result, Refusal):
            lease.mark_lost(result.error("release"))
            return False
        signals.lease_released.send(sender=self, lease=lease, job_id=lease.job_id, reason=reason)
        return True

    def _reject_poison(self, lease: Lease, claim: Acquired, limit: int) -> NoReturn:
        result = self._complete(lease)
        message = (
            f"job {claim.job_id!r} of task {self.name!r} took over a run-out lease "
            f"{claim.takeovers} times (limit {limit}): every worker that ran it died or "
            "stalled, so it is recorded as failed without running; fix the task, then "
            "send it with a new id, or raise lease_max_takeovers"
        )
        logger.error(message)
        if not isinstance(result, Completed):
            raise Ignore()
        signals.lease_completed.send(sender=self, lease=lease, job_id=lease.job_id)
        raise TakeoverLimitExceeded(
            message,
            job_id=claim.job_id,
            owner=claim.owner,
            generation=claim.generation,
            takeovers=claim.takeovers,
            limit=limit,
        )

    def _lease_renewed(self, lease: Lease) -> None:
        signals.lease_renewed.send(sender=self, lease=lease, job_id=lease.job_id)

    # -- lost leases and fenced-out runs ---------------------------------------

    def _lease_lost(
        self, lease: Lease, mode: OnLost, task_id: str | None, host: str | None
    ) -> None:
        error = lease.loss
        reason = lease.lost_reason
        logger.warning("task %s[%s]: %s", self.name, task_id, error)
        signals.lease_lost.send(
            sender=self, lease=lease, job_id=lease.job_id, reason=reason, error=error
        )
        try:
            self.on_lease_lost(lease)
        except Exception:
            logger.exception("on_lease_lost of task %s[%s] failed", self.name, task_id)
        events.send_task_event(
            self._get_app(), events.LEASE_LOST, task_id=task_id, hostname=host,
            job_id=lease.job_id, generation=lease.generation, reason=reason,
        )  # fmt: skip
        if mode == "stop" and lease.in_body:
            if in_prefork_child():
                logger.warning("lease lost: stopping pool process %d (lease_on_lost='stop')",
                               os.getpid())  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)
            logger.warning(
                "lease_on_lost='stop' needs the prefork pool; raising LeaseLost in the task "
                "instead, since stopping this process would stop the whole worker"
            )
            mode = "raise"
        if mode == "raise":
            lease.interrupt()

    def _fenced_out(
        self,
        lease: Lease,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str,
        cause: BaseException | None = None,
        *,
        republish: bool = True,
    ) -> NoReturn:
        logger.warning(
            "task %s[%s]: run of job %r with generation %d is fenced out (%s); its result "
            "is not recorded",
            self.name, request.id, lease.job_id, lease.generation, reason,
        )  # fmt: skip
        signals.lease_fenced_out.send(sender=self, lease=lease, job_id=lease.job_id, reason=reason)
        events.send_task_event(
            self._get_app(), events.LEASE_FENCED_OUT, task_id=request.id,
            hostname=request.hostname, job_id=lease.job_id, generation=lease.generation,
            reason=reason,
        )  # fmt: skip
        if _cannot_publish(request):
            raise lease.loss or LeaseLost(
                f"run of job {lease.job_id!r} (generation {lease.generation}) was fenced "
                f"out: {reason}",
                job_id=lease.job_id, owner=lease.owner, generation=lease.generation,
                reason=reason,
            ) from cause  # fmt: skip
        if republish:
            settings = settings_for(self._get_app())
            countdown = min(lease.timing.ttl, self._defer_max(settings))
            self._publish_again(request, args, kwargs, lease.job_id, "fenced-out", countdown,
                                lease=lease)  # fmt: skip
        raise Ignore() from cause

    # -- deferrals ---------------------------------------------------------------

    def _defer_held(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        claim: HeldElsewhere,
        settings: LeaseSettings,
    ) -> NoReturn:
        if _cannot_publish(request):
            raise LeaseHeld(
                f"job {claim.job_id!r} is held by {claim.holder} (generation "
                f"{claim.generation}) for {claim.remaining:.1f} s more; an eager or direct "
                "call cannot be deferred, so try again later",
                job_id=claim.job_id,
                holder=claim.holder,
                generation=claim.generation,
                remaining=claim.remaining,
            )
        countdown = min(claim.remaining + random.uniform(0.5, 1.0), self._defer_max(settings))
        self._publish_again(
            request, args, kwargs, claim.job_id, "held", countdown, holder=claim.holder
        )
        raise Ignore()

    def _defer_unavailable(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        job_id: str,
        settings: LeaseSettings,
        exc: StoreUnavailable,
    ) -> NoReturn:
        if _cannot_publish(request):
            raise exc
        deferrals = _deferrals(request)
        backoff = settings.defer_backoff * 2 ** min(deferrals, 30)
        countdown = min(backoff * random.uniform(1.0, 1.2), self._defer_max(settings))
        logger.warning(
            "task %s[%s]: lease store unavailable at claim (%s); deferring %.1f s",
            self.name, request.id, exc, countdown,
        )  # fmt: skip
        self._publish_again(request, args, kwargs, job_id, "store-unavailable", countdown)
        raise Ignore() from exc

    def _defer_max(self, settings: LeaseSettings) -> float:
        return settings.defer_max if self.lease_defer_max is None else float(self.lease_defer_max)

    def _publish_again(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        job_id: str,
        reason: str,
        countdown: float,
        *,
        holder: str | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Publish this message again (same id, arguments, options) after ``countdown``.

        Raises:
            Reject: publishing failed; the broker keeps the message (requeue).
        """
        deferrals = _deferrals(request) + 1
        headers = {**(request.headers or {}), DEFERRALS_HEADER: deferrals}
        try:
            self.signature_from_request(
                request, args, kwargs, countdown=countdown, headers=headers
            ).apply_async()
        except Exception as exc:
            logger.error(
                "task %s[%s]: could not publish job %r again (%r); requeueing the message",
                self.name, request.id, job_id, exc,
            )  # fmt: skip
            raise Reject(exc, requeue=True) from exc
        logger.info(
            "task %s[%s]: job %r deferred %.1f s (%s, deferral %d)",
            self.name, request.id, job_id, countdown, reason, deferrals,
        )  # fmt: skip
        signals.duplicate_deferred.send(
            sender=self, lease=lease, job_id=job_id, reason=reason, countdown=countdown,
            deferrals=deferrals, holder=holder,
        )  # fmt: skip
        events.send_task_event(
            self._get_app(), events.LEASE_DEFERRED, task_id=request.id,
            hostname=request.hostname, job_id=job_id, reason=reason, countdown=countdown,
            deferrals=deferrals,
        )  # fmt: skip


def _leave_body(lease: Lease) -> None:
    # an interrupt sent just before the body ended may land in here, once
    try:
        lease.leave_body()
    except LeaseLost:
        lease.leave_body()


def _cannot_publish(request: Any) -> bool:
    return bool(request.is_eager or request.called_directly)


def _deferrals(request: Any) -> int:
    value = getattr(request, DEFERRALS_HEADER, None)
    if value is None:
        value = (request.headers or {}).get(DEFERRALS_HEADER, 0)
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0
