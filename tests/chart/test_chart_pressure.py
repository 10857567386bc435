"""The chart's values for releasing space: disk pressure (`pressure.high`, `pressure.low`,
`pressure.minFreeBytes`) rendered into the agent's flags, quotas (`settings.quota`, `settings.quotaCeiling`)
into the controller's environment; each read by that component's own settings, and bad values refused with
a clear message."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from controller import agent
from controller.cli.sandkeep import COMMANDS
from controller.cluster import main as controller_mod
from controller.rules.policy import Quota
from tests.bed.chart import controller_settings, find, objects, refused, render


def parsed_args(manifest: str, kind: str, component: Any, prefix: str) -> Any:
    """The rendered `kind`'s arguments of `component` that start with `prefix`, parsed by the component's
    own flags and settings."""
    args = find(objects(manifest), kind)["spec"]["template"]["spec"]["containers"][0]["args"]
    name = next(command for command, (module, _) in COMMANDS.items() if module == component.__name__)
    parser = argparse.ArgumentParser()
    component.add_arguments(name, parser)
    own = [a for a in args[args.index(name) + 1 :] if a.startswith(prefix)]
    return component.settings_from(parser.parse_args(own))


def agent_settings(manifest: str) -> agent.AgentSettings:
    """The rendered DaemonSet's pressure arguments, parsed by the agent's own flags and settings."""
    settings: agent.AgentSettings = parsed_args(manifest, "DaemonSet", agent, "--pressure-")
    return settings


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
    refused(tools, value, words)


# --- quotas (the controller's settings) ----------------------------------------------------------------
def test_quotas_are_off_by_default_and_reach_the_controller_as_given(tools: Path) -> None:
    assert controller_settings(render(tools)).policy().quota == Quota()
    settings = controller_settings(
        render(
            tools,
            "--set=settings.quota.maxBytes=50Gi",
            "--set=settings.quota.maxCount=0",
            "--set=settings.quotaCeiling.maxBytes=1099511627776",
            "--set=settings.quotaCeiling.maxCount=500",
        )
    )
    assert settings.policy().quota == Quota(max_bytes=50 << 30, max_count=0)
    assert settings.ceiling().quota == Quota(max_bytes=1 << 40, max_count=500)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("--set=settings.quota.maxBytes=1.5G", "/settings/quota/maxBytes"),
        ("--set=settings.quota.maxCount=-1", "/settings/quota/maxCount"),
        ("--set=settings.quotaCeiling.maxBytes=-5", "/settings/quotaCeiling/maxBytes"),
        ("--set=settings.quota.maxSize=5", "maxSize"),
        ("--set=controller.kubeApi.qps=0", "/controller/kubeApi/qps"),
    ],
)
def test_bad_quota_values_are_refused(tools: Path, value: str, words: str) -> None:
    refused(tools, value, words)


def test_the_client_rate_limits_reach_both_components(tools: Path) -> None:
    manifest = render(tools, "--set-json=agent.kubeApi.qps=7.5", "--set=controller.kubeApi.burst=300")
    settings = parsed_args(manifest, "DaemonSet", agent, "--kube-")
    assert (settings.kube_qps, settings.kube_burst) == (7.5, 40)
    ctl = parsed_args(manifest, "Deployment", controller_mod, "--kube-")
    assert (ctl.kube_qps, ctl.kube_burst) == (-1, 300)  # no client-side limit by default: the server's APF


def test_the_quarantine_grace_reaches_the_agent_and_zero_means_never(tools: Path) -> None:
    settings: agent.AgentSettings = parsed_args(render(tools), "DaemonSet", agent, "--quarantine-")
    assert settings.quarantine_grace.total_seconds() == 24 * 3600
    never: agent.AgentSettings = parsed_args(
        render(tools, "--set-string=agent.quarantineGrace=0"), "DaemonSet", agent, "--quarantine-"
    )
    assert never.quarantine_grace.total_seconds() == 0
    refused(tools, "--set-string=agent.quarantineGrace=1.5h", "/agent/quarantineGrace")
