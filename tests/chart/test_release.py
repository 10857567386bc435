"""`make release` (hack/release.py) against a real registry (CNCF Distribution, hack/registry.py): an image pushed
by crane and answered by digest, the chart packaged with no symlinks and that image as its default, pushed and
pulled back by Helm as an OCI artifact. The image is the node's pause image (an OCI layout made here), so this
needs no image build; the e2e suite releases the real one (tests/bed/e2e_bed.py)."""

from __future__ import annotations

import json
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hack.localcluster import kube_version, tools_bin, tools_dir
from hack.nodeprep import pause_image
from hack.registry import LocalRegistry
from hack.release import package_chart, push_chart, push_image
from tests.bed.chart import helm as run_helm

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.0.1-test.1"


def helm(*args: str) -> str:
    return run_helm(tools_bin(("helm",)), *args).stdout


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    with LocalRegistry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def image(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The pause image pushed as REGISTRY/sandkeep:VERSION: (what push_image answered, its manifest's digest)."""
    archive, _ = pause_image(tools_dir().parent / "node")
    layout = tmp_path_factory.mktemp("layout")
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="data")
    manifest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    return push_image(layout, registry.host, VERSION, plain_http=True), manifest


def test_the_image_is_pushed_and_named_by_the_digest_the_registry_stored(
    registry: LocalRegistry, image: tuple[str, str]
) -> None:
    pushed, manifest = image
    assert pushed == f"{registry.host}/sandkeep@{manifest}"


def test_the_packaged_chart_has_no_links_its_version_and_the_image_by_digest(
    image: tuple[str, str], tmp_path: Path
) -> None:
    assert (REPO / "charts" / "sandkeep" / "files" / "crds").is_symlink()  # what the package must not hold
    package = package_chart(REPO, VERSION, image[0], tmp_path)
    with tarfile.open(package) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert not [m for m in members.values() if not (m.isfile() or m.isdir())]
        chart = yaml.safe_load(tar.extractfile("sandkeep/Chart.yaml").read())  # type: ignore[union-attr]
        values = yaml.safe_load(tar.extractfile("sandkeep/values.yaml").read())  # type: ignore[union-attr]
    crds = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert crds and all(f"sandkeep/files/crds/{name}" in members for name in crds)
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    repository, _, digest = image[0].partition("@")
    assert values["image"] | {"pullPolicy": None} == {
        "registry": "",
        "repository": repository,
        "tag": "",
        "digest": digest,
        "pullPolicy": None,
    }
    assert values["image"]["pullPolicy"] == "IfNotPresent"  # the chart's default, left as it is


def test_helm_pushes_the_chart_and_installs_from_the_registry_by_version(
    registry: LocalRegistry, image: tuple[str, str], tmp_path: Path
) -> None:
    package = package_chart(REPO, VERSION, image[0], tmp_path / "out")
    chart, digest = push_chart(package, registry.host, plain_http=True)
    assert chart == f"oci://{registry.host}/charts/sandkeep"
    shown = yaml.safe_load(helm("show", "chart", chart, "--version", VERSION, "--plain-http"))
    assert shown["version"] == VERSION
    kube = f"--kube-version={kube_version()}"
    rendered = helm("template", "sandkeep", chart, "--version", VERSION, "--plain-http", "-n", "sandkeep", kube)
    images = {
        c["image"]
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] in ("Deployment", "DaemonSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    assert images == {image[0]}
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    args = ("pull", chart, "--version", VERSION, "--plain-http", "--destination", str(pulled))
    said = run_helm(tools_bin(("helm",)), *args)
    assert f"Digest: {digest}" in said.stdout + said.stderr
    assert (pulled / package.name).read_bytes() == package.read_bytes()


def test_release_refuses_a_version_that_is_not_semver(image: tuple[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SemVer"):
        package_chart(REPO, "v1", image[0], tmp_path)


def make_release(*args: str) -> subprocess.CompletedProcess[str]:
    """`make release ...` as a user runs it from the checkout."""
    cmd = ["make", "--no-print-directory", "-C", str(REPO), "release", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


def test_make_release_without_its_arguments_says_how_to_call_it() -> None:
    result = make_release()
    assert result.returncode != 0
    assert "usage: make release VERSION=x.y.z REGISTRY=host[:port][/path]" in result.stdout + result.stderr


def test_make_release_refuses_a_version_that_is_not_semver_before_building(registry: LocalRegistry) -> None:
    result = make_release("VERSION=v1", f"REGISTRY={registry.host}", "RELEASE_ARGS=--plain-http --no-plugin")
    assert result.returncode != 0
    assert "release failed: 'v1' is no SemVer version" in result.stderr, result.stderr


@pytest.mark.slow
def test_make_release_pushes_the_image_and_the_chart_and_prints_them(registry: LocalRegistry, tmp_path: Path) -> None:
    """The command line end to end: the image built (cached for an unchanged tree), pushed and named by digest,
    the chart pushed by version with that digest as its default, each printed as the registry answered."""
    version = "0.0.2-cli.1"
    args = f"RELEASE_ARGS=--plain-http --no-plugin --out {tmp_path}"
    result = make_release(f"VERSION={version}", f"REGISTRY={registry.host}", args)
    assert result.returncode == 0, result.stderr
    printed = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.startswith(("image ", "chart ")))
    repository = f"{registry.host}/sandkeep"
    image = printed["image"]
    assert image.startswith(f"{repository}@sha256:")
    crane = str(tools_bin(("crane",)) / "crane")
    stored = subprocess.run([crane, "digest", "--insecure", f"{repository}:{version}"], capture_output=True, text=True)
    assert stored.stdout.strip() == image.partition("@")[2], "the printed digest is the one the registry stored"
    chart = f"oci://{registry.host}/charts/sandkeep"
    assert printed["chart"].startswith(f"{chart} --version {version} (sha256:")
    values = yaml.safe_load(helm("show", "values", chart, "--version", version, "--plain-http"))
    assert f"{values['image']['repository']}@{values['image']['digest']}" == image
    assert (tmp_path / f"sandkeep-{version}.tgz").is_file()
