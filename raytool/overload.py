"""Overload slows a run, never stalls it (no Ray here).

Three rules, each in one place:
- **Timeouts measure service, not waiting.** A stage with a concurrency limit (a reward worker, a
  sandbox pool) starts a call's clock when the call holds a slot; the time it queued before is
  measured apart (`queued`) and reported per stage (`STAGES`: the trajectory's `timings`, then
  `stage/<name>/queue_s` and `stage/<name>/service_s` in the step metrics).
- **Back-pressure from the slowest stage.** `AdmissionWindow` bounds the groups in flight: it
  starts at what the agent workers can run at once and halves when finished groups say a stage
  downstream queued them for longer than it served them (`CONGESTED_RATIO`), then grows by one per
  group that was not held up. Overload shows up as fewer groups in flight, not as timeouts.
- **Retries back off, with jitter** (`backoff_s`), so that retries do not come back all at once
  into the stage that just failed them; the groups' retry budget is the stream's
  (raytool.streaming.GroupRetries).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

# The stages whose queue and service time a trajectory records: `<stage>_queue_s` and `<stage>_s` in
# Trajectory.timings, summed over its calls to the stage.
STAGES = ("reward", "sandbox", "teacher")

CONGESTED_RATIO = 2.0  # a stage queued calls this many times longer than it served them: it is the bottleneck
CONGESTED_MIN_S = 0.5  # ... and a trajectory waited this long for it on average (a burst of quick calls is no signal)
KNOBS = {"reward": "reward.num_workers, or a judge's reward.judge.concurrency", "sandbox": "sandbox.num_pools or sandbox.max_concurrency",
         "teacher": "distill.num_servers"}
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


async def queued(slots: asyncio.Semaphore) -> float:
    """Take a slot of `slots` -> the seconds waited for it (the caller releases the slot)."""
    start = time.perf_counter()
    await slots.acquire()
    return time.perf_counter() - start


def backoff_s(attempt: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S, rng: random.Random | None = None) -> float:
    """The wait before retry number `attempt` (1: the first): exponential, capped, with "equal
    jitter" (half of it fixed, half drawn), so retries spread out but never come back at once."""
    if attempt <= 0:
        return 0.0
    full = min(cap_s, base_s * 2 ** (attempt - 1))
    return full / 2 + (rng or random).uniform(0, full / 2)


def stage_timing(stage: str, queue_s: float, service_s: float) -> dict[str, float]:
    """The entries of Trajectory.timings that record a stage's queue and service seconds (read back by stage_times)."""
    return {f"{stage}_queue_s": queue_s, f"{stage}_s": service_s}


def stage_times(timings: dict) -> dict[str, tuple[float, float]]:
    """{stage: (queue seconds, service seconds)} of one trajectory's timings, for the stages it used."""
    return {s: (timings.get(f"{s}_queue_s", 0.0), timings[f"{s}_s"]) for s in STAGES if f"{s}_s" in timings}


def congested(per_trajectory: Iterable[dict[str, tuple[float, float]]]) -> tuple[str, float, float]:
    """The stage that held a finished group up, with its calls' mean seconds queued and served per
    trajectory (("", 0, 0): none): one where its trajectories, together, waited in the queue more
    than CONGESTED_RATIO times as long as they were served, and each at least CONGESTED_MIN_S on average."""
    total: dict[str, list[float]] = {}
    for times in per_trajectory:
        for stage, (q, s) in times.items():
            acc = total.setdefault(stage, [0.0, 0.0, 0])
            acc[0] += q
            acc[1] += s
            acc[2] += 1
    return next(((stage, q / n, s / n) for stage, (q, s, n) in sorted(total.items()) if q >= CONGESTED_MIN_S * n and q > CONGESTED_RATIO * s),
                ("", 0.0, 0.0))


class AdmissionWindow:
    """How many groups may be in flight at once: `start` at first (what the agent workers run at
    once), cut to half the groups in flight when a finished group was held up by a stage downstream
    (at most once per window's worth of finished groups, so that one burst counts once), one more
    per group that was not, never below 1 nor above `cap`."""

    def __init__(self, start: int, cap: int | None = None):
        self.cap = max(1, cap if cap is not None else start)
        self.limit = max(1, min(start, self.cap))
        self.since_cut = self.limit  # groups finished since the window was last cut (the first hold-up cuts it at once)
        self.cuts = 0
        self.bottleneck = ""  # the stage that cut it last
        self.peak = 0  # the most groups in flight at once
        self.said: set[str] = set()  # stages whose hold-up was logged

    def admit(self, in_flight: int, waiting: int) -> int:
        """How many of `waiting` groups to start now, with `in_flight` running."""
        k = min(waiting, max(0, self.limit - in_flight))
        self.peak = max(self.peak, in_flight + k)
        return k

    def finished(self, stages: list[dict[str, tuple[float, float]]], in_flight: int) -> None:
        """A group finished, `in_flight` still running; `stages`: each of its trajectories' stage
        times (TrajectoryStats.stages; []: none came back). A cut halves what is in flight (a limit
        far above it would hold nothing back); the first cut by a stage is said once, with its figures."""
        self.since_cut += 1
        held_up_by, queue_s, service_s = congested(stages)
        if held_up_by and self.since_cut >= self.limit:
            self.limit, self.since_cut = max(1, min(self.limit, in_flight + 1) // 2), 0
            self.cuts += 1
            if held_up_by not in self.said:
                self.said.add(held_up_by)
                log.warning("the %s stage holds groups up: their calls queued %.1f s for %.1f s of service per trajectory; groups in flight "
                            "cut to %d. It paces the run: more of it (%s) would let more groups run", held_up_by, queue_s, service_s,
                            self.limit, KNOBS.get(held_up_by, "its concurrency"))
            self.bottleneck = held_up_by
        elif not held_up_by:
            self.limit = min(self.cap, self.limit + 1)
