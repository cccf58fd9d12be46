"""RewardWorker: scores a finished trajectory with the configured reward fn (`raytool.rewards.make_reward_fn`)."""

from __future__ import annotations

import time

import ray

from actors.metrics import RewardMetrics
from raytool.config import RewardConfig
from raytool.rewards import make_reward_fn


@ray.remote
class RewardWorker:
    def __init__(self, cfg: RewardConfig):
        self.reward = make_reward_fn(cfg)
        self.metrics = RewardMetrics(cfg.fn)

    def score(self, view: dict, ground_truth: str, extra: dict) -> tuple[float, dict]:
        """-> (score, metrics); a failing fn raises a one-line RewardError naming it and the data source."""
        start = time.perf_counter()
        out = self.reward(view, ground_truth, extra)
        self.metrics.scored(time.perf_counter() - start)
        return out
