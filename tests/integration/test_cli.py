"""``celery leases``: the command run as a subprocess against real stores.

The app is ``tests/acceptance/app.py``, which reads its lease store from
``LEASES_TEST_*`` variables; the test writes records through the store API
and reads what the command prints and its exit status.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases import LeaseState, LeaseStore, Refusal, open_store
from celery_leases.cli import (
    EXIT_CONFIGURATION,
    EXIT_NOT_FOUND,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
)
from celery_leases.stores.base import ms_to_datetime
from celery_leases.stores.sql import create_table
from celery_leases.stores.waiters import LAST_SKIPPED, SKIPPED_KEPT
from tests.integration.test_conformance import backdate_completion, wait_for_store_clock
from tests.servers import MariadbServer, PostgresServer, RedisServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
OWNER = "host-a:4242:0123456789abcdef"


class Cli:
    """Runs ``celery -A tests.acceptance.app leases ...`` on one store."""

    def __init__(self, url: str, options: dict[str, Any], **env: str) -> None:
        self.url = url
        self.options = options
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "LEASES_TEST_STORE": url,
            "LEASES_TEST_STORE_OPTIONS": json.dumps(options),
            **env,
        }

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.acceptance.app", "leases", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env,
            cwd=REPO_ROOT,
            check=False,
        )

    def json(self, *args: str) -> Any:
        result = self(*args, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture(params=["redis", "postgres", pytest.param("mysql", marks=pytest.mark.mysql)])
def target(request: pytest.FixtureRequest, unique: str) -> Iterator[tuple[Cli, LeaseStore]]:
    """The command and a store handle on the same, fresh store."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url, options = server.url, {"prefix": f"cli{unique}:"}
    elif request.param == "mysql":
        mariadb: MariadbServer = request.getfixturevalue("mariadb_server")
        url, options = mariadb.url, {"table_name": f"cli_{unique}"}
    else:
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        url, options = pg.url, {"table_name": f"cli_{unique}"}
    store = open_store(url, **options)
    try:
        yield Cli(url, options), store
    finally:
        store.close()


def _claim(store: LeaseStore, job_id: str, ttl: float = 60.0, task: str = "t.a") -> int:
    result = store.claim(job_id, OWNER, ttl, task_name=task)
    generation: int = result.generation
    return generation


