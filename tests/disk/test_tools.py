"""hack/tools/build.sh: prebuilt binaries of one's own (KUBEBUILDER_ASSETS) are used instead of a build."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kubebuilder_assets_are_used_as_they_are_and_nothing_is_built(tools: Path, tmp_path: Path) -> None:
    assets, cache = tmp_path / "assets", tmp_path / "cache"
    assets.mkdir()
    shutil.copy2(tools / "kubectl", assets / "kubectl")
    env = {**os.environ, "KUBEBUILDER_ASSETS": str(assets), "SANDKEEP_TOOLS_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", str(REPO / "hack" / "tools" / "build.sh"), "kubectl"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(cache / "bin")
    assert "using kubectl from KUBEBUILDER_ASSETS" in result.stderr
    linked = cache / "bin" / "kubectl"
    assert linked.resolve() == (assets / "kubectl").resolve()
    # No Go on PATH and no build directory: the binary was taken, not built.
    assert not list(cache.glob("kubectl-*"))
    version = subprocess.run([str(linked), "version", "--client"], capture_output=True, text=True, check=True)
    assert "Client Version" in version.stdout


def run_build(tmp_path: Path, *tools_wanted: str, jobs: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KUBEBUILDER_ASSETS": str(tmp_path / "assets"),
        "SANDKEEP_TOOLS_DIR": str(tmp_path / "cache"),
        "SANDKEEP_TOOLS_JOBS": jobs,
        "PATH": "/usr/bin:/bin",  # no Go: anything not in the assets fails to build
    }
    cmd = ["bash", str(REPO / "hack" / "tools" / "build.sh"), *tools_wanted]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_lanes_build_side_by_side_and_a_failed_lane_fails_the_build_by_name(tools: Path, tmp_path: Path) -> None:
    (tmp_path / "assets").mkdir()
    for name in ("kubectl", "etcd"):
        shutil.copy2(tools / name, tmp_path / "assets" / name)
    both = run_build(tmp_path, "kubectl", "etcd", jobs="2")
    assert both.returncode == 0, both.stderr
    assert "building 2 lanes (kube etcd), 2 at a time" in both.stderr
    assert {p.name for p in (tmp_path / "cache" / "bin").iterdir()} == {"kubectl", "etcd"}
    # helm is in no asset and cannot be built without Go: its lane fails, the others still finish
    (tmp_path / "assets" / "etcd").unlink()
    failed = run_build(tmp_path, "kubectl", "helm", jobs="2")
    assert failed.returncode != 0
    assert "lane helm failed" in failed.stderr, failed.stderr
    assert "using kubectl from KUBEBUILDER_ASSETS" in failed.stderr
    refused = run_build(tmp_path, "kubectl", jobs="two")
    assert refused.returncode == 2 and "SANDKEEP_TOOLS_JOBS must be a positive integer" in refused.stderr
