"""A mixture of experts end to end on the CPU: tiny-random-moe (Qwen3-MoE) rolled out on the HF
engine with rollout router replay (r3: the engine returns each token's experts, the trainer
replays them), trained two GRPO steps, its weights synced to the engine after each (the engine's
log-probs then match the trainer's) and exported in the checkpoint's per-expert layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_a_tiny_moe_run_trains_syncs_and_exports(ray_cluster, tmp_path, logprob_tolerance):
    from safetensors import safe_open

    from actors.drivers.pipeline import run

    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", [
        "model.path=tiny-random-moe", "rollout.engine=hf", "trainer.router_replay=r3", "trainer.total_steps=2", "trainer.sft_warmup_steps=0", "eval.before_train=false",
        "eval.after_train=false", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=48",
        "rollout.seed=3", "algorithm.entropy_coeff=0.001", "logging.logger=[]", "logging.progress=false"])
    run_dir = run(cfg, tmp_path / "moe")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and [m["policy_version"] for m in steps] == [1, 2]
    assert all(m["rollout/logprob_abs_diff"] < logprob_tolerance for m in steps)  # the engine serves the trainer's experts
    # Every trajectory came with complete routes through Ray and was replayed; the metrics say how far apart they were.
    assert all(m["router/replayed_seq_frac"] == 1.0 and 0.0 <= m["router/replay_differs_frac"] < 0.5 for m in steps), steps
    assert all(m["router/logprob_abs_diff_without_replay"] < logprob_tolerance and m["router/logprob_abs_diff_with_replay"] < logprob_tolerance
               and m["moe/load_imbalance"] >= 1.0 for m in steps)
    traced = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert traced and all(t["routes"]["layers"] == 2 and t["routes"]["top_k"] == 2 for t in traced)
    with safe_open(str(run_dir / "checkpoints" / "step_2" / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and not any(n.endswith("experts.gate_up_proj") for n in names)
