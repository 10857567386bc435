"""What kube-apiserver says it served (`apiserver_request_total` of its /metrics): the tests' and the benches'
count of a component's API requests and writes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Iterator

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})


def _requests(metrics_text: str) -> Iterator[tuple[dict[str, str], float]]:
    """Each `apiserver_request_total` series: its labels and its count."""
    for line in metrics_text.splitlines():
        if line.startswith("apiserver_request_total{"):
            head, _, value = line.rpartition(" ")
            yield dict(re.findall(r'(\w+)="([^"]*)"', head)), float(value)


def writes_by_resource(metrics_text: str) -> dict[str, float]:
    """The write requests kube-apiserver has served, by resource, from its own `apiserver_request_total`.

    Collection deletes (DELETE at namespace or cluster scope) are left out: kube-controller-manager's
    namespace controller sends them while it empties deleted namespaces, and neither sandkeep component
    may `deletecollection` (tests/apiserver/test_rbac.py), so they are never sandkeep's writes.
    """
    totals: dict[str, float] = {}
    for labels, value in _requests(metrics_text):
        verb, resource = labels.get("verb", ""), labels.get("resource", "")
        if verb not in WRITE_VERBS or (verb == "DELETE" and labels.get("scope") != "resource"):
            continue
        totals[resource] = totals.get(resource, 0.0) + value
    return totals


def requests_by(metrics_text: str, *, subresource: bool = False) -> dict[str, float]:
    """Every request kube-apiserver has served, from its `apiserver_request_total`, as "VERB resource"
    (with `subresource`: "VERB resource/subresource" where there is one) -> count."""
    out: dict[str, float] = {}
    for labels, value in _requests(metrics_text):
        sub = labels.get("subresource") if subresource else None
        key = f"{labels.get('verb')} {labels.get('resource')}{'/' + sub if sub else ''}"
        out[key] = out.get(key, 0.0) + value
    return out


def settled_writes(
    metrics_text: Callable[[], str], resources: Collection[str], *, still_for: float = 1.0, timeout: float = 30.0
) -> dict[str, float] | None:
    """The write counts on `resources` once none has moved for `still_for` seconds; None when they never
    settle within `timeout` (a writer more frequent than that). Counters only grow, so two equal readings
    mean no write in between."""

    def read() -> dict[str, float]:
        return {r: n for r, n in writes_by_resource(metrics_text()).items() if r in resources}

    last = read()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(still_for)
        now = read()
        if now == last:
            return now
        last = now
    return None
