"""The controller scale benchmark runs end to end at a small size (numbers are printed, never asserted).

It checks the benchmark itself works: every sandbox reconciled, zero steady-state writes measured from
kube-apiserver's metrics, every sandbox deleted after its deadline, and the RSS line printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hack.localcluster import LocalCluster
from tests.bed.controller_harness import install_crds

REPO = Path(__file__).resolve().parents[2]


def test_controller_scale_benchmark_runs_small(cluster: LocalCluster) -> None:
    install_crds(cluster)
    script = REPO / "hack" / "bench" / "controller_scale.py"
    small = ("--objects=60", "--nodes=3", "--namespaces=2", "--spread=4", "--quiet=3", "--margin=6")
    cmd = [sys.executable, str(script), f"--kubeconfig={cluster.kubeconfig}", *small]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "time to reconcile all 60:" in out, out
    assert "steady-state API writes per hour (sandboxes, policies, events): 0 " in out, out
    assert "deleted 60/60 due (2 of 2 namespaces)" in out, out
    assert "rss_per_object_kib" in out and "requests APPLY" in out, out
    assert "controller peak RSS:" in out, out
