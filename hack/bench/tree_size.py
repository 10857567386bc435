"""Measuring sizes: sandkeep's `tree_size` against `du -s` on the same trees (issue 25, item 8).

    python hack/bench/tree_size.py [--wide 1000000] [--depth 5000] [--per-level 100] [--teeth 2000]
                                   [--tooth 100] [--rounds 3] [--dir PATH] [--other FILE] [--quick]

Shapes, each built once fd-relative (deeper than PATH_MAX allows by path) and synced:

- `wide`: one directory of `--wide` files;
- `deep`: a chain `--depth` levels deep with `--per-level` entries at each level (that many files less one,
  and the next level), far deeper than the walk's 64 descriptors;
- `comb`: `--teeth` directories side by side, each a chain `--tooth` levels deep with a file at each level:
  the shape that made the walk before issue 25 quadratic (it read the wide level again after every tooth).

Each round times `du -s -B1` (a subprocess) and `tree_size` (in this process, as the agent's size thread
calls it) on the same warm tree, in an order alternated round by round, after one untimed `du` warms the
caches. Printed per shape: the median times, their ratio (tree_size over du; the goal is at most 3), and
whether the two byte counts agree. `--other FILE` times another implementation too, any module with a
`tree_size` (a treesize.py, or an fsdelete.py from before the walk moved out of it: `git show
<commit>:controller/node/fsdelete.py > /tmp/old.py`), reported beside, never in the ratio.
The last line is exactly `ratio_vs_du X.XX`: the highest ratio over the shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.node import treesize  # noqa: E402

_DIR = os.O_RDONLY | os.O_DIRECTORY


def _touch(fd: int, name: str) -> None:
    os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))


def _chain(fd: int, depth: int, files: int) -> None:
    """`depth` levels below `fd`, each holding `files` files and the next level (fds closed as it goes)."""
    fd = os.dup(fd)
    try:
        for _ in range(depth):
            for i in range(files):
                _touch(fd, f"f{i}")
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def build(top: Path, shape: str, a: int, b: int) -> int:
    """Build one shape at `top`; returns its entries (files and directories below the top)."""
    top.mkdir()
    fd = os.open(top, _DIR)
    try:
        if shape == "wide":
            for i in range(a):
                _touch(fd, f"{i:08d}")
            return a
        if shape == "deep":
            _chain(fd, a, b - 1)
            return a * b
        for t in range(a):  # comb
            os.mkdir(f"t{t}", dir_fd=fd)
            tooth = os.open(f"t{t}", _DIR, dir_fd=fd)
            try:
                _chain(tooth, b, 1)
            finally:
                os.close(tooth)
        return a * (1 + 2 * b)
    finally:
        os.close(fd)


def du(top: Path) -> tuple[float, int]:
    start = time.perf_counter()
    out = subprocess.run(["du", "-s", "-B1", str(top)], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, int(out.stdout.split()[0])


def sized(impl: ModuleType) -> Callable[[Path], tuple[float, int]]:
    def run(top: Path) -> tuple[float, int]:
        fd = os.open(top.parent, _DIR)
        try:
            start = time.perf_counter()
            size = impl.tree_size(fd, top.name)
            return time.perf_counter() - start, int(size[0])
        finally:
            os.close(fd)

    return run


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("tree_size_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wide", type=int, default=1_000_000, help="files in the wide directory")
    parser.add_argument("--depth", type=int, default=5000, help="levels of the deep chain")
    parser.add_argument("--per-level", type=int, default=100, help="entries at each level of the deep chain")
    parser.add_argument("--teeth", type=int, default=2000, help="chains side by side in the comb")
    parser.add_argument("--tooth", type=int, default=100, help="levels of each chain of the comb")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="wide,deep,comb")
    parser.add_argument("--dir", default=None, help="where to build the trees (default: a temp dir)")
    parser.add_argument("--other", default="", help="another module with tree_size to time beside (never in the ratio)")
    parser.add_argument("--quick", action="store_true", help="tiny trees, one round: checks the benchmark runs")
    args = parser.parse_args()
    if args.quick:
        args.wide, args.depth, args.per_level, args.teeth, args.tooth, args.rounds = 3000, 150, 10, 40, 80, 1
    if shutil.which("du") is None:
        print("du is not installed", file=sys.stderr)
        return 1
    shapes = {"wide": (args.wide, 0), "deep": (args.depth, args.per_level), "comb": (args.teeth, args.tooth)}
    tools: dict[str, Callable[[Path], tuple[float, int]]] = {"du -s": du, "tree_size": sized(treesize)}
    if args.other:
        tools["other"] = sized(load(args.other))
    print(f"shapes: wide {args.wide} files; deep {args.depth} levels x {args.per_level} entries; ", end="")
    print(f"comb {args.teeth} teeth x {args.tooth} levels; rounds {args.rounds}; load {os.getloadavg()[0]:.2f}")
    rows: list[tuple[str, int, dict[str, float], bool]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for shape in args.shapes.split(","):
            top = Path(tmp) / shape
            start = time.perf_counter()
            entries = build(top, shape, *shapes[shape])
            os.sync()
            print(f"built {shape}: {entries:,} entries in {time.perf_counter() - start:.1f}s", flush=True)
            du(top)  # warm: both read the same cached tree
            times: dict[str, list[float]] = {name: [] for name in tools}
            counted: dict[str, int] = {}
            for r in range(args.rounds):
                order = list(tools) if r % 2 == 0 else list(reversed(tools))
                for name in order:
                    seconds, size = tools[name](top)
                    times[name].append(seconds)
                    counted[name] = size
            agree = counted["tree_size"] == counted["du -s"]
            rows.append((shape, entries, {n: statistics.median(t) for n, t in times.items()}, agree))
            subprocess.run(["rm", "-rf", str(top)], check=True)
    print()
    other = " | other (s)" if args.other else ""
    print(f"| shape | entries | du -s (s) | tree_size (s){other} | ratio | bytes agree |")
    print(f"|---|---|---|---|{'---|' if args.other else ''}---|---|")
    worst = 0.0
    for shape, entries, median, agree in rows:
        ratio = median["tree_size"] / max(median["du -s"], 1e-9)
        worst = max(worst, ratio)
        beside = f" | {median['other']:.3f}" if args.other else ""
        cells = f"{median['du -s']:.3f} | {median['tree_size']:.3f}{beside}"
        print(f"| {shape} | {entries:,} | {cells} | {ratio:.2f} | {'yes' if agree else 'NO'} |")
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"ratio_vs_du {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
