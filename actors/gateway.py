"""GatewayActor: raytool.agent.gateway's OpenAI-compatible HTTP API as a Ray actor over the rollout
servers (its own data plane, raytool.dataplane), for agents that run outside raytool (`raytool serve`, or `agent.gateway: true` beside a
run). Its URL is `http://<node>:<port>`; `open` gives a trajectory's own URL, recorded token-exactly,
and `finish` returns what it recorded. Ray restarts a gateway that died (cluster.max_actor_restarts)
and it serves again; its open trajectories are lost (their URLs answer 404), and with port 0 it
comes back on another port, so set agent.gateway_port for a URL that outlives a restart."""

from __future__ import annotations

import asyncio
import logging

import ray

from actors.common import named
from actors.dataplane import data_plane, follow
from raytool.agent.gateway import Gateway
from raytool.agent.render import ChatRenderer
from raytool.config import RunConfig
from raytool.models import load_tokenizer
from raytool.types import Trajectory

log = logging.getLogger(__name__)


@ray.remote
class GatewayActor:
    def __init__(self, model_path: str, manager, servers: list[str], cfg: RunConfig, namespace: str | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        """`manager`: the control plane (handle or name in `namespace`); `servers`: the rollout
        servers' names, which the gateway's own data plane calls directly."""
        self.manager = named(manager, namespace)
        self.plane = data_plane(dict(zip(servers, named(servers, namespace))), self.manager, cfg.rollout, "gateway")
        self._following = asyncio.get_running_loop().create_task(follow(self.plane, self.manager))
        self.host, self.port = host, port
        r = cfg.rollout
        renderer = ChatRenderer(load_tokenizer(model_path), template_kwargs=cfg.agent.chat_template_kwargs)
        self.gateway = Gateway(renderer, self._generate, model_name=cfg.model.path, max_model_len=r.max_model_len,
                               defaults=r.sampling(),
                               template_kwargs=cfg.agent.chat_template_kwargs, tool_format=cfg.agent.format)
        self.cfg = cfg
        # Serving starts here, in the actor's event loop (Ray runs an async actor's constructor
        # there), so an actor Ray restarts serves again at once, on the same port when it is fixed.
        self._serving = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> str:
        url = await self.gateway.start(self.host, self.port)
        if self.host == "0.0.0.0":
            url = url.replace("0.0.0.0", ray.util.get_node_ip_address())
        self.gateway.url = url
        log.info("OpenAI-compatible gateway at %s/v1 (model %r)", url, self.gateway.model_name)
        return url

    async def _generate(self, prompt_ids, sampling, request_id, session):
        return await self.plane.generate(prompt_ids, sampling, request_id, session, session)

    async def start(self) -> str:
        """The base URL once serving (the node's address when listening on every interface)."""
        return await asyncio.shield(self._serving)

    def open(self, session: str) -> str:
        """A new trajectory's base URL (`.../traj/<key>/v1`)."""
        a = self.cfg.agent
        path = self.gateway.open(session, self._generate, seed=self.cfg.rollout.seed, max_response_tokens=a.max_response_tokens,
                                 on_history_rewrite=a.on_history_rewrite)
        return self.gateway.url + path

    def finish(self, url: str, uid: str, group_id: str, ground_truth: str, answer: str | None = None) -> Trajectory:
        return self.gateway.finish(url.removeprefix(self.gateway.url), uid, group_id, ground_truth, answer)

    def latencies(self) -> list[float]:
        return list(self.gateway.latencies)

    async def shutdown(self) -> None:
        await self.gateway.stop()
