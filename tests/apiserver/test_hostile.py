"""Hostile workspaces and hostile input (issue 12): what an attacker or a typo can hand sandkeep.

Each test generates its input (hypothesis) or builds the worst case by hand, and checks the three
things that matter: nothing outside the root changed, memory stayed bounded (measured in a child
process where it is memory that is at stake), and the component answered instead of crashing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import string
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.api.kube import Kube
from controller.api.leases import agent_heartbeats, heartbeat_name, lease_path, read_lease, renew_heartbeat
from controller.node import fsdelete, nofollow, treesize
from controller.node.store import Root, StoreError, parse_tombstone
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from controller.rules.models import (
    LABEL_VALUE_MAX,
    NAME_MAX,
    Manifest,
    is_namespace_name,
    is_object_name,
    label_value,
)
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import Controller, condition, reasons_for, wait_for
from tests.bed.diskkit import NOW, listing, make_job, outside_bait

pytest_plugins = ["tests.bed.diskkit"]
H = timedelta(hours=1)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
subdomains = st.lists(labels, min_size=1, max_size=8).map(".".join).filter(lambda n: len(n) <= NAME_MAX)


def longest_name(seed: str = "s") -> str:
    """A 253-character DNS-1123 subdomain, as long as Kubernetes allows an object or node name to be."""
    part = (seed * 63)[:63]
    return ".".join([part, part, part, part[:61]])


def longest_namespace(seed: str = "n") -> str:
    return (seed * 63)[:63]


# --- item 7: names are whole-string matches ----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["ns\n", "ns\r\n", "\nns", "ns\x00", "n\u0455", "ns ", "ns\n\n"])
def test_a_name_with_a_newline_or_anything_else_after_it_is_refused(bad: str) -> None:
    assert not is_namespace_name(bad) and not is_object_name(bad)


@given(st.text(alphabet=string.ascii_lowercase + string.digits + "-.\n\r\t \x00", max_size=80))
def test_name_checks_accept_exactly_the_dns1123_shapes(text: str) -> None:
    assert is_namespace_name(text) == (len(text) <= 63 and "." not in text and bool(_SUBDOMAIN.fullmatch(text)))
    assert is_object_name(text) == (len(text) <= NAME_MAX and bool(_SUBDOMAIN.fullmatch(text)))


def test_retain_refuses_a_namespace_ending_in_a_newline_and_creates_nothing(tmp_path: Path) -> None:
    # issue 12, item 7: `retain --namespace $'ns\n'` created `<root>/ns\n/`.
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    before = listing(root.path)
    for ns, name in (("ns\n", "job"), ("ns", "job\n")):
        with pytest.raises(ValueError, match="DNS-1123"):
            root.retain(job, ns, name, job_id="j", created_at=NOW, retention=H, now=NOW)
    assert listing(root.path) == before and (job / "README").read_text() == "hello\n"
    with pytest.raises(ValueError, match="not a DNS-1123"):
        Manifest.model_validate({"namespace": "ns\n", "name": "job"})


def test_a_tombstone_name_with_a_trailing_newline_is_not_a_tombstone() -> None:
    assert parse_tombstone(".reap-abc-1700000000000") is not None
    assert parse_tombstone(".reap-abc-1700000000000\n") is None
    assert parse_tombstone(".reap-abc-１700000000000") is None


# --- item 4: out-of-range times are invalid input, never a crash ---------------------------------------------


@pytest.mark.parametrize(
    "created_at",
    [datetime(9999, 12, 31, 23, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC), datetime.max.replace(tzinfo=UTC)],
)
def test_retain_refuses_a_created_at_out_of_range_and_the_root_stays_listable(tmp_path: Path, created_at) -> None:
    # issue 12, item 4: this retain succeeded, and then every `sandkeep ls` of the root died on it.
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    with pytest.raises(ValueError, match="out of range"):
        root.retain(job, "ns", "far", job_id="j", created_at=created_at, retention=H, now=NOW)
    assert not (root.path / "ns" / "far").exists() and (job / "README").exists()
    assert root.scan().sandboxes == []


def test_a_manifest_with_out_of_range_times_reads_as_expired_not_as_a_crash(tmp_path: Path) -> None:
    from controller.rules.policy import Policy, deadline

    body = {
        "namespace": "ns",
        "name": "x",
        "createdAt": "9999-12-31T23:00:00Z",
        "keepUntil": "0001-01-01T00:00:00+01:00",
    }
    verdict = deadline(Manifest.model_validate(body).facts(), Policy(72 * H, 30 * 24 * H), NOW)
    assert verdict.expired and c.Reason.INVALID_PIN in verdict.reasons and c.Reason.NO_CREATED_AT in verdict.reasons


# --- item 11: every valid Kubernetes name works ----------------------------------------------------------------


@settings(max_examples=300)
@given(subdomains)
def test_a_label_value_made_from_any_name_is_a_valid_bounded_label_value(name: str) -> None:
    value = label_value(name)
    assert len(value) <= LABEL_VALUE_MAX and _LABEL_VALUE.fullmatch(value)
    assert value == label_value(name), "stable: the same name always gives the same value"
    if len(name) <= LABEL_VALUE_MAX:
        assert value == name, "a name that is already a label value is kept as it is"


@settings(max_examples=300)
@given(subdomains, subdomains)
def test_two_names_never_share_a_label_value_or_a_heartbeat_name(a: str, b: str) -> None:
    if a != b:
        assert label_value(a) != label_value(b)
        # The one pair a hash-free name scheme must let collide (the Lease's node annotation then says whose
        # it is, tests/apiserver/test_rbac.py): X and a node named sandkeep-agent-X of more than 238 characters.
        if c.AGENT_LEASE_PREFIX + a != b and c.AGENT_LEASE_PREFIX + b != a:
            assert heartbeat_name(a) != heartbeat_name(b)
    for name in (a, b):
        lease = heartbeat_name(name)
        assert len(lease) <= NAME_MAX and _SUBDOMAIN.fullmatch(lease)


def test_the_heartbeat_of_a_node_too_long_for_the_prefix_is_named_after_the_node() -> None:
    fits = "n" * (NAME_MAX - len(c.AGENT_LEASE_PREFIX))
    assert heartbeat_name(fits) == c.AGENT_LEASE_PREFIX + fits
    assert heartbeat_name(fits + "n") == fits + "n"
    assert heartbeat_name("sandkeep-agent-x") == "sandkeep-agent-sandkeep-agent-x"


def test_the_longest_node_name_has_a_heartbeat_the_api_server_accepts(kube: Kube, namespace: str) -> None:
    node = longest_name("h")
    renew_heartbeat(kube, namespace, node, "agent-1")
    renew_heartbeat(kube, namespace, node, "agent-1")  # the renewal (a PUT) too
    lease = read_lease(kube, namespace, heartbeat_name(node))
    assert lease is not None and lease.holder == "agent-1"
    labels = lease.raw["metadata"]["labels"]
    assert labels[c.LABEL_NODE] == label_value(node) and len(labels[c.LABEL_NODE]) <= LABEL_VALUE_MAX
    renew_heartbeat(kube, namespace, "node-b", "agent-2")
    beats = agent_heartbeats(kube, namespace)
    assert set(beats) == {node, "node-b"}, "the hashed name maps back to the full node name"


def test_a_forged_node_annotation_on_a_heartbeat_is_not_believed(kube: Kube, namespace: str) -> None:
    renew_heartbeat(kube, namespace, "node-b", "agent-2")
    lease = read_lease(kube, namespace, heartbeat_name("node-b"))
    assert lease is not None
    body = dict(lease.raw)
    body["metadata"] = dict(body["metadata"]) | {"annotations": {c.LABEL_NODE: "node-c"}}
    kube.request(
        "PUT", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{heartbeat_name('node-b')}", body=body
    )
    assert set(agent_heartbeats(kube, namespace)) == set()


def _bare_lease(kube: Kube, namespace: str, name: str) -> None:
    """A Lease as someone other than sandkeep's agent (or an agent older than the node annotation) wrote it."""
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}}
    kube.request("POST", lease_path(namespace), body=body | {"spec": {"holderIdentity": "someone"}})


