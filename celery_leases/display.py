"""How lease records are shown to people and scripts.

Durations people type, the JSON view of a record and plain text tables
(:func:`celery_leases.redact.mask` keeps passwords out of what is printed).
"""

from __future__ import annotations

import re
from typing import Any

import click

from celery_leases.stores.base import (
    LeaseRecord,
    LeaseState,
    QueuedMark,
    Waiter,
    ms_to_datetime,
)

__all__ = [
    "parse_duration",
    "queued_to_dict",
    "record_to_dict",
    "short_time",
    "table",
    "skipped_to_dict",
    "waiter_to_dict",
]

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w.

    Raises:
        click.BadParameter: ``text`` is not such a duration.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise click.BadParameter(f"{text!r} is not a duration; use e.g. 3600, 90m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def record_to_dict(record: LeaseRecord, store_now_ms: int) -> dict[str, Any]:
    """A JSON-ready view of ``record``; times are ISO 8601 UTC on the store's clock."""

    def iso(ms: int | None) -> str | None:
        return None if ms is None else ms_to_datetime(ms).isoformat()

    live = record.is_live(store_now_ms)
    data: dict[str, Any] = {
        "job_id": record.job_id,
        "state": record.state.value,
        "task_name": record.task_name,
        "owner": record.owner,
        "generation": record.generation,
        "lease_until": iso(record.lease_until_ms),
        "expired": record.state is LeaseState.HELD and not live,
        "remaining": round((record.lease_until_ms - store_now_ms) / 1000, 3) if live else 0.0,
        "claimed_at": iso(record.claimed_at_ms),
        "renewed_at": iso(record.renewed_at_ms),
        "completed_at": iso(record.completed_at_ms),
        "renew_count": record.renew_count,
        "takeovers": record.takeovers,
    }
    if record.send_id:
        data["send_id"] = record.send_id
    if record.task_id:
        data["task_id"] = record.task_id
    if record.outcome is not None:
        # the encoded result may hold anything: show its size only
        data["outcome_bytes"] = len(record.outcome)
    if record.released_at_ms is not None:
        data["released_at"] = iso(record.released_at_ms)
        # empty when the holder released it itself
        data["released_by"] = record.released_by
        data["release_reason"] = record.release_reason
    return data


def queued_to_dict(mark: QueuedMark, store_now_ms: int) -> dict[str, Any]:
    """A JSON-ready view of a queued mark (``lease_queue_unique``): the
    queued message's task id, when it was marked and when the mark runs out."""
    return {
        "queued_task_id": mark.task_id,
        "queued_at": ms_to_datetime(mark.queued_at_ms).isoformat(),
        "queued_until": ms_to_datetime(mark.queued_until_ms).isoformat(),
        "queued_remaining": round(max(mark.queued_until_ms - store_now_ms, 0) / 1000, 3),
    }


def skipped_to_dict(entry: Waiter) -> dict[str, Any]:
    """A JSON-ready view of a job's last skipped call (``lease_on_busy="skip"``):
    its task id and when it was skipped."""
    return {
        "skipped_task_id": entry.task_id,
        "skipped_at": ms_to_datetime(entry.waiting_since_ms).isoformat(),
    }


def waiter_to_dict(waiter: Waiter, store_now_ms: int) -> dict[str, Any]:
    """A JSON-ready view of a waiter (``lease_on_busy="wait"``): the waiting
    message's task id and send, since when it waits and when its entry
    runs out (its payload, a whole message, is left out)."""
    return {
        "task_id": waiter.task_id,
        "send_id": waiter.send_id,
        "waiting_since": ms_to_datetime(waiter.waiting_since_ms).isoformat(),
        "waiting_until": ms_to_datetime(waiter.waiting_until_ms).isoformat(),
        "waiting_remaining": round(max(waiter.waiting_until_ms - store_now_ms, 0) / 1000, 3),
    }


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Rows as left-aligned text columns under a header."""
    cells = [[title for _, title in columns]]
    cells += [["" if row.get(key) is None else str(row[key]) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def short_time(iso: str | None) -> str:
    return "" if iso is None else iso[:19].replace("T", " ")
