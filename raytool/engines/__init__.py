"""Rollout engines behind one protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

from typing import Iterable, Protocol

from raytool.types import SamplingParams, TokenOutput


class RolloutEngine(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> int: ...

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def abort(self, request_id: str) -> bool: ...


def make_engine(name: str, model_path: str, **options) -> RolloutEngine:
    if name == "hf":
        from raytool.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    raise ValueError(f"unknown rollout engine '{name}'; expected one of ['hf']")
