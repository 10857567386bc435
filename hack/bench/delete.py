"""Deletion benchmark: sandkeep's safe delete against `rm -rf`, `find -delete`, `rsync --delete` and parallel
`rm -rf` at several parallelisms, on identical synced trees of several shapes, interleaved round by round
(issue 15, item 3; issue 31, item 2).

    python hack/bench/delete.py [--files 40000] [--rounds 3] [--shapes repo,wide,deep,flat,tiny,checkout]
                                [--parallel 4,8,16] [--peers rm,find,rsync,xargs] [--dir PATH]
                                [--fsdelete FILE ...] [--drop-caches] [--quick]

Each round builds one tree per tool from the same seed (so every tool deletes the same shape, names and sizes),
syncs them to disk BEFORE timing (an unsynced tree deletes from the page cache several times faster and the
ratio then means nothing; `--drop-caches`, as root, also drops the clean caches so every tool starts cold),
then deletes them in an order rotated every round. Each tool's time ends when its delete is on disk: the
delete, then a `syncfs` of the trees' filesystem, timed as part of it (without it, the journal and metadata
writes a tool leaves behind are paid by whichever tool runs next). Shapes:

- `repo`: the issue's 40,000-file repository (30% in a `.git/objects/xx/` fan-out, the rest 25 per directory
  three levels deep);
- `wide`: one directory holding most of the files, beside a few small subdirectories;
- `deep`: a chain 1,000 levels deep with files at every level;
- `flat`: every file in one directory;
- `tiny`: one directory of `files / 2` directories holding 2 files each;
- `checkout`: a git checkout: `.git/objects/xx/` loose objects, two large packs, refs and hooks, a source tree
  20 files per directory, and a few large build artifacts (about 2 KiB per file in all, at most 128 MiB).

sandkeep's delete runs in a child process the way the agent runs it: `delete_tree_async` (an executor thread)
beside an asyncio loop whose ticking coroutine records the longest gap between ticks (the event-loop stall),
and the child reports its peak RSS (`ru_maxrss`) and its peak thread count, and those of the compiled walker it
runs (`fsdelete.compiled_walker`; its `VmHWM` and `Threads` sampled every 20 ms). The peers run as
subprocesses:

- `rm -rf T`; `find T -delete`; `rsync -a --delete empty/ T/` then `rmdir T`;
- `xargs -PN rm -rf` for each N of `--parallel`: `find T -mindepth D -maxdepth D -print0 | xargs -0 -r -n K -P N
  rm -rf` then `rm -rf T`, D the top level (the second when the top holds fewer than N entries) and K a
  share that gives every process about 8 commands (counted before the clock starts): the strongest plain
  tool on a disk whose unlinks overlap.

`--fsdelete FILE` (repeatable) adds another implementation (e.g. the one before a change:
`git show <commit>:controller/node/fsdelete.py > /tmp/old.py`) as one more tool in the same rounds, named after
its file; it is reported but never counted as a peer. The last line is exactly `ratio_vs_best X.XX`: the best
peer's median time over sandkeep's, on the shape where that is lowest (>= 1.0: sandkeep is the fastest on every
shape).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.node import fsdelete  # noqa: E402

SEED = 15

# The child that runs sandkeep's delete as the agent does: in an executor thread beside a ticking event loop.
CHILD = r"""
import asyncio, importlib.util, json, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])
from hack.bench.walker_peak import Sampler
if sys.argv[2]:
    spec = importlib.util.spec_from_file_location("fsdelete_under_test", sys.argv[2])
    fsdelete = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fsdelete
    spec.loader.exec_module(fsdelete)
else:
    from controller.node import fsdelete
parent, name = sys.argv[3], sys.argv[4]
workers = int(sys.argv[5]) if sys.argv[5] else fsdelete.WORKERS  # each implementation's own default
TICK = 0.005

