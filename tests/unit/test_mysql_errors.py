"""MySQL's error numbers, read one way: a deadlock is tried again, a missing right is not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy import exc

from celery_leases.stores.queued import QueuedMark
from celery_leases.stores.sql import (
    MYSQL_DEADLOCK,
    dialect_named,
    lease_table,
    mysql_error_number,
    refused_for_good,
)
from celery_leases.stores.sql._queued import QueuedMarks

#: MySQL's "access denied" (a wrong password)
ACCESS_DENIED = 1045


def operational(number: int) -> exc.OperationalError:
    """SQLAlchemy's error around PyMySQL's, as a statement that failed raises it."""
    return exc.OperationalError("INSERT ...", {}, pymysql.err.OperationalError(number, "message"))


def test_the_error_number_is_pymysqls_first_argument_and_nothing_else() -> None:
    assert mysql_error_number(pymysql.err.OperationalError(MYSQL_DEADLOCK, "Deadlock")) == 1213
    assert mysql_error_number(ConnectionRefusedError("refused")) is None
    assert mysql_error_number(RuntimeError()) is None
    assert mysql_error_number(RuntimeError(True)) is None
    assert refused_for_good(pymysql.err.OperationalError(ACCESS_DENIED, "denied"))
    assert not refused_for_good(pymysql.err.OperationalError(MYSQL_DEADLOCK, "Deadlock"))


def answering(*answers: Any) -> Callable[..., Any]:
    """An ``in_write`` that raises or returns each answer in turn."""
    left = list(answers)

    def in_write(step: Callable[..., Any], parameters: dict[str, Any]) -> Any:
        answer = left.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return in_write


@pytest.fixture
def marks() -> QueuedMarks:
    return QueuedMarks(lease_table(sa.MetaData()), dialect_named("mysql", "a test"))


def test_a_queued_mark_whose_transaction_ended_as_a_deadlock_is_placed_again(
    marks: QueuedMarks,
) -> None:
    placed = QueuedMark("job", "task", 1, 2)
    in_write = answering(operational(MYSQL_DEADLOCK), placed)
    assert marks.mark(in_write, "job", "task", 1000) == placed


def test_another_error_of_a_queued_mark_is_not_tried_again(marks: QueuedMarks) -> None:
    in_write = answering(operational(ACCESS_DENIED), QueuedMark("job", "task", 1, 2))
    with pytest.raises(exc.OperationalError):
        marks.mark(in_write, "job", "task", 1000)
