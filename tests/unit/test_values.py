"""The one reading of a whole number, a number and a reply's text."""

from __future__ import annotations

import pytest

from celery_leases.values import as_text, is_number, is_whole


@pytest.mark.parametrize(
    ("value", "low", "high", "whole"),
    [
        (0, None, None, True),
        (-3, None, None, True),
        (-3, 0, None, False),
        (1, 1, 1, True),
        (2, 1, 1, False),
        (True, None, None, False),
        (False, 0, None, False),
        (1.0, None, None, False),
        ("1", None, None, False),
        (None, None, None, False),
    ],
)
def test_is_whole_takes_only_ints_in_range_and_never_a_bool(
    value: object, low: int | None, high: int | None, whole: bool
) -> None:
    assert is_whole(value, low, high) is whole


@pytest.mark.parametrize(
    ("value", "number"),
    [(0, True), (2.5, True), (float("inf"), True), (True, False), ("1", False), (None, False)],
)
def test_is_number_takes_ints_and_floats_but_not_bools(value: object, number: bool) -> None:
    assert is_number(value) is number


def test_as_text_decodes_bytes_and_formats_the_rest() -> None:
    assert as_text(b"held") == "held"
    assert as_text("held") == "held"
    assert as_text(7) == "7"
