"""What the API server's audit log (hack/localcluster.py, node mode) says each service account wrote.

The agents' and the controllers' own logs go with their Pods (a rollout or a lost node takes them); the audit
log is the API server's and keeps every write, so "deleted exactly once" and "API writes per deletion" are
counted from it, by the server that decided each request.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controller.rules import contracts as c


@dataclass(frozen=True)
class Write:
    user: str
    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int
    body: Any  # the request's body, for the sandkeep.io resources
    at: str  # stageTimestamp, RFC 3339 with microseconds

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.at)

    @property
    def ok(self) -> bool:
        return 200 <= self.code < 300

    @property
    def sandbox(self) -> bool:
        return self.resource == c.SANDBOX_PLURAL

    @property
    def removes_finalizer(self) -> bool:
        """A JSON patch of a sandbox's metadata that removes the finalizer (the agent's last step)."""
        ops = self.body if self.verb == "patch" and isinstance(self.body, list) else []
        return self.sandbox and any(
            op.get("op") == "remove" and str(op.get("path", "")).startswith("/metadata/finalizers/") for op in ops
        )


def stamp(at: datetime) -> str:
    """`at` as the audit log writes its stageTimestamp (UTC, microseconds): a `since` for what follows."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return stamp(datetime.now(UTC))


def writes(log: Path, since: str = "") -> Iterator[Write]:
    """Every write the log holds (the completed ones), at or after `since` (an audit stageTimestamp)."""
    with log.open() as lines:
        for line in lines:
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete" or event.get("stageTimestamp", "") < since:
                continue
            ref = event.get("objectRef") or {}
            yield Write(
                user=event["user"]["username"],
                verb=event["verb"],
                resource=ref.get("resource", ""),
                subresource=ref.get("subresource", ""),
                namespace=ref.get("namespace", ""),
                name=ref.get("name", ""),
                code=(event.get("responseStatus") or {}).get("code", 0),
                body=event.get("requestObject"),
                at=event["stageTimestamp"],
            )


def sandbox_writes(log: Path, namespace: str, verb: str, since: str = "") -> Iterator[Write]:
    """The successful `verb`s of `namespace`'s sandbox objects themselves (not their status), at or after `since`."""
    for w in writes(log, since):
        if w.namespace == namespace and w.sandbox and not w.subresource and w.verb == verb and w.ok:
            yield w


def deleted(log: Path, namespace: str, since: str = "") -> Counter[str]:
    """Per sandbox of `namespace`: how many times a finalizer removal succeeded (once is deleted once)."""
    return Counter(w.name for w in sandbox_writes(log, namespace, "patch", since) if w.removes_finalizer)


def created(log: Path, namespace: str, since: str = "") -> Counter[str]:
    """Per sandbox of `namespace`: how many times its object was created (an agent adopting its directory)."""
    return Counter(w.name for w in sandbox_writes(log, namespace, "create", since))


def released(log: Path, namespace: str, since: str = "") -> Counter[str]:
    """Per sandbox of `namespace`: how many DELETEs of its object succeeded (an expiry or a release decided)."""
    return Counter(w.name for w in sandbox_writes(log, namespace, "delete", since))
