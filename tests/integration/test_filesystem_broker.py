"""``celery_leases.filesystem``: the filesystem broker hands out whole messages only.

kombu's own transport writes a message file in place, and a consumer
polling at that moment takes it half written and loses it (about one in a
hundred of the messages below). A real publisher process sends while the
test's consumer polls without pause; every message must arrive, once.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from kombu.transport import filesystem as kombu_filesystem

from celery_leases import LeaseConfigurationError, LeasedTask
from celery_leases import filesystem as whole_files
from celery_leases.task import forget_runtime
from celery_leases.worker import check_app
from tests.acceptance.harness import REPO_ROOT

MESSAGES = 2000
TRANSPORT = "celery_leases.filesystem:Transport"


def _options(folder: Path) -> dict[str, Any]:
    (folder / "messages").mkdir(parents=True, exist_ok=True)
    (folder / "processed").mkdir(exist_ok=True)
    (folder / "control").mkdir(exist_ok=True)
    return {
        "control_folder": str(folder / "control"),
        "data_folder_in": str(folder / "messages"),
        "data_folder_out": str(folder / "messages"),
        "store_processed": True,
        "processed_folder": str(folder / "processed"),
    }


def _queue(options: dict[str, Any]) -> str:
    """The test's own queue: kombu keeps the queues declared in a process, and
    a queue declared on another test's folders would not be bound on this one's."""
    return "q-" + Path(options["data_folder_in"]).parent.name


def _queue_process(
    options: dict[str, Any], body: str, *, setup: str = "", transport: str | None = TRANSPORT
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a process that runs ``setup``, then
    ``body`` with ``queue`` on the test's queue over ``transport`` (None: kombu's own)."""
    code = (
        f"{setup}from kombu import Connection\n"
        f"with Connection('filesystem://', transport={transport!r},"
        f" transport_options={options!r}) as connection:\n"
        f"    queue = connection.SimpleQueue({_queue(options)!r})\n" + textwrap.indent(body, "    ")
    )
    return [sys.executable, "-c", code], {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _publisher(options: dict[str, Any], transport: str | None) -> subprocess.Popen[bytes]:
    """A process that puts :data:`MESSAGES` numbered messages on the test's queue."""
    body = f"for number in range({MESSAGES}):\n    queue.put({{'number': number}})\n"
    args, env = _queue_process(options, body, transport=transport)
    return subprocess.Popen(args, env=env)


def _run_with_queue(options: dict[str, Any], setup: str, body: str, timeout: float) -> str:
    """Run ``setup``, then ``body`` with ``queue`` on the test's queue (this
    transport), in a process of its own; its output."""
    args, env = _queue_process(options, body, setup=setup)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _consume_all(
    options: dict[str, Any], publisher: subprocess.Popen[bytes], transport: str | None = TRANSPORT
) -> tuple[list[int], int]:
    """Every number taken from the test's queue with ``transport``, polling without pause,
    and how many taken messages did not decode."""
    numbers: list[int] = []
    undecodable = 0
    deadline = time.monotonic() + 120
    with Connection(
        "filesystem://", transport=transport, transport_options={**options, "polling_interval": 0}
    ) as connection:
        queue = connection.SimpleQueue(_queue(options))
        while len(numbers) < MESSAGES and time.monotonic() < deadline:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                if publisher.poll() is not None and not _waiting(options):
                    break
                continue
            except ValueError:  # kombu's own consumer took a file not yet written
                undecodable += 1
                continue
            numbers.append(message.payload["number"])
            message.ack()
    publisher.wait(timeout=60)
    assert publisher.returncode == 0
    return numbers, undecodable


def _waiting(options: dict[str, Any]) -> list[str]:
    return [n for n in os.listdir(options["data_folder_in"]) if n.endswith(".msg")]


@pytest.mark.parametrize("publisher_transport", [None, TRANSPORT], ids=["kombu", "whole-files"])
def test_every_message_published_while_a_consumer_polls_arrives_once(
    tmp_path: Path, publisher_transport: str | None
) -> None:
    # kombu's own publisher writes in place: the consumer must read its files
    # whole; this transport's publisher renames whole files in
    options = _options(tmp_path)
    numbers, undecodable = _consume_all(options, _publisher(options, publisher_transport))
    assert undecodable == 0
    assert sorted(numbers) == list(range(MESSAGES))
    assert not list((tmp_path / "processed").glob("*.bad"))


def test_two_consumers_polling_one_folder_never_both_take_a_message(tmp_path: Path) -> None:
    # the rename into the processed folder decides who has a message: each
    # arrives once in all, neither lost nor handed to both
    options = _options(tmp_path)
    publisher = _publisher(options, TRANSPORT)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        takes = [pool.submit(_consume_all, options, publisher) for _ in range(2)]
        (first, first_bad), (second, second_bad) = (take.result(timeout=180) for take in takes)
    assert first_bad == second_bad == 0
    assert first  # both took a share
    assert second
    assert sorted(first + second) == list(range(MESSAGES))


def test_a_consumer_of_kombu_s_own_transport_takes_only_whole_files(tmp_path: Path) -> None:
    # this transport's files are whole before they carry a queue's name:
    # even kombu's own consumer, which reads whatever it takes, loses none
    options = _options(tmp_path)
    numbers, undecodable = _consume_all(options, _publisher(options, TRANSPORT), transport=None)
    assert undecodable == 0
    assert sorted(numbers) == list(range(MESSAGES))


def test_a_file_being_written_in_place_is_read_once_its_writer_is_done(tmp_path: Path) -> None:
    options = _options(tmp_path)
    name = f"{round(time.monotonic() * 1000)}_written-late.{_queue(options)}.msg"
    path = tmp_path / "messages" / name
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        body = Connection("filesystem://", transport_options=options)
        with body:
            # a real message's payload, as kombu's own publisher writes it
            body.SimpleQueue(_queue(options)).put({"number": 7})
        [written] = _waiting(options)
        payload = (tmp_path / "messages" / written).read_bytes()
        os.remove(tmp_path / "messages" / written)
        # a writer that opened the file and writes it a moment later
        writer = subprocess.Popen(
            [
                sys.executable, "-c",
                f"import time\nf = open({str(path)!r}, 'wb')\ntime.sleep(0.3)\n"
                f"f.write({payload!r})\nf.close()\n",
            ]
        )  # fmt: skip
        while not path.exists():
            time.sleep(0.01)
        message = queue.get(timeout=5)
        writer.wait(timeout=10)
        assert message.payload == {"number": 7}


def test_a_file_that_never_decodes_is_set_aside_and_the_next_message_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(whole_files, "READ_PATIENCE", 0.2)
    options = _options(tmp_path)
    broken = f"{round(time.monotonic() * 1000) - 1000}_broken.{_queue(options)}.msg"
    (tmp_path / "messages" / broken).write_bytes(b'{"body": "cut')
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        queue.put({"number": 1})
        message = queue.get(timeout=5)
        assert message.payload == {"number": 1}
    assert (tmp_path / "processed" / f"{broken}.bad").read_bytes() == b'{"body": "cut'


@pytest.fixture
def filesystem_app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("fs", broker="filesystem://", set_as_current=False)
    app.conf.leases_store = "memory://"
    app.conf.broker_transport_options = _options(tmp_path)

    @app.task(shared=False, base=LeasedTask, name="job")
    def job() -> None:
        pass

    app.finalize()
    yield app
    forget_runtime(app)
    app.close()


def _filesystem_warnings(app: Celery) -> list[str]:
    return [w for w in check_app(app, pool="solo") if "filesystem://" in w]


def test_the_start_check_warns_of_kombu_s_own_filesystem_transport(
    filesystem_app: Celery,
) -> None:
    [warning] = _filesystem_warnings(filesystem_app)
    assert f"broker_transport = {TRANSPORT!r}" in warning


@pytest.mark.parametrize("transport", [TRANSPORT, whole_files.Transport], ids=["name", "class"])
def test_the_start_check_is_quiet_with_the_whole_files_transport(
    filesystem_app: Celery, transport: object
) -> None:
    filesystem_app.conf.broker_transport = transport
    assert _filesystem_warnings(filesystem_app) == []
    with filesystem_app.connection_for_write() as connection:
        # Celery hands the setting to kombu: the worker's connection uses it
        assert isinstance(connection.transport, whole_files.Transport)
        assert isinstance(connection.default_channel, whole_files.Channel)
    assert issubclass(whole_files.Transport, kombu_filesystem.Transport)


def _visibility_warnings(app: Celery, timeout: object) -> list[str]:
    """The start check's warnings about the visibility timeout, with this
    transport's ``visibility_timeout`` option at ``timeout`` and a 30 s lease."""
    app.conf.broker_transport = TRANSPORT
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "visibility_timeout": timeout,
    }
    app.conf.leases_ttl = 30
    return [w for w in check_app(app, pool="solo") if "visibility" in w]


