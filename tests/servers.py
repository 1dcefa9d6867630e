"""Throwaway servers for the test session: redis-server and PostgreSQL.

Each server is a real process on a free port bound to 127.0.0.1, with its
data in a temporary folder. It can be stopped and started again on the same
data (store-restart tests). Only processes started here are ever signalled,
by their own pid.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = [
    "PostgresServer",
    "RedisServer",
    "ServerMissing",
    "find_postgres_bin",
    "free_port",
]


class ServerMissing(RuntimeError):
    """The server's binaries are not installed on this machine."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start within {timeout} s")


class RedisServer:
    """A redis-server process with AOF persistence in its own folder."""

    def __init__(self, *extra_args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerMissing("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="leases-redis-"))
        self.port = free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or start again) on the same port and data folder."""
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.port, self.proc)

    def stop(self) -> None:
        """Stop the server with SIGTERM (it writes its AOF) and wait for it.

        A server a test froze with SIGSTOP is resumed first, or it would not
        act on the SIGTERM.
        """
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Stop the server abruptly with SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def copy_files(self) -> Path:
        """A copy of the data folder as it is now (AOF and RDB files).

        With ``appendfsync everysec`` a power loss keeps what was synced up
        to a second ago; putting back this copy before :meth:`start` is
        that loss, made on purpose.
        """
        copy = Path(tempfile.mkdtemp(prefix="leases-redis-copy-")) / "data"
        shutil.copytree(self.dir, copy, ignore=shutil.ignore_patterns("*.log"))
        return copy

    def put_back(self, copy: Path) -> None:
        """Replace the data folder with ``copy`` (the server is stopped)."""
        assert self.proc is None, "stop or kill the server first"
        for entry in self.dir.iterdir():
            if entry.name.endswith(".log"):
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        shutil.copytree(copy, self.dir, dirs_exist_ok=True)
        shutil.rmtree(copy.parent, ignore_errors=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def find_postgres_bin() -> Path:
    """The folder with ``initdb``, ``pg_ctl`` and ``postgres``."""
    for name in ("pg_ctl",):
        found = shutil.which(name)
        if found:
            return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if candidates:
        return Path(candidates[-1]).parent
    raise ServerMissing("PostgreSQL server binaries are not installed (apt-get install postgresql)")


class PostgresServer:
    """A PostgreSQL cluster made with initdb and run with pg_ctl.

    As root, the cluster belongs to an unprivileged user (``postgres`` when
    it exists, else ``nobody``), since PostgreSQL refuses to run as root.
    """

    def __init__(self, *settings: str) -> None:
        self.bin = find_postgres_bin()
        #: extra ``name=value`` server settings, given as ``-c`` options
        self.settings = settings
        self.root = Path(tempfile.mkdtemp(prefix="leases-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            for candidate in ("postgres", "nobody"):
                try:
                    entry = pwd.getpwnam(candidate)
                except KeyError:
                    continue
                self.user = candidate
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
                break
        self._run(
            str(self.bin / "initdb"),
            "-D", str(self.data),
            "-U", "postgres",
            "--auth=trust",
            "--no-sync",
            "-E", "UTF8",
        )  # fmt: skip
        self.start()

    def _run(self, *args: str) -> None:
        command = list(args)
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 "
            f"-c unix_socket_directories={self.root} -c fsync=off "
            "-c max_connections=200 -c synchronous_commit=off"
        )
        options += "".join(f" -c {setting}" for setting in self.settings)
        self._run(
            str(self.bin / "pg_ctl"),
            "-D", str(self.data),
            "-o", options,
            "-l", str(self.root / "postgres.log"),
            "-w",
            "-t", "60",
            "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
