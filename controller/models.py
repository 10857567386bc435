"""Typed shapes: the on-disk manifest, settings from env and flags, and Kubernetes name rules.

Nothing read from disk or the API is trusted: every shape is validated here, and a value that does not
fit is refused with a message naming the field, never coerced into something else.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.durations import Invalid, parse_duration, parse_instant
from controller.policy import Ceiling, Facts, Policy

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_namespace_name(text: str) -> bool:
    """A DNS-1123 label (what a namespace may be called): never empty, never starting with a dot."""
    return len(text) <= 63 and bool(_DNS1123_LABEL.match(text))


def is_object_name(text: str) -> bool:
    """A DNS-1123 subdomain (what a RetainedSandbox may be called)."""
    return len(text) <= 253 and bool(_DNS1123_SUBDOMAIN.match(text))


def _instant_or_none(value: Any) -> datetime | None:
    parsed = parse_instant(value) if isinstance(value, str) else None
    return None if parsed is None or isinstance(parsed, Invalid) else parsed


MANIFEST_SCHEMA_VERSION = 1


class Manifest(BaseModel):
    """`<root>/<namespace>/<name>/manifest.json`: who, when, and the deadline recorded at retention.

    Time fields stay text: the one rule parses them, so a bad `createdAt` or pin is reported as the rule
    reports it (expired, or no pin) rather than making the whole manifest unreadable.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    schema_version: Literal[1] = Field(1, alias="schemaVersion")
    namespace: str
    name: str
    job_id: str = Field("", alias="jobId", max_length=1024)
    created_at: str | None = Field(None, alias="createdAt")
    retain_until: str | None = Field(None, alias="retainUntil")
    keep_until: str | None = Field(None, alias="keepUntil")  # a standalone pin
    pinned_at: str | None = Field(None, alias="pinnedAt")
    node: str | None = None
    workspace: str = "workspace"  # relative to the sandbox directory; never absolute

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not is_namespace_name(v):
            raise ValueError(f"namespace {v!r} is not a DNS-1123 label")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not is_object_name(v):
            raise ValueError(f"name {v!r} is not a DNS-1123 subdomain")
        return v

    @field_validator("workspace")
    @classmethod
    def _workspace(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or not v:
            raise ValueError(f"workspace {v!r} must be a relative path inside the sandbox")
        return v

    def facts(self) -> Facts:
        """What the one rule reads from this manifest."""
        return Facts(
            created_at=_instant_or_none(self.created_at),
            retain_until=_instant_or_none(self.retain_until),
            pin_until=self.keep_until,
            pinned_at=self.pinned_at,
        )

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2) + "\n"


def _duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    parsed = parse_duration(value)
    if isinstance(parsed, Invalid):
        raise ValueError(str(parsed))
    return parsed


Duration = Annotated[timedelta, Field(json_schema_extra={"format": "duration"})]


class Settings(BaseSettings):
    """Settings every sandkeep process shares, from `SANDKEEP_*` env vars (flags override them).

    Durations are written the human way (`72h`, `30d`); a bad value stops the process at start with the
    variable's name, not at the first sandbox it would have decided.
    """

    model_config = SettingsConfigDict(env_prefix="SANDKEEP_", extra="ignore")

    retention: Duration = timedelta(hours=72)
    max_pin: Duration = timedelta(days=30)
    max_retention: Duration = timedelta(days=90)  # the ceiling no namespace policy can exceed
    max_pin_ceiling: Duration = timedelta(days=90)
    dry_run: bool = False

    @field_validator("retention", "max_pin", "max_retention", "max_pin_ceiling", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> timedelta:
        return _duration(v)

    def policy(self) -> Policy:
        return Policy(self.retention, self.max_pin, self.dry_run)

    def ceiling(self) -> Ceiling:
        return Ceiling(self.max_retention, self.max_pin_ceiling)