def test_a_long_lease_without_the_node_annotation_is_not_taken_for_a_heartbeat(kube: Kube, namespace: str) -> None:
    _bare_lease(kube, namespace, longest_name("l"))  # named as a 253-char node's heartbeat would be
    assert agent_heartbeats(kube, namespace) == {}


def test_a_heartbeat_written_before_the_node_annotation_gets_it_at_its_next_renewal(kube: Kube, namespace: str) -> None:
    # The chart's node-scope policy admits an agent's Lease only when the annotation names its node.
    _bare_lease(kube, namespace, heartbeat_name("node-old"))
    assert set(agent_heartbeats(kube, namespace)) == {"node-old"}
    renew_heartbeat(kube, namespace, "node-old", "agent-1")
    lease = read_lease(kube, namespace, heartbeat_name("node-old"))
    assert lease is not None and lease.holder == "agent-1"
    assert lease.raw["metadata"]["annotations"] == {c.LABEL_NODE: "node-old"}
    assert lease.raw["metadata"]["labels"] == {c.LABEL_NODE: "node-old", c.LABEL_MANAGED_BY: c.MANAGED_BY}


@pytest.fixture
def long_namespace(cluster: LocalCluster) -> Any:
    name = longest_namespace(f"n{datetime.now(UTC).microsecond % 10}")
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true", check=False)
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def test_the_longest_names_are_kept_pinned_and_deleted_on_the_real_api_server(
    kube: Kube, cluster: LocalCluster, long_namespace: str, tmp_path: Path
) -> None:
    # A 253-char sandbox in a 63-char namespace on a 253-char node: every write sandkeep makes about it
    # (status, Events, the pin's annotations, the label, the DELETE) is accepted by a real API server.
    name, node = longest_name("s"), longest_name("o")
    ctl = Controller(cluster, long_namespace, tmp_path / "controller.log", "--retention=1h")
    try:
        ctl.wait_leader()
        body = {
            "metadata": {"name": name, "labels": {c.LABEL_NODE: label_value(node), c.LABEL_MANAGED_BY: c.MANAGED_BY}},
            "spec": {"nodeName": node, "createdAt": format_instant(datetime.now(UTC) - 2 * H)},
        }
        kube.create_sandbox(long_namespace, body)
        wait_for("Expired then deleted", lambda: kube.get_sandbox(long_namespace, name) is None, timeout=30)
        kube.create_sandbox(
            long_namespace, body | {"spec": body["spec"] | {"createdAt": format_instant(datetime.now(UTC))}}
        )
        cluster.kubectl("annotate", c.SANDBOX_SHORT, name, "-n", long_namespace, f"{c.ANN_PIN_FOR}=72h")
        wait_for(
            "Pinned",
            lambda: ((kube.get_sandbox(long_namespace, name) or {}).get("status") or {}).get("phase") == c.Phase.PINNED,
        )
        wait_for("a Pinned event", lambda: c.Reason.PINNED in reasons_for(kube, long_namespace, name))
        assert condition(kube.get_sandbox(long_namespace, name), "Pinned")["reason"] == c.Reason.PINNED  # type: ignore[index]
        cluster.kubectl("delete", c.SANDBOX_SHORT, name, "-n", long_namespace)
        assert kube.get_sandbox(long_namespace, name) is None
        # A 422 status, not the digits of a timestamp's milliseconds (…36.422Z).
        assert "Unprocessable" not in ctl.log() and not re.search(r"(?<![.\d])422(?!\d)", ctl.log())
    finally:
        ctl.stop()


