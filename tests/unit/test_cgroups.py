"""The agent's container check (controller/agent/cgroups.py): a process answers for a session's container only
from exactly the cgroup the kubelet made for it, over both cgroup drivers, v1 and v2, the reader in a Pod, in
a cgroup namespace or on the host, and never from a child of it, a name holding its id, the same tail under
someone else's delegated cgroup, or a forged line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from controller.agent import cgroups
from controller.agent.cgroups import Container, answers, parse
from controller.agent.sessions import MOUNT_LOG, check, pids_of
from controller.rules import contracts as c

V1 = ("12:pids", "7:cpu,cpuacct", "4:memory", "3:devices", "1:name=systemd", "0:")
Path_ = tuple[str, ...]

names = st.from_regex(r"[a-z][a-z0-9_.-]{0,15}", fullmatch=True).filter(lambda n: "kubepods" not in n)
hexids = st.binary(min_size=32, max_size=32).map(bytes.hex)
containers = st.builds(
    Container,
    runtime=st.sampled_from(sorted(cgroups.RUNTIMES)),
    id=hexids,
    pod_uid=st.uuids().map(str),
    qos=st.sampled_from(sorted(cgroups.QOS_DIRS)),
)


def tail(ct: Container, driver: str) -> Path_:
    return cgroups.tails(ct)[0 if driver == "cgroupfs" else 1]


def text(path: Path_, version: str, unified: Path_ = ()) -> bytes:
    """A /proc/<pid>/cgroup file: every v1 hierarchy at `path` (the unified line elsewhere), or v2 alone."""
    show = "/" + "/".join(path)
    if version == "v2":
        return f"0::{show}\n".encode()
    return "".join(f"{h}:{show if h != '0:' else '/' + '/'.join(unified)}\n" for h in V1).encode()


def seen_from(ns_root: Path_, path: Path_) -> Path_:
    """`path` as the kernel shows it to a reader whose cgroup namespace is rooted at `ns_root`."""
    common = 0
    while common < min(len(ns_root), len(path)) and ns_root[common] == path[common]:
        common += 1
    return ("..",) * (len(ns_root) - common) + path[common:]


@dataclass(frozen=True)
class Node:
    """The kubelet's cgroupRoot, its driver, the cgroup version, and where the agent reads from."""

    root: Path_
    driver: str
    version: str
    reader: str  # pod: another Pod's container; namespace: the same, in a cgroup namespace; host: no Pod
    agent: Container

    def agent_path(self) -> Path_:
        if self.reader == "host":
            return ("system.slice", "sandkeep-agent.service")
        return self.root + tail(self.agent, self.driver)

    def own(self) -> list[cgroups.Line]:
        lines = parse(text(() if self.reader == "namespace" else self.agent_path(), self.version))
        assert lines is not None
        return lines

    def file(self, absolute: Path_) -> bytes:
        shown = seen_from(self.agent_path(), absolute) if self.reader == "namespace" else absolute
        return text(shown, self.version)

    def answers(self, absolute: Path_, ct: Container) -> bool:
        lines = parse(self.file(absolute))
        return lines is not None and answers(self.own(), lines, ct)


@st.composite
def nodes(draw: st.DrawFn) -> Node:
    reader = draw(st.sampled_from(["pod", "namespace", "host"]))
    root = () if reader == "host" else tuple(draw(st.lists(names, max_size=2)))  # a host reader: cgroupRoot /
    driver = draw(st.sampled_from(["cgroupfs", "systemd"]))
    return Node(root, driver, draw(st.sampled_from(["v1", "v2"])), reader, draw(containers))


@given(nodes(), containers)
def test_a_process_in_exactly_the_containers_cgroup_answers(node: Node, ct: Container) -> None:
    assume(ct.pod_uid != node.agent.pod_uid)
    assert node.answers(node.root + tail(ct, node.driver), ct)


