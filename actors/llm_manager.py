"""LLMManager: the router every generate call goes through (policy in raytool.routing.Router)."""

from __future__ import annotations

import logging

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from raytool.routing import Router
from raytool.types import SamplingParams, TokenOutput

log = logging.getLogger(__name__)


@ray.remote
class LLMManager:
    def __init__(self, servers: dict, affinity_slack: int = 4):
        self.servers = servers  # name -> RolloutServer handle
        self.router = Router(list(servers), affinity_slack=affinity_slack)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str, session: str | None = None, group: str | None = None
    ) -> TokenOutput:
        """Route one request; a server whose actor died is ejected and the request retried elsewhere."""
        while True:
            name = self.router.pick(session, group)
            try:
                return await self.servers[name].generate.remote(prompt_ids, sampling, request_id)
            except (ActorDiedError, ActorUnavailableError) as exc:
                log.warning("ejecting rollout server %s: %s", name, exc)
                self.router.eject(name, f"{type(exc).__name__}: {exc}")
            finally:
                self.router.done(name)

    def end_session(self, session: str) -> None:
        self.router.end_session(session)

    def stats(self) -> dict:
        return self.router.stats()