def test_a_root_holds_the_longest_names(tmp_path: Path) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    root = Root(tmp_path / "root")
    ns, name = longest_namespace(), longest_name()
    job = make_job(tmp_path)
    root.retain(job, ns, name, job_id="j", created_at=NOW, retention=H, now=NOW)
    assert [(e.namespace, e.name) for e in root.scan().sandboxes] == [(ns, name)]
    t = root.tombstone(ns, name, id="u1", now=NOW)
    assert root.delete_tombstone(t).ok
    assert bait_file.read_text() == "must survive too\n" and (bait_dir / "keep.txt").exists()


# --- item 1: the delete and size walks hold bounded memory on any tree ----------------------------------------

_CHILD = r"""
import json, os, resource, sys
from controller.node import fsdelete, treesize
parent, name, what = sys.argv[1], sys.argv[2], sys.argv[3]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if what == "size":
    result = list(treesize.tree_size(os.open(parent, os.O_RDONLY | os.O_DIRECTORY), name))
else:
    r = fsdelete.delete_tree(parent, name, workers=int(what))
    result = [r.ok, r.files]
print(json.dumps([before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, result]))
"""


def _walk_in_child(parent: Path, name: str, what: str) -> tuple[int, list[Any]]:
    """Run one walk in a fresh interpreter: (peak RSS growth over the interpreter's own, in KiB; its result)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(parent), name, what], capture_output=True, text=True, check=True
    )
    before, after, result = json.loads(out.stdout)
    return after - before, result


def _chain(parent: Path, depth: int, length: int) -> None:
    """`depth` levels of `length`-byte names, built fd-relative (far deeper than PATH_MAX allows by path)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            level = str(i % 10).ljust(length, "d")
            os.mkdir(level, dir_fd=fd)
            child = os.open(level, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.mark.parametrize("what", ["size", "1", "4"])
def test_a_2000_level_chain_of_255_byte_names_is_walked_in_bounded_memory(tmp_path: Path, what: str) -> None:
    # issue 12, item 1: the delete kept each level's full path (512 MB RSS against the agent's 256Mi limit)
    # and the size walk died with RecursionError at ~1,500 levels. Measured in a child: its peak RSS growth.
    (tmp_path / "t").mkdir()
    _chain(tmp_path / "t", 2000, 255)
    bait_file, bait_dir = outside_bait(tmp_path)
    try:
        grown_kib, result = _walk_in_child(tmp_path, "t", what)
    finally:  # pytest's own tmp_path cleanup (shutil.rmtree) dies with RecursionError on this chain
        fsdelete.delete_tree(tmp_path, "t")
    assert grown_kib < 16 * 1024, f"peak RSS grew {grown_kib} KiB"
    if what == "size":
        assert result[1] == 1 and result[0] >= 2000 * 4096
    else:
        assert result == [True, 1] and listing(tmp_path) == sorted(["outside", "outside-file.txt"])
    assert bait_file.read_text() == "must survive too\n" and listing(bait_dir) == ["keep.txt"]


def test_a_wide_directory_of_long_names_is_deleted_in_bounded_memory(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(30_000):
            os.close(os.open(f"{i:08d}".ljust(240, "w"), os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    grown_kib, result = _walk_in_child(tmp_path, "t", "4")
    assert result == [True, 30_000] and grown_kib < 8 * 1024, f"peak RSS grew {grown_kib} KiB"


_KINDS = ("file", "dir", "link-out-file", "link-out-dir", "link-dangling", "fifo", "hardlink-out")


@st.composite
def hostile_trees(draw: st.DrawFn) -> list[tuple[int, str, str]]:
    """Up to 40 entries, each (index of the directory it goes in, kind, name), names up to 255 bytes."""
    names = st.text(alphabet=string.ascii_letters + string.digits + "-_. \n\\", min_size=1, max_size=255).filter(
        lambda n: n not in (".", "..")
    )
    return draw(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(_KINDS), names), max_size=40))


def _build(top: Path, plan: list[tuple[int, str, str]], bait_file: Path, bait_dir: Path) -> tuple[int, int]:
    """Build `plan` under `top`; return (files, dirs) made (links, fifos and hard links count as files)."""
    dirs, files = [top], 0
    for where, kind, name in plan:
        parent = dirs[where % len(dirs)]
        path = parent / name
        if path.exists() or path.is_symlink():
            continue
        if kind == "dir":
            path.mkdir()
            dirs.append(path)
            continue
        if kind == "file":
            path.write_bytes(b"x" * len(name))
        elif kind == "link-out-file":
            path.symlink_to(bait_file)
        elif kind == "link-out-dir":
            path.symlink_to(bait_dir)
        elif kind == "link-dangling":
            path.symlink_to("/nonexistent/" + name.replace("/", "_"))
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            os.link(bait_file, path)
        files += 1
    return files, len(dirs) - 1


def _snapshot(path: Path) -> list[tuple[str, int, int, bytes]]:
    out = []
    for p in sorted(path.rglob("*")):
        st_ = p.lstat()
        out.append((str(p), st_.st_mode, st_.st_mtime_ns, p.read_bytes() if p.is_file() else b""))
    return out


@settings(max_examples=40, deadline=None)
@given(hostile_trees(), st.sampled_from([1, 4]))
def test_any_tree_is_sized_then_deleted_and_nothing_outside_changes(plan: list[Any], workers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        bait_file, bait_dir = outside_bait(base)
        root = base / "root"
        root.mkdir()
        (root / "t").mkdir()
        files, _dirs = _build(root / "t", plan, bait_file, bait_dir)
        outside = [*_snapshot(bait_dir), bait_file.read_bytes()]
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert treesize.tree_size(fd, "t").files == files
        finally:
            os.close(fd)
        result = fsdelete.delete_tree(root, "t", workers=workers)
        assert result.ok and result.files == files and listing(root) == []
        assert [*_snapshot(bait_dir), bait_file.read_bytes()] == outside


# --- item 2: retain resolves its source with no link in any component ------------------------------------------


def _victim(tmp_path: Path) -> Path:
    """A directory only root should reach, holding `data/` with a config the attacker wants moved."""
    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "secret.conf").write_text("root's\n")
    (victim / "data" / "keep").write_text("root's too\n")
    return victim


def _victim_intact(victim: Path) -> bool:
    return listing(victim / "data") == ["keep", "secret.conf"] and (victim / "data" / "secret.conf").read_text() == (
        "root's\n"
    )


def test_retain_refuses_a_source_with_a_symlink_in_an_intermediate_component(tmp_path: Path) -> None:
    # issue 12, item 2: the user who owns home/ makes home/job a link to a root-only directory; root's
    # `retain home/job/data --exclude '*.conf'` moved the victim's data into the root and deleted inside it.
    victim = _victim(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "job").symlink_to(victim)
    root = Root(tmp_path / "root")
    with pytest.raises(StoreError) as caught:
        root.retain(
            tmp_path / "home" / "job" / "data",
            "ns",
            "run",
            job_id="j",
            created_at=NOW,
            retention=None,
            exclude=["*.conf"],
            now=NOW,
        )
    assert caught.value.reason is c.Reason.SYMLINK and "symlink" in str(caught.value)
    assert _victim_intact(victim) and listing(root.path) == []


@pytest.mark.parametrize("kernel", ["openat2", "per-component"])
def test_open_no_symlinks_refuses_a_link_anywhere_with_or_without_openat2(
    tmp_path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel == "per-component":
        monkeypatch.setattr(nofollow, "_SYS_OPENAT2", 9999)  # ENOSYS: the O_NOFOLLOW walk
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    fd = nofollow.open_no_symlinks(tmp_path / "a" / "b")
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "a" / "b"))
    finally:
        os.close(fd)
    for bad in (tmp_path / "link" / "b", tmp_path / "link"):
        with pytest.raises(OSError) as caught:
            nofollow.open_no_symlinks(bad)
        assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)