@given(nodes(), containers, st.lists(names, min_size=1, max_size=3), names, st.booleans())
def test_a_child_of_the_containers_cgroup_or_a_name_that_holds_its_id_does_not_answer(
    node: Node, ct: Container, nested: list[str], junk: str, before: bool
) -> None:
    assume(ct.pod_uid != node.agent.pod_uid)
    exact = node.root + tail(ct, node.driver)
    assert not node.answers(exact + tuple(nested), ct), "a delegated child of the container's cgroup"
    holding = f"{junk}-{exact[-1]}" if before else f"{exact[-1]}-{junk}"
    assert not node.answers((*exact[:-1], holding), ct), "a sibling whose name holds the id"
    bare = ct.id if exact[-1] != ct.id else f"x{ct.id}"  # the id without the runtime's own prefix and suffix
    assert not node.answers((*exact[:-1], bare), ct)


@given(nodes(), containers, containers, st.lists(names, max_size=2), st.integers(0, 3))
def test_the_containers_tail_under_another_containers_delegated_cgroup_does_not_answer(
    node: Node, ct: Container, tenant: Container, between: list[str], drop: int
) -> None:
    assume(len({ct.pod_uid, tenant.pod_uid, node.agent.pod_uid}) == 3)
    delegated = node.root + tail(tenant, node.driver)  # a tenant that may make cgroups under its own
    whole = tail(ct, node.driver)
    assert not node.answers(delegated + tuple(between) + whole[min(drop, len(whole) - 2) :], ct)


@given(nodes(), containers, st.uuids().map(str), st.sampled_from(sorted(cgroups.QOS_DIRS)))
def test_another_pods_cgroup_or_another_qos_does_not_answer(node: Node, ct: Container, uid: str, qos: str) -> None:
    assume(len({ct.pod_uid, uid, node.agent.pod_uid}) == 3)
    other_pod = Container(ct.runtime, ct.id, uid, ct.qos)
    assert not node.answers(node.root + tail(other_pod, node.driver), ct)
    # Seen from a cgroup namespace the reader's own QoS level is hidden (`../..`): a pod placed in it under
    # another class is a cgroup only the kubelet could make, so only the visible levels are checked there.
    hidden = node.reader == "namespace" and cgroups.QOS_DIRS[qos] == cgroups.QOS_DIRS[node.agent.qos]
    if cgroups.QOS_DIRS[qos] != cgroups.QOS_DIRS[ct.qos] and not hidden:
        assert not node.answers(node.root + tail(Container(ct.runtime, ct.id, ct.pod_uid, qos), node.driver), ct)


@given(nodes(), containers, st.lists(names, min_size=1, max_size=2))
def test_a_forged_line_from_a_cgroup_name_with_a_newline_does_not_answer(
    node: Node, ct: Container, attacker: list[str]
) -> None:
    # A name may hold a newline: `x\n4:memory:/<the container's path>` makes the file read as one line more.
    assume(ct.pod_uid != node.agent.pod_uid)
    exact = node.file(node.root + tail(ct, node.driver)).decode()
    for forged_line in exact.splitlines():
        forged = node.file(node.root + tuple(attacker)).decode() + forged_line + "\n"
        lines = parse(forged.encode())
        assert lines is None or not answers(node.own(), lines, ct)


@given(st.binary(max_size=300), containers)
def test_any_bytes_read_as_a_cgroup_file_never_raise(raw: bytes, ct: Container) -> None:
    lines = parse(raw)
    own = parse(b"0::/\n")
    assert own is not None
    if lines is not None:
        answers(own, lines, ct)
        answers(lines, lines, ct)


def test_the_layouts_named_in_the_issue() -> None:
    ct = Container("containerd", "ab" * 32, "1b2c3d4e-0000-4000-8000-00000000000f", "BestEffort")
    systemd = parse(
        b"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1b2c3d4e_0000_4000_8000_00000000000f"
        b".slice/cri-containerd-" + b"ab" * 32 + b".scope\n"
    )
    agent = parse(
        b"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod9_9.slice/cri-containerd-9.scope\n"
    )
    assert systemd is not None and agent is not None and answers(agent, systemd, ct)
    cgroupfs = parse(
        b"4:memory:/sandkeep-node-x/kubepods/besteffort/pod" + ct.pod_uid.encode() + b"/" + b"ab" * 32 + b"\n"
    )
    own = parse(b"4:memory:/sandkeep-node-x/kubepods/burstable/pod9/" + b"9" * 64 + b"\n")
    assert cgroupfs is not None and own is not None and answers(own, cgroupfs, ct)
    for unknown in (b"", b"garbage", b"4:memory:relative\n", b"0::/a\n0::/b\n", b"0::/a/../b\n"):
        assert parse(unknown) is None or cgroups.path_of(parse(unknown) or []) is None, unknown
    assert not answers(own, cgroupfs, Container("containerd", "ab" * 32, ct.pod_uid, ""))  # no qosClass: closed


