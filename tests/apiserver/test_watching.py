"""`listwatch.ListWatch`, the controller's own list and watch of RetainedSandboxes, against the real API server.

Each test runs a ListWatch in this process on one namespace and records what it hands on: the listed
objects (type None) a page at a time, then the watch's events; a relist after 410 Gone says what vanished.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from controller import agent as agent_mod
from controller.api import listwatch
from controller.api.kube import Kube, KubeError, sandbox_path
from controller.cluster.controller import Controller
from controller.cluster.settings import ControllerSettings
from controller.node.store import Root
from controller.observe.metrics import AgentMetrics, ControllerMetrics
from controller.rules.objects import Obj, key_of
from tests.bed.controller_harness import sandbox

Key = tuple[str, str]


class Recorder:
    """What a ListWatch handed on: each (type, name) in order, and each complete listing's keys."""

    def __init__(self) -> None:
        self.events: list[tuple[str | None, str]] = []
        self.listings: list[set[Key]] = []

    def on_event(self, kind: str | None, obj: Obj) -> None:
        self.events.append((kind, obj["metadata"]["name"]))

    def listed(self, seen: set[Key]) -> None:
        self.listings.append(seen)


async def until(what: str, done: Callable[[], bool], timeout: float = 20.0) -> None:
    limit = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < limit, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def run_watch(watch: listwatch.ListWatch, body: Callable[[], Awaitable[None]]) -> None:
    """Run `watch` while `body` runs; the watch must still be running at the end (it never ends by itself)."""

    async def main() -> None:
        task = asyncio.create_task(watch.run())
        try:
            await body()
            assert not task.done(), "the watch ended by itself"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_listing_comes_in_pages_then_the_watch_brings_each_change_in_order(kube: Kube, namespace: str) -> None:
    for i in range(7):
        kube.create_sandbox(namespace, sandbox(f"s{i}"))
    seen = Recorder()
    watch = listwatch.ListWatch(kube, sandbox_path(namespace), seen.on_event, seen.listed, limit=3)
    before = kube.requests

    async def body() -> None:
        await asyncio.wait_for(watch.synced.wait(), 20)
        assert kube.requests - before == 4, "7 objects at 3 a page are 3 list requests, then the watch's"
        assert seen.events == [(None, f"s{i}") for i in range(7)]
        assert seen.listings == [{(namespace, f"s{i}") for i in range(7)}]
        listed_at = watch.resource_version
        await asyncio.to_thread(kube.create_sandbox, namespace, sandbox("new"))
        obj = await asyncio.to_thread(kube.get_sandbox, namespace, "s0")
        assert obj is not None
        touched = await asyncio.to_thread(kube.patch_annotations, obj, {"example.com/touched": "yes"})
        await asyncio.to_thread(kube.delete_sandbox, touched)
        await until("the three events", lambda: len(seen.events) == 10)
        assert seen.events[7:] == [("ADDED", "new"), ("MODIFIED", "s0"), ("DELETED", "s0")]
        assert int(watch.resource_version) > int(listed_at)
        assert watch.listings == 1

    run_watch(watch, body)


def test_a_watch_the_server_ends_resumes_where_it_stopped_without_listing_again(kube: Kube, namespace: str) -> None:
    # The server ends every watch request at its timeout (here 1 s); the next one starts from the last
    # resourceVersion seen, so nothing is listed twice and no event is lost in the gap.
    seen = Recorder()
    watch = listwatch.ListWatch(kube, sandbox_path(namespace), seen.on_event, seen.listed, timeout=1)

    async def body() -> None:
        await asyncio.wait_for(watch.synced.wait(), 20)
        for i in range(3):
            await asyncio.sleep(1.5)  # past the server's timeout: each create lands on a new watch request
            await asyncio.to_thread(kube.create_sandbox, namespace, sandbox(f"late{i}"))
        await until("three ADDED events", lambda: len(seen.events) == 3)
        assert seen.events == [("ADDED", f"late{i}") for i in range(3)]
        assert watch.listings == 1 and len(seen.listings) == 1

    run_watch(watch, body)


