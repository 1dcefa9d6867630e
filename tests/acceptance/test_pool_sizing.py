"""A threads worker wider than its store client's default pool.

Every thread claims at once through a slowed link, so every claim holds a
connection at the same time: the worker gives the store's pool one per
task (and spares), or the claims beyond it would be deferred (redis-py's
pool of 100 fails at once) or wait for one another's connections
(SQLAlchemy's pool of 5 + 10).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from celery_leases.pool_sizing import SPARE_CONNECTIONS
from tests.acceptance.app import ECHO
from tests.acceptance.conftest import Cluster, StoreTarget
from tests.proxy import Proxy
from tests.servers import MariadbServer, PostgresServer, RedisServer

#: threads per store kind, more than its client's default pool, and the
#: option the worker sets
WIDE = {"redis": 110, "postgres": 20, "mysql": 20}
OPTION = {"redis": "max_connections", "postgres": "pool_size", "mysql": "pool_size"}
SERVER = {"redis": "redis_server", "postgres": "postgres_server", "mysql": "mariadb_server"}


@pytest.fixture
def store_proxy(request: pytest.FixtureRequest, lease_store_target: StoreTarget) -> Iterator[Proxy]:
    server: RedisServer | PostgresServer | MariadbServer
    server = request.getfixturevalue(SERVER[lease_store_target.kind])
    with Proxy("127.0.0.1", server.port) as proxy:
        yield proxy


@pytest.mark.parametrize(
    "lease_store_target",
    [
        "redis",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
    indirect=True,
)
def test_a_threads_worker_wider_than_the_default_pool_claims_every_task_at_once(
    cluster: Cluster, store_proxy: Proxy, lease_store_target: StoreTarget
) -> None:
    kind = lease_store_target.kind
    wide, option = WIDE[kind], OPTION[kind]
    store = re.sub(r":\d+/", f":{store_proxy.port}/", cluster.config.store, count=1)
    assert option not in cluster.config.store_options
    cluster.configure(ttl=60)  # a claim slowed this much is far from its deadline
    worker = cluster.worker("a", pool="threads", concurrency=wide, store=store)
    store_proxy.delay(0.2)
    results = [cluster.send(ECHO, n) for n in range(wide)]
    answers = [result.get(timeout=120) for result in results]
    store_proxy.heal()
    assert sorted(answer["value"] for answer in answers) == list(range(wide))
    assert [a for a in answers if a["deferrals"]] == []
    assert "lease store unavailable at claim" not in worker.log()
    assert f"{option}={wide + SPARE_CONNECTIONS}" in worker.log()
