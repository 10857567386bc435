"""The controller's settings (`SANDKEEP_*` env vars, overridden by flags) and its few fixed names."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Annotated

from pydantic import AliasChoices, Field

from controller.cluster.session_decide import DEFAULT_RESOURCES, MAX_ID, SessionSettings
from controller.rules import contracts as c
from controller.rules import models
from controller.rules.flags import RENAMED_ENV, Flag, HumanDuration, HumanSize, JsonList, JsonObject, KubeQps
from controller.rules.policy import Ceiling, Policy, Quota

COMPONENT = "sandkeep-controller"
# Test seam: when set, the controller waits at `<dir>/<ns>.<name>.go` between its decision and DELETE.
SEAM_ENV = "SANDKEEP_TEST_BEFORE_DELETE_DIR"


def _bound(bound: c.SessionBound, text: str) -> Flag:
    """The flag of a bound on sessions (issue 25): its flag and chart value `sessions.<value>` are contracts."""
    return Flag(text, value=f"sessions.{bound.value}", name=bound.flag)


class ControllerSettings(models.Settings):
    """The controller's settings (`SANDKEEP_*` env vars; flags override them), each declared once: its type,
    default, env var, flag (`Flag`, from which main.py's parser is built) and chart value."""

    node_grace: Annotated[
        HumanDuration,
        Flag("how long a node may be gone before its sandboxes are Lost", value="controller.nodeGrace"),
    ] = timedelta(minutes=10)
    # Where the leader Lease lives (env SANDKEEP_LEASE_NAMESPACE; SANDKEEP_NAMESPACE, its old name, is
    # still read for one release).
    lease_namespace: Annotated[
        str, Flag("namespace of the leader Lease (env SANDKEEP_LEASE_NAMESPACE)", old="--namespace")
    ] = Field(
        "sandkeep-system", validation_alias=AliasChoices("lease_namespace", "SANDKEEP_LEASE_NAMESPACE", *RENAMED_ENV)
    )
    kubeconfig: Annotated[str | None, Flag("kubeconfig path", shown="in-cluster, else $KUBECONFIG")] = None
    metrics_port: Annotated[
        int, Flag("port of /metrics and /healthz (0 = any free port)", value="controller.metricsPort")
    ] = 8080
    metrics_host: Annotated[str, Flag("address to serve metrics on")] = "127.0.0.1"
    lease_duration: Annotated[int, Flag("leader Lease duration in seconds", value="controller.leaseDuration")] = 15
    workers: Annotated[int, Flag("concurrent reconciles", value="controller.workers")] = 8
    identity: Annotated[str | None, Flag("leader-election identity", shown="hostname_pid")] = None
    watch_namespaces: Annotated[
        tuple[str, ...],
        Flag(
            "watch only this namespace (repeatable; default: the whole cluster)",
            value="controller.watchNamespaces",
            name="--watch-namespace",
            repeat=True,
        ),
    ] = ()
    # Client-side rate limit of every API request but the watches (client-go's QPS and burst). Off by
    # default (a negative QPS, client-go's convention): the controller is one client whose pace is the
    # cluster's (a policy change over 100,000 sandboxes, a wave of due deletions), and the API server's
    # Priority and Fairness protects itself, as SIG API Machinery advises and controller-runtime defaults
    # to since v0.21. The agents, thousands of clients restarting together, keep theirs.
    kube_qps: Annotated[
        KubeQps,
        Flag(
            "API requests per second on average; negative: no client-side limit",
            value="controller.kubeApi.qps",
            shown="-1, the server's APF",
        ),
    ] = -1.0
    kube_burst: Annotated[
        int, Field(ge=1), Flag("API requests at once above the average", value="controller.kubeApi.burst")
    ] = 200
    # How long one attempt to post a warnWebhook notice may wait on each socket operation (notices.py).
    warn_webhook_timeout: Annotated[
        HumanDuration,
        Flag("how long one warnWebhook attempt may wait for the receiver", value="controller.warnWebhookTimeout"),
    ] = timedelta(seconds=5)
    # Quotas per namespace (all nodes together): the default where a SandboxPolicy sets none, and the
    # ceiling no policy can exceed. None: no limit.
    quota_max_bytes: Annotated[
        HumanSize | None, Flag("default quota per namespace in bytes (e.g. 50Gi)", value="settings.quota.maxBytes")
    ] = None
    quota_max_count: Annotated[
        Annotated[int, Field(ge=0)] | None,
        Flag("default quota per namespace in sandboxes", value="settings.quota.maxCount"),
    ] = None
    quota_ceiling_bytes: Annotated[
        HumanSize | None,
        Flag("bytes quota no namespace policy can exceed", value="settings.quotaCeiling.maxBytes"),
    ] = None
    quota_ceiling_count: Annotated[
        Annotated[int, Field(ge=0)] | None,
        Flag("count quota no namespace policy can exceed", value="settings.quotaCeiling.maxCount"),
    ] = None
    # SandboxSessions (controller/cluster/sessions.py): whether they are served (their Pods run in their
    # sandbox's own namespace), the default image, the longest lifetime, the uid a session runs
    # as when its workspace's owner is not known (or a system id), the admission policy binding proving
    # who asked (and the policy it binds), and the bounds of issue 25: caps on live sessions, the lowest
    # owner id taken from disk, the images allowed, the container's resources and the agent's tolerations.
    sessions: Annotated[
        bool, Flag("serve SandboxSessions: a Pod in the sandbox's own namespace", value="sessions.enabled")
    ] = False
    sessions_image: Annotated[str, Flag("image of a session that names none", value="sessions.image")] = ""
    sessions_max_lifetime: Annotated[HumanDuration, Flag("longest session lifetime", value="sessions.maxLifetime")] = (
        timedelta(hours=8)
    )
    sessions_run_as_user: Annotated[
        int,
        Field(ge=1, le=MAX_ID),
        Flag("uid of a session whose workspace owner is unknown", value="sessions.runAsUser"),
    ] = c.NOBODY
    sessions_admission_binding: Annotated[
        str, Flag("ValidatingAdmissionPolicyBinding that proves a session's user")
    ] = ""
    sessions_admission_policy: Annotated[
        str, Flag("the policy that binding must bind", name=c.SESSIONS_ADMISSION_POLICY, shown="the binding's name")
    ] = ""
    sessions_max_per_user: Annotated[
        int, Field(ge=0), _bound(c.SESSIONS_MAX_PER_USER, "live sessions one user may have, cluster-wide")
    ] = c.SESSIONS_MAX_PER_USER.default
    sessions_max_per_namespace: Annotated[
        int, Field(ge=0), _bound(c.SESSIONS_MAX_PER_NAMESPACE, "live sessions a namespace may have")
    ] = c.SESSIONS_MAX_PER_NAMESPACE.default
    sessions_min_owner_id: Annotated[
        int,
        Field(ge=1),
        _bound(
            c.SESSIONS_MIN_OWNER_ID,
            "lowest workspace owner uid/gid a session runs as; lower ones run as --sessions-run-as-user",
        ),
    ] = c.SESSIONS_MIN_OWNER_ID.default
    sessions_allowed_images: Annotated[
        tuple[str, ...],
        Flag(
            "an image sessions may run besides --sessions-image (repeat for each)",
            value="sessions.allowedImages",
            name=c.SESSIONS_ALLOWED_IMAGE,
            repeat=True,
        ),
    ] = ()
    sessions_resources: Annotated[
        JsonObject,
        Flag(
            "JSON: the session container's requests and limits", value="sessions.resources", name=c.SESSIONS_RESOURCES
        ),
    ] = Field(default_factory=lambda: copy.deepcopy(DEFAULT_RESOURCES))
    sessions_tolerations: Annotated[
        JsonList, Flag("JSON list: the agent's tolerations (bound a session's)", name=c.SESSIONS_TOLERATIONS)
    ] = ()

    def session_settings(self) -> SessionSettings | None:
        if not self.sessions:
            return None
        return SessionSettings(
            image=self.sessions_image,
            max_lifetime=self.sessions_max_lifetime,
            run_as_user=self.sessions_run_as_user,
            admission_binding=self.sessions_admission_binding,
            admission_policy=self.sessions_admission_policy,
            max_per_user=self.sessions_max_per_user,
            max_per_namespace=self.sessions_max_per_namespace,
            min_owner_id=self.sessions_min_owner_id,
            allowed_images=self.sessions_allowed_images,
            resources=self.sessions_resources,
            tolerations=tuple(self.sessions_tolerations),
        )

    def policy(self) -> Policy:
        return replace(super().policy(), quota=Quota(self.quota_max_bytes, self.quota_max_count))

    def ceiling(self) -> Ceiling:
        return replace(super().ceiling(), quota=Quota(self.quota_ceiling_bytes, self.quota_ceiling_count))
