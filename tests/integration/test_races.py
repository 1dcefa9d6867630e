"""Many processes race for one job; the store hands the lease to one at a time.

Sixteen worker processes (started with ``spawn``, each opening its own store
handle from the URL, as real Celery workers would) wait at a barrier and then
all ask at once, round after round. The memory store is not here: it lives in
one process.

Rounds default to a few so the suite stays quick; set ``LEASES_RACE_ROUNDS``
for a long run (see docs/testing.md)::

    LEASES_RACE_ROUNDS=500 .venv/bin/pytest tests/integration/test_races.py
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest

from celery_leases import (
    Acquired,
    HeldElsewhere,
    LeaseError,
    LeaseStore,
    Refusal,
    RefusalReason,
    Renewed,
    open_store,
)

WORKERS = 16
ROUNDS = int(os.environ.get("LEASES_RACE_ROUNDS", "6"))
#: seconds any one wait may take (process start-up included) before the test fails
WAIT = 90.0
#: long enough never to run out while the racers of one round are answered
LIVE_TTL = 60.0
#: a lease the test lets run out by the store's clock between rounds
SHORT_TTL = 0.3

pytestmark = [
    pytest.mark.parametrize("store_kind", ["redis", "postgres", "sqlite", "mysql"], indirect=True),
    # a long run on demand must not hit the suite's default timeout
    pytest.mark.timeout(120 + ROUNDS * 4),
]


@dataclass(frozen=True)
class Answer:
    """What one racer got, in a form that crosses process boundaries."""

    worker: int
    kind: str
    generation: int | None = None
    store_now_ms: int | None = None
    lease_until_ms: int | None = None
    reason: str | None = None


def _answer(worker: int, result: object) -> Answer:
    if isinstance(result, Acquired):
        return Answer(
            worker, "acquired", result.generation, result.store_now_ms, result.lease_until_ms
        )
    if isinstance(result, HeldElsewhere):
        return Answer(worker, "held", result.generation)
    if isinstance(result, Renewed):
        return Answer(
            worker, "renewed", result.generation, result.store_now_ms, result.lease_until_ms
        )
    if isinstance(result, Refusal):
        return Answer(worker, "refused", result.current_generation, reason=result.reason.value)
    return Answer(worker, f"unexpected {result!r}")


def racer(
    worker: int,
    url: str,
    options: dict[str, Any],
    inbox: multiprocessing.Queue[tuple[Any, ...] | None],
    outbox: multiprocessing.Queue[Answer],
    barrier: Barrier,
) -> None:
    """Worker process: per round, take a command, wait at the barrier, run it.

    Commands: ``("claim", job_id, ttl)`` or ``("renew", job_id, owner,
    generation, ttl)``; ``None`` ends the loop.
    """
    owner = f"racer-{worker}-{os.getpid()}"
    with open_store(url, **options) as store:
        while (command := inbox.get(timeout=WAIT)) is not None:
            barrier.wait(timeout=WAIT)
            try:
                if command[0] == "claim":
                    result: object = store.claim(command[1], owner, command[2])
                else:
                    _, job_id, holder, generation, ttl = command
                    result = store.renew(job_id, holder, generation, ttl)
            except LeaseError as exc:
                result = exc
            outbox.put(_answer(worker, result))


@dataclass
class Racers:
    """The running racer processes and their queues."""

    processes: list[BaseProcess]
    inboxes: list[multiprocessing.Queue[tuple[Any, ...] | None]]
    outbox: multiprocessing.Queue[Answer]
    barrier: Barrier

    def run(self, commands: list[tuple[Any, ...]]) -> list[Answer]:
        """Send one command to each racer, release them together, collect answers."""
        for inbox, command in zip(self.inboxes, commands, strict=True):
            inbox.put(command)
        self.barrier.wait(timeout=WAIT)
        answers = []
        for _ in commands:
            try:
                answers.append(self.outbox.get(timeout=WAIT))
            except queue.Empty:
                dead = [p.pid for p in self.processes if not p.is_alive()]
                pytest.fail(f"racers did not answer within {WAIT} s (dead: {dead})")
        return sorted(answers, key=lambda a: a.worker)


@pytest.fixture
def racers(store_url: tuple[str, dict[str, Any]], store: LeaseStore) -> Iterator[Racers]:
    """Sixteen racer processes on the store (``store`` makes its table first)."""
    url, options = store_url
    context: SpawnContext = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS + 1)
    outbox: multiprocessing.Queue[Answer] = context.Queue()
    inboxes: list[multiprocessing.Queue[tuple[Any, ...] | None]] = [
        context.Queue() for _ in range(WORKERS)
    ]
    processes: list[BaseProcess] = [
        context.Process(
            target=racer, args=(n, url, options, inboxes[n], outbox, barrier), daemon=True
        )
        for n in range(WORKERS)
    ]
    for process in processes:
        process.start()
    try:
        yield Racers(processes, inboxes, outbox, barrier)
    finally:
        for inbox in inboxes:
            inbox.put(None)
        barrier.abort()
        deadline = time.monotonic() + 20
        for process in processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def wait_until_run_out(store: LeaseStore, lease_until_ms: int) -> None:
    deadline = time.monotonic() + 15
    while store.now_ms() <= lease_until_ms + 100:
        assert time.monotonic() < deadline, "the store clock did not pass the lease"
        time.sleep(0.05)


def test_one_winner_per_round_and_no_generation_twice(racers: Racers, store: LeaseStore) -> None:
    job_id = "raced-job"
    handed_out: list[int] = []
    for round_no in range(ROUNDS):
        # even rounds: the winner releases; odd rounds: its short lease runs out
        ttl = LIVE_TTL if round_no % 2 == 0 else SHORT_TTL
        answers = racers.run([("claim", job_id, ttl)] * WORKERS)
        winners = [a for a in answers if a.kind == "acquired"]
        others = [a for a in answers if a.kind != "acquired"]
        assert all(a.kind == "held" for a in others), others

        if ttl == SHORT_TTL and len(winners) > 1:
            # On a starved machine the racers of one round can spread over
            # more than the short TTL; a second winner is then legitimate,
            # but only after the lease before it ran out (I2).
            winners.sort(key=lambda a: a.generation or 0)
            for earlier, later in itertools.pairwise(winners):
                assert earlier.lease_until_ms is not None
                assert later.store_now_ms is not None
                assert later.store_now_ms >= earlier.lease_until_ms, (
                    f"I2: round {round_no}: {later} claimed while {earlier} was live"
                )
        else:
            assert len(winners) == 1, f"round {round_no}: {len(winners)} winners: {winners}"
        assert {a.generation for a in others} <= {w.generation for w in winners}

        for winner in winners:
            assert winner.generation is not None
            assert winner.store_now_ms is not None
            assert not handed_out or winner.generation == max(
                handed_out[-1] + 1, winner.store_now_ms
            ), f"round {round_no}: generation {winner.generation} after {handed_out[-1]}"
            handed_out.append(winner.generation)

        last = winners[-1]
        assert last.generation is not None
        assert last.lease_until_ms is not None
        if ttl == LIVE_TTL:
            record = store.get(job_id)
            assert record is not None
            released = store.release(job_id, record.owner, last.generation)
            assert not isinstance(released, Refusal), released
        else:
            wait_until_run_out(store, last.lease_until_ms)

    assert len(handed_out) == len(set(handed_out)) >= ROUNDS


def test_renew_after_run_out_races_claims_and_one_side_wins(
    racers: Racers, store: LeaseStore
) -> None:
    job_id = "renew-race-job"
    holder = "the-holder"
    handed_out: list[int] = []
    for round_no in range(ROUNDS):
        held = store.claim(job_id, holder, SHORT_TTL)
        assert isinstance(held, Acquired), held
        handed_out.append(held.generation)
        wait_until_run_out(store, held.lease_until_ms)

        # worker 0 renews the run-out lease while fifteen others claim it
        commands: list[tuple[Any, ...]] = [("renew", job_id, holder, held.generation, LIVE_TTL)]
        commands += [("claim", job_id, LIVE_TTL)] * (WORKERS - 1)
        renewal, *claims = racers.run(commands)
        winners = [a for a in claims if a.kind == "acquired"]
        assert all(a.kind in ("acquired", "held") for a in claims), claims

        if renewal.kind == "renewed":
            # the renewal came first; the lease was live for every claim after it
            assert winners == [], f"round {round_no}: renewed and also claimed: {winners}"
            assert {a.generation for a in claims} == {held.generation}
            current_owner, current_generation = holder, held.generation
        else:
            assert renewal.kind == "refused", renewal
            assert renewal.reason == RefusalReason.SUPERSEDED.value
            assert len(winners) == 1, f"round {round_no}: {len(winners)} winners: {winners}"
            winner = winners[0]
            assert winner.store_now_ms is not None
            assert winner.generation == max(held.generation + 1, winner.store_now_ms)
            assert renewal.generation == winner.generation
            assert {a.generation for a in claims if a.kind == "held"} <= {winner.generation}
            handed_out.append(winner.generation)
            record = store.get(job_id)
            assert record is not None
            current_owner, current_generation = record.owner, winner.generation

        released = store.release(job_id, current_owner, current_generation)
        assert not isinstance(released, Refusal), released

    assert handed_out == sorted(set(handed_out))
