"""`make release VERSION=x.y.z REGISTRY=host[:port]`: the image and the chart, versioned, pushed to an OCI registry.

    python -m hack.release --version 0.2.0 --registry registry.example.com/sandkeep [--plain-http] [--source DIR]

1. The image: `hack/image.sh` of the source tree (cached by a hash of its inputs), pushed by crane (built from
   its pinned module, hack/tools/crane) as REGISTRY/sandkeep:VERSION; the registry answers its digest.
2. The chart: `charts/sandkeep` copied into a staging directory with every symlink replaced by the file it
   names (`files/crds`), `version` and `appVersion` set to VERSION, the image's default set to
   REGISTRY/sandkeep at that digest; `helm package`, then `helm push` to oci://REGISTRY/charts.
3. The kubectl plugin (unless --no-plugin): `hack/plugin_zipapp.py`'s single-file archive per platform and
   krew's manifest `sandkeep.yaml` for them, in --out (the archives are to be served from --plugin-uri-base,
   a GitHub release's downloads by default); built from this checkout only.
4. Prints what it pushed: the image by digest, the chart by version and digest; and the plugin's files.

A user then installs with `helm install sandkeep oci://REGISTRY/charts/sandkeep --version VERSION`.
`--source` releases another checkout (the upgrade test releases an earlier commit of main with this script);
`--image-cache` keeps that checkout's image cache apart from this one's (hack/image.sh keeps one image per cache).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hack import plugin_zipapp
from hack.localcluster import REPO, tools_bin

RELEASE_TOOLS = ("helm", "crane")
CHART_NAME = "sandkeep"
# SemVer 2.0 (Helm's and the chart's versions): x.y.z with an optional pre-release.
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Release:
    """What one release pushed."""

    version: str
    image: str  # REGISTRY/sandkeep@sha256:...
    chart: str  # oci://REGISTRY/charts/sandkeep
    chart_digest: str
    package: Path
    plugin: Path | None = None  # krew's manifest, beside the plugin's archives

    def lines(self) -> list[str]:
        lines = [
            f"image  {self.image}",
            f"chart  {self.chart} --version {self.version} ({self.chart_digest})",
            f"install: helm install sandkeep {self.chart} --version {self.version} --namespace sandkeep",
        ]
        if self.plugin is not None:
            archives = self.plugin.parent.glob(f"{plugin_zipapp.PLUGIN}-{self.version}-*.tar.gz")
            lines += [f"plugin {path}" for path in sorted(archives)]
            lines.append(f"krew: kubectl krew install --manifest={self.plugin} (its archives served at their uri)")
        return lines


def _run(cmd: Sequence[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}{result.stderr}".strip())
    return result.stdout + result.stderr


def build_image(source: Path = REPO, image_cache: Path | None = None) -> Path:
    """`hack/image.sh` of `source`: the docker archive's path (built only when that tree changed)."""
    env = dict(os.environ)
    if image_cache is not None:
        env["SANDKEEP_TOOLS_DIR"] = str(image_cache)
    out = _run(["bash", str(source / "hack" / "image.sh")], env=env)
    archive = next(line for line in out.splitlines() if line.endswith(".tar"))
    return Path(archive)


def push_image(archive: Path, registry: str, version: str, plain_http: bool) -> str:
    """crane-push the archive as REGISTRY/sandkeep:VERSION; the image by digest, as the registry stored it."""
    crane = str(tools_bin(RELEASE_TOOLS) / "crane")
    insecure = ["--insecure"] if plain_http else []
    repository = f"{registry}/{CHART_NAME}"
    _run([crane, "push", *insecure, str(archive), f"{repository}:{version}"])
    digest = _run([crane, "digest", *insecure, f"{repository}:{version}"]).strip()
    if not DIGEST.fullmatch(digest):
        raise RuntimeError(f"crane digest answered {digest!r} for {repository}:{version}")
    return f"{repository}@{digest}"


def _set_key(text: str, block: str | None, key: str, value: str) -> str:
    """`key: value` set in YAML text, at the top level or one level under the top-level `block:`; comments kept."""
    lines = text.splitlines(keepends=True)
    inside = block is None
    prefix = f"{key}:" if block is None else f"  {key}:"
    for i, line in enumerate(lines):
        if block is not None and line.startswith(f"{block}:"):
            inside = True
        elif block is not None and inside and line[:1] not in ("", " ", "#", "\n"):
            break  # the next top-level key: the block had no such key
        elif inside and line.startswith(prefix):
            lines[i] = f"{prefix} {value}\n"
            return "".join(lines)
    raise RuntimeError(f"no {key!r} {'at the top' if block is None else f'under {block!r}'} to set")


