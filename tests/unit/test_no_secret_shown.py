"""No settings or store object shows the store's password: not its ``repr``,
not its ``str``, not an error it raises (nor the errors chained to it).

Error trackers record the local variables of a failing frame by ``repr``
(Sentry does) and debug logs print settings and stores, so the password of
every URL form the stores take is walked here. Nothing listens on port 1 or
2 of 127.0.0.1: every store call fails at once, as an outage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from celery_leases import LeaseError, LeaseSettings, open_store
from celery_leases.runtime import forget_runtime, settings_for

#: three pieces, so that a password cut at its ``@``, ``/`` or ``:`` still shows
PIECES = ("Zq7x", "Kv9y", "Jm4w")
PLAIN = "".join(PIECES)
#: ``Zq7x@Kv9y/Jm4w:`` percent-encoded, as a URL must carry it
ENCODED = "Zq7x%40Kv9y%2FJm4w%3A"
#: the same, written into the URL raw (no parser reads it whole)
RAW = "Zq7x@Kv9y/Jm4w"

URL_FORMS: list[tuple[str, str, dict[str, Any]]] = [
    ("redis-password-only", f"redis://:{PLAIN}@127.0.0.1:1/0", {}),
    ("redis-user-and-password", f"redis://leases:{PLAIN}@127.0.0.1:1/0", {}),
    ("rediss", f"rediss://leases:{PLAIN}@127.0.0.1:1/0", {}),
    ("redis-percent-encoded", f"redis://leases:{ENCODED}@127.0.0.1:1/0", {}),
    ("redis-raw-at-and-slash", f"redis://leases:{RAW}@127.0.0.1:1/0", {}),
    ("redis-query-password", f"redis://127.0.0.1:1/0?password={PLAIN}", {}),
    ("unix-query-password", f"unix:///nonexistent/redis.sock?db=0&password={PLAIN}", {}),
    ("redis-option-password", "redis://127.0.0.1:1/0", {"password": PLAIN}),
    ("redis-bad-port", f"redis://:{PLAIN}@127.0.0.1:port/0", {}),
    ("redis+sentinel", f"redis+sentinel://:{PLAIN}@127.0.0.1:1/0", {"master_name": "m"}),
    (
        "sentinel-list",
        f"sentinel://127.0.0.1:1;sentinel://:{PLAIN}@127.0.0.1:2/0",
        {"master_name": "m"},
    ),
    (
        "sentinel-own-password",
        "sentinel://127.0.0.1:1",
        {"master_name": "m", "sentinel_kwargs": {"password": PLAIN}},
    ),
    ("redis-cluster", f"redis+cluster://:{PLAIN}@127.0.0.1:1", {}),
    ("rediss-cluster", f"rediss+cluster://leases:{ENCODED}@127.0.0.1:1", {}),
    ("postgresql+psycopg", f"postgresql+psycopg://leases:{PLAIN}@127.0.0.1:1/leases", {}),
    ("postgresql-percent-encoded", f"postgresql://leases:{ENCODED}@127.0.0.1:1/leases", {}),
    (
        "postgresql-query-password",
        f"postgresql+psycopg://leases@127.0.0.1:1/leases?password={PLAIN}",
        {},
    ),
    (
        "postgresql-connect-args",
        "postgresql+psycopg://leases@127.0.0.1:1/leases",
        {"connect_args": {"password": PLAIN}},
    ),
    ("postgresql-bad-url", f"postgresql+psycopg://leases:{PLAIN}@127.0.0.1:x:y/leases", {}),
    ("unknown-scheme", f"mongodb://leases:{PLAIN}@127.0.0.1:1/leases", {}),
]


def assert_hidden(text: str, where: str) -> None:
    for piece in PIECES:
        assert piece not in text, f"a piece of the password shows in {where}: {text}"


def printed_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors a traceback of it prints (its causes and contexts)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            current = current.__cause__
        elif not current.__suppress_context__:
            current = current.__context__
        else:
            current = None


def assert_error_hidden(error: BaseException, where: str) -> None:
    for link in printed_chain(error):
        assert_hidden(str(link), f"str of {type(link).__name__} from {where}")
        assert_hidden(repr(link), f"repr of {type(link).__name__} from {where}")
        assert_hidden(repr(link.args), f"args of {type(link).__name__} from {where}")


def assert_object_hidden(value: object, where: str) -> None:
    assert_hidden(repr(value), f"repr of {where}")
    assert_hidden(str(value), f"str of {where}")


@pytest.mark.parametrize(
    ("url", "options"), [p[1:] for p in URL_FORMS], ids=[p[0] for p in URL_FORMS]
)
def test_settings_never_show_the_password(url: str, options: dict[str, Any]) -> None:
    settings = LeaseSettings(store_url=url, store_options=options)
    assert_object_hidden(settings, "LeaseSettings")
    assert_object_hidden([settings], "a list holding LeaseSettings")
    from_conf = LeaseSettings.from_conf({"leases_store": url, "leases_store_options": options})
    assert_object_hidden(from_conf, "LeaseSettings.from_conf")
    # the per-process runtime of an app holds them: it shows them masked too
    app = _App({"leases_store": url, "leases_store_options": options})
    try:
        assert_object_hidden(settings_for(app), "the runtime's settings")
    finally:
        forget_runtime(app)


@pytest.mark.parametrize(
    ("url", "options"), [p[1:] for p in URL_FORMS], ids=[p[0] for p in URL_FORMS]
)
def test_stores_and_their_errors_never_show_the_password(url: str, options: dict[str, Any]) -> None:
    try:
        store = open_store(url, **options)
    except LeaseError as exc:
        assert_error_hidden(exc, f"open_store({url.split('://')[0]}://...)")
        return
    try:
        assert_object_hidden(store, type(store).__name__)
        assert_hidden(store.url, f"{type(store).__name__}.url")
        for name, value in _attributes(store):
            assert_hidden(repr(value), f"{type(store).__name__}.{name}")
        with pytest.raises(LeaseError) as caught:
            store.claim("job", "owner", 5.0)
        assert_error_hidden(caught.value, f"{type(store).__name__}.claim")
    finally:
        with contextlib.suppress(Exception):
            store.close()


def _attributes(obj: object) -> Iterator[tuple[str, object]]:
    yield from vars(obj).items()


class _App:
    """The part of a Celery app the runtime reads: its configuration."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf
