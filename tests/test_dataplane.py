"""The data plane without Ray: routing, failover, stall detection, reports to the control plane and
membership updates, over an in-process transport whose servers' behaviour each test sets."""

from __future__ import annotations

import asyncio
import logging

import pytest

from raytool.dataplane import DataPlane, InvalidRequest, Membership, ServerFailed
from raytool.routing import NoHealthyServer, Router
from raytool.types import PromptScores, SamplingParams, ServerProgress, TokenOutput

SERVERS = ["s0", "s1", "s2"]
P = SamplingParams(max_tokens=1)


class FakeServers:
    """Servers in this process: `mode[name]` is ok | raise | died | hang (no tokens, answers progress) |
    frozen (answers nothing) | slow (answers after `slow_s`, reporting progress) | invalid."""

    def __init__(self):
        self.mode = {name: "ok" for name in SERVERS}
        self.answered: dict[str, list[str]] = {name: [] for name in SERVERS}
        self.cancelled: list[tuple[str, str]] = []
        self.in_flight = {name: 0 for name in SERVERS}
        self.others = {name: 0 for name in SERVERS}  # requests other callers hold there
        self.slow_s = 0.3

    async def generate(self, server, prompt_ids, sampling, request_id):
        mode = self.mode[server]
        self.in_flight[server] += 1
        try:
            await asyncio.sleep(0.001)
            if mode == "raise":
                raise ServerFailed(server, "raised", "RuntimeError: engine step failed")
            if mode == "died":
                raise ServerFailed(server, "died", "ActorDiedError: the actor died unexpectedly")
            if mode == "invalid":
                raise InvalidRequest("prompt is longer than max_model_len")
            if mode in ("hang", "frozen"):
                await asyncio.sleep(3600)
            if mode == "slow":
                await asyncio.sleep(self.slow_s)
            self.answered[server].append(request_id)
            return TokenOutput([1], [0.0], "stop", server=server, server_in_flight=self.in_flight[server] - 1 + self.others[server])
        except asyncio.CancelledError:
            self.cancelled.append((server, request_id))
            raise
        finally:
            self.in_flight[server] -= 1

    async def score(self, server, ids, request_id):
        out = await self.generate(server, ids, P, request_id)  # the same failures, the same bookkeeping
        return PromptScores([-1.0] * (len(ids) - 1), server, 0, out.server_in_flight)

    async def progress(self, server):
        if self.mode[server] == "frozen":
            await asyncio.sleep(3600)
        return ServerProgress(server, 1, 1e9 if self.mode[server] == "hang" else 0.0)


class FakeControl:
    """A control plane that ejects every reported server (or none, with `confirm=False`)."""

    def __init__(self, confirm: bool = True, reachable: bool = True, delay_s: float = 0.001):
        self.confirm, self.reachable, self.delay_s = confirm, reachable, delay_s
        self.epoch = 0
        self.ejected: dict[str, str] = {}
        self.reports: list[tuple[str, str]] = []

    def snapshot(self) -> Membership:
        return Membership("cp1", self.epoch, list(SERVERS), dict(self.ejected))

    async def report(self, server, kind, cause):
        self.reports.append((server, kind))
        if not self.reachable:
            raise ConnectionError("control plane unreachable")
        await asyncio.sleep(self.delay_s)  # it confirms (probes the server) before it answers
        if self.confirm and server not in self.ejected:
            self.ejected[server] = f"{kind}: {cause}"
            self.epoch += 1
        return self.snapshot()


def make(servers: FakeServers, control: FakeControl, **kw) -> DataPlane:
    kw = {"stall_timeout_s": 0.1, "no_server_wait_s": 0.3, "wait_poll_s": 0.02, **kw}
    plane = DataPlane(list(SERVERS), servers, control.report, **kw)
    plane.apply(control.snapshot())
    return plane


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0.01)


