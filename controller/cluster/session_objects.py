"""The object a SandboxSession makes, pure: its Pod, in the sandbox's own namespace, on the sandbox's node.

The Pod mounts the sandbox at /sandbox through sandkeep's CSI driver (`volumeAttributes.sandbox`: the node
plugin mounts the sandbox's own verified directory, or refuses), read-only unless the session asks
readWrite. It is admitted by Pod Security `restricted` (non-root, no privilege escalation, no
capabilities, RuntimeDefault seccomp), has bounded resources, tolerates only the taints of its node that
the agent tolerates (`session_tolerations`), and runs as the workspace's owner only where that is a
person's id (`run_as`). The tenant's quota, LimitRange and NetworkPolicies apply to it as to any Pod.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from datetime import datetime

from controller.cluster.session_decide import MAX_ID, SessionSettings, job_container, object_name, session_image
from controller.rules import contracts as c
from controller.rules.objects import Obj, key_of


def run_as(owner: Obj, settings: SessionSettings) -> tuple[int, int]:
    """The uid and gid a session runs as: the workspace owner's read from disk, each only where it is a
    person's (at least `min_owner_id`); otherwise `run_as_user`. Never 0 nor a system id from disk."""

    def person(value: object) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and settings.min_owner_id <= value <= MAX_ID:
            return value
        return settings.run_as_user

    return person(owner.get("uid")), person(owner.get("gid"))


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """Kubernetes' own matching of one toleration against one taint (k8s.io/api/core/v1 ToleratesTaint)."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    exists = toleration.get("operator") == "Exists"
    if not toleration.get("key"):
        return exists  # an empty key with Exists matches every taint; with Equal, none
    if toleration.get("key") != taint.get("key"):
        return False
    return exists or (toleration.get("value") or "") == (taint.get("value") or "")


def session_tolerations(agent: Sequence[Obj], taints: Sequence[Obj]) -> list[Obj]:
    """Exactly the NoExecute taints of the sandbox's node that the agent tolerates, each tolerated by name.

    The Pod names its node, so no scheduler reads NoSchedule taints; the kubelet refuses, and the taint
    manager evicts, a Pod that does not tolerate a NoExecute one. The agent runs there, so its tolerations
    bound what a session may tolerate; a taint it does not tolerate is not tolerated here either.
    """
    out: list[Obj] = []
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        match = next((t for t in agent if tolerates(t, taint)), None)
        if match is None:
            continue
        toleration: Obj = {"key": taint.get("key"), "operator": "Equal", "value": taint.get("value") or ""}
        toleration["effect"] = "NoExecute"
        if match.get("tolerationSeconds") is not None:
            toleration["tolerationSeconds"] = match["tolerationSeconds"]
        if toleration not in out:
            out.append(toleration)
    return out


def _labels(session: Obj, sandbox_uid: str) -> dict[str, str]:
    return {
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_SESSION_UID: session["metadata"]["uid"],
        c.LABEL_SANDBOX_UID: sandbox_uid,
    }


def _annotations(session: Obj) -> dict[str, str]:
    return {c.ANN_SESSION: "/".join(key_of(session))}


def pod_body(
    session: Obj,
    sandbox: Obj,
    settings: SessionSettings,
    expires: datetime,
    now: datetime,
    taints: Sequence[Obj] = (),
) -> Obj:
    """The session's Pod: in the sandbox's namespace, on its node (`taints` are that node's), the sandbox at
    /sandbox through the CSI driver (with `asJob`, where and as the job mounted it), `restricted`-compatible,
    with bounded resources."""
    spec = session.get("spec") or {}
    namespace, name = key_of(sandbox)
    read_write = bool(spec.get("readWrite"))
    attributes = {c.VOLUME_SANDBOX: name, **({c.VOLUME_READ_WRITE: "true"} if read_write else {})}
    seconds = max(1, int((expires - now).total_seconds()))
    # As the workspace's owner (the agent reads it) where that is a person's id, never root nor a system id.
    uid, gid = run_as((sandbox.get("status") or {}).get("owner") or {}, settings)
    # asJob: as the job was, with its recorded image, working directory and the workspace where it mounted it.
    job = (job_container(sandbox) if spec.get("asJob") else None) or {}
    mount = str(job.get("mountPath") or c.SESSION_MOUNT)
    mounts: list[Obj] = [{"name": "sandbox", "mountPath": mount, "readOnly": not read_write}]
    if mount != "/tmp":  # noqa: S108 (a job's workspace at /tmp replaces the session's own scratch there)
        mounts.append({"name": "tmp", "mountPath": "/tmp"})  # noqa: S108 (an emptyDir of its own)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": object_name(session),
            "namespace": namespace,
            "labels": _labels(session, sandbox["metadata"]["uid"]),
            "annotations": {**_annotations(session), c.ANN_SANDBOX: f"{namespace}/{name}"},
        },
        "spec": {
            "nodeName": sandbox["spec"]["nodeName"],
            "restartPolicy": "Never",
            "activeDeadlineSeconds": seconds,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "tolerations": session_tolerations(settings.tolerations, taints),
            "securityContext": {
                "runAsUser": uid,
                "runAsGroup": gid,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": c.SESSION_CONTAINER,
                    "image": session_image(spec, sandbox, settings),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", str(seconds)],
                    "workingDir": str(job.get("workingDir") or mount),
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": copy.deepcopy(settings.resources),
                    "volumeMounts": mounts,
                }
            ],
            "volumes": [
                {
                    "name": "sandbox",
                    "csi": {"driver": c.CSI_DRIVER, "readOnly": not read_write, "volumeAttributes": attributes},
                },
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
            ],
        },
    }
