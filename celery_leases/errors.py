"""The error tree of celery-leases.

Every error the library raises derives from :class:`LeaseError`, so one
``except LeaseError`` covers them all. The subclasses are the cases a caller
handles differently.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LeaseConfigurationError",
    "LeaseError",
    "LeaseStoreWarning",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecordUnreadable",
    "LeaseSkipped",
    "ResultUnavailable",
    "StaleFencingToken",
    "StoreUnavailable",
    "TakeoverLimitExceeded",
]


class LeaseError(Exception):
    """Root of every error raised by celery-leases.

    Each error's ``args`` are its message and then its attributes, in the
    order its constructor takes them, so ``type(error)(*error.args)`` makes
    the same error: that is how Celery's result backends rebuild an error
    stored with the json serializer (``exception_to_python``), and a
    client's ``AsyncResult.result`` keeps the attributes. ``str(error)``
    is the message alone.

    Attributes:
        job_id: the job the error is about, when there is one.
        owner: the owner token involved, when there is one.
        generation: the generation (fencing token) involved, when there is one.
    """

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        owner: str | None = None,
        generation: int | None = None,
    ) -> None:
        # Exception's own constructor, not the next class's: a subclass that
        # also derives from another exception (the worker's click error)
        # sets that one up itself
        Exception.__init__(self, message, job_id, owner, generation)
        self.job_id = job_id
        self.owner = owner
        self.generation = generation

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild with the same class and attributes without calling the
        # constructor, so a subclass whose constructor takes other
        # arguments pickles whole too.
        return (_rebuild, (type(self), self.args, self.__dict__))


class LeaseHeld(LeaseError):
    """Another worker holds a live lease on the job.

    Attributes:
        holder: owner token of the worker that holds the lease.
        remaining: seconds left on the holder's lease, by the store's clock.
        holder_task_id: the task id of the run that holds the job ("" when
            not known).
    """

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        holder: str = "",
        generation: int | None = None,
        remaining: float = 0.0,
        holder_task_id: str = "",
    ) -> None:
        super().__init__(message, job_id=job_id, owner=holder, generation=generation)
        self.args = (message, job_id, holder, generation, remaining, holder_task_id)
        self.holder = holder
        self.remaining = remaining
        self.holder_task_id = holder_task_id


class LeaseSkipped(LeaseHeld):
    """A call was not run because another send held its job (``lease_on_busy="skip"``).

    The call's message is acknowledged and not published again; this error
    is its result (state ``FAILURE``), so ``result.get()`` raises it at once,
    and ``result.get(propagate=False)`` returns it, with its attributes,
    through the json serializer as through pickle.

    Its ``holder_task_id`` is the task id of the run that holds the job
    ("" when the store does not know it).
    """


class LeaseLost(LeaseError):
    """The caller no longer holds the lease it thinks it holds.

    Raised when a renewal, completion or release is refused (another worker
    claimed a newer generation, the job was completed, or the lease was
    released), or when the local safe deadline has passed. Task code that
    sees it must stop producing effects.

    Attributes:
        reason: a short machine-readable reason: a ``RefusalReason`` value
            (``"missing"``, ``"superseded"``, ``"released"``, ``"completed"``),
            ``"deadline"`` when the local safe deadline passed, or
            ``"expired"`` when a fenced transaction found the lease run out
            by the database's clock.
    """

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        owner: str | None = None,
        generation: int | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message, job_id=job_id, owner=owner, generation=generation)
        self.args = (*self.args, reason)
        self.reason = reason


class StaleFencingToken(LeaseError):
    """A fenced target refused a write whose generation is not newer.

    Attributes:
        resource: the fenced resource the write was aimed at.
        accepted: the highest generation the target has accepted, if known.
    """

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        generation: int | None = None,
        resource: str = "",
        accepted: int | None = None,
    ) -> None:
        super().__init__(message, job_id=job_id, generation=generation)
        self.args = (message, job_id, generation, resource, accepted)
        self.resource = resource
        self.accepted = accepted


class StoreUnavailable(LeaseError):
    """The lease store could not be reached or answered with an error.

    The original driver error is chained as ``__cause__``. The caller holds
    no lease. A claim whose reply was lost may still have been recorded in
    the store: that lease is never used, runs out after its TTL, and the
    next claim takes it over.
    """


class LeaseConfigurationError(LeaseError):
    """The configuration is wrong; the message says what to change."""


class LeaseRecordUnreadable(LeaseError):
    """The store holds a record for the job that the library cannot read.

    Something other than celery-leases wrote it (a field that is not a
    number, a state that does not exist, a missing field, a key of another
    type). Only this job is affected; an operator must inspect the record
    and fix or delete it. Retrying does not help.
    """


class TakeoverLimitExceeded(LeaseError):
    """The job took over a run-out lease more often than allowed.

    Each takeover means the previous holder died or stalled while running
    the job; past the limit the job is treated as poison (it kills every
    worker that runs it): its body is not run again and it is recorded as
    failed.

    Attributes:
        takeovers: takeovers counted by the store, this claim included.
        limit: the configured ``lease_max_takeovers``.
    """

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        owner: str | None = None,
        generation: int | None = None,
        takeovers: int = 0,
        limit: int = 0,
    ) -> None:
        super().__init__(message, job_id=job_id, owner=owner, generation=generation)
        self.args = (*self.args, takeovers, limit)
        self.takeovers = takeovers
        self.limit = limit


class ResultUnavailable(LeaseError):
    """A job is completed, but its result can be found nowhere.

    A redelivered copy of a completed job answers its client from the result
    backend or from the outcome kept with the completion. When neither has
    it (the worker died before the backend stored it, and the result was too
    large or could not be serialized to keep with the completion), the copy
    fails with this error rather than leave the client waiting forever.
    """


def _rebuild(cls: type[LeaseError], args: tuple[Any, ...], state: dict[str, Any]) -> LeaseError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class LeaseStoreWarning(UserWarning):
    """A store is configured in a way that can break the guarantees.

    For example a Redis server that may evict keys or does not persist
    them. Not an error: the store works, but a restart or memory pressure
    can lose records and let a generation repeat.
    """
