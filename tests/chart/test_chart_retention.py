"""The chart's retention values (issue 28): `settings.retentionByOutcome` rendered into the SANDKEEP_* environment
both components read, each read by the controller's own settings, and bad values refused with a clear message."""

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


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("--set=settings.retentionByOutcome.failed=two weeks", "/settings/retentionByOutcome/failed"),
        ("--set=settings.retentionByOutcome.cancelled=1d", "cancelled"),
    ],
)
def test_bad_outcome_windows_are_refused(tools: Path, value: str, words: str) -> None:
    refused(tools, value, words)