def test_ls_lists_records_with_filters_sort_and_paging(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    _claim(store, "held-1", task="t.a")
    _claim(store, "held-2", task="t.b")
    store.complete("done", OWNER, _claim(store, "done", task="t.a"))
    _claim(store, "expired", ttl=0.05, task="t.b")
    wait_for_store_clock(store, store.now_ms() + 100)

    everything = cli.json("ls")
    assert everything["total"] == 4
    assert [r["job_id"] for r in everything["records"]] == ["done", "expired", "held-1", "held-2"]
    assert cli.json("ls", "--state", "completed")["records"][0]["job_id"] == "done"
    assert [r["job_id"] for r in cli.json("ls", "--task", "t.b")["records"]] == [
        "expired",
        "held-2",
    ]
    expired = cli.json("ls", "--expired")["records"]
    assert [(r["job_id"], r["expired"], r["remaining"]) for r in expired] == [
        ("expired", True, 0.0)
    ]
    page = cli.json("ls", "--sort", "job", "--reverse", "--limit", "2", "--offset", "1")
    assert (page["total"], [r["job_id"] for r in page["records"]]) == (4, ["held-1", "expired"])


def test_ls_prints_a_table_by_default(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    _claim(store, "job-in-table", task="t.table")
    result = cli("ls")
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()[:2]
    assert header.split()[:4] == ["JOB", "STATE", "TASK", "GENERATION"]
    assert row.split()[:3] == ["job-in-table", "held", "t.table"]
    assert "host-a:4242" in row
    assert "1-1 of 1 records" in result.stdout


def test_show_prints_every_field_of_one_record(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    claimed = store.claim(
        "shown", OWNER, 60, task_name="t.show", send_id="send-9", task_id="task-9"
    )
    generation = claimed.generation
    shown = cli.json("show", "shown")
    assert shown["job_id"] == "shown"
    assert (shown["send_id"], shown["task_id"]) == ("send-9", "task-9")
    assert shown["generation"] == generation
    assert shown["owner"] == OWNER
    assert shown["state"] == "held"
    assert 0 < shown["remaining"] <= 60
    text = cli("show", "shown")
    assert text.returncode == 0
    assert re.search(rf"^generation +{generation}$", text.stdout, re.MULTILINE)
    assert "released_by" not in text.stdout  # only after a release


def test_show_prints_the_queued_mark_of_a_key(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    mark = store.mark_queued("report-7", "task-queued", 600)
    # a key whose job is queued but never ran has no record yet
    shown = cli.json("show", "report-7")
    assert shown["job_id"] == "report-7"
    assert "state" not in shown
    assert shown["queued_task_id"] == "task-queued"
    assert shown["queued_until"] == ms_to_datetime(mark.queued_until_ms).isoformat()
    assert 0 < shown["queued_remaining"] <= 600
    # a key with a record and a job queued behind it shows both
    _claim(store, "report-7")
    text = cli("show", "report-7")
    assert text.returncode == 0, text.stderr
    assert re.search(r"^state +held$", text.stdout, re.MULTILINE)
    assert re.search(r"^queued_task_id +task-queued$", text.stdout, re.MULTILINE)
    store.unmark_queued("report-7", "task-queued")
    assert "queued_task_id" not in cli.json("show", "report-7")


def test_show_lists_the_copies_waiting_for_the_holder(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    _claim(store, "report-8")
    assert cli.json("show", "report-8")["waiters"] == []
    store.add_waiter("report-8", "send-1", "task-waiting", b"a message", 600)
    shown = cli.json("show", "report-8")
    [waiter] = shown["waiters"]
    assert (waiter["task_id"], waiter["send_id"]) == ("task-waiting", "send-1")
    [kept] = store.waiters("report-8")
    assert waiter["waiting_since"] == ms_to_datetime(kept.waiting_since_ms).isoformat()
    assert waiter["waiting_until"] == ms_to_datetime(kept.waiting_until_ms).isoformat()
    assert 0 < waiter["waiting_remaining"] <= 600
    assert "payload" not in waiter  # a whole message: left out
    text = cli("show", "report-8")
    assert text.returncode == 0, text.stderr
    assert re.search(r"^state +held$", text.stdout, re.MULTILINE)
    assert re.search(r"^waiters +1$", text.stdout, re.MULTILINE)
    assert re.search(
        r"^  task-waiting  since \S+  runs out in [\d.]+ s$", text.stdout, re.MULTILINE
    )
    store.take_waiters("report-8")
    assert re.search(r"^waiters +0$", cli("show", "report-8").stdout, re.MULTILINE)


def test_show_names_the_last_skipped_call(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    _claim(store, "report-9")
    assert "skipped_task_id" not in cli.json("show", "report-9")
    for task_id in ("task-skipped-1", "task-skipped-2"):  # each skip replaces the last
        store.add_waiter("report-9", LAST_SKIPPED, task_id, b"", SKIPPED_KEPT)
    shown = cli.json("show", "report-9")
    [kept] = store.waiters("report-9")
    assert shown["skipped_task_id"] == "task-skipped-2"
    assert shown["skipped_at"] == ms_to_datetime(kept.waiting_since_ms).isoformat()
    assert shown["waiters"] == []  # a skipped call waits for nothing
    text = cli("show", "report-9")
    assert re.search(r"^skipped_task_id +task-skipped-2$", text.stdout, re.MULTILINE)
    # a record purged since: the skipped call is still shown
    store.add_waiter("report-10", LAST_SKIPPED, "task-skipped-3", b"", SKIPPED_KEPT)
    alone = cli.json("show", "report-10")
    assert (alone["job_id"], alone["skipped_task_id"]) == ("report-10", "task-skipped-3")
    assert "state" not in alone


def test_show_of_an_unknown_job_exits_3(target: tuple[Cli, LeaseStore]) -> None:
    cli, _ = target
    result = cli("show", "no-such-job")
    assert result.returncode == EXIT_NOT_FOUND
    assert "no lease record for job 'no-such-job'" in result.stderr


def test_purge_deletes_old_finished_records_only(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    old = _claim(store, "old")
    store.complete("old", OWNER, old)
    store.complete("young", OWNER, _claim(store, "young"))
    _claim(store, "held")
    backdate_completion(store, "old", seconds=3 * 3600)
    wait_for_store_clock(store, old)

    assert cli.json("purge", "--older-than", "2h") == {"deleted": 1, "older_than": 7200.0}
    assert store.get("old") is None
    assert sorted(r.job_id for r in store.records()) == ["held", "young"]
    again = cli("purge", "--older-than", "2h")
    assert again.stdout.strip() == "deleted 0 records older than 7200 s"


def test_purge_below_the_retention_minimum_is_a_configuration_error(
    target: tuple[Cli, LeaseStore],
) -> None:
    cli, _ = target
    result = cli("purge", "--older-than", "5s")
    assert result.returncode == EXIT_CONFIGURATION
    assert "at least 60 seconds" in result.stderr


def test_purge_refuses_a_malformed_duration() -> None:
    result = Cli("memory://", {})("purge", "--older-than", "soon")
    assert result.returncode == 2
    assert "Invalid value for '--older-than': 'soon' is not a duration" in result.stderr


def test_purge_below_the_minimum_names_the_option_as_typed() -> None:
    result = Cli("memory://", {})("purge", "--older-than", "30")
    assert result.returncode == EXIT_CONFIGURATION
    assert result.stderr.startswith("Error: --older-than must be at least 60 seconds, got 30")
    assert "older_than" not in result.stderr


def test_every_command_takes_json_and_a_job_id_is_an_argument() -> None:
    cli = Cli("memory://", {})
    commands = ["ls", "show", "release", "purge", "init-db", "check"]
    for command in commands:
        helped = cli(command, "--help")
        assert helped.returncode == 0, (command, helped.stderr)
        assert "--json  " in helped.stdout.split("Options:")[1], command
    assert json.loads(cli("init-db", "--json").stdout) == {"store": "memory://", "table": None}
    for command in ("show", "release"):
        helped = cli(command, "--help").stdout
        arguments, options = helped.split("Arguments:")[1].split("Options:")
        assert "JOB_ID  The job id" in arguments, helped
        assert "JOB_ID" not in options, helped


def test_check_of_a_redis_database_number_the_server_lacks_says_so(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/99"
    result = Cli(url, {})("check", "--json")
    assert result.returncode == EXIT_CONFIGURATION, result.stdout + result.stderr
    report = json.loads(result.stdout)
    (store,) = [c for c in report["checks"] if c["check"] == "store"]
    assert store["status"] == "error"
    assert (
        "the database number in the store URL is out of range for the server" in (store["detail"])
    )
    for misleading in ("init-db", "password"):
        assert misleading not in store["detail"], store["detail"]


def test_release_needs_force(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    _claim(store, "kept")
    result = cli("release", "kept", "--reason", "stuck")
    assert result.returncode == 2
    assert "pass --force" in result.stderr
    record = store.get("kept")
    assert record is not None
    assert record.owner == OWNER


def test_forced_release_fences_out_the_holder_and_keeps_who_and_why(
    target: tuple[Cli, LeaseStore],
) -> None:
    cli, store = target
    generation = _claim(store, "stuck")
    released = cli.json("release", "stuck", "--force", "--reason", "host lost", "--by", "ops")
    assert released["state"] == "released"
    assert released["generation"] == generation + 1
    assert (released["released_by"], released["release_reason"]) == ("ops", "host lost")
    # the old holder is fenced out; a new claim takes a newer generation
    assert isinstance(store.complete("stuck", OWNER, generation), Refusal)
    record = store.get("stuck")
    assert record is not None
    assert record.released_at_ms is not None
    shown = cli("show", "stuck").stdout
    assert re.search(r"^released_by +ops$", shown, re.MULTILINE)
    assert _claim(store, "stuck") > generation + 1


def test_release_of_an_unknown_job_exits_3(target: tuple[Cli, LeaseStore]) -> None:
    cli, _ = target
    result = cli("release", "nobody", "--force", "--reason", "x")
    assert result.returncode == EXIT_NOT_FOUND, result.stderr
    assert "no lease record for job 'nobody'" in result.stderr


def test_release_of_a_completed_job_is_refused(target: tuple[Cli, LeaseStore]) -> None:
    cli, store = target
    generation = _claim(store, "finished")
    store.complete("finished", OWNER, generation)
    result = cli("release", "finished", "--force", "--reason", "x")
    assert result.returncode == EXIT_REFUSED, result.stderr
    assert "is completed" in result.stderr
    record = store.get("finished")
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, generation)


@pytest.fixture(params=["postgres", pytest.param("mysql", marks=pytest.mark.mysql)])
def sql_server(request: pytest.FixtureRequest) -> PostgresServer | MariadbServer:
    name = "postgres_server" if request.param == "postgres" else "mariadb_server"
    server: PostgresServer | MariadbServer = request.getfixturevalue(name)
    return server


def test_init_db_creates_the_sql_table(
    sql_server: PostgresServer | MariadbServer, unique: str
) -> None:
    options = {"table_name": f"init_{unique}", "create_table": False}
    cli = Cli(sql_server.url, options)
    before = cli("ls")
    # no table yet, and ls does not make one
    assert before.returncode == EXIT_CONFIGURATION, before.stderr
    assert f"init_{unique}" in before.stderr
    assert "celery leases init-db" in before.stderr
    result = cli("init-db")
    assert result.returncode == 0, result.stderr
    assert f"lease table 'init_{unique}' is ready" in result.stdout
    assert cli.json("init-db")["table"] == f"init_{unique}"
    # and the table of lease_queue_unique's marks beside it
    engine = sa.create_engine(sql_server.url)
    try:
        assert sa.inspect(engine).has_table(f"init_{unique}_queued")
    finally:
        engine.dispose()
    assert cli("init-db").returncode == 0  # again: nothing to do
    assert cli.json("ls")["total"] == 0
    assert cli("ls").stdout == "no lease records\n"


def test_init_db_refuses_a_table_that_is_not_this_releases_and_leaves_it(
    sql_server: PostgresServer | MariadbServer, unique: str
) -> None:
    table_name = f"init_{unique}"
    engine = sa.create_engine(sql_server.url)
    try:
        create_table(engine, table_name)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {table_name} DROP COLUMN task_id")
        cli = Cli(sql_server.url, {"table_name": table_name, "create_table": False})
        for command in ("ls", "init-db"):
            refused = cli(command)
            assert refused.returncode == EXIT_CONFIGURATION, (command, refused.stderr)
            assert f"the table {table_name!r}" in refused.stderr, command
            assert "is not this release's lease table: it lacks the column task_id" in (
                refused.stderr
            )
            assert "DROP TABLE" in refused.stderr
        inspector = sa.inspect(engine)
        assert "task_id" not in {c["name"] for c in inspector.get_columns(table_name)}
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table_name}")
        assert cli("init-db").returncode == 0  # what the message says to do
        assert cli("ls").stdout == "no lease records\n"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table_name}")
        engine.dispose()


def test_an_unreachable_store_exits_4_and_never_shows_the_password() -> None:
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"
    cli = Cli(url, {})
    for args in (("ls",), ("show", "x"), ("check",)):
        result = cli(*args)
        assert result.returncode == EXIT_UNAVAILABLE, (args, result.stderr)
        assert "s3cret-pw" not in result.stdout + result.stderr
        assert "***" in result.stdout + result.stderr


def test_a_bad_store_url_exits_5_without_its_password() -> None:
    cli = Cli("bogus://user:s3cret-pw@host/0", {})
    result = cli("ls")
    assert result.returncode == EXIT_CONFIGURATION
    assert "unknown lease store scheme" in result.stderr
    assert "s3cret-pw" not in result.stderr


def _checks(result: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
    report = json.loads(result.stdout)
    assert report["ok"] is (result.returncode == 0)
    return [(c["check"], c["status"]) for c in report["checks"]]


def test_check_of_a_sound_setup_exits_0(target: tuple[Cli, LeaseStore]) -> None:
    cli, _ = target
    result = cli("check", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _checks(result) == [
        ("settings", "ok"),
        ("store", "ok"),
        ("clock", "ok"),
        ("tasks", "ok"),
    ]


def test_check_reports_a_redis_server_that_can_lose_records() -> None:
    server = RedisServer("--appendonly", "no", "--maxmemory-policy", "allkeys-lru")
    try:
        result = Cli(server.url, {})("check", "--json")
    finally:
        server.close()
    assert result.returncode == 1
    checks = json.loads(result.stdout)["checks"]
    warned = " ".join(c["detail"] for c in checks if c["status"] == "warning")
    assert "maxmemory-policy 'allkeys-lru'" in warned
    assert "appendonly 'no'" in warned


def test_check_reports_a_visibility_timeout_below_the_ttl(
    target: tuple[Cli, LeaseStore],
) -> None:
    cli, _ = target
    cli.env["LEASES_TEST_VISIBILITY_TIMEOUT"] = "1"
    result = cli("check")
    assert result.returncode == 1
    assert "WARNING  tasks" in result.stdout
    assert "visibility_timeout (1 s) is shorter than the lease ttl" in result.stdout


def test_check_of_invalid_settings_exits_5() -> None:
    result = Cli("memory://", {}, LEASES_TEST_TTL="-1")("check", "--json")
    assert result.returncode == EXIT_CONFIGURATION
    assert _checks(result) == [("settings", "error")]


def test_check_of_a_database_without_the_table_exits_5_and_makes_none(
    postgres_server: PostgresServer, unique: str
) -> None:
    table = f"chk_{unique}"
    cli = Cli(postgres_server.url, {"table_name": table})
    result = cli("check", "--json")
    assert result.returncode == EXIT_CONFIGURATION, result.stdout + result.stderr
    assert ("store", "error") in _checks(result)
    assert "celery leases init-db" in result.stdout
    assert cli("ls").returncode == EXIT_CONFIGURATION  # still no table
