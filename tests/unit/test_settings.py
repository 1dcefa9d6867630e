"""LeaseSettings and LeaseTiming: defaults, per-task timing, validation messages."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeaseSettings, LeaseTiming
from celery_leases.settings import default_drift_margin


def test_missing_store_names_the_setting() -> None:
    with pytest.raises(LeaseConfigurationError, match="leases_store setting is missing"):
        LeaseSettings.from_conf({})


def test_defaults() -> None:
    settings = LeaseSettings.from_conf({"leases_store": "memory://"})
    assert settings.ttl == 60.0
    assert settings.on_lost == "raise"
    assert settings.max_takeovers == 5
    timing = settings.timing()
    assert timing == LeaseTiming(ttl=60.0, renew_interval=20.0, drift_margin=3.0)
    assert timing.safe_duration == 57.0


def test_reads_a_celery_app_conf() -> None:
    app = Celery("settings", set_as_current=False)
    app.conf.update(
        leases_store="redis://localhost/1",
        leases_store_options={"prefix": "x:"},
        leases_ttl=30,
        leases_on_lost="flag",
        leases_max_takeovers=None,
        leases_defer_backoff=0.5,
        leases_defer_max=10,
    )
    settings = LeaseSettings.from_conf(app.conf)
    assert settings.store_url == "redis://localhost/1"
    assert dict(settings.store_options) == {"prefix": "x:"}
    assert settings.timing().renew_interval == 10.0
    assert settings.on_lost == "flag"
    assert settings.defer_backoff == 0.5


def test_task_ttl_derives_its_own_renew_interval_and_margin() -> None:
    settings = LeaseSettings(store_url="memory://")
    timing = settings.timing(ttl=1.5)
    assert timing.renew_interval == 0.5
    assert timing.drift_margin == pytest.approx(0.375)  # capped at a quarter of the ttl


def test_app_wide_renew_interval_wins_over_the_derived_one() -> None:
    settings = LeaseSettings(store_url="memory://", renew_interval=5.0)
    assert settings.timing(ttl=30).renew_interval == 5.0


@pytest.mark.parametrize(("ttl", "expected"), [(60.0, 3.0), (4.0, 0.5), (1.0, 0.25), (600.0, 30.0)])
def test_default_drift_margin(ttl: float, expected: float) -> None:
    assert default_drift_margin(ttl) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl": 0}, "lease ttl"),
        ({"ttl": -1}, "lease ttl"),
        ({"ttl": True}, "lease ttl"),
        ({"ttl": float("inf")}, "lease ttl"),
        ({"ttl": 10, "renew_interval": 9.5}, "lower leases_renew_interval"),
        ({"ttl": 10, "drift_margin": 5}, "lower leases_drift_margin"),
        ({"on_lost": "explode"}, "leases_on_lost must be one of"),
        ({"max_takeovers": -1}, "leases_max_takeovers"),
        ({"defer_backoff": 0}, "leases_defer_backoff"),
        ({"defer_backoff": 5, "defer_max": 1}, "leases_defer_max"),
        ({"store_options": "prefix=x"}, "leases_store_options must be a dict"),
    ],
)
def test_invalid_settings_say_what_to_change(options: dict[str, object], message: str) -> None:
    with pytest.raises(LeaseConfigurationError, match=message):
        LeaseSettings(store_url="memory://", **options)  # type: ignore[arg-type]


def test_invalid_task_timing_is_refused() -> None:
    settings = LeaseSettings(store_url="memory://")
    with pytest.raises(LeaseConfigurationError, match="renew interval"):
        settings.timing(ttl=3, renew_interval=3)
