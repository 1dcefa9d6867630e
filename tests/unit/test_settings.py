"""LeaseSettings and LeaseTiming: defaults, per-task timing, validation messages."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeaseSettings, LeaseTiming
from celery_leases.settings import (
    MAX_DEFER,
    MAX_RESULT_MAX_BYTES,
    MAX_TTL,
    MIN_RENEW_INTERVAL,
    MIN_TTL,
    check_defer_max,
    default_drift_margin,
)


def test_missing_store_names_the_setting() -> None:
    with pytest.raises(LeaseConfigurationError, match="leases_store setting is missing"):
        LeaseSettings.from_conf({})


def test_defaults() -> None:
    settings = LeaseSettings.from_conf({"leases_store": "memory://"})
    assert settings.ttl == 60.0
    assert settings.on_lost == "flag"
    assert settings.max_takeovers == 5
    assert settings.result_max_bytes == 65536
    timing = settings.timing()
    assert timing == LeaseTiming(ttl=60.0, renew_interval=20.0, drift_margin=3.0)
    assert timing.safe_duration == 57.0


def test_reads_a_celery_app_conf() -> None:
    app = Celery("settings", set_as_current=False)
    app.conf.update(
        leases_store="redis://localhost/1",
        leases_store_options={"prefix": "x:"},
        leases_ttl=30,
        leases_on_lost="raise",
        leases_max_takeovers=None,
        leases_defer_backoff=0.5,
        leases_defer_max=10,
        leases_result_max_bytes=0,
    )
    settings = LeaseSettings.from_conf(app.conf)
    assert settings.store_url == "redis://localhost/1"
    assert dict(settings.store_options) == {"prefix": "x:"}
    assert settings.timing().renew_interval == 10.0
    assert settings.on_lost == "raise"
    assert settings.defer_backoff == 0.5
    assert settings.defer_max == 10
    assert settings.result_max_bytes == 0


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
        ({"store_options": {1: "x"}}, "leases_store_options must be a dict whose keys"),
    ],
)
def test_invalid_settings_say_what_to_change(options: dict[str, object], message: str) -> None:
    with pytest.raises(LeaseConfigurationError, match=message):
        LeaseSettings(store_url="memory://", **options)  # type: ignore[arg-type]


def test_invalid_task_timing_is_refused() -> None:
    settings = LeaseSettings(store_url="memory://")
    with pytest.raises(LeaseConfigurationError, match="renew interval"):
        settings.timing(ttl=3, renew_interval=3)


# --- every bad value of every numeric setting ------------------------------------

NAN = float("nan")
INF = float("inf")
#: values no number-of-seconds setting accepts (None last: a task's None means "the app's")
BAD_SECONDS = [True, False, "10", NAN, INF, -INF, -1, 0, 0.0, 1e11, 1e16, None]
BAD_IDS = ["true", "false", "str", "nan", "inf", "-inf", "negative", "zero", "zero-float",
           "1e11", "1e16", "none"]  # fmt: skip


@pytest.mark.parametrize("value", BAD_SECONDS, ids=BAD_IDS)
def test_a_bad_ttl_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(
        LeaseConfigurationError,
        match=r"leases_ttl / lease_ttl\) must be a number of seconds from 0\.1 to 86400",
    ):
        LeaseSettings(store_url="memory://", ttl=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_SECONDS[:-1], ids=BAD_IDS[:-1])
def test_a_bad_task_ttl_is_refused_naming_the_setting(value: object) -> None:
    settings = LeaseSettings(store_url="memory://")
    with pytest.raises(
        LeaseConfigurationError, match=r"lease_ttl\) must be a number of seconds from 0\.1 to 86400"
    ):
        settings.timing(ttl=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=BAD_IDS)
def test_a_bad_defer_max_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="leases_defer_max must be a positive"):
        LeaseSettings(store_url="memory://", defer_max=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=BAD_IDS)
def test_a_bad_defer_backoff_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="leases_defer_backoff must be a positive"):
        LeaseSettings(store_url="memory://", defer_backoff=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=BAD_IDS)
def test_a_bad_task_defer_max_is_refused_naming_the_attribute(value: object) -> None:
    with pytest.raises(LeaseConfigurationError, match=r"job\.lease_defer_max must be a positive"):
        check_defer_max(value, "job.lease_defer_max")


@pytest.mark.parametrize(
    "value",
    [True, False, "1024", NAN, INF, -1, 1024.0, MAX_RESULT_MAX_BYTES + 1, 10**12, None],
    ids=["true", "false", "str", "nan", "inf", "negative", "float", "over", "huge", "none"],
)
def test_a_bad_result_max_bytes_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(
        LeaseConfigurationError, match=r"leases_result_max_bytes must be a whole number.*1048576"
    ):
        LeaseSettings(store_url="memory://", result_max_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("leases_ttl", "60"),
        ("leases_ttl", 1e16),
        ("leases_defer_max", 0),
        ("leases_defer_max", "60"),
        ("leases_defer_backoff", NAN),
        ("leases_result_max_bytes", -1),
        ("leases_renew_interval", INF),
        ("leases_drift_margin", NAN),
        ("leases_on_lost", "ignore"),
    ],
)
def test_from_conf_refuses_a_bad_value_naming_its_key(key: str, value: object) -> None:
    with pytest.raises(LeaseConfigurationError, match=key.removeprefix("leases_")):
        LeaseSettings.from_conf({"leases_store": "memory://", key: value})


@pytest.mark.parametrize("options", ["x", ["prefix", "x:"], 42, b"prefix"])
def test_from_conf_refuses_store_options_that_are_not_a_mapping(options: object) -> None:
    # dict("x") raised a bare ValueError before
    with pytest.raises(LeaseConfigurationError, match="leases_store_options must be a dict"):
        LeaseSettings.from_conf({"leases_store": "memory://", "leases_store_options": options})


def test_the_store_options_message_does_not_echo_the_value() -> None:
    secret = "redis://:hunter2@host"  # a made-up password to look for
    with pytest.raises(LeaseConfigurationError) as caught:
        LeaseSettings.from_conf({"leases_store": "memory://", "leases_store_options": secret})
    assert "hunter2" not in str(caught.value)


def test_the_largest_ttl_is_accepted() -> None:
    settings = LeaseSettings(store_url="memory://", ttl=MAX_TTL)
    assert settings.timing().ttl == 86400.0
    assert settings.timing(ttl=MAX_TTL).ttl == 86400.0


def test_just_past_the_largest_ttl_is_refused() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"from 0\.1 to 86400"):
        LeaseSettings(store_url="memory://", ttl=MAX_TTL + 0.001)
    with pytest.raises(LeaseConfigurationError, match=r"from 0\.1 to 86400"):
        LeaseTiming(ttl=MAX_TTL + 1, renew_interval=1.0, drift_margin=0.0)


def test_the_shortest_ttl_and_renew_interval_are_accepted() -> None:
    timing = LeaseSettings(store_url="memory://", ttl=MIN_TTL).timing()
    assert timing.ttl == 0.1
    shortest = LeaseTiming(ttl=MIN_TTL, renew_interval=MIN_RENEW_INTERVAL, drift_margin=0.0)
    assert shortest.renew_interval == 0.01


def test_a_ttl_or_renew_interval_too_short_to_renew_is_refused() -> None:
    # a heartbeat renewing every microsecond would hammer the store
    with pytest.raises(LeaseConfigurationError, match=r"from 0\.1 to 86400, got 0\.099"):
        LeaseSettings(store_url="memory://", ttl=0.099)
    with pytest.raises(LeaseConfigurationError, match=r"lease_ttl\) must be a number"):
        LeaseSettings(store_url="memory://").timing(ttl=0.001)
    with pytest.raises(LeaseConfigurationError, match=r"renew interval .* at least 0\.01"):
        LeaseSettings(store_url="memory://", renew_interval=0.009)


def test_the_smallest_and_largest_deferrals_are_accepted() -> None:
    small = LeaseSettings(store_url="memory://", defer_backoff=0.001, defer_max=0.001)
    assert (small.defer_backoff, small.defer_max) == (0.001, 0.001)
    large = LeaseSettings(store_url="memory://", defer_backoff=MAX_DEFER, defer_max=MAX_DEFER)
    assert (large.defer_backoff, large.defer_max) == (86400.0, 86400.0)
    assert check_defer_max(5, "job.lease_defer_max") == 5.0


@pytest.mark.parametrize("value", [0, 1, 65536, MAX_RESULT_MAX_BYTES])
def test_result_max_bytes_boundaries_are_accepted(value: int) -> None:
    settings = LeaseSettings.from_conf(
        {"leases_store": "memory://", "leases_result_max_bytes": value}
    )
    assert settings.result_max_bytes == value


@pytest.mark.parametrize("mode", ["flag", "raise", "stop"])
def test_every_on_lost_mode_is_still_accepted(mode: str) -> None:
    settings = LeaseSettings.from_conf({"leases_store": "memory://", "leases_on_lost": mode})
    assert settings.on_lost == mode


def test_republish_options_take_a_queue_and_a_priority() -> None:
    settings = LeaseSettings.from_conf(
        {"leases_store": "memory://", "leases_republish_options": {"queue": "again", "priority": 9}}
    )
    assert settings.republish_options == {"queue": "again", "priority": 9}
    assert LeaseSettings.from_conf({"leases_store": "memory://"}).republish_options == {}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ("again", "must be a dict"),
        ({"exchange": "x"}, "takes only queue and priority"),
        ({"queue": ""}, "must be a queue name"),
        ({"priority": 256}, "from 0 to 255"),
        ({"priority": True}, "from 0 to 255"),
    ],
)
def test_wrong_republish_options_say_what_to_change(options: object, match: str) -> None:
    with pytest.raises(LeaseConfigurationError, match=match):
        LeaseSettings.from_conf({"leases_store": "memory://", "leases_republish_options": options})