def test_the_start_check_warns_of_a_visibility_timeout_below_the_lease_ttl(
    filesystem_app: Celery,
) -> None:
    [warning] = _visibility_warnings(filesystem_app, 10)
    assert "visibility_timeout (10 s) is shorter than the lease ttl" in warning
    forget_runtime(filesystem_app)
    assert _visibility_warnings(filesystem_app, 3600) == []
    forget_runtime(filesystem_app)
    assert _visibility_warnings(filesystem_app, None) == []


def test_keep_invisible_does_not_silence_the_filesystem_visibility_check(
    filesystem_app: Celery,
) -> None:
    # renewals push no message's visibility forward on this broker: the
    # setting has no effect, and the start check says both
    filesystem_app.conf.leases_broker_keep_invisible = True
    no_effect, too_short = sorted(_visibility_warnings(filesystem_app, 10))
    assert "leases_broker_keep_invisible is set but the broker is neither" in no_effect
    assert "visibility_timeout (10 s) is shorter than the lease ttl" in too_short


def test_the_start_check_refuses_a_visibility_timeout_that_is_not_a_number(
    filesystem_app: Celery,
) -> None:
    with pytest.raises(LeaseConfigurationError, match="visibility_timeout"):
        _visibility_warnings(filesystem_app, "an hour")


