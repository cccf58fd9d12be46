"""The control plane (raytool.controlplane) without Ray: fake servers behind its transport, in one event loop."""

from __future__ import annotations

import asyncio

import pytest

from raytool.controlplane import ControlPlane, Record
from raytool.dataplane import Membership, ServerFailed
from raytool.types import ServerHealth, ServerProgress

SERVERS = ["s0", "s1", "s2"]


class FakeServers:
    """Each server answers per its mode: ok | down (every call fails: dead or restarting) | slow (no
    answer: a stopped process) | hang (answers, but its engine has made no token for ages)."""

    def __init__(self, version: int = 0):
        self.mode = dict.fromkeys(SERVERS, "ok")
        self.version = dict.fromkeys(SERVERS, version)
        self.port = dict.fromkeys(SERVERS, 1)
        self.restarted: list[str] = []
        self.calls: list[tuple[str, str]] = []

    async def _answer(self, server: str, what: str) -> None:
        self.calls.append((server, what))
        await asyncio.sleep(0)
        if self.mode[server] == "down":
            raise ServerFailed(server, "unreachable", f"ActorDiedError: {server} is dead")
        if self.mode[server] == "slow":
            await asyncio.sleep(3600)

    async def ready(self, server):
        await self._answer(server, "ready")
        return [f"tcp://{server}:{self.port[server]}"]

    async def health(self, server):
        await self._answer(server, "health")
        return ServerHealth(server, self.version[server], 0, 1.0, 100)

    async def progress(self, server):
        await self._answer(server, "progress")
        return ServerProgress(server, 1, 1e9 if self.mode[server] == "hang" else 0.0)

    async def probe(self, server):
        await self._answer(server, "probe")

    def restart(self, server):
        self.restarted.append(server)
        self.version[server] = 0
        self.mode[server] = "ok"
        self.port[server] += 1


class Counted:
    def __init__(self):
        self.retries: list[str] = []
        self.ejections: list[str] = []

    def retried(self, server):
        self.retries.append(server)

    def ejected(self, server):
        self.ejections.append(server)


def make(servers: FakeServers, record: Record | None = None, **kw) -> tuple[ControlPlane, list, list, Counted]:
    changes, kept, events = [], [], Counted()
    kw = {"stall_timeout_s": 0.2, "probe_interval_s": 0.02, "probe_timeout_s": 0.2, **kw}
    control = ControlPlane(SERVERS, servers, record=record, keep=kept.append, on_change=changes.append, events=events, **kw)
    if record is None:
        control.set_addresses({n: [f"tcp://{n}:1"] for n in SERVERS})
    return control, changes, kept, events


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_raised_error_ejects_at_once_and_the_server_is_readmitted_when_its_probe_answers():
    async def main():
        servers = FakeServers()
        control, changes, _, events = make(servers)
        servers.mode["s1"] = "down"
        answer = await control.report("s1", "raised", "RuntimeError: engine step failed", "agent-worker-0")
        assert answer.ejected == {"s1": "raised: RuntimeError: engine step failed (seen by agent-worker-0)"}
        assert isinstance(answer, Membership) and answer.epoch == 1 and changes[-1] == answer
        assert events.retries == ["s1"] and events.ejections == ["s1"] and control.healthy() == ["s0", "s2"]
        await until(lambda: "last probe failed" in control.stats().ejected["s1"])  # its probes fail meanwhile, said with the cause
        assert control.stats().ejected["s1"].endswith("(last probe failed: ActorDiedError: s1 is dead)")
        servers.mode["s1"] = "ok"
        await until(lambda: not control.ejected)
        assert changes[-1].ejected == {} and ("s1", "probe") in servers.calls  # a one-token generate before it is back

    asyncio.run(main())


