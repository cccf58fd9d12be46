"""LLMManager: the router every generate call goes through (policy in raytool.routing.Router).

Failure handling, in order of what a user sees:
- a server that dies, is unreachable, raises, or stalls is ejected, and the request is retried on
  another server (the hung call is cancelled, so no request is answered twice); a request the
  engine rejects as invalid (ValueError) goes back to its caller instead: every server would
  reject it. Stalled means no progress, not a long request: after `stall_timeout_s` without an
  answer the manager asks the server how long its engine has gone without producing a token while
  requests wait on it (`progress()`); a server whose answer is over `stall_timeout_s`, or that
  does not answer within it (a hung or stopped process), is stalled. A long turn on a busy,
  working server is never cut.
- a caller that gives up on a request (an agent loop past `agent.max_trajectory_s`) cancels it,
  and the cancel reaches the server, whose engine frees the request's slot.
- ejected servers are probed in the background (`ready()` then a one-token generate, each under a
  timeout). One that answers on the current policy version is re-admitted; one that answers on an
  older version (Ray restarted its process: fresh engine, base weights) is handed to the next
  weight sync by `weight_targets()` and re-admitted by `synced()` once its weights are current.
- the manager itself is restarted by Ray when its process dies (`cluster.max_actor_restarts`); the
  new one rebuilds its state from the servers on the first call that needs it (`_rebuild`): their
  weight receivers' addresses from `ready()`, the policy version from `health()` (the newest any
  server holds; servers behind it go to the next sync, servers that do not answer are ejected).
  Routing state (in-flight counts, sticky sessions) starts afresh; callers retry once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.common import named
from actors.metrics import ManagerMetrics
from raytool.errors import one_line
from raytool.routing import NoHealthyServer, Router
from raytool.types import SamplingParams, TokenOutput

log = logging.getLogger(__name__)

_PROBE = SamplingParams(max_tokens=1, temperature=0.0)


class _Stalled(Exception):
    """A server made no progress on the requests waiting on it for stall_timeout_s."""


@ray.remote
class LLMManager:
    def __init__(self, servers: dict | list[str], affinity_slack: int = 8, stall_timeout_s: float = 60.0,
                 probe_interval_s: float = 5.0, probe_timeout_s: float = 60.0, no_server_wait_s: float = 600.0, namespace: str | None = None):
        if not isinstance(servers, dict):  # names of RolloutServer actors in `namespace` (see actors.common.named)
            servers = dict(zip(servers, named(servers, namespace)))
        self.servers = servers  # name -> RolloutServer handle
        self.router = Router(list(servers), affinity_slack=affinity_slack)
        self.stall_timeout_s = stall_timeout_s
        self.no_server_wait_s = no_server_wait_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.policy_version = 0
        self.stale: dict[str, list[str]] = {}  # alive again but behind on weights -> its receiver addresses
        self.addresses: dict[str, list[str]] = {}  # server -> weight receiver addresses (set by the driver)
        self.retries = 0
        self.rebuilt = False  # False in a manager Ray restarted, until _rebuild ran (a fresh one gets set_addresses)
        self._probe_task: asyncio.Task | None = None
        self.metrics = ManagerMetrics(lambda: len(self.router.healthy))

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
                self.router.eject(name, f"on policy version {versions[name]}, behind {self.policy_version}")
                self.stale[name] = list(answer[0])
        log.warning("llm manager restarted: state rebuilt from %d servers (policy version %d, %d behind, %d not answering)",
                    len(versions), self.policy_version, len(self.stale), len(names) - len(versions))

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str, session: str | None = None, group: str | None = None
    ) -> TokenOutput:
        """Route one request; on a server failure eject it and retry on another. With no healthy
        server left (the only one was restarted, say) it waits up to no_server_wait_s for one to be
        re-admitted, then raises NoHealthyServer."""
        tried: set[str] = set()
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            try:
                name = self.router.pick(session, group, exclude=tried)
            except NoHealthyServer:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(1.0)
                tried.clear()  # the servers this request failed on were ejected: they can only come back re-admitted
                continue
            start = time.monotonic()
            ref = self.servers[name].generate.remote(prompt_ids, sampling, request_id)
            ok = False
            try:
                out = await self._answer(name, ref)
                ok = True
                return out
            except asyncio.CancelledError:  # the caller gave up: free the engine's slot too
                ray.cancel(ref)
                ok = True  # not the server's failure
                raise
            except _Stalled as exc:
                ray.cancel(ref)
                first = name not in self.router.ejected  # its other requests stall too: one kill for all of them
                self._eject(name, f"request {request_id}: {exc}")
                if first:
                    # A stalled engine does not come back by itself: kill the server's process, Ray
                    # restarts it with a fresh engine, and the next sync re-loads it (handled like a kill).
                    ray.kill(self.servers[name], no_restart=False)
            except RayTaskError as exc:
                if isinstance(exc.cause, ValueError):  # the request itself is invalid: no server would take it
                    raise exc.cause from None
                self._eject(name, one_line(exc))
            except RayActorError as exc:  # died, restarting, or unreachable
                self._eject(name, one_line(exc))
            finally:
                self.router.done(name, ok=ok, latency_s=time.monotonic() - start)
            tried.add(name)
            self.retries += 1
            self.metrics.retried(name)

    async def _answer(self, name: str, ref) -> TokenOutput:
        """The server's answer to `ref`; _Stalled when its engine makes no progress for stall_timeout_s."""
        answer = asyncio.ensure_future(ref)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(answer), self.stall_timeout_s)
            except asyncio.TimeoutError:
                pass  # a long request: is the engine still producing tokens?
            try:
                progress = await asyncio.wait_for(self.servers[name].progress.remote(), self.stall_timeout_s)
            except asyncio.TimeoutError:
                raise _Stalled(f"no answer to a progress probe within {self.stall_timeout_s:g}s (a hung process)") from None
            if progress["idle_s"] > self.stall_timeout_s:
                raise _Stalled(f"its engine produced no token for {progress['idle_s']:.0f}s with {progress['in_flight']} requests "
                               f"waiting (rollout.stall_timeout_s={self.stall_timeout_s:g})")

    def _eject(self, name: str, reason: str) -> None:
        if name not in self.router.ejected:
            log.warning("ejecting rollout server %s: %s", name, reason)
            self.metrics.ejected(name)
        self.router.eject(name, reason)
        self._ensure_probing()

    def _ensure_probing(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while self.router.ejected:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self._probe(name) for name in list(self.router.ejected) if name not in self.stale))

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
            cause = self.router.ejected.get(name, "").split(" (last probe failed: ")[0]
            self.router.ejected[name] = f"{cause} (last probe failed: {one_line(exc)})"
            return
        self.addresses[name] = list(addresses)
        if health["policy_version"] == self.policy_version:
            log.info("re-admitting rollout server %s (policy version %d)", name, self.policy_version)
            self.router.readmit(name)
        else:
            log.info("rollout server %s is back on policy version %d; re-admitted after the next weight sync", name, health["policy_version"])
            self.stale[name] = list(addresses)

    async def weight_targets(self) -> dict:
        """The servers the next weight sync goes to -> their receiver addresses: every healthy one,
        plus the recovered ones waiting for current weights."""
        await self._rebuild()
        targets = {name: self.addresses[name] for name in self.router.healthy}
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
            names = self.router.healthy
            healths = await asyncio.gather(*(asyncio.wait_for(self.servers[n].health.remote(), self.probe_timeout_s) for n in names),
                                           return_exceptions=True)
            for name, health in zip(names, healths):
                if isinstance(health, BaseException):
                    self._eject(name, f"no health answer: {one_line(health)}")
                elif health["policy_version"] != version:
                    self.router.eject(name, f"on policy version {health['policy_version']}, behind {version}")
                    self.stale[name] = self.addresses[name]
        return sorted(self.stale)

    def synced(self, version: int, acked: list[str], failed: dict) -> None:
        """After a weight sync: the new policy version (versions only go up); re-admit recovered
        servers that took it, eject servers that did not."""
        self.policy_version = max(self.policy_version, version)
        for name in acked:
            if self.stale.pop(name, None) is not None:
                log.info("re-admitting rollout server %s after its weight re-sync (v%d)", name, version)
                self.router.readmit(name)
        for name, reason in failed.items():
            self.stale.pop(name, None)
            if name not in self.router.ejected:
                log.warning("ejecting rollout server %s: weight sync v%d failed: %s", name, version, reason)
                self.metrics.ejected(name)
            self.router.eject(name, f"weight sync v{version} failed: {reason}")
        if failed:
            self._ensure_probing()

    async def server_stats(self) -> dict:
        """Each healthy server's own engine stats (in flight, queued, tokens/s, prefix-cache hits)."""
        names = self.router.healthy
        results = await asyncio.gather(*(self.servers[n].stats.remote() for n in names), return_exceptions=True)
        return {n: r if isinstance(r, dict) else {"error": one_line(r)} for n, r in zip(names, results)}

    def end_session(self, session: str) -> None:
        self.router.end_session(session)

    async def stats(self) -> dict:
        await self._rebuild()
        return {**self.router.stats(), "policy_version": self.policy_version, "stale": sorted(self.stale), "retries": self.retries}
