"""The Promela model of the protocol (``model/leases.pml``), checked with spin.

The full model must verify with no error for every interleaving within its
bounds; each broken variant must give a counterexample that violates the
property it breaks. spin generates a C verifier (``pan.c``), ``cc`` builds
it, and the verifier runs an exhaustive safety search.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI

MODEL = Path(__file__).resolve().parents[2] / "model" / "leases.pml"

#: exhaustive search fits in well under 1 GB with state compression
_PAN_FLAGS = ("-O2", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=2048")


def _tools() -> tuple[str, str]:
    spin, cc = shutil.which("spin"), shutil.which("cc")
    if spin is None or cc is None:
        reason = "spin and a C compiler are needed (apt-get install spin gcc)"
        if IN_CI:
            pytest.fail(f"{reason} (CI=true: a missing tool fails the run)")
        pytest.skip(reason)
    return spin, cc


def verify(tmp_path: Path, *defines: str, source: Path = MODEL) -> subprocess.CompletedProcess[str]:
    """Generate, build and run the verifier of the model ``source`` with ``defines``."""
    spin, cc = _tools()
    model = tmp_path / source.name
    shutil.copy(source, model)
    flags = [f"-D{name}" for name in defines]
    subprocess.run([spin, "-a", *flags, model.name], cwd=tmp_path, check=True, timeout=60)
    subprocess.run([cc, *_PAN_FLAGS, "-o", "pan", "pan.c"], cwd=tmp_path, check=True, timeout=90)
    return subprocess.run(
        ["./pan", "-m100000"], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )


def errors_of(result: subprocess.CompletedProcess[str]) -> int:
    match = re.search(r"errors: (\d+)", result.stdout)
    assert match, f"no verdict in the verifier's output:\n{result.stdout}\n{result.stderr}"
    return int(match.group(1))


def assert_trail_replays(tmp_path: Path, variant: str, source: Path = MODEL) -> None:
    """The verifier wrote a counterexample trail, and spin replays it to the
    violated assertion (the steps that lead there)."""
    trail = tmp_path / f"{source.name}.trail"
    assert trail.exists(), "the verifier wrote no counterexample trail"
    spin, _ = _tools()
    replay = subprocess.run(
        [spin, "-t", f"-D{variant}", source.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "assertion violated" in replay.stdout, replay.stdout


def test_the_protocol_model_verifies_for_every_interleaving(tmp_path: Path) -> None:
    result = verify(tmp_path)
    assert errors_of(result) == 0, result.stdout
    # the search was exhaustive, not cut short by the depth or memory bound
    assert "Full statespace search" in result.stdout
    assert "max search depth too small" not in result.stdout
    assert "out of memory" not in result.stdout
    stored = int(re.search(r"(\d+) states, stored", result.stdout).group(1))  # type: ignore[union-attr]
    assert stored > 100_000, "the model explored suspiciously few states"


@pytest.mark.parametrize(
    ("variant", "violated"),
    [
        ("NO_GENERATION_CHECK", "mine==generation"),
        ("NO_FENCE", "mine>=last_write"),
        ("NO_RENEW_CHECK", "(holder==me)&&(generation==mine)"),
        ("WORKER_CLOCK_CLAIM", "(holder==0)||(lease_until<=clock)"),
        ("DROP_ON_LOST", "completed||((queued+inflight)>0)"),
    ],
)
def test_a_broken_variant_gives_a_counterexample(
    tmp_path: Path, variant: str, violated: str
) -> None:
    result = verify(tmp_path, variant)
    assert errors_of(result) >= 1, result.stdout
    assert f"assertion violated ({violated})" in result.stdout, result.stdout
    assert_trail_replays(tmp_path, variant)
