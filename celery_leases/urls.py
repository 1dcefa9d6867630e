"""The scheme of a store or broker URL, read one way everywhere."""

from __future__ import annotations

__all__ = ["url_scheme"]


def url_scheme(url: object) -> str:
    """The scheme of ``url``, lower case (``"redis"`` of ``REDIS://host/0``);
    ``""`` when ``url`` is not a string with ``://`` in it (unset, or a bare name)."""
    if not isinstance(url, str) or "://" not in url:
        return ""
    return url.split("://", 1)[0].lower()
