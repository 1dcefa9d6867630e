"""The Redis lease store: one hash per job, one Lua script per operation.

Each job's record is a Redis hash at ``{prefix}{{{job_id}}}`` (for example
``leases:{job-123}``). The job id sits inside a hash tag, so Redis Cluster
puts the whole record in one slot. The hash never gets a TTL: its
generation must outlive anything that expires keys.

Every operation is one Lua script, registered with redis-py's
``register_script`` and run with EVALSHA through the client's connection
pool (loaded again after a NOSCRIPT). Time inside a script comes from
``TIME`` on the server, so every comparison uses the store's clock.
``docs/redis.md`` lists the keys, the scripts and what Redis must be
configured with to keep invariant I1.

The package's private modules, each used only here:

- ``_store``: the store, :class:`RedisStore`; ``_cluster``: the same on a
  Redis Cluster, :class:`RedisClusterStore`;
- ``_scripts``: the Lua scripts of the operations; ``_operator_scripts``:
  those of the operators' forced release and purge;
- ``_batches``: renewals of many leases in a few round trips;
- ``_connections``: the store's two clients (the tasks' and the renewals'),
  ``_sentinel``: a client through Redis Sentinel;
- ``_replies``: what a script's reply means; ``_errors``: which driver
  errors are an outage, which a configuration.
"""

from __future__ import annotations

from celery_leases.stores.redis._batches import RENEW_CHUNK
from celery_leases.stores.redis._cluster import RedisClusterStore
from celery_leases.stores.redis._connections import (
    DEFAULT_SOCKET_TIMEOUT,
    RENEW_CONNECTIONS,
    RedisConfigWarning,
)
from celery_leases.stores.redis._store import SCAN_BATCH, RedisStore

__all__ = [
    "RedisStore",
    "RedisClusterStore",
    "RedisConfigWarning",
    "DEFAULT_SOCKET_TIMEOUT",
    "RENEW_CHUNK",
    "RENEW_CONNECTIONS",
    "SCAN_BATCH",
]