def package_chart(source: Path, version: str, image: str, out: Path) -> Path:
    """The chart of `source` packaged as VERSION with `image` (REPOSITORY@sha256:...) as its default: no symlinks."""
    if not SEMVER.match(version):
        raise ValueError(f"{version!r} is no SemVer version (x.y.z or x.y.z-pre)")
    repository, _, digest = image.partition("@")
    if not DIGEST.fullmatch(digest):
        raise ValueError(f"{image!r} names no sha256 digest")
    with tempfile.TemporaryDirectory(prefix="sandkeep-chart-") as tmp:
        staged = Path(tmp) / CHART_NAME
        # symlinks=False copies what a link names (files/crds -> crds/): Helm warns about links and packages
        # them as the files, but only where it runs; the package must hold the files themselves.
        shutil.copytree(source / "charts" / CHART_NAME, staged, symlinks=False)
        chart_yaml = staged / "Chart.yaml"
        text = _set_key(chart_yaml.read_text(), None, "version", version)
        chart_yaml.write_text(_set_key(text, None, "appVersion", f'"{version}"'))
        values = staged / "values.yaml"
        text = _set_key(values.read_text(), "image", "repository", repository)
        text = _set_key(text, "image", "tag", '""')
        values.write_text(_set_key(text, "image", "digest", f'"{digest}"'))
        out.mkdir(parents=True, exist_ok=True)
        _run([str(tools_bin(RELEASE_TOOLS) / "helm"), "package", str(staged), "--destination", str(out)])
    package = out / f"{CHART_NAME}-{version}.tgz"
    with tarfile.open(package) as tar:
        links = [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
    if links:
        raise RuntimeError(f"{package} holds links: {links}")
    return package


def push_chart(package: Path, registry: str, plain_http: bool) -> tuple[str, str]:
    """`helm push` to oci://REGISTRY/charts: the chart's reference (without version) and its digest."""
    cmd = [str(tools_bin(RELEASE_TOOLS) / "helm"), "push", str(package), f"oci://{registry}/charts"]
    out = _run([*cmd, "--plain-http"] if plain_http else cmd)
    found = re.search(r"^Digest: (sha256:[0-9a-f]{64})$", out, re.M)
    if not found:
        raise RuntimeError(f"helm push printed no digest:\n{out}")
    return f"oci://{registry}/charts/{CHART_NAME}", found.group(1)


def release(
    version: str,
    registry: str,
    plain_http: bool = False,
    source: Path = REPO,
    image_cache: Path | None = None,
    out: Path | None = None,
    plugin_uri_base: str | None = None,
) -> Release:
    """Build, push and package one release; see the module's docstring. With PLUGIN_URI_BASE, also the
    kubectl plugin's archives and krew manifest, for archives served from there."""
    if not SEMVER.match(version):
        raise ValueError(f"{version!r} is no SemVer version (x.y.z or x.y.z-pre)")
    if plugin_uri_base is not None and source.resolve() != REPO:
        raise ValueError("the kubectl plugin is built from this checkout only: --no-plugin with --source")
    tools_bin(RELEASE_TOOLS)  # fail before the image build when a tool is missing
    out = out or REPO / ".cache" / "release"
    image = push_image(build_image(source, image_cache), registry, version, plain_http)
    package = package_chart(source, version, image, out)
    chart, chart_digest = push_chart(package, registry, plain_http)
    plugin = None
    if plugin_uri_base is not None:
        uri_base = plugin_uri_base.format(version=version)
        plugin = plugin_zipapp.build(version, out, sorted(plugin_zipapp.PLATFORMS), uri_base)
    return Release(version, image, chart, chart_digest, package, plugin)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True, help="the release's SemVer version (x.y.z)")
    parser.add_argument("--registry", required=True, help="host[:port][/path] the image and chart are pushed under")
    parser.add_argument("--plain-http", action="store_true", help="the registry serves plain HTTP (a local one)")
    parser.add_argument("--source", type=Path, default=REPO, help="the checkout to release (default: this one)")
    parser.add_argument("--image-cache", type=Path, help="SANDKEEP_TOOLS_DIR for that checkout's hack/image.sh")
    parser.add_argument("--out", type=Path, help="where the chart package is written (default .cache/release)")
    parser.add_argument("--no-plugin", action="store_true", help="skip the kubectl plugin's archives and manifest")
    parser.add_argument(
        "--plugin-uri-base",
        default=plugin_zipapp.URI_BASE,
        help="where the plugin's archives will be served, for krew's manifest ({version} is replaced)",
    )
    args = parser.parse_args(argv)
    try:
        source = args.source.resolve()
        uri_base = None if args.no_plugin else args.plugin_uri_base
        pushed = release(args.version, args.registry, args.plain_http, source, args.image_cache, args.out, uri_base)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        print(f"release failed: {e}", file=sys.stderr)
        return 1
    print("\n".join(pushed.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
