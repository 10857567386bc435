"""The chart's disk-pressure values (`pressure.high`, `pressure.low`, `pressure.minFreeBytes`): rendered into
the agent's flags, which the agent's own settings accept, and bad values refused with a clear message."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from localcluster import kube_version
from test_chart import CHART, find, helm, objects, render

from controller import agent


def agent_settings(manifest: str) -> agent.AgentSettings:
    """The rendered DaemonSet's agent arguments, parsed by the agent's own flags and settings."""
    args = find(objects(manifest), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    agent.add_arguments("agent", parser)
    own = [a for a in args[args.index("agent") + 1 :] if a.startswith("--pressure-")]
    return agent.settings_from(parser.parse_args(own))


def test_the_defaults_sit_below_the_kubelets_eviction_threshold_and_reach_the_agent(tools: Path) -> None:
    settings = agent_settings(render(tools))
    # kubelet: evictionHard nodefs.available<10% is 90% used; image GC runs at 85% and stops at 80%.
    assert (settings.pressure_high, settings.pressure_low, settings.pressure_min_free_bytes) == (85, 80, 0)
    assert settings.pressure_high < 90


def test_values_reach_the_agent_as_given(tools: Path) -> None:
    manifest = render(
        tools, "--set-json=pressure.high=88.5", "--set=pressure.low=70", "--set=pressure.minFreeBytes=10737418240"
    )
    settings = agent_settings(manifest)
    assert (settings.pressure_high, settings.pressure_low, settings.pressure_min_free_bytes) == (88.5, 70, 10 << 30)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("--set=pressure.low=90", "pressure.low (90) must be below pressure.high (85)"),
        ("--set=pressure.low=85", "pressure.low (85) must be below pressure.high (85)"),
        ("--set=pressure.high=120", "/pressure/high"),
        ("--set=pressure.high=0", "/pressure/high"),
        ("--set=pressure.low=-5", "/pressure/low"),
        ("--set=pressure.minFreeBytes=-1", "/pressure/minFreeBytes"),
        ("--set=pressure.hihg=90", "pressure"),
    ],
)
def test_bad_pressure_values_are_refused(tools: Path, value: str, words: str) -> None:
    result = helm(tools, "template", "sk", str(CHART), f"--kube-version={kube_version()}", value, check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr
