"""Fenced writes through the Django ORM, with the rules of :mod:`celery_leases.fencing.sql`.

- :func:`fenced_update`: a queryset ``UPDATE`` that also filters on the
  row's fence column, so a stale generation changes nothing and raises
  :class:`~celery_leases.errors.StaleFencingToken`.
- :func:`fenced_save`: ``Model.save()`` under the same fence (an update of
  the row when its fence column is older, else an insert).
- :func:`advance_fence`: the fence table (:class:`~.models.Fence`), inside
  the ORM's transaction, so the fence and your writes commit together.

Each takes the lease (or any ``FencingToken``) and ``on_repeat`` like the
SQLAlchemy forms, and returns the same :class:`~celery_leases.fencing.FenceResult`.
Writes that commit with the lease's completion (exactly once) are
:mod:`.exactly_once`'s.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.db import IntegrityError, models, router, transaction
from django.db.models.functions import Now

from celery_leases.contrib.django.models import Fence
from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import (
    FenceResult,
    FencingToken,
    OnRepeat,
    check_on_repeat,
    check_resource,
    check_token,
    decide,
    stale_token_error,
)
from celery_leases.fencing.sql_column import DEFAULT_FENCE_COLUMN, refused_on_column

__all__ = ["DEFAULT_FENCE_COLUMN", "advance_fence", "fenced_save", "fenced_update"]


def _may_write(fence_field: str, generation: int, on_repeat: OnRepeat) -> models.Q:
    lookup = "lte" if on_repeat == "apply" else "lt"
    newer = models.Q(**{f"{fence_field}__{lookup}": generation})
    return models.Q(**{f"{fence_field}__isnull": True}) | newer


def _check_fence_field(model: type[models.Model], fence_field: str) -> None:
    try:
        field = model._meta.get_field(fence_field)
    except FieldDoesNotExist:
        raise LeaseConfigurationError(
            f"model {model.__name__} has no fence field {fence_field!r}; add "
            f"`{fence_field} = models.BigIntegerField(null=True)` or pass "
            "fence_field=<its name>"
        ) from None
    if not isinstance(field, models.BigIntegerField):
        raise LeaseConfigurationError(
            f"the fence field {model.__name__}.{fence_field} must be a "
            f"BigIntegerField(null=True), not {type(field).__name__}"
        )


def fenced_update(
    queryset: models.QuerySet[Any],
    token: FencingToken,
    *,
    fence_field: str = DEFAULT_FENCE_COLUMN,
    on_repeat: OnRepeat = "apply",
    resource: str | None = None,
    **values: Any,
) -> FenceResult:
    """``queryset.update(**values)`` only where the fence field is older than ``token``.

    One statement::

        UPDATE app_model SET <values>, fence_generation = :g
        WHERE <queryset's filter> AND (fence_generation IS NULL OR fence_generation <= :g)

    (``<`` unless ``on_repeat="apply"``). The queryset should select one
    row (a primary key): each row is fenced on its own.

    Args:
        queryset: the rows to write, for example ``Account.objects.filter(pk=42)``.
        token: the lease (or any ``FencingToken``).
        fence_field: a ``BigIntegerField(null=True)`` of the model.
        on_repeat: what a repeat of the row's generation does.
        resource: name used in results and errors; defaults to the table's.
        **values: the fields to set, as for ``QuerySet.update``.

    Returns:
        The :class:`FenceResult`; ``applied`` is ``False`` (``rowcount`` 0)
        when no row matched the queryset, or for a repeat accepted as a no-op.

    Raises:
        StaleFencingToken: the matched rows hold a newer generation; nothing
            was written.
        LeaseConfigurationError: the model has no such fence field.
    """
    job_id, generation = check_token(token)
    on_repeat = check_on_repeat(on_repeat)
    model = queryset.model
    _check_fence_field(model, fence_field)
    name = check_resource(model._meta.db_table if resource is None else resource)
    rowcount = queryset.filter(_may_write(fence_field, generation, on_repeat)).update(
        **values, **{fence_field: generation}
    )
    if rowcount:
        return FenceResult(name, job_id, generation, applied=True, rowcount=rowcount)
    found = queryset.aggregate(rows=models.Count("pk"), newest=models.Max(fence_field))
    if not found["rows"]:
        return FenceResult(name, job_id, generation, applied=False, rowcount=0)
    accepted = None if found["newest"] is None else int(found["newest"])
    return refused_on_column(name, job_id, generation, on_repeat, accepted)


def fenced_save(
    instance: models.Model,
    token: FencingToken,
    *,
    fence_field: str = DEFAULT_FENCE_COLUMN,
    on_repeat: OnRepeat = "apply",
    using: str | None = None,
) -> FenceResult:
    """Save ``instance`` only if its row's fence field is older than ``token``.

    An existing row is updated with every concrete field of ``instance``
    (as :func:`fenced_update` does); a missing one is inserted with the
    fence field set. A concurrent insert of the same primary key is taken
    as an existing row. ``instance``'s fence field is set to the token's
    generation when the write is applied.

    Raises:
        StaleFencingToken: the stored row holds a newer generation; nothing
            was written.
        LeaseConfigurationError: the model has no such fence field.
    """
    job_id, generation = check_token(token)
    model = type(instance)
    _check_fence_field(model, fence_field)
    db = using or router.db_for_write(model, instance=instance)
    rows = model._default_manager.using(db)
    values = {
        field.attname: getattr(instance, field.attname)
        for field in model._meta.concrete_fields
        if not field.primary_key and field.name != fence_field
    }
    with transaction.atomic(using=db):
        if instance.pk is None or not rows.filter(pk=instance.pk).exists():
            before = getattr(instance, fence_field)
            setattr(instance, fence_field, generation)
            try:
                with transaction.atomic(using=db):
                    instance.save(using=db, force_insert=True)
            except IntegrityError:
                setattr(instance, fence_field, before)
                if instance.pk is None or not rows.filter(pk=instance.pk).exists():
                    raise  # another constraint, not a row inserted in between
            else:
                name = check_resource(model._meta.db_table)
                return FenceResult(name, job_id, generation, applied=True, rowcount=1)
        result = fenced_update(
            rows.filter(pk=instance.pk),
            token,
            fence_field=fence_field,
            on_repeat=on_repeat,
            **values,
        )
    if result.applied:
        setattr(instance, fence_field, generation)
    return result


def advance_fence(
    resource: str,
    token: FencingToken,
    *,
    using: str | None = None,
    on_repeat: OnRepeat = "apply",
) -> FenceResult:
    """Move the fence of ``resource`` to ``token`` in the fence table, through the ORM.

    Call it inside ``transaction.atomic()`` with the writes it guards: the
    fence and the writes commit together, or neither does. An accepted
    fence row stays locked (PostgreSQL) or under the write lock (SQLite)
    until the transaction ends, so two holders' writes take turns.

    Args:
        resource: the fenced resource's name (for example ``"account:42"``).
        token: the lease (or any ``FencingToken``).
        using: the database alias; by default the router's for :class:`Fence`.
        on_repeat: what a repeat of the accepted generation does.

    Returns:
        The :class:`FenceResult`; ``applied`` is ``False`` for a repeat
        accepted as a no-op.

    Raises:
        StaleFencingToken: the token is older than the accepted one (or a
            refused repeat); the fence did not move.
    """
    resource = check_resource(resource)
    job_id, generation = check_token(token)
    on_repeat = check_on_repeat(on_repeat)
    db = using or router.db_for_write(Fence)
    fences = Fence.objects.using(db)
    newer = models.Q(generation__lt=generation)
    if on_repeat == "apply":
        # an equal generation of *another* job is never a repeat
        newer |= models.Q(generation=generation, job_id=job_id)
    with transaction.atomic(using=db):
        for _ in range(2):
            moved = fences.filter(newer, resource=resource).update(
                job_id=job_id, generation=generation, updated_at=Now()
            )
            if moved:
                return FenceResult(resource, job_id, generation, applied=True)
            row = fences.select_for_update().filter(resource=resource).first()
            if row is not None:
                break
            try:
                with transaction.atomic(using=db):
                    fences.create(resource=resource, job_id=job_id, generation=generation)
            except IntegrityError:
                continue  # created by another holder in between: fence against it
            return FenceResult(resource, job_id, generation, applied=True)
        else:  # pragma: no cover - the row exists after a failed insert
            raise stale_token_error(resource, job_id, generation, accepted=None)
    accepted = (row.job_id, row.generation)
    if decide(resource, job_id, generation, on_repeat, accepted):
        # the row did not move though the rule says it may: refuse rather than guess
        raise stale_token_error(
            resource, job_id, generation, accepted=row.generation, accepted_job=row.job_id
        )
    return FenceResult(resource, job_id, generation, applied=False, previous=row.generation)
