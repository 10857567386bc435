"""The one watch stack of both components: kopf, storing nothing on the objects it watches.

The controller watches RetainedSandboxes, SandboxPolicies and Nodes; each agent watches only its own
node's RetainedSandboxes, filtered by the API server (`spec.nodeName=<node>`, a selectable field), so
other nodes' objects never reach it. Both run kopf with low-level `on.event` handlers only, no peering
(sandkeep's own Leases elect), no kopf-posted Events and no progress or diff-base storage: no kopf
annotation, status field or finalizer ever lands on an object. Credentials come from the same
configuration as the JSON client (`controller.kube`), so both clients always talk to the same server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import kopf

from controller import contracts as c
from controller.kube import Kube, Obj

Handler = Callable[[str | None, Obj], Awaitable[None]]


class _NoProgress(kopf.ProgressStorage):
    """Progress storage that stores nothing: no kopf annotation or status field ever lands on an object."""

    def fetch(self, **_: Any) -> None:
        return None

    def store(self, **_: Any) -> None:
        return None

    def purge(self, **_: Any) -> None:
        return None

    def touch(self, **_: Any) -> None:
        return None

    def clear(self, *, essence: Any) -> Any:
        return essence


class _NoDiffBase(kopf.DiffBaseStorage):
    def fetch(self, **_: Any) -> None:
        return None

    def store(self, **_: Any) -> None:
        return None


def connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """kopf's credentials from the configuration the JSON client uses (one source of truth)."""
    cfg = kube.configuration
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme, token = (auth.split(" ", 1) if auth and " " in auth else ("Bearer", auth)) if auth else (None, None)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
    )


def operator_settings(
    field_selectors: Mapping[tuple[str, str], str] | None = None, *, discover: bool = True
) -> kopf.OperatorSettings:
    """No peering, no kopf-posted Events, no storage of any kind on objects; optional server-side filters.

    `discover=False` serves only the resources present at start, without watching the CRDs (and without
    the RBAC to list them); a CRD that goes away then stops the operator, which the caller's health says.
    """
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = not discover
    settings.peering.standalone = True
    settings.posting.enabled = False
    settings.persistence.progress_storage = _NoProgress()
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.persistence.finalizer = "sandkeep.io/never-used-by-kopf"
    settings.watching.server_timeout = 300
    # Lists in pages, so the first listing of 100,000 objects is never one response held at once; a
    # per-object worker gone soon after its last event, so a burst of events leaves no bodies behind.
    settings.watching.chunk_size = 500
    settings.queueing.idle_timeout = 0.5
    for (group, plural), selector in (field_selectors or {}).items():
        settings.watching.field_selectors[group, plural] = selector
    return settings


def registry(kube: Kube, watches: Mapping[tuple[str, ...], Handler]) -> kopf.OperatorRegistry:
    """A registry that logs in with `kube`'s credentials and feeds each watched resource to its handler.

    The handlers are coroutines, so kopf runs them on the loop (a plain function would run in a thread),
    where the components' work queues live: a queue is for one loop and is not thread-safe. Each gets the
    event's type (None for the objects of an initial listing) and the object as a plain dict. A watch is
    named as kopf names resources: (group, version, plural), or ("v1", plural) for the core group.
    """
    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(kube)

    for resource, handler in watches.items():

        async def on_event(event: kopf.RawEvent, _handler: Handler = handler, **_: Any) -> None:
            await _handler(event.get("type"), dict(event["object"]))

        kopf.on.event(*resource, registry=reg, id=f"watch-{resource[-1]}")(on_event)
    return reg


def sandbox_watch(node: str | None = None) -> Mapping[tuple[str, str], str]:
    """The field selectors for watching RetainedSandboxes: every node's, or only `node`'s."""
    return {(c.GROUP, c.SANDBOX_PLURAL): f"spec.nodeName={node}"} if node else {}


def run(
    reg: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    *,
    namespaces: Sequence[str] = (),
    stop: asyncio.Event | None = None,
) -> asyncio.Task[None]:
    """Start kopf on the running loop: cluster-wide, or only `namespaces`. Without `stop`, kopf itself
    handles SIGTERM/SIGINT; with it, the caller's signal handling stays in charge."""
    if logging.getLogger().level > logging.DEBUG:  # one "Handler succeeded" line per watch event is noise
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    scope: dict[str, Any] = {"namespaces": list(namespaces)} if namespaces else {"clusterwide": True}
    if stop is not None:
        scope["stop_flag"] = stop
    return asyncio.create_task(
        kopf.operator(registry=reg, settings=settings, standalone=True, **scope),
        name="kopf",
    )
