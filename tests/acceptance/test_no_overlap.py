"""``lease_on_busy="skip"`` on real workers: a beat-like job never overlaps
itself, and calls made while it runs are answered at once.

``acceptance.beat`` is one job whatever its arguments (``lease_key="beat"``).
A sender calls it every 2 s; each run takes 7 s; the lease TTL is 2 s, so
the lease is renewed all through a run. Each call that finds a run going is
skipped: its result is ``LeaseSkipped`` right away, nothing is published
again, and nothing piles up behind the run.
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timezone

import pytest
from celery import chord, group
from celery.result import AsyncResult

from celery_leases import LeaseSkipped, LeaseState
from celery_leases.stores.waiters import Waiter
from tests.acceptance.app import BEAT, ECHO
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import Worker, wait_until
from tests.broker_servers import RabbitServer

PERIOD = 2.0
BODY = 7.0
SENDS = 8
#: the longest a skipped call may take from its send to its stored answer:
#: one delivery, one claim and one read of the record, on a loaded machine;
#: well below the run it found going (``BODY``)
ANSWER_LIMIT = 4.0
#: generous bound for an answer the test waits on
WAIT = 60.0

STORES = pytest.mark.parametrize("lease_store_target", ["redis", "postgres"], indirect=True)


def _answer(result: AsyncResult) -> dict[str, object] | LeaseSkipped:
    try:
        return dict(result.get(timeout=WAIT))
    except LeaseSkipped as skipped:
        # without its traceback: the frames in it keep the result (and its
        # backend's connection) alive past the test, until a garbage collection
        return skipped.with_traceback(None)


def _done_at(result: AsyncResult) -> float:
    """When the worker stored the answer (wall clock, seconds)."""
    done: datetime = result.date_done
    if done.tzinfo is None:
        done = done.replace(tzinfo=timezone.utc)
    return done.timestamp()


@STORES
def test_a_call_every_2_s_of_a_7_s_job_runs_it_without_overlap_or_backlog(
    cluster: Cluster,
) -> None:
    cluster.worker("a")
    cluster.worker("b")
    sent: list[tuple[float, AsyncResult]] = []
    first = time.monotonic()
    for n in range(SENDS):
        time.sleep(max(first + n * PERIOD - time.monotonic(), 0.0))  # the sender's period
        sent.append((time.time(), cluster.send(BEAT, BODY)))
    answers = [(at, result, _answer(result)) for at, result in sent]

    ran = [result for _, result, answer in answers if not isinstance(answer, LeaseSkipped)]
    skipped = [(at, result, a) for at, result, a in answers if isinstance(a, LeaseSkipped)]
    print(
        f"{len(ran)} runs, {len(skipped)} skipped; skipped answered after "
        f"{[round(_done_at(r) - at, 2) for at, r, _ in skipped]} s"
    )
    assert len(ran) >= 2, "the job ran again once free"
    assert len(ran) <= 1 + SENDS * PERIOD / BODY, "calls piled up and ran one after another"
    assert len(ran) + len(skipped) == SENDS
    runs = sorted(
        (cluster.side.wait_event(r.id, "start", timeout=WAIT)[0]["at"],
         cluster.side.wait_event(r.id, "done", timeout=WAIT)[0]["at"])
        for r in ran
    )  # fmt: skip
    for (_, done), (start, _) in itertools.pairwise(runs):
        assert start >= done, f"runs overlap: {runs}"
    run_ids = {r.id for r in ran}
    for at, result, error in skipped:
        assert result.state == "FAILURE"
        assert _done_at(result) - at < ANSWER_LIMIT, "a skipped call is answered at once"
        assert any(f"held by task {run_id}" in str(error) for run_id in run_ids), error
        assert cluster.side.events(result.id, "start") == []  # its body never ran
    # nothing waits in the broker and nothing was published again
    assert cluster.side.client.llen(cluster.config.queue) == 0
    logs = "".join(worker.log() for worker in cluster.workers)
    assert "lease deferred" not in logs
    assert logs.count("lease skipped") == len(skipped)
    # the store names the job's last skipped call (celery leases show, the admin)
    last = max(skipped, key=lambda call: call[0])[1]

    def last_skipped() -> Waiter | None:
        entries = cluster.store.waiters("beat")
        return next((e for e in entries if e.is_last_skipped and e.task_id == last.id), None)

    noted = wait_until(last_skipped, timeout=WAIT, message="the last skipped call's mark")
    assert abs(noted.waiting_since_ms / 1000 - _done_at(last)) < ANSWER_LIMIT


@STORES
def test_a_killed_holder_lets_the_next_call_run_once_its_lease_runs_out(
    cluster: Cluster,
) -> None:
    workers = [cluster.worker("a"), cluster.worker("b")]
    holder = cluster.send(BEAT, 120.0)
    [started] = cluster.side.wait_event(holder.id, "start", timeout=WAIT)
    held = cluster.wait_record(
        "beat", timeout=WAIT, message="the holder's lease", state=LeaseState.HELD
    )
    victim = _worker_named(workers, started["worker"])
    victim.kill()  # SIGKILL, as a machine crash: nothing releases the lease

    skipped: list[LeaseSkipped] = []
    while True:  # each call is answered before the next is sent
        answer = _answer(cluster.send(BEAT, 0.1))
        if not isinstance(answer, LeaseSkipped):
            break
        skipped.append(answer)
        assert len(skipped) < 500, "the dead holder's lease never ran out"
    record = cluster.record("beat")
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert answer["generation"] == record.generation > held.generation
    assert record.takeovers == 1  # it took over a lease that ran out while held
    assert all(error.holder_task_id == holder.id or holder.id in str(error) for error in skipped)


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_skipped_calls_answer_names_the_holder_and_the_job_through_the_result_backend(
    cluster: Cluster, serializer: str
) -> None:
    """A client that looks the skipped call up by its id (another process,
    say) gets ``LeaseSkipped`` back from the Redis result backend with the
    holder's task id, the job id and the generation as attributes, under the
    json serializer (which stores an error as its class name and args) as
    under pickle."""
    cluster.configure(result_serializer=serializer)
    workers = [cluster.worker("a"), cluster.worker("b")]
    holder = cluster.send(BEAT, 120.0)
    [started] = cluster.side.wait_event(holder.id, "start", timeout=WAIT)
    held = cluster.wait_record("beat", timeout=WAIT, message="the lease", state=LeaseState.HELD)
    call = cluster.send(BEAT, 0.1)

    lookup = cluster.new_app().AsyncResult(call.id)
    answer = lookup.get(timeout=WAIT, propagate=False)
    assert isinstance(answer, LeaseSkipped), answer
    answer.with_traceback(None)
    assert lookup.state == "FAILURE"
    assert isinstance(lookup.result, LeaseSkipped)
    for error in (answer, lookup.result):
        assert error.holder_task_id == holder.id
        assert error.job_id == "beat"
        assert error.generation == started["generation"] == held.generation
        assert error.holder == error.owner == held.owner
        assert 0 < error.remaining <= cluster.config.ttl
        assert f"held by task {holder.id}" in str(error)
        assert "job 'beat'" in str(error)
    for worker in workers:  # the holder's 120 s run is not waited for
        worker.kill()


def _worker_named(workers: list[Worker], hostname: str) -> Worker:
    [found] = [w for w in workers if hostname.startswith(f"{w.name}@")]
    return found


@pytest.mark.parametrize("broker_kind", ["amqp"], indirect=True)
def test_a_killed_holders_message_given_back_runs_and_a_skipped_call_is_acked_once(
    cluster: Cluster, rabbit_server: RabbitServer
) -> None:
    """RabbitMQ gives a killed worker's unacknowledged message to another
    worker at once (``acks_late``): the holder's own send, so it waits for
    the dead holder's lease and takes the job over, never skipped. A call
    made while it runs is skipped and acknowledged once (a second ack of
    one delivery would close the channel, PRECONDITION_FAILED, and give
    every message on it back)."""
    workers = [cluster.worker("a"), cluster.worker("b"), cluster.worker("c")]
    holder = cluster.send(BEAT, 6.0)
    [started] = cluster.side.wait_event(holder.id, "start", timeout=WAIT)
    _worker_named(workers, started["worker"]).kill()

    first, second = cluster.side.wait_event(holder.id, "start", timeout=WAIT, count=2)
    assert second["generation"] > first["generation"]  # the same message took over
    skipped = _answer(cluster.send(BEAT, 0.1))
    assert isinstance(skipped, LeaseSkipped)
    assert f"held by task {holder.id}" in str(skipped)
    assert skipped.holder_task_id == holder.id

    value = _answer(holder)
    assert isinstance(value, dict), value
    assert value["generation"] == second["generation"]
    record = cluster.record("beat")
    assert record is not None
    assert (record.state, record.takeovers) == (LeaseState.COMPLETED, 1)

    def queue_empty() -> bool:
        listed = rabbit_server.ctl_call(
            "list_queues", "name", "messages_ready", "messages_unacknowledged"
        )
        return f"{cluster.config.queue}\t0\t0" in listed.splitlines()

    wait_until(queue_empty, timeout=WAIT, message="nothing ready or unacknowledged")
    logs = "".join(worker.log() for worker in cluster.workers)
    assert "PRECONDITION_FAILED" not in logs
    assert len(cluster.side.events(holder.id, "start")) == 2


def test_group_members_of_one_key_each_get_an_answer_and_a_chord_stops(
    cluster: Cluster,
) -> None:
    """A group whose members share the key: one runs, every other member is
    answered ``LeaseSkipped`` at once (none is left without a result); a
    chord over them does not call its body, and says why."""
    for name in ("a", "b", "c"):
        cluster.worker(name)
    client = cluster.client
    beat = client.signature(BEAT, queue=cluster.config.queue)
    members = group(beat.clone((3.0,)) for _ in range(3)).apply_async()
    answers = members.get(timeout=WAIT, propagate=False)
    ran = [a for a in answers if isinstance(a, dict)]
    skipped = [a for a in answers if isinstance(a, LeaseSkipped)]
    assert (len(ran), len(skipped)) == (1, 2), answers
    for error in skipped:
        error.with_traceback(None)

    body = client.signature(ECHO, args=("body",), queue=cluster.config.queue)
    ended = chord(beat.clone((3.0,)) for _ in range(2))(body)
    with pytest.raises(LeaseSkipped, match="was skipped") as raised:
        ended.get(timeout=WAIT)
    raised.value.with_traceback(None)
    assert cluster.side.events(kind="start", job_id=ended.id) == []
