"""Several SandboxPolicies in one namespace: which one applies, and the status each one carries.

The rule is the oldest (creationTimestamp, then name): adding a policy never silently changes what a
namespace already runs under. Every other policy gets `Active=False` with reason `Superseded`, naming
the one that applies, so `kubectl get sbp` shows the conflict instead of hiding it. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from controller import contracts as c
from controller import kube
from controller.kube import Obj


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
        cond = kube.condition(
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
