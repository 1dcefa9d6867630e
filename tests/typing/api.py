"""Type-checked use of the public task API (run by mypy, not by pytest)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_leases import (
    Lease,
    LeasedTask,
    LeaseLost,
    LeaseSettings,
    LeaseSkipped,
    LeaseStore,
    LeaseTiming,
    QueuedMark,
    TakeoverLimitExceeded,
    install,
)
from celery_leases.exactly_once import ExactlyOnce, exactly_once
from celery_leases.metrics import install_metrics
from celery_leases.purge import schedule_purge
from celery_leases.signals import lease_lost

app = Celery("typing")
app.conf.leases_store = "memory://"
install(app)


@app.task(  # type: ignore[untyped-decorator]  # celery ships no type hints
    base=LeasedTask, bind=True, lease_ttl=30.0, lease_key="report:{customer_id}"
)
def report(self: LeasedTask, customer_id: int) -> str:
    lease: Lease = self.lease
    generation: int = lease.generation
    until: datetime = lease.lease_until
    left: float = lease.remaining()
    lease.check()
    lease.ensure(5.0)
    lost: bool = lease.lost
    return f"{lease.idempotency_key} {generation} {until:%H:%M} {left:.1f} {lost}"


class Careful(LeasedTask):
    lease_on_lost = "flag"
    lease_on_busy = "skip"
    lease_max_takeovers = 3
    lease_key = "careful:{0}"
    lease_queue_unique = 900.0

    def on_lease_lost(self, lease: Lease) -> None:
        reason: str | None = lease.lost_reason
        print(reason)


settings: LeaseSettings = LeaseSettings.from_conf(app.conf)
timing: LeaseTiming = settings.timing(ttl=10.0)
safe: float = timing.safe_duration


def on_lost(sender: object, lease: Lease, reason: str, error: LeaseLost, **_: object) -> None:
    print(sender, lease.job_id, reason, error.generation)


lease_lost.connect(on_lost)


def limit(error: TakeoverLimitExceeded) -> int:
    return error.takeovers - error.limit


def skipped_for(error: LeaseSkipped) -> str:
    return f"{error.job_id} held by {error.holder_task_id}, {error.remaining:.1f} s left"


# operator tools
purge_entry: dict[str, object] = schedule_purge(app, every=3600, older_than=7 * 86400)
install_metrics(app, required=False)


# exactly-once database effects
def bill(task: LeasedTask, engine: sa.Engine, session: Session) -> dict[str, int]:
    with exactly_once(task, engine) as tx:
        open_tx: ExactlyOnce = tx
        conn: sa.Connection = open_tx.connection
        conn.execute(sa.text("SELECT 1"))
        amount: int = tx.complete(42)
    with exactly_once(task, session) as tx:
        return tx.complete({"amount": amount})


def queued(store: LeaseStore) -> str | None:
    mark: QueuedMark = store.mark_queued("report:7", "task-id", 600.0)
    longer: QueuedMark | None = store.extend_queued("report:7", mark.task_id, 3600.0)
    taken: bool = store.unmark_queued("report:7", mark.task_id)
    now: QueuedMark | None = store.queued("report:7")
    return None if now is None or longer is None or taken else now.task_id
