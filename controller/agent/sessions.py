"""The node's half of a SandboxSession: prove that a session Pod's /sandbox is its sandbox's workspace.

The kubelet resolves a hostPath through links, so the directory a session's container sees may not be
the sandbox's (its workspace swapped for a link, or the sandbox swept and another retained under the same
name). The controller grants exec only once this module has compared, by device and inode, what one of
the container's own processes sees at /sandbox (through `/proc/<pid>/root`) with the workspace opened
here without following any link. Only Pods of the sessions namespace the agent is configured with are
looked at (nobody else may create Pods there); the answer lands in the sandbox's `status.sessions`,
written by the agent alone (its own field manager, so the main status apply never drops it). A process is
the container's only when its cgroup is exactly the one the kubelet made for it (controller/agent/cgroups.py).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path

from controller.agent import cgroups
from controller.agent.cgroups import Container
from controller.node.nofollow import open_no_symlinks
from controller.rules import contracts as c
from controller.rules.contracts import MountCheck, Reason
from controller.rules.durations import format_instant
from controller.rules.objects import Obj

SESSIONS_MANAGER_SUFFIX = "-sessions"
# How each finding is logged: only a mismatch is a warning; Unknown (no process read yet) is checked again.
MOUNT_LOG: dict[MountCheck, tuple[int, Reason]] = {
    MountCheck.VERIFIED: (logging.INFO, Reason.SESSION_RUNNING),
    MountCheck.MISMATCH: (logging.WARNING, Reason.MOUNT_MISMATCH),
    MountCheck.UNKNOWN: (logging.INFO, Reason.SESSION_STARTING),
}
_CONTAINER_ID = re.compile(r"^([a-z0-9-]+)://([0-9a-f]{64})$")

Identity = tuple[int, int]  # (st_dev, st_ino)


def container_of(pod: Obj) -> Container | None:
    """The running session container (runtime, id, Pod uid, QoS class), None while it is not running."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == c.SESSION_CONTAINER and "running" in (status.get("state") or {}):
            found = _CONTAINER_ID.match(str(status.get("containerID") or ""))
            if found is None:
                return None
            qos = str((pod.get("status") or {}).get("qosClass") or "")
            return Container(found.group(1), found.group(2), str(pod["metadata"].get("uid") or ""), qos)
    return None


def _cgroup_lines(path: Path) -> list[cgroups.Line] | None:
    try:
        with path.open("rb") as f:
            text = f.read(cgroups.MAX_BYTES + 1)
    except OSError:
        return None  # ended meanwhile, or not ours to read
    return cgroups.parse(text) if len(text) <= cgroups.MAX_BYTES else None


def own_cgroup(proc: Path) -> list[cgroups.Line] | None:
    """The agent's own cgroup file, what every other is judged against; None: unknown (nothing answers)."""
    lines = _cgroup_lines(proc / "self" / "cgroup")
    return lines if lines is not None and cgroups.path_of(lines) is not None else None


def pids_of(container: Container, proc: Path, own: list[cgroups.Line]) -> list[int]:
    """The processes in exactly the container's cgroup (not a child of it, not a name that holds its id)."""
    found = []
    with os.scandir(proc) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            lines = _cgroup_lines(Path(entry.path) / "cgroup")
            if lines is not None and cgroups.answers(own, lines, container):
                found.append(int(entry.name))
    return sorted(found)


def seen_by(pid: int, proc: Path) -> Identity | None:
    """What the process sees at /sandbox, by device and inode (its mount namespace, its root)."""
    try:
        st = (proc / str(pid) / f"root{c.SESSION_MOUNT}").lstat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def workspace_stat(root: Path, namespace: str, name: str) -> os.stat_result | OSError | None:
    """The sandbox's workspace as fstat sees it, no link followed anywhere; None: it is not there."""
    try:
        fd = open_no_symlinks(root / namespace / name / c.WORKSPACE_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:  # ELOOP (a link on the way) is an answer too: it is not the sandbox's
        return None if err.errno == errno.ELOOP else err
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def workspace_of(root: Path, namespace: str, name: str) -> Identity | OSError | None:
    """The sandbox's workspace by device and inode; None: it is not there."""
    st = workspace_stat(root, namespace, name)
    return st if st is None or isinstance(st, OSError) else (st.st_dev, st.st_ino)


def check(pod: Obj, root: Path, namespace: str, name: str, proc: Path) -> MountCheck:
    """Verified, Mismatch, or Unknown (not readable yet: asked again on the next pass)."""
    container = container_of(pod)
    own = own_cgroup(proc)
    if container is None or own is None:
        return MountCheck.UNKNOWN
    want = workspace_of(root, namespace, name)
    if isinstance(want, OSError):
        return MountCheck.UNKNOWN
    for pid in pids_of(container, proc, own):
        got = seen_by(pid, proc)
        if got is not None:
            return MountCheck.VERIFIED if want is not None and got == want else MountCheck.MISMATCH
    return MountCheck.UNKNOWN


def session_pods(pods: Iterable[Obj], namespace: str) -> dict[str, list[Obj]]:
    """The sessions namespace's Pods on this node, by the uid of the sandbox they mount."""
    out: dict[str, list[Obj]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = (meta.get("labels") or {}).get(c.LABEL_SANDBOX_UID)
        if namespace and meta.get("namespace") == namespace and uid:
            out.setdefault(uid, []).append(pod)
    return out


def entries(
    sandbox: Obj, pods: list[Obj], root: Path, proc: Path, now: datetime, known: Mapping[str, Obj]
) -> list[Obj]:
    """`status.sessions` for this sandbox: one entry per session Pod. A settled answer is not read again,
    and an unchanged one is kept as it was, so a Pod that stays Unknown costs no status write per pass.
    The oldest SESSION_VERIFY_SLOTS Pods are read (the controller refuses a session over that), so a newer
    one never takes an older one's slot."""
    namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
    out = []
    oldest = sorted(pods, key=lambda p: (str(p["metadata"].get("creationTimestamp") or ""), p["metadata"]["name"]))
    for pod in oldest[: c.SESSION_VERIFY_SLOTS]:
        meta = pod["metadata"]
        old = known.get(meta["uid"])
        if old is not None and old.get("mount") in (MountCheck.VERIFIED, MountCheck.MISMATCH):
            out.append(old)
            continue
        mount = check(pod, root, namespace, name, proc)
        if old is not None and old.get("mount") == mount:
            out.append(old)
            continue
        out.append(
            {
                "pod": f"{meta['namespace']}/{meta['name']}",
                "podUID": meta["uid"],
                "mount": str(mount),
                "checkedAt": format_instant(now),
            }
        )
    return out
