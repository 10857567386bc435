"""`make demo` (standalone for now): the demo runs end to end on a temp root and checks its own outcomes."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.bed.diskkit import REPO, require_root


@pytest.mark.root
@pytest.mark.slow
def test_the_standalone_demo_shows_every_outcome_and_cleans_up() -> None:
    require_root()
    out = subprocess.run(
        [sys.executable, str(REPO / "hack" / "demo_standalone.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for step in ("1. retain", "2. pin", "5. sweep", "6. a sweep running every second", "7. clear", "8. what is left"):
        assert step in out.stdout
    assert "reason=TombstoneStuck" in out.stdout and "reason=TombstoneLeftover" in out.stdout
    assert "DEMO FAILED" not in out.stderr
    base = re.search(r"under (\S+)/root ", out.stdout)
    assert base is not None and base.group(1).startswith(tempfile.gettempdir())
    assert not Path(base.group(1)).exists()  # its temp directories are gone