def test_a_writer_stopped_while_holding_its_file_stops_no_consumer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kombu's own publisher, SIGSTOPped between its lock and its write: the
    # consumer puts the file back and hands out the next message; the file
    # arrives once its writer goes on
    monkeypatch.setattr(whole_files, "READ_PATIENCE", 0.3)
    options = _options(tmp_path)
    queue_name = _queue(options)
    path = (
        tmp_path / "messages" / f"{round(time.monotonic() * 1000) - 1000}_stopped.{queue_name}.msg"
    )
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(queue_name)
        queue.put({"number": 2})
        [later] = _waiting(options)
        payload = (tmp_path / "messages" / later).read_bytes()
        os.remove(tmp_path / "messages" / later)  # the stopped writer will write it
        queue.put({"number": 1})
        writer = subprocess.Popen(
            [
                sys.executable, "-c",
                "import fcntl, os, signal\n"
                f"f = open({str(path)!r}, 'wb')\n"
                "fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
                "os.kill(os.getpid(), signal.SIGSTOP)\n"
                f"f.write({payload!r})\nf.close()\n",
            ]
        )  # fmt: skip
        try:
            # returns once the writer has stopped itself, holding its lock
            _, status = os.waitpid(writer.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
            started = time.monotonic()
            first = queue.get(timeout=5)
            assert first.payload == {"number": 1}
            assert time.monotonic() - started < 3
            assert path.exists()  # put back, whole or not
        finally:
            writer.send_signal(signal.SIGCONT)
            writer.wait(timeout=10)
        second = queue.get(timeout=5)
        assert second.payload == {"number": 2}


def test_a_publish_whose_write_fails_leaves_no_hidden_file(tmp_path: Path) -> None:
    # a real process whose files may not grow past 2,000 bytes (a full disk,
    # as the write sees it): the big message is refused with kombu's
    # ChannelError and its hidden file removed; the next message goes through
    options = _options(tmp_path)
    setup = (
        "import resource, signal\n"
        "from kombu.exceptions import ChannelError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))\n"
    )
    body = (
        "try:\n"
        "    queue.put({'number': 0, 'padding': 'x' * 10000})\n"
        "except ChannelError as exc:\n"
        "    print('refused:', exc)\n"
        "queue.put({'number': 1})\n"
    )
    assert "refused: Cannot add file" in _run_with_queue(options, setup, body, timeout=60)
    assert sorted(os.listdir(options["data_folder_out"])) == _waiting(options)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        message = connection.SimpleQueue(_queue(options)).get(timeout=5)
        assert message.payload == {"number": 1}
        message.ack()


def test_a_hidden_file_left_by_a_dead_publisher_is_removed_once_stale(tmp_path: Path) -> None:
    # a publisher killed while writing leaves its hidden file (its publish
    # never returned); the next channel opened on the folder removes it once
    # it is STALE_PART_AGE old, and leaves one still being written alone
    options = _options(tmp_path)
    folder = Path(options["data_folder_out"])
    stale = folder / f".1_dead.{_queue(options)}.msg.part"
    fresh = folder / f".2_writing.{_queue(options)}.msg.part"
    for path in (stale, fresh):
        path.write_bytes(b'{"body": ')
    old = time.time() - whole_files.STALE_PART_AGE - 60
    os.utime(stale, (old, old))
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        connection.SimpleQueue(_queue(options)).put({"number": 1})
    assert not stale.exists()
    assert fresh.exists()
    assert len(_waiting(options)) == 1


def test_stale_is_judged_by_the_folder_s_clock_not_this_host_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a host whose clock runs two hours ahead of the one that stamps the
    # folder's files (a file server's, on a shared folder) must not take a
    # hidden file still being written for a dead publisher's
    options = _options(tmp_path)
    folder = Path(options["data_folder_out"])
    fresh = folder / f".2_writing.{_queue(options)}.msg.part"
    fresh.write_bytes(b'{"body": ')
    left = folder / ".x1y2z3.clock"  # a channel died while reading the clock
    left.write_bytes(b"")
    old = time.time() - whole_files.STALE_PART_AGE - 60
    os.utime(left, (old, old))
    host_time = time.time
    monkeypatch.setattr(time, "time", lambda: host_time() + 2 * whole_files.STALE_PART_AGE)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        connection.SimpleQueue(_queue(options)).put({"number": 1})
    monkeypatch.undo()
    assert fresh.exists()
    assert not left.exists()
    assert [n for n in os.listdir(folder) if n.endswith(".clock")] == []
    assert len(_waiting(options)) == 1


def test_a_payload_that_does_not_encode_leaves_no_file(tmp_path: Path) -> None:
    options = _options(tmp_path)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        with pytest.raises(TypeError):
            queue.put({"number": 1}, headers={"not json": object()})
    assert os.listdir(options["data_folder_out"]) == []


def test_an_interrupt_during_the_write_leaves_no_hidden_file(tmp_path: Path) -> None:
    # a real SIGALRM whose handler raises lands in the write of a large
    # message (a gevent Timeout or a KeyboardInterrupt does the same)
    options = _options(tmp_path)
    setup = (
        "import signal, time\n"
        "from kombu.utils import json as kombu_json\n"
        "class Interrupted(BaseException): pass\n"
        "def interrupt(*_): raise Interrupted()\n"
        "signal.signal(signal.SIGALRM, interrupt)\n"
    )
    body = (
        "big = 'x' * 8_000_000\n"
        "started = time.perf_counter()\n"
        "kombu_json.dumps({'body': big})\n"
        "encoded = time.perf_counter() - started\n"
        "interrupted = 0\n"
        "for attempt in range(40):  # from the end of the encoding on, into the write\n"
        "    signal.setitimer(signal.ITIMER_REAL, encoded * (1 + attempt / 10))\n"
        "    try:\n"
        "        queue.put({'padding': big})\n"
        "    except Interrupted:\n"
        "        interrupted += 1\n"
        "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "print('interrupted', interrupted)\n"
    )
    output = _run_with_queue(options, setup, body, timeout=120)
    assert int(output.split()[-1]) > 0, "no put was interrupted"
    assert [n for n in os.listdir(options["data_folder_out"]) if n.endswith(".part")] == []


# --- unacknowledged messages: kept in the consumer's in-flight folder ------------


def _in_flight(options: dict[str, Any]) -> list[str]:
    """Every message file in an in-flight folder, as ``<folder>/<name>``."""
    root = Path(options["data_folder_in"]) / whole_files.IN_FLIGHT_FOLDER
    if not root.exists():
        return []
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob("*/*.msg"))


