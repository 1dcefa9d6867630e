"""celery-leases: Celery tasks that are safe to run twice.

Before a task body runs, the worker claims an expiring lease on the job in a
shared store, renews it from a heartbeat, and finishes with a fenced
completion. Each claim carries a generation number, the fencing token.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from celery_leases import censor as _censor

# `celery inspect leases`, also for workers started from Python code
from celery_leases import inspect as _inspect  # noqa: F401
from celery_leases import observe as _observe
from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseRecordUnreadable,
    LeaseSkipped,
    LeaseStoreWarning,
    ResultUnavailable,
    StaleFencingToken,
    StoreUnavailable,
    TakeoverLimitExceeded,
)
from celery_leases.fencing import FenceResult, FencingToken, Token
from celery_leases.lease import Lease
from celery_leases.runtime import stop
from celery_leases.settings import LeaseSettings, LeaseTiming
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.base import (
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    QueuedMark,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.memory import ManualClock, MemoryStore
from celery_leases.stores.waiters import Waiter
from celery_leases.task import LeasedTask
from celery_leases.worker import install

if TYPE_CHECKING:
    from celery_leases.fencing.http import FenceChecker as FenceChecker
    from celery_leases.fencing.redis import RedisFence as RedisFence
    from celery_leases.fencing.sql import SqlFences as SqlFences
    from celery_leases.pytest_plugin import LeaseFaults as LeaseFaults
    from celery_leases.stores.redis import RedisClusterStore as RedisClusterStore
    from celery_leases.stores.redis import RedisStore as RedisStore
    from celery_leases.stores.sql import SqlStore as SqlStore

#: names whose modules need an extra (or pytest): imported on first use
_LAZY = {
    "FenceChecker": ("celery_leases.fencing.http", "http"),
    "RedisFence": ("celery_leases.fencing.redis", "redis"),
    "SqlFences": ("celery_leases.fencing.sql", "sqlalchemy"),
    "LeaseFaults": ("celery_leases.pytest_plugin", "dev"),
    "RedisStore": ("celery_leases.stores.redis", "redis"),
    "RedisClusterStore": ("celery_leases.stores.redis", "redis"),
    "SqlStore": ("celery_leases.stores.sql", "sqlalchemy"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'celery_leases' has no attribute {name!r}")
    module, extra = _LAZY[name]
    try:
        value = getattr(_importlib.import_module(module), name)
    except ImportError as exc:
        raise ImportError(
            f"celery_leases.{name} needs a package that is not installed ({exc.name}): "
            f"pip install 'celery-leases[{extra}]'",
            name=exc.name,
        ) from exc
    globals()[name] = value
    return value


_observe.connect()
_censor.install_settings_filter()

__version__ = "0.1.0"

__all__ = [
    # tasks
    "LeasedTask",
    "Lease",
    "LeaseSettings",
    "LeaseTiming",
    "install",
    "stop",
    # stores
    "LeaseStore",
    "open_store",
    "MemoryStore",
    "ManualClock",
    # store records and results
    "Acquired",
    "AlreadyCompleted",
    "ClaimResult",
    "Completed",
    "HeldElsewhere",
    "LeaseRecord",
    "LeaseState",
    "Refusal",
    "RefusalReason",
    "Released",
    "RenewRequest",
    "QueuedMark",
    "Renewed",
    "Waiter",
    # fencing tokens
    "Token",
    "FencingToken",
    "FenceResult",
    # errors
    "LeaseConfigurationError",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecordUnreadable",
    "LeaseSkipped",
    "ResultUnavailable",
    "StaleFencingToken",
    "StoreUnavailable",
    "TakeoverLimitExceeded",
    # warnings
    "LeaseStoreWarning",
]
