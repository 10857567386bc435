"""The delete's helpers decision (issue 31, item 1): `delete_helpers.helpers_wanted`, a pure function of one window.

The helpers themselves run against real directories in tests/disk/test_fsdelete_parallel.py.
"""

from __future__ import annotations

import pytest

from controller.node import delete_helpers


@pytest.mark.parametrize(
    ("threads", "busy", "waiting", "idle", "change"),
    [
        (0, 0.1, True, 0, 1),  # the first helper
        (4, 0.3, True, 0, 4),  # unlinks wait on the disk: double
        (24, 0.3, True, 0, delete_helpers.MAX_THREADS - 24),  # never past the cap
        (delete_helpers.MAX_THREADS, 0.3, True, 0, 0),
        (4, 0.3, False, 0, 0),  # nothing waits for a helper
        (4, 0.3, True, 1, 0),  # one has nothing to do already
        (4, 1.6, True, 0, 0),  # between: keep
        (4, 1.9, True, 0, -1),  # every core busy: one ends
        (1, 1.9, True, 0, 0),  # the last one stays
    ],
)
def test_helpers_double_while_the_disk_leaves_the_cpu_idle_and_end_when_it_is_busy(
    threads: int, busy: float, waiting: bool, idle: int, change: int
) -> None:
    assert delete_helpers.helpers_wanted(threads, busy, 2, waiting, idle) == change
