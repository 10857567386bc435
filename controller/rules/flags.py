"""Command-line flags merged into settings, one way for every command: env (`SANDKEEP_*`), then flags.

A flag that was not given is None (argparse's default) and leaves the env value or the default in
place; a flag that was given wins. Boolean switches use `default=None` so that leaving them off does
not override `SANDKEEP_DRY_RUN=true`. Names that are not settings fields (`--once`, `--wait`) are skipped.

A renamed flag (`add_renamed`) keeps its old spelling for one release: it sets the same value, and
`sandkeep` logs once that it is deprecated (`deprecated_uses`), as it does for a renamed env var.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from controller.rules.durations import Invalid, format_duration, parse_duration
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


# --- renamed flags and env vars (issue 26, item 5: every name says one thing) ---------------------------------
_USED = "_deprecated_spellings"  # on the parsed namespace: {old spelling: new}, each once however often given
# Env vars renamed with their flag: the old name is still read (the settings field's alias) and warned about.
RENAMED_ENV = {"SANDKEEP_NAMESPACE": "SANDKEEP_LEASE_NAMESPACE"}


class _OldSpelling(argparse.Action):
    """The old spelling of a renamed flag: stores into the new one's dest and notes the rename."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        setattr(namespace, self.dest, values)
        used = dict(getattr(namespace, _USED, {}))
        used[option or self.option_strings[0]] = self.new
        setattr(namespace, _USED, used)


def add_renamed(parser: argparse.ArgumentParser, new: str, old: str, **kwargs: Any) -> None:
    """Flag `new`, with `old` still accepted (hidden from --help) for one release; both set `new`'s dest."""
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(new, dest=dest, **kwargs)
    parser.add_argument(old, dest=dest, action=_OldSpelling, new=new, help=argparse.SUPPRESS)


def deprecated_uses(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """{old spelling: new} of every renamed flag given and renamed env var set: what to warn about, once each."""
    used: dict[str, str] = dict(getattr(args, _USED, {}))
    used.update({old: new for old, new in RENAMED_ENV.items() if old in env})
    return used


# --- settings declared once (issue 26, item 6): a field's flag, its env var and its chart value -------------
@dataclass(frozen=True)
class Flag:
    """On a settings field (`Annotated[type, Flag(...)]`): its command-line flag, from which `add_settings_arguments`
    builds the parser, so a flag never repeats the field's default or type. The env var is the field's own
    (`SANDKEEP_<FIELD>`); `value` names the chart value that sets it (the chart README's values table is checked
    against it by tests/chart/test_settings_declared.py).

    - `name`: the flag when it is not `--<field-name>` (one repeatable flag for a list: `--watch-namespace`);
    - `repeat`: each use adds one item;
    - `shown`: the default as `--help` says it, when the field's own default does not say it (None: computed);
    - `old`: its old spelling, still accepted for one release (`add_renamed`)."""

    help: str
    value: str | None = None
    name: str | None = None
    repeat: bool = False
    shown: str | None = None
    old: str | None = None


def flag_of(info: FieldInfo) -> Flag | None:
    return next((m for m in info.metadata if isinstance(m, Flag)), None)


def _base(annotation: Any) -> Any:
    """`int` of `int | None`, of `Annotated[int, ...]`, of `Annotated[int, ...] | None`; `str` of a type read
    from text by its own validator (`HumanSize`: `50Gi`), which argparse must pass on as written."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        return str if _reads_text(annotation.__metadata__) else _base(args[0])
    if args and get_origin(annotation) in (Union, UnionType):
        return _base(args[0])
    return annotation


def _reads_text(metadata: Any) -> bool:
    return any(isinstance(m, BeforeValidator) for m in metadata)


def shown_default(info: FieldInfo, declared: Flag) -> str | None:
    """The default as --help says it: the field's own (a duration written the human way), else `shown`."""
    if declared.shown is not None:
        return declared.shown
    value = info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, timedelta):
        return format_duration(value)
    if value is None:
        return "none"
    if isinstance(value, int | float | str) and value != "":
        return str(value)
    return None  # an empty text, list or object: the help says what empty means


def add_settings_arguments(
    parser: argparse.ArgumentParser, cls: type[BaseSettings], without: Collection[str] = ()
) -> None:
    """One flag per field of `cls` that declares a `Flag`, in field order: `--<field-name>` (or its `name`),
    converted as argparse converts (`int`, `float`; a bool is a switch), its default left to the settings
    (a flag not given is None: `settings_from` keeps the env's or the field's value). `without`: fields that
    are settings (env) only for this command."""
    for field, info in cls.model_fields.items():
        declared = flag_of(info)
        if declared is None or field in without:
            continue
        option = declared.name or "--" + field.replace("_", "-")
        shown = shown_default(info, declared)
        kwargs: dict[str, Any] = {"help": declared.help + (f" (default {shown})" if shown else "")}
        base = str if _reads_text(info.metadata) else _base(info.annotation)
        if declared.repeat:  # each use one item, converted as the items are (`list[int]`)
            kwargs["action"] = "append"
            item = next(iter(get_args(base)), str)
            if item in (int, float):
                kwargs["type"] = item
        elif base is bool:
            kwargs.update(action="store_true", default=None)
        elif base in (int, float):
            kwargs["type"] = base
        if declared.old is not None:
            add_renamed(parser, option, declared.old, **kwargs)  # its dest: the option's, which is the field
            continue
        parser.add_argument(option, dest=field, **kwargs)


def chart_values(cls: type[BaseSettings]) -> dict[str, str]:
    """field -> the chart value that sets it, for every field that declares one."""
    return {f: d.value for f, info in cls.model_fields.items() if (d := flag_of(info)) and d.value}
