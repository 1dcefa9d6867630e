"""A lease lost between its claim and its body: the body never starts.

Timeline (TTL 2 s, so the local deadline is 1.5 s after the claim is sent;
the proxy holds every chunk 1 s each way)::

    worker                          proxy                 store
    t0 claim ------------------->   held 1 s ---------->  claimed, generation g
       (deadline t0 + 1.5 s)
    t0 + 2 s  reply arrives    <--  held 1 s -----------
       heartbeat: past its deadline, lost (no body yet: nothing to interrupt)
       lease_claimed receiver (slow: it waits for that notice)
       the body would start here -> it does not: fenced out, published again
    a copy claims g + 1 and runs the body, once

A body started on that lease would run to its end unfenced, then be fenced
out and run again by the copy: its effects would happen twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.test_store_faults import proxied
from tests.proxy import Proxy
from tests.servers import RedisServer

TTL = 2.0
#: each way, so a claim's reply comes back 2 s after it was sent, past the
#: local deadline (TTL minus the 0.5 s drift margin)
CLAIM_DELAY = 1.0


@pytest.fixture
def store_proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


@pytest.mark.parametrize(
    ("pool", "on_lost"), [("prefork", "stop"), ("threads", "raise"), ("gevent", "flag")]
)
def test_a_lease_lost_before_its_body_starts_never_runs_the_body(
    cluster: Cluster, store_proxy: Proxy, pool: str, on_lost: str
) -> None:
    cluster.configure(ttl=TTL, on_lost=on_lost, slow_claimed=True)
    cluster.worker("a", pool=pool, store=proxied(cluster, store_proxy))
    # a first run opens the store connection and loads the scripts
    cluster.send(STEPS, 0.05).get(timeout=30)
    store_proxy.delay(CLAIM_DELAY)
    result = cluster.send(STEPS, 0.2)
    (late,) = cluster.side.wait_event(result.id, "claimed-late", timeout=30)
    store_proxy.heal()  # the copy's claim comes back in time
    value = result.get(timeout=60)
    assert late["noticed"]  # lost while the run was between its claim and its body
    assert late["generation"] < value["generation"]
    starts = cluster.side.events(result.id, "start")
    assert [start["generation"] for start in starts] == [value["generation"]]
    assert cluster.side.done_count(result.id) == 1
