"""The chart's retention values (issue 28): `settings.retentionByOutcome` and `settings.maxAge` rendered into the
SANDKEEP_* environment both components read, each read by the controller's own settings, and bad values refused
with a clear message."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from controller.rules.policy import Windows
from tests.bed.chart import controller_settings, refused, render


def test_outcome_windows_are_off_by_default_and_reach_the_controller_as_given(tools: Path) -> None:
    assert controller_settings(render(tools)).policy().by_outcome == Windows()
    manifest = render(
        tools, "--set=settings.retentionByOutcome.failed=14d", "--set-string=settings.retentionByOutcome.succeeded=0"
    )
    policy = controller_settings(manifest).policy()
    assert policy.by_outcome == Windows(failed=timedelta(days=14), succeeded=timedelta(0))
    assert policy.window(None) == timedelta(hours=72)


def test_the_hard_end_is_off_by_default_and_reaches_the_controller_as_default_and_ceiling(tools: Path) -> None:
    settings = controller_settings(render(tools))
    assert settings.policy().max_age is None and settings.ceiling().max_age is None
    settings = controller_settings(render(tools, "--set=settings.maxAge=30d"))
    assert settings.policy().max_age == settings.ceiling().max_age == timedelta(days=30)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("--set=settings.retentionByOutcome.failed=two weeks", "/settings/retentionByOutcome/failed"),
        ("--set=settings.retentionByOutcome.cancelled=1d", "cancelled"),
        ("--set=settings.maxAge=a month", "/settings/maxAge"),
    ],
)
def test_bad_outcome_windows_are_refused(tools: Path, value: str, words: str) -> None:
    refused(tools, value, words)
