"""examples/env_openenv_tiny.yaml on the tiny model: an OpenEnv environment (examples/openenv_guess.py,
served by each agent worker from its app) as the task, played through the gateway on Ray, rewarded
by the environment, trained for two steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")

from raytool.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "trainer.total_steps=2", "rollout.engine=hf", "rollout.n=2", "data.prompts_per_step=2",
        "rollout.max_tokens_per_turn=8", "agent.max_response_tokens=64", "logging.logger=[]", "logging.progress=false"]


def test_the_openenv_example_trains_on_the_environments_rewards(ray_cluster, tmp_path, monkeypatch):
    from actors.drivers.pipeline import run

    monkeypatch.chdir(REPO)  # the example names its app and rows by paths relative to the repository
    run_dir = run(load_config(REPO / "examples" / "env_openenv_tiny.yaml", TINY), tmp_path / "openenv")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollout/trajectories"] == 4 for m in steps)
    # Every trajectory played its own session: at least one guess each, nothing infra-failed.
    assert all(m["reward/fn/env_steps"] >= 1.0 and "finish/infra_failed" not in m for m in steps), steps
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert traces and all("I picked a number from 1 to 10" in t["prompt_text"] for t in traces)
    assert f"{REPO}/examples/openenv_guess.py:app" in (run_dir / "config.yaml").read_text()  # made absolute for the actors
