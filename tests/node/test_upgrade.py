"""Upgrade as a user does, on two real nodes: the previous release, made by this tree's `make release`
(hack/release.py) from a pinned earlier commit of main, installed from the bed's registry by version and
keeping 202 sandboxes (180 retained, 20 pinned past their retention, one held by a Pod, one being deleted
(an immutable file keeps its tombstone until after the upgrade)) and adopting 600 more as the upgrade starts,
then upgraded to this tree's release with the commands of docs/operations.md#upgrade run as written, then
rolled back with the doc's `helm rollback`.

Afterwards: no pin lost, nothing deleted that should stay, the deletion in flight finished exactly once and
every sandbox adopted by exactly one create (counted by the API server's audit log, across the old and the new
agents), the adoption under way carried on by the new agent, the agents replaced node by node, the controllers
by the new image, every object still read.

The earlier commit's tree comes from `git archive` (nothing is added to the repository's worktrees), its image
is built by its own hack/image.sh into a cache of its own under $SANDKEEP_TOOLS_DIR/previous/<commit> (a few
minutes once; reused afterwards), seeded with this tree's Debian base.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from controller.rules import contracts as c
from hack.localcluster import tools_bin, tools_dir
from hack.localnode import REGISTRY, LocalNode
from hack.release import Release
from tests.bed import audit
from tests.bed.e2e_bed import E2E_VERSION, SYSTEM_NS, LocalBed, eventually, one_node_at_a_time, rolled_to, say
from tests.node.test_e2e import phase, rsb

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("e2e"), pytest.mark.timeout(2400)]
# The last commit of main that CI landed before this one (2026-12-05): its chart and image are "the previous
# release". It has the PID-namespace fix (6bce8ed); 5c1727b, before it, took a Job's young retain stage for a
# crashed one while the 600 late retains ran, and the Job failed (under load) with its stage swept.
PREVIOUS = "20ad8e987bdb14e9c50c9a46ade4905fbe4bb647"
PREVIOUS_VERSION = f"0.0.0-main.{PREVIOUS[:7]}"
NS = "e2e"
KEPT, PINNED = 180, 20
LATE = 600  # retained just before the upgrade: adopted (at the agent's 10 a second) while it rolls
NODES = 2  # so that the agents roll node by node
OPERATIONS = REPO / "docs" / "operations.md"


def previous_source(commit: str = PREVIOUS) -> tuple[Path, Path]:
    """The commit's tree (extracted once) and the image cache its hack/image.sh builds into."""
    cache = tools_dir().parent / "previous" / commit
    src = cache / "src"
    if not (cache / "src.complete").exists():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        (cache / "src.complete").touch()
    venv = src / ".venv"  # its hack/protos.sh runs this venv's grpcio-tools
    if venv.is_symlink() and os.readlink(venv) != str(REPO / ".venv"):
        venv.unlink()  # another checkout's: the cache outlives clones, which may be gone
    if not venv.is_symlink():
        venv.symlink_to(REPO / ".venv")
    # The Debian base is made by the same recipe (mmdebstrap, about 2 minutes): reuse this tree's.
    (cache / "image").mkdir(exist_ok=True)
    for base in (tools_dir().parent / "image").glob("base-*.tar"):
        if not (cache / "image" / base.name).exists():
            shutil.copy2(base, cache / "image" / base.name)
    return src, cache


def doc_blocks(path: Path, heading: str) -> list[str]:
    """The ```sh blocks of one `## heading` section (its ### subsections included), in order."""
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```sh\n(.*?)```", text[start : end if end > 0 else None], re.S)


