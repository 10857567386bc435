"""The work queue's verbs on a real event loop: dedupe, priorities, add_after, backoff, forget, drop; and its
controller-runtime series."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.api.workqueue import WorkQueue
from controller.observe.metrics import QueueMetrics, series_names
from controller.rules import contracts as c

T = TypeVar("T")


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


async def drain(q: WorkQueue[str]) -> list[str]:
    """Every key ready right now, in order, each marked done."""
    out = []
    while True:
        try:
            key = await asyncio.wait_for(q.get(), 0.01)
        except TimeoutError:
            return out
        out.append(key)
        q.done(key)


def test_a_key_added_many_times_is_processed_once() -> None:
    async def body() -> list[str]:
        q: WorkQueue[str] = WorkQueue()
        for key in ("a", "b", "a", "a", "b"):
            q.add(key)
        return await drain(q)

    assert run(body) == ["a", "b"]


def test_priority_zero_goes_before_queued_watch_work() -> None:
    async def body() -> list[str]:
        q: WorkQueue[str] = WorkQueue()
        for i in range(5):
            q.add(f"status-{i}")
        q.add("due", priority=0)
        q.add("status-3", priority=0)  # raised: moves ahead, runs once
        return await drain(q)

    assert run(body) == ["due", "status-3", "status-0", "status-1", "status-2", "status-4"]


def test_a_key_added_while_being_processed_runs_again_after_done_never_twice_at_once() -> None:
    async def body() -> list[str]:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        first = await q.get()
        q.add("a")  # an event arrives mid-reconcile
        assert await drain(q) == []  # not handed out while active
        q.done(first)
        return await drain(q)

    assert run(body) == ["a"]


def test_add_after_waits_and_the_earliest_request_wins() -> None:
    async def body() -> tuple[list[str], list[str], float]:
        q: WorkQueue[str] = WorkQueue()
        started = time.monotonic()
        q.add_after("late", 0.3)
        q.add_after("soon", 0.5)
        q.add_after("soon", 0.1)  # earlier: wins
        q.add_after("soon", 0.4)  # later than pending: ignored
        early = await drain(q)
        key = await q.get()
        q.done(key)
        got = [key, await q.get()]
        return early, got, time.monotonic() - started

    early, got, took = run(body)
    assert early == []
    assert got == ["soon", "late"]
    assert 0.3 <= took < 0.45  # "late" came at 0.3 s; the superseded 0.5 s request never fired


def test_backoff_doubles_per_failure_is_capped_and_forget_resets_it() -> None:
    async def body() -> tuple[list[float], float, int]:
        q: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.05)
        delays = [q.add_rate_limited("k") for _ in range(5)]
        assert q.num_requeues("k") == 5
        q.forget("k")
        return delays, q.add_rate_limited("k"), q.num_requeues("k")

    delays, after_forget, requeues = run(body)
    assert delays == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert after_forget == 0.01 and requeues == 1


def test_a_rate_limited_key_comes_back_after_its_delay() -> None:
    async def body() -> tuple[str, float]:
        q: WorkQueue[str] = WorkQueue(base_delay=0.1)
        started = time.monotonic()
        q.add_rate_limited("k")
        key = await q.get()
        return key, time.monotonic() - started

    key, took = run(body)
    assert key == "k" and 0.09 <= took < 0.3


def test_drop_cancels_a_pending_add_after() -> None:
    async def body() -> tuple[list[str], int]:
        q: WorkQueue[str] = WorkQueue()
        q.add_after("gone", 0.05)
        q.add_after("kept", 0.05)
        q.drop("gone")
        await asyncio.sleep(0.1)
        return await drain(q), q.waiting()

    assert run(body) == (["kept"], 0)


def test_the_queue_is_busy_only_while_keys_are_queued_or_processed() -> None:
    async def body() -> list[bool]:
        q: WorkQueue[str] = WorkQueue()
        states = [q.busy()]
        q.add_after("later", 10)
        states.append(q.busy())
        q.add("now")
        states.append(q.busy())
        key = await q.get()
        states.append(q.busy())
        q.done(key)
        states.append(q.busy())
        return states

    assert run(body) == [False, False, True, True, False]


def test_get_ready_takes_what_is_ready_now_in_order_never_an_active_key_and_never_waits() -> None:
    async def body() -> tuple[str, list[str], list[str], list[str]]:
        q: WorkQueue[str] = WorkQueue()
        for key in ("a", "b", "c", "d"):
            q.add(key)
        q.add("c", priority=0)  # raised: its old entry is stale and must not come out twice
        first = await q.get()
        q.add(first)  # queued again while active: not handed out until done
        batch = q.get_ready(10)
        nothing = q.get_ready(10)  # empty queue: returns at once
        for key in (first, *batch):
            q.done(key)
        return first, batch, nothing, await drain(q)

    first, batch, nothing, after = run(body)
    assert first == "c" and batch == ["a", "b", "d"] and nothing == [] and after == ["c"]


def test_get_ready_stops_at_its_limit_and_leaves_the_rest_queued() -> None:
    async def body() -> tuple[list[str], list[str]]:
        q: WorkQueue[str] = WorkQueue()
        for i in range(5):
            q.add(f"k{i}")
        batch = q.get_ready(2)
        for key in batch:
            q.done(key)
        return batch, await drain(q)

    assert run(body) == (["k0", "k1"], ["k2", "k3", "k4"])


# --- controller-runtime's series (observe/metrics.py QueueMetrics), read as Prometheus reads them ----------------
def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _one(registry: CollectorRegistry, name: str, **labels: str) -> float:
    want = {"name": "q", "controller": "q", **labels}
    [value] = [v for k, v in _samples(registry, name).items() if dict(k) == want or dict(k) == {**want, "le": "+Inf"}]
    return value


def test_an_instrumented_queue_exports_controller_runtimes_workqueue_series() -> None:
    registry = CollectorRegistry()
    metrics = QueueMetrics(registry)

    async def body() -> None:
        q: WorkQueue[str] = WorkQueue(base_delay=0.01)
        q.instrument(metrics, "q")
        for key in ("a", "b", "a", "c"):
            q.add(key)
        q.add("c", priority=0)  # raised, not added again
        assert _samples(registry, c.M_WORKQUEUE_DEPTH) == {
            (("controller", "q"), ("name", "q"), ("priority", "0")): 1.0,
            (("controller", "q"), ("name", "q"), ("priority", "1")): 2.0,
        }
        assert _one(registry, c.M_WORKQUEUE_ADDS) == 3
        first = await q.get()
        assert first == "c"
        q.add("c")  # queued again while it is processed: it waits for done, and is no depth yet
        await asyncio.sleep(0.05)
        assert _one(registry, c.M_WORKQUEUE_DEPTH, priority="1") == 2
        assert _one(registry, c.M_WORKQUEUE_LONGEST) >= 0.05
        assert _one(registry, c.M_WORKQUEUE_UNFINISHED) >= 0.05
        second = await q.get()
        await asyncio.sleep(0.02)
        unfinished, longest = _one(registry, c.M_WORKQUEUE_UNFINISHED), _one(registry, c.M_WORKQUEUE_LONGEST)
        assert unfinished >= longest + 0.01, "summed over both keys under way (the second for 0.02 s)"
        q.done(first)
        q.done(second)
        assert _one(registry, c.M_WORKQUEUE_LONGEST) == 0 and _one(registry, c.M_WORKQUEUE_UNFINISHED) == 0
        assert _one(registry, c.M_WORKQUEUE_WORK_DURATION + "_count") == 2
        # the first for 0.05 + 0.02 s, the second 0.02 s
        assert _one(registry, c.M_WORKQUEUE_WORK_DURATION + "_sum") >= 0.07 + 0.02
        assert _one(registry, c.M_WORKQUEUE_QUEUE_DURATION + "_count") == 2
        q.add_rate_limited("b")  # b is queued: still a retry, as client-go counts every AddAfter
        q.add_after("d", 0.01)
        assert _one(registry, c.M_WORKQUEUE_RETRIES) == 2
        await asyncio.sleep(0.03)
        assert await drain(q) == ["b", "d", "c"]  # b raised to priority 0 when due: not one more add
        assert _one(registry, c.M_WORKQUEUE_ADDS) == 5  # a, b, c; c again; d when due
        assert _one(registry, c.M_WORKQUEUE_QUEUE_DURATION + "_count") == 5
        assert sum(_samples(registry, c.M_WORKQUEUE_DEPTH).values()) == 0

    run(body)


def test_every_queue_series_is_served_before_any_queue_exists() -> None:
    # The names the dashboards and alerts use exist from the first scrape: series_names() sees them.
    names = series_names()
    for name in (c.M_WORKQUEUE_DEPTH, c.M_WORKQUEUE_UNFINISHED, c.M_WORKQUEUE_LONGEST, c.M_WORKQUEUE_ADDS):
        assert name in names
    assert {c.M_RECONCILE_TOTAL, c.M_RECONCILE_TIME + "_bucket", c.M_WORKQUEUE_QUEUE_DURATION + "_count"} <= names
