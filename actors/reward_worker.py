"""RewardWorker: scores a finished trajectory with the configured reward fn."""

from __future__ import annotations

import ray

from raytool.rewards import get_reward_fn, normalize_score


@ray.remote
class RewardWorker:
    def __init__(self, fn_spec: str):
        self.fn_spec = fn_spec
        self.fn = get_reward_fn(fn_spec)

    def score(self, view: dict, ground_truth: str, extra: dict) -> tuple[float, dict]:
        try:
            return normalize_score(self.fn(view, ground_truth, extra))
        except Exception as exc:
            raise RuntimeError(f"reward fn '{self.fn_spec}' failed on ground truth {ground_truth!r}: {exc!r}") from exc
