"""Deletion benchmark: sandkeep's safe delete against `rm -rf` on the same repo-shaped trees.

    python hack/bench/delete.py [--files 100000] [--rounds 3] [--dir PATH]

Each round builds two identical trees (a `.git/objects` fan-out plus a nested source tree of small files),
syncs them to disk BEFORE timing (an unsynced tree deletes from the page cache several times faster and the
ratio then means nothing), and deletes one with `rm -rf` and the other with `fsdelete.delete_tree_async`,
alternating which goes first. An asyncio ticker runs beside sandkeep's delete and records the longest gap
between its ticks: the event-loop stall a caller (the node agent) would see.

Prints files/s medians for both, a line starting `ratio` (sandkeep / rm -rf; >= 1.0 is the target) and the
longest stall (< 100 ms is the target).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controller import fsdelete

TICK = 0.005
T = TypeVar("T")


def build_tree(top: Path, files: int) -> int:
    """A repository-like tree: 30% in `.git/objects/xx/`, the rest ~25 per directory, 3 levels deep."""
    made = 0
    objects = top / ".git" / "objects"
    git_files = files * 3 // 10
    for i in range(git_files):
        d = objects / f"{i % 256:02x}"
        if i < 256:
            d.mkdir(parents=True)
        (d / f"{i:038x}").write_bytes(b"x" * (64 + i % 900))
        made += 1
    rest = files - git_files
    for i in range(rest):
        d = top / f"pkg{i // 2500}" / f"mod{(i // 250) % 10}" / f"sub{(i // 25) % 10}"
        if i % 25 == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"file{i}.py").write_bytes(b"# code\n" * (1 + i % 60))
        made += 1
    return made


async def delete_with_ticker(parent: Path, name: str) -> tuple[float, float, fsdelete.DeleteResult]:
    """sandkeep's async delete with a ticker beside it: (seconds, longest stall in seconds, result)."""
    return await _ticking(fsdelete.delete_tree_async(parent, name))


async def idle_stall(seconds: float) -> float:
    """The longest stall of the same ticker with nothing else running: what the machine alone costs."""
    _, stall, _ = await _ticking(asyncio.sleep(seconds))
    return stall


async def _ticking(work: Awaitable[T]) -> tuple[float, float, T]:
    stall = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            stall = max(stall, now - last - TICK)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    result = await work
    seconds = time.perf_counter() - start
    done.set()
    await tick
    return seconds, stall, result


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def rm_rf(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["rm", "-rf", str(path)], check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the trees (default: a temp dir)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandkeep-bench-", dir=args.dir))
    rm_rates: list[float] = []
    sk_rates: list[float] = []
    stalls: list[float] = []
    idles: list[float] = []
    try:
        for r in range(args.rounds):
            a, b = base / f"rm-{r}", base / f"sk-{r}"
            n = build_tree(a, args.files)
            build_tree(b, args.files)
            os.sync()
            order = ("rm", "sk") if r % 2 == 0 else ("sk", "rm")
            for who in order:
                if who == "rm":
                    rm_rates.append(n / rm_rf(a))
                else:
                    seconds, stall, result = asyncio.run(delete_with_ticker(base, b.name))
                    if not result.ok or result.files != n or b.exists():
                        print(f"sandkeep delete failed: {result.describe()}", file=sys.stderr)
                        return 1
                    sk_rates.append(n / seconds)
                    stalls.append(stall)
                    idles.append(asyncio.run(idle_stall(min(seconds, 10.0))))
            print(
                f"round {r + 1}: rm -rf {rm_rates[-1]:,.0f} files/s, sandkeep {sk_rates[-1]:,.0f} files/s, "
                f"stall {stalls[-1] * 1000:.1f} ms (idle ticker alone: {idles[-1] * 1000:.1f} ms), load {_load()}",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rm_med, sk_med = statistics.median(rm_rates), statistics.median(sk_rates)
    print(f"files per tree: {args.files}, rounds: {args.rounds}")
    print(f"rm -rf median: {rm_med:,.0f} files/s")
    print(f"sandkeep median: {sk_med:,.0f} files/s")
    print(f"ratio {sk_med / rm_med:.2f} (sandkeep / rm -rf; target >= 1.0)")
    print(f"longest event-loop stall: {max(stalls) * 1000:.1f} ms (target < 100 ms)")
    print(f"longest stall of the ticker alone, same machine, same run: {max(idles) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
