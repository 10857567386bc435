"""hack/tools/build.sh: prebuilt binaries of one's own (KUBEBUILDER_ASSETS) are used instead of a build."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