#: a child that outlives its parent and keeps none of its pipes open
_FORK = (
    "import os, time\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os.closerange(0, 3)\n"
    "    time.sleep(600)\n"
    "    os._exit(0)\n"
)


def _holder(options: dict[str, Any], *, fork: bool = False) -> subprocess.Popen[str]:
    """A consumer process that takes one message, says so (with the pid of a
    forked child, if ``fork``), then acknowledges it when told on its stdin."""
    body = (
        "message = queue.get(timeout=30)\n"
        + (_FORK if fork else "child = 0\n")
        + "print('taken', message.payload['number'], child, flush=True)\n"
        "import sys\n"
        "if sys.stdin.readline().strip() == 'ack':\n"
        "    message.ack()\n"
        "    print('acked', flush=True)\n"
    )  # fmt: skip
    args, env = _queue_process(options, body)
    return subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _end(holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.communicate(timeout=30)  # and close its pipes


def _taken(holder: subprocess.Popen[str]) -> tuple[int, int]:
    """Wait for ``holder`` to take its message: the number and the child's pid."""
    assert holder.stdout is not None
    line = holder.stdout.readline()
    assert line.startswith("taken"), f"the holder exited: {holder.wait(timeout=30)}"
    _, number, child = line.split()
    return int(number), int(child)


def _publish(options: dict[str, Any], *numbers: int) -> list[str]:
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        for number in numbers:
            queue.put({"number": number})
    return sorted(_waiting(options))  # the order consumers take them in


def test_the_message_of_a_consumer_killed_before_its_ack_comes_back(tmp_path: Path) -> None:
    # a consumer takes a message and is SIGKILLed before it acknowledges: the
    # lock on its in-flight folder dies with it, and the next channel opened
    # on the folder puts the message back under its own name
    options = _options(tmp_path)
    [name] = _publish(options, 1)
    holder = _holder(options)
    try:
        assert _taken(holder) == (1, 0)
        [held] = _in_flight(options)
        assert held.endswith(f"/{name}")
        assert _waiting(options) == []
    finally:
        _end(holder)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        connection.default_channel  # noqa: B018 - opening a channel sweeps the folder
        assert _waiting(options) == [name]
        message = connection.SimpleQueue(_queue(options)).get(timeout=5)
        assert message.payload == {"number": 1}
        message.ack()
    assert _in_flight(options) == []
    assert os.listdir(tmp_path / "messages" / whole_files.IN_FLIGHT_FOLDER) == []
    assert os.listdir(tmp_path / "processed") == [name]


def test_a_living_consumer_keeps_its_message_until_it_acknowledges(tmp_path: Path) -> None:
    # another consumer sweeps the folder while the holder lives: the message
    # stays in the holder's in-flight folder, and its ack files it away
    options = _options(tmp_path)
    [name] = _publish(options, 1)
    holder = _holder(options)
    try:
        _taken(holder)
        with Connection(
            "filesystem://", transport=TRANSPORT, transport_options=options
        ) as connection:
            queue = connection.SimpleQueue(_queue(options))  # its channel swept at opening
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.2)
            assert [held.split("/")[1] for held in _in_flight(options)] == [name]
            assert holder.stdin is not None
            assert holder.stdout is not None
            holder.stdin.write("ack\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "acked"
            assert holder.wait(timeout=30) == 0
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.2)
    finally:
        _end(holder)
    assert os.listdir(tmp_path / "processed") == [name]
    assert _waiting(options) == _in_flight(options) == []


