"""The node agent's bed against the real local control plane: simulated nodes, the agent as a real process.

- `Node`: a node object on the API server and a root of its own (`retain` puts a finished run there).
- `AgentProcess`: `sandkeep agent` as a real process for one node, its log in a file, stopped by pid.
- `get`, `adopted`, `cond`, `make_object`, `delete`, `tombstones`: the sandbox as the server and the disk
  have it, and the requests a person makes.
- `orphans_of_a_killed_exec`: processes left in a sandbox by a `sandkeep exec` whose recorder was killed.
- `wait_for(check, timeout, what)`: polls until `check()` is truthy.

The fixtures that start them (`crd`, `nodes`, `agents`, `procs`) are in tests/apiserver/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from controller.api import kube
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules import objects
from tests.bed import controller_harness
from tests.bed.procs import IGNORE

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "sandkeep.io_retainedsandboxes.yaml"
T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout: float = 30.0, what: str = "condition") -> T:
    """`controller_harness.wait_for` in the argument order the agent's tests use (the check first)."""
    return controller_harness.wait_for(what, check, timeout)


class Node:
    def __init__(self, cluster: Any, tmp: Path, label: str, name: str | None = None) -> None:
        self.name = name or f"{label}-{secrets.token_hex(3)}"
        cluster.create_node(self.name)
        self.root = Root(tmp / f"root-{label}")
        self.cluster = cluster

    def retain(self, namespace: str, name: str, files: dict[str, str] | None = None) -> Path:
        src = self.root.path.parent / f"job-{self.name}-{name}"
        src.mkdir()
        for rel, text in (files or {"README": "hello"}).items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
        self.root.retain(
            src, namespace, name, job_id=f"job-{name}", created_at=datetime.now(UTC), retention=timedelta(hours=1)
        )
        return self.root.path / namespace / name


class AgentProcess:
    """`sandkeep agent` as a real process; its log in a file; stopped by pid."""

    def __init__(
        self,
        cluster: Any,
        node: Node,
        namespace: str,
        log: Path,
        env: dict[str, str] | None = None,
        kubeconfig: Path | None = None,
        extra: list[str] | None = None,
        wrap: list[str] | None = None,
    ):
        flags = {
            "--node": node.name,
            "--root": str(node.root.path),
            "--kubeconfig": str(kubeconfig or cluster.kubeconfig),
            "--lease-namespace": namespace,
            "--metrics-port": "0",
            "--scan-interval": "1s",
            "--stuck-after": "2s",
            "--orphan-timeout": "2s",
            "--lock-wait": "0",
            # Releasing for space off unless a test turns it on: these roots share the host's disk, and a
            # host above 85% used must not make the agent release the sandboxes a test is about.
            "--pressure-high": "100",
            "--pressure-low": "99",
        }
        cli = [*(wrap or []), sys.executable, "-m", "controller.cli.sandkeep"]  # wrap: e.g. strace, to record its calls
        args = [*cli, "agent", *(part for kv in flags.items() for part in kv)]
        for pid in IGNORE:
            args += ["--ignore-pid", str(pid)]
        args += extra or []  # a flag given again wins (argparse keeps the last)
        self.log_path = log
        self.log_file = log.open("ab")
        self.proc = subprocess.Popen(
            args, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics_port(self) -> int:
        found = wait_for(lambda: re.search(r"metrics_port=(\d+)", self.log()), 30, "agent start")
        return int(found.group(1))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port()}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()


def get(cluster: Any, namespace: str, name: str) -> dict[str, Any] | None:
    """The sandbox as the API server has it now, None when it is gone (an HTTP GET: the waits poll this)."""
    found: dict[str, Any] | None = cluster.read(kube.sandbox_path(namespace, name))
    return found


def adopted(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    """Wait until the agent has adopted `name`: the object exists and carries its finalizer."""
    return wait_for(
        lambda: (o := get(cluster, namespace, name)) and o["metadata"].get("finalizers") and o, what=f"{name} adopted"
    )


def cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return None if obj is None else objects.condition_of(obj, type_)


def make_object(cluster: Any, namespace: str, name: str, node: str, workspace: str | None = None) -> None:
    body: dict[str, Any] = {
        "apiVersion": c.API_VERSION,
        "kind": c.SANDBOX_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": node, "createdAt": "2026-01-01T00:00:00Z"},
    }
    if workspace is not None:
        body["spec"]["workspace"] = {"path": workspace}
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))


def delete(cluster: Any, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "rsb", name, "-n", namespace, "--wait=false")


def tombstones(node: Node) -> list[str]:
    return sorted(p.name for p in node.root.path.iterdir() if p.name.startswith(c.TOMBSTONE_PREFIX))


def orphans_of_a_killed_exec(node: Node, namespace: str, name: str, script: str) -> list[int]:
    """Run `script` (which prints "ready" and leaves two children) with `sandkeep exec` in the sandbox,
    wait until its leader and both children are recorded, SIGKILL the recorder; the recorded pids."""
    flags = getattr(node, "exec_flags", ())  # a caller whose sandbox is already expired opens it under its own window
    argv = ["exec", f"{namespace}/{name}", "--root", str(node.root.path), *flags, "--", "sh", "-c", script]
    cli = [sys.executable, "-m", "controller.cli.sandkeep"]
    recorder = subprocess.Popen([*cli, *argv], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert recorder.stdout is not None and recorder.stdout.readline().strip() == "ready"
    records = node.root.path / namespace / name / c.COMMANDS_DIR
    wait_for(lambda: any(len(json.loads(f.read_text())["members"]) >= 2 for f in records.glob("*.json")))
    record = json.loads(next(records.glob("*.json")).read_text())
    recorder.kill()  # the recorder dies; its command group runs on, cwd inside the sandbox
    recorder.wait()
    return [record["leader"]["pid"], *(m["pid"] for m in record["members"])]
