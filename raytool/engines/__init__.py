"""Rollout engines behind one protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from raytool.types import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from raytool.engines.crash import EngineCrash

ENGINES = ("vllm", "hf", "scripted")
INCOMPLETE = -1  # the policy version of an engine whose last weight load failed half-way


def check_weights_complete(policy_version: int) -> None:
    """Refuse to serve from weights a failed load left half old, half new."""
    if policy_version == INCOMPLETE:
        raise RuntimeError("this engine's last weight load failed half-way: it serves nothing until a weight sync completes")


class EngineStats:
    """What an engine reports about itself: requests, generated tokens and throughput (counted by
    generate), queue sizes and prefix-cache counts (vLLM's stat-logger hook fills those)."""

    def __init__(self):
        self.running = 0
        self.waiting = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.generated_tokens = 0
        self.requests = 0
        self.first_request: float | None = None  # throughput counts from the first request on
        self.progress_at = time.monotonic()  # when the engine last produced tokens (a step, or a batch)

    def request_started(self) -> None:
        self.requests += 1
        self.first_request = self.first_request or time.monotonic()

    def progressed(self) -> None:
        self.progress_at = time.monotonic()

    def as_dict(self) -> dict:
        elapsed = time.monotonic() - self.first_request if self.first_request else 0.0
        return {
            "running": self.running,
            "waiting": self.waiting,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / elapsed if elapsed else 0.0,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
        }


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
