"""The controller's view: what the watches told it, kept warm on every replica, in as little memory as a
decision allows.

Each sandbox is kept slim (`slim`: only what a decision reads, a condition's message as its digest),
its strings interned and the whole packed as one `marshal` string (`controller.api.cache.Packed`); measured
at 10,000 and 100,000 objects in docs/benchmarks-controller.md. Only `View.remember` replaces what it holds, and only
with a version at least as new (`controller.api.cache.supersedes`, the agent's cache's rule too).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controller.api.cache import Packed, supersedes
from controller.cluster.decide import OWNED_CONDITIONS, OWNED_FIELDS
from controller.rules import contracts as c
from controller.rules.objects import Obj, is_session_holder, key_of, message_digest

Key = tuple[str, str]


@dataclass
class View:
    """What the watches told us, kept warm on every replica (a standby takes over with it)."""

    sandboxes: Packed[Key] = field(default_factory=Packed)
    names: dict[str, set[str]] = field(default_factory=dict)  # namespace -> the names of its sandboxes
    on_node: dict[str, set[Key]] = field(default_factory=dict)  # node -> its sandboxes (nodeName is immutable)
    policies: dict[str, dict[str, Obj]] = field(default_factory=dict)  # namespace -> name -> SandboxPolicy
    nodes: set[str] = field(default_factory=set)
    node_gone_since: dict[str, datetime] = field(default_factory=dict)

    def put(self, key: Key, obj: Obj) -> None:
        self.sandboxes[key] = obj
        self.names.setdefault(key[0], set()).add(key[1])
        self.on_node.setdefault((obj.get("spec") or {}).get("nodeName") or "", set()).add(key)

    def drop(self, key: Key) -> None:
        obj = self.sandboxes.get(key)
        if obj is not None:
            node = (obj.get("spec") or {}).get("nodeName") or ""
            keys = self.on_node.get(node, set())
            keys.discard(key)
            if not keys:
                self.on_node.pop(node, None)
        self.sandboxes.pop(key, None)
        names = self.names.get(key[0])
        if names is not None:
            names.discard(key[1])
            if not names:
                del self.names[key[0]]

    def in_namespace(self, namespace: str) -> list[Key]:
        return [(namespace, name) for name in self.names.get(namespace, ())]

    def remember(self, obj: Obj) -> bool:
        """Keep the newest version seen (a watch event may arrive after our own write's answer); True when
        `obj` is now what the view holds."""
        key = key_of(obj)
        if supersedes(obj, self.sandboxes.get(key)):
            self.put(key, _slim(obj))
            return True
        return False

    def holds(self, key: Key, obj: Obj) -> bool:
        """The view already has exactly this version of the object (same uid, same resourceVersion)."""
        known = self.sandboxes.get(key)
        meta = obj.get("metadata") or {}
        return (
            known is not None
            and known["metadata"].get("uid") == meta.get("uid")
            and known["metadata"].get("resourceVersion") == meta.get("resourceVersion")
        )


def _compact(value: Any) -> Any:
    """A copy whose keys and short strings are interned: one "lastTransitionTime" instead of 30,000.

    JSON decoding makes a new string for every key of every object, which made the view of 10,000
    sandboxes the bulk of the controller's memory.
    """
    if isinstance(value, dict):
        return {sys.intern(k): _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, str) and len(value) <= 64:
        return sys.intern(value)
    return value


_KEPT_META = ("name", "namespace", "uid", "resourceVersion", "generation", "deletionTimestamp", "finalizers")
_KEPT_SPEC = ("nodeName", "createdAt", "retainUntil")
_KEPT_STATUS = (*OWNED_FIELDS, "inUse", "sizeBytes", "sessions")
_KEPT_CONDITIONS = frozenset((*OWNED_CONDITIONS, c.Condition.DISK_PRESENT))


def _slim(obj: Obj) -> Obj:
    """What the view keeps of an object: only what a decision reads, a condition's message as its digest.

    Measured at 3,000 objects after reconcile-all: 2.5 KiB per sandbox when the view kept whole objects
    less managedFields, most of it the conditions' messages, which no decision reads back (it compares
    them: `objects.same_condition` takes a digest for a text).
    """
    meta = obj.get("metadata", {})
    kept: Obj = {k: meta[k] for k in _KEPT_META if k in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{c.GROUP}/")}
    if annotations:
        kept["annotations"] = annotations
    spec = {k: v for k, v in (obj.get("spec") or {}).items() if k in _KEPT_SPEC}
    origin = (obj.get("spec") or {}).get("origin")
    if isinstance(origin, dict) and "outcome" in origin:  # the window per outcome and the groups read it (issue 28)
        spec["origin"] = {k: origin[k] for k in ("outcome", "owner", "labels") if k in origin}
    status = obj.get("status") or {}
    view: Obj = {k: status[k] for k in _KEPT_STATUS if k in status}
    # Of the agent's heldBy, what a decision reads (objects.observed_of): the holders that are sessions' Pods,
    # which make the sandbox Open. Without them a sandbox a session held stayed Retained in the view.
    namespace = meta.get("namespace") or ""
    sessions = [h for h in status.get("heldBy") or [] if isinstance(h, str) and is_session_holder(h, namespace)]
    if sessions:
        view["heldBy"] = sessions
    conditions = [
        cd | {"message": message_digest(cd.get("message", ""))}
        for cd in status.get("conditions") or []
        if cd.get("type") in _KEPT_CONDITIONS
    ]
    if conditions:
        view["conditions"] = conditions
    slim: Obj = _compact({"metadata": kept, "spec": spec, "status": view})
    return slim
