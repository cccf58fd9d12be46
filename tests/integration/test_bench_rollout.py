"""`raytool bench rollout` on the tiny model: the table and its JSON line, with sane values."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.integration


def test_rollout_bench_reports_engine_and_agent_throughput(ray_cluster, capsys):
    from raytool.cli import main

    code = main(["bench", "rollout", "--json", "model.path=tiny-random", "data.prompts_per_step=2", "rollout.n=4",
                 "rollout.max_tokens_per_turn=16", "trainer.num_cpus=0"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert "agent_vs_engine" in "\n".join(lines[:-1])
    assert result["trajectories"] == 8 and result["engine"] == "vllm"
    for key in ("engine_tokens_per_s", "agent_tokens_per_s", "agent_vs_engine", "tool_latency_overhead"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    # Each trajectory waits on 3 tool calls of 100 ms in a row: no run can be shorter than that.
    assert result["tool_makespan_100ms_s"] >= 0.3
