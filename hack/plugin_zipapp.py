"""The `kubectl sandkeep` plugin as one file that needs only `python3` (3.11+), and its krew manifest.

    python -m hack.plugin_zipapp --version 0.2.0 [--out DIR] [--platform linux/amd64 ...] [--uri-base URL]

For each platform, `kubectl-sandkeep-VERSION-OS-ARCH.tar.gz` holds `kubectl-sandkeep`, a zipapp
(`python -m zipapp`'s format: a `#!/usr/bin/env python3` line, then a zip) carrying the `controller` package and
the plugin's dependencies from this venv, and LICENSE. `sandkeep.yaml` beside them is krew's `Plugin` manifest
for those archives (uri, sha256, bin per platform).

What it carries: the closure of kubernetes, pydantic, pydantic-settings and PyYAML's requirements, without
aiohttp's (the kubernetes client's asyncio side, which the plugin never imports) and without grpc (only the
CSI node plugin uses it). Every module is pure Python and imported from the zip, except one: pydantic-core
(which pydantic, and the kubernetes client itself, import) is compiled and has no pure fallback. So the archive
is per platform: it carries pydantic-core's extension for each CPython of PYTHONS (the file names carry the ABI
tag, so they sit side by side: `_pydantic_core.cpython-312-x86_64-linux-gnu.so`), taken from that version's
wheel (`pip download`, cached in .cache/plugin-wheels) or, for this interpreter's own, from this venv. Python
cannot import an extension from inside a zip, so on its first run the zipapp extracts pydantic-core's package,
with only the extension for the running interpreter, into `$XDG_CACHE_HOME/sandkeep/kubectl-plugin/BUILD`
(BUILD hashes the archive's contents) and imports it from there. The other compiled extensions in this venv
(PyYAML's `_yaml`, charset-normalizer's mypyc modules) are left out: those packages fall back to pure Python.
Python writes no bytecode for modules in a zip, so the first run of each CPython also writes every module
compiled, with the data files, to `BUILD/cpython-3XX.zip` (about 18 MB, 5 s once) and imports from that:
a run then starts as fast as the venv's (0.5 s for `--version` here, against 1.4 to 2.4 s from the sources).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from importlib.metadata import Distribution, distribution
from pathlib import Path

import yaml

from controller.cli.kubectl_complete import EXECUTABLE as COMPLETE
from hack.localcluster import REPO

PLUGIN = "kubectl-sandkeep"
ROOTS = ("kubernetes", "pydantic", "pydantic-settings", "PyYAML")
LEFT_OUT = frozenset({"aiohttp", "aiohttp-retry"})
COMPILED = "pydantic_core"  # the one package whose extension the plugin cannot do without
STAGED = "_compiled"  # where the zip carries it, out of the import path until extracted
PYTHONS = ("3.11", "3.12", "3.13", "3.14")
# krew's platform selector -> the wheel platform tag pydantic-core publishes for it.
PLATFORMS = {
    "linux/amd64": "manylinux_2_17_x86_64",
    "linux/arm64": "manylinux_2_17_aarch64",
    "darwin/amd64": "macosx_10_12_x86_64",
    "darwin/arm64": "macosx_11_0_arm64",
}
URI_BASE = "https://github.com/sandkeep/sandkeep/releases/download/v{version}"  # {version}: the release's
HOST = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}
WHEELS = REPO / ".cache" / "plugin-wheels"
# Zip and tar members get a fixed time, so one tree gives one archive (and one sha256).
EPOCH = (1980, 1, 1, 0, 0, 0)

MAIN = '''\
"""`kubectl sandkeep`, as one file (hack/plugin_zipapp.py builds it)."""
import importlib.machinery, importlib.util, marshal, os, shutil, sys, zipfile
BUILD = {build!r}
if sys.version_info < (3, 11):
    sys.exit("error: kubectl-sandkeep needs python3 3.11 or later; this python3 is %d.%d" % sys.version_info[:2])
archive = os.path.abspath(sys.argv[0])
cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sandkeep", "kubectl-plugin")
here = os.path.join(cache, BUILD)
if not os.path.isdir(here):  # first run of this build: pydantic-core's package, with this interpreter's extension
    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    with zipfile.ZipFile(archive) as z:
        names = [n for n in z.namelist() if n.startswith("{staged}/") and (n.endswith(ext) or not n.endswith(".so"))]
        if not any(n.endswith(ext) for n in names):
            sys.exit("error: this kubectl-sandkeep carries pydantic-core for CPython %s only, not for this "
                     "python3 (%s); use the archive for this platform, or another python3" % ({pythons!r}, ext))
        staging = "%s.%d" % (here, os.getpid())
        z.extractall(staging, names)
    try:
        os.rename(os.path.join(staging, "{staged}"), here)
    except OSError:  # another run got there first
        pass
    shutil.rmtree(staging, ignore_errors=True)
# Python writes no bytecode for a zip, so each run would compile every module again (about a second): the
# first run of each CPython writes them, compiled, with the data files, to a zip of its own.
code = os.path.join(here, sys.implementation.cache_tag + ".zip")
if not os.path.exists(code):
    try:
        partial = "%s.%d" % (code, os.getpid())
        with zipfile.ZipFile(archive) as z, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
            for n in z.namelist():
                if n.startswith("{staged}/") or n == "__main__.py" or n.endswith("/"):
                    continue
                data = z.read(n)
                if n.endswith(".py"):
                    compiled = compile(data, os.path.join(archive, n), "exec", dont_inherit=True)
                    data, n = importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(compiled), n + "c"
                out.writestr(n, data)
        os.replace(partial, code)
    except OSError:  # a cache it cannot write: run from the sources
        code = archive
sys.path[0:0] = [here, code]
from controller.cli.kubectl_plugin import main
sys.exit(main())
'''


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: Sequence[str] = ROOTS) -> list[Distribution]:
    """The installed distributions the plugin needs: ROOTS and their requirements, without LEFT_OUT's."""
    seen: dict[str, Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in seen or _key(name) in LEFT_OUT:
            continue
        dist = distribution(name)
        seen[_key(name)] = dist
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return sorted(seen.values(), key=lambda d: _key(d.metadata["Name"]))


def _wanted(rel: str) -> bool:
    parts = rel.split("/")
    if rel.startswith("..") or "__pycache__" in parts or parts[0] in ("bin", "tests"):
        return False
    if parts[0] == "kubernetes" and len(parts) > 1 and parts[1] in ("test", "e2e_test"):
        return False
    return not rel.endswith((".so", ".pyc", ".pyi", ".pyd"))


def members(dists: Sequence[Distribution]) -> Iterator[tuple[str, Path]]:
    """(name in the zip, file): the distributions' pure files; pydantic-core's under COMPILED/."""
    for dist in dists:
        for f in dist.files or []:
            rel = str(f)
            if not _wanted(rel):
                continue
            name = f"{STAGED}/{rel}" if rel.split("/")[0] == COMPILED else rel
            yield name, Path(str(dist.locate_file(f)))
    for path in sorted((REPO / "controller").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("controller/csi/"):  # grpc's, the CSI node plugin's only
            yield rel, path


def extensions(platform: str, pythons: Sequence[str]) -> dict[str, bytes]:
    """pydantic-core's compiled extension for each CPython in PYTHONS on PLATFORM: {file name: bytes}."""
    core = distribution("pydantic-core")
    version = core.version
    found: dict[str, bytes] = {}
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    for py in pythons:
        if py == this and platform == HOST.get(sysconfig.get_platform().split("-")[-1]):
            so = next(f for f in core.files or [] if str(f).endswith(".so"))
            found[Path(str(so)).name] = Path(str(core.locate_file(so))).read_bytes()
            continue
        tag = PLATFORMS[platform]
        dest = WHEELS / f"{version}-{py}-{tag}"
        if not list(dest.glob("*.whl")):
            dest.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
            command += ["--platform", tag, "--python-version", py, "--implementation", "cp", "-d", str(dest)]
            subprocess.run([*command, f"pydantic-core=={version}"], check=True)
        with zipfile.ZipFile(next(dest.glob("*.whl"))) as wheel:
            for name in wheel.namelist():
                if name.startswith(f"{COMPILED}/") and name.endswith(".so"):
                    found[Path(name).name] = wheel.read(name)
    return found


def _add(z: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    z.writestr(info, data)


def zipapp(version: str, platform: str, pythons: Sequence[str] = PYTHONS) -> bytes:
    """The plugin as one executable file for PLATFORM: the zipapp's bytes, shebang included."""
    files = sorted(dict(members(closure())).items())
    payload = [(name, path.read_bytes()) for name, path in files]
    payload += [(f"{STAGED}/{COMPILED}/{so}", data) for so, data in sorted(extensions(platform, pythons).items())]
    # importlib.metadata finds this in the zip, so `kubectl sandkeep --version` names the release.
    metadata = f"Metadata-Version: 2.1\nName: sandkeep\nVersion: {version}\n"
    payload.append((f"sandkeep-{version}.dist-info/METADATA", metadata.encode()))
    digest = hashlib.sha256(MAIN.encode())
    for name, data in payload:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    build = f"{version}-{digest.hexdigest()[:16]}"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compresslevel=9) as z:
        _add(z, "__main__.py", MAIN.format(build=build, staged=STAGED, pythons=" ".join(pythons)).encode())
        for name, data in payload:
            _add(z, name, data)
    return b"#!/usr/bin/env python3\n" + buf.getvalue()


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def archive(version: str, platform: str, out: Path, pythons: Sequence[str] = PYTHONS) -> Path:
    """`kubectl-sandkeep-VERSION-OS-ARCH.tar.gz` in OUT: the zipapp and LICENSE."""
    os_, arch = platform.split("/")
    path = out / f"{PLUGIN}-{version}-{os_}-{arch}.tar.gz"
    out.mkdir(parents=True, exist_ok=True)
    # gzip's header carries no name or time (mtime=0), so the sha256 depends only on the contents.
    with (
        tempfile.NamedTemporaryFile(dir=out, delete=False) as tmp,
        gzip.GzipFile(filename="", mode="wb", fileobj=tmp, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        _tar_add(tar, PLUGIN, zipapp(version, platform, pythons), 0o755)
        _tar_add(tar, "LICENSE", (REPO / "LICENSE").read_bytes(), 0o644)
    Path(tmp.name).chmod(0o644)
    Path(tmp.name).replace(path)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(version: str, archives: dict[str, Path], uri_base: str) -> dict[str, object]:
    """krew's `Plugin` for ARCHIVES ({platform: archive}), each fetched from URI_BASE/<archive's name>."""
    platforms = []
    for platform, path in sorted(archives.items()):
        os_, arch = platform.split("/")
        platforms.append(
            {
                "selector": {"matchLabels": {"os": os_, "arch": arch}},
                "uri": f"{uri_base.rstrip('/')}/{path.name}",
                "sha256": sha256(path),
                "bin": PLUGIN,
                "files": [{"from": PLUGIN, "to": "."}, {"from": "LICENSE", "to": "."}],
            }
        )
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "sandkeep"},
        "spec": {
            "version": f"v{version}",
            "homepage": "https://github.com/sandkeep/sandkeep",
            "shortDescription": "List, pin, open and copy from kept job workspaces",
            "description": (
                "kubectl sandkeep lists the workspaces sandkeep keeps on nodes after their jobs finish, pins them\n"
                "past their retention window, opens a shell in one, copies files out of it, and reports what\n"
                "needs a person (doctor). Needs python3 (3.11 or later) on PATH.\n"
            ),
            "caveats": (
                "Needs python3 3.11 or later on PATH. For shell completion (kubectl 1.26+), run once:\n"
                f'  ln -s {PLUGIN} "${{KREW_ROOT:-$HOME/.krew}}/bin/{COMPLETE}"\n'
            ),
            "platforms": platforms,
        },
    }


def build(version: str, out: Path, platforms: Sequence[str], uri_base: str, pythons: Sequence[str] = PYTHONS) -> Path:
    """The archives and `sandkeep.yaml` in OUT; returns the manifest's path."""
    archives = {p: archive(version, p, out, pythons) for p in platforms}
    path = out / "sandkeep.yaml"
    path.write_text(yaml.safe_dump(manifest(version, archives, uri_base), sort_keys=False))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True, help="the release's version (x.y.z)")
    parser.add_argument("--out", type=Path, default=REPO / ".cache" / "release", help="where the files are written")
    parser.add_argument("--platform", action="append", choices=sorted(PLATFORMS), help="(repeatable; default: all)")
    parser.add_argument("--python", action="append", help=f"CPython versions to carry (default: {' '.join(PYTHONS)})")
    parser.add_argument(
        "--uri-base",
        default=URI_BASE,
        help="where the archives are served from ({version} is replaced)",
    )
    args = parser.parse_args(argv)
    platforms = args.platform or sorted(PLATFORMS)
    path = build(args.version, args.out, platforms, args.uri_base.format(version=args.version), args.python or PYTHONS)
    for line in path.read_text().splitlines():
        if line.strip().startswith(("uri:", "sha256:")):
            print(line.strip())
    print(f"manifest {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
