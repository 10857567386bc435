"""What the local control plane's processes cost, for the benchmarks (hack/bench/fleet_model.py; the RSS reader
also for agent_scan.py, controller_scale.py and csi.py): CPU time and memory from /proc, sums of the components'
own metrics, and etcd's metrics and v3 HTTP gateway (its db size, compaction and defragmentation, the keys and
bytes it stores under a prefix)."""

from __future__ import annotations

import base64
import json
import math
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from hack.localcluster import LocalCluster

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of stat)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def percentile(values: list[float], q: float) -> float:
    """The value at rank `int(q * n)` of the sorted values (NaN for none): the latency summaries' rule."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line:
            total += float(line.rpartition(" ")[2])
    return total


class Plane:
    """The local control plane's processes, etcd's metrics and its v3 HTTP gateway."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        pids = {comp.name: comp.proc.pid for comp in cluster.components}
        self.apiserver, self.etcd = pids["kube-apiserver"], pids["etcd"]

    def etcd_metrics(self) -> str:
        with urllib.request.urlopen(f"{self.cluster.etcd_url}/metrics", timeout=30) as response:
            return str(response.read().decode())

    def gateway(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.cluster.etcd_url}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def db_bytes(self) -> tuple[float, float]:
        text = self.etcd_metrics()
        return metric(text, "etcd_mvcc_db_total_size_in_bytes"), metric(text, "etcd_mvcc_db_total_size_in_use_in_bytes")

    def compact_and_defrag(self) -> float:
        """Compact etcd to its current revision and defragment it (what an operator's maintenance does);
        returns the seconds it took."""
        began = time.monotonic()
        revision = int(self.gateway("/v3/kv/range", {"key": b64("compact_rev_key")})["header"]["revision"])
        self.gateway("/v3/kv/compaction", {"revision": revision, "physical": True})
        self.gateway("/v3/maintenance/defragment", {})
        return time.monotonic() - began

    def stored(self, prefix: str, limit: int) -> tuple[int, float, float]:
        """How many keys etcd holds under `prefix`, and the mean key and value bytes of up to `limit` of them."""
        end = _prefix_end(prefix)
        count = int(
            self.gateway("/v3/kv/range", {"key": b64(prefix), "range_end": end, "count_only": True}).get("count", 0)
        )
        found = self.gateway("/v3/kv/range", {"key": b64(prefix), "range_end": end, "limit": limit}).get("kvs", [])
        if not found:
            return count, math.nan, math.nan
        keys = [len(base64.b64decode(kv["key"])) for kv in found]
        values = [len(base64.b64decode(kv.get("value", ""))) for kv in found]
        return count, sum(keys) / len(keys), sum(values) / len(values)

    def heap_mib(self) -> float:
        return metric(self.cluster.metrics_text(), "go_memstats_heap_inuse_bytes") / 2**20


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()
