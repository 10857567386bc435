"""What a real node needs on this machine before it starts: the Debian packages (installed when missing) and
the Pod sandbox image, built locally from hack/node/pause.c (no registry is reachable here). Used by
hack/localnode.py and the release tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from hack.localcluster import ClusterError

# What the node needs from Debian, by command: `make node` and the tests install these when missing.
DEBIAN_PACKAGES = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "socat": "socat",
    "unshare": "util-linux",
    "ip": "iproute2",
    "cc": "gcc",
}
CNI_PLUGINS = Path("/usr/lib/cni")  # containernetworking-plugins
HERE = Path(__file__).resolve().parent / "node"
PAUSE_IMAGE = "sandkeep.local/pause"


def missing_packages() -> list[str]:
    """The Debian packages whose commands (or the CNI plugins) are not on this machine."""
    need = {pkg for cmd, pkg in DEBIAN_PACKAGES.items() if shutil.which(cmd) is None}
    if not (CNI_PLUGINS / "bridge").exists():
        need.add("containernetworking-plugins")
    return sorted(need)


def install_packages() -> None:
    """apt-get install what the node needs (as root); raise with the list to install otherwise."""
    need = missing_packages()
    if not need:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"the local node needs these Debian packages: {' '.join(need)} (apt-get install them)")
    print(f"[node] installing Debian packages: {' '.join(need)}", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *need], check=True, env=env, stdout=subprocess.DEVNULL)


def pause_image(cache: Path) -> tuple[Path, str]:
    """An OCI archive of the Pod sandbox image (hack/node/pause.c, built static), cached by its source.

    No registry is reachable here, so containerd's sandbox image is made locally: one layer holding
    /pause, a config whose entrypoint it is, in an OCI image layout `ctr images import` reads.
    """
    source = (HERE / "pause.c").read_bytes()
    key = hashlib.sha256(source).hexdigest()[:12]
    ref = f"{PAUSE_IMAGE}:{key}"
    archive = cache / f"pause-{key}.tar"
    if archive.exists():
        return archive, ref
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(["cc", "-static", "-O2", "-o", str(binary), str(HERE / "pause.c")], check=True)
        layer = _tar({"pause": (binary.read_bytes(), 0o755)})
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"]},
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
        blobs = {}
        config_blob = json.dumps(config).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": _descriptor("application/vnd.oci.image.config.v1+json", config_blob),
            "layers": [_descriptor("application/vnd.oci.image.layer.v1.tar", layer)],
        }
        manifest_blob = json.dumps(manifest).encode()
        for blob in (layer, config_blob, manifest_blob):
            blobs[f"blobs/sha256/{_digest(blob).removeprefix('sha256:')}"] = (blob, 0o644)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    **_descriptor("application/vnd.oci.image.manifest.v1+json", manifest_blob),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": key},
                }
            ],
        }
        files = {
            "oci-layout": (b'{"imageLayoutVersion":"1.0.0"}', 0o644),
            "index.json": (json.dumps(index).encode(), 0o644),
            **blobs,
        }
        partial = Path(tmp) / "image.tar"
        partial.write_bytes(_tar(files))
        partial.rename(archive)
    return archive, ref


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}


def _tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
