"""How the Redis lease store reads what Redis gives back.

A record's hash fields become a :class:`LeaseRecord` (or
:class:`~celery_leases.errors.LeaseRecordUnreadable`), a fenced script's reply
becomes a result or a refusal, and a redis-py error is judged an outage or a
refusal that trying again cannot change. Also the password-free descriptions
of a server for messages.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import redis
from redis.client import NEVER_DECODE
from redis.commands.core import Script
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from celery_leases.stores.base import (
    LeaseRecord,
    LeaseState,
    Refusal,
    Renewed,
    RenewResult,
    refusal_for,
    unreadable,
)
from celery_leases.stores.deadline import time_left
from celery_leases.stores.redis import _scripts as scripts
from celery_leases.values import as_text

__all__ = ["RAW", "evalsha", "fenced_reply", "raw_command", "renew_result", "run_script"]

#: the options of a command whose reply is read as bytes even on a client
#: that decodes responses: a record's outcome is the task's serialized
#: result, which need not be text (pickle is not)
RAW: dict[str, Any] = {NEVER_DECODE: True}


def _decodes(client: Any) -> bool:
    """Whether ``client`` (a client, a cluster client or a pipeline) decodes
    its replies; True when it cannot be told."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return bool(pool.connection_kwargs.get("decode_responses"))
    return bool(getattr(getattr(client, "encoder", None), "decode_responses", True))


def raw_command(client: Any, *args: Any) -> Any:
    """``client.execute_command(*args)`` (a client, a cluster client or a
    pipeline) with its reply never decoded (:data:`RAW`)."""
    return client.execute_command(*args, **RAW)


def evalsha(client: Any, sha: str, *keys_and_args: Any) -> Any:
    """``EVALSHA sha 1 key *args`` on ``client``, its reply never decoded:
    through the client's own ``evalsha`` when the client does not decode
    anyway (so a tracer of ``evalsha`` sees the script), else
    :func:`raw_command`. ``keys_and_args`` starts with the number of keys."""
    if _decodes(client):
        return raw_command(client, "EVALSHA", sha, *keys_and_args)
    return client.evalsha(sha, *keys_and_args)


def run_script(client: Any, script: Script, key: str, *args: Any) -> Any:
    """Run ``script`` on ``key`` through ``client``: :func:`evalsha`, and
    after a NOSCRIPT reply ``SCRIPT LOAD`` and :func:`evalsha` once more, as
    redis-py's own ``Script.__call__`` does.

    A NOSCRIPT reply means the script did not run (the server's script cache
    was flushed, or this is another server), so sending it again cannot
    apply it twice. Inside :func:`~celery_leases.stores.deadline.bounded`
    (a completion or a release, bounded by its lease's remaining time) the
    wait for the reply ends at that deadline, not only at the socket timeout.
    """
    send = evalsha
    left = time_left()
    pool = getattr(client, "connection_pool", None)
    if left is not None and pool is not None:
        send = functools.partial(_evalsha_within, pool, left)
    try:
        try:
            return send(client, script.sha, 1, key, *args)
        except NoScriptError:
            client.script_load(script.script)
            return send(client, script.sha, 1, key, *args)
    except RedisError:
        raise  # an error reply was read whole, or redis-py closed the connection
    except BaseException:
        # Interrupted after the script was sent (a signal handler, a green
        # timeout, Ctrl-C): redis-py gives the connection back to its pool
        # with the reply unread, and a reply that arrives after the pool's
        # next look at it would be read as another call's.
        _close_idle_connections(client)
        raise


def _evalsha_within(pool: Any, left: float, client: Any, sha: str, *keys_and_args: Any) -> Any:
    """:func:`evalsha` on a connection of ``pool`` that waits at most
    ``left`` seconds for the reply's first bytes (``can_read``), through
    redis-py's public connection API. A connection whose reply did not come
    in time is dropped, so a late reply is never read as another call's."""
    conn = _checkout(pool)
    try:
        conn.send_command("EVALSHA", sha, *keys_and_args)
        if not conn.can_read(timeout=left):
            raise redis.TimeoutError(
                f"no reply from the store within {left:.3g} s, the time its caller had left"
            )
        reply = conn.read_response(disable_decoding=True)
    except ResponseError:
        pool.release(conn)  # the whole error reply was read: ready for the next call
        raise
    except BaseException:
        conn.disconnect()
        pool.release(conn)
        raise
    pool.release(conn)
    return reply


def _checkout(pool: Any) -> Any:
    """A connection of ``pool``: redis-py 5.0 names the command it is for,
    later releases take no argument (and warn when given one)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("EVALSHA")


def _close_idle_connections(client: Any) -> None:
    """Disconnect the connections that ``client``'s pool holds unused."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return  # a cluster client: a pool per node, none of them named here
    try:
        pool.disconnect(inuse_connections=False)
    except TypeError:
        # redis-py 5.0's BlockingConnectionPool can only close every
        # connection, also those in the middle of another call: leave them
        return


