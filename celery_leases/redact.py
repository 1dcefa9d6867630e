"""Keep the lease store's password out of sight.

Celery censors its settings (``celery inspect conf``, Flower's Config tab,
``celery report``) with :func:`celery.app.utils.filter_hidden_settings`,
which hides keys that look secret (``*PASS*``, ``*KEY*``, ...) and the
passwords of the broker and backend URLs, but knows nothing of
``leases_store``. :func:`install_settings_filter` wraps that function once
so that every ``leases_*`` setting has the password of any URL in it
masked too, also inside ``leases_store_options``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["MASK", "install_settings_filter", "mask_settings", "mask_url"]

#: what a password is replaced with (Celery's own mask)
MASK = "********"

#: query parameters whose value is a secret
_SECRET_QUERY_KEYS = ("password", "passwd", "pass", "secret", "token")


def mask_url(url: str) -> str:
    """``url`` with the password in its user part and in its query masked.

    Strings that are not URLs come back unchanged.
    """
    if "://" not in url:
        return url
    parts_of_list = url.split(";")
    if len(parts_of_list) > 1 and all("://" in part for part in parts_of_list):
        # sentinel://a:26379;sentinel://b:26379, as kombu spells a Sentinel list
        return ";".join(mask_url(part) for part in parts_of_list)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL after all (a bad port, say): show nothing of it
        return MASK
    if password is None and not _has_secret_query(parts.query):
        return url  # rebuilding would change a URL such as sqlite:////abs/path
    if password is not None:
        user_part, _, host_part = parts.netloc.rpartition("@")
        user = user_part.split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:{MASK}@{host_part}")
    if _has_secret_query(parts.query):
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        cleaned = [(k, MASK if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs]
        parts = parts._replace(query=urlencode(cleaned, safe="*"))
    return urlunsplit(parts)


def _has_secret_query(query: str) -> bool:
    return any(
        key.lower() in _SECRET_QUERY_KEYS for key, _ in parse_qsl(query, keep_blank_values=True)
    )


def mask_settings(value: Any) -> Any:
    """A copy of ``value`` with every URL's password masked, through mappings and lists."""
    if isinstance(value, str):
        return mask_url(value)
    if isinstance(value, Mapping):
        return {key: mask_settings(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_settings(item) for item in value)
    return value


def _with_leases_masked(
    original: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    @functools.wraps(original)
    def filter_hidden_settings(conf: Mapping[str, Any]) -> dict[str, Any]:
        censored = original(conf)
        return {
            key: mask_settings(value)
            if isinstance(key, str) and key.lower().startswith("leases_")
            else value
            for key, value in censored.items()
        }

    filter_hidden_settings.celery_leases_wrapped = True  # type: ignore[attr-defined]
    return filter_hidden_settings


def install_settings_filter() -> None:
    """Make Celery's settings censor mask the lease settings too; idempotent."""
    from celery.app import utils

    if getattr(utils.filter_hidden_settings, "celery_leases_wrapped", False):
        return
    utils.filter_hidden_settings = _with_leases_masked(utils.filter_hidden_settings)
