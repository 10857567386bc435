"""Renamed flags (issue 26, item 5: every name says one thing): `--lease-namespace` (controller, agent) and
`--install-namespace` (doctor, uninstall) are the names; the old `--namespace` still sets the same value for
one release, hidden from --help, and `sandkeep` warns once that it is deprecated; so does SANDKEEP_NAMESPACE."""

from __future__ import annotations

import pytest

from controller.agent.settings import AgentSettings
from controller.cli import sandkeep
from controller.cluster.settings import ControllerSettings
from controller.rules import flags

RENAMED = [("controller", "--lease-namespace"), ("agent", "--lease-namespace")]
RENAMED += [("doctor", "--install-namespace"), ("uninstall", "--install-namespace")]


@pytest.mark.parametrize(("command", "new"), RENAMED)
def test_both_spellings_set_the_new_flags_value_and_only_the_old_one_is_noted(command: str, new: str) -> None:
    dest = new.removeprefix("--").replace("-", "_")
    parser = sandkeep._parser(command)
    command = command if command != "uninstall" else "uninstall --agent-daemonset=y"
    parse = parser.parse_args
    current = parse([*command.split(), f"{new}=team"])
    assert getattr(current, dest) == "team" and flags.deprecated_uses(current, {}) == {}
    old = parse([*command.split(), "--namespace", "old", "--namespace=team"])
    assert getattr(old, dest) == "team", "the last one given wins, as for any flag"
    assert flags.deprecated_uses(old, {}) == {"--namespace": new}, "noted once however often given"
    assert not hasattr(old, "namespace")


@pytest.mark.parametrize(("command", "new"), RENAMED)
def test_help_names_only_the_new_spelling(command: str, new: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sandkeep._parser(command).parse_args([command, "--help"])
    shown = capsys.readouterr().out
    assert new in shown and "--namespace " not in shown and "--namespace\n" not in shown


@pytest.mark.parametrize("settings", [ControllerSettings, AgentSettings])
def test_the_lease_namespace_env_var_and_its_old_name(settings: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDKEEP_NODE", "node-a")
    assert settings().lease_namespace == "sandkeep-system"
    monkeypatch.setenv("SANDKEEP_NAMESPACE", "old")
    assert settings().lease_namespace == "old"
    monkeypatch.setenv("SANDKEEP_LEASE_NAMESPACE", "new")
    assert settings().lease_namespace == "new", "the new name wins"
    assert settings(lease_namespace="flag").lease_namespace == "flag", "and a flag over both"


def test_sandkeep_warns_once_per_old_spelling_then_runs_the_command(capfd: pytest.CaptureFixture[str]) -> None:
    # uninstall needs its namespace in either spelling: without one it stops before reaching any cluster.
    uninstall = ["uninstall", "--agent-daemonset=y"]
    assert sandkeep.main(uninstall) == 2
    assert "--install-namespace is required" in capfd.readouterr().err
    args = sandkeep._parser("uninstall").parse_args([*uninstall, "--namespace=x", "--namespace=x"])
    env = {"SANDKEEP_NAMESPACE": "x"}
    assert flags.deprecated_uses(args, env) == {"--namespace": "--install-namespace", **flags.RENAMED_ENV}
    assert sandkeep.main([*uninstall, "--namespace=x", "--namespace=x", "--timeout=soon"]) == 2
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "deprecated_spelling" in line]
    assert len(said) == 1 and "used=--namespace use=--install-namespace" in said[0], err
    assert "--timeout" in err, "then the command ran, with the value given"