def test_a_consumer_that_closes_puts_back_what_it_did_not_acknowledge(tmp_path: Path) -> None:
    # a clean exit (Celery's warm shutdown closes its connection): the
    # prefetched message goes back whole, under its own name, not as a copy
    options = _options(tmp_path)
    names = _publish(options, 1, 2)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        first = queue.get(timeout=5)
        queue.get(timeout=5)  # taken, never acknowledged
        first.ack()
    assert sorted(_waiting(options)) == names[1:]
    assert os.listdir(tmp_path / "processed") == names[:1]
    assert os.listdir(tmp_path / "messages" / whole_files.IN_FLIGHT_FOLDER) == []


def test_a_rejected_message_is_requeued_or_dropped_as_asked(tmp_path: Path) -> None:
    options = _options(tmp_path)
    names = _publish(options, 1, 2)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        first = queue.get(timeout=5)
        first.requeue()
        assert sorted(_waiting(options)) == names  # the same file, back in its place
        again = queue.get(timeout=5)
        assert again.payload == first.payload
        again.reject()
        second = queue.get(timeout=5)
        assert second.payload != first.payload
        second.ack()
    # the rejected one is not put back when the connection closes
    assert _waiting(options) == _in_flight(options) == []


def test_messages_taken_without_acknowledgement_are_done_at_once(tmp_path: Path) -> None:
    options = _options(tmp_path)
    _publish(options, 1, 2)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options), no_ack=True)
        first = queue.get(timeout=5)
        got = connection.default_channel.basic_get(_queue(options), no_ack=True)
        assert got is not None
        assert {first.payload["number"], got.payload["number"]} == {1, 2}
        assert _in_flight(options) == []
    assert _waiting(options) == []
    assert len(os.listdir(tmp_path / "processed")) == 2


