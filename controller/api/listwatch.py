"""The watch stack of both components: kopf, storing nothing on the objects it watches, and `ListWatch`.

RetainedSandboxes, the one resource that grows with the fleet, come to both components through
`ListWatch`: a paginated LIST, then a WATCH from its resourceVersion with bookmarks, each event handed on
as it is decoded; each agent's carries the field selector `spec.nodeName=<node>` (a selectable field), so
the API server sends it only its own node's objects. kopf gives every object of a listing and of each
event its own worker task and queue, holding the whole object until handled: at 100,000 sandboxes that,
not the view, was the controller's peak memory (docs/benchmarks-controller.md); and it says neither when
a listing is complete nor what vanished while a watch was down, both of which ListWatch does. Which version
of an object each component's cache keeps, and what a relisting says vanished, is one rule: `cache.py`.

The controller's other watches, SandboxPolicies, Nodes and SandboxSessions, are kopf's, with low-level
`on.event` handlers only, no peering (sandkeep's own Leases elect), no kopf-posted Events and no
progress or diff-base storage: no kopf annotation, status field or finalizer ever lands on an object.
Credentials come from the same configuration as the JSON client (`controller.api.kube`), so all clients
always talk to the same server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import kopf

from controller.api.kube import PAGE, Kube, KubeError, status_message
from controller.observe import logs
from controller.rules.objects import Obj, key_of, sandbox_items

log = logging.getLogger("sandkeep.watch")

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
    if cfg.refresh_api_key_hook is not None:  # in a Pod: the projected token is re-read as it rotates
        cfg.refresh_api_key_hook(cfg)
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


def operator_settings(*, discover: bool = True) -> kopf.OperatorSettings:
    """No peering, no kopf-posted Events, no storage of any kind on objects.

    `discover=False` serves only the resources present at start, without watching CRDs or listing
    namespaces (kopf lists them to match namespace patterns even when given exact names, which needs
    a cluster-wide grant the chart does not give); a CRD that goes away then stops kopf, which health says.
    """
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = not discover
    settings.peering.standalone = True
    settings.posting.enabled = False
    settings.persistence.progress_storage = _NoProgress()
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.persistence.finalizer = "sandkeep.io/never-used-by-kopf"
    settings.watching.server_timeout = 300
    # Lists in pages; a per-object worker gone soon after its last event, so a burst leaves no bodies behind.
    settings.watching.chunk_size = 500
    settings.queueing.idle_timeout = 0.5
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


# --- ListWatch: both components' RetainedSandboxes ------------------------------------------------------
WATCH_TIMEOUT = 300  # seconds a watch request lasts on the server (kopf's server_timeout is the same)
MAX_EVENT = 16 << 20  # one watch line longer than this is refused: etcd keeps no object past 1.5 MiB


class Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): only a new listing can go on."""


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=info.ca_path)
    if info.certificate_path:
        context.load_cert_chain(info.certificate_path, info.private_key_path)
    if info.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The newline-delimited lines of a stream of chunks, each bounded by MAX_EVENT."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.strip():
                yield line
        if len(buffer) > MAX_EVENT:
            raise KubeError(0, f"a watch event is longer than {MAX_EVENT} bytes: refused")


def http_session(kube: Kube) -> aiohttp.ClientSession:
    """An HTTP session to `kube`'s server with its TLS settings: one connection per watch, never a cap (a
    watch holds its connection for minutes, and a controller watching 200 namespaces holds 200)."""
    info = connection_info(kube)
    return aiohttp.ClientSession(
        base_url=info.server,
        connector=aiohttp.TCPConnector(ssl=_ssl_context(info), limit=0),
        headers={"User-Agent": kube.api.user_agent, "Accept": "application/json"},
    )


class ListWatch:
    """One collection listed in pages, then watched from the listing's resourceVersion with bookmarks.

    `on_event(type, obj)` gets every object as it is decoded: type None for a listed object, else the
    watch event's ADDED, MODIFIED or DELETED; nothing is queued per object, so at most one page (or one
    event) is held. After each complete listing, `listed(seen)` gets the keys that exist now: what a
    caller still holds beyond them vanished while its watch was down (410 Gone after a long disconnect),
    which a watch alone never says. `synced` is set once the first listing is complete. Errors are
    logged and retried with backoff; the task ends only when cancelled.
    """

    def __init__(
        self,
        kube: Kube,
        path: str,
        on_event: Callable[[str | None, Obj], None],
        listed: Callable[[set[tuple[str, str]]], None],
        *,
        query: Mapping[str, str] | None = None,
        limit: int = PAGE,
        timeout: int = WATCH_TIMEOUT,
    ) -> None:
        self.kube = kube
        self.limit = limit
        self.timeout = timeout
        self.path = path
        self.on_event = on_event
        self.listed = listed
        self.query = dict(query or {})
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.listings = 0  # complete listings (the first and every relist after a 410)

    async def run(self, session: aiohttp.ClientSession | None = None) -> None:
        """List and watch until cancelled, on `session` (several watches share one: `http_session`)."""
        delay = 0.5
        own = session is None
        if session is None:
            session = http_session(self.kube)
        try:
            while True:
                try:
                    if not self.resource_version:
                        await self._list()
                    await self._watch(session)
                    delay = 0.5
                    continue
                except Gone:
                    logs.say(log, "watch_relist", path=self.path, resource_version=self.resource_version)
                    self.resource_version = ""
                    continue
                except (KubeError, aiohttp.ClientError, TimeoutError, ValueError) as err:
                    logs.say(
                        log,
                        "watch_failed",
                        level=logging.WARNING,
                        path=self.path,
                        error=str(err)[:300] or type(err).__name__,
                        retry_in=f"{delay:.1f}s",
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        finally:
            if own:
                await session.close()

    async def _list(self) -> None:
        """Every object, a page at a time. A listing that fails part-way (an expired continue token answers
        410) raises, and `run` starts it again whole after its backoff."""
        seen: set[tuple[str, str]] = set()
        pages = self.kube.pages(self.path, self.query, self.limit)
        resource_version = ""
        while (page := await asyncio.to_thread(next, pages, None)) is not None:
            for item in sandbox_items(page):
                seen.add(key_of(item))
                self.on_event(None, item)
            resource_version = (page.get("metadata") or {}).get("resourceVersion") or ""
            del page
        self.listed(seen)
        self.resource_version = resource_version
        self.listings += 1
        self.synced.set()
        logs.say(log, "watch_listed", path=self.path, objects=len(seen), resource_version=resource_version)

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        """One watch request, from `resource_version` until the server ends it (`timeout`); each event and
        bookmark moves the resourceVersion on, so the next request resumes where this one stopped."""
        query = {
            **self.query,
            "watch": "1",
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.timeout),
        }
        info = connection_info(self.kube)
        headers = {"Authorization": f"{info.scheme} {info.token}"} if info.token else {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout + 30)
        self.kube.requests += 1
        async with session.get(self.path, params=query, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                message = status_message(await response.text())
                if response.status == 410:
                    raise Gone(message)
                raise KubeError(response.status, message, "WATCH", self.path)
            async for line in lines(response.content.iter_any()):
                self._event(json.loads(line))

    def _event(self, event: Obj) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise KubeError(int(obj.get("code") or 0), str(obj.get("message", obj)), "WATCH", self.path)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self.on_event(kind, obj)
        if version:
            self.resource_version = version