def test_after_410_gone_it_lists_again_and_says_what_vanished_meanwhile(kube: Kube, namespace: str) -> None:
    # A watch down long enough that its resourceVersion left the server's window gets 410 Gone; a watch
    # alone would never tell of the objects deleted meanwhile. The new listing's keys do.
    for name in ("stays", "goes"):
        kube.create_sandbox(namespace, sandbox(name))
    seen = Recorder()
    watch = listwatch.ListWatch(kube, sandbox_path(namespace), seen.on_event, seen.listed)

    async def main() -> None:
        first = asyncio.create_task(watch.run())
        await asyncio.wait_for(watch.synced.wait(), 20)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        goes = await asyncio.to_thread(kube.get_sandbox, namespace, "goes")
        assert goes is not None
        await asyncio.to_thread(kube.delete_sandbox, goes)  # while nothing watches
        watch.synced.clear()
        watch.resource_version = "1"  # long compacted away: the server answers 410 Gone
        again = asyncio.create_task(watch.run())
        try:
            await until("a new listing", lambda: watch.listings == 2)
        finally:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)

    asyncio.run(main())
    assert seen.listings[-1] == {(namespace, "stays")}, "the relist's keys leave out what was deleted meanwhile"


def test_the_controller_drops_what_a_relisting_no_longer_has() -> None:
    # The controller's side of a relist: a sandbox in its view but not in the new listing is gone, taken
    # out of the view, the queue and the gauges as a DELETED event would; other namespaces are untouched.
    async def main() -> None:
        rec = Controller(Kube(k8s.Configuration()), ControllerSettings(), ControllerMetrics())
        for obj in (_obj("a", "ns1"), _obj("b", "ns1"), _obj("c", "ns2")):
            rec.on_sandbox(None, obj)
        assert len(rec.view.sandboxes) == 3
        rec.on_listed("ns1", {("ns1", "a")})
        assert sorted(rec.view.sandboxes) == [("ns1", "a"), ("ns2", "c")]
        assert ("ns1", "b") not in rec._phases
        rec.on_listed(None, {("ns1", "a")})
        assert sorted(rec.view.sandboxes) == [("ns1", "a")]

    asyncio.run(main())


def test_a_refused_watch_is_said_and_retried_and_never_ends(
    kube: Kube, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Recorder()
    path = sandbox_path(namespace).replace("retainedsandboxes", "nosuchresources")
    watch = listwatch.ListWatch(kube, path, seen.on_event, seen.listed)

    async def body() -> None:
        await until("two refusals", lambda: caplog.text.count("watch_failed") >= 2, timeout=10)

    with caplog.at_level(logging.WARNING, logger="sandkeep.watch"):
        run_watch(watch, body)
    assert "404" in caplog.text or "not found" in caplog.text
    assert not watch.synced.is_set() and seen.events == []


def test_a_watch_line_longer_than_any_object_is_refused_not_held() -> None:
    async def chunks(total: int) -> AsyncIterator[bytes]:
        yield b'{"type": "ADDED"}\n{"partial'
        for _ in range(total // 65536 + 1):
            yield b"x" * 65536

    async def read(total: int) -> list[bytes]:
        return [line async for line in listwatch.lines(chunks(total))]

    assert asyncio.run(read(1 << 20))[0] == b'{"type": "ADDED"}', "an ordinary line is handed on"
    with pytest.raises(KubeError, match="longer than"):
        asyncio.run(read(listwatch.MAX_EVENT + 1))


def _obj(name: str, namespace: str) -> dict[str, Any]:
    obj = sandbox(name)
    obj["metadata"] |= {"namespace": namespace, "uid": f"uid-{name}", "resourceVersion": "5"}
    assert key_of(obj) == (namespace, name)
    return obj


def test_the_agent_forgets_what_a_relisting_no_longer_has_and_only_then_may_adopt(tmp_path: Path) -> None:
    # The agent's side: its passes wait for a complete listing (a directory whose object has not arrived yet
    # must not be adopted as new); after a relist, an object deleted meanwhile is forgotten (its uid kept as
    # gone, so a late answer cannot bring it back) instead of staying a ghost that blocks a new adoption.
    settings = agent_mod.AgentSettings(node="n1", root=tmp_path / "root", namespace="sandkeep")
    agent = agent_mod.Agent(settings, Kube(k8s.Configuration()), Root(tmp_path / "root"), AgentMetrics("n1"))
    a, b = _obj("a", "ns1"), _obj("b", "ns1")
    for obj in (a, b):
        obj["spec"]["nodeName"] = "n1"
        agent._on_watch(None, obj)
    assert not agent.state.synced
    agent._listed({("ns1", "a"), ("ns1", "b")})
    assert agent.state.synced and sorted(agent.state.objects) == [("ns1", "a"), ("ns1", "b")]
    agent._listed({("ns1", "a")})
    assert sorted(agent.state.objects) == [("ns1", "a")]
    assert "uid-b" in agent.state.gone
    agent._on_watch("MODIFIED", b)  # a late event of the forgotten object
    assert ("ns1", "b") not in agent.state.objects
