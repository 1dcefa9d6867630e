"""A read-only admin of the lease table, with a "force release" action, and
of the queued marks (``lease_queue_unique``).

The action does what ``celery leases release --force`` does: it asks for a
reason, then the store's :meth:`~celery_leases.stores.base.LeaseStore.force_release`
moves the generation on, so the holder (if any) is fenced out of its
renewals, its completion and its fenced writes; the job runs again at its
next claim. Leases are never added, edited or deleted here.

The lease list shows a job's live queued mark beside its lease, read with
the rows in the same query; a lease's page shows it too, and the job's
last call skipped under ``lease_on_busy="skip"``. A key that is only queued (its job never ran,
so it has no lease record) is listed by the queued marks' own admin: the
lease list is a list of lease records, with their filters, their ordering
and their action, none of which a mark has.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.db.models import OuterRef, QuerySet, Subquery
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from celery_leases.contrib.django.models import Lease, QueuedMark, Waiter
from celery_leases.contrib.django.store import SCHEME
from celery_leases.errors import LeaseError
from celery_leases.stores import open_store
from celery_leases.stores.base import LeaseState, ms_to_datetime
from celery_leases.stores.checks import REASON_LIMIT
from celery_leases.stores.waiters import LAST_SKIPPED

__all__ = ["ForceReleaseForm", "LeaseAdmin", "QueuedMarkAdmin", "ReadOnlyAdmin"]


class ForceReleaseForm(forms.Form):
    """The reason an operator gives, kept in the record."""

    reason = forms.CharField(max_length=REASON_LIMIT, widget=forms.Textarea, strip=True)


def _operator(request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    name = user.get_username() if user is not None else ""
    return f"{name or 'anonymous'} (django admin)"


def _when(ms: int | None) -> str:
    """A time of the store in milliseconds, as people read it (UTC)."""
    if ms is None:
        return "-"
    return ms_to_datetime(ms).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _date_column(field: str, description: str) -> Callable[[Any, Lease], str]:
    """A read-only column of a time field of the store (milliseconds), shown as a date."""

    def column(model_admin: Any, lease: Lease) -> str:
        return _when(getattr(lease, field))

    shown: Callable[[Any, Lease], str] = admin.display(description=description)(column)
    return shown


def _now_ms(row: Any) -> int:
    """The database's clock when the row was read (the ``db_now`` annotation):
    the clock a ``django://`` store keeps its leases and marks by."""
    now = row.db_now
    if now.tzinfo is None:  # USE_TZ = False: the database's time, in UTC
        now = now.replace(tzinfo=datetime.timezone.utc)
    return int(now.timestamp() * 1000)


def _left(until_ms: int | None, now_ms: int) -> str:
    """Seconds from ``now_ms`` to ``until_ms``; empty when past (or none)."""
    if until_ms is None or until_ms <= now_ms:
        return ""
    return f"{(until_ms - now_ms) / 1000:.1f} s"


def _queued_mark_of(row: Any) -> QueuedMark | None:
    """The live queued mark read with a lease row (``queued_*`` annotations),
    or ``None``: no mark, or one that ran out (the store counts neither)."""
    if row.queued_until is None or row.queued_until <= _now_ms(row):
        return None
    return QueuedMark(
        job_id=row.job_id,
        task_id=row.queued_task_id,
        queued_at=row.queued_at,
        queued_until=row.queued_until,
    )


def _annotated_field(field: str, until: str, description: str) -> Callable[[Any, Lease], str]:
    """A read-only field of the detail page: the annotation ``field`` of a
    lease row (a task id, or a time shown as a date), "-" once the entry it
    comes from ran out at the annotation ``until`` (the store counts it no
    more): the job's queued mark, or its last skipped call."""

    def column(model_admin: Any, lease: Lease) -> str:
        runs_out = getattr(lease, until)
        if runs_out is None or runs_out <= _now_ms(lease):
            return "-"
        value = getattr(lease, field)
        return value if isinstance(value, str) else _when(value)

    shown: Callable[[Any, Lease], str] = admin.display(description=description)(column)
    return shown


