"""The data plane's Ray side: the transport that calls RolloutServer actors, and the task that keeps
a plane's membership current from the control plane (actors.llm_manager). See raytool.dataplane."""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from raytool.config import RolloutConfig
from raytool.dataplane import DataPlane, InvalidRequest, ServerFailed
from raytool.errors import one_line
from raytool.types import PromptScores, SamplingParams, ServerHealth, ServerProgress, TokenOutput

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 30.0  # how long one long-poll for a membership change waits at the control plane
CONTROL_RETRY_S = 1.0  # between tries while the control plane cannot be reached


_PROBE = SamplingParams(max_tokens=1, temperature=0.0)


class RayTransport:
    """The calls to RolloutServer actor handles, their failures typed: the data plane's
    (raytool.dataplane.Transport) and the control plane's (raytool.controlplane.Servers)."""

    def __init__(self, servers: dict):
        self.servers = servers  # name -> RolloutServer handle

    async def generate(self, server: str, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        return await self._request(server, self.servers[server].generate.remote(prompt_ids, sampling, request_id))

    async def score(self, server: str, ids: list[int], request_id: str) -> PromptScores:
        return await self._request(server, self.servers[server].score.remote(ids, request_id))

    @staticmethod
    async def _request(server: str, ref):
        try:
            return await ref
        except asyncio.CancelledError:  # the caller gave up or the call stalled: free the engine's slot too
            ray.cancel(ref)
            raise
        except RayTaskError as exc:
            if isinstance(exc.cause, ValueError):  # the request itself is invalid: no server would take it
                raise InvalidRequest(str(exc.cause)) from None
            raise ServerFailed(server, "raised", one_line(exc)) from None
        except RayActorError as exc:  # died, restarting, or unreachable
            raise ServerFailed(server, "died", one_line(exc)) from None

    async def _call(self, server: str, method: str, *args):
        try:
            return await getattr(self.servers[server], method).remote(*args)
        except (RayTaskError, RayActorError) as exc:
            raise ServerFailed(server, "unreachable", one_line(exc)) from None

    async def progress(self, server: str) -> ServerProgress:
        return await self._call(server, "progress")

    # The control plane's calls too (raytool.controlplane.Servers).

    async def ready(self, server: str) -> list[str]:
        return await self._call(server, "ready")

    async def health(self, server: str) -> ServerHealth:
        return await self._call(server, "health")

    async def probe(self, server: str) -> None:
        await self._call(server, "generate", [0], _PROBE, f"probe-{server}-{time.monotonic_ns()}")

    def restart(self, server: str) -> None:
        ray.kill(self.servers[server], no_restart=False)


def data_plane(servers: dict, control, rollout: RolloutConfig, role: str) -> DataPlane:
    """A DataPlane over `servers` (name -> handle) that reports failures to `control` (the LLMManager
    actor). Call `follow(plane, control)` from the holder's event loop to keep its membership current."""

    async def report(server: str, kind: str, cause: str):
        return await control.report.remote(server, kind, cause, role)

    return DataPlane(list(servers), RayTransport(servers), report, affinity_slack=rollout.affinity_slack,
                     stall_timeout_s=rollout.stall_timeout_s, no_server_wait_s=rollout.engine_start_timeout_s, role=role)


async def follow(plane: DataPlane, control) -> None:
    """Long-poll the control plane for membership changes, forever. While it cannot be reached, the
    plane keeps serving on its last membership (said once, and once when it is back)."""
    away = False
    while True:
        m = plane.membership
        try:
            update = await control.membership.remote(m.incarnation if m else "", m.epoch if m else -1, MEMBERSHIP_POLL_S)
        except Exception as exc:  # restarting (calls fail at once meanwhile), or gone
            if not away:
                log.warning("%s: the control plane cannot be reached (%s); serving on membership epoch %s meanwhile",
                            plane.role, one_line(exc), m.epoch if m else "none (every server)")
                away = True
            await asyncio.sleep(CONTROL_RETRY_S)
            continue
        if away:
            log.info("%s: the control plane is back (membership %s/%d)", plane.role, update.incarnation, update.epoch)
            away = False
        if not plane.apply(update):  # unchanged after the poll's timeout, or refused (logged): not a hot loop
            await asyncio.sleep(CONTROL_RETRY_S)
