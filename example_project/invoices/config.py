"""Where the example keeps its broker, results, leases and ledger.

Two set-ups:

- **embedded** (the default): no server at all. The broker is kombu's
  ``filesystem://`` transport in a local folder, the lease store and the
  ledger are SQLite files, and results go to SQLite through Celery's
  database backend (``db+sqlite://``).
- **servers**: pass a broker URL (``redis://``) and a lease store URL
  (``redis://`` or ``postgresql+psycopg://``); results then go to the
  broker's Redis unless a backend URL is given.

Why ``filesystem://`` and not kombu's SQLAlchemy transport on SQLite: the
filesystem transport hands a message to exactly one consumer by renaming
its file, and a rename within one file system is atomic, so two worker
processes never both receive one message. kombu's own filesystem transport
writes a file in place, so a worker polling at that moment can take it half
written and lose it, and it removes a message as it hands it out, so a
killed worker's job is lost; the example uses
:mod:`celery_leases.filesystem`, which writes each file under a hidden name
and renames it in once whole, and keeps a taken message in the worker's
locked in-flight folder (inside the messages folder) until it is
acknowledged: a killed worker's messages go back to the queue. The SQLAlchemy transport reads a
message and marks it invisible in two statements; SQLite has no ``SELECT ... FOR UPDATE``, so two
processes can read the same message, and its polling writes make the other
process meet "database is locked".

Processes read their configuration from ``INVOICES_*`` environment
variables (:meth:`Config.from_env`), so a worker started with
``celery -A invoices.tasks worker`` uses what the demo or the user chose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Config"]

_ENV_PREFIX = "INVOICES_"


@dataclass(frozen=True)
class Config:
    """One set-up of the example.

    Args:
        data_dir: folder for the embedded broker, the SQLite files and logs.
        broker: broker URL; empty for the embedded ``filesystem://`` broker.
        backend: result backend URL; empty for the default of the broker.
        store: lease store URL; empty for SQLite in ``data_dir``.
        ledger: SQLAlchemy URL of the ledger database; empty for SQLite.
        receipts_url: base URL of the receipt service.
        ttl: lease TTL in seconds.
        work_seconds: how long a charge prepares before it writes.
        worker: this process's worker name, for the timeline.
        queue: the queue charges are sent to and workers consume.
    """

    data_dir: Path
    broker: str = ""
    backend: str = ""
    store: str = ""
    ledger: str = ""
    receipts_url: str = "http://127.0.0.1:8000"
    ttl: float = 3.0
    work_seconds: float = 1.5
    worker: str = field(default="client")
    queue: str = "invoices"

    @property
    def embedded(self) -> bool:
        """Whether the broker is the embedded ``filesystem://`` one."""
        return not self.broker

    @property
    def broker_url(self) -> str:
        return self.broker or "filesystem://"

    @property
    def broker_transport(self) -> str | None:
        """The embedded broker's transport: kombu's, writing whole message files."""
        return "celery_leases.filesystem:Transport" if self.embedded else None

    @property
    def backend_url(self) -> str:
        if self.backend:
            return self.backend
        if self.broker.startswith(("redis://", "rediss://")):
            return self.broker
        return f"db+sqlite:///{self.data_dir / 'results.sqlite3'}"

    @property
    def store_url(self) -> str:
        return self.store or f"sqlite:///{self.data_dir / 'leases.sqlite3'}"

    @property
    def ledger_url(self) -> str:
        return self.ledger or f"sqlite:///{self.data_dir / 'ledger.sqlite3'}"

    @property
    def timeline_path(self) -> Path:
        return self.data_dir / "timeline.sqlite3"

    def broker_transport_options(self) -> dict[str, Any]:
        """Options of the embedded broker: folders inside ``data_dir``."""
        if not self.embedded:
            return {}
        queue = self.data_dir / "broker"
        return {
            "data_folder_in": str(queue / "messages"),
            "data_folder_out": str(queue / "messages"),
            # acknowledged messages are kept here
            "store_processed": True,
            "processed_folder": str(queue / "processed"),
            "control_folder": str(queue / "control"),
            "polling_interval": 0.1,
        }

    def make_folders(self) -> None:
        """Create ``data_dir`` and the embedded broker's folders."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for key in ("data_folder_in", "processed_folder", "control_folder"):
            folder = self.broker_transport_options().get(key)
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)

    def to_env(self) -> dict[str, str]:
        """This set-up as the environment variables :meth:`from_env` reads."""
        return {
            f"{_ENV_PREFIX}DATA_DIR": str(self.data_dir),
            f"{_ENV_PREFIX}BROKER": self.broker,
            f"{_ENV_PREFIX}BACKEND": self.backend,
            f"{_ENV_PREFIX}STORE": self.store,
            f"{_ENV_PREFIX}LEDGER": self.ledger,
            f"{_ENV_PREFIX}RECEIPTS_URL": self.receipts_url,
            f"{_ENV_PREFIX}TTL": str(self.ttl),
            f"{_ENV_PREFIX}WORK_SECONDS": str(self.work_seconds),
            f"{_ENV_PREFIX}WORKER": self.worker,
            f"{_ENV_PREFIX}QUEUE": self.queue,
        }

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Config:
        """Read the set-up from ``INVOICES_*`` variables (defaults: embedded,
        in ``./var`` of the current folder)."""
        env = dict(os.environ if environ is None else environ)

        def get(name: str, default: str = "") -> str:
            return env.get(_ENV_PREFIX + name, default)

        return cls(
            data_dir=Path(get("DATA_DIR", "var")).resolve(),
            broker=get("BROKER"),
            backend=get("BACKEND"),
            store=get("STORE"),
            ledger=get("LEDGER"),
            receipts_url=get("RECEIPTS_URL", "http://127.0.0.1:8000"),
            ttl=float(get("TTL", "3")),
            work_seconds=float(get("WORK_SECONDS", "1.5")),
            worker=get("WORKER", "client"),
            queue=get("QUEUE", "invoices"),
        )
