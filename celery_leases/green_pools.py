"""The worker's start checks for the gevent and eventlet pools.

Under monkey-patching the lease threads are OS threads
(:mod:`celery_leases.unpatched`): they renew and keep deadlines while a task
greenlet holds the hub. Two things cannot follow them there, and the worker
refuses them at start with a message naming what to use instead:

- a store whose client only has patched connections: its renewals would
  wait in the hub, and leases would run out in the store while held;
- ``lease_on_lost`` ``"raise"`` and ``"stop"``. The loss is noticed on an
  OS thread, which cannot throw into a greenlet; a throw scheduled on the
  hub lands only when the body yields, and the bodies that need it (a tight
  loop, a blocking C call) never do.
"""

from __future__ import annotations

from typing import Any

from celery_leases import unpatched
from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.redact import mask, secrets_of
from celery_leases.runtime import settings_for, store_for
from celery_leases.stores import open_store

__all__ = ["check_green_on_lost", "check_green_store", "green_pool"]


def green_pool(pool: str) -> str | None:
    """``"gevent"`` or ``"eventlet"`` when ``pool`` (or the process's
    monkey-patching) is that green pool, else None."""
    name = pool.lower()
    for library in ("gevent", "eventlet"):
        if library in name:
            return library
    return unpatched.green_library()


def check_green_store(app: Any, library: str) -> None:
    """Refuse a store whose renewals would wait in the hub of a green pool.

    Under gevent or eventlet the heartbeat renews from OS threads, so that
    a task greenlet holding the hub delays no renewal; a store whose client
    only has patched connections (TLS, Sentinel, Cluster, SQL drivers)
    would wait in that hub, and its leases would run out in the store. The
    store asked is the one this process's runs will use.

    Raises:
        LeaseConfigurationError: the store cannot renew outside the hub.
    """
    settings = settings_for(app)
    try:
        store = store_for(app)
    except StoreUnavailable:
        # not opened (a store that connects to open): ask one of the same kind
        try:
            store = open_store(settings.store_url, **dict(settings.store_options))
        except StoreUnavailable:
            return  # the store check warns; the kind cannot be told yet
        store.close()
    if store.renews_outside_the_hub:
        return
    url = settings.store_url
    raise LeaseConfigurationError(
        f"the lease store {mask(url, secrets=secrets_of(url))!r} cannot renew leases "
        f"outside the {library} hub: a task that does not yield would keep its renewals "
        "from going out, and leases would run out while held. With the "
        f"{library} pool use a plain redis:// or unix:// lease store (no TLS, Sentinel "
        "or Cluster), or run these tasks on the prefork or threads pool"
    )


def check_green_on_lost(task_name: str, mode: str, library: str) -> None:
    """Refuse ``lease_on_lost`` "raise" and "stop" on a green pool.

    The loss is noticed on an OS thread, which cannot throw into a greenlet;
    a throw scheduled on the hub lands only when the body yields, and the
    bodies that need it most (a tight loop, a blocking C call) never do.

    Raises:
        LeaseConfigurationError: ``mode`` is not ``"flag"``.
    """
    if mode == "flag":
        return
    raise LeaseConfigurationError(
        f"task {task_name!r} uses lease_on_lost={mode!r}, which the {library} pool cannot "
        "honour: a lost lease cannot be raised in a greenlet that holds the hub. Use "
        "lease_on_lost='flag' and check self.lease.lost or call self.lease.check() "
        "before each effect, or run the task on the prefork pool"
    )
