"""hack/protos.sh: the CSI plugin's gRPC modules come from the pinned modules, checked, and the script is instant
when they are already generated."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from controller.csi import proto

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "protos.sh"


def _copy_of_the_repo(tmp_path: Path, script: str) -> Path:
    """The script and the kube pins it reads, in a repository of their own (its output lands there)."""
    (tmp_path / "hack" / "tools" / "kube").mkdir(parents=True)
    (tmp_path / "controller" / "csi").mkdir(parents=True)
    (tmp_path / "hack" / "protos.sh").write_text(script)
    for name in ("go.mod", "go.sum"):
        shutil.copy(REPO / "hack" / "tools" / "kube" / name, tmp_path / "hack" / "tools" / "kube" / name)
    return tmp_path


def run(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / "hack" / "protos.sh"), sys.executable], capture_output=True, text=True, timeout=300
    )


def test_the_generated_modules_are_the_pinned_versions_and_an_unchanged_key_is_instant() -> None:
    go_mod = (REPO / "hack/tools/kube/go.mod").read_text()
    assert f"require k8s.io/kubernetes v1.{proto.KUBELET_VERSION.removeprefix('0.')}\n" in go_mod
    assert proto.CSI_SPEC_VERSION == "1.12.0"
    started = time.monotonic()
    # Up to date: no Go needed, nothing written.
    done = subprocess.run(
        ["bash", str(SCRIPT), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and time.monotonic() - started < 30


def test_a_module_whose_sum_is_not_the_pinned_one_is_refused_and_nothing_is_generated(tmp_path: Path) -> None:
    script = SCRIPT.read_text()
    good = _copy_of_the_repo(tmp_path / "good", script)
    assert run(good).returncode == 0
    for name in ("csi_pb2.py", "pluginregistration_pb2_grpc.py", "__init__.py"):
        generated = (good / "controller/csi/proto" / name).read_text()
        assert generated == (REPO / "controller/csi/proto" / name).read_text()  # the same bytes, every time

    pinned = next(line for line in script.splitlines() if line.startswith("CSI_SPEC_SUM="))
    bad = _copy_of_the_repo(tmp_path / "bad", script.replace(pinned, "CSI_SPEC_SUM=h1:AAAA="))
    out = run(bad)
    assert out.returncode == 1
    assert "has sum 'h1:" in out.stderr and "the pin says h1:AAAA=" in out.stderr
    assert not (bad / "controller/csi/proto").exists()
