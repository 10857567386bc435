"""Typed shapes: the on-disk manifest, settings from env and flags, and Kubernetes name rules.

Nothing read from disk or the API is trusted: every shape is validated here, and a value that does not
fit is refused with a message naming the field, never coerced into something else.
"""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.rules.contracts import ORIGIN_CONTAINERS_MAX, ORIGIN_LABELS, Outcome
from controller.rules.durations import instant_or_none
from controller.rules.flags import Flag, HumanDuration
from controller.rules.policy import Ceiling, Facts, Policy, Windows

# Whole-string matches: `$` also matches before a final newline, which let `ns\n` pass as a namespace.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
LABEL_VALUE_MAX = 63
NAME_MAX = 253  # a DNS-1123 subdomain: object names, node names
_HASH_LEN = 16  # hex digits of sha256 kept: 64 bits, so two names of one cluster never share a bounded form


def is_namespace_name(text: str) -> bool:
    """A DNS-1123 label (what a namespace may be called): never empty, never starting with a dot."""
    return len(text) <= 63 and bool(_DNS1123_LABEL.fullmatch(text))


def is_object_name(text: str) -> bool:
    """A DNS-1123 subdomain (what a RetainedSandbox may be called)."""
    return len(text) <= NAME_MAX and bool(_DNS1123_SUBDOMAIN.fullmatch(text))


def _bounded(text: str, limit: int) -> str:
    """`text` cut to fit `limit` with `-<hash of all of text>` appended: stable, distinct, alnum at the end."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]
    kept = re.sub(r"[^A-Za-z0-9._-]", "-", text[: limit - _HASH_LEN - 1]).strip("-._")
    return f"{kept}-{digest}" if kept else digest


def label_value(text: str) -> str:
    """`text` as a label value: itself when it is one, else a bounded form with a hash of the whole.

    Node and object names run to 253 characters and label values stop at 63, so a label built from a
    name as-is is a 422 from the API server, retried forever. Select by field (spec.nodeName), not by it.
    """
    if len(text) <= LABEL_VALUE_MAX and _LABEL_VALUE.fullmatch(text):
        return text
    return _bounded(text, LABEL_VALUE_MAX)


def bounded_name(prefix: str, name: str, limit: int = NAME_MAX) -> str:
    """`prefix + name` as an object name: as-is when it fits in `limit`, else cut with a hash of `name`."""
    if len(prefix) + len(name) <= limit:
        return prefix + name
    return prefix + _bounded(name, limit - len(prefix))


def _namespace_name(v: str) -> str:
    if not is_namespace_name(v):
        raise ValueError(f"namespace {v!r} is not a DNS-1123 label")
    return v


def _object_name(v: str) -> str:
    if not is_object_name(v):
        raise ValueError(f"name {v!r} is not a DNS-1123 subdomain")
    return v


NamespaceName = Annotated[str, AfterValidator(_namespace_name)]  # a field that must be a namespace's name
ObjectName = Annotated[str, AfterValidator(_object_name)]  # ... an object's name


MANIFEST_SCHEMA_VERSION = 1
IMAGE_MAX = 512  # an image reference in `origin.containers[].image` (registry/path:tag@sha256:... fits)
ORIGIN_PATH_MAX = 512  # a container's recorded workingDir or mountPath (longer ones are not recorded)
_Name = Annotated[str, Field(max_length=NAME_MAX)]
_Short = Annotated[str, Field(max_length=LABEL_VALUE_MAX)]
_Id = Annotated[int, Field(ge=0, le=2**31 - 1)]  # a uid or gid as a Pod's securityContext takes it


class OriginOwner(BaseModel):
    """The Pod's controlling owner (its first ownerReference with `controller: true`)."""

    kind: _Short
    name: _Name


