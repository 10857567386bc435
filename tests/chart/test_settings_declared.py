"""Settings declared once (issue 26, item 6): the controller's and the agent's flags are built from their settings'
declarations (`flags.Flag` on each field of controller/cluster/settings.py and controller/agent/settings.py), and
every chart value a setting names is in the chart README's values table with the setting's own default (or
null, saying that default in words)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings

from controller.agent import command
from controller.agent.settings import AgentSettings
from controller.cluster import main
from controller.cluster.settings import ControllerSettings
from controller.rules import flags
from controller.rules.models import Settings

REPO = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?P<type>\w+) \| `(?P<default>.*)` \| (?P<text>.*) \|$")


def values_table() -> dict[str, tuple[Any, str]]:
    """key -> (default, description) of every row of charts/sandkeep/README.md's values table."""
    rows = {}
    for line in (REPO / "charts" / "sandkeep" / "README.md").read_text().splitlines():
        if row := _ROW.match(line):
            rows[row["key"]] = (json.loads(row["default"].replace("\\|", "|")), row["text"].replace("\\|", "|"))
    return rows


# Each component: its settings, the command that parses them, and the settings that are env only there.
COMPONENTS: dict[str, tuple[type[BaseSettings], Any, set[str]]] = {
    "controller": (ControllerSettings, main.add_arguments, set()),
    "agent": (AgentSettings, command.add_arguments, set(Settings.model_fields)),
}
FIELDS = [(name, field) for name, (cls, _, env_only) in COMPONENTS.items() for field in cls.model_fields]
FIELDS = [(name, field) for name, field in FIELDS if field not in COMPONENTS[name][2]]


def parser(component: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    COMPONENTS[component][1](component, p)
    return p


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_setting_has_one_flag_built_from_its_declaration(component: str) -> None:
    cls, _, env_only = COMPONENTS[component]
    fields = cls.model_fields
    undeclared = [f for f, info in fields.items() if flags.flag_of(info) is None]
    assert undeclared == [], "a setting with no Flag cannot be set from the command line"
    dests = {a.dest for a in parser(component)._actions if a.dest != "help"}
    assert dests == set(fields) - env_only


@pytest.mark.parametrize(("component", "field"), FIELDS)
def test_each_flag_sets_its_setting(component: str, field: str) -> None:
    # The value each flag carries reaches the setting: one that differs from the default, written as a person would.
    cls = COMPONENTS[component][0]
    info = cls.model_fields[field]
    declared = flags.flag_of(info)
    assert declared is not None
    option = declared.name or "--" + field.replace("_", "-")
    samples = {
        "kubeconfig": "/k",
        "watch_namespaces": "team-a",
        "sessions_allowed_images": "busybox:1",
        "sessions_resources": '{"limits": {"cpu": "2"}}',
        "sessions_tolerations": '[{"key": "k", "operator": "Exists"}]',
        "kube_qps": "5",
        "identity": "me",
        "root": "/r",
        "ignore_pids": "7",
        "pressure_high": "90",
        "pressure_low": "70",
        **dict.fromkeys(("retention_failed", "retention_succeeded", "retention_unknown", "max_age"), "5h"),
    }
    default = info.get_default(call_default_factory=True)
    if isinstance(default, bool):
        args = [option]
    else:
        text = samples.get(field)
        if text is None:
            text = {int: "7", str: "x", type(None): "9"}.get(type(default), "5h" if "bytes" not in field else "5Gi")
        args = [option, text]
    got = getattr(flags.settings_from(cls, parser(component).parse_args(args)), field)
    assert got != default, f"{' '.join(args)} left {field} at its default"


@pytest.mark.parametrize("component", COMPONENTS)
def test_the_chart_values_table_matches_the_settings_it_sets(component: str) -> None:
    table = values_table()
    cls, _, env_only = COMPONENTS[component]
    declared = {f: v for f, v in flags.chart_values(cls).items() if f not in env_only}
    assert len(declared) >= 10, "the component's chart values are declared on its settings"
    for field, key in declared.items():
        assert key in table, f"{field}: chart value {key} is not in the values table"
        chart, text = table[key]
        default = cls.model_fields[field].get_default(call_default_factory=True)
        if chart is None and default is not None:  # left null: the setting's own default applies, and says so
            assert f"({default})" in text, f"{key} is null: its description must name {field}'s default {default}"
            continue
        assert getattr(cls(**{field: chart}), field) == default, f"{key}: {chart!r} vs {default!r}"
