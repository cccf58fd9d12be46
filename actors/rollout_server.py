"""RolloutServer: one rollout-engine replica; generate, take weights over ZMQ, sleep/wake, health."""

from __future__ import annotations

import asyncio
import time

import ray

from raytool.device import set_torch_threads
from raytool.engines import make_engine
from raytool.types import SamplingParams, TokenOutput
from raytool.weightsync import WeightReceiver


@ray.remote
class RolloutServer:
    def __init__(self, name: str, model_path: str, engine: str, engine_options: dict, torch_threads: int = 0):
        set_torch_threads(torch_threads)
        self.name = name
        self.engine = make_engine(engine, model_path, **engine_options)
        self.receiver = WeightReceiver(host=ray.util.get_node_ip_address())
        self.requests = 0
        self.started = time.time()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        self.requests += 1
        out = await self.engine.generate(prompt_ids, sampling, request_id)
        out.server = self.name
        return out

    def weight_address(self) -> str:
        return self.receiver.address

    async def receive_weights(self, version: int, timeout_s: float = 300.0) -> dict:
        """Take one weight sync from the trainer (bucket by bucket into the engine); ack with counts."""

        def receive() -> int:
            loaded = 0
            for bucket in self.receiver.receive(version, timeout_s):
                loaded += self.engine.load_weights(bucket)
            return loaded

        start = time.perf_counter()
        loaded = await asyncio.to_thread(receive)
        self.engine.policy_version = version
        return {"server": self.name, "tensors": loaded, "version": version, "seconds": time.perf_counter() - start}

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    def health(self) -> dict:
        return {"server": self.name, "requests": self.requests, "policy_version": self.engine.policy_version, "uptime_s": time.time() - self.started}
