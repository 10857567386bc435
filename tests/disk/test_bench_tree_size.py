"""The size benchmark runs end to end in --quick mode (numbers are printed, never asserted).

It checks the benchmark itself works: every shape is built, timed against `du -s` and the byte counts
compared, and the last line is `ratio_vs_du X.XX`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_size_benchmark_runs_quick_and_prints_each_shape_against_du(tmp_path: Path) -> None:
    script = REPO / "hack" / "bench" / "tree_size.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", f"--dir={tmp_path}"], capture_output=True, text=True, timeout=300
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for shape in ("wide", "deep", "comb"):
        assert re.search(
            rf"^\| {shape} \| [\d,]+ \| \d+\.\d{{3}} \| \d+\.\d{{3}} \| \d+\.\d\d \| yes \|$", out, re.M
        ), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"ratio_vs_du \d+\.\d\d", last), last
    assert list(tmp_path.iterdir()) == []  # every tree it built is gone
