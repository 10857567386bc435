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
from controller.rules.flags import RENAMED_ENV, HumanDuration, HumanSize, JsonList, JsonObject, KubeQps
from controller.rules.policy import Ceiling, Policy, Quota

COMPONENT = "sandkeep-controller"
# Test seam: when set, the controller waits at `<dir>/<ns>.<name>.go` between its decision and DELETE.
SEAM_ENV = "SANDKEEP_TEST_BEFORE_DELETE_DIR"


class ControllerSettings(models.Settings):
    """The controller's settings (`SANDKEEP_*` env vars; flags override them)."""

    node_grace: HumanDuration = timedelta(minutes=10)  # a node gone this long: its sandboxes are Lost
    # Where the leader Lease lives (env SANDKEEP_LEASE_NAMESPACE; SANDKEEP_NAMESPACE, its old name, is
    # still read for one release).
    lease_namespace: str = Field(
        "sandkeep-system", validation_alias=AliasChoices("lease_namespace", "SANDKEEP_LEASE_NAMESPACE", *RENAMED_ENV)
    )
    kubeconfig: str | None = None
    metrics_port: int = 8080
    metrics_host: str = "127.0.0.1"
    lease_duration: int = 15
    workers: int = 8
    identity: str | None = None
    watch_namespaces: tuple[str, ...] = ()  # empty: the whole cluster
    # Client-side rate limit of every API request but the watches (client-go's QPS and burst). Off by
    # default (a negative QPS, client-go's convention): the controller is one client whose pace is the
    # cluster's (a policy change over 100,000 sandboxes, a wave of due deletions), and the API server's
    # Priority and Fairness protects itself, as SIG API Machinery advises and controller-runtime defaults
    # to since v0.21. The agents, thousands of clients restarting together, keep theirs.
    kube_qps: KubeQps = -1.0
    kube_burst: Annotated[int, Field(ge=1)] = 200
    # Quotas per namespace (all nodes together): the default where a SandboxPolicy sets none, and the
    # ceiling no policy can exceed. None: no limit.
    quota_max_bytes: HumanSize | None = None
    quota_max_count: Annotated[int, Field(ge=0)] | None = None
    quota_ceiling_bytes: HumanSize | None = None
    quota_ceiling_count: Annotated[int, Field(ge=0)] | None = None
    # SandboxSessions (controller/cluster/sessions.py): whether they are served (their Pods run in their
    # sandbox's own namespace), the default image, the longest lifetime, the uid a session runs
    # as when its workspace's owner is not known (or a system id), the admission policy binding proving
    # who asked (and the policy it binds), and the bounds of issue 25: caps on live sessions, the lowest
    # owner id taken from disk, the images allowed, the container's resources and the agent's tolerations.
    sessions: bool = False
    sessions_image: str = ""
    sessions_max_lifetime: HumanDuration = timedelta(hours=8)
    sessions_run_as_user: Annotated[int, Field(ge=1, le=MAX_ID)] = c.NOBODY
    sessions_admission_binding: str = ""
    sessions_admission_policy: str = ""
    sessions_max_per_user: Annotated[int, Field(ge=0)] = c.SESSIONS_MAX_PER_USER.default
    sessions_max_per_namespace: Annotated[int, Field(ge=0)] = c.SESSIONS_MAX_PER_NAMESPACE.default
    sessions_min_owner_id: Annotated[int, Field(ge=1)] = c.SESSIONS_MIN_OWNER_ID.default
    sessions_allowed_images: tuple[str, ...] = ()
    sessions_resources: JsonObject = Field(default_factory=lambda: copy.deepcopy(DEFAULT_RESOURCES))
    sessions_tolerations: JsonList = ()

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
