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

import contextlib
import hashlib
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from celery_leases.errors import LeaseConfigurationError, LeaseStoreWarning, StoreUnavailable
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
)

__all__ = ["RedisConfigWarning", "RedisStore"]

logger = logging.getLogger(__name__)

#: Default socket timeouts (seconds) of a client made by :meth:`RedisStore.from_url`.
DEFAULT_SOCKET_TIMEOUT = 5.0

#: Keys fetched per SCAN step and per pipelined HGETALL / purge batch.
SCAN_BATCH = 500


class RedisConfigWarning(LeaseStoreWarning):
    """The Redis server is configured in a way that can lose lease records."""


# --- Lua scripts -----------------------------------------------------------
#
# Reply codes shared by renew, complete and release:
#   {1, ...}            done
#   {0}                 no record: refusal MISSING
#   {2, HGETALL pairs}  refused; the record as it is, to name the reason
#                       (superseded, released, completed) without asking twice

# Store time in integer milliseconds from the server's clock, and integer
# formatting: Lua numbers are doubles, and the default conversion of a
# number to a string may use an exponent for large values.
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n)
  return string.format('%d', n)
end
"""

#: Claim the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] ttl in ms, ARGV[3] task name.
#: Returns {1, generation, lease_until, now, takeovers}  acquired
#:         {2, holder, generation, lease_until, now}     held by a live lease elsewhere
#:         {3, generation}                               already completed
CLAIM_SCRIPT = (
    _PRELUDE
    + """
local key = KEYS[1]
local owner, ttl_ms, task_name = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_ms()
local f = redis.call('HMGET', key, 'generation', 'state', 'owner', 'lease_until', 'takeovers')
local generation, takeovers
local existed = f[1] ~= false
if not existed then
  -- a new record starts at the clock: above any generation of a purged one
  generation, takeovers = now, 0
else
  local current = tonumber(f[1])
  if f[2] == 'completed' then
    return {3, current}
  end
  local lease_until = tonumber(f[4])
  if f[2] == 'held' and lease_until > now then
    return {2, f[3], current, lease_until, now}
  end
  generation = current + 1
  takeovers = tonumber(f[5] or '0')
  if f[2] == 'held' then
    -- the holder's lease ran out without a release: it died or stalled
    takeovers = takeovers + 1
  end
end
local lease_until = now + ttl_ms
redis.call('HSET', key, 'owner', owner, 'generation', int(generation),
  'lease_until', int(lease_until), 'state', 'held', 'task_name', task_name,
  'claimed_at', int(now), 'renew_count', '0', 'takeovers', int(takeovers))
if existed then
  -- a new record never had these; an old one's belong to the previous holder
  redis.call('HDEL', key, 'renewed_at', 'completed_at')
end
return {1, generation, lease_until, now, takeovers}
"""
)

# The fence of renew, complete and release: owner and generation match and
# the lease is held (a run-out lease nobody claimed since still matches).
_FENCE = """
local key = KEYS[1]
local f = redis.call('HMGET', key, 'owner', 'generation', 'state')
if not f[2] then
  return {0}
end
if f[1] ~= ARGV[1] or f[2] ~= ARGV[2] or f[3] ~= 'held' then
  return {2, redis.call('HGETALL', key)}
end
local now = now_ms()
"""

#: Renew the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation, ARGV[3] ttl in ms.
#: Returns {1, lease_until, now} renewed; {0} missing; {2, pairs} refused.
RENEW_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
local lease_until = now + tonumber(ARGV[3])
redis.call('HSET', key, 'lease_until', int(lease_until), 'renewed_at', int(now))
redis.call('HINCRBY', key, 'renew_count', 1)
return {1, lease_until, now}
"""
)

#: Complete the job; the record keeps its owner and generation.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation.
#: Returns {1} completed; {0} missing; {2, pairs} refused.
COMPLETE_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
redis.call('HSET', key, 'state', 'completed', 'completed_at', int(now))
return {1}
"""
)

#: Release the lease: the owner is cleared, the generation kept.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation.
#: Returns {1} released; {0} missing; {2, pairs} refused.
RELEASE_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
redis.call('HSET', key, 'state', 'released', 'owner', '', 'lease_until', int(now))
return {1}
"""
)

#: Delete one completed record if it is old enough and its generation is
#: below the clock, so a record made again starts above it (I1).
#: KEYS[1] record key; ARGV[1] retention in ms.
#: Returns 1 deleted, 0 kept.
PURGE_ONE_SCRIPT = (
    _PRELUDE
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'completed_at', 'generation')
if f[1] ~= 'completed' or not f[2] then
  return 0
