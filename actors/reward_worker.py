"""RewardWorker: scores a finished trajectory with the configured reward fn (`raytool.rewards.make_reward_fn`)."""

from __future__ import annotations

import asyncio
import time

import ray

from actors.metrics import RewardMetrics
from raytool.config import RewardConfig
from raytool.rewards import make_reward_fn


@ray.remote
class RewardWorker:
    """Scores one trajectory at a time, on a thread: the actor's event loop stays free to answer
    heartbeats (actors.watchdog) while a slow reward fn runs."""

    def __init__(self, cfg: RewardConfig, namespace: str | None = None):
        self.namespace = namespace  # the run's: where its gateway is, for a judge that is the run's own model
        self.reward = make_reward_fn(cfg, own_api=self._own_api)
        self.metrics = RewardMetrics(cfg.fn)
        # A user's reward fn need not be thread-safe: one call at a time, unless the fn says it takes more (an LLM judge).
        self.one_at_a_time = asyncio.Semaphore(self.reward.concurrency)

    def _own_api(self) -> str:
        """The run's gateway's OpenAI API (reward.judge.base_url self); called on a scoring thread."""
        gateway = ray.get_actor("gateway", namespace=self.namespace)
        return ray.get(gateway.start.remote(), timeout=60) + "/v1"

    async def score(self, view: dict, ground_truth: str, extra: dict) -> tuple[float, dict]:
        """-> (score, metrics); a failing fn raises a one-line RewardError naming it and the data source."""
        async with self.one_at_a_time:
            start = time.perf_counter()
            out = await asyncio.to_thread(self.reward, view, ground_truth, extra)
        self.metrics.scored(time.perf_counter() - start)
        return out
