"""Several SandboxPolicies in one namespace: which one applies, and the status each one carries.

The rule is the oldest (creationTimestamp, then name): adding a policy never silently changes what a
namespace already runs under. Every other policy gets `Active=False` with reason `Superseded`, naming
the one that applies, so `kubectl get sbp` shows the conflict instead of hiding it. The rule and the
statuses are pure; `write_statuses` is the thin adapter the controller's leader calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from controller.api import kube
from controller.api.kube import CONTROLLER_MANAGER, Kube, policy_path
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.objects import Obj


def _age_key(name: str, obj: Obj) -> tuple[str, str]:
    # The API server writes creationTimestamp as RFC 3339 in UTC to the second, so text order is time order;
    # a missing one (never from the server) sorts last rather than winning.
    return (obj.get("metadata", {}).get("creationTimestamp") or "9999", name)


def in_force(policies: Mapping[str, Obj]) -> str | None:
    """The name of the policy that applies among one namespace's policies (name -> object); None when none."""
    if not policies:
        return None
    return min(policies, key=lambda name: _age_key(name, policies[name]))


def policy_statuses(namespace: str, policies: Mapping[str, Obj], now: datetime | None = None) -> dict[str, Obj]:
    """name -> the status the controller applies to that policy: observedGeneration and the Active condition.

    Each condition keeps its lastTransitionTime while its status holds, so re-applying is a no-op.
    """
    winner = in_force(policies)
    others = sorted(n for n in policies if n != winner)
    result: dict[str, Obj] = {}
    for name, obj in policies.items():
        generation = obj.get("metadata", {}).get("generation")
        if name == winner:
            active, reason = True, c.Reason.IN_FORCE
            message = f"applies to the RetainedSandboxes of namespace {namespace}"
            if others:
                message += f"; superseded here and without effect: {', '.join(others)} (the oldest policy applies)"
        else:
            active, reason = False, c.Reason.SUPERSEDED
            message = (
                f"SandboxPolicy {namespace}/{winner} applies instead: it is the oldest of the {len(policies)} "
                f"policies in namespace {namespace}, and only one applies; merge this one's settings into "
                f"{winner} and delete this one"
            )
        previous = (obj.get("status") or {}).get("conditions") or []
        cond = objects.condition(
            c.PolicyCondition.ACTIVE,
            active,
            reason,
            message,
            observed_generation=generation,
            previous=previous,
            now=now,
        )
        status: Obj = {"conditions": [cond]}
        if generation is not None:
            status["observedGeneration"] = generation
        result[name] = status
    return result


def _unchanged(current: Obj, desired: Obj) -> bool:
    have = {cd.get("type"): cd for cd in current.get("conditions") or []}
    return current.get("observedGeneration") == desired.get("observedGeneration") and all(
        objects.same_condition(have.get(cd["type"]), cd) for cd in desired["conditions"]
    )


def write_statuses(client: Kube, namespace: str, policies: Mapping[str, Obj]) -> list[str]:
    """Apply each policy's status as the controller (server-side apply, its own field manager); only the
    ones that would change are written, so a steady namespace costs no writes. Returns the names written.

    A policy deleted meanwhile (404) is skipped: its namespace is recomputed on the DELETED event.
    """
    written = []
    for name, status in policy_statuses(namespace, policies).items():
        if _unchanged(policies[name].get("status") or {}, status):
            continue
        body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": name, "namespace": namespace}}
        try:
            client.request(
                "PATCH",
                policy_path(namespace, name) + "/status",
                body=body | {"status": status},
                query={"fieldManager": CONTROLLER_MANAGER, "force": "true"},
                content_type="application/apply-patch+yaml",
            )
        except kube.KubeError as err:
            if err.not_found:
                continue
            raise
        written.append(name)
    return written
