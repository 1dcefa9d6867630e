"""A read-only admin of the lease table, with a "force release" action.

The action does what ``celery leases release --force`` does: it asks for a
reason, then the store's :meth:`~celery_leases.stores.base.LeaseStore.force_release`
moves the generation on, so the holder (if any) is fenced out of its
renewals, its completion and its fenced writes; the job runs again at its
next claim. Leases are never added, edited or deleted here.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from celery_leases.contrib.django.models import Lease
from celery_leases.contrib.django.store import SCHEME
from celery_leases.errors import LeaseError
from celery_leases.stores import open_store
from celery_leases.stores.base import ms_to_datetime
from celery_leases.stores.checks import REASON_LIMIT

__all__ = ["ForceReleaseForm", "LeaseAdmin"]


class ForceReleaseForm(forms.Form):
    """The reason an operator gives, kept in the record."""

    reason = forms.CharField(max_length=REASON_LIMIT, widget=forms.Textarea, strip=True)


def _operator(request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    name = user.get_username() if user is not None else ""
    return f"{name or 'anonymous'} (django admin)"


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin):
    """Leases: list, filter by state and task, search by job id or task id; force release."""

    list_display = ("job_id", "state", "task_name", "generation", "owner", "until")
    list_filter = ("state", "task_name")
    search_fields = ("job_id", "task_id")
    ordering = ("-claimed_at",)
    actions = ("force_release",)

    @admin.display(description="lease until (UTC)")
    def until(self, lease: Lease) -> str:
        return ms_to_datetime(lease.lease_until).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{Lease._meta.app_label}.change_lease"))

    @admin.action(
        description="Force release (the holder is fenced out)", permissions=["force_release"]
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lease]) -> HttpResponse | None:
        """Ask for a reason, then release every selected lease through the store."""
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
