"""kombu's ``filesystem://`` broker, handing out whole messages only and
keeping each one until it is acknowledged.

kombu's filesystem transport writes a message file in place (open, then
write), and a consumer takes a file by renaming it away. A consumer that
polls between a publisher's open and its write takes an empty or cut file,
fails to decode it (``JSONDecodeError: Expecting value``, kombu issue 1551)
and the message is gone. A leased task publishes often (a deferred copy, a
copy sent again after a store outage), so a worker that polls every tenth of
a second meets this within a few hundred runs.

kombu's transport also removes (or files away) a message as it hands it
out, so an unacknowledged message lives only in the consumer's memory: a
worker killed with SIGKILL takes its running and prefetched jobs with it.

This transport keeps kombu's folders, file names and options, and closes
both holes:

* it writes each message under a hidden name and renames it into the folder
  once whole, so a consumer never sees a file being written;
* a file it takes that is not yet whole (written in place by kombu's own
  transport in another process) is read again, under the writer's lock,
  until it decodes; one that never does is left in the processed folder
  under a ``.bad`` name and logged, never crashing the worker's loop;
* a consumer takes a file by renaming it into its own **in-flight folder**
  (``<data_folder_in>/.in-flight/<host>-<pid>-<random>/``), where it stays
  until the message is acknowledged (then it is removed, or moved to the
  processed folder with ``store_processed``) or rejected (removed, or put
  back into the queue when requeued). The folder holds a lock file its
  connection keeps locked (``flock``) while it lives; the operating system
  drops the lock when the process dies, however it dies. Every connection
  on the folder sweeps the in-flight folders when it opens a channel and
  about every :data:`SWEEP_INTERVAL` seconds while it consumes: the files
  of a folder whose lock is free are put back into the queue, under their
  own names (so in their place in the order). A living consumer's
  folder is never swept, except for the files it has held longer than the
  ``visibility_timeout`` transport option (seconds, default
  :data:`DEFAULT_VISIBILITY_TIMEOUT`, kombu's Redis default; ``None`` turns
  it off), which are put back as the Redis and SQS transports do with an
  unacknowledged message, for a consumer that is alive but stuck. Its late
  acknowledgement is then a no-op. A connection that closes puts back what
  it has not acknowledged, under the same names.

A hidden file whose write failed (a full disk, an interrupt) is removed at once; one left
by a publisher that died while writing it, which never told anyone the
message was sent, is removed by the next channel opened on the folder once
it is :data:`STALE_PART_AGE` old by the clock that stamps the folder's files
(a file server's, on a shared folder), not this host's. That clock also
times the visibility timeout.

Use it by naming it beside the broker URL::

    app.conf.broker_url = "filesystem://"
    app.conf.broker_transport = "celery_leases.filesystem:Transport"

Every process that publishes or consumes (workers, web processes, beat)
should use it; a stock publisher's messages are still read whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from queue import Empty
from typing import IO, Any, cast

from kombu.exceptions import ChannelError
from kombu.exceptions import ConnectionError as BrokerConnectionError
from kombu.transport import filesystem
from kombu.utils import json as kombu_json

from celery_leases.errors import LeaseConfigurationError
from celery_leases.values import is_number

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    _flock = None
else:
    _flock = fcntl.flock

__all__ = [
    "DEFAULT_VISIBILITY_TIMEOUT",
    "IN_FLIGHT_FOLDER",
    "READ_PATIENCE",
    "STALE_PART_AGE",
    "SWEEP_INTERVAL",
    "TRANSPORT",
    "Channel",
    "Transport",
    "visibility_timeout_option",
]

logger = logging.getLogger(__name__)

#: the ``broker_transport`` setting that names :class:`Transport`
TRANSPORT = "celery_leases.filesystem:Transport"

#: seconds a consumer reads a taken file again while it is not whole
READ_PATIENCE = 2.0

#: seconds after which a hidden file still being written is taken for the
#: leftover of a publisher that died: its write never returned, so its
#: message was never reported sent (a publisher stopped that long and then
#: woken finds its file gone, and its publish fails with an error)
STALE_PART_AGE = 3600.0

#: the folder inside ``data_folder_in`` that holds each consumer's in-flight folder
IN_FLIGHT_FOLDER = ".in-flight"

#: seconds between two sweeps of the in-flight folders by a consuming channel
SWEEP_INTERVAL = 1.0

#: seconds a living consumer may hold a message unacknowledged before it is
#: put back into the queue (kombu's Redis transport's default); the
#: ``visibility_timeout`` transport option sets it, ``None`` turns it off
DEFAULT_VISIBILITY_TIMEOUT = 3600.0

_READ_PAUSE = 0.01
_PART_SUFFIX = ".part"
#: the hidden file that reads the folder's clock (removed at once)
_CLOCK_SUFFIX = ".clock"
_LEFT_SUFFIXES = (_PART_SUFFIX, _CLOCK_SUFFIX)
_MESSAGE_SUFFIX = ".msg"
#: the file in an in-flight folder that its connection keeps locked
_LOCK_NAME = "lock"

# kombu's own helpers, typed: its file locks (fcntl or win32) and its JSON
_lock = cast("Callable[[IO[bytes], int], None]", filesystem.lock)
_unlock = cast("Callable[[IO[bytes]], None]", filesystem.unlock)
_dumps = cast("Callable[[Any], str]", kombu_json.dumps)
_loads = cast("Callable[[str], Any]", kombu_json.loads)


def _message_name(queue: str) -> str:
    """kombu's name of a new message file: publishing time (ms), a uuid, the queue."""
    return f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}{_MESSAGE_SUFFIX}"


