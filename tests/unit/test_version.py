"""One version: pyproject.toml's, read at run time; the chart's appVersion is checked against it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from controller import __version__

REPO = Path(__file__).resolve().parents[2]


def _pyproject_version() -> str:
    version: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return version


def test_the_package_version_is_pyprojects() -> None:
    assert __version__ == _pyproject_version()


def test_the_cli_says_the_same_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "controller.cli.sandkeep", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == f"sandkeep {_pyproject_version()}"


def test_the_charts_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((REPO / "charts" / "sandkeep" / "Chart.yaml").read_text())
    assert chart["appVersion"] == _pyproject_version()


def test_the_changelog_has_a_section_for_the_version() -> None:
    assert f"## [{_pyproject_version()}]" in (REPO / "CHANGELOG.md").read_text()


def test_the_newest_released_version_in_the_changelog_is_the_charts_and_the_packages() -> None:
    """`make release` packages the chart at a version; the CHANGELOG names the newest release, and
    pyproject.toml and Chart.yaml (`version` and `appVersion`) carry it until the next one."""
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert released, "CHANGELOG.md names no release"
    chart = yaml.safe_load((REPO / "charts" / "sandkeep" / "Chart.yaml").read_text())
    assert (released[0], released[0], released[0]) == (chart["version"], chart["appVersion"], _pyproject_version())
