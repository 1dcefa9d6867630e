"""The Celery app and the leased charge tasks, in two styles.

- ``invoices.charge`` (``charge_invoice``): the ledger entry fenced by the
  lease's generation, in any database, then the receipt; a run can be
  repeated after a crash, and the fences make the repeat harmless.
- ``invoices.charge_once`` (``charge_invoice_once``): the receipt first,
  fenced, then the ledger entry inside ``exactly_once``, in the lease
  store's own database: the entry commits with the job's completion, so it
  is written exactly once.

Start a worker with ``celery -A invoices.tasks worker`` from this folder;
it reads its set-up from ``INVOICES_*`` variables (see :mod:`invoices.config`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, LeaseLost, StaleFencingToken, signals
from celery_leases.exactly_once import exactly_once
from invoices.config import Config
from invoices.ledger import amount_of, open_ledger, post_charge, post_charge_once
from invoices.receipts import ReceiptRefused, send_receipt
from invoices.timeline import Timeline

__all__ = ["CHARGE", "CHARGE_ONCE", "app", "make_app"]

#: the tasks' names, as clients send them
CHARGE = "invoices.charge"
CHARGE_ONCE = "invoices.charge_once"


def make_app(config: Config) -> Celery:
    """The Celery app of ``config``, with ``charge_invoice`` registered."""
    app = Celery("invoices", broker=config.broker_url, backend=config.backend_url)
    app.conf.update(
        broker_transport=config.broker_transport,
        broker_transport_options=config.broker_transport_options(),
        broker_connection_retry_on_startup=True,
        task_acks_late=True,  # LeasedTask needs it; a lost worker's message comes back
        worker_prefetch_multiplier=1,
        task_default_queue=config.queue,
        task_track_started=True,
        result_extended=True,
        worker_enable_remote_control=not config.embedded,
        leases_store=config.store_url,
        leases_ttl=config.ttl,
        # a lost lease is a flag the task reads; fenced writes refuse the rest
        leases_on_lost="flag",
        leases_defer_max=max(config.ttl, 1.0),
    )
    engines: dict[tuple[int, str], sa.Engine] = {}

    def engine_on(url: str) -> sa.Engine:
        # one engine per process: a forked pool child must not share sockets
        key = (os.getpid(), url)
        if key not in engines:
            engines[key] = open_ledger(url)
        return engines[key]

    def ledger_engine() -> sa.Engine:
        return engine_on(config.ledger_url)

    timeline = Timeline(config.timeline_path)

    @app.task(base=LeasedTask, bind=True, name=CHARGE, shared=False)  # type: ignore[untyped-decorator]
    def charge_invoice(self: Any, invoice_id: int) -> dict[str, Any]:
        """Charge one invoice: a ledger entry, then a receipt, both fenced."""
        lease = self.lease
        _prepare(config.work_seconds)
        try:
            entry = post_charge(ledger_engine(), lease, invoice_id, config.worker)
        except (StaleFencingToken, LeaseLost) as exc:
            timeline.record(
                config.worker, "ledger write refused", lease.job_id, lease.generation, _why(exc)
            )
            raise
        timeline.record(
            config.worker,
            "ledger write accepted",
            lease.job_id,
            lease.generation,
            f"{entry.amount_cents} cents",
        )
        try:
            send_receipt(
                config.receipts_url,
                lease,
                invoice_id,
                {"invoice": invoice_id, "amount_cents": entry.amount_cents},
            )
        except ReceiptRefused as exc:
            timeline.record(
                config.worker, "receipt refused", lease.job_id, lease.generation, str(exc)
            )
            raise
        timeline.record(config.worker, "receipt accepted", lease.job_id, lease.generation)
        return {
            "invoice": invoice_id,
            "amount_cents": entry.amount_cents,
            "generation": lease.generation,
            "worker": config.worker,
        }

    @app.task(base=LeasedTask, bind=True, name=CHARGE_ONCE, shared=False)  # type: ignore[untyped-decorator]
    def charge_invoice_once(self: Any, invoice_id: int) -> dict[str, Any]:
        """Charge one invoice: the receipt (fenced), then the ledger entry
        and the job's completion in one transaction of the lease store's database."""
        lease = self.lease
        # the ledger tables live in the lease store's database
        engine = engine_on(config.store_url)
        _prepare(config.work_seconds)  # slow work: no transaction is open
        amount = amount_of(engine, invoice_id)
        # outside the transaction: fenced, and sent again by a later generation
        # if this run dies before its commit
        send_receipt(
            config.receipts_url, lease, invoice_id, {"invoice": invoice_id, "amount_cents": amount}
        )
        with exactly_once(self, engine) as tx:
            entry = post_charge_once(tx.connection, lease, invoice_id, amount, config.worker)
            return tx.complete(
                {
                    "invoice": invoice_id,
                    "amount_cents": entry.amount_cents,
                    "generation": lease.generation,
                    "worker": config.worker,
                }
            )

    _record_lease_signals(app, timeline, config.worker)
    return app


def _prepare(seconds: float) -> None:
    """Stand-in for the slow part of a charge (rendering, fraud checks).

    Counts on ``time.monotonic``, which keeps running while the process is
    stopped, so a worker frozen past the end goes on at once when resumed.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))


def _why(exc: Exception) -> str:
    if isinstance(exc, LeaseLost):
        return f"lease lost ({exc.reason}) before the write was sent"
    accepted = getattr(exc, "accepted", None)
    return f"the ledger holds generation {accepted}" if accepted else str(exc)


def _record_lease_signals(app: Celery, timeline: Timeline, worker: str) -> None:
    """Write what the library reports about ``app``'s charges to the timeline."""

    def generation(lease: Any) -> int | None:
        return None if lease is None else int(lease.generation)

    def claimed(lease: Any, job_id: str, takeovers: int, **_: Any) -> None:
        detail = f"took over a run-out lease ({takeovers})" if takeovers else ""
        timeline.record(worker, "claimed", job_id, generation(lease), detail)

    def deferred(job_id: str, reason: str, countdown: float, **_: Any) -> None:
        timeline.record(worker, "deferred", job_id, None, f"{reason}; again in {countdown:.1f} s")

    def lost(lease: Any, job_id: str, reason: str, **_: Any) -> None:
        timeline.record(worker, "lease lost", job_id, generation(lease), reason)

    def fenced_out(lease: Any, job_id: str, reason: str, **_: Any) -> None:
        timeline.record(
            worker, "completion refused", job_id, generation(lease), f"fenced out: {reason}"
        )

    def completed(lease: Any, job_id: str, **_: Any) -> None:
        timeline.record(worker, "completed", job_id, generation(lease))

    def released(lease: Any, job_id: str, reason: str, **_: Any) -> None:
        timeline.record(worker, "released", job_id, generation(lease), reason)

    receivers = {
        signals.lease_claimed: claimed,
        signals.duplicate_deferred: deferred,
        signals.lease_lost: lost,
        signals.lease_fenced_out: fenced_out,
        signals.lease_completed: completed,
        signals.lease_released: released,
    }
    for signal, receiver in receivers.items():

        def receive(sender: Any, _receiver: Any = receiver, **kwargs: Any) -> None:
            # the sender is the task object; other apps in this process are not ours
            if getattr(sender, "name", None) == CHARGE and getattr(sender, "app", None) is app:
                _receiver(**kwargs)

        signal.connect(receive, weak=False)


app = make_app(Config.from_env())
