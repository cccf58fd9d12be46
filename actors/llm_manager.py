"""LLMManager: the actor that holds the rollout servers' control plane (raytool.controlplane: the
policy version, membership, health verdicts, re-admission and each weight sync's plan). Generate
calls do not go through it: each agent-loop worker and gateway routes its own (raytool.dataplane,
actors.dataplane).

Ray restarts it when its process dies (`cluster.max_actor_restarts`). What the control plane cannot
learn back from the servers (the policy version, the sync attempts) it keeps in Ray's GCS key-value
store under the actor's id, which a restart keeps (Ray Serve's controller recovers its state the
same way); the rest is rebuilt from the servers on the first call that needs it.

`generate` routes through a data plane held here: the central layout, kept for callers that hold
only the manager and as `raytool bench scale`'s baseline.
"""

from __future__ import annotations

import asyncio
import warnings

import msgspec
import ray
from ray.experimental import internal_kv

from actors.common import named
from actors.dataplane import RayTransport
from actors.metrics import ManagerMetrics
from raytool.controlplane import ControlPlane, ControlStats, Record, SyncPlan
from raytool.dataplane import DataPlane, FailureKind, Membership
from raytool.errors import one_line
from raytool.types import SamplingParams, TokenOutput

_KV_NAMESPACE = "raytool-control-plane"


class _KeptRecord:
    """The control plane's Record in the GCS key-value store, under this actor's id (kept across its restarts)."""

    def __init__(self):
        self.key = ray.get_runtime_context().get_actor_id().encode()

    def load(self) -> Record:
        data = internal_kv._internal_kv_get(self.key, namespace=_KV_NAMESPACE)
        return msgspec.msgpack.decode(data, type=Record) if data else Record()

    def keep(self, record: Record) -> None:
        internal_kv._internal_kv_put(self.key, msgspec.msgpack.encode(record), overwrite=True, namespace=_KV_NAMESPACE)

    def drop(self) -> None:
        internal_kv._internal_kv_del(self.key, namespace=_KV_NAMESPACE)


@ray.remote
class LLMManager:
    def __init__(self, servers: dict | list[str], affinity_slack: int = 8, stall_timeout_s: float = 60.0,
                 probe_interval_s: float = 5.0, probe_timeout_s: float = 60.0, no_server_wait_s: float = 600.0, namespace: str | None = None):
        if not isinstance(servers, dict):  # names of RolloutServer actors in `namespace` (see actors.common.named)
            servers = dict(zip(servers, named(servers, namespace)))
        self.servers = servers  # name -> RolloutServer handle
        transport = RayTransport(servers)
        self.kept = kept = _KeptRecord()
        with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id` inside
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.plane = DataPlane(list(servers), transport, self._central_report, affinity_slack=affinity_slack,
                               stall_timeout_s=stall_timeout_s, no_server_wait_s=no_server_wait_s, role="llm-manager")
        self.control = ControlPlane(list(servers), transport, stall_timeout_s=stall_timeout_s, probe_interval_s=probe_interval_s,
                                    probe_timeout_s=probe_timeout_s, record=kept.load() if restarted else None, keep=kept.keep,
                                    on_change=self.plane.apply)
        self.control.events = self.metrics = ManagerMetrics(lambda: len(self.control.healthy()))
        self.plane.apply(self.control.snapshot())

    # The control plane's calls (see raytool.controlplane.ControlPlane).

    async def membership(self, incarnation: str = "", epoch: int = -1, timeout_s: float = 30.0) -> Membership:
        return await self.control.membership(incarnation, epoch, timeout_s)

    async def report(self, server: str, kind: FailureKind, cause: str, role: str = "") -> Membership:
        return await self.control.report(server, kind, cause, role)

    async def _central_report(self, server: str, kind: FailureKind, cause: str) -> Membership:
        return await self.control.report(server, kind, cause, "llm-manager")

    def set_addresses(self, addresses: dict) -> None:
        self.control.set_addresses(addresses)

    async def policy_version(self) -> int:
        await self.control.rebuild()
        return self.control.policy_version

    async def plan_sync(self, version: int | None = None, only: list[str] | None = None) -> SyncPlan:
        return await self.control.plan_sync(version, only)

    async def plan_resync(self) -> SyncPlan | None:
        return await self.control.plan_resync()

    def synced(self, version: int, acked: list[str], failed: dict, hung: list[str] = (), sent: int | None = None,
               attestations: dict[str, int] | None = None) -> dict[str, str]:
        return self.control.synced(version, acked, failed, hung, sent, attestations)

    async def stats(self) -> ControlStats:
        await self.control.rebuild()
        return self.control.stats()

    def shutdown(self) -> None:
        """The run is over: its record goes (a restart would have read it back)."""
        self.kept.drop()

    # The central layout, and the servers' own stats.

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       session: str | None = None, group: str | None = None) -> TokenOutput:
        """Route one request from here (the central layout; see raytool.dataplane.DataPlane.generate)."""
        await self.control.rebuild()
        return await self.plane.generate(prompt_ids, sampling, request_id, session, group)

    def end_session(self, session: str) -> None:
        self.plane.end_session(session)

    def central_stats(self) -> dict:
        """The central layout's data plane: its routing counts (requests in flight per server, retries)."""
        return self.plane.stats()

    async def server_stats(self) -> dict:
        """Each healthy server's own engine stats (in flight, queued, tokens/s, prefix-cache hits)."""
        names = self.control.healthy()
        results = await asyncio.gather(*(self.servers[n].stats.remote() for n in names), return_exceptions=True)
        return {n: r if isinstance(r, dict) else {"error": one_line(r)} for n, r in zip(names, results)}