class _StillWritten(Exception):
    """The file's writer held its lock for all of :data:`READ_PATIENCE`."""


def _folder_now(folder: str) -> float | None:
    """The time by the clock that stamps ``folder``'s files: a new file's mtime.

    On a folder shared over the network the file server stamps the files,
    and this host's clock may be far from its clock. None when no file can
    be made there (then nothing there can be removed either).
    """
    try:
        fd, path = tempfile.mkstemp(prefix=".", suffix=_CLOCK_SUFFIX, dir=folder)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)


def _remove_stale_parts(folder: str, older_than: float) -> None:
    """Remove the hidden files in ``folder`` last written ``older_than`` seconds ago,
    by the folder's own clock."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(".") and n.endswith(_LEFT_SUFFIXES)]
    except OSError:
        return  # a folder that cannot be listed fails the channel's first call
    if not names:
        return
    now = _folder_now(folder)
    if now is None:
        return
    cutoff = now - older_than
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):  # another channel removed it first
            if os.stat(path).st_mtime < cutoff:
                os.remove(path)
                logger.warning("removed %s, left by a process that died while writing it", path)


def _try_lock(file: IO[bytes], *, exclusive: bool) -> bool:
    """Take a lock on ``file`` without waiting for another holder of it."""
    if _flock is None:  # pragma: no cover - Windows: kombu's own lock
        flags = filesystem.LOCK_EX if exclusive else filesystem.LOCK_SH
        try:
            _lock(file, flags | filesystem.LOCK_NB)
        except Exception:  # pywin32's error is not an OSError
            return False
        return True
    try:
        _flock(file.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_whole(path: str) -> Any:
    """The decoded message in ``path``, read under a shared lock until whole.

    A writer in place holds an exclusive lock while it writes; one that has
    opened the file but not locked it yet leaves it empty. Both are waited
    for, at most :data:`READ_PATIENCE` seconds, and never by blocking on the
    lock: a writer that stopped (SIGSTOP, a hung disk) cannot stop the
    consumer's loop.

    Raises:
        _StillWritten: the writer held the lock all that time.
        ValueError: the file did not decode within :data:`READ_PATIENCE`.
        OSError: the file could not be opened or read.
    """
    deadline = time.monotonic() + READ_PATIENCE
    while True:
        with open(path, "rb") as file:
            locked = _try_lock(file, exclusive=False)
            if locked:
                try:
                    payload = file.read()
                finally:
                    _unlock(file)
        if locked:
            try:
                return _loads(payload.decode("utf-8"))
            except ValueError:
                if time.monotonic() >= deadline:
                    raise
        elif time.monotonic() >= deadline:
            raise _StillWritten(path)
        time.sleep(_READ_PAUSE)


def _message_files(folder: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if n.endswith(_MESSAGE_SUFFIX))
    except OSError:
        return []


def _put_back(folder: str, name: str, queue_folder: str) -> bool:
    """Move message file ``name`` from ``folder`` back into the queue; whether it was there."""
    try:
        os.rename(os.path.join(folder, name), os.path.join(queue_folder, name))
    except FileNotFoundError:  # acknowledged, or put back by a sweep, meanwhile
        return False
    return True


def _remove_in_flight_folder(folder: str, lock_file: IO[bytes]) -> None:
    """Remove an in-flight folder whose lock ``lock_file`` holds, then release it."""
    with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, _LOCK_NAME))
    with contextlib.suppress(OSError):  # a file was put in it after all: the next sweep
        os.rmdir(folder)
    lock_file.close()


def _sweep(queue_folder: str, visibility_timeout: float | None) -> None:
    """Put back into the queue the messages of every consumer that is gone, and
    those a living consumer has held longer than ``visibility_timeout``.

    A consumer is gone when the lock on its in-flight folder is free: the
    operating system drops it when the process dies. Taking that lock here
    also keeps a second sweep out until this one removed the folder.
    """
    root = os.path.join(queue_folder, IN_FLIGHT_FOLDER)
    try:
        names = os.listdir(root)
    except OSError:
        return  # no consumer has taken a message here yet
    folders = [n for n in names if not n.startswith(".")]
    _remove_stale_staging(root, [n for n in names if n.startswith(".")])
    now: float | None = None
    # this process's own folders live, and their lock files are never opened
    # here: where flock is emulated with POSIX locks (NFS), a second open in
    # the same process would take the lock, and its close would drop the owner's
    own = {place.folder for place in list(_places) if place.usable}
    for name in folders:
        folder = os.path.join(root, name)
        if folder not in own and _remove_if_gone(folder, queue_folder):
            continue
        if visibility_timeout is None:
            continue
        for message in _message_files(folder):
            now = _folder_now(queue_folder) if now is None else now
            if now is None:
                return
            path = os.path.join(folder, message)
            with contextlib.suppress(OSError):  # acknowledged meanwhile
                held_since = os.stat(path).st_mtime
                if held_since < now - visibility_timeout and _put_back(
                    folder, message, queue_folder
                ):
                    logger.warning(
                        "put back message %s: unacknowledged for more than the visibility "
                        "timeout (%g s) by the consumer of %s",
                        message, visibility_timeout, folder,
                    )  # fmt: skip


def _remove_stale_staging(root: str, names: list[str]) -> None:
    """Remove the hidden folders in ``root`` left by a process that died while
    making its in-flight folder (nothing was put in them), once
    :data:`STALE_PART_AGE` old by the folder's clock."""
    queue_folder = os.path.dirname(root)
    now = _folder_now(queue_folder) if names else None
    if now is None:
        return
    for name in names:
        folder = os.path.join(root, name)
        with contextlib.suppress(OSError):  # removed meanwhile
            if os.stat(folder).st_mtime < now - STALE_PART_AGE:
                _remove_if_gone(folder, queue_folder)
                os.rmdir(folder)  # one that died before it made its lock file


