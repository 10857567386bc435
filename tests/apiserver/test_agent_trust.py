"""The node agent trusting nothing, against the real local control plane: symlinks and mounts inside a
sandbox, SIGTERM, a second agent on the same root (the lock, the probes), a watch that gets only its node's
objects, and the longest names Kubernetes allows.

The bed is tests/bed/agentkit.py, its fixtures in this folder's conftest.py; the deletion itself is in
test_agent.py.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from controller.agent import watch as agent_watch
from controller.api import kube
from controller.rules import contracts as c
from tests.bed.agentkit import Node, adopted, delete, get, make_object, tombstones, wait_for

REPO = Path(__file__).resolve().parents[2]


# --- trust nothing -------------------------------------------------------------------------------------


def test_a_symlink_inside_a_sandbox_pointing_outside_the_root_is_never_followed(
    cluster, namespace, nodes, agents, tmp_path
):
    n1, _ = nodes
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    path = n1.retain(namespace, "linky")
    (path / "workspace" / "escape").symlink_to(outside)
    (path / "workspace" / "escape-file").symlink_to(outside / "keep.txt")
    (n1.root.path / namespace / "evil").symlink_to(outside)  # a sandbox name that is a link out of the root
    make_object(cluster, namespace, "evil", n1.name)
    agents(n1)
    adopted(cluster, namespace, "linky")
    adopted(cluster, namespace, "evil")
    delete(cluster, namespace, "linky")
    delete(cluster, namespace, "evil")
    wait_for(lambda: get(cluster, namespace, "linky") is None and get(cluster, namespace, "evil") is None)
    assert (outside / "keep.txt").read_text() == "keep me"
    assert not path.exists()
    assert (n1.root.path / namespace / "evil").is_symlink()  # never followed, never renamed: only reported


def test_a_mount_inside_a_sandbox_holds_deletion_and_its_files_survive(cluster, namespace, nodes, agents, tmp_path):
    n1, _ = nodes
    other_fs = tmp_path / "other-filesystem"
    other_fs.mkdir()
    (other_fs / "data").write_text("not the sandbox's")
    path = n1.retain(namespace, "mounted-in", {"sub/.keep": ""})
    point = path / "workspace" / "sub"
    subprocess.run(["mount", "--bind", str(other_fs), str(point)], check=True)
    try:
        agents(n1)
        adopted(cluster, namespace, "mounted-in")
        delete(cluster, namespace, "mounted-in")
        held = wait_for(
            lambda: (o := get(cluster, namespace, "mounted-in")) and o["status"].get("phase") == "Held" and o
        )
        assert f"mount at {point}" in held["status"]["heldBy"]
        assert (other_fs / "data").read_text() == "not the sandbox's"
    finally:
        subprocess.run(["umount", str(point)], check=False)
    wait_for(lambda: get(cluster, namespace, "mounted-in") is None, what="deleted once unmounted")
    assert (other_fs / "data").read_text() == "not the sandbox's"


def test_sigterm_stops_the_agent_cleanly_once_its_watch_runs(cluster, namespace, nodes, agents):
    # Once its watch runs, the agent must still stop on SIGTERM, not linger until a SIGKILL (the kubelet's
    # grace period) with a watch request open.
    n1, _ = nodes
    make_object(cluster, namespace, "seen", n1.name)
    agent = agents(n1)
    agent.metrics_port()
    wait_for(lambda: "watch_listed" in agent.log(), what="the watch's listing done")
    wait_for(
        lambda: (
            get(cluster, namespace, "seen")
            and c.FINALIZER in get(cluster, namespace, "seen")["metadata"].get("finalizers", [])
        ),
        what="the object seen",
    )
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0, agent.log()[-3000:]
    assert "agent_stopped" in agent.log()


def probe(port: int, path: str) -> int:
    """The HTTP status of a kubelet's probe of `path`."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_a_second_agent_on_the_same_root_waits_for_the_lock(cluster, namespace, nodes, agents):
    n1, _ = nodes
    first = agents(n1)
    first.metrics_port()
    second = agents(n1)
    wait_for(lambda: "root_locked_waiting" in second.log(), what="second agent waiting")
    assert "agent_started" not in second.log()
    # Alive while it waits (a kubelet's liveness probe leaves it be), not Ready: it does nothing yet.
    assert probe(second.metrics_port(), "/healthz") == 200
    assert probe(second.metrics_port(), "/readyz") == 503
    first.stop()
    wait_for(lambda: "agent_started" in second.log(), what="second agent took over")
    assert "root_lock_acquired" in second.log()


