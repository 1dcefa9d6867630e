"""The countdown of a copy deferred behind a held job."""

from __future__ import annotations

import pytest

from celery_leases.waiting import MIN_COUNTDOWN, POLL_INTERVAL, held_countdown


@pytest.mark.parametrize("remaining", [1.5, 30.0, 59.9, 3600.0])
def test_a_copy_looks_again_within_a_second_while_the_lease_lasts(remaining: float) -> None:
    # at most one claim per second, and at most a second after the holder's end
    for _ in range(200):
        assert held_countdown(remaining, defer_max=60.0) == POLL_INTERVAL


@pytest.mark.parametrize("remaining", [0.0, 0.3, 0.8])
def test_a_lease_about_to_run_out_is_looked_at_just_after(remaining: float) -> None:
    for _ in range(200):
        countdown = held_countdown(remaining, defer_max=60.0)
        assert remaining < countdown <= min(remaining + 0.1, POLL_INTERVAL)
        assert countdown >= MIN_COUNTDOWN


def test_the_countdown_never_passes_defer_max() -> None:
    assert held_countdown(30.0, defer_max=0.5) == 0.5


def test_a_negative_remaining_time_still_waits_a_little() -> None:
    assert held_countdown(-5.0, defer_max=60.0) >= MIN_COUNTDOWN
