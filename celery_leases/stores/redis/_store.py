"""The Redis lease store: :class:`RedisStore` (see the package's docstring)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import ResponseError
from redis.sentinel import Sentinel

from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseRecordUnreadable,
)
from celery_leases.stores.base import (
    MAX_WAITERS,
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    LeaseStore,
    QueuedMark,
    Released,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    Waiter,
    unreadable,
)
from celery_leases.stores.redis import _queued as redis_queued
from celery_leases.stores.redis import _scripts as scripts
from celery_leases.stores.redis import _waiters as redis_waiters
from celery_leases.stores.redis._batches import Call, RedisBatches
from celery_leases.stores.redis._connections import (
    RENEW_CONNECTIONS,
    check_renew_connections,
    client_options,
    config_warnings,
    open_client,
    renewal_client,
    renews_outside_the_hub,
)
from celery_leases.stores.redis._errors import DriverErrors
from celery_leases.stores.redis._operator_scripts import FORCE_RELEASE_SCRIPT, PURGE_ONE_SCRIPT
from celery_leases.stores.redis._replies import (
    describe_server,
    fenced_reply,
    hash_fields,
    raw_command,
    record_of,
    renew_result,
    run_script,
    scan_record_keys,
)
from celery_leases.values import as_text

__all__ = ["SCAN_BATCH", "RedisStore"]

logger = logging.getLogger("celery_leases.stores.redis")

#: Keys fetched per SCAN step and per pipelined HGETALL / purge batch.
SCAN_BATCH = 500


# --- the store -------------------------------------------------------------


class RedisStore(RedisBatches, LeaseStore):
    """Lease store in Redis: one hash per job, one Lua script per operation.

    Args:
        client: a ``redis.Redis`` client, for every call but ``renew_many``.
            Its retry policy is its own; the client made by :meth:`from_url`
            sends every command at most once.
        prefix: put in front of every key, ``leases:`` by default.
        check_config: check ``maxmemory-policy`` and ``appendonly`` and warn
            with :class:`RedisConfigWarning` when they can lose records. Done
            at once when the server answers, else before the first operation
            that reaches it; opening never needs the server.
        renew_client: the client that sends ``renew_many`` (the heartbeat's
            renewals), so that they never wait for a connection that tasks
            hold. By default one like ``client`` with a pool of its own of
            :data:`RENEW_CONNECTIONS` connections.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "leases:",
        check_config: bool = True,
        renew_client: redis.Redis | None = None,
    ) -> None:
        if not isinstance(prefix, str):
            raise LeaseConfigurationError(f"prefix must be a string, got {prefix!r}")
        if "\x00" in prefix:
            # renew_many ends each field with a NUL byte
            raise LeaseConfigurationError(f"prefix {prefix!r} contains a NUL character")
        self.url = describe_server(client)
        self.prefix = prefix
        self._client = client
        self._renew_client = (
            renewal_client(client, RENEW_CONNECTIONS) if renew_client is None else renew_client
        )
        #: the sentinels a sentinel:// URL named, closed with the store
        self._sentinel: Sentinel | None = None
        self._renews_outside_the_hub = renews_outside_the_hub(self._renew_client)
        #: the connection pools the store made, disconnected when it closes
        self._own_pools: list[redis.ConnectionPool] = (
            [] if renew_client is not None else [self._renew_client.connection_pool]
        )
        self._claim_script = client.register_script(scripts.CLAIM_SCRIPT)
        self._renew_script = client.register_script(scripts.RENEW_SCRIPT)
        self._renew_many_script = client.register_script(scripts.RENEW_MANY_SCRIPT)
        self._renew_many_compiles = True
        self._complete_script = client.register_script(scripts.COMPLETE_SCRIPT)
        self._release_script = client.register_script(scripts.RELEASE_SCRIPT)
        self._force_release_script = client.register_script(FORCE_RELEASE_SCRIPT)
        self._purge_one_script = client.register_script(PURGE_ONE_SCRIPT)
        self._mark_queued_script = client.register_script(redis_queued.MARK_QUEUED_SCRIPT)
        self._unmark_queued_script = client.register_script(redis_queued.UNMARK_QUEUED_SCRIPT)
        self._extend_queued_script = client.register_script(redis_queued.EXTEND_QUEUED_SCRIPT)
        self._queued_script = client.register_script(redis_queued.QUEUED_SCRIPT)
        self._add_waiter_script = client.register_script(redis_waiters.ADD_WAITER_SCRIPT)
        self._take_waiters_script = client.register_script(redis_waiters.TAKE_WAITERS_SCRIPT)
        self._waiters_script = client.register_script(redis_waiters.WAITERS_SCRIPT)
        self._config_pending = check_config
        if check_config:
            self._check_config(client)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "leases:",
        check_config: bool = True,
        renew_connections: int = RENEW_CONNECTIONS,
        **client_options_: Any,
    ) -> RedisStore:
        """Open the store at ``url`` (``redis://``, ``rediss://``, ``unix://``,
        or Sentinel's ``sentinel://host:26379;sentinel://host2:26379``).

        Args:
            url: the server URL, as ``redis.Redis.from_url`` reads it, or
                the sentinels' URLs joined by ``;`` (with the
                ``master_name=`` option; see
                :mod:`celery_leases.stores.redis._sentinel`).
            prefix: put in front of every key.
            check_config: see :class:`RedisStore`.
            renew_connections: the size of the renewal pool, which only
                ``renew_many`` (the heartbeat) uses.
            **client_options_: passed to ``redis.Redis.from_url``
                (``max_connections`` sizes the tasks' pool). By default
                socket and connect timeouts are 5 s and commands are never
                retried: a script whose reply was lost is not sent again
                (a second complete would be refused as already completed).

        Raises:
            LeaseConfigurationError: the URL or an option is invalid.
        """
        renew_connections = check_renew_connections(renew_connections)
        client, sentinel, shown = open_client(url, client_options(client_options_))
        renew_client = renewal_client(client, renew_connections)
        store = cls(client, prefix=prefix, check_config=False, renew_client=renew_client)
        store.url = shown
        store._sentinel = sentinel
        store._own_pools = [client.connection_pool, renew_client.connection_pool]
        store._config_pending = check_config
        if check_config:
            store._check_config(client)
        return store

    @property
    def renews_outside_the_hub(self) -> bool:
        """True for a plain TCP or Unix socket store opened under monkey-patching."""
        return self._renews_outside_the_hub

    def close(self) -> None:
        """Close the clients, the connection pools the store made, and the sentinels'
        connections."""
        self._client.close()
        if self._renew_client is not self._client:
            self._renew_client.close()
        for pool in self._own_pools:
            pool.disconnect()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()
                sentinel.connection_pool.disconnect()

    def key(self, job_id: str) -> str:
        """The Redis key of ``job_id``'s record."""
        return f"{self.prefix}{{{job_id}}}"

    # -- errors and configuration --------------------------------------------

    def _errors(
        self, operation: str, job_id: str | None = None, client: redis.Redis | None = None
    ) -> DriverErrors:
        """Wrap driver errors of ``operation`` (sent by ``client``, the task
        client by default) in :class:`StoreUnavailable`.

        A configuration check deferred at open runs after the first
        operation that reached the server, on that operation's client, so a
        server that is down costs one failed connection per operation, not
        two, and a renewal never waits for the tasks' pool.
        """
        return DriverErrors(self, operation, job_id, client or self._client)

    def _check_config(self, client: redis.Redis) -> None:
        """Warn when the server can lose lease records; see :class:`RedisStore`."""
        if config_warnings(client, self.url):
            self._config_pending = False

    # -- scripts -------------------------------------------------------------

    def _eval(self, script: Script, key: str, *args: Any) -> Any:
        """Run ``script`` on ``key`` on the task client (see :func:`run_script`)."""
        return run_script(self._client, script, key, *args)

    # -- backend hooks ---------------------------------------------------------

    def _claim(
        self,
        job_id: str,
        owner: str,
        ttl_ms: int,
        task_name: str,
        send_id: str | None,
        task_id: str,
    ) -> ClaimResult:
        with self._errors("claim", job_id):
            reply = self._eval(
                self._claim_script,
                self.key(job_id),
                f"{owner}\0{ttl_ms}\0{task_name}\0{send_id or ''}\0"
                f"{'0' if send_id is None else '1'}\0{task_id}\0",
            )
            if isinstance(reply, (bytes, str)):
                generation, lease_until, now, takeovers = map(int, reply.split())
                return Acquired(job_id, owner, generation, lease_until, now, takeovers)
            code = int(reply[0])
            if code == scripts.HELD_ELSEWHERE:
                holder = as_text(reply[1])
                generation, lease_until, now = (int(v) for v in reply[2:5])
                return HeldElsewhere(job_id, holder, generation, (lease_until - now) / 1000)
            if code == scripts.ALREADY_COMPLETED:
                outcome = reply[3] if len(reply) > 3 else None
                return AlreadyCompleted(job_id, int(reply[1]), as_text(reply[2]), outcome)
            if code == scripts.CLAIM_UNREADABLE:
                raise unreadable(job_id, self.url, "found by the claim script")
            raise ResponseError(f"unexpected reply {reply!r} from the claim script")

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        with self._errors("renew", job_id):
            reply = self._eval(self._renew_script, self.key(job_id), owner, generation, ttl_ms)
            return renew_result(reply, job_id, owner, generation, self.url)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """One renew-many script call per chunk of leases, all in one pipeline
        of the renewal client; see :mod:`celery_leases.stores.redis._batches`."""
        with self._errors(f"renew_many of {len(requests)} leases", client=self._renew_client):
            return self._renew_batch(requests)

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        with self._errors("complete", job_id):
            args = (owner, generation) if outcome is None else (owner, generation, outcome)
            reply = self._eval(self._complete_script, self.key(job_id), *args)
            if reply == scripts.DONE:
                return Completed(job_id, generation)
            _, refusal = fenced_reply(reply, job_id, owner, generation, self.url)
            assert refusal is not None
            return refusal

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        with self._errors("release", job_id):
            reply = self._eval(self._release_script, self.key(job_id), owner, generation)
            if reply == scripts.DONE:
                return Released(job_id, generation)
            _, refusal = fenced_reply(reply, job_id, owner, generation, self.url)
            assert refusal is not None
            return refusal

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        with self._errors("force_release", job_id):
            reply = self._eval(self._force_release_script, self.key(job_id), by, reason)
            code = int(reply[0])
            if code == scripts.MISSING:
                return None
            if code == scripts.UNREADABLE:
                raise unreadable(job_id, self.url, "found by the release script")
            if code in (scripts.DONE, scripts.REFUSED):
                return record_of(job_id, hash_fields(reply[1]), self.url)
            raise ResponseError(f"unexpected reply {reply!r} from the release script")

    def _get(self, job_id: str) -> LeaseRecord | None:
        with self._errors("get", job_id):
            key = self.key(job_id)
            try:
                fields = raw_command(self._client, "HGETALL", key)
            except ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
                raise unreadable(job_id, self.url, "the key is not a hash") from exc
            if not fields:
                return None
            return record_of(job_id, fields, self.url)

    def _scan_keys(self) -> Iterator[list[str]]:
        """Batches of record keys under the prefix, each key once."""
        return scan_record_keys([self._client], self.prefix, SCAN_BATCH)

    def _job_id(self, key: str) -> str:
        return key[len(self.prefix) + 1 : -1]

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        with self._errors("records"):
            for keys in self._scan_keys():
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    raw_command(pipe, "HGETALL", key)
                for key, fields in zip(keys, pipe.execute(raise_on_error=False), strict=True):
                    # deleted since the scan, or not a record (another kind of key)
                    if not isinstance(fields, dict) or not fields:
                        continue
                    try:
                        record = record_of(self._job_id(key), fields, self.url)
                    except LeaseRecordUnreadable as error:
                        yield error
                        continue
                    if state is None or record.state is state:
                        yield record

    def _purge(self, older_than_ms: int) -> int:
        with self._errors("purge"):
            deleted = 0
            for keys in self._scan_keys():
                calls: list[Call] = [((key,), (older_than_ms,)) for key in keys]
                replies = self._run_batch(self._client, self._purge_one_script, calls)
                deleted += sum(int(r) for r in replies)
            return deleted

    def _now_ms(self) -> int:
        with self._errors("now_ms"):
            seconds, microseconds = self._client.time()
            return int(seconds) * 1000 + int(microseconds) // 1000

    # -- queued marks (module redis_queued) ----------------------------------------

    def _mark_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark:
        with self._errors("mark_queued", job_id):
            key = redis_queued.mark_key(self.prefix, job_id)
            reply = self._eval(self._mark_queued_script, key, task_id, ttl_ms)
            mark = redis_queued.queued_mark(job_id, reply)
            if mark is None:
                raise ResponseError(f"unexpected reply {reply!r} from the mark script")
            return mark

    def _extend_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None:
        with self._errors("extend_queued", job_id):
            key = redis_queued.mark_key(self.prefix, job_id)
            reply = self._eval(self._extend_queued_script, key, task_id, ttl_ms)
            return redis_queued.queued_mark(job_id, reply)

    def _unmark_queued(self, job_id: str, task_id: str) -> bool:
        with self._errors("unmark_queued", job_id):
            key = redis_queued.mark_key(self.prefix, job_id)
            return bool(int(self._eval(self._unmark_queued_script, key, task_id)))

    def _queued(self, job_id: str) -> QueuedMark | None:
        with self._errors("queued", job_id):
            key = redis_queued.mark_key(self.prefix, job_id)
            return redis_queued.queued_mark(job_id, self._eval(self._queued_script, key))

    # -- waiters (module redis_waiters) ----------------------------------------

    def _add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        with self._errors("add_waiter", job_id):
            key = redis_waiters.waiters_key(self.prefix, job_id)
            value = redis_waiters.entry_value(task_id, payload)
            return bool(
                int(self._eval(self._add_waiter_script, key, send_id, ttl_ms, value, MAX_WAITERS))
            )

    def _take_waiters(self, job_id: str) -> list[Waiter]:
        with self._errors("take_waiters", job_id):
            key = redis_waiters.waiters_key(self.prefix, job_id)
            return redis_waiters.live_waiters(job_id, self._eval(self._take_waiters_script, key))

    def _waiters(self, job_id: str) -> list[Waiter]:
        with self._errors("waiters", job_id):
            key = redis_waiters.waiters_key(self.prefix, job_id)
            return redis_waiters.live_waiters(job_id, self._eval(self._waiters_script, key))
