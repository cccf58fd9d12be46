"""examples/judge_tiny.yaml on the tiny model: a run rewarded by an LLM judge over HTTP (raytool's
OpenAI-compatible server with a scripted judge, tests/helpers/judge_server.py), the same run
against a judge that is not there, stopped in one line before any actor starts, and a run whose
own rollout servers judge it through its gateway (reward.judge.base_url self)."""

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
    from actors.drivers.pipeline import run

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


def test_a_run_judged_by_its_own_servers_through_its_gateway(ray_cluster, tmp_path):
    """The example as it is (base_url: self), on the scripted engine, which answers any prompt, the
    judge's rubric too, with a turn of its script: each trajectory's judge call goes through the
    run's gateway (started for it) to the run's rollout server, and its reply's last number is the score."""
    from actors.drivers.pipeline import run

    cfg = load_config(REPO / "examples" / "judge_tiny.yaml", [
        *TINY, "rollout.engine=scripted", "rollout.scripted_delay_s=0.01", "agent.format=retool", "rollout.max_tokens_per_turn=64",
        "agent.max_response_tokens=256", r"reward.judge.score_pattern=(\d+)", "reward.judge.max_score=null"])
    assert cfg.reward.judges_itself
    run_dir = run(cfg, tmp_path / "self-judged")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollout/trajectories"] == 4 for m in steps)
    # the script's turns end in 7, 1 or 43: each trajectory was judged, none scored from a failure
    assert all(m["critic/score/mean"] >= 1.0 and m["reward/fn/judge_raw"] >= 1.0 for m in steps), steps
    assert json.loads((run_dir / "gateway.json").read_text())["url"].startswith("http://")
