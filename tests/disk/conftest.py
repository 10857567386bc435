"""Fixtures of the tests on this machine's directories and processes (the bed's own: tests/bed/diskkit.py)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.bed.procs import alive


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test saw started; any still alive at the end are SIGKILLed by pid."""
    seen: list[int] = []
    yield seen
    for pid in seen:
        if pid > 1 and pid != os.getpid() and alive(pid):
            os.kill(pid, signal.SIGKILL)
