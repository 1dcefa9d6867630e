"""Keep secrets out of sight: the one masker for URLs, text and settings.

Every message, ``repr`` and settings table that may show the lease store's
URL or options goes through :func:`mask`. It masks

- the password of every URL in the text (``scheme://user:password@host``),
  also one that does not parse as a URL (a password with ``/``, ``#`` or
  ``@`` in it, a Sentinel list of URLs joined by ``;``);
- the value of every query parameter whose name says secret
  (``?password=``, ``?sslpassword=``, ``?token=``, ...);
- each of the ``secrets`` given (the passwords :func:`secrets_of` finds in a
  URL and in store options), in its plain, percent-encoded and
  percent-decoded forms: a driver's message may quote a password decoded.

The module imports nothing of Celery, so the stores use it too.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

__all__ = ["MASK", "is_secret_key", "mask", "mask_settings", "secrets_of"]

#: what a secret is replaced with
MASK = "***"

#: names of options and query parameters whose value is a secret
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|credential", re.IGNORECASE)

_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"

#: ``scheme://user:password@``. The password runs to the last ``@`` before a
#: space or the next URL of a ``;`` list, so ``@``, ``/`` and ``#`` in it are
#: masked too; the user part has no ``:`` (no URL parser reads one there).
_USERINFO = re.compile(rf"(?P<head>{_SCHEME}[^\s:/?#@]*:)(?P<password>(?:(?!;{_SCHEME})\S)*)@")

#: ``user:password@host`` without a scheme: only when the whole text is one
#: such word (a URL written without its scheme), so free text keeps its colons
_BARE_USERINFO = re.compile(r"(?P<head>[^\s:/?#@]*:)(?P<password>\S*)@(?=\S*$)")

#: ``?name=value`` or ``&name=value`` where the name says secret
_SECRET_QUERY = re.compile(
    r"(?P<head>[?&;][\w.-]*(?:pass|pwd|secret|token|credential)[\w.-]*=)(?P<value>[^&#\s'\"]*)",
    re.IGNORECASE,
)

#: a shorter secret would blank out ordinary words of a message
_MIN_SECRET = 3


def is_secret_key(name: object) -> bool:
    """Whether an option or parameter called ``name`` holds a secret."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def mask(text: str, *, secrets: Iterable[str] = (), placeholder: str = MASK) -> str:
    """``text`` with every URL password, secret query value and each of
    ``secrets`` replaced by ``placeholder``.

    Text without any of them comes back unchanged.
    """
    for secret in _forms(secrets):
        text = text.replace(secret, placeholder)
    if "://" in text:
        text = _USERINFO.sub(lambda m: f"{m['head']}{placeholder}@", text)
    elif "@" in text and not any(c.isspace() for c in text):
        text = _BARE_USERINFO.sub(lambda m: f"{m['head']}{placeholder}@", text, count=1)
    if "=" in text:
        text = _SECRET_QUERY.sub(lambda m: f"{m['head']}{placeholder}", text)
    return text


def secrets_of(url: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """The secrets a message about a store must not show: the password of
    ``url`` (of each URL of a ``;`` list), its secret query values, and the
    string values of ``options`` (nested too) whose name says secret."""
    found: list[str] = []
    for part in url.split(";") if isinstance(url, str) else ():
        with contextlib.suppress(ValueError):
            parts = urlsplit(part.strip())
            if parts.password:
                found.append(parts.password)
            found += [v for k, v in parse_qsl(parts.query) if is_secret_key(k)]
        for match in _USERINFO.finditer(part):
            found.append(match["password"])
    stack: list[Mapping[str, Any]] = [options or {}]
    while stack:
        for key, value in stack.pop().items():
            if isinstance(value, Mapping):
                stack.append(value)
            elif isinstance(value, str) and is_secret_key(key):
                found.append(value)
    return _forms(found)


def _forms(secrets: Iterable[str]) -> list[str]:
    """Each secret as written, percent-decoded and percent-encoded, longest first."""
    forms: set[str] = set()
    for secret in secrets:
        if isinstance(secret, str):
            forms.update((secret, unquote(secret), quote(unquote(secret), safe="")))
    return sorted((s for s in forms if len(s) >= _MIN_SECRET), key=len, reverse=True)


def mask_settings(value: Any, *, secrets: Iterable[str] = (), placeholder: str = MASK) -> Any:
    """A copy of ``value`` with its secrets masked, through mappings, lists and tuples.

    A string goes through :func:`mask`; a string or number under a key whose
    name says secret becomes ``placeholder`` whatever it is.
    """
    secrets = list(secrets)
    if isinstance(value, str):
        return mask(value, secrets=secrets, placeholder=placeholder)
    if isinstance(value, Mapping):
        return {
            key: placeholder
            if is_secret_key(key) and isinstance(item, (str, bytes, int, float))
            else mask_settings(item, secrets=secrets, placeholder=placeholder)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(
            mask_settings(item, secrets=secrets, placeholder=placeholder) for item in value
        )
    return value
