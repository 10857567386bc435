"""The kubectl plugin installed as kubectl plugins are: `hack/plugin_zipapp.py`'s archive and krew manifest,
installed by krew (built from its pinned module, hack/tools/krew), run by the real kubectl against the real
API server, on a PATH with no venv: the krew bin directory, kubectl alone, and /usr/bin for python3."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack import plugin_zipapp
from hack.localcluster import tools_bin
from tests.apiserver.test_plugin import make
from tests.bed.controller_harness import install_crds, kube_for

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.0.0-krew"
PYTHON3 = Path("/usr/bin/python3")  # the machine's own, not the venv's


def python3_version() -> str:
    out = subprocess.run([str(PYTHON3), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True)
    return out.stdout.decode().strip()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """This machine's archive (linux/amd64, for /usr/bin/python3's CPython) and its manifest."""
    out = tmp_path_factory.mktemp("plugin")
    manifest = plugin_zipapp.build(VERSION, out, ["linux/amd64"], out.as_uri(), [python3_version()])
    return manifest, out / f"kubectl-sandkeep-{VERSION}-linux-amd64.tar.gz"


@pytest.fixture(scope="module")
def installed(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """krew installs the plugin into a KREW_ROOT of its own; returns the environment a user's shell has then."""
    manifest, archive = built
    home = tmp_path_factory.mktemp("home")
    kubectl_only = home / "kubectl-bin"
    kubectl_only.mkdir()
    tools = tools_bin(["kubectl", "kubectl-krew"])
    for tool in ("kubectl", "kubectl-krew"):
        (kubectl_only / tool).symlink_to(tools / tool)
    root = home / "krew"
    env = {"HOME": str(home), "KREW_ROOT": str(root), "PATH": f"{root / 'bin'}:{kubectl_only}:/usr/bin"}
    done = subprocess.run(
        ["kubectl", "krew", "install", f"--manifest={manifest}", f"--archive={archive}"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Installed plugin: sandkeep" in done.stderr
    (kubectl_only / "kubectl-krew").unlink()  # from here on, kubectl and the plugin only
    return env


def kubectl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=90, cwd=env["HOME"])


def test_the_archive_carries_no_grpc_and_one_compiled_module(built):
    manifest, archive = built
    doc = yaml.safe_load(manifest.read_text())
    assert (doc["kind"], doc["spec"]["version"]) == ("Plugin", f"v{VERSION}")
    (platform,) = doc["spec"]["platforms"]
    assert platform["sha256"] == plugin_zipapp.sha256(archive) and platform["bin"] == "kubectl-sandkeep"
    assert platform["uri"].endswith(archive.name)
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(archive.parent)], check=True)
    app = archive.parent / "kubectl-sandkeep"
    assert app.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(app) as z:
        names = z.namelist()
    assert not [n for n in names if n.split("/")[0] in ("grpc", "google", "aiohttp", "controller/csi")]
    compiled = [n for n in names if n.endswith(".so")]
    assert compiled and all(n.startswith("_compiled/pydantic_core/_pydantic_core.cpython-") for n in compiled)
    print(f"archive {archive.stat().st_size / 1e6:.1f} MB, zipapp {app.stat().st_size / 1e6:.1f} MB")


def test_kubectl_sandkeep_ls_runs_from_krew_with_no_venv(cluster: Any, namespace: str, installed: dict[str, str]):
    install_crds(cluster)
    client = kube_for(cluster)
    try:
        make(client, namespace, "run-krew", "node-a")
    finally:
        client.close()
    assert "VIRTUAL_ENV" not in installed and "PYTHONPATH" not in installed
    listed = kubectl(installed, "plugin", "list")
    assert str(Path(installed["KREW_ROOT"]) / "bin" / "kubectl-sandkeep") in listed.stdout, listed
    version = kubectl(installed, "sandkeep", "--version")
    assert version.stdout.strip() == f"kubectl-sandkeep {VERSION}", version.stderr
    ls = kubectl(installed, "sandkeep", f"--kubeconfig={cluster.kubeconfig}", "ls", "-n", namespace)
    assert ls.returncode == 0, ls.stderr
    header, row = ls.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "NODE", "PHASE"] and row.split()[:2] == ["run-krew", "node-a"]
    # the extracted compiled module sits in the user's cache: one directory for the build, no staging left
    (extracted,) = (Path(installed["HOME"]) / ".cache" / "sandkeep" / "kubectl-plugin").iterdir()
    assert extracted.name.startswith(f"{VERSION}-") and (extracted / "pydantic_core" / "__init__.py").is_file()
    assert (extracted / f"cpython-{python3_version().replace('.', '')}.zip").is_file()  # the compiled modules


def test_kubectl_completes_the_plugins_commands_and_sandbox_names(
    cluster: Any, namespace: str, installed: dict[str, str]
):
    install_crds(cluster)
    client = kube_for(cluster)
    try:
        for name in ("done-1", "done-2", "other"):
            make(client, namespace, name)
    finally:
        client.close()
    bin_dir = Path(installed["KREW_ROOT"]) / "bin"
    link = bin_dir / "kubectl_complete-sandkeep"
    before = kubectl(installed, "__complete", "sandkeep", "p")
    assert "pin" not in before.stdout.splitlines()  # no completion executable yet: kubectl completes nothing
    link.symlink_to("kubectl-sandkeep")  # as the manifest's caveats say
    try:
        assert kubectl(installed, "__complete", "sandkeep", "p").stdout.splitlines()[:2] == ["pin", ":4"]
        flags = ["--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
        done = kubectl(installed, "__complete", "sandkeep", *flags, "unpin", "do")
        assert done.stdout.splitlines()[:3] == ["done-1", "done-2", ":4"], done.stderr
        cp = kubectl(installed, "__complete", "sandkeep", *flags, "cp", "")
        assert cp.stdout.splitlines()[:4] == ["done-1:", "done-2:", "other:", ":6"], cp.stderr
    finally:
        os.unlink(link)