def test_a_failing_server_is_dropped_reported_once_and_its_requests_complete_elsewhere():
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control)
        servers.mode["s1"] = "raise"
        outs = await asyncio.gather(*(plane.generate([1], P, f"r{i}", session=f"sess{i}") for i in range(12)))
        await _settle()
        assert {o.server for o in outs} <= {"s0", "s2"}
        assert sorted(sum(servers.answered.values(), [])) == sorted(f"r{i}" for i in range(12))  # each answered once
        assert control.reports == [("s1", "raised")]  # one report, though several calls failed there
        assert plane.router.ejected == {"s1": control.ejected["s1"]} and plane.membership.epoch == 1
        assert plane.retries >= 1
        # A call that failed on s1 before the control plane's answer can end after it (a loaded host's
        # event loop ran the report first once): the server is not reported again.
        plane._drop(ServerFailed("s1", "raised", "a late failure"))
        await _settle()
        assert control.reports == [("s1", "raised")] and plane.router.ejected == {"s1": control.ejected["s1"]}

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["hang", "frozen"])
def test_a_stalled_server_is_reported_stalled_and_the_call_is_cancelled_on_it(mode):
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control)
        servers.mode["s0"] = mode
        out = await plane.generate([1], P, "r0")  # s0 is the first pick
        await _settle()
        assert out.server == "s1"
        assert control.reports == [("s0", "stalled")]
        assert ("s0", "r0") in servers.cancelled

    asyncio.run(main())


def test_a_long_request_on_a_working_server_is_not_cut():
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control)
        servers.mode["s0"] = "slow"  # 0.3 s: three stall timeouts, with progress all along
        out = await plane.generate([1], P, "long")
        assert out.server == "s0" and control.reports == [] and plane.router.ejected == {}

    asyncio.run(main())


def test_an_invalid_request_goes_back_to_its_caller_without_dropping_anyone():
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control)
        servers.mode = {name: "invalid" for name in SERVERS}
        with pytest.raises(InvalidRequest, match="max_model_len"):
            await plane.generate([1] * 10, P, "too-long")
        assert control.reports == [] and plane.router.ejected == {}

    asyncio.run(main())