def _remove_if_gone(folder: str, queue_folder: str) -> bool:
    """If the consumer of in-flight ``folder`` is gone, put its messages back
    and remove the folder; whether it was gone (or is being removed)."""
    try:
        lock_file = open(os.path.join(folder, _LOCK_NAME), "rb")  # noqa: SIM115 - closed below
    except OSError:
        return True  # another sweep is removing it
    if not _try_lock(lock_file, exclusive=True):
        lock_file.close()
        return False
    restored = [n for n in _message_files(folder) if _put_back(folder, n, queue_folder)]
    _remove_in_flight_folder(folder, lock_file)
    if restored:
        logger.warning(
            "put back %d unacknowledged message(s) of a consumer that is gone (%s): %s",
            len(restored), folder, ", ".join(restored),
        )  # fmt: skip
    return True


class _InFlight:
    """One connection's in-flight folder: the message files it took and has
    not acknowledged yet, and the lock file it keeps locked while it lives.

    Args:
        queue_folder: the folder messages are taken from (``data_folder_in``).
        done_folder: where an acknowledged file goes (``processed_folder``
            with ``store_processed``), or None to remove it.
    """

    def __init__(self, queue_folder: str, done_folder: str | None) -> None:
        self.queue_folder = queue_folder
        self.done_folder = done_folder
        root = os.path.join(queue_folder, IN_FLIGHT_FOLDER)
        os.makedirs(root, exist_ok=True)
        # made and locked under a hidden name that no sweep looks at, then
        # renamed into view: a sweep never finds it unlocked while it lives
        staging = tempfile.mkdtemp(prefix=".", dir=root)
        self._lock_file: IO[bytes] | None = open(os.path.join(staging, _LOCK_NAME), "wb")  # noqa: SIM115 - held for the connection's life
        if not _try_lock(self._lock_file, exclusive=True):  # pragma: no cover - a new file
            raise ChannelError(f"cannot lock the in-flight folder {staging!r}")
        self.folder = os.path.join(
            root, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        )
        os.rename(staging, self.folder)
        self._pid = os.getpid()
        #: delivery tag -> name of the message file taken for it
        self._names: dict[str, str] = {}
        _places.add(self)

    @property
    def usable(self) -> bool:
        """False in a forked child: the folder and its lock are the parent's."""
        return self._lock_file is not None and self._pid == os.getpid()

    def take(self, name: str) -> str | None:
        """Move message file ``name`` from the queue into this folder; its new
        path, or None when another consumer took it first."""
        path = os.path.join(self.folder, name)
        waiting = os.path.join(self.queue_folder, name)
        # when it was taken, by the folder's clock: the visibility timeout
        # runs from here. Stamped before the move, so that no sweep finds it
        # in this folder with the time it waited in the queue (a backlog
        # older than the timeout would be put back as it is being read)
        with contextlib.suppress(OSError):  # taken by another consumer: the rename fails
            os.utime(waiting)
        try:
            # the rename decides which consumer has it
            os.rename(waiting, path)
        except OSError:
            return None
        return path

    def put_back(self, name: str) -> None:
        """Move a taken file back into the queue, under its own name."""
        _put_back(self.folder, name, self.queue_folder)

    def hold(self, delivery_tag: str, name: str) -> None:
        """Keep ``name`` here until ``delivery_tag`` is acknowledged or rejected."""
        self._names[delivery_tag] = name

    def acknowledge(self, delivery_tag: str) -> None:
        """Remove the file of ``delivery_tag`` (or move it to the done folder).

        Acknowledging twice, or after a sweep put the file back, does nothing.
        """
        name = self._names.pop(delivery_tag, None)
        if name is not None:
            self.finish(name)

    def finish(self, name: str) -> None:
        """Remove taken file ``name``, or move it to the done folder."""
        path = os.path.join(self.folder, name)
        with contextlib.suppress(FileNotFoundError):
            if self.done_folder is None:
                os.remove(path)
            else:
                shutil.move(path, os.path.join(self.done_folder, name))

    def restore(self, delivery_tag: str) -> bool:
        """Put the file of ``delivery_tag`` back into the queue; False if it is not held here."""
        name = self._names.pop(delivery_tag, None)
        if name is None:
            return False
        self.put_back(name)
        return True

    def close(self) -> None:
        """Put back every file still here, then remove the folder and release its lock."""
        if not self.usable:
            return
        assert self._lock_file is not None
        for name in _message_files(self.folder):
            self.put_back(name)
        self._names.clear()
        _remove_in_flight_folder(self.folder, self._lock_file)
        self._lock_file = None

    def forget(self) -> None:
        """In a forked child: close the inherited lock without releasing it.

        An ``flock`` lock belongs to the open file, which a fork shares: a
        child that kept it open would keep its parent's folder locked after
        the parent died, and would release the parent's lock if it unlocked.
        """
        if self._lock_file is not None:
            self._lock_file.close()  # a close, not an unlock: the parent's stays held
            self._lock_file = None
        self._names.clear()


