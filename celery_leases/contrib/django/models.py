"""The lease table, the tables of queued marks and waiters, and the fence table as Django models.

They map onto the tables the SQL store and :mod:`celery_leases.fencing.sql`
use (``docs/sql.md``): the migration creates them with the very DDL those
modules emit, so a ``django://`` store, a ``sqlite:///`` or
``postgresql://`` or ``mysql+pymysql://`` store on the same database and the ORM read the same rows.
Times of the lease and queued-mark tables are integer milliseconds on the
database's clock.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models.functions import Now

from celery_leases.stores.base import LeaseRecord, LeaseState
from celery_leases.stores.sql import record_of

__all__ = ["ExactTextField", "Fence", "Lease", "QueuedMark", "Waiter"]


class ExactTextField(models.CharField):
    """A job id, owner, send id, task id or resource: text compared byte for byte.

    On MySQL and MariaDB the tables keep these columns as ``VARBINARY`` of
    their UTF-8 (their text collations ignore case or trailing spaces), and
    the driver reads them as bytes: this field reads them back as text.
    Elsewhere it is a ``CharField``.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value).decode("utf-8")
        return value


class Lease(models.Model):
    """One job's lease record (table ``celery_leases``); written only by the store."""

    job_id = ExactTextField(max_length=255, primary_key=True)
    owner = ExactTextField(max_length=255, db_default="")
    generation = models.BigIntegerField()
    lease_until = models.BigIntegerField()
    state = models.CharField(
        max_length=16, choices=[(state.value, state.value) for state in LeaseState]
    )
    task_name = models.CharField(max_length=255, db_default="")
    claimed_at = models.BigIntegerField(null=True)
    renewed_at = models.BigIntegerField(null=True)
    completed_at = models.BigIntegerField(null=True)
    renew_count = models.IntegerField(db_default=0)
    takeovers = models.IntegerField(db_default=0)
    send_id = ExactTextField(max_length=255, db_default="")
    outcome = models.BinaryField(null=True)
    released_at = models.BigIntegerField(null=True)
    released_by = models.CharField(max_length=255, db_default="")
    release_reason = models.TextField(db_default="")
    #: the Celery task id of the delivery that claimed the job
    task_id = ExactTextField(max_length=255, db_default="")

    class Meta:
        db_table = "celery_leases"
        verbose_name = "lease"
        # the index is made by the migrations, as the SQL store makes it
        # (celery_leases.stores.sql.indexes_in): in PostgreSQL a partial
        # one, which a model's Meta.indexes cannot name per database

    def __str__(self) -> str:
        return f"{self.job_id} ({self.state}, generation {self.generation})"

    def record(self) -> LeaseRecord:
        """This row as the store's :class:`~celery_leases.stores.base.LeaseRecord`.

        Raises:
            LeaseRecordUnreadable: a column holds what the store never writes.
        """
        row = {field.column: getattr(self, field.attname) for field in self._meta.concrete_fields}
        return record_of(row, f"table {self._meta.db_table!r}")


class QueuedMark(models.Model):
    """A job queued under a key of a ``lease_queue_unique`` task (table
    ``celery_leases_queued``); written only by the store.

    A row whose ``queued_until`` has passed on the database's clock ran out:
    the store no longer counts it, and the next mark of the key replaces it.
    """

    job_id = ExactTextField(max_length=255, primary_key=True)
    #: the Celery task id of the queued message
    task_id = ExactTextField(max_length=255)
    queued_at = models.BigIntegerField()
    queued_until = models.BigIntegerField()

    class Meta:
        db_table = "celery_leases_queued"
        verbose_name = "queued mark"

    def __str__(self) -> str:
        return f"{self.job_id} (queued as {self.task_id})"


class Waiter(models.Model):
    """An entry of a job's waiters (table ``celery_leases_waiters``, see
    :mod:`celery_leases.stores.waiters`); written only by the store.

    A send waiting for the job's holder keeps its message in ``payload``;
    an entry without one is a mark, such as the one that names the job's
    last skipped call (``send_id`` ``"last-skipped"``).
    """

    pk = models.CompositePrimaryKey("job_id", "send_id")
    job_id = ExactTextField(max_length=255)
    send_id = ExactTextField(max_length=255)
    #: the Celery task id of the entry's message
    task_id = ExactTextField(max_length=255)
    waiting_since = models.BigIntegerField()
    waiting_until = models.BigIntegerField()
    payload = models.BinaryField()

    class Meta:
        db_table = "celery_leases_waiters"
        verbose_name = "waiter"

    def __str__(self) -> str:
        return f"{self.job_id}: {self.send_id} ({self.task_id})"


class Fence(models.Model):
    """The newest generation accepted per fenced resource (table ``celery_leases_fences``)."""

    resource = ExactTextField(max_length=255, primary_key=True)
    job_id = ExactTextField(max_length=255)
    generation = models.BigIntegerField()
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "celery_leases_fences"
        verbose_name = "fence"

    def __str__(self) -> str:
        return f"{self.resource}: job {self.job_id}, generation {self.generation}"