class ReadOnlyAdmin(admin.ModelAdmin):
    """An admin that adds, changes and deletes nothing: the store writes the rows."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    """Leases: list, filter by state and task, search by job id or task id; force release."""

    list_display = (
        "job_id",
        "state",
        "task_name",
        "task_id",
        "generation",
        "holder",
        "until",
        "expired",
        "left",
        "queued",
    )
    list_filter = ("state", "task_name")
    search_fields = ("job_id", "task_id")
    ordering = ("-claimed_at",)
    actions = ("force_release",)
    #: the detail page: the store's times as dates, the outcome left out (bytes)
    fields = (
        "job_id",
        "state",
        "task_name",
        "task_id",
        "generation",
        "owner",
        "until",
        "expired",
        "left",
        "claimed",
        "renewed",
        "renew_count",
        "takeovers",
        "completed",
        "send_id",
        "released",
        "released_by",
        "release_reason",
        "queued_task",
        "queued_since",
        "queued_until_shown",
        "skipped_task",
        "skipped_at",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lease]:
        # the database's clock, read with the rows, for "expired" and "left";
        # the job's queued mark and last skipped call, read in the same
        # query (not one per row)
        mark = QueuedMark.objects.filter(job_id=OuterRef("job_id"))
        skipped = Waiter.objects.filter(job_id=OuterRef("job_id"), send_id=LAST_SKIPPED)
        return (
            super()
            .get_queryset(request)
            .annotate(
                db_now=Now(),
                queued_task_id=Subquery(mark.values("task_id")[:1]),
                queued_at=Subquery(mark.values("queued_at")[:1]),
                queued_until=Subquery(mark.values("queued_until")[:1]),
                skipped_task_id=Subquery(skipped.values("task_id")[:1]),
                skipped_since=Subquery(skipped.values("waiting_since")[:1]),
                skipped_until=Subquery(skipped.values("waiting_until")[:1]),
            )
        )

    @admin.display(description="holder")
    def holder(self, lease: Lease) -> str:
        """host:pid of the owner (the detail page shows the whole owner)."""
        return ":".join(lease.owner.split(":")[:2])

    @admin.display(description="lease until (UTC)", ordering="lease_until")
    def until(self, lease: Lease) -> str:
        return _when(lease.lease_until)

    @admin.display(description="expired")
    def expired(self, lease: Lease) -> str:
        """ "yes" for a holder past its lease (gone or stalled); empty when not held."""
        if lease.state != LeaseState.HELD.value:
            return ""
        return "no" if lease.record().is_live(_now_ms(lease)) else "yes"

    @admin.display(description="left")
    def left(self, lease: Lease) -> str:
        """Seconds until the lease runs out, for a live holder."""
        now = _now_ms(lease)
        if not lease.record().is_live(now):
            return ""
        return _left(lease.lease_until, now)

    @admin.display(description="queued")
    def queued(self, lease: Lease) -> str:
        """The task id of the job's queued message and the time its mark has
        left (``lease_queue_unique``); empty when none is queued."""
        mark = _queued_mark_of(lease)
        if mark is None:
            return ""
        return f"{mark.task_id} ({_left(mark.queued_until, _now_ms(lease))} left)"

    queued_task = _annotated_field("queued_task_id", "queued_until", "queued task id")
    queued_since = _annotated_field("queued_at", "queued_until", "queued at (UTC)")
    queued_until_shown = _annotated_field(
        "queued_until", "queued_until", "queued mark runs out (UTC)"
    )
    skipped_task = _annotated_field("skipped_task_id", "skipped_until", "last skipped task id")
    skipped_at = _annotated_field("skipped_since", "skipped_until", "last skipped at (UTC)")

    claimed = _date_column("claimed_at", "claimed (UTC)")
    renewed = _date_column("renewed_at", "renewed (UTC)")
    completed = _date_column("completed_at", "completed (UTC)")
    released = _date_column("released_at", "released (UTC)")

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{Lease._meta.app_label}.change_lease"))

    @admin.action(
        description="Force release (the holder is fenced out)", permissions=["force_release"]
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lease]) -> HttpResponse | None:
        """Ask for a reason, then release every selected lease through the store;
        a selection with a completed job is refused before the reason is asked."""
        completed = [lease for lease in queryset if lease.state == LeaseState.COMPLETED.value]
        if completed:
            for lease in completed:
                self.message_user(
                    request,
                    f"job {lease.job_id!r} is completed (generation {lease.generation}); "
                    "a completed job is not released: select held or released jobs only",
                    messages.ERROR,
                )
            return None
        form = ForceReleaseForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            context = {
                **self.admin_site.each_context(request),
                "title": "Force release",
                "leases": list(queryset),
                "form": form,
                "opts": self.model._meta,
                "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/celery_leases/lease/force_release.html", context
            )
        store = open_store(f"{SCHEME}://{queryset.db}")
        try:
            for lease in queryset:
                try:
                    record = store.force_release(
                        lease.job_id, by=_operator(request), reason=form.cleaned_data["reason"]
                    )
                except LeaseError as exc:
                    self.message_user(request, str(exc), messages.ERROR)
                    continue
                self.message_user(
                    request,
                    f"released job {lease.job_id!r}: generation is now {record.generation}; "
                    "a holder with an older generation is fenced out",
                    messages.SUCCESS,
                )
        finally:
            store.close()
        return None


@admin.register(QueuedMark)
class QueuedMarkAdmin(ReadOnlyAdmin):
    """Queued marks (``lease_queue_unique``): every key with a job queued,
    also one whose job never ran (no lease record yet). Read-only."""

    list_display = ("job_id", "task_id", "since", "until", "left", "lease")
    search_fields = ("job_id", "task_id")
    ordering = ("-queued_at",)
    fields = ("job_id", "task_id", "since", "until", "left", "lease")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[QueuedMark]:
        # the database's clock and the state of the key's lease record, with the rows
        record = Lease.objects.filter(job_id=OuterRef("job_id"))
        return (
            super()
            .get_queryset(request)
            .annotate(db_now=Now(), lease_state=Subquery(record.values("state")[:1]))
        )

    @admin.display(description="queued at (UTC)", ordering="queued_at")
    def since(self, mark: QueuedMark) -> str:
        return _when(mark.queued_at)

    @admin.display(description="runs out (UTC)", ordering="queued_until")
    def until(self, mark: QueuedMark) -> str:
        return _when(mark.queued_until)

    @admin.display(description="left")
    def left(self, mark: QueuedMark) -> str:
        """Seconds until the mark runs out; "ran out" past it (the store no
        longer counts it, and the key's next send replaces it)."""
        return _left(mark.queued_until, _now_ms(mark)) or "ran out"

    @admin.display(description="lease")
    def lease(self, mark: QueuedMark) -> str:
        """The state of the key's lease record, with a link to it; "none"
        when the key's job has never run."""
        state = mark.lease_state
        if state is None:
            return "none (never run)"
        url = reverse("admin:celery_leases_lease_change", args=[quote(mark.job_id)])
        link: str = format_html('<a href="{}">{}</a>', url, state)
        return link
