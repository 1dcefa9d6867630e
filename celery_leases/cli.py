"""The ``celery leases`` command: list, show, release and purge lease records.

Celery loads this group from the ``celery.commands`` entry point, so it runs
with the app of ``celery -A proj`` and its ``leases_*`` settings::

    celery -A proj leases ls --state held --expired
    celery -A proj leases show JOB_ID --json
    celery -A proj leases release JOB_ID --force --reason "stuck on host-3"
    celery -A proj leases purge --older-than 7d
    celery -A proj leases init-db
    celery -A proj leases check

Exit status: 0 success; 1 ``check`` found problems; 2 usage error; 3 no such
job; 4 the store could not be reached; 5 the configuration is wrong; 6 the
store refused (a completed job is not released). No
command prints a password of the store URL.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand

from celery_leases import inspect as _inspect  # noqa: F401 - registers `celery inspect leases`
from celery_leases.checks import Check, run_checks
from celery_leases.display import (
    parse_duration,
    queued_to_dict,
    record_to_dict,
    short_time,
    skipped_to_dict,
    table,
    waiter_to_dict,
)
from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseStoreWarning,
    StoreUnavailable,
)
from celery_leases.purge import purge_records
from celery_leases.redact import mask, secrets_of
from celery_leases.runtime import settings_for
from celery_leases.stores import (
    INIT_DB,
    LeaseStore,
    is_sql_url,
    open_store,
    scheme_is_known,
    table_maker,
)
from celery_leases.stores.base import LeaseState, ms_to_datetime
from celery_leases.stores.checks import check_retention

__all__ = [
    "EXIT_CONFIGURATION",
    "EXIT_NOT_FOUND",
    "EXIT_PROBLEMS",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "leases",
]

EXIT_PROBLEMS = 1
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4
EXIT_CONFIGURATION = 5
EXIT_REFUSED = 6

_SORT_KEYS = {
    "job": lambda r: r.job_id,
    "lease-until": lambda r: r.lease_until_ms,
    "generation": lambda r: r.generation,
    "claimed": lambda r: r.claimed_at_ms or 0,
    "task": lambda r: (r.task_name, r.job_id),
    "state": lambda r: (r.state.value, r.job_id),
}


# --- plumbing ----------------------------------------------------------------


def _fail(ctx: click.Context, code: int, message: str) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    ctx.exit(code)
    raise AssertionError("unreachable")  # ctx.exit raises


def _operator() -> str:
    """``user@host`` of whoever runs the command, for the record."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _app(ctx: click.Context) -> Any:
    return ctx.find_root().obj.app


def _no_app(ctx: click.Context) -> str:
    """Why there are no settings to read when ``celery`` was given no app
    (no ``-A``, no ``CELERY_APP``) and its fallback app has no lease store;
    ``""`` otherwise (a fallback app may read a ``celeryconfig`` module)."""
    root = ctx.find_root()
    if root.params.get("app") is not None or root.obj.app.conf.get("leases_store"):
        return ""
    names = []
    while ctx.parent is not None:
        names.append(str(ctx.info_name))
        ctx = ctx.parent
    return (
        "no Celery app was given, so there are no lease settings to read: name your "
        f"app with -A (celery -A proj {' '.join(reversed(names))}) or the CELERY_APP "
        "environment variable"
    )


@contextlib.contextmanager
def _errors(ctx: click.Context, url: str) -> Iterator[None]:
    """Turn lease errors into an exit status and a message without secrets."""
    try:
        yield
    except StoreUnavailable as exc:
        _fail(ctx, EXIT_UNAVAILABLE, mask(str(exc), secrets=secrets_of(url)))
    except LeaseConfigurationError as exc:
        message = mask(str(exc), secrets=secrets_of(url))
        maker = table_maker(url)
        if maker and "table" in message and maker not in f"{ctx.command_path} {message}":
            message += f" A new database needs its table first: {maker}."
        _fail(ctx, EXIT_CONFIGURATION, message)


@contextlib.contextmanager
def _store(ctx: click.Context, *, create_table: bool = False) -> Iterator[LeaseStore]:
    """Open the app's lease store; a SQL table is never made by accident."""
    if no_app := _no_app(ctx):
        _fail(ctx, EXIT_CONFIGURATION, no_app)
    app = _app(ctx)
    with _errors(ctx, str(app.conf.get("leases_store") or "")):
        settings = settings_for(app)
    url = settings.store_url
    if not scheme_is_known(url):
        # a scheme an integration registers when its framework starts
        # (django://): prepare the app as a worker would, which starts it
        app.loader.import_default_modules()
    maker = table_maker(url)
    if create_table and maker not in ("", INIT_DB):
        _fail(
            ctx,
            EXIT_CONFIGURATION,
            f"the lease table of {mask(url)} is made by {maker}, which owns it: run that "
            "instead (a table init-db made would stand in its way)",
        )
    options = dict(settings.store_options)
    if is_sql_url(url):
        options["create_table"] = create_table
    # the server's settings are reported by `check`, not after every listing
    with _errors(ctx, url), warnings.catch_warnings():
        warnings.simplefilter("ignore", LeaseStoreWarning)
        store = open_store(url, **options)
        try:
            yield store
        finally:
            store.close()


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


