"""Validation on the actor graph: `raytool eval` on a built-in model, on a run's checkpoint with
preprocessed data, and validation and dynamic sampling inside `raytool train` (on the HF engine:
its subject is the schedule; `raytool eval` on vLLM is the first test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytool.cli import main
from raytool.config import load_config
from raytool.data.preprocess import preprocess

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=24",
        "agent.max_response_tokens=64", "logging.progress=false"]


def test_eval_prints_the_table_and_a_last_line_json(ray_cluster, capsys):
    code = main(["eval", "-c", str(REPO / "examples" / "tiny_cpu.yaml"), "--model", "tiny-random", "--n", "2", "--json",
                 "eval.max_prompts=6", "rollout.engine=hf", *TINY[2:]])  # the table's making, not the engine: HF starts in half the time
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("source "))
    assert out[header].split()[:4] == ["source", "prompts", "mean@2", "maj@2"]
    result = json.loads(out[-1])
    assert result["n"] == 2 and result["model"] == "tiny-random"
    for source in ("tool_arith", "tool_arith_unseen"):
        for key in ("acc/mean@2", "acc/maj@2", "acc/pass@2"):
            assert 0.0 <= result[f"val-core/{source}/{key}"] <= 1.0
        assert any(line.startswith(source) for line in out[header + 1:-1])
    assert result["val-aux/tool_arith/prompts"] + result["val-aux/tool_arith_unseen/prompts"] == 6
    for key in ("num_turns/mean", "tool/calls_per_traj", "tool/call_rate", "tool/error_rate", "response_length/mean"):
        assert f"val-aux/{key}" in result
    assert result["val-aux/response_length/mean"] > 0  # the random model babbles until its budget


def test_train_validates_on_schedule_samples_dynamically_and_eval_reads_its_checkpoint(ray_cluster, tmp_path, capsys):
    from actors.drivers.pipeline import run

    cfg = load_config(None, [*TINY, "rollout.engine=hf", "trainer.total_steps=2", "trainer.sft_warmup_steps=1", "eval.before_train=true",
                             "eval.every=2", "eval.n=2", "eval.max_prompts=4", "algorithm.dynamic_sampling=true",
                             "algorithm.max_sampling_rounds=2"])
    run_dir = run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val-core/tool_arith/acc/mean@2" in rows[0] and "val-core/tool_arith/acc/mean@2" in rows[2]
    assert "val-core/tool_arith/acc/mean@2" not in rows[1]
    val_traces = [json.loads(line) for line in (run_dir / "val_traces.jsonl").read_text().splitlines()]
    assert [(t["step"], t["data_source"]) for t in val_traces] == [(0, "tool_arith")] * 2 + [(2, "tool_arith")] * 2  # logging.val_trace_samples each
    assert all(t["prompt_text"] and t["response_ids"] for t in val_traces)
    # The random model scores 0 everywhere: no group has a reward spread, so every step draws its
    # rounds to the cap and trains on the last round.
    assert all(r["rollout/sampling_rounds"] == 2 and r["rollout/prompts_drawn"] == 4 and r["rollout/groups_kept"] == 0 for r in rows[1:])

    data = preprocess("aime_2024", REPO / "tests" / "fixtures" / "sources" / "aime_2024.jsonl", tmp_path / "aime.parquet").output
    capsys.readouterr()
    assert main(["eval", "--model", str(run_dir), "--data", data, "--n", "1", "--json", *TINY, "rollout.engine=hf"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["val-aux/aime_2024/prompts"] >= 2 and "val-core/aime_2024/acc/pass@1" in result

