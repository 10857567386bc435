"""What becomes of a captured workspace once its Pod ended (issue 27): pure, no I/O, no clock.

The kubelet unpublishes a Pod's volumes when the Pod terminates, which may be before the Pod's final status
reaches the API. So the node plugin only records the unpublish, and each agent pass reads the Pod and asks
`decide` here: keep it, delete it, or look again next pass. Everything is read from a Pod object as the API
serves it, and nothing in it is trusted: any Mapping (or none) gives an answer, never an exception.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from controller.rules.contracts import ORIGIN_CONTAINERS_MAX, ORIGIN_LABELS, Keep, Outcome
from controller.rules.durations import format_duration, instant_or_none
from controller.rules.models import (
    IMAGE_MAX,
    LABEL_VALUE_MAX,
    NAME_MAX,
    ORIGIN_PATH_MAX,
    Origin,
    OriginContainer,
    OriginOwner,
)

# How long after an unpublish a Pod may take to report how it ended (its containers' exit codes, or its phase)
# before it counts as Unknown (kept unless `keep: Never`). The kubelet posts the final status within seconds.
WAIT_FOR_END = timedelta(minutes=2)
KEPT_NAME_MAX = 63  # a generated sandbox name stays a DNS-1123 label, so it also fits wherever a label must
_HASH_DIGITS = 5
_TERMINAL = {"Succeeded": Outcome.SUCCEEDED, "Failed": Outcome.FAILED}
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


def _map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _items(value: object) -> list[Mapping[str, object]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _text(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _exit_code(status: Mapping[str, object]) -> int | None:
    """A container status's exit code once it has terminated (an int32, as the API types it)."""
    code = _map(_map(status.get("state")).get("terminated")).get("exitCode")
    if isinstance(code, bool) or not isinstance(code, int) or not -(2**31) <= code < 2**31:
        return None
    return code