async def ticking(work):
    stall, threads, walker, done = 0.0, 0, Sampler(), asyncio.Event()
    async def ticker():
        nonlocal stall, threads
        last, ticks = time.perf_counter(), 0
        while not done.is_set():
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            stall = max(stall, now - last - TICK)
            threads = max(threads, threading.active_count())
            ticks += 1
            if ticks % 4 == 0:
                walker.sample()
            last = time.perf_counter()
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    result = await work
    seconds = time.perf_counter() - start
    done.set()
    await tick
    return seconds, stall, (threads, walker.peak), result

async def main():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, stall, threads, result = await ticking(fsdelete.delete_tree_async(parent, name, workers=workers))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _, idle, _, _ = await ticking(asyncio.sleep(min(seconds, 10.0)))  # as long: a fair maximum
    return {"seconds": seconds, "stall": stall, "idle_stall": idle, "rss_before_kib": before, "rss_peak_kib": peak,
            "threads": threads[0], "walker_rss_kib": threads[1][0], "walker_threads": threads[1][1],
            "ok": result.ok, "files": result.files, "describe": result.describe()}

print(json.dumps(asyncio.run(main())))
"""


# --- the trees ---------------------------------------------------------------------------------------------
def _write(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for at in range(0, size, 1 << 20):  # a large file a MiB at a time: the children's RSS starts from ours
            f.write(b"x" * min(size - at, 1 << 20))


def build_repo(top: Path, files: int, rng: random.Random) -> int:
    """A repository-like tree: 30% in `.git/objects/xx/`, the rest ~25 per directory, 3 levels deep."""
    objects = top / ".git" / "objects"
    git_files = files * 3 // 10
    for i in range(git_files):
        d = objects / f"{i % 256:02x}"
        if i < 256:
            d.mkdir(parents=True)
        _write(d / f"{i:038x}", rng.randint(64, 964))
    for i in range(files - git_files):
        d = top / f"pkg{i // 2500}" / f"mod{(i // 250) % 10}" / f"sub{(i // 25) % 10}"
        if i % 25 == 0:
            d.mkdir(parents=True, exist_ok=True)
        _write(d / f"file{i}.py", rng.randint(7, 420))
    return files


def build_wide(top: Path, files: int, rng: random.Random) -> int:
    """90% of the files in one directory, the rest in 10 small subdirectories of it."""
    top.mkdir(parents=True)
    many = files * 9 // 10
    for i in range(many):
        _write(top / f"{i:08d}-{rng.getrandbits(32):08x}.log", rng.randint(0, 256))
    rest = files - many
    for i in range(rest):
        d = top / f"sub{i % 10}"
        if i < 10:
            d.mkdir()
        _write(d / f"f{i}", rng.randint(0, 256))
    return files


def build_deep(top: Path, files: int, rng: random.Random) -> int:
    """A chain 1,000 levels deep (fewer for tiny trees) with files at every level, built fd-relative."""
    top.mkdir(parents=True)
    depth = min(1000, max(10, files // 40))
    per = max(1, files // depth)
    made, fd = 0, os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            for j in range(per if level < depth - 1 else files - made):
                fdf = os.open(f"f{j}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
                os.write(fdf, b"x" * rng.randint(0, 256))
                os.close(fdf)
                made += 1
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return made


def build_flat(top: Path, files: int, rng: random.Random) -> int:
    """Every file in one directory."""
    top.mkdir(parents=True)
    for i in range(files):
        _write(top / f"{i:08d}-{rng.getrandbits(32):08x}.tmp", rng.randint(0, 256))
    return files


def build_tiny(top: Path, files: int, rng: random.Random) -> int:
    """`files / 2` directories of 2 small files each, all in one directory."""
    top.mkdir(parents=True)
    for i in range(files // 2):
        d = top / f"task-{i:07d}"
        d.mkdir()
        _write(d / "stdout", rng.randint(0, 256))
        _write(d / "exit-code", 2)
    return files // 2 * 2


def build_checkout(top: Path, files: int, rng: random.Random) -> int:
    """A git checkout: loose objects in a `.git/objects/xx/` fan-out, two large packs, refs and hooks, a source
    tree of 20 files per directory three levels deep, and four large build artifacts."""
    big = min(files * 2048, 128 << 20)  # bytes in the large files together
    git = top / ".git"
    for d in ("objects/pack", "refs/heads", "refs/tags", "hooks", "info"):
        (git / d).mkdir(parents=True)
    made = 0
    for name, size in (("pack/pack-a.pack", big * 3 // 8), ("pack/pack-b.pack", big // 8)):
        _write(git / "objects" / name, size)
        _write(git / "objects" / name.replace(".pack", ".idx"), max(1024, size // 64))
        made += 2
    for name in ("HEAD", "config", "description", "index", "packed-refs", "info/exclude", "refs/heads/main"):
        _write(git / name, rng.randint(40, 4096))
        made += 1
    for i in range(12):
        _write(git / "hooks" / f"hook-{i}.sample", rng.randint(400, 4000))
        made += 1
    loose = (files - made) // 4
    for i in range(loose):
        d = git / "objects" / f"{i % 256:02x}"
        if i < 256:
            d.mkdir()
        _write(d / f"{rng.getrandbits(152):038x}", rng.randint(64, 2048))
        made += 1
    (top / "build").mkdir()
    for i in range(4):
        _write(top / "build" / f"artifact-{i}.bin", big // 8)
        made += 1
    for i in range(files - made):
        d = top / "src" / f"pkg{i // 2000}" / f"mod{(i // 200) % 10}" / f"part{(i // 20) % 10}"
        if i % 20 == 0:
            d.mkdir(parents=True, exist_ok=True)
        _write(d / f"file{i}.go", rng.randint(100, 8000))
    return files


SHAPES = {
    "repo": build_repo,
    "wide": build_wide,
    "deep": build_deep,
    "flat": build_flat,
    "tiny": build_tiny,
    "checkout": build_checkout,
}


# --- the tools -----------------------------------------------------------------------------------------------
@dataclass
class Child:
    """What a sandkeep child reported, over every delete of the run."""

    stalls: list[float] = field(default_factory=list)
    idles: list[float] = field(default_factory=list)
    rss: list[tuple[int, int]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    walker: list[tuple[int, int]] = field(default_factory=list)  # the compiled walker's (peak RSS KiB, threads)

    def add(self, got: dict[str, object]) -> None:
        self.stalls.append(float(got["stall"]))  # type: ignore[arg-type]
        self.idles.append(float(got["idle_stall"]))  # type: ignore[arg-type]
        self.rss.append((int(got["rss_before_kib"]), int(got["rss_peak_kib"])))  # type: ignore[call-overload]
        self.threads.append(int(got["threads"]))  # type: ignore[call-overload]
        self.walker.append((int(got["walker_rss_kib"]), int(got["walker_threads"])))  # type: ignore[call-overload]


@dataclass
class Tool:
    name: str
    peer: bool
    parallel: int = 0  # N of `xargs -PN rm -rf`; 0: not a parallel peer
    times: dict[str, list[float]] = field(default_factory=dict)
    missing: str = ""  # why it did not run (a command not installed)
    impl: str = ""  # sandkeep's: the fsdelete.py it runs ("": this tree's)
    child: Child = field(default_factory=Child)  # sandkeep's own: its loop stall, RSS and threads


def _run(cmd: list[str] | str, shell: bool = False) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, shell=shell)
    return time.perf_counter() - start


def xargs_plan(tree: Path, parallel: int) -> tuple[int, int]:
    """(depth, names per `rm`) for `xargs -P parallel`: the top level, or the second when the top has fewer
    entries than processes; about 8 commands per process. Counted before the clock starts."""
    top = list(tree.iterdir())
    if len(top) >= parallel:
        return 1, max(1, len(top) // (8 * parallel))
    second = sum(len(list(p.iterdir())) for p in top if p.is_dir() and not p.is_symlink())
    return 2, max(1, second // (8 * parallel))


def peer_delete(tool: Tool, tree: Path, empty: Path) -> float:
    """Delete `tree` with one of the peers; its wall time in seconds."""
    if tool.name == "rm -rf":
        return _run(["rm", "-rf", str(tree)])
    if tool.name == "find -delete":
        return _run(["find", str(tree), "-delete"])
    if tool.name == "rsync --delete":
        start = time.perf_counter()
        subprocess.run(["rsync", "-a", "--delete", f"{empty}/", f"{tree}/"], check=True)
        tree.rmdir()
        return time.perf_counter() - start
    if tool.parallel:
        depth, share = xargs_plan(tree, tool.parallel)
        q = f"'{tree}'"
        script = (
            f"find {q} -mindepth {depth} -maxdepth {depth} -print0 | xargs -0 -r -n {share} -P {tool.parallel} rm -rf"
            f" && rm -rf {q}"
        )
        return _run(script, shell=True)
    raise ValueError(tool.name)


def sandkeep_delete(tree: Path, workers: int | None, impl: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), impl, str(tree.parent), tree.name, str(workers or "")],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"sandkeep's delete died: {out.stderr.strip()[-2000:]}")
    data: dict[str, object] = json.loads(out.stdout)
    return data


_LIBC = ctypes.CDLL(None, use_errno=True)


def syncfs(where: Path) -> float:
    """Write the filesystem holding `where` to disk (what a delete left in memory); its wall time in seconds."""
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        start = time.perf_counter()
        if _LIBC.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
        return time.perf_counter() - start
    finally:
        os.close(fd)


def settle(drop_caches: bool) -> None:
    """Write everything to disk; as root with --drop-caches, also drop the clean page, dentry and inode caches."""
    os.sync()
    if drop_caches and os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def the_tools(args: argparse.Namespace) -> list[Tool]:
    tools = [Tool("sandkeep", peer=False)]
    for impl in args.fsdelete:
        tools.append(Tool(f"sandkeep ({Path(impl).stem})", peer=False, impl=impl))
    peers = set(args.peers.split(","))
    for key, name, cmd in (
        ("rm", "rm -rf", "rm"),
        ("find", "find -delete", "find"),
        ("rsync", "rsync --delete", "rsync"),
    ):
        if key in peers:
            tools.append(Tool(name, peer=True, missing="" if shutil.which(cmd) else f"{cmd} not installed"))
    if "xargs" in peers:
        for n in (int(x) for x in args.parallel.split(",") if x):
            tools.append(
                Tool(f"xargs -P{n} rm -rf", True, n, missing="" if shutil.which("xargs") else "xargs not installed")
            )
    return tools


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=40_000, help="files per tree (default: the issue's 40,000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--workers", type=int, default=None, help="sandkeep's threads at most (default: its own)")
    parser.add_argument("--parallel", default="4,8,16", help="the N of each `xargs -PN rm -rf` peer")
    parser.add_argument("--peers", default="rm,find,rsync,xargs", help="which peers run, of rm,find,rsync,xargs")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the trees (default: a temp dir)")
    parser.add_argument("--fsdelete", action="append", default=[], help="also time this fsdelete.py (not a peer)")
    parser.add_argument("--drop-caches", action="store_true", help="as root: drop caches after each sync")
    parser.add_argument("--quick", action="store_true", help="tiny trees, one round: checks the benchmark runs")
    args = parser.parse_args()
    if args.quick:
        args.files, args.rounds = 300, 1
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}")
    tools = the_tools(args)
    running = [t for t in tools if not t.missing]
    print(f"uid {os.geteuid()}, drop caches: {'yes' if args.drop_caches and os.geteuid() == 0 else 'no (sync only)'}")
    cap = args.workers or fsdelete.WORKERS
    print(f"sandkeep's threads at most {cap}, files per tree {args.files}, rounds {args.rounds}, seed {SEED}")
    base = Path(tempfile.mkdtemp(prefix="sandkeep-bench-", dir=args.dir))
    empty = base / "empty"
    empty.mkdir()
    try:
        for r in range(args.rounds):
            for shape in shapes:
                trees = {}
                for i, tool in enumerate(running):
                    trees[tool.name] = base / f"{shape}-{r}-{i}"
                    n = SHAPES[shape](trees[tool.name], args.files, random.Random(SEED))
                settle(args.drop_caches)
                k = (r * len(shapes) + shapes.index(shape)) % len(running)
                order = running[k:] + running[:k]
                line = []
                for tool in order:
                    tree = trees[tool.name]
                    if tool.peer:
                        seconds = peer_delete(tool, tree, empty)
                    else:
                        got = sandkeep_delete(tree, args.workers, tool.impl)
                        if not got["ok"] or got["files"] != n:
                            print(f"{tool.name} delete failed: {got['describe']}", file=sys.stderr)
                            return 1
                        seconds = float(got["seconds"])  # type: ignore[arg-type]
                        tool.child.add(got)
                    if tree.exists():
                        print(f"{tool.name} left {tree} behind", file=sys.stderr)
                        return 1
                    synced = syncfs(base)
                    tool.times.setdefault(shape, []).append(seconds + synced)
                    line.append(f"{tool.name} {seconds + synced:.2f}s ({synced:.2f} sync)")
                print(f"round {r + 1} {shape}: " + ", ".join(line) + f"  (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report(tools, shapes, args.files)


def report(tools: list[Tool], shapes: list[str], files: int) -> int:
    """The table of medians (seconds, files/s, sandkeep's speed-up over each), then the summary lines."""
    sk = tools[0]
    print()
    heads = [f"{s} median s (files/s)" for s in shapes] + [f"{s} x" for s in shapes]
    print(f"| tool | {' | '.join(heads)} |")
    print(f"|---|{'---|' * (2 * len(shapes))}")
    for tool in tools:
        if tool.missing:
            print(f"| {tool.name} | skipped: {tool.missing} |")
            continue
        meds = [statistics.median(tool.times[s]) for s in shapes]
        cells = [f"{m:.2f} ({files / m:,.0f})" for m in meds]
        ratios = [f"{m / statistics.median(sk.times[s]):.2f}" for s, m in zip(shapes, meds, strict=True)]
        print(f"| {tool.name} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    worst = float("inf")
    for s in shapes:
        peers = [(statistics.median(t.times[s]), t.name) for t in tools if t.peer and not t.missing]
        best, who = min(peers)
        ratio = best / statistics.median(sk.times[s])
        worst = min(worst, ratio)
        print(f"{s}: best peer {who} {best:.2f}s, sandkeep {statistics.median(sk.times[s]):.2f}s, ratio {ratio:.2f}")
    for tool in tools:
        child = tool.child
        if tool.peer or not child.rss:
            continue
        who = "" if tool is sk else f" [{tool.name}]"
        before, peak = max(child.rss, key=lambda p: p[1])
        print(f"sandkeep peak RSS: {peak / 1024:.1f} MiB (interpreter before the delete {before / 1024:.1f} MiB){who}")
        print(f"sandkeep peak threads: {max(child.threads)} (the event loop's and the executor's included){who}")
        rss, threads = max(r for r, _ in child.walker), max(t for _, t in child.walker)
        if rss:
            print(f"compiled walker peak RSS: {rss / 1024:.1f} MiB, peak threads: {threads} (sampled every 20 ms){who}")
        stall, idle = max(child.stalls) * 1000, max(child.idles) * 1000
        median = statistics.median(child.stalls) * 1000
        print(f"longest event-loop stall: {stall:.1f} ms (median {median:.1f}, ticker alone {idle:.1f} ms){who}")
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"ratio_vs_best {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
