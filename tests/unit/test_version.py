"""One version: pyproject.toml's, read at run time; the chart's appVersion is checked against it."""

from __future__ import annotations

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
