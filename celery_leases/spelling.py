"""Misspelled lease settings and task attributes, found before they are silently ignored.

Celery keeps any key in ``app.conf`` and any keyword of ``@app.task``, so
``leases_tll = 5`` or ``lease_tll=5`` would leave the TTL at its default
with no word said. The worker's start checks and ``celery leases check``
warn about every ``lease``-prefixed name that celery-leases does not read,
naming the closest one it does (:func:`difflib.get_close_matches`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any

from celery.app.defaults import DEFAULTS

from celery_leases.settings import LeaseSettings

__all__ = ["SETTINGS", "as_spelled", "misspelled_settings", "misspelled_task_attributes"]

#: settings read outside :class:`LeaseSettings` (the metrics server, the
#: broker's consumer timeout, keeping leased messages invisible on the broker)
_OTHER_SETTINGS = (
    "leases_metrics_port",
    "leases_metrics_address",
    "leases_broker_consumer_timeout",
    "leases_broker_keep_invisible",
)

#: every ``leases_*`` key of ``app.conf`` that celery-leases reads
SETTINGS: frozenset[str] = frozenset(
    {
        "leases_store" if f.name == "store_url" else f"leases_{f.name}"
        for f in dataclasses.fields(LeaseSettings)
    }
    | set(_OTHER_SETTINGS)
)


def _closest(name: str, known: Iterable[str], prefix: str = "", upper: bool = False) -> str:
    matches = difflib.get_close_matches(name.lower(), sorted(known), n=1, cutoff=0.6)
    if not matches:
        return ""
    match = prefix + matches[0]
    return f"; did you mean {(match.upper() if upper else match)!r}?"


def _looks_like_ours(name: str) -> bool:
    return name.lower().startswith(("lease_", "leases_"))


def _nearly_ours(name: str) -> bool:
    """A key whose first word is ``leases`` or close to it (``leasses_ttl``, ``lease_ttl``)."""
    head, underscore, _ = name.lower().partition("_")
    return bool(underscore) and difflib.SequenceMatcher(None, head, "leases").ratio() >= 0.8


def _setting_name(key: str, prefix: str) -> tuple[str, str]:
    """The ``leases_*`` name a key of ``app.conf`` stands for, and the namespace before it.

    With ``config_from_object(..., namespace="CELERY")`` Celery keeps Django's
    ``CELERY_LEASES_TTL`` as it is and reads it for ``leases_ttl``.
    """
    if prefix and key.upper().startswith(prefix.upper()) and key.upper() != prefix.upper():
        return key[len(prefix) :].lower(), key[: len(prefix)]
    return key, ""


def _namespace(conf: Any) -> tuple[str, set[str]]:
    """The namespace of ``conf`` (``"CELERY_"`` for a Django project's) and its keys."""
    keys = {str(k) for k in conf.keys()}  # noqa: SIM118 - Celery's conf is no dict
    # read after the keys: until then app.conf is a stand-in that answers
    # every attribute as a setting (None for "prefix")
    return str(getattr(conf, "prefix", None) or ""), keys


#: the names of Celery's settings and of celery-leases', as messages name them
_SETTING_NAMES = re.compile(
    r"\b(?:"
    + "|".join(sorted(map(re.escape, {*DEFAULTS, *SETTINGS}), key=len, reverse=True))
    + r")\b"
)


def as_spelled(message: str, conf: Any) -> str:
    """``message`` with every setting it names spelled as ``conf`` reads it.

    Under ``config_from_object(..., namespace="CELERY")`` (a Django
    project), ``leases_ttl`` is written ``CELERY_LEASES_TTL`` and
    ``broker_transport_options`` is ``CELERY_BROKER_TRANSPORT_OPTIONS``;
    without a namespace the message is returned as it is.
    """
    prefix, _ = _namespace(conf)
    if not prefix:
        return message
    return _SETTING_NAMES.sub(
        lambda found: prefix + (found[0].upper() if prefix.isupper() else found[0]), message
    )


def misspelled_settings(conf: Any) -> list[str]:
    """Warnings for ``lease``-prefixed keys of ``conf`` that no setting reads.

    Keys under the app's namespace (``CELERY_LEASES_TLL`` with
    ``namespace="CELERY"``) are judged by the name after it, and the
    suggestion keeps their form (``CELERY_LEASES_TTL``).
    """
    prefix, keys = _namespace(conf)
    found = []
    for key in sorted(keys):
        name, namespace = _setting_name(key, prefix)
        if (_looks_like_ours(name) or _nearly_ours(name)) and name not in SETTINGS:
            # a key outside the namespace is not read even when spelled
            # right: the suggestion puts it in (LEASES_TTL: CELERY_LEASES_TTL)
            found.append(
                f"the setting {key!r} is not a celery-leases setting and is ignored"
                f"{_closest(name, SETTINGS, namespace or prefix, upper=key.isupper())}"
            )
    return found


def misspelled_task_attributes(task: Any, base: type) -> list[str]:
    """Warnings for ``lease``-prefixed attributes of ``task`` that ``base`` does not read.

    Args:
        task: a task whose class derives from ``base``.
        base: :class:`~celery_leases.task.LeasedTask`; its own names are the valid ones.
    """
    known = {name for name in dir(base) if _looks_like_ours(name)}
    found = []
    for cls in type(task).__mro__:
        if cls is base or issubclass(base, cls):
            continue
        for name in sorted(vars(cls)):
            if _looks_like_ours(name) and name not in known:
                found.append(
                    f"task {task.name!r} sets {name!r}, which is not a LeasedTask attribute "
                    f"and is ignored{_closest(name, known)}"
                )
    return found