def test_a_server_reported_dead_that_answers_on_the_current_version_stays_and_one_that_does_not_is_ejected():
    async def main():
        servers = FakeServers()
        control, changes, _, _ = make(servers, probe_interval_s=60)
        answer = await control.report("s0", "died", "ActorDiedError", "gateway")
        assert answer.ejected == {} and changes == []  # its own answer on the current weights keeps it in
        servers.mode["s2"] = "slow"
        answer = await control.report("s2", "unreachable", "no route", "gateway")
        assert answer.ejected["s2"] == "unreachable: no route (seen by gateway); confirmed: no answer within 0.2s"
        servers.mode["s0"] = "down"
        await asyncio.gather(*(control.report("s0", "died", "ActorDiedError", f"worker-{i}") for i in range(5)))
        assert control.ejected["s0"].endswith("confirmed: ActorDiedError: s0 is dead") and control.retries == 7
        assert servers.calls.count(("s0", "health")) == 2  # the first report's check, then one for five reports

    asyncio.run(main())


def test_a_stalled_server_is_ejected_and_restarted_only_when_its_own_progress_agrees():
    async def main():
        servers = FakeServers(version=3)
        control, _, _, _ = make(servers, record=None)
        control.synced(3, SERVERS, {})
        assert (await control.report("s1", "stalled", "no token for 60s")).ejected == {}  # busy, not stalled
        servers.mode["s1"] = "hang"
        answer = await control.report("s1", "stalled", "no token for 60s")
        assert "s1" in answer.ejected and servers.restarted == ["s1"]
        # Ray restarted it with a fresh engine: back on the base weights (and new ports), it waits for the next sync.
        await until(lambda: "s1" in control.stale)
        assert "s1" in control.ejected and control.stale["s1"] == ["tcp://s1:2"]
        plan = await control.plan_resync()
        assert plan.version == 3 and plan.targets == {"s1": ["tcp://s1:2"]}
        control.synced(3, ["s1"], {})
        assert not control.ejected and not control.stale and control.policy_version == 3

    asyncio.run(main())


def test_sync_plans_number_their_passes_go_to_the_healthy_and_the_waiting_and_a_failed_sync_ejects():
    async def main():
        servers = FakeServers()
        control, changes, kept, _ = make(servers)
        assert await control.plan_resync() is None  # nobody waits for weights
        plan = await control.plan_sync()
        assert (plan.version, plan.attempt, sorted(plan.targets)) == (1, 1, SERVERS)
        epoch = control.epoch
        control.synced(1, ["s0", "s2"], {"s1": "TimeoutError: no bucket 0 within 300s"})
        assert control.policy_version == 1 and control.epoch == epoch + 1 and changes[-1].ejected.keys() == {"s1"}  # the ejection, one change
        assert control.ejected["s1"] == "weight sync v1 failed: TimeoutError: no bucket 0 within 300s"
        again = await control.plan_sync(1, ["s0"])  # a broken chain's second pass: the same version, a new attempt
        assert (again.version, again.attempt, list(again.targets)) == (1, 2, ["s0"])
        nxt = await control.plan_sync()
        assert nxt.version == 2 and "s1" not in nxt.targets
        assert kept[-1] == Record(policy_version=1, sync_attempts=3)  # what a restarted holder reads back
        control.synced(0, [], {})  # a late word on an older sync: versions only go up
        assert control.policy_version == 1
        # A server alive but never acking (hung in its load): the control plane, the one to decide, restarts it.
        control.synced(2, ["s0"], {"s2": "s2 did not ack weight sync v2 within 330s"}, ["s2"])
        assert servers.restarted == ["s2"] and control.ejected["s2"].startswith("weight sync v2 failed: s2 did not ack")

    asyncio.run(main())


