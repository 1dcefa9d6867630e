"""Fencing external effects: targets that refuse a stale generation.

A check in the lease store cannot stop a write that is already on the wire.
So every external write carries the lease's ``(job_id, generation)``, and the
target itself keeps, per resource, the highest generation it has accepted
and refuses anything lower (invariant I5)::

    A claims job J with generation 7 ... pauses past its lease
    B claims J with generation 8, writes resource R with 8   -> accepted
    A wakes up, writes R with 7                              -> refused

This package holds what every target shares: the token a write carries, the
result of a fenced write, what to do with a repeat of the same generation,
and an in-memory fence. The targets live in submodules:
:mod:`celery_leases.fencing.sql` (SQLAlchemy tables),
:mod:`celery_leases.fencing.redis` (Redis keys) and
:mod:`celery_leases.fencing.http` (the header convention and a checker for
services).

Generations of different jobs compare by when each job was first claimed
(the first generation is the store's clock in milliseconds), so a resource
written by several jobs keeps the writes of the job claimed last. Fence a
resource with the job that owns it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.values import is_whole

__all__ = [
    # tokens
    "FencingToken",
    "HolderToken",
    "Token",
    "check_resource",
    "check_token",
    # outcomes
    "FenceResult",
    "OnRepeat",
    "check_on_repeat",
    "stale_token_error",
    # storage
    "FenceStorage",
    "MemoryFences",
    "decide",
]

#: What a target does with a write that repeats the highest generation it
#: accepted (same job, same generation):
#:
#: - ``"apply"`` (default): write again; the holder may write a resource
#:   several times in one run.
#: - ``"refuse"``: raise :class:`~celery_leases.errors.StaleFencingToken`;
#:   the resource takes one write per generation.
#: - ``"accept"``: succeed without writing (an idempotent retry), reported
#:   as ``FenceResult.applied == False``.
OnRepeat = Literal["apply", "refuse", "accept"]

_ON_REPEAT_VALUES: tuple[str, ...] = get_args(OnRepeat)


class FencingToken(Protocol):
    """Anything that carries a fencing token: a ``Lease`` or a :class:`Token`."""

    @property
    def job_id(self) -> str: ...

    @property
    def generation(self) -> int: ...


class HolderToken(FencingToken, Protocol):
    """A fencing token that also names its holder (needed for lease checks)."""

    @property
    def owner(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Token:
    """A fencing token built by hand: in tests, or from a request's headers.

    Task code passes its ``self.lease`` instead; both fit :class:`FencingToken`.
    """

    job_id: str
    generation: int
    owner: str = ""

    @property
    def idempotency_key(self) -> str:
        """``"<job_id>:<generation>"``, the same key a ``Lease`` gives."""
        return f"{self.job_id}:{self.generation}"


def check_token(token: FencingToken) -> tuple[str, int]:
    """Return ``(job_id, generation)`` of ``token`` after checking them.

    A token with a ``check()`` method (a ``Lease``) is asked first, so a
    lease already lost locally (its safe deadline passed, a renewal was
    refused) stops the write before anything is sent.

    Raises:
        LeaseLost: the lease's own ``check()`` says it is lost.
        LeaseConfigurationError: ``job_id`` is not a non-empty string or
            ``generation`` is not a positive integer.
    """
    local_check = getattr(token, "check", None)
    if callable(local_check):
        local_check()
    job_id = getattr(token, "job_id", None)
    generation = getattr(token, "generation", None)
    if not isinstance(job_id, str) or not job_id:
        raise LeaseConfigurationError(
            f"a fenced write needs a token with a non-empty job_id, got {job_id!r}; "
            "pass the task's lease (self.lease) or a Token(job_id, generation)"
        )
    if not is_whole(generation, 1):
        raise LeaseConfigurationError(
            f"a fenced write needs a positive integer generation, got {generation!r} "
            f"(job {job_id!r})",
            job_id=job_id,
        )
    return job_id, generation


def check_on_repeat(on_repeat: object) -> OnRepeat:
    """Check an ``on_repeat`` argument.

    Raises:
        LeaseConfigurationError: it is not ``"apply"``, ``"refuse"`` or ``"accept"``.
    """
    if on_repeat not in _ON_REPEAT_VALUES:
        raise LeaseConfigurationError(
            f"on_repeat must be one of {', '.join(map(repr, _ON_REPEAT_VALUES))}, got {on_repeat!r}"
        )
    return on_repeat  # type: ignore[return-value]  # checked just above


def check_resource(resource: object) -> str:
    """Check a resource name: a non-empty string.

    Raises:
        LeaseConfigurationError: it is not.
    """
    if not isinstance(resource, str) or not resource:
        raise LeaseConfigurationError(f"resource must be a non-empty string, got {resource!r}")
    return resource


@dataclass(frozen=True, slots=True)
class FenceResult:
    """A fenced write that the target accepted.

    Attributes:
        resource: the fenced resource.
        job_id: job of the token the write carried.
        generation: generation the write carried; now the highest accepted.
        applied: ``True`` when the write took effect; ``False`` when it was a
            repeat accepted as a no-op (``on_repeat="accept"``), or, for a
            fenced ``UPDATE``, when no row matched its ``where``.
        previous: the highest generation accepted before this write, when
            the target reports it (``None``: none, or not reported).
        rowcount: rows the statement changed (SQL targets only).
        entry_id: id of the new stream entry (Redis ``XADD`` only).
    """

    resource: str
    job_id: str
    generation: int
    applied: bool
    previous: int | None = None
    rowcount: int | None = None
    entry_id: str | None = None


def stale_token_error(
    resource: str,
    job_id: str,
    generation: int,
    *,
    accepted: int | None,
    accepted_job: str | None = None,
) -> StaleFencingToken:
    """Build the :class:`StaleFencingToken` a target raises, ready to raise.

    Args:
        resource: the resource the write was aimed at.
        job_id: job of the refused token.
        generation: generation of the refused token.
        accepted: highest generation the target has accepted, if known.
        accepted_job: the job that generation belongs to, if known.
    """
    if accepted is None:
        detail = "the target has accepted a newer write"
    elif accepted == generation and accepted_job in (None, job_id):
        detail = (
            f"generation {generation} already wrote it and repeats are refused "
            "(on_repeat='refuse'); use on_repeat='accept' to make the retry a no-op"
        )
    else:
        of_job = f" of job {accepted_job!r}" if accepted_job and accepted_job != job_id else ""
        detail = (
            f"it has accepted generation {accepted}{of_job}; this writer's lease was "
            "taken over, so it must stop producing effects"
        )
    return StaleFencingToken(
        f"write to {resource!r} by job {job_id!r} with generation {generation} was "
        f"refused: {detail}",
        job_id=job_id,
        generation=generation,
        resource=resource,
        accepted=accepted,
    )


def decide(
    resource: str,
    job_id: str,
    generation: int,
    on_repeat: OnRepeat,
    accepted: tuple[str, int] | None,
) -> bool:
    """Apply the fencing rule to one write, given what the target accepted.

    Args:
        resource: the resource (for the error).
        job_id: job of the write's token.
        generation: generation of the write's token.
        on_repeat: what a repeat of the accepted generation does.
        accepted: ``(job_id, generation)`` the target accepted last, or ``None``.

    Returns:
        ``True`` if the write must take effect, ``False`` if it is a repeat
        accepted as a no-op.

    Raises:
        StaleFencingToken: the write is older than the accepted one, or is a
            repeat and ``on_repeat="refuse"``, or repeats the generation of
            another job.
    """
    if accepted is None:
        return True
    accepted_job, accepted_generation = accepted
    if generation > accepted_generation:
        return True
    if generation == accepted_generation and job_id == accepted_job:
        if on_repeat == "apply":
            return True
        if on_repeat == "accept":
            return False
    raise stale_token_error(
        resource, job_id, generation, accepted=accepted_generation, accepted_job=accepted_job
    )


class FenceStorage(Protocol):
    """Where a :class:`~celery_leases.fencing.http.FenceChecker` keeps its fences.

    :class:`MemoryFences`, :class:`~celery_leases.fencing.redis.RedisFence`
    and :class:`~celery_leases.fencing.sql.SqlFences` fit it.
    """

    def advance(
        self, resource: str, token: FencingToken, *, on_repeat: OnRepeat = "apply"
    ) -> FenceResult:
        """Move the fence of ``resource`` to ``token`` if the rule allows it.

        Raises:
            StaleFencingToken: the token is stale (see :func:`decide`).
        """
        ...


class MemoryFences:
    """Fences in a dict guarded by a lock: one process, many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted: dict[str, tuple[str, int]] = {}

    def advance(
        self, resource: str, token: FencingToken, *, on_repeat: OnRepeat = "apply"
    ) -> FenceResult:
        """Move the fence of ``resource`` to ``token`` if the rule allows it.

        Returns:
            The :class:`FenceResult`; ``applied`` is ``False`` for a repeat
            accepted as a no-op.

        Raises:
            StaleFencingToken: the token is stale.
        """
        resource = check_resource(resource)
        job_id, generation = check_token(token)
        on_repeat = check_on_repeat(on_repeat)
        with self._lock:
            accepted = self._accepted.get(resource)
            applied = decide(resource, job_id, generation, on_repeat, accepted)
            self._accepted[resource] = (job_id, generation)
        return FenceResult(resource, job_id, generation, applied, accepted[1] if accepted else None)

    def accepted(self, resource: str) -> Token | None:
        """The token last accepted for ``resource``, or ``None``."""
        with self._lock:
            entry = self._accepted.get(resource)
        return Token(entry[0], entry[1]) if entry else None
