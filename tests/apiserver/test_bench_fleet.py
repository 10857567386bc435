"""The fleet model's measurement runs end to end at a tiny size (its numbers are printed, never asserted).

It runs `hack/bench/fleet_model.py` as a subprocess that starts its own control plane in a temporary
directory, and checks each section printed its numbers with the load beside them: a broken step (the etcd
gateway's defrag, a watch that does not open, an expiry's request mix) fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"[0-9]+(?:\.[0-9]+)?"
LOAD = rf"\[load {NUMBER} {NUMBER} {NUMBER}\]$"


def test_fleet_model_prints_every_section_with_numbers_at_a_tiny_size(tmp_path: Path) -> None:
    script = REPO / "hack" / "bench" / "fleet_model.py"
    tiny = ("--sizes=12,24", "--watches=2,3", "--nodes=3", "--namespaces=2", "--updates=12", "--update-rate=40")
    cmd = [sys.executable, str(script), *tiny, "--expire=8", "--idle=0.5", "--api-objects=12", f"--workdir={tmp_path}"]
    cmd.append(f"--json={tmp_path / 'points.json'}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    lines = out.splitlines()
    assert all(re.search(LOAD, line) for line in lines), out  # every line carries the load average

    def line(pattern: str) -> str:
        found = [x for x in lines if re.search(pattern, x)]
        assert found, f"no line matches {pattern!r}:\n{out}"
        return found[-1]

    for n in (12, 24):
        line(rf"^objects {n}: .* MiB after compaction\+defrag \({NUMBER}s\): {NUMBER} B/object")
    line(rf"^objects 12: 12 through the API in {NUMBER}s \({NUMBER} objects/s, 3 writes each\);")
    line(r"^objects 24: none through the API, 12 cloned in etcd in")
    line(rf"stored in etcd: 24 keys, value {NUMBER} B, key {NUMBER} B per object; as returned: {NUMBER} B of JSON")
    line(rf"kube-apiserver RSS {NUMBER} MiB \(-?{NUMBER} KiB/object\)")
    for w in (2, 3):
        line(rf"^watches {w}: {w} open in {NUMBER}s; kube-apiserver RSS {NUMBER} MiB")
        line(rf"^watches {w}: 12 updates .* CPU -?{NUMBER} ms/update .* delivered 12/12, latency p50 {NUMBER} ms")
    line(r"^watches 0: 12 updates")
    # 4 + 4 expiries, each: DELETE (on the view's version: no GET), one Event, PATCH (finalizer); no Deleting
    # status (a delete this small is over before it is worth one); one Pod list per node
    mix = line(r"^expired 4 on \d nodes with 32 threads: requests")
    assert "DELETE retainedsandboxes 4" in mix, mix
    assert "GET retainedsandboxes" not in mix and "APPLY retainedsandboxes" not in mix, mix
    assert "PATCH retainedsandboxes 4" in mix and "POST events 4" in mix and "LIST pods" in mix, mix
    line(rf"requests/expiry; {NUMBER} requests in {NUMBER}s: {NUMBER} QPS sustained")
    line(rf"^events: {NUMBER} Events in etcd, value {NUMBER} B")
    points = json.loads((tmp_path / "points.json").read_text())
    assert [p["objects"] for p in points["objects"]] == [12, 24]
    assert [p["watches"] for p in points["watches"]] == [0, 2, 3]
    assert sum(p["expired"] for p in points["expiry"]) == 8
    assert not list(tmp_path.glob("sandkeep-cluster-*")), "the control plane's directory was left behind"
