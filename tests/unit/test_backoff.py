"""The backoff of retries: doubling waits, a cap, and jitter within its bounds."""

from __future__ import annotations

import itertools

import pytest

from celery_leases.backoff import backoff_delay, backoff_delays


def test_the_wait_doubles_after_each_failure_up_to_the_cap() -> None:
    assert list(itertools.islice(backoff_delays(0.05, cap=1.0), 7)) == [
        0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0,
    ]  # fmt: skip


def test_without_a_cap_the_wait_keeps_doubling() -> None:
    assert list(itertools.islice(backoff_delays(0.5), 4)) == [0.5, 1.0, 2.0, 4.0]


def test_a_long_run_of_failures_gives_the_cap_not_an_overflow() -> None:
    assert backoff_delay(1.0, 10**6, cap=86400.0) == 86400.0


@pytest.mark.parametrize("tries", [0, 1, 5])
def test_jitter_stretches_the_wait_by_at_most_its_share(tries: int) -> None:
    plain = backoff_delay(2.0, tries, cap=1e9)
    waits = [backoff_delay(2.0, tries, cap=1e9, jitter=0.2) for _ in range(200)]
    assert all(plain <= wait <= plain * 1.2 for wait in waits)
    assert len(set(waits)) > 1


def test_jitter_never_passes_the_cap() -> None:
    assert all(backoff_delay(1.0, 3, cap=8.0, jitter=0.2) == 8.0 for _ in range(50))
