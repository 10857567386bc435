"""Whether a retained sandbox may be opened now: one answer for every door that opens one (issue 27).

A SandboxSession (cluster/session_decide.py), `kubectl sandkeep open` and `cp` before they create anything
(cli/kubectl_plugin.py), and a Pod's reopen volume at publish (csi/) all refuse with these reasons and words.
"""

from __future__ import annotations

from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.objects import Obj, is_deleting


def sandbox_refusal(sandbox: Obj | None, expired: bool, namespace: str, name: str) -> tuple[Reason, str] | None:
    """Why this sandbox cannot be opened now, by the one rule and its state; None: it can."""
    ref = f"RetainedSandbox {namespace}/{name}"
    if sandbox is None:
        return Reason.SANDBOX_NOT_FOUND, f"{ref} does not exist; `kubectl sandkeep ls -n {namespace}` lists them"
    if is_deleting(sandbox):
        return Reason.SANDBOX_DELETING, f"{ref} is being deleted; a deletion is final and it cannot be opened"
    status = sandbox.get("status") or {}
    phase = status.get("phase")
    if phase == c.Phase.LOST:
        return Reason.LOST, f"{ref} is Lost (its node or its directory is gone): there is nothing to open"
    if phase == c.Phase.STUCK:
        return Reason.TOMBSTONE_STUCK, f"{ref} is Stuck mid-deletion on its node; see `kubectl sandkeep doctor`"
    for cond in status.get("conditions") or []:
        if cond.get("type") == c.Condition.ORPHANS_SURVIVED and cond.get("status") == "True":
            return Reason.ORPHAN_SURVIVOR, f"{ref} has commands that survived their reaping: {cond.get('message')}"
    if expired:
        return Reason.EXPIRED, (
            f"{ref} is expired (deadline {status.get('deadline') or 'unknown'}); to look inside it, pin it first: "
            f"kubectl sandkeep pin {name} -n {namespace} --for 24h"
        )
    return None


def expired_by_phase(sandbox: Obj) -> bool:
    """Expired as the controller last said it (the phase): for doors that read no policy of their own."""
    return (sandbox.get("status") or {}).get("phase") == c.Phase.EXPIRED


def volume_refusal(sandbox: Obj | None, namespace: str, name: str, node: str) -> tuple[str, str] | None:
    """Why a Pod's reopen volume (`volumeAttributes: {sandbox: name}` in namespace) cannot be published on `node`,
    as the CSI status name and the message the Pod's Events show; None: it can.

    The name is looked up in the Pod's own namespace only, so another namespace's sandbox is simply not found.
    """
    refusal = sandbox_refusal(sandbox, sandbox is not None and expired_by_phase(sandbox), namespace, name)
    if refusal is not None:
        return ("NOT_FOUND" if sandbox is None else "FAILED_PRECONDITION"), refusal[1]
    assert sandbox is not None
    on = (sandbox.get("spec") or {}).get("nodeName")
    if on != node:
        return "FAILED_PRECONDITION", (
            f"RetainedSandbox {namespace}/{name} is on node {on}, not {node}; schedule the Pod there: "
            f"spec.nodeName: {on}, or a nodeSelector on kubernetes.io/hostname={on}"
        )
    return None
