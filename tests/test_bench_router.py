"""`raytool bench router`: the simulation completes every request, reports finite ratios, and the CLI's JSON line."""

import json
import math

from raytool.bench import BENCHES
from raytool.bench.router_sim import POLICIES, QUICK, bench, make_trajectories, run, simulate
from raytool.cli import main

KEYS = ("makespan_vs_oracle", "makespan_vs_round_robin", "p99_vs_least_inflight", "prefix_hit_rate", "overhead_us")


def test_every_request_completes_once_and_runs_repeat_exactly():
    turns = sum(len(t[2]) for t in make_trajectories(QUICK, seed=0))
    for policy in POLICIES:
        first = simulate(QUICK, policy, seed=0)
        assert len(first.latencies_s) == turns and min(first.latencies_s) > 0
        assert 0 < first.cached_tokens < first.prompt_tokens
        assert simulate(QUICK, policy, seed=0).makespan_s == first.makespan_s


def test_small_run_has_finite_ratios_and_raytool_beats_round_robin():
    table, result = run(QUICK, seeds=(0,), overhead_calls=2_000)
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in KEYS)
    assert result["makespan_vs_round_robin"] < 1.0
    assert result["prefix_hit_rate"] > result["policies"]["round_robin"]["prefix_hit_rate"]
    assert all(policy in table for policy in POLICIES)


def quick(cfg):
    return bench(cfg, quick=True)


def test_cli_bench_prints_the_result_as_the_last_stdout_line(monkeypatch, capsys):
    monkeypatch.setitem(BENCHES, "router", f"{__name__}:quick")  # a bench is registered by its function's name
    assert main(["bench", "router", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("policy")
    assert set(KEYS) <= json.loads(lines[-1]).keys()