RENAME_EXCHANGE = 2


def test_retain_racing_a_user_who_swaps_the_source_for_a_link_never_touches_the_victim(tmp_path: Path) -> None:
    # The attacker flips home/job between their own directory and a link to the victim (RENAME_EXCHANGE, so
    # the name always exists) while root retains home/job/data again and again. Whatever wins each race,
    # the victim's files are never moved and never excluded away; the store keeps answering.
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    victim = _victim(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    (home / "swap").symlink_to(victim)
    root = Root(tmp_path / "root")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            libc.renameat2(-100, str(home / "job").encode(), -100, str(home / "swap").encode(), RENAME_EXCHANGE)

    outcomes: dict[str, int] = {}
    flipper = threading.Thread(target=flip)
    (home / "job").mkdir()
    own = os.open(home / "job", os.O_RDONLY | os.O_DIRECTORY)  # the attacker's own directory, whatever its name
    try:
        for i in range(150):
            with contextlib.suppress(FileExistsError):
                os.mkdir("data", dir_fd=own)
            data = os.open("data", os.O_RDONLY | os.O_DIRECTORY, dir_fd=own)
            for leaf in ("mine.conf", "mine"):
                os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=data))
            os.close(data)
            if i == 0:
                flipper.start()
            try:
                root.retain(
                    home / "job" / "data",
                    "ns",
                    f"r{i}",
                    job_id="j",
                    created_at=NOW,
                    retention=None,
                    exclude=["*.conf"],
                    now=NOW,
                )
                outcomes["retained"] = outcomes.get("retained", 0) + 1
                assert listing(root.path / "ns" / f"r{i}" / "workspace") == ["mine"]
            except StoreError as err:
                outcomes[str(err.reason)] = outcomes.get(str(err.reason), 0) + 1
            except FileNotFoundError:
                outcomes["vanished"] = outcomes.get("vanished", 0) + 1
            assert _victim_intact(victim)
    finally:
        stop.set()
        if flipper.is_alive():
            flipper.join()
        os.close(own)
    assert _victim_intact(victim)
    assert sum(outcomes.values()) == 150 and outcomes.get(str(c.Reason.SYMLINK), 0) > 0, outcomes


