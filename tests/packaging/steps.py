"""The steps of the packaging tests: commands run outside the checkout, each in a bounded time."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["ROOT", "STEP_TIMEOUT", "clean_env", "run_step"]

ROOT = Path(__file__).resolve().parents[2]

#: seconds any one step (make a venv, install, run a probe) may take
STEP_TIMEOUT = 300.0


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that points back at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


def run_step(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run ``args``; its output, or a failed assertion with what it printed."""
    done = subprocess.run(
        args, cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
        timeout=STEP_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout
