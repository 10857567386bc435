"""The delete benchmark runs end to end in --quick mode (numbers are printed, never asserted).

It checks the benchmark itself works: every peer ran (or says it is not installed) on every shape, sandkeep's
peak RSS, threads and event-loop stall are printed, and the last line is `ratio_vs_best X.XX`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = ("rm -rf", "find -delete", "rsync --delete", "xargs -P4 rm -rf", "xargs -P8 rm -rf", "xargs -P16 rm -rf")
SHAPES = ("repo", "wide", "deep", "flat", "tiny", "checkout")


def test_the_delete_benchmark_runs_quick_and_prints_every_peer_and_the_ratio(tmp_path: Path) -> None:
    script = REPO / "hack" / "bench" / "delete.py"
    cmd = [sys.executable, str(script), "--quick", f"--dir={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for tool in ("sandkeep", *PEERS):
        assert tool in rows, f"no row for {tool}:\n{out}"
        assert "skipped" not in rows[tool] or "not installed" in rows[tool], rows[tool]
        if "skipped" not in rows[tool]:
            assert len(re.findall(r"\d+\.\d\d \([\d,]+\)", rows[tool])) == len(SHAPES), rows[tool]
    for shape in SHAPES:
        assert re.search(rf"^{shape}: best peer .+ ratio \d+\.\d\d$", out, re.M), out
    assert re.search(r"^sandkeep peak RSS: \d+\.\d MiB", out, re.M), out
    assert re.search(r"^sandkeep peak threads: \d+", out, re.M), out
    assert re.search(r"^compiled walker peak RSS: \d+\.\d MiB, peak threads: \d+", out, re.M), out  # make venv's
    assert re.search(r"^longest event-loop stall: \d+\.\d ms", out, re.M), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"ratio_vs_best \d+\.\d\d", last), last
    assert list(tmp_path.iterdir()) == []  # every tree it built is gone
