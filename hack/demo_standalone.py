"""The standalone demo: sandkeep on one host, no cluster, in under a minute on a temp root.

    python hack/demo_standalone.py

Retains five sandboxes (real files), pins one, lets three expire, and shows `sandkeep sweep` tombstoning and
deleting them; one holds a file made undeletable with `chattr +i` (needs root), so its tombstone gets stuck
and is reported once, not on every pass; then the attribute is cleared and the next sweep clears the
tombstone. Every step runs the real `sandkeep` CLI. Exits non-zero if any expected outcome did not happen.
The temp directories are removed at the end, also on Ctrl-C, and the immutable attribute always cleared.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from controller.node.inuse import uninspectable_pids

REPO = Path(__file__).resolve().parent.parent
START = time.monotonic()
WINDOW_S = 4  # the retention the expiring sandboxes record: seconds, so the demo needs no waiting around


class DemoFailed(Exception):
    pass


def say(step: str, text: str) -> None:
    print(f"[{time.monotonic() - START:5.1f}s] {step} {text}", flush=True)


def sandkeep_cmd() -> list[str]:
    script = Path(sys.executable).parent / "sandkeep"
    return [str(script)] if script.exists() else [sys.executable, "-m", "controller.cli.sandkeep"]


def run(*args: str, show: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `sandkeep ARGS`, echo the command and its output, indented."""
    cmd = [*sandkeep_cmd(), *args]
    print(f"        $ sandkeep {' '.join(args)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if show:
        for line in (out.stdout + out.stderr).splitlines():
            print(f"          {_short(line)}", flush=True)
    return out


def _short(line: str) -> str:
    # Log lines carry a timestamp and the logger name; the demo shows the decision itself.
    if " sandkeep.sweep: " in line:
        return line.split(" sandkeep.sweep: ", 1)[1]
    return line


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise DemoFailed(what)
    print(f"          ok: {what}", flush=True)


def make_job(parent: Path, name: str, files: int) -> Path:
    job = parent / name
    (job / "src").mkdir(parents=True)
    for i in range(files):
        (job / "src" / f"module_{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    (job / "session").mkdir()
    (job / "session" / "transcript.jsonl").write_text('{"role": "tool", "content": "..."}\n')
    return job


def demo(base: Path, immutable: list[Path]) -> None:
    root, jobs = base / "root", base / "jobs"
    jobs.mkdir()
    ignore = [f"--ignore-pid={pid}" for pid in uninspectable_pids()]

    say("1.", f"retain five finished jobs under {root} (renamed into place, transcripts excluded)")
    plan = [
        ("team-a", "build-1", f"{WINDOW_S}s"),
        ("team-a", "build-2", f"{WINDOW_S}s"),
        ("team-a", "build-3", "1h"),
        ("team-b", "notebook-7", f"{WINDOW_S}s"),
        ("team-b", "agent-run-3", f"{WINDOW_S}s"),
    ]
    for ns, name, retention in plan:
        job = make_job(jobs, name, files=20)
        where = ("--root", str(root), "--namespace", ns, "--name", name)
        out = run("retain", str(job), *where, "--retention", retention, "--exclude", "session")
        expect(out.returncode == 0 and not job.exists(), f"{ns}/{name} retained (the job dir moved, not copied)")
    expect(not (root / "team-a" / "build-1" / "workspace" / "session").exists(), "the transcript was excluded")
    run("ls", "--root", str(root))

    say("2.", "pin team-b/notebook-7 for an hour: a pin wins over its short window")
    out = run("pin", "team-b/notebook-7", "--root", str(root), "--for", "1h")
    expect(out.returncode == 0, "team-b/notebook-7 pinned")

    say("3.", "make one file of team-b/agent-run-3 undeletable (chattr +i stops even root)")
    stuck_file = root / "team-b" / "agent-run-3" / "workspace" / "src" / "module_3.py"
    subprocess.run(["chattr", "+i", str(stuck_file)], check=True)
    immutable.append(stuck_file)
    print(f"        $ chattr +i {stuck_file.relative_to(base)}", flush=True)

    say("4.", f"wait {WINDOW_S + 1}s for the {WINDOW_S}s windows to close")
    time.sleep(WINDOW_S + 1)
    run("ls", "--root", str(root))

    say("5.", "sweep: expired sandboxes are renamed to tombstones, then deleted; one tombstone gets stuck")
    if ignore:
        print(
            f"        (this machine's pid(s) {', '.join(a.split('=')[1] for a in ignore)} cannot be inspected even "
            "by root; without --ignore-pid the in-use check would hold every sandbox as unknown)"
        )
    out = run("sweep", "--root", str(root), "--once", *ignore)
    expect("sweep_deleted reason=RetainUntil entry=team-a/build-1" in out.stderr, "team-a/build-1 deleted")
    expect("sweep_deleted reason=RetainUntil entry=team-a/build-2" in out.stderr, "team-a/build-2 deleted")
    expect(
        "sweep_stuck reason=TombstoneStuck entry=team-b/agent-run-3" in out.stderr,
        "team-b/agent-run-3's tombstone is stuck, reported with errno and path",
    )
    expect(not (root / "team-b" / "agent-run-3").exists(), "team-b/agent-run-3 is no longer openable under its name")
    expect(
        (root / "team-b" / "notebook-7").is_dir() and (root / "team-a" / "build-3").is_dir(),
        "the pinned and the unexpired sandboxes are kept",
    )
    tombstones = [n for n in os.listdir(root) if n.startswith(".reap-")]
    expect(len(tombstones) == 1, f"one tombstone left: {tombstones}")

    say("6.", "a sweep running every second retries the stuck tombstone on every pass but says so only once a day")
    cmd = [*sandkeep_cmd(), "sweep", "--root", str(root), "--interval", "1s", *ignore]
    print(f"        $ sandkeep sweep --root {root} --interval 1s   (three passes, then SIGTERM)", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while sum("sweep_pass" in line for line in lines) < 3 and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        print(f"          {_short(line.rstrip())}", flush=True)
    proc.send_signal(signal.SIGTERM)
    err = "".join(lines) + proc.communicate(timeout=30)[1]
    passes = [line for line in err.splitlines() if "sweep_pass" in line]
    expect(proc.returncode == 0, "the interval sweep stopped cleanly on SIGTERM")
    expect(len(passes) >= 3 and all("stuck=1" in p for p in passes), f"{len(passes)} passes, stuck in every one")
    expect(err.count("reason=TombstoneStuck") == 1, "the stuck tombstone was logged once, not once per pass")

    say("7.", "clear the attribute: the next sweep deletes the leftover tombstone")
    subprocess.run(["chattr", "-i", str(root / tombstones[0] / "workspace" / "src" / "module_3.py")], check=True)
    print(f"        $ chattr -i {tombstones[0]}/workspace/src/module_3.py", flush=True)
    out = run("sweep", "--root", str(root), "--once", *ignore)
    expect(f"sweep_deleted reason=TombstoneLeftover entry={tombstones[0]}" in out.stderr, "the tombstone cleared")
    expect(not [n for n in os.listdir(root) if n.startswith(".reap-")], "no tombstone left")

    say("8.", "what is left: the pinned notebook and the build still inside its window")
    out = run("ls", "--root", str(root))
    rows = {line.split()[1]: line.split()[5] for line in out.stdout.splitlines()[1:] if len(line.split()) >= 7}
    expect(rows == {"build-3": "Retained", "notebook-7": "Pinned"}, f"sandboxes left: {rows}")


def main() -> int:
    if os.geteuid() != 0:
        print("demo_standalone: needs root for `chattr +i` (the stuck-tombstone step); run it as root", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="sandkeep-demo-"))
    immutable: list[Path] = []

    def _term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        demo(base, immutable)
    except DemoFailed as err:
        print(f"\nDEMO FAILED: expected {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        subprocess.run(["chattr", "-R", "-i", str(base)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
    print(f"\ndone in {time.monotonic() - START:.1f}s: retained, pinned, expired, tombstoned, deleted, stuck, cleared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