def describe_server(client: redis.Redis) -> str:
    """A password-free URL naming the server of ``client``, for messages."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a RedisCluster: no pool of its own, one per node
        node = client.get_default_node()  # type: ignore[attr-defined]
        return f"redis+cluster://{node.host}:{node.port}"
    kwargs = pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    scheme = "rediss" if kwargs.get("ssl") else "redis"
    host = kwargs.get("host", "localhost")
    return f"{scheme}://{host}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def hash_fields(flat: Sequence[Any]) -> dict[str, Any]:
    """A field -> raw value dict from a flat HGETALL reply of a script."""
    return {as_text(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


_WHOLE = re.compile(r"[0-9]+")
_INT_FIELDS = ("claimed_at", "renewed_at", "completed_at", "released_at")


def record_of(job_id: str, raw: Mapping[Any, Any], where: str) -> LeaseRecord:
    """The record of ``job_id`` from its raw hash fields.

    Raises:
        LeaseRecordUnreadable: a field is missing or is not what the store writes.
    """
    try:
        fields = {as_text(k): v for k, v in raw.items()}
        outcome = fields.pop("outcome", None)
        text = {name: as_text(value) for name, value in fields.items()}
        for name in ("generation", "lease_until", "renew_count", "takeovers", *_INT_FIELDS):
            if name in text and not _WHOLE.fullmatch(text[name]):
                raise ValueError(f"{name} is {text[name]!r}, not a whole number")
        for name in ("owner", "generation", "lease_until", "state"):
            if name not in text:
                raise ValueError(f"the field {name!r} is missing")
        times = {name: int(text[name]) if text.get(name) else None for name in _INT_FIELDS}
        if isinstance(outcome, str):  # a client that decodes responses
            outcome = outcome.encode("utf-8", "surrogateescape")
        return LeaseRecord(
            job_id=job_id,
            owner=text["owner"],
            generation=int(text["generation"]),
            lease_until_ms=int(text["lease_until"]),
            state=LeaseState(text["state"]),
            task_name=text.get("task_name", ""),
            claimed_at_ms=times["claimed_at"],
            renewed_at_ms=times["renewed_at"],
            completed_at_ms=times["completed_at"],
            renew_count=int(text.get("renew_count") or 0),
            takeovers=int(text.get("takeovers") or 0),
            send_id=text.get("send_id", ""),
            outcome=outcome,
            released_at_ms=times["released_at"],
            released_by=text.get("released_by", ""),
            release_reason=text.get("release_reason", ""),
            task_id=text.get("task_id", ""),
        )
    except ValueError as exc:  # UnicodeDecodeError and a bad state are ValueErrors
        raise unreadable(job_id, where, str(exc)) from exc


def fenced_reply(
    reply: Any, job_id: str, owner: str, generation: int, where: str
) -> tuple[list[Any] | None, Refusal | None]:
    """Split the reply of a fenced script (renew, complete, release) into
    (done payload, refusal).

    Raises:
        LeaseRecordUnreadable: the script found the record unreadable.
        ResponseError: the reply is none of the script's codes.
    """
    code = int(reply[0])
    if code == scripts.DONE:
        return list(reply[1:]), None
    if code == scripts.MISSING:
        return None, refusal_for(None, job_id, owner, generation)
    if code == scripts.REFUSED:
        record = record_of(job_id, hash_fields(reply[1]), where)
        return None, refusal_for(record, job_id, owner, generation)
    if code == scripts.UNREADABLE:
        raise unreadable(job_id, where, "found by the script")
    raise ResponseError(f"unexpected reply {reply!r} from a lease script")


def renew_result(reply: Any, job_id: str, owner: str, generation: int, where: str) -> RenewResult:
    """The result of a renew script's reply; see :func:`fenced_reply`."""
    done, refusal = fenced_reply(reply, job_id, owner, generation, where)
    if refusal is not None:
        return refusal
    assert done is not None
    return Renewed(job_id, generation, int(done[0]), int(done[1]))


def permanent(exc: RedisError) -> bool:
    """Whether ``exc`` is a refusal that trying again cannot change.

    Unreachable, timed out, loading, busy, read-only (a failover), out of
    memory, a cluster that is down, a disk it cannot write (``MISCONF``),
    too few replicas for ``min-replicas-to-write`` (``NOREPLICAS``), a
    script cache flushed again right after the script was loaded
    (``NOSCRIPT``): the store is unavailable for now.
    Credentials, rights, and any other error reply (an unknown command, a
    server without scripting): a configuration to fix.
    """
    if isinstance(
        exc,
        (
            AuthenticationError,
            AuthorizationError,
            NoPermissionError,
            AuthenticationWrongNumberOfArgsError,
        ),
    ):
        return True
    if not isinstance(exc, ResponseError):
        return False  # connection errors, timeouts, BusyLoadingError, bad replies
    if isinstance(
        exc, (ReadOnlyError, OutOfMemoryError, TryAgainError, ClusterDownError, NoScriptError)
    ):
        return False
    code = str(exc).split(" ", 1)[0].upper()
    if code in ("NOAUTH", "WRONGPASS", "NOPERM"):
        return True
    return code not in (
        "BUSY",
        "LOADING",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "READONLY",
        "MISCONF",
        "NOREPLICAS",
    )


def escape_glob(text: str) -> str:
    """``text`` with the glob characters of SCAN MATCH escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_record_keys(clients: Iterable[Any], prefix: str, count: int) -> Iterator[list[str]]:
    """Batches of the record keys under ``prefix`` (``<prefix>{<job id>}``) on
    each client in turn, each key once (SCAN may return a key twice)."""
    pattern = escape_glob(prefix) + "{*}"
    seen: set[str] = set()
    for client in clients:
        cursor = 0
        while True:
            next_cursor, keys = client.scan(cursor, match=pattern, count=count)
            cursor = int(next_cursor)
            batch = [k for k in (as_text(key) for key in keys) if k not in seen]
            seen.update(batch)
            if batch:
                yield batch
            if cursor == 0:
                break
