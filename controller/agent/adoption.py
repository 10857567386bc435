"""Adoption: a retained directory with a valid manifest and no object gets one, finalizer included."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from controller.agent.decide import Key
from controller.agent.report import Reporter
from controller.agent.state import Part, Shared
from controller.api.kube import KubeError
from controller.node.store import Entry, Mismatch, Present, Read, Transient
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.contracts import FINALIZER, Reason
from controller.rules.models import label_value
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.agent")

Each = Callable[[list[Key], Callable[[Key], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class Refusal:
    """A sandbox-shaped entry no object can be made for: why (`reason`), the read it was refused on, and
    what a person can do (`action`)."""

    entry: Entry
    reason: Reason
    read: Read
    action: str


class Adopter(Part):
    def __init__(self, shared: Shared, report: Reporter, each: Each) -> None:
        super().__init__(shared)
        self.report = report
        self.each = each  # runs one coroutine per key, a bounded number at once

    async def adopt(self, entries: Iterable[Entry]) -> list[Refusal]:
        """Create the missing objects for a scan's sandboxes; return the entries no object can be made for.

        Refused (quarantined by the caller, `quarantine.py`): a manifest that is missing, does not parse,
        cannot be read or names another sandbox, one without a usable createdAt (the CRD requires one), a
        namespace that does not exist. A read that failed for a moment, or an API error, is neither: tried
        again next pass.
        """
        refused: list[Refusal] = []
        namespaces: dict[str, bool] = {}
        todo: dict[Key, Present] = {}
        for entry in entries:
            key = (entry.namespace, entry.name)
            if key in self.state.objects:
                continue
            read = await asyncio.to_thread(self.root.read, *key)
            if isinstance(read, Transient):
                continue
            if isinstance(read, Mismatch):
                claims = f"{read.manifest.namespace}/{read.manifest.name}"
                why = f"the manifest names another sandbox ({claims}) than its path; fix or remove the directory"
                refused.append(Refusal(entry, Reason.MANIFEST_MISMATCH, read, why))
                continue
            if not isinstance(read, Present):
                refused.append(Refusal(entry, read.reason, read, "no readable manifest; fix or remove the directory"))
                continue
            if read.manifest.facts().created_at is None:
                why = "the manifest has no usable createdAt; fix it or remove the directory"
                refused.append(Refusal(entry, Reason.NO_CREATED_AT, read, why))
                continue
            if entry.namespace not in namespaces:
                namespaces[entry.namespace] = await asyncio.to_thread(self.namespace_exists, entry.namespace)
            if not namespaces[entry.namespace]:
                why = f"namespace {entry.namespace} does not exist; create it, or remove the directory"
                refused.append(Refusal(entry, Reason.NAMESPACE_MISSING, read, why))
                continue
            todo[key] = read
        await self.each(list(todo), lambda key: self._create(key, todo[key]))
        return refused

    def namespace_exists(self, name: str) -> bool:
        try:
            self.kube.request("GET", f"/api/v1/namespaces/{name}")
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return True

    def _body(self, key: Key, read: Present) -> Obj:
        """The object for a manifest: its times, job and origin, the node, a pin it carries, our finalizer."""
        m = read.manifest
        spec: Obj = {
            "nodeName": self.s.node,
            "createdAt": m.created_at,
            "workspace": {"path": str(self.root.sandbox_path(*key) / m.workspace)},
        }
        if m.retain_until:
            spec["retainUntil"] = m.retain_until
        if m.job_id:
            spec["jobId"] = m.job_id
        if m.origin is not None:  # a captured workspace's Pod, owner, node, containers and outcome
            spec["origin"] = m.origin.body()
        body: Obj = {
            "metadata": {
                "name": key[1],
                "namespace": key[0],
                "finalizers": [FINALIZER],
                "labels": {c.LABEL_NODE: label_value(self.s.node), c.LABEL_MANAGED_BY: c.MANAGED_BY},
            },
            "spec": spec,
        }
        if m.keep_until:
            body["metadata"]["annotations"] = {c.ANN_PIN_UNTIL: m.keep_until}
            if m.pinned_at:
                body["metadata"]["annotations"][c.ANN_PINNED_AT] = m.pinned_at
        return body

    async def _create(self, key: Key, read: Present) -> None:
        try:
            created: Obj = await asyncio.to_thread(self.kube.create_sandbox, key[0], self._body(key, read))
        except KubeError as err:
            terminating = err.status == 403 and "being terminated" in err.message
            self.report.say_limited(
                f"adopt:{key}",
                "adoption_failed",
                reason=Reason.CONFLICT if err.conflict else Reason.ADOPTION_FAILED,
                object=f"{key[0]}/{key[1]}",
                error=err.message[:300],
                action=(
                    f"namespace {key[0]} is being deleted: the directory is kept and retried every pass; "
                    "remove it if it is not needed"
                    if terminating
                    else "retried every pass"
                ),
            )
            return
        self.state.remember(created)
        logs.say(log, "adopted", reason=Reason.ADOPTED, object=f"{key[0]}/{key[1]}", uid=created["metadata"]["uid"])
        where = f"adopted {self.root.sandbox_path(*key)} on node {self.s.node}"
        await self.report.event(created, Reason.ADOPTED, where)
