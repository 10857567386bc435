"""A real OCI registry for the test bed and `make release`: CNCF Distribution's `registry`, built from its pinned
module (hack/tools/registry) by hack/tools/build.sh, serving plain HTTP on one address of this machine.

    with LocalRegistry(workdir) as registry:              # 127.0.0.1, a free port
        helm push chart.tgz oci://{registry.host}/charts --plain-http

The real node's containerd reaches it at `hack.localnode.REGISTRY` (the host's end of the node's link, a fixed
port), through the `hosts.toml` the node writes for it. Storage is a directory under `workdir`; `stop()` ends
the process by its pid (its own process group) and leaves the directory to the caller.

`python -m hack.registry [--addr HOST:PORT]` serves one until Ctrl-C, for `make release REGISTRY=...` by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from hack.localcluster import ClusterError, tools_bin
from hack.processes import Component, Lifecycle, free_port, spawn, tail


class LocalRegistry(Lifecycle):
    """One `registry serve` on `addr` (default 127.0.0.1 and a free port), its blobs under `workdir/registry`."""

    def __init__(self, workdir: Path, addr: str | None = None) -> None:
        self.workdir = workdir
        self.host = addr or f"127.0.0.1:{free_port()}"
        self.component: Component | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self, timeout: float = 30.0) -> None:
        binary = tools_bin(("registry",)) / "registry"
        storage = self.workdir / "registry"
        storage.mkdir(parents=True, exist_ok=True)
        config = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
            "http": {"addr": self.host},
        }
        config_file = self.workdir / "registry.yaml"
        config_file.write_text(yaml.safe_dump(config))
        log = self.workdir / "registry.log"
        self.component = spawn("registry", [str(binary), "serve", str(config_file)], log)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if (code := self.component.proc.poll()) is not None:
                self.component = None
                raise ClusterError(f"the registry exited ({code}) on {self.host}:\n{tail(log, 20)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(f"the registry did not answer {self.url}/v2/ in {timeout:.0f}s:\n{tail(log, 20)}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{self.url}/v2/", timeout=2) as response,
        ):
            return bool(response.status == 200)
        return False

    def logtail(self, lines: int = 20) -> str:
        return f"----- registry ({self.host}) -----\n{tail(self.workdir / 'registry.log', lines)}"

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()
            self.component = None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", help="HOST:PORT to serve on (default 127.0.0.1 and a free port)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sandkeep-registry-") as tmp, LocalRegistry(Path(tmp), args.addr) as reg:
        print(f"registry at {reg.host} (plain HTTP); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
