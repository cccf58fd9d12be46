"""`raytool bench pipeline` on the tiny model: every mode runs, and the result's ratios are the
ones its table states."""

from __future__ import annotations

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration


def test_pipeline_bench_times_sync_and_async_modes_on_one_graph(ray_cluster):
    from actors.benches.pipeline import MODES, bench

    cfg = load_config(None, ["model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "trainer.sft_warmup_steps=1", "rollout.n=2", "data.prompts_per_step=2",
                             "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=48", "rollout.engine=hf", "async.partial_rollout=wait"])
    table, result = bench(cfg, steps=1, repeats=1)
    modes = result["modes"]
    assert set(modes) == {str(k) for k in MODES}
    best = modes[str(result["best_max_staleness"])]
    assert result["async_vs_sync"] == pytest.approx(best["step_s"] / modes["0"]["step_s"])
    assert result["async_vs_ideal"] == pytest.approx(result["ideal_step_s"] / best["step_s"])
    assert result["ideal_step_s"] == pytest.approx(max(modes["0"]["wait_s"], modes["0"]["train_s"] + modes["0"]["sync_s"]))
    for k in MODES:
        assert modes[str(k)]["staleness_token_max"] <= k
    assert modes["0"]["staleness_token_mean"] == 0 and result["tool_latency"] == {"median_s": 0.3, "p95_s": 2.0}
    assert "async_vs_sync" in table.splitlines()[-1] and table.splitlines()[2].startswith("sync")
