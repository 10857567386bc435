"""Command-line flags merged into settings, one way for every command: env (`SANDKEEP_*`), then flags.

A flag that was not given is None (argparse's default) and leaves the env value or the default in
place; a flag that was given wins. Boolean switches use `default=None` so that leaving them off does
not override `SANDKEEP_DRY_RUN=true`. Names that are not settings fields (`--once`, `--wait`) are skipped.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_settings import BaseSettings

from controller.rules.durations import Invalid, parse_duration
from controller.rules.sizes import parse_size

S = TypeVar("S", bound=BaseSettings)


def _duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    parsed = parse_duration(value)
    if isinstance(parsed, Invalid):
        raise ValueError(str(parsed))
    return parsed


# A duration setting written the human way (`72h`, `30d`, `1h30m`), from the env or a flag: one annotated
# type for every component's settings (controller, agent, sweep) instead of a validator per class. A bad
# value stops the process at start, naming it.
HumanDuration = Annotated[timedelta, BeforeValidator(_duration), Field(json_schema_extra={"format": "duration"})]


def _size(value: Any) -> int:
    parsed = parse_size(value)
    if isinstance(parsed, Invalid):
        raise ValueError(str(parsed))
    return parsed


def _qps(value: float) -> float:
    if value == 0:
        raise ValueError("a QPS of 0 allows no request: give a positive rate, or a negative one for no limit")
    return value


# A client-side rate limit in requests a second (client-go's QPS): positive, or negative for none.
KubeQps = Annotated[float, AfterValidator(_qps)]

# A byte count written the Kubernetes way (`50Gi`, `500Mi`, `2T` or plain bytes), from the env or a flag.
HumanSize = Annotated[int, BeforeValidator(_size)]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# A JSON object or list from a flag or the env (the chart renders values such as resources with toJson).
JsonObject = Annotated[dict[str, Any], BeforeValidator(_json)]
JsonList = Annotated[tuple[dict[str, Any], ...], BeforeValidator(_json)]


def settings_from(cls: type[S], args: argparse.Namespace) -> S:
    """`cls()` from the env, with every flag given on the command line put over it (ValueError when bad)."""
    given = {k: v for k, v in vars(args).items() if v is not None and k in cls.model_fields}
    return cls(**given)
