"""LLMManager: the control plane of the rollout servers. Generate calls do not go through it: each
agent-loop worker and gateway routes its own (raytool.dataplane, actors.dataplane).

It owns, and nobody else holds a copy they act on:
- **membership**: which servers serve and why the others do not, as numbered `Membership`
  snapshots the data planes long-poll (`membership`) and get back from their reports;
- **the policy version** and which servers are behind it (`stale`: restarted or failed a sync);
- **health**: a data plane that saw a server fail reports it (`report`); the manager confirms it
  before every plane drops the server: an error the server raised is its own word; a server said to
  have died or be unreachable is ejected when it does not answer a health probe within
  `stall_timeout_s` or answers on an older policy version (Ray restarted it); a stalled one when its
  own progress report agrees, and it is then killed (Ray restarts it with a fresh engine, handled
  like a kill). A server that answers well stays in, and the reporting plane takes it back.
- **re-admission**: ejected servers are probed in the background (`ready()` then a one-token
  generate, each under a timeout). One on the current policy version is re-admitted; one on an
  older version is handed to the next weight sync by `weight_targets()` and re-admitted by
  `synced()` once its weights are current.
- the manager itself is restarted by Ray when its process dies (`cluster.max_actor_restarts`); the
  new one rebuilds its state from the servers on the first call that needs it (`_rebuild`): their
  weight receivers' addresses from `ready()`, the policy version from `health()` (the newest any
  server holds; servers behind it go to the next sync, servers that do not answer are ejected).
  Data planes keep serving on their last membership meanwhile, and take the new one's snapshots
  (a new `incarnation`) when it is back.

`generate` routes through a data plane held here: the central layout, kept for callers that hold
only the manager and as `raytool bench scale`'s baseline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.common import named
from actors.dataplane import RayTransport
from actors.metrics import ManagerMetrics
from raytool.dataplane import DataPlane, FailureKind, Membership
from raytool.errors import one_line
from raytool.types import SamplingParams, TokenOutput

log = logging.getLogger(__name__)

_PROBE = SamplingParams(max_tokens=1, temperature=0.0)


@ray.remote
class LLMManager:
    def __init__(self, servers: dict | list[str], affinity_slack: int = 8, stall_timeout_s: float = 60.0,
                 probe_interval_s: float = 5.0, probe_timeout_s: float = 60.0, no_server_wait_s: float = 600.0, namespace: str | None = None):
        if not isinstance(servers, dict):  # names of RolloutServer actors in `namespace` (see actors.common.named)
            servers = dict(zip(servers, named(servers, namespace)))
        self.servers = servers  # name -> RolloutServer handle
        self.ejected: dict[str, str] = {}  # server -> why it is out of rotation
        self.probe_failures: dict[str, str] = {}  # ejected server -> what its latest probe got
        self.stall_timeout_s = stall_timeout_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.policy_version = 0
        self.stale: dict[str, list[str]] = {}  # alive again but behind on weights -> its receiver addresses
        self.addresses: dict[str, list[str]] = {}  # server -> weight receiver addresses (set by the driver)
        self.retries = 0  # calls the data planes retried elsewhere (one per report)
        self.incarnation = uuid.uuid4().hex[:8]
        self.epoch = 0
        self._changed = asyncio.Event()  # set (and replaced) on every membership change
        self._confirming: dict[str, asyncio.Task] = {}  # server -> the check of a report on it
        self._probe_task: asyncio.Task | None = None
        # A manager Ray restarted rebuilds its state from the servers; a fresh one is told by the driver.
        with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id` inside
            warnings.simplefilter("ignore", DeprecationWarning)
            self.rebuilt = not ray.get_runtime_context().was_current_actor_reconstructed
        self.metrics = ManagerMetrics(lambda: len(self.servers) - len(self.ejected))
        self.plane = DataPlane(list(servers), RayTransport(servers), self._central_report, affinity_slack=affinity_slack,
                               stall_timeout_s=stall_timeout_s, no_server_wait_s=no_server_wait_s, role="llm-manager")
        self.plane.apply(self._snapshot())

    # -- membership -------------------------------------------------------------------------------

    def _snapshot(self) -> Membership:
        return Membership(self.incarnation, self.epoch, list(self.servers), self._reasons(), self.policy_version)

    def _reasons(self) -> dict[str, str]:
        """Why each ejected server is out: its ejection's cause, with its latest probe's answer."""
        return {name: cause + (f" (last probe failed: {self.probe_failures[name]})" if name in self.probe_failures else "")
                for name, cause in self.ejected.items()}

    def _changed_now(self) -> None:
        self.epoch += 1
        self.plane.apply(self._snapshot())
        self._changed.set()
        self._changed = asyncio.Event()

    async def membership(self, incarnation: str = "", epoch: int = -1, timeout_s: float = 30.0) -> Membership:
        """The current snapshot: at once when the caller's (incarnation, epoch) is not it, else on
        the next change or after timeout_s (a long poll)."""
        await self._rebuild()
        if incarnation == self.incarnation and epoch == self.epoch:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._snapshot()

    def set_addresses(self, addresses: dict) -> None:
        self.addresses.update(addresses)
        self.rebuilt = True

    async def _rebuild(self) -> None:
        """After a restart: the servers' addresses and the policy version, from the servers themselves."""
        if self.rebuilt:
            return
        self.rebuilt = True
        names = list(self.servers)

        async def ask(name: str):
            server = self.servers[name]
            addresses = await asyncio.wait_for(server.ready.remote(), self.probe_timeout_s)
            return addresses, (await asyncio.wait_for(server.health.remote(), self.probe_timeout_s))["policy_version"]

        answers = await asyncio.gather(*(ask(name) for name in names), return_exceptions=True)
        versions = {name: a[1] for name, a in zip(names, answers) if not isinstance(a, BaseException)}
        self.policy_version = max(versions.values(), default=0)
        for name, answer in zip(names, answers):
            if isinstance(answer, BaseException):
                self._eject(name, f"no answer after the manager restarted: {one_line(answer)}")
                continue
            self.addresses[name] = list(answer[0])
            if versions[name] != self.policy_version:
                self._eject(name, f"on policy version {versions[name]}, behind {self.policy_version}", probe=False)
                self.stale[name] = list(answer[0])
        self._changed_now()
        log.warning("llm manager restarted: state rebuilt from %d servers (policy version %d, %d behind, %d not answering)",
                    len(versions), self.policy_version, len(self.stale), len(names) - len(versions))

    # -- health -----------------------------------------------------------------------------------

    async def report(self, server: str, kind: FailureKind, cause: str, role: str = "") -> Membership:
        """A data plane saw `server` fail a call (and retried it elsewhere): confirm, decide, and
        answer with the membership decided."""
        await self._rebuild()
        if server not in self.servers:
            raise ValueError(f"report on unknown rollout server {server!r} (known: {sorted(self.servers)})")
        self.retries += 1
        self.metrics.retried(server)
        if server not in self.ejected:
            if server not in self._confirming:
                self._confirming[server] = asyncio.get_running_loop().create_task(self._confirm(server, kind, cause, role))
            task = self._confirming[server]
            try:
                await asyncio.shield(task)
            finally:
                if task.done():
                    self._confirming.pop(server, None)
        return self._snapshot()

    async def _central_report(self, server: str, kind: FailureKind, cause: str) -> Membership:
        return await self.report(server, kind, cause, "llm-manager")

    async def _confirm(self, server: str, kind: FailureKind, cause: str, role: str) -> None:
        why = f"{kind}: {cause}" + (f" (seen by {role})" if role else "")
        handle = self.servers[server]
        if kind == "raised":  # the server's own answer
            self._eject(server, why)
            return
        try:
            if kind == "stalled":
                progress = await asyncio.wait_for(handle.progress.remote(), self.stall_timeout_s)
                confirmed = progress["idle_s"] > self.stall_timeout_s
            else:
                health = await asyncio.wait_for(handle.health.remote(), self.stall_timeout_s)
                confirmed = health["policy_version"] != self.policy_version
                if confirmed:
                    why += f"; back on policy version {health['policy_version']}, behind {self.policy_version}"
        except (asyncio.TimeoutError, GetTimeoutError, RayTaskError, RayActorError) as exc:
            confirmed = True
            why += f"; confirmed: {one_line(exc) if not isinstance(exc, asyncio.TimeoutError) else f'no answer within {self.stall_timeout_s:g}s'}"
        if not confirmed:
            log.info("rollout server %s reported %s, but it answers on the current policy version: kept in rotation", server, why)
            return
        self._eject(server, why)
        if kind == "stalled":
            # A stalled engine does not come back by itself: kill the server's process, Ray restarts
            # it with a fresh engine, and the next sync re-loads it (handled like a kill).
            ray.kill(handle, no_restart=False)

    def _eject(self, name: str, reason: str, probe: bool = True) -> None:
        """Out of every plane's rotation. An already ejected server keeps its first reason: later
        failures (its other requests failing while it restarts) are consequences, not the cause."""
        if name not in self.ejected:
            log.warning("ejecting rollout server %s: %s", name, reason)
            self.metrics.ejected(name)
            self.ejected[name] = reason
            self._changed_now()
        if probe:
            self._ensure_probing()

    def _readmit(self, name: str) -> None:
        self.probe_failures.pop(name, None)
        if self.ejected.pop(name, None) is not None:
            self._changed_now()

    def _ensure_probing(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while self.ejected:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self._probe(name) for name in list(self.ejected) if name not in self.stale))

    async def _probe(self, name: str) -> None:
        """Re-admit an ejected server that answers on the current weights; hand one on other weights
        (a restarted engine's base weights, or a load that failed half-way) to the next weight sync."""
        server = self.servers[name]
        try:
            addresses = await asyncio.wait_for(server.ready.remote(), self.probe_timeout_s)
            health = await asyncio.wait_for(server.health.remote(), self.probe_timeout_s)
            if health["policy_version"] == self.policy_version:
                await asyncio.wait_for(server.generate.remote([0], _PROBE, f"probe-{name}-{time.monotonic_ns()}"), self.probe_timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError):
            return  # still restarting or still hung: try again later
        except (RayTaskError, RayActorError) as exc:  # keep why it was ejected, with the latest probe's answer
            self.probe_failures[name] = one_line(exc)
            return
        self.addresses[name] = list(addresses)
        if health["policy_version"] == self.policy_version:
            log.info("re-admitting rollout server %s (policy version %d)", name, self.policy_version)
            self._readmit(name)
        else:
            log.info("rollout server %s is back on policy version %d; re-admitted after the next weight sync", name, health["policy_version"])
            self.stale[name] = list(addresses)

    # -- weight syncs -----------------------------------------------------------------------------

    async def weight_targets(self) -> dict:
        """The servers the next weight sync goes to -> their receiver addresses: every healthy one,
        plus the recovered ones waiting for current weights."""
        await self._rebuild()
        targets = {name: self.addresses[name] for name in self.servers if name not in self.ejected}
        targets.update(self.stale)
        return targets

    async def expect_version(self, version: int) -> list[str]:
        """The driver's word on the version every server should hold (the trainer's): a manager that
        Ray restarted together with its servers cannot learn it from them. Healthy servers found
        behind it are taken out and handed to the next sync -> the servers waiting for one."""
        await self._rebuild()
        if version > self.policy_version:
            log.warning("llm manager: the trainer is on policy version %d, not %d: checking every server's version", version, self.policy_version)
            self.policy_version = version
            self._changed_now()
            names = [n for n in self.servers if n not in self.ejected]
            healths = await asyncio.gather(*(asyncio.wait_for(self.servers[n].health.remote(), self.probe_timeout_s) for n in names),
                                           return_exceptions=True)
            for name, health in zip(names, healths):
                if isinstance(health, BaseException):
                    self._eject(name, f"no health answer: {one_line(health)}")
                elif health["policy_version"] != version:
                    self._eject(name, f"on policy version {health['policy_version']}, behind {version}", probe=False)
                    self.stale[name] = self.addresses[name]
        return sorted(self.stale)

    def synced(self, version: int, acked: list[str], failed: dict) -> None:
        """After a weight sync: the new policy version (versions only go up); re-admit recovered
        servers that took it, eject servers that did not."""
        if version > self.policy_version:
            self.policy_version = version
            self._changed_now()
        for name in acked:
            if self.stale.pop(name, None) is not None:
                log.info("re-admitting rollout server %s after its weight re-sync (v%d)", name, version)
                self._readmit(name)
        for name, reason in failed.items():
            self.stale.pop(name, None)
            self._eject(name, f"weight sync v{version} failed: {reason}", probe=False)
        if failed:
            self._ensure_probing()

    # -- the central layout, stats ----------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       session: str | None = None, group: str | None = None) -> TokenOutput:
        """Route one request from here (the central layout; see raytool.dataplane.DataPlane.generate)."""
        await self._rebuild()
        return await self.plane.generate(prompt_ids, sampling, request_id, session, group)

    def end_session(self, session: str) -> None:
        self.plane.end_session(session)

    async def server_stats(self) -> dict:
        """Each healthy server's own engine stats (in flight, queued, tokens/s, prefix-cache hits)."""
        names = [n for n in self.servers if n not in self.ejected]
        results = await asyncio.gather(*(self.servers[n].stats.remote() for n in names), return_exceptions=True)
        return {n: r if isinstance(r, dict) else {"error": one_line(r)} for n, r in zip(names, results)}

    async def stats(self) -> dict:
        await self._rebuild()
        return {"servers": list(self.servers), "healthy": [n for n in self.servers if n not in self.ejected], "ejected": self._reasons(),
                "policy_version": self.policy_version, "stale": sorted(self.stale), "retries": self.retries,
                "membership": f"{self.incarnation}/{self.epoch}", "central": self.plane.stats()}
