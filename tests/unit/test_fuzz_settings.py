"""Property-based fuzzing of the settings and of store URLs (R7).

Any value in any ``leases_*`` key either gives settings whose timing is sane
or a :class:`LeaseConfigurationError`; any URL either opens a store object
(without connecting) or is a :class:`LeaseConfigurationError`. Nothing else
escapes, and a password in a URL never shows in the error.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_leases import (
    LeaseConfigurationError,
    LeaseError,
    LeaseSettings,
    StoreUnavailable,
    open_store,
)

FUZZ = settings(max_examples=150, deadline=None, database=None)

anything: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["flag", "raise", "stop", "60", 0, 0.1, 86400, 86401, -1, [], {}, {"a": 1}]),
)
KEYS = [
    "leases_ttl",
    "leases_renew_interval",
    "leases_drift_margin",
    "leases_on_lost",
    "leases_max_takeovers",
    "leases_defer_backoff",
    "leases_defer_max",
    "leases_result_max_bytes",
    "leases_store_options",
]


@FUZZ
@given(values=st.dictionaries(st.sampled_from(KEYS), anything, max_size=4))
def test_any_setting_is_valid_or_a_configuration_error(values: dict[str, Any]) -> None:
    conf = {"leases_store": "redis://localhost:6379/0", **values}
    try:
        built = LeaseSettings.from_conf(conf)
    except LeaseConfigurationError as exc:
        error: LeaseConfigurationError | None = exc
    else:
        error = None
    if error is not None:
        assert str(error), "an error without a message"
        return
    timing = built.timing()
    assert math.isfinite(timing.ttl)
    assert 0 < timing.ttl <= 86400
    assert 0 < timing.renew_interval < timing.ttl
    assert 0 <= timing.drift_margin < timing.ttl
    assert built.on_lost in ("flag", "raise", "stop")


SCHEMES = ["redis", "rediss", "memory", "postgresql+psycopg", "postgresql", "mysql", "", "ftp"]


# ASCII without brackets and dots: hosts that break open_store have their own test
URL_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters="[]."),
    max_size=40,
)


@FUZZ
@given(scheme=st.sampled_from(SCHEMES), rest=URL_TEXT)
def test_any_url_opens_a_store_or_is_a_configuration_error(scheme: str, rest: str) -> None:
    url = f"{scheme}://user:s3cret-pw@{rest}" if scheme else rest
    if scheme.startswith("sqlite"):
        return  # a SQLite URL names a file: not fuzzed here
    try:
        store = open_store(url)
    except (LeaseConfigurationError, StoreUnavailable) as exc:
        error: LeaseError | None = exc
    else:
        error = None
        store.close()
    if error is not None:
        assert "s3cret-pw" not in str(error), f"the password leaked: {error}"


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:s3cret-pw@\x80/0",
        "redis://user:s3cret-pw@[::1/0",
        "redis://user:s3cret-pw@./0",
        "postgresql+psycopg://user:s3cret-pw@\x80/db",
    ],
)
def test_a_malformed_host_is_a_configuration_error(url: str) -> None:
    with pytest.raises(LeaseConfigurationError) as caught:
        open_store(url).close()
    assert "s3cret-pw" not in str(caught.value)


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://user:s3cret-pw@host:/db", "postgresql://user:s3cret-pw@h:x/db"]
)
def test_an_unparsable_sql_url_does_not_show_its_password(url: str) -> None:
    with pytest.raises(LeaseConfigurationError) as caught:
        open_store(url).close()
    assert "s3cret-pw" not in str(caught.value)
