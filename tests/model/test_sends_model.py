"""The Promela model of which deliveries are the same run (``model/sends.pml``).

Three sends of one custom key (a send with the library, a new send that
reuses its task id, a ``send_task`` by name without a send id), redelivery,
deferred copies and crashes. The rule must verify for every interleaving;
each broken variant of it must give a counterexample that spin replays.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.model.test_spin import assert_trail_replays, errors_of, verify

MODEL = Path(__file__).resolve().parents[2] / "model" / "sends.pml"


def test_the_send_id_rule_verifies_for_every_interleaving(tmp_path: Path) -> None:
    result = verify(tmp_path, source=MODEL)
    assert errors_of(result) == 0, result.stdout
    assert "Full statespace search" in result.stdout
    assert "max search depth too small" not in result.stdout
    assert "out of memory" not in result.stdout
    stored = int(re.search(r"(\d+) states, stored", result.stdout).group(1))  # type: ignore[union-attr]
    assert stored > 1_000_000, "the model explored suspiciously few states"


@pytest.mark.parametrize(
    "variant",
    [
        # a message without a send id is the same run as whatever completed
        "NO_ID_SAME_RUN",
        # every delivery of a completed key is the same run
        "SAME_KEY_SAME_RUN",
        # the task id alone decides
        "IGNORE_SEND_ID",
        # the same send id or the same task id decides
        "SEND_OR_TASK_ID",
    ],
)
def test_a_broken_send_id_rule_gives_a_counterexample(tmp_path: Path, variant: str) -> None:
    result = verify(tmp_path, variant, source=MODEL)
    assert errors_of(result) >= 1, result.stdout
    # a skipped delivery answered with another send's outcome
    assert "assertion violated (done_by==m)" in result.stdout, result.stdout
    assert_trail_replays(tmp_path, variant, MODEL)
