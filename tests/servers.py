"""Throwaway servers for the test session: redis-server, PostgreSQL and MariaDB.

Each server is a real process on a free port bound to 127.0.0.1, with its
data in a temporary folder. It can be stopped and started again on the same
data (store-restart tests). Only processes started here are ever signalled,
by their own pid.
"""

from __future__ import annotations

import abc
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
    "MariadbServer",
    "PostgresServer",
    "RedisCluster",
    "RedisServer",
    "SentinelGroup",
    "ServerExited",
    "ServerMissing",
    "find_postgres_bin",
    "free_port",
]


class ServerMissing(RuntimeError):
    """The server's binaries are not installed on this machine."""


class ServerExited(RuntimeError):
    """The server process exited while it was starting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"server on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start within {timeout} s")


def _wait_until_loaded(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Wait until the redis-server on ``port`` has loaded its files: it
    accepts connections before that and answers every command ``LOADING``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"server on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(256).startswith(b"-LOADING"):
                return
        time.sleep(0.01)
    raise RuntimeError(f"server on port {port} did not load its files within {timeout} s")


class _ServerProcess(abc.ABC):
    """A server run as a child process of the tests: stopped, killed and
    started again by its own pid."""

    #: seconds a SIGTERM may take before SIGKILL
    STOP_TIMEOUT = 20.0

    proc: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def start(self) -> None:
        """Start (or start again) on the same port and data folder."""

    def stop(self) -> None:
        """Stop the server with SIGTERM (a clean shutdown) and wait for it.

        A server a test froze with SIGSTOP is resumed first, or it would not
        act on the SIGTERM.
        """
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
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


class RedisServer(_ServerProcess):
    """A redis-server process with AOF persistence in its own folder.

    ``env`` is added to the server's environment (a test clock, say);
    ``prefix`` is a command the server runs under (a profiler, say).
    """

    #: first starts on fresh ports before giving up: a port that another
    #: process took between its pick and the server's bind makes it exit
    FIRST_START_TRIES = 3

    def __init__(
        self,
        *extra_args: str,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        bus_port: bool = False,
    ) -> None:
        self.env = env or {}
        self.prefix = prefix
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerMissing("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="leases-redis-"))
        self.extra_args = extra_args
        self.bus_port = bus_port
        self.proc: subprocess.Popen[bytes] | None = None
        for attempt in range(self.FIRST_START_TRIES):
            self.port = free_port()
            # a cluster node's bus port is set: port + 10000 may be above 65535
            self.cluster_port = free_port() if bus_port else None
            try:
                self.start()
                break
            except ServerExited:
                if attempt == self.FIRST_START_TRIES - 1:
                    raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or start again) on the same port and data folder."""
        args = [
            *self.prefix,
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
            *(() if self.cluster_port is None else ("--cluster-port", str(self.cluster_port))),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        _wait_for_port(self.port, self.proc)
        _wait_until_loaded(self.port, self.proc)

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
    ``env`` is added to the environment of its programs (a test clock, say).
    """

    def __init__(self, *settings: str, env: dict[str, str] | None = None) -> None:
        self.env = env or {}
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
        subprocess.run(
            command,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **self.env},
        )

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


class MariadbServer(_ServerProcess):
    """A MariaDB server made with mariadb-install-db and run as a process.

    Its data, socket and pid file live in a temporary folder; it listens on
    a free port of 127.0.0.1. The store connects as ``leases`` with a
    password (root keeps the socket's authentication). As root, the server
    runs as root (``--user=root``).
    """

    USER = "leases"
    PASSWORD = "lease-test-pw"
    DATABASE = "leases"
    STOP_TIMEOUT = 30.0

    def __init__(self, *extra_args: str) -> None:
        binary = shutil.which("mariadbd") or (
            "/usr/sbin/mariadbd" if os.path.exists("/usr/sbin/mariadbd") else None
        )
        install = shutil.which("mariadb-install-db")
        if binary is None or install is None:
            raise ServerMissing("MariaDB is not installed (apt-get install mariadb-server)")
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="leases-mariadb-"))
        self.data = self.root / "data"
        self.socket = self.root / "mariadb.sock"
        self.port = free_port()
        #: more server options, after (and so above) the defaults
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        user = ["--user=root"] if os.geteuid() == 0 else []
        # a temporary folder of its own: servers bootstrapped at once in /tmp
        # meet each other's temporary tables there
        self.tmp = self.root / "tmp"
        self.tmp.mkdir()
        subprocess.run(
            [
                install, "--no-defaults", f"--datadir={self.data}", f"--tmpdir={self.tmp}",
                "--auth-root-authentication-method=socket", "--skip-test-db", *user,
            ],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(3):  # another process may take the free port first
            with contextlib.suppress(RuntimeError):  # it exited: the port was taken
                self.start()
            if self._listening():
                break
            self.stop()
            self.port = free_port()
        self.sql(
            f"CREATE DATABASE {self.DATABASE};"
            f"CREATE USER '{self.USER}'@'127.0.0.1' IDENTIFIED BY '{self.PASSWORD}';"
            f"GRANT ALL ON {self.DATABASE}.* TO '{self.USER}'@'127.0.0.1';"
        )

    @property
    def url(self) -> str:
        return f"mysql+pymysql://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/{self.DATABASE}"

    def start(self) -> None:
        """Start (or start again) on the same port and data folder."""
        args = [
            self.binary,
            "--no-defaults",
            f"--datadir={self.data}",
            f"--tmpdir={self.tmp}",
            f"--socket={self.socket}",
            f"--pid-file={self.root / 'mariadb.pid'}",
            f"--log-error={self.root / 'mariadb.log'}",
            "--bind-address=127.0.0.1",
            f"--port={self.port}",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=16M",
            "--innodb-log-file-size=16M",
            "--innodb-flush-log-at-trx-commit=2",
            "--max-connections=200",
            *(["--user=root"] if os.geteuid() == 0 else []),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.port, self.proc, timeout=60.0)

    def _listening(self) -> bool:
        """Whether this server (not another process on its port) is up: it is
        running and has made its socket, which it does after binding the port."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self.socket.exists():
                return True
            time.sleep(0.1)
        return False

    def sql(self, script: str) -> str:
        """Run ``script`` as root over the socket; its output."""
        reply = subprocess.run(
            ["mariadb", "--no-defaults", f"--socket={self.socket}", "-uroot", "-N", "-e", script],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return reply.stdout

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _sentinel_command() -> list[str]:
    binary = shutil.which("redis-sentinel")
    if binary is not None:
        return [binary]
    server = shutil.which("redis-server")
    if server is None:
        raise ServerMissing("redis-sentinel is not installed (apt-get install redis-sentinel)")
    return [server]  # redis-sentinel is redis-server started with --sentinel


class SentinelGroup:
    """One master, one replica and three sentinels watching them.

    Each process is a real server on a free port; sentinels decide a master
    is down after ``down_after_ms`` and fail over to the replica.
    """

    MASTER_NAME = "leases-master"

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.master = RedisServer("--appendfsync", "everysec")
        self.replica = RedisServer(
            "--appendfsync", "everysec", "--replicaof", "127.0.0.1", str(self.master.port)
        )
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []
        self.dir = Path(tempfile.mkdtemp(prefix="leases-sentinel-"))
        try:
            self._start_sentinels(down_after_ms)
        except BaseException:
            self.close()
            raise

    def _start_sentinels(self, down_after_ms: int) -> None:
        command = _sentinel_command()
        for number in range(3):
            port = free_port()
            config = self.dir / f"sentinel-{number}.conf"
            config.write_text(
                f"port {port}\n"
                "bind 127.0.0.1\n"
                f"dir {self.dir}\n"
                f"logfile {self.dir / f'sentinel-{number}.log'}\n"
                f"sentinel monitor {self.MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER_NAME} {down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {self.MASTER_NAME} 1\n"
            )
            args = [*command, str(config)]
            if not command[0].endswith("redis-sentinel"):
                args.append("--sentinel")
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_for_port(port, proc)
            self.sentinels.append(proc)
            self.sentinel_ports.append(port)

    def sentinel(self, *command: str, port: int | None = None) -> str:
        """The reply of a sentinel (the first by default) to ``command``, as text."""
        reply = subprocess.run(
            ["redis-cli", "-p", str(port or self.sentinel_ports[0]), *command],
            check=True, capture_output=True, text=True, timeout=5,
        )  # fmt: skip
        return reply.stdout

    def wait_ready(self, timeout: float = 40.0) -> None:
        """Wait until every sentinel knows the replica and the other sentinels."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = all(
                "OK" in self.sentinel("SENTINEL", "ckquorum", self.MASTER_NAME, port=port)
                and str(self.replica.port)
                in self.sentinel("SENTINEL", "replicas", self.MASTER_NAME, port=port)
                for port in self.sentinel_ports
            )
            if ready:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the sentinels did not see each other within {timeout} s")

    def wait_master(self, port: int, timeout: float = 40.0) -> None:
        """Wait until the sentinels name the server on ``port`` as the master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.master_port() == port:
                return
            time.sleep(0.1)
        raise RuntimeError(f"no failover to port {port} within {timeout} s")

    @property
    def url(self) -> str:
        """The sentinels, as kombu spells them."""
        return ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports)

    def master_port(self) -> int | None:
        """The master's port according to the first sentinel that answers."""
        for port in self.sentinel_ports:
            with contextlib.suppress(OSError, subprocess.CalledProcessError):
                reply = subprocess.run(
                    ["redis-cli", "-p", str(port), "SENTINEL", "get-master-addr-by-name",
                     self.MASTER_NAME],
                    check=True, capture_output=True, text=True, timeout=5,
                )  # fmt: skip
                lines = reply.stdout.split()
                if len(lines) == 2:
                    return int(lines[1])
        return None

    def close(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.replica.close()
        self.master.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """A Redis Cluster of 3 masters and 3 replicas, each a redis-server on a free port."""

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(6):
                node_args = [
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "1000",
                    "--appendfsync", "everysec",
                ]  # fmt: skip
                self.nodes.append(RedisServer(*node_args, bus_port=True))
            self.cli(
                "--cluster", "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas", "1", "--cluster-yes",
            )  # fmt: skip
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """The URL of the store: any one node; the client finds the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def cli(self, *args: str, timeout: float = 60.0) -> str:
        reply = subprocess.run(
            ["redis-cli", *args], check=True, capture_output=True, text=True, timeout=timeout
        )
        return reply.stdout

    def node_cli(self, port: int, *args: str) -> str:
        return self.cli("-p", str(port), *args)

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.proc is not None]

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Wait until every live node reports cluster_state:ok and agrees on the slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.SubprocessError):
                if all(
                    "cluster_state:ok" in self.node_cli(node.port, "CLUSTER", "INFO")
                    for node in self.live_nodes()
                ):
                    check = self.cli("--cluster", "check", f"127.0.0.1:{self.live_nodes()[0].port}")
                    if "[OK] All 16384 slots covered" in check and "[ERR]" not in check:
                        return
            time.sleep(0.2)
        raise RuntimeError(f"the cluster was not ok within {timeout} s")

    def node_of_slot(self, slot: int) -> RedisServer:
        """The live master that serves ``slot``."""
        for node in self.live_nodes():
            with contextlib.suppress(subprocess.SubprocessError):
                for line in self.node_cli(node.port, "CLUSTER", "NODES").splitlines():
                    fields = line.split()
                    if "master" not in fields[2] or "fail" in fields[2]:
                        continue
                    for span in fields[8:]:
                        low, _, high = span.partition("-")
                        if low.isdigit() and int(low) <= slot <= int(high or low):
                            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                            return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no live master serves slot {slot}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