def test_the_agents_watch_gets_only_its_nodes_objects_from_the_api_server(cluster, namespace, nodes):
    # The agent's watch carries the field selector spec.nodeName=<node>: the API server filters, so other
    # nodes' objects never cross the wire (the handler here has no client-side filter of its own).
    n1, n2 = nodes
    make_object(cluster, namespace, "mine", n1.name)
    make_object(cluster, namespace, "theirs", n2.name)
    client = kube.Kube(kube.load_config(str(cluster.kubeconfig)), component="test-watch")
    seen: list[tuple[str | None, str]] = []

    def record(event_type: str | None, obj: dict[str, Any]) -> None:
        if obj["metadata"]["namespace"] == namespace:
            seen.append((event_type, obj["metadata"]["name"]))

    async def watch_until_later_create() -> None:
        lister = agent_watch.sandboxes(client, n1.name, record, lambda _seen: None)
        task = asyncio.create_task(lister.run())
        await lister.synced.wait()
        assert (None, "mine") in seen, "the listing"
        await asyncio.to_thread(make_object, cluster, namespace, "theirs-later", n2.name)
        await asyncio.to_thread(make_object, cluster, namespace, "mine-later", n1.name)
        while ("ADDED", "mine-later") not in seen:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(watch_until_later_create(), timeout=60))
    finally:
        client.close()
    assert {name for _, name in seen} == {"mine", "mine-later"}


def test_the_longest_names_are_retained_adopted_opened_pinned_and_deleted(cluster, crd, namespace, tmp_path, agents):
    """Every valid Kubernetes name works end to end (issue 12, item 11): a 253-character sandbox in a
    63-character namespace on a 253-character node is retained on disk, adopted by the real agent (its node
    label bounded), opened with `sandkeep exec`, pinned with kubectl, and deleted from disk on request."""
    seed = secrets.token_hex(3)
    sandkeep_exec = [sys.executable, "-m", "controller.cli.sandkeep", "exec"]

    def longest(prefix: str) -> str:  # a 253-character DNS-1123 subdomain
        part = (prefix + seed + "x" * 63)[:63]
        return ".".join([part, part, part, part[:61]])

    long_ns = (f"l{seed}" + "n" * 63)[:63]
    name, node_name = longest("s"), longest("o")
    cluster.kubectl("create", "namespace", long_ns)
    node = Node(cluster, tmp_path, "long", name=node_name)
    try:
        src = tmp_path / "job-long"  # Node.retain names the source after both names: too long for one component
        src.mkdir()
        (src / "data.txt").write_text("payload")
        node.root.retain(
            src, long_ns, name, job_id="job-long", created_at=datetime.now(UTC), retention=timedelta(hours=1)
        )
        path = node.root.path / long_ns / name
        a = agents(node)
        obj = adopted(cluster, long_ns, name)
        label = obj["metadata"]["labels"][c.LABEL_NODE]
        assert len(label) <= 63 and obj["spec"]["nodeName"] == node_name
        opened = subprocess.run(
            [*sandkeep_exec, f"{long_ns}/{name}", "--root", str(node.root.path), "--", "cat", "data.txt"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert opened.returncode == 0 and opened.stdout == "payload", opened.stderr
        cluster.kubectl("annotate", "rsb", name, "-n", long_ns, f"{c.ANN_PIN_FOR}=72h")
        assert get(cluster, long_ns, name)["metadata"]["annotations"][c.ANN_PIN_FOR] == "72h"  # type: ignore[index]
        delete(cluster, long_ns, name)
        wait_for(lambda: get(cluster, long_ns, name) is None and not path.exists(), what="deleted from disk")
        assert tombstones(node) == []
        assert not re.search(r"(?<![.\d])422(?!\d)|Unprocessable", a.log())
    finally:
        cluster.kubectl("delete", "namespace", long_ns, "--wait=false", "--ignore-not-found", check=False)
        cluster.kubectl("delete", "node", node_name, "--wait=false", "--ignore-not-found", check=False)
