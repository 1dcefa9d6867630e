"""ORM fencing keeps the rules, results and errors of celery_leases.fencing.sql."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.db import transaction
from orders.models import Order

from celery_leases.contrib.django import fencing as orm
from celery_leases.contrib.django.models import Fence
from celery_leases.contrib.django.store import connection_arguments
from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.fencing import FenceResult, Token
from celery_leases.fencing import sql as core

pytestmark = pytest.mark.django_db(transaction=True)

REPEATS = ["apply", "accept", "refuse"]


@pytest.fixture
def engine() -> Iterator[sa.Engine]:
    url, arguments = connection_arguments()
    engine = sa.create_engine(url, connect_args=arguments)
    yield engine
    engine.dispose()


def outcome(write: Any) -> FenceResult | str:
    """What a fenced write returned, or the class of what it raised."""
    try:
        return write()  # type: ignore[no-any-return]
    except (StaleFencingToken, LeaseConfigurationError) as error:
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("on_repeat", REPEATS)
def test_fenced_update_answers_as_the_sqlalchemy_form_does(
    engine: sa.Engine, on_repeat: Any
) -> None:
    orders = sa.Table("orders_order", sa.MetaData(), autoload_with=engine)
    for stored, incoming in [(None, 5), (5, 7), (7, 5), (5, 5)]:
        core_row = Order.objects.create(fence_generation=stored)
        orm_row = Order.objects.create(fence_generation=stored)
        token = Token("job-1", incoming)
        with engine.begin() as conn:
            by_core = outcome(
                lambda: core.fenced_update(
                    conn,
                    orders,
                    {"status": "paid"},
                    where=orders.c.id == core_row.pk,  # noqa: B023 - called at once
                    token=token,  # noqa: B023
                    on_repeat=on_repeat,
                    resource="orders",
                )
            )
        by_orm = outcome(
            lambda: orm.fenced_update(
                Order.objects.filter(pk=orm_row.pk),  # noqa: B023 - called at once
                token,  # noqa: B023
                on_repeat=on_repeat,
                resource="orders",
                status="paid",
            )
        )
        case = f"stored {stored}, incoming {incoming}"
        assert by_orm == by_core, case
        core_row.refresh_from_db()
        orm_row.refresh_from_db()
        assert (orm_row.status, orm_row.fence_generation) == (
            core_row.status,
            core_row.fence_generation,
        ), case


def test_a_stale_generation_changes_nothing_and_says_which_won() -> None:
    order = Order.objects.create()
    orm.fenced_update(Order.objects.filter(pk=order.pk), Token("job-1", 8), status="paid")
    with pytest.raises(StaleFencingToken, match="accepted generation 8") as caught:
        orm.fenced_update(Order.objects.filter(pk=order.pk), Token("job-1", 7), status="open")
    assert (caught.value.generation, caught.value.accepted) == (7, 8)
    order.refresh_from_db()
    assert (order.status, order.fence_generation) == ("paid", 8)


def test_an_update_that_matches_no_row_is_not_applied() -> None:
    result = orm.fenced_update(Order.objects.filter(pk=10**9), Token("job-1", 3), status="x")
    assert (result.applied, result.rowcount) == (False, 0)


def test_a_model_without_the_fence_field_is_refused_before_writing() -> None:
    with pytest.raises(LeaseConfigurationError, match="no fence field 'version'"):
        orm.fenced_update(Order.objects.all(), Token("job-1", 3), fence_field="version", status="x")


def test_fenced_save_inserts_updates_and_refuses_a_stale_generation() -> None:
    order = Order(status="new")
    assert orm.fenced_save(order, Token("job-1", 4)).applied
    assert Order.objects.get(pk=order.pk).fence_generation == 4
    order.status = "paid"
    assert orm.fenced_save(order, Token("job-1", 6)).applied
    assert (order.fence_generation, Order.objects.get(pk=order.pk).status) == (6, "paid")
    order.status = "stale"
    with pytest.raises(StaleFencingToken):
        orm.fenced_save(order, Token("job-1", 5))
    assert Order.objects.get(pk=order.pk).status == "paid"
    # a row inserted by someone else with this primary key is fenced against
    newer = Order.objects.create(pk=10**6, status="theirs", fence_generation=9)
    with pytest.raises(StaleFencingToken):
        orm.fenced_save(Order(pk=newer.pk, status="mine"), Token("job-2", 8))


@pytest.mark.parametrize("on_repeat", REPEATS)
def test_advance_fence_answers_as_the_sqlalchemy_form_does_on_the_same_table(
    engine: sa.Engine, on_repeat: Any
) -> None:
    fences = core.fence_table(sa.MetaData())
    cases = [
        (("job-1", 5), ("job-1", 7)),
        (("job-1", 7), ("job-1", 5)),
        (("job-1", 5), ("job-1", 5)),
        (("job-1", 5), ("job-2", 5)),
    ]
    for number, (first, second) in enumerate(cases):
        by_orm_name, by_core_name = f"orm:{number}", f"core:{number}"
        # the core form moves the fence first and the ORM second, and the reverse
        with engine.begin() as conn:
            core.advance_fence(conn, by_orm_name, Token(*first), fences=fences)
        by_orm = outcome(
            lambda: orm.advance_fence(by_orm_name, Token(*second), on_repeat=on_repeat)  # noqa: B023
        )
        orm.advance_fence(by_core_name, Token(*first))
        with engine.begin() as conn:
            by_core = outcome(
                lambda: core.advance_fence(
                    conn,
                    by_core_name,  # noqa: B023 - called at once
                    Token(*second),  # noqa: B023
                    fences=fences,
                    on_repeat=on_repeat,
                )
            )
        case = f"{first} then {second}"
        assert str(by_orm).replace(by_orm_name, "X") == str(by_core).replace(by_core_name, "X")
        one, two = Fence.objects.get(pk=by_orm_name), Fence.objects.get(pk=by_core_name)
        assert (one.job_id, one.generation) == (two.job_id, two.generation), case


def test_a_refused_fence_rolls_back_the_writes_of_its_transaction() -> None:
    order = Order.objects.create()
    orm.advance_fence(f"order:{order.pk}", Token("job-1", 9))

    def stale_write() -> None:
        with transaction.atomic():
            Order.objects.filter(pk=order.pk).update(status="stale")
            orm.advance_fence(f"order:{order.pk}", Token("job-1", 8))

    with pytest.raises(StaleFencingToken):
        stale_write()
    order.refresh_from_db()
    assert order.status == "open"
