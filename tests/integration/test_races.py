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
import threading
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
#: seconds an idle racer waits for its next command (between tests) before it ends
IDLE = 300.0

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
    inbox: multiprocessing.Queue[tuple[Any, ...] | None],
    outbox: multiprocessing.Queue[Answer],
    barrier: Barrier,
) -> None:
    """Worker process: per round, take a command, wait at the barrier, run it.

    ``("open", url, options)`` opens its own handle on a test's store (and
    ``("close",)`` closes it), answered at once; the racing commands are
    ``("claim", job_id, ttl)`` and ``("renew", job_id, owner, generation,
    ttl)``. ``None`` ends the loop.
    """
    owner = f"racer-{worker}-{os.getpid()}"
    store: LeaseStore | None = None
    try:
        while (command := inbox.get(timeout=IDLE)) is not None:
            if command[0] in ("open", "close"):
                if store is not None:
                    store.close()
                store = open_store(command[1], **command[2]) if command[0] == "open" else None
                outbox.put(Answer(worker, command[0]))
                continue
            assert store is not None, "a racing command before open"
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
    finally:
        if store is not None:
            store.close()


@dataclass
class Racers:
    """The running racer processes and their queues."""

    processes: list[BaseProcess]
    inboxes: list[multiprocessing.Queue[tuple[Any, ...] | None]]
    outbox: multiprocessing.Queue[Answer]
    barrier: Barrier
    #: set when a round went unanswered: the racers' state is unknown
    broken: bool = False

    def answers(self, count: int) -> list[Answer]:
        """The next ``count`` answers, by racer; fails the test if they are late."""
        answers = []
        for _ in range(count):
            try:
                answers.append(self.outbox.get(timeout=WAIT))
            except queue.Empty:
                self.broken = True
                dead = [p.pid for p in self.processes if not p.is_alive()]
                pytest.fail(f"racers did not answer within {WAIT} s (dead: {dead})")
        return sorted(answers, key=lambda a: a.worker)

    def run(self, commands: list[tuple[Any, ...]]) -> list[Answer]:
        """Send one command to each racer, release them together, collect answers."""
        for inbox, command in zip(self.inboxes, commands, strict=True):
            inbox.put(command)
        try:
            self.barrier.wait(timeout=WAIT)
        except threading.BrokenBarrierError:
            self.broken = True
            raise
        return self.answers(len(commands))

    def tell_all(self, *command: Any) -> None:
        """Send ``command`` to every racer and wait until each has done it."""
        for inbox in self.inboxes:
            inbox.put(command)
        answers = self.answers(len(self.inboxes))
        assert all(a.kind == command[0] for a in answers), answers

    def usable(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.processes)

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        self.barrier.abort()
        deadline = time.monotonic() + 20
        for process in self.processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def start_racers() -> Racers:
    """Sixteen racer processes, started with ``spawn``, holding no store yet."""
    context: SpawnContext = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS + 1)
    outbox: multiprocessing.Queue[Answer] = context.Queue()
    inboxes: list[multiprocessing.Queue[tuple[Any, ...] | None]] = [
        context.Queue() for _ in range(WORKERS)
    ]
    processes: list[BaseProcess] = [
        context.Process(target=racer, args=(n, inboxes[n], outbox, barrier), daemon=True)
        for n in range(WORKERS)
    ]
    for process in processes:
        process.start()
    return Racers(processes, inboxes, outbox, barrier)


@pytest.fixture(scope="module")
def racer_pool() -> Iterator[list[Racers]]:
    """The module's racer processes (starting sixteen is the slow part), started
    again after a test that left them in an unknown state."""
    pool: list[Racers] = []
    yield pool
    for racers in pool:
        racers.stop()


@pytest.fixture
def racers(
    racer_pool: list[Racers], store_url: tuple[str, dict[str, Any]], store: LeaseStore
) -> Iterator[Racers]:
    """Sixteen racer processes, each with a handle of its own on the test's store
    (``store`` makes its table first), opened from its URL as a real worker would."""
    if not (racer_pool and racer_pool[0].usable()):
        racer_pool[:] = [start_racers()]
    racers = racer_pool[0]
    url, options = store_url
    racers.tell_all("open", url, options)
    yield racers
    if racers.usable():
        racers.tell_all("close")
    if not racers.usable():
        racers.stop()


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