# --- through the agent's check, on a /proc made of files ------------------------------------------------------
def fake_proc(tmp_path: Path, ct: Container, hostile: dict[int, str]) -> tuple[Path, Path]:
    """A /proc where pid 100 is the container's and each of `hostile` sits in the cgroup named; every process
    sees at SESSION_MOUNT either the workspace (pid 100) or a decoy (the hostile ones)."""
    base = "/sandkeep-node-x/kubepods/burstable"
    proc, root = tmp_path / "proc", tmp_path / "root"
    workspace = root / "team" / "run-1" / c.WORKSPACE_DIR
    workspace.mkdir(parents=True)
    decoy = tmp_path / "decoy"
    (decoy / c.WORKSPACE_DIR).mkdir(parents=True)
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(f"4:memory:/sandkeep-node-x/kubepods/besteffort/pod-agent/{'9' * 64}\n")
    for pid, path in {100: f"{base}/pod{ct.pod_uid}/{ct.id}", **hostile}.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(f"4:memory:{path}\n")
        (proc / str(pid) / "root").symlink_to(workspace.parent if pid == 100 else decoy)
    return proc, root


def session_pod(ct: Container) -> dict[str, object]:
    state = {"name": c.SESSION_CONTAINER, "state": {"running": {}}, "containerID": f"containerd://{ct.id}"}
    return {"metadata": {"uid": ct.pod_uid}, "status": {"qosClass": ct.qos, "containerStatuses": [state]}}


def test_a_hostile_process_whose_cgroup_holds_the_id_never_answers_for_the_container(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(c, "SESSION_MOUNT", f"/{c.WORKSPACE_DIR}")  # the fake root shows the workspace there
    ct = Container("containerd", "cd" * 32, "0f0f0f0f-1111-4222-8333-444444444444", "Burstable")
    here = f"/sandkeep-node-x/kubepods/burstable/pod{ct.pod_uid}"
    # Lower pids than the container's, so the substring match read them first and ended the session.
    hostile = {10: f"{here}/{ct.id}/nested", 11: f"{here}/evil-{ct.id}", 12: f"/user.slice/{ct.id}"}
    proc, root = fake_proc(tmp_path, ct, hostile)
    own = parse((proc / "self" / "cgroup").read_bytes())
    assert own is not None and pids_of(ct, proc, own) == [100]
    assert check(session_pod(ct), root, "team", "run-1", proc) == c.MountCheck.VERIFIED
    (proc / "100" / "cgroup").write_text(f"4:memory:{here}/{ct.id}/init\n")  # only hostile ones are left
    assert check(session_pod(ct), root, "team", "run-1", proc) == c.MountCheck.UNKNOWN
    (proc / "100" / "cgroup").write_text(f"4:memory:{here}/{ct.id}\n")
    (proc / "self" / "cgroup").write_text("unreadable\n")  # the agent's own cgroup unknown: nobody answers
    assert check(session_pod(ct), root, "team", "run-1", proc) == c.MountCheck.UNKNOWN


def test_only_a_mount_that_is_not_the_workspace_is_logged_as_a_warning() -> None:
    # An Unknown finding (no process of the container read yet) is checked again, not a mismatch: it was logged
    # as a MountMismatch warning, which sent a person looking for a wrong mount that did not exist.
    assert set(MOUNT_LOG) == set(c.MountCheck)
    warned = {found for found, (level, _) in MOUNT_LOG.items() if level >= logging.WARNING}
    assert warned == {c.MountCheck.MISMATCH} and MOUNT_LOG[c.MountCheck.MISMATCH][1] == c.Reason.MOUNT_MISMATCH
    assert MOUNT_LOG[c.MountCheck.UNKNOWN][1] == c.Reason.SESSION_STARTING
