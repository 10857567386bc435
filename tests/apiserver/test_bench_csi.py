"""The CSI benchmark runs end to end at a tiny size (numbers are printed, never asserted).

It checks the benchmark itself works against a real `sandkeep csi-node` and a real agent: every section prints
its percentiles or ratio beside its target, the live volumes are still published and mounted after the agent's
passes, and nothing stays mounted or on disk.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hack.localcluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
SPREAD = r"p50 +\d+\.\d ms, p99 +\d+\.\d ms, max +\d+\.\d ms"


def test_the_csi_benchmark_runs_tiny_and_prints_every_number_beside_its_target(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    script = REPO / "hack" / "bench" / "csi.py"
    tiny = ("--publishes=4", "--waves=2", "--mounts=20", "--files=300", "--rounds=2", "--volumes=5", "--passes=2")
    cmd = [sys.executable, str(script), *tiny, f"--kubeconfig={cluster.kubeconfig}", f"--dir={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for pattern in (
        rf"^publish, 4 at once \(8 in all\) +{SPREAD}$",
        rf"^  the plugin's own time \(its log\) +{SPREAD}$",
        rf"^  floor: NodeGetInfo, 4 at once +{SPREAD} \(gRPC",
        r"^  floor: 4 records written at once in \d+ threads, .*: median \d+\.\d ms for all \(the disk\)$",
        rf"^publish, 1 at a time \(8 in all\) +{SPREAD}$",
        rf"^unpublish, 4 at once +{SPREAD}$",
        rf"^publish, 4 at once beside 20 other mounts +{SPREAD}$",
        rf"^unpublish, 4 at once beside 20 other mounts +{SPREAD}$",
        r"^publish p99 at once / 100 ms target: \d+\.\d\d \(target <= 1\)$",
        r"^publish p99 at once beside 20 other mounts / without: \d+\.\d\dx$",
        r"^keep of 300 files: median \d+\.\d ms \(unpublish \d+\.\d ms \+ Volumes\.keep \d+\.\d ms\), .* 2 rounds$",
        r"^keep ratio 300 / 10 files: \d+\.\d\dx \(target <= 2x\)$",
        r"^agent RSS: idle \d+\.\d MiB \(\d+ passes\), with 5 live volumes \d+\.\d MiB .* MiB \(target <= 20 MiB\)$",
        r"^live volumes after the agent's passes: 5/5 published, 5/5 mounted$",
    ):
        assert re.search(pattern, out, re.M), f"no line matches {pattern!r}:\n{out}"
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()  # every bind mount is gone
    assert list(tmp_path.iterdir()) == []
