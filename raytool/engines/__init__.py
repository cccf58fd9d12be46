"""Rollout engines behind one protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from raytool.engines.common import EngineStats
from raytool.types import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from raytool.engines.crash import EngineCrash

ENGINES = ("vllm", "hf", "scripted")


class RolloutEngine(Protocol):
    policy_version: int
    stats: EngineStats  # its counters, and when it last produced tokens (the manager's stall check)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput: ...

    async def bind_weight_receivers(self, host: str) -> list[str]:
        """Open the ZMQ receivers the trainer streams to (one per process that holds weights)."""

    async def receive_weights(self, version: int, timeout_s: float, attempt: int = 0) -> int:
        """Take one weight sync (`attempt` of `version`) into the live engine; returns the number
        of tensors loaded."""

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def abort(self, request_id: str) -> bool: ...

    def engine_stats(self) -> dict: ...

    def dead(self, exc: BaseException | None = None) -> bool:
        """Whether the engine can never serve again in this process (`exc`: what a call raised)."""

    def crash(self) -> EngineCrash | None:
        """The exception the engine died of, where its process recorded one (None: not known, or alive)."""

    def shutdown(self) -> None: ...


def make_engine(name: str, model_path: str, **options) -> RolloutEngine:
    if name == "vllm":
        from raytool.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **options)
    if name == "hf":
        from raytool.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    if name == "scripted":
        from raytool.engines.scripted import ScriptedEngine

        return ScriptedEngine(model_path, **options)
    raise ValueError(f"unknown rollout engine '{name}'; expected one of {list(ENGINES)}")
