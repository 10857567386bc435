"""hack/plugin_zipapp.py's choices without building an archive: what the plugin carries, krew's manifest, and
how `make release` reports it (tests/apiserver/test_krew.py builds one and installs it with krew)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack import plugin_zipapp as pz
from hack.release import Release, release

REPO = Path(__file__).resolve().parents[2]


def test_the_plugin_carries_the_kubernetes_client_and_pydantic_but_not_aiohttp_or_grpc():
    names = {pz._key(d.metadata["Name"]) for d in pz.closure()}
    assert {"kubernetes", "pydantic", "pydantic-core", "pyyaml", "requests"} <= names
    assert not names & {"aiohttp", "aiohttp-retry", "multidict", "yarl", "grpcio", "protobuf"}


def test_members_leave_out_compiled_files_caches_tests_and_the_csi_plugin_and_stage_pydantic_core():
    names = [name for name, _ in pz.members(pz.closure())]
    assert "controller/cli/kubectl_plugin.py" in names and "kubernetes/client/api_client.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "__pycache__" in n]
    assert not [n for n in names if n.startswith(("controller/csi/", "kubernetes/test/", "pydantic_core/"))]
    assert f"{pz.STAGED}/pydantic_core/__init__.py" in names


def test_the_manifest_names_each_platforms_archive_by_uri_and_sha256(tmp_path):
    archives = {}
    for platform in ("linux/amd64", "darwin/arm64"):
        archives[platform] = tmp_path / f"kubectl-sandkeep-1.2.3-{platform.replace('/', '-')}.tar.gz"
        archives[platform].write_bytes(platform.encode())
    doc = pz.manifest("1.2.3", archives, "https://example.com/v1.2.3/")
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]) == (
        "krew.googlecontainertools.github.com/v1alpha2",
        "Plugin",
        {"name": "sandkeep"},
    )
    spec = doc["spec"]
    assert isinstance(spec, dict) and spec["version"] == "v1.2.3"
    darwin, linux = spec["platforms"]
    assert darwin["selector"] == {"matchLabels": {"os": "darwin", "arch": "arm64"}}
    assert linux["uri"] == "https://example.com/v1.2.3/kubectl-sandkeep-1.2.3-linux-amd64.tar.gz"
    assert linux["sha256"] == pz.sha256(archives["linux/amd64"]) != darwin["sha256"]
    assert linux["bin"] == "kubectl-sandkeep" and pz.COMPLETE in spec["caveats"]


def test_release_builds_the_plugin_from_this_checkout_only(tmp_path):
    with pytest.raises(ValueError, match="this checkout only"):
        release("1.2.3", "registry.example.com", source=tmp_path, plugin_uri_base=pz.URI_BASE)


def test_release_lists_the_plugins_archives_and_how_krew_installs_them(tmp_path):
    (tmp_path / "kubectl-sandkeep-1.2.3-linux-amd64.tar.gz").write_bytes(b"")
    manifest = tmp_path / "sandkeep.yaml"
    chart = ("1.2.3", "r/sandkeep@sha256:0", "oci://r/charts/sandkeep", "sha256:1", tmp_path / "c.tgz")
    lines = Release(*chart, manifest).lines()
    assert f"plugin {tmp_path / 'kubectl-sandkeep-1.2.3-linux-amd64.tar.gz'}" in lines
    assert lines[-1].startswith(f"krew: kubectl krew install --manifest={manifest}")
    assert not [line for line in Release(*chart).lines() if line.startswith(("plugin", "krew"))]
