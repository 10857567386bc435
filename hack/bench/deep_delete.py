"""Peak memory of the safe delete and size walks on hostile trees (issue 12, item 1), each in a child process.

    python hack/bench/deep_delete.py [--dir PATH] [--fsdelete FILE] [--only NAME ...]

Builds each tree fd-relative (deeper than PATH_MAX allows by path), then runs `delete_tree` (one plain walk and
the 4-worker split) and `tree_size` in a fresh child process and prints that child's peak RSS (`ru_maxrss`)
before and after the walk, and the compiled walker's own (`VmHWM`, sampled: hack/bench/walker_peak.py) when
`delete_tree` ran it. `--fsdelete FILE` loads another implementation (e.g. the one before the fix:
`git show <commit>:controller/node/fsdelete.py > /tmp/old.py`), so before/after run on the same machine: its
`delete_tree`, and its `tree_size` (from before the size walk moved to treesize.py); with a module that has no
`tree_size`, the size walk measured is `os.fwalk`, which the agent's `measure` used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TREES = {
    "chain-2000x255": ("chain", 2000, 255),  # 2,000 levels, every name 255 bytes
    "chain-20000x1": ("chain", 20000, 1),  # 20,000 levels of 1-byte names
    "flat-200000x200": ("flat", 200000, 200),  # one directory of 200,000 files with 200-byte names
}

CHILD = r"""
import importlib.util, json, os, resource, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2]:
    spec = importlib.util.spec_from_file_location("fsdelete_under_test", sys.argv[2])
    fsdelete = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fsdelete
    spec.loader.exec_module(fsdelete)
    tree_size = getattr(fsdelete, "tree_size", None)
else:
    from controller.node import fsdelete
    from controller.node.treesize import tree_size
from hack.bench.walker_peak import Sampler
parent, name, what = sys.argv[3], sys.argv[4], sys.argv[5]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
walker = (0, 0)
if what == "size" and tree_size is not None:
    result = repr(tree_size(os.open(parent, os.O_RDONLY | os.O_DIRECTORY), name))
elif what == "size":  # before tree_size: the agent's `measure` walked with os.fwalk
    total = sum(len(f) for _, _, f, _ in os.fwalk(os.path.join(parent, name), follow_symlinks=False))
    result = f"os.fwalk: {total} files"
else:
    with Sampler() as sampler:
        result = fsdelete.delete_tree(parent, name, workers=int(what)).describe()
    walker = sampler.peak
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "peak_kib": after, "walker_kib": walker[0], "result": result}))
"""


def build(parent: Path, name: str, shape: str, count: int, length: int) -> None:
    """A chain `count` levels deep of `length`-byte names, or one directory of `count` such files."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir(name, dir_fd=fd)
        top = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = top
        if shape == "flat":
            for i in range(count):
                leaf = f"{i:08d}".ljust(length, "f")
                os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
            return
        for i in range(count):
            level = f"{i % 10}".ljust(length, "d")
            os.mkdir(level, dir_fd=fd)
            child = os.open(level, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def run_child(parent: Path, name: str, what: str, impl: str) -> dict[str, object]:
    """Run one walk in a fresh interpreter and return its peak RSS (KiB) before and after, and its result."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), impl, str(parent), name, what],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return {"before_kib": 0, "peak_kib": 0, "result": "died: " + (out.stderr.strip().splitlines() or ["?"])[-1]}
    data: dict[str, object] = json.loads(out.stdout)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to build the trees (default: a temp dir)")
    parser.add_argument("--fsdelete", default="", help="an fsdelete.py to load instead of controller.node's")
    parser.add_argument("--only", nargs="*", default=list(TREES), choices=list(TREES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(tmp)
        for label in args.only:
            shape, count, length = TREES[label]
            for what in ("size", "1", "4"):
                build(base, "t", shape, count, length)
                got = run_child(base, "t", what, args.fsdelete)
                walk = "tree_size" if what == "size" else f"delete_tree(workers={what})"
                peak, before = int(got["peak_kib"]) / 1024, int(got["before_kib"]) / 1024  # type: ignore[call-overload]
                walker = int(got.get("walker_kib", 0)) / 1024  # type: ignore[call-overload]
                beside = f", compiled walker {walker:5.1f} MiB" if walker else ""
                memory = f"peak {peak:7.1f} MiB (interpreter {before:5.1f} MiB{beside})"
                print(f"{label:18} {walk:24} {memory}  {got['result']}")
                subprocess.run(["rm", "-rf", str(base / "t")], check=False)


if __name__ == "__main__":
    main()
