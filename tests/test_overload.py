"""raytool.overload: backoff with jitter, the congestion signal and the admission window (no Ray, milliseconds)."""

import asyncio
import random

from raytool.overload import AdmissionWindow, backoff_s, congested, queued, stage_times, stage_timing


def test_backoff_grows_exponentially_is_capped_and_jittered():
    rng = random.Random(0)
    assert backoff_s(0) == 0.0
    for attempt, full in ((1, 0.5), (2, 1.0), (3, 2.0), (10, 30.0)):
        waits = [backoff_s(attempt, rng=rng) for _ in range(200)]
        assert all(full / 2 <= w <= full for w in waits), (attempt, min(waits), max(waits))
        assert max(waits) - min(waits) > full / 4  # spread out: retries do not come back together
    assert backoff_s(3, base_s=0.2, cap_s=0.5, rng=rng) <= 0.5


def test_a_stage_is_congested_when_its_calls_queue_longer_than_they_are_served():
    slow_judge = [stage_times({"reward_queue_s": 12.0, "reward_s": 1.0}), stage_times({"reward_queue_s": 9.0, "reward_s": 1.0})]
    assert congested(slow_judge) == ("reward", 10.5, 1.0)
    assert congested([stage_times({"reward_queue_s": 1.0, "reward_s": 1.0, "sandbox_queue_s": 0.0, "sandbox_s": 0.2})])[0] == ""
    assert congested([stage_times({"sandbox_queue_s": 0.3, "sandbox_s": 0.001})])[0] == ""  # a burst of quick cells: no signal
    assert congested([stage_times({"total_s": 3.0})])[0] == "" and stage_times({"reward_s": 2.0}) == {"reward": (0.0, 2.0)}
    assert stage_times({"total_s": 3.0, **stage_timing("sandbox", 0.5, 2.0)}) == {"sandbox": (0.5, 2.0)}  # what the agent worker writes


HELD = [{"reward": (5.0, 0.5)}]  # a trajectory that queued 5 s for 0.5 s of scoring
FINE = [{"reward": (0.0, 0.5)}]


def test_the_window_halves_once_per_burst_and_grows_back_one_group_at_a_time(caplog):
    w = AdmissionWindow(16)
    assert w.admit(10, 100) == 6 and w.admit(0, 3) == 3 and w.peak == 16
    w.finished(HELD, 15)
    assert w.limit == 8 and w.bottleneck == "reward" and w.cuts == 1
    for _ in range(7):  # the rest of the burst that was already in flight: no second cut yet
        w.finished(HELD, 8)
    assert w.limit == 8
    w.finished(HELD, 8)
    assert w.limit == 4
    for _ in range(100):
        w.finished(FINE, 4)
    assert w.limit == 16  # never above where it started
    w = AdmissionWindow(256)
    w.finished(HELD, 9)
    assert w.limit == 5  # half of what was in flight, not of a limit nothing reached
    for _ in range(200):
        w.finished([{"sandbox": (9.0, 1.0)}], 0)
    assert w.limit == 1 and w.admit(0, 5) == 1 and w.admit(1, 5) == 0  # never below one group
    said = [r.getMessage() for r in caplog.records if "holds groups up" in r.getMessage()]
    assert len(said) == 3 and "the reward stage holds groups up: their calls queued 5.0 s for 0.5 s" in said[0]  # once per stage per window
    assert "sandbox.num_pools or sandbox.max_concurrency" in said[-1]


def test_queued_measures_the_wait_for_a_slot():
    async def main():
        slots = asyncio.Semaphore(1)
        assert await queued(slots) < 0.05
        asyncio.get_running_loop().call_later(0.2, slots.release)
        waited = await queued(slots)
        slots.release()
        return waited

    assert 0.15 <= asyncio.run(main()) < 2.0