#: every in-flight folder this process holds, for the fork handler below
_places: weakref.WeakSet[_InFlight] = weakref.WeakSet()


def _forget_inherited_places() -> None:
    for place in list(_places):
        place.forget()


if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=_forget_inherited_places)


def visibility_timeout_option(options: dict[str, Any]) -> float | None:
    """The ``visibility_timeout`` transport option, checked (None: turned off).

    Raises:
        LeaseConfigurationError: it is not a positive number or None.
    """
    value = options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT)
    if value is None:
        return None
    if not is_number(value) or not value > 0:
        raise LeaseConfigurationError(
            f"broker_transport_options['visibility_timeout'] must be a number of seconds "
            f"above 0, or None to keep a living consumer's messages until it acknowledges "
            f"them, got {value!r}"
        )
    return float(value)


class Channel(filesystem.Channel):
    """A filesystem channel whose files are always whole when a consumer takes
    them, and stay in the consumer's in-flight folder until acknowledged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        #: files put back while their writer held them: name -> when to look again
        self._look_again: dict[str, float] = {}
        #: queues consumed without acknowledgements, by consumer tag
        self._no_ack_queues: dict[str, str] = {}
        self.visibility_timeout = visibility_timeout_option(self.transport_options)
        _remove_stale_parts(self.data_folder_out, STALE_PART_AGE)
        _sweep(self.data_folder_in, self.visibility_timeout)
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL

    def _in_flight(self) -> _InFlight:
        """The connection's in-flight folder, made before its first take.

        Raises:
            kombu.exceptions.ConnectionError: it cannot be made (a full disk,
                a folder that cannot be written). Nothing was taken, and the
                worker reconnects and tries again, as with a broker that is
                down, instead of stopping on an error it cannot recover from.
        """
        transport = cast("Transport", self.connection)
        try:
            return transport.in_flight_folder(
                self.data_folder_in, self.processed_folder if self.store_processed else None
            )
        except OSError as exc:
            raise BrokerConnectionError(
                f"cannot make an in-flight folder in {self.data_folder_in!r} to take messages "
                f"into: {exc}"
            ) from exc

    def _held(self) -> _InFlight | None:
        """The connection's in-flight folder, if it has taken a message."""
        transport = self.connection  # None once the channel is closed
        return transport.in_flight if isinstance(transport, Transport) else None

    # kombu names the argument "payload" here and "message" in its base class
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = _message_name(queue)
        final = os.path.join(self.data_folder_out, name)
        # a hidden name: no queue's consumer matches it while it is written
        partial = os.path.join(self.data_folder_out, f".{name}{_PART_SUFFIX}")
        data = _dumps(payload).encode("utf-8")  # a payload that does not encode makes no file
        try:
            with open(partial, "wb") as file:
                file.write(data)
            os.replace(partial, final)
        except BaseException as exc:
            # a full disk, or a timeout or interrupt raised in the write
            with contextlib.suppress(OSError):  # the open may have failed before making it
                os.remove(partial)
            if isinstance(exc, OSError):
                raise ChannelError(f"Cannot add file {final!r} to directory") from exc
            raise

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL
            _sweep(self.data_folder_in, self.visibility_timeout)
        wanted = f"{queue}{_MESSAGE_SUFFIX}"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.partition(".")[2] != wanted or self._look_again.get(name, 0.0) > now:
                continue
            place = self._in_flight()
            taken = place.take(name)
            if taken is None:
                continue  # another consumer took it first
            try:
                message = _read_whole(taken)
            except _StillWritten:
                # its writer still holds it: back into the queue, for a later look
                place.put_back(name)
                self._look_again[name] = time.monotonic() + READ_PATIENCE
                logger.warning("message file %s is still being written: put back", name)
                continue
            except ValueError:
                bad_folder = (
                    self.processed_folder if self.store_processed else tempfile.gettempdir()
                )
                bad = os.path.join(bad_folder, f"{name}.bad")
                with contextlib.suppress(OSError):
                    shutil.move(taken, bad)
                logger.error("message file %s never became whole: left as %s", name, bad)
                continue
            except FileNotFoundError:
                # put back by a sweep while this consumer was stopped, after
                # its take, for longer than the visibility timeout: the
                # message is in the queue again, and no longer this one's
                logger.warning("message file %s was put back before it was read", name)
                continue
            except OSError as exc:
                place.put_back(name)
                raise ChannelError(f"Cannot read file {taken!r} from queue.") from exc
            self._look_again.pop(name, None)
            tag = _delivery_tag(message)
            if tag is None or queue in self._no_ack_queues.values():
                place.finish(name)  # nothing will acknowledge it: taken is done
            else:
                place.hold(tag, name)
            return message
        raise Empty()

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            self._no_ack_queues[consumer_tag] = queue
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[no-untyped-call]

    def basic_cancel(self, consumer_tag: str) -> Any:
        self._no_ack_queues.pop(consumer_tag, None)
        return super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)  # type: ignore[no-untyped-call]
        place = self._held()
        if message is not None and no_ack and place is not None:
            place.acknowledge(message.delivery_tag)
        return message

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        place = self._held()
        if place is not None:
            place.acknowledge(delivery_tag)
        super().basic_ack(delivery_tag, multiple)  # type: ignore[no-untyped-call]

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        place = self._held()
        if place is not None and not requeue:
            place.acknowledge(delivery_tag)
        # requeued: kombu's QoS calls _restore_at_beginning, which puts the file back
        super().basic_reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]

    # kombu has no public hook for putting a message back: its QoS calls the
    # channel's _restore on a requeue, a recover and the channel's close.
    # tests/integration/test_filesystem_broker.py (requeue, clean close) fails
    # if kombu stops calling it: the file would not come back under its name.
    def _restore(self, message: Any) -> None:
        """Put an unacknowledged message back (a requeue, a recover, the channel's
        close): its own file, moved back into the queue. kombu's own, which
        publishes a copy, only for a message this connection did not take."""
        place = self._held()
        if place is None or not place.restore(message.delivery_tag):
            super()._restore(message)  # type: ignore[no-untyped-call]


def _delivery_tag(message: Any) -> str | None:
    """The delivery tag kombu stamped on ``message`` when it was published."""
    try:
        tag = message["properties"]["delivery_tag"]
    except (KeyError, TypeError):
        return None
    return tag if isinstance(tag, str) else None


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`: set it as ``broker_transport``."""

    Channel = Channel

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        #: where this connection's channels keep the messages they took
        self.in_flight: _InFlight | None = None

    def in_flight_folder(self, queue_folder: str, done_folder: str | None) -> _InFlight:
        """This connection's in-flight folder, made at its first take."""
        if self.in_flight is None or not self.in_flight.usable:
            self.in_flight = _InFlight(queue_folder, done_folder)
        return self.in_flight

    def close_connection(self, connection: Any) -> None:
        """Close the channels (each puts back what it has not acknowledged),
        then remove the in-flight folder."""
        super().close_connection(connection)  # type: ignore[no-untyped-call]
        if self.in_flight is not None:
            self.in_flight.close()
            self.in_flight = None