def run_doc(bed: LocalBed, block: str, version: str) -> str:
    """A block of the doc as written, by bash, with REGISTRY and VERSION set as a user following it would and
    the built helm and kubectl first on PATH. The bed's registry is plain HTTP: the `helm` on PATH is a
    wrapper adding --plain-http to the commands that reach a registry, so the doc's text runs unchanged."""
    wrapper_dir = bed.workdir / "doc-bin"
    wrapper_dir.mkdir(exist_ok=True)
    helm = wrapper_dir / "helm"
    helm.write_text(
        "#!/bin/sh\n"
        f'case "$1" in install|upgrade|pull|show|template) exec {bed.bin}/helm "$@" --plain-http ;; esac\n'
        f'exec {bed.bin}/helm "$@"\n'
    )
    helm.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{wrapper_dir}:{tools_bin(('helm', 'kubectl'))}:{os.environ['PATH']}",
        "KUBECONFIG": str(bed.kubeconfig),
        "REGISTRY": REGISTRY,
        "VERSION": version,
    }
    say(f"docs/operations.md, as written (VERSION={version}):\n{block.strip()}")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"the doc's commands failed:\n{block}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def sandboxes(bed: LocalBed) -> dict[str, dict[str, object]]:
    return {o["metadata"]["name"]: o for o in bed.get("rsb", "-n", NS)["items"]}


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalBed, Release, Release]]:
    bed = LocalBed(tmp_path_factory.mktemp("upgrade"), count=NODES)
    src, cache = previous_source()
    bed.start_node()
    try:
        previous = bed.publish(PREVIOUS_VERSION, source=src, image_cache=cache)
        current = bed.publish(E2E_VERSION)
        bed.image_ref, bed.chart, bed.chart_version = previous.image, previous.chart, previous.version
        bed._install()
        bed.job_namespace(NS)
        yield bed, previous, current
    except BaseException:
        bed.cluster.failed = True
        raise
    finally:
        bed.stop()


def agent_created(bed: LocalBed, on: LocalNode, image: str) -> datetime:
    """When the agent Pod of `image` on node `on` was created (its predecessor had stopped by then)."""
    pods = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"]
    (pod,) = [p for p in pods if p["spec"]["nodeName"] == on.name and p["spec"]["containers"][0]["image"] == image]
    return datetime.fromisoformat(pod["metadata"]["creationTimestamp"])