def _statuses(pod: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    out: dict[str, Mapping[str, object]] = {}
    for status in _items(_map(pod.get("status")).get("containerStatuses")):
        name = status.get("name")
        if isinstance(name, str):
            out.setdefault(name, status)
    return out


def _container_names(pod: Mapping[str, object]) -> list[str]:
    names = [c.get("name") for c in _items(_map(pod.get("spec")).get("containers"))]
    return [n for n in names if isinstance(n, str)]


def exit_codes(pod: Mapping[str, object]) -> dict[str, int] | None:
    """The exit code of every container of the Pod (its spec's, else those with a status) once all have
    terminated; None while one has not (or none is known)."""
    statuses = _statuses(pod)
    names = _container_names(pod) or list(statuses)
    codes: dict[str, int] = {}
    for name in names:
        code = _exit_code(statuses.get(name, {}))
        if code is None:
            return None
        codes[name] = code
    return codes or None


def _deletion_asked(meta: Mapping[str, object]) -> datetime | None:
    """When the Pod's deletion was asked for: its deletionTimestamp less its grace period. None: not deleted."""
    at = meta.get("deletionTimestamp")
    if not at:
        return None
    when = instant_or_none(at) if isinstance(at, str) else None
    grace = meta.get("deletionGracePeriodSeconds")
    if when is None:
        return datetime.max.replace(tzinfo=UTC)  # deleted, when unknown: nothing ended provably before it
    seconds = grace if isinstance(grace, int) and not isinstance(grace, bool) and 0 <= grace < 2**31 else 0
    return when - timedelta(seconds=seconds)


def _ended_before(pod: Mapping[str, object], asked: datetime) -> bool:
    """Whether every container had terminated, by its own `finishedAt`, a whole second before `asked` (the
    API's times are whole seconds: the same second proves nothing)."""
    statuses = _statuses(pod)
    names = _container_names(pod) or list(statuses)
    for name in names:
        terminated = _map(_map(statuses.get(name, {}).get("state")).get("terminated"))
        finished = terminated.get("finishedAt")
        at = instant_or_none(finished) if isinstance(finished, str) else None
        if at is None or at >= asked - timedelta(seconds=1):
            return False
    return bool(names)


def outcome_of(pod: object) -> Outcome | None:
    """How the Pod ended: its terminal phase; else, once every container has terminated, Failed when one
    exited non-zero. A Pod whose deletion was asked for before all its containers had ended is Unknown, whatever
    phase the kubelet then posts (a job stopped by SIGTERM may exit 0); so is none at all (gone, unreadable).
    None: not ended yet (or not reported yet): look again later."""
    if not isinstance(pod, Mapping):
        return Outcome.UNKNOWN
    asked = _deletion_asked(_map(pod.get("metadata")))
    if asked is not None and not _ended_before(pod, asked):
        return Outcome.UNKNOWN
    phase = _map(pod.get("status")).get("phase")
    if isinstance(phase, str) and phase in _TERMINAL:
        return _TERMINAL[phase]
    codes = exit_codes(pod)
    if codes is None:
        return None
    return Outcome.FAILED if any(codes.values()) else Outcome.SUCCEEDED


def should_keep(keep: Keep, outcome: Outcome) -> bool:
    """Always keeps everything, Never nothing, OnFailure all but a success: Unknown is kept (fail closed)."""
    if keep is Keep.NEVER:
        return False
    return keep is Keep.ALWAYS or outcome is not Outcome.SUCCEEDED


@dataclass(frozen=True)
class Decision:
    """Keep (`keep`) or delete a workspace, the outcome that decided it, and why in words for the Event."""

    keep: bool
    outcome: Outcome
    why: str


def decide(keep: Keep, pod: object, *, waited: timedelta | None) -> Decision | None:
    """What to do with a workspace whose volume is no longer mounted; None: look again next pass.

    `pod` is the volume's Pod as the API serves it (same uid), None when it is gone. `waited` is the time since
    the unpublish; None when none came (found unmounted, e.g. after a reboot), and then only a Pod in a terminal
    phase or gone releases it: one still running may be published again by the kubelet.
    """
    because = ""
    if pod is None:
        outcome: Outcome | None = Outcome.UNKNOWN
        because = "its Pod is gone"
    elif waited is None:
        phase = _map(_map(pod).get("status")).get("phase")
        outcome = _TERMINAL.get(phase) if isinstance(phase, str) else None
    else:
        outcome = outcome_of(pod)
        if outcome is Outcome.UNKNOWN:
            because = "its Pod was deleted before it ended" if isinstance(pod, Mapping) else "its Pod is unreadable"
    if outcome is None:
        if waited is None or waited < WAIT_FOR_END:
            return None
        outcome, because = (
            Outcome.UNKNOWN,
            f"its Pod did not report how it ended within {format_duration(WAIT_FOR_END)}",
        )
    said = f"{outcome} ({because})" if because else str(outcome)
    return Decision(should_keep(keep, outcome), outcome, f"{said} and keep: {keep}")


def kept_name(base: str, pod_uid: str, volume_id: str, digits: int = _HASH_DIGITS) -> str:
    """`base` (the Pod's name, or the one the volume chose) shortened, `-`, and `digits` hex of a hash of the
    Pod's uid and the volume id: unique per Pod and volume, a DNS-1123 label of at most 63 characters."""
    digest = hashlib.sha256(f"{pod_uid}\0{volume_id}".encode(errors="surrogateescape")).hexdigest()[:digits]
    stem = _NOT_LABEL.sub("-", base.lower())[: KEPT_NAME_MAX - digits - 1].strip("-")
    return f"{stem or 'workspace'}-{digest}"


def kept_names(chosen: str | None, pod_name: str, pod_uid: str, volume_id: str) -> list[str]:
    """The names to try, in order, for a kept workspace: the volume's own `name` when it gave one, then the
    generated one, then a longer hash (the generated one taken by another Pod's: about one in a million)."""
    base = chosen or pod_name
    names = [chosen] if chosen else []
    names += [kept_name(base, pod_uid, volume_id), kept_name(base, pod_uid, volume_id, 16)]
    return list(dict.fromkeys(names))


def pod_volume(target_path: str) -> str | None:
    """The name the Pod's spec gives the volume published at `target_path`: the kubelet publishes an inline
    CSI volume at <kubelet dir>/pods/<pod uid>/volumes/kubernetes.io~csi/<name>/mount. None for another layout.
    """
    parts = target_path.rstrip("/").split("/")
    if len(parts) >= 6 and parts[-1] == "mount" and parts[-3] == "kubernetes.io~csi" and parts[-4] == "volumes":
        return parts[-2] or None
    return None


def _path(value: object) -> str | None:
    """A recorded path: only a whole one (one too long to record is left out, never cut)."""
    return value if isinstance(value, str) and 0 < len(value) <= ORIGIN_PATH_MAX else None


def _mount_path(container: Mapping[str, object], volume: str | None) -> str | None:
    """Where the container mounted the volume named `volume` whole (a subPath mount shows only part of it)."""
    for mount in _items(container.get("volumeMounts")):
        if volume is not None and mount.get("name") == volume and not mount.get("subPath"):
            return _path(mount.get("mountPath"))
    return None


def _id(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def origin_of(
    pod: object, outcome: Outcome, *, pod_name: str, pod_uid: str, node: str | None, volume: str | None = None
) -> Origin:
    """Where a workspace came from, for its manifest and `spec.origin`: the Pod (the kubelet's name and uid,
    which stay true when the Pod is gone), its controlling owner, node, containers with their images, exit
    codes, working directories and where each mounted the workspace (its volume's name in the Pod's spec is
    `volume`), the outcome, and the pipeline labels of ORIGIN_LABELS. Every string and list is cut to fit."""
    p = _map(pod)
    meta, spec = _map(p.get("metadata")), _map(p.get("spec"))
    owner = next(
        (
            OriginOwner(kind=_text(ref.get("kind"), LABEL_VALUE_MAX), name=_text(ref.get("name"), NAME_MAX))
            for ref in _items(meta.get("ownerReferences"))
            if ref.get("controller") is True and _text(ref.get("kind"), 1) and _text(ref.get("name"), 1)
        ),
        None,
    )
    statuses = _statuses(p)
    pod_sc = _map(spec.get("securityContext"))
    containers = [
        OriginContainer(
            name=name[:LABEL_VALUE_MAX],
            image=_text(c.get("image"), IMAGE_MAX),
            exit_code=_exit_code(statuses.get(name, {})),
            working_dir=_path(c.get("workingDir")),
            mount_path=_mount_path(c, volume),
            run_as_user=_id(_map(c.get("securityContext")).get("runAsUser", pod_sc.get("runAsUser"))),
            run_as_group=_id(_map(c.get("securityContext")).get("runAsGroup", pod_sc.get("runAsGroup"))),
        )
        for c in _items(spec.get("containers"))[:ORIGIN_CONTAINERS_MAX]
        if isinstance(name := c.get("name"), str)
    ]
    labels = _map(meta.get("labels"))
    return Origin(
        pod=pod_name[:NAME_MAX],
        pod_uid=pod_uid[:128],
        owner=owner,
        node=_text(spec.get("nodeName"), NAME_MAX) or (node[:NAME_MAX] if node else None),
        containers=containers,
        outcome=outcome,
        labels={k: v[:LABEL_VALUE_MAX] for k in ORIGIN_LABELS if isinstance(v := labels.get(k), str)},
        fs_group=_id(pod_sc.get("fsGroup")),
    )


def job_id_of(origin: Origin) -> str:
    """The manifest's jobId for a captured workspace: its Pod's controlling owner (`Job/build-42`), else the Pod."""
    return f"{origin.owner.kind}/{origin.owner.name}" if origin.owner else f"Pod/{origin.pod or ''}"
