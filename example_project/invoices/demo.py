"""The protocol's worked example, live, with two real worker processes.

1. Worker A claims the charge of an invoice (job J, generation N) and is
   frozen with SIGSTOP before it writes anything, past its lease.
2. The charge is sent again with the same task id (as a user or a beat
   schedule would). Worker B receives it, finds A's live lease and defers
   the copy; when A's lease has run out, B claims a higher generation N+k, writes the ledger
   entry and the receipt, and completes.
3. A is resumed with SIGCONT: its ledger write is refused, its completion
   is refused, and it writes nothing to the result backend.

The demo is a check: it exits 0 only if every step happened so.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from celery_leases import LeaseState, open_store
from invoices.config import Config
from invoices.ledger import add_invoice, entries, open_ledger
from invoices.processes import WorkerProcess, wait_until
from invoices.receipts import ReceiptService, serve
from invoices.tasks import CHARGE, make_app
from invoices.timeline import Event, Timeline

__all__ = ["DemoReport", "run_demo"]

#: seconds any one step may take on a slow, shared machine
STEP_TIMEOUT = 60.0


@dataclass
class DemoReport:
    """What the demo saw, and which checks passed."""

    job_id: str = ""
    generation: int | None = None
    timeline: list[Event] = field(default_factory=list)
    checks: list[tuple[str, bool]] = field(default_factory=list)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    receipt: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    result_state: str = ""
    roles: dict[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.checks) and all(ok for _, ok in self.checks)

    def check(self, name: str, ok: bool) -> None:
        self.checks.append((name, bool(ok)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "job_id": self.job_id,
            "generation": self.generation,
            "timeline": [event.as_dict() for event in self.timeline],
            "checks": [{"check": name, "ok": ok} for name, ok in self.checks],
            "ledger": self.ledger,
            "receipt": self.receipt,
            "result": self.result,
            "result_state": self.result_state,
            "roles": self.roles,
            "error": self.error,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2))


def _with_roles(events: list[Event], roles: dict[str, str]) -> list[Event]:
    """The events with worker names replaced by their roles (A, B)."""
    return [dataclasses.replace(e, worker=roles.get(e.worker, e.worker)) for e in events]


def _find(events: list[Event], worker: str, event: str) -> Event | None:
    return next((e for e in events if e.worker == worker and e.event == event), None)


def _say(line: str) -> None:
    """Print a step as it happens, also when the output goes to a pipe."""
    print(line, flush=True)


def run_demo(config: Config, report: DemoReport, *, say: Callable[[str], None] = _say) -> None:
    """Run the scenario on ``config``; fill ``report``. Stops what it started."""
    config.make_folders()
    service = ReceiptService()
    server = serve(service)
    config = dataclasses.replace(config, receipts_url=f"http://127.0.0.1:{server.server_port}")
    timeline = Timeline(config.timeline_path)
    ledger = open_ledger(config.ledger_url)
    client = make_app(config)
    workers = {name: WorkerProcess(name, config) for name in ("w1", "w2")}
    try:
        _scenario(config, report, timeline, ledger, client, workers, service, say)
    finally:
        for worker in workers.values():
            worker.stop()
        server.shutdown()
        server.server_close()
        ledger.dispose()
        client.close()


def _scenario(
    config: Config,
    report: DemoReport,
    timeline: Timeline,
    ledger: sa.Engine,
    client: Celery,
    workers: dict[str, WorkerProcess],
    service: ReceiptService,
    say: Callable[[str], None],
) -> None:
    invoice_id = add_invoice(ledger, "ACME Ltd", 12_500)
    job_id = report.job_id = str(uuid.uuid4())
    # reading any state creates the result tables before two workers race to
    _ = AsyncResult("warm-up", app=client).state

    say(f"starting two workers (broker {config.broker_url}, leases {config.store_url})")
    for worker in workers.values():
        worker.start()
    pids = ", ".join(f"{w.name} {w.pid}" for w in workers.values())
    say(f"worker process groups: {pids}")
    for worker in workers.values():
        worker.wait_ready(STEP_TIMEOUT)
    client.send_task(CHARGE, args=[invoice_id], task_id=job_id)
    say(f"sent the charge of invoice {invoice_id} as job {job_id}")

    def seen(worker: str, event: str) -> Event | None:
        return _find(_with_roles(timeline.events(job_id), roles), worker, event)

    # whichever worker claims first plays A
    roles: dict[str, str] = {}
    claimed = wait_until(
        lambda: next((e for e in timeline.events(job_id) if e.event == "claimed"), None),
        timeout=STEP_TIMEOUT,
        what="the first claim",
    )
    a = workers[claimed.worker]
    a.freeze()
    (b_name,) = set(workers) - {claimed.worker}
    b = workers[b_name]
    roles.update({claimed.worker: "A", b_name: "B"})
    report.roles = {"A": claimed.worker, "B": b_name}
    timeline.record("demo", "froze A (SIGSTOP)", job_id, claimed.generation)
    report.generation = generation = claimed.generation
    client.send_task(CHARGE, args=[invoice_id], task_id=job_id)
    timeline.record("demo", "sent the charge again", job_id, None, "same task id")
    say(f"A ({a.name}) froze holding the lease; the charge was sent again; B ({b.name}) has it")

    result = AsyncResult(job_id, app=client)
    wait_until(lambda: seen("B", "completed"), timeout=STEP_TIMEOUT, what="B's completion")
    first_result = result.get(timeout=STEP_TIMEOUT, interval=0.1)

    timeline.record("demo", "resumed A (SIGCONT)", job_id, generation)  # before A can act
    a.thaw()
    say("B completed; A resumed")
    wait_until(lambda: seen("A", "completion refused"), timeout=STEP_TIMEOUT, what="A fenced out")
    # whatever A could still write would land now: read everything afresh
    wait_until(lambda: seen("A", "ledger write refused"), timeout=5, what="A's ledger refusal")

    stored = AsyncResult(job_id, app=make_app(config))
    report.result_state = stored.state
    report.result = stored.result if stored.state == "SUCCESS" else {"error": repr(stored.result)}
    report.ledger = [
        {**entry.__dict__, "worker": roles.get(entry.worker, entry.worker)}
        for entry in entries(ledger)
    ]
    report.receipt = service.receipts.get(str(invoice_id))
    store = open_store(config.store_url)
    try:
        record = store.get(job_id)
    finally:
        store.close()
    report.timeline = _with_roles(timeline.events(job_id), roles)
    _judge(report, generation, first_result, record)


def _judge(report: DemoReport, generation: int | None, first_result: Any, record: Any) -> None:
    events = report.timeline
    names = [(e.worker, e.event) for e in events]

    def at(worker: str, event: str) -> int:
        return names.index((worker, event)) if (worker, event) in names else -1

    b_claim = _find(events, "B", "claimed")
    n = generation if generation is not None else -1
    report.check("A claimed the job first", at("A", "claimed") == 0)
    report.check(
        "A was frozen before it wrote anything",
        at("demo", "froze A (SIGSTOP)") > at("A", "claimed"),
    )
    deferred = at("B", "deferred")
    report.check(
        "B deferred the copy while A's lease was live",
        deferred >= 0 and (b_claim is None or deferred < names.index(("B", "claimed"))),
    )
    # the next generation is max(N + 1, the store's clock in ms): above N
    m = b_claim.generation if b_claim is not None and b_claim.generation is not None else -1
    report.check("B claimed a higher generation", b_claim is not None and m > n)
    b_write = _find(events, "B", "ledger write accepted")
    report.check("B's ledger write was accepted", b_write is not None and b_write.generation == m)
    report.check("B completed", _find(events, "B", "completed") is not None)
    resumed = at("demo", "resumed A (SIGCONT)")
    report.check("A was resumed after B completed", resumed > at("B", "completed"))
    refused = _find(events, "A", "ledger write refused")
    report.check("A's ledger write was refused", refused is not None and refused.generation == n)
    report.check(
        "A wrote nothing to the ledger", _find(events, "A", "ledger write accepted") is None
    )
    report.check("A's completion was refused", at("A", "completion refused") > resumed)
    report.check("A never completed", _find(events, "A", "completed") is None)
    report.check(
        "the ledger holds one entry, B's",
        [(e["worker"], e["generation"]) for e in report.ledger] == [("B", m)],
    )
    report.check(
        "the receipt is B's", report.receipt is not None and report.receipt["generation"] == m
    )
    report.check(
        "the result backend holds B's result, unchanged after A woke",
        report.result_state == "SUCCESS"
        and report.result == first_result
        and isinstance(first_result, dict)
        and first_result.get("worker") == report.roles.get("B")
        and first_result.get("generation") == m,
    )
    report.check(
        "the store recorded B's completion",
        record is not None and record.state is LeaseState.COMPLETED and record.generation == m,
    )