def test_exclusions_are_not_applied_inside_a_tree_deeper_than_the_walk_keeps_open(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    _chain(job, 300, 8)
    with pytest.raises(StoreError) as caught:
        root.retain(job, "ns", "deep", job_id="j", created_at=NOW, retention=None, exclude=["*.log"], now=NOW)
    assert "too deep" in str(caught.value) and "nothing was retained" in str(caught.value)
    assert listing(root.path) == [] and (job / "README").exists()
    fsdelete.delete_tree(tmp_path, "job")


# --- item 4 on the real API server: the controller answers an out-of-range pin and keeps running -------------


def test_an_out_of_range_pin_is_reported_and_the_expired_sandbox_still_deleted(
    kube: Kube, cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    # issue 12, item 4: decide() raised OverflowError on this pin on every reconcile, so the sandbox was kept
    # forever (defeating maxPin). Now the pin is invalid, said so, and the controller goes on deciding.
    ctl = Controller(cluster, namespace, tmp_path / "controller.log", "--retention=1h")
    try:
        ctl.wait_leader()
        for name, pin in (("year-one", "0001-01-01T00:00:00+01:00"), ("fullwidth", "２０２６-01-01T00:00:00Z")):
            body = {
                "metadata": {"name": name, "annotations": {c.ANN_PIN_UNTIL: pin}},
                "spec": {"nodeName": "node-a", "createdAt": format_instant(datetime.now(UTC) - 2 * H)},
            }
            kube.create_sandbox(namespace, body)
        kube.create_sandbox(
            namespace,
            {
                "metadata": {"name": "kept"},
                "spec": {"nodeName": "node-a", "createdAt": format_instant(datetime.now(UTC))},
            },
        )
        cluster.kubectl("annotate", c.SANDBOX_SHORT, "kept", "-n", namespace, f"{c.ANN_PIN_FOR}=３h")
        for name in ("year-one", "fullwidth"):
            wait_for(f"{name} deleted", lambda n=name: kube.get_sandbox(namespace, n) is None, timeout=30)
            wait_for(
                "a DeleteRequested event", lambda n=name: c.Reason.DELETE_REQUESTED in reasons_for(kube, namespace, n)
            )
        cond = wait_for("PinValid=False", lambda: condition(kube.get_sandbox(namespace, "kept"), "PinValid"))
        assert cond["reason"] == c.Reason.INVALID_PIN and "not a duration" in cond["message"]
        wait_for("an InvalidPin event", lambda: c.Reason.INVALID_PIN in reasons_for(kube, namespace, "kept"))
        assert ctl.proc.poll() is None and "OverflowError" not in ctl.log() and "Traceback" not in ctl.log()
    finally:
        ctl.stop()
