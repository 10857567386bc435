"""A failing end-to-end test gets every component's logs of its bed (tests/bed/e2e_bed.py) in its report."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report: pytest.TestReport = yield
    bed = getattr(item, "funcargs", {}).get("bed")
    if report.failed and bed is not None:
        report.sections.append(("end-to-end bed logs", bed.logs()))
    return report
