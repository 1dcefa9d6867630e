"""Throwaway brokers for the test session: a RabbitMQ node and a local SQS server.

Like the servers of :mod:`tests.servers`, each is a real process on free
ports bound to 127.0.0.1, with its files in a temporary folder, and only
processes started here are ever signalled, by their own pid.

The RabbitMQ node has its own node name, ``HOME`` (and so its own Erlang
cookie), mnesia and log folders, and its own ``epmd`` on a port of its own,
started here in the foreground so that it can be stopped by pid too. The
management plugin is off. ``consumer_timeout`` is set low and checked every
second (RabbitMQ checks it only every ``channel_tick_interval``, a minute by
default), so a test sees the broker close a channel within seconds.

The SQS server is ``moto_server`` (``moto[server]``), which kombu's SQS
transport reaches through its ``endpoint_url`` made from the broker URL's
host and port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.servers import ServerMissing, _wait_for_port, free_port

__all__ = ["CONSUMER_TIMEOUT", "RabbitServer", "SqsServer"]

#: the test node's consumer_timeout, seconds: above every body and deferral
#: of the amqp acceptance tests, low enough for a test to wait it out
CONSUMER_TIMEOUT = 8.0

_RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")


def _rabbit_tool(name: str) -> str:
    # the /usr/sbin wrappers switch to the rabbitmq user and its fixed folders
    candidate = _RABBIT_BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerMissing("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    return found


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RabbitServer:
    """A private RabbitMQ node started as a process of this session.

    Args:
        consumer_timeout: the node's ``consumer_timeout``, seconds.
    """

    def __init__(self, consumer_timeout: float = CONSUMER_TIMEOUT) -> None:
        self.server = _rabbit_tool("rabbitmq-server")
        self.ctl = _rabbit_tool("rabbitmqctl")
        epmd = shutil.which("epmd") or next(
            iter(sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))), None
        )
        if epmd is None:
            raise ServerMissing("epmd (Erlang) is not installed (apt-get install rabbitmq-server)")
        self.consumer_timeout = consumer_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="leases-rabbit-"))
        self.port = free_port()
        self.epmd_port = free_port()
        self.dist_port = free_port()
        self.node = f"leases{self.port}@localhost"
        self.pid_file = self.dir / "node.pid"
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            "log.console = false\n"
        )
        timeout_ms = round(consumer_timeout * 1000)
        rabbit_env = f"{{consumer_timeout, {timeout_ms}}}, {{channel_tick_interval, 1000}}"
        (self.dir / "advanced.config").write_text(f"[{{rabbit, [{rabbit_env}]}}].\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.env = {
            **os.environ,
            "HOME": str(self.dir),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        self.epmd: subprocess.Popen[bytes] | None = subprocess.Popen(
            [str(epmd), "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            _wait_for_port(self.epmd_port, self.epmd)
            self.start()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 120.0) -> None:
        """Start the node and wait until its applications run."""
        with (self.dir / "server.out").open("ab") as out:
            self.proc = subprocess.Popen(
                [self.server], env=self.env, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.ctl_call("wait", str(self.pid_file), "--timeout", str(int(timeout)), timeout=timeout)
        _wait_for_port(self.port, self.proc)

    def ctl_call(self, *args: str, timeout: float = 60.0) -> str:
        """The output of ``rabbitmqctl -n <node> args``."""
        done = subprocess.run(
            [self.ctl, "-n", self.node, *args], env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")
        return done.stdout

    def log(self) -> str:
        """The node's log, as text."""
        path = self.dir / "log" / f"{self.node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the node: SIGTERM to its Erlang VM (a clean stop), then its launcher."""
        if self.pid_file.exists():
            text = self.pid_file.read_text().strip()
            if text.isdigit() and self.proc is not None and self.proc.poll() is None:
                # the VM is a child of the launcher script started here
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(text), signal.SIGTERM)
        _stop(self.proc)
        self.proc = None

    def close(self) -> None:
        self.stop()
        _stop(self.epmd)
        self.epmd = None
        shutil.rmtree(self.dir, ignore_errors=True)


class SqsServer:
    """A local SQS endpoint: ``moto_server`` on a free port."""

    def __init__(self) -> None:
        try:
            import boto3  # noqa: F401  # kombu's SQS transport needs them
            import moto.server  # noqa: F401
            import pycurl  # noqa: F401
        except ImportError as exc:
            raise ServerMissing(
                f"the SQS tests need moto[server], boto3 and pycurl ({exc}); "
                "pip install -e '.[dev]'"
            ) from exc
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="leases-sqs-"))
        with (self.dir / "moto.out").open("ab") as out:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _wait_for_port(self.port, self.proc)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """A broker URL for kombu's SQS transport (moto takes any credentials)."""
        return f"sqs://testing:testing@127.0.0.1:{self.port}"

    def close(self) -> None:
        _stop(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