#: ``--json``, which every command takes
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


class _JobArgument(click.Argument):
    """A ``JOB_ID`` argument, listed under "Arguments" in ``--help``.

    ``CeleryCommand`` lists every parameter's help row under the
    parameter's ``help_group`` (its public way to group them), or under
    "Options" when it has none.
    """

    help_group = "Arguments"

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        return self.human_readable_name, "The job id: the task id, or the task's lease_key."


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """An option's duration in seconds (``callback=``): click's error names the option."""
    return parse_duration(value)


# --- the commands --------------------------------------------------------------


@click.group(name="leases")
@click.pass_context
def leases(ctx: click.Context) -> None:
    """Inspect and manage the lease records of this app's lease store."""


@leases.command(name="ls", cls=CeleryCommand)
@click.option(
    "--state",
    type=click.Choice([s.value for s in LeaseState]),
    help="Only records in this state.",
)
@click.option("--task", "task_name", help="Only records of this task name.")
@click.option("--expired", is_flag=True, help="Only held records whose lease ran out.")
@click.option("--sort", type=click.Choice(sorted(_SORT_KEYS)), default="job", show_default=True)
@click.option("--reverse", is_flag=True, help="Sort in descending order.")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0, show_default=True)
@_json_option
@click.pass_context
def ls_command(
    ctx: click.Context,
    state: str | None,
    task_name: str | None,
    expired: bool,
    sort: str,
    reverse: bool,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """List lease records (reads every record of the store to sort them)."""
    wanted = LeaseState.HELD if expired else (LeaseState(state) if state else None)
    if expired and state not in (None, LeaseState.HELD.value):
        raise click.UsageError("--expired lists held records only; drop --state or use held")
    with _store(ctx) as store:
        records = list(store.records(state=wanted))
        now = store.now_ms()
    if task_name is not None:
        records = [r for r in records if r.task_name == task_name]
    if expired:
        records = [r for r in records if not r.is_live(now)]
    records.sort(key=_SORT_KEYS[sort], reverse=reverse)
    page = [record_to_dict(r, now) for r in records[offset : offset + limit]]
    if as_json:
        _emit_json(
            {
                "store_time": ms_to_datetime(now).isoformat(),
                "total": len(records),
                "offset": offset,
                "records": page,
            }
        )
        return
    if not records:
        click.echo("no lease records")
        return
    for row in page:
        row["host_pid"] = ":".join(row["owner"].split(":")[:2])
        row["lease_until"] = short_time(row["lease_until"])
        row["remaining"] = f"{row['remaining']:.1f}s" if row["state"] == "held" else ""
        if row["expired"]:
            row["remaining"] = "expired"
    click.echo(
        table(
            page,
            [
                ("job_id", "JOB"),
                ("state", "STATE"),
                ("task_name", "TASK"),
                ("generation", "GENERATION"),
                ("host_pid", "HOLDER"),
                ("lease_until", "LEASE UNTIL (UTC)"),
                ("remaining", "LEFT"),
            ],
        )
    )
    shown = f"{offset + 1}-{offset + len(page)}" if page else "none"
    click.echo(f"\n{shown} of {len(records)} records")


@leases.command(name="show", cls=CeleryCommand)
@click.argument("job_id", cls=_JobArgument)
@_json_option
@click.pass_context
def show_command(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show every field of one job's record, its queued mark if it has one,
    its last skipped call, and the copies waiting for its holder."""
    with _store(ctx) as store:
        record = store.get(job_id)
        mark = store.queued(job_id)
        entries = store.waiters(job_id)
        now = store.now_ms()
    waiters = [entry for entry in entries if not entry.is_mark]
    skipped = next((entry for entry in entries if entry.is_last_skipped), None)
    if record is None and mark is None and not waiters and skipped is None:
        _fail(ctx, EXIT_NOT_FOUND, f"no lease record for job {job_id!r}")
    data: dict[str, Any] = {"job_id": job_id} if record is None else record_to_dict(record, now)
    if mark is not None:
        data.update(queued_to_dict(mark, now))
    if skipped is not None:
        data.update(skipped_to_dict(skipped))
    waiting = [waiter_to_dict(waiter, now) for waiter in waiters]
    if as_json:
        _emit_json({**data, "waiters": waiting})
        return
    width = max(len(key) for key in [*data, "waiters"])
    for key, value in data.items():
        click.echo(f"{key.ljust(width)}  {'' if value is None else value}")
    click.echo(f"{'waiters'.ljust(width)}  {len(waiting)}")
    for waiter in waiting:
        click.echo(
            f"  {waiter['task_id']}  since {waiter['waiting_since']}"
            f"  runs out in {waiter['waiting_remaining']:g} s"
        )


@leases.command(name="release", cls=CeleryCommand)
@click.argument("job_id", cls=_JobArgument)
@click.option("--force", is_flag=True, help="Required: the job will be claimed and run again.")
@click.option("--reason", required=True, help="Why, kept in the record.")
@click.option("--by", "released_by", help="Who releases it (default: user@host).")
@_json_option
@click.pass_context
def release_command(
    ctx: click.Context,
    job_id: str,
    force: bool,
    reason: str,
    released_by: str | None,
    as_json: bool,
) -> None:
    """Take the lease away from its holder, so the job can be claimed again.

    The generation moves on, so the old holder's renewals, completion and
    fenced writes are refused; the job itself is not finished: a redelivery
    or a deferred copy claims it and runs it again.
    """
    if not force:
        raise click.UsageError(
            "releasing a lease by hand lets the job run again while its old holder may "
            "still be running (its fenced writes are refused); pass --force to do it"
        )
    who = released_by or _operator()
    with _store(ctx) as store:
        try:
            record = store.force_release(job_id, by=who, reason=reason)
        except LeaseConfigurationError:
            # the store refuses a job it has no record of, or a completed one
            current = store.get(job_id)
            if current is None:
                _fail(ctx, EXIT_NOT_FOUND, f"no lease record for job {job_id!r}")
            if current.state is LeaseState.COMPLETED:
                _fail(
                    ctx,
                    EXIT_REFUSED,
                    f"job {job_id!r} is completed (generation {current.generation}); "
                    "a completed job is not released",
                )
            raise
        now = store.now_ms()
    data = record_to_dict(record, now)
    if as_json:
        _emit_json(data)
        return
    click.echo(
        f"released job {job_id!r}: generation is now {record.generation}; a holder with an "
        "older generation is fenced out, and the job runs again when it is claimed"
    )


@leases.command(name="purge", cls=CeleryCommand)
@click.option(
    "--older-than",
    "older_than",
    callback=_duration,
    required=True,
    help="Age of finished records to delete: seconds, or with a unit (90m, 12h, 7d).",
)
@_json_option
@click.pass_context
def purge_command(ctx: click.Context, older_than: float, as_json: bool) -> None:
    """Delete finished records older than --older-than (never held ones)."""
    seconds = older_than
    with _errors(ctx, ""):
        check_retention(seconds, "--older-than")  # before the store is opened
    with _store(ctx) as store:
        deleted = purge_records(store, seconds)
    if as_json:
        _emit_json({"deleted": deleted, "older_than": seconds})
    else:
        click.echo(f"deleted {deleted} records older than {seconds:g} s")


@leases.command(name="init-db", cls=CeleryCommand)
@_json_option
@click.pass_context
def init_db_command(ctx: click.Context, as_json: bool) -> None:
    """Create the SQL lease table and its index (safe to run again); a table
    of that name that is not this release's is refused, and left as it is."""
    with _store(ctx, create_table=True) as store:
        engine = getattr(store, "engine", None)
        table_name = None
        if engine is not None:
            from celery_leases.stores.sql import create_table

            table_name = create_table(engine, store.table.name).name  # type: ignore[attr-defined]
    if as_json:
        _emit_json({"store": store.url, "table": table_name})
    elif table_name is None:
        click.echo(f"nothing to do: the store {store.url} needs no schema")
    else:
        click.echo(f"lease table {table_name!r} is ready in {store.url}")


@leases.command(name="check", cls=CeleryCommand)
@_json_option
@click.pass_context
def check_command(ctx: click.Context, as_json: bool) -> None:
    """Check the store and the lease setup; exit 1 on any warning."""
    app = _app(ctx)
    url = str(app.conf.get("leases_store") or "")
    no_app = _no_app(ctx)
    report = (
        [Check("settings", "error", no_app, exit_code=EXIT_CONFIGURATION)]
        if no_app
        else run_checks(app)
    )
    secrets = secrets_of(url)
    results = [
        {"check": c.name, "status": c.status, "detail": mask(c.detail, secrets=secrets)}
        for c in report
    ]
    if as_json:
        _emit_json({"ok": all(c.status == "ok" for c in report), "checks": results})
    else:
        for row in results:
            row["status"] = row["status"].upper()
        click.echo(table(results, [("status", "STATUS"), ("check", "CHECK"), ("detail", "")]))
    statuses = {c.status for c in report}
    if "error" in statuses:
        worst = max((c.exit_code for c in report if c.status == "error"), default=EXIT_PROBLEMS)
        sys.exit(worst)
    if "warning" in statuses:
        sys.exit(EXIT_PROBLEMS)
