"""The configuration of a chaos run, shared by the runner and the workers.

Kept apart from :mod:`chaos.app`, which only worker processes import: it
puts a recording store in place of the one the library opens.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery

__all__ = ["JOB", "ChaosConfig", "make_app"]

JOB = "chaos.job"


@dataclass(frozen=True)
class ChaosConfig:
    """What a chaos worker (and the runner's client app) needs."""

    broker: str = "redis://127.0.0.1:6379/0"
    queue: str = "chaos"
    store: str = "memory://"
    store_options: dict[str, Any] = field(default_factory=dict)
    ttl: float = 1.5
    visibility_timeout: float = 3600.0
    history: str = "chaos-out/history"
    sql_target: str = ""
    redis_target: str = ""
    variant: str = ""
    #: the table (in the store's own database) of the exactly-once effects;
    #: "" when the jobs make none
    once_table: str = ""

    def to_env(self) -> dict[str, str]:
        return {"CHAOS_CONFIG": json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> ChaosConfig:
        raw = os.environ.get("CHAOS_CONFIG")
        return cls(**json.loads(raw)) if raw else cls()


def make_app(config: ChaosConfig) -> Celery:
    """A Celery app on the config's broker (also the result backend) and store."""
    celery_app = Celery("chaos", broker=config.broker, backend=config.broker)
    celery_app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=config.queue,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": config.visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        result_expires=None,
        leases_store=config.store,
        leases_store_options=config.store_options,
        leases_ttl=config.ttl,
        leases_defer_max=max(2 * config.ttl, 2.0),
    )
    return celery_app
