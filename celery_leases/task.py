"""``LeasedTask``: a Celery task whose body runs only while it holds a lease.

Everything happens inside ``__call__``, because Celery stores the result
right after it returns::

    claim ──Acquired──▶ body ──returns──▶ complete ──Completed──▶ result stored
      │         │         │                   └─Refusal─▶ fenced out: Ignore
      │         │         ├─raises──▶ release, re-raise (FAILURE / RETRY)
      │         │         └─raises, lease lost──▶ fenced out: Ignore
      │         └─lost before the body starts──▶ fenced out: Ignore (no body)
      ├─HeldElsewhere──▶ publish again with a countdown, Ignore
      │    (lease_on_busy="skip", another send holds it)──▶ LeaseSkipped (FAILURE)
      ├─AlreadyCompleted (same send)──▶ answer with the stored result
      └─StoreUnavailable──▶ publish again with backoff, Ignore

Which deliveries are the same run is decided by send ids
(:mod:`celery_leases.sending`); a claim on a job this thread already holds
(``replace()`` or a retry run eagerly, recursion on a custom key) runs
inside the holder's lease. A fenced-out run releases what it may still hold
and publishes its message again, unless the same task id was completed by
another delivery, so a job is never dropped (invariant I6).
"""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task
from celery._state import _task_stack  # no public API; tests/unit/test_layout.py pins it
from celery.exceptions import Ignore, Reject, Retry

from celery_leases import observe, signals
from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseError,
    LeaseLost,
    LeaseSkipped,
    StoreUnavailable,
)
from celery_leases.heartbeat import process_heartbeat
from celery_leases.lease import Lease, make_owner
from celery_leases.losses import fenced_out, react_to_loss, reject_poison
from celery_leases.notify import notify
from celery_leases.publish import DEFERRALS_HEADER
from celery_leases.queue_unique import check_queue_unique_key, send_unique
from celery_leases.run_steps import (
    UNKNOWN_COMPLETION,
    answer_completed,
    answer_held,
    complete_run,
    defer_unavailable,
    release,
)
from celery_leases.runs import Run, innermost, pop, push, running
from celery_leases.runtime import (
    TaskOptions,
    app_bound,
    forget_runtime,
    settings_for,
    store_for,
    task_options,
)
from celery_leases.sending import send_id_for
from celery_leases.settings import (
    LeaseTiming,
    OnBusy,
    OnLost,
    check_defer_max,
    check_max_takeovers,
    check_on_busy,
    check_on_lost,
    check_queue_unique,
)
from celery_leases.stores.base import Acquired, AlreadyCompleted, HeldElsewhere, Refusal
from celery_leases.wake import ran_already

__all__ = ["DEFERRALS_HEADER", "LeasedTask", "forget_runtime", "settings_for", "store_for"]