def test_a_message_held_past_the_visibility_timeout_goes_to_another_consumer(
    tmp_path: Path,
) -> None:
    # a consumer that lives but does not acknowledge (stuck): as on Redis and
    # SQS, its message goes back once the visibility timeout passed; its late
    # acknowledgements, and one acknowledgement twice, do nothing
    options = {**_options(tmp_path), "visibility_timeout": 1}
    [name] = _publish(options, 1)
    with (
        Connection("filesystem://", transport=TRANSPORT, transport_options=options) as stuck,
        Connection("filesystem://", transport=TRANSPORT, transport_options=options) as other,
    ):
        held = stuck.SimpleQueue(_queue(options)).get(timeout=5)
        started = time.monotonic()
        again = other.SimpleQueue(_queue(options)).get(timeout=60)
        assert time.monotonic() - started >= 0.9
        assert again.payload == {"number": 1}
        held.ack()  # late: the file is the other consumer's now
        stuck.default_channel.basic_ack(held.delivery_tag)  # twice
        assert [h.split("/")[1] for h in _in_flight(options)] == [name]
        again.ack()
    assert os.listdir(tmp_path / "processed") == [name]
    assert _waiting(options) == _in_flight(options) == []


def _after_each_take(
    monkeypatch: pytest.MonkeyPatch, step: Callable[[str, str], None], *, times: int
) -> list[str]:
    """Run ``step(path, queue_folder)`` right after the first ``times`` renames
    of a message file into an in-flight folder (a take): what another process
    does while the consumer is paused there. The paths it ran on."""
    rename = os.rename
    seen: list[str] = []

    def renamed(source: Any, target: Any) -> None:
        rename(source, target)
        path = str(target)
        folder = os.path.dirname(path)
        if (
            len(seen) < times
            and path.endswith(".msg")
            and os.path.basename(os.path.dirname(folder)) == whole_files.IN_FLIGHT_FOLDER
        ):
            seen.append(path)
            step(path, os.path.dirname(os.path.dirname(folder)))

    monkeypatch.setattr(os, "rename", renamed)
    return seen


def test_a_message_that_waited_past_the_visibility_timeout_is_not_put_back_as_it_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a backlog older than the visibility timeout (the workers were down):
    # a sweep in the moment right after a take must judge the message by
    # when it was taken, not by when it was published, or it puts it back
    # under the consumer that is reading it
    options = {**_options(tmp_path), "visibility_timeout": 60}
    [name] = _publish(options, 1)
    old = time.time() - 3600
    os.utime(Path(options["data_folder_in"]) / name, (old, old))

    waiting_after_sweep: list[list[str]] = []

    def sweep(path: str, queue_folder: str) -> None:
        with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as other:
            other.default_channel  # noqa: B018 - opening a channel sweeps the folder
        waiting_after_sweep.append(_waiting(options))

    swept = _after_each_take(monkeypatch, sweep, times=1)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        message = connection.SimpleQueue(_queue(options)).get(timeout=5)
        assert [os.path.basename(path) for path in swept] == [name]
        assert waiting_after_sweep == [[]]  # the sweep left it with its consumer
        assert message.payload == {"number": 1}
        assert [held.split("/")[1] for held in _in_flight(options)] == [name]
        assert _waiting(options) == []
        message.ack()
    assert os.listdir(tmp_path / "processed") == [name]