def test_a_server_whose_loaded_weights_do_not_match_the_trainers_digest_is_not_attested_and_is_ejected():
    async def main():
        control, changes, _, _ = make(FakeServers())
        plan = await control.plan_sync()
        failed = control.synced(plan.version, ["s0", "s1", "s2"], {}, (), sent=0xABC, attestations={"s0": 0xABC, "s1": 0xABD, "s2": 0xABC})
        assert control.attested == {"s0": 1, "s2": 1}
        assert failed == {"s1": "its weights are not attested: it reports digest 0000000000000abd of what it loaded, the trainer sent 0000000000000abc"}
        assert changes[-1].ejected.keys() == {"s1"} and control.ejected["s1"].startswith("weight sync v1 failed: its weights are not attested")
        # Without the trainer's word (its pass failed), acks are taken as they are.
        assert control.synced(plan.version, ["s0"], {}) == {} and control.attested == {"s0": 1, "s2": 1}

    asyncio.run(main())


def test_a_sync_every_server_took_changes_no_membership_and_wakes_no_plane():
    async def main():
        control, changes, _, _ = make(FakeServers())
        first = await control.membership()
        poll = asyncio.ensure_future(control.membership(first.incarnation, first.epoch, timeout_s=0.2))
        plan = await control.plan_sync()
        control.synced(plan.version, sorted(plan.targets), {})
        assert control.policy_version == 1 and control.epoch == first.epoch and changes == []
        assert await poll == first  # the long poll ran out: nothing was sent to any plane
        control.synced(2, ["s0", "s2"], {"s1": "no ack"})  # an ejection is a change
        assert control.epoch == first.epoch + 1 and list(changes[-1].ejected) == ["s1"]

    asyncio.run(main())


def test_a_restarted_holder_keeps_the_version_and_rebuilds_the_rest_from_the_servers():
    async def main():
        servers = FakeServers(version=7)
        servers.version["s2"] = 4
        control, changes, kept, _ = make(servers, record=Record(policy_version=7, sync_attempts=12))
        stats = control.stats()  # nothing asked yet: the rebuild runs on the first call that needs the state
        assert servers.calls == [] and stats.policy_version == 7
        plan = await control.plan_sync()
        assert control.stale == {"s2": ["tcp://s2:1"]} and set(control.ejected) == {"s2"}
        assert (plan.version, plan.attempt) == (8, 13) and plan.targets == {n: [f"tcp://{n}:1"] for n in SERVERS}
        assert changes[-1].ejected == {"s2": "on policy version 4, behind 7"}

        # Restarted together with every server (their engines on the base weights): the version is the kept one.
        servers = FakeServers(version=0)
        servers.mode["s0"] = "down"
        control, _, _, _ = make(servers, record=kept[-1])
        await control.membership()
        assert control.policy_version == 7
        assert sorted(control.stale) == ["s1", "s2"] and control.ejected["s0"] == "no answer after the manager restarted: ActorDiedError: s0 is dead"
        # A server on a newer version than the record (a sync that ended as the holder died) raises it.
        servers = FakeServers(version=9)
        control, _, _, _ = make(servers, record=Record(policy_version=8))
        await control.membership()
        assert control.policy_version == 9 and not control.stale

    asyncio.run(main())


def test_membership_is_a_long_poll_answered_at_once_when_the_caller_is_behind():
    async def main():
        servers = FakeServers()
        control, _, _, _ = make(servers)
        first = await control.membership()
        assert (first.incarnation, first.epoch, first.servers) == (control.incarnation, 0, SERVERS)
        timed_out = await control.membership(first.incarnation, first.epoch, timeout_s=0.05)
        assert timed_out == first
        poll = asyncio.ensure_future(control.membership(first.incarnation, first.epoch, timeout_s=5))
        await asyncio.sleep(0.02)
        assert not poll.done()
        await control.report("s2", "raised", "boom")
        assert (await poll).epoch == 1 and "s2" in (await poll).ejected

    asyncio.run(main())


def test_unknown_servers_are_refused_by_name():
    async def main():
        control, _, _, _ = make(FakeServers())
        with pytest.raises(ValueError, match=r"report on unknown rollout server 's9'"):
            await control.report("s9", "raised", "boom")
        with pytest.raises(ValueError, match=r"addresses of unknown rollout servers \['s9'\]"):
            control.set_addresses({"s9": ["tcp://x"]})

    asyncio.run(main())
