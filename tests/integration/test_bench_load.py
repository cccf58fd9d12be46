"""`raytool bench load`: concurrent trajectories through the real graph on the scripted engine
(400 at once here; the bench's default is 1,000)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_load_bench_completes_every_trajectory_once_and_memory_grows_at_most_linearly(ray_cluster, capsys):
    from raytool.cli import main

    # 400 and 100 trajectories here (the bench's default, 1,000 and 250, takes 25 s more of the suite)
    assert main(["bench", "load", "--json", "--trajectories", "400", "model.path=tiny-random", "rollout.scripted_delay_s=0.3", "trainer.num_cpus=0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert "memory_400_vs_100" in "\n".join(lines[:-1])
    for name, count in (("100", 100), ("400", 400)):
        r = result["rounds"][name]
        # every trajectory back exactly once, its two cells right (the second read the first's state)
        assert (r["completed"], r["lost"], r["duplicated"], r["wrong"], r["groups_failed"]) == (count, 0, 0, 0, 0), r
        assert r["engine_s_per_request"] >= 0.3 and r["overhead_ms_per_request"] > 0
    # linear growth is 4.0, quadratic 16; the bench's own goal (1,000 vs 250) is 4.5, but rounds 2.5x
    # smaller leave the allocators' fixed-size noise a larger share (CI measured 4.52 once)
    assert 0 < result["memory_400_vs_100"] <= 6
    assert set(result["actors"]) == {"rollout-server", "llm-manager", "agent-worker", "sandbox-pool", "reward-worker"}


def test_a_judge_ten_times_slower_than_generation_is_kept_busy_with_no_retry_and_no_group_lost(ray_cluster, capsys):
    """`raytool bench load --slow-stage judge`, short: 40 trajectories at once through a scripted
    judge behind the real OpenAI API, one call at a time per reward worker, each call 10x a
    trajectory's generation; reward.call_timeout_s is 3 calls' time, far less than the queue the
    burst builds: no call times out for waiting, no group is retried or lost, and the judge's
    throughput is its capacity (within 20%) while the admission window holds groups back."""
    from raytool.cli import main

    assert main(["bench", "load", "--json", "--slow-stage", "judge", "--trajectories", "40", "model.path=tiny-random",
                 "rollout.scripted_delay_s=0.01", "trainer.num_cpus=0"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["completed"], r["lost"], r["retries"], r["infra_failed"], r["answered"], r["judged_right"]) == (40, 0, 0, 0, 40, 40), r
    assert r["queued_past_the_timeout"] > 0, r  # what a timeout that counted the wait would have failed
    assert r["throughput_vs_capacity"] >= 0.8, r
    assert r["window_cuts"] >= 1 and r["window_end"] < r["window_start"], r  # back-pressure: fewer groups in flight