def test_a_message_put_back_before_its_consumer_read_it_is_skipped_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a consumer paused (SIGSTOP, a suspended VM) between its take and its
    # read for longer than the visibility timeout finds the file gone: put
    # back by another's sweep. It goes on polling (an error here would stop
    # the worker's consumer) and takes the message when it comes round.
    options = _options(tmp_path)
    [name] = _publish(options, 1)

    def put_back(path: str, queue_folder: str) -> None:
        os.rename(path, os.path.join(queue_folder, os.path.basename(path)))

    taken = _after_each_take(monkeypatch, put_back, times=1)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        message = connection.SimpleQueue(_queue(options)).get(timeout=10)
        assert [os.path.basename(path) for path in taken] == [name]
        assert message.payload == {"number": 1}
        message.ack()
    assert os.listdir(tmp_path / "processed") == [name]
    assert _waiting(options) == _in_flight(options) == []


def test_an_in_flight_folder_that_cannot_be_made_is_a_connection_error(tmp_path: Path) -> None:
    # nothing can be made where the in-flight folders go (here a file in
    # their place; a full disk does the same): the consumer takes nothing
    # and raises an error Celery's consumer recovers from by reconnecting,
    # then consumes once the folder can be made
    options = _options(tmp_path)
    [name] = _publish(options, 1)
    blocker = Path(options["data_folder_in"]) / whole_files.IN_FLIGHT_FOLDER
    blocker.write_bytes(b"")
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        queue = connection.SimpleQueue(_queue(options))
        with pytest.raises(connection.connection_errors, match="in-flight folder"):
            queue.get(timeout=5)
        assert _waiting(options) == [name]
        blocker.unlink()
        message = queue.get(timeout=5)
        assert message.payload == {"number": 1}
        message.ack()
    assert os.listdir(tmp_path / "processed") == [name]


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_a_visibility_timeout_that_is_not_a_positive_number_is_refused(
    tmp_path: Path, value: object
) -> None:
    options = {**_options(tmp_path), "visibility_timeout": value}
    with (
        Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection,
        pytest.raises(LeaseConfigurationError, match="visibility_timeout"),
    ):
        connection.default_channel  # noqa: B018 - opening it checks the options


def test_a_forked_child_does_not_keep_a_dead_consumer_s_messages(tmp_path: Path) -> None:
    # a prefork pool child forked after the consumer took a message shares
    # the lock's open file: it must not keep the lock when the consumer dies
    options = _options(tmp_path)
    _publish(options, 1)
    holder = _holder(options, fork=True)
    child = 0
    try:
        _, child = _taken(holder)
        assert child > 0
    finally:
        _end(holder)
    try:
        with Connection(
            "filesystem://", transport=TRANSPORT, transport_options=options
        ) as connection:
            message = connection.SimpleQueue(_queue(options)).get(timeout=5)
            assert message.payload == {"number": 1}
            os.kill(child, 0)  # the child still lives
            message.ack()
    finally:
        if child:
            os.kill(child, signal.SIGKILL)


def test_a_folder_left_by_a_consumer_that_died_while_making_it_is_removed_once_stale(
    tmp_path: Path,
) -> None:
    # a consumer makes its in-flight folder under a hidden name, locks it,
    # then renames it into view; one killed before the rename leaves the
    # hidden folder, removed by the next channel once STALE_PART_AGE old
    options = _options(tmp_path)
    root = tmp_path / "messages" / whole_files.IN_FLIGHT_FOLDER
    stale, unlocked, fresh = root / ".stale", root / ".no-lock", root / ".fresh"
    for folder in (stale, unlocked, fresh):
        folder.mkdir(parents=True)
    (stale / "lock").write_bytes(b"")
    (fresh / "lock").write_bytes(b"")
    old = time.time() - whole_files.STALE_PART_AGE - 60
    for folder in (stale, unlocked):
        os.utime(folder, (old, old))
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
        connection.default_channel  # noqa: B018 - opening a channel sweeps the folder
    assert sorted(os.listdir(root)) == [".fresh"]
