"""Rollout engines behind one protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Protocol

import msgspec
from msgspec import UNSET, UnsetType

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
        of tensors loaded. Before it serves a token of them, the engine checks what it loaded
        against the digests the trainer sent (raytool.weightsync.protocol), raising
        AttestationError naming the first tensor that differs, and keeps the sync's combined digest
        in `attestation`, which its server reports to the control plane."""

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def abort(self, request_id: str) -> bool: ...

    def engine_stats(self) -> dict: ...

    def dead(self, exc: BaseException | None = None) -> bool:
        """Whether the engine can never serve again in this process (`exc`: what a call raised)."""

    def crash(self) -> EngineCrash | None:
        """The exception the engine died of, where its process recorded one (None: not known, or alive)."""

    def shutdown(self) -> None: ...


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Every option a RolloutServer may give its engine, declared: a misspelled one is a TypeError
    where it is built. Each engine takes those it has a parameter for; one left UNSET keeps the
    engine's own default (HF computes in float32 by default, vLLM picks its dtype)."""

    dtype: str | UnsetType = UNSET
    device: str | UnsetType = UNSET  # hf: where the model runs
    max_batch_size: int | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    record_routes: bool | UnsetType = UNSET  # MoE: the experts of each position (router replay r3)
    tensor_parallel_size: int | UnsetType = UNSET  # vllm from here on
    gpu_memory_utilization: float | UnsetType = UNSET
    max_model_len: int | None | UnsetType = UNSET
    cpu_kv_cache_gb: float | UnsetType = UNSET
    cpu_preload: bool | UnsetType = UNSET
    enforce_eager: bool | UnsetType = UNSET
    seeded_requests: bool | UnsetType = UNSET
    partial_rollout: str | UnsetType = UNSET
    start_timeout_s: int | UnsetType = UNSET
    priority_scheduling: bool | UnsetType = UNSET
    delay_s: float | UnsetType = UNSET  # scripted from here on
    crash_with: str | None | UnsetType = UNSET


def make_engine(name: str, model_path: str, options: EngineOptions | None = None) -> RolloutEngine:
    """Engine `name` on `model_path`, given the options it takes of `options` (those set)."""
    if name == "vllm":
        from raytool.engines.vllm_engine import VLLMEngine as engine
    elif name == "hf":
        from raytool.engines.hf import HFEngine as engine
    elif name == "scripted":
        from raytool.engines.scripted import ScriptedEngine as engine
    else:
        raise ValueError(f"unknown rollout engine '{name}'; expected one of {list(ENGINES)}")
    takes = inspect.signature(engine).parameters
    given = {field: value for field, value in msgspec.structs.asdict(options or EngineOptions()).items()
             if value is not UNSET and field in takes}
    return engine(model_path, **given)
