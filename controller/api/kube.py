"""Kubernetes client helpers shared by the controller and the node agent.

One small JSON-over-HTTP adapter (`Kube.request`) on top of the official client's authentication and
connection pool, so every call reads and writes plain dicts exactly as the API server sends them, and
the few operations sandkeep needs: sandboxes, policies, nodes, Events, status by server-side apply,
annotation patches and deletes guarded by uid + resourceVersion. Transport only: what the objects say
(accessors, conditions, a SandboxPolicy's spec) is read in `controller.rules.objects`, with no client.

Status ownership (both components follow it): each writes `status` by SERVER-SIDE APPLY on the status
subresource with its own field manager (`CONTROLLER_MANAGER`, `AGENT_MANAGER`). An apply always carries
every field that manager owns, so a field it stops sending is removed, and the other manager's fields
and condition types (conditions are a map-list keyed by `type`) are never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from controller import __version__
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from controller.rules.models import bounded_name
from controller.rules.objects import Obj, sandbox_items

log = logging.getLogger(__name__)

CONTROLLER_MANAGER = "sandkeep-controller"
AGENT_MANAGER = "sandkeep-agent"
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE"})
PAGE = 500  # objects per list request: memory stays bounded however many objects there are


class KubeError(Exception):
    """A request the API server refused (or could not be sent): the status code and the server's words."""

    def __init__(self, status: int, message: str, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: {status} {message}".strip())
        self.status = status
        self.message = message

    @property
    def conflict(self) -> bool:
        """409: a precondition (uid, resourceVersion) failed or someone else changed the object first."""
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404


# --- configuration ---------------------------------------------------------------------------------------
def load_config(kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> k8s.Configuration:
    """The client configuration: an explicit kubeconfig, else in-cluster, else $KUBECONFIG / ~/.kube/config.

    An explicit path always wins, so a test or a person can point a process at a cluster even when it
    happens to run inside another one; so does a `context` (a kubeconfig context's name, as kubectl's
    `--context`), which only a kubeconfig has.
    """
    configuration = k8s.Configuration()
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=_kubeconfig_path(kubeconfig), context=context, client_configuration=configuration
        )
    # Workers issue requests from a thread pool: one connection per thread, never a pool-full warning.
    configuration.connection_pool_maxsize = 32
    return configuration


def _kubeconfig_path(kubeconfig: str | os.PathLike[str] | None) -> str | None:
    return str(kubeconfig) if kubeconfig is not None else os.environ.get("KUBECONFIG") or None


def config_namespace(kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> str:
    """The namespace kubectl would use without `-n`: the context's, else in a Pod its own, else `default`."""
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        with (
            contextlib.suppress(OSError),
            open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f,
        ):
            return f.read().strip() or "default"
        return "default"
    contexts, current = k8s_config.list_kube_config_contexts(_kubeconfig_path(kubeconfig))  # type: ignore[no-untyped-call]
    chosen = next((ctx for ctx in contexts if ctx.get("name") == context), None) if context else current
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


def now_utc() -> datetime:
    return datetime.now(UTC)


def micro_time(when: datetime) -> str:
    """A Kubernetes MicroTime (`2026-01-02T03:04:05.123456Z`), as Leases and Events carry."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _path(plural: str, namespace: str | None, name: str | None, subresource: str | None) -> str:
    """The REST path of one of sandkeep's collections (all namespaces, or one), one object, or its subresource."""
    base = f"/apis/{c.GROUP}/{c.VERSION}"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{base}/{plural}"
    if name:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


def sandbox_path(namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    """The REST path of the RetainedSandbox collection (all namespaces, or one) or of one object."""
    return _path(c.SANDBOX_PLURAL, namespace, name, subresource)


def session_path(namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    """The API path of SandboxSessions (all, one namespace's, one, or one's subresource)."""
    return _path(c.SESSION_PLURAL, namespace, name, subresource)


def policy_path(namespace: str | None = None, name: str | None = None) -> str:
    base = f"/apis/{c.GROUP}/{c.VERSION}"
    path = f"{base}/namespaces/{quote(namespace)}/{c.POLICY_PLURAL}" if namespace else f"{base}/{c.POLICY_PLURAL}"
    return path if name is None else f"{path}/{quote(name)}"


class RateLimiter:
    """A token bucket, as client-go's flowcontrol limiter: `qps` requests a second on average, `burst` at once.

    Thread-safe; `wait()` blocks until a token is free. A client of 5,000 agents adopting at once, or of a
    controller rewriting 100,000 statuses, must not be what takes the API server down.
    """

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs qps > 0 and burst >= 1, got qps {qps}, burst {burst}")
        self.qps, self.burst, self.clock = qps, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds spent waiting, in all

    @classmethod
    def of(cls, qps: float, burst: int) -> RateLimiter | None:
        """The limiter a `--kube-qps`/`--kube-burst` pair asks for: None (no client-side limit) when qps < 0."""
        return None if qps < 0 else cls(qps, burst)

    def reserve(self) -> float:
        """Take a token; how long to wait before using it (0 when one was free)."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1
            delay = 0.0 if self._tokens >= 0 else -self._tokens / self.qps
            self.waited += delay
            return delay

    def wait(self) -> None:
        delay = self.reserve()
        if delay > 0:
            time.sleep(delay)


def status_message(text: str) -> str:
    """The `message` of a refused request's Status body, or the body itself when it is not one."""
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(text).get("message", text))
    return text


class Kube:
    """A thin, thread-safe JSON client: plain dicts in and out, KubeError for every refusal.

    Synchronous on purpose (the official client is); async callers run it with `asyncio.to_thread`.
    `user_agent` names the component, so the API server's audit and request logs say who wrote what.
    With `limiter`, every request waits for its token first (watches are kopf's and not counted).
    """

    def __init__(
        self,
        configuration: k8s.Configuration,
        component: str = "sandkeep",
        timeout: float = 30.0,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.configuration = configuration
        self.api = k8s.ApiClient(configuration)
        self.api.user_agent = f"{component}/{__version__}"
        self.component = component
        self.timeout = timeout
        self.limiter = limiter
        self.requests = 0  # sent, in all (for benchmarks and tests)

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Any:
        """One API request; returns the decoded JSON body (None when empty), raises KubeError otherwise."""
        if self.limiter is not None:
            self.limiter.wait()
        self.requests += 1
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        try:
            _method, url, headers_out, body_out, _post = self.api.param_serialize(
                method, path, query_params=params, header_params=headers, body=body, auth_settings=["BearerToken"]
            )
            response = self.api.call_api(
                method, url, header_params=headers_out, body=body_out, _request_timeout=timeout or self.timeout
            )
            data = response.read()  # type: ignore[no-untyped-call]
        except Exception as err:  # connection refused, TLS, timeout: the caller decides whether to retry
            raise KubeError(0, f"request failed: {err}", method, path) from err
        text = data.decode("utf-8", "replace") if data else ""
        if not 200 <= response.status < 300:
            raise KubeError(response.status, status_message(text), method, path)
        return json.loads(text) if text else None

    # --- RetainedSandboxes --------------------------------------------------------------------------------
    def get_sandbox(self, namespace: str, name: str) -> Obj | None:
        """The object as the API server has it now (a quorum read), or None when it does not exist."""
        try:
            result: Obj = self.request("GET", sandbox_path(namespace, name))
        except KubeError as err:
            if err.not_found:
                return None
            raise
        return result

    def pages(self, path: str, query: Mapping[str, Any] | None = None, limit: int = PAGE) -> Iterator[Obj]:
        """A collection one page at a time (limit/continue): every list response, the last one carrying
        the snapshot's resourceVersion; no page is ever more than `limit` objects held at once."""
        token: str | None = None
        while True:
            page: Obj = self.request("GET", path, query={**(query or {}), "limit": str(limit), "continue": token})
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def iter_sandboxes(self, namespace: str | None = None, node: str | None = None) -> Iterator[Obj]:
        """Every sandbox (of one namespace, of one node via the `spec.nodeName` selectable field), paged."""
        query = {"fieldSelector": f"spec.nodeName={node}" if node else None}
        for page in self.pages(sandbox_path(namespace), query):
            yield from sandbox_items(page)

    def list_sandboxes(self, namespace: str | None = None, node: str | None = None) -> list[Obj]:
        return list(self.iter_sandboxes(namespace, node))

    def create_sandbox(self, namespace: str, body: Obj) -> Obj:
        body = {"apiVersion": c.API_VERSION, "kind": c.SANDBOX_KIND, **body}
        result: Obj = self.request("POST", sandbox_path(namespace), body=body)
        return result

    def apply_status(self, obj: Obj, status: Obj, manager: str) -> Obj:
        """Server-side apply of `status` as `manager`: exactly the fields this manager owns, nothing else.

        Forced, because `phase` moves between the two managers by design (the agent's on deleting
        objects); without force the API server would refuse the hand-over with a conflict.
        """
        meta = obj["metadata"]
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "status": status,
        }
        result: Obj = self.request(
            "PATCH",
            sandbox_path(meta["namespace"], meta["name"], "status"),
            body=body,
            query={"fieldManager": manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        return result

    def patch_annotations(self, obj: Obj, changes: Mapping[str, str | None]) -> Obj:
        """Set (or, for None, remove) annotations, only if the object is still at the version read.

        The resourceVersion in a merge patch is a precondition: a change in between makes this a 409 and
        the caller decides again on the fresh object instead of overwriting what it did not see.
        """
        meta = obj["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"], "annotations": dict(changes)}}
        result: Obj = self.request(
            "PATCH",
            sandbox_path(meta["namespace"], meta["name"]),
            body=body,
            content_type="application/merge-patch+json",
        )
        return result

    def delete_sandbox(self, obj: Obj, *, dry_run: bool = False) -> Obj | None:
        """DELETE with preconditions on uid AND resourceVersion: any change since the read makes it a 409."""
        meta = obj["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
        }
        if dry_run:
            body["dryRun"] = ["All"]
        result: Obj | None = self.request("DELETE", sandbox_path(meta["namespace"], meta["name"]), body=body)
        return result

    def remove_finalizer(self, obj: Obj, finalizer: str = c.FINALIZER) -> Obj:
        """Drop one finalizer, guarded by resourceVersion (a JSON patch `test` keeps others' finalizers)."""
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        index = finalizers.index(finalizer)
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
            {"op": "test", "path": f"/metadata/finalizers/{index}", "value": finalizer},
            {"op": "remove", "path": f"/metadata/finalizers/{index}"},
        ]
        return self._guarded_json_patch(meta, ops)

    def add_finalizer(self, obj: Obj, finalizer: str = c.FINALIZER) -> Obj:
        """Add one finalizer (no-op when present), guarded by resourceVersion like every metadata write."""
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        if finalizer in finalizers:
            return obj
        add = (
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer}
            if finalizers
            else {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]}
        )
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}, add]
        return self._guarded_json_patch(meta, ops)

    def _guarded_json_patch(self, meta: Obj, ops: list[Obj]) -> Obj:
        """A JSON patch whose `test` ops guard it; a failed `test` (422) is a stale read, so it is a 409."""
        try:
            result: Obj = self.request(
                "PATCH",
                sandbox_path(meta["namespace"], meta["name"]),
                body=ops,
                content_type="application/json-patch+json",
            )
        except KubeError as err:
            if err.status == 422:
                raise KubeError(409, err.message) from err
            raise
        return result

    # --- policies and nodes --------------------------------------------------------------------------------
    def list_policies(self, namespace: str | None = None) -> list[Obj]:
        items: list[Obj] = self.request("GET", policy_path(namespace)).get("items", [])
        return items

    def get_node(self, name: str) -> Obj | None:
        try:
            result: Obj = self.request("GET", f"/api/v1/nodes/{quote(name)}")
        except KubeError as err:
            if err.not_found:
                return None
            raise
        return result

    # --- Events --------------------------------------------------------------------------------------------
    def post_event(
        self,
        obj: Obj,
        reason: c.Reason,
        message: str,
        type: str = "Normal",
        component: str | None = None,
    ) -> None:
        """Post a core/v1 Event about `obj`; never raises (an Event is a report, not a decision).

        The involvedObject carries uid and resourceVersion, so `kubectl describe` shows the Event on
        this object and not on a later one of the same name.
        """
        meta = obj.get("metadata", {})
        namespace = meta.get("namespace") or "default"
        stamp = now_utc()
        source = component or self.component
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": bounded_name("", f"{meta.get('name', 'unknown')}.{secrets.token_hex(8)}"),
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", c.API_VERSION),
                "kind": obj.get("kind", c.SANDBOX_KIND),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": str(reason),
            "message": message[:1024],
            "type": type,
            "source": {"component": source},
            "reportingComponent": f"{c.GROUP}/{source}",
            "reportingInstance": os.environ.get("HOSTNAME", source)[:128],
            "firstTimestamp": format_instant(stamp),
            "lastTimestamp": format_instant(stamp),
            "count": 1,
        }
        try:
            self.request("POST", f"/api/v1/namespaces/{quote(namespace)}/events", body=event)
        except Exception as err:  # an unreachable API server must not turn a decision into a crash
            logs.say(
                log, "event_not_posted", level=logging.WARNING, reason=reason, object=_ref(obj), error=str(err)[:300]
            )


def _ref(obj: Obj) -> str:
    meta = obj.get("metadata", {})
    return f"{meta.get('namespace')}/{meta.get('name')}"
