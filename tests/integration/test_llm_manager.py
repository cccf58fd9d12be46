"""The control plane (LLMManager) and the data planes under failure: servers that raise, hang past
the request timeout, or die are ejected, their requests complete on another server (none lost, none
answered twice), and a server that recovers is re-admitted (after a weight re-sync when its process
was restarted).

The servers here are small fake actors with the RolloutServer interface whose failure mode the
test sets; the manager is the real one, and requests go through a caller actor that holds a data
plane exactly as an agent-loop worker does (actors.dataplane), or, where said, through the
manager's own (the central layout). Real vLLM servers killed mid-run: test_end_to_end.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import ray

from raytool.types import SamplingParams, ServerHealth, ServerProgress, TokenOutput

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fakes travel with the test


class _Fake:
    def __init__(self, name: str):
        self.name = name
        self.mode = "ok"  # ok | raise | hang (generates nothing) | frozen (answers nothing: a stopped process) | slow (5 s, progressing)
        self.version = 0
        self.answered: list[str] = []

    def set_mode(self, mode: str) -> None:
        self.mode = mode

    async def ready(self) -> list[str]:
        return [f"tcp://fake/{self.name}"]

    async def generate(self, prompt_ids, sampling, request_id) -> TokenOutput:
        await asyncio.sleep(0.05)
        if self.mode == "raise":
            raise RuntimeError(f"{self.name}: engine step failed")
        if self.mode in ("hang", "frozen"):
            await asyncio.sleep(3600)
        if self.mode == "slow":
            await asyncio.sleep(5)
        if request_id.startswith("probe-"):
            return TokenOutput([0], [0.0], "length", server=self.name, policy_version=self.version)
        self.answered.append(request_id)
        return TokenOutput([len(prompt_ids)], [0.0], "stop", server=self.name, policy_version=self.version)

    def health(self) -> ServerHealth:
        return ServerHealth(self.name, self.version, 0, 0.0, os.getpid())

    async def progress(self) -> dict:  # a hung engine has produced nothing for ages; a frozen process answers nothing
        if self.mode == "frozen":
            await asyncio.sleep(3600)
        return ServerProgress(self.name, 1, 1e9 if self.mode == "hang" else 0.0)

    def set_version(self, version: int) -> None:
        self.version = version

    def answered_ids(self) -> list[str]:
        return list(self.answered)

    def stats(self) -> dict:
        return {"server": self.name, "tokens_per_s": 1.0, "prefix_cache_hit_rate": None}


class _Rejecting(_Fake):
    async def generate(self, prompt_ids, sampling, request_id):
        raise ValueError("prompt is longer than max_model_len")


class _Caller:
    """What an agent-loop worker holds: a data plane over the servers that follows the manager."""

    def __init__(self, servers: dict, manager, stall_timeout_s: float):
        from actors.dataplane import data_plane, follow
        from raytool.config import RolloutConfig

        self.plane = data_plane(servers, manager, RolloutConfig(stall_timeout_s=stall_timeout_s, engine_start_timeout_s=60), "test-caller")
        self._following = asyncio.get_running_loop().create_task(follow(self.plane, manager))

    async def generate(self, prompt_ids, sampling, request_id, session=None, group=None) -> TokenOutput:
        return await self.plane.generate(prompt_ids, sampling, request_id, session, group)

    def stats(self) -> dict:
        return self.plane.stats()


FakeServer = ray.remote(max_restarts=1, max_task_retries=0, num_cpus=0)(_Fake)
Rejecting = ray.remote(num_cpus=0)(_Rejecting)
Caller = ray.remote(num_cpus=0)(_Caller)


@pytest.fixture
def fleet(ray_cluster):
    from actors.llm_manager import LLMManager

    servers = {f"s{i}": FakeServer.remote(f"s{i}") for i in range(3)}
    manager = LLMManager.options(num_cpus=0).remote(servers, stall_timeout_s=2.0, probe_interval_s=0.3, probe_timeout_s=5.0)
    ray.get(manager.set_addresses.remote({n: [f"tcp://fake/{n}"] for n in servers}))
    caller = Caller.remote(servers, manager, 2.0)
    yield servers, manager, caller
    for actor in [caller, manager, *servers.values()]:
        ray.kill(actor)


def _burst(caller, tag: str, n: int = 24):
    """n concurrent requests through `caller` (a data plane's holder, or the manager), 4 per
    trajectory session, 8 per group -> {request_id: output}."""
    ids = [f"{tag}-{i}" for i in range(n)]
    refs = [caller.generate.remote([1, 2, 3], SamplingParams(max_tokens=1), rid, f"{tag}-sess{i // 4}", f"{tag}-g{i // 8}")
            for i, rid in enumerate(ids)]
    return dict(zip(ids, ray.get(refs, timeout=60)))


def _answered(servers) -> dict[str, list[str]]:
    return {name: ray.get(s.answered_ids.remote()) for name, s in servers.items()}


def _wait_for(predicate, timeout_s: float = 30.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def _check_exactly_once(outs: dict, servers) -> None:
    answered = _answered(servers)
    every = [rid for ids in answered.values() for rid in ids]
    assert sorted(rid for rid in every if rid in outs) == sorted(outs), "a request was lost or answered twice"
    for rid, out in outs.items():
        assert rid in answered[out.server]


@pytest.mark.parametrize("mode", ["raise", "hang", "frozen"])
def test_a_failing_server_is_ejected_its_requests_complete_elsewhere_and_it_comes_back(fleet, mode):
    servers, manager, caller = fleet
    from actors.common import wait_until_alive

    ray.get(servers["s1"].set_mode.remote(mode))
    start = time.time()
    outs = _burst(caller, mode)
    assert {o.server for o in outs.values()} <= {"s0", "s2"}
    # The caller dropped s1 at once and reported it; the manager confirms before everyone drops it.
    _wait_for(lambda: "s1" in ray.get(manager.stats.remote()).ejected)
    stats = ray.get(manager.stats.remote())
    if mode != "raise":  # a stalled server is killed, once, and Ray restarts it (a fresh engine)
        assert wait_until_alive(servers["s1"], timeout_s=30)
    _check_exactly_once(outs, servers)
    assert stats.retries >= 1
    assert all(n == 0 for n in ray.get(caller.stats.remote())["in_flight"].values())
    if mode == "hang":
        assert "produced no token for" in stats.ejected["s1"] and time.time() - start < 30
    elif mode == "frozen":  # found within twice the stall timeout: one wait for the answer, one for the probe
        assert "no answer to a progress probe within 2s" in stats.ejected["s1"] and time.time() - start < 30
    else:
        assert "engine step failed" in stats.ejected["s1"]
    # It recovers: the background probe re-admits it (same process, current weights).
    ray.get(servers["s1"].set_mode.remote("ok"))
    _wait_for(lambda: "s1" not in ray.get(manager.stats.remote()).ejected)
    _wait_for(lambda: "s1" not in ray.get(caller.stats.remote())["ejected"])  # the caller learns it from the manager
    outs = _burst(caller, f"{mode}-after", n=48)
    assert "s1" in {o.server for o in outs.values()}


def test_a_killed_server_is_restarted_resynced_then_readmitted(fleet):
    servers, manager, caller = fleet
    for s in servers.values():
        ray.get(s.set_version.remote(5))
    ray.get(manager.synced.remote(5, list(servers), {}))
    # Kill s0 while requests are in flight on it (slow ones, so that they surely are, however busy
    # the machine); Ray restarts its process (max_restarts=1), fresh: on version 0, not slow.
    ray.get(servers["s0"].set_mode.remote("slow"))
    refs = [caller.generate.remote([1], SamplingParams(max_tokens=1), f"k-{i}", f"k-sess{i}", None) for i in range(12)]
    time.sleep(1.0)
    ray.kill(servers["s0"], no_restart=False)
    outs = dict(zip([f"k-{i}" for i in range(12)], ray.get(refs, timeout=60)))
    assert len(outs) == 12 and all(len(o.token_ids) == 1 for o in outs.values())
    _wait_for(lambda: "s0" in ray.get(manager.stats.remote()).ejected)
    # The restarted process answers on policy version 0: it waits for the next weight sync.
    _wait_for(lambda: ray.get(manager.stats.remote()).stale == ["s0"])
    targets = ray.get(manager.plan_sync.remote()).targets
    assert set(targets) == {"s0", "s1", "s2"} and targets["s0"] == ["tcp://fake/s0"]
    assert "s0" in ray.get(manager.stats.remote()).ejected
    for s in servers.values():
        ray.get(s.set_version.remote(6))
    ray.get(manager.synced.remote(6, ["s0", "s1", "s2"], {}))
    stats = ray.get(manager.stats.remote())
    assert stats.ejected == {} and stats.stale == [] and stats.policy_version == 6
    _wait_for(lambda: ray.get(caller.stats.remote())["ejected"] == {})
    outs = _burst(caller, "k-after", n=48)
    assert "s0" in {o.server for o in outs.values()}


def test_a_server_that_fails_its_weight_sync_is_ejected_and_the_rest_serve(fleet):
    servers, manager, caller = fleet
    ray.get(manager.synced.remote(3, ["s0", "s2"], {"s1": "TimeoutError: no bucket 0 within 300s"}))
    stats = ray.get(manager.stats.remote())
    assert stats.ejected["s1"].startswith("weight sync v3 failed") and stats.policy_version == 3
    assert set(ray.get(manager.plan_sync.remote()).targets) == {"s0", "s2"}
    _wait_for(lambda: "s1" in ray.get(caller.stats.remote())["ejected"])  # pushed to the caller by its long poll
    outs = _burst(caller, "sync")
    assert {o.server for o in outs.values()} <= {"s0", "s2"}


def test_an_invalid_request_goes_back_to_its_caller_without_ejecting_anyone(ray_cluster):
    from actors.llm_manager import LLMManager

    rejecting = {"r0": Rejecting.remote("r0"), "r1": Rejecting.remote("r1")}
    m = LLMManager.options(num_cpus=0).remote(rejecting, stall_timeout_s=2.0)
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            ray.get(m.generate.remote([1] * 10, SamplingParams(), "too-long"))
        assert ray.get(m.stats.remote()).ejected == {}
    finally:
        for actor in [m, *rejecting.values()]:
            ray.kill(actor)


def test_a_killed_manager_is_restarted_and_rebuilds_its_state_from_the_servers(ray_cluster):
    """SIGKILL of the manager's process: Ray starts it again; it reads back the policy version it
    kept, and its first call that needs state asks the servers their addresses and versions (a
    server behind it waits for the next sync), and requests route again. Killed again while every
    server is on its base weights (restarted with it), it still knows the version."""
    import signal

    from actors.common import wait_until_alive
    from actors.llm_manager import LLMManager

    servers = {f"s{i}": FakeServer.remote(f"s{i}") for i in range(3)}
    manager = LLMManager.options(num_cpus=0, max_restarts=2, max_task_retries=0).remote(servers, stall_timeout_s=2.0, probe_timeout_s=5.0)
    try:
        ray.get(manager.set_addresses.remote({n: [f"tcp://fake/{n}"] for n in servers}))
        for name, s in servers.items():
            ray.get(s.set_version.remote(4 if name == "s2" else 7))
        ray.get(manager.synced.remote(7, ["s0", "s1"], {"s2": "weight sync v7 failed"}))

        def kill():
            pid = ray.get(manager.__ray_call__.remote(lambda self: os.getpid()))
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(manager.stats.remote())
            assert wait_until_alive(manager, timeout_s=60)

        kill()
        stats = ray.get(manager.stats.remote())
        assert stats.policy_version == 7 and stats.stale == ["s2"] and set(stats.ejected) == {"s2"}
        plan = ray.get(manager.plan_sync.remote())
        assert plan.targets == {n: [f"tcp://fake/{n}"] for n in servers} and plan.version == 8
        outs = _burst(manager, "after-restart")
        assert len(outs) == 24 and {o.server for o in outs.values()} <= {"s0", "s1"}  # the central layout, after the restart
        ray.get(manager.synced.remote(3, [], {}))  # versions only go up: still 7
        assert ray.get(manager.stats.remote()).policy_version == 7
        for s in servers.values():
            ray.get(s.set_version.remote(0))
        kill()
        stats = ray.get(manager.stats.remote())
        assert stats.policy_version == 7 and stats.stale == ["s0", "s1", "s2"]
    finally:
        for actor in [manager, *servers.values()]:
            ray.kill(actor)


def test_a_cancelled_request_is_cancelled_on_its_server_and_a_long_one_on_a_working_server_is_not_cut(ray_cluster):
    """The caller gave up (a trajectory past agent.max_trajectory_s): the cancel reaches the server,
    whose generate call ends (its engine slot freed). A request longer than stall_timeout_s on a
    server that keeps producing tokens completes without an ejection."""
    from actors.llm_manager import LLMManager

    @ray.remote(num_cpus=0)
    class Slow(_Fake):
        async def generate(self, prompt_ids, sampling, request_id):
            try:
                await asyncio.sleep(float(sampling.max_tokens))
            except asyncio.CancelledError:
                self.answered.append(f"cancelled:{request_id}")
                raise
            self.answered.append(request_id)
            return TokenOutput([1], [0.0], "stop", server=self.name)

    servers = {"s0": Slow.remote("s0")}
    manager = LLMManager.options(num_cpus=0).remote(servers, stall_timeout_s=1.0)
    caller = Caller.remote(servers, manager, 1.0)
    try:
        ray.get(manager.set_addresses.remote({"s0": ["tcp://fake/s0"]}))
        out = ray.get(caller.generate.remote([1], SamplingParams(max_tokens=3), "long"), timeout=30)  # 3 s > stall_timeout_s
        assert out.server == "s0" and ray.get(manager.stats.remote()).ejected == {}
        ref = caller.generate.remote([1], SamplingParams(max_tokens=60), "given-up")
        time.sleep(0.5)
        ray.cancel(ref)
        with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
            ray.get(ref, timeout=30)
        _wait_for(lambda: "cancelled:given-up" in ray.get(servers["s0"].answered_ids.remote()), timeout_s=10)
        assert ray.get(manager.stats.remote()).ejected == {}
    finally:
        for actor in [caller, manager, *servers.values()]:
            ray.kill(actor)
