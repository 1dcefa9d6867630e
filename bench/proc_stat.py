"""The benchmarks' reading of ``/proc/<pid>/stat`` (Linux): CPU time and family of a process."""

from __future__ import annotations

import os

#: clock ticks per second, the unit of the CPU times in ``stat``
CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, so that the
    state (field 3 of proc(5)) is ``[0]``, the parent ``[1]``, the process
    group ``[2]``, ``utime`` ``[11]`` and ``stime`` ``[12]``.

    Raises:
        OSError: the process is gone.
    """
    with open(f"/proc/{pid}/stat") as stat:
        # the command name may hold spaces and parentheses: split after its last ")"
        return stat.read().rsplit(")", 1)[1].split()


def cpu_ticks(fields: list[str]) -> int:
    """User + system CPU (ticks, all threads) of a process, from its :func:`stat_fields`."""
    return int(fields[11]) + int(fields[12])
