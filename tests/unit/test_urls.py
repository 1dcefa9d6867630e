"""The scheme of a store or broker URL, read one way everywhere."""

from __future__ import annotations

import pytest

from celery_leases.stores import is_redis_url, is_sql_url, scheme_is_known
from celery_leases.urls import url_scheme


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("redis://localhost:6379/0", "redis"),
        ("REDIS+Cluster://node:7000", "redis+cluster"),
        ("sentinel://a:26379;sentinel://b:26379", "sentinel"),
        ("postgresql+psycopg://u:p@h/db", "postgresql+psycopg"),
        ("sqlite:///x.db", "sqlite"),
        ("://nothing", ""),
        ("redis", ""),
        ("localhost:6379", ""),
        ("", ""),
        (None, ""),
        (6379, ""),
    ],
)
def test_the_scheme_is_the_lower_case_text_before_the_separator(url: object, scheme: str) -> None:
    assert url_scheme(url) == scheme


@pytest.mark.parametrize("name", ["redis", "sentinel", "sqlite", "postgresql", "memory"])
def test_a_bare_name_is_no_store_url(name: str) -> None:
    # open_store refuses it as not a URL: no check may take it for one
    assert not is_redis_url(name)
    assert not is_sql_url(name)
    assert not scheme_is_known(name)
