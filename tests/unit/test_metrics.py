"""What both components expose besides their own series: process and platform series and build info."""

from __future__ import annotations

import platform
import urllib.request
from importlib.metadata import version

from prometheus_client.parser import text_string_to_metric_families

from controller import __version__
from controller.observe.metrics import AgentMetrics, ControllerMetrics, series_names, serve
from controller.rules import contracts as c

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _scrape(port: int) -> Samples:
    """Every sample served on /metrics, parsed by the client library's own parser (what Prometheus reads)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def test_both_components_serve_process_platform_and_build_info_series() -> None:
    registries = [ControllerMetrics().registry, AgentMetrics("node-a").registry, AgentMetrics("node-b").registry]
    servers = [serve(r, 0) for r in registries]
    try:
        for server in servers:
            samples = _scrape(server.server_port)
            assert samples["process_resident_memory_bytes"][0][1] > 10 * 2**20  # a Python process: tens of MiB
            assert samples["process_open_fds"][0][1] > 0 and "process_cpu_seconds_total" in samples
            [(labels, value)] = samples["python_info"]
            assert labels["version"] == platform.python_version() and value == 1
            assert samples[c.M_BUILD_INFO] == [({"version": __version__, "python": platform.python_version()}, 1.0)]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_build_info_says_the_installed_version() -> None:
    assert __version__ == version("sandkeep")


def test_the_standard_series_are_among_the_names_rules_and_dashboards_may_use() -> None:
    names = series_names()
    assert {c.M_BUILD_INFO, "process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names