def test_a_caller_that_gives_up_cancels_the_call_on_its_server():
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control, stall_timeout_s=10.0)
        servers.mode["s0"] = "slow"
        servers.slow_s = 5.0
        task = asyncio.ensure_future(plane.generate([1], P, "given-up"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert servers.cancelled == [("s0", "given-up")] and plane.router.in_flight["s0"] == 0 and control.reports == []

    asyncio.run(main())


def test_a_server_the_control_plane_does_not_confirm_comes_back_into_rotation():
    async def main():
        servers, control = FakeServers(), FakeControl(confirm=False, delay_s=0.05)
        plane = make(servers, control)
        servers.mode["s0"] = "died"
        out = await plane.generate([1], P, "r0")
        assert out.server != "s0" and "s0" in plane.router.ejected  # out at once, for this plane
        await asyncio.sleep(0.1)
        assert control.reports == [("s0", "died")] and plane.router.ejected == {}  # the control plane kept it

    asyncio.run(main())


def test_an_unreachable_control_plane_leaves_the_server_out_until_the_next_membership(caplog):
    async def main():
        servers, control = FakeServers(), FakeControl(reachable=False)
        plane = make(servers, control)
        servers.mode["s2"] = "died"
        servers.mode["s0"] = servers.mode["s1"] = "ok"
        await asyncio.gather(*(plane.generate([1], P, f"r{i}") for i in range(6)))
        await _settle()
        assert "s2" in plane.router.ejected and plane.reporting == {}
        control.epoch += 1  # the control plane is back, and says everyone serves
        assert plane.apply(control.snapshot()) and plane.router.ejected == {}

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "could not report rollout server s2 to the control plane" in caplog.text


def test_with_no_server_left_a_call_waits_for_one_then_says_who_is_out():
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = make(servers, control)
        servers.mode = {name: "raise" for name in SERVERS}
        with pytest.raises(NoHealthyServer, match="s0 .*raised"):
            await plane.generate([1], P, "r0")

    asyncio.run(main())


def test_membership_updates_malformed_refused_whole_older_ignored_new_incarnation_taken(caplog):
    plane = DataPlane(list(SERVERS), FakeServers(), FakeControl().report)
    assert plane.apply(Membership("a", 3, list(SERVERS), {"s1": "dead"}))
    assert plane.router.ejected == {"s1": "dead"}
    with caplog.at_level(logging.ERROR):
        assert not plane.apply(Membership("a", 4, list(SERVERS), {"s0": "x", "s9": "y"}))  # s9 unknown: nothing applied
        assert not plane.apply(Membership("a", 5, ["s0", "s1"], {}))
        assert not plane.apply({"epoch": 9})
    assert plane.router.ejected == {"s1": "dead"}
    assert "ejects unknown servers ['s9']" in caplog.text and "not a Membership" in caplog.text
    assert not plane.apply(Membership("a", 2, list(SERVERS), {}))  # older: ignored
    assert plane.router.ejected == {"s1": "dead"}
    assert plane.apply(Membership("b", 0, list(SERVERS), {}))  # a restarted control plane counts from 0 again
    assert plane.router.ejected == {}


def test_the_router_adds_the_load_other_routers_put_on_a_server_for_a_short_while():
    r = Router(["a", "b"], load_ttl_s=0.05)
    name = r.pick()
    assert name == "a"
    r.observe("a", 5)  # a answered: 5 requests of other routers wait there
    r.done("a")
    assert r.pick() == "b" and r.pick() == "b"  # b: 0 then 1, against a's 5
    r.done("b"), r.done("b")
    import time

    time.sleep(0.06)  # the report is stale: a is judged on this router's own count again
    assert r.pick() == "a"


def test_routing_with_reported_load_spreads_two_planes_over_the_servers():
    async def main():
        servers = FakeServers()
        servers.mode = {name: "slow" for name in SERVERS}
        servers.slow_s = 0.02
        servers.others["s0"] = 20  # a busy server, loaded by callers this plane does not know
        plane = make(servers, FakeControl(), stall_timeout_s=10.0)
        outs = []
        for i in range(10):
            outs.append(await plane.generate([1], P, f"r{i}"))
        return [o.server for o in outs]

    picked = asyncio.run(main())
    assert picked[0] == "s0" and "s0" not in picked[1:]  # once it said how busy it is, this plane goes elsewhere


def test_a_large_fleet_is_balanced_from_a_random_few_per_pick():
    r = Router([f"s{i}" for i in range(1024)], scan=16)
    for i in range(1024 * 8):
        r.pick(group=f"g{i}")  # no session, a new group each time: the least-loaded choice alone
    loads = list(r.in_flight.values())
    assert sum(loads) == 1024 * 8 and max(loads) - min(loads) <= 3, (min(loads), max(loads))
    r2 = Router([f"s{i}" for i in range(20)], scan=16)
    for name in list(r2.in_flight)[:19]:
        r2.eject(name, "down")
    assert all(r2.pick() == "s19" for _ in range(20))  # drawn servers all out: the full scan finds the last one


def test_a_teachers_scoring_call_is_routed_retried_and_watched_like_a_generate_call():
    """distill.teacher: DataPlane.score on the teacher's servers: a server that dies is dropped and
    reported, the call answered by another; a stalled one is found by its progress report."""
    async def main():
        servers, control = FakeServers(), FakeControl()
        plane = DataPlane(list(SERVERS), servers, control.report, stall_timeout_s=0.05)
        servers.mode["s0"] = "died"
        servers.mode["s1"] = "hang"
        out = await plane.score([5, 6, 7, 8], "t0", session="traj-1")
        assert out.logprobs == [-1.0] * 3 and out.server == "s2" and servers.answered["s2"] == ["t0"]
        await asyncio.sleep(0.02)  # the reports reach the control plane
        assert sorted(control.reports) == [("s0", "died"), ("s1", "stalled")] and set(plane.router.ejected) == {"s0", "s1"}
        assert ("s1", "t0") in servers.cancelled  # the stalled call was cancelled on its server

    asyncio.run(main())