end
local now = now_ms()
if tonumber(f[2]) <= now - tonumber(ARGV[1]) and tonumber(f[3]) < now then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

_DONE, _MISSING, _REFUSED = 1, 0, 2
_ACQUIRED, _HELD_ELSEWHERE, _ALREADY_COMPLETED = 1, 2, 3


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


# --- helpers ---------------------------------------------------------------


def mask_url(url: str) -> str:
    """``url`` with any password (in the netloc or the query) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostinfo = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostinfo}"
    query = "&".join(
        f"{name}=***" if name.lower() == "password" else f"{name}={value}"
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    masked = f"{parts.scheme}://{netloc}{parts.path}"
    if query:
        masked += f"?{query}"
    return masked


def _describe(client: redis.Redis) -> str:
    """A password-free URL naming the server of ``client``, for messages."""
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    scheme = "rediss" if kwargs.get("ssl") else "redis"
    host = kwargs.get("host", "localhost")
    return f"{scheme}://{host}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A field -> value dict from a flat HGETALL reply of a script."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _optional_int(fields: Mapping[str, str], name: str) -> int | None:
    value = fields.get(name)
    return int(value) if value else None


def _record(job_id: str, fields: Mapping[str, str]) -> LeaseRecord:
    """The record of ``job_id`` from its hash fields."""
    return LeaseRecord(
        job_id=job_id,
        owner=fields.get("owner", ""),
        generation=int(fields["generation"]),
        lease_until_ms=int(fields.get("lease_until") or 0),
        state=LeaseState(fields["state"]),
        task_name=fields.get("task_name", ""),
        claimed_at_ms=_optional_int(fields, "claimed_at"),
        renewed_at_ms=_optional_int(fields, "renewed_at"),
        completed_at_ms=_optional_int(fields, "completed_at"),
        renew_count=int(fields.get("renew_count") or 0),
        takeovers=int(fields.get("takeovers") or 0),
    )


def _escape_glob(text: str) -> str:
    """``text`` with the glob characters of SCAN MATCH escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


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
        self.url = _describe(client)
        self.prefix = prefix
        self._client = client
        self._claim_script = _Script(CLAIM_SCRIPT)
        self._renew_script = _Script(RENEW_SCRIPT)
        self._complete_script = _Script(COMPLETE_SCRIPT)
        self._release_script = _Script(RELEASE_SCRIPT)
        self._purge_one_script = _Script(PURGE_ONE_SCRIPT)
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
        """Open the store at ``url`` (``redis://``, ``rediss://``, ``unix://``).

        Args:
            url: the server URL, as ``redis.Redis.from_url`` reads it.
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
        try:
            client = redis.Redis.from_url(url, **options)
        except (ValueError, TypeError) as exc:
            raise LeaseConfigurationError(
                f"cannot open the Redis lease store {mask_url(url)!r}: {exc}"
            ) from exc
        store = cls(client, prefix=prefix, check_config=False)
        store.url = mask_url(url)
        store._config_pending = check_config
        if check_config:
            store._check_config()
        return store

    def close(self) -> None:
        """Close the client and its connection pool."""
        self._client.close()

    def key(self, job_id: str) -> str:
        """The Redis key of ``job_id``'s record."""
        return f"{self.prefix}{{{job_id}}}"

    # -- errors and configuration --------------------------------------------

    @contextlib.contextmanager
    def _errors(self, operation: str, job_id: str | None = None) -> Iterator[None]:
        """Wrap driver errors of ``operation`` in :class:`StoreUnavailable`.

        A configuration check deferred at open runs after the first
        operation that reached the server, so a server that is down costs
        one failed connection per operation, not two.
        """
        try:
            yield
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(
                f"the Redis lease store at {self.url} failed during {operation}"
                + (f" of job {job_id!r}" if job_id else "")
                + f" ({type(exc).__name__}: {exc}). Check that the server is up and "
                "reachable; the outcome of this operation is unknown to the caller.",
                job_id=job_id,
            ) from exc
        except (KeyError, ValueError, IndexError) as exc:
            # a record written by something else under our prefix, or a reply
            # from a server that is not Redis-compatible enough
            raise StoreUnavailable(
                f"the Redis lease store at {self.url} returned data it cannot read during "
                f"{operation}" + (f" of job {job_id!r}" if job_id else "") + f" ({exc!r}). "
                f"Check that nothing else writes keys under the prefix {self.prefix!r}.",
                job_id=job_id,
            ) from exc
        if self._config_pending:
            self._check_config()

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

    def _run_batch(self, script: _Script, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``script`` once per (key, args) in one pipelined round trip.

        Replies that are NOSCRIPT (the script cache was flushed) are sent
        again after loading the script; such a call did not run.

        Raises:
            RedisError: the pipeline failed, or a call answered with an error.
        """
        replies = self._send_batch(script.sha, calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            script.sha = _text(self._client.script_load(script.source))
            again = self._send_batch(script.sha, [calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _send_batch(self, sha: str, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key, args in calls:
            pipe.evalsha(sha, 1, key, *args)
        return list(pipe.execute(raise_on_error=False))

    def _fenced_reply(
        self, reply: Any, job_id: str, owner: str, generation: int
    ) -> tuple[list[Any] | None, Refusal | None]:
        """Split a fenced script reply into (done payload, refusal)."""
        code = int(reply[0])
        if code == _DONE:
            return list(reply[1:]), None
        if code == _MISSING:
            return None, refusal_for(None, job_id, owner, generation)
        if code == _REFUSED:
            record = _record(job_id, _pairs(reply[1]))
            return None, refusal_for(record, job_id, owner, generation)
        raise ResponseError(f"unexpected reply {reply!r} from a lease script")

    def _renew_result(self, reply: Any, job_id: str, owner: str, generation: int) -> RenewResult:
        done, refusal = self._fenced_reply(reply, job_id, owner, generation)
        if refusal is not None:
            return refusal
        assert done is not None
        return Renewed(job_id, generation, int(done[0]), int(done[1]))

    # -- backend hooks ---------------------------------------------------------

    def _claim(self, job_id: str, owner: str, ttl_ms: int, task_name: str) -> ClaimResult:
        with self._errors("claim", job_id):
            reply = self._eval(self._claim_script, self.key(job_id), owner, ttl_ms, task_name)
            code = int(reply[0])
            if code == _ACQUIRED:
                return Acquired(
                    job_id, owner, int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4])
                )
            if code == _HELD_ELSEWHERE:
                holder = _text(reply[1])
                generation, lease_until, now = (int(v) for v in reply[2:5])
                return HeldElsewhere(job_id, holder, generation, (lease_until - now) / 1000)
            if code == _ALREADY_COMPLETED:
                return AlreadyCompleted(job_id, int(reply[1]))
            raise ResponseError(f"unexpected reply {reply!r} from the claim script")

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        with self._errors("renew", job_id):
            reply = self._eval(self._renew_script, self.key(job_id), owner, generation, ttl_ms)
            return self._renew_result(reply, job_id, owner, generation)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        calls = [(self.key(r.job_id), (r.owner, r.generation, ttl_to_ms(r.ttl))) for r in requests]
        with self._errors(f"renew_many of {len(calls)} leases"):
            replies = self._run_batch(self._renew_script, calls)
            return [
                self._renew_result(reply, r.job_id, r.owner, r.generation)
                for r, reply in zip(requests, replies, strict=True)
            ]

    def _complete(self, job_id: str, owner: str, generation: int) -> CompleteResult:
        with self._errors("complete", job_id):
            reply = self._eval(self._complete_script, self.key(job_id), owner, generation)
            _, refusal = self._fenced_reply(reply, job_id, owner, generation)
            return refusal if refusal is not None else Completed(job_id, generation)

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        with self._errors("release", job_id):
            reply = self._eval(self._release_script, self.key(job_id), owner, generation)
            _, refusal = self._fenced_reply(reply, job_id, owner, generation)
            return refusal if refusal is not None else Released(job_id, generation)

    def _get(self, job_id: str) -> LeaseRecord | None:
        with self._errors("get", job_id):
            fields = self._client.hgetall(self.key(job_id))
            if not fields:
                return None
            return _record(job_id, {_text(k): _text(v) for k, v in fields.items()})

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

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord]:
        with self._errors("records"):
            for keys in self._scan_keys():
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.hgetall(key)
                for key, fields in zip(keys, pipe.execute(raise_on_error=False), strict=True):
                    # deleted since the scan, or not a record (another kind of key)
                    if not isinstance(fields, dict) or not fields:
                        continue
                    record = _record(
                        self._job_id(key), {_text(k): _text(v) for k, v in fields.items()}
                    )
                    if state is None or record.state is state:
                        yield record

    def _purge_completed(self, older_than_ms: int) -> int:
        with self._errors("purge_completed"):
            deleted = 0
            for keys in self._scan_keys():
                calls = [(key, (older_than_ms,)) for key in keys]
                deleted += sum(int(r) for r in self._run_batch(self._purge_one_script, calls))
            return deleted

    def _now_ms(self) -> int:
        with self._errors("now_ms"):
            seconds, microseconds = self._client.time()
            return int(seconds) * 1000 + int(microseconds) // 1000
