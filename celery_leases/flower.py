"""Lease fields on Flower's task page and in ``/api/task/info/<id>``.

Name this module in Flower's configuration file (``flowerconfig.py``, a
Python file Flower reads at start, or any file given with ``--conf``)::

    import celery_leases.flower  # noqa: F401

Importing it makes Flower's event state understand the ``lease-*`` events
that leased tasks send (see :mod:`celery_leases.events`) and show them as
task fields: ``lease_job_id``, ``lease_generation``, ``lease_owner``,
``lease_until``, ``lease_renewals``, ``lease_takeovers``, ``lease_fate``,
``lease_ran_on`` and ``lease_attempts`` (one entry per claim, deferral or
skip, with its worker and generation, in the order they happened).
``lease_until`` reads as Flower's own times do (``2026-12-01 04:02:45.405000
UTC``); each attempt keeps its ``lease_until`` in ISO 8601. Task states are not touched: a
running leased task stays ``STARTED``, and ``SUCCESS`` and ``FAILURE`` stay
final. Without this module the events are ignored by Flower and by
``celery events``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery.events.state import State
from celery.events.state import Task as _CeleryTask

from celery_leases.values import is_number

__all__ = ["EVENT_GROUP", "LEASE_FIELDS", "LeaseAttempts", "LeaseTask", "install", "watch"]

#: the event group (``lease-claimed`` ... ``lease-skipped``)
EVENT_GROUP = "lease"

LEASE_FIELDS = (
    "lease_job_id",
    "lease_generation",
    "lease_owner",
    "lease_until",
    "lease_renewals",
    "lease_takeovers",
    "lease_fate",
    "lease_ran_on",
    "lease_attempts",
    "lease_queued",
)

#: what took a queued mark away, as ``lease_queued`` says it
_UNQUEUED = {
    "claimed": "its run claimed the lease",
    "revoked": "its message was revoked",
    "skipped": "its call was skipped",
}

#: a later outcome of one claim never gives way to an earlier one that arrives late
_RANK = {"claimed": 0, "renewed": 1, "released": 2, "lost": 3, "fenced-out": 4, "completed": 5}


class LeaseAttempts(list[dict[str, Any]]):
    """The claims, deferrals and skips of one task, oldest generation first.

    A list of dicts in JSON; one line per entry on the task page.
    """

    def __str__(self) -> str:
        return "; ".join(_describe(entry) for entry in self)


def _describe(entry: dict[str, Any]) -> str:
    worker = entry.get("worker") or "?"
    outcome = entry.get("outcome", "?")
    reason = entry.get("reason")
    text = f"{outcome} ({reason})" if reason else str(outcome)
    if entry.get("generation") is None or outcome in ("deferred", "skipped"):
        return f"{text} on {worker}"
    return f"generation {entry['generation']} on {worker}: {text}"


def _as_flower_time(value: Any) -> Any:
    """An ISO 8601 time as Flower writes its own (``2026-12-01 04:02:45.405000 UTC``)."""
    if not isinstance(value, str):
        return value
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")


def _stamp(entry: dict[str, Any], fields: dict[str, Any]) -> None:
    """Keep the time of the entry's first event (the sender's clock), ``at``."""
    timestamp = fields.get("timestamp")
    if is_number(timestamp):
        entry["at"] = min(entry.get("at", timestamp), timestamp)


def _is_claim(entry: dict[str, Any]) -> bool:
    return entry.get("generation") is not None and entry["outcome"] in _RANK


def _order(attempts: LeaseAttempts) -> None:
    """Entries by time; claims among themselves by generation.

    A deferral is placed between the claims it came between. Claims sort by
    generation, not by time: generations are the store's order, while event
    times come from the clocks of several workers.
    """
    attempts.sort(key=lambda e: (e.get("at") is None, e.get("at") or 0.0))
    claims = sorted(filter(_is_claim, attempts), key=lambda e: int(e["generation"]))
    slots = [i for i, e in enumerate(attempts) if _is_claim(e)]
    for slot, claim in zip(slots, claims, strict=True):
        attempts[slot] = claim


class LeaseTask(_CeleryTask):  # type: ignore[misc]  # celery ships no type hints
    """A Flower task that also knows the lease facts of its runs."""

    lease_job_id = lease_generation = lease_owner = lease_until = None
    lease_renewals = lease_takeovers = lease_fate = lease_ran_on = lease_attempts = None
    lease_queued = None
    _fields = _CeleryTask._fields + LEASE_FIELDS

    def __init__(self, uuid: str | None = None, cluster_state: Any = None, **kwargs: Any) -> None:
        attempts = kwargs.pop("lease_attempts", None)
        super().__init__(uuid, cluster_state=cluster_state, **kwargs)
        if attempts is not None:  # restored from Flower's saved state
            self.lease_attempts = LeaseAttempts(attempts)

    def event(
        self,
        type_: str,
        timestamp: float | None = None,
        local_received: float | None = None,
        fields: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().event(type_, timestamp, local_received, fields, **kwargs)
        self._keep_worker_that_ran_it()

    def lease_event(self, subject: str, fields: dict[str, Any]) -> None:
        """Merge one ``lease-<subject>`` event into the lease fields."""
        if subject == "unqueued":  # not an attempt: a fact of the queued message
            reason = fields.get("reason")
            why = _UNQUEUED.get(str(reason), str(reason))
            self.lease_queued = f"the queued job of {fields.get('job_id')!r}, until {why}"
            return
        attempts = self.lease_attempts
        if attempts is None:
            attempts = self.lease_attempts = LeaseAttempts()
        worker = fields.get("hostname")
        generation = fields.get("generation")
        if subject in ("deferred", "skipped"):
            entry: dict[str, Any] = {"outcome": subject, "worker": worker}
            if subject == "deferred":
                entry["reason"] = fields.get("reason")
            elif fields.get("reason") == "busy":
                holder = fields.get("holder_task_id") or "another send"
                entry["reason"] = f"busy: held by {holder}, generation {generation}"
            else:
                entry["reason"] = f"already completed by generation {generation}"
            _stamp(entry, fields)
            attempts.append(entry)
            _order(attempts)
            self.lease_job_id = fields.get("job_id", self.lease_job_id)
        elif subject in _RANK and isinstance(generation, int):
            self._merge_claim(attempts, subject, generation, worker, fields)
        self._update_summary()
        self._keep_worker_that_ran_it()

    def _merge_claim(
        self,
        attempts: LeaseAttempts,
        subject: str,
        generation: int,
        worker: str | None,
        fields: dict[str, Any],
    ) -> None:
        entry = next((e for e in attempts if e.get("generation") == generation), None)
        if entry is None:
            entry = {"generation": generation, "worker": worker, "outcome": subject}
            attempts.append(entry)
        elif _RANK[subject] >= _RANK.get(entry["outcome"], -1):
            entry["outcome"] = subject
        else:
            subject = entry["outcome"]  # a late event of an earlier step: facts only
        _stamp(entry, fields)
        _order(attempts)
        if entry["outcome"] == subject and fields.get("reason"):
            entry["reason"] = fields["reason"]
        for key in ("owner", "lease_until"):
            if fields.get(key) is not None:
                entry[key] = fields[key]
        if isinstance(fields.get("renewals"), int):
            entry["renewals"] = max(entry.get("renewals", 0), fields["renewals"])
        if fields.get("takeovers") is not None:
            entry["takeovers"] = fields["takeovers"]
        self.lease_job_id = fields.get("job_id", self.lease_job_id)

    def _update_summary(self) -> None:
        attempts = self.lease_attempts or LeaseAttempts()
        claims = [e for e in attempts if _is_claim(e)]
        completed = next((e for e in claims if e["outcome"] == "completed"), None)
        if claims:
            latest = claims[-1]
            self.lease_generation = latest["generation"]
            self.lease_owner = latest.get("owner")
            self.lease_until = _as_flower_time(latest.get("lease_until"))
            self.lease_renewals = latest.get("renewals", 0)
            self.lease_takeovers = max(e.get("takeovers", 0) for e in claims)
        if completed is not None:
            self.lease_ran_on = completed.get("worker")
            self.lease_fate = f"completed by generation {completed['generation']}"
        elif claims:
            latest = claims[-1]
            outcome = {"claimed": "held", "renewed": "held"}.get(latest["outcome"])
            outcome = outcome or latest["outcome"]
            reason = latest.get("reason")
            self.lease_fate = f"{outcome} ({reason})" if reason and outcome != "held" else outcome
        if attempts and attempts[-1]["outcome"] in ("deferred", "skipped"):
            last = attempts[-1]
            note = "skipped" if last["outcome"] == "skipped" else "deferred as a duplicate"
            text = f"{note} ({last.get('reason')})"
            self.lease_fate = f"{self.lease_fate}; {text}" if self.lease_fate else text

    def _keep_worker_that_ran_it(self) -> None:
        # every event moves ``worker`` to its sender; once a run completed,
        # the task page should name that run's worker, not a later copy's
        if self.lease_ran_on is None or self.cluster_state is None:
            return
        worker = self.cluster_state.workers.get(self.lease_ran_on)
        if worker is not None:
            self.worker = worker


def _handler(state: State) -> Any:
    def handle(subject: str, event: dict[str, Any]) -> tuple[Any, bool] | None:
        uuid = event.get("uuid")
        if not uuid:
            return None
        task, created = state.get_or_create_task(uuid)
        if isinstance(task, LeaseTask):
            hostname = event.get("hostname")
            if hostname and task.worker is None:
                task.worker, _ = state.get_or_create_worker(hostname)
            task.lease_event(subject, event)
        return task, created

    return handle


def watch(state: State) -> State:
    """Make ``state`` (a Celery or Flower event state) merge lease events; returns it.

    Use it for a :class:`celery.events.state.State` of your own; Flower's
    is handled by importing this module.
    """
    state.Task = LeaseTask
    state.handlers[EVENT_GROUP] = _handler(state)
    # the dispatcher captured the task class when first used: build it again
    state.__dict__.pop("_event", None)
    return state


def install() -> bool:
    """Make Flower's event state use :class:`LeaseTask`; idempotent.

    Returns:
        False when Flower is not installed.
    """
    try:
        # Flower 2.0.0's event state reads tornado options (its runtime
        # histogram's buckets) that only flower.options defines, which its
        # command imports but its events module does not (later releases do):
        # without it, a state made outside `celery flower` (a saved one
        # loaded, a test's) cannot be built
        import flower.options  # noqa: F401
        from flower import events as flower_events
    except ImportError:
        return False
    original = flower_events.EventsState
    if getattr(original, "celery_leases_watched", False):
        return True

    class LeaseEventsState(original):  # type: ignore[misc, valid-type]
        """Flower's event state, with lease events merged into its tasks."""

        celery_leases_watched = True
        Task = LeaseTask

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            watch(self)  # also when Flower loads a saved state: it is rebuilt by __init__

    LeaseEventsState.__module__ = __name__
    LeaseEventsState.__qualname__ = "LeaseEventsState"
    flower_events.EventsState = LeaseEventsState
    globals()["LeaseEventsState"] = LeaseEventsState  # so a saved state can be loaded
    return True


install()
