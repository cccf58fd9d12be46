"""examples/env_verifiers_tiny.yaml on the tiny model: a verifiers ToolEnv (examples/vf_tool_arith.py)
as the task, rolled out through the gateway on Ray, scored by its rubric, trained for two steps
and validated on its eval dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from raytool.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "trainer.total_steps=2", "eval.before_train=false", "eval.after_train=true", "eval.max_prompts=2",
        "eval.n=2", "rollout.engine=hf", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16",
        "agent.max_response_tokens=48", "logging.logger=[]", "logging.progress=false"]


def test_the_verifiers_example_trains_on_the_environments_rubric(ray_cluster, tmp_path, monkeypatch):
    from actors.drivers.pipeline import run

    monkeypatch.chdir(REPO)  # the example names its environment by a path relative to the repository
    cfg = load_config(REPO / "examples" / "env_verifiers_tiny.yaml", TINY)
    run_dir = run(cfg, tmp_path / "vf")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in steps if "rollout/trajectories" in m]
    assert [m["step"] for m in train] == [1, 2] and all(m["rollout/trajectories"] == 4 for m in train)
    # The rubric's function and the ToolEnv's call count, per step; nothing infra-failed.
    assert all("reward/fn/correct" in m and "reward/fn/total_tool_calls" in m and "finish/infra_failed" not in m for m in train)
    recorded = (run_dir / "config.yaml").read_text()
    assert f"{REPO}/examples/vf_tool_arith.py:load_environment" in recorded  # made absolute for the actors
    source = "verifiers:vf_tool_arith:load_environment"
    assert any(f"val-core/{source}/acc/mean@2" in m for m in steps), "validation on the environment's eval dataset"
