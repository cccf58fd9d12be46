"""The ReTool cold start end to end: `raytool sft` on conversations with tool calls, `raytool
export` of its checkpoint, then GRPO (with LoRA: the engine gets merged weights) from the
exported model on the vLLM engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_sft_then_export_then_rl_from_the_exported_model(ray_cluster, tmp_path, logprob_tolerance):
    from actors.drivers.pipeline import run
    from actors.drivers.sft import run_sft

    data = str(FIXTURES / "sft_conversations.jsonl")
    cfg = load_config(None, ["model.path=tiny-random", f"sft.train_files=[{data}]", f"sft.val_files=[{data}]", "sft.epochs=2",
                             "sft.batch_size=2", "sft.lr=1e-3", "sft.lr_schedule=cosine", "sft.save_every=2"])
    run_dir = run_sft(cfg, tmp_path / "sft")
    rows = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    # 4 usable conversations (3 malformed rows are reported and skipped), batches of 2, 2 epochs.
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert [("val/loss" in m) for m in rows] == [False, True, False, True]  # after each epoch
    assert rows[3]["val/loss"] < rows[1]["val/loss"]
    assert rows[3]["train/lr"] < rows[0]["train/lr"]  # cosine decay
    assert {d.name for d in (run_dir / "checkpoints").iterdir()} == {"step_2", "step_4"}

    out = tmp_path / "exported"
    cli = Path(sys.executable).parent / "raytool"
    done = subprocess.run([str(cli), "export", "--ckpt", str(run_dir / "checkpoints" / "step_4"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file() and (out / "chat_template.jinja").is_file()

    rl = load_config(None, [f"model.path={out}", "eval.before_train=false", "eval.after_train=false", "trainer.total_steps=1", "trainer.sft_warmup_steps=0", "rollout.n=2",
                            "data.prompts_per_step=1", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=32",
                            "trainer.save_final=false", "algorithm.entropy_coeff=0.001", "trainer.lora_rank=4"])
    (metrics,) = [json.loads(line) for line in (run(rl, tmp_path / "rl") / "metrics.jsonl").read_text().splitlines()]
    assert metrics["policy_version"] == 1 and metrics["rollout/logprob_abs_diff"] < logprob_tolerance
