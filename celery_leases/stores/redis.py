"""The Redis lease store: one hash per job, one Lua script per operation.

Each job's record is a Redis hash at ``{prefix}{{{job_id}}}`` (for example
``leases:{job-123}``). The job id sits inside a hash tag, so Redis Cluster
puts the whole record in one slot. The hash never gets a TTL: its
generation must outlive anything that expires keys.

Every operation is one Lua script, run with EVALSHA (loaded again after a
NOSCRIPT). Time inside a script comes from ``TIME`` on the server, so every
comparison uses the store's clock. ``docs/redis.md`` lists the keys, the
scripts and what Redis must be configured with to keep invariant I1.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseRecordUnreadable,
    LeaseStoreWarning,
    StoreUnavailable,
)
from celery_leases.redact import mask
from celery_leases.stores import redis_scripts as scripts
from celery_leases.stores import redis_sentinel
from celery_leases.stores.base import (
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    LeaseStore,
    Refusal,
    Released,
    ReleaseResult,
    Renewed,
    RenewRequest,
    RenewResult,
    refusal_for,
    ttl_to_ms,
    unreadable,
    unreadable_refusal,
)
from celery_leases.stores.redis_replies import (
    _describe,
    _escape_glob,
    _fields,
    _permanent,
    _record,
    _text,
)

__all__ = ["RedisConfigWarning", "RedisStore"]

logger = logging.getLogger(__name__)

#: Default socket timeouts (seconds) of a client made by :meth:`RedisStore.from_url`.
DEFAULT_SOCKET_TIMEOUT = 5.0

#: Keys fetched per SCAN step and per pipelined HGETALL / purge batch.
SCAN_BATCH = 500

#: Leases per call of the renew-many script. One call holds the server for
#: its whole run (about 4 µs per lease); the calls of one ``renew_many``
#: share a pipeline, so they still take one round trip.
RENEW_CHUNK = 500

#: Error replies of a renew-many call that reached a Cluster node not
#: serving one of its keys' slots (a resharding, or a slot map the client has
#: not caught up with): the call stopped at that key or did not start.
_REDIRECTS = (AskError, TryAgainError, ClusterCrossSlotError)  # MovedError is an AskError
_NON_LOCAL = "non local key"


def _cannot_compile(error: ResponseError) -> bool:
    """Whether the server refused to compile a script (its flags line, before Redis 7)."""
    text = str(error)
    return "Error compiling script" in text or "shebang" in text


def _redirected(error: ResponseError) -> bool:
    return isinstance(error, _REDIRECTS) or _NON_LOCAL in str(error)


#: A batched call: the keys it names and the rest of its arguments.
_Call = tuple[Sequence[str], Sequence[Any]]


class RedisConfigWarning(LeaseStoreWarning):
    """The Redis server is configured in a way that can lose lease records."""


class _DriverErrors:
    """The context of :meth:`RedisStore._errors` (a class: a generator-based
    context manager costs a measurable part of a fast operation)."""

    __slots__ = ("job_id", "operation", "store")

    def __init__(self, store: RedisStore, operation: str, job_id: str | None) -> None:
        self.store = store
        self.operation = operation
        self.job_id = job_id

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if exc is None:
            if self.store._config_pending:
                self.store._check_config()
            return
        self.store._raise_wrapped(exc, self.operation, self.job_id)


class _Script:
    """A Lua script and the SHA1 that EVALSHA names it by.

    The store calls ``client.evalsha`` itself rather than through redis-py's
    ``Script``, whose per-call work (copying keys and arguments into new
    tuples, an import, a type check) is a tenth of a claim's Python time.
    """

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


# --- the store -------------------------------------------------------------


class RedisStore(LeaseStore):
    """Lease store in Redis: one hash per job, one Lua script per operation.

    Args:
        client: a ``redis.Redis`` client. Its retry policy is its own; the
            client made by :meth:`from_url` sends every command at most once.
        prefix: put in front of every key, ``leases:`` by default.
        check_config: check ``maxmemory-policy`` and ``appendonly`` and warn
            with :class:`RedisConfigWarning` when they can lose records. Done
            at once when the server answers, else before the first operation
            that reaches it; opening never needs the server.
    """

    def __init__(
        self, client: redis.Redis, *, prefix: str = "leases:", check_config: bool = True
    ) -> None:
        if not isinstance(prefix, str):
            raise LeaseConfigurationError(f"prefix must be a string, got {prefix!r}")
        if "\x00" in prefix:
            # renew_many ends each field with a NUL byte
            raise LeaseConfigurationError(f"prefix {prefix!r} contains a NUL character")
        self.url = _describe(client)
        self.prefix = prefix
        self._client = client
        #: the sentinels a sentinel:// URL named, closed with the store
        self._sentinel: Sentinel | None = None
        self._claim_script = _Script(scripts.CLAIM_SCRIPT)
        self._renew_script = _Script(scripts.RENEW_SCRIPT)
        self._renew_many_script = _Script(scripts.RENEW_MANY_SCRIPT)
        #: False once the server could not compile the renew-many script
        #: (Redis before 7 reads its flags line as code): renew one by one
        self._renew_many_compiles = True
        self._complete_script = _Script(scripts.COMPLETE_SCRIPT)
        self._release_script = _Script(scripts.RELEASE_SCRIPT)
        self._force_release_script = _Script(scripts.FORCE_RELEASE_SCRIPT)
        self._purge_one_script = _Script(scripts.PURGE_ONE_SCRIPT)
        self._config_pending = check_config
        if check_config:
            self._check_config()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "leases:",
        check_config: bool = True,
        **client_options: Any,
    ) -> RedisStore:
        """Open the store at ``url`` (``redis://``, ``rediss://``, ``unix://``,
        or Sentinel's ``sentinel://host:26379;sentinel://host2:26379``).

        Args:
            url: the server URL, as ``redis.Redis.from_url`` reads it, or
                the sentinels' URLs joined by ``;`` (with the
                ``master_name=`` option; see
                :mod:`celery_leases.stores.redis_sentinel`).
            prefix: put in front of every key.
            check_config: see :class:`RedisStore`.
            **client_options: passed to ``redis.Redis.from_url``. By default
                socket and connect timeouts are 5 s and commands are never
                retried: a script whose reply was lost is not sent again
                (a second complete would be refused as already completed).

        Raises:
            LeaseConfigurationError: the URL or an option is invalid.
        """
        options: dict[str, Any] = {
            "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
            "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT,
            "retry": Retry(NoBackoff(), 0),
            **client_options,
        }
        sentinel = None
        if url.split("://", 1)[0].lower() == redis_sentinel.SENTINEL_SCHEME:
            client, sentinel = redis_sentinel.sentinel_client(url, options)
            shown = mask(url)
        else:
            try:
                client = redis.Redis.from_url(url, **options)
            except (ValueError, TypeError) as exc:
                raise LeaseConfigurationError(
                    f"cannot open the Redis lease store {mask(url)!r}: {exc}"
                ) from exc
            shown = mask(url)
        store = cls(client, prefix=prefix, check_config=False)
        store.url = shown
        store._sentinel = sentinel
        store._config_pending = check_config
        if check_config:
            store._check_config()
        return store

    def close(self) -> None:
        """Close the client and its connection pool (and the sentinels')."""
        self._client.close()
        if self._sentinel is not None:
            self._sentinel.close()

    def key(self, job_id: str) -> str:
        """The Redis key of ``job_id``'s record."""
        return f"{self.prefix}{{{job_id}}}"

    # -- errors and configuration --------------------------------------------

    def _errors(self, operation: str, job_id: str | None = None) -> _DriverErrors:
        """Wrap driver errors of ``operation`` in :class:`StoreUnavailable`.

        A configuration check deferred at open runs after the first
        operation that reached the server, so a server that is down costs
        one failed connection per operation, not two.
        """
        return _DriverErrors(self, operation, job_id)

    def _raise_wrapped(self, exc: BaseException, operation: str, job_id: str | None) -> None:
        """Raise the store's error for driver error ``exc``; return for any other error."""
        about = f" of job {job_id!r}" if job_id else ""
        if isinstance(exc, RedisError):
            if _permanent(exc):
                raise LeaseConfigurationError(
                    f"the Redis lease store at {self.url} refused {operation}{about} "
                    f"({type(exc).__name__}: {exc}). This is not an outage and trying again "
                    "will not help: check the user and password in the store URL and that "
                    "the user may run EVALSHA, SCRIPT LOAD, HGETALL, SCAN and TIME on keys "
                    f"under {self.prefix!r}.",
                    job_id=job_id,
                ) from exc
            raise self._unavailable(operation, about, exc, job_id) from exc
        if isinstance(exc, (OSError, RedisClusterException)):
            # a cluster client error (a slot no node serves after a failover,
            # no node reachable) is not a RedisError: the cluster is unavailable
            raise self._unavailable(operation, about, exc, job_id) from exc
        if isinstance(exc, (KeyError, ValueError, IndexError)):
            # a reply from a server that is not Redis-compatible enough
            raise StoreUnavailable(
                f"the Redis lease store at {self.url} returned data it cannot read during "
                f"{operation}{about} ({exc!r}). Check that the server is Redis 7 or newer.",
                job_id=job_id,
            ) from exc

    def _unavailable(
        self, operation: str, about: str, exc: Exception, job_id: str | None
    ) -> StoreUnavailable:
        return StoreUnavailable(
            f"the Redis lease store at {self.url} failed during {operation}{about} "
            f"({type(exc).__name__}: {exc}). Check that the server is up and reachable; "
            "the outcome of this operation is unknown to the caller.",
            job_id=job_id,
        )

    def _check_config(self) -> None:
        """Warn when the server can lose lease records; see :class:`RedisStore`."""
        try:
            policy = self._config_value("maxmemory-policy")
            appendonly = self._config_value("appendonly")
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            logger.debug("Redis at %s not reachable; config check deferred", self.url)
            return
        except RedisError as exc:
            # managed services often disable or rename CONFIG
            logger.debug("CONFIG GET refused by Redis at %s (%s); not checked", self.url, exc)
            self._config_pending = False
            return
        self._config_pending = False
        if policy is not None and policy != "noeviction":
            warnings.warn(
                f"Redis at {self.url} has maxmemory-policy {policy!r}: when memory runs out "
                "it may evict lease records, and then a held job can be claimed a second "
                "time or a completed job run again. Set maxmemory-policy noeviction.",
                RedisConfigWarning,
                stacklevel=3,
            )
        if appendonly is not None and appendonly != "yes":
            warnings.warn(
                f"Redis at {self.url} has appendonly {appendonly!r}: a restart loses lease "
                "records written since the last snapshot, and then a held job can be claimed "
                "a second time or a completed job run again. Set appendonly yes.",
                RedisConfigWarning,
                stacklevel=3,
            )

    def _config_value(self, name: str) -> str | None:
        reply = self._client.config_get(name)
        values = {_text(k): _text(v) for k, v in reply.items()}
        return values.get(name)

    # -- scripts -------------------------------------------------------------

    def _eval(self, script: _Script, key: str, *args: Any) -> Any:
        """Run ``script`` on ``key`` with EVALSHA, loading it after a NOSCRIPT.

        A NOSCRIPT reply means the script did not run (the server's script
        cache was flushed, or this is another server), so sending it again
        cannot apply it twice.
        """
        try:
            return self._client.evalsha(script.sha, 1, key, *args)
        except NoScriptError:
            script.sha = _text(self._client.script_load(script.source))
            return self._client.evalsha(script.sha, 1, key, *args)

    def _run_batch(
        self, script: _Script, calls: Sequence[_Call], *, single: bool = True
    ) -> list[Any]:
        """Run ``script`` once per (keys, args) in one pipelined round trip.

        Replies that are NOSCRIPT (the script cache was flushed) are sent
        again after loading the script; such a call did not run. With
        ``single`` (each call on one record) a Cluster store sends a
        redirected call again where it is sent, and an error reply is
        raised; else (renew-many calls) error replies are returned as they
        are, for the caller to judge.

        Raises:
            RedisError: the pipeline failed, or (``single``) a call answered
                with an error.
        """
        replies = self._send_batch(script.sha, calls, single)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            script.sha = _text(self._client.script_load(script.source))
            again = self._send_batch(script.sha, [calls[i] for i in missing], single)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        if single:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def _send_batch(self, sha: str, calls: Sequence[_Call], follow: bool) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return list(pipe.execute(raise_on_error=False))

    def _renew_chunks(self, requests: Sequence[RenewRequest]) -> list[list[int]]:
        """The requests' indexes, grouped into one renew-many call each."""
        return [
            list(range(start, min(start + RENEW_CHUNK, len(requests))))
            for start in range(0, len(requests), RENEW_CHUNK)
        ]

    def _fenced_reply(
        self, reply: Any, job_id: str, owner: str, generation: int
    ) -> tuple[list[Any] | None, Refusal | None]:
        """Split a fenced script reply into (done payload, refusal).

        Raises:
            LeaseRecordUnreadable: the script found the record unreadable.
        """
        code = int(reply[0])
        if code == scripts.DONE:
            return list(reply[1:]), None
        if code == scripts.MISSING:
            return None, refusal_for(None, job_id, owner, generation)
        if code == scripts.REFUSED:
            record = _record(job_id, _fields(reply[1]), self.url)
            return None, refusal_for(record, job_id, owner, generation)
        if code == scripts.UNREADABLE:
            raise unreadable(job_id, self.url, "found by the script")
        raise ResponseError(f"unexpected reply {reply!r} from a lease script")

    def _renew_result(self, reply: Any, job_id: str, owner: str, generation: int) -> RenewResult:
        done, refusal = self._fenced_reply(reply, job_id, owner, generation)
        if refusal is not None:
            return refusal
        assert done is not None
        return Renewed(job_id, generation, int(done[0]), int(done[1]))

    # -- backend hooks ---------------------------------------------------------

    def _claim(
        self, job_id: str, owner: str, ttl_ms: int, task_name: str, send_id: str | None
    ) -> ClaimResult:
        with self._errors("claim", job_id):
            reply = self._eval(
                self._claim_script,
                self.key(job_id),
                owner,
                ttl_ms,
                task_name,
                send_id or "",
                "0" if send_id is None else "1",
            )
            code = int(reply[0])
            if code == scripts.ACQUIRED:
                return Acquired(
                    job_id, owner, int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4])
                )
            if code == scripts.HELD_ELSEWHERE:
                holder = _text(reply[1])
                generation, lease_until, now = (int(v) for v in reply[2:5])
                return HeldElsewhere(job_id, holder, generation, (lease_until - now) / 1000)
            if code == scripts.ALREADY_COMPLETED:
                outcome = reply[3] if len(reply) > 3 else None
                if isinstance(outcome, str):  # a client that decodes responses
                    outcome = outcome.encode("utf-8", "surrogateescape")
                return AlreadyCompleted(job_id, int(reply[1]), _text(reply[2]), outcome)
            if code == scripts.CLAIM_UNREADABLE:
                raise unreadable(job_id, self.url, "found by the claim script")
            raise ResponseError(f"unexpected reply {reply!r} from the claim script")

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        with self._errors("renew", job_id):
            reply = self._eval(self._renew_script, self.key(job_id), owner, generation, ttl_ms)
            return self._renew_result(reply, job_id, owner, generation)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """One renew-many script call per chunk of leases, all in one pipeline.

        A call that failed because a Cluster slot moved may have renewed the
        leases before the moved one: renewing them again moves their
        ``lease_until`` on once more, which the fence allows. So its whole
        chunk is renewed again lease by lease, each call following its own
        redirection. A server that cannot compile the script (before Redis
        7) has every chunk renewed lease by lease.
        """
        with self._errors(f"renew_many of {len(requests)} leases"):
            chunks = self._renew_chunks(requests)
            ttl_ms: dict[float, int] = {}  # the leases of one worker mostly share a ttl
            ttls = [
                ttl_ms.get(r.ttl) or ttl_ms.setdefault(r.ttl, ttl_to_ms(r.ttl)) for r in requests
            ]
            replies = self._send_renew_many(requests, chunks, ttls)
            results: list[RenewResult | None] = [None] * len(requests)
            for chunk, reply in zip(chunks, replies, strict=True):
                if reply is None or (isinstance(reply, ResponseError) and _redirected(reply)):
                    self._renew_each(requests, chunk, ttls, results)
                    continue
                if isinstance(reply, Exception):
                    raise reply
                now = int(reply[0])
                for n in range(1, len(reply), 2):
                    index = chunk[int(reply[n]) - 1]
                    results[index] = self._batch_renew_result(reply[n + 1], requests[index])
                for index in chunk:
                    if results[index] is None:
                        r = requests[index]
                        results[index] = Renewed(r.job_id, r.generation, now + ttls[index], now)
            done = [result for result in results if result is not None]
            assert len(done) == len(requests), "a lease was left without a reply"
            return done

    def _send_renew_many(
        self, requests: Sequence[RenewRequest], chunks: list[list[int]], ttls: list[int]
    ) -> list[Any]:
        """The replies of one renew-many call per chunk; None for every chunk
        when the server cannot compile the script."""
        if not self._renew_many_compiles:
            return [None] * len(chunks)
        calls: list[_Call] = []
        for chunk in chunks:
            leases = "".join(
                f"{self.key(requests[i].job_id)}\0{requests[i].owner}\0"
                f"{requests[i].generation}\0{ttls[i]}\0"
                for i in chunk
            )
            calls.append(((self.key(requests[chunk[0]].job_id),), (leases,)))
        try:
            return self._run_batch(self._renew_many_script, calls, single=False)
        except ResponseError as exc:
            if not _cannot_compile(exc):
                raise
            logger.info(
                "the Redis server at %s cannot run the batched renewal script (%s); "
                "renewing each lease with its own script call, in one pipeline",
                self.url,
                exc,
            )
            self._renew_many_compiles = False
            return [None] * len(chunks)

    def _renew_each(
        self,
        requests: Sequence[RenewRequest],
        chunk: Sequence[int],
        ttls: list[int],
        results: list[RenewResult | None],
    ) -> None:
        """Renew the leases at ``chunk`` with one single-lease call each, pipelined."""
        calls: list[_Call] = [
            ((self.key(requests[i].job_id),), (requests[i].owner, requests[i].generation, ttls[i]))
            for i in chunk
        ]
        for index, reply in zip(chunk, self._run_batch(self._renew_script, calls), strict=True):
            results[index] = self._batch_renew_result(reply, requests[index])

    def _batch_renew_result(self, reply: Any, r: RenewRequest) -> RenewResult:
        try:
            return self._renew_result(reply, r.job_id, r.owner, r.generation)
        except LeaseRecordUnreadable:
            # one bad record must not stop the heartbeat of every other lease
            return unreadable_refusal(r.job_id, r.owner, r.generation)

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        with self._errors("complete", job_id):
            reply = self._eval(
                self._complete_script,
                self.key(job_id),
                owner,
                generation,
                outcome or b"",
                "0" if outcome is None else "1",
            )
            _, refusal = self._fenced_reply(reply, job_id, owner, generation)
            return refusal if refusal is not None else Completed(job_id, generation)

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        with self._errors("release", job_id):
            reply = self._eval(self._release_script, self.key(job_id), owner, generation)
            _, refusal = self._fenced_reply(reply, job_id, owner, generation)
            return refusal if refusal is not None else Released(job_id, generation)

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        with self._errors("force_release", job_id):
            reply = self._eval(self._force_release_script, self.key(job_id), by, reason)
            code = int(reply[0])
            if code == scripts.MISSING:
                return None
            if code == scripts.UNREADABLE:
                raise unreadable(job_id, self.url, "found by the release script")
            if code in (scripts.DONE, scripts.REFUSED):
                return _record(job_id, _fields(reply[1]), self.url)
            raise ResponseError(f"unexpected reply {reply!r} from the release script")

    def _get(self, job_id: str) -> LeaseRecord | None:
        with self._errors("get", job_id):
            key = self.key(job_id)
            try:
                fields = self._client.hgetall(key)
            except ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
                raise unreadable(job_id, self.url, "the key is not a hash") from exc
            if not fields:
                return None
            return _record(job_id, fields, self.url)

    def _scan_keys(self) -> Iterator[list[str]]:
        """Batches of record keys under the prefix, each key once."""
        pattern = _escape_glob(self.prefix) + "{*}"
        seen: set[str] = set()
        cursor = 0
        while True:
            next_cursor, keys = self._client.scan(cursor, match=pattern, count=SCAN_BATCH)
            cursor = int(next_cursor)
            batch = [k for k in (_text(key) for key in keys) if k not in seen]
            seen.update(batch)
            if batch:
                yield batch
            if cursor == 0:
                return

    def _job_id(self, key: str) -> str:
        return key[len(self.prefix) + 1 : -1]

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        with self._errors("records"):
            for keys in self._scan_keys():
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.hgetall(key)
                for key, fields in zip(keys, pipe.execute(raise_on_error=False), strict=True):
                    # deleted since the scan, or not a record (another kind of key)
                    if not isinstance(fields, dict) or not fields:
                        continue
                    try:
                        record = _record(self._job_id(key), fields, self.url)
                    except LeaseRecordUnreadable as error:
                        yield error
                        continue
                    if state is None or record.state is state:
                        yield record

    def _purge(self, older_than_ms: int) -> int:
        with self._errors("purge"):
            deleted = 0
            for keys in self._scan_keys():
                calls: list[_Call] = [((key,), (older_than_ms,)) for key in keys]
                deleted += sum(int(r) for r in self._run_batch(self._purge_one_script, calls))
            return deleted

    def _now_ms(self) -> int:
        with self._errors("now_ms"):
            seconds, microseconds = self._client.time()
            return int(seconds) * 1000 + int(microseconds) // 1000
