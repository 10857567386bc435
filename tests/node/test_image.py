"""`make image` (hack/image.sh): the sandkeep image built from the repository's Dockerfile with buildah,
with no Docker engine and no registry, as a docker archive that `ctr -n k8s.io images import` reads.

The slow test builds the image when the cache does not hold it for this tree (one to two and a half
minutes, see docs/image.md) and is instant after `make image`. Running the image on a real node is the
e2e suite's part.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "image.sh"


def test_image_script_passes_shellcheck_and_bash_n() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    result = subprocess.run(["shellcheck", "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def tools_dir() -> Path:
    """Where `make image` keeps the image: the same default as the Makefile's."""
    return Path(os.environ.get("SANDKEEP_TOOLS_DIR") or REPO / ".cache" / "tools")


def snapshot(into: Path) -> Path:
    """A copy of the script and its build context, so that edits made meanwhile in the working tree do not
    change the image's key between the two builds. The key has no path in it: the copy and the tree hash
    alike, so `make image` of an unchanged tree leaves the first build nothing to do."""
    for name in (
        *("Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "README.md", "hack/image.sh"),
        *("hack/protos.sh", "hack/tools/kube/go.mod", "hack/tools/kube/go.sum"),  # image.sh runs protos.sh first
        *("hack/rmtree.sh", "rmtree/go.mod", "rmtree/go.sum", "rmtree/main.go"),  # and builds the compiled walker
    ):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, into / name)
    shutil.copytree(REPO / "controller", into / "controller", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (into / ".venv").symlink_to(REPO / ".venv")  # protos.sh's Python (the copied protos are already generated)
    return into / "hack" / "image.sh"


def build(script: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    env = {**os.environ, "SANDKEEP_TOOLS_DIR": str(tools_dir())}
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result, time.monotonic() - start


def read_archive(archive: Path) -> tuple[list[dict[str, Any]], dict[str, Any], set[str]]:
    """The docker archive's manifest, its image config and the paths in all its layers."""
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(outer.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]
        paths = set()
        for layer in manifest[0]["Layers"]:
            with tarfile.open(fileobj=outer.extractfile(layer), mode="r|") as inner:
                paths.update(member.name.removeprefix("./") for member in inner)
    return manifest, config, paths


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(900)
def test_the_archive_holds_the_dockerfiles_image_and_an_unchanged_tree_is_not_rebuilt(tmp_path: Path) -> None:
    script = snapshot(tmp_path)
    first, _ = build(script)
    archive_line, ref = first.stdout.splitlines()
    archive = Path(archive_line)
    assert archive.parent == tools_dir() / "image" and archive.stat().st_size > 0
    assert ref.startswith("localhost/sandkeep:0.") and ref.endswith(archive.stem.removeprefix("sandkeep-"))

    manifest, config, paths = read_archive(archive)
    # `ctr images import` names the image after RepoTags: this is the reference the chart's values take.
    assert manifest[0]["RepoTags"] == [ref]
    assert config["config"]["Entrypoint"] == ["sandkeep"]
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Labels"]["org.opencontainers.image.title"] == "sandkeep"
    assert "opt/sandkeep/bin/sandkeep" in paths and "usr/bin/python3" in paths
    # The host's CA bundle and pip.conf were mounted into the build's RUN steps only.
    assert not {"etc/pip.conf", "etc/ssl/host-ca.crt"} & paths

    second, elapsed = build(script)
    assert second.stdout == first.stdout
    assert "up to date" in second.stderr and elapsed < 5, second.stderr[-2000:]
