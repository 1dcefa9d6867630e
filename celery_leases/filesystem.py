"""kombu's ``filesystem://`` broker, handing out whole messages only.

kombu's filesystem transport writes a message file in place (open, then
write), and a consumer takes a file by renaming it away. A consumer that
polls between a publisher's open and its write takes an empty or cut file,
fails to decode it (``JSONDecodeError: Expecting value``, kombu issue 1551)
and the message is gone. A leased task publishes often (a deferred copy, a
copy sent again after a store outage), so a worker that polls every tenth of
a second meets this within a few hundred runs.

This transport keeps kombu's folders, file names and options, and closes the
race from both sides:

* it writes each message under a hidden name and renames it into the folder
  once whole, so a consumer never sees a file being written;
* a file it takes that is not yet whole (written in place by kombu's own
  transport in another process) is read again, under the writer's lock,
  until it decodes; one that never does is left in the processed folder
  under a ``.bad`` name and logged, never crashing the worker's loop.

A hidden file whose write failed (a full disk, an interrupt) is removed at once; one left
by a publisher that died while writing it, which never told anyone the
message was sent, is removed by the next channel opened on the folder once
it is :data:`STALE_PART_AGE` old by the clock that stamps the folder's files
(a file server's, on a shared folder), not this host's.

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
import tempfile
import time
import uuid
from collections.abc import Callable
from queue import Empty
from typing import IO, Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils import json as kombu_json

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    _flock = None
else:
    _flock = fcntl.flock

__all__ = ["READ_PATIENCE", "STALE_PART_AGE", "TRANSPORT", "Channel", "Transport"]

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

_READ_PAUSE = 0.01
_PART_SUFFIX = ".part"
#: the hidden file that reads the folder's clock (removed at once)
_CLOCK_SUFFIX = ".clock"
_LEFT_SUFFIXES = (_PART_SUFFIX, _CLOCK_SUFFIX)

# kombu's own helpers, typed: its file locks (fcntl or win32) and its JSON
_lock = cast("Callable[[IO[bytes], int], None]", filesystem.lock)
_unlock = cast("Callable[[IO[bytes]], None]", filesystem.unlock)
_dumps = cast("Callable[[Any], str]", kombu_json.dumps)
_loads = cast("Callable[[str], Any]", kombu_json.loads)


def _message_name(queue: str) -> str:
    """kombu's name of a new message file: publishing time (ms), a uuid, the queue."""
    return f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"


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


def _try_shared_lock(file: IO[bytes]) -> bool:
    """Take a shared lock on ``file`` without waiting for a writer that holds it."""
    if _flock is None:  # Windows: kombu's own lock, which waits
        _lock(file, filesystem.LOCK_SH)
        return True
    try:
        _flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
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
            locked = _try_shared_lock(file)
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


class Channel(filesystem.Channel):
    """A filesystem channel whose files are always whole when a consumer takes them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        #: files put back while their writer held them: name -> when to look again
        self._look_again: dict[str, float] = {}
        _remove_stale_parts(self.data_folder_out, STALE_PART_AGE)

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
        wanted = f"{queue}.msg"
        taken_to = self.processed_folder if self.store_processed else tempfile.gettempdir()
        now = time.monotonic()
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.partition(".")[2] != wanted or self._look_again.get(name, 0.0) > now:
                continue
            taken = os.path.join(taken_to, name)
            try:
                # the rename decides which consumer has it
                shutil.move(os.path.join(self.data_folder_in, name), taken)
            except OSError:
                continue  # another consumer took it first
            try:
                message = _read_whole(taken)
            except _StillWritten:
                # its writer still holds it: back into the queue, for a later look
                shutil.move(taken, os.path.join(self.data_folder_in, name))
                self._look_again[name] = time.monotonic() + READ_PATIENCE
                logger.warning("message file %s is still being written: put back", name)
                continue
            except ValueError:
                with contextlib.suppress(OSError):
                    os.replace(taken, f"{taken}.bad")
                logger.error("message file %s never became whole: left as %s.bad", name, taken)
                continue
            except OSError as exc:
                raise ChannelError(f"Cannot read file {taken!r} from queue.") from exc
            self._look_again.pop(name, None)
            if not self.store_processed:
                os.remove(taken)
            return message
        raise Empty()


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`: set it as ``broker_transport``."""

    Channel = Channel
