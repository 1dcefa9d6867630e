"""Make Celery's settings censor mask the lease settings too.

Celery censors its settings (``celery inspect conf``, Flower's Config tab,
``celery report``) with :func:`celery.app.utils.filter_hidden_settings`,
which hides keys that look secret (``*PASS*``, ``*KEY*``, ...) and the
passwords of the broker and backend URLs, but knows nothing of
``leases_store``. :func:`install_settings_filter` wraps that function once
so that every ``leases_*`` setting goes through
:func:`celery_leases.redact.mask_settings` too, with Celery's own mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from celery_leases.redact import mask_settings

__all__ = ["CELERY_MASK", "install_settings_filter"]

#: what Celery's censor shows in place of a secret
CELERY_MASK = "********"


def _with_leases_masked(
    original: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    @functools.wraps(original)
    def filter_hidden_settings(conf: Mapping[str, Any]) -> dict[str, Any]:
        censored = original(conf)
        return {
            key: mask_settings(value, placeholder=CELERY_MASK)
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
