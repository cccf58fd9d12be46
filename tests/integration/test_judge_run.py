"""examples/judge_tiny.yaml on the tiny model: a run rewarded by an LLM judge over HTTP (raytool's
OpenAI-compatible server with a scripted judge, tests/helpers/judge_server.py), and the same run
against a judge that is not there, stopped in one line before any actor starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.judge_server import JudgeServer

from raytool.config import ConfigError, load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "trainer.total_steps=2", "trainer.sft_warmup_steps=0", "eval.before_train=false", "eval.after_train=false",
        "rollout.engine=hf", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=32",
        "logging.logger=[]", "logging.progress=false"]


def test_the_judge_example_trains_on_the_judges_scores(ray_cluster, tmp_path, tokenizer):
    from actors.pipeline import run

    asked = []

    def verdict(prompt: str) -> str:
        answer = re.search(r"Answer: (.*)\nEnd with", prompt, re.DOTALL)
        asked.append(answer.group(1) if answer else None)
        return f"Score: {len(asked) % 11}"

    with JudgeServer(tokenizer, verdict) as url:
        cfg = load_config(REPO / "examples" / "judge_tiny.yaml", [*TINY, f"reward.judge.base_url={url}"])
        run_dir = run(cfg, tmp_path / "judged")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollout/trajectories"] == 4 for m in steps)
    assert all(a is not None for a in asked) and len(asked) >= 8  # every trajectory judged, by the example's rubric
    scores = [m["critic/score/mean"] for m in steps]
    assert all(0.0 <= s <= 1.0 for s in scores) and any(s > 0 for s in scores)

    with pytest.raises(ConfigError, match=r"reward.judge.base_url=http://127.0.0.1:9/v1: the judge does not answer"):
        run(load_config(REPO / "examples" / "judge_tiny.yaml", [*TINY, "reward.judge.base_url=http://127.0.0.1:9/v1"]), tmp_path / "nobody")
    assert not (tmp_path / "nobody").exists()