def test_the_previous_release_upgrades_to_this_one_and_rolls_back_keeping_every_sandbox(
    releases: tuple[LocalBed, Release, Release],
) -> None:
    bed, previous, current = releases
    eventually(lambda: rolled_to(bed, previous.image), f"the previous release {previous.version} running", timeout=240)

    since = audit.now()
    kept = [f"kept-{i}" for i in range(KEPT)]
    pinned = [f"pinned-{i}" for i in range(PINNED)]
    say(f"{KEPT} sandboxes retained for 1h, {PINNED} for 150s then pinned for 2h, one for 60s and held by a Pod")
    bed.retain_many(NS, bed.nodes[0], "keep", kept, "1h")
    bed.retain_many(NS, bed.nodes[0], "pin", pinned, "150s")
    pinned_at = time.monotonic()
    bed.retain_many(NS, bed.nodes[0], "hold", ["held"], "60s")  # the holder Pod runs before it expires
    eventually(lambda: len(sandboxes(bed)) == KEPT + PINNED + 1, "every sandbox adopted", timeout=240, every=3)
    workspace = str(bed.root / NS / "held" / "workspace")
    holder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "holder", "namespace": NS},
        "spec": bed.pod_spec(bed.nodes[0], "sleep 3600", disk=workspace),
    }
    bed.kubectl("apply", "-f", "-", input=json.dumps(holder))
    for name in pinned:
        bed.kubectl("annotate", f"rsb/{name}", "-n", NS, f"{c.ANN_PIN_FOR}=2h")
    eventually(lambda: phase(bed, "held") == "Held", "the expired sandbox held by the Pod", timeout=120)
    eventually(
        lambda: all(phase(bed, n) == "Pinned" for n in pinned), "the pins taken by the old controller", timeout=120
    )

    say("one more sandbox retained for 10s with one immutable file: its deletion starts and cannot finish yet")
    bed.retain_many(NS, bed.nodes[0], "delete", ["deleting"], "10s", files=100)
    deleting = bed.root / NS / "deleting"
    bed.on_node(f"chattr +i '{deleting}/workspace/f0'")
    tombstone = eventually(bed.tombstones, "the delete under way (a tombstone)", timeout=120, every=0.5)

    say(f"{LATE} more sandboxes retained for 1h: the old agent is adopting them when the upgrade starts")
    late = [f"late-{i}" for i in range(LATE)]
    bed.retain_many(NS, bed.nodes[0], "late", late, "1h", wait=False)
    eventually(lambda: len(bed.sandbox_names(NS, "late-")) >= 20, "the old agent adopting them", timeout=240, every=0.5)
    handover, upgrade, rollback = doc_blocks(OPERATIONS, "Upgrade")
    run_doc(bed, handover, current.version)
    out = run_doc(bed, upgrade, current.version)
    assert "has been upgraded" in out, out
    eventually(lambda: rolled_to(bed, current.image), f"this release {current.version} running", timeout=300)
    order = one_node_at_a_time(bed, current.image)
    say(f"the agents upgraded one node at a time: {', '.join(order)}")
    assert sorted(order) == sorted(n.name for n in bed.nodes)
    bed.wait_job(NS, "late", timeout=300)
    eventually(
        lambda: len(bed.sandbox_names(NS, "late-")) == LATE, f"all {LATE} late ones adopted", timeout=240, every=3
    )
    log = bed.cluster.audit_log
    started = agent_created(bed, bed.nodes[0], current.image)
    made = [w for w in audit.sandbox_writes(log, NS, "create", since) if w.name in late]
    by_old = sum(1 for w in made if w.when < started)
    say(f"the late ones: {by_old} adopted by the old agent, {LATE - by_old} by the new one (from {started})")
    assert 0 < by_old < LATE, "the upgrade did not land during the adoption"

    assert bed.tombstones() == tombstone and rsb(bed, "deleting") is not None, "the deletion in flight left as is"
    say("chattr -i: the new agent finishes the deletion the old one started")
    bed.on_node(f"chattr -R -i '{bed.root}'")
    eventually(lambda: rsb(bed, "deleting") is None, "the deletion in flight finished", timeout=240)
    assert not bed.exists(deleting) and not bed.tombstones()
    # Past the pinned sandboxes' 150 s: a lost pin would delete them now.
    time.sleep(max(0.0, 150 + 15 - (time.monotonic() - pinned_at)))
    time.sleep(10)  # several passes of the new agent and controller
    objects = sandboxes(bed)
    assert set(objects) == {*kept, *pinned, *late, "held"}, "a sandbox that should stay is gone"
    created = audit.created(log, NS, since)
    assert {n: created[n] for n in objects} == dict.fromkeys(objects, 1), "a sandbox adopted twice"
    assert audit.deleted(log, NS, since) == {"deleting": 1}, "the deletion in flight finished once, nothing else"
    assert {n: phase(bed, n) for n in pinned} == dict.fromkeys(pinned, "Pinned")
    assert phase(bed, "held") == "Held"
    missing = [n for n in objects if not bed.exists(bed.root / NS / n)]
    assert missing == [], f"directories gone from the node: {missing}"
    say("every RetainedSandbox replaced as it is, dry-run: each still valid under this release's CRD")
    listed = bed.kubectl("get", "rsb", "-n", NS, "-o", "json").stdout
    replaced = bed.kubectl("replace", "--dry-run=server", "-f", "-", input=listed, timeout=120).stdout
    assert replaced.count("replaced (server dry run)") == len(objects), replaced

    say("helm rollback, as docs/operations.md says: the previous release again, every sandbox still there")
    run_doc(bed, rollback, current.version)
    eventually(lambda: rolled_to(bed, previous.image), "the previous release running again", timeout=300)
    order = one_node_at_a_time(bed, previous.image)
    say(f"the agents rolled back one node at a time: {', '.join(order)}")
    time.sleep(10)
    assert set(sandboxes(bed)) == {*kept, *pinned, *late, "held"}
    assert {n: phase(bed, n) for n in pinned} == dict.fromkeys(pinned, "Pinned")

    say("delete the holder: the rolled-back agent deletes the expired sandbox it held")
    bed.kubectl("delete", "pod", "holder", "-n", NS, "--wait=true")
    eventually(lambda: rsb(bed, "held") is None, "the released sandbox deleted", timeout=120)
    assert not bed.exists(bed.root / NS / "held")
    assert audit.deleted(log, NS, since) == {"deleting": 1, "held": 1}