logger = logging.getLogger("celery_leases")


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
    #: tells the task its message's content type, so a copy keeps it
    Request = "celery_leases.request:LeasedRequest"
    #: a skipped call (``lease_on_busy="skip"``) is an expected outcome: Celery
    #: logs it without a traceback; a subclass's own ``throws`` keep it too
    throws: tuple[type[BaseException], ...] = (LeaseSkipped,)

    lease_ttl: float | None = None
    lease_renew_interval: float | None = None
    lease_drift_margin: float | None = None
    lease_on_lost: OnLost | None = None
    #: None: the task id; a format string over the arguments; or a callable
    #: taking the task's (*args, **kwargs) and returning the key
    lease_key: str | Callable[..., str] | None = None
    lease_max_takeovers: int | None = None
    lease_defer_max: float | None = None
    #: a call whose key another send holds: ``"wait"`` (run after it) or
    #: ``"skip"`` (not run; its result is ``LeaseSkipped``)
    lease_on_busy: OnBusy | None = None

    #: at most one queued job per ``lease_key``: True (marks last at most
    #: ``DEFAULT_QUEUED_FOR`` s) or the seconds a mark lasts at most; see
    #: :mod:`celery_leases.queue_unique`
    lease_queue_unique: bool | float = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # ``@app.task(base=LeasedTask, ...)`` makes a subclass: a wrong mode
        # is refused where the task is defined, not at its first call
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or cls.__qualname__
        if cls.lease_on_busy is not None:
            check_on_busy(cls.lease_on_busy, f"{name}.lease_on_busy")
        if "name" in cls.__dict__:  # a task, whose key is known by now
            check_queue_unique_key(name, cls.lease_queue_unique, cls.lease_key)
        else:  # a base class may leave the key to its tasks
            check_queue_unique(cls.lease_queue_unique, f"{name}.lease_queue_unique")
        if not issubclass(LeaseSkipped, tuple(cls.throws)):
            cls.throws = (*cls.throws, LeaseSkipped)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # bound to its app, a task has its final options (task_annotations
        # applied) and its name (a task class registered without one)
        name = cls.name or cls.__qualname__
        check_queue_unique_key(name, cls.lease_queue_unique, cls.lease_key)
        app_bound(app)  # the worker integration installs its bootstep on this

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """Celery's ``apply_async``; with ``lease_queue_unique``, a key that has
        a job queued gets that job's ``AsyncResult`` (``lease_coalesced`` True)
        and nothing is published."""
        if task_id is not None:
            options["task_id"] = task_id
        return send_unique(self, super().apply_async, args, kwargs, options)

    # -- what task code uses -------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease of the running body.

        Raises:
            LeaseError: no leased run of this task is running in this thread.
        """
        for run in innermost():
            if run.task_name == self.name:
                return run.lease
        raise LeaseError(
            f"task {self.name!r} holds no lease here: self.lease is only available inside "
            "the body of a running LeasedTask (not from other threads or callbacks)"
        )

    def on_lease_lost(self, lease: Lease) -> None:
        """Called once when the lease of a running body is lost; override it.

        It runs on the notifier thread: do not use ``self.request`` there.
        """

    # -- resolved options ----------------------------------------------------

    def lease_timing(self) -> LeaseTiming:
        """This task's TTL, renew interval and drift margin, validated."""
        return settings_for(self.app).timing(
            self.lease_ttl, self.lease_renew_interval, self.lease_drift_margin
        )

    def lease_on_lost_mode(self) -> OnLost:
        """This task's ``on_lost`` mode, validated."""
        if self.lease_on_lost is None:
            return settings_for(self.app).on_lost
        return check_on_lost(self.lease_on_lost, f"{self.name}.lease_on_lost")

    def lease_on_busy_mode(self) -> OnBusy:
        """This task's ``on_busy`` mode, validated."""
        if self.lease_on_busy is None:
            return settings_for(self.app).on_busy
        return check_on_busy(self.lease_on_busy, f"{self.name}.lease_on_busy")

    def lease_takeover_limit(self) -> int | None:
        """This task's takeover limit (None: no limit), validated."""
        if self.lease_max_takeovers is None:
            return settings_for(self.app).max_takeovers
        return check_max_takeovers(self.lease_max_takeovers, f"{self.name}.lease_max_takeovers")

    def lease_defer_limit(self) -> float:
        """The longest deferral of this task (seconds), validated."""
        settings = settings_for(self.app)
        if self.lease_defer_max is None:
            return settings.defer_max
        return check_defer_max(self.lease_defer_max, f"{self.name}.lease_defer_max")

    def lease_options(self) -> TaskOptions:
        """Every lease option of this task, resolved once per process."""
        return task_options(
            self.app,
            self.name,
            lambda: TaskOptions(
                self.lease_timing(),
                self.lease_on_lost_mode(),
                self.lease_takeover_limit(),
                self.lease_defer_limit(),
                self.app.conf.result_serializer,
                settings_for(self.app).result_max_bytes,
                self.lease_on_busy_mode(),
            ),
        )

    def lease_job_id(
        self, task_id: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """The job key for a run with these arguments (see ``lease_key``)."""
        key = type(self).lease_key  # from the class: a function must not bind
        if key is None:
            return task_id or uuid.uuid4().hex
        try:
            if isinstance(key, str):
                job_id = key.format(*args, **{**self._named_arguments(args), **kwargs})
            else:
                job_id = key(*args, **kwargs)
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

    def _named_arguments(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """Positional arguments by parameter name, so a key can name them."""
        if not args:
            return {}
        signature = self.__dict__.get("_lease_signature")
        if signature is None:
            signature = self.__dict__["_lease_signature"] = inspect.signature(self.run)
        try:
            return dict(signature.bind_partial(*args).arguments)
        except TypeError:
            return {}

    # -- Celery's own ways to end a run --------------------------------------------

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, which first gives the lease up, fenced.

        A stale run (lease lost, or the release refused) is fenced out: no
        retry message is published and nothing is written.
        """
        self._hand_over("retry")
        return super().retry(*args, **kwargs)

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``on_replace``, which first gives the lease up, fenced."""
        self._hand_over("replaced")
        return super().on_replace(sig)

    def _hand_over(self, reason: str) -> None:
        request = self.request
        run = self._current_run()
        if run is not None and run.lease.in_transaction:
            _refuse_inside_transaction(run.lease, reason)
        if run is None or request.is_eager or request.called_directly or run.handed_over:
            return  # eager: the new run nests inside this one's lease
        lease = run.lease
        if lease.lost or not release(self, lease, reason):
            fenced_out(self, lease, request, request.args, request.kwargs, lease.lost_reason)
        lease.hand_over(reason)  # the next run holds the job: this one reads lost
        run.handed_over = True

    def _current_run(self) -> Run | None:
        request = self.request
        for run in innermost():
            if run.request is request:
                return run
        return None

    # -- the run ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        top = self.request_stack.top
        if top is not None and not running(top):
            return self._run_leased(args, kwargs)
        # called directly (also from inside a running body): a request of its own
        # Celery has no public way to make a task the current one for a direct call
        # (its own Task.__call__ pushes this stack); tests/integration/
        # test_task_semantics.py pins it (a direct call is the current task).
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs, called_directly=True)
        try:
            return self._run_leased(args, kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _run_leased(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        app = self.app
        options = self.lease_options()
        # a direct call inside a body sees the outer request's id, as in plain
        # Celery, but it is a run of its own
        task_id = None if request.called_directly else request.id
        job_id = self.lease_job_id(task_id, args, kwargs)
        owner = make_owner()
        try:
            store = store_for(app)
            for run in innermost():
                if run.lease.job_id == job_id and run.lease.store is store:
                    return self._run_nested(run, request, args, kwargs)
            started = time.monotonic()  # before the claim is sent
            send_id = send_id_for(request, job_id)
            claim = store.claim(
                job_id,
                owner,
                options.timing.ttl,
                task_name=self.name,
                send_id=send_id,
                task_id=task_id,
            )
        except StoreUnavailable as exc:
            defer_unavailable(self, request, args, kwargs, job_id, options.defer_max, exc)
        if isinstance(claim, AlreadyCompleted):
            return answer_completed(self, request, claim)
        if isinstance(claim, HeldElsewhere):
            answer_held(self, request, args, kwargs, claim, send_id, options)
        lease = self._make_lease(claim, started, store, options, request)
        if ran_already(self, lease, request, send_id):
            # another copy of this waiting send ran: this one is its duplicate
            release(self, lease, "duplicate")
            raise Ignore()
        limit = options.takeover_limit
        if limit is not None and claim.takeovers > limit:
            reject_poison(self, lease, claim, limit, args, kwargs)
        run = Run(self.name, lease, request)
        push(run)
        heartbeat = process_heartbeat()
        heartbeat.add(lease)
        observe.send(
            signals.lease_claimed, self, lease=lease, job_id=job_id, takeovers=claim.takeovers
        )
        try:
            return self._run_body(run, args, kwargs, options)
        finally:
            heartbeat.remove(lease)
            pop(run)

    def _run_nested(
        self, holder: Run, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run inside the lease this thread already holds on the same job.

        Raises:
            LeaseLost: the holder's lease is lost (``lease_on_lost="flag"``
                lets the holder's body go on): a body never starts on it.
        """
        holder.lease.check()
        run = Run(self.name, holder.lease, request)
        push(run)
        try:
            return self.run(*args, **kwargs)
        finally:
            pop(run)

    def _make_lease(
        self,
        claim: Acquired,
        started: float,
        store: Any,
        options: TaskOptions,
        request: Any,
    ) -> Lease:
        on_lost, on_renewed = self._lease_callbacks(options.on_lost)
        return Lease(
            job_id=claim.job_id,
            owner=claim.owner,
            generation=claim.generation,
            lease_until_ms=claim.lease_until_ms,
            started_at=started,
            store=store,
            timing=options.timing,
            task_name=self.name,
            on_lost=on_lost,
            on_renewed=on_renewed,
            task_id=request.id,
            hostname=request.hostname,
        )

    def _lease_callbacks(self, mode: OnLost) -> tuple[Callable[[Lease], None], ...]:
        """The ``on_lost`` and ``on_renewed`` of this task's leases, made once per
        mode (a pair of closures per run would cost each running task 400 bytes)."""
        cached = self.__dict__.get("_lease_callback_pair")
        if cached is not None and cached[0] == mode:
            return cached[1:]  # type: ignore[no-any-return]

        def on_lost(lease: Lease) -> None:
            react_to_loss(self, lease, mode)

        def on_renewed(lease: Lease) -> None:
            notify(signals.lease_renewed.send, sender=self, lease=lease, job_id=lease.job_id)

        self.__dict__["_lease_callback_pair"] = (mode, on_lost, on_renewed)
        return on_lost, on_renewed

    def _run_body(
        self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any], options: TaskOptions
    ) -> Any:
        lease, request = run.lease, run.request
        try:
            try:
                # raises LeaseLost if the lease was lost since the claim: the
                # body never starts, and the run is fenced out below
                lease.enter_body()
                value = self.run(*args, **kwargs)
            finally:
                _leave_body(lease)
        except Retry:
            if not run.handed_over:  # eager: retried at once by apply()
                release(self, lease, "retry")
            raise
        except (Ignore, Reject):
            if not run.handed_over:
                release(self, lease, "ignored")
            raise
        except Exception as exc:
            # a stale run's FAILURE would overwrite the real holder's result
            if not run.handed_over and (lease.lost or not release(self, lease, "failure")):
                fenced_out(self, lease, request, args, kwargs, lease.lost_reason, exc)
            raise
        except BaseException:
            if not lease.lost and not run.handed_over:
                release(self, lease, "interrupted")
            raise
        if run.handed_over:
            # retry(throw=False): the retry message is out and claims the job next
            return value
        if lease.lost and not lease.completed_in_transaction:
            fenced_out(self, lease, request, args, kwargs, lease.lost_reason)
        result = complete_run(self, lease, value, options)
        if result is None:
            fenced_out(self, lease, request, args, kwargs, UNKNOWN_COMPLETION)
        if isinstance(result, Refusal):
            lease.mark_lost(result.error("complete"))
            fenced_out(self, lease, request, args, kwargs, result.reason.value)
        observe.send(signals.lease_completed, self, lease=lease, job_id=lease.job_id)
        return value


def _refuse_inside_transaction(lease: Lease, reason: str) -> NoReturn:
    """``retry()`` or ``replace()`` inside an ``exactly_once`` block.

    The block's transaction holds the lease record's lock until it ends:
    a release sent now would wait for that lock (the store's lock timeout,
    then the new run waits for the lease to run out), and ending the
    transaction here would leave the block's code running on a finished
    one. The block ends first, then the run can hand the lease over.
    """
    call = "self.retry()" if reason == "retry" else "self.replace()"
    raise LeaseConfigurationError(
        f"{call} was called inside the exactly_once block of job {lease.job_id!r} "
        f"(generation {lease.generation}): the block's transaction holds the lease "
        f"record's lock until it ends, so the lease cannot be handed over from inside it. "
        f"The block is rolled back and nothing was written; call {call} after the "
        "block (raise inside it, catch outside, then retry)",
        job_id=lease.job_id,
        owner=lease.owner,
        generation=lease.generation,
    )


def _leave_body(lease: Lease) -> None:
    # an interrupt sent just before the body ended may land in here, once
    try:
        lease.leave_body()
    except LeaseLost:
        lease.leave_body()
