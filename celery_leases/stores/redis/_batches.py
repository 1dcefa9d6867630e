"""The batched calls of the Redis lease store: script calls in one pipeline,
and ``renew_many``.

``renew_many`` sends one renew-many script call per chunk of
:data:`RENEW_CHUNK` leases, all in one pipeline, on the store's renewal
client (see :mod:`celery_leases.stores.redis._connections`). A call that
failed because a Cluster slot moved may have renewed the leases before the
moved one: renewing them again moves their ``lease_until`` on once more,
which the fence allows. So its whole chunk is renewed again lease by lease,
each call following its own redirection. A server that cannot compile the
script (before Redis 7) has every chunk renewed lease by lease.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.stores.base import (
    Renewed,
    RenewRequest,
    RenewResult,
    ttl_to_ms,
    unreadable_refusal,
)
from celery_leases.stores.redis._replies import evalsha, renew_result

__all__ = ["RENEW_CHUNK", "Call", "RedisBatches"]

logger = logging.getLogger("celery_leases.stores.redis")

#: Leases per call of the renew-many script. One call holds the server for
#: its whole run (about 4 µs per lease); the calls of one ``renew_many``
#: share a pipeline, so they still take one round trip.
RENEW_CHUNK = 500

#: Error replies of a renew-many call that reached a Cluster node not
#: serving one of its keys' slots (a resharding, or a slot map the client has
#: not caught up with): the call stopped at that key or did not start.
_REDIRECTS = (AskError, TryAgainError, ClusterCrossSlotError)  # MovedError is an AskError
_NON_LOCAL = "non local key"

#: A batched call: the keys it names and the rest of its arguments.
Call = tuple[Sequence[str], Sequence[Any]]


def _cannot_compile(error: ResponseError) -> bool:
    """Whether the server refused to compile a script (its flags line, before Redis 7)."""
    text = str(error)
    return "Error compiling script" in text or "shebang" in text


def _redirected(error: ResponseError) -> bool:
    return isinstance(error, _REDIRECTS) or _NON_LOCAL in str(error)


class RedisBatches:
    """The batched calls of :class:`~celery_leases.stores.redis.RedisStore`
    (a base class of it; the Cluster store overrides how a batch is sent)."""

    url: str
    _renew_client: redis.Redis
    _renew_script: Script
    _renew_many_script: Script
    #: False once the server could not compile the renew-many script
    #: (Redis before 7 reads its flags line as code): renew one by one
    _renew_many_compiles: bool

    if TYPE_CHECKING:

        def key(self, job_id: str) -> str: ...

    def _run_batch(
        self, client: redis.Redis, script: Script, calls: Sequence[Call], *, single: bool = True
    ) -> list[Any]:
        """Run ``script`` once per (keys, args) in one pipelined round trip of ``client``.

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
        replies = self._send_batch(client, script.sha, calls, single)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            client.script_load(script.script)
            again = self._send_batch(client, script.sha, [calls[i] for i in missing], single)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        if single:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def _send_batch(
        self, client: redis.Redis, sha: str, calls: Sequence[Call], follow: bool
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            evalsha(pipe, sha, len(keys), *keys, *args)
        return list(pipe.execute(raise_on_error=False))

    def _renew_chunks(self, requests: Sequence[RenewRequest]) -> list[list[int]]:
        """The requests' indexes, grouped into one renew-many call each."""
        return [
            list(range(start, min(start + RENEW_CHUNK, len(requests))))
            for start in range(0, len(requests), RENEW_CHUNK)
        ]

    def _renew_batch(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """Renew ``requests`` on the renewal client; see the module's description."""
        chunks = self._renew_chunks(requests)
        ttl_ms: dict[float, int] = {}  # the leases of one worker mostly share a ttl
        ttls = [ttl_ms.get(r.ttl) or ttl_ms.setdefault(r.ttl, ttl_to_ms(r.ttl)) for r in requests]
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
        calls: list[Call] = []
        for chunk in chunks:
            leases = "".join(
                f"{self.key(requests[i].job_id)}\0{requests[i].owner}\0"
                f"{requests[i].generation}\0{ttls[i]}\0"
                for i in chunk
            )
            calls.append(((self.key(requests[chunk[0]].job_id),), (leases,)))
        try:
            return self._run_batch(self._renew_client, self._renew_many_script, calls, single=False)
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
        calls: list[Call] = [
            ((self.key(requests[i].job_id),), (requests[i].owner, requests[i].generation, ttls[i]))
            for i in chunk
        ]
        replies = self._run_batch(self._renew_client, self._renew_script, calls)
        for index, reply in zip(chunk, replies, strict=True):
            results[index] = self._batch_renew_result(reply, requests[index])

    def _batch_renew_result(self, reply: Any, r: RenewRequest) -> RenewResult:
        try:
            return renew_result(reply, r.job_id, r.owner, r.generation, self.url)
        except LeaseRecordUnreadable:
            # one bad record must not stop the heartbeat of every other lease
            return unreadable_refusal(r.job_id, r.owner, r.generation)
