"""The client-side rate limit of every API request (kube.RateLimiter, client-go's token bucket)."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from controller.agent.settings import AgentSettings
from controller.api.kube import Kube, RateLimiter, load_config
from controller.cluster.settings import ControllerSettings
from hack.localcluster import LocalCluster


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_at_once_and_the_rest_at_the_average_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(qps=10, burst=3, clock=clock)
    assert [limiter.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.reserve() == pytest.approx(0.1)  # the fourth waits for one token
    assert limiter.reserve() == pytest.approx(0.2)  # the fifth for two
    clock.now += 10.0  # idle a long while: the bucket refills, never above the burst
    assert [limiter.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.reserve() > 0


def test_many_threads_together_never_exceed_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(qps=50, burst=5, clock=clock)
    delays: list[float] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(25):
            delay = limiter.reserve()
            with lock:
                delays.append(delay)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 200 requests at a frozen clock: 5 free, then each 1/50 s after the one before it
    assert sorted(delays)[-1] == pytest.approx((200 - 5) / 50)
    assert len({round(d, 6) for d in delays if d > 0}) == 195


@pytest.mark.parametrize(("qps", "burst"), [(0, 1), (-1, 5), (10, 0)])
def test_a_limit_that_cannot_work_is_refused(qps: float, burst: int) -> None:
    with pytest.raises(ValueError, match="qps > 0 and burst >= 1"):
        RateLimiter(qps, burst)


def test_a_negative_qps_means_no_client_side_limit_and_zero_is_refused() -> None:
    # client-go's convention: QPS < 0 disables the limiter (the controller's default, the server's APF
    # paces it); 0 would allow no request at all, so a setting of 0 stops the process at start, naming it.
    assert RateLimiter.of(-1, 200) is None
    limiter = RateLimiter.of(7.5, 3)
    assert limiter is not None and (limiter.qps, limiter.burst) == (7.5, 3)
    assert ControllerSettings().kube_qps == -1 and AgentSettings(node="n").kube_qps == 20
    for settings in (ControllerSettings, AgentSettings):
        with pytest.raises(ValidationError, match="QPS of 0 allows no request"):
            settings(node="n", kube_qps=0)


def test_the_client_waits_its_turn_against_the_real_api_server(cluster: LocalCluster) -> None:
    # One request every 2 s after a burst of one: the second and third wait for their tokens, never longer
    # than the 4 s two tokens take to come (less the time the requests themselves took).
    limiter = RateLimiter(qps=0.5, burst=1)
    client = Kube(load_config(cluster.kubeconfig), "test-ratelimit", limiter=limiter)
    try:
        for _ in range(3):
            client.request("GET", "/api")
    finally:
        client.close()
    assert client.requests == 3
    assert 0 < limiter.waited <= 4.0
