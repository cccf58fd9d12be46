"""RewardWorker: scores a finished trajectory with the configured reward fn (`raytool.rewards.make_reward_fn`)."""

from __future__ import annotations

import ray

from raytool.config import RewardConfig
from raytool.rewards import make_reward_fn


@ray.remote
class RewardWorker:
    def __init__(self, cfg: RewardConfig):
        self.reward = make_reward_fn(cfg)

    def score(self, view: dict, ground_truth: str, extra: dict) -> tuple[float, dict]:
        """-> (score, metrics); a failing fn raises a one-line RewardError naming it and the data source."""
        return self.reward(view, ground_truth, extra)
