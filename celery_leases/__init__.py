"""celery-leases: Celery tasks that are safe to run twice.

Before a task body runs, the worker claims an expiring lease on the job in a
shared store, renews it from a heartbeat, and finishes with a fenced
completion. Each claim carries a generation number, the fencing token.
"""

from __future__ import annotations

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
    LeaseStoreWarning,
    StaleFencingToken,
    StoreUnavailable,
    TakeoverLimitExceeded,
)
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
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.task import LeasedTask
from celery_leases.worker import install

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
    "Renewed",
    # errors
    "LeaseConfigurationError",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecordUnreadable",
    "StaleFencingToken",
    "StoreUnavailable",
    "TakeoverLimitExceeded",
    # warnings
    "LeaseStoreWarning",
]