class OriginContainer(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: _Short
    image: Annotated[str, Field(max_length=IMAGE_MAX)] = ""
    exit_code: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = Field(None, alias="exitCode")
    # Where it worked, and where it mounted the captured volume (absent: the image's default, or not mounted):
    # what `kubectl sandkeep open --as-job` opens the workspace as.
    working_dir: Annotated[str, Field(max_length=ORIGIN_PATH_MAX)] | None = Field(None, alias="workingDir")
    mount_path: Annotated[str, Field(max_length=ORIGIN_PATH_MAX)] | None = Field(None, alias="mountPath")
    # Who it ran as (its securityContext's, else the Pod's; absent: the image's user, unknown here).
    run_as_user: _Id | None = Field(None, alias="runAsUser")
    run_as_group: _Id | None = Field(None, alias="runAsGroup")


class Origin(BaseModel):
    """Where a captured workspace came from (issue 27): its Pod, owner, node, containers and outcome.

    Written into the manifest when the workspace is kept (by `sandkeep retain --outcome`, the outcome alone) and
    copied by adoption to `spec.origin`; every list and string is bounded here and in the CRD, so no Pod can make
    an object the API server refuses.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    pod: _Name | None = None  # absent for `sandkeep retain --outcome`'s, which knows no Pod
    pod_uid: Annotated[str, Field(max_length=128)] = Field("", alias="podUID")
    owner: OriginOwner | None = None
    node: _Name | None = None
    containers: list[OriginContainer] = Field(default_factory=list, max_length=ORIGIN_CONTAINERS_MAX)
    outcome: Outcome
    labels: dict[str, _Short] = Field(default_factory=dict)
    fs_group: _Id | None = Field(None, alias="fsGroup")  # the Pod's fsGroup: the group its workspace was written as

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(ORIGIN_LABELS))
        if unknown:
            raise ValueError(f"labels {unknown} are not among {list(ORIGIN_LABELS)}")
        return v

    def body(self) -> dict[str, object]:
        """As `spec.origin` says it (camelCase, absent fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Manifest(BaseModel):
    """`<root>/<namespace>/<name>/manifest.json`: who, when, and the deadline recorded at retention.

    Time fields stay text: the one rule parses them, so a bad `createdAt` or pin is reported as the rule
    reports it (expired, or no pin) rather than making the whole manifest unreadable.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    schema_version: Literal[1] = Field(1, alias="schemaVersion")
    namespace: NamespaceName
    name: ObjectName
    job_id: str = Field("", alias="jobId", max_length=1024)
    created_at: str | None = Field(None, alias="createdAt")
    retain_until: str | None = Field(None, alias="retainUntil")
    keep_until: str | None = Field(None, alias="keepUntil")  # a standalone pin
    pinned_at: str | None = Field(None, alias="pinnedAt")
    node: str | None = None
    workspace: str = "workspace"  # relative to the sandbox directory; never absolute
    origin: Origin | None = None  # a captured workspace's (issue 27); absent for `sandkeep retain`'s

    @field_validator("workspace")
    @classmethod
    def _workspace(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or not v:
            raise ValueError(f"workspace {v!r} must be a relative path inside the sandbox")
        return v

    @field_validator("origin", mode="wrap")
    @classmethod
    def _origin(cls, v: object, handler: ValidatorFunctionWrapHandler) -> Origin | None:
        """An origin that does not fit is dropped, never the manifest: the files are what must be kept."""
        try:
            origin: Origin | None = handler(v)
        except ValidationError:
            return None
        return origin

    def facts(self, newer: int | None = None) -> Facts:
        """What the one rule reads from this manifest; `newer`: how many of its history group and outcome are
        newer (counted over a pass's manifests; None: in no group)."""
        return Facts(
            created_at=instant_or_none(self.created_at),
            retain_until=instant_or_none(self.retain_until),
            pin_until=self.keep_until,
            pinned_at=self.pinned_at,
            outcome=self.origin.outcome if self.origin is not None else None,
            newer=newer,
        )

    def as_object(self) -> dict[str, Any]:
        """What a RetainedSandbox of this manifest says of it that the history groups read: its key, createdAt and
        origin (the standalone sweep groups manifests as the controller groups objects)."""
        spec: dict[str, Any] = {"createdAt": self.created_at}
        if self.origin is not None:
            spec["origin"] = self.origin.body()
        return {"metadata": {"namespace": self.namespace, "name": self.name}, "spec": spec}

    def to_json(self) -> str:
        unset = {"origin"} if self.origin is None else None  # a manifest without one reads as it always did
        return self.model_dump_json(by_alias=True, indent=2, exclude=unset) + "\n"


class Settings(BaseSettings):
    """Settings every sandkeep process shares, from `SANDKEEP_*` env vars (flags override them).

    Durations are written the human way (`72h`, `30d`); a bad value stops the process at start with the
    variable's name, not at the first sandbox it would have decided.
    """

    model_config = SettingsConfigDict(env_prefix="SANDKEEP_", extra="ignore")

    retention: Annotated[
        HumanDuration, Flag("cluster default retention window, e.g. 72h", value="settings.retention")
    ] = timedelta(hours=72)
    max_pin: Annotated[HumanDuration, Flag("cluster default longest pin, e.g. 30d", value="settings.maxPin")] = (
        timedelta(days=30)
    )
    # the ceiling no namespace policy can exceed
    max_retention: Annotated[
        HumanDuration, Flag("ceiling no namespace policy can exceed", value="settings.maxRetention")
    ] = timedelta(days=90)
    max_pin_ceiling: Annotated[
        HumanDuration, Flag("pin ceiling no namespace policy can exceed", value="settings.maxPinCeiling")
    ] = timedelta(days=90)
    dry_run: Annotated[bool, Flag("decide and report, delete nothing", value="settings.dryRun")] = False
    # The window per outcome of the job (issue 28) where a SandboxPolicy sets none; None: `retention`.
    retention_failed: Annotated[
        HumanDuration | None,
        Flag("cluster default retention of Failed jobs", value="settings.retentionByOutcome.failed"),
    ] = None
    retention_succeeded: Annotated[
        HumanDuration | None,
        Flag("cluster default retention of Succeeded jobs", value="settings.retentionByOutcome.succeeded"),
    ] = None
    retention_unknown: Annotated[
        HumanDuration | None,
        Flag("cluster default retention of Unknown jobs", value="settings.retentionByOutcome.unknown"),
    ] = None
    # The hard end (issue 28): past createdAt + max_age only a live user of a sandbox's directory keeps it. The
    # default of every namespace and the ceiling of every SandboxPolicy's maxAge; None: off.
    max_age: Annotated[
        HumanDuration | None,
        Flag("the hard end (default off): every namespace's maxAge and its ceiling", value="settings.maxAge"),
    ] = None

    def policy(self) -> Policy:
        windows = Windows(self.retention_failed, self.retention_succeeded, self.retention_unknown)
        return Policy(self.retention, self.max_pin, self.dry_run, by_outcome=windows, max_age=self.max_age)

    def ceiling(self) -> Ceiling:
        return Ceiling(self.max_retention, self.max_pin_ceiling, max_age=self.max_age)
