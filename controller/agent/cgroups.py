"""Whose container a process is in, read exactly from `/proc/<pid>/cgroup`: the kubelet's own cgroup path.

The kubelet puts a container's processes in one cgroup named after the Pod and the container: cgroupfs
`<root>/kubepods[/<qos>]/pod<uid>/<id>`, systemd `<root>/kubepods.slice[/kubepods-<qos>.slice]/
kubepods[-<qos>]-pod<uid_>.slice/cri-containerd-<id>.scope`. A process answers for a container only when
its cgroup is that path exactly: a delegated child (`<id>/nested`) or a name holding the id (`evil-<id>`)
is someone else's. Anything unreadable or unexpected answers for nobody (fail closed).

The kubelet's prefix (its cgroupRoot; `..` when the reader is in a cgroup namespace) is not known here, so
a path is judged from its deepest common ancestor with the reader's own cgroup (the agent is a Pod of the
same kubelet): below it the path must be exactly the tail the kubelet makes, and what is seen above it
the rest of that tail (in a namespace, where those names are hidden: as many levels up as the reader's
own QoS level or kubepods). Only the kubelet and root create cgroups in the reader's ancestors; a
tenant's delegated cgroup is always below some other container's, where no exact tail fits.

v1 is judged by its memory hierarchy (every kubelet needs it), v2 by its one `0::` line. A cgroup name
may hold a newline, so a file whose hierarchies are not exactly the reader's own (a forged extra line)
answers for nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_BYTES = 64 * 1024  # a cgroup file is a few lines; more is not one
QOS_DIRS = {"Guaranteed": "", "Burstable": "burstable", "BestEffort": "besteffort"}  # Pod status.qosClass
# runtime (the containerID's scheme) -> (cgroupfs name prefix, systemd scope prefix); the suffix is `.scope`
RUNTIMES = {"containerd": ("", "cri-containerd-"), "cri-o": ("crio-", "crio-"), "docker": ("", "docker-")}

Line = tuple[str, str, str]  # hierarchy id, controllers, path


@dataclass(frozen=True)
class Container:
    """What the API says about a running container: enough to name the cgroup the kubelet made for it."""

    runtime: str  # the containerID's scheme: containerd, cri-o, docker
    id: str  # 64 hex digits
    pod_uid: str
    qos: str  # the Pod's status.qosClass


def parse(text: bytes) -> list[Line] | None:
    """The lines of a cgroup file, None: not one (empty, truncated, or a line not `id:controllers:/path`)."""
    if not text.endswith(b"\n") or b"\0" in text:
        return None
    out = []
    for raw in text.decode(errors="surrogateescape").split("\n")[:-1]:
        parts = raw.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            return None
        out.append((parts[0], parts[1], parts[2]))
    return out or None


def path_of(lines: Sequence[Line]) -> tuple[str, ...] | None:
    """The path that decides, as components: the v1 memory hierarchy's, else v2's one `0::`; None: neither."""
    memory = [p for _, ctl, p in lines if "memory" in ctl.split(",")]
    unified = [p for hid, ctl, p in lines if hid == "0" and not ctl]
    found = memory or unified
    if len(found) != 1:
        return None
    parts = tuple(found[0].split("/")[1:]) if found[0] != "/" else ()
    up = len(parts) - len(tuple(p for p in parts if p != ".."))
    if any(p in ("", ".") for p in parts) or parts[:up] != ("..",) * up:
        return None  # `..` only leads (a path outside the reader's cgroup namespace), never inside
    return parts


def tails(ct: Container) -> list[tuple[str, ...]]:
    """The whole tails the kubelet makes for this container, from `kubepods` down, in each cgroup driver."""
    qos = QOS_DIRS.get(ct.qos)
    names = RUNTIMES.get(ct.runtime)
    if qos is None or names is None or not ct.pod_uid or not ct.id:
        return []
    fs_name, scope_prefix = names
    cgroupfs = ("kubepods", *((qos,) if qos else ()), f"pod{ct.pod_uid}", f"{fs_name}{ct.id}")
    slice_qos = f"-{qos}" if qos else ""
    systemd = (
        "kubepods.slice",
        *((f"kubepods-{qos}.slice",) if qos else ()),
        f"kubepods{slice_qos}-pod{ct.pod_uid.replace('-', '_')}.slice",
        f"{scope_prefix}{ct.id}.scope",
    )
    return [cgroupfs, systemd]


def answers(own: Sequence[Line], lines: Sequence[Line], ct: Container) -> bool:
    """True when `lines` (a process's cgroup file) put it in exactly the container's cgroup, as seen by a
    reader whose own cgroup file is `own`."""
    if [line[:2] for line in own] != [line[:2] for line in lines]:
        return False
    mine, theirs = path_of(own), path_of(lines)
    if mine is None or theirs is None or ".." in mine:
        return False
    up = theirs.count("..")
    above: tuple[str, ...] = ()  # the ancestor's names, where the reader sees them
    if up:  # outside the reader's cgroup namespace: the ancestor is `up` levels above its root
        depth, below = up + len(mine), theirs[up:]
    else:
        common = 0
        while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
            common += 1
        depth, below, above = len(mine) - common, theirs[common:], theirs[:common]
    if depth < 1 or len(below) < 2:  # in the reader's own subtree, or not even pod/container below
        return False
    for tail in tails(ct):
        cut = len(tail) - len(below)  # how much of the tail lies at or above the common ancestor
        if cut < 0 or tail[cut:] != below:
            continue
        if up and _levels_fit(cut, depth):
            return True
        if not up and len(above) >= cut and above[len(above) - cut :] == tail[:cut]:
            return True
    return False


def _levels_fit(cut: int, depth: int) -> bool:
    """In a cgroup namespace the names above are hidden, but not how far up they are: the reader (a container
    cgroup, 2 levels below kubepods or 3 with a QoS level) is exactly that far from where the tail starts."""
    if cut >= 2:  # the common ancestor is the QoS level: the reader is in it too
        return depth == 2
    if cut == 1:  # kubepods
        return depth in (2, 3)
    return depth >= 3  # above kubepods
