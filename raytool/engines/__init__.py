"""Rollout engines behind one protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

from typing import Protocol

from raytool.types import SamplingParams, TokenOutput

ENGINES = ("vllm", "hf")


class RolloutEngine(Protocol):
    policy_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput: ...

    async def bind_weight_receivers(self, host: str) -> list[str]:
        """Open the ZMQ receivers the trainer streams to (one per process that holds weights)."""

    async def receive_weights(self, version: int, timeout_s: float) -> int:
        """Take one weight sync into the live engine; returns the number of tensors loaded."""

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def abort(self, request_id: str) -> bool: ...

    def engine_stats(self) -> dict: ...

    def shutdown(self) -> None: ...


def make_engine(name: str, model_path: str, **options) -> RolloutEngine:
    if name == "vllm":
        from raytool.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **options)
    if name == "hf":
        from raytool.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    raise ValueError(f"unknown rollout engine '{name}'; expected one of {list(ENGINES)}")
