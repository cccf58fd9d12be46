"""RewardWorker: scores a finished trajectory with the configured reward fn (`raytool.rewards.make_reward_fn`)."""

from __future__ import annotations

import asyncio
import time

import ray

from actors.metrics import RewardMetrics
from raytool.config import RewardConfig
from raytool.overload import queued
from raytool.rewards import RewardError, make_reward_fn


@ray.remote
class RewardWorker:
    """Scores one trajectory at a time, on a thread: the actor's event loop stays free to answer
    heartbeats (actors.drivers.watchdog) while a slow reward fn runs."""

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

    async def score(self, view: dict, ground_truth: str, extra: dict, timeout_s: float) -> tuple[float, dict, tuple[float, float]]:
        """-> (score, metrics, (seconds queued for a slot, seconds scoring)); a failing fn raises a
        one-line RewardError naming it and the data source. `timeout_s` (reward.call_timeout_s)
        bounds the scoring alone, from when the call holds a slot: a call queued behind others is
        not timed out for waiting (raytool.overload)."""
        waited = await queued(self.one_at_a_time)
        start = time.perf_counter()
        try:
            out = await asyncio.wait_for(asyncio.to_thread(self.reward, view, ground_truth, extra), timeout_s)
        except asyncio.TimeoutError:
            raise RewardError(f"no reward within reward.call_timeout_s={timeout_s:g}s of scoring (after {waited:.1f}s queued for a slot)") from None
        finally:
            self.one_at_a_time.release()
        served = time.perf_counter() - start
        self.metrics.scored(served)
        return out[0], out[1], (waited, served)
