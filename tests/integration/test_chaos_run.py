"""`raytool chaos` as a CI test: a short run (the HF engine, tiny model) in which each actor kind is hit
once (but the vLLM engine core, which tests/integration/test_end_to_end.py's weight-sync test kills), one fault per step (killed, or stopped and found by the heartbeat), and the run's checks
hold: every step logged once, versions going up one per step, the ledger reconciling, no actor of
the run left. The long soak is the README's `raytool chaos` run."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STEPS = 20


def test_a_short_chaos_run_hits_every_actor_kind_once_and_loses_nothing(ray_cluster, tmp_path):
    from actors.chaos import run_chaos, table
    from raytool.chaos import KINDS

    kinds = sorted(set(KINDS) - {"engine"})  # the HF engine has no engine core process: its kill is the weight-sync test's
    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", [
        "model.path=tiny-random", "rollout.engine=hf", "eval.before_train=false", "eval.after_train=false", f"trainer.total_steps={STEPS}",
        "trainer.sft_warmup_steps=1", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=24", "agent.max_response_tokens=64",
        "rollout.seed=7", "cluster.heartbeat_s=5", "trainer.save_final=false", "trainer.save_every=4", "logging.logger=[]", "logging.progress=false",
    ])
    report = run_chaos(cfg, tmp_path / "chaos", kinds, every_s=1.0, hang=True, seed=0, per_step=True, max_faults=len(kinds))
    assert report["ok"], table(report)
    assert report["by_kind"] == {kind: 1 for kind in kinds} and report["stopped"] >= 1, table(report)
    assert report["steps"] == STEPS and report["lost"] == 0 and report["ledger"]["trained"] == STEPS * 2 - report["groups_failed"], table(report)
