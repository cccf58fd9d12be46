"""Resume at the edges (the shared Ray cluster, the HF engine on the tiny model): from a checkpoint
at an epoch boundary the run trains the next epoch (verl users report 0 steps there), drawing the
same prompts as the uninterrupted run; from the checkpoint of the last step it trains nothing and
ends cleanly."""

from __future__ import annotations

import json

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration


def _first_prompt_by_step(run_dir) -> dict[int, str]:
    """The prompt of each step's first group (its traces in traces.jsonl)."""
    firsts: dict[int, str] = {}
    for line in (run_dir / "traces.jsonl").read_text().splitlines():
        trace = json.loads(line)
        firsts.setdefault(trace["step"], trace["prompt_text"])
    return firsts


def test_resume_at_an_epoch_boundary_trains_the_next_epoch_and_at_the_last_step_trains_nothing(ray_cluster, tmp_path, caplog):
    import logging

    from actors.drivers.pipeline import run
    from raytool.ledger import audit

    # 4 prompts, 2 per step: an epoch is 2 steps, and the step-2 checkpoint sits on its boundary.
    cfg = load_config(None, [
        "model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "rollout.engine=hf", "trainer.sft_warmup_steps=0", "trainer.total_steps=4", "trainer.save_every=2",
        "data.train_size=4", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=32",
        "rollout.seed=7", "logging.logger=[]", "logging.progress=false",
    ])
    whole = run(cfg, tmp_path / "whole")
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_2", "step_4"]

    resumed = run(cfg, tmp_path / "from_boundary", resume=whole / "checkpoints" / "step_2")
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 4]
    assert {step: len(keys) for step, keys in _trained(resumed).items()} == {3: 2, 4: 2}
    prompts = _first_prompt_by_step(whole)
    assert _first_prompt_by_step(resumed) == {3: prompts[3], 4: prompts[4]}  # the same draw of the second epoch

    with caplog.at_level(logging.INFO, logger="raytool.console"):
        done = run(cfg, tmp_path / "from_last", resume=whole / "checkpoints" / "step_4")
    assert not (done / "metrics.jsonl").exists() or not (done / "metrics.jsonl").read_text().strip()
    assert any("resumed from" in r.getMessage() and "at step 4" in r.getMessage() for r in caplog.records)
    assert audit(done)["drawn"] == 0


def _trained(run_dir) -> dict[int, list[str]]:
    """Step -> the group keys trained at it."""
    trained: dict[int, list[str]] = {}
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        event = json.loads(line)
        trained.setdefault(event["step"], []).extend(event.get("trained", []))
    return trained
