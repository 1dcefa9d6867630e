"""The Redis lease store on a Redis Cluster, through redis-py's ``RedisCluster``.

URL: ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS), the
spelling of the ``celery-redis-cluster`` result backend; any one node is
enough, the client learns the others and the slot map from it.

Every operation but one stays one key, one slot, one script: a record's
key is ``<prefix>{<job id>}``, so its slot is that of the job id.
``renew_many`` groups its leases by the node that serves each key's slot and
sends each node its leases in renew-many script calls (a script flag lets
one call name keys of several slots on one node), one pipeline per node, one
node after another. A call that meets a slot moved by a resharding is
refused before it starts (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CROSSSLOT``) or
stops at the first record its node no longer serves; its leases are then
renewed one call each (a lease renewed twice is allowed by its fence), and
each such call follows the redirection to the node that now serves the slot.
``records()`` and ``purge()`` scan every primary.

``renew_many`` goes through a cluster client of its own, whose per-node pools
tasks never hold (see :mod:`celery_leases.stores.redis._connections`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ConnectionError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError,
)

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.redact import mask
from celery_leases.stores.redis._batches import RENEW_CHUNK, Call
from celery_leases.stores.redis._connections import (
    RENEW_CONNECTIONS,
    check_renew_connections,
    client_options,
)
from celery_leases.stores.redis._replies import evalsha, scan_record_keys
from celery_leases.stores.redis._store import SCAN_BATCH, RedisStore
from celery_leases.stores.results import RenewRequest
from celery_leases.urls import url_scheme

__all__ = ["CLUSTER_SCHEMES", "RedisClusterStore"]

#: URL schemes of a cluster, and the plain scheme each stands for
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def _open_cluster(url: str, plain_url: str, options: dict[str, Any]) -> RedisCluster:
    """A cluster client of ``plain_url`` (``url`` without ``+cluster``).

    Raises:
        LeaseConfigurationError: the URL or an option is invalid.
        StoreUnavailable: no node of the URL answered.
    """
    try:
        return RedisCluster.from_url(plain_url, **options)
    except (ValueError, TypeError) as exc:
        raise LeaseConfigurationError(
            f"cannot open the Redis Cluster lease store {mask(url)!r}: {exc}"
        ) from exc
    except (RedisClusterException, RedisError) as exc:
        raise StoreUnavailable(
            f"the Redis Cluster at {mask(url)} did not answer ({exc}); check that its "
            "nodes are running and reachable"
        ) from exc


class RedisClusterStore(RedisStore):
    """The Redis store on a cluster; see the module's description.

    Args:
        client: a ``redis.cluster.RedisCluster``.
        prefix: put in front of every key; no ``{`` or ``}``.
        check_config: as for :class:`RedisStore` (one node is asked).
        renew_client: a second ``RedisCluster`` of the same cluster, for
            ``renew_many`` alone (:meth:`from_url` makes one); without it
            renewals share ``client``'s pools with every other call.
    """

    def __init__(
        self,
        client: RedisCluster,
        *,
        prefix: str = "leases:",
        check_config: bool = True,
        renew_client: RedisCluster | None = None,
    ) -> None:
        if isinstance(prefix, str) and ("{" in prefix or "}" in prefix):
            raise LeaseConfigurationError(
                f"prefix {prefix!r} has a brace: on a cluster the hash tag must be the job id"
            )
        # RedisCluster answers the commands the store sends as redis.Redis does
        super().__init__(
            client,  # type: ignore[arg-type]
            prefix=prefix,
            check_config=check_config,
            renew_client=client if renew_client is None else renew_client,  # type: ignore[arg-type]
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "leases:",
        check_config: bool = True,
        renew_connections: int = RENEW_CONNECTIONS,
        **client_options_: Any,
    ) -> RedisClusterStore:
        """Open the store on the cluster that the node at ``url`` belongs to.

        Unlike a single-node store, opening asks that node for the slot map
        (twice: once for the task client, once for the renewal client, whose
        pools hold ``renew_connections`` connections per node;
        ``max_connections`` sizes the task client's, per node).

        Raises:
            LeaseConfigurationError: the URL or an option is invalid.
            StoreUnavailable: no node of the URL answered.
        """
        plain = CLUSTER_SCHEMES.get(url_scheme(url))
        if plain is None:
            raise LeaseConfigurationError(
                f"{mask(url)!r} is not a cluster URL; use redis+cluster://host:port"
            )
        renew_connections = check_renew_connections(renew_connections)
        options = client_options(client_options_)
        nodes = f"{plain}://{url.partition('://')[2]}"
        client = _open_cluster(url, nodes, options)
        try:
            renew_client = _open_cluster(
                url, nodes, {**options, "max_connections": renew_connections}
            )
        except BaseException:
            client.close()
            raise
        store = cls(client, prefix=prefix, check_config=False, renew_client=renew_client)
        store.url = mask(url)
        store._config_pending = check_config
        if check_config:
            store._check_config(store._client)
        return store

    @property
    def _cluster(self) -> RedisCluster:
        return self._client  # type: ignore[return-value]

    @property
    def _renew_cluster(self) -> RedisCluster:
        return self._renew_client  # type: ignore[return-value]

    def _scan_keys(self) -> Iterator[list[str]]:
        """Batches of record keys under the prefix, primary after primary."""
        primaries = self._cluster.get_primaries()  # type: ignore[no-untyped-call]
        clients = (node.redis_connection for node in primaries)
        return scan_record_keys(clients, self.prefix, SCAN_BATCH)

    def _renew_chunks(self, requests: Sequence[RenewRequest]) -> list[list[int]]:
        """The requests' indexes by the node serving their keys, in chunks."""
        by_node: dict[str, list[int]] = {}
        for index, r in enumerate(requests):
            node = self._renew_cluster.get_node_from_key(self.key(r.job_id))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, []).append(index)
        return [
            indexes[start : start + RENEW_CHUNK]
            for indexes in by_node.values()
            for start in range(0, len(indexes), RENEW_CHUNK)
        ]

    def _send_batch(
        self, client: redis.Redis, sha: str, calls: Sequence[Call], single: bool
    ) -> list[Any]:
        """One pipeline per node that serves the calls' keys, one node after
        another, on the nodes' pools of ``client`` (a ``RedisCluster``).

        A call names keys of one node only (its first key says which). A
        ``single`` call (on one record) refused with ``MOVED`` or ``ASK``
        (its slot moved since the client last read the slot map) did not
        run; it is sent again alone through the cluster client, which
        follows the redirection. A renew-many call's refusal (its other
        records may not have moved) is left to the caller.
        """
        cluster: RedisCluster = client  # type: ignore[assignment]
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for index, (keys, _) in enumerate(calls):
            node = cluster.get_node_from_key(keys[0])  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, []).append(index)
            nodes[node.name] = node
        replies: list[Any] = [None] * len(calls)
        for name, indexes in by_node.items():
            pipe = nodes[name].redis_connection.pipeline(transaction=False)
            for index in indexes:
                keys, args = calls[index]
                evalsha(pipe, sha, len(keys), *keys, *args)
            try:
                answers = pipe.execute(raise_on_error=False)
            except (ConnectionError, TimeoutError):
                # the node is gone or moved: read the slot map again for the
                # next call, as the cluster client does after such an error
                with contextlib.suppress(RedisError, RedisClusterException):
                    cluster.nodes_manager.initialize()
                raise
            for index, reply in zip(indexes, answers, strict=True):
                replies[index] = reply
        for index, reply in enumerate(replies):
            keys, args = calls[index]
            if single and (
                isinstance(reply, (MovedError, AskError))
                or (isinstance(reply, ResponseError) and str(reply).startswith(("MOVED", "ASK")))
            ):
                try:
                    replies[index] = evalsha(cluster, sha, 1, keys[0], *args)
                except RedisError as exc:
                    replies[index] = exc
        return replies
